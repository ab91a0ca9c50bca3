"""Memory lifetimes (docs/lifetimes.md): what a graph keeps, when a free happens, when a borrowed
host buffer is given back. Anything that crashed or hung before runs in a child interpreter with a
timeout (helpers.child), so a regression fails the test instead of the run."""

import gc
import sys
import time
import weakref

import numpy as np
import pytest

import metrale_feed as mf
from helpers.child import run_python
from helpers.leaks import wait_for_counts


# ---------------------------------------------------------------------------------------------
# Graphs and frees (invariants 1-3)


def test_closed_buffer_of_a_live_graph_is_kept_and_its_address_not_reused(backend, no_leaks):
    """Closing a buffer a live graph names defers its free until the graph goes: no new
    allocation can take its address meanwhile, and a launch raises (its generation changed)."""
    with mf.Stream() as s:
        gone = mf.DeviceBuffer(256)
        address = gone.ptr
        with mf.graph_capture(s) as graph:
            gone.memset_async(7, s)
        gone.close()
        others = [mf.DeviceBuffer(256) for _ in range(16)]  # same size: the allocator's favourite
        assert address not in [b.ptr for b in others]
        for b in others:
            b.memset_async(0, s)
        with pytest.raises(mf.FeedError, match="freed after the capture"):
            graph.launch(s)
        s.synchronize()
        if mf.backend() == "host":  # the new owners were never written by the graph
            assert all(not np.asarray(b).any() for b in others)
        before = mf.live_objects()["device_bytes"]
        graph.close()
        assert wait_for_counts(dict(mf.live_objects(), device_bytes=before - 256))["device_bytes"] \
            == before - 256
        for b in others:
            b.close()


def test_address_reuse_never_passes_a_launch(host, no_leaks):
    """Capture, free, allocate the same size, launch, many times: the launch always raises and
    the new allocation is never written (it used to be, whenever it took the freed address)."""
    with mf.Stream() as s:
        for _ in range(20):
            a = mf.DeviceBuffer(512)
            with mf.graph_capture(s) as graph:
                a.memset_async(9, s)
            a.close()
            b = mf.DeviceBuffer(512)  # may or may not land on a's address: never written
            b.memset_async(0, s)
            with pytest.raises(mf.FeedError, match="freed after the capture"):
                graph.launch(s)
            s.synchronize()
            assert not np.asarray(b).any()
            graph.close()
            b.close()


def test_launch_after_pinned_destination_closed_is_refused():
    """A graph reading back into a PinnedBuffer closed after the capture: the launch used to
    write the freed block (a segfault: 1 MiB is unmapped when freed) or its new owner's. Now it
    raises and queues nothing, and the new owner keeps its bytes."""
    run_python("""
        import numpy as np, metrale_feed as mf
        with mf.Stream() as s, mf.DeviceBuffer(1 << 20) as dev, mf.DeviceBuffer(64) as cells:
            dev.memset_async(7, s)
            for i in range(20):
                pinned = mf.PinnedBuffer(1 << 20)
                with mf.graph_capture(s) as g:
                    mf.copy_d2h_async(dev, pinned, s)
                pinned.close()
                again = mf.PinnedBuffer(1 << 20)  # its address, before the fix
                try:
                    g.launch(s)
                except mf.FeedError as e:
                    assert "freed after the capture" in str(e), e
                else:
                    raise AssertionError("a launch after the free passed")
                s.synchronize()
                assert not np.frombuffer(again, np.uint8).any()
                g.close()
                again.close()
        print("ok")
    """, timeout=60)


def test_launch_after_raw_pinned_pointer_freed_is_refused():
    """The same through an int pointer of alloc_host_pinned (no object the graph could keep)."""
    run_python("""
        import metrale_feed as mf
        with mf.Stream() as s, mf.DeviceBuffer(1 << 20) as dev, mf.DeviceBuffer(64) as cells:
            dev.memset_async(0, s)
            for i in range(20):
                ptr = mf.alloc_host_pinned(1 << 20)
                with mf.graph_capture(s) as g:
                    mf.argmax_to_feed(dev, None, cells, ptr, None, s, rows=1, vocab=4,
                                      dtype="float32")
                mf.free_host_pinned(ptr, 1 << 20)
                again = mf.alloc_host_pinned(1 << 20)
                try:
                    g.launch(s)
                except mf.FeedError as e:
                    assert "freed after the capture" in str(e), e
                else:
                    raise AssertionError("a launch after the free passed")
                g.close()
                s.synchronize()
                mf.free_host_pinned(again, 1 << 20)
        print("ok")
    """, timeout=60)


