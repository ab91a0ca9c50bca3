# The launcher of the top-logprobs op (docs/kernels.md, "Top logprobs"): every argument checked
# here or in the C layer before anything is queued, as the other launchers do.

def top_logprobs(logits, out, stream=0, *, n, rows=None, vocab=None, dtype=None, row_stride=None,
                 ids=None, chosen=None):
    """Each row's ``n`` most likely ids under its raw distribution and their logprobs, on the
    device, in stream order.

    The ids come in the argmax order (the greater logit first, ties by the smaller id, a NaN
    below ``-inf``); each logprob is ``log_softmax`` of the row at that id, computed as the
    chosen-token logprobs are (docs/kernels.md, "Logprobs of the chosen token"), bit for bit the
    same on every backend. No masks, bitmask or temperature: the model's own distribution. A row
    of fewer than ``n`` ids ends with ``(NO_TOKEN, NaN)`` records. With ``ids``, ``chosen[r]``
    is also the logprob of ``ids[r]`` under row ``r`` (NaN for ``NO_TOKEN`` or an id outside the
    row): the raw logprob of a token another call chose, from logits changed since.

    Parameters
    ----------
    logits : DeviceBuffer, int, or a 2-D float tensor
        ``rows`` rows of ``row_stride`` elements; read only.
    out : DeviceBuffer, int, a device array, or None
        ``rows * n`` records of 8 bytes, a uint32 id then a float32 logprob: row ``r``'s ``j``-th
        at record ``r * n + j``; None only with ``n`` 0.
    stream : Stream, int or stream-like, optional
    n : int
        1 to ``MAX_TOP_LOGPROBS`` (20); 0 with ``ids``: the chosen logprobs alone.
    rows, vocab, dtype, row_stride : optional
        Required (``row_stride`` defaults to ``vocab``) unless ``logits`` is a tensor.
    ids : DeviceBuffer, int, or a uint32 device array, optional
        ``rows`` ids, read when the kernel runs (a step's feed cells).
    chosen : DeviceBuffer, int, or a float32 device array, optional
        ``rows`` float32 logprobs of ``ids``; with ``ids`` and only with them.

    Returns
    -------
    int
        The rows.

    Raises
    ------
    ValueError, TypeError
        ``n`` out of range, ``out`` too small, bad sizes or dtype; nothing is queued.
    FeedError
        A closed or unknown buffer or stream.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> from metrale_feed import _core
    >>> logits = np.array([[0.0, 2.0, 1.0, 2.0]], np.float32)
    >>> with mf.DeviceBuffer(16) as dev, mf.DeviceBuffer(16) as out:
    ...     mf.copy_h2d_async(dev, logits)
    ...     _core.top_logprobs(dev, out, n=2, rows=1, vocab=4, dtype="float32")
    ...     host = np.zeros(2, [("id", "<u4"), ("logprob", "<f4")])
    ...     mf.copy_d2h_async(out, host)
    ...     mf.stream_synchronize()
    1
    >>> host["id"].tolist()     # the two 2.0 logits, the smaller id first
    [1, 3]
    """
    return queue_top(logits, out, stream, n, rows, vocab, dtype, row_stride, ids, chosen, None)


