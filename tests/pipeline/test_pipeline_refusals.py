"""DecodePipeline after a refusal that is not a device fault (issue 41): a model's block
reservation that raises once, a step refused after part of it was queued, and a request left
with no id it may pick. Every request is held to the oracle of that request alone, and the pool
and the budget's counters come back whole."""

from __future__ import annotations

import pytest

from metrale_feed import DecodePipeline, FeedError
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, prompts, sampled_tokens

SAMPLED = dict(temperature=0.9, top_p=0.95, seed=11)


def drive(pipe, limit=200):
    """Step until idle (a bounded number of steps, so a wedged pipeline fails instead of
    hanging); the messages of the steps that raised."""
    errors = []
    for _ in range(limit):
        if pipe.idle:
            return errors
        try:
            pipe.step()
        except Exception as exc:  # noqa: BLE001 - what each refused step raised is the point
            errors.append(f"{type(exc).__name__}: {exc}")
    raise AssertionError(f"not idle after {limit} steps; {len(errors)} raised, the last: "
                         f"{errors[-1:]}")


class ReserveOnce(ReferenceModel):
    """The reference model whose ``fail_at``-th ``reserve_decode_block`` raises (a transient
    refusal, not a full pool) before it takes a block."""

    def __init__(self, *args, fail_at=0, hide_block_size=False, **kw):
        super().__init__(*args, **kw)
        self.fail_at = fail_at
        self.calls = 0
        self.hide_block_size = hide_block_size

    def feed_info(self):
        info = super().feed_info()
        # Without a block size the pipeline asks for every row at every step, through the
        # budget's ledger.
        return info._replace(block_size=None, pool=None) if self.hide_block_size else info

    def reserve_decode_block(self, seq):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected: the reservation was refused once")
        return super().reserve_decode_block(seq)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("num_blocks", [120, 8])  # 8: the pool runs dry, rows are preempted
@pytest.mark.parametrize("fail_at", [1, 2, 3, 5, 8])
def test_a_reservation_refused_once_is_made_again_by_the_next_step(host, no_leaks, depth,
                                                                    sampled, num_blocks, fail_at):
    """The refused launch raises; the next step reserves the block again (the rows due at that
    block boundary are still due) and decodes exactly, instead of every later step raising
    "no KV block reserved"."""
    ps = prompts(4, seed=fail_at, lo=2, hi=9)
    kw = SAMPLED if sampled else {}
    with ReserveOnce(VOCAB, block_size=4, num_blocks=num_blocks, max_rows=3,
                     fail_at=fail_at) as model:
        with DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=11, **kw) for p in ps]
            errors = drive(pipe)
            assert errors == ["RuntimeError: injected: the reservation was refused once"]
            assert pipe.stats.reserved_in_flight == 0
            if num_blocks == 8:
                assert pipe.stats.preemptions > 0
        assert model.pool.free_count == model.pool.num_blocks
    for req in reqs:
        assert req.finish_reason == "length", req
        assert req.tokens == sampled_tokens(req.prompt, 11, VOCAB, **kw), req


@pytest.mark.parametrize("depth", [1])
@pytest.mark.parametrize("fail_at", [1, 5, 6, 17])
def test_a_refused_reservation_through_the_ledger_counts_what_it_took(host, no_leaks, depth,
                                                                      fail_at):
    """A model that does not say its block size: the rows reserved before the refusal keep their
    block, counted, so the counters come back to 0 once every step is read. (Prompts of 4 ids:
    the 3 rows cross a block at the 2nd and 6th steps, calls 4 to 6 and 16 to 18.)"""
    ps = prompts(3, seed=30 + fail_at, lo=4, hi=4)
    with ReserveOnce(VOCAB, block_size=4, num_blocks=120, max_rows=3, fail_at=fail_at,
                     hide_block_size=True) as model:
        with DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=9) for p in ps]
            assert drive(pipe) == ["RuntimeError: injected: the reservation was refused once"]
            assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == model.pool.num_blocks
    for req in reqs:
        assert req.tokens == sampled_tokens(req.prompt, 9, VOCAB), req


# ---- a step refused after its pick was queued ----

PENALISED = [dict(frequency_penalty=1.5, logit_bias={9: 3.0}, seed=3),
             dict(presence_penalty=0.5, logit_bias={3: 2.0}, repetition_penalty=1.3, seed=4),
             dict(seed=5)]  # a row without penalties in the same batch


