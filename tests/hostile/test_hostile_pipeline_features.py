"""Hostile tests of DecodePipeline's speculative decoding, logprobs and penalties, as a demanding
serving-engine user drives them: tokens and logprobs against independent oracles (the pipeline
without speculation, the host rule ``host_next_token``, a float64 numpy ``log_softmax`` of the
reference logits), bad input refused before anything is queued, no leaks after errors, aborts
and closes with steps in flight, and hangs or crashes caught in a child interpreter."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError
from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import ReferenceModel, _widened_logits, host_next_token

from helpers.child import run_unhung

VOCAB = 211


def model_for(rows=4, num_blocks=200, block_size=4, vocab=VOCAB, **kw):
    return ReferenceModel(vocab, block_size=block_size, num_blocks=num_blocks, max_rows=rows, **kw)


def greedy(prompt, max_new, stops=(), vocab=VOCAB):
    """Greedy decoding of the request alone, by the host rule; the stop id committed last."""
    history, out = list(prompt), []
    while len(out) < max_new:
        token = host_next_token(history, vocab)
        out.append(token)
        history.append(token)
        if token in stops:
            break
    return out


def log_softmax_oracle(prompt, tokens, vocab=VOCAB):
    """float64 numpy log_softmax of the reference logits at each committed step: per token,
    its logprob and the row (for top-n checks)."""
    history, lps, rows = list(prompt), [], []
    for token in tokens:
        row = _widened_logits(history, vocab, "float32").astype(np.float64)
        top = row.max()
        lsm = row - top - np.log(np.exp(row - top).sum())
        lps.append(lsm[token])
        rows.append(lsm)
        history.append(token)
    return np.array(lps), rows


def _prompts(n, seed=0, lo=2, hi=12):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- speculative decoding: a drafter that fails ----

class _FlakyDrafter(ReferenceDrafter):
    """Raises from ``propose`` on the calls listed in ``fail`` (1-based)."""

    def __init__(self, *args, fail=()):
        super().__init__(*args)
        self.fail, self.calls = set(fail), 0

    def propose(self, batch, out, stream):
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError("drafter failed")
        super().propose(batch, out, stream)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fail", [(2,), (2, 3), (3, 4), (2, 3, 4)])
def test_a_drafter_that_raises_leaves_the_pipeline_exact(host, no_leaks, depth, fail):
    """A drafter's error reaches the caller of step(); the next step() carries on and every
    request still gets exactly the greedy tokens (before the fix, two failed launches in a row
    at depth 2 reused the buffers of the verify step still in flight: wrong tokens)."""
    ps = _prompts(4, seed=1)
    with model_for() as model:
        drafter = _FlakyDrafter(VOCAB, 3, 0.6, fail=fail)
        with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=15) for p in ps]
            errors = 0
            while not pipe.idle:
                try:
                    pipe.step()
                except RuntimeError as exc:
                    assert "drafter failed" in str(exc)
                    errors += 1
            assert errors == len(fail)
        assert model.pool.free_count == model.pool.num_blocks
    for req, p in zip(reqs, ps):
        assert req.tokens == greedy(p, 15) and req.finish_reason == "length"


# ---- logprobs: bad input ----

@pytest.mark.parametrize("vocab, n", [(1, 2), (5, 6), (5, 20)])
def test_top_logprobs_beyond_the_vocabulary_is_refused(host, no_leaks, vocab, n):
    """A vocabulary smaller than ``top_logprobs`` has no ``n`` ids to return: before the fix
    the request ran and its top lists ended in (NO_TOKEN, NaN) placeholders."""
    with model_for(1, vocab=vocab) as model, DecodePipeline(model, 1) as pipe:
        with pytest.raises(ValueError, match="vocabulary"):
            pipe.submit([0], max_new_tokens=2, logprobs=True, top_logprobs=n)
        assert pipe.idle
        ok = pipe.submit([0], max_new_tokens=2, logprobs=True, top_logprobs=vocab)
        pipe.run()
    assert len(ok.top_logprobs) == 2
    for entry in ok.top_logprobs:
        assert sorted(i for i, _ in entry) == list(range(vocab))
        assert all(np.isfinite(lp) and lp <= 0.0 for _, lp in entry)


@pytest.mark.parametrize("kw, error", [
    (dict(logprobs=1), TypeError), (dict(logprobs=0), TypeError), (dict(logprobs="true"), TypeError),
    (dict(logprobs=np.array([True])), TypeError),
    (dict(logprobs=True, top_logprobs=21), ValueError),
    (dict(logprobs=True, top_logprobs=-1), ValueError),
    (dict(logprobs=True, top_logprobs=2.0), TypeError),
    (dict(logprobs=True, top_logprobs=True), TypeError),
    (dict(logprobs=True, top_logprobs="3"), TypeError),
    (dict(logprobs=False, top_logprobs=1), ValueError),
    (dict(logit_bias={True: 1.0}), TypeError), (dict(logit_bias={np.True_: 1.0}), TypeError),
    (dict(logit_bias={1.0: 1.0}), TypeError), (dict(logit_bias={"1": 1.0}), TypeError),
    (dict(logit_bias={-1: 1.0}), ValueError), (dict(logit_bias={VOCAB: 1.0}), ValueError),
    (dict(logit_bias={2**40: 1.0}), ValueError),
    (dict(logit_bias={1: float("nan")}), ValueError), (dict(logit_bias={1: float("inf")}), ValueError),
    (dict(logit_bias={1: -float("inf")}), ValueError), (dict(logit_bias={1: 1e39}), ValueError),
    (dict(logit_bias={1: True}), TypeError), (dict(logit_bias={1: None}), TypeError),
    (dict(logit_bias={1: "2"}), TypeError), (dict(logit_bias=[(1, 2.0)]), TypeError),
    (dict(logit_bias={i: 1.0 for i in range(301)}), ValueError),
    (dict(repetition_penalty=float("nan")), ValueError),
    (dict(repetition_penalty=float("inf")), ValueError),
    (dict(repetition_penalty=0.0), ValueError), (dict(repetition_penalty=-1.0), ValueError),
    (dict(repetition_penalty=1e-46), ValueError),  # 0 in float32
    (dict(repetition_penalty=True), TypeError), (dict(repetition_penalty="1.2"), TypeError),
    (dict(repetition_penalty=None), TypeError), (dict(repetition_penalty=1 + 0j), TypeError),
    (dict(presence_penalty=float("nan")), ValueError), (dict(presence_penalty=2.5), ValueError),
    (dict(frequency_penalty=-float("inf")), ValueError), (dict(frequency_penalty=False), TypeError),
    (dict(min_tokens=True), TypeError), (dict(min_tokens=1.0), TypeError),
    (dict(min_tokens=-1), ValueError), (dict(min_tokens=5), ValueError),  # > max_new_tokens
    (dict(min_tokens=1, stop_ids=range(65)), ValueError),
])
def test_bad_feature_input_is_refused_before_anything_is_queued(host, no_leaks, kw, error):
    with model_for(1) as model, DecodePipeline(model, 1) as pipe:
        with pytest.raises(error):
            pipe.submit([1, 2], max_new_tokens=4, **kw)
        assert pipe.idle and pipe._pen is None
        assert pipe.io._ring.lp_dev == [] and pipe.io._ring.top_dev == []


# ---- speculative decoding: interactions ----

@pytest.mark.parametrize("depth", [1, 2])
def test_a_stop_inside_an_accepted_run_returns_the_blocks_in_that_step(host, no_leaks, depth):
    """Every draft accepted, the stop id second of a run of k + 1: the request finishes in the
    step that emits it, with none of its KV blocks kept while the other request goes on."""
    p = [3, 1, 4, 1, 5]
    traj = greedy(p, 10)
    stop = traj[1]
    assert stop != traj[0]
    with model_for(block_size=2) as model:
        with DecodePipeline(model, 4, depth=depth,
                            speculative=ReferenceDrafter(VOCAB, 4, 1.0)) as pipe:
            a = pipe.submit(p, max_new_tokens=10, stop_ids=[stop])
            b = pipe.submit([9, 8, 7], max_new_tokens=40)
            done = pipe.step()
            assert a in done and a.finish_reason == "stop" and a.tokens == traj[:2]
            assert a._seq is None
            held = model.pool.num_blocks - model.pool.free_count
            assert held == len(b._seq.block_table)
            pipe.run()
        assert model.pool.free_count == model.pool.num_blocks
    assert b.tokens == greedy([9, 8, 7], 40)


@pytest.mark.parametrize("depth", [1, 2])
def test_aborting_every_request_with_a_verify_step_in_flight(host, no_leaks, depth):
    """All running requests aborted between steps while a verify step is in flight: the
    in-flight rows are thrown away, every block comes back, and requests submitted after get
    their exact tokens in the freed rows."""
    ps = _prompts(6, seed=3)
    with model_for() as model:
        with DecodePipeline(model, 4, depth=depth,
                            speculative=ReferenceDrafter(VOCAB, 3, 0.7)) as pipe:
            first = [pipe.submit(p, max_new_tokens=30) for p in ps[:4]]
            pipe.step()
            for req in first:
                pipe.abort(req)
            later = [pipe.submit(p, max_new_tokens=12) for p in ps[4:]]
            pipe.run()
            assert model.pool.free_count == model.pool.num_blocks
        assert model.pool.free_count == model.pool.num_blocks
    for req, p in zip(first, ps):
        assert req.finish_reason == "abort" and req.tokens == greedy(p, 30)[:len(req.tokens)]
    for req, p in zip(later, ps[4:]):
        assert req.tokens == greedy(p, 12) and req.finish_reason == "length"


@pytest.mark.parametrize("depth", [1, 2])
def test_spec_takes_penalties_and_refuses_only_what_never_fits(host, no_leaks, depth):
    """A speculative pipeline runs every penalty parameter (docs/speculative.md, "Penalties")
    and refuses, as the plain pipeline does, what could never run: a table past
    penalty_capacity, more stop ids than min_tokens can ban; nothing queued for them."""
    drafter = ReferenceDrafter(VOCAB, 2, 0.5)
    with model_for() as model, DecodePipeline(model, 4, depth=depth, speculative=drafter,
                                              penalty_capacity=8) as pipe:
        with pytest.raises(ValueError, match="penalty_capacity"):
            pipe.submit([1, 2], max_new_tokens=40, repetition_penalty=1.1)
        with pytest.raises(ValueError, match="stop ids"):
            pipe.submit([1, 2], max_new_tokens=4, min_tokens=1, stop_ids=range(70))
        assert pipe.idle and pipe._pen is None
        reqs = [pipe.submit([1, 2], max_new_tokens=4, **kw) for kw in [
            dict(repetition_penalty=1.1), dict(presence_penalty=0.5), dict(frequency_penalty=-0.5),
            dict(logit_bias={3: 1.0}), dict(min_tokens=2, stop_ids=[5]),
            dict(repetition_penalty=1.0, logit_bias={})]]
        pipe.run()
    assert all(len(r.tokens) == 4 for r in reqs)
    assert reqs[-1].tokens == greedy([1, 2], 4)


@pytest.mark.parametrize("depth", [1, 2])
def test_spec_matches_the_plain_pipeline_with_stops_bans_and_preemption(host, no_leaks, depth):
    """The independent oracle is the pipeline without speculation on the same model: many
    requests through 3 rows and a pool that forces preemption, stop ids taken from the
    trajectories, bans."""
    import random

    rng = random.Random(7)
    requests = []
    for i, p in enumerate(_prompts(10, seed=5)):
        m = rng.choice([1, 3, 8, 17, 24])
        ban = (host_next_token(p, VOCAB), NO_TOKEN) if i % 3 == 1 else None
        stops = [rng.choice(greedy(p, m))] if i % 2 == 0 else []
        requests.append((p, m, stops, ban))

    def run(spec):
        with model_for(3, num_blocks=11) as model:
            with DecodePipeline(model, 3, depth=depth, speculative=spec) as pipe:
                reqs = [pipe.submit(p, max_new_tokens=m, stop_ids=s, ban=b)
                        for p, m, s, b in requests]
                pipe.run()
                stats = pipe.stats.as_dict()
            assert model.pool.free_count == model.pool.num_blocks
        return reqs, stats

    plain, _ = run(None)
    spec, stats = run(ReferenceDrafter(VOCAB, 4, 0.6))
    assert stats["preemptions"] > 0
    for a, b in zip(plain, spec):
        assert b.tokens == a.tokens and b.finish_reason == a.finish_reason


# ---- logprobs against numpy ----

@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("penalised", [False, True])
def test_logprobs_through_preemption_match_numpy(host, no_leaks, depth, penalised):
    """A pool too small for the batch: preempted requests resume by recompute; each committed
    token's logprob and top list is numpy's log_softmax of the raw logits of its own step."""
    ps = _prompts(4, seed=9, lo=3, hi=6)
    pen = dict(logit_bias={11: 0.5}, frequency_penalty=0.3) if penalised else {}
    with model_for(4, num_blocks=8, block_size=2) as model, \
            DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=9, logprobs=True, top_logprobs=1 + 3 * (i % 2),
                            temperature=0.7 if i == 2 else 0.0, seed=i, **pen)
                for i, p in enumerate(ps)]
        pipe.run()
        assert pipe.stats.preemptions > 0
        assert pipe.stats.host_syncs == pipe.stats.steps
    for i, (req, p) in enumerate(zip(reqs, ps)):
        n = 1 + 3 * (i % 2)
        assert len(req.tokens) == len(req.logprobs) == len(req.top_logprobs) == 9
        want, rows = log_softmax_oracle(p, req.tokens)
        np.testing.assert_allclose(req.logprobs, want, rtol=0, atol=2e-5)
        for entry, lsm in zip(req.top_logprobs, rows):
            order = np.argsort(-lsm, kind="stable")[:n]
            assert [t for t, _ in entry] == order.tolist()
            np.testing.assert_allclose([v for _, v in entry], lsm[order], rtol=0, atol=2e-5)
        if not penalised and i != 2:  # greedy, no bias: the chosen id is the top one
            assert [e[0][0] for e in req.top_logprobs] == req.tokens


# ---- hangs: calls back into the pipeline from inside its own step ----

@pytest.mark.parametrize("call", ["close", "step", "run", "admit"])
def test_a_loop_call_from_inside_a_step_raises_rather_than_hangs(call):
    """A drafter (or model) that calls the pipeline's step(), run(), admit() or close() from
    inside the step would wait for the step's own lock forever (before the fix: a hang). It
    raises FeedError out of that step; the pipeline then carries on with the exact tokens and
    closes with nothing leaked. abort() from there is posted, as before."""
    code = f"""
        import metrale_feed as mf
        from metrale_feed import DecodePipeline, FeedError
        from metrale_feed.testing.reference import ReferenceModel, host_next_token
        from metrale_feed.testing.drafter import ReferenceDrafter
        from helpers.leaks import assert_counts_back

        V = 211
        class Calling(ReferenceDrafter):
            pipe, calls = None, 0
            def propose(self, batch, out, stream):
                Calling.calls += 1
                if Calling.calls == 2:
                    getattr(self.pipe, {call!r})()
                super().propose(batch, out, stream)

        before = mf.live_objects()
        model = ReferenceModel(V, block_size=4, num_blocks=200, max_rows=4)
        drafter = Calling(V, 2, 0.5)
        pipe = DecodePipeline(model, 4, depth=2, speculative=drafter)
        drafter.pipe = pipe
        req = pipe.submit([1, 2, 3], max_new_tokens=10)
        try:
            pipe.run()
            raise SystemExit("no error")
        except FeedError as exc:
            assert "inside" in str(exc) and {call!r} in str(exc), exc
        pipe.run()
        history, want = [1, 2, 3], []
        for _ in range(10):
            want.append(host_next_token(history, V))
            history.append(want[-1])
        assert req.tokens == want and req.finish_reason == "length", req.tokens
        pipe.close()
        assert model.pool.free_count == model.pool.num_blocks
        model.close()
        assert_counts_back(before)  # frees are deferred until the streams pass their work
        print("ok")
    """
    run_unhung(code, timeout=60, hung="the pipeline hung")


# ---- closing with work in flight, after errors ----

@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("spec", [False, True])
def test_close_with_requests_running_and_waiting_in_a_child(depth, spec):
    """close() with steps in flight, requests running, preempted and waiting, logprobs and
    penalties rows among them (without speculation): every request aborted, every block and
    buffer back, the drafter's pinned ring freed, and no hang."""
    code = f"""
        import metrale_feed as mf
        from metrale_feed import DecodePipeline
        from metrale_feed.testing.reference import ReferenceModel
        from metrale_feed.testing.drafter import ReferenceDrafter
        from helpers.leaks import assert_counts_back

        V = 211
        before = mf.live_objects()
        model = ReferenceModel(V, block_size=2, num_blocks=40, max_rows=3)
        drafter = ReferenceDrafter(V, 3, 0.7) if {spec!r} else None
        pipe = DecodePipeline(model, 3, depth={depth}, speculative=drafter)
        extra = [dict(), dict(logprobs=True, top_logprobs=3), dict(presence_penalty=0.5)]
        reqs = [pipe.submit([1 + i, 2, 3, 4], max_new_tokens=14,
                            **(dict() if {spec!r} else extra[i % 3])) for i in range(7)]
        for _ in range(4):
            pipe.step()
        assert any(r.status.value == "running" for r in reqs)
        pipe.close()
        pipe.close()  # twice: a no-op
        assert all(r.finished for r in reqs), [r.status for r in reqs]
        assert all(r.finish_reason in ("abort", "length") for r in reqs)
        assert model.pool.free_count == model.pool.num_blocks
        try:
            pipe.step()
            raise SystemExit("step after close ran")
        except mf.FeedError:
            pass
        model.close()
        del pipe, drafter
        assert_counts_back(before)  # frees are deferred until the streams pass their work
        print("ok")
    """
    run_unhung(code, timeout=60, hung="close hung")


