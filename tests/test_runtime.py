"""The runtime foundation on the host backend: stream order, events, copies, zero-copy buffers,
leak counters, the fault knobs, backend selection, and the bad-input matrix (nothing may crash)."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

from helpers.child import run_python

import metrale_feed as mf
from metrale_feed import (
    DeviceBuffer,
    Event,
    FeedError,
    PinnedBuffer,
    Stream,
)

LAG = 20_000  # us: long enough that queued work is visibly pending, short enough to keep tests quick


def pinned_view(buf):
    return np.frombuffer(buf, dtype=np.uint8)


# ---------------------------------------------------------------------------------------------
# Stream order and events under lag
# ---------------------------------------------------------------------------------------------

def test_event_pending_while_queued_then_done(host, no_leaks):
    host.configure_host(lag_us=100_000)
    with Stream() as s, Event() as e:
        e.record(s)
        assert e.query() is False
        assert mf.event_query(e) is False
        assert mf.event_query(e.handle) is False
        assert s.query() is False
        s.synchronize()
        assert e.query() is True
        assert s.query() is True
        # Recorded again, it is pending again.
        e.record(s)
        assert e.query() is False
        e.synchronize()
        assert e.query() is True


def test_unrecorded_event_is_complete(host, no_leaks):
    with Event() as e:
        assert e.query() is True
        e.synchronize()  # returns at once
    h = mf.event_create()
    try:
        assert mf.event_query(h) is True
    finally:
        mf.destroy_event(h)


def test_free_function_events_over_int_handles(host, no_leaks):
    host.configure_host(lag_us=LAG)
    with Stream() as s:
        h = mf.event_create()
        mf.event_record(h, s.handle)
        assert mf.event_query(h) is False
        mf.event_synchronize(h)
        assert mf.event_query(h) is True
        mf.destroy_event(h)


def test_d2h_bytes_valid_after_event(host, dev, no_leaks):
    rng = np.random.default_rng(1)
    data = rng.integers(1, 256, size=4096, dtype=np.uint8)
    d = dev.upload(data)
    p = PinnedBuffer(data.nbytes)
    host.configure_host(lag_us=100_000)
    with Stream() as s, Event() as e:
        mf.copy_d2h_async(d, p, s)
        e.record(s)
        view = pinned_view(p)
        assert not e.query()
        assert not view.any(), "the copy ran before its stream reached it"
        e.synchronize()
        assert np.array_equal(view, data)
        del view
    p.close()
    d.close()


def test_stream_order_of_copies(host, dev, no_leaks):
    """Two H2D/D2H rounds through one device buffer on one stream: each readback sees its own
    round's bytes, so the stream ran them in order."""
    rng = np.random.default_rng(2)
    first = rng.integers(0, 256, size=1000, dtype=np.uint8)
    second = rng.integers(0, 256, size=1000, dtype=np.uint8)
    d = DeviceBuffer(1000)
    out1, out2 = PinnedBuffer(1000), PinnedBuffer(1000)
    host.configure_host(lag_us=5_000)
    with Stream() as s, Event() as e:
        mf.copy_h2d_async(d, first, s)
        mf.copy_d2h_async(d, out1, s)
        mf.copy_h2d_async(d, second, s)
        mf.copy_d2h_async(d, out2, s)
        e.record(s)
        e.synchronize()
        assert np.array_equal(pinned_view(out1), first)
        assert np.array_equal(pinned_view(out2), second)
    for b in (out1, out2, d):
        b.close()


def test_two_streams_are_independent(host, no_leaks):
    host.configure_host(lag_us=LAG)
    d = DeviceBuffer(64)
    with Stream() as s1, Stream() as s2, Event() as e1, Event() as e2:
        for _ in range(20):  # ~20 * LAG of queued work on s1
            d.memset_async(1, s1)
        e1.record(s1)
        e2.record(s2)
        t0 = time.monotonic()
        e2.synchronize()
        waited = time.monotonic() - t0
        assert not e1.query(), "an event on an idle stream waited for another stream's queue"
        assert waited < 15 * LAG / 1e6
        s1.synchronize()
        assert e1.query()
    d.close()


def test_stream_wait_event_orders_across_streams(host, dev, no_leaks):
    rng = np.random.default_rng(3)
    data = rng.integers(1, 256, size=512, dtype=np.uint8)
    d = DeviceBuffer(512)
    p = PinnedBuffer(512)
    host.configure_host(lag_us=LAG)
    with Stream() as s1, Stream() as s2, Event() as e1, Event() as e2:
        for _ in range(5):
            d.memset_async(0, s1)
        mf.copy_h2d_async(d, data, s1)
        e1.record(s1)
        s2.wait_event(e1)
        mf.copy_d2h_async(d, p, s2)
        e2.record(s2)
        e2.synchronize()
        assert e1.query(), "s2 passed wait_event before the event completed"
        assert np.array_equal(pinned_view(p), data)
    p.close()
    d.close()


def test_stream_wait_event_by_handle_and_unrecorded(host, no_leaks):
    host.configure_host(lag_us=LAG)
    with Stream() as s1, Stream() as s2, Event() as e1, Event() as e2, Event() as fresh:
        # An event never recorded: waiting on it does not block (CUDA semantics).
        s2.wait_event(fresh)
        e2.record(s2)
        e2.synchronize()
        # By int handle.
        for _ in range(10):
            e1.record(s1)
        s2.wait_event(e1.handle)
        e2.record(s2)
        e2.synchronize()
        assert e1.query()


