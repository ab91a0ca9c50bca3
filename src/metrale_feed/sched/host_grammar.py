"""Host grammars in the decode pipeline (docs/pipeline.md, "Structured outputs").

A request submitted with ``grammar=<HostGrammar>`` picks only what its matcher allows after the
tokens before it. The matcher lives on the host, so each launch with such a row fills the step's
bitmask there: once the forward is queued (the router calls the fill between the forward and the
pick, so the device runs the forward meanwhile), the host reads the ids of the step in flight
(at depth 2: the one host sync more), brings each row's matcher to the row's committed tokens
plus that step's id, fills its bitmask row, and queues the upload before the pick. Rows without
a host grammar get every bit set, so a row's ``TokenAutomaton`` state, its ban and penalties
decide as without it. At each step's wait the host accepts the committed ids (``walk``): a
matcher that terminates finishes its request ``"stop"``; an id it refuses is never committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Set, Tuple

import numpy as np

from .. import _core
from .lifecycle import close_each
from .request import _RUNNING, RequestStatus

if TYPE_CHECKING:
    from .request import Request

__all__ = ["HostMasks", "walk"]


class HostMasks:
    """The bitmask rows of a pipeline's host grammars: two page-locked buffers of ``max_rows``
    rows (a launch fills one while the upload of the one before may still be queued) and the
    device buffer the pick reads, made at the first launch with a host grammar.

    ``bind(rows, hosted, ahead)`` gives a launch's fill: a callable the router calls once the
    step's forward is queued, which returns the device bitmask for ``bitmask=``."""

    def __init__(self, max_rows: int, vocab: int, io: Any, stream: Any) -> None:
        self.words = (vocab + 31) // 32
        self.io = io
        self.stream = stream
        self.host: List[Any] = []
        self.device: Any = None
        try:
            for _ in range(2):
                self.host.append(_core.PinnedBuffer(max_rows * self.words * 4))
            self.device = _core.DeviceBuffer(max_rows * self.words * 4)
        except BaseException:
            self.close()
            raise
        self.turn = 0

    def bind(self, rows: int, hosted: List[Tuple[int, "Request"]],
             ahead: Optional[Any]) -> Callable[[], Any]:
        """The fill of a launch of ``rows`` rows whose rows ``hosted`` have a host grammar;
        ``ahead``: the step still in flight (``_Step``, depth 2), whose ids the rows' matchers
        must accept first, or None (every id before is committed)."""
        return lambda: self.fill(rows, hosted, ahead)

    def fill(self, rows: int, hosted: List[Tuple[int, "Request"]], ahead: Optional[Any]) -> Any:
        ids: Optional[List[int]] = None
        index: Any = None
        if ahead is not None:
            # The previous step's ids, read without settling it (its await reads them again).
            ids = self.io.peek(ahead.ticket)
            dead = ahead.dead or ()
            index = {r: j for j, r in enumerate(ahead.rows) if j not in dead}
        host = self.host[self.turn]
        self.turn ^= 1
        bits = np.frombuffer(host, np.int32, rows * self.words).reshape(rows, self.words)
        bits[:] = -1  # a row without a host grammar: every id (its own masks decide)
        for i, req in hosted:
            grammar = req._host
            j = -1 if index is None else index.get(req, -1)
            # Its id in the step in flight, if any, comes before this one.
            if grammar._sync(req.tokens, None if j < 0 else ids[j]):  # type: ignore[index]
                grammar._fill(bits, i)
            else:  # an id it refuses: that step's walk finishes the request, this row is dropped
                bits[i] = 0
        del bits
        _core.copy_h2d_async(self.device, memoryview(host)[:rows * self.words * 4], self.stream)
        return self.device

    def close(self) -> None:
        device, self.device = self.device, None
        host, self.host = self.host, []
        close_each([buf.close for buf in host] + ([device.close] if device is not None else []))


def walk(hosted: List[Tuple[int, "Request"]], ids: List[int], dead: Optional[Set[int]],
         finishing: List[Tuple["Request", RequestStatus]]
         ) -> Tuple[Optional[Set[int]], List["Request"]]:
    """The host's walk of each row with a host grammar over the id its step picked, before the
    ids are committed (as ``Finishing._walk`` for automata): its matcher accepts it (unless it
    did when the next step's bitmask was filled), and the requests whose matcher has terminated
    are returned. An id the matcher refuses is never committed: the request finishes
    ``"grammar"`` and the row joins the returned set of rows thrown away."""
    ends: List["Request"] = []
    copied = False
    for i, req in hosted:
        if (dead is not None and i in dead) or req.status is not _RUNNING:
            continue
        grammar = req._host
        if not grammar._sync(req.tokens, ids[i]):
            if not copied:  # a copy: the step's own set keeps what was thrown away
                dead, copied = set(dead or ()), True
            dead.add(i)  # type: ignore[union-attr]
            finishing.append((req, RequestStatus.FINISHED_GRAMMAR))
            continue
        if grammar._terminated():
            ends.append(req)
    return dead, ends