@pytest.mark.parametrize("depth", [1, 2])
def test_close_after_a_verify_fault_leaks_nothing(host, no_leaks, depth):
    class Faulty(ReferenceModel):
        forwards = 0

        def decode_batch_verify(self, input_ids, seqs, k, stream=None, advance=None):
            logits = super().decode_batch_verify(input_ids, seqs, k, stream, advance)
            Faulty.forwards += 1
            if Faulty.forwards == 3:
                def boom():
                    raise RuntimeError("injected verify fault")
                mf.launch_host_func(stream, boom)
            return logits

    Faulty.forwards = 0
    with Faulty(VOCAB, block_size=4, num_blocks=100, max_rows=2) as model:
        pipe = DecodePipeline(model, 2, depth=depth, speculative=ReferenceDrafter(VOCAB, 2, 0.5))
        reqs = [pipe.submit(p, max_new_tokens=20) for p in _prompts(4, seed=2)]
        with pytest.raises(FeedError, match="injected verify fault"):
            while True:
                pipe.step()
        assert [r.finish_reason for r in reqs[:2]] == ["error", "error"]
        pipe.close()
        assert [r.finish_reason for r in reqs[2:]] == ["abort", "abort"]
        assert model.pool.free_count == model.pool.num_blocks


# ---- bans with speculation and logprobs ----

