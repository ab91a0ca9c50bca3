"""Hostile matrix: Streams. Bad input, one call per case, run in child interpreters by
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
# Streams
# ---------------------------------------------------------------------------------------------


@case("stream")
def stream_init_twice():
    s = Stream()
    raises(FeedError, "already initialised", s.__init__)
    s.synchronize()
    s.close()


for _label, _call in [("query", lambda s: s.query()), ("synchronize", lambda s: s.synchronize()),
                      ("handle", lambda s: s.handle), ("cuda_stream", lambda s: s.__cuda_stream__()),
                      ("wait_event", lambda s: s.wait_event(Event())),
                      ("enter", lambda s: s.__enter__())]:
    add("stream", f"closed_{_label}",
        lambda c=_call: raises(FeedError, "the stream is closed", c, closed_stream()))


class _CudaStreamProto:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        return self.value


class _TorchLike:
    def __init__(self, value):
        self.cuda_stream = value


@case("stream")
def wrap_bad_handles():
    raises(FeedError, "unknown or destroyed stream", Stream.wrap, 12345)
    raises(FeedError, "unknown or destroyed stream", Stream.wrap, _CudaStreamProto((0, 777)))
    raises(FeedError, "unknown or destroyed stream", Stream.wrap, _TorchLike(4242))
    raises(ValueError, "64-bit handle", Stream.wrap, -1)
    raises(ValueError, "64-bit handle", Stream.wrap, _TorchLike(-5))
    raises(ValueError, "64-bit handle", Stream.wrap, _TorchLike(2**64))
    raises(TypeError, "expected a Stream", Stream.wrap, "x")
    raises(TypeError, "expected a Stream", Stream.wrap, 1.0)
    raises(TypeError, "str|int", Stream.wrap, _CudaStreamProto((0, "x")))
    raises(TypeError, "subscriptable", Stream.wrap, _CudaStreamProto(5))
    raises(FeedError, "the stream is closed", Stream.wrap, closed_stream())


@case("stream")
def wait_event_bad():
    s = Stream()
    raises(FeedError, "unknown or destroyed event", s.wait_event, _destroyed_handle())
    raises(FeedError, "the event is closed", s.wait_event, closed_event())
    raises(TypeError, "expected an Event", s.wait_event, None)
    raises(TypeError, "expected an Event", s.wait_event, "x")
    raises(ValueError, "64-bit handle", s.wait_event, -2)
    assert s.query() is True  # nothing was queued
    s.close()


@case("stream")
def wrapped_stream_close_leaves_owner():
    # A wrapped stream is not owned: closing it must not destroy the owner's stream.
    owner = Stream()
    alias = Stream.wrap(owner.handle)
    alias.close()
    raises(FeedError, "the stream is closed", alias.synchronize)
    owner.synchronize()
    owner.close()


# ---------------------------------------------------------------------------------------------


test_hostile = hostile_test(__name__)
