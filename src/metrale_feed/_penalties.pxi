# Launchers of the penalty ops (docs/penalties.md): the same pattern as _kernels.pxi's, every
# argument checked here or in the C layer before anything is queued.

cdef uint32_t penalty_extent(object given, size_t have, size_t per, str what, uint32_t high) except? 0:
    """A capacity: the given one, or the table's bytes over ``per`` (a buffer whose length is known)."""
    if given is None:
        if have == <size_t>-1:
            raise ValueError(f"{what} is required when the tables are foreign pointers")
        given = have // per
    return <uint32_t>int_of(given, what, 1, high)


cdef int penalty_tables(_Launch launch, mf_penalty_args *a, object state, object table, object items,
                        object slot_count, object table_cap, object item_cap) except -1:
    """The tables' pointers and capacities into ``a``, each checked against its buffer's length."""
    cdef void *ptr
    cdef size_t have, state_have, table_have, items_have
    launch.device(state, &ptr, &state_have, "state", True, False)
    a.state = <mf_penalty_slot *>ptr
    launch.device(table, &ptr, &table_have, "table", True, False)
    a.table = <mf_penalty_entry *>ptr
    launch.device(items, &ptr, &items_have, "items", False, False)
    a.items = <const mf_penalty_item *>ptr
    a.slot_count = penalty_extent(slot_count, state_have, sizeof(mf_penalty_slot), "slot_count",
                                  MF_MAX_PENALTY_SLOTS)
    a.table_cap = penalty_extent(table_cap, table_have // a.slot_count if table_have != <size_t>-1 else table_have,
                                 8, "table_cap", MF_MAX_PENALTY_TABLE)
    a.item_cap = penalty_extent(item_cap, items_have // a.slot_count if items_have != <size_t>-1 else items_have,
                                8, "item_cap", 4 * MF_PENALTY_ITEMS)
    for have, need, what in ((state_have, <size_t>a.slot_count * sizeof(mf_penalty_slot), "state"),
                             (table_have, <size_t>a.slot_count * a.table_cap * 8, "table"),
                             (items_have, <size_t>a.slot_count * a.item_cap * 8, "items")):
        if have != <size_t>-1 and need > have:
            raise ValueError(f"{what}: {need} bytes run past the end of its {have}")
    return 0


cdef _Words host_slots(object slots):
    """Host slots as words, at most MF_MAX_ROWS of them."""
    cdef _Words words = words_of(slots, False, "slots")
    if words.n > MF_MAX_ROWS:
        raise ValueError(f"rows must be at most {MF_MAX_ROWS}, got {words.n}")
    return words


cdef int need_layout(object vocab, object dtype) except -1:
    """A logits pointer tells no layout: vocab and dtype must be given."""
    if vocab is None or dtype is None:
        raise TypeError(f"{'vocab' if vocab is None else 'dtype'} is required unless logits is a tensor")
    return 0


cdef int logits_layout(mf_penalty_args *a, object vocab, object dtype, object row_stride) except -1:
    """A logits pointer's layout into ``a``: each given value checked (one not given stays 0)."""
    if vocab is not None:
        a.vocab = <uint32_t>int_of(vocab, "vocab", 0, MF_MAX_VOCAB)
        a.row_stride = a.vocab if row_stride is None else int_of(row_stride, "row_stride", 0, UINT64_MAX)
    if dtype is not None:
        a.dtype = dtype_of(dtype)
    return 0


cdef int ids_extent(size_t have, uint32_t rows, uint32_t k) except -1:
    """An update's ids hold a word a row, or a verify's cells ``k + 2`` (``have`` SIZE_MAX:
    unknown, an int pointer)."""
    cdef size_t need = <size_t>rows * (k + 2 if k else 1) * 4
    if have != <size_t>-1 and need > have:
        raise ValueError(f"ids: {need} bytes run past the end of the array's {have}")
    return 0


