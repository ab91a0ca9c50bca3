"""Hostile matrix: PinnedBuffer and DeviceBuffer. Bad input, one call per case, run in child interpreters by
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
# PinnedBuffer
# ---------------------------------------------------------------------------------------------

@case("pinned")
def pinned_zero():
    raises(ValueError, "at least 1 byte", PinnedBuffer, 0)


@case("pinned")
def pinned_negative():
    raises(ValueError, "nbytes must not be negative, got -1", PinnedBuffer, -1)


@case("pinned")
def pinned_beyond_u64():
    raises(OverflowError, "does not fit in size_t", PinnedBuffer, 2**64)


@case("pinned")
def pinned_huge():
    raises(FeedError, "alloc_host_pinned of .* bytes failed", PinnedBuffer, 1 << 62)


@case("pinned")
def pinned_near_2_64():
    # The allocator's rounding to its alignment must not wrap to a tiny block.
    raises(FeedError, "alloc_host_pinned of 18446744073709551615 bytes is too large", PinnedBuffer, 2**64 - 1)
    raises(FeedError, "too large", PinnedBuffer, 2**64 - 4096)


@case("pinned")
def pinned_wrong_types():
    for bad in ("10", None, [4], b"4", 8.5, 8.0, True):
        raises(TypeError, "nbytes must be an int", PinnedBuffer, bad)
    raises(TypeError, "keyword", PinnedBuffer, 4, pageable=True)


for _label, _call in [("ptr", lambda b: b.ptr), ("memoryview", lambda b: memoryview(b)),
                      ("numpy", lambda b: np.frombuffer(b, np.uint8)),
                      ("enter", lambda b: b.__enter__()),
                      ("copy_into", lambda b: mf.copy_d2h_async(DeviceBuffer(4), b)),
                      ("copy_from", lambda b: mf.copy_h2d_async(DeviceBuffer(4), b))]:
    def _closed_pinned_case(c=_call):
        b = PinnedBuffer(4)
        b.close()
        raises(FeedError, "the pinned buffer is closed", c, b)
        drained()
    add("pinned", f"closed_{_label}", _closed_pinned_case)


@case("pinned")
def pinned_close_while_exported():
    b = pinned_with(b"\x11" * 8)
    view = memoryview(b)
    raises(BufferError, "exported view", b.close)
    assert not b.closed and view[0] == 0x11  # still usable
    view[1] = 0x22
    view.release()
    b.close()
    assert b.closed


@case("pinned")
def pinned_close_while_numpy_view():
    b = pinned_with(b"\x33" * 8)
    arr = np.frombuffer(b, np.uint8)
    raises(BufferError, "exported view", b.close)
    assert arr[0] == 0x33
    del arr
    b.close()


@case("pinned")
def free_host_pinned_under_a_buffer():
    # Either the free is refused, or the buffer learns it is closed; anything else leaves the
    # PinnedBuffer pointing at freed memory.
    b = PinnedBuffer(4096)
    try:
        mf.free_host_pinned(b.ptr, 4096)
    except FeedError:
        b.close()
        return
    if not b.closed:
        raise AssertionError("free_host_pinned freed a live PinnedBuffer's memory; the buffer "
                             "still hands out views of it")


# ---------------------------------------------------------------------------------------------
# DeviceBuffer
# ---------------------------------------------------------------------------------------------

@case("device")
def device_sizes():
    raises(ValueError, "at least 1 byte", DeviceBuffer, 0)
    raises(ValueError, "nbytes must not be negative", DeviceBuffer, -1)
    raises(OverflowError, "does not fit in size_t", DeviceBuffer, 2**64)
    raises(FeedError, "device_alloc of .* bytes failed", DeviceBuffer, 1 << 62)
    raises(FeedError, "device_alloc of .* bytes is too large", DeviceBuffer, 2**64 - 1)
    for bad in ("x", None, [1], 8.5, False):
        raises(TypeError, "nbytes must be an int", DeviceBuffer, bad)


@case("device")
def device_closed():
    d = DeviceBuffer(8)
    d.close()
    for call in (lambda: d.ptr, lambda: d.memset_async(0), d.__enter__,
                 lambda: mf.copy_h2d_async(d, bytes(8)), lambda: mf.copy_d2h_async(d, bytearray(8)),
                 lambda: mf.copy_d2d_async(d, DeviceBuffer(8), 8)):
        raises(FeedError, "the device buffer is closed", call)
    d.close()  # a second close is a no-op


@case("device")
def device_memset_bad():
    d = dev_with(b"\x5a" * 16)
    raises(TypeError, "integer", d.memset_async, "x")
    raises(OverflowError, "too large", d.memset_async, 2**40)
    raises(FeedError, "unknown or destroyed stream", d.memset_async, 1, 0xABC)
    raises(TypeError, "expected a Stream", d.memset_async, 1, "s")
    assert dev_bytes(d) == b"\x5a" * 16


@case("device")
def device_no_cuda_array_interface_on_host():
    d = DeviceBuffer(8)
    assert not hasattr(d, "__cuda_array_interface__")
    raises(AttributeError, "only on the cuda backend", lambda: d.__cuda_array_interface__)


@case("device")
def control_memset_changes_contents():
    # The sentinel check of this file can see a launch.
    d = dev_with(b"\x5a" * 16)
    d.memset_async(7)
    assert dev_bytes(d) == b"\x07" * 16


# ---------------------------------------------------------------------------------------------


test_hostile = hostile_test(__name__)
