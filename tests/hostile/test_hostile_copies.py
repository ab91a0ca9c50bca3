"""Hostile matrix: Copies, and the pinned-memory free functions. Bad input, one call per case, run in child interpreters by
_matrix.py (see its docstring)."""

from __future__ import annotations

import ctypes
import gc
import time

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DeviceBuffer, Event, FeedError, PinnedBuffer, Stream
from metrale_feed._core import reference_forward

from _matrix import (FOREIGN, NT, add, case, closed_event, closed_stream, dev_bytes, dev_with,
                     drained, hostile_test, pinned_with, raises, _destroyed_handle, _model)

# ---------------------------------------------------------------------------------------------
# Copies
# ---------------------------------------------------------------------------------------------

def _d2h_refused(exc, match, src_of, dst=None, stream=0):
    src = dev_with(bytes(range(16)))
    dst = bytearray(b"\xee" * 16) if dst is None else dst
    before = bytes(dst) if isinstance(dst, (bytes, bytearray)) else None
    raises(exc, match, mf.copy_d2h_async, src_of(src), dst, stream)
    drained()
    if isinstance(dst, bytearray):
        assert bytes(dst) == before, "a refused D2H copy wrote its destination"
        dst.append(0)  # not left exported by the refused call
    return src


D2H_SOURCES = [
    ("freed_ptr", lambda s: (lambda p: (s.close(), p)[1])(s.ptr), FeedError, "not a live device allocation"),
    ("foreign_ptr", lambda s: FOREIGN.ctypes.data, FeedError, "not a live device allocation"),
    ("null", lambda s: 0, ValueError, "null pointer"),
    ("past_end", lambda s: s.ptr + 16, FeedError, "not a live device allocation"),
    ("interior_too_long", lambda s: s.ptr + 8, ValueError, "run past the end of its device allocation"),
    ("pinned_as_device", lambda s: PinnedBuffer(64), ValueError, "page-locked host memory"),
    ("negative", lambda s: -8, ValueError, "64-bit handle"),
    ("str", lambda s: "x", TypeError, "expected a DeviceBuffer"),
    ("float", lambda s: 1.0, TypeError, "expected a DeviceBuffer"),
    ("none", lambda s: None, TypeError, "expected a DeviceBuffer"),
    ("bool", lambda s: True, TypeError, "expected a DeviceBuffer"),
    # A CPU array stands for device memory on the host backend (test_interop); one DLPack cannot
    # carry is refused.
    ("numpy_object_array", lambda s: np.array([None] * 16, dtype=object), TypeError, "DLPack"),
]
for _label, _src, _exc, _match in D2H_SOURCES:
    add("copies", f"d2h_src_{_label}", lambda s=_src, x=_exc, m=_match: _d2h_refused(x, m, s))


@case("copies")
def d2h_dst_too_long():
    src = dev_with(bytes(16))
    dst = bytearray(b"\xee" * 17)
    raises(ValueError, "run past the end", mf.copy_d2h_async, src, dst)
    drained()
    assert dst == bytearray(b"\xee" * 17)


@case("copies")
def d2h_dst_read_only():
    src = dev_with(bytes(range(16)))
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    for dst, exc, match in [(b"\x00" * 16, BufferError, "not writable"),
                            (memoryview(b"\x00" * 16), BufferError, "not writable"),
                            (ro, (ValueError, BufferError), "read-only")]:
        raises(exc, match, mf.copy_d2h_async, src, dst)
    drained()
    assert not ro.any()


@case("copies")
def d2h_dst_not_contiguous():
    src = dev_with(bytes(range(16)))
    strided = np.zeros(32, np.uint8)
    raises((ValueError, BufferError), "contiguous", mf.copy_d2h_async, src, strided[::2])
    raises(BufferError, "contiguous", mf.copy_d2h_async, src, memoryview(bytearray(32))[::2])
    drained()
    assert not strided.any()


@case("copies")
def d2h_dst_wrong_types():
    src = dev_with(bytes(16))
    raises(TypeError, "not an int", mf.copy_d2h_async, src, PinnedBuffer(16).ptr)
    for bad in ("abcdefghabcdefgh", None, 1.5, [0] * 16, DeviceBuffer(16)):
        raises(TypeError, "must be a buffer", mf.copy_d2h_async, src, bad)


@case("copies")
def d2h_bad_stream_launches_nothing():
    _d2h_refused(FeedError, "unknown or destroyed stream", lambda s: s, stream=0xF00D)
    _d2h_refused(FeedError, "the stream is closed", lambda s: s, stream=closed_stream())
    _d2h_refused(TypeError, "expected a Stream", lambda s: s, stream="s")