def _raw_logprob(history, token):
    import numpy as np

    from metrale_feed.testing.reference import _widened_logits

    row = _widened_logits(history, VOCAB, "float32").astype(np.float64)
    top = row.max()
    return row[token] - top - np.log(np.exp(row - top).sum())


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_copy_refused_anywhere_in_a_step_never_moves_a_token(host, no_leaks, depth,
                                                               temperature):
    """Penalties and logprobs: the Nth copy from now is refused, for every N a run makes. A
    refusal before the step's pick is retried and every token is the oracle's; one after it (the
    raw logprobs' copies, the counts' update) is a failed step: its requests finish "error"
    with a prefix of the oracle's tokens. Never counts applied twice nor a token moved."""
    import numpy as np

    import metrale_feed as mf
    from test_pipeline_penalties import oracle

    ps = prompts(3, seed=5)
    kws = [dict(kw, temperature=temperature) for kw in PENALISED]
    want = [oracle(p, 8, **kw) for p, kw in zip(ps, kws)]
    outcomes = set()
    for n in range(1, 400):
        with ReferenceModel(VOCAB, block_size=4, num_blocks=40, max_rows=3) as model:
            with DecodePipeline(model, 3, depth=depth) as pipe:
                reqs = [pipe.submit(p, max_new_tokens=8, logprobs=True, **kw)
                        for p, kw in zip(ps, kws)]
                mf.configure_host(fail_copy_at=n)
                try:
                    errors = drive(pipe)
                finally:
                    fired = mf.host_faults()["fail_copy_at"] == 0
                    mf.configure_host()
                assert pipe.stats.reserved_in_flight == 0
            assert model.pool.free_count == model.pool.num_blocks
        for req, p, w in zip(reqs, ps, want):
            if req.finish_reason == "error":
                assert req.tokens == w[: len(req.tokens)], (n, req.tokens, w)
            else:
                assert req.finish_reason == "length" and req.tokens == w, (n, req.tokens, w)
            history = list(p)
            got = []
            for token in req.tokens:
                got.append(_raw_logprob(history, token))
                history.append(token)
            np.testing.assert_allclose(req.logprobs, got, rtol=0, atol=2e-5)
        outcomes.add((len(errors), tuple(r.finish_reason for r in reqs)))
        if not fired:  # the run made fewer than n copies: every refusal point was tried
            break
    else:
        raise AssertionError("the sweep never reached the end of the run")
    # Both kinds were met: refusals retried with every request exact, and failed steps.
    assert any(e == 1 and all(r == "length" for r in rs) for e, rs in outcomes), outcomes
    assert any("error" in rs for _, rs in outcomes), outcomes


# ---- a request left with no id it may pick ----

def test_what_leaves_no_id_to_pick_is_refused_at_submit(host, no_leaks):
    """min_tokens bans the stop ids until it is reached: stop ids (and a ban) that cover the
    vocabulary leave nothing to pick, greedy or sampled; nothing is queued. A ban set later that
    does so is refused the same way, while min_tokens still applies."""
    with ReferenceModel(4, block_size=4, num_blocks=20, max_rows=2) as model:
        with DecodePipeline(model, 2) as pipe:
            for temperature in (0.0, 0.8):
                for stops, ban in (((0, 1, 2, 3), None), ((0, 1), (2, 3)), ((1, 2, 3), (0, 0))):
                    with pytest.raises(ValueError, match="leave no id"):
                        pipe.submit([1, 2], max_new_tokens=6, stop_ids=stops, ban=ban,
                                    min_tokens=3, temperature=temperature)
            assert pipe.idle
            # Without min_tokens (or with one id left) they run.
            ok = pipe.submit([1, 2], max_new_tokens=6, stop_ids=(0, 1, 2, 3), temperature=0.8)
            left = pipe.submit([1, 2], max_new_tokens=6, stop_ids=(0, 1), ban=(2, 3))
            late = pipe.submit([1, 2], max_new_tokens=6, stop_ids=(0, 1), min_tokens=3,
                               temperature=0.8, seed=2)
            with pytest.raises(ValueError, match="leave no id"):
                late.ban = (2, 3)
            assert late.ban is None
            late.ban = (2, 2)
            pipe.run()
    assert len(ok.tokens) == 1 and ok.finish_reason == "stop"
    for req in (ok, left, late):
        assert all(0 <= t < 4 for t in req.tokens), req.tokens
    assert 3 <= len(late.tokens) and all(t == 3 for t in late.tokens[:2]), late.tokens