def test_foreign_stream_objects_accepted(host, no_leaks):
    host.configure_host(lag_us=LAG)

    class ByProtocol:
        def __init__(self, h):
            self.h = h

        def __cuda_stream__(self):
            return (0, self.h)

    class ByAttr:
        def __init__(self, h):
            self.cuda_stream = h

    class ByPtr:
        def __init__(self, h):
            self.ptr = h

    with Stream() as s, Event() as e:
        for wrapper in (ByProtocol, ByAttr, ByPtr):
            e.record(wrapper(s.handle))
            assert not e.query()
            s.synchronize()
            assert e.query()
        wrapped = Stream.wrap(s.handle)
        e.record(wrapped)
        wrapped.synchronize()
        assert e.query()
        wrapped.close()  # not owned: s stays usable
        assert not s.closed
        e.record(s)
        s.synchronize()
        assert s == Stream.wrap(s)
        assert hash(Stream.wrap(s.handle)) == hash(s)


def test_lag_env_var_is_honoured(tmp_path):
    code = (
        "import time, metrale_feed as m\n"
        "s = m.Stream(); e = m.Event()\n"
        "t = time.monotonic(); e.record(s); e.synchronize(); dt = time.monotonic() - t\n"
        "print(m.host_faults()['lag_us'], dt)\n"
        "e.close(); s.close()\n"
    )
    lagged = run_python(code, env={"METRALE_FEED_HOST_LAG_US": "150000"}, cwd=tmp_path,
                        check=False)
    assert lagged.returncode == 0, lagged.stderr
    lag, dt = lagged.stdout.split()
    assert int(lag) == 150_000
    assert float(dt) >= 0.14
    plain = run_python(code, cwd=tmp_path, check=False)
    assert plain.returncode == 0, plain.stderr
    lag, dt = plain.stdout.split()
    assert int(lag) == 0
    assert float(dt) < 0.14


def _pipeline(host, lag_us):
    """A fixed sequence of copies and argmax launches over two streams; returns every result."""
    rng = np.random.default_rng(7)
    rows, vocab = 24, 300
    logits = rng.choice(np.array([0.0, 1.0, 2.0, -1.0], np.float32), size=(rows, vocab))
    masks = rng.integers(0, vocab, size=(rows, 2), dtype=np.uint32)
    host.configure_host(lag_us=lag_us)
    results = []
    with Stream() as s1, Stream() as s2, Event() as e1, Event() as e2:
        d = DeviceBuffer(logits.nbytes)
        cells = DeviceBuffer(rows * 4)
        mf.copy_h2d_async(d, logits, s1)
        e1.record(s1)
        s2.wait_event(e1)
        outs = [np.full(rows, 0xAB, np.uint32) for _ in range(3)]
        for k, out in enumerate(outs):
            m = masks.copy()
            m[:, k % 2] = mf.NO_TOKEN
            mf.argmax_to_feed(d, m, cells, out, e2, s2, vocab=vocab, dtype="float32")
            m[:] = 0  # reused at once
        e2.synchronize()
        results.extend(o.copy() for o in outs)
        d.close()
        cells.close()
    return results


def test_results_do_not_depend_on_lag(host, no_leaks):
    fast = _pipeline(host, 0)
    slow = _pipeline(host, 200)
    for a, b in zip(fast, slow):
        assert np.array_equal(a, b)
    assert not np.array_equal(fast[0], np.full(24, 0xAB, np.uint32))


# ---------------------------------------------------------------------------------------------
# Zero-copy pinned buffers
# ---------------------------------------------------------------------------------------------

def test_pinned_buffer_is_zero_copy(host, no_leaks):
    buf = PinnedBuffer(4096)
    a = np.asarray(buf)
    assert a.dtype == np.uint8 and a.shape == (4096,)
    assert a.__array_interface__["data"][0] == buf.ptr
    assert not a.any(), "pinned memory must start zeroed"
    m = memoryview(buf)
    assert m.nbytes == 4096 and not m.readonly
    m[17] = 99
    assert a[17] == 99
    a[4095] = 7
    assert m[4095] == 7
    words = np.frombuffer(buf, dtype=np.uint32)
    words[3] = 0xDEADBEEF
    assert mf.read_pinned_u32(buf.ptr + 12, 1) == [0xDEADBEEF]
    mf.write_pinned_u32(buf.ptr, [1, 2])
    assert list(words[:2]) == [1, 2]
    del a, words
    m.release()
    buf.close()


def test_alloc_host_pinned_is_zeroed_and_tracked(host, no_leaks):
    start = mf.live_objects()["pinned_bytes"]
    p = mf.alloc_host_pinned(256)
    assert mf.live_objects()["pinned_bytes"] == start + 256
    assert mf.read_pinned_u32(p, 64) == [0] * 64
    mf.write_pinned_u32(p, range(64))
    assert mf.read_pinned_u32(p, 64) == list(range(64))
    mf.free_host_pinned(p, 256)
    assert mf.live_objects()["pinned_bytes"] == start


def test_close_refused_while_exported(host, no_leaks):
    buf = PinnedBuffer(64)
    m = memoryview(buf)
    with pytest.raises(BufferError):
        buf.close()
    assert not buf.closed
    m[0] = 5  # still valid memory
    a = np.asarray(buf)
    m.release()
    with pytest.raises(BufferError):
        buf.close()
    assert a[0] == 5
    del a
    gc.collect()
    buf.close()
    assert buf.closed
    buf.close()  # idempotent
    with pytest.raises(FeedError):
        memoryview(buf)
    with pytest.raises(FeedError):
        buf.ptr


