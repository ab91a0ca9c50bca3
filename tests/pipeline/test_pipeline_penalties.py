"""Penalties through DecodePipeline (docs/penalties.md): every request's tokens against an oracle
of that request alone (the reference logits on the host, vLLM's rules in numpy, then the argmax or
the host backend's sampler), at depth 1 and 2, in batches where only some rows have penalties,
with preemption, aborts and stops; and no host synchronisation added."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError
from metrale_feed.feed import NO_TOKEN
from metrale_feed.sched.penalized import PipelinePenalties
from metrale_feed.testing.reference import ReferenceModel, _widened_logits

from conftest import VOCAB, model_for, prompts
from helpers.penalty_oracle import penalize

# The reference model's logits are fresh noise in [0, 1) each step, so a penalty shows when a
# bias first makes an id win: then the penalties on the generated ids push it back.
PEN = [dict(logit_bias={7: 0.6}, frequency_penalty=0.15),
       dict(logit_bias={3: 0.8, 100: 0.7}, presence_penalty=0.5),
       dict(logit_bias={9: 1.0}, repetition_penalty=3.0),
       dict(logit_bias={9: 1.0}, repetition_penalty=0.5, presence_penalty=-0.25),
       {}]  # no penalties: a row of a mixed batch


def oracle(prompt, max_new, dtype="float32", stops=(), *, temperature=0.0, seed=0,
           repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
           min_tokens=0):
    """The request alone: the reference logits after the numpy penalty rules, then the argmax
    (first maximum) or the host backend's sampler over that one row."""
    history, out = list(prompt), []
    pen = dict(repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
               frequency_penalty=frequency_penalty, logit_bias=logit_bias, min_tokens=min_tokens,
               stop_ids=sorted(stops), dtype=dtype)
    itemsize = 4 if dtype == "float32" else 2
    with mf.DeviceBuffer(VOCAB * itemsize) as dev, mf.DeviceBuffer(4) as cells, mf.Event() as done:
        while len(out) < max_new:
            row = penalize(_widened_logits(history, VOCAB, dtype), prompt, out, **pen)
            if temperature == 0.0:
                token = int(np.argmax(row))
            else:
                if dtype == "bfloat16":
                    import ml_dtypes
                    row = row.astype(ml_dtypes.bfloat16)
                mf.copy_h2d_async(dev, np.ascontiguousarray(row).view(np.uint8))
                params = mf.sampling_params(1, temperature=temperature, seed=seed,
                                            position=len(history))
                dst = np.zeros(1, np.uint32)
                mf.sample_to_feed(dev, params, cells, dst, done, vocab=VOCAB, dtype=dtype)
                done.synchronize()
                token = int(dst[0])
            out.append(token)
            history.append(token)
            if token in stops and len(out) >= min_tokens:
                break
    return out


def test_the_oracle_can_fail():
    """Each configuration changes greedy decoding, and its penalty changes what its bias alone
    gives (else the tests below would pass with penalties that do nothing)."""
    p = prompts(1, seed=4)[0]
    plain = oracle(p, 14)
    for kw in PEN[:-1]:
        assert oracle(p, 14, **kw) != plain, kw
        assert oracle(p, 14, **kw) != oracle(p, 14, logit_bias=kw["logit_bias"]), kw


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_equals_each_request_alone(host, no_leaks, depth, dtype):
    ps = prompts(5, seed=21)
    with model_for(5, logits_dtype=dtype) as model, DecodePipeline(model, 5, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=14, **kw) for p, kw in zip(ps, PEN)]
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps  # one per step: nothing added
    for req, p, kw in zip(reqs, ps, PEN):
        assert req.tokens == oracle(p, 14, dtype, **kw), kw


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("logprobs", [False, True])
def test_a_model_with_graphs_runs_its_forward_before_the_penalties(host, no_leaks, depth, logprobs):
    """ReferenceModel(graphs=True) holds its forward back until the feed method (one graph):
    the router has it queued first (contract.DefersForward), else the penalties change the
    previous step's logits and the forward overwrites them (penalties that silently do nothing)."""
    ps = prompts(5, seed=21)
    with model_for(5, graphs=True) as model, DecodePipeline(model, 5, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=14, logprobs=logprobs, **kw) for p, kw in zip(ps, PEN)]
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps
    for req, p, kw in zip(reqs, ps, PEN):
        assert req.tokens == oracle(p, 14, **kw), kw
        if logprobs:  # of the raw logits (the copy taken before the penalties change them)
            want = []
            for i, token in enumerate(req.tokens):
                row = _widened_logits(list(p) + req.tokens[:i], VOCAB, "float32").astype(np.float64)
                top = row.max()
                want.append(row[token] - top - np.log(np.exp(row - top).sum()))
            np.testing.assert_allclose(req.logprobs, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("depth", [1, 2])
def test_sampled_rows_with_penalties(host, no_leaks, depth):
    ps = prompts(3, seed=5)
    kws = [dict(temperature=0.8, seed=3, frequency_penalty=1.5),
           dict(temperature=1.2, seed=4, logit_bias={9: 3.0}, repetition_penalty=1.3),
           dict(temperature=0.7, seed=5)]
    with model_for(3) as model, DecodePipeline(model, 3, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=10, **kw) for p, kw in zip(ps, kws)]
        pipe.run()
    for req, p, kw in zip(reqs, ps, kws):
        assert req.tokens == oracle(p, 10, **kw)


