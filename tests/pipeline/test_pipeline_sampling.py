"""Sampling through DecodePipeline: every request's tokens against the one-request-alone host
oracle (``sampled``: the host backend's ``sample_to_feed`` row by row over the reference logits),
whatever the batch, the row, the depth, preemption, stops and bans."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError
from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.reference import ReferenceModel
from metrale_feed.trait import ModelDeviceFeed

from conftest import VOCAB, model_for, prompts, sampled_tokens

HOT = dict(temperature=0.9, top_p=0.9, seed=12345)  # a sampled request's parameters


@pytest.mark.parametrize("depth", [1, 2])
def test_temperature_zero_is_greedy_decoding(host, no_leaks, greedy, depth):
    """Temperature 0 ignores the filters and the seed: the argmax, as with no sampling args."""
    ps = prompts(4, seed=1)
    with model_for() as model, DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=7, temperature=0.0, top_k=2, top_p=0.3,
                            min_p=0.5, seed=99) for p in ps]
        pipe.run()
        for req, p in zip(reqs, ps):
            assert not req.sampled
            assert req.tokens == greedy(p, 7, VOCAB)


def test_sampled_tokens_are_not_the_greedy_ones(host, no_leaks, greedy, sampled):
    """The oracle itself can fail: sampling at a high temperature leaves the argmax's path, and
    another seed gives other tokens."""
    p = prompts(1, seed=2)[0]
    hot = sampled(p, 12, VOCAB, temperature=5.0, seed=1)
    assert hot != greedy(p, 12, VOCAB)
    assert hot != sampled(p, 12, VOCAB, temperature=5.0, seed=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sampled_request_draws_as_if_alone_whatever_the_batch_row_and_depth(
        host, no_leaks, sampled, dtype):
    target = [5, 17, 3]
    expected = sampled(target, 10, VOCAB, dtype, **HOT)
    others = prompts(5, seed=3)
    for depth in (1, 2):
        for before in (0, 1, 3):  # the rows submitted ahead of it: its row in the batch
            rows = before + 2
            with model_for(rows, logits_dtype=dtype) as model, \
                    DecodePipeline(model, rows, depth=depth) as pipe:
                for i, p in enumerate(others[:before]):
                    pipe.submit(p, max_new_tokens=3 + 2 * i, temperature=1.5, seed=i)
                req = pipe.submit(target, max_new_tokens=10, **HOT)
                pipe.submit(others[-1], max_new_tokens=4)  # a greedy row after it
                pipe.run()
                assert req.tokens == expected, (depth, before)


@pytest.mark.parametrize("depth", [1, 2])
def test_mixed_greedy_and_sampled_rows_with_bans(host, no_leaks, greedy, sampled, depth):
    ps = prompts(6, seed=5)
    specs = []
    for i, p in enumerate(ps):
        kw = {} if i % 2 == 0 else dict(temperature=0.5 + 0.4 * i, top_k=[0, 5, 40][i % 3],
                                        min_p=0.1 if i == 5 else 0.0, seed=1000 + i)
        ban = (greedy(p, 1, VOCAB)[0], NO_TOKEN) if i % 3 == 1 else None
        specs.append((p, ban, kw))
    with model_for(6) as model, DecodePipeline(model, 6, depth=depth, debug=True) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=9, ban=ban, **kw) for p, ban, kw in specs]
        pipe.run()
        for req, (p, ban, kw) in zip(reqs, specs):
            assert req.sampled == bool(kw)
            assert req.tokens == sampled(p, 9, VOCAB, ban=ban, **kw)
            if ban is not None:
                assert ban[0] not in req.tokens[:1]


@pytest.mark.parametrize("depth", [1, 2])
def test_stop_ids_with_sampling(host, no_leaks, sampled, depth):
    ps = prompts(4, seed=6)
    trajectories = [sampled(p, 12, VOCAB, temperature=1.2, seed=i) for i, p in enumerate(ps)]
    stops = [(t[k],) for t, k in zip(trajectories, (0, 3, 11, 6))]
    with model_for() as model, DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=12, stop_ids=s, temperature=1.2, seed=i)
                for i, (p, s) in enumerate(zip(ps, stops))]
        pipe.run()
        for i, (req, p, s) in enumerate(zip(reqs, ps, stops)):
            expected = sampled(p, 12, VOCAB, stops=s, temperature=1.2, seed=i)
            assert req.tokens == expected
            assert req.tokens[-1] == s[0] and req.finish_reason == "stop"
        assert len(reqs[0].tokens) == 1


@pytest.mark.parametrize("depth", [1, 2])
def test_a_preempted_sampled_request_resumes_with_the_same_draws(host, no_leaks, sampled, depth):
    """Requests that each fit alone in 8 blocks of 2 but not together: the youngest is preempted
    and resumes by recompute; its draws are keyed on the position, so its tokens are those of
    a run without preemption (and of the request alone)."""
    ps = prompts(4, seed=11, lo=3, hi=6)
    kws = [dict(temperature=1.0 + 0.25 * i, top_k=[0, 8][i % 2], seed=77 + i) for i in range(4)]
    runs = []
    for num_blocks in (8, 200):
        with model_for(4, num_blocks=num_blocks, block_size=2) as model, \
                DecodePipeline(model, 4, depth=depth, debug=True) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=9, **kw) for p, kw in zip(ps, kws)]
            pipe.run()
            assert (pipe.stats.preemptions > 0) == (num_blocks == 8)
            assert pipe.stats.reserved_in_flight == 0
            runs.append([r.tokens for r in reqs])
        assert model.pool.free_count == num_blocks
    assert runs[0] == runs[1]
    assert runs[0] == [sampled(p, 9, VOCAB, **kw) for p, kw in zip(ps, kws)]


def test_the_pipeline_picks_the_feed_method_per_step(host, no_leaks):
    """An all-greedy step goes to argmax_batch_to_feed, a step with any sampled row to
    sample_batch_to_feed with one record per row at its position."""

    class Spy(ReferenceModel):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls = []

        def argmax_batch_to_feed(self, logits, masks, dst, event, stream):
            self.calls.append(("argmax", None))
            super().argmax_batch_to_feed(logits, masks, dst, event, stream)

        def sample_batch_to_feed(self, logits, params, masks, dst, event, stream):
            self.calls.append(("sample", params.copy()))
            super().sample_batch_to_feed(logits, params, masks, dst, event, stream)

    with Spy(VOCAB, max_rows=2) as model, DecodePipeline(model, 2) as pipe:
        greedy = pipe.submit([1, 2], max_new_tokens=2)
        pipe.run()
        assert [c[0] for c in model.calls] == ["argmax", "argmax"]
        model.calls.clear()
        hot = pipe.submit([4, 5, 6], max_new_tokens=3, temperature=0.7, top_k=9, seed=2**64 - 1)
        cold = pipe.submit([1, 2], max_new_tokens=1)
        pipe.run()
        assert [c[0] for c in model.calls] == ["sample"] * 3
        first = model.calls[0][1]
        assert first["temperature"].tolist() == [np.float32(0.7), 0.0]
        assert first["top_k"].tolist() == [9, 0] and first["seed"][0] == 2**64 - 1
        assert [c[1]["position"][0] for c in model.calls] == [3, 4, 5]
        assert first["position"][1] == 2
        assert len(hot.tokens) == 3 and cold.tokens == greedy.tokens[:1]


def test_a_model_without_the_device_feed_samples_at_depth_1(host, no_leaks, sampled):
    """Host-known inputs (launch_decode) with sampled rows: the same draws."""

    class NoFeed(ReferenceModel):
        def supports_device_token_feed(self):
            return False

    ps = prompts(3, seed=8)
    with NoFeed(VOCAB, block_size=3, num_blocks=60, max_rows=2) as model:
        with DecodePipeline(model, 2, depth=1) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=6, temperature=1.1, top_k=30, seed=i)
                    for i, p in enumerate(ps)]
            pipe.run()
            assert [r.tokens for r in reqs] == [
                sampled(p, 6, VOCAB, temperature=1.1, top_k=30, seed=i) for i, p in enumerate(ps)]
        assert model.pool.free_count == 60


@pytest.mark.parametrize("depth", [1, 2])
def test_a_sampler_that_raises_once_is_retried_with_the_same_draws(host, no_leaks, sampled,
                                                                   depth):
    """The sampler fails at the third step: step() raises it, nothing is committed, and the
    retried launch draws at the same positions."""

    class Flaky(ReferenceModel):
        calls = 0

        def sample_batch_to_feed(self, *args):
            Flaky.calls += 1
            if Flaky.calls == 3:
                raise FeedError("injected: the sampler failed")
            return super().sample_batch_to_feed(*args)

    ps = prompts(3, seed=18, lo=2, hi=3)
    with Flaky(VOCAB, block_size=2, num_blocks=60, max_rows=3) as model:
        with DecodePipeline(model, 3, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=7, temperature=0.9, seed=40 + i)
                    for i, p in enumerate(ps)]
            with pytest.raises(FeedError, match="injected"):
                while True:
                    pipe.step()
            pipe.run()
            assert [r.tokens for r in reqs] == [
                sampled(p, 7, VOCAB, temperature=0.9, seed=40 + i) for i, p in enumerate(ps)]
            assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == 60


def test_bad_sampling_params_at_submit_queue_nothing(host, no_leaks):
    with model_for(2) as model, DecodePipeline(model, 2) as pipe:
        cases = [
            (ValueError, "temperature", dict(temperature=-0.5)),
            (ValueError, "temperature", dict(temperature=math.inf)),
            (ValueError, "temperature", dict(temperature=math.nan)),
            (ValueError, "temperature", dict(temperature=1e39)),  # not a float32
            (TypeError, "temperature", dict(temperature="hot")),
            (ValueError, "top_p", dict(temperature=1.0, top_p=0.0)),
            (ValueError, "top_p", dict(temperature=1.0, top_p=1e-50)),  # 0 in float32
            (ValueError, "top_p", dict(temperature=1.0, top_p=1.5)),
            (ValueError, "top_p", dict(top_p=math.nan)),
            (ValueError, "min_p", dict(temperature=1.0, min_p=1.0)),
            (ValueError, "min_p", dict(temperature=1.0, min_p=0.99999999)),  # 1.0 in float32
            (ValueError, "min_p", dict(min_p=-0.1)),
            (ValueError, "top_k", dict(top_k=-1)),
            (ValueError, "top_k", dict(top_k=2**32)),
            (TypeError, None, dict(top_k=2.5)),
            (ValueError, "seed", dict(seed=-1)),
            (ValueError, "seed", dict(seed=2**64)),
            (TypeError, None, dict(seed=1.0)),
            # A str is no number, though float() would take it; a bool is no count.
            (TypeError, "temperature", dict(temperature="0.5")),
            (TypeError, "top_p", dict(top_p="1")),
            (TypeError, "min_p", dict(min_p=b"0")),
            (TypeError, "temperature", dict(temperature=None)),
            (TypeError, "temperature", dict(temperature=True)),
            (TypeError, "top_p", dict(top_p=True)),
            (TypeError, "top_k", dict(top_k=True)),
            (TypeError, "seed", dict(seed=False)),
            (TypeError, "max_new_tokens", dict(max_new_tokens=True)),
            (TypeError, "max_new_tokens", dict(max_new_tokens="2")),
        ]
        for error, match, kw in cases:
            with pytest.raises(error, match=match):
                pipe.submit([1, 2], **dict(dict(max_new_tokens=2), **kw))
        with pytest.raises(TypeError, match="prompt id"):
            pipe.submit([True, 2], max_new_tokens=2)
        assert pipe.idle and pipe.stats.admitted == 0 and pipe.stats.launches == 0
        edge = pipe.submit([1], max_new_tokens=2, temperature=np.float32(1e-3), top_p=1.0,
                           min_p=0.0, top_k=2**32 - 1, seed=2**64 - 1)
        pipe.run()
        assert len(edge.tokens) == 2 and edge.sampled


def test_a_model_without_a_sampler_refuses_sampled_requests_at_submit(host, no_leaks, greedy):
    class ArgmaxOnly(ReferenceModel):
        sample_batch_to_feed = ModelDeviceFeed.sample_batch_to_feed

        def feed_info(self):  # sampling is declared, not detected
            return super().feed_info()._replace(sampling=False)

    with ArgmaxOnly(VOCAB, max_rows=2) as model, DecodePipeline(model, 2) as pipe:
        with pytest.raises(FeedError, match="sample_batch_to_feed"):
            pipe.submit([1, 2], max_new_tokens=2, temperature=0.5)
        assert pipe.idle
        req = pipe.submit([1, 2], max_new_tokens=3, top_p=0.5)  # greedy: fine
        pipe.run()
        assert req.tokens == greedy([1, 2], 3, VOCAB)


def test_the_routers_take_params_and_refuse_bad_ones_before_the_forward(host, no_leaks, sampled):
    with model_for(2) as model, mf.SyncDeviceIo(model, 2) as io:
        seqs = [mf.SequenceState(0), mf.SequenceState(1)]
        for seq, p in zip(seqs, ([3, 4], [5, 6, 7])):
            model.prefill(seq, p[:-1])
        bad = [(TypeError, np.zeros(2, np.float32)),
               (ValueError, mf.sampling_params(1, temperature=0.5)),
               (ValueError, mf.sampling_params(2, temperature=-1.0)),
               (ValueError, mf.sampling_params(2, temperature=1.0, top_p=0.0)),
               (ValueError, mf.sampling_params(2, temperature=1.0, min_p=1.0))]
        free = model.pool.free_count
        for error, params in bad:
            with pytest.raises(error, match="params"):
                io.launch_decode([4, 7], seqs, None, params=params)
            assert [s.seq_len for s in seqs] == [1, 2] and model.pool.free_count == free
        params = mf.sampling_params(2, temperature=[0.8, 0.0], seed=3, position=[2, 3])
        ids = io.await_result(io.launch_decode([4, 7], seqs, None, params=params))
        assert ids == [sampled([3, 4], 1, VOCAB, temperature=0.8, seed=3)[0],
                       sampled([5, 6, 7], 1, VOCAB)[0]]


@st.composite
def sampled_schedules(draw):
    vocab = draw(st.integers(3, 120))
    block_size = draw(st.integers(1, 4))
    max_rows = draw(st.integers(1, 4))
    ops, longest = [], 1
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["submit", "submit", "step", "abort"]))
        if kind != "submit":
            ops.append((kind, draw(st.integers(0, 50))))
            continue
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12))
        max_new = draw(st.integers(1, 8))
        kw = {}
        if draw(st.booleans()):
            kw = dict(temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 2.5])),
                      top_k=draw(st.sampled_from([0, 1, 3, vocab])),
                      top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.01])),
                      min_p=draw(st.sampled_from([0.0, 0.05, 0.5])),
                      seed=draw(st.integers(0, 2**64 - 1)))
        ban = None
        if draw(st.booleans()):
            ban = (draw(st.integers(0, vocab - 1)), NO_TOKEN)
        stops = tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=2)))
        longest = max(longest, len(prompt) + max_new - 1)
        ops.append(("submit", (prompt, max_new, stops, ban, kw)))
    need = -(-longest // block_size)
    num_blocks = draw(st.sampled_from([need, need + 1, need * max_rows + 8]))
    return vocab, block_size, max_rows, num_blocks, ops


def _run_schedule(schedule, depth):
    vocab, block_size, max_rows, num_blocks, ops = schedule
    submitted = []
    with ReferenceModel(vocab, block_size=block_size, num_blocks=num_blocks,
                        max_rows=max_rows) as model:
        with DecodePipeline(model, max_rows, depth=depth) as pipe:
            for kind, arg in ops:
                if kind == "submit":
                    prompt, max_new, stops, ban, kw = arg
                    req = pipe.submit(prompt, max_new_tokens=max_new, stop_ids=stops, ban=ban,
                                      **kw)
                    submitted.append((req, arg))
                elif kind == "step" and not pipe.idle:
                    pipe.step()
                elif kind == "abort" and submitted:
                    pipe.abort(submitted[arg % len(submitted)][0])
            pipe.run()
        assert model.pool.free_count == num_blocks
    return submitted


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(sampled_schedules())
def test_schedules_with_random_sampling_params_match_at_depth_1_and_2(host, schedule):
    vocab = schedule[0]
    runs = [_run_schedule(schedule, depth) for depth in (1, 2)]
    for (one, arg), (two, _) in zip(*runs):
        prompt, max_new, stops, ban, kw = arg
        expected = sampled_tokens(prompt, max_new, vocab, stops=stops, ban=ban, **kw)
        if "abort" in (one.finish_reason, two.finish_reason):
            # Aborted: each depth committed a prefix of the request-alone tokens.
            assert one.tokens == expected[:len(one.tokens)]
            assert two.tokens == expected[:len(two.tokens)]
            continue
        assert one.tokens == two.tokens == expected