# ---------------------------------------------------------------------------------------------
# Frees never wait (invariant 5)

FREES_IN_HOST_FUNCS = """
    import gc, sys, time, numpy as np, metrale_feed as mf
    def counts():
        gc.collect()
        return mf.live_objects()
    start = counts()
    with mf.Stream() as s:
        # 1. close() of a DeviceBuffer and of a PinnedBuffer in a host function
        d, p = mf.DeviceBuffer(64), mf.PinnedBuffer(64)
        d.memset_async(1, s)
        mf.launch_host_func(s, d.close)
        mf.launch_host_func(s, p.close)
        # 2. free_host_pinned in a host function
        ptr = mf.alloc_host_pinned(64)
        mf.launch_host_func(s, mf.free_host_pinned, ptr, 64)
        # 3. the last reference dropped there
        box = [mf.DeviceBuffer(64), mf.PinnedBuffer(64)]
        mf.launch_host_func(s, box.clear)
        # 4. a collection that frees an unrelated cycle holding a buffer
        class Cycle:
            pass
        c = Cycle(); c.me = c; c.buf = mf.DeviceBuffer(1 << 16)
        del c
        mf.launch_host_func(s, gc.collect)
        s.synchronize()
        # 5. on another stream than the one the host function runs on
        with mf.Stream() as other:
            busy = mf.DeviceBuffer(64)
            busy.memset_async(3, other)
            mf.launch_host_func(s, busy.close)
            s.synchronize()
            other.synchronize()
        # 6. a host function captured in a graph frees at each launch (cuda: the graph owns the
        # call, and the free goes to the reaper as an uncaptured one does)
        bufs = [mf.DeviceBuffer(64), mf.PinnedBuffer(64)]
        def close_one():
            if bufs:
                bufs.pop().close()
        with mf.graph_capture(s) as graph:
            mf.launch_host_func(s, close_one)
        graph.launch(s)
        graph.launch(s)
        s.synchronize()
        assert not bufs
        graph.close()
    deadline = time.monotonic() + 20  # polled: a margin for loaded machines
    while counts() != start and time.monotonic() < deadline:
        time.sleep(0.01)
    assert counts() == start, (start, counts())
    print("ok")
"""


def test_frees_inside_host_functions_do_not_deadlock():
    """Each used to deadlock its stream: every free waited for every stream, its own too."""
    result = run_python(FREES_IN_HOST_FUNCS, timeout=60)
    assert result.stdout.strip().endswith("ok")


def test_free_does_not_wait_for_unrelated_work():
    """A free with work queued on other streams returns at once (it used to wait for them: here
    forever); the memory goes, counted as released, once every stream has passed the work queued
    before the free, never earlier."""
    run_python("""
        import threading, time, metrale_feed as mf
        gate = threading.Event()
        with mf.Stream() as blocked, mf.Stream() as writer:
            mf.launch_host_func(blocked, gate.wait)
            buf = mf.DeviceBuffer(1 << 20)
            buf.memset_async(5, writer)
            before = mf.live_objects()
            t0 = time.monotonic()
            buf.close()
            assert time.monotonic() - t0 < 0.5
            time.sleep(0.05)
            assert mf.live_objects()["device_bytes"] == before["device_bytes"]  # queued behind
            gate.set()
            blocked.synchronize()
            writer.synchronize()
            deadline = time.monotonic() + 20  # polled: a margin for loaded machines
            while mf.live_objects()["device_bytes"] != before["device_bytes"] - (1 << 20):
                assert time.monotonic() < deadline, mf.live_objects()
                time.sleep(0.005)
        print("ok")
    """, timeout=30)


def test_sigint_during_a_free_with_queued_work_is_prompt():
    """SIGINT while a free's work is queued (7.5 s of it): the free returns at once, so the
    KeyboardInterrupt arrives within the interval, not after the queue drains."""
    result = run_python("""
        import os, signal, threading, time, metrale_feed as mf
        # A child of a background job inherits SIGINT ignored (POSIX shells do that without job
        # control), and Python then installs no handler: restore the default one.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        mf.configure_host(lag_us=2_500_000)
        s = mf.Stream()
        buf = mf.DeviceBuffer(64)
        for _ in range(3):
            buf.memset_async(1, s)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            buf.close()
            time.sleep(5)
        except KeyboardInterrupt:
            print("interrupted after", time.monotonic() - t0)
        mf.configure_host()
        os._exit(0)
    """, timeout=30)
    took = float(result.stdout.split()[-1])
    assert took < 0.5, result.describe()


