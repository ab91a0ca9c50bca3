# Event and Stream: owners of C-layer handles. Hot methods are one C call; blocking waits drop
# the GIL; non-blocking ones do not pay for dropping it.

# Blocking waits run in slices of this many microseconds with the GIL released, checking for
# signals between slices: Ctrl-C ends a wait of any length within about one slice.
cdef enum:
    WAIT_SLICE_US = 20000


cdef int wait_event(uint64_t event) except -1:
    """Wait for the event's record current now; KeyboardInterrupt (any signal handler's
    exception) ends the wait early. A destroy from another thread meanwhile raises FeedError."""
    cdef uint64_t mark = 0
    cdef int done = 0
    cdef mf_status status
    while True:
        with nogil:
            status = mf_event_synchronize_for(event, WAIT_SLICE_US, &mark, &done)
        if status != MF_SUCCESS:
            raise_status(status)
        if done:
            return 0
        PyErr_CheckSignals()


cdef int wait_stream(uint64_t stream) except -1:
    """As wait_event, for the work queued on ``stream`` when the wait began."""
    cdef uint64_t mark = 0
    cdef int done = 0
    cdef mf_status status
    while True:
        with nogil:
            status = mf_stream_synchronize_for(stream, WAIT_SLICE_US, &mark, &done)
        if status != MF_SUCCESS:
            raise_status(status)
        if done:
            return 0
        PyErr_CheckSignals()

