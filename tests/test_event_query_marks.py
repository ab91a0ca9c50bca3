"""A query of an event that has completed answers from its slot's done mark, without pinning the
slot (registry.hpp, Slot). The mark must never outlive what it says: a record after it, a kernel
or a graph replay that records the event, a destroy (even with the slot reused by a new event),
an armed query fault and a fork() each make the next query ask again."""

from __future__ import annotations

import os
from array import array

import pytest

import metrale_feed as mf
from helpers.child import run_python

LAG_US = 200_000  # long enough that a record is still queued when the query right after it runs


def completed_and_marked(handle):
    mf.event_record(handle, 0)
    mf.event_synchronize(handle)
    # The first query leaves the mark, the next ones answer from it.
    assert all(mf.event_query(handle) for _ in range(3))


def test_a_destroyed_handle_is_refused_even_with_its_slot_reused(host, no_leaks):
    handle = mf.event_create()
    completed_and_marked(handle)
    mf.destroy_event(handle)
    with pytest.raises(mf.InvalidHandleError, match="destroyed"):
        mf.event_query(handle)
    # A new event takes the freed slot (same low word, the next generation).
    made, reused = [], None
    for _ in range(64):
        new = mf.event_create()
        made.append(new)
        if new & 0xFFFFFFFF == handle & 0xFFFFFFFF:
            reused = new
            break
    assert reused is not None and reused != handle
    try:
        for _ in range(3):
            with pytest.raises(mf.InvalidHandleError, match="destroyed"):
                mf.event_query(handle)
        # The new event of that slot has its own state: pending while its record is queued.
        host.configure_host(lag_us=LAG_US)
        mf.event_record(reused, 0)
        assert not mf.event_query(reused)
        with pytest.raises(mf.InvalidHandleError):
            mf.event_query(handle)
        mf.event_synchronize(reused)
        assert mf.event_query(reused)
    finally:
        host.configure_host()
        mf.stream_synchronize(0)
        for new in made:
            mf.destroy_event(new)


def test_a_record_after_the_mark_is_seen(host, no_leaks):
    with mf.Event() as event:
        completed_and_marked(event.handle)
        host.configure_host(lag_us=LAG_US)
        try:
            for _ in range(2):
                event.record(0)
                assert not event.query() and not mf.event_query(event.handle)
                event.synchronize()
                assert event.query() and event.query()
        finally:
            host.configure_host()
            mf.stream_synchronize(0)


def test_a_kernel_that_records_the_event_after_the_mark_is_seen(host, no_leaks):
    with mf.Event() as event, mf.DeviceBuffer(16 * 4) as logits, mf.DeviceBuffer(4) as cells, \
            mf.PinnedBuffer(4) as dst:
        completed_and_marked(event.handle)
        host.configure_host(lag_us=LAG_US)
        try:
            mf.argmax_to_feed(logits, array("I", [3, mf.NO_TOKEN]), cells, dst, event, 0, rows=1,
                              vocab=16, dtype="float32")
            assert not event.query()
            event.synchronize()
            assert event.query() and event.query()
        finally:
            host.configure_host()
            mf.stream_synchronize(0)


def test_a_graph_replay_that_records_the_event_after_the_mark_is_seen(host, no_leaks):
    with mf.Stream() as stream, mf.Event() as event:
        with mf.graph_capture(stream) as graph:
            event.record(stream)
        completed_and_marked(event.handle)
        host.configure_host(lag_us=LAG_US)
        try:
            graph.launch(stream)
            assert not event.query()
            stream.synchronize()
            assert event.query() and event.query()
        finally:
            host.configure_host()
            stream.synchronize()
            graph.close()


def test_an_armed_query_fault_fires_on_a_marked_event(host, no_leaks):
    with mf.Event() as event:
        completed_and_marked(event.handle)
        host.configure_host(fail_event_query_at=2)
        assert event.query()
        with pytest.raises(mf.InjectedFault, match="event_query"):
            event.query()
        host.configure_host()
        assert event.query() and event.query()


def test_a_query_racing_records_never_answers_done_for_a_record_that_returned(host, no_leaks):
    # One thread records, with the stream lagging, and queries right after each record returned;
    # others query the same event all along, leaving marks. A stale mark would answer True.
    import threading

    stop = threading.Event()

    with mf.Event() as event:
        completed_and_marked(event.handle)

        def hammer():
            while not stop.is_set():
                mf.event_query(event.handle)

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for thread in threads:
            thread.start()
        host.configure_host(lag_us=LAG_US)  # far longer than the hammering threads hold the GIL
        try:
            for _ in range(8):
                event.record(0)
                assert not event.query()
                event.synchronize()
                assert event.query()
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            host.configure_host()
            mf.stream_synchronize(0)


FORK_MARKED = """
    import os, metrale_feed as mf
    event = mf.Event()
    event.record(0)
    event.synchronize()
    assert event.query() and event.query()  # marked
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for _ in range(2):
                try:
                    event.query()
                    raise AssertionError("a parent's event answered in the child")
                except mf.InvalidHandleError as error:
                    assert "before fork()" in str(error), error
            print("child ok", flush=True)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert event.query()
    event.close()
    print("parent ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_refuses_a_parent_event_that_was_marked():
    out = run_python(FORK_MARKED, timeout=60).stdout.split("\n")
    assert "child ok" in out and "parent ok" in out


def test_an_int_handle_out_of_range_is_refused_as_before(host):
    for bad in (-1, 2**64, -(2**70)):
        with pytest.raises(ValueError, match="is not a 64-bit handle"):
            mf.event_query(bad)
    with pytest.raises(mf.InvalidHandleError):
        mf.event_query(2**64 - 1)
    with pytest.raises(TypeError, match="expected an Event or an int handle"):
        mf.event_query(True)
    with mf.Event() as event:

        class Handle(int):
            pass

        assert mf.event_query(Handle(event.handle))  # an int subclass takes the checked path
