# Launchers of speculative verification (docs/kernels.md, "Verify"): verify_to_feed and
# resolve_verified, with the helpers of _kernels.pxi (logits_of, device_input, fill_params,
# fill_logprobs). Every argument is checked here or in the C layer before anything is queued.


cdef class _VerifyInputs:
    """What one verify launch holds while its descriptor is filled (host drafts, masks, params)."""
    cdef _Words drafts
    cdef _Words masks
    cdef _PickInputs pick


def verify_to_feed(logits, drafts, cells, dst, event, stream=0, *, k, masks=None, bitmask=None,
                   params=None, draft_probs=None, logprobs=None, logprobs_dst=None, rows=None,
                   vocab=None, dtype=None, row_stride=None, shard=None, advance=None, grammar=None,
                   penalties=None):
    """Verify ``k`` draft tokens per row against the target's logits, into the feed cells.

    Speculative decoding's check (docs/kernels.md, "Verify"). Row ``r`` has the drafts
    ``drafts[r * k : (r + 1) * k]`` (``NO_TOKEN`` ends them early) and ``k + 1`` logit rows: its
    position ``j`` (its input, then its first ``j`` drafts) is logit row ``r * (k + 1) + j``. The
    row accepts its drafts in order while the rule at their position agrees, then emits one id of
    its own, so it emits ``n`` ids, ``1 <= n <= k + 1``:

    - greedy rows (``params`` None, or temperature 0): a draft is accepted when it equals the
      argmax rule's id at its position (``argmax_to_feed``); the first mismatch, or the position
      after the last draft, emits the rule's id;
    - sampled rows: the speculative sampling rule over the distribution ``sample_to_feed`` draws
      from at that position (the row's params at ``position + j``: temperature, top_k, top_p,
      min_p, masks and bitmask). A draft ``x`` is accepted with probability ``p(x)`` (one-hot
      drafts; ``min(1, p(x) / q(x))`` with ``draft_probs``); the first rejection emits a draw from
      ``p`` without ``x`` (``max(0, p - q)``), renormalised; after the last accepted draft, the
      bonus is ``sample_to_feed``'s own id at that position. Every uniform comes from
      the counter-based generator (the same ids on every backend and in any batch).

    In stream order and with no host synchronisation: the kernel, an async copy of
    ``rows * (k + 2)`` words of cells into ``dst`` (and of ``logprobs`` into ``logprobs_dst``),
    then a record of ``event``.

    Parameters
    ----------
    logits : tensor, DeviceBuffer, or int
        ``rows * (k + 1)`` logit rows, as ``argmax_to_feed``'s logits.
    drafts : sequence of int, uint32 buffer, or device memory
        ``rows * k`` draft ids. Host drafts (a list, a numpy array) are read and checked before
        the call returns; device memory (a ``DeviceBuffer``, a device pointer of this package, a
        tensor without the buffer protocol) is read when the kernel runs, where an id at or
        beyond ``vocab`` is never accepted.
    cells : DeviceBuffer, int, or a uint32/int32 tensor
        ``rows * (k + 2)`` words: row ``r`` holds ``n``, then the ``n`` emitted ids, then
        ``NO_TOKEN``.
    dst : PinnedBuffer, writable buffer, int, or None
        Where the ``rows * (k + 2)`` words of cells are copied, as ``argmax_to_feed``'s ``dst``.
    event : Event, int, or None
        Recorded after the copies.
    stream : Stream, int or stream-like, optional
    k : int
        Drafts per row, 1 to ``MAX_DRAFTS`` (64).
    masks : sequence of (int, int), uint32 buffer, device memory, or None
        Two ids per **logit row** (``rows * (k + 1)`` pairs), as ``argmax_to_feed``'s masks.
    bitmask : device memory, optional
        ``[rows * (k + 1), ceil(vocab / 32)]`` int32 words, one row per logit row.
    params : SAMPLING_PARAMS_DTYPE array, or device memory holding such records, optional
        One record per row (not per logit row); its ``position`` is position 0's.
    draft_probs : device memory, optional
        The drafter's distributions, float32 ``[rows * k, vocab]`` (row ``r * k + j`` for draft
        ``j`` of row ``r``), read when the kernel runs: a sampled row accepts draft ``x`` with
        probability ``min(1, p(x) / q(x))`` and after a rejection draws from
        ``max(0, p - q)``, renormalised; a value that is not finite and positive counts as 0.
        None: one-hot drafts (a deterministic drafter), ``q(x) = 1``. Greedy rows ignore it.
    logprobs : device memory, optional
        ``rows * (k + 1)`` float32: the log-probability of each emitted id under its logit row's
        raw distribution (as ``argmax_to_feed``'s logprobs), NaN past ``n``.
    logprobs_dst : PinnedBuffer, writable float32 buffer, int, or None
        Where ``logprobs`` is copied; needs ``logprobs``.
    rows : int, optional
        Rows of drafts; taken from a logits tensor (its rows over ``k + 1``) or host drafts
        (their length over ``k``) when None.
    vocab, dtype, row_stride
        As for ``argmax_to_feed`` (``row_stride`` between logit rows).
    shard : VocabShard, optional
        A vocabulary split across ranks, as for ``argmax_to_feed``: one-hot drafts,
        ``rows * (k + 1)`` at most ``shard.max_rows``; every rank gets the unsharded call's
        cells and ``dst``. Greedy rows take one all-gather of 16 bytes a position; sampled rows
        (device params, which need the shard's ``FilterRounds``, or any params with them) a
        sampled call's rounds, 16 bytes a position more plus the filters' rounds, with
        ``advance`` read on the device. ``draft_probs``, and logprobs with sampled rows (or
        any params on a shard with fixed rounds: give greedy rows ``params=None``), raise
        ``FeedError`` (docs/tensor-parallel.md, "Verify").
    advance : device memory, optional
        ``rows`` uint32 (needs ``params``): ``advance[r]`` is added to row ``r``'s ``position``
        when the kernel runs. At depth 2 a step is queued before the last one's counts are read:
        ``resolve_verified``'s ``out_advance`` (gathered per row) moves each sampled row's draws
        to the positions that step reached (docs/speculative.md).
    grammar : tuple, optional
        As for ``argmax_to_feed``: position ``j`` of row ``r`` may pick only what the state its
        first ``j`` drafts reach allows (a draft the grammar forbids is rejected like any other
        mismatch), and the row's state word becomes the state after its emitted ids. Host
        drafts are uploaded to the scratch first (refused in a capture).
    penalties : PenaltyLaunch, optional
        The step's penalties in the same call (docs/speculative.md, "Penalties"), a launch of
        ``k`` (``PenaltyState.prepare(k=)``) over these rows: what ``penalties.apply(logits,
        stream, drafts)`` queues before the verify and ``penalties.update(cells, stream)``
        after it, with the same logits, cells and counts. Needs device drafts; not with
        ``shard``. On the host backend each logit row's penalties are applied just before the
        verify reads the row, in the same pass.

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError
        ``k`` outside 1..64; ``rows * (k + 1)`` above ``MAX_ROWS``; drafts that do not hold
        ``rows * k`` ids, or a host draft id at or beyond ``vocab``; masks that do not cover the
        logit rows, or a mask id at or beyond ``vocab``; cells, ``dst``, ``logprobs`` or
        ``logprobs_dst`` too small; bad params (as ``sample_to_feed``); ``penalties`` of another
        ``k`` or rows, or with host drafts; before anything is queued.
    TypeError
        An argument of the wrong kind.
    FeedError
        ``shard`` with sampled rows or ``draft_probs``; a closed or unknown buffer, event or stream.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> logits = np.zeros((2, 4), np.float32); logits[0, 3] = 1; logits[1, 2] = 1
    >>> with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(3 * 4) as cells, \\
    ...         mf.PinnedBuffer(3 * 4) as out, mf.Event() as done:
    ...     mf.copy_h2d_async(dev, logits)
    ...     mf.verify_to_feed(dev, [3], cells, out, done, k=1, vocab=4, dtype="float32")
    ...     done.synchronize()
    ...     np.frombuffer(out, np.uint32).tolist()   # draft 3 accepted, then the bonus 2
    1
    [2, 3, 2]
    """
    return pick_to_feed(verify_step(logits, drafts, cells, dst, event, stream, k, masks, bitmask,
                                    params, draft_probs, logprobs, logprobs_dst, rows, vocab,
                                    dtype, row_stride, shard, advance, grammar, penalties))