cdef uint32_t queue_top(logits, out, stream, n, rows, vocab, dtype, row_stride, ids, chosen,
                        tuple partial) except? 0xFFFFFFFF:
    """top_logprobs and _top_partial: ``partial`` None, or (partials, start, vocab_total, call) for
    a slice's block, where ``logits`` may be None (an empty slice: ``vocab`` 0)."""
    cdef uint64_t s
    cdef mf_top_logprobs_args a
    cdef void *ptr
    cdef size_t have
    cdef _Foreign f
    cdef TensorRows t
    mf_top_logprobs_args_init(&a)
    stream_of(stream, &s)
    a.n = <uint32_t>int_of(n, "n", 0 if ids is not None else 1, MF_MAX_TOP_LOGPROBS)
    if partial is None and (ids is None) != (chosen is None):
        raise ValueError("ids and chosen go together")
    cdef _Launch launch = launch_on(s)
    try:
        if partial is not None:
            a.flags = MF_TOP_PARTIAL
            a.start = <uint32_t>int_of(partial[1], "start", 0, MF_MAX_VOCAB)
            a.vocab_total = <uint32_t>int_of(partial[2], "vocab_total", 1, MF_MAX_VOCAB)
            u64_of(partial[3], &a.call, "call")
        if logits is None or not is_foreign(logits):
            if rows is None or vocab is None or dtype is None:
                missing = "rows" if rows is None else "vocab" if vocab is None else "dtype"
                raise TypeError(f"{missing} is required unless logits is a tensor")
            a.rows = <uint32_t>int_of(rows, "rows", 0, MF_MAX_ROWS)
            a.vocab = <uint32_t>int_of(vocab, "vocab", 0 if partial is not None else 1, MF_MAX_VOCAB)
            a.row_stride = a.vocab if row_stride is None else int_of(row_stride, "row_stride", 0, UINT64_MAX)
            a.dtype = dtype_of(dtype)
            if logits is not None or a.vocab:
                device_ptr_of(logits, &ptr)
                a.logits = ptr
        else:
            f = launch.foreign(logits, "logits")
            tensor_rows(f, &t, rows, vocab, dtype, row_stride, False, 0, 0 if partial is not None else 1, False)
            a.rows = <uint32_t>t.rows
            a.vocab = <uint32_t>t.vocab
            a.row_stride = <uint64_t>t.stride
            a.dtype = t.dtype
            a.logits = t.ptr
            launch.lend(f, tensor_extent(&t, t.rows))
        if partial is not None:
            launch.device(partial[0], &ptr, &have, "partials", True, False)
            if have != <size_t>-1 and mf_top_block_records(a.rows, a.n) * MF_PARTIAL_RECORD_BYTES > have:
                raise ValueError(f"partials: a block of {a.rows} rows of {a.n} ids needs "
                                 f"{mf_top_block_records(a.rows, a.n) * MF_PARTIAL_RECORD_BYTES} bytes; it has {have}")
            a.partials = ptr
        elif a.n or out is not None:
            launch.device(out, &ptr, &have, "out", True, False)
            if have != <size_t>-1 and <size_t>a.rows * a.n * 8 > have:
                raise ValueError(f"out: {a.rows} rows of {a.n} records need {a.rows * a.n * 8} bytes; it has {have}")
            a.out = <mf_top_logprob *>ptr
        if ids is not None:
            launch.device(ids, &ptr, &have, "ids", False, True)
            if have != <size_t>-1 and <size_t>a.rows * 4 > have:
                raise ValueError(f"ids: {a.rows} ids need {a.rows * 4} bytes; it has {have}")
            a.ids = <const uint32_t *>ptr
        if chosen is not None:
            launch.device(chosen, &ptr, &have, "chosen", True, False)
            if have != <size_t>-1 and <size_t>a.rows * 4 > have:
                raise ValueError(f"chosen: {a.rows} floats need {a.rows * 4} bytes; it has {have}")
            a.chosen = <float *>ptr
        launch.queued(mf_top_logprobs(&a, s), (logits, out, ids, chosen, partial))
    finally:
        launch.close()
    return a.rows


def _top_block_bytes(rows, n):
    """Bytes of one slice's top-logprobs block of ``rows`` rows of ``n`` ids (partial_layout.h's
    mf_top_block_records, whole 16-byte records): what a shard sizes its exchange by."""
    return mf_top_block_records(<uint32_t>int_of(rows, "rows", 0, MF_MAX_ROWS),
                                <uint32_t>int_of(n, "n", 0, MF_MAX_TOP_LOGPROBS)) * MF_PARTIAL_RECORD_BYTES


def _top_partial(logits, partials, stream=0, *, n, start, vocab_total, call, rows=None, vocab=None,
                 dtype=None, row_stride=None, ids=None):
    """One slice's top-logprobs block (feed.h's MF_TOP_PARTIAL), for ``_top_combine``: its own
    ``n`` greatest ids as global ids, its ``(m, s)``, and, with ``ids`` (global, device, read when
    the kernel runs), the logit of each row's id when the slice holds it.

    Parameters
    ----------
    logits : DeviceBuffer, int, a 2-D float tensor, or None
        The slice's columns ``[start, start + vocab)`` of each row; None with ``vocab`` 0.
    partials : DeviceBuffer or int
        At least ``_top_block_bytes(rows, n)`` bytes.
    stream : Stream, int or stream-like, optional
    n : int
        0 (with ``ids``) to ``MAX_TOP_LOGPROBS``.
    start, vocab_total, call : int
        The slice's first global id, the whole vocabulary, the header's call word.
    rows, vocab, dtype, row_stride : optional
        As ``top_logprobs``; ``vocab`` may be 0.
    ids : DeviceBuffer, int, or a uint32 device array, optional

    Returns
    -------
    int
        The rows.

    Raises
    ------
    ValueError, TypeError
        Bad sizes, a slice outside the vocabulary, a block too small; nothing is queued.

    Examples
    --------
    >>> _top_partial(part, block, n=5, start=500, vocab_total=1000, call=1, rows=4, vocab=500,
    ...              dtype="float32")   # doctest: +SKIP
    4
    """
    return queue_top(logits, None, stream, n, rows, vocab, dtype, row_stride, ids, None,
                     (partials, start, vocab_total, call))