# ---------------------------------------------------------------------------------------------
# Borrowed host buffers (invariant 6)


def test_bytearray_destination_is_released_when_its_copy_completes(host, no_leaks):
    with mf.DeviceBuffer(8) as d, mf.Stream() as s, mf.Event() as e:
        d.memset_async(4, s)
        dst = bytearray(8)
        mf.copy_d2h_async(d, dst, s)
        e.record(s)
        while not e.query():  # a poll, no wait: nothing else of the package runs meanwhile
            time.sleep(0.001)
        assert dst == b"\x04" * 8
        dst.extend(b"more")  # BufferError while it stayed exported


def test_dropped_destination_is_freed_when_its_copy_completes(host, no_leaks):
    with mf.DeviceBuffer(1 << 20) as d, mf.Stream() as s, mf.Event() as e:
        dst = np.empty(1 << 20, np.uint8)
        gone = weakref.ref(dst)
        mf.copy_d2h_async(d, dst, s)
        del dst
        e.record(s)
        while not e.query():
            time.sleep(0.001)
        assert gone() is None  # used to stay until some later call


def test_tensors_of_a_pick_given_no_event_stay_until_it_has_run(host, no_leaks):
    """A pick given no event records its tensors' keep-alive event itself, behind its work (one
    operation, rule 12): they outlast every release made before that work has run, then go."""
    mf.configure_host(lag_us=50_000)
    try:
        with mf.Stream() as s:
            logits = np.zeros((2, 8), np.float32)
            logits[:, 3] = 1
            cells = np.zeros(2, np.uint32)
            alive = weakref.ref(logits)
            mf.argmax_to_feed(logits, None, cells, None, None, s)
            del logits
            mf.live_objects()  # lets go of what has passed, this pick's tensors not among it
            gc.collect()
            assert alive() is not None
            s.synchronize()
            mf.live_objects()
            gc.collect()
            assert alive() is None
            assert cells.tolist() == [3, 3]
    finally:
        mf.configure_host()


def test_a_refused_pick_leaves_no_keep_alive_event(host, no_leaks):
    """The keep-alive event a pick was given is taken back when the C layer refuses the call
    (no_leaks counts the events)."""
    logits, cells = np.zeros((2, 8), np.float32), np.full(2, 7, np.uint32)
    for _ in range(100):
        with pytest.raises(ValueError, match="mask"):
            mf.argmax_to_feed(logits, [(9, mf.NO_TOKEN)] * 2, cells, None, None)  # id 9 >= vocab
    mf.stream_synchronize()
    assert cells.tolist() == [7, 7]


def test_a_captured_pick_given_no_event_records_no_event_of_ours(host, no_leaks):
    """In a capture the graph keeps the tensors (rule 4): the pick records no keep-alive event,
    which a replay would record again after the event went (live_objects destroys the spares)."""
    logits, cells = np.zeros((2, 8), np.float32), np.zeros(2, np.uint32)
    with mf.Stream() as s:
        with mf.graph_capture(s) as graph:
            mf.argmax_to_feed(logits, None, cells, None, None, s)
        mf.live_objects()
        for i in range(3):
            logits[:] = 0
            logits[:, i + 1] = 1
            graph.launch(s)
            s.synchronize()
            assert cells.tolist() == [i + 1] * 2
        graph.close()


def test_host_function_error_on_a_closed_stream_frees_its_frame(host, no_leaks, monkeypatch):
    """An exception of a host function that ran after its stream was closed cannot be reported
    by a wait any more: it goes to sys.unraisablehook, and its frame (and what it referenced)
    is freed."""
    import threading

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))

    class Big:
        pass

    gate = threading.Event()
    big = Big()
    gone = weakref.ref(big)

    def fails(obj):
        raise ValueError("late")

    s = mf.Stream()
    mf.launch_host_func(s, gate.wait)
    mf.launch_host_func(s, fails, big)
    del big
    s.close()  # unsynchronised: both still queued
    gate.set()
    deadline = time.monotonic() + 20  # polled: a margin for loaded machines
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    assert gone() is None
    assert any("late" in text and "closed" in text for text in seen), seen


def test_closed_streams_that_ran_host_functions_leave_nothing(host, no_leaks):
    import tracemalloc

    def cycle(n):
        for _ in range(n):
            with mf.Stream() as s:
                mf.launch_host_func(s, int)
                s.synchronize()

    cycle(50)
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    cycle(1000)
    gc.collect()
    grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(base, "filename"))
    tracemalloc.stop()
    assert grown < 20_000, grown  # ~78 bytes a stream (80 kB) before