@cython.final
@cython.freelist(32)
cdef class Event:
    """A CUDA event, or its host-backend twin: a marker recorded into a stream.

    The event completes when the stream reaches it. ``query()`` never blocks; ``synchronize()``
    blocks with the GIL released. Events are tracked: a closed one raises ``FeedError``.

    Parameters
    ----------
    timing : bool, optional
        Record timestamps, for ``elapsed_ms`` (costs a little on CUDA). Default False.
    blocking : bool, optional
        On CUDA, ``synchronize`` sleeps instead of spinning. Default False.

    Raises
    ------
    FeedError
        The backend could not create an event (``CudaError`` on the cuda backend).

    See Also
    --------
    Event.wrap : adopt a foreign ``cudaEvent_t``.
    event_create : the same as an int handle.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.Event() as done:
    ...     done.record(0)          # after everything queued on stream 0 so far
    ...     done.synchronize()
    ...     done.query()
    True
    """

    def __init__(self, bint timing=False, bint blocking=False):
        cdef unsigned flags = (MF_EVENT_TIMING if timing else 0) | (MF_EVENT_BLOCKING if blocking else 0)
        if self._handle:
            raise FeedError("Event is already initialised")
        check(mf_event_create(flags, &self._handle))
        self._owned = True
        self._timing = timing

    @staticmethod
    def wrap(handle):
        """A non-owning Event over a foreign ``cudaEvent_t`` (cuda backend).

        Parameters
        ----------
        handle : int
            The raw ``cudaEvent_t``, e.g. ``torch.cuda.Event().cuda_event``.

        Returns
        -------
        Event
            An Event that never destroys ``handle``; ``close()`` only forgets it.

        Raises
        ------
        ValueError
            On the host backend, which has no foreign events, or ``handle`` is not in uint64.
        TypeError
            ``handle`` is not an int.

        Examples
        --------
        >>> ev = Event.wrap(torch_event.cuda_event)  # doctest: +SKIP
        """
        cdef uint64_t raw
        cdef Event event = Event.__new__(Event)
        u64_of(handle, &raw, "event")
        check(mf_event_wrap(raw, &event._handle))
        event._owned = False
        return event

    def __dealloc__(self):
        if self._handle:
            mf_event_destroy(self._handle)

    cdef int _check_open(self) except -1:
        if self._handle == 0:
            raise FeedError("the event is closed")
        return 0

    cdef int _record(self, uint64_t stream) except -1:
        self._check_open()
        queued_on(stream, mf_event_record(self._handle, stream), self, self._handle)
        return 0

    cdef bint _query(self) except -1:
        cdef int done = 0
        if self._handle == 0:
            raise FeedError("the event is closed")
        cdef mf_status status = mf_event_query(self._handle, &done)
        if status != MF_SUCCESS:
            raise_status(status)
        if _failures:
            event_host_errors(self._handle)
        return done != 0

    cdef int _synchronize(self) except -1:
        self._check_open()
        wait_event(self._handle)
        after_event_wait(self._handle)
        return 0

    @property
    def handle(self):
        """The handle the free functions take (not the raw cudaEvent_t: see ``cuda_event``)."""
        self._check_open()
        return self._handle

    @property
    def cuda_event(self):
        """The raw ``cudaEvent_t`` as an int (for other CUDA libraries); 0 on the host backend.
        """
        cdef uint64_t raw
        self._check_open()
        check(mf_event_raw(self._handle, &raw))
        return raw

    @property
    def closed(self):
        """Whether ``close()`` has run.
        """
        return self._handle == 0

    def record(self, stream=0):
        """Record the event on ``stream``: it completes after the work queued there so far.

        Parameters
        ----------
        stream : Stream, int or object with ``__cuda_stream__``, optional
            The stream; 0 (the default) is the default stream.

        Raises
        ------
        FeedError
            The event or the stream is closed, or unknown.

        Examples
        --------
        >>> import metrale_feed as mf
        >>> with mf.Stream() as s, mf.Event() as e:
        ...     e.record(s)
        ...     s.synchronize()
        ...     e.query()
        True
        """
        cdef uint64_t s
        stream_of(stream, &s)
        self._record(s)

    def query(self):
        """Whether the work recorded against the event has completed; never blocks.

        Returns
        -------
        bool
            True once the stream has passed the record (and for an event never recorded).

        Raises
        ------
        FeedError
            The event is closed.
        """
        # _query's body, written out: the hottest method, and a vtable call costs ~1 ns of ~28.
        cdef int done = 0
        if self._handle == 0:
            raise FeedError("the event is closed")
        cdef mf_status status = mf_event_query(self._handle, &done)
        if status != MF_SUCCESS:
            raise_status(status)
        if _failures:
            event_host_errors(self._handle)
        return done != 0

    def synchronize(self):
        """Block until the work recorded against the event has completed (GIL released).

        Raises
        ------
        FeedError
            The event is closed, or the work failed (``CudaError`` on the cuda backend).
        """
        self._synchronize()

    def elapsed_ms(self, Event end not None):
        """Milliseconds between this event and ``end``.

        Parameters
        ----------
        end : Event
            A later event; both need ``timing=True`` and must have completed.

        Returns
        -------
        float
            The time between the two records, in milliseconds.

        Raises
        ------
        FeedError
            Either event is closed, lacks timing or has not completed.
        """
        cdef float ms
        self._check_open()
        end._check_open()
        check(mf_event_elapsed_ms(self._handle, end._handle, &ms))
        return ms

    def close(self):
        """Destroy the event (a no-op for a wrapped one, and when already closed)."""
        cdef uint64_t handle = self._handle
        if handle:
            self._handle = 0
            if _event_marks:
                _event_marks.pop(handle, None)
            check(mf_event_destroy(handle))

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<Event {'closed' if self._handle == 0 else hex(self._handle)}>"


