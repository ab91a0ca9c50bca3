"""Graphs: graph_capture / Graph.launch / Graph.close on both backends. A replay reads its
device-resident inputs when it runs (new values each launch, checked against the numpy oracle and
against the same operations queued eagerly); host-side inputs are refused during a capture; bad
input gets clear exceptions; nothing leaks."""

import gc

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.testing.oracle import reference_argmax

ROWS, VOCAB = 5, 300
WORDS = (VOCAB + 31) // 32


def words_of(bits):
    """int32 bitmask words [rows, ceil(vocab / 32)] of a boolean [rows, vocab] array."""
    rows, vocab = bits.shape
    words = np.zeros((rows, (vocab + 31) // 32), np.uint32)
    for v in range(vocab):
        words[:, v // 32] |= bits[:, v].astype(np.uint32) << np.uint32(v % 32)
    return words.view(np.int32)


class Inputs:
    """Pinned staging of one argmax step and its device copies; the graph copies them in."""

    def __init__(self):
        self.host_logits = mf.PinnedBuffer(ROWS * VOCAB * 4)
        self.host_masks = mf.PinnedBuffer(ROWS * 8)
        self.host_bits = mf.PinnedBuffer(ROWS * WORDS * 4)
        self.logits = mf.DeviceBuffer(ROWS * VOCAB * 4)
        self.masks = mf.DeviceBuffer(ROWS * 8)
        self.bits = mf.DeviceBuffer(ROWS * WORDS * 4)
        self.cells = mf.DeviceBuffer(ROWS * 4)
        self.dst = mf.PinnedBuffer(ROWS * 4)
        self.done = mf.Event()

    def fill(self, rng):
        logits = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
        logits[0, :7] = np.nan if rng.random() < 0.5 else np.inf
        masks = rng.integers(0, VOCAB, (ROWS, 2)).astype(np.uint32)
        masks[1] = mf.NO_TOKEN
        bits = words_of(rng.random((ROWS, VOCAB)) < rng.choice([0.02, 0.3, 1.0]))
        bits[2] = 0  # a row with no allowed id
        np.frombuffer(self.host_logits, np.float32)[:] = logits.ravel()
        np.frombuffer(self.host_masks, np.uint32)[:] = masks.ravel()
        np.frombuffer(self.host_bits, np.int32)[:] = bits.ravel()
        return reference_argmax(logits, masks, bits)

    def queue(self, stream):
        mf.copy_h2d_async(self.logits, self.host_logits, stream)
        mf.copy_h2d_async(self.masks, self.host_masks, stream)
        mf.copy_h2d_async(self.bits, self.host_bits, stream)
        mf.argmax_to_feed(self.logits, self.masks, self.cells, self.dst, self.done, stream,
                          rows=ROWS, vocab=VOCAB, dtype="float32", bitmask=self.bits)

    def ids(self):
        return np.frombuffer(self.dst, np.uint32).copy()

    def close(self):
        for buf in (self.host_logits, self.host_masks, self.host_bits, self.logits, self.masks,
                    self.bits, self.cells, self.dst, self.done):
            buf.close()


@pytest.fixture
def inputs(backend):
    made = Inputs()
    yield made
    mf.stream_synchronize(0)
    made.close()


def test_argmax_replays_read_new_device_inputs(backend, no_leaks, inputs):
    rng = np.random.default_rng(5)
    with mf.Stream() as stream:
        inputs.fill(rng)
        inputs.queue(stream)  # a warm-up launch: cuda allocates its split scratch on the first
        inputs.done.synchronize()
        with mf.graph_capture(stream) as graph:
            inputs.queue(stream)
        assert mf.live_objects()["graphs"] == no_leaks.start["graphs"] + 1
        for step in range(6):
            want = inputs.fill(rng)  # new values in the pinned staging, after the last replay
            graph.launch(stream)
            inputs.done.synchronize()
            assert np.array_equal(inputs.ids(), want), step
            assert inputs.ids()[2] == mf.NO_TOKEN
            # The same operations queued one by one give the same ids.
            inputs.queue(stream)
            inputs.done.synchronize()
            assert np.array_equal(inputs.ids(), want), step
        graph.close()


def test_a_graph_launches_on_another_stream_and_the_event_completes(backend, no_leaks, inputs):
    rng = np.random.default_rng(6)
    with mf.Stream() as capture, mf.Stream() as other:
        inputs.fill(rng)
        inputs.queue(capture)
        inputs.queue(other)
        mf.stream_synchronize(0)
        other.synchronize()
        capture.synchronize()
        with mf.graph_capture(capture) as graph:
            inputs.queue(capture)
        want = inputs.fill(rng)
        graph.launch(other)
        other.synchronize()  # the event recorded by the replay completes with its stream
        assert inputs.done.query()
        assert np.array_equal(inputs.ids(), want)
        graph.close()


def test_event_in_a_graph_is_recorded_at_each_launch(host, no_leaks):
    """An event recorded inside a capture is a node of the graph: each launch records it again,
    so it is pending while the replay's earlier work runs (the host lag makes that observable)."""
    with mf.Stream() as stream, mf.DeviceBuffer(64) as buf, mf.Event() as done:
        with mf.graph_capture(stream) as graph:
            mf.copy_d2d_async(buf, buf, 16, stream)
            done.record(stream)
        assert done.query()  # the capture recorded nothing
        mf.configure_host(lag_us=20000)
        graph.launch(stream)
        assert not done.query()
        done.synchronize()
        mf.configure_host()
        graph.launch(stream)
        done.synchronize()
        graph.close()


def test_resolve_replays_read_new_device_sources(backend, no_leaks, dev):
    rng = np.random.default_rng(7)
    n, prev_rows = 9, 6
    with mf.Stream() as stream, mf.PinnedBuffer(n * 4) as host_sources, \
            mf.PinnedBuffer(prev_rows * 4) as host_cells, mf.PinnedBuffer(n * 4) as out_host, \
            mf.DeviceBuffer(n * 4) as sources, mf.DeviceBuffer(prev_rows * 4) as cells, \
            mf.DeviceBuffer(n * 4) as out, mf.Event() as done:
        with mf.graph_capture(stream) as graph:
            mf.copy_h2d_async(sources, host_sources, stream)
            mf.copy_h2d_async(cells, host_cells, stream)
            mf.resolve_feed(sources, cells, out, stream, prev_rows=prev_rows)
            mf.copy_d2h_async(out, out_host, stream)
            done.record(stream)
        for step in range(5):
            cell_ids = rng.integers(0, 2**31, prev_rows).astype(np.uint32)
            from_row = rng.integers(0, prev_rows + 3, n).astype(np.uint32)  # some out of range
            host_ids = rng.integers(0, 2**31, n).astype(np.uint32)
            is_host = rng.random(n) < 0.4
            words = np.where(is_host, host_ids | np.uint32(0x80000000), from_row).astype(np.uint32)
            want = np.where(is_host, host_ids,
                            np.where(from_row < prev_rows, cell_ids[np.minimum(from_row, prev_rows - 1)],
                                     np.uint32(mf.NO_TOKEN))).astype(np.uint32)
            np.frombuffer(host_sources, np.uint32)[:] = words
            np.frombuffer(host_cells, np.uint32)[:] = cell_ids
            graph.launch(stream)
            done.synchronize()
            assert np.array_equal(np.frombuffer(out_host, np.uint32), want), step
        graph.close()


def test_no_masks_is_a_constant_a_capture_accepts(backend, no_leaks, dev):
    logits = np.random.default_rng(8).standard_normal((3, 40)).astype(np.float32)
    with mf.Stream() as stream, mf.DeviceBuffer(3 * 4) as cells, mf.PinnedBuffer(12) as dst, \
            mf.Event() as done:
        buf = dev.upload(logits)
        mf.argmax_to_feed(buf, None, cells, dst, done, stream, rows=3, vocab=40, dtype="float32")
        done.synchronize()
        with mf.graph_capture(stream) as graph:
            mf.argmax_to_feed(buf, None, cells, dst, done, stream, rows=3, vocab=40, dtype="float32")
        np.frombuffer(dst, np.uint32)[:] = 7
        graph.launch(stream)
        done.synchronize()
        assert np.array_equal(np.frombuffer(dst, np.uint32), reference_argmax(logits))
        graph.close()
        buf.close()


HOST_INPUT_CASES = {
    "host masks": lambda k: mf.argmax_to_feed(k.logits, [(1, 2)] * ROWS, k.cells, k.dst, None, k.stream,
                                              vocab=VOCAB, dtype="float32"),
    "host sources": lambda k: mf.resolve_feed([0, 1], k.cells, k.masks, k.stream, prev_rows=ROWS),
    "host params": lambda k: mf.sample_to_feed(k.logits, mf.sampling_params(ROWS, temperature=1.0),
                                               k.cells, k.dst, None, k.stream, vocab=VOCAB,
                                               dtype="float32", masks=k.masks, rows=ROWS),
    "pageable dst": lambda k: mf.argmax_to_feed(k.logits, k.masks, k.cells, np.zeros(ROWS, np.uint32),
                                                None, k.stream, rows=ROWS, vocab=VOCAB, dtype="float32"),
    "pageable h2d": lambda k: mf.copy_h2d_async(k.cells, np.zeros(ROWS, np.uint32), k.stream),
    "pageable d2h": lambda k: mf.copy_d2h_async(k.cells, np.zeros(ROWS, np.uint32), k.stream),
    "synchronize": lambda k: k.stream.synchronize(),
    "query": lambda k: k.stream.query(),
    "wait_event": lambda k: k.stream.wait_event(k.done),
    "close": lambda k: k.stream.close(),
}


@pytest.mark.parametrize("case", sorted(HOST_INPUT_CASES))
def test_host_side_inputs_are_refused_during_a_capture(backend, no_leaks, inputs, case):
    with mf.Stream() as stream:
        inputs.stream = stream
        inputs.fill(np.random.default_rng(9))
        inputs.queue(stream)
        inputs.done.synchronize()
        with mf.graph_capture(stream) as graph:
            with pytest.raises(mf.FeedError, match="capturing a graph|during a graph capture"):
                HOST_INPUT_CASES[case](inputs)
            assert not stream.closed
            inputs.queue(stream)  # the capture goes on after a refusal
        assert not mf.stream_capturing(stream)
        want = inputs.fill(np.random.default_rng(10))
        graph.launch(stream)
        inputs.done.synchronize()
        assert np.array_equal(inputs.ids(), want)  # the refused call left nothing in the graph
        graph.close()
        # Outside a capture the same call is accepted again (the sync ones at least).
        if case in ("synchronize", "query"):
            HOST_INPUT_CASES[case](inputs)
        del inputs.stream


def test_a_failed_block_drops_its_capture(backend, no_leaks):
    with mf.Stream() as stream:
        with pytest.raises(KeyError):
            with mf.graph_capture(stream) as graph:
                assert mf.stream_capturing(stream)
                raise KeyError("body")
        assert graph.closed and not mf.stream_capturing(stream)
        with pytest.raises(mf.FeedError, match="closed"):
            graph.launch(stream)
        stream.synchronize()


def test_bad_input_gets_clear_exceptions(backend, no_leaks):
    with mf.Stream() as stream, mf.Stream() as other:
        with pytest.raises(ValueError, match="default stream"):
            mf.graph_capture(0)
        with mf.graph_capture(stream) as graph:
            with pytest.raises(mf.FeedError, match="already capturing"):
                with mf.graph_capture(stream):
                    pass
            with pytest.raises(mf.FeedError, match="has not ended"):
                graph.launch(other)
            with pytest.raises(mf.FeedError, match="still capturing"):
                graph.close()
        with pytest.raises(mf.FeedError, match="already used"):
            with graph:
                pass
        with mf.graph_capture(other) as capturing_other:
            with pytest.raises(mf.FeedError, match="capturing"):
                graph.launch(other)  # a launch into a capturing stream
        capturing_other.close()
        graph.launch(stream)  # an empty graph does nothing
        stream.synchronize()
        graph.close()
        graph.close()  # twice: a no-op
        with pytest.raises(mf.FeedError, match="closed"):
            graph.launch(stream)
    closed = mf.Stream()
    closed.close()
    with pytest.raises(mf.FeedError, match="closed"):
        mf.graph_capture(closed)
    with pytest.raises(TypeError):
        mf.graph_capture(1.5)


def test_garbage_collection_destroys_graphs(backend, no_leaks):
    with mf.Stream() as stream, mf.DeviceBuffer(16) as buf:
        for _ in range(3):
            with mf.graph_capture(stream) as graph:
                mf.copy_d2d_async(buf, buf, 16, stream)
            graph.launch(stream)
            del graph
        gc.collect()
        assert mf.live_objects()["graphs"] == no_leaks.start["graphs"]
        stream.synchronize()


def test_launch_after_a_free_queues_nothing(backend, no_leaks):
    """A launch checks the generation of every allocation the graph names: memory freed since
    the capture fails the launch before anything of it is queued (its memory is kept until the
    graph is closed)."""
    with mf.Stream() as stream, mf.PinnedBuffer(8) as src, mf.DeviceBuffer(8) as kept, \
            mf.PinnedBuffer(8) as back:
        gone = mf.DeviceBuffer(8)
        with mf.graph_capture(stream) as graph:
            mf.copy_h2d_async(kept, src, stream)
            mf.copy_d2h_async(kept, back, stream)
            mf.copy_d2d_async(gone, kept, 8, stream)
        gone.close()
        np.frombuffer(src, np.uint32)[:] = [5, 6]
        with pytest.raises(mf.FeedError, match="freed after the capture"):
            graph.launch(stream)
        stream.synchronize()
        assert np.frombuffer(back, np.uint32).tolist() == [0, 0]  # its first copies did not run
        kept_bytes = mf.live_objects()["device_bytes"]
        graph.close()  # the deferred free of `gone` happens now (its streams are idle)
        assert mf.live_objects()["device_bytes"] == kept_bytes - 8


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_fork_while_another_thread_captures(host):
    """A thread begins and ends captures in a loop while the main thread forks: each child works
    with new streams of its own, none of them capturing. (The fork hooks of the capture lock
    matter for C callers without the GIL; from Python the lock is never held across a fork.)"""
    from helpers.child import run_python

    run_python("""
        import os, threading
        import numpy as np, metrale_feed as mf
        stop = threading.Event()
        def capture_loop():
            with mf.Stream() as s, mf.DeviceBuffer(8) as buf:
                while not stop.is_set():
                    with mf.graph_capture(s) as g:
                        buf.memset_async(0, s)
                    g.close()
        worker = threading.Thread(target=capture_loop)
        worker.start()
        for _ in range(100):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    with mf.Stream() as s, mf.DeviceBuffer(8) as buf, mf.PinnedBuffer(8) as host:
                        np.frombuffer(host, np.uint32)[:] = [3, 4]
                        mf.copy_h2d_async(buf, host, s)
                        mf.copy_d2h_async(buf, np.zeros(2, np.uint32), s)
                        assert not mf.stream_capturing(s)
                        s.synchronize()
                    code = 0
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, status
        stop.set()
        worker.join()
        print("ok")
    """, timeout=120)


def test_other_streams_and_threads_run_eagerly_during_a_capture(backend, no_leaks, dev):
    """A capture restricts only its own stream: another stream, from another thread, queues and
    synchronises as usual meanwhile, and its host-side inputs are accepted."""
    import threading

    logits = np.random.default_rng(12).standard_normal((4, 50)).astype(np.float32)
    errors = []
    with mf.Stream() as capturing, mf.Stream() as other, mf.DeviceBuffer(16) as cells, \
            mf.DeviceBuffer(16) as buf:
        dlogits = dev.upload(logits)

        def eager():
            try:
                for _ in range(20):
                    got = np.zeros(4, np.uint32)
                    mf.argmax_to_feed(dlogits, [(0, 1)] * 4, cells, got, None, other, vocab=50,
                                      dtype="float32")
                    other.synchronize()
                    if not np.array_equal(got, reference_argmax(logits, [(0, 1)] * 4)):
                        errors.append(got)
            except BaseException as error:  # noqa: BLE001 - reported below
                errors.append(error)

        with mf.graph_capture(capturing) as graph:
            buf.memset_async(1, capturing)
            worker = threading.Thread(target=eager)
            worker.start()
            worker.join()
            assert mf.stream_capturing(capturing) and not mf.stream_capturing(other)
        assert not errors, errors
        graph.launch(capturing)
        capturing.synchronize()
        assert (dev.download(buf) == 1).all()
        graph.close()
        dlogits.close()


def test_a_graph_keeps_the_buffers_its_operations_name(backend, no_leaks):
    """Buffers made inside the capture and dropped by the caller stay alive with the graph (a
    replay writes them), and go with it."""
    with mf.Stream() as stream, mf.PinnedBuffer(8) as back:
        with mf.graph_capture(stream) as graph:
            src = mf.PinnedBuffer(8)
            tmp = mf.DeviceBuffer(8)
            np.frombuffer(src, np.uint32)[:] = [9, 10]
            mf.copy_h2d_async(tmp, src, stream)
            mf.copy_d2h_async(tmp, back, stream)
        del src, tmp
        gc.collect()
        graph.launch(stream)
        stream.synchronize()
        assert np.frombuffer(back, np.uint32).tolist() == [9, 10]
        assert mf.live_objects()["device_bytes"] == no_leaks.start["device_bytes"] + 8
        graph.close()
        gc.collect()
        assert mf.live_objects()["device_bytes"] == no_leaks.start["device_bytes"]


def test_concurrent_captures_and_launches_on_several_streams(backend, no_leaks):
    """Threads capturing their own streams while others launch graphs: each graph replays its
    own operations only (the capture state is per stream)."""
    import threading

    errors = []

    def worker(k):
        try:
            with mf.Stream() as s, mf.PinnedBuffer(4) as src, mf.DeviceBuffer(4) as d, \
                    mf.PinnedBuffer(4) as back:
                with mf.graph_capture(s) as graph:
                    mf.copy_h2d_async(d, src, s)
                    mf.copy_d2h_async(d, back, s)
                for step in range(30):
                    np.frombuffer(src, np.uint32)[0] = k * 1000 + step
                    graph.launch(s)
                    s.synchronize()
                    got = int(np.frombuffer(back, np.uint32)[0])
                    if got != k * 1000 + step:
                        errors.append((k, step, got))
                graph.close()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
