# Launchers of the two feed kernels and the reference forward. Every argument is checked here
# or in the C layer before anything is queued.

cdef uint32_t cells_capacity(object cells, void *ptr, size_t nbytes, uint32_t rows):
    cdef size_t left = 0
    if nbytes != <size_t>-1:  # a DeviceBuffer or a tensor: its own length
        return <uint32_t>min(nbytes // 4, 0xFFFFFFFF)
    if mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        return <uint32_t>min(left // 4, 0xFFFFFFFF)
    return rows  # foreign device memory: CUDA cannot say, so trust the caller


cdef int agree(object given, object found, str what) except -1:
    if given is not None and given != found:
        raise ValueError(f"{what}={given!r} disagrees with the logits tensor's {found!r}")
    return 0


cdef int logits_of(_Call call, object logits, mf_argmax_args *a, object rows, object vocab,
                   object dtype, object row_stride) except -1:
    """Logits: a tensor gives its own rows, vocab, dtype and row stride (given ones must agree);
    a DeviceBuffer or an int pointer needs vocab and dtype. Sets a.logits, a.vocab, a.dtype,
    a.row_stride, and a.rows when the tensor says."""
    cdef void *ptr
    cdef size_t nbytes
    cdef _Foreign f
    cdef int64_t t_rows, t_vocab, t_stride
    if not is_foreign(logits):
        if vocab is None or dtype is None:
            raise TypeError(f"{'vocab' if vocab is None else 'dtype'} is required unless logits is a tensor")
        a.vocab = <uint32_t>int_of(vocab, "vocab", 1, 1 << 24)
        a.row_stride = a.vocab if row_stride is None else int_of(row_stride, "row_stride", 1, UINT64_MAX)
        a.dtype = dtype_of(dtype)
        device_ptr_of(logits, &ptr)
        a.logits = ptr
        return 0
    f = call.foreign(logits, "logits")
    if f.entry is None or f.entry.code is None:
        raise TypeError(f"logits must be float32, float16 or bfloat16, not {f.type_name()}")
    if f.ndim == 1:
        t_rows, t_vocab, t_stride = 1, f.shape[0], f.shape[0]
        if f.shape[0] > 1 and f.strides[0] != 1:
            raise ValueError("logits must have unit stride along the vocabulary")
    elif f.ndim == 2:
        t_rows, t_vocab, t_stride = f.shape[0], f.shape[1], f.strides[0]
        if f.shape[1] > 1 and f.strides[1] != 1:
            raise ValueError("logits must have unit stride along the vocabulary (the last dimension)")
        if f.shape[0] == 1:
            t_stride = t_vocab
        elif t_stride < t_vocab:
            raise ValueError(f"logits rows overlap or run backwards (row stride {t_stride} < vocab {t_vocab})")
    else:
        raise ValueError(f"logits must be 1-D (vocab,) or 2-D (rows, vocab), not {f.ndim}-D")
    if t_rows < 1 or t_rows > 4096:
        raise ValueError(f"the logits tensor has {t_rows} rows; rows must be in [1, 4096]")
    if t_vocab < 1 or t_vocab > (1 << 24):
        raise ValueError(f"the logits tensor has vocab {t_vocab}; vocab must be in [1, 2**24]")
    agree(rows, t_rows, "rows")
    agree(vocab, t_vocab, "vocab")
    agree(row_stride, t_stride, "row_stride")
    if dtype is not None and dtype_entry(dtype) is not f.entry:
        raise ValueError(f"dtype={dtype!r} disagrees with the logits tensor's {f.entry.name}")
    a.rows = <uint32_t>t_rows
    a.vocab = <uint32_t>t_vocab
    a.row_stride = <uint64_t>t_stride
    a.dtype = <mf_dtype><int>f.entry.code
    a.logits = f.ptr
    call.lend(f, ((t_rows - 1) * t_stride + t_vocab) * <size_t>f.entry.itemsize)
    return 0


# Rows the last argmax launched into each feed-cell array, by address: the default from_row bound
# of the resolve that reads them (launch order is stream order for one stream).
cdef dict _cell_rows = {}


cdef uint32_t table_words_of(object tables, void *ptr, size_t nbytes):
    """Ids in a block-table array: its DeviceBuffer's, tensor's or allocation's length (the
    forward reads nothing past it); a foreign pointer on cuda cannot say, so the caller is trusted."""
    cdef size_t left = 0
    if nbytes != <size_t>-1:
        return <uint32_t>min(nbytes // 4, 0xFFFFFFFF)
    if mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        return <uint32_t>min(left // 4, 0xFFFFFFFF)
    return 0xFFFFFFFF


def argmax_to_feed(logits, masks, cells, dst, event, stream=0, *, rows=None, vocab=None,
                   dtype=None, row_stride=None):
    """Masked argmax of each row of ``logits`` into feed ``cells``, then an async copy of
    ``rows * 4`` bytes of cells into ``dst`` and a record of ``event``, in stream order and with
    no host synchronisation.

    Parameters
    ----------
    logits : tensor, DeviceBuffer or int pointer
        A tensor (torch, CuPy, numpy on the host backend, any ``__dlpack__`` object) gives rows,
        vocab, dtype and row stride itself; given ones must agree. A DeviceBuffer or pointer
        needs ``vocab`` and ``dtype`` (``row_stride`` defaults to ``vocab``).
    masks : sequence of pairs, uint32 buffer, or None
        Two banned ids per row (``NO_TOKEN`` unused); reusable as soon as this returns.
    cells : tensor, DeviceBuffer or int pointer
        uint32 feed cells, at least ``rows`` of them.
    dst : PinnedBuffer, int pointer to pinned memory, host buffer, or None
        Where the ids land; valid once ``event`` completes (on CUDA a pageable ``dst`` makes the
        copy, and so this call, wait for the kernel).
    event : Event, int handle or None
    stream : Stream, int handle or any ``__cuda_stream__`` object

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError, TypeError
        Before anything is queued: bad masks, rows or vocab, a tensor on the wrong device, of a
        type the call does not take, with strides it cannot follow, too small or read-only.
    FeedError
        A closed or unknown handle.

    Examples
    --------
    >>> import numpy as np
    >>> logits = np.zeros((2, 8), np.float32); logits[:, 3] = 1
    >>> cells = DeviceBuffer(8)
    >>> argmax_to_feed(logits, None, cells, None, None)
    2
    """
    cdef mf_argmax_args a
    cdef uint64_t s, e
    cdef void *ptr
    cdef size_t dst_len, cells_len
    cdef _HeldBuffer held = None
    cdef _Words words
    stream_of(stream, &s)
    cdef _Call call = call_on(s)
    try:
        a.rows = 0
        logits_of(call, logits, &a, rows, vocab, dtype, row_stride)
        if a.rows:  # the tensor's
            rows = a.rows
        if rows is None:
            if masks is None:
                raise ValueError("rows is required when masks is None")
            words = words_of(masks, True, "masks")
            rows = words.n // 2
            int_of(rows, "rows", 1, 4096)  # a huge uint32 mask buffer must not wrap a.rows
        else:
            rows = int_of(rows, "rows", 1, 4096)
            words = unmasked_words(rows) if masks is None else words_of(masks, True, "masks")
        if words.n != 2 * rows:
            raise ValueError(f"masks hold {words.n // 2} rows, not {rows}")
        a.rows = rows
        a.masks = words.data
        call.device(cells, &ptr, &cells_len, "cells", True, True)
        a.cells = <uint32_t *>ptr
        a.cell_capacity = cells_capacity(cells, ptr, cells_len, a.rows)
        event_of(event, &a.event, True)
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
        call.done()
    finally:
        call.close()
    _cell_rows[<size_t>a.cells] = a.rows
    if held is not None:
        hold_until_passed(held, s)
    if a.event and _host_func_seq:
        note_record(a.event, s)
    return a.rows


def resolve_feed(sources, cells, out, stream=0, *, prev_rows=None):
    """``out[i]`` = the host id of ``sources[i]``, or ``cells[from_row]`` of the previous step,
    on the device in stream order. A ``from_row >= prev_rows`` raises before launch; by default
    ``prev_rows`` is the row count of the last ``argmax_to_feed`` into these cells. ``cells`` and
    ``out`` may be DeviceBuffers, int pointers or uint32 tensors."""
    cdef uint64_t s
    cdef void *cells_ptr
    cdef void *out_ptr
    cdef size_t have
    cdef _Words words = words_of(sources, False, "sources")
    if words.n > 4096:  # before the uint32 cast below: 2**32 + 2 sources must not resolve 2
        raise ValueError(f"rows must be in [1, 4096], got {words.n}")
    stream_of(stream, &s)
    cdef _Call call = call_on(s)
    try:
        call.device(cells, &cells_ptr, &have, "cells", False, True)
        if prev_rows is None:
            prev_rows = _cell_rows.get(<size_t>cells_ptr)
            if prev_rows is None:
                raise ValueError("prev_rows is required: no argmax_to_feed has written these cells")
        prev_rows = int_of(prev_rows, "prev_rows", 0, 0xFFFFFFFF)
        if is_foreign(cells) and prev_rows * 4 > have:  # the C layer checks its own allocations
            raise ValueError(f"feed cells: {prev_rows * 4} bytes run past the end of the tensor's {have}")
        call.device(out, &out_ptr, &have, "out", True, True)
        if is_foreign(out) and <size_t>words.n * 4 > have:
            raise ValueError(f"resolve output: {words.n * 4} bytes run past the end of the tensor's {have}")
        check(mf_resolve_feed(words.data, <uint32_t>words.n, <const uint32_t *>cells_ptr,
                              <uint32_t>prev_rows, <uint32_t *>out_ptr, s))
        call.done()
    finally:
        call.close()


def reference_forward(input_ids, meta, tables, kv, kv_slots, block_size, rows, vocab, dtype,
                      logits, stream=0):
    """The reference model's forward kernel (device arrays; see feed.h). For ReferenceModel.
    ``logits=None`` only writes the KV cache (prefill)."""
    cdef mf_reference_args a
    cdef uint64_t s
    cdef void *ptr
    cdef size_t have
    stream_of(stream, &s)
    cdef _Call call = call_on(s)
    try:
        call.device(input_ids, &ptr, &have, "input_ids", False, True)
        a.input_ids = <const uint32_t *>ptr
        call.device(meta, &ptr, &have, "meta", False, True)
        a.meta = <const uint32_t *>ptr
        call.device(tables, &ptr, &have, "tables", False, True)
        a.tables = <const uint32_t *>ptr
        a.table_words = table_words_of(tables, ptr, have)
        call.device(kv, &ptr, &have, "kv", True, True)
        a.kv = <uint32_t *>ptr
        a.logits = NULL
        if logits is not None:
            call.device(logits, &ptr, &have, "logits", True, False)
            a.logits = ptr
        a.kv_slots = <uint32_t>int_of(kv_slots, "kv_slots", 0, 0xFFFFFFFF)
        a.block_size = <uint32_t>int_of(block_size, "block_size", 1, 0xFFFFFFFF)
        a.rows = <uint32_t>int_of(rows, "rows", 1, 4096)
        a.vocab = <uint32_t>int_of(vocab, "vocab", 1, 1 << 24)
        a.dtype = dtype_of(dtype)
        check(mf_reference_forward(&a, s))
        call.done()
    finally:
        call.close()


cdef mf_status argmax_to_feed_c(const mf_argmax_args *args, uint64_t stream) noexcept nogil:
    return mf_argmax_to_feed(args, stream)

cdef mf_status resolve_feed_c(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, uint64_t stream) noexcept nogil:
    return mf_resolve_feed(sources, n, cells, prev_rows, out, stream)
