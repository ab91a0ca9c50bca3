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
    _Launch.device)."""
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
