"""DecodePipeline(..., speculative=): greedy speculative decoding gives exactly the tokens of the
pipeline without it (and of the host oracle), whatever the drafter's acceptance; the verify
counts match what the drafter's own rule predicts; KV blocks all come back."""

from __future__ import annotations

import random

import numpy as np

import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError
from metrale_feed.feed import NO_TOKEN
from metrale_feed.sched.speculative import HostDrafter, NGramDrafter
from metrale_feed.testing.drafter import ReferenceDrafter
from helpers.leaks import assert_counts_back

from conftest import VOCAB, check_greedy, greedy_tokens, model_for, play, prompts


def _requests(n, seed):
    """(prompt, max_new_tokens, stops, ban) of ``n`` requests: prompts of 1 to 20 ids, some
    with a stop id taken from their own trajectory (so it falls inside an accepted run), some
    with a ban."""
    rng = random.Random(seed)
    out = []
    for i, p in enumerate(prompts(n, seed=seed)):
        max_new = rng.choice([1, 2, 3, 7, 12, 19])
        ban = (greedy_tokens(p, 1, VOCAB)[0], NO_TOKEN) if i % 4 == 3 else None
        traj = greedy_tokens(p, max_new, VOCAB, ban=ban)
        stops = (traj[rng.randrange(len(traj))],) if i % 3 == 0 else ()
        out.append((p, max_new, stops, ban))
    return out


def _run(model, requests, speculative=None, rows=4, abort=None, depth=1, **submit):
    with DecodePipeline(model, rows, depth=depth, speculative=speculative) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=m, stop_ids=s, ban=b, **submit)
                for p, m, s, b in requests]
        if abort is not None:
            at, victim = abort
            for _ in range(at):
                pipe.step()
            pipe.abort(reqs[victim])
        pipe.run()
        stats = pipe.stats.as_dict()
    return reqs, stats


def _drafters(k):
    return [NGramDrafter(k), ReferenceDrafter(VOCAB, k, 0.0), ReferenceDrafter(VOCAB, k, 0.5),
            ReferenceDrafter(VOCAB, k, 1.0)]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("which", range(4), ids=["ngram", "a0", "a0.5", "a1"])