def test_live_object_counters(host):
    gc.collect()
    start = mf.live_objects()
    assert set(start) == {"events", "streams", "graphs", "pinned_bytes", "device_bytes"}

    def delta():
        now = mf.live_objects()
        return {k: now[k] - start[k] for k in now}

    e = Event()
    s = Stream()
    p = PinnedBuffer(100)
    d = DeviceBuffer(300)
    raw = mf.alloc_host_pinned(64)
    h = mf.event_create()
    assert delta() == {"events": 2, "streams": 1, "graphs": 0, "pinned_bytes": 164, "device_bytes": 300}
    mf.free_host_pinned(raw, 64)
    mf.destroy_event(h)
    e.close()
    s.close()
    assert delta() == {"events": 0, "streams": 0, "graphs": 0, "pinned_bytes": 100, "device_bytes": 300}
    del p, d  # freed by collection
    gc.collect()
    assert delta() == {"events": 0, "streams": 0, "graphs": 0, "pinned_bytes": 0, "device_bytes": 0}
    # Dropping open objects frees them too.
    Event(), Stream(), PinnedBuffer(10), DeviceBuffer(10)
    gc.collect()
    mf.stream_synchronize(0)
    assert delta() == {"events": 0, "streams": 0, "graphs": 0, "pinned_bytes": 0, "device_bytes": 0}


def test_foreign_host_buffer_held_until_copy_passed(host, dev, no_leaks):
    """A bytearray handed to an async copy stays exported (cannot be resized or freed) until the
    copy has passed, then is released."""
    d = dev.upload(np.arange(64, dtype=np.uint8))
    dst = bytearray(64)
    host.configure_host(lag_us=100_000)
    with Stream() as s:
        mf.copy_d2h_async(d, dst, s)
        with pytest.raises(BufferError):
            dst.extend(b"x")  # exported: the copy still holds it
        s.synchronize()
        mf.live_objects()  # lets the binding drop buffers whose copies passed
        dst.extend(b"x")
        assert bytes(dst[:64]) == bytes(range(64))
    d.close()


# ---------------------------------------------------------------------------------------------
# Timing and context managers
# ---------------------------------------------------------------------------------------------

def test_elapsed_ms(host, no_leaks):
    host.configure_host(lag_us=10_000)
    d = DeviceBuffer(16)
    with Stream() as s, Event(timing=True) as start, Event(timing=True) as end:
        start.record(s)
        for _ in range(5):
            d.memset_async(0, s)
        end.record(s)
        with pytest.raises((ValueError, FeedError)):
            start.elapsed_ms(end)  # not complete yet
        end.synchronize()
        ms = start.elapsed_ms(end)
        assert 5 * 10 * 0.9 <= ms < 5000
        assert end.elapsed_ms(start) == pytest.approx(-ms)
        with Event() as untimed:
            untimed.record(s)
            s.synchronize()
            with pytest.raises((ValueError, FeedError)):
                start.elapsed_ms(untimed)
        with Event(timing=True) as never:
            with pytest.raises((ValueError, FeedError)):
                start.elapsed_ms(never)
        with pytest.raises(TypeError):
            start.elapsed_ms(None)
    d.close()


def test_context_managers_close(host, no_leaks):
    before = mf.live_objects()
    with Event() as e, Stream() as s, PinnedBuffer(32) as p, DeviceBuffer(32) as d:
        assert not (e.closed or s.closed or p.closed or d.closed)
        now = mf.live_objects()
        assert now["events"] == before["events"] + 1
        assert now["streams"] == before["streams"] + 1
    assert e.closed and s.closed and p.closed and d.closed
    assert mf.live_objects() == before
    for obj in (e, s, p, d):
        with pytest.raises(FeedError):
            obj.__enter__()
    # Closed on the way out of an exception too.
    with pytest.raises(KeyError):
        with Event() as e2:
            raise KeyError
    assert e2.closed


# ---------------------------------------------------------------------------------------------
# Bad input: raised errors, never a crash
# ---------------------------------------------------------------------------------------------

def test_destroyed_and_unknown_event_handles(host, no_leaks):
    h = mf.event_create()
    mf.destroy_event(h)
    for call in (mf.event_query, mf.event_synchronize, mf.event_record, mf.destroy_event):
        with pytest.raises(FeedError):
            call(h)
    for bogus in (0, 1, 0xDEAD0000BEEF, 2**64 - 1):
        with pytest.raises(FeedError):
            mf.event_query(bogus)
        with pytest.raises(FeedError):
            mf.destroy_event(bogus)
    # A new event reusing the slot must not revive the old handle.
    h2 = mf.event_create()
    try:
        with pytest.raises(FeedError):
            mf.event_query(h)
        assert mf.event_query(h2) is True
    finally:
        mf.destroy_event(h2)


def test_closed_event_object(host, no_leaks):
    e = Event()
    handle = e.handle
    e.close()
    assert e.closed
    for call in (e.query, e.synchronize, e.record, lambda: e.handle):
        with pytest.raises(FeedError):
            call()
    with pytest.raises(FeedError):
        mf.destroy_event(e)
    with pytest.raises(FeedError):
        mf.destroy_event(handle)
    e.close()  # a second close is a no-op
    with Stream() as s:
        with pytest.raises(FeedError):
            s.wait_event(e)
        with pytest.raises(FeedError):
            s.wait_event(handle)


def test_double_destroy_event(host, no_leaks):
    h = mf.event_create()
    mf.destroy_event(h)
    with pytest.raises(FeedError):
        mf.destroy_event(h)
    e = Event()
    mf.destroy_event(e)
    assert e.closed
    with pytest.raises(FeedError):
        mf.destroy_event(e)