def test_sampled_speculative_rows_never_emit_a_banned_id(host, no_leaks):
    """A drafter that always proposes the banned id, sampled and greedy rows, a vocabulary of
    5 with 2 ids banned: no banned id is ever committed, no draft accepted."""
    class Banned(ReferenceDrafter):
        def draft(self, history, k, seed=0, mask=(NO_TOKEN, NO_TOKEN)):
            return [0] * k

    with model_for(vocab=5, num_blocks=400) as model:
        with DecodePipeline(model, 4, depth=1, speculative=Banned(5, 3, 0.5)) as pipe:
            reqs = [pipe.submit([1, 2, 3], max_new_tokens=40, temperature=1.0, seed=s,
                                ban=(0, 3)) for s in range(3)]
            reqs.append(pipe.submit([1, 2, 3], max_new_tokens=40, ban=(0, 3)))
            pipe.run()
            assert pipe.stats.accepted == 0
    tokens = [t for r in reqs for t in r.tokens]
    assert len(tokens) == 160 and set(tokens) <= {1, 2, 4} and len(set(tokens)) == 3


@pytest.mark.parametrize("depth", [1, 2])
def test_logprobs_of_a_banned_argmax_are_the_raw_ones(host, no_leaks, depth):
    """The ban changes the chosen id, not the distribution its logprob is taken from: the top
    entry is the banned raw argmax, the chosen id's logprob numpy's at the chosen id."""
    p = [4, 5, 6]
    first = host_next_token(p, VOCAB)
    with model_for(1) as model, DecodePipeline(model, 1, depth=depth) as pipe:
        req = pipe.submit(p, max_new_tokens=6, ban=(first, NO_TOKEN), logprobs=True,
                          top_logprobs=2)
        pipe.run()
    assert req.tokens[0] != first and first not in req.tokens
    want, rows = log_softmax_oracle(p, req.tokens)
    np.testing.assert_allclose(req.logprobs, want, rtol=0, atol=2e-5)
    assert req.top_logprobs[0][0][0] == first
    assert req.top_logprobs[0][1][0] == req.tokens[0]  # the second-best raw id
    assert req.top_logprobs[0][1][1] == req.logprobs[0]


