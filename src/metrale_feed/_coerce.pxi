# What the Python API takes wherever a stream, event or pointer goes: the package's object, its int
# handle, or a foreign object (the __cuda_stream__ protocol, torch's .cuda_stream, CuPy's .ptr).

cdef int u64_of(object value, uint64_t *out, str what) except -1:
    if value < 0 or value > UINT64_MAX:
        raise ValueError(f"{what} {value} is not a 64-bit handle")
    out[0] = <uint64_t>value
    return 0


cdef object index_of(object value, str what):
    """``value`` as a Python int: an int or anything with __index__, never a float or a bool."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return value.__index__()


cdef uint64_t int_of(object value, str what, uint64_t low, uint64_t high) except? 0xFFFFFFFFFFFFFFFF:
    """An int in [low, high]."""
    value = index_of(value, what)
    if value < 0 and low == 0:
        raise ValueError(f"{what} must not be negative, got {value}")
    if value < low or value > high:
        raise ValueError(f"{what} must be in [{bound_text(low)}, {bound_text(high)}], got {value}")
    return <uint64_t>value


cdef str bound_text(uint64_t n):
    """2**24 and 2**32-1 read better than their digits in a message."""
    if n >= 65536 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    if n >= 65535 and (n + 1) & n == 0:
        return f"2**{(n + 1).bit_length() - 1}-1" if n != UINT64_MAX else "2**64-1"
    return str(n)


cdef size_t size_of(object value, str what) except? 0:
    """A byte count: an int >= 0 that fits in size_t (OverflowError beyond it)."""
    value = index_of(value, what)
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {value}")
    if value > <size_t>-1:
        raise OverflowError(f"{what} {value} does not fit in size_t")
    return <size_t>value


cdef int stream_of(object stream, uint64_t *out) except -1:
    if stream is None:
        out[0] = 0
    elif type(stream) is Stream:
        (<Stream>stream)._check_open()
        out[0] = (<Stream>stream)._handle
    elif PyLong_CheckExact(stream):
        u64_of(stream, out, "stream")
    elif hasattr(stream, "__cuda_stream__"):
        u64_of(stream.__cuda_stream__()[1], out, "stream")
    elif hasattr(stream, "cuda_stream"):
        u64_of(stream.cuda_stream, out, "stream")
    elif hasattr(stream, "ptr"):
        u64_of(stream.ptr, out, "stream")
    elif isinstance(stream, int):
        u64_of(int(stream), out, "stream")
    else:
        raise TypeError(f"expected a Stream, an int handle or a CUDA stream object, not {type(stream).__name__}")
    return 0


cdef int event_of(object event, uint64_t *out, bint optional) except -1:
    if type(event) is Event:
        (<Event>event)._check_open()
        out[0] = (<Event>event)._handle
    elif event is None and optional:
        out[0] = 0
    elif isinstance(event, int) and not isinstance(event, bool):
        u64_of(event, out, "event")
    else:
        raise TypeError(f"expected an Event or an int handle, not {type(event).__name__}")
    return 0


# Device memory: a DeviceBuffer, an int pointer, or a foreign array (any __dlpack__ object, and
# __cuda_array_interface__ on cuda; see _dlpack.pxi). The C layer range-checks what this package
# allocated; on the host backend it refuses other memory unless a call borrows it (a CPU tensor
# standing in for device memory), and on cuda it takes foreign pointers as they are.
cdef int device_ptr_of(object obj, void **out) except -1:
    """A DeviceBuffer's, a view of one's or an int's address (foreign arrays go through
    _Call.device)."""
    cdef uint64_t value
    if type(obj) is DeviceBuffer:
        (<DeviceBuffer>obj)._check_open()
        out[0] = (<DeviceBuffer>obj)._ptr
        return 0
    if type(obj) is BufferView:  # the package's own view: its buffer's bytes from its offset
        if (<BufferView>obj)._pinned:
            raise ValueError("a view of a PinnedBuffer is page-locked host memory, not device memory")
        out[0] = (<BufferView>obj)._address()
        return 0
    if isinstance(obj, int) and not isinstance(obj, bool):
        u64_of(obj, &value, "device pointer")
        out[0] = <void *><size_t>value
        return 0
    raise TypeError(f"expected a DeviceBuffer (or its view()), an int pointer or a tensor (__dlpack__), not {type(obj).__name__}")


cdef char _empty_target  # the address of an empty tensor that has none (_Call.device)


cdef inline bint is_foreign(object obj):
    return type(obj) is not DeviceBuffer and not isinstance(obj, int)


@cython.final
@cython.freelist(8)
cdef class _Call:
    """The foreign arrays one call uses: each is checked against the backend's device, lent to
    the C layer's range checks for this call (host backend), and kept alive until the work the
    call queued has run. ``done()`` after the C call succeeded; ``close()`` always."""
    cdef list kept
    cdef uint64_t stream
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
        cdef _Foreign f
        kind = type(obj)
        if kind is PinnedBuffer or kind is BufferView and (<BufferView>obj)._pinned:
            raise ValueError(f"{what} is page-locked host memory, not device memory")
        if (not self.cuda and cpu_exporter(kind) is not None) or hasattr(obj, "__dlpack__"):
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

    cdef int done(self) except -1:
        """The C call queued its work: keep the foreign arrays until the stream has passed it
        (in a capture the graph keeps them, note_capture: an event record would join the graph)."""
        if self.kept:
            if capturing_graph(self.stream) is None:
                keep_until_passed(self.kept, self.stream)
            self.kept = None
        return 0

    cdef void close(self) noexcept:
        if not self.cuda:  # nothing lent outlives the call, whether it worked or not
            mf_device_borrow_clear()


cdef _Call call_on(uint64_t stream):
    cdef _Call c = _Call.__new__(_Call)
    c.stream = stream
    c.cuda = mf_active_backend() == MF_BACKEND_CUDA
    return c


# A foreign host buffer handed to an async copy stays exported until an event recorded after the
# copy has completed, so the copy never writes memory that Python has already freed.
@cython.final
cdef class _HeldBuffer:
    cdef Py_buffer view
    cdef bint held

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


cdef _HeldBuffer host_buffer_of(object obj, bint writable, str what):
    cdef _HeldBuffer held = _HeldBuffer.__new__(_HeldBuffer)
    if not PyObject_CheckBuffer(obj):
        raise TypeError(f"{what} must be a buffer (PinnedBuffer, numpy array, bytearray, ...), not {type(obj).__name__}")
    cdef int flags = (PyBUF_WRITABLE if writable else 0) | PyBUF_C_CONTIGUOUS
    try:
        PyObject_GetBuffer(obj, &held.view, flags | PyBUF_FORMAT)
    except (BufferError, ValueError):
        # A type the buffer protocol has no format for (numpy cannot say ml_dtypes' bfloat16,
        # "cannot include dtype 'E' in a buffer"): a copy moves bytes, so take them untyped. An
        # object array does have a format ('O'), so it never gets here.
        PyObject_GetBuffer(obj, &held.view, flags)
    held.held = True
    if held.view.format != NULL and b"O" in <bytes>held.view.format:
        # Object arrays hold PyObject pointers: bytes copied into them would be dereferenced.
        raise TypeError(f"{what} holds Python objects (format {held.view.format.decode()!r}); use a numeric buffer")
    return held


# Foreign arrays kept for queued kernels: (event, arrays) in call order, events reused. A call
# releases from the front while the front has passed, so each call costs O(1) amortised; an entry
# behind a slower stream's waits for it or for the next synchronize (release_passed).
cdef int keep_until_passed(object objs, uint64_t stream) except -1:
    cdef uint64_t event
    cdef mf_status status
    release_kept(False)
    if _spare_events:
        event = _spare_events.pop()
        status = MF_SUCCESS
    else:
        status = mf_event_create(MF_EVENT_UNCOUNTED, &event)
    if status == MF_SUCCESS:
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
            if status == MF_SUCCESS and len(_spare_events) < 64:
                _spare_events.append(event)
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
