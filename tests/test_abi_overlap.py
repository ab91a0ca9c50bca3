"""Outputs of one call that overlap each other or an input the call reads are refused at the C
ABI before anything is queued (ValueError), on every path: argmax_to_feed, sample_to_feed, the
sharded combine, resolve_feed and device-to-device copies. Before, logprobs over the cells came
back as ids read as float bits."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

ROWS, VOCAB = 4, 16
SENTINEL = b"\xab" * 64


@pytest.fixture
def setup(host, no_leaks, dev):
    rng = np.random.default_rng(3)
    values = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
    bufs = dict(logits=dev.upload(values), cells=mf.DeviceBuffer(64), lp=mf.DeviceBuffer(64),
                dst=mf.PinnedBuffer(64), lp_dst=mf.PinnedBuffer(64))
    for name in ("cells", "lp"):
        mf.copy_h2d_async(bufs[name], SENTINEL)
    for name in ("dst", "lp_dst"):
        memoryview(bufs[name])[:] = SENTINEL
    mf.stream_synchronize(0)
    yield values, bufs
    mf.stream_synchronize(0)
    for buf in bufs.values():
        buf.close()


def untouched(bufs):
    """Nothing was queued: every destination still holds its sentinel once the stream drains."""
    mf.stream_synchronize(0)
    for name in ("cells", "lp"):
        out = bytearray(64)
        mf.copy_d2h_async(bufs[name], out)
        mf.stream_synchronize(0)
        assert bytes(out) == SENTINEL, f"a refused call wrote {name}"
    for name in ("dst", "lp_dst"):
        assert bytes(memoryview(bufs[name])) == SENTINEL, f"a refused call wrote {name}"


def argmax(bufs, **kw):
    args = dict(logits=bufs["logits"], cells=bufs["cells"], dst=bufs["dst"])
    args.update(kw)
    mf.argmax_to_feed(args.pop("logits"), None, args.pop("cells"), args.pop("dst"), None, 0,
                      rows=ROWS, vocab=VOCAB, dtype="float32", **args)


def sample(bufs, **kw):
    params = mf.sampling_params(ROWS, temperature=0.7, seed=5)
    args = dict(logits=bufs["logits"], cells=bufs["cells"], dst=bufs["dst"])
    args.update(kw)
    mf.sample_to_feed(args.pop("logits"), params, args.pop("cells"), args.pop("dst"), None, 0,
                      rows=ROWS, vocab=VOCAB, dtype="float32", **args)


@pytest.mark.parametrize("launch", [argmax, sample], ids=["argmax", "sample"])
@pytest.mark.parametrize("case", ["logprobs_over_cells", "logprobs_dst_over_dst", "cells_over_logits",
                                  "logprobs_over_logits", "logprobs_inside_cells"])
def test_overlapping_outputs_are_refused(setup, launch, case):
    values, b = setup
    kw = {
        "logprobs_over_cells": dict(logprobs=b["cells"], logprobs_dst=b["lp_dst"]),
        "logprobs_dst_over_dst": dict(logprobs=b["lp"], logprobs_dst=b["dst"]),
        "cells_over_logits": dict(cells=b["logits"]),
        "logprobs_over_logits": dict(logprobs=b["logits"]),
        "logprobs_inside_cells": dict(logprobs=b["cells"].ptr + 8),
    }[case]
    logits_before = values.tobytes()
    with pytest.raises(ValueError, match="overlap"):
        launch(b, **kw)
    untouched(b)
    out = bytearray(len(logits_before))
    mf.copy_d2h_async(b["logits"], out)
    mf.stream_synchronize(0)
    assert bytes(out) == logits_before, "a refused call wrote the logits"


@pytest.mark.parametrize("launch", [argmax, sample], ids=["argmax", "sample"])
def test_separate_outputs_still_work(setup, launch):
    values, b = setup
    launch(b, logprobs=b["lp"], logprobs_dst=b["lp_dst"])
    mf.stream_synchronize(0)
    ids = np.frombuffer(bytes(memoryview(b["dst"]))[: ROWS * 4], np.uint32)
    lp = np.frombuffer(bytes(memoryview(b["lp_dst"]))[: ROWS * 4], np.float32)
    if launch is argmax:
        assert list(ids) == list(values.argmax(axis=1))
    assert (ids < VOCAB).all()
    ref = values.astype(np.float64)
    ref = ref - ref.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(ROWS), ids], atol=2e-5)


def test_combine_refuses_overlapping_outputs(setup):
    values, b = setup
    parts = mf.DeviceBuffer(_core._partial_bytes(ROWS))
    try:
        _core._argmax_partial(b["logits"], None, parts, rows=ROWS, start=0, stop=VOCAB, vocab=VOCAB,
                              dtype="float32", call=1, logprobs=True)
        mf.stream_synchronize(0)
        fault = mf.PinnedBuffer(4)
        ids = np.zeros(ROWS, np.uint32)
        for kw in (dict(logprobs=b["cells"]), dict(logprobs=b["lp"], logprobs_dst=b["dst"]),
                   dict(logprobs=parts)):
            with pytest.raises(ValueError, match="overlap"):
                _core._combine_partials(parts, 1, b["cells"], b["dst"], None, rows=ROWS, vocab=VOCAB,
                                        call=1, fault_dst=fault, **kw)
            untouched(b)
        # Separate outputs: the unsharded call's ids.
        _core._combine_partials(parts, 1, b["cells"], ids, None, rows=ROWS, vocab=VOCAB, call=1,
                                fault_dst=fault, logprobs=b["lp"], logprobs_dst=b["lp_dst"])
        mf.stream_synchronize(0)
        assert list(ids) == list(values.argmax(axis=1))
        fault.close()
    finally:
        mf.stream_synchronize(0)
        parts.close()


def test_resolve_output_over_cells_is_refused(host, no_leaks):
    cells = mf.DeviceBuffer(64)
    try:
        with pytest.raises(ValueError, match="overlap"):
            mf.resolve_feed([0, 1], cells, cells.ptr + 4, 0, prev_rows=4)
    finally:
        mf.stream_synchronize(0)
        cells.close()


def test_overlapping_device_copy_is_refused(host, no_leaks):
    buf = mf.DeviceBuffer(64)
    try:
        with pytest.raises(ValueError, match="overlap"):
            mf.copy_d2d_async(buf.ptr + 8, buf, 16)
        mf.copy_d2d_async(buf.ptr + 32, buf, 32)  # adjacent ranges touch nothing twice
    finally:
        mf.stream_synchronize(0)
        buf.close()