def test_free_host_pinned_misuse(host, no_leaks):
    p = mf.alloc_host_pinned(128)
    # A wrong size is refused and leaves the allocation live and intact.
    mf.write_pinned_u32(p, [42])
    for wrong in (127, 129, 1):
        with pytest.raises((FeedError, ValueError)):
            mf.free_host_pinned(p, wrong)
    assert mf.read_pinned_u32(p, 1) == [42]
    mf.free_host_pinned(p, 128)
    with pytest.raises(FeedError):
        mf.free_host_pinned(p, 128)  # double free
    foreign = np.zeros(64, np.uint8)
    with pytest.raises(FeedError):
        mf.free_host_pinned(foreign.ctypes.data, 64)
    with pytest.raises(FeedError):
        mf.free_host_pinned(0, 64)
    # The interior of a live allocation is not an allocation.
    q = mf.alloc_host_pinned(64)
    try:
        with pytest.raises((FeedError, ValueError)):
            mf.free_host_pinned(q + 16, 48)
    finally:
        mf.free_host_pinned(q, 64)
    # A PinnedBuffer's memory belongs to the buffer: freeing it by pointer with the wrong size fails.
    buf = PinnedBuffer(32)
    with pytest.raises((FeedError, ValueError)):
        mf.free_host_pinned(buf.ptr, 31)
    buf.close()
    # Device memory is not pinned memory.
    d = DeviceBuffer(64)
    with pytest.raises(FeedError):
        mf.free_host_pinned(d.ptr, 64)
    d.close()


def test_pinned_word_access_is_range_checked(host, no_leaks):
    p = mf.alloc_host_pinned(16)
    # Past the end of a live allocation: an invalid argument.
    with pytest.raises(ValueError):
        mf.read_pinned_u32(p, 5)
    with pytest.raises(ValueError):
        mf.read_pinned_u32(p + 8, 3)
    with pytest.raises(ValueError):
        mf.write_pinned_u32(p, [0] * 5)
    assert mf.read_pinned_u32(p + 12, 1) == [0]
    # Freed or foreign: an unknown pointer.
    with pytest.raises(ValueError):
        mf.read_pinned_u32(p, -1)
    mf.free_host_pinned(p, 16)
    with pytest.raises(FeedError):
        mf.read_pinned_u32(p, 1)  # freed
    with pytest.raises(FeedError):
        mf.write_pinned_u32(p, [1])
    foreign = np.zeros(4, np.uint32)
    with pytest.raises(FeedError):
        mf.read_pinned_u32(foreign.ctypes.data, 1)


def test_device_copies_are_range_checked(host, dev, no_leaks):
    host.configure_host(lag_us=LAG)
    d = DeviceBuffer(16)
    dst = bytearray(b"\xaa" * 32)
    with pytest.raises(ValueError):
        mf.copy_d2h_async(d, dst)  # 32 bytes from a 16-byte buffer
    with pytest.raises(ValueError):
        mf.copy_d2h_async(d.ptr + 8, bytearray(16))
    with pytest.raises(ValueError):
        mf.copy_h2d_async(d, bytes(17))
    with pytest.raises(ValueError):
        mf.copy_h2d_async(d.ptr + 15, bytes(2))
    other = DeviceBuffer(8)
    with pytest.raises(ValueError):
        mf.copy_d2d_async(other, d, 16)
    with pytest.raises(ValueError):
        mf.copy_d2d_async(d, other, 9)
    mf.stream_synchronize(0)
    assert dst == bytearray(b"\xaa" * 32), "a refused copy was launched"
    dst.extend(b"x")  # and the refused copy does not still hold the buffer
    # Exactly at the end is fine.
    mf.copy_h2d_async(d.ptr + 8, bytes(range(8)))
    mf.copy_d2d_async(other, d.ptr + 8, 8)
    mf.stream_synchronize(0)
    assert bytes(dev.download(other)) == bytes(range(8))
    # Zero bytes is a no-op, not an error.
    mf.copy_d2h_async(d, bytearray(0))
    other.close()
    # Freed and foreign device pointers.
    p = d.ptr
    d.close()
    with pytest.raises(FeedError):
        mf.copy_d2h_async(p, bytearray(4))
    with pytest.raises(FeedError):
        mf.copy_h2d_async(d, bytes(4))  # closed buffer object
    foreign = np.zeros(16, np.uint8)
    with pytest.raises(FeedError):
        mf.copy_d2h_async(foreign.ctypes.data, bytearray(4))
    pinned = PinnedBuffer(16)
    with pytest.raises((ValueError, FeedError)):
        mf.copy_d2h_async(pinned.ptr, bytearray(4))  # pinned memory is not device memory
    with pytest.raises(TypeError):
        mf.copy_d2h_async(DeviceBuffer(4), pinned.ptr)  # an int is not a host buffer
    pinned.close()
    mf.stream_synchronize(0)


def test_unknown_and_destroyed_streams(host, no_leaks):
    with Event() as e:
        for bogus in (12345, 0xFFFF_FFFF_FFFF):
            with pytest.raises(FeedError):
                e.record(bogus)
            with pytest.raises(FeedError):
                mf.stream_synchronize(bogus)
            with pytest.raises(FeedError):
                Stream.wrap(bogus)
            with pytest.raises(FeedError):
                mf.copy_h2d_async(DeviceBuffer(4), bytes(4), bogus)
        s = Stream()
        h = s.handle
        s.close()
        assert s.closed
        with pytest.raises(FeedError):
            mf.stream_synchronize(h)
        with pytest.raises(FeedError):
            e.record(h)
        for call in (s.synchronize, s.query, lambda: s.handle, lambda: s.wait_event(e)):
            with pytest.raises(FeedError):
                call()
        with pytest.raises(FeedError):
            e.record(s)
        s.close()  # no-op
        mf.stream_synchronize(0)
        mf.stream_synchronize(None)


