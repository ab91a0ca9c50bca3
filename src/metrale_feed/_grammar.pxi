# The device grammar's two operations (feed.h, "grammar"; docs/kernels.md, "Grammar"), private:
# the automaton's owner (TokenAutomaton) lays its arrays out with the sizes below; a split pick
# (tp/shard.py) calls these around its calls, an unsplit one hands the C call its grammar (below).
# The C layer checks every argument before anything is queued; this binding only coerces the
# buffers and checks the length of a foreign tensor, which the C layer cannot see.

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
# The pick's own C call queues the mask (each row's bitmask rows from its state word, ANDed with the
# caller's bitmask), the pick with that bitmask, and the advance of the state words by the ids the
# pick wrote, all ahead of its copies and event record, after checking all of it together (feed.h's
# mf_grammar_pick; docs/kernels.md, "Grammar in a pick"). This binding fills the descriptor.


@cython.final
cdef class _GrammarCall:
    """One pick's grammar descriptor, and the arrays a capture keeps for it (the automaton's, and
    a scratch made for the capture)."""
    cdef mf_grammar_pick desc
    cdef object names


cdef _GrammarCall grammar_of(_Launch launch, object grammar, uint64_t s, uint32_t rows, uint32_t k,
                             bint host_drafts):
    """``grammar=(automaton, states[, scratch])`` of a pick of ``rows`` rows with ``k`` drafts (0:
    argmax or sample) as the C layer's descriptor. The automaton is taken by what it offers, not by
    its type (the extension knows nothing of the layer that builds it): ``_device_view()`` gives
    ``(states, edges, num_states, num_edges, vocab)``, its device arrays and their counts (the
    arrays as ``_grammar_mask`` takes them), and ``_scratch(stream, nbytes)`` the scratch kept for a
    stream. Coerces and sizes; the C layer checks the vocabulary, every extent and every overlap
    with the rest of the pick. ``host_drafts``: a verify's drafts are uploaded into the scratch
    after the mask. Queues nothing."""
    cdef _GrammarCall g = _GrammarCall.__new__(_GrammarCall)
    cdef void *ptr
    if not isinstance(grammar, tuple) or len(grammar) not in (2, 3):
        raise TypeError("grammar must be a tuple (automaton, states) or (automaton, states, scratch), "
                        f"not {type(grammar).__name__}")
    automaton, states = grammar[0], grammar[1]
    scratch = grammar[2] if len(grammar) == 3 else None
    view = getattr(automaton, "_device_view", None)
    if view is None or not hasattr(automaton, "_scratch"):
        raise TypeError(f"grammar's automaton must be a metrale_feed.TokenAutomaton (an object with "
                        f"_device_view() and _scratch()), not {type(automaton).__name__}")
    view = view()
    if not isinstance(view, tuple) or len(view) != 5:
        raise TypeError("grammar's automaton: _device_view() must return (states, edges, num_states, "
                        "num_edges, vocab)")
    table, edges, num_states, num_edges, vocab = view
    mf_grammar_pick_init(&g.desc)
    g.desc.num_states = <uint32_t>int_of(num_states, "the automaton's num_states", 0, 0xFFFFFFFF)
    g.desc.num_edges = <uint32_t>int_of(num_edges, "the automaton's num_edges", 0, 0xFFFFFFFF)
    g.desc.vocab = <uint32_t>int_of(vocab, "the automaton's vocab", 1, MF_MAX_VOCAB)
    g.desc.states = <const mf_grammar_state *>grammar_buffer(
        launch, table, num_states * GRAMMAR_STATE_BYTES, "the automaton's states", False, False)
    if edges is not None:
        g.desc.edges = <const mf_grammar_edge *>grammar_buffer(
            launch, edges, num_edges * GRAMMAR_EDGE_BYTES, "the automaton's edges", False, False)
    if not device_resident(states, "grammar states"):
        raise TypeError(f"grammar states must be device memory (a DeviceBuffer, a device pointer or a "
                        f"tensor) of uint32 words, not {type(states).__name__}")
    g.desc.state_words = <uint32_t *>grammar_buffer(launch, states, rows * 4, "grammar state words", True, True)
    need = rows * (k + 1) * ((g.desc.vocab + 31) // 32) * 4 + (rows * k * 4 if host_drafts else 0)
    if scratch is None:
        # In a capture the graph owns a scratch of its own (a replay must not share the stream's
        # with the eager calls, nor lose it when that one grows).
        scratch = DeviceBuffer(need) if capturing_graph(s) is not None else automaton._scratch(s, need)
    elif type(scratch) is not DeviceBuffer:
        raise TypeError(f"grammar's scratch must be a DeviceBuffer, not {type(scratch).__name__}")
    device_ptr_of(scratch, &ptr)
    g.desc.scratch = <uint32_t *>ptr
    g.names = (table, edges, scratch)
    return g
