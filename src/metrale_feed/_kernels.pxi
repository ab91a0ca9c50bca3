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


cdef struct TensorRows:
    # A logits tensor's layout as the kernels read it: `rows` rows of `vocab` elements, `stride`
    # elements apart, from `ptr`.
    void *ptr
    int64_t rows
    int64_t vocab
    int64_t stride
    mf_dtype dtype
    size_t itemsize


cdef int tensor_rows(_Foreign f, TensorRows *t, object rows, object vocab, object dtype, object row_stride,
                     bint one_dim, int64_t min_rows, int64_t min_vocab, bint writes,
                     int64_t used=-1) except -1:
    """The one reading of a logits tensor for every launcher: its dtype, a 2-D (or, with
    ``one_dim``, 1-D) shape with unit stride along the vocabulary, rows that neither overlap nor run
    backwards, rows and vocab in range, and the given ``rows``, ``vocab``, ``row_stride`` and
    ``dtype`` agreeing with it (None: not given). ``writes``: the launcher writes the logits.
    ``used``: the leading rows the launcher touches, where it says (else all): the rows' range and
    overlap are checked over those, and the tensor must have them."""
    if f.entry is None or f.entry.code is None:
        raise TypeError(f"logits must be float32, float16 or bfloat16, not {f.type_name()}")
    if f.ndim == 1 and one_dim:
        t.rows, t.vocab, t.stride = 1, f.shape[0], f.shape[0]
        if f.shape[0] > 1 and f.strides[0] != 1:
            raise ValueError("logits must have unit stride along the vocabulary")
    elif f.ndim == 2:
        t.rows, t.vocab, t.stride = f.shape[0], f.shape[1], f.strides[0]
        if f.shape[1] > 1 and f.strides[1] != 1:
            raise ValueError("logits must have unit stride along the vocabulary (the last dimension)")
        if f.shape[0] <= 1:
            t.stride = t.vocab
    elif one_dim:
        raise ValueError(f"logits must be 1-D (vocab,) or 2-D (rows, vocab), not {f.ndim}-D")
    else:
        raise ValueError(f"logits must be a 2-D (rows, vocab) tensor, not {f.ndim}-D")
    cdef int64_t n = t.rows if used < 0 else used
    if used > t.rows:
        raise ValueError(f"the logits tensor has {t.rows} rows; {used} are needed")
    if t.stride < t.vocab:  # rows that overlap or run backwards: harmless only if one is used
        if n > 1:
            raise ValueError(f"logits rows overlap or run backwards (row stride {t.stride} < vocab {t.vocab})")
        t.stride = t.vocab
    if n < min_rows or n > MF_MAX_ROWS:
        raise ValueError(f"the logits tensor has {n} rows; rows must be in [{min_rows}, {MF_MAX_ROWS}]")
    if t.vocab < min_vocab or t.vocab > MF_MAX_VOCAB:
        raise ValueError(f"the logits tensor has vocab {t.vocab}; vocab must be in [{min_vocab}, 2**24]")
    if writes and f.readonly:
        raise ValueError("logits is read-only but this call writes it")
    agree(rows, t.rows, "rows")
    agree(vocab, t.vocab, "vocab")
    agree(row_stride, t.stride, "row_stride")
    if dtype is not None and dtype_entry(dtype) is not f.entry:
        raise ValueError(f"dtype={dtype!r} disagrees with the logits tensor's {f.entry.name}")
    t.ptr = f.ptr
    t.dtype = <mf_dtype><int>f.entry.code
    t.itemsize = <size_t>f.entry.itemsize
    return 0


cdef size_t tensor_extent(const TensorRows *t, int64_t rows):
    """Bytes that ``rows`` of the tensor's rows span (what a launch lends the tensor for)."""
    return 0 if rows <= 0 or t.vocab == 0 else ((rows - 1) * t.stride + t.vocab) * t.itemsize