def test_wrong_types(host, no_leaks):
    d = DeviceBuffer(8)
    with Event() as e:
        for bad in ("x", 1.5, [1], b"\x00"):
            with pytest.raises(TypeError):
                mf.event_query(bad)
            with pytest.raises(TypeError):
                e.record(bad)
            with pytest.raises(TypeError):
                mf.stream_synchronize(bad)
        with pytest.raises(TypeError):
            mf.event_query(True)
        with pytest.raises(TypeError):
            mf.copy_d2h_async("x", bytearray(8))
        with pytest.raises(TypeError):
            mf.copy_d2h_async(1.0, bytearray(8))
        with pytest.raises(TypeError):
            mf.copy_d2h_async(d, 123)  # an int is not a host buffer
        with pytest.raises(TypeError):
            mf.copy_d2h_async(d, "abcdefgh")
        with pytest.raises((TypeError, BufferError, ValueError)):
            mf.copy_d2h_async(d, b"12345678")  # read-only destination
        with pytest.raises(TypeError):
            mf.copy_h2d_async(d, 8)
        with pytest.raises(TypeError):
            PinnedBuffer("10")
        with pytest.raises(TypeError):
            DeviceBuffer(None)
        with pytest.raises(TypeError):
            mf.read_pinned_u32(0, 1.5)
    d.close()


@pytest.mark.parametrize("call", ["PinnedBuffer", "DeviceBuffer", "alloc_host_pinned"])
def test_float_sizes_are_type_errors(host, no_leaks, call):
    """A float byte count is refused, not truncated."""
    made = None
    try:
        with pytest.raises(TypeError):
            made = getattr(mf, call)(1.5)
    finally:
        if isinstance(made, int):
            mf.free_host_pinned(made, 1)
        elif made is not None:
            made.close()
    p = mf.alloc_host_pinned(8)
    try:
        with pytest.raises(TypeError):
            mf.free_host_pinned(p, 8.0)
        with pytest.raises(TypeError):
            mf.copy_d2d_async(DeviceBuffer(4), DeviceBuffer(4), 4.0)
    finally:
        mf.free_host_pinned(p, 8)


def test_negative_and_huge_sizes(host, no_leaks):
    for ctor in (PinnedBuffer, DeviceBuffer, mf.alloc_host_pinned):
        with pytest.raises((OverflowError, ValueError)):
            ctor(-1)
        with pytest.raises((OverflowError, ValueError)):
            ctor(2**64)
    p = mf.alloc_host_pinned(8)
    with pytest.raises((OverflowError, ValueError)):
        mf.free_host_pinned(p, -8)
    with pytest.raises((OverflowError, ValueError)):
        mf.free_host_pinned(-p, 8)
    mf.free_host_pinned(p, 8)
    with pytest.raises((OverflowError, ValueError)):
        mf.copy_d2d_async(DeviceBuffer(4), DeviceBuffer(4), -1)
    with pytest.raises((OverflowError, ValueError)):
        mf.event_query(-1)
    with pytest.raises((FeedError, MemoryError)):
        PinnedBuffer(1 << 62)
    with pytest.raises((FeedError, MemoryError)):
        DeviceBuffer(1 << 62)


@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**64 - 255, 2**64 - 4096, 2**63])
@pytest.mark.parametrize("ctor", ["PinnedBuffer", "DeviceBuffer", "alloc_host_pinned"])
def test_size_near_2_64_is_refused(host, no_leaks, ctor, nbytes):
    """No size wraps around in the allocator's rounding: near 2**64 bytes is refused."""
    made = None
    try:
        with pytest.raises((FeedError, MemoryError, ValueError, OverflowError)):
            made = getattr(mf, ctor)(nbytes)
    finally:
        if isinstance(made, int):
            mf.free_host_pinned(made, nbytes)
        elif made is not None:
            made.close()


def test_zero_sizes_refused(host, no_leaks):
    with pytest.raises(ValueError):
        PinnedBuffer(0)
    with pytest.raises(ValueError):
        DeviceBuffer(0)
    with pytest.raises(ValueError):
        mf.alloc_host_pinned(0)


def test_event_wrap_is_cuda_only(host, no_leaks):
    with pytest.raises((ValueError, FeedError)):
        Event.wrap(0x1234)
    with Event() as e:
        with pytest.raises((ValueError, FeedError)):
            e.cuda_event  # the host backend has no cudaEvent_t


# ---------------------------------------------------------------------------------------------
# Fault knobs
# ---------------------------------------------------------------------------------------------

def test_fail_event_query_at(host, no_leaks):
    with Event() as e:
        host.configure_host(fail_event_query_at=3)
        assert e.query() is True
        assert mf.event_query(e.handle) is True
        with pytest.raises(FeedError) as info:
            e.query()
        assert not isinstance(info.value, ValueError)
        assert "inject" in str(info.value).lower()
        assert e.query() is True
        assert e.query() is True
        assert host.host_faults()["fail_event_query_at"] == 0


def test_fail_alloc_at(host, no_leaks):
    before = mf.live_objects()
    host.configure_host(fail_alloc_at=1)
    with pytest.raises(FeedError):
        PinnedBuffer(4096)
    assert mf.live_objects() == before
    with PinnedBuffer(4096):
        pass
    host.configure_host(fail_alloc_at=2)
    first = DeviceBuffer(64)
    with pytest.raises(FeedError):
        DeviceBuffer(64)
    assert mf.live_objects()["device_bytes"] == before["device_bytes"] + 64
    first.close()
    host.configure_host(fail_alloc_at=1)
    with pytest.raises(FeedError):
        mf.alloc_host_pinned(16)
    assert mf.live_objects() == before