@pytest.mark.parametrize("depth", [1, 2])
def test_aborts_and_submits_from_another_thread_during_speculative_steps(depth):
    """One thread runs the loop, another submits and aborts while verify steps are in flight:
    no hang, every request finished, each one's tokens a prefix of (or equal to) its greedy
    trajectory, every block back, nothing leaked."""
    code = f"""
        import random, threading
        import metrale_feed as mf
        from metrale_feed import DecodePipeline
        from metrale_feed.testing.reference import ReferenceModel, host_next_token
        from metrale_feed.testing.drafter import ReferenceDrafter
        from helpers.leaks import assert_counts_back

        V = 211
        def greedy(p, n):
            h, out = list(p), []
            for _ in range(n):
                out.append(host_next_token(h, V)); h.append(out[-1])
            return out

        before = mf.live_objects()
        model = ReferenceModel(V, block_size=2, num_blocks=60, max_rows=3)
        pipe = DecodePipeline(model, 3, depth={depth}, speculative=ReferenceDrafter(V, 3, 0.6))
        rng = random.Random(4)
        reqs, lock = [], threading.Lock()
        stop = threading.Event()

        def other():
            for i in range(40):
                p = [rng.randrange(V) for _ in range(rng.randint(1, 6))]
                r = pipe.submit(p, max_new_tokens=rng.randint(1, 12))
                with lock:
                    reqs.append((r, p))
                    victim = rng.choice(reqs)[0]
                if i % 3 == 0:
                    pipe.abort(victim)
            stop.set()

        t = threading.Thread(target=other)
        t.start()
        while not (stop.is_set() and pipe.idle):
            if not pipe.idle:
                pipe.step()
        t.join()
        pipe.run()
        for r, p in reqs:
            assert r.finished, r
            want = greedy(p, r.max_new_tokens)
            if r.finish_reason == "abort":
                assert r.tokens == want[:len(r.tokens)]
            else:
                assert r.finish_reason == "length" and r.tokens == want, (r.tokens, want)
        assert model.pool.free_count == model.pool.num_blocks
        pipe.close(); model.close()
        assert_counts_back(before)  # frees are deferred until the streams pass their work
        print("ok")
    """
    run_unhung(code, timeout=90)