cdef uint32_t verify_k(object k) except? 0xFFFFFFFF:
    """A verify's drafts a row (0: a plain step); the C layer checks it against the rows."""
    return <uint32_t>int_of(k, "k", 0, MF_MAX_DRAFTS)


cdef int walk_drafts(_Launch launch, mf_penalty_args *a, object drafts) except -1:
    """An apply's drafts (device, ``rows * k`` words, read when the kernel runs), given exactly
    when ``k > 0``."""
    cdef void *ptr
    cdef size_t have
    if (drafts is None) != (a.k == 0):
        raise ValueError("drafts are given exactly when k > 0 (a verify's logit rows)" if a.k
                         else "drafts need k > 0 (a verify's drafts a row)")
    if drafts is None:
        return 0
    if not device_resident(drafts, "drafts"):
        raise TypeError("drafts must be device memory (the drafter's ids, read when the kernel runs)")
    launch.device(drafts, &ptr, &have, "drafts", False, True)
    if have != <size_t>-1 and <size_t>a.rows * a.k * 4 > have:
        raise ValueError(f"drafts: {a.rows * a.k * 4} bytes run past the end of the array's {have}")
    a.drafts = <const uint32_t *>ptr
    return 0


cdef object launch_penalties(bint update, object target, object slots, object state, object table, object items,
                             object stream, object slot_count, object table_cap, object item_cap, object rows,
                             object vocab, object dtype, object row_stride, object start, object k=0,
                             object drafts=None):
    cdef uint64_t s
    cdef mf_penalty_args a
    cdef void *ptr
    cdef size_t have
    cdef _Words words = None
    cdef _Foreign f
    cdef TensorRows t
    mf_penalty_args_init(&a)
    stream_of(stream, &s)
    a.k = verify_k(k)
    cdef _Launch launch = launch_on(s)
    try:
        penalty_tables(launch, &a, state, table, items, slot_count, table_cap, item_cap)
        if device_resident(slots, "slots"):
            launch.device(slots, &ptr, &have, "slots", False, True)
            if rows is None:
                rows = device_words(slots, ptr, have)
            a.rows = <uint32_t>int_of(rows, "rows", 0, MF_MAX_ROWS)
            if have != <size_t>-1 and <size_t>a.rows * 4 > have:
                raise ValueError(f"slots: {a.rows * 4} bytes run past the end of the array's {have}")
            a.slots = <const uint32_t *>ptr
            a.flags = MF_PENALTY_SLOTS_DEVICE
        else:
            words = host_slots(slots)
            if rows is not None and rows != words.n:
                raise ValueError(f"rows {rows} differs from the {words.n} slots given")
            a.rows = <uint32_t>words.n
            a.slots = words.data if words.n else <const uint32_t *>&_empty_target
        if update:
            if drafts is not None:
                raise ValueError("the update takes no drafts: it counts the verify's cells")
            launch.device(target, &ptr, &have, "ids", False, True)
            ids_extent(have, a.rows, a.k)
            a.ids = <const uint32_t *>ptr
            launch.queued(mf_penalties_update(&a, s), (target, slots, state, table, items))
        else:
            walk_drafts(launch, &a, drafts)
            a.start = <uint32_t>int_of(start, "start", 0, MF_MAX_VOCAB)
            if not is_foreign(target):
                need_layout(vocab, dtype)
                logits_layout(&a, vocab, dtype, row_stride)
                device_ptr_of(target, &ptr)
                a.logits = ptr
            else:
                f = launch.foreign(target, "logits")
                tensor_rows(f, &t, None, vocab, dtype, row_stride, False, 0, 0, True, a.rows * (a.k + 1))
                a.vocab = <uint32_t>t.vocab
                a.row_stride = <uint64_t>t.stride
                a.dtype = t.dtype
                a.logits = t.ptr
                launch.lend(f, tensor_extent(&t, a.rows * (a.k + 1)))
            launch.queued(mf_penalties_apply(&a, s), (target, slots, state, table, items, drafts))
    finally:
        launch.close()
    return a.rows


