"""The speculative pipeline after a refusal that is not a device fault (issue 41, as
test_pipeline_refusals has them for the plain pipeline): an allocation or a copy refused anywhere
in a verify step, a return of blocks or of a penalty slot refused as a row finishes or is
trimmed, and a row the logits leave no id it may pick. Every request is held to an oracle of
that request alone: greedy rows to the penalised argmax, sampled ones to the verify rule over
the penalised logits with the same drafts, logprobs to the raw logits' log-softmax."""

from __future__ import annotations

import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, _core
from metrale_feed.penalties import PenaltyState
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, prompts
from pipeline.test_pipeline_logprobs import check as check_logprobs
from pipeline.test_pipeline_penalties import oracle
from pipeline.test_pipeline_spec_penalties import pen_of, spec_oracle
from test_pipeline_refusals import NoFiniteLogit, drive

K = 2
# Per request: its penalties and logprobs, and its stop ids. The second one's bias makes its stop
# id likely, so min_tokens' ban and the stop after it are met; the third has neither penalties
# nor logprobs (a row of a mixed batch).
REQUESTS = [(dict(frequency_penalty=1.5, logit_bias={9: 3.0}, logprobs=True, top_logprobs=3), ()),
            (dict(presence_penalty=0.5, repetition_penalty=1.3, logit_bias={3: 2.0}, min_tokens=4,
                  logprobs=True), (3,)),
            (dict(), ())]
MAX_NEW = [9, 8, 7]
SEEDS = [3, 4, 5]


def _wanted(ps, temperature, drafter):
    """Each request alone: its tokens, and the reason they end with."""
    want = []
    for p, (kw, stops), n, seed in zip(ps, REQUESTS, MAX_NEW, SEEDS):
        pen = {key: v for key, v in kw.items() if key not in ("logprobs", "top_logprobs")}
        if temperature == 0.0:
            tokens = oracle(p, n, stops=stops, **pen)
        else:
            tokens = spec_oracle(p, n, drafter, pen_of(pen, stops), temperature=temperature,
                                 seed=seed, stops=stops)
        stopped = bool(tokens) and tokens[-1] in stops and len(tokens) >= pen.get("min_tokens", 0)
        want.append((tokens, "stop" if stopped else "length"))
    return want


def _submit(pipe, ps, temperature):
    return [pipe.submit(p, max_new_tokens=n, stop_ids=stops, temperature=temperature, seed=seed,
                        **kw)
            for p, (kw, stops), n, seed in zip(ps, REQUESTS, MAX_NEW, SEEDS)]


def _held_to_oracle(reqs, errors, want, n):
    """Each request is exact, or finished "error" (its step failed: ``DeviceError``) with a
    prefix of its oracle's tokens; its logprobs are the raw logits' either way."""
    for req, (kw, _), (tokens, reason) in zip(reqs, REQUESTS, want):
        if req.finish_reason == "error":
            assert req.tokens == tokens[: len(req.tokens)], (n, errors, req.tokens, tokens)
            assert errors and errors[0].startswith("DeviceError"), (n, errors)
        else:
            assert (req.tokens, req.finish_reason) == (tokens, reason), (n, errors, req.tokens,
                                                                         tokens)
        if kw.get("logprobs"):
            check_logprobs(req, n=kw.get("top_logprobs", 0))


def _sweep(depth, temperature, arm):
    """A run for every N with the Nth refusal armed (``arm(n)`` arms it and returns a callable
    that disarms it and says whether it fired), until a run ends before it; each held to the
    oracle. The outcomes: (errors raised, finish reasons) of the runs."""
    ps = prompts(3, seed=21, lo=2, hi=7)
    drafter = ReferenceDrafter(VOCAB, K, 0.6)
    want = _wanted(ps, temperature, drafter)
    outcomes = set()
    for n in range(1, 600):
        with ReferenceModel(VOCAB, block_size=2, num_blocks=60, max_rows=3) as model:
            with DecodePipeline(model, 3, depth=depth, speculative=drafter) as pipe:
                reqs = _submit(pipe, ps, temperature)
                disarm = arm(n)
                try:
                    errors = drive(pipe)
                finally:
                    fired = disarm()
                assert pipe.stats.reserved_in_flight == 0
            assert model.pool.free_count == model.pool.num_blocks
        _held_to_oracle(reqs, errors, want, n)
        assert len(errors) == fired, (n, errors)
        outcomes.add((len(errors), tuple(r.finish_reason for r in reqs)))
        if not fired:  # the run made fewer than n: every refusal point was tried
            break
    else:
        raise AssertionError("the sweep never reached the end of the run")
    drafter.close()
    retried = {rs for e, rs in outcomes if e == 1 and "error" not in rs}
    failed = {rs for _, rs in outcomes if "error" in rs}
    return retried, failed


