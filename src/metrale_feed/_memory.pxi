# Page-locked host memory with zero-copy Python buffers, device memory, and the async copies.

# Pinned memory owned by a PinnedBuffer: free_host_pinned refuses it, since the object still
# hands out views of it (its close() is the one way to free it).
cdef set _object_pinned = set()


@cython.final
cdef class PinnedBuffer:
    """Zeroed page-locked host memory. ``numpy.asarray(buf)`` and ``memoryview(buf)`` see the
    same bytes; ``close()`` refuses while a view is exported."""

    def __cinit__(self, nbytes, *, bint portable=False, bint mapped=False,
                  bint write_combined=False):
        cdef unsigned flags = ((MF_HOST_PORTABLE if portable else 0) | (MF_HOST_MAPPED if mapped else 0)
                               | (MF_HOST_WRITE_COMBINED if write_combined else 0))
        self._nbytes = size_of(nbytes, "nbytes")
        check(mf_host_alloc(self._nbytes, flags, &self._ptr))
        self._shape[0] = <Py_ssize_t>self._nbytes
        _object_pinned.add(<size_t>self._ptr)

    def __dealloc__(self):
        # A live export holds a reference to this object, so none can remain here.
        cdef void *ptr = self._ptr
        if ptr != NULL:
            _object_pinned.discard(<size_t>ptr)
            with nogil:  # the free waits for queued work, which may be a host function taking the GIL
                mf_host_free(ptr, self._nbytes)

    cdef int _check_open(self) except -1:
        if self._ptr == NULL:
            raise FeedError("the pinned buffer is closed")
        return 0

    def __getbuffer__(self, Py_buffer *view, int flags):
        self._check_open()
        view.buf = self._ptr
        view.obj = self
        view.len = <Py_ssize_t>self._nbytes
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = b"B"
        view.ndim = 1
        view.shape = NULL
        view.strides = NULL
        if flags & PyBUF_ND:
            view.shape = self._shape
        if (flags & PyBUF_STRIDES) == PyBUF_STRIDES:
            view.strides = &view.itemsize
        view.suboffsets = NULL
        view.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self._exports -= 1

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of the bytes as 1-D uint8 (``kDLCUDAHost`` on cuda, ``kDLCPU`` on the
        host backend); never synchronises. See ``view`` for a typed, shaped export."""
        self._check_open()
        device = buffer_dlpack_device(True)
        return dlpack_export(self, self._ptr, device[0], device[1], _UINT8, (self._nbytes,),
                             stream, max_version, dl_device, copy)

    def __dlpack_device__(self):
        """``(kDLCUDAHost, 0)`` on cuda, ``(kDLCPU, 0)`` on the host backend."""
        return buffer_dlpack_device(True)

    @property
    def __cuda_array_interface__(self):
        self._check_open()
        return cuda_array_interface(<size_t>self._ptr, (self._nbytes,), "|u1")

    def view(self, dtype="uint8", shape=None, *, offset=0):
        """A typed, shaped exporter over these bytes (DLPack, and the CUDA array interface on
        cuda); its ``.base`` is this buffer, kept alive by it and by every tensor made from it.

        Parameters
        ----------
        dtype : str, numpy or torch dtype
            Any spelling of the package's dtype table.
        shape : int or tuple of int, optional
            C-contiguous shape; default: as many elements as fit after ``offset``.
        offset : int
            Bytes from the start, a multiple of the element size.

        Returns
        -------
        BufferView

        Raises
        ------
        ValueError
            An unknown dtype, or a shape that needs more bytes than the buffer has.

        Examples
        --------
        >>> buf = PinnedBuffer(64)
        >>> buf.view("float32", (4, 4)).shape
        (4, 4)
        """
        self._check_open()
        return make_view(self, self._nbytes, True, dtype, shape, offset)

    @property
    def ptr(self):
        self._check_open()
        return <size_t>self._ptr

    @property
    def nbytes(self):
        return self._nbytes

    @property
    def closed(self):
        return self._ptr == NULL

    def __len__(self):
        return self._nbytes

    def close(self):
        """Free the memory (after queued work that may touch it). Refused while views exist."""
        if self._ptr == NULL:
            return
        release_passed()  # views held for copies that have completed go first
        if self._exports:
            raise BufferError(f"the pinned buffer has {self._exports} exported view(s) or tensor(s); release them first")
        cdef void *ptr = self._ptr
        self._ptr = NULL
        _object_pinned.discard(<size_t>ptr)
        with nogil:
            status = mf_host_free(ptr, self._nbytes)
        check(status)

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<PinnedBuffer {self._nbytes} bytes{' closed' if self._ptr == NULL else ''}>"


@cython.final
cdef class DeviceBuffer:
    """Device memory (host memory on the host backend), freed by ``close()`` or collection."""

    def __cinit__(self, nbytes):
        self._nbytes = size_of(nbytes, "nbytes")
        check(mf_device_alloc(self._nbytes, &self._ptr))

    def __dealloc__(self):
        cdef void *ptr = self._ptr
        if ptr != NULL:
            _cell_rows.pop(<size_t>ptr, None)
            with nogil:  # as PinnedBuffer's
                mf_device_free(ptr)

    cdef int _check_open(self) except -1:
        if self._ptr == NULL:
            raise FeedError("the device buffer is closed")
        return 0

    @property
    def ptr(self):
        self._check_open()
        return <size_t>self._ptr

    @property
    def nbytes(self):
        return self._nbytes

    @property
    def closed(self):
        return self._ptr == NULL

    def __len__(self):
        return self._nbytes

    @property
    def __cuda_array_interface__(self):
        self._check_open()
        return cuda_array_interface(<size_t>self._ptr, (self._nbytes,), "|u1")

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of the bytes as 1-D uint8 (``kDLCUDA`` on cuda, ``kDLCPU`` on the host
        backend). Never synchronises: order the writer's stream before the reader's yourself
        (``stream=-1`` and any other stream alike). See ``view`` for a typed, shaped export."""
        self._check_open()
        device = buffer_dlpack_device(False)
        return dlpack_export(self, self._ptr, device[0], device[1], _UINT8, (self._nbytes,),
                             stream, max_version, dl_device, copy)

    def __dlpack_device__(self):
        """``(kDLCUDA, ordinal)`` on cuda, ``(kDLCPU, 0)`` on the host backend."""
        return buffer_dlpack_device(False)

    def __array__(self, dtype=None, copy=None):
        """``numpy.asarray(buf)``: the bytes themselves on the host backend (zero-copy; ``close()``
        is refused while the array lives); a ``TypeError`` on cuda (device memory)."""
        self._check_open()
        return as_numpy(self, True, dtype, copy)

    def view(self, dtype="uint8", shape=None, *, offset=0):
        """A typed, shaped exporter over these bytes; see ``PinnedBuffer.view``.

        Examples
        --------
        >>> logits = DeviceBuffer(4 * 2 * 8)
        >>> logits.view("f32", (2, 8)).shape
        (2, 8)
        """
        self._check_open()
        return make_view(self, self._nbytes, False, dtype, shape, offset)

    def memset_async(self, int value, stream=0):
        cdef uint64_t s
        self._check_open()
        stream_of(stream, &s)
        check(mf_memset_async(self._ptr, value, self._nbytes, s))

    def close(self):
        """Free the memory (after queued work that may touch it). Refused while tensors made
        from it through DLPack are alive."""
        if self._ptr == NULL:
            return
        if self._exports:
            raise BufferError(f"the device buffer has {self._exports} exported tensor(s); release them first")
        cdef void *ptr = self._ptr
        self._ptr = NULL
        _cell_rows.pop(<size_t>ptr, None)  # a later allocation may reuse the address
        with nogil:
            status = mf_device_free(ptr)
        check(status)

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<DeviceBuffer {self._nbytes} bytes{' closed' if self._ptr == NULL else ''}>"