@case("copies")
def h2d_refused():
    d = dev_with(b"\x77" * 16)
    raises(ValueError, "run past the end", mf.copy_h2d_async, d, bytes(17))
    raises(ValueError, "run past the end", mf.copy_h2d_async, d.ptr + 12, bytes(8))
    raises(ValueError, "page-locked host memory", mf.copy_h2d_async, PinnedBuffer(16), bytes(4))
    raises(FeedError, "not a live device allocation", mf.copy_h2d_async, FOREIGN.ctypes.data, bytes(4))
    raises(TypeError, "not an int", mf.copy_h2d_async, d, 16)
    raises(TypeError, "must be a buffer", mf.copy_h2d_async, d, "text")
    raises(TypeError, "must be a buffer", mf.copy_h2d_async, d, d)
    raises(BufferError, "contiguous", mf.copy_h2d_async, d, memoryview(bytearray(32))[::2])
    other = DeviceBuffer(4)
    raises(ValueError, "device memory, not host memory", mf.copy_h2d_async, d,
           (ctypes.c_uint8 * 4).from_address(other.ptr))  # a host buffer over device memory
    raises(FeedError, "unknown or destroyed stream", mf.copy_h2d_async, d, bytes(4), 0xF00D)
    drained()
    assert dev_bytes(d) == b"\x77" * 16, "a refused H2D copy wrote the device buffer"


@case("copies")
def d2d_refused():
    a, b = dev_with(b"\x01" * 16), dev_with(b"\x02" * 8)
    raises(ValueError, "run past the end", mf.copy_d2d_async, b, a, 9)
    raises(ValueError, "run past the end", mf.copy_d2d_async, a, b, 9)
    raises(ValueError, "run past the end", mf.copy_d2d_async, a, b, 2**64 - 1)
    raises(ValueError, "nbytes must not be negative", mf.copy_d2d_async, a, b, -1)
    raises(OverflowError, "does not fit in size_t", mf.copy_d2d_async, a, b, 2**64)
    raises(TypeError, "nbytes must be an int", mf.copy_d2d_async, a, b, 1.5)
    raises(ValueError, "page-locked", mf.copy_d2d_async, a, PinnedBuffer(16), 4)
    raises(FeedError, "not a live device allocation", mf.copy_d2d_async, FOREIGN.ctypes.data, b, 4)
    raises(TypeError, "expected a DeviceBuffer", mf.copy_d2d_async, a, bytearray(8), 4)
    raises(TypeError, "nbytes must be an int", mf.copy_d2d_async, a, b, "4")
    raises(FeedError, "unknown or destroyed stream", mf.copy_d2d_async, a, b, 4, 0xF00D)
    drained()
    assert dev_bytes(a) == b"\x01" * 16 and dev_bytes(b) == b"\x02" * 8


@case("copies")
def control_copies_run():
    d = dev_with(b"\x77" * 16)
    mf.copy_h2d_async(d.ptr + 4, b"\x01\x02")
    out = bytearray(4)
    mf.copy_d2h_async(d.ptr + 4, out)
    drained()
    assert out == b"\x01\x02\x77\x77"


# ---------------------------------------------------------------------------------------------
# alloc_host_pinned / free_host_pinned / read_pinned_u32 / write_pinned_u32
# ---------------------------------------------------------------------------------------------

@case("pinned_funcs")
def alloc_sizes():
    raises(ValueError, "at least 1 byte", mf.alloc_host_pinned, 0)
    raises(ValueError, "nbytes must not be negative", mf.alloc_host_pinned, -1)
    raises(OverflowError, "does not fit in size_t", mf.alloc_host_pinned, 2**64)
    raises(FeedError, "alloc_host_pinned of .* bytes failed", mf.alloc_host_pinned, 1 << 62)
    raises(FeedError, "too large", mf.alloc_host_pinned, 2**64 - 1)
    for bad in ("8", 8.5, None, True):
        raises(TypeError, "nbytes must be an int", mf.alloc_host_pinned, bad)


