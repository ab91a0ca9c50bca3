"""Host functions in graphs: ``launch_host_func`` on a capturing stream is an operation of the
graph (CUDA's host node), run at each launch with the same arguments, in the launch's stream
order; its exception is reported once, on the launch stream, by the next query or synchronize of
that stream or of an event recorded after it; its callable and arguments live as long as the
graph and its queued launches (docs/graphs.md, "Host functions in a graph")."""

import gc
import threading
import weakref

import numpy as np
import pytest

import metrale_feed as mf
from test_regressions import run_child


def test_a_host_function_runs_at_each_launch_in_stream_order(backend, no_leaks):
    with mf.Stream() as s, mf.PinnedBuffer(4) as staged, mf.DeviceBuffer(4) as dev, \
            mf.PinnedBuffer(4) as back:
        seen = []
        with mf.graph_capture(s) as graph:
            mf.copy_h2d_async(dev, staged, s)
            mf.copy_d2h_async(dev, back, s)
            # Reads what the copies before it in the graph left: stream order at each launch.
            mf.launch_host_func(s, lambda tag: seen.append((tag, bytes(back))), "node")
        assert seen == []  # recorded, not run
        for i in range(4):
            np.frombuffer(staged, np.uint8)[:] = [i, i + 1, i + 2, 7]
            graph.launch(s)
            s.synchronize()
            assert seen[-1] == ("node", bytes([i, i + 1, i + 2, 7])), seen
        assert len(seen) == 4
        graph.close()


def test_launches_queued_back_to_back_run_the_node_once_each(backend, no_leaks):
    with mf.Stream() as s, mf.Stream() as other:
        order = []
        with mf.graph_capture(s) as graph:
            mf.launch_host_func(s, order.append, "a")
            mf.launch_host_func(s, order.append, "b")
        for _ in range(5):
            graph.launch(s)
        s.synchronize()  # a graph runs on one stream at a time
        graph.launch(other)  # any stream: run in that stream's order
        other.synchronize()
        assert order == ["a", "b"] * 6
        graph.close()


def test_an_exception_at_a_replay_is_reported_once_on_the_launch_stream(backend, no_leaks):
    calls = []

    def maybe(x):
        calls.append(x)
        if len(calls) % 2 == 0:
            raise KeyError(f"replay {len(calls)}")

    with mf.Stream() as s, mf.Stream() as launch, mf.Event() as before, mf.Event() as after:
        with mf.graph_capture(s) as graph:
            before.record(s)
            mf.launch_host_func(s, maybe, "x")
            after.record(s)
        graph.launch(launch)  # replay 1: no error
        after.synchronize()
        before.synchronize()
        graph.launch(launch)  # replay 2 raises
        before.synchronize()  # recorded before the node: it never reports it
        with pytest.raises(mf.HostFunctionError, match="KeyError") as info:
            after.synchronize()  # a fault of queued work: a DeviceError, typed (not a refusal)
        assert isinstance(info.value.__cause__, KeyError) and "replay 2" in str(info.value)
        after.synchronize()   # reported once
        launch.synchronize()
        s.synchronize()       # the capturing stream ran nothing: nothing to report there
        graph.launch(launch)  # replay 3: no error
        graph.launch(launch)  # replay 4 raises: the stream reports it
        with pytest.raises(mf.FeedError, match="replay 4"):
            launch.synchronize()
        launch.synchronize()
        assert calls == ["x"] * 4
        graph.close()


def test_an_event_recorded_eagerly_after_a_launch_reports_its_node(backend, no_leaks):
    def boom():
        raise ZeroDivisionError("in the graph")

    with mf.Stream() as s, mf.Event() as done:
        with mf.graph_capture(s) as graph:
            mf.launch_host_func(s, boom)
        graph.launch(s)
        done.record(s)
        with pytest.raises(mf.HostFunctionError, match="in the graph") as info:
            done.synchronize()
        assert isinstance(info.value, mf.DeviceError) and isinstance(info.value.__cause__, ZeroDivisionError)
        s.synchronize()
        graph.close()


def test_the_graph_keeps_the_callable_and_arguments_alive(backend, no_leaks):
    class Payload:
        pass

    got = []
    p = Payload()
    alive = weakref.ref(p)
    with mf.Stream() as s:
        with mf.graph_capture(s) as graph:
            mf.launch_host_func(s, lambda q: got.append(q), p)
        del p
        gc.collect()
        assert alive() is not None
        graph.launch(s)
        graph.launch(s)
        s.synchronize()
        assert len(got) == 2 and got[0] is got[1] is alive()
        got.clear()
        graph.close()
        gc.collect()
        assert alive() is None  # closed, no launch queued: released


def test_a_graph_closed_with_launches_queued_still_runs_its_nodes(host, no_leaks):
    # The launches hold the node: closing and dropping the graph before they run frees nothing
    # they use.
    class Payload:
        pass

    release = threading.Event()
    got = []
    p = Payload()
    alive = weakref.ref(p)
    with mf.Stream() as s:
        with mf.graph_capture(s) as graph:
            mf.launch_host_func(s, lambda q: got.append(type(q).__name__), p)
        mf.launch_host_func(s, release.wait, 10)
        graph.launch(s)
        graph.launch(s)
        graph.close()
        del graph, p
        gc.collect()
        assert alive() is not None
        release.set()
        s.synchronize()
        assert got == ["Payload", "Payload"]
        gc.collect()
        assert alive() is None


def test_a_failed_launch_undoes_its_bookkeeping(host, no_leaks):
    ran = []
    with mf.Stream() as s, mf.DeviceBuffer(8) as dev, mf.Event() as done:
        with mf.graph_capture(s) as graph:
            mf.launch_host_func(s, ran.append, 1)
            dev.memset_async(0, s)
            done.record(s)
        dev.close()
        with pytest.raises(mf.FeedError):
            graph.launch(s)  # the host backend checks the memory first: nothing queued
        done.record(s)
        done.synchronize()
        s.synchronize()
        assert ran == []
        graph.close()


def test_exit_with_graph_host_functions_queued_is_clean():
    out = run_child("""
        import metrale_feed as mf
        s = mf.Stream()
        with mf.graph_capture(s) as g:
            mf.launch_host_func(s, print, "ran")
        mf.configure_host(lag_us=200_000)
        for _ in range(3):
            g.launch(s)
        g.close()
        print("exiting")
    """, timeout=30)
    assert "exiting" in out


@pytest.mark.gpu
def test_a_host_function_in_a_foreign_capture_runs_at_each_replay():
    # torch's own capture API: no Graph of ours counts the launches, so the node is kept for the
    # process's life and its runs take no reference (a child: a refcount error would crash).
    pytest.importorskip("torch")
    from helpers.child import run_python

    done = run_python("""
        import torch, metrale_feed as mf
        assert mf.backend() == "cuda"
        side, got = torch.cuda.Stream(), []
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            x = torch.zeros(4, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=side):
                x += 1
                mf.launch_host_func(torch.cuda.current_stream(), got.append, "node")
        for _ in range(4):
            graph.replay()
        torch.cuda.synchronize()
        assert got == ["node"] * 4, got
        print("OK foreign", x.tolist())
    """, backend="cuda", timeout=120)
    assert "OK foreign [4.0, 4.0, 4.0, 4.0]" in done.stdout, done.describe()