cdef _HeldBuffer host_ptr_of(object obj, bint writable, void **ptr, size_t *nbytes):
    """A PinnedBuffer's own memory (None returned), or any other buffer exported and returned, to
    be held until the copy has passed (see hold_until_passed)."""
    if type(obj) is PinnedBuffer:
        (<PinnedBuffer>obj)._check_open()
        ptr[0] = (<PinnedBuffer>obj)._ptr
        nbytes[0] = (<PinnedBuffer>obj)._nbytes
        return None
    if isinstance(obj, int):
        raise TypeError("a host buffer must be a buffer object (its length is the copy's size), not an int")
    cdef _HeldBuffer held = host_buffer_of(obj, writable, "the host buffer")
    ptr[0] = held.view.buf
    nbytes[0] = <size_t>held.view.len
    return held


cdef int device_side_fits(size_t have, size_t need, str what) except -1:
    if have != <size_t>-1 and have < need:  # -1: an int pointer, range-checked by the C layer
        raise ValueError(f"{what}: {need} bytes run past the end of its {have} bytes")
    return 0


def copy_d2h_async(src, dst, stream=0):
    """Copy ``len(dst)`` bytes from device ``src`` into host buffer ``dst`` on ``stream``; never
    waits. ``dst`` must stay untouched until the stream has passed the copy. ``src`` may be a
    DeviceBuffer, an int pointer or a tensor."""
    cdef void *device
    cdef void *host
    cdef size_t nbytes, have
    cdef uint64_t s
    cdef _HeldBuffer held = None
    stream_of(stream, &s)
    cdef _Call call = call_on(s)
    try:
        call.device(src, &device, &have, "copy source", False, False)
        held = host_ptr_of(dst, True, &host, &nbytes)
        device_side_fits(have, nbytes, "copy source")
        check(mf_copy_d2h_async(host, device, nbytes, s))
        call.done()
    finally:
        call.close()
    if held is not None and nbytes:
        hold_until_passed(held, s)


