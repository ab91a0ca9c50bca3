# Python functions in stream order (launch_host_func). The C layer runs a callback when the stream
# reaches it (cuda: a runtime thread through cudaLaunchHostFunc; host backend: the stream's
# worker); the callback takes the GIL, calls fn(*args), and keeps any exception here so that the
# next query or wait of that stream, or of an event recorded on it afterwards, raises it.

from cpython.ref cimport Py_XDECREF
from posix.unistd cimport usleep

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

cdef extern from *:
    """
    /* Exit protocol between the callbacks and the atexit hook (sequentially consistent, so a
     * callback either sees the exit flag or is counted before the hook reads the count). */
    static int mf_hf_exiting = 0;
    static int mf_hf_entering = 0;
    static int mf_hf_enter(void) {
        __atomic_fetch_add(&mf_hf_entering, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&mf_hf_exiting, __ATOMIC_SEQ_CST)) {
            __atomic_fetch_sub(&mf_hf_entering, 1, __ATOMIC_SEQ_CST);
            return 0;
        }
        return 1;
    }
    static void mf_hf_leave(void) { __atomic_fetch_sub(&mf_hf_entering, 1, __ATOMIC_SEQ_CST); }
    static void mf_hf_set_exiting(void) { __atomic_store_n(&mf_hf_exiting, 1, __ATOMIC_SEQ_CST); }
    static int mf_hf_in_flight(void) { return __atomic_load_n(&mf_hf_entering, __ATOMIC_SEQ_CST); }
    """
    int mf_hf_enter() nogil
    void mf_hf_leave() nogil
    void mf_hf_set_exiting() nogil
    int mf_hf_in_flight() nogil

# Per-stream state (_StreamState: the host functions' count, their unreported exceptions) and
# _event_marks are declared in _state.pxi.


def _mark_exiting():
    # Exit policy: host functions still queued are skipped (their payloads are leaked on purpose:
    # nothing may be released without a running interpreter); one already started may finish,
    # for up to 2 s, with the GIL released here so that it can. A callback that would take the GIL
    # while the interpreter finalises would be ended mid-call by Python.
    import time
    mf_hf_set_exiting()
    deadline = time.monotonic() + 2.0
    while mf_hf_in_flight() and time.monotonic() < deadline:
        with nogil:
            usleep(1000)


import atexit as _atexit
_atexit.register(_mark_exiting)


cdef void _host_func_trampoline(void *data) noexcept nogil:
    if not mf_hf_enter():
        return
    if Py_IsInitialized():
        with gil:
            _host_func_run(<object>data)
            Py_XDECREF(<PyObject *>data)  # the reference launch_host_func took
    mf_hf_leave()


cdef void _graph_host_func_trampoline(void *data) noexcept nogil:
    # A host node of a graph: runs at each launch with the same data. Each launch took a
    # reference for each of its host nodes (Graph.launch), dropped here once the node has run, so
    # a node outlives a graph closed while its launches are queued.
    if not mf_hf_enter():
        return
    if Py_IsInitialized():
        with gil:
            if _graph_host_func_run(<_GraphHostFunc>data):
                Py_XDECREF(<PyObject *>data)
    mf_hf_leave()


@cython.final
cdef class _GraphHostFunc:
    """A host function captured into a graph: ``fn(*args)`` at each launch.

    ``runs`` holds one (stream, sequence) per queued launch, in launch order (a graph runs on one
    stream at a time, so its nodes run in that order): where an exception of that run is reported,
    as for a host function launched eagerly on the launch stream at that point."""
    cdef object fn
    cdef tuple args
    cdef uint64_t stream   # the capturing stream: where a run with no launch of ours reports
    cdef object runs


cdef bint _graph_host_func_run(_GraphHostFunc node) noexcept:
    """Run the node once; True when a launch of ours queued this run (and holds a reference)."""
    cdef bint ours = True
    try:
        stream, seq = node.runs.popleft()
    except IndexError:  # a capture not made by graph_capture (CUDA's own API): no bookkeeping
        stream, seq, ours = node.stream, 0, False
    try:
        node.fn(*node.args)
    except BaseException as exc:  # never into the C layer: it is reported at the next wait
        if ours:
            keep_host_error(stream, seq, exc)
        else:
            stream_state_made(stream).fail(seq, exc)
    return ours


cdef int launch_graph_host_func(uint64_t s, object fn, tuple args) except -1:
    """``launch_host_func`` on a capturing stream: a host node, kept with the graph."""
    cdef _GraphHostFunc node = _GraphHostFunc.__new__(_GraphHostFunc)
    node.fn, node.args, node.stream, node.runs = fn, args, s, _deque()
    graph = capturing_graph(s)
    check(mf_launch_host_func(s, _graph_host_func_trampoline, <void *>node))
    if graph is None:
        # A capture this package did not begin (the cuda backend, CUDA's or torch's capture API):
        # nothing tells when its graph dies, so the node is kept for the process's life (its
        # runs take no reference: no launch of ours counts them).
        Py_INCREF(node)
    else:
        (<Graph>graph)._keep.append((node,))
        (<Graph>graph)._order.append(node)
    return 0