def test_greedy_tokens_equal_the_pipeline_without_speculation(host, no_leaks, k, which, depth):
    requests = _requests(9, seed=k)
    with model_for() as model:
        plain, _ = _run(model, requests, depth=depth)
        spec, stats = _run(model, requests, _drafters(k)[which], depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    for a, b, (p, m, s, ban) in zip(plain, spec, requests):
        assert b.tokens == a.tokens == greedy_tokens(p, m, VOCAB, stops=s, ban=ban)
        assert b.finish_reason == a.finish_reason
        assert b.finish_reason == ("stop" if s and b.tokens[-1] in s else "length")
    assert stats["drafted"] == k * stats["emitted"] - k * stats["accepted"]  # k a row a step
    assert stats["emitted"] - stats["spec_discarded"] == sum(len(r.tokens) for r in spec)
    assert stats["host_syncs"] == stats["steps"]
    assert (stats["ahead_launches"] > 0) == (depth == 2)


def _expected_counts(drafter, requests, seed=0):
    """Each request alone, stepped as the pipeline steps it: the accepted run of a step is the
    drafter's leading agreeing positions; returns (drafted, accepted, emitted, discarded)."""
    k = drafter.k
    drafted = accepted = emitted = discarded = 0
    for p, max_new, stops, ban in requests:
        traj = greedy_tokens(p, max_new, VOCAB, stops=stops, ban=ban)
        done = 0
        while done < len(traj):
            position = len(p) + done  # the first draft's position
            m = 0
            while m < k and drafter.agrees(seed, position + m):
                m += 1
            drafted += k
            accepted += m
            emitted += m + 1
            take = min(m + 1, len(traj) - done)
            discarded += m + 1 - take
            done += take
    return drafted, accepted, emitted, discarded


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_acceptance_is_the_drafters_setting(host, no_leaks, k, acceptance, depth):
    # At depth 2 the reference drafter drafts after what the step in flight will commit (the
    # rule is known on the host), so every committed step is the one of depth 1.
    requests = _requests(7, seed=10 + k)
    drafter = ReferenceDrafter(VOCAB, k, acceptance)
    with model_for() as model:
        spec, stats = _run(model, requests, drafter, depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    for req, (p, m, s, ban) in zip(spec, requests):
        assert req.tokens == greedy_tokens(p, m, VOCAB, stops=s, ban=ban)
    got = (stats["drafted"], stats["accepted"], stats["emitted"], stats["spec_discarded"])
    assert got == _expected_counts(drafter, requests)
    if acceptance == 1.0:
        assert stats["accepted"] == stats["drafted"] > 0
    if acceptance == 0.0:
        assert stats["accepted"] == 0
        assert stats["emitted"] == sum(len(r.tokens) for r in spec)  # one token a row a step


@pytest.mark.parametrize("depth", [1, 2])
def test_a_stop_inside_an_accepted_run_discards_the_rest(host, no_leaks, depth):
    p = [3, 1, 4, 1, 5]
    traj = greedy_tokens(p, 10, VOCAB)
    stop = traj[1]
    assert stop not in traj[:1]
    with model_for() as model:
        spec, stats = _run(model, [(p, 10, (stop,), None), (p, 3, (), None)],
                           ReferenceDrafter(VOCAB, 4, 1.0), depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    assert spec[0].tokens == traj[:2] and spec[0].finish_reason == "stop"
    assert spec[1].tokens == traj[:3] and spec[1].finish_reason == "length"
    # One step each: 5 emitted, 2 and 3 kept; at depth 2 a second step was launched before
    # the first one's counts were read, and both its rows are thrown away.
    assert stats["steps"] == depth and stats["emitted"] == 10 and stats["spec_discarded"] == 5
    assert stats["rows_discarded"] == 2 * (depth - 1)


@pytest.mark.parametrize("depth", [1, 2])
def test_an_abort_between_verify_steps(host, no_leaks, depth):
    requests = [(p, 19, (), None) for p in prompts(4, seed=3)]
    with model_for() as model:
        spec, stats = _run(model, requests, ReferenceDrafter(VOCAB, 2, 0.5), abort=(2, 1),
                           depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    for i, (req, (p, m, s, ban)) in enumerate(zip(spec, requests)):
        traj = greedy_tokens(p, m, VOCAB)
        if i == 1:
            assert req.finish_reason == "abort"
            assert 2 <= len(req.tokens) < m and req.tokens == traj[:len(req.tokens)]
        else:
            assert req.tokens == traj and req.finish_reason == "length"


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_with_a_small_pool_keeps_the_tokens(host, no_leaks, depth):
    requests = [(p, 12, (), None) for p in prompts(6, seed=8, lo=5, hi=12)]
    with model_for(num_blocks=14) as model:
        spec, stats = _run(model, requests, ReferenceDrafter(VOCAB, 4, 0.5), depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    assert stats["preemptions"] > 0
    for req, (p, m, s, ban) in zip(spec, requests):
        assert req.tokens == greedy_tokens(p, m, VOCAB)


def test_sampled_rows_with_top_k_1_are_the_greedy_tokens(host, no_leaks):
    # top_k = 1 leaves the argmax alone: a draft is accepted exactly when it is the argmax,
    # and a rejection draws the argmax, so the sampled rule gives the greedy tokens.
    requests = [(p, 9, (), None) for p in prompts(4, seed=5)]
    with model_for() as model:
        spec, stats = _run(model, requests, ReferenceDrafter(VOCAB, 3, 0.5), temperature=0.7,
                           top_k=1, seed=3)
    for req, (p, m, s, ban) in zip(spec, requests):
        assert req.tokens == greedy_tokens(p, m, VOCAB)
    assert 0 < stats["accepted"] < stats["drafted"]


def test_sampled_rows_are_reproducible_and_in_the_vocabulary(host, no_leaks):
    requests = [(p, 8, (), None) for p in prompts(3, seed=6)]
    runs = []
    for rows in (1, 3):  # alone or batched: the same draws
        with model_for() as model:
            spec, _ = _run(model, requests, ReferenceDrafter(VOCAB, 2, 0.5), rows=rows,
                           temperature=1.0, seed=11)
        runs.append([r.tokens for r in spec])
    assert runs[0] == runs[1]
    assert all(len(t) == 8 and all(0 <= x < VOCAB for x in t) for t in runs[0])


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_backend_gives_the_greedy_tokens(backend, no_leaks, dtype, depth):
    requests = _requests(4, seed=2)
    with model_for(logits_dtype=dtype) as model:
        spec, stats = _run(model, requests, ReferenceDrafter(VOCAB, 2, 0.5, dtype), depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    for req, (p, m, s, ban) in zip(spec, requests):
        assert req.tokens == greedy_tokens(p, m, VOCAB, dtype, stops=s, ban=ban)
    assert stats["accepted"] > 0


def test_the_ngram_lookup_against_a_brute_force_oracle():
    rng = random.Random(0)
    drafter = NGramDrafter(3, max_n=3, min_n=1)
    for _ in range(300):
        h = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        want = [NO_TOKEN] * 3
        for n in (3, 2, 1):
            if n >= len(h):
                continue
            hits = [s for s in range(len(h) - n) if h[s:s + n] == h[-n:]]
            if hits:
                found = h[hits[-1] + n:hits[-1] + n + 3]
                want = found + [NO_TOKEN] * (3 - len(found))
                break
        assert drafter.lookup(h, 3) == want
    drafter.close()


def test_the_ngram_drafter_accepts_what_the_model_repeats(host, no_leaks):
    # A prompt s + [x] + s whose greedy next id is x: the lookup of the suffix s finds x.
    from metrale_feed.testing.reference import host_next_token

    rng = random.Random(1)
    prompt = None
    while prompt is None:
        s = [rng.randrange(VOCAB) for _ in range(3)]
        for x in range(VOCAB):
            if host_next_token(s + [x] + s, VOCAB) == x:
                prompt = s + [x] + s
                break
    with model_for() as model:
        spec, stats = _run(model, [(prompt, 6, (), None)], NGramDrafter(1))
    assert spec[0].tokens == greedy_tokens(prompt, 6, VOCAB)
    assert spec[0].tokens[0] == prompt[3] and stats["accepted"] >= 1


class _NoPropose:
    k = 2


class _BadK(HostDrafter):
    def __init__(self, k):
        super().__init__(1)
        self.k = k

    def draft(self, history, k, seed, mask):
        return []


@pytest.mark.parametrize("drafter, error, match", [
    (_NoPropose(), TypeError, "propose"),
    (object(), TypeError, "propose"),
    (_BadK(0), ValueError, "k must be in"),
    (_BadK(mf.MAX_DRAFTS + 1), ValueError, "k must be in"),
    (_BadK(2.0), TypeError, "k"),
])
def test_a_bad_drafter_is_refused_at_construction(host, no_leaks, drafter, error, match):
    with model_for() as model:
        with pytest.raises(error, match=match):
            DecodePipeline(model, 4, depth=1, speculative=drafter)
    if isinstance(drafter, HostDrafter):
        drafter.close()


@pytest.mark.parametrize("k", [0, mf.MAX_DRAFTS + 1])
def test_the_shipped_drafters_refuse_k_out_of_range(k):
    with pytest.raises(ValueError, match="k must be in"):
        NGramDrafter(k)
    with pytest.raises(ValueError, match="k must be in"):
        ReferenceDrafter(VOCAB, k, 0.5)


def test_what_the_pipeline_cannot_run_speculatively_is_refused(host, no_leaks):
    drafter = ReferenceDrafter(VOCAB, 4, 0.5)
    with model_for() as model:
        with pytest.raises(ValueError, match="logit rows"):
            with model_for(rows=1000) as big:
                DecodePipeline(big, 1000, depth=1, speculative=drafter)
        with DecodePipeline(model, 4, depth=1, speculative=drafter) as pipe:
            with pytest.raises(ValueError, match="KV blocks"):
                pipe.submit([1] * 790, max_new_tokens=8)  # fits without the k drafted positions
            assert pipe.idle
        with DecodePipeline(model, 4, speculative=drafter) as pipe:  # depth 2, the default
            with pytest.raises(ValueError, match="KV blocks"):  # 2k + 1 positions ahead
                pipe.submit([1] * 788, max_new_tokens=8)
    drafter.close()
    with pytest.raises(ValueError):
        ReferenceDrafter(1, 2, 0.5)
    with pytest.raises(ValueError):
        ReferenceDrafter(VOCAB, 2, 1.5)


def test_a_model_without_a_verify_step_is_refused(host, no_leaks):
    class Plain:
        def __init__(self, model):
            self._m = model

        def __getattr__(self, name):
            if name == "decode_batch_verify":
                raise AttributeError(name)
            return getattr(self._m, name)

    drafter = NGramDrafter(2)
    with model_for() as model:
        with pytest.raises(TypeError, match="decode_batch_verify"):
            DecodePipeline(Plain(model), 4, depth=1, speculative=drafter)
    drafter.close()


# ---- schedules, dtypes, graphs and faults ----

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_pipeline_schedules import schedules  # noqa: E402


@settings(max_examples=80, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(schedules(), st.integers(1, 8), st.sampled_from([0.0, 0.5, 1.0]),
       st.sampled_from([0, 0, 50]), st.sampled_from([1, 2]))
def test_schedules_match_greedy_decoding_with_speculation(host, schedule, k, acceptance, lag_us,
                                                          depth):
    """The pipeline's property schedules (random submissions between steps, stops on the first
    token and later, bans, aborts, more requests than rows, pools that force preemption, host
    lag, three logits dtypes) with a drafter of any k and acceptance: greedy tokens exact."""
    from metrale_feed.testing.reference import ReferenceModel

    vocab, dtype, block_size, max_rows, num_blocks, ops = schedule
    longest = max([len(a[0]) + a[1] - 1 for kind, a in ops if kind == "submit"] + [1])
    reach = k if depth == 1 else 2 * k + 1  # positions a step may write past the committed
    num_blocks = max(num_blocks, -(-(longest + reach) // block_size))
    mf.configure_host(lag_us=lag_us)
    before = mf.live_objects()
    submitted = []
    try:
        drafter = ReferenceDrafter(vocab, k, acceptance, dtype)
        with ReferenceModel(vocab, block_size=block_size, num_blocks=num_blocks,
                            max_rows=max_rows, logits_dtype=dtype) as model:
            with DecodePipeline(model, max_rows, depth=depth, speculative=drafter) as pipe:
                play(pipe, ops, submitted)
                stats = pipe.stats
                assert stats.host_syncs == stats.steps
                assert stats.drafted == k * (stats.emitted - stats.accepted)
                if acceptance == 0.0:
                    assert stats.accepted == 0
                if acceptance == 1.0:
                    assert stats.accepted == stats.drafted
            assert model.pool.free_count == num_blocks, "KV blocks leaked"
        check_greedy(submitted, vocab, dtype)
    finally:
        mf.configure_host()
    assert_counts_back(before)


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(schedules(), st.integers(1, 6), st.sampled_from([0.0, 0.5, 1.0]),
       st.sampled_from([0, 0, 50]), st.sampled_from([0.005, 0.02, 1.0]), st.integers(0, 2**40))
def test_sampled_schedules_give_the_draws_of_depth_1(host, schedule, k, acceptance, lag_us,
                                                     temperature, seed):
    """Sampled requests through the property schedules (aborts, preemption, stops inside
    accepted runs, bans, host lag) at depth 1 and 2: each request's tokens are those of the
    verify rule over the request alone (a prefix where it was aborted), so depth 2's draws are
    depth 1's; at depth 2 the host still waits once a step."""
    from metrale_feed.testing.reference import ReferenceModel

    vocab, dtype, block_size, max_rows, num_blocks, ops = schedule
    longest = max([len(a[0]) + a[1] - 1 for kind, a in ops if kind == "submit"] + [1])
    num_blocks = max(num_blocks, -(-(longest + 2 * k + 1) // block_size))
    oracle_drafter = ReferenceDrafter(vocab, k, acceptance, dtype)
    sampling = dict(temperature=temperature, seed=seed)
    mf.configure_host(lag_us=lag_us)
    before = mf.live_objects()
    try:
        for depth in (1, 2):
            submitted = []
            drafter = ReferenceDrafter(vocab, k, acceptance, dtype)
            with ReferenceModel(vocab, block_size=block_size, num_blocks=num_blocks,
                                max_rows=max_rows, logits_dtype=dtype) as model:
                with DecodePipeline(model, max_rows, depth=depth, speculative=drafter) as pipe:
                    play(pipe, ops, submitted, **sampling)
                    stats = pipe.stats
                    assert stats.host_syncs == stats.steps
                assert model.pool.free_count == num_blocks, "KV blocks leaked"
            for req, (prompt, max_new, stops, ban) in submitted:
                expected = _sampled_spec_tokens(prompt, max_new, oracle_drafter, vocab=vocab,
                                                dtype=dtype, stops=stops, ban=ban, **sampling)
                assert req.finished
                if req.finish_reason == "abort":
                    assert req.tokens == expected[:len(req.tokens)]
                else:
                    assert req.tokens == expected, (depth, prompt)
    finally:
        mf.configure_host()
        oracle_drafter.close()
    assert_counts_back(before)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_graphs_model_gives_the_same_tokens(host, no_leaks, depth):
    requests = _requests(5, seed=9)
    with model_for(graphs=True) as model:
        spec, _ = _run(model, requests, ReferenceDrafter(VOCAB, 3, 0.5), depth=depth)
        plain, _ = _run(model, requests)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_fault_in_a_verify_step_fails_the_running_requests_only(host, no_leaks, depth):
    from metrale_feed import RequestStatus
    from metrale_feed.testing.reference import ReferenceModel

    class VerifyFault(ReferenceModel):
        forwards = 0

        def decode_batch_verify(self, input_ids, seqs, k, stream=None, advance=None):
            logits = super().decode_batch_verify(input_ids, seqs, k, stream, advance)
            VerifyFault.forwards += 1
            if VerifyFault.forwards == 2:
                def boom():
                    raise RuntimeError("injected fault in a verify step")
                mf.launch_host_func(stream, boom)
            return logits

    VerifyFault.forwards = 0
    ps = prompts(5, seed=4)
    with VerifyFault(VOCAB, block_size=4, num_blocks=120, max_rows=2) as model:
        with DecodePipeline(model, 2, depth=depth,
                            speculative=ReferenceDrafter(VOCAB, 2, 0.5)) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=12) for p in ps]
            pipe.step()
            with pytest.raises(FeedError, match="injected fault"):
                pipe.step()
            failed = [r for r in reqs if r.status is RequestStatus.FINISHED_ERROR]
            assert failed == reqs[:2] and all("injected fault" in r.error for r in failed)
            assert all(r.status is RequestStatus.WAITING for r in reqs[2:])
            pipe.run()
        assert model.pool.free_count == model.pool.num_blocks
    for req, p in zip(reqs, ps):
        want = greedy_tokens(p, 12, VOCAB)
        if req.finish_reason == "error":
            assert 1 <= len(req.tokens) < 12 and req.tokens == want[: len(req.tokens)]
        else:
            assert req.tokens == want and req.finish_reason == "length"


def test_a_drafter_that_raises_in_stream_order_fails_its_step(host, no_leaks):
    """At depth 2 a host drafter drafts the rows of the step in flight in a host function: an
    error there is the step's fault, reported by its wait as a HostFunctionError naming the
    drafter's exception; that step's requests fail, the others go on, no KV block is lost."""
    from metrale_feed import RequestStatus
    from metrale_feed.errors import HostFunctionError

    class Flaky(ReferenceDrafter):
        calls = 0

        def draft(self, history, k, seed=0, mask=(NO_TOKEN, NO_TOKEN)):
            Flaky.calls += 1
            if Flaky.calls == 5:
                raise RuntimeError("injected drafter fault")
            return super().draft(history, k, seed, mask)

    ps = prompts(5, seed=8)
    with model_for(rows=2, num_blocks=120) as model:
        with DecodePipeline(model, 2, depth=2, speculative=Flaky(VOCAB, 2, 0.5)) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=12) for p in ps]
            with pytest.raises(HostFunctionError) as info:
                while not pipe.idle:
                    pipe.step()
            assert "injected drafter fault" in str(info.value.__cause__)
            failed = [r for r in reqs if r.status is RequestStatus.FINISHED_ERROR]
            assert failed and all("injected drafter fault" in r.error for r in failed)
            pipe.run()
        assert model.pool.free_count == model.pool.num_blocks
    for req, p in zip(reqs, ps):
        want = greedy_tokens(p, 12, VOCAB)
        if req.finish_reason == "error":
            assert req.tokens == want[: len(req.tokens)]
        else:
            assert req.tokens == want and req.finish_reason == "length"


class _Garbage(HostDrafter):
    """Drafts no model would accept: ids past the vocabulary, NO_TOKEN first on odd rows."""

    def draft(self, history, k, seed, mask):
        if len(history) % 2:
            return [NO_TOKEN] + [VOCAB + 7] * (k - 1)
        return [VOCAB + j for j in range(k)]


@pytest.mark.parametrize("depth", [1, 2])
def test_placeholder_and_out_of_vocabulary_drafts_are_never_accepted(host, no_leaks, depth):
    requests = _requests(6, seed=12)
    with model_for() as model:
        spec, stats = _run(model, requests, _Garbage(3), depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    for req, (p, m, s, ban) in zip(spec, requests):
        assert req.tokens == greedy_tokens(p, m, VOCAB, stops=s, ban=ban)
    assert stats["accepted"] == 0 and stats["emitted"] == sum(len(r.tokens) for r in spec)


class _Aborting(ReferenceDrafter):
    """Aborts a request from inside a step (its verify step about to run): the abort is
    posted and applies when the step ends."""

    pipe = victim = None
    calls = 0

    def propose(self, batch, out, stream):
        _Aborting.calls += 1
        if _Aborting.calls == 3:
            self.pipe.abort(self.victim)
            assert not self.victim.finished  # posted: the step in progress is not disturbed
        super().propose(batch, out, stream)


@pytest.mark.parametrize("depth", [1, 2])
def test_an_abort_posted_while_a_verify_step_runs(host, no_leaks, depth):
    ps = prompts(3, seed=13)
    drafter = _Aborting(VOCAB, 2, 0.5)
    _Aborting.calls = 0
    with model_for() as model:
        with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=15) for p in ps]
            drafter.pipe, drafter.victim = pipe, reqs[0]
            pipe.run()
        assert model.pool.free_count == model.pool.num_blocks
    assert reqs[0].finish_reason == "abort"
    assert 2 <= len(reqs[0].tokens) < 15
    assert reqs[0].tokens == greedy_tokens(ps[0], 15, VOCAB)[: len(reqs[0].tokens)]
    for req, p in zip(reqs[1:], ps[1:]):
        assert req.tokens == greedy_tokens(p, 15, VOCAB) and req.finish_reason == "length"


def test_depth_2_needs_a_verify_step_that_takes_the_advance(host, no_leaks, greedy):
    from metrale_feed.testing.reference import ReferenceModel

    class NoAdvance(ReferenceModel):  # says so in its FeedInfo, as a model must
        def decode_batch_verify(self, input_ids, seqs, k, stream=None):
            return super().decode_batch_verify(input_ids, seqs, k, stream)

        def feed_info(self):
            return super().feed_info()._replace(verify_advance=False)

    drafter = ReferenceDrafter(VOCAB, 2, 0.5)
    with NoAdvance(VOCAB, block_size=4, num_blocks=50, max_rows=2) as model:
        with pytest.raises(TypeError, match="advance"):
            DecodePipeline(model, 2, depth=2, speculative=drafter)
        with DecodePipeline(model, 2, depth=1, speculative=drafter) as pipe:
            req = pipe.submit([4, 5], max_new_tokens=6)
            pipe.run()
    assert req.tokens == greedy([4, 5], 6, VOCAB)


@pytest.mark.parametrize("depth", [1, 2])
def test_kv_blocks_hold_the_committed_positions_after_every_step(host, no_leaks, depth):
    """After each step's commit a running request keeps the blocks of its committed KV and, at
    depth 2 while it is in the step in flight, of the k + 1 positions that step writes; the
    rejected positions' blocks are back in the pool."""
    k, bs = 4, 2
    drafter = ReferenceDrafter(VOCAB, k, 0.3)
    with model_for(block_size=bs, num_blocks=400) as model:
        with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=30) for p in prompts(4, seed=21)]
            while not pipe.idle:
                pipe.step()
                held = 0
                for req in reqs:
                    if req.finished:
                        continue
                    written = req._base + (k + 1 if depth == 2 else 0)
                    assert len(req._seq.block_table) == -(-written // bs)
                    held += len(req._seq.block_table)
                assert model.pool.num_blocks - model.pool.free_count == held
            assert pipe.stats.spec_blocks_returned > 0
        assert model.pool.free_count == model.pool.num_blocks
    for req, p in zip(reqs, prompts(4, seed=21)):
        assert req.tokens == greedy_tokens(p, 30, VOCAB)


def _sampled_spec_tokens(prompt, max_new, drafter, *, temperature, top_k=0, top_p=1.0, seed=0,
                         vocab=VOCAB, dtype="float32", stops=(), ban=None):
    """The oracle of a sampled request alone: each step, the drafter's drafts, the reference
    logits of its k + 1 positions (``host_logits``), one host ``verify_to_feed`` row with the
    params' position at the first emitted id; the emitted ids committed up to max_new or a
    stop id (committed last)."""
    from metrale_feed.testing.reference import host_logits

    k, history, out = drafter.k, list(prompt), []
    mask = (NO_TOKEN, NO_TOKEN) if ban is None else tuple(ban)
    with mf.DeviceBuffer((k + 1) * vocab * 4) as logits, mf.DeviceBuffer((k + 2) * 4) as cells, \
            mf.Event() as done:
        while len(out) < max_new:
            drafts = drafter.draft(history, k, seed, mask)
            rows = np.stack([host_logits(history + drafts[:j], vocab, dtype) for j in range(k + 1)])
            mf.copy_h2d_async(logits, np.ascontiguousarray(rows))
            params = mf.sampling_params(1, temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=seed, position=len(history))
            dst = np.zeros(k + 2, np.uint32)
            mf.verify_to_feed(logits, np.asarray(drafts, np.uint32), cells, dst, done, k=k,
                              masks=[mask] * (k + 1), params=params, rows=1, vocab=vocab,
                              dtype=dtype)
            done.synchronize()
            n = int(dst[0])
            for token in dst[1:1 + n].tolist():
                out.append(token)
                history.append(token)
                if token in stops or len(out) >= max_new:
                    return out
    return out


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=20), dict(top_p=0.5)])
def test_sampled_rows_match_the_verify_rule_over_each_request_alone(host, no_leaks, filters,
                                                                      depth):
    # The reference logits are close together in [0, 1): a low temperature makes the argmax
    # likely enough that drafts are accepted as well as rejected. At depth 2 each step's draws
    # are keyed by the positions the step in flight reaches on the device: the same draws.
    drafter = ReferenceDrafter(VOCAB, 3, 0.5)
    requests = [(p, 10, (), None) for p in prompts(4, seed=31)]
    with model_for() as model:
        spec, stats = _run(model, requests, drafter, depth=depth, temperature=0.01, seed=5,
                           **filters)
    assert 0 < stats["accepted"] < stats["drafted"]
    if depth == 2:
        assert stats["host_syncs"] == stats["steps"] and stats["ahead_launches"] > 0
    for req, (p, m, s, ban) in zip(spec, requests):
        assert req.tokens == _sampled_spec_tokens(p, m, drafter, temperature=0.01, seed=5,
                                                  **filters)
        assert req.tokens != greedy_tokens(p, m, VOCAB) or filters.get("top_p") == 0.5


def _first_ids_distributions(prompt, vocab, temperature, n, **filters):
    """sample_to_feed's distribution of the first ``n`` generated ids of ``prompt`` over the
    reference logits (float64 from the definitions, ``reference_survivors``), by enumerating
    the prefixes: the marginal of each position, and the joint of the first two."""
    from metrale_feed.testing.oracle import reference_survivors
    from metrale_feed.testing.reference import host_logits

    from helpers.chisq import prefix_distributions

    def target(prefix):
        ids, p = reference_survivors(host_logits(list(prompt) + list(prefix), vocab),
                                     np.ones(vocab, bool), temperature, **filters)
        full = np.zeros(vocab)
        full[ids] = p
        return full

    return prefix_distributions(target, vocab, n)


def sampled_speculation(prompt, vocab, k, depth, requests, new, **submit):
    """``requests`` requests of ``prompt`` (seeds 0, 1, ...; ``submit``: more arguments of
    each) through a pipeline of 64 rows at ``depth`` with the reference drafter of ``k`` drafts
    at acceptance 0.5: (their tokens, one request a row; the pipeline's stats)."""
    from metrale_feed.testing.reference import ReferenceModel

    with ReferenceModel(vocab, block_size=4, num_blocks=300, max_rows=64) as model:
        with DecodePipeline(model, 64, depth=depth,
                            speculative=ReferenceDrafter(vocab, k, 0.5)) as pipe:
            reqs = [pipe.submit(prompt, max_new_tokens=new, seed=seed, **submit)
                    for seed in range(requests)]
            pipe.run()
            stats = pipe.stats
    return np.array([r.tokens for r in reqs]), stats


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=5)], ids=["all", "top_k"])
def test_sampled_speculation_emits_the_target_distribution(host, no_leaks, depth, filters):
    """Many requests of one prompt (each its own seed) through the pipeline with the reference
    drafter at acceptance 0.5: the ids at positions 1 to 3 (each an accepted draft, a residual
    draw or a bonus) follow sample_to_feed's distribution there (chi-square per position, and
    over the pairs of the first two ids), as without speculation."""
    from helpers.chisq import assert_sequences_follow

    vocab, k, temperature, requests, new = 8, 3, 0.5, 2000, 3
    prompt = [3, 1, 4, 1, 5]
    marginals, joint = _first_ids_distributions(prompt, vocab, temperature, new, **filters)
    tokens, stats = sampled_speculation(prompt, vocab, k, depth, requests, new,
                                        temperature=temperature, **filters)
    assert tokens.shape == (requests, new)
    assert_sequences_follow(tokens, marginals, joint, vocab)
    assert 0 < stats.accepted < stats.drafted  # drafts accepted and rejected alike