cdef int logits_of(_Launch launch, object logits, mf_argmax_args *a, object rows, object vocab,
                   object dtype, object row_stride, bint writes=False) except -1:
    """Logits: a tensor gives its own rows, vocab, dtype and row stride (given ones must agree);
    a DeviceBuffer or an int pointer needs vocab and dtype. Sets a.logits, a.vocab, a.dtype,
    a.row_stride, and a.rows when the tensor says."""
    cdef void *ptr
    cdef TensorRows t
    if not is_foreign(logits):
        if vocab is None or dtype is None:
            raise TypeError(f"{'vocab' if vocab is None else 'dtype'} is required unless logits is a tensor")
        a.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
        a.row_stride = a.vocab if row_stride is None else int_of(row_stride, "row_stride", 1, UINT64_MAX)
        a.dtype = dtype_of(dtype)
        device_ptr_of(logits, &ptr)
        a.logits = ptr
        return 0
    f = launch.foreign(logits, "logits")
    tensor_rows(f, &t, rows, vocab, dtype, row_stride, True, 1, 1, writes)
    a.rows = <uint32_t>t.rows
    a.vocab = <uint32_t>t.vocab
    a.row_stride = <uint64_t>t.stride
    a.dtype = t.dtype
    a.logits = t.ptr
    launch.lend(f, tensor_extent(&t, t.rows))
    return 0


cdef int empty_slice_of(_Launch launch, object logits, mf_argmax_args *a, object rows,
                        object dtype) except -1:
    """The logits of an empty slice: nothing is read, but a ``(rows, 0)`` tensor still gives its
    dtype and rows (given ones must agree), as a slice with columns does; ``None``, a
    DeviceBuffer or a pointer needs ``dtype``."""
    cdef _Foreign f
    a.logits = NULL
    a.row_stride = 0
    if logits is None or not is_foreign(logits):
        a.dtype = dtype_of(dtype)
        return 0
    f = launch.foreign(logits, "logits")
    if f.entry is None or f.entry.code is None:
        raise TypeError(f"logits must be float32, float16 or bfloat16, not {f.type_name()}")
    if f.ndim != 2 or f.shape[1] != 0:
        shape = tuple(f.shape[i] for i in range(f.ndim))
        raise ValueError(f"the logits of an empty slice are a (rows, 0) tensor, not {shape}")
    if f.shape[0] < 1 or f.shape[0] > MF_MAX_ROWS:
        raise ValueError(f"the logits tensor has {f.shape[0]} rows; rows must be in [1, {MF_MAX_ROWS}]")
    agree(rows, f.shape[0], "rows")
    if dtype is not None and dtype_entry(dtype) is not f.entry:
        raise ValueError(f"dtype={dtype!r} disagrees with the logits tensor's {f.entry.name}")
    a.rows = <uint32_t>f.shape[0]
    a.dtype = <mf_dtype><int>f.entry.code
    return 0