# ---- penalties against the numpy oracle, where the logits go negative ----

def _penalised_greedy(prompt, max_new, stops=(), dtype="float32", **pen):
    from helpers.penalty_oracle import penalize

    history, out = list(prompt), []
    while len(out) < max_new:
        row = penalize(_widened_logits(history, VOCAB, dtype), prompt, out,
                       stop_ids=sorted(stops), dtype=dtype, **pen)
        token = int(np.argmax(row))
        out.append(token)
        history.append(token)
        if token in stops and len(out) >= pen.get("min_tokens", 0):
            break
    return out


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", range(3))
def test_random_penalties_with_negative_logits_match_numpy(host, no_leaks, depth, dtype, seed):
    """Random configurations over a batch: negative biases on many ids (so the repetition
    penalty's multiply branch runs), both signs of presence and frequency, min_tokens with
    several stop ids, rows without penalties between them, a pool that preempts."""
    import random

    rng = random.Random(seed)
    ps = _prompts(5, seed=100 + seed, lo=2, hi=8)
    configs, stops = [], []
    for i, p in enumerate(ps):
        if i == 2:
            configs.append({})
            stops.append(())
            continue
        bias = {rng.randrange(VOCAB): rng.uniform(-1.5, 1.5) for _ in range(rng.randint(1, 40))}
        for t in p:  # the prompt's ids pushed below zero: rep multiplies them
            bias[t] = -rng.uniform(0.5, 2.0)
        cfg = dict(logit_bias=bias, repetition_penalty=rng.choice([0.6, 1.0, 1.7, 3.0]),
                   presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-0.5, 1))
        st = tuple(rng.sample(range(VOCAB), rng.randint(0, 5)))
        if st and i % 2:
            cfg["min_tokens"] = rng.randint(1, 8)
        configs.append(cfg)
        stops.append(st)
    with model_for(5, num_blocks=14, block_size=2, logits_dtype=dtype) as model, \
            DecodePipeline(model, 5, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=12, stop_ids=s, **c)
                for p, s, c in zip(ps, stops, configs)]
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps
    for req, p, s, c in zip(reqs, ps, stops, configs):
        assert req.tokens == _penalised_greedy(p, 12, s, dtype, **c), c


