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


def argmax_to_feed(logits, masks, cells, dst, event, stream=0, *, rows=None, vocab, dtype,
                   row_stride=None):
    """Masked argmax of ``rows`` rows of ``logits`` into feed ``cells``, then an async copy of
    ``rows * 4`` bytes of cells into ``dst`` and a record of ``event``, in stream order and with
    no host synchronisation. ``masks`` (pairs or a uint32 buffer, None for no mask) may be reused
    as soon as this returns; ``dst`` (pinned memory) is valid once ``event`` completes (on CUDA a
    pageable ``dst`` makes the copy, and so this call, wait for the kernel). Returns
    the rows launched (taken from ``masks`` when ``rows`` is None)."""
    cdef mf_argmax_args a
    cdef uint64_t s, e, hold
    cdef void *ptr
    cdef size_t dst_len
    cdef _HeldBuffer held = None
    cdef _Words words
    if rows is None:
        if masks is None:
            raise ValueError("rows is required when masks is None")
        words = words_of(masks, True, "masks")
        rows = words.n // 2
    else:
        rows = int_of(rows, "rows", 1, MF_MAX_ROWS)
        words = unmasked_words(rows) if masks is None else words_of(masks, True, "masks")
    if words.n != 2 * rows:
        raise ValueError(f"masks hold {words.n // 2} rows, not {rows}")
    a.rows = rows
    a.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
    a.row_stride = a.vocab if row_stride is None else int_of(row_stride, "row_stride", 1, UINT64_MAX)
    a.dtype = dtype_of(dtype)
    a.masks = words.data
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
    _cell_rows[<size_t>a.cells] = a.rows
    return a.rows


def resolve_feed(sources, cells, out, stream=0, *, prev_rows=None):
    """``out[i]`` = the host id of ``sources[i]``, or ``cells[from_row]`` of the previous step,
    on the device in stream order. A ``from_row >= prev_rows`` raises before launch; by default
    ``prev_rows`` is the row count of the last ``argmax_to_feed`` into these cells."""
    cdef uint64_t s
    cdef void *cells_ptr
    cdef void *out_ptr
    cdef _Words words = words_of(sources, False, "sources")
    device_ptr_of(cells, &cells_ptr)
    if prev_rows is None:
        prev_rows = _cell_rows.get(<size_t>cells_ptr)
        if prev_rows is None:
            raise ValueError("prev_rows is required: no argmax_to_feed has written these cells")
    prev_rows = int_of(prev_rows, "prev_rows", 0, 0xFFFFFFFF)
    device_ptr_of(out, &out_ptr)
    stream_of(stream, &s)
    check(mf_resolve_feed(words.data, <uint32_t>words.n, <const uint32_t *>cells_ptr,
                          <uint32_t>prev_rows, <uint32_t *>out_ptr, s))


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


cdef mf_status argmax_to_feed_c(const mf_argmax_args *args, uint64_t stream) noexcept nogil:
    return mf_argmax_to_feed(args, stream)

cdef mf_status resolve_feed_c(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, uint64_t stream) noexcept nogil:
    return mf_resolve_feed(sources, n, cells, prev_rows, out, stream)
