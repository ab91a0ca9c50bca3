# The building blocks of a vocabulary split across slices (docs/kernels.md, "Partial records and
# the combine"): a partial argmax or temperature-only sample over one slice of each row, writing a
# partial block, the stages of sampling with filters over a slice ("Filters need global
# thresholds"), and the combine of the gathered blocks into the feed cells, exactly as the
# unsharded call. Private: the tensor-parallel shard is built on them.

# The block's layout, from partial_layout.h (its one source): sizes, and the byte offset and
# numpy format of each field of the header and of a record.
PARTIAL_RECORD_BYTES = MF_PARTIAL_RECORD_BYTES            # one row of one slice
PARTIAL_HEADER_BYTES = MF_PARTIAL_HEADER_BYTES            # the fingerprint before the rows
PARTIAL_FAULT_OFFSET = MF_PARTIAL_OFF_FAULT               # slice 0's word the combine's fault goes to
PARTIAL_HEADER_FIELDS = {"tag": (MF_PARTIAL_OFF_TAG, "<u4"), "rows": (MF_PARTIAL_OFF_ROWS, "<u4"),
                         "call": (MF_PARTIAL_OFF_CALL, "<u8"), "vocab": (MF_PARTIAL_OFF_VOCAB, "<u4"),
                         "start": (MF_PARTIAL_OFF_START, "<u4"), "stop": (MF_PARTIAL_OFF_STOP, "<u4"),
                         "reserved": (MF_PARTIAL_OFF_FAULT, "<u4")}
PARTIAL_RECORD_FIELDS = {"id": (MF_RECORD_OFF_ID, "<u4"), "logit_bits": (MF_RECORD_OFF_LOGIT_BITS, "<u4"),
                         "max": (MF_RECORD_OFF_MAX, "<f4"), "sum": (MF_RECORD_OFF_SUM, "<f4")}

_FAULTS = {1: "another operation or not a partial block", 2: "another row count",
           3: "another call counter (or, sampling with host params, other params: their digest is in it)",
           4: "another vocabulary",
           5: "slices that do not tile the vocabulary in order",
           6: "the other logprobs setting (logprobs asked for on some slices only)"}
_FAULT_FILTERS = 7  # bits 8+ hold a row, not a slice (feed.h, mf_combine_args)
_FAULT_IDS = 8  # bits 8+ hold a row (mf_top_logprobs_combine)
_FAULT_ROUNDS = 9  # bits 8+ hold a row (mf_select_decide with fixed rounds)
_FAULT_PARAMS = 10  # bits 8+ hold a row (mf_select_decide: the slices' params digests differ)


SELECT_ROW_BYTES = sizeof(mf_select_row)              # one row's state between filter stages
SELECT_BINS = MF_SELECT_BINS                             # one digit's values
SELECT_DIGIT_BITS = MF_SELECT_DIGIT_BITS
SELECT_HIST_BYTES = MF_SELECT_BINS * 8                  # one row's digit histogram
SELECT_CANDS_MAX = MF_SELECT_CANDS_MAX                  # the largest top_k a candidates stage lists
PARTIAL_CAND_BYTES = MF_PARTIAL_CAND_BYTES              # one entry of a row's candidate list
SELECT_STAGES = {"top": MF_SELECT_TOP, "hist": MF_SELECT_HIST, "race": MF_SELECT_RACE,
                 "cands": MF_SELECT_CANDS}
SELECT_ROW_FLAGS = {"top": MF_SELECT_ROW_TOP, "hist": MF_SELECT_ROW_HIST, "mass": MF_SELECT_ROW_MASS,
                    "cut": MF_SELECT_ROW_CUT, "cut_mass": MF_SELECT_ROW_CUT_MASS,
                    "cands": MF_SELECT_ROW_CANDS}
PARTIAL_OPS = {"argmax": MF_PARTIAL_ARGMAX, "sample": MF_PARTIAL_SAMPLE, "filtered": MF_PARTIAL_FILTERED,
               "top": MF_PARTIAL_TOP, "hist": MF_PARTIAL_HIST, "cands": MF_PARTIAL_CANDS}
