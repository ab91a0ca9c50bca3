# Event and Stream: owners of C-layer handles. Hot methods are one C call; blocking waits drop
# the GIL; non-blocking ones do not pay for dropping it.

@cython.final
@cython.freelist(32)
cdef class Event:
    """A CUDA event (or its host-backend twin). ``query()`` never blocks."""

    def __init__(self, bint timing=False, bint blocking=False):
        cdef unsigned flags = (MF_EVENT_TIMING if timing else 0) | (MF_EVENT_BLOCKING if blocking else 0)
        if self._handle:
            raise FeedError("Event is already initialised")
        check(mf_event_create(flags, &self._handle))
        self._owned = True
        self._timing = timing

    @staticmethod
    def wrap(handle):
        """A non-owning Event over a foreign ``cudaEvent_t`` (cuda backend); never destroyed here."""
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
        check(mf_event_record(self._handle, stream))
        if _host_func_seq:
            note_record(self._handle, stream)
        return 0

    cdef bint _query(self) except -1:
        cdef int done = 0
        if self._handle == 0:
            raise FeedError("the event is closed")
        cdef mf_status status = mf_event_query(self._handle, &done)
        if status != MF_SUCCESS:
            raise_status(status)
        if _host_func_errors:
            event_host_errors(self._handle)
        return done != 0

    cdef int _synchronize(self) except -1:
        cdef mf_status status
        self._check_open()
        with nogil:
            status = mf_event_synchronize(self._handle)
        check(status)
        release_passed()  # copies up to here are done: their held buffers can go
        if _host_func_errors:
            event_host_errors(self._handle)
        return 0

    @property
    def handle(self):
        """The handle the free functions take (not the raw cudaEvent_t: see ``cuda_event``)."""
        self._check_open()
        return self._handle

    @property
    def cuda_event(self):
        cdef uint64_t raw
        self._check_open()
        check(mf_event_raw(self._handle, &raw))
        return raw

    @property
    def closed(self):
        return self._handle == 0

    def record(self, stream=0):
        cdef uint64_t s
        stream_of(stream, &s)
        self._record(s)

    def query(self):
        return self._query()

    def synchronize(self):
        self._synchronize()

    def elapsed_ms(self, Event end not None):
        """Milliseconds between this event and ``end``; both need ``timing=True`` and to be done."""
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
    """An ordered queue of device work. ``Stream.wrap(handle)`` takes a foreign one, unowned."""

    def __init__(self, bint non_blocking=True):
        if self._handle or self._owned:
            raise FeedError("Stream is already initialised")
        check(mf_stream_create(MF_STREAM_NON_BLOCKING if non_blocking else 0, &self._handle))
        self._owned = True

    @staticmethod
    def wrap(handle):
        """The same as ``from_handle``."""
        cdef Stream stream = Stream.__new__(Stream)
        stream_of(handle, &stream._handle)
        check(mf_stream_check(stream._handle))
        return stream

    @staticmethod
    def from_handle(handle):
        """A non-owning Stream over a foreign stream: an int ``cudaStream_t``, or any object with
        ``__cuda_stream__`` (torch.cuda.Stream, CuPy streams). Closing it never destroys the
        stream. On the host backend a handle it never made raises ``FeedError``.

        Examples
        --------
        >>> s = Stream()
        >>> Stream.from_handle(s.handle) == s
        True
        """
        return Stream.wrap(handle)

    def __dealloc__(self):
        if self._owned and not self._closed:
            mf_stream_destroy(self._handle)

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
        """True when all work queued so far has completed; never blocks."""
        cdef int idle = 0
        self._check_open()
        check(mf_stream_query(self._handle, &idle))
        if _host_func_errors:
            stream_host_errors(self._handle)
        return idle != 0

    def synchronize(self):
        cdef mf_status status
        self._check_open()
        with nogil:
            status = mf_stream_synchronize(self._handle)
        check(status)
        release_passed()
        if _host_func_errors:
            stream_host_errors(self._handle)

    def wait_event(self, event):
        """Later work on this stream waits for ``event`` (no host wait)."""
        cdef uint64_t e
        self._check_open()
        event_of(event, &e, False)
        check(mf_stream_wait_event(self._handle, e))

    def close(self):
        """Destroy an owned stream; queued work still completes. Wrapped streams are left alone."""
        if self._closed:
            return
        self._closed = True
        if self._owned:
            check(mf_stream_destroy(self._handle))

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
    """A new event's int handle; destroy it with ``destroy_event``."""
    cdef uint64_t handle
    check(mf_event_create((MF_EVENT_TIMING if timing else 0) | (MF_EVENT_BLOCKING if blocking else 0), &handle))
    return handle


def event_record(event, stream=0):
    cdef uint64_t e, s
    event_of(event, &e, False)
    stream_of(stream, &s)
    check(mf_event_record(e, s))
    if _host_func_seq:
        note_record(e, s)


def event_query(event):
    """Whether the work recorded against ``event`` has completed; never blocks."""
    cdef uint64_t e
    cdef int done = 0
    if type(event) is Event:
        return (<Event>event)._query()
    event_of(event, &e, False)
    check(mf_event_query(e, &done))
    if _host_func_errors:
        event_host_errors(e)
    return done != 0


def event_synchronize(event):
    cdef uint64_t e
    cdef mf_status status
    event_of(event, &e, False)
    with nogil:
        status = mf_event_synchronize(e)
    check(status)
    release_passed()
    if _host_func_errors:
        event_host_errors(e)


def destroy_event(event):
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
    cdef uint64_t s
    cdef mf_status status
    stream_of(stream, &s)
    with nogil:
        status = mf_stream_synchronize(s)
    check(status)
    release_passed()
    if _host_func_errors:
        stream_host_errors(s)


# C-level entry points for cimport users: no Python objects, no GIL.
cdef mf_status event_record_c(uint64_t event, uint64_t stream) noexcept nogil:
    return mf_event_record(event, stream)

cdef mf_status event_query_c(uint64_t event, int *done) noexcept nogil:
    return mf_event_query(event, done)

cdef mf_status event_synchronize_c(uint64_t event) noexcept nogil:
    return mf_event_synchronize(event)
