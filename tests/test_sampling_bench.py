"""The bench's sampling section (``metrale-feed bench``, ``--peaked``) on a small shape: every
figure is in the record with a sane value and the timed ids were checked against the portable
path. Timings are printed by the bench, never asserted."""

import math

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core
from metrale_feed.tools import bench
from metrale_feed.tools.bench import kernels

HAVE_FLOORS = _core._host_floor("hash", np.zeros((1, 16), np.float32)) is not None


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_sampling_section_record(host, capsys):
    record = bench.bench_sampling(False, True, rows_list=(4,), vocab=3000, repeats=1)
    out = capsys.readouterr().out
    assert "sample_to_feed against the masked argmax" in out
    assert record["checked"] is True
    entries = record["entries"]
    assert [(e["logits"], e["case"]) for e in entries] == [
        (kind, case[0]) for kind in ("flat", "peaked") for case in bench.SAMPLE_CASES]
    for e in entries:
        assert (e["rows"], e["vocab"]) == (4, 3000) and e["checked"] is True
        assert positive(e["ms"]) and positive(e["argmax_ms"])
        assert positive(e["ratio"]) and e["ratio_of_minima"] == pytest.approx(e["ms"] / e["argmax_ms"])
        floors = kernels.FLOORS.get({"temperature 1": "temperature", "top_p 0.9": "top_p"}.get(e["case"]), ())
        assert set(e["floor_ratio"]) == (set(floors) if HAVE_FLOORS else set())
        assert all(positive(v) for v in e["floor_ratio"].values())
        assert all(f"floor {n} " in e["floor_note"] for n in e["floor_ratio"])
        if record["torch"] is None:
            assert e["torch_ms"] is None and "torch is not importable" in out
        else:
            assert positive(e["torch_ms"]) and e["torch_ratio"] == pytest.approx(e["torch_ms"] / e["argmax_ms"])


def test_floor_loops(host):
    """The bench's floors (feed.h's mf_host_floor) run over any row length, tails included, and give
    a finite checksum; the stats floor's is the rows' sums of exponentials, which the logprobs of the
    argmax give back; a name or shape it does not take is a ValueError."""
    if not HAVE_FLOORS:
        pytest.skip("no vector floor loops on this CPU")
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 1000 + 7), dtype=np.float32)
    for name in ("hash", "race", "stats", "top_p", "top_p_log"):
        assert math.isfinite(_core._host_floor(name, logits))
    # logprob of the argmax = x - (m + log s), with x = m for it: the sum is exp(-logprob).
    lp = np.zeros(3, np.float32)
    with mf.Event() as ev, mf.DeviceBuffer(12) as lp_dev, mf.DeviceBuffer(12) as cells:
        mf.argmax_to_feed(logits, None, cells, np.zeros(3, np.uint32), ev, 0, logprobs=lp_dev, logprobs_dst=lp)
        ev.synchronize()
    assert _core._host_floor("stats", logits) == pytest.approx(float(np.exp(-lp.astype(np.float64)).sum()), rel=1e-6)
    with pytest.raises(ValueError):
        _core._host_floor("nope", logits)
    with pytest.raises(ValueError):
        _core._host_floor("hash", logits[0])


def test_peaked_logits_are_peaked():
    """The bench's peaked rows: the top holds a large share of softmax, and all but a few ids past
    the head of 16 trail it by more than the race's reach (18 + 2.86)."""
    logits = bench.peaked_logits(8, 152064, np, 1).astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - top)
    p /= p.sum(axis=1, keepdims=True)
    assert (p.max(axis=1) > 0.3).all()
    assert ((logits > top - 21).sum(axis=1) <= 20).all()


def test_torch_recipe_keeps_to_the_filters():
    """The peer row samples what it says: top_k and top_p survivors only (float64 oracle)."""
    torch = pytest.importorskip("torch")
    from metrale_feed.testing.oracle import reference_survivors

    rng = np.random.default_rng(2)
    rows, vocab = 64, 500
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    for kw in (dict(top_k=5), dict(top_p=0.5), dict(top_k=20, top_p=0.7)):
        ids = bench.torch_sampler(torch, torch.from_numpy(logits), 1.0, **kw).numpy()
        for r in range(rows):
            keep, _ = reference_survivors(logits[r], np.ones(vocab, bool), 1.0, kw.get("top_k", 0),
                                          kw.get("top_p", 1.0))
            assert ids[r] in keep, (kw, r)