PARTIAL_TAG = MF_PARTIAL_TAG
SELECT_PLAN_BYTES = sizeof(mf_select_plan)            # one row's decision state between rounds
SELECTS = {"k": MF_SELECT_K, "p": MF_SELECT_P}          # the radix selects, in the order they run


cdef int fill_partial(mf_argmax_args *a, object partial) except -1:
    """The slice of a partial call: ``partial`` is (partials, start, stop, vocab, call, logprobs)
    and, for a stage of the split filters, (select, stage, id_list, list_cap, cands, drafts) after
    them, ``cands`` None or (gathered lists or None, cap, world, stride), ``drafts`` None or a
    sampled verify's (device drafts, k)."""
    cdef void *ptr
    cdef uint64_t call
    partials, start, stop, vocab, call_obj, logprobs = partial[:6]
    if logprobs is not True and logprobs is not False:
        raise TypeError(f"logprobs must be True or False, not {logprobs!r}")
    if len(partial) == 12:
        select, stage, id_list, list_cap, cands, drafts = partial[6:]
        if stage not in SELECT_STAGES:
            raise ValueError(f"stage must be one of {sorted(SELECT_STAGES)}, not {stage!r}")
        device_ptr_of(select, &ptr)
        a.select = <mf_select_row *>ptr
        a.select_stage = SELECT_STAGES[stage]
        a.flags |= MF_ARGS_SELECT
        if id_list is not None:
            a.select_list_cap = <uint32_t>int_of(list_cap, "list_cap", 1, 0xFFFFFFFF)
            device_ptr_of(id_list, &ptr)
            a.select_list = <uint32_t *>ptr
        if cands is not None:
            lists, cap, world, stride = cands
            a.select_cands_cap = <uint32_t>int_of(cap, "cands_cap", 1, MF_SELECT_CANDS_MAX)
            if lists is not None:
                a.select_cands_world = <uint32_t>int_of(world, "cands_world", 1, 0xFFFFFFFF)
                a.select_cands_stride = <uint64_t>int_of(stride, "cands_stride", 1, 0xFFFFFFFFFFFF)
                device_ptr_of(lists, &ptr)
                a.select_cands = ptr
        if drafts is not None:
            ids, k = drafts
            a.select_k = <uint32_t>int_of(k, "k", 1, MF_MAX_DRAFTS)
            device_ptr_of(ids, &ptr)
            a.select_drafts = <const uint32_t *>ptr
    total = int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
    lo = int_of(start, "start", 0, total)
    hi = int_of(stop, "stop", lo, total)
    u64_of(call_obj, &call, "call")
    device_ptr_of(partials, &ptr)
    a.partials = ptr
    a.vocab = <uint32_t>(hi - lo)
    a.vocab_total = <uint32_t>total
    a.start = <uint32_t>lo
    a.call = call
    a.flags |= MF_ARGS_PARTIAL | (MF_ARGS_PARTIAL_LOGPROBS if logprobs else 0)
    return 0


def _partial_bytes(rows):
    """Bytes of one slice's partial block for ``rows`` rows (a header, then a record per row)."""
    return (int_of(rows, "rows", 1, MF_MAX_ROWS) + MF_PARTIAL_HEADER_RECORDS) * MF_PARTIAL_RECORD_BYTES


