# Launchers of the two feed kernels and the reference forward. Every argument is checked here
# or in the C layer before anything is queued.

cdef dict _DTYPES = {"float32": MF_DTYPE_F32, "float16": MF_DTYPE_F16, "bfloat16": MF_DTYPE_BF16,
                     "f4": MF_DTYPE_F32, "f2": MF_DTYPE_F16, "half": MF_DTYPE_F16, "float": MF_DTYPE_F32}


cdef mf_dtype dtype_of(object dtype) except *:
    # A string, a dtype object (.name), or a scalar type such as numpy.float16 or ml_dtypes.bfloat16.
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if not isinstance(name, str) and isinstance(dtype, type):
        name = dtype.__name__
    if not isinstance(name, str):
        name = str(dtype)
    if name.startswith("torch."):
        name = name[6:]
    code = _DTYPES.get(name)
    if code is None:
        raise ValueError(f"unknown logits dtype {dtype!r}: use float32, float16 or bfloat16")
    return <mf_dtype>code


cdef uint32_t cells_capacity(object cells, void *ptr, uint32_t rows):
    cdef size_t left = 0
    if type(cells) is DeviceBuffer:
        return <uint32_t>min((<DeviceBuffer>cells)._nbytes // 4, 0xFFFFFFFF)
    if mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        return <uint32_t>min(left // 4, 0xFFFFFFFF)
    return rows  # foreign device memory: CUDA cannot say, so trust the caller


cdef uint32_t table_words_of(object tables, void *ptr):
    """Ids in a block-table array: its DeviceBuffer's or allocation's length (the forward reads
    nothing past it); foreign device memory on cuda cannot say, so the caller is trusted."""
    cdef size_t left = 0
    if type(tables) is DeviceBuffer:
        return <uint32_t>min((<DeviceBuffer>tables)._nbytes // 4, 0xFFFFFFFF)
    if mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        return <uint32_t>min(left // 4, 0xFFFFFFFF)
    return 0xFFFFFFFF


cdef bint device_resident(object obj, void **out, str what) except -1:
    """Whether ``obj`` is device memory (a DeviceBuffer, an int pointer to a device allocation of
    this package, a CUDA array), with its pointer in ``out``; False for a host buffer. Device
    memory is read when the kernel runs, host memory before the call returns."""
    cdef size_t left = 0
    if isinstance(obj, int) and not isinstance(obj, bool):
        device_ptr_of(obj, out)
        if mf_mem_lookup(out[0], &left) != MF_MEM_DEVICE:
            raise TypeError(f"{what} must be a uint32 buffer or a sequence, or device memory: the int "
                            f"{obj:#x} is not a device allocation of this package")
        return True
    if type(obj) is DeviceBuffer or hasattr(obj, "__cuda_array_interface__"):
        device_ptr_of(obj, out)
        return True
    return False


cdef class _PickInputs:
    """What one argmax/sample launch holds while its descriptor is filled (host words, params)."""
    cdef _Words words
    cdef _HeldBuffer params


cdef object _params_dtype = None


cdef int fill_params(mf_argmax_args *a, object params, _PickInputs keep) except -1:
    """``params``: one SAMPLING_PARAMS_DTYPE record per row, host (read and checked now) or device
    memory (read when the kernel runs)."""
    global _params_dtype
    cdef void *ptr
    if isinstance(params, int) and not isinstance(params, bool):
        device_ptr_of(params, &ptr)  # device memory, foreign ones included (the C layer checks ours)
        a.params = <const mf_sampling_params *>ptr
        a.flags |= MF_ARGS_PARAMS_DEVICE
        return 0
    if device_resident(params, &ptr, "params"):
        a.params = <const mf_sampling_params *>ptr
        a.flags |= MF_ARGS_PARAMS_DEVICE
        return 0
    if _params_dtype is None:
        from metrale_feed.sampling import SAMPLING_PARAMS_DTYPE
        _params_dtype = SAMPLING_PARAMS_DTYPE
    if getattr(params, "dtype", None) != _params_dtype:
        raise TypeError("params must be an array of metrale_feed.SAMPLING_PARAMS_DTYPE records "
                        f"(or device memory holding them), not {getattr(params, 'dtype', type(params).__name__)}")
    keep.params = host_buffer_of(params, False, "params")
    if keep.params.view.len < <Py_ssize_t>a.rows * 32:
        raise ValueError(f"params hold {keep.params.view.len // 32} rows, fewer than the {a.rows} launched")
    a.params = <const mf_sampling_params *>keep.params.view.buf
    return 0


cdef object launch_pick(object logits, object masks, object cells, object dst, object event,
                        object stream, object bitmask, object params, object rows, object vocab,
                        object dtype, object row_stride):
    """The one launcher under argmax_to_feed and sample_to_feed: one descriptor, one C call."""
    cdef mf_argmax_args a
    cdef uint64_t s, e, hold
    cdef void *ptr
    cdef size_t dst_len
    cdef _HeldBuffer held = None
    cdef _PickInputs keep = _PickInputs.__new__(_PickInputs)
    memset(&a, 0, sizeof(a))
    if masks is not None and device_resident(masks, &ptr, "masks"):
        if rows is None:
            raise ValueError("rows is required with device-resident masks")
        a.masks = <const uint32_t *>ptr
        a.flags |= MF_ARGS_MASKS_DEVICE
        rows = int_of(rows, "rows", 1, MF_MAX_ROWS)
    else:
        if rows is None:
            if masks is None:
                raise ValueError("rows is required when masks is None")
            keep.words = words_of(masks, True, "masks")
            rows = keep.words.n // 2
        else:
            rows = int_of(rows, "rows", 1, MF_MAX_ROWS)
            if masks is not None:
                keep.words = words_of(masks, True, "masks")
        if keep.words is not None:  # None: no masks, which the C layer reads as constant (NULL)
            if keep.words.n != 2 * rows:
                raise ValueError(f"masks hold {keep.words.n // 2} rows, not {rows}")
            a.masks = keep.words.data
    a.rows = rows
    a.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
    a.row_stride = a.vocab if row_stride is None else int_of(row_stride, "row_stride", 1, UINT64_MAX)
    a.dtype = dtype_of(dtype)
    if bitmask is not None:
        if type(bitmask) is not DeviceBuffer and PyObject_CheckBuffer(bitmask) \
                and not hasattr(bitmask, "__cuda_array_interface__"):
            raise TypeError("bitmask must be device memory (a DeviceBuffer, a device pointer or a "
                            f"CUDA array) of int32 words, not {type(bitmask).__name__}")
        device_ptr_of(bitmask, &ptr)  # an int: device memory, foreign ones included
        a.bitmask = <const uint32_t *>ptr
    if params is not None:
        fill_params(&a, params, keep)
    device_ptr_of(logits, &ptr)
    a.logits = ptr
    device_ptr_of(cells, &ptr)
    a.cells = <uint32_t *>ptr
    a.cell_capacity = cells_capacity(cells, ptr, a.rows)
    event_of(event, &a.event, True)
    stream_of(stream, &s)
    if dst is None:
        a.host_dst = NULL
    elif isinstance(dst, int):
        u64_of(dst, &e, "dst pointer")
        a.host_dst = <void *><size_t>e
        pinned_range(e, a.rows * 4)
    else:
        held = host_ptr_of(dst, True, &a.host_dst, &dst_len)
        if dst_len < a.rows * 4:
            raise ValueError(f"dst holds {dst_len} bytes; {a.rows} ids need {a.rows * 4}")
    hold = reserve_hold(held)  # all or nothing: reserved before the launch is queued
    commit_hold(held, hold, s, mf_argmax_to_feed(&a, s))
    note_capture(s, (logits, masks, cells, dst, event, bitmask, params))
    _cell_rows[<size_t>a.cells] = a.rows
    return a.rows


def argmax_to_feed(logits, masks, cells, dst, event, stream=0, *, rows=None, vocab, dtype,
                   row_stride=None, bitmask=None):
    """Masked argmax of each row into the feed cells, then an async readback and an event record.

    In stream order and with no host synchronisation: the argmax of each row (the rule is in
    docs/encodings.md, "The masked-argmax rule") is written to ``cells[row]``, ``rows * 4`` bytes
    of cells are copied into ``dst``, and ``event`` is recorded. ``dst`` holds the ids once
    ``event`` has completed; ``masks`` may be reused as soon as the call returns. Every argument is
    checked before anything is launched.

    Parameters
    ----------
    logits : DeviceBuffer, int, or a device array
        Device memory holding ``rows`` rows of ``vocab`` values of ``dtype``, row ``r`` starting at
        element ``r * row_stride``: a ``DeviceBuffer``, an int device pointer, or an object with
        ``__cuda_array_interface__`` (CuPy, Numba), ``data_ptr()`` (a CUDA ``torch.Tensor``) or
        ``.ptr``. A ``DeviceBuffer`` is bounds-checked; a foreign pointer is trusted.
    masks : sequence of (int, int), uint32 buffer, device memory, or None
        Two ids per row that may not win, ``NO_TOKEN`` where unused: pairs, or a buffer of
        ``2 * rows`` uint32 (a ``(rows, 2)`` array), read before the call returns. Device memory
        (a ``DeviceBuffer``, a device pointer of this package) is read when the kernel runs:
        ``rows`` is then required, and a mask id ``>= vocab`` masks nothing. None masks nothing
        (then ``rows`` is required).
    cells : DeviceBuffer, int, or a device array
        The feed cells, one uint32 per row; a ``DeviceBuffer`` must hold ``rows * 4`` bytes.
    dst : PinnedBuffer, writable buffer, int, or None
        Where the ids are copied: a ``PinnedBuffer``, any writable buffer of at least ``rows * 4``
        bytes, an int pointer from ``alloc_host_pinned``, or None for no readback.
    event : Event, int, or None
        Recorded after the copy; None records nothing.
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.
    rows : int, optional
        Rows to process, 1 to 4096; taken from ``masks`` when None.
    vocab : int
        Values per row, 1 to 2**24.
    dtype : {"float32", "float16", "bfloat16"}
        The logits' element type.
    row_stride : int, optional
        Distance between row starts, in **elements** of ``dtype`` (not bytes), at least ``vocab``;
        default ``vocab``.
    bitmask : device memory, optional
        int32 words of shape ``[rows, ceil(vocab / 32)]``; bit ``v % 32`` of word ``v // 32`` set
        allows id ``v`` (the xgrammar convention), combined with ``masks``. Read when the kernel
        runs. A row with no allowed id gives ``NO_TOKEN``.

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError
        A mask id at or beyond ``vocab`` other than ``NO_TOKEN``; masks that do not cover ``rows``;
        ``rows`` outside 1..4096 or beyond the cells' or ``dst``'s capacity; ``row_stride < vocab``;
        an unknown ``dtype``; ``rows`` missing with ``masks=None``.
    TypeError
        An argument of the wrong kind (a float where an int is needed, a non-buffer ``dst``).
    FeedError
        A closed or unknown buffer, event or stream; ``dst`` not inside pinned memory of this
        package (an int pointer); a failed launch (``CudaError`` on the cuda backend).

    See Also
    --------
    resolve_feed : the next step's input ids from these cells.
    reference_argmax : the same rule in numpy.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> logits = np.array([[0.1, 0.9, 0.5], [0.7, 0.2, 0.7]], np.float32)
    >>> with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(2 * 4) as cells, \\
    ...         mf.PinnedBuffer(2 * 4) as ids, mf.Event() as done:
    ...     mf.copy_h2d_async(dev, logits)
    ...     mf.argmax_to_feed(dev, [(1, mf.NO_TOKEN), (mf.NO_TOKEN, mf.NO_TOKEN)], cells, ids,
    ...                       done, vocab=3, dtype="float32")
    ...     done.synchronize()
    ...     np.frombuffer(ids, np.uint32).tolist()   # row 0 masks id 1; row 1 ties go low
    2
    [2, 0]
    """
    return launch_pick(logits, masks, cells, dst, event, stream, bitmask, None, rows, vocab, dtype,
                       row_stride)


def sample_to_feed(logits, params, cells, dst, event, stream=0, *, masks=None, bitmask=None,
                   rows=None, vocab=None, dtype=None, row_stride=None):
    """``argmax_to_feed`` with a sampled id per row (``docs/kernels.md``, "Sampling").

    Parameters
    ----------
    params : SAMPLING_PARAMS_DTYPE array, or device memory holding such records
        One record per row (``temperature``, ``top_p``, ``min_p``, ``top_k``, ``seed``,
        ``position``). Host params are read and checked before this returns; device-resident
        ones when the kernel runs (an out-of-range value there means its neutral setting).
    masks, bitmask
        As for ``argmax_to_feed``.

    Returns
    -------
    int
        The rows launched (``rows``, else the masks' rows, else the params' records).

    Raises
    ------
    ValueError
        A temperature that is negative or not finite, ``top_p`` outside (0, 1], ``min_p``
        outside [0, 1), fewer params than rows; before anything is queued.
    TypeError
        params of another dtype.

    Examples
    --------
    >>> p = sampling_params(2, temperature=0.7, top_p=0.9, seed=1, position=[5, 9])  # doctest: +SKIP
    >>> sample_to_feed(logits, p, cells, dst, ev, vocab=32000, dtype="f32")  # doctest: +SKIP
    2
    """
    cdef void *ptr
    if vocab is None or dtype is None:
        raise ValueError("vocab and dtype are required")
    if rows is None and masks is None:
        if device_resident(params, &ptr, "params"):
            raise ValueError("rows is required with device-resident params and no masks")
        rows = len(params)
    return launch_pick(logits, masks, cells, dst, event, stream, bitmask, params, rows, vocab, dtype,
                       row_stride)


def resolve_feed(sources, cells, out, stream=0, *, prev_rows=None, rows=None):
    """Build a step's input ids on the device from FeedSource words.

    In stream order: ``out[i]`` = the host id of ``sources[i]`` (bit 31 set), or ``cells[from_row]``
    of the previous step (bit 31 clear). See docs/encodings.md, "FeedSource".

    Parameters
    ----------
    sources : sequence of int, uint32 buffer, or device memory
        ``FeedSource`` words, one per row of the new step. Host sources are read before the call
        returns; device memory (a ``DeviceBuffer``, a device pointer of this package) is read when
        the kernel runs, and a ``from_row >= prev_rows`` there resolves to ``NO_TOKEN``.
    cells : DeviceBuffer, int, or a device array
        The previous step's feed cells.
    out : DeviceBuffer, int, or a device array
        Where the input ids go, one uint32 per source.
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.
    prev_rows : int, optional
        Rows of the previous step; default: the rows of the last ``argmax_to_feed`` into ``cells``.
    rows : int, optional
        With device-resident sources, how many to resolve (default: the buffer's length in words).

    Raises
    ------
    ValueError
        A ``from_row`` at or beyond ``prev_rows``; ``prev_rows`` missing when no ``argmax_to_feed``
        wrote these cells; ``out`` or ``cells`` too small.
    FeedError
        A closed or unknown buffer or stream.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> with mf.DeviceBuffer(8) as cells, mf.DeviceBuffer(8) as out, mf.PinnedBuffer(8) as host:
    ...     mf.copy_h2d_async(cells, np.array([11, 22], np.uint32))
    ...     mf.resolve_feed([mf.FeedSource.feed(1), mf.FeedSource.host(5)], cells, out, prev_rows=2)
    ...     mf.copy_d2h_async(out, host); mf.stream_synchronize()
    ...     np.frombuffer(host, np.uint32).tolist()
    [22, 5]
    """
    cdef uint64_t s
    cdef void *cells_ptr
    cdef void *out_ptr
    cdef void *src_ptr
    cdef _Words words = None
    cdef uint32_t n
    cdef unsigned flags = 0
    if device_resident(sources, &src_ptr, "sources"):
        n = <uint32_t>int_of(device_words(sources, src_ptr) if rows is None else rows, "rows", 1, MF_MAX_ROWS)
        flags = MF_SOURCES_DEVICE
    else:
        words = words_of(sources, False, "sources")
        src_ptr = <void *>words.data
        if rows is not None and rows != words.n:
            raise ValueError(f"rows {rows} differs from the {words.n} sources given")
        if words.n > MF_MAX_ROWS:
            raise ValueError(f"rows must be in [1, {MF_MAX_ROWS}], got {words.n}")
        n = <uint32_t>words.n
    device_ptr_of(cells, &cells_ptr)
    if prev_rows is None:
        prev_rows = _cell_rows.get(<size_t>cells_ptr)
        if prev_rows is None:
            raise ValueError("prev_rows is required: no argmax_to_feed has written these cells")
    prev_rows = int_of(prev_rows, "prev_rows", 0, 0xFFFFFFFF)
    device_ptr_of(out, &out_ptr)
    stream_of(stream, &s)
    check(mf_resolve_feed_flags(<const uint32_t *>src_ptr, n, <const uint32_t *>cells_ptr,
                                <uint32_t>prev_rows, <uint32_t *>out_ptr, flags, s))
    note_capture(s, (sources, cells, out))


cdef object device_words(object obj, void *ptr):
    """The uint32 words of device-resident sources: a DeviceBuffer's or this package's allocation's
    length; foreign memory cannot say, so it is refused."""
    cdef size_t left = 0
    if type(obj) is DeviceBuffer:
        return (<DeviceBuffer>obj)._nbytes // 4
    if mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        return left // 4
    raise ValueError("device-resident sources must be a DeviceBuffer or an allocation of this package "
                     "(their length is the row count)")


def reference_forward(input_ids, meta, tables, kv, kv_slots, block_size, rows, vocab, dtype,
                      logits, stream=0):
    """The reference model's forward kernel (device arrays; see feed.h). For ReferenceModel.
    ``logits=None`` only writes the KV cache (prefill)."""
    cdef mf_reference_args a
    cdef uint64_t s
    cdef void *ptr
    device_ptr_of(input_ids, &ptr)
    a.input_ids = <const uint32_t *>ptr
    device_ptr_of(meta, &ptr)
    a.meta = <const uint32_t *>ptr
    device_ptr_of(tables, &ptr)
    a.tables = <const uint32_t *>ptr
    a.table_words = table_words_of(tables, ptr)
    device_ptr_of(kv, &ptr)
    a.kv = <uint32_t *>ptr
    a.logits = NULL
    if logits is not None:
        device_ptr_of(logits, &ptr)
        a.logits = ptr
    a.kv_slots = <uint32_t>int_of(kv_slots, "kv_slots", 0, 0xFFFFFFFF)
    a.block_size = <uint32_t>int_of(block_size, "block_size", 1, 0xFFFFFFFF)
    a.rows = <uint32_t>int_of(rows, "rows", 1, MF_MAX_ROWS)
    a.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
    a.dtype = dtype_of(dtype)
    stream_of(stream, &s)
    check(mf_reference_forward(&a, s))
    note_capture(s, (input_ids, meta, tables, kv, logits))


cdef mf_status argmax_to_feed_c(const mf_argmax_args *args, uint64_t stream) noexcept nogil:
    return mf_argmax_to_feed(args, stream)

cdef mf_status resolve_feed_c(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, uint64_t stream) noexcept nogil:
    return mf_resolve_feed(sources, n, cells, prev_rows, out, stream)
