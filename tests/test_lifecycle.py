"""The process around the package: fork(), signals, and exit, each in a child interpreter (a hang
or a crash there fails the test, with a timeout). docs/host-backend.md states the behaviour."""

from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest

import metrale_feed as mf
from helpers.child import run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

# ---------------------------------------------------------------------------------------------
# fork()
# ---------------------------------------------------------------------------------------------

FORK_AFTER_USE = """
    import os, sys, numpy as np, metrale_feed as mf
    mf.configure_host(lag_us=20_000)
    stream, event = mf.Stream(), mf.Event()
    dev = mf.DeviceBuffer(16)
    mf.copy_h2d_async(dev, np.arange(4, dtype=np.uint32))  # stream 0 used, work queued
    mf.copy_h2d_async(dev, np.arange(4, dtype=np.uint32), stream)
    event.record(stream)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            mf.configure_host()
            # The backend works in the child: stream 0, a new stream, events, copies.
            mine, done = mf.Stream(), mf.Event()
            buf = mf.DeviceBuffer(16)
            mf.copy_h2d_async(buf, np.arange(10, 14, dtype=np.uint32), mine)
            out = np.zeros(4, np.uint32)
            mf.copy_d2h_async(buf, out, mine)
            done.record(mine)
            done.synchronize()
            mf.stream_synchronize(0)
            assert out.tolist() == [10, 11, 12, 13], out
            # The parent's objects say they were created before the fork.
            for call in (event.synchronize, event.query, stream.synchronize,
                         lambda: mf.stream_synchronize(stream.handle),
                         lambda: mf.event_record(event, 0)):
                try:
                    call()
                    raise AssertionError(f"{call} worked on a parent's object")
                except mf.FeedError as error:
                    assert "before fork()" in str(error), error
            mine.close(); done.close(); buf.close()
            print("child ok", flush=True)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    mf.configure_host()
    event.synchronize(); stream.synchronize(); mf.stream_synchronize()
    print("parent ok")
"""


def test_a_forked_child_gets_a_working_host_backend():
    out = run_python(FORK_AFTER_USE, timeout=60).stdout.split("\n")
    assert "child ok" in out and "parent ok" in out


FORK_POOL = """
    import multiprocessing as mp, numpy as np, metrale_feed as mf

    def work(i):
        dev = mf.DeviceBuffer(4)
        mf.copy_h2d_async(dev, np.array([i * 7], np.uint32))
        out = np.zeros(1, np.uint32)
        mf.copy_d2h_async(dev, out)
        mf.stream_synchronize()
        return int(out[0])

    mf.configure_host(lag_us=2_000)
    warm = mf.Stream()
    for _ in range(20):
        mf.DeviceBuffer(8).memset_async(1, warm)   # work queued while the pool forks
    mf.stream_synchronize(0)
    with mp.get_context("fork").Pool(2) as pool:
        print(pool.map(work, range(8)))
    warm.close()
"""


def test_a_fork_pool_does_not_hang():
    out = run_python(FORK_POOL, timeout=90).stdout.strip()
    assert out == str([i * 7 for i in range(8)])


@pytest.mark.gpu
def test_a_forked_child_of_a_cuda_process_gets_a_clear_error():
    out = run_python("""
        import os, metrale_feed as mf
        stream = mf.Stream(); mf.DeviceBuffer(16).memset_async(0, stream); stream.synchronize()
        pid = os.fork()
        if pid == 0:
            try:
                mf.Stream()
                os._exit(3)
            except mf.FeedError as error:
                os._exit(0 if "fork" in str(error) else 4)
            except BaseException:
                os._exit(5)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """, backend="cuda", timeout=60).stdout.strip()
    assert out == "0"


# ---------------------------------------------------------------------------------------------
# Ctrl-C during a long wait
# ---------------------------------------------------------------------------------------------

CTRL_C = """
    import os, signal, threading, time, metrale_feed as mf
    # A child of a background job inherits SIGINT ignored (POSIX shells do that without job
    # control), and Python then installs no handler: restore the default one.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mf.configure_host(lag_us=10_000_000)  # each op takes 10 s: far past any scheduling delay
    stream, event = mf.Stream(), mf.Event()
    buf = mf.DeviceBuffer(8)  # kept: freeing it would wait for the memset before the waits start
    buf.memset_async(0, stream)
    event.record(stream)
    waits = {"Event.synchronize": event.synchronize,
             "event_synchronize": lambda: mf.event_synchronize(event.handle),
             "Stream.synchronize": stream.synchronize,
             "stream_synchronize": lambda: mf.stream_synchronize(stream)}
    worst = 0.0
    for name, wait in waits.items():
        sent = []
        def interrupt():
            time.sleep(0.2)
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt).start()
        try:
            wait()
            raise SystemExit(f"{name} returned: the work should take seconds")
        except KeyboardInterrupt:
            latency = time.monotonic() - sent[0]
        worst = max(worst, latency)
        print(name, f"{latency * 1000:.1f}")
    print("worst_ms", f"{worst * 1000:.1f}")
    mf.configure_host()
    os._exit(0)  # the exit policy is its own test
"""


def test_ctrl_c_ends_a_long_wait_within_100_ms():
    out = run_python(CTRL_C, timeout=60).stdout.split()
    worst = float(out[out.index("worst_ms") + 1])
    assert worst < 100, out


def test_exit_with_queued_work_does_not_wait_for_it():
    """The exit policy: queued work is abandoned at exit (docs/host-backend.md), so an exit with
    minutes of work queued takes no longer than an exit with none."""
    result = run_python("""
        import time, metrale_feed as mf
        mf.configure_host(lag_us=2_000_000)
        streams = [mf.Stream() for _ in range(3)]
        buffers = [mf.DeviceBuffer(8) for _ in range(4)]
        for s, buf in zip(streams + [0], buffers):
            for _ in range(30):
                buf.memset_async(0, s)   # 30 x 2 s per stream, into buffers live at exit
        print("queued")
    """, timeout=20)
    assert result.stdout.strip() == "queued"


# ---------------------------------------------------------------------------------------------
# Shutdown while closed streams drain, with tracing on
# ---------------------------------------------------------------------------------------------

SHUTDOWN = """
    import metrale_feed as mf
    mf._core.trace_enable(1 << 16)
    mf.configure_host(lag_us=300)
    for i in range(6):
        s = mf.Stream(non_blocking=bool(i % 2))
        buf = mf.DeviceBuffer(64)
        for _ in range(8):
            buf.memset_async(i, s)
        mf.Event().record(s)
        s.close()          # still draining when the interpreter finalises
    mf.DeviceBuffer(8).memset_async(0)
"""


def test_exit_while_closed_streams_drain_with_tracing_is_clean_100_times():
    def one(_):
        return run_python(SHUTDOWN, timeout=60, check=False)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(100)))
    bad = [r for r in results if r.returncode != 0]
    assert not bad, f"{len(bad)} of 100 exits failed; the first:\n{bad[0].describe()}"
