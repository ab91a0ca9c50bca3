# Page-locked host memory with zero-copy Python buffers, device memory, and the async copies.

@cython.final
cdef class PinnedBuffer:
    """Zeroed page-locked (pinned) host memory, the destination of asynchronous readbacks.

    It exports the buffer protocol: ``memoryview(buf)`` and ``numpy.frombuffer(buf, numpy.uint32)``
    see the same bytes without a copy. Read them only after an event recorded behind the copy that
    writes them has completed. ``close()`` (or leaving a ``with`` block) frees the memory once the
    work queued on it has passed, and refuses while a view is still exported.

    Parameters
    ----------
    nbytes : int
        Size in bytes, at least 1 (``rows * 4`` for ``rows`` token ids).
    portable, mapped, write_combined : bool, optional
        CUDA's ``cudaHostAlloc`` flags (no effect on the host backend). Default False.

    Raises
    ------
    ValueError
        ``nbytes`` below 1 or negative.
    TypeError
        ``nbytes`` is not an int.
    FeedError
        The allocation failed.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> with mf.PinnedBuffer(4 * 4) as ids:
    ...     np.frombuffer(ids, dtype=np.uint32).tolist()
    [0, 0, 0, 0]
    """

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
        if ptr != NULL and not _exiting:
            _object_pinned.discard(<size_t>ptr)
            with nogil:  # a free never waits (docs/lifetimes.md, rule 5), but takes ledger locks
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
        >>> import metrale_feed as mf
        >>> buf = mf.PinnedBuffer(64)
        >>> buf.view("float32", (4, 4)).shape
        (4, 4)
        """
        self._check_open()
        return make_view(self, self._nbytes, True, dtype, shape, offset)

    @property
    def ptr(self):
        """The memory's address, an int (what ``copy_d2h_async`` or a C library takes).
        """
        self._check_open()
        return <size_t>self._ptr

    @property
    def nbytes(self):
        """The size in bytes.
        """
        return self._nbytes

    @property
    def closed(self):
        """Whether ``close()`` has run.
        """
        return self._ptr == NULL

    def __len__(self):
        return self._nbytes

    def close(self):
        """Free the memory (after queued work that may touch it). Refused while views exist."""
        if self._ptr == NULL:
            return
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
    """Device memory (host memory on the host backend), e.g. the feed cells or a logits array.

    The memory is not initialised; ``memset_async`` fills it. It is freed by ``close()``, by leaving a
    ``with`` block or when the object is collected, after the work queued on it has passed. Copies
    into or out of it are bounds-checked against its size before launch. On the cuda backend it has
    ``__cuda_array_interface__``, so CuPy, Numba and PyTorch can view it.

    Parameters
    ----------
    nbytes : int
        Size in **bytes**, at least 1: ``rows * 4`` for ``rows`` feed cells, ``rows * vocab * 4`` for
        float32 logits.

    Raises
    ------
    ValueError
        ``nbytes`` below 1 or negative.
    TypeError
        ``nbytes`` is not an int.
    FeedError
        The allocation failed (``CudaError`` on the cuda backend).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> rows = 256
    >>> with mf.DeviceBuffer(rows * 4) as cells:   # one uint32 feed cell per row
    ...     cells.nbytes
    1024
    """

    def __cinit__(self, nbytes):
        self._nbytes = size_of(nbytes, "nbytes")
        check(mf_device_alloc(self._nbytes, &self._ptr))

    def __dealloc__(self):
        cdef void *ptr = self._ptr
        if ptr != NULL and not _exiting:
            forget_cell_rows(<size_t>ptr, self._nbytes)
            with nogil:  # as PinnedBuffer's
                mf_device_free(ptr)

    cdef int _check_open(self) except -1:
        if self._ptr == NULL:
            raise FeedError("the device buffer is closed")
        return 0

    @property
    def ptr(self):
        """The device address, an int.
        """
        self._check_open()
        return <size_t>self._ptr

    @property
    def nbytes(self):
        """The size in bytes.
        """
        return self._nbytes

    @property
    def closed(self):
        """Whether ``close()`` has run.
        """
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
        >>> import metrale_feed as mf
        >>> logits = mf.DeviceBuffer(4 * 2 * 8)
        >>> logits.view("f32", (2, 8)).shape
        (2, 8)
        """
        self._check_open()
        return make_view(self, self._nbytes, False, dtype, shape, offset)

    def memset_async(self, int value, stream=0):
        """Set every byte to ``value`` on ``stream``; never waits.

        Parameters
        ----------
        value : int
            The byte value (its low 8 bits are used).
        stream : Stream, int or stream-like, optional
            Default 0, the default stream.

        Raises
        ------
        FeedError
            The buffer or the stream is closed.
        """
        cdef uint64_t s
        self._check_open()
        stream_of(stream, &s)
        queued_on(s, mf_memset_async(self._ptr, value, self._nbytes, s), self, 0)

    def close(self):
        """Free the memory after the work queued on it has passed. Closing twice is a no-op;
        closing is refused (``BufferError``) while tensors made from it through DLPack are alive.
        """
        if self._ptr == NULL:
            return
        if self._exports:
            raise BufferError(f"the device buffer has {self._exports} exported tensor(s); release them first")
        cdef void *ptr = self._ptr
        self._ptr = NULL
        forget_cell_rows(<size_t>ptr, self._nbytes)  # a later allocation may reuse the address
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
    """Copy ``len(dst)`` bytes from device ``src`` into host buffer ``dst`` on ``stream``.

    The call never waits: ``dst`` must stay alive and unread until the stream has passed the copy
    (an event recorded after it has completed). Into a ``PinnedBuffer`` the copy is asynchronous on
    CUDA; a pageable host buffer is held by the package until the copy has passed.

    Parameters
    ----------
    src : DeviceBuffer, int, or a tensor (DLPack or ``__cuda_array_interface__``)
        The device memory; a ``DeviceBuffer`` must hold at least ``len(dst)`` bytes.
    dst : writable buffer
        A ``PinnedBuffer``, a numpy array, a bytearray: any writable contiguous buffer.
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.

    Raises
    ------
    ValueError
        The copy would run past the end of ``src``.
    TypeError
        ``dst`` is not a writable contiguous buffer.
    FeedError
        A closed or unknown buffer or stream.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.DeviceBuffer(8) as d, mf.PinnedBuffer(8) as h, mf.Event() as e:
    ...     d.memset_async(7)
    ...     mf.copy_d2h_async(d, h)
    ...     e.record(0); e.synchronize()
    ...     bytes(h)
    b'\\x07\\x07\\x07\\x07\\x07\\x07\\x07\\x07'
    """
    cdef void *device
    cdef void *host
    cdef size_t nbytes, have
    cdef uint64_t s
    cdef _HeldBuffer held = None
    stream_of(stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        launch.device(src, &device, &have, "copy source", False, False)
        held = host_ptr_of(dst, True, &host, &nbytes)
        device_side_fits(have, nbytes, "copy source")
        if not nbytes:
            held = None
        launch.hold(held)
        launch.queued(mf_copy_d2h_async(host, device, nbytes, s), (src, dst))
    finally:
        launch.close()


def copy_h2d_async(dst, src, stream=0):
    """Copy ``len(src)`` bytes from host buffer ``src`` into device ``dst`` on ``stream``.

    The call never waits: ``src`` must stay alive and unchanged until the stream has passed the copy.

    Parameters
    ----------
    dst : DeviceBuffer, int, or an object with ``__cuda_array_interface__`` or ``data_ptr()``
        The device memory; a ``DeviceBuffer`` must hold at least ``len(src)`` bytes.
    src : buffer
        Any contiguous buffer (a ``PinnedBuffer``, a numpy array, bytes).
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.

    Raises
    ------
    ValueError
        The copy would run past the end of ``dst``.
    FeedError
        A closed or unknown buffer or stream.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> logits = np.zeros((2, 8), np.float32)
    >>> with mf.DeviceBuffer(logits.nbytes) as d:
    ...     mf.copy_h2d_async(d, logits)
    ...     mf.stream_synchronize()
    """
    cdef void *device
    cdef void *host
    cdef size_t nbytes, have
    cdef uint64_t s
    cdef _HeldBuffer held = None
    stream_of(stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        launch.device(dst, &device, &have, "copy destination", True, False)
        held = host_ptr_of(src, False, &host, &nbytes)
        device_side_fits(have, nbytes, "copy destination")
        if not nbytes:
            held = None
        launch.hold(held)
        launch.queued(mf_copy_h2d_async(device, host, nbytes, s), (dst, src))
    finally:
        launch.close()


def copy_d2d_async(dst, src, nbytes, stream=0):
    """Copy ``nbytes`` bytes between device allocations on ``stream``; never waits.

    Parameters
    ----------
    dst, src : DeviceBuffer, int, or a tensor (DLPack or ``__cuda_array_interface__``)
        Destination and source; a ``DeviceBuffer`` must hold ``nbytes``.
    nbytes : int
        Bytes to copy.
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.

    Raises
    ------
    ValueError
        The copy would run past the end of ``dst`` or ``src``, or ``nbytes`` is negative.
    FeedError
        A closed or unknown buffer or stream.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> with mf.DeviceBuffer(16) as a, mf.DeviceBuffer(16) as b:
    ...     mf.copy_d2d_async(b, a, 16)
    ...     mf.stream_synchronize()
    """
    cdef size_t n = size_of(nbytes, "nbytes")
    cdef void *d
    cdef void *s_ptr
    cdef size_t have
    cdef uint64_t s
    stream_of(stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        launch.device(dst, &d, &have, "copy destination", True, False)
        device_side_fits(have, n, "copy destination")
        launch.device(src, &s_ptr, &have, "copy source", False, False)
        device_side_fits(have, n, "copy source")
        launch.queued(mf_copy_d2d_async(d, s_ptr, n, s), (dst, src))
    finally:
        launch.close()


def alloc_host_pinned(nbytes):
    """Zeroed page-locked memory as an int pointer (the trait's form of ``PinnedBuffer``).

    Parameters
    ----------
    nbytes : int
        Size in bytes, at least 1.

    Returns
    -------
    int
        The address; free it with ``free_host_pinned(ptr, nbytes)``.

    Raises
    ------
    ValueError
        ``nbytes`` below 1.
    FeedError
        The allocation failed.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> ptr = mf.alloc_host_pinned(16)
    >>> mf.read_pinned_u32(ptr, 4)
    [0, 0, 0, 0]
    >>> mf.free_host_pinned(ptr, 16)
    """
    cdef void *ptr
    check(mf_host_alloc(size_of(nbytes, "nbytes"), 0, &ptr))
    return <size_t>ptr


def free_host_pinned(ptr, nbytes):
    """Free what ``alloc_host_pinned`` returned, after the work queued on it has passed.

    Parameters
    ----------
    ptr : int
        The address ``alloc_host_pinned`` returned.
    nbytes : int
        The size it was allocated with.

    Raises
    ------
    FeedError
        A wrong size, a pointer this package did not allocate, one already freed, or a
        ``PinnedBuffer``'s memory (close the buffer instead).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.free_host_pinned(mf.alloc_host_pinned(64), 64)
    """
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
    """Copy ``count`` uint32 ids out of live pinned memory at ``ptr`` (a readback slot).

    Read only what an event has declared complete: the call itself does not wait.

    Parameters
    ----------
    ptr : int
        An address inside memory from ``alloc_host_pinned`` or a ``PinnedBuffer``.
    count : int
        How many uint32 values; ``count * 4`` bytes must lie inside the allocation.

    Returns
    -------
    list of int

    Raises
    ------
    FeedError
        ``ptr`` is not inside live pinned memory of this package, or the range runs past its end.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> ptr = mf.alloc_host_pinned(8)
    >>> mf.read_pinned_u32(ptr, 2)
    [0, 0]
    >>> mf.free_host_pinned(ptr, 8)
    """
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
    """Store uint32 ``values`` into live pinned memory at ``ptr``.

    Parameters
    ----------
    ptr : int
        An address inside memory from ``alloc_host_pinned`` or a ``PinnedBuffer``.
    values : uint32 buffer or iterable of int
        Each in ``[0, 2**32)``. All are checked before any is stored; an iterable is read only up
        to what fits, so an endless one is refused instead of filling memory.

    Raises
    ------
    FeedError
        ``ptr`` is not inside live pinned memory, or the range runs past its end.
    ValueError
        A value outside uint32, or more values than fit in the allocation.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> ptr = mf.alloc_host_pinned(8)
    >>> mf.write_pinned_u32(ptr, [1, 2]); mf.read_pinned_u32(ptr, 2)
    [1, 2]
    >>> mf.free_host_pinned(ptr, 8)
    """
    cdef uint64_t p
    cdef size_t left = 0
    cdef Py_ssize_t fits
    cdef _Words words
    u64_of(ptr, &p, "pointer")
    pinned_range(p, 0)
    mf_mem_lookup(<void *><size_t>p, &left)
    fits = <Py_ssize_t>min(left // 4, 1 << 28)
    if PyObject_CheckBuffer(values) and not isinstance(values, (bytes, bytearray)):
        words = words_of(values, False, "values", 1 << 28)
    elif hasattr(values, "__len__"):  # sized: its length is checked against the buffer below
        words = words_of(list(values), False, "values", 1 << 28)
    else:  # an iterator or generator, maybe endless: read no more than fits, plus one
        items = []
        for value in values:
            if len(items) == fits:
                raise ValueError(f"values hold more ids than the {fits} that fit in the pinned "
                                 f"allocation at 0x{p:x}")
            items.append(value)
        words = words_of(items, False, "values", fits)  # all checked first
    pinned_range(p, <size_t>words.n * 4)
    memcpy(<void *><size_t>p, words.data, <size_t>words.n * 4)


cdef mf_status copy_d2h_async_c(void *dst, const void *src, size_t nbytes, uint64_t stream) noexcept nogil:
    return mf_copy_d2h_async(dst, src, nbytes, stream)

cdef mf_status copy_h2d_async_c(void *dst, const void *src, size_t nbytes, uint64_t stream) noexcept nogil:
    return mf_copy_h2d_async(dst, src, nbytes, stream)


def _device_bytes_left(ptr):
    """Bytes of this package's device allocation from ``ptr`` to its end, or None where the layer
    cannot say (a pointer it did not allocate on the cuda backend: foreign memory it trusts). On
    the host and simt backends every device pointer is this package's, so an unknown one is 0."""
    cdef uint64_t p
    cdef size_t left = 0
    u64_of(ptr, &p, "pointer")
    if mf_mem_lookup(<void *><size_t>p, &left) == MF_MEM_DEVICE:
        return left
    return None if mf_active_backend() == MF_BACKEND_CUDA else 0