def copy_h2d_async(dst, src, stream=0):
    """Copy ``len(src)`` bytes from host buffer ``src`` into device ``dst`` on ``stream``."""
    cdef void *device
    cdef void *host
    cdef size_t nbytes, have
    cdef uint64_t s
    cdef _HeldBuffer held = None
    stream_of(stream, &s)
    cdef _Call call = call_on(s)
    try:
        call.device(dst, &device, &have, "copy destination", True, False)
        held = host_ptr_of(src, False, &host, &nbytes)
        device_side_fits(have, nbytes, "copy destination")
        check(mf_copy_h2d_async(device, host, nbytes, s))
        call.done()
    finally:
        call.close()
    if held is not None and nbytes:
        hold_until_passed(held, s)


def copy_d2d_async(dst, src, nbytes, stream=0):
    """Copy ``nbytes`` between two device arrays (DeviceBuffers, int pointers or tensors)."""
    cdef size_t n = size_of(nbytes, "nbytes")
    cdef void *d
    cdef void *s_ptr
    cdef size_t have
    cdef uint64_t s
    stream_of(stream, &s)
    cdef _Call call = call_on(s)
    try:
        call.device(dst, &d, &have, "copy destination", True, False)
        device_side_fits(have, n, "copy destination")
        call.device(src, &s_ptr, &have, "copy source", False, False)
        device_side_fits(have, n, "copy source")
        check(mf_copy_d2d_async(d, s_ptr, n, s))
        call.done()
    finally:
        call.close()


def alloc_host_pinned(nbytes):
    """Zeroed page-locked memory as an int pointer; free it with ``free_host_pinned(ptr, nbytes)``."""
    cdef void *ptr
    check(mf_host_alloc(size_of(nbytes, "nbytes"), 0, &ptr))
    return <size_t>ptr


def free_host_pinned(ptr, nbytes):
    """Free what ``alloc_host_pinned`` returned; a wrong size, a foreign or freed pointer raise."""
    cdef uint64_t p
    cdef mf_status status
    cdef size_t n = size_of(nbytes, "nbytes")
    u64_of(ptr, &p, "pointer")
    if <size_t>p in _object_pinned:
        raise FeedError(f"0x{p:x} belongs to a PinnedBuffer: close() it instead")
    with nogil:
        status = mf_host_free(<void *><size_t>p, n)
    check(status)


cdef int pinned_range(uint64_t ptr, size_t nbytes) except -1:
    cdef size_t left = 0
    if ptr % 4:
        raise ValueError(f"0x{ptr:x} is not aligned to 4 bytes for uint32 ids")
    if mf_mem_lookup(<void *><size_t>ptr, &left) != MF_MEM_PINNED:
        raise FeedError(f"0x{ptr:x} is not live pinned memory of this package (freed or foreign)")
    if left < nbytes:
        raise ValueError(f"{nbytes} bytes run past the end of the pinned allocation at 0x{ptr:x} ({left} left)")
    return 0


def read_pinned_u32(ptr, Py_ssize_t count):
    """``count`` uint32 ids copied out of live pinned memory at ``ptr`` (a readback slot).
    Read only what an event has declared complete."""
    cdef uint64_t p
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    if count > (1 << 40):  # so count * 4 cannot wrap
        raise ValueError(f"count must be at most 2**40, got {count}")
    u64_of(ptr, &p, "pointer")
    pinned_range(p, <size_t>count * 4)
    cdef const uint32_t *ids = <const uint32_t *><size_t>p
    return [ids[i] for i in range(count)]


def write_pinned_u32(ptr, values):
    """Store uint32 ``values`` into live pinned memory at ``ptr``."""
    cdef uint64_t p
    cdef _Words words = words_of(list(values), False, "values", 1 << 28)  # all checked first
    u64_of(ptr, &p, "pointer")
    pinned_range(p, <size_t>words.n * 4)
    memcpy(<void *><size_t>p, words.data, <size_t>words.n * 4)


cdef mf_status copy_d2h_async_c(void *dst, const void *src, size_t nbytes, uint64_t stream) noexcept nogil:
    return mf_copy_d2h_async(dst, src, nbytes, stream)

cdef mf_status copy_h2d_async_c(void *dst, const void *src, size_t nbytes, uint64_t stream) noexcept nogil:
    return mf_copy_h2d_async(dst, src, nbytes, stream)
