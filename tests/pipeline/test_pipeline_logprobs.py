"""Logprobs through DecodePipeline (``submit(logprobs=True, top_logprobs=n)``): each request's
``logprobs`` and ``top_logprobs`` against a float64 numpy oracle of that request alone
(``log_softmax`` of the reference model's logits at each committed step, and its ``n`` greatest
ids, ties by the smaller id), at depth 1 and 2, in batches that mix greedy and sampled rows with
rows that ask for none or for other ``n``, through preemption, aborts and stops, with no host
synchronisation added; and the checks of the two options at submit."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError
from metrale_feed.testing.oracle import reference_logprobs
from metrale_feed.testing.reference import ReferenceModel, host_logits

from conftest import VOCAB, model_for, prompts
from helpers.accuracy import assert_close

# Per request: sampling, and whether it asks for logprobs. Rows without logprobs sit between
# rows with them, so a row index mixed up in the readback shows.
KWS = [dict(logprobs=True, top_logprobs=3),
       dict(),
       dict(logprobs=True, temperature=0.9, top_k=40, seed=7),
       dict(temperature=1.1, seed=2),
       dict(logprobs=True, top_logprobs=20, temperature=0.6, top_p=0.8, seed=11)]


def oracle(req, dtype="float32"):
    """The logprob of each committed token under the raw logits of its own step: the reference
    forward over the prompt and the tokens before it, in float64."""
    history = list(req.prompt)
    out = []
    for token in req.tokens:
        row = host_logits(history, VOCAB, dtype)[None]
        out.append(reference_logprobs(row, [token])[0])
        history.append(token)
    return np.array(out)


def top_oracle(req, n, dtype="float32"):
    """Per committed token: the ``n`` greatest logits' ids of its step (ties by the smaller id)
    and their float64 logprobs."""
    history = list(req.prompt)
    ids, lps = [], []
    for token in req.tokens:
        row = host_logits(history, VOCAB, dtype)[None]
        order = np.argsort(-np.asarray(row[0], np.float64), kind="stable")[:n]
        ids.append(order.tolist())
        lps.append([reference_logprobs(row, [i])[0] for i in order])
        history.append(token)
    return ids, np.array(lps)


def check(req, dtype="float32", n=0):
    assert req.logprobs is not None and len(req.logprobs) == len(req.tokens)
    assert all(type(v) is float for v in req.logprobs)
    assert_close(req.logprobs, oracle(req, dtype))
    if not n:
        assert req.top_logprobs is None
        return
    assert len(req.top_logprobs) == len(req.tokens)
    assert all(len(entry) == n for entry in req.top_logprobs)
    ids, lps = top_oracle(req, n, dtype)
    assert [[i for i, _ in entry] for entry in req.top_logprobs] == ids
    assert_close(np.array([[lp for _, lp in entry] for entry in req.top_logprobs]).ravel(),
                 lps.ravel())
    for token, lp, entry in zip(req.tokens, req.logprobs, req.top_logprobs):
        for i, value in entry:  # the chosen token, when among the top, has the same logprob
            if i == token:
                assert value == lp


def test_the_oracle_can_fail(host, no_leaks):
    """One step off, or another request's logits, is far outside the contract."""
    with model_for(1) as model, DecodePipeline(model, 1) as pipe:
        req = pipe.submit([3, 4, 5], max_new_tokens=6, logprobs=True)
        pipe.run()
    ref = oracle(req)
    assert np.abs(np.array(req.logprobs[1:]) - ref[:-1]).max() > 1e-3
    with pytest.raises(AssertionError):
        assert_close(req.logprobs[::-1], ref)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_matches_the_oracle(host, no_leaks, sampled, greedy, depth, dtype):
    ps = prompts(len(KWS), seed=31)
    with model_for(len(KWS), logits_dtype=dtype) as model, \
            DecodePipeline(model, len(KWS), depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=9, **kw) for p, kw in zip(ps, KWS)]
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps  # read with the ids: no wait added
    for req, p, kw in zip(reqs, ps, KWS):
        sampling = {k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs")}
        want = (sampled(p, 9, VOCAB, dtype, **sampling) if sampling
                else greedy(p, 9, VOCAB, dtype))
        assert req.tokens == want  # logprobs change no id
        if kw.get("logprobs"):
            check(req, dtype, kw.get("top_logprobs", 0))
        else:
            assert req.logprobs is None and req.top_logprobs is None


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_keeps_one_logprob_per_token(host, no_leaks, depth):
    """Requests that do not fit the pool together: the preempted one resumes by recompute, and
    its in-flight steps' logprobs are thrown away with their ids."""
    ps = prompts(4, seed=12, lo=3, hi=6)
    kws = [dict(logprobs=True, top_logprobs=2), dict(logprobs=True, temperature=0.8, seed=1), {},
           dict(logprobs=True, top_logprobs=5)]
    with model_for(4, num_blocks=8, block_size=2) as model, \
            DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=9, **kw) for p, kw in zip(ps, kws)]
        pipe.run()
        assert pipe.stats.preemptions > 0
        if depth == 2:
            assert pipe.stats.rows_discarded > 0
    for req, kw in zip(reqs, kws):
        assert len(req.tokens) == 9
        if kw:
            check(req, n=kw.get("top_logprobs", 0))


