"""Interop gaps: the package's own BufferView of a DeviceBuffer is device memory wherever a
DeviceBuffer is; copies take numpy arrays of any dtype (ml_dtypes' bfloat16 too: a copy is
bytes); a view whose DLPack sizes cannot fit int64 is refused at view(), not at export."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf


def log_softmax_at_argmax(logits):
    """The independent reference: float64 log-softmax of each row at its argmax."""
    x = logits.astype(np.float64)
    m = x.max(axis=1)
    return (m - m - np.log(np.exp(x - m[:, None]).sum(axis=1))).astype(np.float32)


def test_a_view_of_a_device_buffer_is_taken_as_device_logprobs(host, no_leaks):
    rows, vocab = 3, 50
    logits = np.random.default_rng(1).standard_normal((rows, vocab)).astype(np.float32)
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(16 + rows * 4) as lp, \
            mf.DeviceBuffer(rows * 4) as cells, mf.Event() as done:
        mf.copy_h2d_async(dev, logits.view(np.uint8))
        dst = np.zeros(rows, np.uint32)
        out = np.zeros(rows, np.float32)
        mf.argmax_to_feed(dev, None, cells, dst, done, 0, rows=rows, vocab=vocab, dtype="float32",
                          logprobs=lp.view("float32", (rows,), offset=16), logprobs_dst=out)
        done.synchronize()
        assert dst.tolist() == logits.argmax(axis=1).tolist()
        np.testing.assert_allclose(out, log_softmax_at_argmax(logits), rtol=1e-5, atol=1e-6)
        with mf.PinnedBuffer(rows * 4) as pinned:
            with pytest.raises(ValueError, match="page-locked"):
                mf.argmax_to_feed(dev, None, cells, dst, done, 0, rows=rows, vocab=vocab,
                                  dtype="float32", logprobs=pinned.view("float32", (rows,)))


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "int4"])
def test_copies_take_numpy_arrays_of_ml_dtypes(host, no_leaks, name):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    kind = getattr(ml_dtypes, name)
    src = np.resize(np.arange(-4, 4, dtype=np.float32), 16).astype(kind)
    with mf.DeviceBuffer(src.nbytes) as dev:
        mf.copy_h2d_async(dev, src)
        back = np.zeros_like(src)
        mf.copy_d2h_async(dev, back)
        mf.stream_synchronize(0)
    assert back.tobytes() == src.tobytes()  # bytes in, the same bytes out
    with pytest.raises(TypeError, match="Python objects"):  # an object array still has a format
        with mf.DeviceBuffer(16) as dev:
            mf.copy_d2h_async(dev, np.empty(2, dtype=object))


def test_a_view_too_large_for_dlpack_is_refused_at_view(host, no_leaks):
    with mf.DeviceBuffer(16) as buf:
        for shape in [(0, 2**62, 2**62), (2**62, 0, 8), (0, 2**63 - 1, 2)]:
            with pytest.raises(ValueError, match="too large"):
                buf.view("uint8", shape)
        with pytest.raises(ValueError, match="too large"):
            buf.view("uint32", (0, 2**62))  # 2**64 bytes of strides
        empty = buf.view("uint8", (0, 2**40))  # fits: exported, and empty
        assert np.from_dlpack(empty).shape == (0, 2**40)