def test_fail_copy_at(host, dev, no_leaks):
    d = dev.upload(np.arange(32, dtype=np.uint8))
    dst = bytearray(b"\x55" * 32)
    host.configure_host(fail_copy_at=1)
    with pytest.raises(FeedError):
        mf.copy_d2h_async(d, dst)
    mf.stream_synchronize(0)
    assert dst == bytearray(b"\x55" * 32)
    dst.append(0)  # the refused copy does not hold the buffer
    del dst[-1]
    mf.copy_d2h_async(d, dst)  # the next copy works
    mf.stream_synchronize(0)
    assert bytes(dst) == bytes(range(32))
    host.configure_host(fail_copy_at=2)
    mf.copy_h2d_async(d, bytes(32))
    with pytest.raises(FeedError):
        mf.copy_h2d_async(d, bytes(range(1, 33)))
    mf.stream_synchronize(0)
    assert not dev.download(d).any()
    d.close()


def test_fail_synchronize_at(host, no_leaks):
    host.configure_host(fail_synchronize_at=1)
    with Stream() as s, Event() as e:
        e.record(s)
        with pytest.raises(FeedError):
            e.synchronize()
        e.synchronize()
        host.configure_host(fail_synchronize_at=2)
        s.synchronize()
        with pytest.raises(FeedError):
            mf.stream_synchronize(s)
        s.synchronize()
        assert e.query()


def test_configure_host_validation(host):
    with pytest.raises(ValueError):
        host.configure_host(lag_us=-1)
    for knob in ("fail_event_query_at", "fail_alloc_at", "fail_copy_at", "fail_synchronize_at",
                 "fail_event_create_at"):
        with pytest.raises(ValueError):
            host.configure_host(**{knob: -1})
    with pytest.raises(ValueError):
        host.configure_host(lag_us=10_000_001)
    with pytest.raises(TypeError):
        host.configure_host(lag=5)
    with pytest.raises(TypeError):
        host.configure_host(5)
    with pytest.raises(TypeError):
        host.configure_host(lag_us="5")
    host.configure_host(lag_us=5, fail_event_query_at=2, fail_alloc_at=3, fail_copy_at=4,
                        fail_synchronize_at=5, fail_event_create_at=6)
    assert host.host_faults() == {"lag_us": 5, "fail_event_query_at": 2, "fail_alloc_at": 3,
                                  "fail_copy_at": 4, "fail_synchronize_at": 5,
                                  "fail_event_create_at": 6}
    host.configure_host(fail_alloc_at=7)  # every call sets every knob
    assert host.host_faults() == {"lag_us": 0, "fail_event_query_at": 0, "fail_alloc_at": 7,
                                  "fail_copy_at": 0, "fail_synchronize_at": 0,
                                  "fail_event_create_at": 0}
    host.configure_host()
    assert set(host.host_faults().values()) == {0}


# ---------------------------------------------------------------------------------------------
# Backend selection and the package's import
# ---------------------------------------------------------------------------------------------

def test_backend_and_build_info():
    assert mf.backend() in ("host", "cuda", "simt")
    info = mf.build_info()
    assert {"cuda", "cuda_version", "architectures", "nvtx"} <= set(info)
    assert isinstance(info["cuda"], bool) and isinstance(info["nvtx"], bool)
    assert isinstance(info["architectures"], list)
    if info["cuda"]:
        assert info["architectures"] and all(isinstance(a, str) and a for a in info["architectures"])
        major, minor = info["cuda_version"].split(".")
        assert int(major) >= 11 and int(minor) >= 0
    else:
        assert info["architectures"] == [] and info["cuda_version"] is None
        assert mf.backend() in ("host", "simt")
    with pytest.raises(ValueError):
        mf.set_backend("tpu")


def test_host_backend_facts(host):
    assert mf.backend() in ("host", "simt")
    assert mf.devices() == []
    with pytest.raises(AttributeError):
        DeviceBuffer(8).__cuda_array_interface__
    assert not hasattr(DeviceBuffer(8), "__cuda_array_interface__")


def test_switch_backend_refused_while_objects_live(host):
    if not mf.build_info()["cuda"]:
        with pytest.raises(FeedError):
            mf.set_backend("cuda")
        return
    with Event():
        with pytest.raises((ValueError, FeedError)):
            mf.set_backend("cuda")
    assert mf.backend() in ("host", "simt")


def test_import_does_not_import_numpy(tmp_path):
    result = run_python("import sys, metrale_feed\nassert 'numpy' not in sys.modules, 'numpy imported'\n"
                        "metrale_feed.FeedSource.host(1)\nassert 'numpy' not in sys.modules\n",
                        cwd=tmp_path, check=False)
    assert result.returncode == 0, result.stderr


def test_backend_env_selection(tmp_path):
    code = "import metrale_feed as m; print(m.backend())"
    auto = run_python(code, backend=None, cwd=tmp_path, check=False)
    assert auto.returncode == 0, auto.stderr
    auto_backend = auto.stdout.strip()
    assert auto_backend in ("host", "cuda")
    default = run_python(code, backend="auto", cwd=tmp_path, check=False)
    assert default.stdout.strip() == auto_backend
    forced_host = run_python(code, backend="host", cwd=tmp_path, check=False)
    assert forced_host.returncode == 0 and forced_host.stdout.strip() == "host"
    simt = run_python(code, backend="simt", cwd=tmp_path, check=False)
    assert simt.returncode == 0 and simt.stdout.strip() == "simt", simt.stderr
    bogus = run_python(code, backend="tpu", cwd=tmp_path, check=False)
    assert bogus.returncode != 0 and "ValueError" in bogus.stderr

    cuda = run_python(code, backend="cuda", cwd=tmp_path, check=False)
    if auto_backend == "cuda":
        assert cuda.returncode == 0 and cuda.stdout.strip() == "cuda", cuda.stderr
    else:
        # No usable device (or no CUDA build): asked for by name, the import says why.
        assert cuda.returncode != 0
        last = cuda.stderr.strip().splitlines()[-1]
        assert last.startswith(("metrale_feed.errors.CudaError", "metrale_feed.errors.FeedError",
                                "metrale_feed.errors.BackendUnavailable", "CudaError", "FeedError",
                                "BackendUnavailable")), cuda.stderr
        message = last.split(":", 1)[1].strip()
        assert len(message) > 10, cuda.stderr


