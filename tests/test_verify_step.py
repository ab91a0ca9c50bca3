"""``pick_to_feed`` given a verify ``PickStep``: the keyword call ``verify_to_feed`` described once.

Checked bit for bit against ``verify_to_feed`` and the exact numpy oracle (helpers/spec_oracle.py,
which tests/test_verify.py checks against ``sample_to_feed``): greedy and sampled rows, masks,
k of 1 and 3, logprobs, host and device drafts. A bad step raises what the keyword call raises,
before anything is queued; a step with a shard is the shard's (``run_step``).
"""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from helpers import spec_oracle as so
from metrale_feed import NO_TOKEN, DeviceBuffer, Event, PickStep
from metrale_feed.testing.oracle import reference_allowed, reference_logprobs


def _case(k, rows, vocab, seed, sampled):
    rng = np.random.default_rng(seed)
    lrows = rows * (k + 1)
    logits = (rng.standard_normal((lrows, vocab)) * 2).astype(np.float32)
    masks = rng.integers(0, vocab, (lrows, 2)).astype(np.uint32)
    masks[rng.random((lrows, 2)) < 0.5] = NO_TOKEN
    allowed = reference_allowed(masks, None, lrows, vocab)
    best = np.array([so.masked_argmax(logits[i], allowed[i]) for i in range(lrows)])
    best = best.reshape(rows, k + 1)
    drafts = np.where(rng.random((rows, k)) < 0.7, best[:, :k], rng.integers(0, vocab, (rows, k)))
    drafts = drafts.astype(np.uint32)
    drafts[0, k - 1:] = NO_TOKEN  # a row whose drafts end early
    params = None
    if sampled:  # sampled rows with filters beside greedy ones (temperature 0)
        params = mf.sampling_params(
            rows, temperature=np.where(np.arange(rows) % 3, 0.8, 0.0), top_k=[0, 5] * (rows // 2),
            top_p=0.9, seed=rng.integers(0, 2**63, rows), position=rng.integers(0, 2**20, rows))
    return logits, masks, allowed, drafts, params


def _run(dev, launch, logits, drafts, k, masks, params, device_drafts):
    """``launch(kw)`` with ``kw`` the call's arguments on fresh buffers; returns (cells read
    back through dst, cells read from the device, logprobs read back)."""
    rows = drafts.shape[0]
    lrows = rows * (k + 1)
    buf = dev.upload(logits)
    drafts_in = dev.upload(drafts) if device_drafts else drafts.reshape(-1)
    with DeviceBuffer(rows * (k + 2) * 4) as cells, DeviceBuffer(lrows * 4) as lp, Event() as done:
        dst = np.zeros((rows, k + 2), np.uint32)
        lp_dst = np.full(lrows, 7.0, np.float32)
        kw = dict(logits=buf, drafts=drafts_in, cells=cells, dst=dst, event=done, k=k,
                  masks=masks, params=params, logprobs=lp, logprobs_dst=lp_dst, rows=rows,
                  vocab=logits.shape[1], dtype="float32")
        assert launch(kw) == rows
        done.synchronize()
        on_device = dev.download(cells, np.uint32).reshape(rows, k + 2)
    buf.close()
    if device_drafts:
        drafts_in.close()
    return dst, on_device, lp_dst


def _by_keywords(kw):
    kw = dict(kw)
    return mf.verify_to_feed(kw.pop("logits"), kw.pop("drafts"), kw.pop("cells"), kw.pop("dst"),
                             kw.pop("event"), **kw)


def _by_step(kw):
    return mf.pick_to_feed(PickStep("verify", **kw))


@pytest.mark.parametrize("device_drafts", [False, True], ids=["host-drafts", "device-drafts"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_verify_step_is_the_keyword_call_and_the_oracle(backend, dev, no_leaks, k, sampled,
                                                          device_drafts):
    rows = 6
    logits, masks, allowed, drafts, params = _case(k, rows, 90, seed=10 * k + sampled, sampled=sampled)
    by_step = _run(dev, _by_step, logits, drafts, k, masks, params, device_drafts)
    by_keywords = _run(dev, _by_keywords, logits, drafts, k, masks, params, device_drafts)
    for a, b in zip(by_step, by_keywords):
        assert a.tobytes() == b.tobytes()  # bit for bit, NaN logprobs included
    want = so.verify_rows(logits, allowed, drafts, k, params)
    assert np.array_equal(by_step[0], want) and np.array_equal(by_step[1], want)
    lp = by_step[2].reshape(rows, k + 1)
    for r in range(rows):
        n = int(want[r, 0])
        assert 1 <= n <= k + 1
        expected = reference_logprobs(logits[r * (k + 1): r * (k + 1) + n], want[r, 1: 1 + n])
        assert np.allclose(lp[r, :n], expected, atol=2e-5, rtol=0), f"row {r}"
        assert np.isnan(lp[r, n:]).all()


BAD = {  # (the step's changes, the error, its message): as tests/test_verify.py's keyword calls
    "no k": (dict(k=None), TypeError, None),
    "k zero": (dict(k=0), ValueError, "k"),
    "drafts too short": (dict(drafts=[1, 2, 3]), ValueError, "drafts hold 3 ids"),
    "draft id past vocab": (dict(drafts=[1, 40, 2, 3, 4, 5]), ValueError, "not below vocab"),
    "masks too few": (dict(masks=[(1, 2)] * 3), ValueError, "logit rows"),
    "too many logit rows": (dict(k=64, rows=64), ValueError, "logit rows"),
    "advance without params": (dict(advance="buf"), ValueError, "advance needs params"),
    "draft_probs on the host": (dict(draft_probs=np.zeros(120, np.float32)), TypeError, "device memory"),
    "bad temperature": (dict(params="nan"), ValueError, "temperature"),
    "shard not a VocabShard": (dict(shard=object()), TypeError, "VocabShard"),
    "penalties with a shard": (dict(shard=object(), penalties=object()), ValueError, "penalties="),
    "top logprobs": (dict(top_logprobs="buf"), ValueError, "top_logprobs"),
    "raw logits": (dict(raw_logits="buf"), ValueError, "raw_logits"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_verify_step_raises_the_keyword_calls_error_before_anything_is_queued(
        host, dev, no_leaks, case):
    change, error, match = BAD[case]
    k, rows, vocab = 2, 3, 20
    buf = dev.upload(np.zeros((rows * (k + 1), vocab), np.float32))
    cells = DeviceBuffer(rows * (k + 2) * 4)
    adv = DeviceBuffer(rows * 4)
    sentinel = np.full(rows * (k + 2), 0xABCD, np.uint32)
    dev.write(cells, sentinel)
    dst = np.full(rows * (k + 2), 0xABCD, np.uint32)
    kw = dict(logits=buf, drafts=np.arange(rows * k, dtype=np.uint32) % vocab, cells=cells,
              dst=dst, k=k, vocab=vocab, dtype="float32", rows=rows)
    kw.update(change)
    if change.get("advance") == "buf":
        kw["advance"] = adv
    if change.get("params") == "nan":
        kw["params"] = mf.sampling_params(rows, temperature=1.0)
        kw["params"]["temperature"][1] = np.nan
    for name in ("top_logprobs", "raw_logits"):
        if name in change:
            kw[name] = adv
    host.configure_host(lag_us=50_000)  # anything queued would still be pending at the check
    errors = []
    with Event() as done:
        for call in ("step", "keywords"):
            if call == "keywords" and ("top_logprobs" in kw or "raw_logits" in kw):
                continue  # the model's fields: verify_to_feed has no such keyword
            with pytest.raises(error, match=match) as raised:
                if call == "step":
                    _by_step(dict(kw, event=done))
                else:
                    _by_keywords(dict(kw, event=done))
            errors.append(str(raised.value))
        host.configure_host()
        mf.stream_synchronize(0)
        assert done.query()  # never recorded: a recorded event still pending would say False
    assert len(set(errors)) == 1, errors  # the same message by either path
    assert np.array_equal(dev.download(cells, np.uint32), sentinel), "the kernel ran"
    assert (dst == 0xABCD).all(), "a copy ran"
    for b in (buf, cells, adv):
        b.close()


class _Shard:
    """Stands in for a VocabShard: records the steps it is handed."""

    def __init__(self):
        self.steps = []

    def run_step(self, step):
        self.steps.append(step)
        return 17


def test_a_verify_step_with_a_shard_is_the_shards(host):
    shard = _Shard()
    step = PickStep("verify", logits="x", drafts="d", cells="c", dst="o", event=None, k=3,
                    rows=2, shard=shard, advance="a", draft_probs="q")
    assert mf.pick_to_feed(step) == 17
    assert shard.steps == [step]  # the step itself, unchanged: nothing was checked or queued here
    # The keyword call hands its shard the same step, field for field.
    assert mf.verify_to_feed("x", "d", "c", "o", None, k=3, rows=2, shard=shard, advance="a",
                             draft_probs="q") == 17
    assert shard.steps[1].op == "verify"
    assert shard.steps[1].asdict() == step.asdict()