@cython.final
cdef class Stream:
    """An ordered queue of device work (on the host backend, served by a worker thread).

    Work queued on one stream runs in order; different streams may overlap. Pass a Stream (or its
    ``handle``) wherever a ``stream`` argument is taken; it also has ``__cuda_stream__``.

    Parameters
    ----------
    non_blocking : bool, optional
        Do not synchronise with the legacy default stream (CUDA's ``cudaStreamNonBlocking``).
        Default True.

    Raises
    ------
    FeedError
        The backend could not create a stream.

    See Also
    --------
    Stream.wrap : adopt a foreign stream (torch, CuPy, an int handle).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.Stream() as s:
    ...     s.synchronize()
    ...     s.query()
    True
    """

    def __init__(self, bint non_blocking=True):
        if self._handle or self._owned:
            raise FeedError("Stream is already initialised")
        check(mf_stream_create(MF_STREAM_NON_BLOCKING if non_blocking else 0, &self._handle))
        self._owned = True

    @staticmethod
    def wrap(handle):
        """A non-owning Stream over a foreign stream: an int ``cudaStream_t``, or an object with
        ``__cuda_stream__``, ``.cuda_stream`` (torch) or ``.ptr`` (CuPy).

        Parameters
        ----------
        handle : int or stream-like
            The foreign stream; 0 is the default stream.

        Returns
        -------
        Stream
            A Stream that never destroys ``handle``. A stream object (not an int) is kept alive
            as long as the Stream, so its owner cannot destroy the stream under it.

        Raises
        ------
        FeedError
            On the host backend, a handle that is not one of this package's streams.

        Examples
        --------
        >>> import metrale_feed as mf
        >>> mf.Stream.wrap(0).synchronize()
        """
        cdef Stream stream = Stream.__new__(Stream)
        stream_of(handle, &stream._handle)
        check(mf_stream_check(stream._handle))
        if not isinstance(handle, int):
            stream._owner = handle  # a torch or CuPy stream destroys its handle when collected
        return stream

    @staticmethod
    def from_handle(handle):
        """A non-owning Stream over a foreign stream: an int ``cudaStream_t``, or any object with
        ``__cuda_stream__`` (torch.cuda.Stream, CuPy streams). Closing it never destroys the
        stream. On the host backend a handle it never made raises ``FeedError``.

        Examples
        --------
        >>> import metrale_feed as mf
        >>> with mf.Stream() as s:
        ...     mf.Stream.from_handle(s.handle) == s
        True
        """
        return Stream.wrap(handle)

    def __dealloc__(self):
        if self._owned and not self._closed:
            if mf_stream_destroy(self._handle) == MF_SUCCESS and _streams:
                forget_stream(self._handle)

    cdef int _check_open(self) except -1:
        if self._closed:
            raise FeedError("the stream is closed")
        return 0

    @property
    def handle(self):
        self._check_open()
        return self._handle

    @property
    def closed(self):
        return self._closed

    def __cuda_stream__(self):
        self._check_open()
        return (0, self._handle)

    def query(self):
        """Whether all work queued so far has completed; never blocks.

        Returns
        -------
        bool
        """
        cdef int idle = 0
        self._check_open()
        check(mf_stream_query(self._handle, &idle))
        if _failures:
            stream_host_errors(self._handle)
        return idle != 0

    def synchronize(self):
        """Block until all work queued so far has completed (GIL released).

        Raises
        ------
        FeedError
            The stream is closed, or queued work failed.
        """
        self._check_open()
        wait_stream(self._handle)
        after_stream_wait(self._handle)

    def wait_event(self, event):
        """Make later work on this stream wait for ``event``; the host does not wait.

        Parameters
        ----------
        event : Event or int
            An event recorded on any stream.

        Raises
        ------
        FeedError
            The stream or the event is closed or unknown.
        """
        cdef uint64_t e
        self._check_open()
        event_of(event, &e, False)
        queued_on(self._handle, mf_stream_wait_event(self._handle, e), (self, event), 0)

    def close(self):
        """Destroy an owned stream; work already queued still completes. A wrapped stream is left
        alone. Closing twice is a no-op.
        """
        if self._closed:
            return
        cdef mf_status status = MF_SUCCESS
        if self._owned:
            status = mf_stream_destroy(self._handle)
            if status == MF_ERROR_CAPTURE:
                raise_status(status)  # still open: its capture must end first
        self._closed = True
        self._owner = None  # a wrapped stream: its owner may go now
        if status == MF_SUCCESS and self._owned and _streams:
            forget_stream(self._handle)
        check(status)

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __eq__(self, other):
        return type(other) is Stream and (<Stream>other)._handle == self._handle

    def __hash__(self):
        return hash(self._handle)

    def __repr__(self):
        return f"<Stream {'closed' if self._closed else hex(self._handle)}>"


# The trait's free functions over int handles (or the objects).