@cython.final
cdef class PenaltyLaunch:
    """``penalties_apply`` and ``penalties_update`` of one batch's host slots, coerced once.

    A decode loop queues both ops every step with the same slots and tables while its batch
    keeps its rows; only the logits (or ids) and the stream change. Coercing the slots, the
    tables and the logits' layout again at each call was most of each call's host cost
    (docs/penalties.md, "Host cost"). This checks them once, as the two functions do; a call
    then resolves its buffers (a closed one still raises) and queues, and the C layer checks
    the descriptor at every call as before.

    Parameters
    ----------
    slots : sequence of int or uint32 buffer
        Each row's slot, copied here: later changes to the object do not reach the calls.
    state, table, items : DeviceBuffer or int
        As ``penalties_apply`` (tensors there go through the functions).
    slot_count, table_cap, item_cap, vocab, dtype, row_stride, start : optional
        As ``penalties_apply``; ``apply`` with a logits pointer needs ``vocab`` and ``dtype``.
    k : int, optional
        A verify's drafts a row (``penalties_apply(k=)``): ``apply`` then takes each step's
        ``drafts`` and ``update`` its cells. Default 0, a plain step.
    """
    cdef mf_penalty_args ap, up  # apply's and update's descriptors, all but the step's pointer
    cdef uint32_t *words
    cdef object slots, state, table, items, vocab, dtype, row_stride, start, k

    def __dealloc__(self):
        free(self.words)

    def __init__(self, slots, state, table, items, *, slot_count=None, table_cap=None, item_cap=None,
                 vocab=None, dtype=None, row_stride=None, start=0, k=0):
        cdef _Words words
        cdef _Launch launch = launch_on(0)
        cdef Py_ssize_t i
        for obj, what in ((state, "state"), (table, "table"), (items, "items")):
            if is_foreign(obj):
                raise TypeError(f"{what}: a PenaltyLaunch takes a DeviceBuffer or an int pointer, not a tensor")
        if device_resident(slots, "slots"):
            raise TypeError("a PenaltyLaunch takes host slots (a sequence or a uint32 buffer), not device memory")
        mf_penalty_args_init(&self.up)
        self.up.k = verify_k(k)
        try:
            penalty_tables(launch, &self.up, state, table, items, slot_count, table_cap, item_cap)
        finally:
            launch.close()
        words = host_slots(slots)
        self.ap = self.up
        self.ap.start = <uint32_t>int_of(start, "start", 0, MF_MAX_VOCAB)
        logits_layout(&self.ap, vocab, dtype, row_stride)
        free(self.words)
        self.words = <uint32_t *>malloc(words.n * 4 + 4)
        if self.words == NULL:
            raise MemoryError()
        memcpy(self.words, words.data, words.n * 4)
        self.up.rows = self.ap.rows = <uint32_t>words.n
        self.up.slots = self.ap.slots = self.words
        self.slots = [self.words[i] for i in range(words.n)]  # what a tensor's call and a graph get
        self.state, self.table, self.items = state, table, items
        self.vocab, self.dtype, self.row_stride, self.start = vocab, dtype, row_stride, start
        self.k = self.up.k

    cdef int reload(self) except -1:
        """The tables' addresses now: a closed buffer raises here, as the functions' coercion does."""
        cdef void *ptr
        device_ptr_of(self.state, &ptr)
        self.up.state = self.ap.state = <mf_penalty_slot *>ptr
        device_ptr_of(self.table, &ptr)
        self.up.table = self.ap.table = <mf_penalty_entry *>ptr
        device_ptr_of(self.items, &ptr)
        self.up.items = self.ap.items = <const mf_penalty_item *>ptr
        return 0

    def apply(self, logits, stream=0, drafts=None):
        """``penalties_apply(logits, slots, ..., k=k, drafts=drafts)`` with the arguments given
        here; returns the rows."""
        cdef uint64_t s
        cdef void *ptr
        cdef mf_penalty_args a
        cdef _Launch launch
        if is_foreign(logits) or is_foreign(drafts):  # shape, dtype and lending: the function's path
            return launch_penalties(False, logits, self.slots, self.state, self.table, self.items, stream,
                                    self.up.slot_count, self.up.table_cap, self.up.item_cap, None,
                                    self.vocab, self.dtype, self.row_stride, self.start, self.k, drafts)
        need_layout(self.vocab, self.dtype)
        stream_of(stream, &s)
        self.reload()
        device_ptr_of(logits, &ptr)
        a = self.ap
        a.logits = ptr
        if drafts is not None or a.k:
            launch = launch_on(s)
            try:
                walk_drafts(launch, &a, drafts)
            finally:
                launch.close()
        # Buffers and pointers lend and hold nothing: queued_on is all of _Launch.queued here.
        queued_on(s, mf_penalties_apply(&a, s), (logits, self.slots, self.state, self.table, self.items, drafts), 0)
        return a.rows

    def update(self, ids, stream=0):
        """``penalties_update(ids, slots, ...)`` with the arguments given here; returns the rows."""
        cdef uint64_t s
        cdef void *ptr
        cdef mf_penalty_args a
        if is_foreign(ids):
            return launch_penalties(True, ids, self.slots, self.state, self.table, self.items, stream,
                                    self.up.slot_count, self.up.table_cap, self.up.item_cap, None,
                                    None, None, None, 0, self.k)
        stream_of(stream, &s)
        self.reload()
        device_ptr_of(ids, &ptr)
        ids_extent((<DeviceBuffer>ids)._nbytes if type(ids) is DeviceBuffer else <size_t>-1, self.up.rows,
                   self.up.k)
        a = self.up
        a.ids = <const uint32_t *>ptr
        queued_on(s, mf_penalties_update(&a, s), (ids, self.slots, self.state, self.table, self.items), 0)
        return a.rows