class NoFiniteLogit(ReferenceModel):
    """The reference model whose logits for one request's rows are all ``-inf`` (``nan=True``:
    all NaN) from the first launch at which it has ``after`` committed tokens: no id has a finite
    logit, as a model's masked head could give."""

    def __init__(self, *args, after=2, nan=False, **kw):
        super().__init__(*args, **kw)
        self.target = None
        self.after = after
        self.value = float("nan") if nan else float("-inf")
        self.hit = 0

    def _poison(self, logits, seqs, stream, positions=1):
        import numpy as np

        import metrale_feed as mf

        for row, seq in enumerate(seqs):
            req = getattr(seq, "req", None)
            if req is not None and req is self.target and len(req.tokens) >= self.after:
                bad = np.full(VOCAB * positions, self.value, np.float32)
                mf.copy_h2d_async(logits + row * positions * VOCAB * 4, bad, stream)
                self.hit += 1
        return logits

    def decode_batch_fed(self, sources, seqs, stream=None):
        logits = super().decode_batch_fed(sources, seqs, stream)
        return self._poison(logits, seqs, self.stream if stream is None else stream)

    def decode_batch_verify(self, input_ids, seqs, k, stream=None, advance=None):
        logits = super().decode_batch_verify(input_ids, seqs, k, stream, advance)
        return self._poison(logits, seqs, self.stream if stream is None else stream, k + 1)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("case", ["sampled", "sampled-nan", "greedy-min-tokens"])
def test_a_step_with_no_id_to_pick_finishes_the_request_and_commits_nothing(
        host, no_leaks, depth, debug, case):
    """Every logit of one request's row is not finite from some step on. A sampled row draws
    NO_TOKEN; a greedy one whose min_tokens bans its stop id gets that stop id at -inf (the
    argmax's lowest candidate). Neither is committed nor fed on: the request finishes
    "no_candidate" with a prefix of its oracle's tokens, and the other rows are exact."""
    from test_pipeline_penalties import oracle

    ps = prompts(3, seed=8, lo=3, hi=9)
    with NoFiniteLogit(VOCAB, block_size=4, num_blocks=60, max_rows=3,
                       nan=case == "sampled-nan") as model:
        with DecodePipeline(model, 3, depth=depth, debug=debug) as pipe:
            if case == "greedy-min-tokens":
                target_kw = dict(stop_ids=(0,), min_tokens=7)
                want = oracle(ps[0], 10, stops=(0,), min_tokens=7)
            else:
                target_kw = dict(SAMPLED)
                want = sampled_tokens(ps[0], 10, VOCAB, **SAMPLED)
            target = pipe.submit(ps[0], max_new_tokens=10, **target_kw)
            model.target = target
            others = [pipe.submit(ps[1], max_new_tokens=10),
                      pipe.submit(ps[2], max_new_tokens=10, **SAMPLED)]
            assert drive(pipe) == []
            assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == model.pool.num_blocks
    assert model.hit
    assert target.finish_reason == "no_candidate", (target.tokens, target.finish_reason)
    assert 2 <= len(target.tokens) < 10 and target.tokens == want[: len(target.tokens)]
    for req, p, kw in zip(others, ps[1:], ({}, SAMPLED)):
        assert req.tokens == sampled_tokens(p, 10, VOCAB, **kw), req


@pytest.mark.parametrize("depth", [1, 2])
def test_a_verify_with_no_id_to_pick_commits_nothing(host, no_leaks, depth):
    """The speculative pipeline: a sampled row with no finite logit emits NO_TOKEN; the request
    finishes "no_candidate" with a prefix of its oracle's tokens, the others run exactly."""
    from metrale_feed.testing.drafter import ReferenceDrafter

    ps = prompts(3, seed=9, lo=3, hi=9)
    with NoFiniteLogit(VOCAB, block_size=4, num_blocks=80, max_rows=3, after=3) as model:
        with DecodePipeline(model, 3, depth=depth,
                            speculative=ReferenceDrafter(VOCAB, 2, 0.5)) as pipe:
            target = pipe.submit(ps[0], max_new_tokens=12, **SAMPLED)
            model.target = target
            others = [pipe.submit(ps[1], max_new_tokens=12),
                      pipe.submit(ps[2], max_new_tokens=12, **SAMPLED)]
            assert drive(pipe) == []
        assert model.pool.free_count == model.pool.num_blocks
    assert model.hit and target.finish_reason == "no_candidate", target.tokens
    want = sampled_tokens(ps[0], 12, VOCAB, **SAMPLED)
    assert 3 <= len(target.tokens) < 12 and target.tokens == want[: len(target.tokens)]
    for req, p, kw in zip(others, ps[1:], ({}, SAMPLED)):
        assert req.tokens == sampled_tokens(p, 12, VOCAB, **kw), req
