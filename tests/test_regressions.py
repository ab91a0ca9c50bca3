"""Regressions: each of these once crashed, hung or released a wait too early.
The risky ones run in a child interpreter so that a crash fails the test, not the run."""

import threading
import time

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.feed import NO_TOKEN
from metrale_feed.kv import SequenceState
from metrale_feed.testing.reference import ReferenceModel, host_next_token

from helpers.child import run_python


def run_child(code, timeout=60):
    """Run ``code`` in a child interpreter on the host backend; its stdout (a failure fails the test)."""
    return run_python(code, timeout=timeout).stdout


def test_a_huge_len_is_refused_before_any_allocation():
    out = run_child("""
        import metrale_feed as mf
        class Huge:
            def __init__(self, n): self.n = n
            def __len__(self): return self.n
            def __getitem__(self, i): return 0
        cells, out = mf.DeviceBuffer(64), mf.DeviceBuffer(64)
        for n in (2**61, 2**62, 8193):
            try:
                mf.resolve_feed(Huge(n), cells, out, prev_rows=1)
            except ValueError as error:
                print("refused", "at most" in str(error))
        try:
            mf.argmax_to_feed(cells, Huge(2**61), cells, None, None, rows=2, vocab=4, dtype="float32")
        except ValueError as error:
            print("refused", "at most" in str(error))
    """)
    assert out.split() == ["refused", "True"] * 4


def test_a_position_past_the_cache_does_not_hang_the_forward():
    out = run_child("""
        import numpy as np, metrale_feed as mf
        ids, meta, tables = mf.DeviceBuffer(4), mf.DeviceBuffer(8), mf.DeviceBuffer(4)
        kv, logits = mf.DeviceBuffer(64), mf.DeviceBuffer(16 * 4)
        mf.copy_h2d_async(meta, np.array([0xFFFFFFFF, 0], np.uint32))
        mf._core.reference_forward(ids, meta, tables, kv, 16, 4, 1, 16, "float32", logits)
        mf.stream_synchronize()
        got = bytearray(64)
        mf.copy_d2h_async(logits, got); mf.stream_synchronize()
        print("done")
    """, timeout=30)
    assert out.strip() == "done"


def test_a_wait_is_for_the_record_current_when_it_was_made(host, no_leaks):
    """A later record of the same event on an idle stream must not release a wait on an earlier
    record that is still queued behind slow work (CUDA's semantics)."""
    busy = mf.DeviceBuffer(1 << 20)
    try:
        with mf.Stream() as a, mf.Stream() as b, mf.Stream() as c, mf.Event() as event, \
                mf.Event() as c_done, mf.Event() as a_done:
            host.configure_host(lag_us=40_000)  # every op waits 40 ms before it runs
            busy.memset_async(1, a)
            busy.memset_async(2, a)
            event.record(a)                     # runs at about 120 ms
            a_done.record(a)
            c.wait_event(event)
            c_done.record(c)
            event.record(b)                     # a newer record, on an idle stream: ~40 ms
            event.synchronize()                 # waits for the record on b only
            assert not a_done.query()
            assert not c_done.query(), "the wait on the earlier record was released by a later one"
            c_done.synchronize()
            a_done.synchronize()  # c_done and a_done both run one op after the record on a:
            assert a_done.query()  # either may finish first, so neither is asked before its wait
    finally:
        host.configure_host()
        mf.stream_synchronize()
        busy.close()


def test_closing_an_event_while_another_thread_waits_on_it(host, no_leaks):
    event = mf.Event()
    host.configure_host(lag_us=50_000)
    with mf.Stream() as stream:
        event.record(stream)
        outcome = []

        def wait():
            try:
                event.synchronize()
                outcome.append("returned")
            except mf.FeedError:
                outcome.append("FeedError")  # destroyed between two slices of the wait

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.01)
        event.close()  # a wait in progress keeps the event alive until it leaves the C layer
        waiter.join(5)
        assert not waiter.is_alive() and outcome in (["returned"], ["FeedError"])
        host.configure_host()
        stream.synchronize()


def test_router_takes_masks_none(host, no_leaks):
    with ReferenceModel(64, block_size=4, num_blocks=16, max_rows=2) as model, \
            mf.AsyncDeviceIo(model, 2) as io:
        seq = SequenceState(0)
        ticket = io.launch_decode([4], [seq], None)
        assert io.await_result(ticket) == [host_next_token([4], 64)]
        model.release_sequence(seq)


def test_a_copy_into_a_foreign_buffer_lets_it_go_at_synchronize(host, no_leaks, dev):
    source = dev.upload(np.arange(4, dtype=np.uint32))
    target = bytearray(16)
    mf.copy_d2h_async(source, target)
    mf.stream_synchronize()
    target.extend(b"x")  # no export left behind: a resize is allowed
    assert bytes(target[:16]) == np.arange(4, dtype=np.uint32).tobytes()
    source.close()


def test_a_zero_byte_copy_at_one_past_the_end_of_an_allocation_is_accepted():
    # Found by the runtime state machine: copy_d2d_async(dst.ptr + len, src.ptr, 0) was refused
    # as "not a live device allocation" although it touches nothing (memcpy's end pointer).
    with mf.DeviceBuffer(1) as a, mf.DeviceBuffer(1) as b:
        mf.copy_d2d_async(b.ptr + 1, a.ptr, 0)
        mf.copy_d2d_async(b.ptr, a.ptr + 1, 0)
        mf.stream_synchronize()
        with pytest.raises(mf.FeedError, match="not a live device allocation"):
            mf.copy_d2d_async(b.ptr + 1, a.ptr, 1)  # one byte there is past the end
