"""``PickStep`` and ``pick_to_feed``: one launch described once and handed down.

Checked against the keyword ops (``argmax_to_feed``, ``sample_to_feed``: the same cells, ids and
logprobs, bit for bit) and the numpy rule (``reference_argmax``); refusals queue nothing; the
router hands a model its step when ``FeedInfo.step`` says it takes one, and the trait's keywords
otherwise (a model that overrides a feed method is never bypassed).
"""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import NO_TOKEN, DeviceBuffer, Event, PickStep, PinnedBuffer
from metrale_feed.sampling import sampling_params
from metrale_feed.step import FIELDS, OPS
from metrale_feed.testing.oracle import reference_argmax
from metrale_feed.testing.reference import ReferenceModel


def _case(rows=6, vocab=300, seed=3):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the lower id wins
    masks = np.full((rows, 2), NO_TOKEN, np.uint32)
    masks[2, 0] = int(np.argmax(logits[2]))  # the winner banned
    return logits, masks


def _launch(run, rows, logprobs=False):
    """Run ``run(cells, dst, event, lp, lp_dst)`` and return (ids, cells, logprobs)."""
    with DeviceBuffer(rows * 4) as cells, PinnedBuffer(rows * 4) as dst, Event() as done, \
            DeviceBuffer(rows * 4) as lp, PinnedBuffer(rows * 4) as lp_dst:
        run(cells, dst, done, lp if logprobs else None, lp_dst if logprobs else None)
        done.synchronize()
        host_cells = np.empty(rows, np.uint32)
        mf.copy_d2h_async(cells, host_cells)
        mf.stream_synchronize(0)
        return (np.frombuffer(dst, np.uint32).copy(), host_cells,
                np.frombuffer(lp_dst, np.float32).copy() if logprobs else None)


@pytest.mark.parametrize("logprobs", [False, True])
def test_an_argmax_step_is_the_keyword_call_and_the_rule(host, no_leaks, logprobs):
    logits, masks = _case()
    rows = len(logits)
    by_keywords = _launch(lambda c, d, e, lp, lpd: mf.argmax_to_feed(
        logits, masks, c, d, e, logprobs=lp, logprobs_dst=lpd), rows, logprobs)
    by_step = _launch(lambda c, d, e, lp, lpd: mf.pick_to_feed(PickStep(
        "argmax", logits=logits, masks=masks, cells=c, dst=d, event=e, logprobs=lp,
        logprobs_dst=lpd)), rows, logprobs)
    expected = reference_argmax(logits, [tuple(m) for m in masks])
    assert np.array_equal(by_step[0], expected) and np.array_equal(by_step[1], expected)
    for a, b in zip(by_keywords, by_step):
        assert (a is None and b is None) or a.tobytes() == b.tobytes()


def test_a_sample_step_is_the_keyword_call(host, dev, no_leaks):
    logits, masks = _case(rows=8, vocab=2000, seed=11)
    params = sampling_params(8, temperature=0.9, top_p=0.8, seed=5, position=list(range(8)))
    by_keywords = _launch(lambda c, d, e, lp, lpd: mf.sample_to_feed(
        logits, params, c, d, e, masks=masks), 8)
    by_step = _launch(lambda c, d, e, lp, lpd: mf.pick_to_feed(PickStep(
        "sample", logits=logits, params=params, masks=masks, cells=c, dst=d, event=e)), 8)
    assert by_keywords[0].tobytes() == by_step[0].tobytes()
    assert by_keywords[1].tobytes() == by_step[1].tobytes()
    assert masks[2, 0] not in by_step[0][2:3]
    # Rows from the params when neither rows nor masks give them, as sample_to_feed infers.
    with dev.upload(logits) as buf:
        inferred = _launch(lambda c, d, e, lp, lpd: mf.pick_to_feed(PickStep(
            "sample", logits=buf, params=params, cells=c, dst=d, event=e, vocab=2000,
            dtype="float32")), 8)
        plain = _launch(lambda c, d, e, lp, lpd: mf.sample_to_feed(
            buf, params, c, d, e, vocab=2000, dtype="float32"), 8)
    assert inferred[0].tobytes() == plain[0].tobytes()


def test_the_step_is_read_only_and_says_its_fields():
    step = PickStep("argmax", rows=4, masks=None)
    with pytest.raises(AttributeError, match="read-only"):
        step.rows = 5
    with pytest.raises(AttributeError, match="read-only"):
        step.anything = 1
    assert FIELDS[0] == "op" and set(OPS) == {"argmax", "sample", "verify"}
    assert list(step.asdict()) == list(FIELDS)
    assert step.asdict()["rows"] == 4 and step.stream == 0 and step.top_n == 0
    with pytest.raises(ValueError, match="op must be one of"):
        PickStep("decode")
    with pytest.raises(TypeError):
        PickStep("argmax", colour=1)
    with pytest.raises(TypeError, match="no field 'colour'"):
        step.replace(colour=1)
    moved = step.replace(rows=9, bitmask=7)
    assert (moved.rows, moved.bitmask, step.rows, step.bitmask) == (9, 7, 4, None)
    with pytest.raises(TypeError, match="cannot be pickled"):
        import pickle
        pickle.dumps(step)