class _Successor:
    """A verify-capable model whose greedy id after input ``t`` is ``succ[t]`` (a permutation):
    its runs cycle, so prompt lookup finds them, as it does on a real model's repetitive text
    (the reference model hashes the whole history and never repeats). It wraps a
    ``ReferenceModel`` (KV, pool, prefill) and rewrites each verify step's logits in stream
    order from the ids the step was fed."""

    def __init__(self, model, vocab, seed):
        self._m, self.vocab = model, vocab
        self.succ = np.random.default_rng(seed).permutation(vocab).astype(np.int64)
        self._held = []

    def __getattr__(self, name):
        return getattr(self._m, name)

    def decode_batch_verify(self, input_ids, seqs, k, stream=None, advance=None):
        extra = {} if advance is None else {"advance": advance}
        logits = self._m.decode_batch_verify(input_ids, seqs, k, stream, **extra)
        n, vocab = len(seqs) * (k + 1), self.vocab
        ids, rows = mf.PinnedBuffer(n * 4), mf.PinnedBuffer(n * vocab * 4)
        mf.copy_d2h_async(input_ids, ids, stream)
        mf.launch_host_func(stream, self._fill, ids, rows, n, vocab)
        mf.copy_h2d_async(logits, rows, stream)
        self._held.append((ids, rows))  # until close: the stream reads them later
        return logits

    def _fill(self, ids, rows, n, vocab):
        fed = np.minimum(np.frombuffer(ids, np.uint32, n).astype(np.int64), vocab - 1)
        out = np.frombuffer(rows, np.float32, n * vocab).reshape(n, vocab)
        out[:] = 0.0
        out[np.arange(n), self.succ[fed]] = 1.0

    def close(self):
        self._m.close()
        for ids, rows in self._held:
            ids.close()
            rows.close()