def _argmax_partial(logits, masks, partials, event=None, stream=0, *, start, stop, vocab, dtype,
                    call, rows=None, row_stride=None, bitmask=None, logprobs=False):
    """The masked argmax of the slice ``[start, stop)`` of each row, as a partial block.

    Writes ``partials`` (device, ``_partial_bytes(rows)`` bytes) in stream order: a 32-byte header
    (operation, rows, ``call``, ``vocab``, ``start``, ``stop``), then one 16-byte record per row
    (the slice's best candidate as a global id and its logit, and, with ``logprobs``, the slice's
    greatest logit and sum of exponentials, else 0 and 0), then records ``event``. ``_combine_partials`` turns the blocks of every
    slice into what ``argmax_to_feed`` gives on the whole rows.

    Parameters
    ----------
    logits : device memory or None
        The slice's ``stop - start`` columns of each row (row ``r`` at element ``r * row_stride``);
        for an empty slice None (``dtype`` needed) or a ``(rows, 0)`` tensor (its dtype and rows).
    masks : as for ``argmax_to_feed``
        Global ids (below ``vocab``); an id outside the slice masks nothing here.
    partials : DeviceBuffer, int, or a device array
        Where the block goes.
    event, stream
        As for ``argmax_to_feed``.
    start, stop : int
        The slice, ``0 <= start <= stop <= vocab``.
    vocab : int
        The whole vocabulary.
    dtype : {"float32", "float16", "bfloat16"}
    call : int
        The caller's call counter (uint64), written into the header and checked by the combine.
    rows, row_stride
        As for ``argmax_to_feed`` (``row_stride`` in elements of the slice's rows).
    bitmask : device memory, optional
        The *whole* rows' bitmask, ``[rows, ceil(vocab / 32)]`` int32 words.
    logprobs : bool
        Whether the combine will write logprobs: the records then carry the slice's max and sum
        of exponentials (one more pass over the slice), and the header says so, so that a combine
        with the other setting refuses the block (a fault, never a logprob from a zero sum).

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError
        A slice outside ``[0, vocab]``, a mask id ``>= vocab``, ``partials`` too small, and the
        errors of ``argmax_to_feed``; before anything is queued.

    Examples
    --------
    >>> _argmax_partial(dev, None, part, rows=4, start=0, stop=50, vocab=100,
    ...                 dtype="float32", call=7)  # doctest: +SKIP
    4
    """
    return launch_pick(pick_step("argmax", logits, masks, None, None, None, event, stream, rows,
                                 None, dtype, row_stride, bitmask, None, None, None, None, None),
                       rows, (partials, start, stop, vocab, call, logprobs))


def _sample_partial(logits, params, partials, event=None, stream=0, *, start, stop, vocab, dtype,
                    call, masks=None, rows=None, row_stride=None, bitmask=None, logprobs=False):
    """``_argmax_partial`` with each row's race winner over the slice (``sample_to_feed``'s rule).

    The race draws by global id, so the combine gives the very id ``sample_to_feed`` draws on the
    whole row. Rows must be temperature-only (``top_k`` 0, ``top_p`` 1, ``min_p`` 0): the filters
    need thresholds over the whole row (docs/kernels.md).

    Parameters
    ----------
    params : SAMPLING_PARAMS_DTYPE array, or device memory holding such records
        One record per row, the same on every slice. Host records are read and checked now;
        device-resident ones when the kernel runs (capturable in a graph), where a sampled row
        with a filter set is the combine's fault (``_combine_partials``), never a token.
    logits, partials, event, stream, start, stop, vocab, dtype, call, masks, rows, row_stride, bitmask, logprobs
        As for ``_argmax_partial``.

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError
        A filter set on some host row, and the errors of ``_argmax_partial``.

    Examples
    --------
    >>> _sample_partial(dev, p, part, rows=4, start=50, stop=100, vocab=100,
    ...                 dtype="float32", call=7)  # doctest: +SKIP
    4
    """
    if rows is None and masks is None:
        rows = len(params)
    return launch_pick(pick_step("sample", logits, masks, params, None, None, event, stream, rows,
                                 None, dtype, row_stride, bitmask, None, None, None, None, None),
                       rows, (partials, start, stop, vocab, call, logprobs))