def test_on_fills_only_what_the_step_leaves_and_clears_the_models_fields():
    step = PickStep("sample", params="p", vocab=10, top_logprobs="t", top_logprobs_dst="td",
                    top_n=3, raw_logits="raw", logprobs="lp")
    done = step.on("cells", 99, "bfloat16", 128, "shard")
    assert (done.cells, done.vocab, done.dtype, done.row_stride, done.shard) == \
        ("cells", 10, "bfloat16", 128, "shard")
    assert (done.top_logprobs, done.top_logprobs_dst, done.top_n, done.raw_logits) == \
        (None, None, 0, None)
    assert (done.params, done.logprobs, done.op) == ("p", "lp", "sample")
    assert step.top_n == 3 and step.cells is None  # the step itself is unchanged


def test_refused_steps_queue_nothing(host, dev, no_leaks):
    logits, masks = _case()
    rows = len(logits)
    with DeviceBuffer(rows * 4) as cells, PinnedBuffer(rows * 4) as dst, Event() as ev:
        dev.write(cells, np.full(rows, 0xCDCDCDCD, np.uint32))
        np.frombuffer(dst, np.uint32)[:] = 0xABABABAB
        base = dict(logits=logits, masks=masks, cells=cells, dst=dst, event=ev)
        with pytest.raises(TypeError, match="k must be an int"):  # verify_to_feed's k, unset
            mf.pick_to_feed(PickStep("verify", **base))
        with pytest.raises(ValueError, match="drafts hold"):  # a verify step: its drafts are checked
            mf.pick_to_feed(PickStep("verify", drafts=[1, 2, 3], k=2, **base))
        with pytest.raises(ValueError, match="top_logprobs"):  # refused on a verify step too
            mf.pick_to_feed(PickStep("verify", drafts=[1] * 4, k=1, top_logprobs=cells, **base))
        with pytest.raises(TypeError, match="params"):
            mf.pick_to_feed(PickStep("sample", **base))
        with pytest.raises(ValueError, match="top_logprobs"):
            mf.pick_to_feed(PickStep("argmax", top_logprobs=cells, **base))
        with pytest.raises(ValueError, match="raw_logits"):
            mf.pick_to_feed(PickStep("argmax", raw_logits=logits, **base))
        with pytest.raises(ValueError, match="disagrees"):
            mf.pick_to_feed(PickStep("argmax", rows=rows + 1, **base))
        with pytest.raises(TypeError):
            mf.pick_to_feed(None)
        mf.stream_synchronize(0)
        assert ev.query()
        assert (np.frombuffer(dst, np.uint32) == 0xABABABAB).all()
        assert (dev.download(cells, np.uint32) == 0xCDCDCDCD).all()


class _Counting(ReferenceModel):
    """The reference model, counting which feed method each launch reached."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps, self.keywords = [], 0

    def pick_to_feed(self, step):
        self.steps.append(step)
        super().pick_to_feed(step)


class _Overriding(_Counting):
    """Overrides the trait's argmax method: the router must call it, not pick_to_feed."""

    def argmax_batch_to_feed(self, logits, masks, dst, event, stream, **extra):
        self.keywords += 1
        super().argmax_batch_to_feed(logits, masks, dst, event, stream, **extra)


def _serve(model_type, sampled):
    model = model_type(64, max_rows=4, num_blocks=64, block_size=4)
    try:
        with mf.DecodePipeline(model, 4) as pipe:
            kw = dict(temperature=0.8, seed=1) if sampled else {}
            reqs = [pipe.submit([1 + i, 2], max_new_tokens=6, **kw) for i in range(3)]
            pipe.run()
            return model, [list(r.tokens) for r in reqs]
    finally:
        model.close()


@pytest.mark.parametrize("sampled", [False, True])
def test_the_router_hands_its_step_to_a_model_that_takes_one(host, no_leaks, monkeypatch,
                                                              sampled):
    by_keywords = []
    for name in ("argmax_batch_to_feed", "sample_batch_to_feed"):
        def spy(self, *a, _orig=getattr(mf.RuntimeFeedMixin, name), **k):
            by_keywords.append(type(self))
            return _orig(self, *a, **k)
        monkeypatch.setattr(mf.RuntimeFeedMixin, name, spy)  # still the mixin's own
    model, tokens = _serve(_Counting, sampled)
    assert model.feed_info().step
    assert by_keywords == []  # the router's step went to pick_to_feed, not through keywords
    assert model.steps and all(s.op == ("sample" if sampled else "argmax") for s in model.steps)
    assert all(s.cells is None and s.dst is not None and s.event is not None
               for s in model.steps)  # the router's half; the model adds its feed
    assert model.keywords == 0
    # The same tokens as the model whose overridden method the router must call instead.
    if not sampled:
        other, same = _serve(_Overriding, sampled)
        assert not other.feed_info().step
        assert other.keywords == len(other.steps) > 0  # each through the override, then on
        assert same == tokens
