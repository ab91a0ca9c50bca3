# The device grammar's two operations (feed.h, "grammar"; docs/kernels.md, "Grammar"), private:
# the automaton's owner (TokenAutomaton) lays its arrays out with the sizes below and calls these
# around a pick. The C layer checks every argument before anything is queued; this binding only
# coerces the buffers and checks the length of a foreign tensor, which the C layer cannot see.

GRAMMAR_STATE_BYTES = sizeof(mf_grammar_state)  # one state record: first, count, fallback, flags
GRAMMAR_EDGE_BYTES = sizeof(mf_grammar_edge)    # one edge record: token, next
GRAMMAR_DEAD = MF_GRAMMAR_DEAD                  # a next state: the id is not allowed
GRAMMAR_FINAL = MF_GRAMMAR_FINAL                # a state's flag: no outgoing transition


cdef void *grammar_buffer(_Launch launch, object obj, object need, str what, bint writable, bint words) except? NULL:
    """``obj``'s device pointer; a foreign tensor must hold ``need`` bytes (the C layer checks
    this package's allocations itself)."""
    cdef void *ptr
    cdef size_t have
    launch.device(obj, &ptr, &have, what, writable, words)
    if is_foreign(obj) and need > have:
        raise ValueError(f"{what}: {need} bytes run past the end of the tensor's {have}")
    return ptr