def test_aborts_and_stops(host, no_leaks, greedy):
    """An aborted request keeps the logprobs of what it committed; a stopped one has its stop
    token's; later requests in the freed rows get their own."""
    ps = prompts(6, seed=14)
    stop = greedy(ps[2], 12, VOCAB)[3]
    with model_for(3) as model, DecodePipeline(model, 3, depth=2) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=12, logprobs=i % 2 == 0, top_logprobs=i % 4,
                            stop_ids=[stop] if i == 2 else ()) if i % 2 == 0 else
                pipe.submit(p, max_new_tokens=12) for i, p in enumerate(ps)]
        pipe.step(), pipe.step(), pipe.step()
        pipe.abort(reqs[0])
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps
    assert reqs[0].finish_reason == "abort" and 0 < len(reqs[0].tokens) < 12
    assert reqs[2].finish_reason == "stop" and reqs[2].tokens[-1] == stop
    for i, req in enumerate(reqs):
        if i % 2 == 0:
            check(req, n=i % 4)
        else:
            assert req.logprobs is None


def test_the_graphs_model_runs_logprob_steps_eagerly(host, no_leaks):
    """``ReferenceModel(graphs=True)`` captures no logprobs: a step that asks runs the default
    path, with the same ids and the oracle's logprobs."""
    ps = prompts(2, seed=15)
    with ReferenceModel(VOCAB, block_size=4, num_blocks=100, max_rows=2, graphs=True) as model:
        with DecodePipeline(model, 2) as pipe:
            a = pipe.submit(ps[0], max_new_tokens=6, logprobs=True, top_logprobs=4)
            b = pipe.submit(ps[1], max_new_tokens=6)
            pipe.run()
    check(a, n=4)
    assert b.logprobs is None


def test_options_are_checked_at_submit(host, no_leaks):
    with model_for(1) as model, DecodePipeline(model, 1) as pipe:
        for kw, error, match in [
                (dict(logprobs=1), TypeError, "logprobs must be a bool"),
                (dict(logprobs="yes"), TypeError, "logprobs must be a bool"),
                (dict(logprobs=None), TypeError, "logprobs must be a bool"),
                (dict(logprobs=True, top_logprobs=1.0), TypeError, "top_logprobs must be an int"),
                (dict(logprobs=True, top_logprobs=True), TypeError, "top_logprobs"),
                (dict(logprobs=True, top_logprobs=-1), ValueError, r"\[0, 20\]"),
                (dict(logprobs=True, top_logprobs=21), ValueError, r"\[0, 20\]"),
                (dict(top_logprobs=3), ValueError, "needs logprobs=True"),
                ]:
            with pytest.raises(error, match=match):
                pipe.submit([1, 2], max_new_tokens=3, **kw)
        assert pipe.idle  # nothing queued
        ok = pipe.submit([1, 2], max_new_tokens=3, logprobs=np.bool_(True), top_logprobs=np.int64(2))
        off = pipe.submit([1, 2], max_new_tokens=3, logprobs=False)
        pipe.run()
    assert len(ok.logprobs) == 3 and off.logprobs is None and off.top_logprobs is None
    check(ok, n=2)