cdef int pick_penalties(mf_argmax_args *a, object penalties) except -1:
    """A pick's ``penalties=``: the launch's apply descriptor, its tables' addresses read now (a
    closed table raises here); the C layer takes its layout from the pick's."""
    if type(penalties) is not PenaltyLaunch:
        raise TypeError("penalties must be a PenaltyLaunch (PenaltyState.prepare), not "
                        f"{type(penalties).__name__}")
    cdef PenaltyLaunch launch = <PenaltyLaunch>penalties
    if launch.up.k:
        raise ValueError("penalties= of a pick takes a PenaltyLaunch of k 0: a verify's are "
                         "PenaltyLaunch(k=).apply and update around verify_to_feed")
    launch.reload()  # the C layer checks the rest (rows included) with the pick's arguments
    a.penalties = &launch.ap
    return 0


cdef int verify_penalties(mf_verify_args *a, object penalties) except -1:
    """A verify's ``penalties=``: the launch's apply descriptor (its ``k`` the verify's), its
    tables' addresses read now; the C layer takes the layout and the drafts from the verify's."""
    if type(penalties) is not PenaltyLaunch:
        raise TypeError("penalties must be a PenaltyLaunch (PenaltyState.prepare), not "
                        f"{type(penalties).__name__}")
    cdef PenaltyLaunch launch = <PenaltyLaunch>penalties
    if launch.up.k != a.k:
        raise ValueError(f"penalties= of a verify takes a PenaltyLaunch of k = {a.k} (the verify's), "
                         f"not {launch.up.k}")
    if launch.up.rows != a.rows:
        raise ValueError(f"the penalties name {launch.up.rows} rows; the verify has {a.rows}")
    if not (a.flags & MF_VERIFY_DRAFTS_DEVICE):
        raise ValueError("penalties= needs device drafts (the apply's walk reads them when it runs)")
    launch.reload()  # the C layer checks the rest with the verify's arguments
    a.penalties = &launch.ap
    return 0