def event_create(bint timing=False, bint blocking=False):
    """A new event as an int handle (the trait's form); destroy it with ``destroy_event``.

    Parameters
    ----------
    timing, blocking : bool, optional
        As for ``Event``.

    Returns
    -------
    int
        The handle.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> h = mf.event_create()
    >>> mf.event_record(h, 0); mf.event_synchronize(h); mf.event_query(h)
    True
    >>> mf.destroy_event(h)
    """
    cdef uint64_t handle
    check(mf_event_create((MF_EVENT_TIMING if timing else 0) | (MF_EVENT_BLOCKING if blocking else 0), &handle))
    return handle


def event_record(event, stream=0):
    """Record ``event`` on ``stream``; it completes after the work queued there so far.

    Parameters
    ----------
    event : Event or int
        An Event or a handle from ``event_create``.
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.

    Raises
    ------
    FeedError
        A closed, destroyed or unknown event or stream.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> h = mf.event_create()
    >>> mf.event_record(h, 0); mf.event_synchronize(h)
    >>> mf.destroy_event(h)
    """
    cdef uint64_t e, s
    event_of(event, &e, False)
    stream_of(stream, &s)
    queued_on(s, mf_event_record(e, s), event, e)


cdef extern from "Python.h":
    # Declared without an exception check: event_query looks at the error itself, to raise
    # event_of's message instead of an OverflowError.
    unsigned long long _u64_or_error "PyLong_AsUnsignedLongLong"(object) noexcept
    void *_error_set "PyErr_Occurred"() noexcept
    void _error_clear "PyErr_Clear"() noexcept


def event_query(event):
    """Whether the work recorded against ``event`` has completed; never blocks.

    Parameters
    ----------
    event : Event or int

    Returns
    -------
    bool

    Raises
    ------
    FeedError
        A closed, destroyed or unknown event.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.Event() as e:
    ...     mf.event_query(e)
    True
    """
    cdef uint64_t e
    cdef int done = 0
    if type(event) is Event:
        return (<Event>event)._query()
    if type(event) is int:  # the hot int path: one C conversion (event_of's checks cost ~20 ns)
        e = _u64_or_error(event)
        if e == <uint64_t>-1 and _error_set() != NULL:
            _error_clear()
            event_of(event, &e, False)  # negative or too wide: raises its ValueError
    else:
        event_of(event, &e, False)
    check(mf_event_query(e, &done))
    if _failures:
        event_host_errors(e)
    return done != 0


def event_synchronize(event):
    """Block until the work recorded against ``event`` has completed (GIL released).

    Parameters
    ----------
    event : Event or int

    Raises
    ------
    FeedError
        A closed, destroyed or unknown event, or failed work.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> h = mf.event_create()
    >>> mf.event_record(h, 0); mf.event_synchronize(h)
    >>> mf.destroy_event(h)
    """
    cdef uint64_t e
    event_of(event, &e, False)
    wait_event(e)
    after_event_wait(e)


def destroy_event(event):
    """Destroy an event made by ``event_create`` (or close an ``Event``).

    Parameters
    ----------
    event : Event or int

    Raises
    ------
    FeedError
        The event was already destroyed, or is unknown.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> h = mf.event_create()
    >>> mf.event_record(h, 0); mf.event_synchronize(h)
    >>> mf.destroy_event(h)
    """
    cdef uint64_t e
    if type(event) is Event:
        (<Event>event)._check_open()
        event.close()
        return
    event_of(event, &e, False)
    if _event_marks:
        _event_marks.pop(e, None)
    check(mf_event_destroy(e))


def stream_synchronize(stream=0):
    """Block until all work queued on ``stream`` has completed (GIL released).

    Parameters
    ----------
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.

    Raises
    ------
    FeedError
        A closed or unknown stream, or failed work.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.stream_synchronize()
    """
    cdef uint64_t s
    stream_of(stream, &s)
    wait_stream(s)
    after_stream_wait(s)


# C-level entry points for cimport users: no Python objects, no GIL.
cdef mf_status event_record_c(uint64_t event, uint64_t stream) noexcept nogil:
    return mf_event_record(event, stream)

cdef mf_status event_query_c(uint64_t event, int *done) noexcept nogil:
    return mf_event_query(event, done)

cdef mf_status event_synchronize_c(uint64_t event) noexcept nogil:
    return mf_event_synchronize(event)
