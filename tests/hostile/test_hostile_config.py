"""Hostile matrix: Host-backend configuration: fault knobs, kernel threads, tracing. Bad input, one call per case, run in child interpreters by
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

def _knobs_unchanged(call, exc, match):
    mf.configure_host()
    before = mf.host_faults()
    raises(exc, match, call)
    assert mf.host_faults() == before, "a refused configure_host changed the knobs"


CONFIGURE_BAD = [
    ("lag_negative", dict(lag_us=-1), ValueError, "must not be negative"),
    ("query_negative", dict(fail_event_query_at=-1), ValueError, "must not be negative"),
    ("alloc_negative", dict(fail_alloc_at=-5), ValueError, "must not be negative"),
    ("copy_negative", dict(fail_copy_at=-1), ValueError, "must not be negative"),
    ("sync_negative", dict(fail_synchronize_at=-1), ValueError, "must not be negative"),
    ("lag_too_long", dict(lag_us=10_000_001), ValueError, "lag_us must be in"),
    ("lag_beyond_u32", dict(lag_us=2**32), ValueError, "lag_us must be in"),
    ("copy_beyond_u64", dict(fail_copy_at=2**64), ValueError, "fail_copy_at must be in"),
    ("query_str", dict(fail_event_query_at="1"), TypeError, "not supported|str"),
    ("unknown_knob", dict(fail_everything_at=1), TypeError, "unexpected keyword"),
]
for _label, _kw, _exc, _match in CONFIGURE_BAD:
    add("host_config", _label, lambda k=_kw, x=_exc, m=_match:
        _knobs_unchanged(lambda: mf.configure_host(**k), x, m))


@case("host_config")
def configure_positional():
    _knobs_unchanged(lambda: mf.configure_host(1), TypeError, "positional")


@case("host_config")
def configure_float_knob():
    _knobs_unchanged(lambda: mf.configure_host(fail_copy_at=1.5), TypeError, None)


@case("host_config")
def kernel_threads_bad():
    before = mf.host_kernel_threads()
    raises(ValueError, "threads must not be negative", mf.host_kernel_threads, -1)
    raises(ValueError, r"threads must be in \[0, 1024\]", mf.host_kernel_threads, 1025)
    raises(ValueError, r"threads must be in \[0, 1024\]", mf.host_kernel_threads, 2**64)
    raises(TypeError, "not supported|str", mf.host_kernel_threads, "2")
    assert mf.host_kernel_threads() == before


@case("host_config")
def trace_enable_bad():
    from metrale_feed import _core

    raises(ValueError, "must not be negative", _core.trace_enable, -1)
    raises(ValueError, "capacity must be in", _core.trace_enable, 2**64)
    raises(TypeError, "integer|str", _core.trace_enable, "8")
    _core.trace_enable(0)
    assert _core.trace_read() == ([], 0)


@case("host_config")
def trace_enable_huge():
    from metrale_feed import _core

    try:
        raises((ValueError, OverflowError, FeedError, MemoryError), None, _core.trace_enable, 2**34)
    finally:
        _core.trace_enable(0)


@case("host_config")
def trace_enable_float():
    from metrale_feed import _core

    try:
        raises(TypeError, None, _core.trace_enable, 1.5)
    finally:
        _core.trace_enable(0)


@case("host_config")
def kernel_threads_float():
    before = mf.host_kernel_threads()
    try:
        raises(TypeError, None, mf.host_kernel_threads, 1.5)
    finally:
        mf.host_kernel_threads(0)
    assert mf.host_kernel_threads() == before


# ---------------------------------------------------------------------------------------------


test_hostile = hostile_test(__name__)