def test_a_model_whose_feed_methods_take_no_logprobs(host, no_leaks):
    """An older model's feed methods, without the keywords: logprobs=True is refused at submit,
    and everything else runs as before."""

    class Old(ReferenceModel):  # says what its feed methods lack (FeedInfo), as a model must
        def argmax_batch_to_feed(self, logits, masks, dst, event, stream):
            super().argmax_batch_to_feed(logits, masks, dst, event, stream)

        def feed_info(self):
            return super().feed_info()._replace(logprobs=False, top_logprobs=False,
                                                raw_logits=False)

    class Middle(ReferenceModel):  # chosen-token logprobs, no top ones
        def argmax_batch_to_feed(self, logits, masks, dst, event, stream, *, logprobs=None,
                                 logprobs_dst=None):
            super().argmax_batch_to_feed(logits, masks, dst, event, stream, logprobs=logprobs,
                                         logprobs_dst=logprobs_dst)

        def feed_info(self):
            return super().feed_info()._replace(top_logprobs=False, raw_logits=False)

    with Old(VOCAB, max_rows=1) as model, DecodePipeline(model, 1) as pipe:
        with pytest.raises(FeedError, match="logprobs"):
            pipe.submit([1], max_new_tokens=2, logprobs=True)
        req = pipe.submit([1], max_new_tokens=2)
        pipe.run()
    assert len(req.tokens) == 2 and req.logprobs is None
    with Middle(VOCAB, max_rows=1) as model, DecodePipeline(model, 1) as pipe:
        with pytest.raises(FeedError, match="top_logprobs"):
            pipe.submit([1], max_new_tokens=2, logprobs=True, top_logprobs=1)
        with pytest.raises(FeedError, match="raw_logits"):
            pipe.submit([1], max_new_tokens=2, logprobs=True, presence_penalty=0.5)
        req = pipe.submit([1], max_new_tokens=2, logprobs=True)
        pipe.run()
    check(req)


def test_the_ring_makes_logprob_buffers_only_when_asked(host, no_leaks):
    with model_for(1) as model, DecodePipeline(model, 1) as pipe:
        pipe.submit([1], max_new_tokens=2)
        pipe.run()
        assert pipe.io._ring.lp_dev == []
        pipe.submit([1], max_new_tokens=2, logprobs=True)
        pipe.run()
        assert len(pipe.io._ring.lp_dev) == 3 and pipe.io._ring.top_dev == []
        pipe.submit([1], max_new_tokens=2, logprobs=True, top_logprobs=1)
        pipe.run()
        assert len(pipe.io._ring.top_dev) == 3


# ---- with penalties: the logprobs of the raw logits, the ids of the penalised ones ----

PEN = [dict(logprobs=True, top_logprobs=3, logit_bias={7: 0.6}, frequency_penalty=0.15),
       dict(logit_bias={3: 0.8, 100: 0.7}, presence_penalty=0.5),
       dict(logprobs=True, logit_bias={9: 1.0}, repetition_penalty=3.0, temperature=0.8, seed=4),
       dict(logprobs=True, top_logprobs=2),
       dict(logprobs=True, min_tokens=4, logit_bias={5: 0.9})]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [10, 200])
def test_penalties_with_logprobs(host, no_leaks, depth, num_blocks):
    """Rows with penalties and logprobs, rows with either, in one batch (and preempted when the
    pool is small): every token as the penalties oracle has it, every logprob and top logprob as
    the raw logits have them, not the penalised ones."""
    from test_pipeline_penalties import oracle as penalised

    ps = prompts(len(PEN), seed=41, lo=3, hi=6)
    stop = 5
    with model_for(len(PEN), num_blocks=num_blocks, block_size=2) as model, \
            DecodePipeline(model, len(PEN), depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=10, stop_ids=[stop] if kw.get("min_tokens") else (),
                            **kw) for p, kw in zip(ps, PEN)]
        pipe.run()
        assert (pipe.stats.preemptions > 0) == (num_blocks == 10)
        assert pipe.stats.host_syncs == pipe.stats.steps
    raw_differs = False
    for req, p, kw in zip(reqs, ps, PEN):
        rules = {k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs")}
        assert req.tokens == penalised(p, 10, stops=[stop] if kw.get("min_tokens") else (),
                                       **rules), kw
        if kw.get("logprobs"):
            check(req, n=kw.get("top_logprobs", 0))
            # The biased id wins where the raw distribution does not rank it first.
            raw_differs |= any(entry[0][0] != t for entry, t in zip(req.top_logprobs or [],
                                                                     req.tokens))
    assert raw_differs  # else the test could not tell raw from penalised logprobs