@pytest.mark.parametrize("depth", [1, 2])
def test_min_tokens_defers_the_stop(host, no_leaks, depth):
    p = prompts(1, seed=8)[0]
    free = oracle(p, 12)
    stop = free[2]  # greedy decoding would stop at its third token
    with model_for(2) as model, DecodePipeline(model, 2, depth=depth) as pipe:
        a = pipe.submit(p, max_new_tokens=12, stop_ids=[stop])
        b = pipe.submit(p, max_new_tokens=12, stop_ids=[stop], min_tokens=6)
        pipe.run()
    assert a.tokens == free[:3] and a.finish_reason == "stop"
    assert b.tokens == oracle(p, 12, stops=[stop], min_tokens=6)
    assert len(b.tokens) > 6 and stop not in b.tokens[:6]


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_rebuilds_the_counts(host, no_leaks, depth):
    """Requests that do not fit the pool together: the youngest is preempted and resumes by
    recompute, its slot rebuilt from its prompt and committed tokens; tokens as if alone."""
    ps = prompts(4, seed=11, lo=3, hi=6)
    kws = [dict(frequency_penalty=0.4, repetition_penalty=1.5), dict(presence_penalty=0.6),
           {}, dict(repetition_penalty=2.0, logit_bias={1: 0.3})]
    runs = []
    for num_blocks in (8, 200):
        with model_for(4, num_blocks=num_blocks, block_size=2) as model, \
                DecodePipeline(model, 4, depth=depth) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=9, **kw) for p, kw in zip(ps, kws)]
            pipe.run()
            assert (pipe.stats.preemptions > 0) == (num_blocks == 8)
            runs.append([r.tokens for r in reqs])
    assert runs[0] == runs[1] == [oracle(p, 9, **kw) for p, kw in zip(ps, kws)]


def test_aborts_and_slot_reuse(host, no_leaks):
    """An aborted request's slot goes to a later one, which sees none of the old counts; more
    requests than rows reuse slots as they finish."""
    ps = prompts(7, seed=13)
    kws = [dict(frequency_penalty=0.5 + 0.1 * i) for i in range(7)]
    with model_for(3) as model, DecodePipeline(model, 3, depth=2) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=6 + i, **kw) for i, (p, kw) in enumerate(zip(ps, kws))]
        pipe.step(), pipe.step(), pipe.step()
        pipe.abort(reqs[1])
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps
        assert pipe._pen.state.free == 3
    assert reqs[1].finish_reason == "abort"
    for i, (req, p, kw) in enumerate(zip(reqs, ps, kws)):
        if i != 1:
            assert req.tokens == oracle(p, 6 + i, **kw)


def test_request_exposes_its_penalties(host, no_leaks):
    with model_for(1) as model, DecodePipeline(model, 1) as pipe:
        req = pipe.submit([1, 2], max_new_tokens=3, repetition_penalty=1.1, logit_bias={4: 1},
                          min_tokens=2)
        plain = pipe.submit([1, 2], max_new_tokens=3)
        pipe.run()
    assert (req.repetition_penalty, req.presence_penalty, req.frequency_penalty) == (
        np.float32(1.1), 0.0, 0.0)
    assert req.logit_bias == {4: 1.0} and req.min_tokens == 2
    assert plain._pen is None and plain.logit_bias == {}