def _greedy_switch(prompt, max_new, switch, ban1, ban2):
    history, out = list(prompt), []
    while len(out) < max_new:
        mask = ban2 if len(out) >= switch else ban1
        token = host_next_token(history, VOCAB, "float32", tuple(mask) if mask else (NO_TOKEN, NO_TOKEN))
        out.append(token)
        history.append(token)
    return out


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("spec", [False, True])
def test_a_ban_set_between_steps_applies_from_the_next_launched_step(host, no_leaks, depth, spec):
    """Request.ban changed between steps: the tokens are greedy under the old ban up to the
    step launched after the change, then under the new one. At depth 2 the step in flight
    keeps the old ban (one token, or up to k + 1 with speculation)."""
    k = 3
    p = [7, 8, 9]
    plain = greedy(p, 30)
    with model_for(2) as model:
        drafter = ReferenceDrafter(VOCAB, k, 0.8) if spec else None
        with DecodePipeline(model, 2, depth=depth, speculative=drafter) as pipe:
            req = pipe.submit(p, max_new_tokens=30)
            pipe.step(), pipe.step()
            c = len(req.tokens)
            ban2 = (plain[c + (k + 1 if spec else 1) * (depth - 1) + 2], plain[c + 4])
            req.ban = ban2
            pipe.run()
    lo = c + (1 if depth == 2 else 0)
    hi = c + ((k + 1) if spec else 1) * (depth - 1)
    ok = [s for s in range(lo, hi + 1) if _greedy_switch(p, 30, s, None, ban2) == req.tokens]
    assert ok, (c, req.tokens)
    assert not set(ban2) & set(req.tokens[hi:])