# ---------------------------------------------------------------------------------------------
# What a capture takes (invariant 4)


def test_graph_copies_through_pinned_views(host, no_leaks):
    """np.frombuffer(pinned) and memoryview(pinned) in a capture: the graph holds the views and
    replays into the pinned memory (it used to fail at launch: "unknown or destroyed event")."""
    with mf.Stream() as s, mf.DeviceBuffer(16) as dev, mf.PinnedBuffer(16) as up, \
            mf.PinnedBuffer(16) as down:
        with mf.graph_capture(s) as graph:
            mf.copy_h2d_async(dev, memoryview(up), s)
            mf.copy_d2h_async(dev, np.frombuffer(down, np.uint32), s)
        for step in range(3):
            values = np.arange(4, dtype=np.uint32) * (step + 2)
            np.frombuffer(up, np.uint32)[:] = values
            graph.launch(s)
            s.synchronize()
            assert np.frombuffer(down, np.uint32).tolist() == values.tolist()
        with pytest.raises(BufferError):
            down.close()  # the graph's view is still exported
        graph.close()
        gc.collect()


def test_graph_replays_cpu_dlpack_arrays(host, no_leaks):
    """numpy arrays (DLPack CPU tensors) as logits and cells: the graph keeps and re-lends
    them at each launch (they used to fail every launch: "not a live device allocation")."""
    rows, vocab = 3, 40
    logits = np.zeros((rows, vocab), np.float32)
    cells = np.zeros(rows, np.uint32)
    with mf.Stream() as s, mf.PinnedBuffer(rows * 4) as ids, mf.Event() as done:
        with mf.graph_capture(s) as graph:
            mf.argmax_to_feed(logits, None, cells, ids, done, s, rows=rows, vocab=vocab,
                              dtype="float32")
        rng = np.random.default_rng(0)
        for _ in range(3):
            logits[:] = rng.standard_normal((rows, vocab)).astype(np.float32)
            graph.launch(s)
            done.synchronize()
            assert np.frombuffer(ids, np.uint32).tolist() == logits.argmax(axis=1).tolist()
            assert cells.tolist() == logits.argmax(axis=1).tolist()
        graph.close()


def test_pageable_logprobs_destination_is_refused_in_a_capture(backend, no_leaks):
    rows, vocab = 2, 16
    with mf.Stream() as s, mf.DeviceBuffer(rows * vocab * 4) as logits, \
            mf.DeviceBuffer(rows * 4) as cells, mf.DeviceBuffer(rows * 4) as lp, \
            mf.PinnedBuffer(rows * 4) as ids:
        logits.memset_async(0, s)
        s.synchronize()
        with mf.graph_capture(s) as graph:
            with pytest.raises(mf.FeedError, match="pageable host memory during a graph capture"):
                mf.argmax_to_feed(logits, None, cells, ids, None, s, rows=rows, vocab=vocab,
                                  dtype="float32", logprobs=lp,
                                  logprobs_dst=np.zeros(rows, np.float32))
        graph.close()


def test_dropped_unended_capture_ends_its_capture(backend, no_leaks):
    with mf.Stream() as s, mf.DeviceBuffer(8) as buf:
        capture = mf.graph_capture(s)
        capture.__enter__()
        buf.memset_async(1, s)
        assert mf.stream_capturing(s)
        del capture
        gc.collect()
        assert not mf.stream_capturing(s)  # capturing forever before
        s.synchronize()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_fork_while_a_free_is_queued():
    """A free still queued behind a blocked stream at fork(): the child's ledger does not count
    it (no worker of the parent runs there to perform it) and the child frees its own memory at
    once; the parent performs it once its stream passes."""
    run_python("""
        import os, threading, time, metrale_feed as mf
        gate = threading.Event()
        s = mf.Stream()
        mf.launch_host_func(s, gate.wait)
        start = mf.live_objects()["device_bytes"]
        buf = mf.DeviceBuffer(4096)
        buf.memset_async(1, s)
        buf.close()  # queued behind the gate
        assert mf.live_objects()["device_bytes"] == start + 4096
        pid = os.fork()
        if pid == 0:
            ok = mf.live_objects()["device_bytes"] == start
            own = mf.DeviceBuffer(64)
            own.close()
            ok = ok and mf.live_objects()["device_bytes"] == start
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        gate.set()
        s.synchronize()
        deadline = time.monotonic() + 20  # polled: a margin for loaded machines
        while mf.live_objects()["device_bytes"] != start:
            assert time.monotonic() < deadline, mf.live_objects()
            time.sleep(0.005)
        s.close()
        print("ok")
    """, timeout=30)