def test_bad_penalties_are_refused_at_submit(host, no_leaks):
    with model_for(1) as model, DecodePipeline(model, 1, penalty_capacity=16) as pipe:
        for kw, error in [(dict(repetition_penalty=0), ValueError),
                          (dict(presence_penalty=3), ValueError),
                          (dict(frequency_penalty="1"), TypeError),
                          (dict(logit_bias={VOCAB: 1.0}), ValueError),
                          (dict(logit_bias=[1, 2]), TypeError),
                          (dict(min_tokens=5), ValueError),
                          (dict(repetition_penalty=1.2, max_new_tokens=20), ValueError),  # capacity
                          (dict(min_tokens=1, stop_ids=range(65)), ValueError)]:
            kw.setdefault("max_new_tokens", 4)
            with pytest.raises(error):
                pipe.submit([1, 2], **kw)
        assert pipe.idle and pipe._pen is None  # nothing queued, nothing allocated
    with pytest.raises(ValueError, match="penalty_capacity"):
        DecodePipeline(model_for(1), 1, penalty_capacity=0)


def test_a_model_without_feed_cells_refuses_penalties(host, no_leaks):
    with model_for(1) as model:
        cells, model.feed_cells = model.feed_cells, None
        try:
            pipe = DecodePipeline(model, 1, depth=1)
            with pytest.raises(FeedError, match="feed cells"):
                pipe.submit([1], max_new_tokens=2, presence_penalty=1.0)
            pipe.close()
        finally:
            model.feed_cells = cells


def test_a_penalty_slot_whose_write_failed_is_given_back(host, no_leaks, monkeypatch):
    """Writing a joining request's penalties into its slot fails: the slot goes back to the free
    list and the request holds none (a slot never written would decode without its penalties)."""
    ps = prompts(2, seed=3)
    with model_for(2) as model, DecodePipeline(model, 2) as pipe:
        first = pipe.submit(ps[0], max_new_tokens=6, **PEN[0])
        pipe.step()
        pen = pipe._pen
        assert first._pslot >= 0 and pen.state.free == pen.state.slots - 1
        second = pipe.submit(ps[1], max_new_tokens=6, **PEN[1])

        def failing_set(*args, **kwargs):
            raise RuntimeError("the slot's write failed")

        monkeypatch.setattr(pen.state, "set_checked", failing_set)  # the write a join makes
        with pytest.raises(RuntimeError, match="write failed"):
            while second._pslot < 0 and not pipe.idle:
                pipe.step()
        assert second._pslot < 0
        assert pen.state.free == pen.state.slots - 1  # only the first request's slot is taken


@pytest.mark.parametrize("depth", [1, 2])
def test_penalties_are_checked_once_at_submit_and_trusted_at_every_join(host, no_leaks, depth,
                                                                        monkeypatch):
    """``submit`` checks a request's penalties (``_checks.penalties``) once; a join, and each
    rejoin after a preemption, writes the slot from those values with no second check. The
    tokens still follow the oracle of each request alone."""
    from metrale_feed import _checks

    calls = []
    real = _checks.penalties

    def counting(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(_checks, "penalties", counting)
    ps = prompts(5, seed=40 + depth, lo=3, hi=8)
    with model_for(rows=3, block_size=2, num_blocks=16) as model, \
            DecodePipeline(model, 3, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=10, **PEN[i % 4]) for i, p in enumerate(ps)]
        assert len(calls) == len(reqs)
        pipe.run()
        assert pipe.stats.preemptions > 0, "no rejoin: the test checks nothing"
    assert len(calls) == len(reqs)
    for i, (req, p) in enumerate(zip(reqs, ps)):
        assert req.tokens == oracle(p, 10, **PEN[i % 4])


def test_a_batch_coerces_its_penalty_ops_once(host, no_leaks):
    """The two ops of every step reuse the batch's PenaltyLaunch while its rows keep their slots
    (docs/penalties.md, "Host cost"); a batch with other slots gets a new one. Tokens: the
    oracle's."""
    ps = prompts(3, seed=11)
    seen = []
    with model_for(3) as model, DecodePipeline(model, 3, depth=2) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=n, **PEN[i])
                for i, (p, n) in enumerate(zip(ps, (3, 12, 7)))]
        while not pipe.idle:
            pipe.step()
            if pipe._pen is not None and pipe._pen.launch is not None:
                seen.append((tuple(pipe._pen.slots), pipe._pen.launch))
    for (slots, launch), (next_slots, next_launch) in zip(seen, seen[1:]):
        assert (launch is next_launch) == (slots == next_slots)
    assert len({id(launch) for _, launch in seen}) < len(seen) - 4, "no step reused a launch"
    for i, (req, p) in enumerate(zip(reqs, ps)):
        assert req.tokens == oracle(p, (3, 12, 7)[i], **PEN[i])


