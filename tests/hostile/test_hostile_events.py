"""Hostile matrix: Events: the Event class and the free functions over a matrix of bad handles. Bad input, one call per case, run in child interpreters by
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
# Events: the Event class
# ---------------------------------------------------------------------------------------------


@case("event")
def init_twice():
    e = Event()
    raises(FeedError, "already initialised", e.__init__)
    assert e.query() is True


for _label, _call in [("query", lambda e: e.query()), ("synchronize", lambda e: e.synchronize()),
                      ("record", lambda e: e.record()), ("handle", lambda e: e.handle),
                      ("cuda_event", lambda e: e.cuda_event), ("enter", lambda e: e.__enter__()),
                      ("elapsed_from_closed", lambda e: e.elapsed_ms(Event(timing=True)))]:
    add("event", f"closed_{_label}",
        lambda c=_call: raises(FeedError, "the event is closed", c, closed_event()))


@case("event")
def elapsed_to_closed():
    raises(FeedError, "the event is closed", Event(timing=True).elapsed_ms, closed_event())


@case("event")
def elapsed_wrong_types():
    e = Event(timing=True)
    raises(TypeError, "Event", e.elapsed_ms, None)
    raises(TypeError, "Event", e.elapsed_ms, "x")
    raises(TypeError, "Event", e.elapsed_ms, e.handle)


@case("event")
def elapsed_without_timing():
    a, b = Event(), Event()
    a.record()
    b.record()
    drained()
    raises(ValueError, "created with timing", a.elapsed_ms, b)


@case("event")
def elapsed_never_recorded():
    raises(ValueError, "never recorded", Event(timing=True).elapsed_ms, Event(timing=True))


@case("event")
def elapsed_not_complete():
    mf.configure_host(lag_us=100_000)
    with Stream() as s:
        a, b = Event(timing=True), Event(timing=True)
        a.record(s)
        b.record(s)
        raises(ValueError, "not completed", a.elapsed_ms, b)
        s.synchronize()
    mf.configure_host()


@case("event")
def wrap_is_cuda_only():
    raises(ValueError, "only be wrapped on the cuda backend", Event.wrap, 0x1234)
    raises(ValueError, "64-bit handle", Event.wrap, -1)
    raises(ValueError, "64-bit handle", Event.wrap, 2**64)
    raises(TypeError, "str|int", Event.wrap, "x")


@case("event")
def cuda_event_on_host():
    raises(ValueError, "no cudaEvent_t", lambda: Event().cuda_event)


@case("event")
def record_on_bad_streams():
    e = Event()
    s = Stream()
    s.close()
    raises(FeedError, "unknown or destroyed stream", e.record, 12345)
    raises(FeedError, "the stream is closed", e.record, s)
    raises(ValueError, "64-bit handle", e.record, -1)
    raises(ValueError, "64-bit handle", e.record, 2**64)
    for bad in ("x", 1.5, b"", [0], object()):
        raises(TypeError, "expected a Stream", e.record, bad)
    assert e.query() is True  # never recorded


# ---------------------------------------------------------------------------------------------
# Events: the free functions, over a matrix of bad handles
# ---------------------------------------------------------------------------------------------


def _stream_handle():
    s = Stream()
    return s.handle, s  # the Stream stays alive with the handle


BAD_EVENTS = [
    ("destroyed", lambda: _destroyed_handle(), FeedError, "unknown or destroyed event"),
    ("zero", lambda: 0, FeedError, "unknown or destroyed event"),
    ("max_u64", lambda: 2**64 - 1, FeedError, "unknown or destroyed event"),
    ("high_index", lambda: (1 << 32) | 0xFFFFFFFF, FeedError, "unknown or destroyed event"),
    ("negative", lambda: -1, ValueError, "64-bit handle"),
    ("beyond_u64", lambda: 2**64, ValueError, "64-bit handle"),
    ("str", lambda: "x", TypeError, "expected an Event"),
    ("float", lambda: 1.5, TypeError, "expected an Event"),
    ("bool", lambda: True, TypeError, "expected an Event"),
    ("none", lambda: None, TypeError, "expected an Event"),
    ("stream_object", lambda: Stream(), TypeError, "expected an Event"),
    ("closed_event", lambda: closed_event(), FeedError, "the event is closed"),
]
EVENT_FUNCS = [
    ("event_query", lambda e: mf.event_query(e)),
    ("event_synchronize", lambda e: mf.event_synchronize(e)),
    ("event_record", lambda e: mf.event_record(e, 0)),
    ("destroy_event", lambda e: mf.destroy_event(e)),
    ("stream_wait_event", lambda e: Stream().wait_event(e)),
]
for _fname, _call in EVENT_FUNCS:
    for _label, _make, _exc, _match in BAD_EVENTS:
        add("event_funcs", f"{_fname}_{_label}",
            lambda c=_call, m=_make, x=_exc, r=_match: raises(x, r, c, m()))


@case("event_funcs")
def stream_handle_is_not_an_event():
    handle, keep = _stream_handle()
    for _, call in EVENT_FUNCS:
        raises(FeedError, "unknown or destroyed event", call, handle)
    keep.close()


@case("event_funcs")
def destroy_event_twice():
    h = mf.event_create()
    mf.destroy_event(h)
    raises(FeedError, "unknown or destroyed event", mf.destroy_event, h)
    e = Event()
    mf.destroy_event(e)
    raises(FeedError, "the event is closed", mf.destroy_event, e)


@case("event_funcs")
def destroy_by_handle_under_an_event_object():
    # The Event object's handle dies under it: the object must report it, not use a dead slot.
    e = Event()
    mf.destroy_event(e.handle)
    replacement = mf.event_create()  # may take the slot; the generation must tell them apart
    raises(FeedError, "unknown or destroyed event", e.query)
    raises(FeedError, "unknown or destroyed event", e.record)
    assert mf.event_query(replacement) is True
    mf.destroy_event(replacement)


@case("event_funcs")
def event_record_on_bad_stream():
    h = mf.event_create()
    raises(FeedError, "unknown or destroyed stream", mf.event_record, h, 0xDEAD)
    raises(TypeError, "expected a Stream", mf.event_record, h, 2.0)
    raises(ValueError, "64-bit handle", mf.event_record, h, -3)
    assert mf.event_query(h) is True
    mf.destroy_event(h)


@case("event_funcs")
def stream_synchronize_bad():
    s = Stream()
    h = s.handle
    s.close()
    raises(FeedError, "the stream is closed", mf.stream_synchronize, s)
    raises(FeedError, "unknown or destroyed stream", mf.stream_synchronize, 0xBEEF0)
    raises(ValueError, "64-bit handle", mf.stream_synchronize, -1)
    raises(TypeError, "expected a Stream", mf.stream_synchronize, "0")
    del h


# ---------------------------------------------------------------------------------------------


test_hostile = hostile_test(__name__)
