"""The reference forward's device position advance (``reference_forward(..., advance=,
advance_group=)``): row ``r`` writes and reads at ``meta[2r] + advance[r // group]``, the same
bits as the forward given those positions from the host, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

from helpers.backends import on


def _forward(meta, ids, tables, kv_words, vocab, advance=None, group=1, dtype="float32"):
    rows = len(ids)
    item = 4 if dtype == "float32" else 2
    with mf.DeviceBuffer(rows * 4) as d_ids, mf.DeviceBuffer(rows * 8) as d_meta, \
            mf.DeviceBuffer(len(tables) * 4) as d_tables, mf.DeviceBuffer(kv_words * 4) as kv, \
            mf.DeviceBuffer(rows * vocab * item) as logits, mf.DeviceBuffer(64 * 4) as d_adv:
        kv.memset_async(0, 0)
        mf.copy_h2d_async(d_ids, np.asarray(ids, np.uint32))
        mf.copy_h2d_async(d_meta, np.asarray(meta, np.uint32))
        mf.copy_h2d_async(d_tables, np.asarray(tables, np.uint32))
        if advance is not None:
            mf.copy_h2d_async(d_adv, np.asarray(advance, np.uint32))
        for out in (None, logits):  # the KV writes first, as a verify step does
            _core.reference_forward(d_ids, d_meta, d_tables, kv, kv_words, 4, rows, vocab, dtype,
                                    out, advance=None if advance is None else d_adv,
                                    advance_group=group)
        got_logits = np.zeros(rows * vocab * item, np.uint8)
        got_kv = np.zeros(kv_words, np.uint32)
        mf.copy_d2h_async(logits, got_logits)
        mf.copy_d2h_async(kv, got_kv)
        mf.stream_synchronize()
    return got_logits, got_kv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_advance_equals_host_positions(backend, no_leaks, dtype):
    rng = np.random.default_rng(1)
    k, seqs, vocab = 2, 3, 37
    group = k + 1
    base = [0, 5, 11]
    advance = [3, 1, 2]
    tables = list(range(12))  # each sequence owns 4 blocks of 4: offset 4 * s
    ids, meta, host_meta = [], [], []
    for s in range(seqs):
        for j in range(group):
            ids.append(int(rng.integers(vocab)))
            meta += [base[s] + j, 4 * s]
            host_meta += [base[s] + advance[s] + j, 4 * s]
    want = _forward(host_meta, ids, tables, 48, vocab, dtype=dtype)
    got = _forward(meta, ids, tables, 48, vocab, advance, group, dtype=dtype)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert np.count_nonzero(want[1]) > 0


def test_a_bad_advance_is_refused_before_anything_runs(host, no_leaks):
    with mf.DeviceBuffer(16) as d, mf.DeviceBuffer(4) as small, mf.DeviceBuffer(64) as kv:
        with pytest.raises(ValueError, match="advance_group"):
            _core.reference_forward(d, d, d, kv, 16, 4, 2, 8, "float32", None, advance=d,
                                    advance_group=0)
        with pytest.raises(ValueError, match="advance"):
            _core.reference_forward(d, d, d, kv, 16, 4, 4, 8, "float32", None, advance=small,
                                    advance_group=1)


@pytest.mark.parametrize("settings", [dict(), dict(sm_count=3, order="random", seed=7)])
def test_simt_gives_the_host_bits(host, no_leaks, settings):
    rng = np.random.default_rng(4)
    k, vocab = 3, 53
    base, advance = [2, 0, 9, 4], [4, 1, 2, 3]
    ids, meta = [], []
    for s in range(4):
        for j in range(k + 1):
            ids.append(int(rng.integers(vocab)))
            meta += [base[s] + j, 5 * s]

    def run():
        return _forward(meta, ids, list(range(20)), 80, vocab, advance, k + 1, dtype="float16")

    h = on("host", run)
    s = on("simt", run, **settings)
    assert h[0].tobytes() == s[0].tobytes() and h[1].tobytes() == s[1].tobytes()
