"""Fixtures of the decode pipeline tests: the reference-token oracle (``reference_tokens``)."""

from __future__ import annotations

import pytest

from metrale_feed.testing.reference import ReferenceModel, reference_tokens

VOCAB = 211  # the pipeline tests' vocabulary: prime, so no row width is a vector multiple


def model_for(rows=4, num_blocks=200, block_size=4, **kw):
    """The reference model the pipeline tests drive: ``rows`` rows over ``VOCAB`` ids."""
    return ReferenceModel(VOCAB, block_size=block_size, num_blocks=num_blocks, max_rows=rows, **kw)


def prompts(n, seed=0, lo=1, hi=20):
    """``n`` random prompts of ``lo`` to ``hi`` ids below ``VOCAB``, the same for a seed."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy_tokens(prompt, max_new, vocab, dtype="float32", stops=(), ban=None, switch=None):
    """What greedy decoding of the request alone gives: the shared oracle ``reference_tokens``
    (``host_next_token`` step by step, the stop id committed as the last token).
    ``switch=(k, ban2)``: tokens from index ``k`` on are taken under ``ban2``."""
    return sampled_tokens(prompt, max_new, vocab, dtype, stops, ban, switch=switch)


@pytest.fixture
def greedy():
    return greedy_tokens


def check_failed(reqs, running, reasons, most=None):
    """After a fault in a step: exactly ``running`` finished with the error, whose message holds
    every string of ``reasons``; each kept only ids committed before the fault, a prefix of greedy
    decoding's shorter than its length (at most ``most`` ids when given); the others still wait.
    Returns the failed ones."""
    from metrale_feed import RequestStatus

    failed = [r for r in reqs if r.status is RequestStatus.FINISHED_ERROR]
    assert failed == running, [(r.status, r.error) for r in reqs]
    rest = reqs[len(running):]  # they wait for rows: none was in a step that ran behind the fault
    assert all(r.status is RequestStatus.WAITING for r in rest), [r.status for r in rest]
    for r in failed:
        assert r.finish_reason == "error" and all(s in r.error for s in reasons), r.error
        want = greedy_tokens(r.prompt, r.max_new_tokens, VOCAB)
        assert r.tokens == want[: len(r.tokens)] and len(r.tokens) < r.max_new_tokens, r
        assert most is None or len(r.tokens) <= most, (len(r.tokens), most)
    return failed


def check_the_rest_run(pipe, reqs, running):
    """The requests that waited through the fault then run to their length, exactly greedy
    decoding's tokens, and nothing stays reserved."""
    rest = reqs[len(running):]
    pipe.run()
    for r in rest:
        assert r.finish_reason == "length", r
        assert r.tokens == greedy_tokens(r.prompt, r.max_new_tokens, VOCAB), r
    assert pipe.stats.reserved_in_flight == 0


def sampled_tokens(prompt, max_new, vocab, dtype="float32", stops=(), ban=None, *, switch=None,
                   **sampling):
    """What decoding of the request alone gives: the shared oracle ``reference_tokens``, at each
    step the host backend's ``sample_to_feed`` over one row of the reference logits at position
    ``len(prompt) + len(tokens)`` (``host_next_token`` with no temperature); the stop id
    committed as the last token. Needs the host backend active (the ``host`` fixture) when it
    samples. ``switch=(k, ban2)`` as for ``greedy_tokens``."""
    if sampling.get("temperature", 0.0) > 0.0:
        import metrale_feed as mf

        assert mf.backend() in ("host", "simt")
    first = max_new if switch is None else min(switch[0], max_new)
    out = reference_tokens(prompt, first, vocab, dtype, mask=ban, stops=stops, sampling=sampling)
    if len(out) == first < max_new and not (out and out[-1] in stops):
        out += reference_tokens(list(prompt) + out, max_new - first, vocab, dtype, mask=switch[1],
                                stops=stops, sampling=sampling)
    return out


@pytest.fixture
def sampled():
    return sampled_tokens


def play(pipe, ops, submitted, **submit):
    """Run a drawn schedule on ``pipe`` (submit, step, abort ops), then ``run()``; appends each
    submitted (request, its submit args) to ``submitted`` and checks every one finished once.
    ``submit``: more arguments of every ``submit`` (sampling params)."""
    # Imported here: children that put only this folder on their path import this module too.
    from helpers.schedules import play_ops

    def one(arg):
        prompt, max_new, stops, ban = arg
        return pipe.submit(prompt, max_new_tokens=max_new, stop_ids=stops, ban=ban, **submit)

    return play_ops(pipe, ops, one, submitted)


def check_greedy(submitted, vocab, dtype):
    """Each request's tokens are greedy decoding's (a prefix of them when it was aborted), and
    its finish reason is the one its tokens give."""
    for req, (prompt, max_new, stops, ban) in submitted:
        expected = greedy_tokens(prompt, max_new, vocab, dtype, stops=stops, ban=ban)
        assert req.finished
        if req.finish_reason == "abort":
            assert req.tokens == expected[: len(req.tokens)]
            continue
        assert req.tokens == expected
        assert req.finish_reason == ("stop" if req.tokens[-1] in stops else "length")