cdef uint32_t table_words_of(object tables, void *ptr, size_t nbytes):
    """Ids in a block-table array: its DeviceBuffer's, tensor's or allocation's length (the
    forward reads nothing past it); a foreign pointer on cuda cannot say, so the caller is trusted."""
    cdef size_t left = 0
    if nbytes != <size_t>-1:
        return <uint32_t>min(nbytes // 4, 0xFFFFFFFF)
    if mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        return <uint32_t>min(left // 4, 0xFFFFFFFF)
    return 0xFFFFFFFF


cdef bint device_resident(object obj, str what) except -1:
    """Whether a masks/sources/params argument is device memory, read when the kernel runs: a
    DeviceBuffer, an int pointer, or a tensor that is not a host buffer (``__cuda_array_interface__``,
    or ``__dlpack__`` without the buffer protocol). Sequences and buffers (lists, numpy arrays,
    ``array``) are host inputs, read before the call returns. An int on the host backend must be
    one of this package's device allocations (on cuda a foreign pointer is taken as is)."""
    cdef size_t left = 0
    if type(obj) is DeviceBuffer:
        return True
    if isinstance(obj, int) and not isinstance(obj, bool):
        if mf_active_backend() != MF_BACKEND_CUDA and (obj <= 0 or obj > <object>UINT64_MAX or mf_mem_lookup(
                <void *><size_t>obj, &left) != MF_MEM_DEVICE):
            raise TypeError(f"{what} must be a uint32 buffer or a sequence, or device memory: the int "
                            f"{obj:#x} is not a device allocation of this package")
        return True
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    return hasattr(obj, "__dlpack__") and not PyObject_CheckBuffer(obj)


cdef void *device_input(_Launch launch, object obj, size_t need, str what, bint words=True) except? NULL:
    """A device-resident input's pointer, checked to hold ``need`` bytes where its length is known
    (an int pointer of this package's allocations is checked by the C layer; a foreign one is
    trusted, as CUDA must). ``words``: a tensor must hold 4-byte integers (uint32, or int32 as
    its bit pattern), as masks, sources and bitmasks do."""
    cdef void *ptr
    cdef size_t have
    cdef size_t left = 0
    launch.device(obj, &ptr, &have, what, False, words)
    if have == <size_t>-1 and mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        have = left
    if have != <size_t>-1 and have < need:
        raise ValueError(f"{what} holds {have} bytes; {need} are needed")
    return ptr


cdef class _PickInputs:
    """What one argmax/sample launch holds while its descriptor is filled (host words, params)."""
    cdef _Words words
    cdef _HeldBuffer params


cdef int fill_params(_Launch launch, mf_argmax_args *a, object params, _PickInputs keep) except -1:
    """``params``: one SAMPLING_PARAMS_DTYPE record per row, host (read and checked now) or device
    memory (read when the kernel runs)."""
    global _params_dtype
    cdef void *ptr
    if device_resident(params, "params"):
        a.params = <const mf_sampling_params *>device_input(launch, params, <size_t>a.rows * sizeof(mf_sampling_params), "params", False)
        a.flags |= MF_ARGS_PARAMS_DEVICE
        return 0
    if _params_dtype is None:
        from metrale_feed.sampling import SAMPLING_PARAMS_DTYPE
        _params_dtype = SAMPLING_PARAMS_DTYPE
    if getattr(params, "dtype", None) != _params_dtype:
        raise TypeError("params must be an array of metrale_feed.SAMPLING_PARAMS_DTYPE records "
                        f"(or device memory holding them), not {getattr(params, 'dtype', type(params).__name__)}")
    keep.params = host_buffer_of(params, False, "params")
    if keep.params.view.len < <Py_ssize_t>(a.rows * sizeof(mf_sampling_params)):
        raise ValueError(f"params hold {keep.params.view.len // sizeof(mf_sampling_params)} rows, "
                         f"fewer than the {a.rows} launched")
    a.params = <const mf_sampling_params *>keep.params.view.buf
    return 0


cdef object launch_pick(PickStep step, object rows, object partial=None):
    """The one launcher under argmax_to_feed and sample_to_feed (and their partial calls, see
    _shard.pxi): one step, one descriptor, one C call. ``rows``: the step's, or what the op
    inferred. Every field is checked before the launch, which commits what the work needs or
    raises with nothing kept (_Launch.queued). ``step.grammar``: its descriptor (_grammar.pxi),
    from which the C call queues the mask, the pick and the advance."""
    cdef object logits = step.logits, masks = step.masks, cells = step.cells, dst = step.dst
    cdef object event = step.event, bitmask = step.bitmask, params = step.params
    cdef object penalties = step.penalties, grammar = step.grammar
    cdef mf_argmax_args a
    cdef uint64_t s, e
    cdef void *ptr
    cdef size_t dst_len, cells_len
    cdef _HeldBuffer held = None
    cdef _HeldBuffer held_lp = None
    cdef _PickInputs keep = _PickInputs.__new__(_PickInputs)
    cdef _GrammarCall g = None
    mf_argmax_args_init(&a)  # every option off, struct_size set (feed.h, "descriptors")
    stream_of(step.stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        if partial is None:
            logits_of(launch, logits, &a, rows, step.vocab, step.dtype, step.row_stride,
                      penalties is not None)
        else:  # a slice [start, stop) of rows of `vocab` ids: the logits hold the slice's columns
            fill_partial(&a, partial)
            if a.vocab == 0:  # an empty slice reads nothing
                empty_slice_of(launch, logits, &a, rows, step.dtype)
            else:
                logits_of(launch, logits, &a, rows, a.vocab, step.dtype, step.row_stride)
        if a.rows:  # the tensor's
            rows = a.rows
        if masks is not None and device_resident(masks, "masks"):
            if rows is None:
                raise ValueError("rows is required with device-resident masks")
            a.rows = <uint32_t>int_of(rows, "rows", 1, MF_MAX_ROWS)
            a.masks = <const uint32_t *>device_input(launch, masks, <size_t>a.rows * 8, "masks")
            a.flags |= MF_ARGS_MASKS_DEVICE
        else:
            if rows is None:
                if masks is None:
                    raise ValueError("rows is required when masks is None")
                keep.words = words_of(masks, True, "masks")
                rows = keep.words.n // 2
                int_of(rows, "rows", 1, MF_MAX_ROWS)  # a huge mask buffer must not wrap a.rows
            else:
                rows = int_of(rows, "rows", 1, MF_MAX_ROWS)
                if masks is not None:
                    keep.words = words_of(masks, True, "masks")
            if keep.words is not None:  # None: no masks, which the C layer reads as constant (NULL)
                if keep.words.n != 2 * rows:
                    raise ValueError(f"masks hold {keep.words.n // 2} rows, not {rows}")
                a.masks = keep.words.data
            a.rows = rows
        if bitmask is not None:
            if not (isinstance(bitmask, int) or type(bitmask) is DeviceBuffer
                    or hasattr(bitmask, "__dlpack__") or hasattr(bitmask, "__cuda_array_interface__")):
                raise TypeError("bitmask must be device memory (a DeviceBuffer, a device pointer or a "
                                f"tensor) of int32 words, not {type(bitmask).__name__}")
            total = a.vocab if partial is None else a.vocab_total  # the whole row's words
            a.bitmask = <const uint32_t *>device_input(
                launch, bitmask, <size_t>a.rows * ((total + 31) // 32) * 4, "bitmask")
        if params is not None:
            fill_params(launch, &a, params, keep)
        if partial is None:
            launch.device(cells, &ptr, &cells_len, "cells", True, True)
            a.cells = <uint32_t *>ptr
            a.cell_capacity = cells_capacity(cells, ptr, cells_len, a.rows)
        held_lp = fill_logprobs(&a.logprobs, &a.logprobs_dst, step.logprobs, step.logprobs_dst, a.rows)
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
        launch.hold(held)
        launch.hold(held_lp)
        launch.records(a.event)
        if partial is None:
            launch.writes_cells(a.cells, a.rows)
        if penalties is not None:  # the launch keeps its tables alive until the work has run
            pick_penalties(&a, penalties)
        if grammar is not None:  # the shard's is its own
            g = grammar_of(launch, grammar, s, a.rows, 0, False)
            a.grammar = &g.desc
        # The C call queues all of the launch's work (the grammar's mask and advance included,
        # before its copies and event): it may record the foreign arrays' keep-alive itself.
        a.event = launch.event_to_record(a.event)
        # `partial`: a partial call's block, and a select stage's state, list and gathered lists,
        # which a captured graph keeps with the rest.
        launch.queued(mf_argmax_to_feed(&a, s),
                      (logits, masks, cells, dst, event, bitmask, params, step.logprobs,
                       step.logprobs_dst, penalties, partial, grammar, g))
    finally:
        launch.close()
    return a.rows


cdef _HeldBuffer fill_logprobs(float **dev, void **host, object logprobs, object logprobs_dst,
                               uint32_t rows):
    """The logprobs options: device float32 (one per row, checked for dtype and size where the
    object can say) and a host float32 destination; returns a foreign host buffer to hold."""
    cdef void *ptr
    cdef size_t n = 0
    cdef uint64_t e
    cdef _HeldBuffer held = None
    dev[0] = NULL
    host[0] = NULL
    if logprobs is None:
        if logprobs_dst is not None:
            raise ValueError("logprobs_dst needs logprobs (the device floats it copies)")
        return None
    check_float_rows(logprobs, rows, "logprobs", True)
    device_ptr_of(logprobs, &ptr)
    dev[0] = <float *>ptr
    if logprobs_dst is None:
        return None
    if isinstance(logprobs_dst, int) and not isinstance(logprobs_dst, bool):
        u64_of(logprobs_dst, &e, "logprobs_dst pointer")  # pinned memory of this package, as dst
        pinned_range(e, <size_t>rows * 4)
        host[0] = <void *><size_t>e
        return None
    check_float_rows(logprobs_dst, rows, "logprobs_dst", False)
    held = host_ptr_of(logprobs_dst, True, host, &n)
    if n < <size_t>rows * 4:
        raise ValueError(f"logprobs_dst holds {n} bytes; {rows} float32 logprobs need {rows * 4}")
    return held


cdef int check_float_rows(object obj, uint32_t rows, str what, bint device) except -1:
    """A typed array must hold float32 and at least ``rows`` elements; untyped memory (a
    DeviceBuffer, a PinnedBuffer, bytes) is checked for its size by the C layer or the caller."""
    cdef size_t left = 0
    cdef void *ptr
    typestr = None
    count = None
    if type(obj) is DeviceBuffer:
        count = (<DeviceBuffer>obj)._nbytes // 4
    elif device and hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        typestr = cai.get("typestr")
        count = 1
        for d in cai.get("shape", ()):
            count *= d
        typestr = "float32" if typestr in ("<f4", "=f4", "f4") else typestr
    elif hasattr(obj, "dtype") and hasattr(obj, "shape"):  # numpy, torch
        typestr = str(obj.dtype).replace("torch.", "")
        count = 1
        for d in obj.shape:
            count *= int(d)
    elif not device and PyObject_CheckBuffer(obj) and type(obj) is not PinnedBuffer:
        view = memoryview(obj)
        if view.format not in ("B", "b", "c"):
            typestr = "float32" if view.format in ("f", "<f", "=f") else view.format
            count = view.nbytes // view.itemsize
    elif device and isinstance(obj, int) and not isinstance(obj, bool):
        if mf_mem_lookup(<void *><size_t>obj, &left) == MF_MEM_DEVICE:
            count = left // 4
    if typestr is not None and typestr != "float32":
        raise TypeError(f"{what} must hold float32, not {typestr}")
    if count is not None and count < rows:
        raise ValueError(f"{what} holds {count} float32, fewer than the {rows} rows launched")
    return 0


cdef object run_on_shard(PickStep step):
    """A pick over a split vocabulary: the step handed to its shard, which runs it (tp/shard.py;
    torch is imported there only). The extension knows nothing of the shard but this one method."""
    run = getattr(step.shard, "run_step", None)
    if run is None:
        raise TypeError(f"shard must be a VocabShard, not {type(step.shard).__name__}")
    return run(step)


cpdef object pick_to_feed(PickStep step):
    """Launch the pick ``step`` describes: ``argmax_to_feed``, ``sample_to_feed`` or
    ``verify_to_feed`` given whole.

    What a model's feed method calls with the scheduler's step once it has completed it with its
    own feed (``PickStep.on``), and what the speculative step calls with its verify: the fields
    are read as the keyword functions read their arguments (the same checks, errors and launch),
    with no keyword parsed again. A step with a ``shard`` goes to it (``VocabShard.run_step``).

    Parameters
    ----------
    step : PickStep
        ``op`` "argmax", "sample" (``params`` then required) or "verify" (``drafts`` and ``k``
        then required, as ``verify_to_feed`` takes them); its ``top_logprobs``,
        ``top_logprobs_dst`` and ``raw_logits`` unset (the model's, queued by its feed method).

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError
        A step that still holds the model's fields; ``penalties`` with a ``shard``; then whatever
        ``argmax_to_feed``, ``sample_to_feed`` or ``verify_to_feed`` raise for the same
        arguments, before anything is queued.
    TypeError
        A sample step without params; then as the keyword function.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> logits = np.array([[0.1, 0.9, 0.5]], np.float32)
    >>> with mf.DeviceBuffer(4) as cells, mf.PinnedBuffer(4) as ids, mf.Event() as done:
    ...     mf.pick_to_feed(mf.PickStep("argmax", logits=logits, masks=[(1, mf.NO_TOKEN)],
    ...                                 cells=cells, dst=ids, event=done))
    ...     done.synchronize()
    ...     np.frombuffer(ids, np.uint32).tolist()
    1
    [2]
    """
    if step is None:
        raise TypeError("pick_to_feed takes a PickStep, not None")
    if step.op == "sample" and step.params is None:
        raise TypeError("a sample step's params must be an array of metrale_feed.SAMPLING_PARAMS_DTYPE "
                        "records (or device memory holding them), not NoneType")
    if step.top_logprobs is not None or step.raw_logits is not None:
        raise ValueError("pick_to_feed does not queue top_logprobs or raw_logits: the model's feed "
                         "method does, then hands on step.on(...), which clears them")
    if step.shard is not None:  # host params, temperature-only device params, a verify (shard.py)
        refuse_sharded_penalties(step.penalties)
        return run_on_shard(step)
    if step.op == "verify":
        return launch_verify(step)
    rows = step.rows
    if (rows is None and step.masks is None and step.op == "sample"
            and not (is_foreign(step.logits) and not isinstance(step.logits, (list, tuple)))):
        if device_resident(step.params, "params"):
            raise ValueError("rows is required with device-resident params and no masks")
        rows = len(step.params)
    return launch_pick(step, rows)


def argmax_to_feed(logits, masks, cells, dst, event, stream=0, *, rows=None, vocab=None,
                   dtype=None, row_stride=None, bitmask=None, logprobs=None, logprobs_dst=None,
                   shard=None, penalties=None, grammar=None):
    """Masked argmax of each row into the feed cells, then an async readback and an event record.

    In stream order and with no host synchronisation: the argmax of each row (the rule is in
    docs/encodings.md, "The masked-argmax rule") is written to ``cells[row]``, ``rows * 4`` bytes
    of cells are copied into ``dst``, and ``event`` is recorded. ``dst`` holds the ids once
    ``event`` has completed; ``masks`` may be reused as soon as the call returns. Every argument is
    checked before anything is launched.

    Parameters
    ----------
    logits : tensor, DeviceBuffer, or int
        Device memory holding ``rows`` rows of ``vocab`` values of ``dtype``, row ``r`` starting at
        element ``r * row_stride``. A tensor (torch, CuPy, numpy on the host backend: any
        ``__dlpack__`` or ``__cuda_array_interface__`` object) gives rows, vocab, dtype and row
        stride itself, and given ones must agree. A ``DeviceBuffer`` (bounds-checked) or an int
        device pointer (trusted when foreign) needs ``vocab`` and ``dtype``.
    masks : sequence of (int, int), uint32 buffer, device memory, or None
        Two ids per row that may not win, ``NO_TOKEN`` where unused: pairs, or a buffer of
        ``2 * rows`` uint32 (a ``(rows, 2)`` array), read before the call returns. Device memory
        (a ``DeviceBuffer``, a device pointer of this package) is read when the kernel runs:
        ``rows`` is then required, and a mask id ``>= vocab`` masks nothing. None masks nothing
        (then ``rows`` is required).
    cells : DeviceBuffer, int, or a uint32/int32 tensor
        The feed cells, one uint32 per row; they must hold ``rows * 4`` bytes.
    dst : PinnedBuffer, writable buffer, int, or None
        Where the ids are copied: a ``PinnedBuffer``, any writable buffer of at least ``rows * 4``
        bytes, an int pointer from ``alloc_host_pinned``, or None for no readback.
    event : Event, int, or None
        Recorded after the copy; None records nothing.
    stream : Stream, int or stream-like, optional
        Default 0, the default stream.
    rows : int, optional
        Rows to process, 1 to ``MAX_ROWS`` (4096); taken from the tensor or ``masks`` when None.
    vocab : int, optional
        Values per row, 1 to ``MAX_VOCAB`` (2**24); required unless ``logits`` is a tensor.
    dtype : dtype spelling, optional
        The logits' element type: float32, float16 or bfloat16 in any spelling
        ``metrale_feed.dtype`` knows (``"bf16"``, ``numpy.float16``, ``torch.bfloat16``);
        required unless ``logits`` is a tensor.
    row_stride : int, optional
        Distance between row starts, in **elements** of ``dtype`` (not bytes), at least ``vocab``;
        default ``vocab``.
    bitmask : device memory, optional
        int32 words of shape ``[rows, ceil(vocab / 32)]``; bit ``v % 32`` of word ``v // 32`` set
        allows id ``v`` (the xgrammar convention), combined with ``masks``. Read when the kernel
        runs. A row with no allowed id gives ``NO_TOKEN``.
    logprobs : device memory, optional
        One float32 per row: the chosen id's ``log_softmax`` over all ``vocab`` ids (temperature 1,
        before masks and bitmask; NaN logits count as ``-inf``), within 2e-5 or 2 float32 ulps of
        a float64 reference. A ``-inf`` or NaN choice gives ``-inf``; a ``NO_TOKEN`` row, a row with
        no finite logit and a row with a ``+inf`` logit give NaN (docs/kernels.md, "Logprobs").
    logprobs_dst : PinnedBuffer, writable float32 buffer, int, or None
        Where ``logprobs`` is copied (an int: a pointer from ``alloc_host_pinned``), after
        ``dst`` and before the event record; needs ``logprobs``.
    shard : VocabShard, optional
        A vocabulary split across ranks (docs/tensor-parallel.md): ``logits`` then hold this
        rank's ``shard.stop - shard.start`` columns (``vocab``, if given, is that width), masks
        hold global ids, ``bitmask`` covers the whole vocabulary; every rank gets the unsharded
        call's cells, ids and logprobs. ``rows`` may not exceed ``shard.max_rows``.
    penalties : PenaltyLaunch, optional
        The step's penalties in the same call (docs/penalties.md, "One call a step"): what
        ``penalties.apply(logits)`` queues before the pick and ``penalties.update(cells)`` after
        it, queued by this call ahead of the copy and the event (on the host backend one hand-off
        to the stream's worker instead of three). Its rows must be the call's; its layout is the
        call's. Not with ``shard`` (each rank applies its own slice, and updates with the
        combined ids).
    grammar : tuple, optional
        ``(automaton, states)`` or ``(automaton, states, scratch)``: each row may pick only an id
        its state allows, and its state word becomes the state after that id, in the same call
        (docs/kernels.md, "Grammar in a pick"). ``automaton`` a ``TokenAutomaton`` on the device
        for this vocabulary (the whole one with ``shard``); ``states`` device memory of one
        uint32 a row, read and written when the kernels run (``NO_TOKEN``: unconstrained);
        ``scratch`` a ``DeviceBuffer`` for the mask (default: the automaton's for this stream).

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError
        A mask id at or beyond ``vocab`` other than ``NO_TOKEN``; masks that do not cover ``rows``;
        ``rows`` outside 1..``MAX_ROWS`` or beyond the cells' or ``dst``'s capacity; ``row_stride < vocab``;
        an unknown ``dtype``; ``rows`` missing with ``masks=None``; a tensor whose shape or
        dtype disagrees with a given ``rows``/``vocab``/``dtype``/``row_stride``, or on another device;
        ``logprobs`` or ``logprobs_dst`` holding fewer than ``rows`` floats, or ``logprobs_dst``
        without ``logprobs``.
    TypeError
        An argument of the wrong kind (a float where an int is needed, a non-buffer ``dst``);
        ``vocab`` or ``dtype`` missing with logits that are not a tensor; ``logprobs`` or
        ``logprobs_dst`` typed other than float32.
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
    return pick_to_feed(pick_step("argmax", logits, masks, None, cells, dst, event, stream, rows,
                              vocab, dtype, row_stride, bitmask, logprobs, logprobs_dst,
                              penalties, grammar, shard))


def sample_to_feed(logits, params, cells, dst, event, stream=0, *, masks=None, bitmask=None,
                   rows=None, vocab=None, dtype=None, row_stride=None, logprobs=None,
                   logprobs_dst=None, shard=None, penalties=None, grammar=None):
    """``argmax_to_feed`` with a sampled id per row (``docs/kernels.md``, "Sampling").

    Parameters
    ----------
    params : SAMPLING_PARAMS_DTYPE array, or device memory holding such records
        One record per row (``temperature``, ``top_p``, ``min_p``, ``top_k``, ``seed``,
        ``position``). Host params are read and checked before this returns; device-resident
        ones when the kernel runs (an out-of-range value there means its neutral setting).
    masks, bitmask, logprobs, logprobs_dst, penalties, grammar
        As for ``argmax_to_feed``; the logprob is the sampled id's under the raw distribution
        (temperature 1, before top_k, top_p and min_p).
    shard : VocabShard, optional
        As for ``argmax_to_feed``: the same survivors and draw as the unsharded call. Host params
        may set filters (their thresholds take a few more exchanges of per-row records:
        docs/tensor-parallel.md). Device-resident params are read when the kernels run, so the
        call can be captured in a graph, and must be temperature-only: a sampled row with a filter
        there gets ``NO_TOKEN`` and a ``FeedError`` from the event on every rank.

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
    return pick_to_feed(pick_step("sample", logits, masks, params, cells, dst, event, stream, rows,
                              vocab, dtype, row_stride, bitmask, logprobs, logprobs_dst,
                              penalties, grammar, shard))


cdef int refuse_sharded_penalties(object penalties) except -1:
    if penalties is not None:
        raise ValueError("penalties= takes the unsharded call: over a split vocabulary each rank "
                         "applies its own slice (penalties_apply) and updates with the combined ids")
    return 0


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
    cdef size_t have
    cdef _Words words = None
    cdef uint32_t n
    cdef unsigned flags = 0
    stream_of(stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        if device_resident(sources, "sources"):
            launch.device(sources, &src_ptr, &have, "sources", False, True)
            n = <uint32_t>int_of(device_words(sources, src_ptr, have) if rows is None else rows, "rows", 1,
                                 MF_MAX_ROWS)
            if have != <size_t>-1 and <size_t>n * 4 > have:
                raise ValueError(f"sources: {n * 4} bytes run past the end of the array's {have}")
            flags = MF_SOURCES_DEVICE
        else:
            words = words_of(sources, False, "sources")
            if words.n > MF_MAX_ROWS:  # before the uint32 cast: 2**32 + 2 sources must not resolve 2
                raise ValueError(f"rows must be in [1, {MF_MAX_ROWS}], got {words.n}")
            if rows is not None and rows != words.n:
                raise ValueError(f"rows {rows} differs from the {words.n} sources given")
            src_ptr = <void *>words.data
            n = <uint32_t>words.n
        launch.device(cells, &cells_ptr, &have, "cells", False, True)
        if prev_rows is None:
            prev_rows = cell_rows_of(<size_t>cells_ptr)
            if prev_rows is None:
                raise ValueError("prev_rows is required: no argmax_to_feed has written these cells")
        prev_rows = int_of(prev_rows, "prev_rows", 0, 0xFFFFFFFF)
        if is_foreign(cells) and prev_rows * 4 > have:  # the C layer checks its own allocations
            raise ValueError(f"feed cells: {prev_rows * 4} bytes run past the end of the tensor's {have}")
        launch.device(out, &out_ptr, &have, "out", True, True)
        if is_foreign(out) and <size_t>n * 4 > have:
            raise ValueError(f"resolve output: {n * 4} bytes run past the end of the tensor's {have}")
        launch.queued(mf_resolve_feed_flags(<const uint32_t *>src_ptr, n, <const uint32_t *>cells_ptr,
                                            <uint32_t>prev_rows, <uint32_t *>out_ptr, flags, s),
                      (sources, cells, out))
    finally:
        launch.close()


cdef object device_words(object obj, void *ptr, size_t have):
    """The uint32 words of device-resident sources: a DeviceBuffer's, a tensor's or this package's
    allocation's length; a foreign pointer cannot say, so it is refused."""
    cdef size_t left = 0
    if have != <size_t>-1:
        return have // 4
    if mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        return left // 4
    raise ValueError("device-resident sources given as a foreign pointer need rows= (their length is "
                     "unknown)")


def reference_forward(input_ids, meta, tables, kv, kv_slots, block_size, rows, vocab, dtype,
                      logits, stream=0, *, start=0, advance=None, advance_group=1):
    """The reference model's forward kernel (device arrays; see feed.h). For ReferenceModel.
    ``logits=None`` only writes the KV cache (prefill). The logits hold ``vocab`` columns, the ids
    ``start`` to ``start + vocab`` (a rank's slice of a split vocabulary). ``advance`` (device,
    ``ceil(rows / advance_group)`` uint32) adds ``advance[r // advance_group]`` to row ``r``'s
    position when the kernel runs (a speculative step's advance, docs/speculative.md)."""
    cdef mf_reference_args a
    cdef uint64_t s
    cdef void *ptr
    cdef size_t have
    mf_reference_args_init(&a)
    stream_of(stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        launch.device(input_ids, &ptr, &have, "input_ids", False, True)
        a.input_ids = <const uint32_t *>ptr
        launch.device(meta, &ptr, &have, "meta", False, True)
        a.meta = <const uint32_t *>ptr
        launch.device(tables, &ptr, &have, "tables", False, True)
        a.tables = <const uint32_t *>ptr
        a.table_words = table_words_of(tables, ptr, have)
        launch.device(kv, &ptr, &have, "kv", True, True)
        a.kv = <uint32_t *>ptr
        a.logits = NULL
        if logits is not None:
            launch.device(logits, &ptr, &have, "logits", True, False)
            a.logits = ptr
        a.kv_slots = <uint32_t>int_of(kv_slots, "kv_slots", 0, 0xFFFFFFFF)
        a.block_size = <uint32_t>int_of(block_size, "block_size", 1, 0xFFFFFFFF)
        a.rows = <uint32_t>int_of(rows, "rows", 1, MF_MAX_ROWS)
        a.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
        a.start = <uint32_t>int_of(start, "start", 0, MF_MAX_VOCAB - a.vocab)
        a.dtype = dtype_of(dtype)
        if advance is not None:
            a.advance_group = <uint32_t>int_of(advance_group, "advance_group", 1, MF_MAX_ROWS)
            launch.device(advance, &ptr, &have, "advance", False, True)
            a.advance = <const uint32_t *>ptr
            if have != <size_t>-1 and have < <size_t>((a.rows + a.advance_group - 1) // a.advance_group) * 4:
                raise ValueError(f"advance: {have} bytes, fewer than one uint32 per group of "
                                 f"{a.advance_group} of the {a.rows} rows")
        launch.queued(mf_reference_forward(&a, s), (input_ids, meta, tables, kv, logits, advance))
    finally:
        launch.close()


cdef mf_status argmax_to_feed_c(const mf_argmax_args *args, uint64_t stream) noexcept nogil:
    return mf_argmax_to_feed(args, stream)

cdef mf_status resolve_feed_c(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, uint64_t stream) noexcept nogil:
    return mf_resolve_feed(sources, n, cells, prev_rows, out, stream)
