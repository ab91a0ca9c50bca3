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


# Rows the last argmax launched into each feed-cell array, by address: the default from_row bound
# of the resolve that reads them (launch order is stream order for one stream).
cdef dict _cell_rows = {}


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
    cdef uint64_t s, e
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
        rows = int_of(rows, "rows", 1, 4096)
    else:
        if rows is None:
            if masks is None:
                raise ValueError("rows is required when masks is None")
            keep.words = words_of(masks, True, "masks")
            rows = keep.words.n // 2
        else:
            rows = int_of(rows, "rows", 1, 4096)
            keep.words = unmasked_words(rows) if masks is None else words_of(masks, True, "masks")
        if keep.words.n != 2 * rows:
            raise ValueError(f"masks hold {keep.words.n // 2} rows, not {rows}")
        a.masks = keep.words.data
    a.rows = rows
    a.vocab = <uint32_t>int_of(vocab, "vocab", 1, 1 << 24)
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
    check(mf_argmax_to_feed(&a, s))
    _cell_rows[<size_t>a.cells] = a.rows
    if held is not None:
        hold_until_passed(held, s)
    return a.rows


def argmax_to_feed(logits, masks, cells, dst, event, stream=0, *, rows=None, vocab, dtype,
                   row_stride=None, bitmask=None):
    """Masked argmax of ``rows`` rows of ``logits`` into feed ``cells``, then an async copy of
    ``rows * 4`` bytes of cells into ``dst`` and a record of ``event``, in stream order and with
    no host synchronisation.

    Parameters
    ----------
    masks : pairs, a uint32 buffer, device memory, or None
        Two banned ids per row. Host masks may be reused as soon as this returns; device-resident
        masks (a DeviceBuffer, a device pointer) are read when the kernel runs (``rows`` is then
        required, and a mask id >= vocab masks nothing).
    bitmask : device memory, optional
        int32 words ``[rows, ceil(vocab / 32)]``; bit ``v % 32`` of word ``v // 32`` set allows
        id ``v``. Read when the kernel runs. A row with no allowed id gives ``NO_TOKEN``.
    dst : pinned memory, a host buffer, or None
        Valid once ``event`` completes (on CUDA a pageable ``dst`` makes the copy wait).

    Returns
    -------
    int
        The rows launched (taken from ``masks`` when ``rows`` is None).

    Raises
    ------
    ValueError, TypeError
        Bad input, before anything is queued.

    Examples
    --------
    >>> argmax_to_feed(logits, [(5, NO_TOKEN)], cells, dst, ev, vocab=32000, dtype="bf16")  # doctest: +SKIP
    1
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
    """``out[i]`` = the host id of ``sources[i]``, or ``cells[from_row]`` of the previous step,
    on the device in stream order.

    Host ``sources`` are read before this returns, and a ``from_row >= prev_rows`` raises before
    launch; device-resident ``sources`` (a DeviceBuffer, a device pointer) are read when the
    kernel runs (``rows`` of them, by default the buffer's length in words), and a
    ``from_row >= prev_rows`` there resolves to ``NO_TOKEN``. By default ``prev_rows`` is the
    row count of the last ``argmax_to_feed`` into these cells."""
    cdef uint64_t s
    cdef void *cells_ptr
    cdef void *out_ptr
    cdef void *src_ptr
    cdef _Words words = None
    cdef uint32_t n
    cdef unsigned flags = 0
    if device_resident(sources, &src_ptr, "sources"):
        n = <uint32_t>int_of(device_words(sources, src_ptr) if rows is None else rows, "rows", 1, 4096)
        flags = MF_SOURCES_DEVICE
    else:
        words = words_of(sources, False, "sources")
        src_ptr = <void *>words.data
        if rows is not None and rows != words.n:
            raise ValueError(f"rows {rows} differs from the {words.n} sources given")
        if words.n > 4096:
            raise ValueError(f"rows must be in [1, 4096], got {words.n}")
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
    a.rows = <uint32_t>int_of(rows, "rows", 1, 4096)
    a.vocab = <uint32_t>int_of(vocab, "vocab", 1, 1 << 24)
    a.dtype = dtype_of(dtype)
    stream_of(stream, &s)
    check(mf_reference_forward(&a, s))


cdef mf_status argmax_to_feed_c(const mf_argmax_args *args, uint64_t stream) noexcept nogil:
    return mf_argmax_to_feed(args, stream)

cdef mf_status resolve_feed_c(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, uint64_t stream) noexcept nogil:
    return mf_resolve_feed(sources, n, cells, prev_rows, out, stream)