# ---- penalties never make a finite logit infinite ----

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_overflowing_penalty_saturates_so_greedy_and_sampled_rows_agree(host, no_leaks, dtype):
    """A huge logit_bias, then repetition_penalty < 1 on the generated id: l / rep overflows.
    Before the fix the logit became +inf, which the argmax takes and the sampler (whose
    candidates are the finite logits) never draws: a greedy row repeated id 7, a near-greedy
    sampled row (temperature 1e-3) dropped it after its first draw. Saturated at the dtype's
    largest finite value, both keep drawing 7, as the numpy oracle says."""
    big = {"float32": 3e38, "bfloat16": 3e38, "float16": 6e4}[dtype]
    pen = dict(logit_bias={7: big}, repetition_penalty=0.5)
    p = [1, 2, 3]
    with model_for(2, logits_dtype=dtype) as model, DecodePipeline(model, 2, depth=2) as pipe:
        g = pipe.submit(p, max_new_tokens=6, **pen)
        s = pipe.submit(p, max_new_tokens=6, temperature=1e-3, seed=1, **pen)
        pipe.run()
    assert g.tokens == [7] * 6 == _penalised_greedy(p, 6, (), dtype, **pen)
    assert s.tokens == g.tokens


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_penalties_apply_saturates_on_every_backend(backend, dev, dtype):
    """The device op itself, on host, simt and cuda: finite logits pushed past the dtype's
    largest finite value either way (a bias, a division by rep < 1, a multiply of a negative
    logit by rep > 1, a frequency penalty) stop there, bit for bit as the numpy oracle; a
    logit already +-inf and a min_tokens stop id (-inf) stay infinite."""
    from helpers.penalty_oracle import largest, penalize, round_to
    from metrale_feed.penalties import PenaltyState

    m = float(largest(dtype))
    vocab = 8
    logits = round_to(np.array([[0.9 * m, -0.9 * m, 0.5, np.inf, -np.inf, 0.7 * m, 2.0,
                                 -0.6 * m]], np.float32), dtype)
    req = [dict(prompt=[0, 1, 3, 4], generated=[5, 7, 7], repetition_penalty=0.5,
                logit_bias={2: 0.99 * m, 6: m}, min_tokens=5, stop_ids=[6]),
           dict(prompt=[1, 7], generated=[1], repetition_penalty=1.5, frequency_penalty=2.0,
                logit_bias={0: 0.5 * m})]
    import ml_dtypes

    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    for r in req:
        with PenaltyState(1, capacity=16) as state:
            state.set(0, **r)
            host = np.ascontiguousarray(logits.astype(np_dtype))
            buf = dev.upload(host)
            state.apply(buf, [0], vocab=vocab, dtype=dtype)
            got = dev.download(buf, host.dtype).astype(np.float32)[:vocab]
            buf.close()
        want = penalize(logits[0], dtype=dtype, **r)
        assert ((got == want) | (np.isnan(got) & np.isnan(want))).all(), (got, want)
        finite_in = np.isfinite(logits[0])
        if r.get("min_tokens"):
            finite_in[r["stop_ids"]] = False
        assert np.isfinite(got[finite_in]).all(), got
        assert got[3] == np.inf and got[4] == -np.inf


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_ngram_drafter_over_a_tiny_vocabulary_with_aborts(host, no_leaks, depth, k):
    """A vocabulary of 7 ids makes the greedy trajectories cycle, so the n-gram lookup is often
    right (long accepted runs, stops inside them); aborts at random steps, more requests than
    rows, a pool that preempts: every request's tokens are greedy decoding's (a prefix for
    the aborted ones), every block back."""
    import random

    from metrale_feed.sched.speculative import NGramDrafter

    vocab = 7
    rng = random.Random(k * 10 + depth)
    reqs_in = []
    for i in range(9):
        p = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        m = rng.randint(1, 30)
        stops = [rng.choice(greedy(p, m, vocab=vocab))] if i % 3 == 0 else []
        reqs_in.append((p, m, stops))
    reach = k if depth == 1 else 2 * k + 1
    with model_for(3, vocab=vocab, block_size=2, num_blocks=(40 + reach) // 2 + 4) as model:
        with DecodePipeline(model, 3, depth=depth, speculative=NGramDrafter(k)) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=m, stop_ids=s) for p, m, s in reqs_in]
            steps = 0
            while not pipe.idle:
                pipe.step()
                steps += 1
                if steps % 4 == 0:
                    pipe.abort(reqs[rng.randrange(len(reqs))])
            stats = pipe.stats
            assert stats.accepted > 0
        assert model.pool.free_count == model.pool.num_blocks
    for req, (p, m, s) in zip(reqs, reqs_in):
        want = greedy(p, m, s, vocab=vocab)
        if req.finish_reason == "abort":
            assert req.tokens == want[:len(req.tokens)]
        else:
            assert req.tokens == want
            assert req.finish_reason == ("stop" if s and req.tokens[-1] in s else "length")


# ---- drafters: bad input ----

class _KDrafter:
    def __init__(self, k):
        self.k = k

    def propose(self, batch, out, stream):  # pragma: no cover - refused before any step
        raise AssertionError("never called")


@pytest.mark.parametrize("drafter, error", [
    (_KDrafter(True), TypeError), (_KDrafter("2"), TypeError), (_KDrafter(None), TypeError),
    (_KDrafter(2.0), TypeError), (_KDrafter(0), ValueError), (_KDrafter(-1), ValueError),
    (_KDrafter(mf.MAX_DRAFTS + 1), ValueError), (True, TypeError), (object, TypeError),
])
def test_a_bad_drafter_is_refused_before_anything_is_allocated(host, no_leaks, drafter, error):
    from metrale_feed.sched.speculative import NGramDrafter

    with model_for() as model:
        with pytest.raises(error):
            DecodePipeline(model, 4, depth=1, speculative=drafter)
        with pytest.raises(TypeError, match="k attribute"):
            DecodePipeline(model, 4, depth=1, speculative=NGramDrafter)  # the class itself
        with DecodePipeline(model, 4, depth=1, speculative=_KDrafter(np.int64(2))) as pipe:
            assert pipe._spec.k == 2 and type(pipe._spec.k) is int


@pytest.mark.parametrize("kw, error", [
    (dict(acceptance=True), TypeError), (dict(acceptance="0.5"), TypeError),
    (dict(acceptance=None), TypeError), (dict(acceptance=float("nan")), ValueError),
    (dict(acceptance=1.5), ValueError), (dict(acceptance=0.5, dtype="float64"), ValueError),
    (dict(acceptance=0.5, dtype=3), ValueError),
])
def test_the_reference_drafter_refuses_bad_settings(kw, error):
    """Before the fix acceptance=True or "0.5" went through float() and ran, and a dtype no
    model has was refused only at the first step."""
    with pytest.raises(error):
        ReferenceDrafter(VOCAB, 2, **kw)