def test_the_ngram_drafter_at_depth_2_drafts_what_it_drafts_at_depth_1(host, no_leaks):
    """At depth 2 a host drafter drafts in stream order, from the history with the ids the step
    in flight emitted: on a model whose runs repeat, the n-gram drafter gets exactly depth 1's
    acceptance, where drafting from the history without that step (as before) was accepted far
    less often; the tokens are greedy decoding's either way."""
    from metrale_feed.testing.reference import ReferenceModel

    class Blind(NGramDrafter):  # the history without the step in flight, as before
        def propose(self, batch, out, stream):
            batch.ahead_cells = 0
            super().propose(batch, out, stream)

    vocab, k, rng = 16, 3, random.Random(3)
    requests = [([rng.randrange(vocab) for _ in range(rng.randint(2, 8))], 40, (), None)
                for _ in range(6)]
    rates, tokens = {}, {}
    for name, depth, drafter in ((1, 1, NGramDrafter(k)), (2, 2, NGramDrafter(k)),
                                 ("blind", 2, Blind(k))):
        model = _Successor(ReferenceModel(vocab, block_size=4, num_blocks=200, max_rows=4),
                           vocab, 5)
        try:
            spec, stats = _run(model, requests, drafter, depth=depth)
        finally:
            model.close()
        tokens[name] = [r.tokens for r in spec]
        for req in spec:  # greedy: each id the successor of the one before it
            assert all(int(model.succ[a]) == b for a, b in zip(req.tokens, req.tokens[1:]))
        if depth == 2:
            assert stats["host_syncs"] == stats["steps"] and stats["ahead_launches"] > 0
        rates[name] = stats["accepted"] / stats["drafted"]
    assert tokens[1] == tokens[2] == tokens["blind"]
    assert rates[2] == rates[1] > 0.5, rates
    assert rates["blind"] < 0.5 * rates[2], rates