@case("pinned_funcs")
def free_bad():
    p = mf.alloc_host_pinned(64)
    mf.write_pinned_u32(p, [0xC0FFEE])
    raises(ValueError, "has 64 bytes, not 63", mf.free_host_pinned, p, 63)
    raises(ValueError, "has 64 bytes, not 65", mf.free_host_pinned, p, 65)
    raises(FeedError, "not a live pinned allocation", mf.free_host_pinned, p + 4, 60)
    raises(ValueError, "nbytes must not be negative", mf.free_host_pinned, p, -64)
    raises(ValueError, "64-bit handle", mf.free_host_pinned, -p, 64)
    raises(TypeError, "str|int", mf.free_host_pinned, "p", 64)
    raises(TypeError, "nbytes must be an int", mf.free_host_pinned, p, "64")
    raises(TypeError, "nbytes must be an int", mf.free_host_pinned, p, 64.0)
    assert mf.read_pinned_u32(p, 1) == [0xC0FFEE]  # intact after the refusals
    mf.free_host_pinned(p, 64)
    raises(FeedError, "not a live pinned allocation", mf.free_host_pinned, p, 64)  # double free
    raises(FeedError, "not a live pinned allocation", mf.free_host_pinned, FOREIGN.ctypes.data, 64)
    raises(FeedError, "not a live pinned allocation", mf.free_host_pinned, 0, 64)
    d = DeviceBuffer(64)
    raises(FeedError, "not a live pinned allocation", mf.free_host_pinned, d.ptr, 64)
    raises(FeedError, "not a live pinned allocation", mf.free_host_pinned, 2**64 - 4096, 4096)


@case("pinned_funcs")
def read_bad():
    p = mf.alloc_host_pinned(16)
    raises(ValueError, "20 bytes run past the end of the pinned allocation .*16 left", mf.read_pinned_u32, p, 5)
    raises(ValueError, "run past the end of the pinned allocation", mf.read_pinned_u32, p + 8, 3)
    raises(ValueError, "must not be negative", mf.read_pinned_u32, p, -1)
    raises(TypeError, "integer|float", mf.read_pinned_u32, p, 1.5)
    raises(TypeError, "integer|str", mf.read_pinned_u32, p, "1")
    raises(FeedError, "is not live pinned memory", mf.read_pinned_u32, FOREIGN.ctypes.data, 1)
    raises(FeedError, "is not live pinned memory", mf.read_pinned_u32, DeviceBuffer(16).ptr, 1)
    raises(FeedError, "is not live pinned memory", mf.read_pinned_u32, 0, 1)
    raises(ValueError, "64-bit handle", mf.read_pinned_u32, -p, 1)
    assert mf.read_pinned_u32(p, 4) == [0, 0, 0, 0] and mf.read_pinned_u32(p, 0) == []
    mf.free_host_pinned(p, 16)
    raises(FeedError, "is not live pinned memory", mf.read_pinned_u32, p, 1)  # freed


@case("pinned_funcs")
def read_count_wraps():
    p = mf.alloc_host_pinned(64)
    try:
        raises((FeedError, ValueError, OverflowError), None, mf.read_pinned_u32, p, 2**62 + 1)
    finally:
        mf.free_host_pinned(p, 64)


@case("pinned_funcs")
def write_bad():
    p = mf.alloc_host_pinned(16)
    raises(ValueError, "20 bytes run past the end of the pinned allocation", mf.write_pinned_u32, p, [1] * 5)
    raises(TypeError, "not iterable", mf.write_pinned_u32, p, 5)
    raises(TypeError, "integer|str", mf.write_pinned_u32, p, ["x"])
    raises(ValueError, "outside uint32", mf.write_pinned_u32, p, [-1])
    raises(ValueError, "outside uint32", mf.write_pinned_u32, p, [2**32])
    raises(FeedError, "is not live pinned memory", mf.write_pinned_u32, FOREIGN.ctypes.data, [1])
    raises(FeedError, "is not live pinned memory", mf.write_pinned_u32, DeviceBuffer(16).ptr, [1])
    assert mf.read_pinned_u32(p, 4) == [0, 0, 0, 0]
    mf.free_host_pinned(p, 16)
    raises(FeedError, "is not live pinned memory", mf.write_pinned_u32, p, [1])  # freed


@case("pinned_funcs")
def write_refused_writes_nothing():
    p = mf.alloc_host_pinned(16)
    try:
        raises(ValueError, None, mf.write_pinned_u32, p, [7, 8, -1])
        assert mf.read_pinned_u32(p, 3) == [0, 0, 0], "a refused write stored part of its values"
    finally:
        mf.free_host_pinned(p, 16)


@case("pinned_funcs")
def misaligned_word_access():
    p = mf.alloc_host_pinned(64)
    try:
        raises((ValueError, FeedError), "align", mf.read_pinned_u32, p + 2, 1)
        raises((ValueError, FeedError), "align", mf.write_pinned_u32, p + 1, [1])
    finally:
        mf.free_host_pinned(p, 64)


test_hostile = hostile_test(__name__)
