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


class _NoDataTensor:
    """An empty CPU tensor exported as torch exports one: its DLPack data pointer is null (numpy
    gives a real address, so its capsule is edited before it is handed over)."""

    def __init__(self, dtype=np.float32, shape=(0,)):
        self.array = np.zeros(shape, dtype)
        assert self.array.size == 0

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kw):
        import ctypes

        capsule = self.array.__dlpack__(**kw)
        api = ctypes.pythonapi
        api.PyCapsule_IsValid.restype = ctypes.c_int
        api.PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
        api.PyCapsule_GetPointer.restype = ctypes.c_void_p
        api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
        # DLManagedTensorVersioned: version (8 bytes), manager_ctx, deleter, flags, then the
        # DLTensor whose first field is data; the unversioned struct starts with the DLTensor.
        name, offset = ((b"dltensor_versioned", 32) if api.PyCapsule_IsValid(capsule, b"dltensor_versioned")
                        else (b"dltensor", 0))
        ctypes.c_void_p.from_address(api.PyCapsule_GetPointer(capsule, name) + offset).value = None
        return capsule


def test_zero_byte_copies_with_empty_tensors_that_have_no_data_pointer(host, no_leaks):
    with mf.DeviceBuffer(8) as dev, mf.Stream() as stream:
        empty = _NoDataTensor()
        mf.copy_h2d_async(empty, np.empty(0, np.uint8))
        mf.copy_h2d_async(empty, b"", stream)
        mf.copy_d2h_async(empty, bytearray())
        mf.copy_d2h_async(empty, np.empty(0, np.float32), stream)
        mf.copy_d2d_async(empty, dev, 0)
        mf.copy_d2d_async(dev, empty, 0, stream)
        mf.copy_d2d_async(empty, _NoDataTensor(np.uint8, (4, 0)), 0)
        stream.synchronize()
        mf.stream_synchronize()
        # Still a copy: everything else is checked as for an empty buffer.
        with pytest.raises(mf.FeedError, match="unknown or destroyed stream"):
            mf.copy_h2d_async(empty, b"", 0x3039)
        with pytest.raises(mf.FeedError, match="unknown or destroyed stream"):
            mf.copy_d2d_async(dev, empty, 0, 0x3039)
        with pytest.raises(ValueError, match="run past the end"):
            mf.copy_h2d_async(empty, b"\x00" * 4)
        with pytest.raises(ValueError, match="run past the end"):
            mf.copy_d2h_async(empty, bytearray(4))
        with pytest.raises(ValueError, match="run past the end"):
            mf.copy_d2d_async(dev, empty, 1)
        with pytest.raises(ValueError, match="read-only"):
            ro = _NoDataTensor()
            ro.array.flags.writeable = False
            mf.copy_h2d_async(ro, b"")