def penalties_apply(logits, slots, state, table, items, stream=0, *, slot_count=None, table_cap=None,
                    item_cap=None, vocab=None, dtype=None, row_stride=None, start=0, k=0, drafts=None):
    """Apply each row's logit bias, min_tokens and penalties to its logits, in place, in stream order.

    vLLM v1's rules and order (docs/penalties.md): ``logit_bias``, then ``min_tokens`` (the stop
    ids get ``-inf`` while fewer than ``min_tokens`` tokens were generated), then
    ``repetition_penalty`` over the prompt's and the generated ids (a positive logit divided, a
    negative one multiplied), ``frequency_penalty`` per generated occurrence and
    ``presence_penalty`` once per generated id. ``metrale_feed.penalties.PenaltyState`` owns the
    tables and calls this; the arguments are its layout.

    Parameters
    ----------
    logits : DeviceBuffer, int, or a 2-D float tensor
        ``rows`` rows of ``row_stride`` elements, changed in place; a slice of a split vocabulary
        holds the global ids ``[start, start + vocab)``.
    slots : sequence of int, uint32 buffer, or device memory
        Each row's request slot, ``NO_TOKEN`` for a row without penalties (left as it is). Host
        slots are read before the call returns (each below ``slot_count``, none twice); device
        ones when the kernel runs.
    state, table, items : DeviceBuffer, int, or a device array
        The slot records (``mf_penalty_slot``, 32 bytes each), the per-slot id tables
        (``table_cap`` (id, count) pairs) and items (``item_cap`` (id, value) pairs: biases,
        then stop ids).
    stream : Stream, int or stream-like, optional
    slot_count, table_cap, item_cap : int, optional
        Default: from the buffers' lengths.
    vocab, dtype, row_stride : optional
        Required unless ``logits`` is a tensor.
    start : int, optional
        The global id of column 0 (a rank's slice; default 0).
    k, drafts : optional
        A verify's logit rows (docs/speculative.md, "Penalties"): ``slots`` names the verify's
        rows, ``logits`` holds ``rows * (k + 1)`` rows (verify_to_feed's layout), and logit row
        ``r * (k + 1) + j`` is judged as if row ``r``'s first ``j`` drafts (``drafts``, device,
        ``rows * k`` ids, read when the kernel runs; a ``NO_TOKEN`` ends them) had been
        generated: their counts, ``generated`` and the ``min_tokens`` ban. The slots' counts stay
        as they are. Default 0 and None: a plain step.

    Returns
    -------
    int
        The rows.

    Raises
    ------
    ValueError, TypeError
        A slot out of range or named twice, a buffer too small, bad sizes; nothing is queued.
    FeedError
        A closed or unknown buffer or stream.
    """
    return launch_penalties(False, logits, slots, state, table, items, stream, slot_count, table_cap,
                            item_cap, None, vocab, dtype, row_stride, start, k, drafts)


def penalties_update(ids, slots, state, table, items, stream=0, *, slot_count=None, table_cap=None,
                     item_cap=None, k=0):
    """Count each row's id of a step into its slot's table, on the device, in stream order.

    ``ids[r]`` (device: the feed cells the step's argmax or sampler wrote, read when the kernel
    runs) is counted into row ``r``'s slot: its generated count goes up by one (a new id is
    appended to the table) and the slot's ``generated`` by one. ``NO_TOKEN`` counts nothing, as
    does a row whose slot is ``NO_TOKEN``. No host synchronisation: the next step's
    ``penalties_apply`` sees the counts by stream order.

    Parameters
    ----------
    ids : DeviceBuffer, int, or a uint32/int32 device array
        ``rows`` ids.
    slots, state, table, items, stream, slot_count, table_cap, item_cap
        As ``penalties_apply``.
    k : int, optional
        A verify's drafts a row: ``ids`` are its cells (``rows * (k + 2)`` words, ``n`` then the
        ``n`` emitted ids), each emitted id counted in order. Default 0: a word a row.

    Returns
    -------
    int
        The rows.
    """
    return launch_penalties(True, ids, slots, state, table, items, stream, slot_count, table_cap,
                            item_cap, None, None, None, None, 0, k)
