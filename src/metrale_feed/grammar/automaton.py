"""``TokenAutomaton``: a deterministic automaton over token ids, one request's structured-output
constraint, encoded for the device (docs/encodings.md, "TokenAutomaton").

The device holds two arrays whose records are feed.h's ``mf_grammar_state`` (16 bytes:
``first``, ``count``, ``fallback``, ``flags``, uint32 each) and ``mf_grammar_edge`` (8 bytes:
``token``, ``next``); ``STATE_DTYPE`` and ``EDGE_DTYPE`` spell that layout for numpy, and any
change to it is a change of feed.h first. State ``s`` allows id ``t`` when ``t`` is one of its
edges whose ``next`` is not ``DEAD``, or when ``t`` is none of its edges and its ``fallback`` is
not ``DEAD``; the next state is that edge's ``next`` or the fallback. Each state takes the
smaller of two encodings of its allowed map ``A`` (id -> next), so no state costs a bitmask of the
vocabulary:

- sparse: its edges are ``A``, its fallback ``DEAD`` (``len(A)`` edges);
- dense: its fallback is ``d``, the next state most ids of ``A`` go to (``c`` of them), and its
  edges are the ids of ``A`` going elsewhere plus every id outside ``A`` with ``next = DEAD``
  (``vocab - c`` edges: a JSON string's state that allows most of the vocabulary costs the few
  ids it excludes and those that leave it).

The host keeps the same arrays: ``allowed``, ``next`` and ``walk`` read them as the kernels do,
so they are the oracle of the device ops and what a recompute rebuilds a state word from.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from .. import _checks, _core
from ..errors import FeedError

__all__ = ["TokenAutomaton", "STATE_DTYPE", "EDGE_DTYPE", "DEAD", "FINAL"]

#: One state (feed.h's ``mf_grammar_state``, 16 bytes).
STATE_DTYPE = np.dtype([("first", "<u4"), ("count", "<u4"), ("fallback", "<u4"),
                        ("flags", "<u4")])
#: One edge (feed.h's ``mf_grammar_edge``, 8 bytes).
EDGE_DTYPE = np.dtype([("token", "<u4"), ("next", "<u4")])
#: ``MF_GRAMMAR_DEAD``: a fallback or an edge's next that allows nothing.
DEAD = 0xFFFFFFFF
#: ``MF_GRAMMAR_FINAL``: the flag of a state with no outgoing transition (the output ends).
FINAL = 1

_GRAMMAR_EXTRA = "pip install 'metrale-feed[grammar]'"


def _outlines() -> Any:
    try:
        import outlines_core
    except ImportError as error:
        raise ImportError(f"building a TokenAutomaton from a regex, a JSON schema or an "
                          f"outlines-core Index needs outlines-core: {_GRAMMAR_EXTRA}") from error
    return outlines_core


def _vocab(value: Any) -> int:
    vocab = _checks.integer(value, "vocab")
    if not 1 <= vocab <= _core.MAX_VOCAB:
        raise ValueError(f"vocab must be in [1, {_core.MAX_VOCAB}], got {vocab}")
    return vocab


def _ints(values: Iterable[Any], what: str) -> List[int]:
    """``values`` as plain ints: the common case (all ``int``) checked in one pass, anything else
    through ``_checks.integer`` (numpy integers pass; a bool, a float or a str is a TypeError)."""
    values = list(values)
    if not all(type(v) is int for v in values):
        values = [_checks.integer(v, what) for v in values]
    return values


def _encode(src: Any, tok: Any, nxt: Any, num_states: int,
            vocab: int) -> Tuple[Any, Any]:
    """The states and edges arrays of the transitions ``(src[i], tok[i]) -> nxt[i]`` (renumbered
    states, ids in range, no pair twice), each state in the smaller of its two encodings."""
    entries = len(tok)
    # By state, then by id (a state's edges in id order): one sort of a combined key, which
    # fits int64 (states below 2**32, ids below 2**24).
    order = np.argsort(src * vocab + tok)
    src, tok, nxt = src[order], tok[order], nxt[order]
    allowed = np.bincount(src, minlength=num_states).astype(np.int64)
    start = np.zeros(num_states, np.int64)  # where each state's entries begin
    np.cumsum(allowed[:-1], out=start[1:])
    # The most common next state of each state (the smallest on ties): the runs of equal
    # (state, next) pairs in sorted order, then the first longest run of each state.
    mode = np.full(num_states, DEAD, np.int64)
    mode_count = np.zeros(num_states, np.int64)
    if entries:
        pairs = np.sort(src * num_states + nxt)
        heads = np.flatnonzero(np.r_[True, pairs[1:] != pairs[:-1]])
        lengths = np.diff(np.r_[heads, entries])
        run_state, run_next = np.divmod(pairs[heads], num_states)
        groups = np.flatnonzero(np.r_[True, run_state[1:] != run_state[:-1]])
        longest = np.maximum.reduceat(lengths, groups)
        ties = np.flatnonzero(lengths == np.repeat(longest, np.diff(np.r_[groups, len(heads)])))
        best = ties[np.r_[True, run_state[ties][1:] != run_state[ties][:-1]]]
        mode[run_state[best]] = run_next[best]
        mode_count[run_state[best]] = lengths[best]
    dense = vocab - mode_count < allowed  # ties stay sparse
    count = np.where(dense, vocab - mode_count, allowed)
    total = int(count.sum())
    if total >= DEAD:
        raise ValueError(f"the automaton needs {total} edges; a device table indexes fewer "
                         f"than 2**32")
    first = np.zeros(num_states, np.int64)
    np.cumsum(count[:-1], out=first[1:])
    edges = np.empty(total, EDGE_DTYPE)
    # Sparse states: their entries as they are, already in id order.
    sparse = np.flatnonzero(~dense[src])
    at = first[src[sparse]] + (sparse - start[src[sparse]])
    edges["token"][at] = tok[sparse]
    edges["next"][at] = nxt[sparse]
    # Dense states: every id that does not go to the fallback. Each costs O(vocab) here, and a
    # state is dense only when it allows more than half the vocabulary, so this is at most twice
    # the work of reading its entries.
    full = np.empty(vocab, np.int64)
    for s in np.flatnonzero(dense):
        full.fill(DEAD)
        lo, hi = start[s], start[s] + allowed[s]
        full[tok[lo:hi]] = nxt[lo:hi]
        ids = np.flatnonzero(full != mode[s])
        edges["token"][first[s]:first[s] + len(ids)] = ids
        edges["next"][first[s]:first[s] + len(ids)] = full[ids]
    states = np.empty(num_states, STATE_DTYPE)
    states["first"] = first
    states["count"] = count
    states["fallback"] = np.where(dense, mode, DEAD)
    states["flags"] = np.where(allowed == 0, FINAL, 0)
    return states, edges


class TokenAutomaton:
    """A deterministic automaton over token ids: the structured-output constraint of a request,
    kept compact on the host and uploaded to the device once (``to_device``).

    Parameters
    ----------
    transitions : mapping of int to mapping of int to int
        Each state (any int) to its transitions: token id -> next state. Every next state must be
        a key; a state with an empty mapping has no outgoing transition (the output ends there).
        States are renumbered: ``initial`` becomes 0, the others follow in increasing order.
    initial : int
        The start state, a key of ``transitions``.
    vocab : int
        The vocabulary size (the logits' width), in ``[1, MAX_VOCAB]``; every id is in
        ``[0, vocab)``.

    Raises
    ------
    ValueError
        A next state or ``initial`` that is not a key, an id outside ``[0, vocab)``, a ``vocab``
        out of range.
    TypeError
        ``transitions`` (or a state's transitions) not a mapping; a state, id or ``vocab`` that is
        not an int.

    Notes
    -----
    The device layout is feed.h's (``STATE_DTYPE``, ``EDGE_DTYPE``): a state that allows few ids
    costs few edges, one that allows most of the vocabulary costs the ids it excludes; the
    ``states`` and ``edges`` arrays are what ``to_device`` uploads.

    Examples
    --------
    >>> from metrale_feed import TokenAutomaton
    >>> yes_no = TokenAutomaton({10: {1: 11, 2: 12}, 11: {3: 13}, 12: {3: 13}, 13: {}},
    ...                         initial=10, vocab=5)
    >>> yes_no.num_states, yes_no.initial, yes_no.allowed(yes_no.initial)
    (4, 0, [1, 2])
    >>> end = yes_no.walk([1, 3]); end, yes_no.final(end), yes_no.walk([3])
    (3, True, None)
    >>> with yes_no:  # the device copy lives until the block ends
    ...     states, edges = yes_no.to_device()
    ...     states.nbytes, edges.nbytes, yes_no.nbytes
    (64, 32, 96)
    """

    def __init__(self, transitions: Mapping[Any, Any], *, initial: int, vocab: int) -> None:
        vocab = _vocab(vocab)
        if not isinstance(transitions, Mapping):
            raise TypeError(f"transitions must be a mapping of state to {{token id: next state}}, "
                            f"not {type(transitions).__name__}")
        table: Dict[int, Mapping[Any, Any]] = {}
        for key, moves in transitions.items():
            state = _checks.integer(key, "a state of transitions")
            if not isinstance(moves, Mapping):
                raise TypeError(f"state {state}'s transitions must be a mapping of token id to "
                                f"next state, not {type(moves).__name__}")
            table[state] = moves
        initial = _checks.integer(initial, "initial")
        if initial not in table:
            raise ValueError(f"initial state {initial} is not a state of transitions")
        order = [initial] + sorted(s for s in table if s != initial)
        number = {state: i for i, state in enumerate(order)}
        srcs, toks, nexts = [], [], []
        for i, state in enumerate(order):
            moves = table[state]
            if not moves:
                continue
            ids = _ints(moves.keys(), f"a token id of state {state}")
            targets = _ints(moves.values(), f"a next state of state {state}")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"state {state} has token id {bad[0]}, outside [0, {vocab})")
            try:
                renumbered = [number[n] for n in targets]
            except KeyError as missing:
                raise ValueError(f"state {state} goes to {missing.args[0]}, which is not a state "
                                 f"of transitions") from None
            srcs.append(np.full(len(ids), i, np.int64))
            toks.append(np.array(ids, np.int64))
            nexts.append(np.array(renumbered, np.int64))
        self._setup(srcs, toks, nexts, len(order), vocab)

    def _setup(self, srcs: List[Any], toks: List[Any], nexts: List[Any], num_states: int,
               vocab: int) -> None:
        """Encode the renumbered transitions (initial state 0) and keep the host arrays."""
        def joined(parts: List[Any]) -> Any:
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)

        if num_states >= DEAD:
            raise ValueError(f"{num_states} states do not fit a uint32 state word")
        states, edges = _encode(joined(srcs), joined(toks), joined(nexts), num_states, vocab)
        self._keep(states, edges, vocab)

    def _keep(self, states: Any, edges: Any, vocab: int) -> None:
        """Keep encoded arrays (``STATE_DTYPE``, ``EDGE_DTYPE``) as this automaton's: what
        ``_setup`` encodes, or what the decode pipeline joins from several automata."""
        states.flags.writeable = False
        edges.flags.writeable = False
        self._vocab = vocab
        self._states = states
        self._edges = edges
        # Contiguous columns for the host lookups, and the state fields as Python ints.
        self._tokens = np.ascontiguousarray(edges["token"])
        self._nexts = np.ascontiguousarray(edges["next"])
        self._first: List[int] = states["first"].tolist()
        self._count: List[int] = states["count"].tolist()
        self._fallback: List[int] = states["fallback"].tolist()
        self._flags: List[int] = states["flags"].tolist()
        self._device: Optional[Tuple[Any, Any]] = None
        # The grammar ops' scratch (a bitmask, uploaded drafts), one buffer a stream handle.
        self._scratches: Dict[int, Any] = {}

    # ---- outlines-core ----

    @classmethod
    def from_outlines(cls, index: Any, vocab: int, *, eos: Optional[int] = None) -> "TokenAutomaton":
        """The automaton of an ``outlines_core.Index``, with its transitions as it has them: the
        final states' end-of-sequence transitions included.

        Parameters
        ----------
        index : outlines_core.Index
        vocab : int
            The vocabulary size (the logits' width); every id the index names must be below it.
        eos : int, optional
            The end-of-sequence id. Given, its transitions out of the index's final states lead to
            a state with no outgoing transition, so the output ends with it; None (the default)
            keeps them as the index has them (in outlines-core, to the same final state).

        Returns
        -------
        TokenAutomaton

        Raises
        ------
        ImportError
            outlines-core is not installed (``pip install 'metrale-feed[grammar]'``).
        ValueError
            The index names an id outside ``[0, vocab)``.
        TypeError
            ``index`` is not an ``outlines_core.Index``.

        Examples
        --------
        >>> import outlines_core  # doctest: +SKIP
        >>> from metrale_feed import TokenAutomaton  # doctest: +SKIP
        >>> words = outlines_core.Vocabulary(3, {"a": [0], "b": [1], "ab": [2]})  # doctest: +SKIP
        >>> index = outlines_core.Index("a+b", words)  # doctest: +SKIP
        >>> ab = TokenAutomaton.from_outlines(index, 4)  # doctest: +SKIP
        >>> ab.allowed(ab.initial), ab.allowed(ab.walk([2]))  # doctest: +SKIP
        ([0, 2], [3])
        >>> ab.walk([2, 3]) == ab.walk([2])  # without eos=: the index's loop  # doctest: +SKIP
        True
        """
        oc = _outlines()
        vocab = _vocab(vocab)
        if not isinstance(index, oc.Index):
            raise TypeError(f"index must be an outlines_core.Index, not {type(index).__name__}")
        if eos is not None:
            eos = _checks.integer(eos, "eos")
        table = index.get_transitions()
        initial = index.get_initial_state()
        finals = set(index.get_final_states())
        raw_src = np.fromiter(table, np.int64, len(table))
        counts = np.fromiter(map(len, table.values()), np.int64, len(table))
        toks = np.concatenate([np.zeros(0, np.int64)] + [
            np.fromiter(m.keys(), np.int64, len(m)) for m in table.values()])
        raw_next = np.concatenate([np.zeros(0, np.int64)] + [
            np.fromiter(m.values(), np.int64, len(m)) for m in table.values()])
        if len(toks) and not 0 <= int(toks.min()) <= int(toks.max()) < vocab:
            bad = int(toks.max()) if toks.max() >= vocab else int(toks.min())
            raise ValueError(f"the index names token id {bad}, outside [0, {vocab})")
        # Renumber: the initial state first, then the others in increasing order (a next state
        # that is not a key of the index's table, which outlines-core does not make, would be a
        # state with no transitions), then the end state when ``eos`` ends the output.
        others = np.setdiff1d(np.union1d(raw_src, raw_next), [initial])
        keys = np.r_[np.int64(initial), others]
        order = np.argsort(keys)
        sorted_keys = keys[order]
        src = np.repeat(order[np.searchsorted(sorted_keys, raw_src)], counts)
        nxt = order[np.searchsorted(sorted_keys, raw_next)]
        num_states = len(keys)
        if eos is not None and finals:
            final = np.isin(raw_src, np.fromiter(finals, np.int64, len(finals)))
            ends = np.repeat(final, counts) & (toks == eos)
            if ends.any():
                nxt = np.where(ends, num_states, nxt)
                num_states += 1
        automaton = cls.__new__(cls)
        automaton._setup([src], [toks], [nxt], num_states, vocab)
        return automaton

    @classmethod
    def _from_compiled(cls, regex: str, vocabulary: Any, vocab: Optional[int],
                       what: str) -> "TokenAutomaton":
        oc = _outlines()
        if not isinstance(vocabulary, oc.Vocabulary):
            raise TypeError(f"vocabulary must be an outlines_core.Vocabulary, not "
                            f"{type(vocabulary).__name__}")
        try:
            index = oc.Index(regex, vocabulary)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValueError(f"outlines-core cannot compile {what}: {error}") from error
        eos = vocabulary.get_eos_token_id()
        if vocab is None:
            # The vocabulary's ids when they run from 0 without a gap; pass the logits' width
            # when the model has more (padding, special tokens the vocabulary leaves out).
            top = max((max(m) for m in index.get_transitions().values() if m), default=0)
            vocab = max(len(vocabulary), top + 1, eos + 1)
        return cls.from_outlines(index, vocab, eos=eos)

    @classmethod
    def from_regex(cls, pattern: str, vocabulary: Any, *,
                   vocab: Optional[int] = None) -> "TokenAutomaton":
        """The automaton of the outputs that match ``pattern``, through outlines-core.

        The end-of-sequence id is allowed where the text so far matches, and the output ends
        with it (its state has no outgoing transition). The automaton is outlines-core's index,
        which cuts a match's continuation through text that does not match (its ``0(\\.5)?``
        allows ``0``, then only the end).

        Parameters
        ----------
        pattern : str
            A regular expression in outlines-core's syntax (anchored: the whole output).
        vocabulary : outlines_core.Vocabulary
            The tokenizer's tokens and end-of-sequence id.
        vocab : int, optional
            The vocabulary size (the logits' width). Default: ``len(vocabulary)``, or more when
            the ids skip numbers; pass the model's when it has ids the vocabulary leaves out.

        Returns
        -------
        TokenAutomaton

        Raises
        ------
        ImportError
            outlines-core is not installed (``pip install 'metrale-feed[grammar]'``).
        ValueError
            outlines-core cannot compile ``pattern`` (its message follows), or an id is outside
            ``[0, vocab)``.
        TypeError
            ``pattern`` is not a str, ``vocabulary`` not an ``outlines_core.Vocabulary``.

        Examples
        --------
        >>> import outlines_core  # doctest: +SKIP
        >>> from metrale_feed import TokenAutomaton  # doctest: +SKIP
        >>> words = outlines_core.Vocabulary(3, {"a": [0], "b": [1], "ab": [2]})  # doctest: +SKIP
        >>> ab = TokenAutomaton.from_regex("a+b", words)  # doctest: +SKIP
        >>> ab.vocab, ab.allowed(ab.walk([0])), ab.final(ab.walk([0, 2, 3]))  # doctest: +SKIP
        (4, [0, 1, 2], True)
        """
        if not isinstance(pattern, str):
            raise TypeError(f"pattern must be a str, not {type(pattern).__name__}")
        return cls._from_compiled(pattern, vocabulary, vocab, f"the regex {pattern!r}")

    @classmethod
    def from_json_schema(cls, schema: Any, vocabulary: Any, *, vocab: Optional[int] = None,
                         whitespace_pattern: Optional[str] = None) -> "TokenAutomaton":
        """The automaton of the JSON texts that ``schema`` validates, through outlines-core.

        Parameters
        ----------
        schema : str or mapping
            A JSON schema, as JSON text or as its parsed mapping.
        vocabulary : outlines_core.Vocabulary
            The tokenizer's tokens and end-of-sequence id.
        vocab : int, optional
            As ``from_regex`` takes it.
        whitespace_pattern : str, optional
            The regex of the whitespace allowed between JSON tokens (outlines-core's default:
            at most one space).

        Returns
        -------
        TokenAutomaton

        Raises
        ------
        ImportError
            outlines-core is not installed (``pip install 'metrale-feed[grammar]'``).
        ValueError
            ``schema`` is not valid JSON, or it uses a feature outlines-core cannot compile (its
            message follows).
        TypeError
            ``schema`` is neither a str nor a mapping, or holds values JSON cannot encode.

        Examples
        --------
        >>> import outlines_core  # doctest: +SKIP
        >>> from metrale_feed import TokenAutomaton  # doctest: +SKIP
        >>> chars = {c: [i] for i, c in enumerate('{}":, abcdefghijklmnopqrstuvwxyz0123456789')}
        >>> words = outlines_core.Vocabulary(len(chars), chars)  # doctest: +SKIP
        >>> schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
        ...           "required": ["ok"]}
        >>> ok = TokenAutomaton.from_json_schema(schema, words)  # doctest: +SKIP
        >>> ids = [chars[c][0] for c in '{"ok":true}']
        >>> ok.allowed(ok.walk(ids)) == [len(chars)]  # doctest: +SKIP
        True
        """
        if isinstance(schema, Mapping):
            text = json.dumps(schema)
        elif isinstance(schema, str):
            try:
                json.loads(schema)
            except ValueError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
            text = schema
        else:
            raise TypeError(f"schema must be a str or a mapping, not {type(schema).__name__}")
        if whitespace_pattern is not None and not isinstance(whitespace_pattern, str):
            raise TypeError(f"whitespace_pattern must be a str, not "
                            f"{type(whitespace_pattern).__name__}")
        oc = _outlines()
        try:
            regex = oc.json_schema.build_regex_from_schema(text, whitespace_pattern)
        except (ValueError, TypeError, RuntimeError) as error:
            raise ValueError(f"outlines-core cannot compile the JSON schema: {error}") from error
        return cls._from_compiled(regex, vocabulary, vocab, "the JSON schema's regex")

    # ---- the automaton ----

    @property
    def num_states(self) -> int:
        """The states (``initial`` is 0; state words are in ``[0, num_states)``)."""
        return len(self._first)

    @property
    def vocab(self) -> int:
        """The vocabulary size: every id is in ``[0, vocab)``."""
        return self._vocab

    @property
    def initial(self) -> int:
        """The start state's number (always 0): what a request's state word starts as."""
        return 0

    @property
    def states(self) -> Any:
        """The states array (``STATE_DTYPE``, read-only): what the device holds."""
        return self._states

    @property
    def edges(self) -> Any:
        """The edges array (``EDGE_DTYPE``, read-only): what the device holds (at least one
        record is allocated there)."""
        return self._edges

    @property
    def nbytes(self) -> int:
        """The device bytes of the two arrays (an automaton with no edge still allocates one)."""
        return int(self._states.nbytes) + max(len(self._edges), 1) * EDGE_DTYPE.itemsize

    def _state(self, value: Any) -> int:
        state = _checks.integer(value, "state")
        if not 0 <= state < len(self._first):
            raise ValueError(f"state {state} is outside [0, {len(self._first)})")
        return state

    def _step(self, state: int, token: Any) -> Optional[int]:
        token = _checks.integer(token, "token")
        if not 0 <= token < self._vocab:
            return None  # as on the device: an id outside the vocabulary is never allowed
        lo = self._first[state]
        hi = lo + self._count[state]
        at = lo + int(np.searchsorted(self._tokens[lo:hi], token)) if hi > lo else lo
        if at < hi and int(self._tokens[at]) == token:
            nxt = int(self._nexts[at])
        else:
            nxt = self._fallback[state]
        return None if nxt == DEAD else nxt

    def next(self, state: int, token: int) -> Optional[int]:
        """The state after ``token`` in ``state``, or None when ``state`` does not allow it (an id
        outside ``[0, vocab)`` is never allowed).

        Raises
        ------
        ValueError
            ``state`` is outside ``[0, num_states)``.
        TypeError
            ``state`` or ``token`` is not an int.
        """
        return self._step(self._state(state), token)

    def walk(self, tokens: Iterable[int], *, start: Optional[int] = None) -> Optional[int]:
        """The state after ``tokens`` from ``start`` (default: ``initial``), or None when one of
        them is not allowed where the ones before it lead.

        Raises
        ------
        ValueError
            ``start`` is outside ``[0, num_states)``.
        TypeError
            ``start`` or an id is not an int.
        """
        state: Optional[int] = 0 if start is None else self._state(start)
        for token in tokens:
            state = self._step(state, token)  # type: ignore[arg-type]
            if state is None:
                return None
        return state

    def _mask(self, state: int) -> Any:
        lo = self._first[state]
        hi = lo + self._count[state]
        tokens, nexts = self._tokens[lo:hi], self._nexts[lo:hi]
        if self._fallback[state] == DEAD:
            mask = np.zeros(self._vocab, bool)
            mask[tokens[nexts != DEAD]] = True
        else:
            mask = np.ones(self._vocab, bool)
            mask[tokens[nexts == DEAD]] = False
        return mask

    def allowed(self, state: int) -> List[int]:
        """The ids ``state`` allows, in increasing order.

        Raises
        ------
        ValueError
            ``state`` is outside ``[0, num_states)``.
        """
        state = self._state(state)
        if self._fallback[state] == DEAD:  # sparse: its edges, in id order
            lo = self._first[state]
            hi = lo + self._count[state]
            live: List[int] = self._tokens[lo:hi][self._nexts[lo:hi] != DEAD].tolist()
            return live
        ids: List[int] = np.flatnonzero(self._mask(state)).tolist()
        return ids

    def bitmask(self, state: int) -> Any:
        """The ids ``state`` allows as ``ceil(vocab / 32)`` uint32 words (bit ``v % 32`` of word
        ``v // 32``; bits at or above ``vocab`` clear), the bitmask layout of ``sample_to_feed``.

        Raises
        ------
        ValueError
            ``state`` is outside ``[0, num_states)``.
        """
        mask = self._mask(self._state(state))
        words = (self._vocab + 31) // 32
        padded = np.zeros(words * 32, bool)
        padded[: self._vocab] = mask
        return np.packbits(padded, bitorder="little").view("<u4")

    def final(self, state: int) -> bool:
        """Whether ``state`` has no outgoing transition (the output ends there; its flags hold
        ``FINAL``). Not outlines-core's final states, which may still go on.

        Raises
        ------
        ValueError
            ``state`` is outside ``[0, num_states)``.
        """
        return bool(self._states["flags"][self._state(state)] & FINAL)

    # ---- the device copy ----

    def to_device(self, stream: Any = 0) -> Tuple[Any, Any]:
        """The device copy of the states and edges arrays: uploaded by async copies on ``stream``
        at the first call (later calls return the same two buffers, until ``close``).

        The first call returns once the copies have completed (it waits for ``stream``), so work
        on any stream may read the buffers: an automaton is shared by requests on every stream,
        and an upload is made once per grammar, never per step. Upload outside a graph capture.

        Parameters
        ----------
        stream : stream-like, optional
            Where the copies run (default: the null stream).

        Returns
        -------
        tuple of DeviceBuffer
            ``(states, edges)``; ``device_arrays`` returns them too.

        Raises
        ------
        FeedMemoryError
            The device cannot hold them (nothing is kept).

        Examples
        --------
        >>> import numpy as np, metrale_feed as mf
        >>> from metrale_feed import TokenAutomaton
        >>> digits = TokenAutomaton({0: {t: 0 for t in range(10)}}, initial=0, vocab=12)
        >>> states, edges = digits.to_device()
        >>> back = np.zeros(1, digits.states.dtype); mf.copy_d2h_async(states, back)
        >>> mf.stream_synchronize(); back.tolist()  # dense: ids 10 and 11 are not allowed
        [(0, 2, 0, 0)]
        >>> digits.close()
        """
        if self._device is not None:
            return self._device
        edges: Any = self._edges if len(self._edges) else np.array([(DEAD, DEAD)], EDGE_DTYPE)
        states_buffer = _core.DeviceBuffer(self._states.nbytes)
        try:
            edges_buffer = _core.DeviceBuffer(edges.nbytes)
            try:
                _core.copy_h2d_async(states_buffer, self._states, stream)
                _core.copy_h2d_async(edges_buffer, edges, stream)
                # Ops on other streams read these buffers with no event to order them after
                # the copies: the one wait of an automaton's life.
                _core.stream_synchronize(stream)
            except BaseException:
                edges_buffer.close()
                raise
        except BaseException:
            states_buffer.close()
            raise
        self._device = (states_buffer, edges_buffer)
        return self._device

    @property
    def device_arrays(self) -> Tuple[Any, Any]:
        """The ``(states, edges)`` device buffers ``to_device`` uploaded.

        Raises
        ------
        FeedError
            The automaton is not on the device (never uploaded, or closed since).
        """
        if self._device is None:
            raise FeedError("the automaton is not on the device: call to_device(stream) first")
        return self._device

    @property
    def on_device(self) -> bool:
        """Whether ``to_device`` uploaded it and ``close`` has not freed it."""
        return self._device is not None

    def _device_view(self) -> Tuple[Any, Any, int, int, int]:
        """What the ops given ``grammar=(self, states)`` read (the extension's protocol for an
        automaton, which it takes by these two methods, not by type): ``(states, edges,
        num_states, num_edges, vocab)``, the device arrays ``to_device`` uploaded and their
        record counts (``edges`` holds one unused record when there are none).

        Raises
        ------
        ValueError
            The automaton is not on the device.
        """
        if self._device is None:
            raise ValueError("the automaton is not on the device: call automaton.to_device(stream) first")
        states, edges = self._device
        return states, edges, self.num_states, len(self._edges), self._vocab

    def _scratch(self, stream: int, nbytes: int) -> Any:
        """The device scratch of the ops given ``grammar=(self, states)`` on the stream whose
        handle is ``stream``: the bitmask they build before the pick (and the drafts a verify
        uploads), at least ``nbytes``, reused by every such call on that stream (stream order
        keeps one call's pick ahead of the next call's mask; no two streams share one).

        Grown geometrically: growth frees the old buffer, which is deferred past the work
        queued on it on the host backend, and is ``cudaFree`` on cuda (it waits for the device):
        a caller that must never wait passes its own scratch (``grammar=(automaton, states,
        scratch)``, docs/kernels.md, "Grammar in a pick")."""
        held = self._scratches.get(stream)
        if held is not None and held.nbytes >= nbytes:
            return held
        fresh = _core.DeviceBuffer(max(nbytes, 2 * held.nbytes if held is not None else 0))
        self._scratches[stream] = fresh
        if held is not None:
            held.close()
        return fresh

    def close(self) -> None:
        """Free the device copy and the ops' scratch (deferred past the work queued on them,
        docs/lifetimes.md, "Frees"); the host side stays usable, and ``to_device`` uploads it
        again."""
        device, self._device = self._device, None
        scratches, self._scratches = list(self._scratches.values()), {}
        for buffer in (device or ()) + tuple(scratches):
            buffer.close()

    def __enter__(self) -> "TokenAutomaton":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"TokenAutomaton(num_states={self.num_states}, edges={len(self._edges)}, "
                f"vocab={self._vocab}, nbytes={self.nbytes}"
                f"{', on the device' if self._device is not None else ''})")