class _TwoCallModel(ReferenceModel):
    """A model that says its feed methods do not take the step's penalties (its FeedInfo): the
    pipeline queues the two calls around them."""

    def feed_info(self):
        return super().feed_info()._replace(penalties=False)


@pytest.mark.parametrize("two_calls", [False, True], ids=["one-call", "two-calls"])
@pytest.mark.parametrize("depth", [1, 2])
def test_the_penalties_ride_on_the_pick_when_the_model_takes_them(host, no_leaks, monkeypatch,
                                                                  depth, two_calls):
    """The reference model's feed methods take ``penalties=`` (docs/penalties.md, "One call a
    step"; its FeedInfo says so): no separate apply or update is queued, and the tokens are the
    oracle's, greedy and sampled; a model that says they do not gets the two calls, with the same
    tokens."""
    calls = {"apply": 0, "update": 0}
    for name in calls:
        real = getattr(PipelinePenalties, name)

        def counted(self, *a, _real=real, _name=name):
            calls[_name] += 1
            return _real(self, *a)

        monkeypatch.setattr(PipelinePenalties, name, counted)
    ps = prompts(5, seed=21)
    kws = [dict(kw) for kw in PEN]
    kws[1].update(temperature=0.9, seed=2)
    cls = _TwoCallModel if two_calls else ReferenceModel
    with cls(VOCAB, block_size=4, num_blocks=200, max_rows=5) as model, \
            DecodePipeline(model, 5, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=14, **kw) for p, kw in zip(ps, kws)]
        pipe.run()
        assert pipe._pen.fused is not two_calls
        assert pipe.stats.host_syncs == pipe.stats.steps
    if two_calls:
        assert calls["apply"] == calls["update"] >= 14
    else:
        assert calls == {"apply": 0, "update": 0}
    for req, p, kw in zip(reqs, ps, kws):
        assert req.tokens == oracle(p, 14, **kw), kw


def test_the_mixin_says_it_takes_penalties_only_with_its_own_feed_methods():
    """RuntimeFeedMixin.feed_info().penalties: True while both feed methods are the mixin's; a
    subclass that overrides one (which may not pass the keyword on) gets the two calls unless it
    says otherwise, as ReferenceModel does."""

    class Plain(mf.RuntimeFeedMixin, mf.ModelDeviceFeed):
        def __init__(self):
            self.init_device_feed(vocab=16, max_rows=2)

    class Overrides(Plain):
        def argmax_batch_to_feed(self, logits, masks, dst, event, stream):
            super().argmax_batch_to_feed(logits, masks, dst, event, stream)

    for cls, want in ((Plain, True), (Overrides, False)):
        model = cls()
        try:
            assert model.feed_info().penalties is want, cls
        finally:
            model.close_device_feed()
    with ReferenceModel(VOCAB, block_size=4, num_blocks=8, max_rows=1) as model:
        assert model.feed_info().penalties is True


def test_top_logprobs_with_penalties_need_the_raw_logits(host, no_leaks):
    """Without raw_logits the top lists would be read before the call applies the penalties and
    the chosen id after: refused, nothing queued."""
    from metrale_feed.penalties import PenaltyState

    with ReferenceModel(VOCAB, block_size=4, num_blocks=8, max_rows=1) as model, \
            PenaltyState(1, capacity=8) as state, mf.DeviceBuffer(16 * 8) as top, mf.Event() as done:
        state.set(0, prompt=[1], logit_bias={2: 1.0})
        logits = mf.DeviceBuffer(VOCAB * 4)
        try:
            with pytest.raises(ValueError, match="raw_logits"):
                model.argmax_batch_to_feed(logits, [(NO_TOKEN, NO_TOKEN)], None, done, 0,
                                           top_logprobs=top, top_n=2,
                                           penalties=state.prepare([0]))
            assert done.query()
        finally:
            logits.close()