cdef PickStep verify_step(object logits, object drafts, object cells, object dst, object event,
                          object stream, object k, object masks, object bitmask, object params,
                          object draft_probs, object logprobs, object logprobs_dst, object rows,
                          object vocab, object dtype, object row_stride, object shard,
                          object advance, object grammar, object penalties):
    """verify_to_feed's step, made without parsing keywords again (as pick_step for the others)."""
    cdef PickStep s = pick_step("verify", logits, masks, params, cells, dst, event, stream, rows,
                                vocab, dtype, row_stride, bitmask, logprobs, logprobs_dst,
                                penalties, grammar, shard)
    s.drafts, s.k, s.draft_probs, s.advance = drafts, k, draft_probs, advance
    return s


cdef object launch_verify(PickStep step):
    """The one launcher under verify_to_feed (and pick_to_feed given a verify step): the step's
    fields checked, in the keyword call's order, into one mf_verify_args and one C call. Every
    field is checked before the launch, which commits what the work needs or raises with nothing
    kept (_Launch.queued). Over a split vocabulary pick_to_feed hands the step to its shard."""
    cdef object logits = step.logits, drafts = step.drafts, cells = step.cells, dst = step.dst
    cdef object event = step.event, masks = step.masks, bitmask = step.bitmask
    cdef object params = step.params, draft_probs = step.draft_probs, logprobs = step.logprobs
    cdef object logprobs_dst = step.logprobs_dst, rows = step.rows, advance = step.advance
    cdef object grammar = step.grammar, penalties = step.penalties
    cdef mf_verify_args a
    cdef mf_argmax_args view
    cdef uint64_t s, e
    cdef void *ptr
    cdef size_t dst_len, cells_len
    cdef uint32_t logit_rows
    cdef _HeldBuffer held = None
    cdef _HeldBuffer held_lp = None
    cdef _VerifyInputs keep = _VerifyInputs.__new__(_VerifyInputs)
    cdef _GrammarCall g = None
    k = int_of(step.k, "k", 1, MF_MAX_DRAFTS)
    mf_verify_args_init(&a)  # every option off, struct_size set (feed.h, "descriptors")
    memset(&view, 0, sizeof(view))
    keep.pick = _PickInputs.__new__(_PickInputs)
    stream_of(step.stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        logits_of(launch, logits, &view, None, step.vocab, step.dtype, step.row_stride)
        if view.rows:  # a tensor: its logit rows are rows * (k + 1)
            if view.rows % (k + 1):
                raise ValueError(f"the logits tensor has {view.rows} rows, not a multiple of k + 1 = {k + 1}")
            agree(rows, view.rows // (k + 1), "rows")
            rows = view.rows // (k + 1)
        drafts_on_device = device_resident(drafts, "drafts")
        if not drafts_on_device:
            keep.drafts = words_of(drafts, False, "drafts")
            if rows is None:
                if keep.drafts.n % k:
                    raise ValueError(f"drafts hold {keep.drafts.n} ids, not a multiple of k = {k}")
                rows = keep.drafts.n // k
        if rows is None:
            raise ValueError("rows is required with device-resident drafts and logits that are not a tensor")
        rows = int_of(rows, "rows", 1, MF_MAX_ROWS)
        if rows * (k + 1) > MF_MAX_ROWS:
            raise ValueError(f"rows * (k + 1) = {rows * (k + 1)} logit rows; at most {MF_MAX_ROWS}")
        a.rows = <uint32_t>rows
        a.k = <uint32_t>k
        logit_rows = a.rows * (a.k + 1)
        a.logits = view.logits
        a.vocab = view.vocab
        a.dtype = view.dtype
        a.row_stride = view.row_stride
        if drafts_on_device:
            a.drafts = <const uint32_t *>device_input(launch, drafts, <size_t>a.rows * a.k * 4, "drafts")
            a.flags |= MF_VERIFY_DRAFTS_DEVICE
        else:
            if keep.drafts.n != <Py_ssize_t>a.rows * a.k:
                raise ValueError(f"drafts hold {keep.drafts.n} ids, not rows * k = {a.rows * a.k}")
            a.drafts = keep.drafts.data
        if masks is not None and device_resident(masks, "masks"):
            a.masks = <const uint32_t *>device_input(launch, masks, <size_t>logit_rows * 8, "masks")
            a.flags |= MF_ARGS_MASKS_DEVICE
        elif masks is not None:
            keep.masks = words_of(masks, True, "masks")
            if keep.masks.n != 2 * <Py_ssize_t>logit_rows:
                raise ValueError(f"masks hold {keep.masks.n // 2} rows, not the {logit_rows} logit rows "
                                 f"(rows * (k + 1))")
            a.masks = keep.masks.data
        if bitmask is not None:
            if not (isinstance(bitmask, int) or type(bitmask) is DeviceBuffer
                    or hasattr(bitmask, "__dlpack__") or hasattr(bitmask, "__cuda_array_interface__")):
                raise TypeError("bitmask must be device memory (a DeviceBuffer, a device pointer or a "
                                f"tensor) of int32 words, not {type(bitmask).__name__}")
            a.bitmask = <const uint32_t *>device_input(
                launch, bitmask, <size_t>logit_rows * ((a.vocab + 31) // 32) * 4, "bitmask")
        if draft_probs is not None:
            if not device_resident(draft_probs, "draft_probs"):
                raise TypeError("draft_probs must be device memory (a DeviceBuffer, a device pointer or a "
                                f"tensor) of float32, not {type(draft_probs).__name__}")
            # dtype, and the count up to what a uint32 says (device_input checks the bytes)
            check_float_rows(draft_probs, <uint32_t>min(<uint64_t>a.rows * a.k * a.vocab, 0xFFFFFFFF),
                             "draft_probs", True)
            a.draft_probs = <const float *>device_input(launch, draft_probs, <size_t>a.rows * a.k * a.vocab * 4,
                                                        "draft_probs", False)
        if params is not None:
            view.rows = a.rows  # one record per row
            fill_params(launch, &view, params, keep.pick)
            a.params = view.params
            a.flags |= view.flags & MF_ARGS_PARAMS_DEVICE
        if advance is not None:
            if params is None:
                raise ValueError("advance needs params (it moves the sampled rows' positions)")
            launch.device(advance, &ptr, &cells_len, "advance", False, True)
            a.advance = <const uint32_t *>ptr
            if cells_len != <size_t>-1 and cells_len < <size_t>a.rows * 4:
                raise ValueError(f"advance: {cells_len} bytes, fewer than one uint32 for each of the "
                                 f"{a.rows} rows")
        launch.device(cells, &ptr, &cells_len, "cells", True, True)
        a.cells = <uint32_t *>ptr
        a.cell_capacity = cells_capacity(cells, ptr, cells_len, a.rows * (a.k + 2))
        held_lp = fill_logprobs(&a.logprobs, &a.logprobs_dst, logprobs, logprobs_dst, logit_rows)
        event_of(event, &a.event, True)
        if dst is None:
            a.host_dst = NULL
        elif isinstance(dst, int):
            u64_of(dst, &e, "dst pointer")
            a.host_dst = <void *><size_t>e
            pinned_range(e, <size_t>a.rows * (a.k + 2) * 4)
        else:
            held = host_ptr_of(dst, True, &a.host_dst, &dst_len)
            if dst_len < <size_t>a.rows * (a.k + 2) * 4:
                raise ValueError(f"dst holds {dst_len} bytes; {a.rows} rows of k + 2 words need "
                                 f"{a.rows * (a.k + 2) * 4}")
        launch.hold(held)
        launch.hold(held_lp)
        launch.records(a.event)
        launch.writes_cells(a.cells, (a.rows, a.k))
        if grammar is not None:  # the C call uploads host drafts for the mask's walk
            g = grammar_of(launch, grammar, s, a.rows, a.k, not drafts_on_device)
            a.grammar = &g.desc
        if penalties is not None:  # the launch keeps its tables alive until the work has run
            verify_penalties(&a, penalties)
        launch.queued(mf_verify_to_feed(&a, s),
                      (logits, drafts, cells, dst, event, masks, bitmask, params, logprobs, logprobs_dst, advance,
                       grammar, g, penalties))
    finally:
        launch.close()
    return a.rows


def resolve_verified(cells, out_ids, out_advance, stream=0, *, rows=None, k=None):
    """Each verified row's next input id and advance, on the device, in stream order.

    ``out_ids[r]`` = row ``r``'s last emitted id (its cell word ``n``), ``out_advance[r]`` = its
    ``n``, read from ``cells`` when the kernel runs: the next fed step's input ids and how far
    each sequence moved, with no host synchronisation. Cells whose count word is outside
    ``1..k + 1`` (not written by ``verify_to_feed``) give ``NO_TOKEN`` and 0.

    Parameters
    ----------
    cells : DeviceBuffer, int, or a uint32/int32 tensor
        The cells of a ``verify_to_feed`` call: ``rows * (k + 2)`` words.
    out_ids, out_advance : DeviceBuffer, int, a uint32/int32 tensor, or None
        ``rows`` words each; either may be None (not both).
    stream : Stream, int or stream-like, optional
    rows, k : int, optional
        Default: those of the last ``verify_to_feed`` into ``cells``.

    Raises
    ------
    ValueError
        ``rows`` or ``k`` missing when no ``verify_to_feed`` wrote these cells, or out of range;
        an output or ``cells`` too small.
    FeedError
        A closed or unknown buffer or stream.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> with mf.DeviceBuffer(2 * 3 * 4) as cells, mf.DeviceBuffer(8) as ids, mf.DeviceBuffer(8) as n, \\
    ...         mf.PinnedBuffer(16) as host:
    ...     mf.copy_h2d_async(cells, np.array([2, 7, 8, 1, 5, mf.NO_TOKEN], np.uint32))  # k = 1
    ...     mf.resolve_verified(cells, ids, n, rows=2, k=1)
    ...     mf.copy_d2h_async(ids, memoryview(host)[:8]); mf.copy_d2h_async(n, memoryview(host)[8:])
    ...     mf.stream_synchronize()
    ...     np.frombuffer(host, np.uint32).tolist()   # last ids 8 and 5, advances 2 and 1
    [8, 5, 2, 1]
    """
    cdef uint64_t s
    cdef void *cells_ptr
    cdef void *ids_ptr = NULL
    cdef void *adv_ptr = NULL
    cdef size_t have
    if out_ids is None and out_advance is None:
        raise ValueError("resolve_verified needs out_ids or out_advance")
    stream_of(stream, &s)
    cdef _Launch launch = launch_on(s)
    try:
        launch.device(cells, &cells_ptr, &have, "cells", False, True)
        if rows is None or k is None:
            shape = verify_shape_of(<size_t>cells_ptr)
            if shape is None:
                raise ValueError("rows and k are required: no verify_to_feed has written these cells")
            rows = shape[0] if rows is None else rows
            k = shape[1] if k is None else k
        rows = int_of(rows, "rows", 1, MF_MAX_ROWS)
        k = int_of(k, "k", 1, MF_MAX_DRAFTS)
        if is_foreign(cells) and rows * (k + 2) * 4 > have:  # the C layer checks its own allocations
            raise ValueError(f"verify cells: {rows * (k + 2) * 4} bytes run past the end of the tensor's {have}")
        if out_ids is not None:
            launch.device(out_ids, &ids_ptr, &have, "out_ids", True, True)
            if is_foreign(out_ids) and <size_t>rows * 4 > have:
                raise ValueError(f"out_ids: {rows * 4} bytes run past the end of the tensor's {have}")
        if out_advance is not None:
            launch.device(out_advance, &adv_ptr, &have, "out_advance", True, True)
            if is_foreign(out_advance) and <size_t>rows * 4 > have:
                raise ValueError(f"out_advance: {rows * 4} bytes run past the end of the tensor's {have}")
        launch.queued(mf_resolve_verified(<const uint32_t *>cells_ptr, <uint32_t>rows, <uint32_t>k,
                                          <uint32_t *>ids_ptr, <uint32_t *>adv_ptr, s),
                      (cells, out_ids, out_advance))
    finally:
        launch.close()