@pytest.mark.parametrize("knob", ["fail_copy_at", "fail_alloc_at"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_refusal_anywhere_in_a_verify_step_never_moves_a_token(host, no_leaks, knob, depth,
                                                                  temperature):
    """Penalties, logprobs and top logprobs under speculation: the Nth copy (or allocation) from
    now is refused, for every N a run makes. A refusal before the verify's pick is retried and
    every request is exact; one after it (the count update, the logprobs' copies) is a failed
    step: its requests finish "error" with a prefix of their oracle's tokens. Never counts
    applied twice nor a token moved. An allocation is never refused after the pick: the step's
    buffers are made before anything of it is queued."""

    def arm(n):
        mf.configure_host(**{knob: n})

        def disarm():
            fired = mf.host_faults()[knob] == 0
            mf.configure_host()
            return fired

        return disarm

    retried, failed = _sweep(depth, temperature, arm)
    assert retried, (retried, failed)
    if knob == "fail_copy_at":
        assert failed, (retried, failed)
    else:
        assert not failed, failed


class _RefusingCore:
    """The speculative step's ``_core`` with one op refused (``FeedError``, as a bad argument
    is) at its ``n``-th call."""

    def __init__(self, name, n):
        self.name, self.n, self.calls = name, n, 0

    def __getattr__(self, attr):
        op = getattr(_core, attr)
        if attr != self.name:
            return op

        def refused(*args, **kw):
            self.calls += 1
            if self.calls == self.n:
                raise mf.FeedError(f"injected: {attr} refused once")
            return op(*args, **kw)

        return refused


@pytest.mark.parametrize("name, depth", [("resolve_feed", 1), ("resolve_feed", 2),
                                         ("top_logprobs", 1), ("top_logprobs", 2),
                                         ("event_record", 1), ("resolve_verified", 2)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_op_refused_after_the_verify_fails_the_step(host, no_leaks, monkeypatch, name, depth,
                                                       temperature):
    """The ops a verify step queues after its pick (the emitted ids' gather, the logprobs'
    kernel, the event, at depth 2 the next step's inputs), each refused at its Nth call: a
    failed step, its requests finished "error" with a prefix of their oracle's tokens (the
    gather before the pick, the fed ids', is retried exactly)."""
    from metrale_feed.sched import speculative

    monkeypatch.setattr(speculative, "_core", _core)  # put back whatever a failure leaves

    def arm(n):
        speculative._core = core = _RefusingCore(name, n)

        def disarm():
            speculative._core = _core
            return core.calls >= n

        return disarm

    retried, failed = _sweep(depth, temperature, arm)
    assert failed, (retried, failed)
    assert bool(retried) == (name == "resolve_feed"), (retried, failed)


class ReleaseOnce(ReferenceModel):
    """The reference model whose ``fail_at``-th ``release_decode_blocks`` raises before it
    returns a block (a trim of rejected positions, or a finished request's blocks)."""

    def __init__(self, *args, fail_at=0, **kw):
        super().__init__(*args, **kw)
        self.fail_at, self.calls, self.refused = fail_at, 0, None

    def release_decode_blocks(self, seq, blocks):
        self.calls += 1
        if self.calls == self.fail_at:
            self.refused = seq
            raise RuntimeError("injected: the blocks' return was refused once")
        return super().release_decode_blocks(seq, blocks)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("what", ["blocks", "penalty slot"])
def test_a_return_refused_as_a_verify_is_committed_stops_no_other_row(host, no_leaks, monkeypatch,
                                                                       depth, temperature, what):
    """The Nth return of blocks (a trim or a finish) or of a penalty slot (its clear) raises, for
    every N a run makes. That step raises it once every row of the step has its emitted ids
    committed (the device has advanced them, and at depth 2 the step in flight was fed from
    them): every request's tokens and finish are its oracle's, and the pool comes back whole
    but for the blocks whose return was refused as their request left."""
    ps = prompts(3, seed=22, lo=2, hi=7)
    drafter = ReferenceDrafter(VOCAB, K, 0.6)
    want = _wanted(ps, temperature, drafter)
    clears = [0, 0]  # calls, and the call that raises
    real_clear = PenaltyState.clear

    def clear_once(self, slot):
        clears[0] += 1
        if clears[0] == clears[1]:
            raise RuntimeError("injected: the penalty slot's clear was refused once")
        return real_clear(self, slot)

    monkeypatch.setattr(PenaltyState, "clear", clear_once)
    fired = True
    n = 0
    while fired:
        n += 1
        assert n < 100, "the sweep never reached the end of the run"
        clears[:] = [0, n if what == "penalty slot" else 0]
        with ReleaseOnce(VOCAB, block_size=2, num_blocks=60, max_rows=3,
                         fail_at=n if what == "blocks" else 0) as model:
            with DecodePipeline(model, 3, depth=depth, speculative=drafter) as pipe:
                reqs = _submit(pipe, ps, temperature)
                errors = drive(pipe)
                assert pipe.stats.reserved_in_flight == 0
            fired = model.calls >= n if what == "blocks" else clears[0] >= n
            lost = 0 if model.refused is None else len(model.refused.block_table)
            assert model.pool.free_count + lost == model.pool.num_blocks
        assert len(errors) == fired and all("refused once" in e for e in errors), (n, errors)
        for req, (kw, _), (tokens, reason) in zip(reqs, REQUESTS, want):
            assert (req.tokens, req.finish_reason) == (tokens, reason), (n, errors, req.tokens,
                                                                         tokens)
            if kw.get("logprobs"):
                check_logprobs(req, n=kw.get("top_logprobs", 0))
    drafter.close()
    # Every return was refused once: each penalised request's clear, and the blocks of trims
    # and of finishes.
    assert n - 1 >= (2 if what == "penalty slot" else 8), n


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("nan", [False, True])
def test_a_greedy_verify_with_no_id_to_pick_commits_nothing(host, no_leaks, depth, nan):
    """Every logit of one greedy request's rows is -inf (or NaN) from some step on, while
    min_tokens bans its stop id: the verify's rule answers that stop id at every position (the
    argmax's lowest candidate). It is never committed as a stop: the request finishes
    "no_candidate" with a prefix of its oracle's tokens, as without speculation, and the other
    rows are exact."""
    from conftest import sampled_tokens

    ps = prompts(3, seed=23, lo=3, hi=9)
    sampled = dict(temperature=0.9, top_p=0.95, seed=11)
    with NoFiniteLogit(VOCAB, block_size=4, num_blocks=80, max_rows=3, after=3, nan=nan) as model:
        with DecodePipeline(model, 3, depth=depth,
                            speculative=ReferenceDrafter(VOCAB, K, 0.5)) as pipe:
            target = pipe.submit(ps[0], max_new_tokens=12, stop_ids=(0,), min_tokens=9)
            model.target = target
            others = [pipe.submit(ps[1], max_new_tokens=12),
                      pipe.submit(ps[2], max_new_tokens=12, **sampled)]
            assert drive(pipe) == []
            assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == model.pool.num_blocks
    assert model.hit and target.finish_reason == "no_candidate", (target.tokens,
                                                                   target.finish_reason)
    want = oracle(ps[0], 12, stops=(0,), min_tokens=9)
    assert 3 <= len(target.tokens) < 9 and target.tokens == want[: len(target.tokens)]
    assert others[0].tokens == sampled_tokens(ps[1], 12, VOCAB)
    assert others[1].tokens == sampled_tokens(ps[2], 12, VOCAB, **sampled)
