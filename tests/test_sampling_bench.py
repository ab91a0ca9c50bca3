"""The bench's sampling section (``metrale-feed bench``, ``--peaked``) on a small shape: every
figure is in the record with a sane value and the timed ids were checked against the portable
path. Timings are printed by the bench, never asserted."""

import math

import numpy as np
import pytest

from metrale_feed.tools import bench


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
        if record["torch"] is None:
            assert e["torch_ms"] is None and "torch is not importable" in out
        else:
            assert positive(e["torch_ms"]) and e["torch_ratio"] == pytest.approx(e["torch_ms"] / e["argmax_ms"])


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
