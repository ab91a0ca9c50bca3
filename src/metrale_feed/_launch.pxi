# The launch path: every operation queued from Python goes through one _Launch, which coerces
# its foreign arguments, holds what the queued work reads or writes, and commits or raises in one
# place (docs/lifetimes.md, rules 1 to 8). What a stream must keep alive lives here too: foreign
# arrays behind an event (keep_until_passed) and host buffers behind a release callback
# (hold_until_passed).

cdef char _empty_target  # the address of an empty tensor that has none (_Launch.device)


cdef inline bint is_foreign(object obj):
    return type(obj) is not DeviceBuffer and not isinstance(obj, int)


@cython.final
@cython.freelist(8)
cdef class _Launch:
    """One call's launch: the one path through which every launcher queues (docs/lifetimes.md).

    A launcher makes one (``launch_on``), coerces its arguments through it (``device``,
    ``foreign``: each foreign array checked against the backend's device, lent to the C layer's
    range checks for this call on the host backend), says what the queued work will need
    (``hold`` a host buffer, ``records`` an event, ``writes_cells``), and hands the C call's
    status to ``queued``. That one method commits everything or raises: on success the foreign
    arrays and host buffers are kept until the stream has passed the work (or for the life of the
    graph capturing it), the objects named are kept by that graph, the event is marked for host
    function errors and the cells' rows noted; on failure nothing was queued and nothing is
    kept. ``close()`` always, in a ``finally``. Nothing is reserved before the C call (a hold's
    release callback is queued after it), so a failure has nothing to give back.
    """
    cdef list kept        # foreign arrays (_Foreign) the kernels read or write
    cdef list holds       # foreign host buffers (_HeldBuffer) a copy reads or writes
    cdef uint64_t stream
    cdef uint64_t event   # an event the call records, 0 for none
    cdef uint64_t keep    # a keep-alive event the C call records itself (event_to_record), 0 for none
    cdef size_t cells     # feed cells the call writes (0 for none) and their shape (_state.pxi)
    cdef object cell_shape
    cdef bint cuda

    cdef int device(self, object obj, void **out, size_t *nbytes, str what, bint writable,
                    bint ids) except -1:
        """``obj`` as device memory at ``out``, ``nbytes`` long (SIZE_MAX when unknown: an int).
        ``ids``: 4-byte integer elements (uint32 ids; int32 is taken as its bit pattern)."""
        cdef _Foreign f
        if not is_foreign(obj):
            device_ptr_of(obj, out)
            nbytes[0] = (<DeviceBuffer>obj)._nbytes if type(obj) is DeviceBuffer else <size_t>-1
            return 0
        f = self.foreign(obj, what)
        if ids and not f.ids:
            raise TypeError(f"{what} must hold uint32 ids, not {f.type_name()}")
        if f.entry is None:
            raise TypeError(f"{what}: DLPack type {f.type_name()} is not taken")
        if not f.contiguous():
            raise ValueError(f"{what} must be contiguous (its strides cannot be followed)")
        if writable and f.readonly:
            raise ValueError(f"{what} is read-only but this call writes it")
        out[0] = f.ptr
        nbytes[0] = f.count() * (f.dl_bits // 8)
        if out[0] == NULL and nbytes[0] == 0:
            # An empty tensor may carry no data pointer (torch's does not); it names no memory,
            # so a zero-byte copy to or from it is a no-op as with an empty buffer. The C layer
            # refuses a null pointer whatever the size, so it gets an address that holds nothing
            # instead, and still checks the rest (the stream, the other side).
            out[0] = &_empty_target
            if not self.cuda:  # the host backend takes only what a call lends it
                check(mf_device_borrow(out[0], 0))
            return 0
        self.lend(f, nbytes[0])
        return 0

    cdef _Foreign foreign(self, object obj, str what):
        """A foreign array on the active backend's device, kept for the call."""
        cdef _Foreign f = None
        kind = type(obj)
        if kind is PinnedBuffer or kind is BufferView and (<BufferView>obj)._pinned:
            raise ValueError(f"{what} is page-locked host memory, not device memory")
        if not self.cuda and takes_buffer_import(kind):  # numpy: its buffer, not DLPack
            f = foreign_from_buffer(obj)
        if f is not None:
            pass
        elif (not self.cuda and cpu_exporter(kind) is not None) or hasattr(obj, "__dlpack__"):
            # cuda: the array is made safe to use on the call's stream (1: CUDA's legacy default)
            # with no host wait; host backend: CPU memory, no stream.
            f = foreign_from_dlpack(obj, (self.stream or 1) if self.cuda else None)
        elif self.cuda and hasattr(obj, "__cuda_array_interface__"):
            f = foreign_from_cai(obj, self.stream)
        else:
            raise TypeError(f"{what}: expected a DeviceBuffer, an int pointer or a tensor "
                            f"(__dlpack__), not {type(obj).__name__}")
        if self.cuda:
            if f.device_type != kDLCUDA and f.device_type != kDLCUDAManaged:
                raise ValueError(f"{what} is on DLPack device {f.device_type}, not CUDA ({kDLCUDA})")
            if f.device_id != device_ordinal():
                raise ValueError(f"{what} is on CUDA device {f.device_id}, not the current device {device_ordinal()}")
        elif f.device_type != kDLCPU:
            raise ValueError(f"{what} is on DLPack device {f.device_type}; the host backend takes "
                             f"CPU memory ({kDLCPU}) as device memory")
        if self.kept is None:
            self.kept = []
        self.kept.append(f)
        return f

    cdef int lend(self, _Foreign f, size_t nbytes) except -1:
        if not self.cuda and f.ptr != NULL:  # an empty tensor too: a 0-byte copy to it is valid
            check(mf_device_borrow(f.ptr, nbytes))
        return 0

    cdef int hold(self, _HeldBuffer held) except -1:
        """Keep the host buffer ``held`` (None: nothing to keep) until the work has passed."""
        if held is not None:
            if self.holds is None:
                self.holds = []
            self.holds.append(held)
        return 0

    cdef inline void records(self, uint64_t event) noexcept:
        self.event = event

    cdef uint64_t event_to_record(self, uint64_t event) noexcept:
        """The event a C call that records one should be given: ``event``, the caller's, when
        there is one. Otherwise, when the call keeps foreign arrays outside a capture, a
        keep-alive event of ours, so that the call's own queued work records it after everything
        it reads and writes, and ``queued`` keeps the arrays behind it: one queued operation
        fewer than a record of its own behind the call (on cuda one ``cudaEventRecord`` fewer).
        Only for a C call that queues all of the launch's work: nothing queued after it may read
        the arrays. 0 (no event) when none could be had: ``queued`` then records one itself."""
        if event or not self.kept or self.keep or capturing_graph(self.stream) is not None:
            return event
        self.keep = spare_event()
        return self.keep

    cdef inline void writes_cells(self, const void *cells, object shape):
        self.cells = <size_t>cells
        self.cell_shape = shape

    cdef int queued(self, mf_status status, object names) except -1:
        """The C call returned ``status``: raise its error (nothing was queued), or commit what
        the work needs (``queued_on``, below, then what only a launch that coerced holds)."""
        cdef Graph graph = queued_on(self.stream, status, names, self.event)
        if graph is not None:
            if self.holds:  # a replay reads or writes them at every launch
                graph._keep.append(tuple(self.holds))
        else:
            if self.holds:
                for held in self.holds:
                    hold_until_passed(<_HeldBuffer>held, self.stream)
            if self.kept:
                keep_until_passed(self.kept, self.stream, self.keep)
                self.keep = 0  # recorded by the call: the arrays' entry owns it now
        self.holds = None
        self.kept = None
        if self.cells:
            note_cell_rows(self.cells, self.cell_shape)
        return 0

    cdef void close(self) noexcept:
        if not self.cuda:  # nothing lent outlives the call, whether it worked or not
            mf_device_borrow_clear()
        if self.keep:  # a refused call recorded nothing: the event is as good as new
            spare_event_back(self.keep)
            self.keep = 0


cdef Graph queued_on(uint64_t stream, mf_status status, object names, uint64_t event):
    """The commit every queued operation ends with: raise ``status``'s error (nothing was
    queued), or, in a capture of this package's, keep ``names`` (the object or tuple of objects
    the call was given) with the graph, so that garbage collection cannot free what a replay
    reads or writes, and make an event record one of the graph's operations (returned: the
    graph); outside one, mark the event for the host functions queued before it (None). A call
    that coerced nothing (an event record, a memset, a stream wait) ends here directly: a
    _Launch for it would cost a third of the call; _Launch.queued ends here too, so the rule is written once."""
    if status != MF_SUCCESS:
        raise_status(status)
    if not _streams:  # no capture and no host function anywhere: the hot path
        return None
    graph = capturing_graph(stream)
    if graph is not None:
        (<Graph>graph)._keep.append(names)
        if event:
            (<Graph>graph)._order.append(event)
        return <Graph>graph
    if event:
        note_record(event, stream)
    return None


cdef _Launch launch_on(uint64_t stream):
    cdef _Launch c = _Launch.__new__(_Launch)
    c.stream = stream
    c.cuda = mf_active_backend() == MF_BACKEND_CUDA
    return c


# Foreign arrays kept for queued kernels: (event, arrays) in call order, events reused. A call
# releases from the front while the front has passed, so each call costs O(1) amortised; an entry
# behind a slower stream's waits for it or for the next synchronize (release_passed).
cdef uint64_t spare_event() noexcept:
    """A keep-alive event: a spare one, or a new one (0 when none can be made)."""
    cdef uint64_t event = 0
    if _spare_events:
        return _spare_events.pop()
    if mf_event_create(MF_EVENT_UNCOUNTED, &event) != MF_SUCCESS:
        return 0
    return event


cdef void spare_event_back(uint64_t event) noexcept:
    if len(_spare_events) < 64:
        _spare_events.append(event)
    else:
        mf_event_destroy(event)


cdef int keep_until_passed(object objs, uint64_t stream, uint64_t recorded=0) except -1:
    """Keep ``objs`` until ``stream`` has passed the work just queued: behind ``recorded``, a
    keep-alive event that work recorded itself (_Launch.event_to_record), or else behind one
    recorded here."""
    cdef uint64_t event = recorded
    cdef mf_status status = MF_SUCCESS
    release_kept(False)
    if not event:
        event = spare_event()
        if not event:
            status = MF_ERROR_OUT_OF_MEMORY
        else:
            status = mf_event_record(event, stream)
            if status != MF_SUCCESS:
                mf_event_destroy(event)
    if status != MF_SUCCESS:
        # The work is queued already (this runs after the C call): never raise here and let the
        # arrays go under it; wait for it instead.
        with nogil:
            mf_stream_synchronize(stream)
        return 0
    _kept.append((event, objs))
    return 0


cdef int release_kept(bint all_passed) except -1:
    """Drop the arrays of every front entry whose work has passed (all of them when the caller
    has just synchronised and ``all_passed`` may hold: each is still queried)."""
    cdef int done
    cdef uint64_t event
    cdef mf_status status
    cdef Py_ssize_t n = len(_kept)
    while n:
        event = (<tuple>_kept[0])[0]
        status = mf_event_query(event, &done)
        if status != MF_SUCCESS or done:
            _kept.popleft()
            if status == MF_SUCCESS:
                spare_event_back(event)
            else:  # a failed query (its stream is gone): never reuse that event
                mf_event_destroy(event)
        elif all_passed:
            _kept.rotate(-1)  # look past a pending one: a wait on one stream passes only it
        else:
            break
        n -= 1
    return 0


cdef int drop_spare_events() except -1:
    """Destroy the reusable keep-alive events (live_objects counts what is left: none of ours)."""
    while _spare_events:
        mf_event_destroy(_spare_events.pop())
    return 0


# Holding foreign host buffers for async copies (docs/lifetimes.md, rule 6). A buffer is held
# from the call until its stream has passed the copy: a release callback queued right behind the
# copy gives it back, so it is resizable (a bytearray) or freed (dropped) as soon as the copy is
# done, not at some later call. In a capture the graph holds it instead, for as long as it lives.

cdef void _release_hold(void *key) noexcept nogil:
    # On the stream's worker (cuda: a runtime thread) once the copy before it has run.
    if not mf_hf_enter():
        return  # exiting: the buffer stays held (see _note_exit)
    if Py_IsInitialized():
        with gil:
            _pending_holds.pop(<size_t>key, None)
    mf_hf_leave()


cdef int hold_until_passed(_HeldBuffer held, uint64_t stream) except -1:
    """Hold ``held`` until ``stream`` has passed the work just queued (a release callback behind
    it). Called by _Launch.queued only, outside a capture of this package's."""
    global _hold_key
    cdef int on = 0
    if mf_stream_capturing(stream, &on) == MF_SUCCESS and on:
        # A capture this package did not begin (cuda: CUDA's or torch's API): nothing tells when
        # its graph dies, so the buffer stays held for the process's life.
        Py_INCREF(held)
        return 0
    _hold_key += 1
    key = _hold_key
    _pending_holds[key] = held
    if mf_launch_host_func(stream, _release_hold, <void *><size_t>key) != MF_SUCCESS:
        # Only a stream destroyed by another thread since the copy was queued gets here. Its work
        # still completes, at a time nothing can tell any more: the buffer stays held for the
        # process's life (a leak in a race, never a write into freed memory).
        Py_INCREF(held)
        _pending_holds.pop(key, None)
    return 0


cdef int release_passed() except -1:
    """Let go of the foreign arrays kept for kernels whose work has passed."""
    if _kept:
        release_kept(True)
    return 0


# What a completed wait lets go of and reports, the same after every wait (Event.synchronize,
# event_synchronize, Stream.synchronize, stream_synchronize): the arrays and buffers kept for
# work that has passed, then a failure of a host function the waited work included.

cdef int after_event_wait(uint64_t event) except -1:
    release_passed()
    if _failures:
        event_host_errors(event)
    return 0


cdef int after_stream_wait(uint64_t stream) except -1:
    release_passed()
    if _failures:
        stream_host_errors(stream)
    return 0