def test_cuda_error_class():
    err = mf.CudaError("boom", 1, "cudaErrorInvalidValue")
    assert isinstance(err, FeedError) and isinstance(err, RuntimeError)
    assert err.code == 1 and err.name == "cudaErrorInvalidValue"
    assert issubclass(mf.NoDeviceTokenFeed, NotImplementedError)
    assert issubclass(mf.KvPoolExhausted, FeedError)


# ---------------------------------------------------------------------------------------------
# cuda backend (skipped without a device)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_array_interface(no_leaks):
    d = DeviceBuffer(64)
    cai = d.__cuda_array_interface__
    assert cai["data"][0] == d.ptr and cai["data"][1] is False
    assert cai["shape"] == (64,) and cai["typestr"] == "|u1" and cai["version"] >= 2
    assert cai.get("strides") is None
    d.close()
    with pytest.raises(FeedError):
        d.__cuda_array_interface__


@pytest.mark.gpu
def test_cuda_copies_round_trip(dev, no_leaks):
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    d = dev.upload(data)
    p = PinnedBuffer(data.nbytes)
    with Stream() as s, Event() as e:
        mf.copy_d2h_async(d, p, s)
        e.record(s)
        e.synchronize()
        assert e.query()
        assert np.array_equal(pinned_view(p), data)
    p.close()
    d.close()
    assert mf.devices()


@pytest.mark.gpu
def test_cuda_bad_handles_raise(no_leaks):
    h = mf.event_create()
    mf.destroy_event(h)
    with pytest.raises(FeedError):
        mf.event_query(h)
    p = mf.alloc_host_pinned(64)
    with pytest.raises((FeedError, ValueError)):
        mf.free_host_pinned(p, 63)
    mf.free_host_pinned(p, 64)
    with pytest.raises(FeedError):
        mf.free_host_pinned(p, 64)
    d = DeviceBuffer(16)
    with pytest.raises(ValueError):
        mf.copy_d2h_async(d, bytearray(32))
    d.close()


# ---------------------------------------------------------------------------------------------
# CUDA's semantics the host backend keeps (issue classes 6, 7, 11)
# ---------------------------------------------------------------------------------------------


def test_copy_h2d_from_pageable_memory_has_consumed_it_on_return(host, no_leaks, dev):
    """As cudaMemcpyAsync from pageable memory, the source may be reused as soon as the call
    returns: the copy delivers what the source held then."""
    target = DeviceBuffer(4096)
    source = np.full(4096, 7, np.uint8)
    host.configure_host(lag_us=LAG)
    mf.copy_h2d_async(target, source)
    source[:] = 9  # the worker has not run yet
    host.configure_host()
    mf.stream_synchronize()
    assert (dev.download(target) == 7).all()
    target.close()


def test_pinned_h2d_source_is_read_in_stream_order(host, no_leaks, dev):
    """Pinned memory is not staged (as on CUDA, where the DMA reads it when the copy runs)."""
    target = DeviceBuffer(64)
    with PinnedBuffer(64) as source:
        pinned_view(source)[:] = 3
        host.configure_host(lag_us=LAG)
        mf.copy_h2d_async(target, source)
        pinned_view(source)[:] = 5
        host.configure_host()
        mf.stream_synchronize()
        assert (dev.download(target) == 5).all()
    target.close()


def _ordered(first_stream, second_stream, dev, host):
    """Work queued on second_stream after first_stream's ran after it (True) or overtook it."""
    a = dev.upload(np.zeros(4, np.uint32))
    out = np.zeros(4, np.uint32)
    # Every op waits 40 ms before it runs: the first stream's 0x11 lands at about 120 ms; the
    # copy runs at about 40 ms, or after 120 ms when ordered behind the first stream.
    host.configure_host(lag_us=40_000)
    a.memset_async(0, first_stream)
    a.memset_async(0, first_stream)
    a.memset_async(0x11, first_stream)
    mf.copy_d2h_async(a, out, second_stream)
    done = Event()
    done.record(second_stream)
    done.synchronize()
    mf.stream_synchronize(first_stream)
    host.configure_host()
    done.close()
    a.close()
    return bool((out == 0x11111111).all())


@pytest.mark.parametrize("direction", ["blocking_then_default", "default_then_blocking"])
def test_the_legacy_default_stream_orders_against_blocking_streams(host, no_leaks, dev, direction):
    with Stream(non_blocking=False) as blocking:
        first, second = (blocking, 0) if direction == "blocking_then_default" else (0, blocking)
        assert _ordered(first, second, dev, host)


def test_a_non_blocking_stream_does_not_wait_for_the_default_stream(host, no_leaks, dev):
    with Stream(non_blocking=True) as free:
        assert not _ordered(0, free, dev, host)


