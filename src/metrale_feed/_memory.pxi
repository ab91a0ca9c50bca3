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
        if self._ptr != NULL:
            _object_pinned.discard(<size_t>self._ptr)
            mf_host_free(self._ptr, self._nbytes)

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
            raise BufferError(f"the pinned buffer has {self._exports} exported view(s); release them first")
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
        if self._ptr != NULL:
            _cell_rows.pop(<size_t>self._ptr, None)
            mf_device_free(self._ptr)

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
        if mf_active_backend() != MF_BACKEND_CUDA:
            raise AttributeError("__cuda_array_interface__ exists only on the cuda backend")
        return {"shape": (self._nbytes,), "typestr": "|u1", "data": (<size_t>self._ptr, False),
                "version": 3, "strides": None}

    def memset_async(self, int value, stream=0):
        cdef uint64_t s
        self._check_open()
        stream_of(stream, &s)
        check(mf_memset_async(self._ptr, value, self._nbytes, s))

    def close(self):
        if self._ptr == NULL:
            return
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


def copy_d2h_async(src, dst, stream=0):
    """Copy ``len(dst)`` bytes from device ``src`` into host buffer ``dst`` on ``stream``; never
    waits. ``dst`` must stay untouched until the stream has passed the copy."""
    cdef void *device
    cdef void *host
    cdef size_t nbytes
    cdef uint64_t s
    cdef _HeldBuffer held = None
    device_ptr_of(src, &device)
    stream_of(stream, &s)
    held = host_ptr_of(dst, True, &host, &nbytes)
    check(mf_copy_d2h_async(host, device, nbytes, s))
    if held is not None and nbytes:
        hold_until_passed(held, s)


def copy_h2d_async(dst, src, stream=0):
    """Copy ``len(src)`` bytes from host buffer ``src`` into device ``dst`` on ``stream``."""
    cdef void *device
    cdef void *host
    cdef size_t nbytes
    cdef uint64_t s
    cdef _HeldBuffer held = None
    device_ptr_of(dst, &device)
    stream_of(stream, &s)
    held = host_ptr_of(src, False, &host, &nbytes)
    check(mf_copy_h2d_async(device, host, nbytes, s))
    if held is not None and nbytes:
        hold_until_passed(held, s)


def copy_d2d_async(dst, src, nbytes, stream=0):
    cdef size_t n = size_of(nbytes, "nbytes")
    cdef void *d
    cdef void *s_ptr
    cdef uint64_t s
    device_ptr_of(dst, &d)
    device_ptr_of(src, &s_ptr)
    stream_of(stream, &s)
    check(mf_copy_d2d_async(d, s_ptr, n, s))


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