cdef void _host_func_run(tuple payload) noexcept:
    fn, args, stream, seq = payload
    try:
        fn(*args)
    except BaseException as exc:  # never into the C layer: it is reported at the next wait
        keep_host_error(stream, seq, exc)


cdef bint stream_marked(uint64_t stream):
    """Whether a live event's record still reports host functions of ``stream`` (rare path)."""
    for mark in _event_marks.values():
        if (<tuple>mark)[0] == stream:
            return True
    return False


cdef void keep_host_error(uint64_t stream, object seq, object exc) noexcept:
    """Keep a host function's exception for the next wait that reports it; one that nothing can
    report any more (its stream was closed, no event recorded on it after it lives) goes to
    ``sys.unraisablehook`` now, so it does not keep its frames alive (docs/lifetimes.md)."""
    cdef _StreamState st = stream_state(stream)
    if (st is not None and st.seq is not None) or stream_marked(stream):
        stream_state_made(stream).fail(seq, exc)
    else:
        _report_lost(stream, exc)


cdef void _report_lost(uint64_t stream, object exc) noexcept:
    # Raised in a noexcept function: Cython hands it to sys.unraisablehook and clears it.
    raise _HostFunctionError(f"a host function launched on stream 0x{stream:x} raised "
                    f"{type(exc).__name__}: {exc} (the stream was closed: nothing can report it "
                    f"there)") from exc


cdef int forget_stream(uint64_t stream) except -1:
    """A stream of ours was destroyed: its host-function bookkeeping goes with it (its pending
    exceptions too, unless a live event recorded on it still reports them)."""
    cdef _StreamState st = stream_state(stream)
    if st is None:
        return 0
    st.seq = None
    if st.failed and not stream_marked(stream):
        for seq, exc in st.take_failures():
            _report_lost(stream, exc)
    stream_state_trim(stream)
    return 0


def launch_host_func(stream, fn, *args):
    """Run ``fn(*args)`` in stream order: after the work queued before it on ``stream``, before
    the work queued after it. Never waits.

    On cuda it runs on a CUDA runtime thread (``cudaLaunchHostFunc``), on the host backend on the
    stream's worker; either way it takes the GIL. ``fn`` must not call CUDA nor wait on its own
    stream. An exception in ``fn`` never crashes the process: the next ``query``/``synchronize``
    of the stream, or of an event recorded on it afterwards, raises a ``FeedError`` with the
    exception as ``__cause__``.

    On a stream capturing a graph (``graph_capture``) the call is an operation of the graph: each
    ``Graph.launch`` runs ``fn(*args)`` again, with the same arguments, in the launch's stream
    order, and its exception is reported on the launch stream as above. The graph keeps ``fn``
    and ``args`` alive (and each queued launch does, after the graph is closed).

    Parameters
    ----------
    stream : Stream, int handle or any ``__cuda_stream__`` object
    fn : callable
    *args
        Passed to ``fn``; kept alive until it has run.

    Raises
    ------
    TypeError
        ``fn`` is not callable.
    FeedError
        A closed or unknown stream.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> out = []
    >>> with mf.Stream() as s:
    ...     mf.launch_host_func(s, out.append, 1)
    ...     s.synchronize()
    >>> out
    [1]
    """
    cdef uint64_t s
    cdef int on = 0
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    stream_of(stream, &s)
    check(mf_stream_capturing(s, &on))
    if on:
        launch_graph_host_func(s, fn, args)
        return
    cdef _StreamState st = stream_state_made(s)
    seq = (st.seq or 0) + 1
    payload = (fn, args, s, seq)
    Py_INCREF(payload)  # dropped by the trampoline once fn has run
    cdef mf_status status = mf_launch_host_func(s, _host_func_trampoline, <void *>payload)
    if status != MF_SUCCESS:
        Py_DECREF(payload)
        stream_state_trim(s)
        raise_status(status)
    st.seq = seq


cdef int note_record(uint64_t event, uint64_t stream) except -1:
    """An event recorded on ``stream`` (not capturing: there the record is an operation of the
    graph, and each launch marks it): it reports the host functions queued there before it."""
    cdef _StreamState st = stream_state(stream)
    seq = None if st is None else st.seq
    if seq is not None:
        _event_marks[event] = (stream, seq)
    else:
        _event_marks.pop(event, None)
    return 0


cdef int _raise_failed(uint64_t stream, object upto) except -1:
    cdef _StreamState st = stream_state(stream)
    if st is None:
        return 0
    exc = st.take_failure(upto)
    if exc is None:
        return 0
    stream_state_trim(stream)
    raise _HostFunctionError(f"a host function launched on stream 0x{stream:x} raised "
                    f"{type(exc).__name__}: {exc}") from exc


cdef int stream_host_errors(uint64_t stream) except -1:
    """A failure of a host function queued on ``stream`` (reported once)."""
    if _failures:
        _raise_failed(stream, None)
    return 0


cdef int event_host_errors(uint64_t event) except -1:
    """A failure of a host function queued before ``event``'s record on its stream."""
    if _failures:
        mark = _event_marks.get(event)
        if mark is not None:
            _raise_failed(mark[0], mark[1])
    return 0