def test_a_speculative_pipeline_gives_logprobs_whatever_the_models_feed_methods_take(host, no_leaks):
    """A verify step's logprobs are verify_to_feed's and its top logprobs top_logprobs' over the
    verify's logits, so a model whose feed methods take neither still gives them with
    speculation; a top_logprobs above the vocabulary is refused either way, and without
    speculation the model's own refusals remain."""
    from metrale_feed.testing.reference import ReferenceModel

    class NoLogprobs(ReferenceModel):
        def feed_info(self):
            return super().feed_info()._replace(logprobs=False, top_logprobs=False)

    drafter = ReferenceDrafter(8, 2, 0.5)
    with NoLogprobs(8, block_size=4, num_blocks=60, max_rows=2) as model:
        for depth in (1, 2):
            with DecodePipeline(model, 2, depth=depth, speculative=drafter) as pipe:
                with pytest.raises(ValueError, match="more than the vocabulary"):
                    pipe.submit([1, 2], max_new_tokens=3, logprobs=True, top_logprobs=12)
                assert pipe.idle
                req = pipe.submit([1, 2], max_new_tokens=3, logprobs=True, top_logprobs=3, temperature=0.7)
                pipe.run()
                assert len(req.logprobs) == len(req.top_logprobs) == len(req.tokens) == 3
        with DecodePipeline(model, 2) as pipe:  # the model's own refusals, once no speculation
            with pytest.raises(FeedError, match="logprobs=False"):
                pipe.submit([1, 2], max_new_tokens=3, logprobs=True)
            with pytest.raises(ValueError, match="more than the vocabulary"):
                pipe.submit([1, 2], max_new_tokens=3, logprobs=True, top_logprobs=12)