def _top_combine(partials, world, out, stream=0, *, rows, n, vocab, call, slice_stride, fault_dst,
                 chosen=None, event=None):
    """The top logprobs of a split vocabulary from ``world`` gathered ``_top_partial`` blocks
    (feed.h's mf_top_logprobs_combine): every rank's same records, the unsplit call's ids in its
    order, and with ``chosen`` the logprobs of the ids the slices were given. The fault word is
    slice 0's reserved header word, copied to ``fault_dst`` (``_check_partials_fault``).

    Parameters
    ----------
    partials : DeviceBuffer or int
        ``world`` blocks, ``slice_stride`` 16-byte records apart.
    world : int
    out : DeviceBuffer, int, or None
        ``rows * n`` records; None with ``n`` 0.
    stream : Stream, int or stream-like, optional
    rows, n, vocab, call, slice_stride : int
        As the slices' calls; ``slice_stride`` at least ``_top_block_bytes(rows, n) // 16``.
    fault_dst : buffer
        Four bytes of host memory (page-locked in a capture).
    chosen : DeviceBuffer or int, optional
        ``rows`` float32; exactly when the slices had ``ids``.
    event : Event, optional
        Recorded after everything above.

    Raises
    ------
    ValueError, TypeError
        Bad sizes or buffers; nothing is queued.

    Examples
    --------
    >>> _top_combine(gathered, 2, out, rows=4, n=5, vocab=1000, call=1, slice_stride=stride,
    ...              fault_dst=fault)   # doctest: +SKIP
    """
    cdef uint64_t s
    cdef mf_top_combine_args c
    cdef void *ptr
    cdef size_t have
    mf_top_combine_args_init(&c)
    stream_of(stream, &s)
    c.world = <uint32_t>int_of(world, "world", 1, MF_MAX_SLICES)
    c.rows = <uint32_t>int_of(rows, "rows", 1, MF_MAX_ROWS)
    c.n = <uint32_t>int_of(n, "n", 0 if chosen is not None else 1, MF_MAX_TOP_LOGPROBS)
    c.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
    u64_of(call, &c.call, "call")
    c.slice_stride = <uint32_t>int_of(slice_stride, "slice_stride", mf_top_block_records(c.rows, c.n), 0xFFFFFFFF)
    cdef _Launch launch = launch_on(s)
    try:
        device_ptr_of(partials, &ptr)
        c.partials = ptr
        c.fault = <uint32_t *>(<char *>ptr + MF_PARTIAL_OFF_FAULT)  # slice 0's header, its reserved word
        if c.n or out is not None:
            launch.device(out, &ptr, &have, "out", True, False)
            if have != <size_t>-1 and <size_t>c.rows * c.n * 8 > have:
                raise ValueError(f"out: {c.rows} rows of {c.n} records need {c.rows * c.n * 8} bytes; it has {have}")
            c.out = <mf_top_logprob *>ptr
        if chosen is not None:
            launch.device(chosen, &ptr, &have, "chosen", True, False)
            if have != <size_t>-1 and <size_t>c.rows * 4 > have:
                raise ValueError(f"chosen: {c.rows} floats need {c.rows * 4} bytes; it has {have}")
            c.chosen = <float *>ptr
        if isinstance(fault_dst, int):
            raise TypeError("fault_dst must be a buffer of at least 4 bytes, not an int")
        launch.hold(host_ptr_of(fault_dst, True, &c.fault_dst, &have))
        if have < 4:
            raise ValueError(f"fault_dst holds {have} bytes, fewer than the fault word's 4")
        event_of(event, &c.event, True)
        launch.records(c.event)
        launch.queued(mf_top_logprobs_combine(&c, s), (partials, out, chosen, fault_dst, event))
    finally:
        launch.close()