def _select_partial(logits, params, partials, select, stage, stream=0, *, start, stop, vocab, dtype,
                    call, masks=None, rows=None, row_stride=None, bitmask=None, id_list=None,
                    list_cap=0, logprobs=False, cands=None, cands_cap=0, cands_world=0,
                    cands_stride=0, drafts=None, k=None):
    """One stage of sampling with filters over the slice ``[start, stop)`` of each row.

    The filters need thresholds over the whole row (docs/kernels.md, "Filters need global
    thresholds"): each stage writes a block the slices exchange, and ``_select_decide`` writes
    ``select`` between stages from the gathered blocks. ``"top"`` writes each row's greatest finite candidate
    (a partial record), ``"hist"`` the weights of one 8-bit digit of the logit key
    (``SELECT_BINS`` uint64 a row after the header), ``"cands"`` each listed row's greatest ``min(top_k, count)``
    candidates (``cands_cap`` entries of ``PARTIAL_CAND_BYTES`` a row), ``"race"`` the race winner
    over the survivors (a partial record, combined by ``_combine_partials(..., filtered=True)``).

    Parameters
    ----------
    select : device memory
        ``rows * SELECT_ROW_BYTES`` bytes of per-row state (``mf_select_row``, feed.h).
    stage : {"top", "hist", "cands", "race"}
    id_list : device memory, optional
        ``rows * list_cap`` uint32 of scratch: the ids a select's later rounds read instead of
        the whole slice (a row whose ids in range do not fit scans the slice).
    list_cap : int
        Ids a row's list holds, with ``id_list``.
    logprobs : bool
        ``"race"``: whether the combine will write logprobs (the records then carry the slice's
        max and sum of exponentials, and the header says so); the other stages take False.
    cands : device memory, optional
        ``"race"``: the gathered ``"cands"`` blocks of ``cands_world`` slices in id order,
        ``cands_stride`` bytes apart; rows flagged ``"cands"`` take their floor from them.
    cands_cap : int
        Entries a row of a ``"cands"`` block (1 to ``SELECT_CANDS_MAX``), for both stages.
    cands_world, cands_stride : int
        With ``cands``.
    drafts : device memory, optional
        A sampled ``verify_to_feed`` over a split vocabulary (docs/tensor-parallel.md, "Verify"):
        ``rows`` is ``R * (k + 1)`` logit rows and ``drafts`` the ``R * k`` drafts, read when the
        kernel runs. ``"top"`` then carries each position's draft's logit bits from the slice
        that holds it, ``"race"`` races without the draft and carries the slice's survivors'
        total mass (verify_rule.h; no ``logprobs``).
    k : int, optional
        Drafts per row, with ``drafts``.
    logits, params, partials, stream, start, stop, vocab, dtype, call, masks, rows, row_stride, bitmask
        As for ``_sample_partial`` (filters allowed; host params).

    Returns
    -------
    int
        The rows launched.

    Raises
    ------
    ValueError
        A bad stage, buffers too small, device-resident params, and the errors of
        ``_sample_partial``; before anything is queued.

    Examples
    --------
    >>> _select_partial(dev, p, part, state, "top", rows=4, start=0, stop=50, vocab=100,
    ...                 dtype="float32", call=7)  # doctest: +SKIP
    4
    """
    if rows is None and masks is None:
        rows = len(params)
    if (drafts is None) != (k is None):
        raise ValueError("drafts and k go together (a sampled verify's stages)")
    return launch_pick(pick_step("sample", logits, masks, params, None, None, None, stream, rows,
                                 None, dtype, row_stride, bitmask, None, None, None, None, None),
                       rows,
                       (partials, start, stop, vocab, call, logprobs, select, stage, id_list, list_cap,
                        (cands, cands_cap, cands_world, cands_stride) if cands_cap else None,
                        None if drafts is None else (drafts, k)))