@pytest.mark.parametrize("depth", [1, 2])
def test_top_logprobs_after_the_batch_grows(host, no_leaks, depth):
    """The first step that asks for top logprobs has one row; requests that join later make the
    batch larger: their records still fit (each slot's are sized for its most rows)."""
    from pipeline.test_pipeline_logprobs import check

    ps = prompts(4, seed=21)
    with model_for(4) as model, DecodePipeline(model, 4, depth=depth,
                                               speculative=ReferenceDrafter(VOCAB, 3, 0.5)) as pipe:
        first = pipe.submit(ps[0], max_new_tokens=10, logprobs=True, top_logprobs=20)
        pipe.step()
        later = [pipe.submit(p, max_new_tokens=8, logprobs=True, top_logprobs=20) for p in ps[1:]]
        pipe.run()
    for req in [first] + later:
        assert req.finish_reason == "length"
        check(req, n=20)


@pytest.mark.parametrize("depth", [1, 2])
def test_logprobs_with_speculation_are_each_tokens_raw_logprob(host, no_leaks, depth):
    """Each committed token's logprob under the raw logits of its own position (verify_to_feed's,
    one per emitted id) and its top logprobs (top_logprobs over the verify's logit rows, each
    request's own n of the batch's greatest), for greedy and sampled rows beside rows that ask
    for none, with drafts accepted and rejected and stops inside accepted runs: one entry a
    token, the float64 oracle's; a greedy request's are bit for bit those of the pipeline
    without speculation."""
    from pipeline.test_pipeline_logprobs import check

    ps = prompts(5, seed=8)
    kws = [dict(logprobs=True, top_logprobs=4), dict(), dict(logprobs=True, temperature=0.9, top_k=40, seed=3),
           dict(temperature=1.1, seed=2), dict(logprobs=True, top_logprobs=20, temperature=0.7, top_p=0.9, seed=5)]
    with model_for(5) as model, DecodePipeline(model, 5, depth=depth) as pipe:
        plain = pipe.submit(ps[0], max_new_tokens=12, logprobs=True, top_logprobs=4)
        pipe.run()
    stop = plain.tokens[5]
    for drafter in (ReferenceDrafter(VOCAB, 3, 0.6), NGramDrafter(3)):
        with model_for(5) as model, DecodePipeline(model, 5, depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=12, stop_ids=[stop] if i == 0 else (), **kw)
                    for i, (p, kw) in enumerate(zip(ps, kws))]
            pipe.run()
            if isinstance(drafter, ReferenceDrafter):  # (random prompts repeat little: n-grams miss)
                assert pipe.stats.accepted > 0 and pipe.stats.drafted > pipe.stats.accepted
            if depth == 2:
                assert pipe.stats.host_syncs == pipe.stats.steps
        drafter.close()
        for req, kw in zip(reqs, kws):
            if not kw.get("logprobs"):
                assert req.logprobs is None and req.top_logprobs is None
                continue
            check(req, n=kw.get("top_logprobs", 0))  # one a token, the oracle's
        first = reqs[0]
        assert first.tokens == plain.tokens[:6] and first.tokens[-1] == stop  # stopped inside a run
        assert first.logprobs == plain.logprobs[:6] and first.top_logprobs == plain.top_logprobs[:6]
