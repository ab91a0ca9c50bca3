# Graphs: a capture of the operations queued on one stream, replayed by one launch
# (docs/graphs.md, docs/lifetimes.md). The C layer checks every call; this keeps the handle and
# the capture's state.

from _weakref import ref as _weak_ref  # the C type weakref re-exports, without weakref's import


@cython.final
cdef class Graph:
    """Operations captured on a stream, replayed on any stream by one ``launch``.

    Made by ``graph_capture``; the operations queued on the capturing stream inside its ``with``
    block are recorded, not run. Each ``launch`` runs them all in order, each reading its
    device-resident inputs (masks, bitmask, sources, params, pinned copy sources) when it runs,
    and each event record in the graph records that event again. The graph keeps the objects its
    operations named (buffers, events, tensors) alive. A buffer it names that is closed
    explicitly is given up by its owner, but its memory is kept until the graph is closed, and
    a later ``launch`` raises ``FeedError`` (docs/lifetimes.md). A capture object dropped before
    its block ends discards its capture.

    Attributes
    ----------
    closed : bool
        True once closed, or when the capture failed.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.Stream() as s, mf.DeviceBuffer(8) as dev, mf.PinnedBuffer(8) as host:
    ...     with mf.graph_capture(s) as g:
    ...         mf.copy_h2d_async(dev, host, s)      # pinned: read at each launch
    ...     g.launch(s); s.synchronize(); g.close()
    """
    cdef uint64_t _handle
    cdef object _stream   # the capturing stream, while the capture is open
    cdef list _keep       # the objects its operations name: alive as long as the graph
    cdef list _order      # its host functions (_GraphHostFunc) and event records (handles), in order
    cdef uint64_t _capturing
    cdef bint _began
    cdef bint _closed
    cdef object __weakref__  # its stream's state refers to a capturing graph weakly

    def __cinit__(self):
        self._handle = 0
        self._keep = []
        self._order = []
        self._capturing = 0
        self._began = False
        self._closed = False

    def __enter__(self):
        cdef uint64_t s
        if self._began:
            raise FeedError("this capture was already used: call graph_capture again")
        stream_of(self._stream, &s)
        check(mf_graph_begin(s))
        self._began = True
        self._capturing = s
        stream_state_made(s).graph = _weak_ref(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        cdef uint64_t s = self._capturing
        self._capturing = 0
        self._stream = None
        forget_capture(s)
        if exc_type is not None:
            # The body failed: the capture is ended and dropped (its error is the one raised).
            mf_graph_end(s, NULL)
            self._closed = True
            self._keep = []
            self._order = []
            return False
        status = mf_graph_end(s, &self._handle)
        if status != MF_SUCCESS:
            self._closed = True
            self._keep = []
            self._order = []
            raise_status(status)
        return False

    cdef int _check_ready(self) except -1:
        if self._closed:
            raise FeedError("the graph is closed")
        if self._handle == 0:
            raise FeedError("the graph's capture has not ended (launch it after its with block)")
        return 0

    @property
    def closed(self):
        return self._closed

    def launch(self, stream=0):
        """Queue the whole graph on ``stream``; the host does not wait.

        Parameters
        ----------
        stream : Stream, int or stream-like, optional
            Any stream that is not capturing; default 0. A graph runs on one stream at a time
            (replaying it on two streams at once races on the memory it writes).

        Returns
        -------
        None

        Raises
        ------
        FeedError
            The graph is closed or its capture has not ended; the stream is closed, unknown or
            capturing; on the host backend, memory or an event the graph uses is gone (nothing
            is queued then).

        Examples
        --------
        >>> g.launch(stream)  # doctest: +SKIP
        """
        cdef uint64_t s
        self._check_ready()
        stream_of(stream, &s)
        if not self._order:
            check(mf_graph_launch(self._handle, s))
            return
        # Host functions and event records: the bookkeeping an eager launch_host_func and record
        # on `s` would do, made before the launch (a node may run as soon as it is queued) and
        # undone if nothing was queued.
        cdef _StreamState st = stream_state_made(s)
        seq0 = st.seq
        marks = {}
        seq = seq0
        for op in self._order:
            if type(op) is _GraphHostFunc:
                seq = (seq or 0) + 1
                (<_GraphHostFunc>op).runs.append((s, seq))
                Py_INCREF(op)  # this launch's reference, dropped once the node has run
            else:
                marks.setdefault(op, _event_marks.get(op))
                if seq is None:
                    _event_marks.pop(op, None)
                else:
                    _event_marks[op] = (s, seq)
        st.seq = seq
        status = mf_graph_launch(self._handle, s)
        if status != MF_SUCCESS:
            for op in reversed(self._order):
                if type(op) is _GraphHostFunc:
                    (<_GraphHostFunc>op).runs.pop()
                    Py_DECREF(op)
            for op, old in marks.items():
                if old is None:
                    _event_marks.pop(op, None)
                else:
                    _event_marks[op] = old
            st.seq = seq0
            stream_state_trim(s)
            raise_status(status)
        stream_state_trim(s)  # event records alone leave the stream's state as it was

    def close(self):
        """Destroy the graph; launches already queued still run. Closing twice is a no-op.

        Returns
        -------
        None

        Examples
        --------
        >>> g.close()  # doctest: +SKIP
        """
        if self._closed or self._capturing:
            if self._capturing:
                raise FeedError("the graph is still capturing: leave its with block first")
            return
        self._closed = True
        if self._handle:
            handle, self._handle = self._handle, 0
            status = mf_graph_destroy(handle)
            self._keep = []  # after the destroy: a launch already queued still runs (see docs)
            self._order = []  # its host functions are kept by the launches queued (Graph.launch)
            check(status)

    def __dealloc__(self):
        if self._capturing:
            # Dropped inside its capture (never ended): discard it, so the stream is usable again.
            mf_graph_end(self._capturing, NULL)
            forget_capture(self._capturing)
        if self._handle and not self._closed:
            mf_graph_destroy(self._handle)

    def __repr__(self):
        state = "closed" if self._closed else ("capturing" if self._capturing else
                                               ("ready" if self._handle else "new"))
        return f"<Graph {state}>"


cdef inline object capturing_graph(uint64_t stream):
    """The Graph capturing ``stream`` through ``graph_capture``, or None. One dict test when
    nothing captures."""
    cdef _StreamState st = stream_state(stream)
    if st is None or st.graph is None:
        return None
    return st.graph()


cdef int forget_capture(uint64_t stream) except -1:
    cdef _StreamState st = stream_state(stream)
    if st is not None:
        st.graph = None
        stream_state_trim(stream)
    return 0


def graph_capture(stream):
    """Capture the operations queued on ``stream`` into a ``Graph``: ``with graph_capture(s) as g``.

    Inside the ``with`` block, work queued on ``stream`` is recorded, not run. Operations whose
    inputs live in host memory (host masks, params or sources, copies from or into memory that is
    not this package's pinned memory), a wait on another event, and a synchronize, query or close
    of ``stream`` raise ``FeedError`` there, because a replay could not see new host values. An
    empty capture is a graph that does nothing. If the block raises, the capture is dropped.

    Parameters
    ----------
    stream : Stream, int or stream-like
        A stream that is not the default stream and not already capturing.

    Returns
    -------
    Graph
        A context manager; after its block, ``launch`` replays the capture.

    Raises
    ------
    ValueError
        ``stream`` is the default stream.
    FeedError
        ``stream`` is closed, unknown or already capturing (on entering the block).

    See Also
    --------
    Graph.launch : replay the capture.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> with mf.Stream() as s, mf.DeviceBuffer(8) as dev, mf.PinnedBuffer(8) as host:
    ...     with mf.graph_capture(s) as g:
    ...         mf.copy_h2d_async(dev, host, s); mf.copy_d2h_async(dev, host, s)
    ...     g.launch(s); s.synchronize(); g.close()
    """
    cdef uint64_t s
    stream_of(stream, &s)  # refused now, not on entering the block
    if s == 0:
        raise ValueError("the default stream cannot be captured: capture a Stream of your own")
    cdef Graph graph = Graph.__new__(Graph)
    graph._stream = stream
    return graph


def stream_capturing(stream):
    """Whether ``stream`` is capturing a graph.

    Parameters
    ----------
    stream : Stream, int or stream-like

    Returns
    -------
    bool

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.stream_capturing(0)
    False
    """
    cdef uint64_t s
    cdef int on = 0
    stream_of(stream, &s)
    check(mf_stream_capturing(s, &on))
    return on != 0