def _combine_partials(partials, world, cells, dst, event, stream=0, *, rows, vocab, call, fault_dst,
                      params=None, logprobs=None, logprobs_dst=None, slice_stride=None,
                      filtered=False, drafts=None, k=None, refused=None, select=None):
    """The feed cells (and logprobs) of whole rows from the partial blocks of their slices.

    ``partials`` holds ``world`` blocks, block ``w`` at byte ``w * slice_stride *
    PARTIAL_RECORD_BYTES``, slices in
    id order (what an all-gather of each slice's block gives). In stream order: every header is
    checked against (operation, ``rows``, ``call``, ``vocab``) and the slices against
    ``[0, vocab)``, and the blocks' logprobs setting against whether ``logprobs`` is given; then
    ``cells``, ``dst``, ``logprobs`` and ``logprobs_dst`` get what
    ``argmax_to_feed`` (``params`` None) or ``sample_to_feed`` gives on the whole rows; then the
    fault word is copied into ``fault_dst`` and ``event`` recorded. A mismatch writes ``NO_TOKEN``
    and NaN to every row and a nonzero fault: ``_check_partials_fault(fault_dst)`` raises it as a
    ``FeedError`` once the event has completed.

    Parameters
    ----------
    partials : device memory
        The gathered blocks (slice 0's header also holds the fault word the combine writes).
    world : int
        Slices, 1 to 65536.
    cells, dst, event, stream, logprobs, logprobs_dst
        As for ``argmax_to_feed``.
    rows : int
        Rows, 1 to 4096, the same as every partial call's.
    vocab : int
        The whole vocabulary.
    call : int
        The call counter every block must carry.
    fault_dst : PinnedBuffer or writable buffer of at least 4 bytes
        Where the fault word is copied (0: the blocks agreed).
    params : SAMPLING_PARAMS_DTYPE array, or device memory holding such records, optional
        The sampled combine's records (temperature-only unless ``filtered``), the partial calls'
        own. Host records are read and checked now. Device-resident ones are read when the
        combine runs, so the call is capturable and a graph's replay draws with what they hold
        then; a temperature out of range there is 0 (as in ``sample_to_feed``), and without
        ``filtered`` a sampled row with a filter set gets ``NO_TOKEN`` and NaN and the fault ("a
        filter the slices cannot apply"), the other rows their draws.
    slice_stride : int, optional
        16-byte records between blocks, at least ``rows + 2`` (default ``rows + 2``).
    filtered : bool
        The blocks are ``_select_partial``'s ``"race"`` stage: ``params`` may hold filters.
    drafts : device memory, optional
        A greedy ``verify_to_feed`` over a split vocabulary: the blocks are argmax partials of
        ``rows`` logit rows (``rows / (k + 1)`` verified rows), ``drafts`` their ``rows / (k + 1) * k``
        draft ids, read when the combine runs, and ``cells``, ``dst``, ``logprobs`` and
        ``logprobs_dst`` take ``verify_to_feed``'s layout.
        With ``filtered`` (and device ``params``, the logit rows' own: position ``j``'s at
        ``position + j``), a sampled verify: the blocks are the ``"race"`` blocks of its stages
        (``_select_partial(..., drafts=)``) and ``select`` this rank's state after them; no
        logprobs.
    k : int, optional
        Drafts per row, with ``drafts``.
    select : device memory, optional
        A sampled verify's ``rows`` records of ``SELECT_ROW_BYTES`` (with ``filtered``).
    refused : device memory, optional
        A fault word found before the last exchange (a split filter's first decision), read when
        the combine runs: nonzero, with headers that agree, it is the combine's fault (every row
        ``NO_TOKEN`` and NaN), so rounds that every rank ran but did not agree on give no token.

    Raises
    ------
    ValueError
        A bad ``world``, ``rows``, ``vocab`` or ``slice_stride``, buffers too small, filters set in
        host ``params`` without ``filtered``; before anything is queued.
    TypeError
        ``logprobs`` or ``logprobs_dst`` typed other than float32; a non-buffer ``fault_dst``.

    Examples
    --------
    >>> _combine_partials(gathered, 2, cells, ids, done, rows=4, vocab=100, call=7,
    ...                   fault_dst=fault)  # doctest: +SKIP
    """
    cdef mf_combine_args c
    cdef mf_argmax_args view
    cdef _PickInputs keep = _PickInputs.__new__(_PickInputs)
    cdef uint64_t s, e
    cdef void *ptr
    cdef size_t n = 0
    cdef size_t words
    cdef _Launch launch
    mf_combine_args_init(&c)
    mf_argmax_args_init(&view)
    stream_of(stream, &s)
    c.world = <uint32_t>int_of(world, "world", 1, MF_MAX_SLICES)
    c.rows = <uint32_t>int_of(rows, "rows", 1, MF_MAX_ROWS)
    c.vocab = <uint32_t>int_of(vocab, "vocab", 1, MF_MAX_VOCAB)
    u64_of(call, &c.call, "call")
    c.slice_stride = <uint32_t>int_of(c.rows + MF_PARTIAL_HEADER_RECORDS if slice_stride is None
                                      else slice_stride, "slice_stride",
                                      c.rows + MF_PARTIAL_HEADER_RECORDS, 0xFFFFFFFF)
    c.op = MF_PARTIAL_ARGMAX
    if (drafts is None) != (k is None):
        raise ValueError("drafts and k go together (a verify combine)")
    if k is not None:
        c.k = <uint32_t>int_of(k, "k", 1, MF_MAX_DRAFTS)
        if c.rows % (c.k + 1):
            raise ValueError(f"a verify combine's {c.rows} logit rows are not a multiple of k + 1 = {c.k + 1}")
        c.flags |= MF_COMBINE_VERIFY
    words = c.rows // (c.k + 1) * (c.k + 2) if c.k else c.rows  # cell words: verify_to_feed's layout
    # A foreign params array is lent to the C layer for this call (host backend) and kept until
    # the work has run; the lending ends whatever happens (close()).
    launch = launch_on(s)
    try:
        if params is not None:
            view.rows = c.rows
            fill_params(launch, &view, params, keep)
            c.params = view.params
            if view.flags & MF_ARGS_PARAMS_DEVICE:
                c.flags |= MF_COMBINE_PARAMS_DEVICE
            c.op = MF_PARTIAL_FILTERED if filtered else MF_PARTIAL_SAMPLE
        device_ptr_of(partials, &ptr)
        c.partials = ptr
        c.fault = <uint32_t *>(<char *>ptr + MF_PARTIAL_OFF_FAULT)  # slice 0's header, its reserved word
        device_ptr_of(cells, &ptr)
        c.cells = <uint32_t *>ptr
        c.cell_capacity = cells_capacity(
            cells, ptr, (<DeviceBuffer>cells)._nbytes if type(cells) is DeviceBuffer else <size_t>-1, words)
        if c.k:
            c.drafts = <const uint32_t *>device_input(launch, drafts, <size_t>c.rows // (c.k + 1) * c.k * 4, "drafts")
        if refused is not None:
            c.refused = <const uint32_t *>device_input(launch, refused, 4, "refused")
        if select is not None:
            c.select = <const mf_select_row *>device_input(launch, select, <size_t>c.rows * sizeof(mf_select_row),
                                                           "select")
        if dst is not None:
            if isinstance(dst, int):
                u64_of(dst, &e, "dst pointer")
                pinned_range(e, words * 4)
                c.host_dst = <void *><size_t>e
            else:
                launch.hold(host_ptr_of(dst, True, &c.host_dst, &n))
                if n < words * 4:
                    raise ValueError(f"dst holds {n} bytes; {words} words need {words * 4}")
        launch.hold(fill_logprobs(&c.logprobs, &c.logprobs_dst, logprobs, logprobs_dst, c.rows))
        if isinstance(fault_dst, int):
            raise TypeError("fault_dst must be a buffer of at least 4 bytes, not an int")
        launch.hold(host_ptr_of(fault_dst, True, &c.fault_dst, &n))
        if n < 4:
            raise ValueError(f"fault_dst holds {n} bytes, fewer than the fault word's 4")
        event_of(event, &c.event, True)
        launch.records(c.event)
        launch.writes_cells(c.cells, (c.rows // (c.k + 1), c.k) if c.k else <object>c.rows)
        launch.queued(mf_combine_partials(&c, s),
                      (partials, cells, dst, logprobs, logprobs_dst, fault_dst, event, params, drafts, refused,
                       select))
    finally:
        launch.close()


def _select_decide(gathered, block_bytes, world, rank, rows, params, select, plan, fault, stream=0, *,
                   step, vocab=0, call=0, sel=None, round=0, next=None, rounds=None):
    """Queue one decision between a split row's filter stages (feed.h's mf_select_decide,
    select_rule.h): after the ``"top"`` exchange or after round ``round`` of select ``sel``
    (``"k"`` or ``"p"``), then start select ``next`` (None: none). Device state only: the host
    does nothing between the rounds.

    Parameters
    ----------
    gathered : DeviceBuffer or int
        ``world`` blocks, ``block_bytes`` apart: the TOP stage's partial blocks, or a round's
        histograms.
    block_bytes, world, rank, rows : int
    params : DeviceBuffer or int
        ``rows`` SAMPLING_PARAMS_DTYPE records in device memory, read when the decision runs.
    select, plan : DeviceBuffer or int
        ``rows`` records of ``SELECT_ROW_BYTES`` and ``SELECT_PLAN_BYTES``.
    fault : DeviceBuffer or int
        A word: the TOP decision's header check writes it; a later decision after a fault changes
        nothing.
    stream : Stream, int or stream-like, optional
    step : {"top", "round"}
    vocab, call : int
        ``"top"``: what the headers must carry.
    rounds : (int, bool), optional
        ``"top"``: fixed rounds (``FilterRounds``): the candidate lists' cap and whether top_p's
        radix select runs; a sampled row they do not serve is the fault (``MF_FAULT_ROUNDS``).
        None: the rounds follow the params.

    Raises
    ------
    ValueError
        Bad sizes, steps or selects, buffers too small or overlapping; nothing is queued.

    Examples
    --------
    >>> _select_decide(gathered, block, 2, 0, 4, params, state, plan, fault, step="top",
    ...                vocab=1000, call=call, next="k")   # doctest: +SKIP
    """
    cdef uint64_t s
    cdef mf_select_decide_args a
    cdef void *ptr
    mf_select_decide_args_init(&a)
    stream_of(stream, &s)
    if step not in ("top", "round"):
        raise ValueError(f"step must be 'top' or 'round', not {step!r}")
    a.step = MF_DECIDE_TOP if step == "top" else MF_DECIDE_ROUND
    for value, what in ((sel, "sel"), (next, "next")):
        if value is not None and value not in SELECTS:
            raise ValueError(f"{what} must be one of {sorted(SELECTS)} or None, not {value!r}")
    a.select_k_p = SELECTS[sel] if sel is not None else 0
    a.next = SELECTS[next] if next is not None else 0
    a.round = <uint32_t>int_of(round, "round", 0, 0xFFFFFFFF)
    if rounds is not None:
        cap, top_p = rounds
        a.rounds = (MF_ROUNDS_FIXED | <uint32_t>int_of(cap, "the rounds' cap", 0, MF_SELECT_CANDS_MAX)
                    | (MF_ROUNDS_TOP_P if top_p else 0))
    u64_of(block_bytes, &a.block_bytes, "block_bytes")
    a.world = <uint32_t>int_of(world, "world", 1, MF_MAX_SLICES)
    a.rank = <uint32_t>int_of(rank, "rank", 0, MF_MAX_SLICES)
    a.rows = <uint32_t>int_of(rows, "rows", 1, MF_MAX_ROWS)
    a.vocab = <uint32_t>int_of(vocab, "vocab", 0, MF_MAX_VOCAB)
    u64_of(call, &a.call, "call")
    device_ptr_of(gathered, &ptr)
    a.gathered = ptr
    device_ptr_of(params, &ptr)
    a.params = <const mf_sampling_params *>ptr
    device_ptr_of(select, &ptr)
    a.select = <mf_select_row *>ptr
    device_ptr_of(plan, &ptr)
    a.plan = <mf_select_plan *>ptr
    device_ptr_of(fault, &ptr)
    a.fault = <uint32_t *>ptr
    queued_on(s, mf_select_decide(&a, s), (gathered, params, select, plan, fault), 0)


def _verify_logit_params(params, advance, out, stream=0, *, rows, k):
    """Queue the params of a verify's ``rows * (k + 1)`` logit rows (feed.h's
    mf_verify_logit_params): ``out[r * (k + 1) + j]`` is ``params[r]`` at position
    ``position + advance[r] + j`` (mod 2**32), what a split verify's sampled call reads a logit
    row at a time. Device memory only, read and written when it runs, so the rows' params and
    their advance may be the device's own (a step queued before the last one's counts are read).

    Parameters
    ----------
    params : DeviceBuffer, int, or a device tensor
        ``rows`` SAMPLING_PARAMS_DTYPE records.
    advance : DeviceBuffer, int, a uint32/int32 device tensor, or None
        ``rows`` words (None: no advance).
    out : DeviceBuffer or int
        ``rows * (k + 1)`` records, written; it may not overlap the inputs.
    stream : Stream, int or stream-like, optional
    rows, k : int

    Raises
    ------
    ValueError
        ``rows`` or ``k`` out of range, a buffer too small, or ``out`` over an input; nothing
        is queued.

    Examples
    --------
    >>> _verify_logit_params(row_params, adv, logit_params, stream, rows=4, k=3)   # doctest: +SKIP
    """
    cdef uint64_t s
    cdef void *params_ptr
    cdef void *adv_ptr = NULL
    cdef void *out_ptr
    cdef size_t have
    stream_of(stream, &s)
    rows = int_of(rows, "rows", 1, MF_MAX_ROWS)
    k = int_of(k, "k", 1, MF_MAX_DRAFTS)
    if rows * (k + 1) > MF_MAX_ROWS:
        raise ValueError(f"rows * (k + 1) = {rows * (k + 1)} logit rows; at most {MF_MAX_ROWS}")
    cdef _Launch launch = launch_on(s)
    try:
        params_ptr = device_input(launch, params, <size_t>rows * sizeof(mf_sampling_params), "params", False)
        if advance is not None:
            adv_ptr = device_input(launch, advance, <size_t>rows * 4, "advance")
        launch.device(out, &out_ptr, &have, "out", True, False)
        if have != <size_t>-1 and have < <size_t>rows * (k + 1) * 32:
            raise ValueError(f"out holds {have} bytes; {rows * (k + 1) * 32} are needed")
        launch.queued(mf_verify_logit_params(<const mf_sampling_params *>params_ptr, <const uint32_t *>adv_ptr,
                                             <uint32_t>rows, <uint32_t>k, <mf_sampling_params *>out_ptr, s),
                      (params, advance, out))
    finally:
        launch.close()


def _check_partials_fault(fault_dst, outcome="every row got NO_TOKEN"):
    """Raise the fault a combine copied into ``fault_dst``, if any; read it only once the
    combine's event has completed.

    Parameters
    ----------
    fault_dst : buffer
        The combine's ``fault_dst``.
    outcome : str, optional
        What the combine wrote instead, for the message.

    Raises
    ------
    FeedError
        The partial blocks did not match: the reason and the first mismatched slice.

    Examples
    --------
    >>> _check_partials_fault(fault)  # doctest: +SKIP
    """
    word = memoryview(fault_dst).cast("B")[:4].cast("I")[0]
    if word & 0xFF == _FAULT_FILTERS:
        raise FeedError(f"partial blocks refused: row {word >> 8} of the device-resident params "
                        "sets top_k, top_p or min_p, which a split row cannot apply (sharded "
                        "sampling with device params is temperature-only); it got NO_TOKEN")
    if word & 0xFF == _FAULT_ROUNDS:
        raise FeedError(f"partial blocks refused: row {word >> 8} of the params asks for a filter "
                        "the shard's fixed rounds do not serve (a top_k above their top_k, or top_p "
                        "alone without top_p=True); every row got NO_TOKEN")
    if word & 0xFF == _FAULT_PARAMS:
        raise FeedError(f"partial blocks refused: the ranks sampled row {word >> 8} with other params "
                        "(every rank must pass the same); every row got NO_TOKEN")
    if word & 0xFF == _FAULT_IDS:
        raise FeedError(f"top logprobs blocks refused: the slices were asked other ids in row "
                        f"{word >> 8} (every rank must pass the same ids); its chosen logprob is NaN")
    if word:
        reason = _FAULTS.get(word & 0xFF, f"fault {word & 0xFF}")
        raise FeedError(f"partial blocks refused: slice {word >> 8} has {reason}; {outcome}")
