"""Structured outputs in the decode pipeline (docs/pipeline.md, "Structured outputs").

A request submitted with ``grammar=<TokenAutomaton>`` picks only what its automaton allows from
the state its tokens so far reach. The pick ops take one automaton a call, so the pipeline joins
the automata of its running requests into one (``PipelineGrammar._join``: each one's states at
an offset of its own, its edges' next states and fallbacks moved by it) and keeps one uint32 state word a row
on the device: that offset plus the request's state, or ``NO_TOKEN`` for a row without a
grammar. The ops mask each row by its word, pick, and advance the words in the same call, so the
host never waits for a state. The host walks the same automaton over each committed token (it
reads them anyway at the step's one wait) to finish a request at a state with no outgoing
transition, and to rebuild a row's word from its committed tokens when it joins the batch
(admission, or a resume after a preemption).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from .. import _core
from ..feed import _HOST_BIT, FeedSource
from ..grammar.automaton import DEAD, EDGE_DTYPE, FINAL, STATE_DTYPE, TokenAutomaton
from .lifecycle import close_each

if TYPE_CHECKING:
    from .host import StepHost
    from .request import Request

__all__ = ["PipelineGrammar", "walk"]


class PipelineGrammar:
    """The device side of a pipeline's grammars: the joined automaton, two buffers of state
    words (``max_rows`` words, then one ``NO_TOKEN`` word that unconstrained rows are gathered
    from), and the ops' scratch, sized for ``max_rows * (k + 1)`` bitmask rows, so no call grows
    one (which on cuda would wait for the device).

    ``call(rows)`` gives a launch's ``grammar=`` tuple: while the rows are the last launch's, the
    same words (the ops advance them in place); when they change, the words are gathered into the
    other buffer with ``resolve_feed`` in stream order (a row that stays takes its word from its
    row of the last launch, a row that joins its offset plus its host state), so a step still in
    flight has advanced them before they are read.
    """

    def __init__(self, host: "StepHost", k: int) -> None:
        self.stream = host.stream
        self.vocab = host.vocab
        self.free_word = host.max_rows  # the NO_TOKEN word of each buffer
        self.words: List[Any] = []
        self.scratch: Any = None
        try:
            for _ in range(2):
                buf = _core.DeviceBuffer((host.max_rows + 1) * 4)
                self.words.append(buf)
                buf.memset_async(0xFF, self.stream)  # NO_TOKEN in every word
            self.scratch = _core.DeviceBuffer(
                host.max_rows * (k + 1) * ((host.vocab + 31) // 32) * 4)
        except BaseException:
            self.close()
            raise
        self.current = 0  # the buffer the last launch's words are in
        self.joined: Optional[TokenAutomaton] = None  # on the device while rows use it
        self.offsets: Dict[TokenAutomaton, int] = {}  # each automaton joined, at its offset
        self.last: Optional[List["Request"]] = None  # the last launch's rows
        self.index: Dict["Request", int] = {}  # and their row, when its words were gathered
        self.grammar: Optional[Tuple[Any, Any, Any]] = None  # the last launch's tuple

    def call(self, rows: List["Request"]) -> Optional[Tuple[Any, Any, Any]]:
        """The ``grammar=`` of a launch of ``rows`` (None when no row has a grammar), its words
        gathered in stream order when the rows changed. Never waits."""
        if rows == self.last:  # identity compare: the same requests in the same rows
            return self.grammar
        # The rows' automata in the order they first appear (dict keys: identity, ordered).
        automata = dict.fromkeys(r._grammar for r in rows if r._grammar is not None)
        if not automata:
            self.release()
            self.last = rows
            return None
        if not self.offsets.keys() >= automata.keys():
            self._join(list(automata))
        index, free, offsets = self.index, FeedSource.feed(self.free_word), self.offsets
        sources = []
        for r in rows:
            automaton = r._grammar
            if automaton is None:
                sources.append(free)
                continue
            at = index.get(r, -1)
            sources.append(FeedSource.feed(at) if at >= 0
                           else FeedSource.host(offsets[automaton] + r._gstate))
        old, new = self.words[self.current], self.words[1 - self.current]
        _core.resolve_feed(sources, old, new, self.stream, prev_rows=self.free_word + 1)
        self.current = 1 - self.current
        self.last = rows
        self.index = {r: i for i, r in enumerate(rows)}
        self.grammar = (self.joined, new, self.scratch)
        return self.grammar

    def _join(self, automata: List[TokenAutomaton]) -> None:
        """Join the automata of the rows of a launch: the ones joined before keep their offsets
        (rows that stay keep their words on the device), the new ones take the first gap of
        states that holds them (the states of automata no row uses any more are gaps), else the
        end. The joined automaton is uploaded in stream order; the one before is freed in stream
        order after the steps queued with it (a host function: never a wait of this thread)."""
        live = set(automata)
        kept = {a: off for a, off in self.offsets.items() if a in live}
        spans = sorted((off, off + a.num_states) for a, off in kept.items())
        for automaton in [a for a in automata if a not in kept]:
            need, at = automaton.num_states, 0
            for lo, hi in spans:
                if lo - at >= need:
                    break
                at = max(at, hi)
            kept[automaton] = at
            spans.append((at, at + need))
            spans.sort()
        end = max(hi for _, hi in spans)
        if end >= _HOST_BIT:
            raise ValueError(f"the running requests' automata need {end} states together; a "
                             f"state word holds fewer than 2**31")
        states = np.zeros(end, STATE_DTYPE)  # gaps: states no word names, allowing nothing
        states["fallback"] = DEAD
        states["flags"] = FINAL
        parts = []
        first = 0
        for automaton, off in sorted(kept.items(), key=lambda item: item[1]):
            own = automaton.states
            block = states[off:off + automaton.num_states]
            block["first"] = own["first"].astype(np.int64) + first
            block["count"] = own["count"]
            block["fallback"] = _moved(own["fallback"], off)
            block["flags"] = own["flags"]
            edges = np.empty(len(automaton.edges), EDGE_DTYPE)
            edges["token"] = automaton.edges["token"]
            edges["next"] = _moved(automaton.edges["next"], off)
            parts.append(edges)
            first += len(edges)
        if first >= DEAD:
            raise ValueError(f"the running requests' automata need {first} edges together; a "
                             f"device table indexes fewer than 2**32")
        joined = TokenAutomaton.__new__(TokenAutomaton)
        joined._keep(states, np.concatenate(parts) if parts else np.zeros(0, EDGE_DTYPE),
                     self.vocab)
        joined.to_device(self.stream)
        self._free_joined()
        self.joined, self.offsets = joined, kept

    def _free_joined(self) -> None:
        """The joined automaton freed after the work queued so far, in stream order (a host
        function, so this thread never waits for it, nor a step in flight loses it)."""
        joined, self.joined = self.joined, None
        if joined is not None:
            _core.launch_host_func(self.stream, joined.close)

    def release(self) -> None:
        """No running row has a grammar: the joined automaton is freed after the steps queued
        with it (and the pipeline holds none of the requests' automata any more); the words are
        no longer advanced, so the next row with a grammar takes its word from the host."""
        self._free_joined()
        self.offsets = {}
        self.index = {}
        self.grammar = None
        self.last = None

    def close(self) -> None:
        joined, self.joined = self.joined, None
        close_each([buf.close for buf in self.words]
                   + [part.close for part in (self.scratch, joined) if part is not None])


def walk(automaton: TokenAutomaton, state: int, token: int) -> Tuple[Optional[int], bool]:
    """The host's step of a committed ``token``: the state after it (None when ``state`` does
    not allow it) and whether that state ends the output (no outgoing transition)."""
    nxt = automaton._step(state, token)
    return nxt, nxt is not None and bool(automaton._flags[nxt] & FINAL)


def _moved(nexts: Any, offset: int) -> Any:
    """Next states moved by ``offset``, ``DEAD`` kept."""
    wide = nexts.astype(np.int64)
    return np.where(wide == DEAD, DEAD, wide + offset)
