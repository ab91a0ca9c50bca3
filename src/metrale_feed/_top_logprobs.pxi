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
    cdef uint64_t s
    cdef mf_top_logprobs_args a
    cdef void *ptr
    cdef size_t have
    cdef _Foreign f
    mf_top_logprobs_args_init(&a)
    stream_of(stream, &s)
    a.n = <uint32_t>int_of(n, "n", 0 if ids is not None else 1, MF_MAX_TOP_LOGPROBS)
    if (ids is None) != (chosen is None):
        raise ValueError("ids and chosen go together")
    cdef _Launch launch = launch_on(s)
    try:
        if not is_foreign(logits):
            if rows is None or vocab is None or dtype is None:
                missing = "rows" if rows is None else "vocab" if vocab is None else "dtype"
                raise TypeError(f"{missing} is required unless logits is a tensor")
            a.rows = <uint32_t>int_of(rows, "rows", 0, MF_MAX_ROWS)
            a.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
            a.row_stride = a.vocab if row_stride is None else int_of(row_stride, "row_stride", 0, UINT64_MAX)
            a.dtype = dtype_of(dtype)
            device_ptr_of(logits, &ptr)
            a.logits = ptr
        else:
            f = launch.foreign(logits, "logits")
            if f.entry is None or f.entry.code is None:
                raise TypeError(f"logits must be float32, float16 or bfloat16, not {f.type_name()}")
            if f.ndim != 2 or (f.shape[1] > 1 and f.strides[1] != 1):
                raise ValueError("logits must be a 2-D (rows, vocab) tensor with unit stride along the vocabulary")
            agree(rows, f.shape[0], "rows")
            agree(vocab, f.shape[1], "vocab")
            agree(row_stride, f.strides[0] if f.shape[0] > 1 else f.shape[1], "row_stride")
            if dtype is not None and dtype_entry(dtype) is not f.entry:
                raise ValueError(f"dtype={dtype!r} disagrees with the logits tensor's {f.entry.name}")
            a.rows = <uint32_t>int_of(f.shape[0], "rows", 0, MF_MAX_ROWS)
            a.vocab = <uint32_t>int_of(f.shape[1], "vocab", 1, MF_MAX_VOCAB)
            a.row_stride = f.strides[0] if f.shape[0] > 1 else f.shape[1]
            a.dtype = <mf_dtype><int>f.entry.code
            a.logits = f.ptr
            if a.rows:
                launch.lend(f, ((a.rows - 1) * a.row_stride + a.vocab) * <size_t>f.entry.itemsize)
        if a.n or out is not None:
            launch.device(out, &ptr, &have, "out", True, False)
            if have != <size_t>-1 and <size_t>a.rows * a.n * 8 > have:
                raise ValueError(f"out: {a.rows} rows of {a.n} records need {a.rows * a.n * 8} bytes; it has {have}")
            a.out = <mf_top_logprob *>ptr
        if ids is not None:
            launch.device(ids, &ptr, &have, "ids", False, True)
            if have != <size_t>-1 and <size_t>a.rows * 4 > have:
                raise ValueError(f"ids: {a.rows} ids need {a.rows * 4} bytes; it has {have}")
            a.ids = <const uint32_t *>ptr
            launch.device(chosen, &ptr, &have, "chosen", True, False)
            if have != <size_t>-1 and <size_t>a.rows * 4 > have:
                raise ValueError(f"chosen: {a.rows} floats need {a.rows * 4} bytes; it has {have}")
            a.chosen = <float *>ptr
        launch.queued(mf_top_logprobs(&a, s), (logits, out, ids, chosen))
    finally:
        launch.close()
    return a.rows