def _grammar_mask(states, edges, state_words, bitmask_out, stream=0, *, num_states, num_edges, vocab, rows,
                  k=0, drafts=None, bitmask_in=None):
    """Queue the bitmask rows of each row's grammar states (feed.h's mf_grammar_mask).

    Row ``r`` with ``k`` drafts gets ``k + 1`` bitmask rows of ``ceil(vocab / 32)`` words in
    ``bitmask_out``: row ``r * (k + 1) + j`` holds the ids allowed by the state that
    ``state_words[r]`` reaches through the row's first ``j`` drafts (the walk stops at a draft its
    state does not allow). A state word ``NO_TOKEN`` allows every id, one at or past
    ``num_states`` none. With ``bitmask_in`` the output is ANDed with it. Everything is device
    memory read when the kernel runs.

    Parameters
    ----------
    states, edges : DeviceBuffer, int, or a device tensor
        ``num_states`` records of GRAMMAR_STATE_BYTES, ``num_edges`` of GRAMMAR_EDGE_BYTES
        (``edges`` None when there are none).
    state_words : DeviceBuffer, int, or a uint32 device tensor
        ``rows`` words.
    bitmask_out : DeviceBuffer, int, or a uint32 device tensor
        ``rows * (k + 1) * ceil(vocab / 32)`` words, written; it may not overlap an input.
    stream : Stream, int or stream-like, optional
    num_states, num_edges, vocab, rows, k : int
    drafts : ``rows * k`` uint32 device words, given exactly when ``k > 0``
    bitmask_in : device words shaped as ``bitmask_out``, or None

    Raises
    ------
    ValueError
        A count out of range, a buffer too small, null or misaligned, or ``bitmask_out`` over an
        input; nothing is queued.

    Examples
    --------
    >>> _core._grammar_mask(states, edges, words, mask, stream, num_states=3, num_edges=4,
    ...                     vocab=100, rows=2)   # doctest: +SKIP
    """
    cdef uint64_t s
    cdef mf_grammar_mask_args a
    mf_grammar_mask_args_init(&a)
    stream_of(stream, &s)
    # Python ints: the byte counts below must not wrap (the C layer refuses the values it cannot take).
    num_states, num_edges, vocab, rows, k = [int_of(v, name, 0, 0xFFFFFFFF) for v, name in (
        (num_states, "num_states"), (num_edges, "num_edges"), (vocab, "vocab"), (rows, "rows"), (k, "k"))]
    a.num_states, a.num_edges, a.vocab, a.rows, a.k = num_states, num_edges, vocab, rows, k
    mask_bytes = rows * (k + 1) * ((vocab + 31) // 32) * 4
    cdef _Launch launch = launch_on(s)
    try:
        a.states = <const mf_grammar_state *>grammar_buffer(
            launch, states, num_states * GRAMMAR_STATE_BYTES, "states", False, False)
        if edges is not None:
            a.edges = <const mf_grammar_edge *>grammar_buffer(
                launch, edges, num_edges * GRAMMAR_EDGE_BYTES, "edges", False, False)
        a.state_words = <const uint32_t *>grammar_buffer(launch, state_words, rows * 4, "state_words", False, True)
        if drafts is not None:
            a.drafts = <const uint32_t *>grammar_buffer(launch, drafts, rows * k * 4, "drafts", False, True)
        if bitmask_in is not None:
            a.bitmask_in = <const uint32_t *>grammar_buffer(launch, bitmask_in, mask_bytes, "bitmask_in", False, True)
        a.bitmask_out = <uint32_t *>grammar_buffer(launch, bitmask_out, mask_bytes, "bitmask_out", True, True)
        launch.queued(mf_grammar_mask(&a, s), (states, edges, state_words, bitmask_out, drafts, bitmask_in))
    finally:
        launch.close()


def _grammar_advance(states, edges, cells, state_words, stream=0, *, num_states, num_edges, vocab, rows, k=0):
    """Queue each row's grammar state advanced by the ids a pick wrote (feed.h's mf_grammar_advance).

    ``k = 0``: ``cells[r]`` is row ``r``'s id (argmax_to_feed, sample_to_feed); ``k > 0``: the
    cells of a verify_to_feed with ``k`` drafts, ``n`` then the ``n`` emitted ids. Each id steps
    ``state_words[r]`` on its own: an id its state does not allow (``NO_TOKEN`` included) leaves
    it, and so does a state word ``NO_TOKEN`` or at or past ``num_states``. Device memory, read
    and written when the kernel runs.

    Parameters
    ----------
    states, edges : as ``_grammar_mask``'s
    cells : DeviceBuffer, int, or a uint32 device tensor
        ``rows`` words (``k = 0``) or ``rows * (k + 2)``.
    state_words : DeviceBuffer, int, or a uint32 device tensor
        ``rows`` words, read and written; it may not overlap the other arrays.
    stream : Stream, int or stream-like, optional
    num_states, num_edges, vocab, rows, k : int

    Raises
    ------
    ValueError
        A count out of range, a buffer too small, null or misaligned, or ``state_words`` over
        another array; nothing is queued.

    Examples
    --------
    >>> _core._grammar_advance(states, edges, cells, words, stream, num_states=3, num_edges=4,
    ...                        vocab=100, rows=2)   # doctest: +SKIP
    """
    cdef uint64_t s
    cdef mf_grammar_advance_args a
    mf_grammar_advance_args_init(&a)
    stream_of(stream, &s)
    # Python ints: the byte counts below must not wrap (the C layer refuses the values it cannot take).
    num_states, num_edges, vocab, rows, k = [int_of(v, name, 0, 0xFFFFFFFF) for v, name in (
        (num_states, "num_states"), (num_edges, "num_edges"), (vocab, "vocab"), (rows, "rows"), (k, "k"))]
    a.num_states, a.num_edges, a.vocab, a.rows, a.k = num_states, num_edges, vocab, rows, k
    cell_words = rows * (k + 2 if k else 1)
    cdef _Launch launch = launch_on(s)
    try:
        a.states = <const mf_grammar_state *>grammar_buffer(
            launch, states, num_states * GRAMMAR_STATE_BYTES, "states", False, False)
        if edges is not None:
            a.edges = <const mf_grammar_edge *>grammar_buffer(
                launch, edges, num_edges * GRAMMAR_EDGE_BYTES, "edges", False, False)
        a.cells = <const uint32_t *>grammar_buffer(launch, cells, cell_words * 4, "cells", False, True)
        a.state_words = <uint32_t *>grammar_buffer(launch, state_words, rows * 4, "state_words", True, True)
        launch.queued(mf_grammar_advance(&a, s), (states, edges, cells, state_words))
    finally:
        launch.close()


# ---- grammar= of argmax_to_feed, sample_to_feed and verify_to_feed ----
# One call queues the mask (each row's bitmask rows from its state word, ANDed with the caller's
# bitmask), the pick with that bitmask, then the advance of the state words by the ids the pick
# wrote, in stream order (docs/kernels.md, "Grammar in a pick").



@cython.final
cdef class _GrammarCall:
    """One pick's grammar, checked before anything is queued: the mask and advance descriptors,
    the scratch the bitmask goes to, the host drafts to upload first (a verify), and what a
    capture keeps."""
    cdef mf_grammar_mask_args mask
    cdef mf_grammar_advance_args adv
    cdef object names          # the automaton's arrays, the state words, the scratch
    cdef object scratch
    cdef uint32_t *bitmask     # in the scratch: the pick's bitmask
    cdef object upload         # host drafts (bytes) copied to upload_at first, or None
    cdef size_t upload_at

    cdef int queue_mask(self, uint64_t s) except -1:
        """The drafts' upload and the mask: raises with nothing of the pick queued."""
        if self.upload is not None:
            copy_h2d_async(self.upload_at, self.upload, s)
        queued_on(s, mf_grammar_mask(&self.mask, s), self.names, 0)
        return 0


cdef int refuse_overlap(size_t ptr, size_t nbytes, list spans) except -1:
    """The state words must not overlap what the pick reads or writes: the advance rewrites
    them after the pick, and a pick writing over them would leave states no automaton reached."""
    cdef size_t p, n
    for p, n, what in spans:
        if p and n and ptr < p + n and p < ptr + nbytes:
            raise ValueError(f"grammar states overlap {what}")
    return 0


cdef _GrammarCall grammar_of(_Launch launch, object grammar, uint64_t s, uint32_t rows, uint32_t k,
                             uint32_t vocab, const uint32_t *bitmask_in, const uint32_t *drafts,
                             object host_drafts, list spans):
    """``grammar=(automaton, states[, scratch])`` of a pick of ``rows`` rows with ``k`` drafts
    (0: argmax or sample) over ``vocab`` ids, checked: the automaton on the device and for this
    vocabulary, ``states`` device words of at least ``rows``, overlapping none of ``spans``
    ((pointer, bytes, name) of what the pick touches), the scratch big enough. Queues nothing."""
    global _automaton_type
    cdef _GrammarCall g = _GrammarCall.__new__(_GrammarCall)
    cdef void *ptr
    cdef size_t have
    cdef size_t left = 0
    if _automaton_type is None:
        from metrale_feed.grammar.automaton import TokenAutomaton
        _automaton_type = TokenAutomaton
    if not isinstance(grammar, tuple) or len(grammar) not in (2, 3):
        raise TypeError("grammar must be a tuple (automaton, states) or (automaton, states, scratch), "
                        f"not {type(grammar).__name__}")
    automaton, states = grammar[0], grammar[1]
    scratch = grammar[2] if len(grammar) == 3 else None
    if not isinstance(automaton, _automaton_type):
        raise TypeError(f"grammar's automaton must be a metrale_feed.TokenAutomaton, not "
                        f"{type(automaton).__name__}")
    if automaton.vocab != vocab:
        raise ValueError(f"the automaton is for a vocabulary of {automaton.vocab} ids; this call's "
                         f"is {vocab}")
    if not automaton.on_device:
        raise ValueError("the automaton is not on the device: call automaton.to_device(stream) first")
    table, edges = automaton.device_arrays
    if not device_resident(states, "grammar states"):
        raise TypeError(f"grammar states must be device memory (a DeviceBuffer, a device pointer or a "
                        f"tensor) of uint32 words, not {type(states).__name__}")
    launch.device(states, &ptr, &have, "grammar states", True, True)
    cdef uint32_t *words = <uint32_t *>ptr
    if have == <size_t>-1 and mf_mem_lookup(ptr, &left) == MF_MEM_DEVICE:
        have = left
    if have != <size_t>-1 and have < <size_t>rows * 4:
        raise ValueError(f"grammar states hold {have} bytes; {rows} rows need {rows * 4}")
    refuse_overlap(<size_t>words, <size_t>rows * 4, spans)
    cdef size_t mask_bytes = <size_t>rows * (k + 1) * ((vocab + 31) // 32) * 4
    cdef size_t need = mask_bytes + (len(host_drafts) if host_drafts is not None else 0)
    graph = capturing_graph(s)
    if host_drafts is not None and graph is not None:
        raise ValueError("grammar= with host drafts in a capture: pass device drafts (a replay reads "
                         "them where they are)")
    if scratch is None:
        # In a capture the graph owns a scratch of its own (a replay must not share the stream's
        # with the eager calls, nor lose it when that one grows).
        scratch = DeviceBuffer(need) if graph is not None else automaton._scratch(s, need)
    elif type(scratch) is not DeviceBuffer:
        raise TypeError(f"grammar's scratch must be a DeviceBuffer, not {type(scratch).__name__}")
    elif (<DeviceBuffer>scratch)._nbytes < need:
        raise ValueError(f"grammar's scratch holds {(<DeviceBuffer>scratch)._nbytes} bytes; this call "
                         f"needs {need}")
    device_ptr_of(scratch, &ptr)
    if <size_t>ptr < <size_t>words + rows * 4 and <size_t>words < <size_t>ptr + need:
        raise ValueError("grammar's scratch overlaps the grammar states")
    for p, n, what in spans:
        if p and n and <size_t>ptr < <size_t>p + <size_t>n and <size_t>p < <size_t>ptr + need:
            raise ValueError(f"grammar's scratch overlaps {what}")
    g.scratch = scratch
    g.bitmask = <uint32_t *>ptr
    if host_drafts is not None:
        g.upload = host_drafts
        g.upload_at = <size_t>ptr + mask_bytes
        drafts = <const uint32_t *>(<size_t>ptr + mask_bytes)
    cdef mf_grammar_state *st_ptr = <mf_grammar_state *>grammar_buffer(launch, table, 0, "states", False, False)
    cdef mf_grammar_edge *ed_ptr = <mf_grammar_edge *>grammar_buffer(launch, edges, 0, "edges", False, False)
    mf_grammar_mask_args_init(&g.mask)
    g.mask.states, g.mask.edges = st_ptr, ed_ptr
    g.mask.num_states, g.mask.num_edges = automaton.num_states, len(automaton.edges)
    g.mask.vocab, g.mask.rows, g.mask.k = vocab, rows, k
    g.mask.state_words = words
    g.mask.drafts = drafts if k else NULL
    g.mask.bitmask_in = bitmask_in
    g.mask.bitmask_out = g.bitmask
    mf_grammar_advance_args_init(&g.adv)
    g.adv.states, g.adv.edges = st_ptr, ed_ptr
    g.adv.num_states, g.adv.num_edges = g.mask.num_states, g.mask.num_edges
    g.adv.vocab, g.adv.rows, g.adv.k = vocab, rows, k
    g.adv.state_words = words
    g.names = (table, edges, states, scratch)
    return g


cdef int grammar_advance(_GrammarCall g, uint64_t s, const uint32_t *cells, mf_status picked,
                         _Launch launch) except -1:
    """The advance, once the pick returned ``picked``. A pick the C layer refused after the
    mask was queued queues no advance; the foreign arrays the mask reads are kept past it then
    (the launch keeps nothing of a refused call). The advance is refused only if the pick's
    checks missed something (its cells were checked there): the pick ran without it."""
    if picked != MF_SUCCESS:
        if launch.kept and capturing_graph(s) is None:
            keep_until_passed(launch.kept, s)
            launch.kept = None
        return 0
    g.adv.cells = cells
    status = mf_grammar_advance(&g.adv, s)
    if status != MF_SUCCESS:
        try:
            queued_on(s, status, None, 0)
        except FeedError as exc:
            from metrale_feed.errors import DeviceError
            raise DeviceError(f"the pick was queued but its grammar advance was refused: {exc}") from exc
    queued_on(s, status, g.names, 0)
    return 0