def test_a_hold_needs_nothing_made_before_its_copy(host, no_leaks, dev):
    """All or nothing: a foreign buffer is held by a release callback queued behind its copy, so
    no object is made before the copy is queued and nothing can fail between (an event table
    that refuses new events does not matter), and the buffer is given back once the copy ran."""
    source = dev.upload(np.arange(16, dtype=np.uint32))
    target = np.zeros(16, np.uint32)
    host.configure_host(lag_us=LAG, fail_event_create_at=1)
    mf.copy_d2h_async(source, target)
    cells = DeviceBuffer(64)
    logits = dev.upload(np.arange(8, dtype=np.float32))
    ids = np.full(2, 77, np.uint32)
    mf.argmax_to_feed(logits, None, cells, ids, None, rows=2, vocab=4, dtype="float32")
    host.configure_host()
    mf.stream_synchronize()
    assert target.tolist() == list(range(16))
    assert ids.tolist() == [3, 3]
    target.resize(32, refcheck=False)  # no longer exported
    for b in (source, cells, logits):
        b.close()


def test_freeing_a_buffer_while_another_stream_works_never_waits(host, no_leaks):
    """A free with work queued on another stream returns at once (cudaFree would wait): the
    memory goes once that work has passed, and is counted as live until then."""
    with Stream() as busy:
        work = DeviceBuffer(8)
        host.configure_host(lag_us=400_000)
        work.memset_async(0, busy)
        time.sleep(0.02)  # the worker has taken the op with its lag
        host.configure_host()
        small = DeviceBuffer(8)
        before = mf.live_objects()["device_bytes"]
        start = time.monotonic()
        del small  # __dealloc__
        waited = time.monotonic() - start
        assert waited < 0.2, f"the free waited {waited:.2f} s"  # a blocking free: >= 0.38 s
        assert mf.live_objects()["device_bytes"] == before  # not yet: `busy` has not passed it
        busy.synchronize()
        deadline = time.monotonic() + 20  # polled: a margin for loaded machines
        while mf.live_objects()["device_bytes"] != before - 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert mf.live_objects()["device_bytes"] == before - 8
        work.close()


def test_an_async_copy_costs_the_same_with_16k_outstanding(host, no_leaks, dev):
    """Each copy into a Python buffer costs O(1), however many are outstanding (it used to scan
    every one: 21 us at 2k, 115 us at 16k)."""
    source = dev.upload(np.arange(4, dtype=np.uint32))
    gate = Event()
    with Stream() as slow, Stream() as copies:
        host.configure_host(lag_us=5_000_000)
        gate.record(slow)          # 5 s: the copies below stay outstanding
        time.sleep(0.02)           # the worker has taken the record with its lag
        host.configure_host()
        copies.wait_event(gate)
        targets = [bytearray(16) for _ in range(16384)]
        # Per-copy cost over windows of 128 copies; the least window near 2k outstanding against
        # the least near 16k. A minimum over eight windows shrugs off a load spike on a shared
        # machine, while a scan of the outstanding copies would still show as 8x.
        window, windows = 128, {}
        for n, target in enumerate(targets):
            if n % window == 0:
                started = time.perf_counter()
            mf.copy_d2h_async(source, target, copies)
            if n % window == window - 1:
                windows[n + 1] = (time.perf_counter() - started) / window
        assert not gate.query(), "the gate passed before the copies were measured"
        at_2k = min(t for n, t in windows.items() if 1024 < n <= 2048)
        at_16k = min(t for n, t in windows.items() if 15360 < n <= 16384)
        print(f"per copy: {at_2k * 1e6:.1f} us at 2k, {at_16k * 1e6:.1f} us at 16k")
        assert at_16k / at_2k < 2.5, (at_2k, at_16k)
        copies.synchronize()
        assert all(t == targets[0] for t in targets) and targets[0][:4] == b"\0\0\0\0"
    gate.close()
    source.close()


@pytest.mark.skipif("san.so" in os.environ.get("LD_PRELOAD", ""),
                    reason="a sanitizer runtime needs more address space than the limit leaves")
def test_stream_when_the_os_refuses_a_thread_raises():
    """Stream() with no thread to be had (the address space is full) is a FeedError, not an
    abort from std::system_error."""
    out = run_python("""
        import resource, metrale_feed as mf
        mf.stream_synchronize()  # the default stream and the pool exist before the limit
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
        limit = pages * resource.getpagesize() + (2 << 20)   # no room for an 8 MiB stack
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        refused = 0
        for _ in range(3):
            try:
                mf.Stream()
            except mf.FeedError as error:
                refused += "thread" in str(error)
        print(refused)
    """, timeout=30).stdout.strip()
    assert out == "3"


def test_write_pinned_u32_stops_an_endless_iterable_at_the_end_of_the_buffer(backend, no_leaks):
    import itertools

    with PinnedBuffer(64) as buf:
        with pytest.raises(ValueError, match="more ids than the 16 that fit"):
            mf.write_pinned_u32(buf.ptr, itertools.count())
        assert mf.read_pinned_u32(buf.ptr, 16) == [0] * 16  # nothing stored
        mf.write_pinned_u32(buf.ptr, iter(range(16)))        # exactly full is fine
        assert mf.read_pinned_u32(buf.ptr, 16) == list(range(16))
        mf.write_pinned_u32(buf.ptr + 60, (x for x in [5]))
        assert mf.read_pinned_u32(buf.ptr + 60, 1) == [5]


def test_max_rows_and_max_vocab_are_the_kernels_limits(backend, no_leaks):
    assert (mf.MAX_ROWS, mf.MAX_VOCAB) == (4096, 2**24)
    logits = DeviceBuffer(16)
    cells = DeviceBuffer(4 * (mf.MAX_ROWS + 1))
    with pytest.raises(ValueError):
        mf.argmax_to_feed(logits, None, cells, None, None, rows=mf.MAX_ROWS + 1, vocab=1,
                          dtype="float32")
    with pytest.raises(ValueError):
        mf.argmax_to_feed(logits, None, cells, None, None, rows=1, vocab=mf.MAX_VOCAB + 1,
                          dtype="float32")
    logits.close()
    cells.close()