@pytest.mark.parametrize("depth", [1, 2])
def test_one_penalty_slot_reused_by_requests_that_stop_with_a_step_in_flight(host, no_leaks, depth):
    """One row: each request stops (early, by its own stop id) while the next step is in
    flight at depth 2, whose dead row still counts into the slot; the next request in that
    slot must see none of it. Tokens and logprobs against the oracles."""
    ps = _prompts(6, seed=17)
    cfgs = [dict(frequency_penalty=0.8 + 0.1 * i, repetition_penalty=1.5,
                 logit_bias={(5 * i) % VOCAB: 0.4}) for i in range(6)]
    stops = []
    for p, c in zip(ps, cfgs):
        traj = _penalised_greedy(p, 10, (), "float32", **c)
        stops.append([traj[3]] if traj[3] not in traj[:3] else [])
    with model_for(1) as model, DecodePipeline(model, 1, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=10, stop_ids=s, logprobs=True, **c)
                for p, s, c in zip(ps, stops, cfgs)]
        pipe.run()
        if depth == 2:
            assert pipe.stats.rows_discarded > 0
        assert pipe._pen.state.free == 1
    assert sum(r.finish_reason == "stop" for r in reqs) >= 3
    for req, p, s, c in zip(reqs, ps, stops, cfgs):
        assert req.tokens == _penalised_greedy(p, 10, s, "float32", **c)
        want, _ = log_softmax_oracle(p, req.tokens)
        np.testing.assert_allclose(req.logprobs, want, rtol=0, atol=2e-5)


def test_sampled_speculative_rows_are_the_same_through_preemption(host, no_leaks):
    """The verify draws are keyed by seed and position, the reference drafter's drafts too: a
    pool small enough to preempt over and over gives every sampled request the tokens it gets
    with room to spare."""
    runs = []
    for num_blocks in (400, 14):
        with model_for(3, block_size=2, num_blocks=num_blocks) as model:
            with DecodePipeline(model, 3, depth=1,
                                speculative=ReferenceDrafter(VOCAB, 3, 0.5)) as pipe:
                reqs = [pipe.submit([1 + i, 2, 3, 4], max_new_tokens=12, temperature=0.05,
                                    seed=i, top_k=30) for i in range(4)]
                pipe.run()
                assert (pipe.stats.preemptions > 0) == (num_blocks == 14)
            assert model.pool.free_count == model.pool.num_blocks
        runs.append([r.tokens for r in reqs])
    assert runs[0] == runs[1]
    assert any(t != greedy([1 + i, 2, 3, 4], 12) for i, t in enumerate(runs[0]))  # really sampled


def _verify_alone(prompt, max_new, drafter, **params):
    """A sampled request alone through the verify rule: each step the drafter's drafts, the
    reference logits of the k + 1 positions, one host verify_to_feed row."""
    from metrale_feed.testing.reference import host_logits

    k, history, out = drafter.k, list(prompt), []
    with mf.DeviceBuffer((k + 1) * VOCAB * 4) as logits, mf.DeviceBuffer((k + 2) * 4) as cells, \
            mf.Event() as done:
        while len(out) < max_new:
            drafts = drafter.draft(history, k, params.get("seed", 0), (NO_TOKEN, NO_TOKEN))
            rows = np.stack([host_logits(history + drafts[:j], VOCAB) for j in range(k + 1)])
            mf.copy_h2d_async(logits, np.ascontiguousarray(rows, np.float32))
            sp = mf.sampling_params(1, position=len(history), **params)
            dst = np.zeros(k + 2, np.uint32)
            mf.verify_to_feed(logits, np.asarray(drafts, np.uint32), cells, dst, done, k=k,
                              params=sp, rows=1, vocab=VOCAB, dtype="float32")
            done.synchronize()
            for token in dst[1:1 + int(dst[0])].tolist():
                if len(out) < max_new:
                    out.append(token)
                    history.append(token)
    return out


@pytest.mark.parametrize("filters", [dict(min_p=0.2), dict(min_p=0.05, top_k=10, top_p=0.7)])
def test_sampled_speculative_rows_with_min_p_match_the_verify_rule(host, no_leaks, filters):
    drafter = ReferenceDrafter(VOCAB, 3, 0.5)
    ps = _prompts(3, seed=23)
    with model_for() as model, DecodePipeline(model, 4, depth=1, speculative=drafter) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=10, temperature=0.02, seed=9, **filters)
                for p in ps]
        pipe.run()
    for req, p in zip(reqs, ps):
        assert req.tokens == _verify_alone(p, 10, drafter, temperature=0.02, seed=9, **filters)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "x", None])
def test_a_host_drafter_that_gives_a_bad_id_is_named(host, no_leaks, bad):
    """A draft that is no uint32 id raises out of step() with the drafter's name and the id
    (before: array's bare "can't convert negative value to unsigned int"); the pipeline then
    closes with nothing leaked."""
    from metrale_feed.sched.speculative import HostDrafter

    class BadIds(HostDrafter):
        def draft(self, history, k, seed, mask):
            return [bad, 1]

    with model_for(2) as model, DecodePipeline(model, 2, depth=1, speculative=BadIds(2)) as pipe:
        pipe.submit([1, 2], max_new_tokens=3)
        with pytest.raises((OverflowError, TypeError), match=r"BadIds\.draft gave .*uint32"):
            pipe.step()
    assert model.pool.free_count == model.pool.num_blocks
