"""Speculative decoding through ``DecodePipeline`` (docs/speculative.md).

A drafter proposes ``k`` ids a row into a device buffer, in stream order; the model's verify
step runs the ``k + 1`` positions of each row (its input, then its drafts) in one forward;
``verify_to_feed`` keeps the longest prefix the target rule agrees with and emits one id of the
target's own, so a row advances ``1 <= n <= k + 1`` positions a step. ``SpeculativeStep`` is the
pipeline's delegate for such steps: it reserves KV for the ``k + 1`` positions, gives back the
blocks that hold only rejected positions once the counts are read, and commits the emitted ids up
to a stop or ``max_new_tokens`` (the ids past it are discarded, never shown). At depth 2 the next
step is launched before those counts are read: its inputs and positions come from the step in
flight's cells on the device (``resolve_verified``), so the host waits once a step.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import (TYPE_CHECKING, Any, Deque, Dict, List, Optional, Protocol, Sequence, Set,
                    Tuple, runtime_checkable)

from .. import _checks, _core
from ..contract import ReservesAhead, VerifyStep, require
from ..errors import DeviceError, FeedError, KvPoolExhausted
from ..feed import NO_TOKEN, FeedSource
from ..runtime import _ran_in_part
from .lifecycle import close_each
from .request import _RUNNING, _RequestView

if TYPE_CHECKING:
    from .host import StepHost
    from .request import Request

__all__ = ["DraftBatch", "Drafter", "HostDrafter", "NGramDrafter", "SpeculativeStep", "check_drafter"]


class DraftBatch:
    """What a drafter is given for one step.

    Parameters
    ----------
    rows, k : int
    inputs : int
    histories : list of list of int
    seeds : list of int
    masks : list of (int, int)
    ahead : list of int, optional

    Attributes
    ----------
    rows : int
        Rows of the step.
    k : int
        Drafts a row to write.
    inputs : int
        Device pointer to ``rows`` uint32: each row's input id of this step, written in stream
        order before ``propose`` is called: what a device-side head (EAGLE, MTP) reads.
    histories : list of list of int
        Each row's ids so far (prompt and committed tokens), the input id last.
    seeds : list of int
        Each request's ``seed``.
    masks : list of (int, int)
        Each row's ban pair (``NO_TOKEN`` where unused).
    ahead : list of int
        At depth 2, each row's index in the previous ``propose`` call's batch when that step is
        still in flight, so its history lacks what that step emits (its input and position
        are on the device); -1: the row's history is current.
    ahead_cells : int
        With rows ahead, the host address of the step in flight's cells as its verify copies
        them (pinned memory, ``k + 2`` words a row of its batch: ``n``, then the ``n`` emitted
        ids), written in stream order: a host function queued on the stream by ``propose``
        (``launch_host_func``) reads them complete, the host thread may not. 0: none.

    The lists are the pipeline's, kept from step to step (a request's history grows as its
    tokens are committed): read them during ``propose``, copy what is kept past it, change
    none.
    """

    __slots__ = ("rows", "k", "inputs", "histories", "seeds", "masks", "ahead", "ahead_cells")

    def __init__(self, rows: int, k: int, inputs: Any, histories: List[List[int]],
                 seeds: List[int], masks: List[Tuple[int, int]],
                 ahead: Optional[List[int]] = None, ahead_cells: int = 0) -> None:
        self.rows, self.k, self.inputs = rows, k, inputs
        self.histories, self.seeds, self.masks = histories, seeds, masks
        self.ahead = ahead if ahead is not None else [-1] * rows
        self.ahead_cells = ahead_cells


@runtime_checkable
class Drafter(Protocol):
    """What ``DecodePipeline(..., speculative=)`` takes: ``k`` drafts a row a step.

    ``propose(batch, out, stream)`` writes ``batch.rows * batch.k`` uint32 ids into the device
    memory ``out`` (row ``r``'s drafts at words ``r * k ..``; ``NO_TOKEN`` ends a row's drafts
    early), in stream order on ``stream``: the verify step queued after the call reads them. It
    must not synchronise the host with the device (a host-side drafter stages its ids in pinned
    memory and copies them asynchronously, as ``HostDrafter`` does). ``out`` is the drafter's
    own: it may write its first ``max_rows * (k + 1)`` words whatever ``batch.rows`` (a padded
    batch, ``k + 1`` ids a row, scratch); guard words follow, and a write over them fails that
    step at its wait (``FeedError``).

    Attributes
    ----------
    k : int
        Drafts a row, 1 to ``MAX_DRAFTS``.
    """

    k: int

    def propose(self, batch: DraftBatch, out: Any, stream: Any) -> None:
        ...


def check_drafter(drafter: Any) -> int:
    """The drafter's ``k``, checked; a clear error for anything that is not a drafter."""
    if not callable(getattr(drafter, "propose", None)):
        raise TypeError(f"speculative= takes a drafter with propose(batch, out, stream) and k; "
                        f"{type(drafter).__name__} has no propose method")
    if not hasattr(drafter, "k"):
        raise TypeError(f"speculative= takes a drafter with a k attribute (drafts a row); "
                        f"{type(drafter).__name__} has none")
    k = _checks.integer(drafter.k, "the drafter's k")
    if not 1 <= k <= _core.MAX_DRAFTS:
        raise ValueError(f"the drafter's k must be in [1, {_core.MAX_DRAFTS}], got {k}")
    return k


class _Upload:
    """Host-computed drafts staged in pinned memory and copied to the device in stream order; a
    slot is rewritten only once the event recorded after its copy says the copy has run."""

    _SLOTS = 3

    def __init__(self) -> None:
        self.slots: List[Optional[Tuple[Any, Any]]] = [None] * self._SLOTS
        self.next = 0
        self.host_syncs = 0

    def send(self, words: List[int], out: Any, stream: Any) -> None:
        data = array("I", words).tobytes()
        self._copy(self._take(len(data)), len(data), data, out, stream)

    def send_later(self, nwords: int, fill: Any, out: Any, stream: Any) -> None:
        """``send(fill(), ...)`` with ``fill`` run in stream order (a host function), so it may
        read what the work queued before it wrote; ``fill`` must return ``nwords`` ids."""
        nbytes = 4 * nwords
        slot = self._take(nbytes)
        _core.launch_host_func(stream, _fill_pinned, slot[0], nbytes, fill)
        self._copy(slot, nbytes, None, out, stream)

    @staticmethod
    def _copy(slot: Tuple[Any, Any], nbytes: int, data: Optional[bytes], out: Any,
              stream: Any) -> None:
        """Write ``data`` (None: a host function queued before fills it) into the slot, queue its
        copy to ``out`` and record the slot's event after it."""
        view = memoryview(slot[0]).cast("B")
        try:
            if data is not None:
                view[:nbytes] = data
            _core.copy_h2d_async(out, view[:nbytes], stream)
        finally:
            view.release()
        slot[1].record(stream)

    def _take(self, nbytes: int) -> Tuple[Any, Any]:
        """The next pinned slot of at least ``nbytes``, once its last copy has run."""
        at = self.next
        self.next = (at + 1) % self._SLOTS
        slot = self.slots[at]
        if slot is not None:
            if not slot[1].query():  # only with more than _SLOTS proposals queued
                self.host_syncs += 1
                slot[1].synchronize()
            if slot[0].nbytes < nbytes:
                slot[0].close()
                slot[1].close()
                slot = None
        if slot is None:
            self.slots[at] = None  # a failed allocation leaves no closed slot behind
            slot = (_core.PinnedBuffer(max(nbytes, 256)), _core.Event())
            self.slots[at] = slot
        return slot

    def close(self) -> None:
        slots, self.slots = self.slots, [None] * self._SLOTS
        close_each(part.close for slot in slots if slot is not None for part in slot)


def _fill_pinned(buf: Any, nbytes: int, fill: Any) -> None:
    """A host function: write ``fill()``'s ids into the pinned ``buf`` before its copy runs."""
    data = array("I", fill()).tobytes()
    if len(data) != nbytes:
        raise ValueError(f"a drafter's deferred drafts hold {len(data)} bytes, not {nbytes}")
    view = memoryview(buf).cast("B")
    try:
        view[:nbytes] = data
    finally:
        view.release()


def _extended(history: List[int], cells: Sequence[int], at: int, k: int) -> List[int]:
    """``history`` followed by the ids row ``at`` of a verify step emitted (its cells)."""
    n = cells[at * (k + 2)]
    if not 1 <= n <= k + 1:  # not written by a verify that ran: nothing to add
        return history
    return history + list(cells[at * (k + 2) + 1:at * (k + 2) + 1 + n])


class HostDrafter:
    """A drafter that computes its ids on the host from the rows' histories (``draft``) and
    copies them to the device asynchronously, through a small ring of pinned buffers.

    Parameters
    ----------
    k : int
        Drafts a row, 1 to ``MAX_DRAFTS``.
    """

    def __init__(self, k: int) -> None:
        k = _checks.integer(k, "k")
        if not 1 <= k <= _core.MAX_DRAFTS:
            raise ValueError(f"k must be in [1, {_core.MAX_DRAFTS}], got {k}")
        self.k = k
        self._upload = _Upload()
        self._last: List[int] = []  # the last propose call's words (the step in flight)

    def draft(self, history: Sequence[int], k: int, seed: int, mask: Tuple[int, int]) -> List[int]:
        """``k`` drafts after ``history`` (the input id last); ``NO_TOKEN`` past the last."""
        raise NotImplementedError

    def after(self, history: Sequence[int], drafts: Sequence[int], seed: int,
              mask: Tuple[int, int]) -> List[int]:
        """At depth 2, a row's history once the step still in flight (whose input is
        ``history[-1]`` and whose drafts were ``drafts``) is committed, as far as the drafter
        can tell, where the batch gives no ``ahead_cells`` (``propose`` otherwise drafts in
        stream order from the history itself). The default keeps the history as it is: the
        drafts are then for earlier positions, still exact, less often accepted."""
        return list(history)

    def propose(self, batch: DraftBatch, out: Any, stream: Any) -> None:
        """Write ``draft`` of every row into ``out`` in stream order (see ``Drafter``).

        With rows of the step still in flight and its cells given (``batch.ahead_cells``), the
        rows are drafted in stream order, in a host function that runs once that step's verify
        has written its cells: each such row's history then holds what that step emitted, so
        the drafts are those of depth 1. Without the cells, ``after`` guesses that history."""
        k = batch.k
        if batch.ahead_cells and any(at >= 0 for at in batch.ahead):
            histories = [list(h) for h in batch.histories]  # the host thread moves on meanwhile
            seeds, masks, ahead = list(batch.seeds), list(batch.masks), list(batch.ahead)
            cells_ptr, cell_words = batch.ahead_cells, (max(ahead) + 1) * (k + 2)

            def fill() -> List[int]:
                cells = _core.read_pinned_u32(cells_ptr, cell_words)
                exact = [h if at < 0 else _extended(h, cells, at, k)
                         for h, at in zip(histories, ahead)]
                return self._words(exact, seeds, masks, k)

            self._upload.send_later(batch.rows * k, fill, out, stream)
            return
        last = self._last
        histories = list(batch.histories)
        for row, (history, seed, mask) in enumerate(zip(batch.histories, batch.seeds, batch.masks)):
            at = batch.ahead[row]
            if at >= 0 and len(last) >= (at + 1) * k:  # the step in flight: this drafter's
                histories[row] = self.after(history, last[at * k:(at + 1) * k], seed, mask)
        self._upload.send(self._words(histories, batch.seeds, batch.masks, k), out, stream)

    def _words(self, histories: Sequence[Sequence[int]], seeds: Sequence[int],
               masks: Sequence[Tuple[int, int]], k: int) -> List[int]:
        """Each row's ``draft``, ``NO_TOKEN``-padded to ``k`` ids, checked to be uint32 ids."""
        words: List[int] = []
        for history, seed, mask in zip(histories, seeds, masks):
            ids = list(self.draft(history, k, seed, mask))[:k]
            words.extend(ids + [NO_TOKEN] * (k - len(ids)))
        try:
            array("I", words)  # what send stages; checked first, so a bad id names the drafter
        except (OverflowError, TypeError) as exc:
            bad = next((t for t in words if not (hasattr(type(t), "__index__")
                                                 and 0 <= t.__index__() <= NO_TOKEN)), words)
            raise type(exc)(f"{type(self).__name__}.draft gave {bad!r}: a draft is a uint32 id "
                            f"(NO_TOKEN ends a row's drafts early)") from exc
        self._last = words
        return words

    @property
    def host_syncs(self) -> int:
        """Waits for a pinned slot still being copied (none while at most 3 steps are queued)."""
        return self._upload.host_syncs

    def close(self) -> None:
        """Free the pinned ring (the pipeline calls it at its close)."""
        self._upload.close()


class NGramDrafter(HostDrafter):
    """Prompt lookup: the ids that followed the latest earlier occurrence of the row's last
    ``n`` ids (``n`` from ``max_n`` down to ``min_n``), up to ``k`` of them; ``NO_TOKEN`` where
    none was found. Deterministic (one-hot drafts), no second model.

    Parameters
    ----------
    k : int
        Drafts a row, 1 to ``MAX_DRAFTS``.
    max_n, min_n : int, optional
        The longest and shortest suffix looked up (default 3 and 1).

    Raises
    ------
    ValueError
        ``k`` out of range, or not ``1 <= min_n <= max_n``.

    Examples
    --------
    >>> from metrale_feed.sched.speculative import NGramDrafter
    >>> NGramDrafter(3).lookup([5, 6, 7, 9, 5, 6], 3)
    [7, 9, 5]
    """

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1) -> None:
        max_n, min_n = _checks.integer(max_n, "max_n"), _checks.integer(min_n, "min_n")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} and max_n={max_n}")
        super().__init__(k)
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, history: Sequence[int], k: int) -> List[int]:
        """The ``k`` drafts after ``history`` (``NO_TOKEN`` past what the lookup found)."""
        h = history if isinstance(history, list) else list(history)  # read only: no copy
        for n in range(min(self.max_n, len(h) - 1), self.min_n - 1, -1):
            suffix = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):  # the latest earlier occurrence first
                if h[start:start + n] == suffix:
                    found = h[start + n:start + n + k]
                    return found + [NO_TOKEN] * (k - len(found))
        return [NO_TOKEN] * k

    def draft(self, history: Sequence[int], k: int, seed: int, mask: Tuple[int, int]) -> List[int]:
        return self.lookup(history, k)


class _SpecView(_RequestView):
    """A speculative request's KV view: ``seq_len`` is the positions whose KV holds a committed
    id (``req._base``: the prefilled history, then each step's input and accepted drafts), set
    by prefill while the request waits and by ``SpeculativeStep`` once a step's counts are read.
    ``tokens`` is the pipeline's read-only view (``_RequestView``)."""

    __slots__ = ()

    @property
    def seq_len(self) -> int:
        return self.req._base

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        if self.req.status is not _RUNNING:  # prefill fills the cache
            self.req._base = value


# Guard words after a drafter's region (``_Slot.drafts``): armed before each ``propose`` and read
# back with the step's cells, so a drafter that writes past its region fails that step at its
# one wait instead of changing what the pipeline reads. Bit 31 set, none NO_TOKEN: no id.
_GUARD = [0x9E3779B1 ^ (i * 0x01000193) for i in range(16)]


class _Slot:
    """One launch's buffers: the drafter's region (``drafts``: ``rows * (k + 1)`` words it may
    write, then the guard words), the drafts as the step reads them then the inputs (``taken``:
    one device buffer, so one gather makes the fed ids; the drafter never writes it), the guard
    words' pinned copy, the fed ids, the advance, the verify cells and their pinned copy, the
    resolved last ids and advances the next launch reads on the device, and the logprobs of every
    logit row with their pinned copy (written when a row of the step asks for them)."""

    def __init__(self, rows: int, k: int) -> None:
        self.logit_rows = rows * (k + 1)  # the most a step has (max_rows of k + 1 positions)
        self.region = rows * (k + 1) * 4  # the drafter's bytes; the guard words follow
        self.drafts = _core.DeviceBuffer(self.region + len(_GUARD) * 4)
        self.taken = _core.DeviceBuffer(rows * (k + 1) * 4)
        self.guard = _core.PinnedBuffer(len(_GUARD) * 4)
        self.fed = _core.DeviceBuffer(rows * (k + 1) * 4)
        self.advance = _core.DeviceBuffer(rows * 4)
        self.cells = _core.DeviceBuffer(rows * (k + 2) * 4)
        self.dst = _core.PinnedBuffer(rows * (k + 2) * 4)
        self.ids = _core.DeviceBuffer(rows * 4)
        self.adv = _core.DeviceBuffer(rows * 4)
        self.lp = _core.DeviceBuffer(rows * (k + 1) * 4)
        self.lp_dst = _core.PinnedBuffer(rows * (k + 1) * 4)
        self.top: Any = None  # the top logprobs' records and their copy: made at the first step
        self.top_dst: Any = None  # that asks for them (MAX_TOP_LOGPROBS a logit row)
        self.emitted: Any = None  # each logit row's emitted id (raw logprobs with penalties)
        self.done = _core.Event()

    def top_buffers(self) -> Tuple[Any, Any]:
        """The top logprobs' buffers, sized for the slot's most rows (a later batch may be larger
        than the first that asked), both made or neither."""
        if self.top is None:
            nbytes = self.logit_rows * _core.MAX_TOP_LOGPROBS * 8
            top = _core.DeviceBuffer(nbytes)
            try:
                self.top_dst = _core.PinnedBuffer(nbytes)
            except BaseException:
                top.close()
                raise
            self.top = top
        return self.top, self.top_dst

    def close(self) -> None:
        close_each(buf.close for buf in (self.drafts, self.taken, self.guard, self.fed,
                                         self.advance, self.cells, self.dst, self.ids, self.adv,
                                         self.lp, self.lp_dst, self.top, self.top_dst,
                                         self.emitted, self.done)
                   if buf is not None)


class _Batch:
    """What a launch derives from its rows alone, kept while the rows and their bans stay the
    same (a verify step of the same batch reuses it): their index, sequences, ban pairs (and
    one per logit row), seeds, sampling records (positions set each launch) and, for row ``r``
    of the step in flight being row ``r`` of this one, each row's index and
    ``FeedSource.feed(r)``. Read only: a drafter is handed its lists."""

    __slots__ = ("rows", "index", "seqs", "masks", "vmasks", "seeds", "params", "identity",
                 "feeds", "logprobs", "top_n", "pen")

    def __init__(self, rows: List["Request"], k: int) -> None:
        self.rows = rows
        self.index = {id(r): i for i, r in enumerate(rows)}
        self.seqs = [r._seq for r in rows]
        self.masks = [(int(r._mask[0]), int(r._mask[1])) for r in rows]
        self.vmasks: Any = None
        if any(r._ban is not None for r in rows):
            self.vmasks = [m for m in self.masks for _ in range(k + 1)]  # a pair a logit row
        self.seeds = [r.seed for r in rows]
        self.params: Any = None
        if any(r.sampled for r in rows):
            from ..sampling import step_records

            self.params = step_records([r.params for r in rows])
        self.identity = list(range(len(rows)))
        self.feeds = [FeedSource.feed(i) for i in self.identity]
        self.logprobs = any(r.logprobs is not None for r in rows)  # the verify writes them all
        self.top_n = max((r._top_n for r in rows), default=0)  # the top logprobs of every logit row
        self.pen: Any = None  # the rows' penalties (PipelinePenalties), None when none has any


class _Flight:
    """A launched verify step: its batch (rows, their row index), its slot, and the rows whose
    result will be thrown away (finished, aborted or preempted while it was in flight)."""

    __slots__ = ("batch", "rows", "index", "slot", "launch", "dead")

    def __init__(self, batch: _Batch, slot: _Slot, launch: int) -> None:
        self.batch = batch
        self.rows = batch.rows
        self.index = batch.index
        self.slot = slot
        self.launch = launch
        self.dead: Set[int] = set()


class SpeculativeStep:
    """The pipeline's step when ``speculative=`` is given: draft, verify, then commit.

    At depth 1 each step is launched and its counts read in the same ``step()`` call. At depth
    2 the next step is launched before the last one's counts are read: a row that was in the
    step in flight takes its input id and its position advance from that step's cells on the
    device (``resolve_verified``, then a gather), so the host waits once a step.

    Parameters
    ----------
    host : StepHost
        The pipeline it runs in, as its ``PipelineHost`` (sched/host.py): the members
        ``StepHost`` declares, never the pipeline itself.
    drafter : Drafter
    """

    def __init__(self, host: "StepHost", drafter: Any) -> None:
        k = check_drafter(drafter)
        model: Any = host.model
        require(model, "speculative decoding", VerifyStep, ReservesAhead)
        if host.depth == 2 and not host.info.verify_advance:
            raise TypeError(f"speculative decoding at depth 2 needs decode_batch_verify(..., "
                            f"advance=) (positions advanced on the device); "
                            f"{type(model).__name__}'s has no advance (its feed_info() says "
                            f"verify_advance=False): use depth=1")
        if not host.info.block_size or host.info.pool is None:
            raise TypeError("speculative decoding needs a model with block_size and pool (a "
                            "BlockPool): the pipeline reserves the k + 1 positions itself")
        rows = host.max_rows
        limit = _core.MAX_ROWS if host.shard is None else host.shard.max_rows
        if rows * (k + 1) > limit:
            raise ValueError(f"max_rows x (k + 1) = {rows * (k + 1)} logit rows is more than "
                             f"{limit}" + ("" if host.shard is None else " (the shard's max_rows)"))
        self.host, self.k, self.drafter = host, k, drafter
        self.depth = host.depth
        # Positions past a row's committed KV a step may write: its k + 1, after (depth 2) the
        # up to k + 1 the step in flight advances it by.
        self.reach = k if self.depth == 1 else 2 * k + 1
        self.slots: List[_Slot] = []
        self._guard: Any = None  # the guard words, copied after a drafter's region each launch
        try:
            for _ in range(self.depth + 1):  # a slot is rewritten only after its step's await
                self.slots.append(_Slot(rows, k))
            self._guard = _core.PinnedBuffer(len(_GUARD) * 4)
            _core.write_pinned_u32(self._guard.ptr, _GUARD)
        except BaseException:
            close_each([slot.close for slot in self.slots]
                       + ([self._guard.close] if self._guard is not None else []))
            raise
        self.next_slot = 0
        self.inflight: Deque[_Flight] = deque()
        self.host_syncs = 0
        self.launches = self.ahead_launches = 0  # PipelineStats adds them to the router's
        self._batch: Optional[_Batch] = None  # the last launch's
        self._history: Dict["Request", List[int]] = {}  # a running request's ids so far
        self._gathers: Dict[int, List[int]] = {}  # rows -> the fed ids' sources
        self._emitted_at: Dict[int, List[int]] = {}  # rows -> the emitted ids' (_emitted)
        self._row_stride = getattr(model, "feed_row_stride", None)
        self._closed = False

    # ---- KV ----

    def _reserve(self, rows: List["Request"], reach: int) -> List["Request"]:
        """Blocks for every row's positions up to ``_base + reach``, through the budget; when
        the pool runs dry the pipeline preempts the youngest (``reserve_or_preempt``). Returns
        the rows left."""
        extend = self.host.budget.extend

        def extend_each(due: List["Request"]) -> int:
            for at, req in enumerate(due):
                try:
                    extend(req._seq, req._base + reach)  # type: ignore[arg-type]
                except KvPoolExhausted:
                    return at
            return -1

        return self.host.reserve_or_preempt(rows, rows, extend_each)

    def _trim(self, req: "Request", ahead: bool) -> None:
        """Give back the blocks that hold only rejected positions: past ``_base``, or past
        ``_base + k`` while a step in flight (``ahead``) still writes from ``_base`` on."""
        seq = req._seq
        assert seq is not None
        written = req._base + (self.k + 1 if ahead else 0)
        self.host.stats.spec_blocks_returned += self.host.budget.trim(seq, written)

    def discard(self, req: "Request") -> None:
        """``req`` left the batch: its rows in the steps in flight are thrown away, and the next
        launch derives its batch again (a request back in the same rows has a new sequence and
        penalty slot)."""
        self._history.pop(req, None)
        self._batch = None
        for flight in self.inflight:
            at = flight.index.get(id(req))
            if at is not None and at not in flight.dead:
                flight.dead.add(at)
                self.host.stats.rows_discarded += 1

    # ---- launching ----

    def launch(self) -> bool:
        """Queue one verify step of every running row (after admitting); False when none.

        One that raises is retried by the next ``step()``, unless it raised ``DeviceError``:
        earlier work failed (on cuda a kernel's fault surfaces at whichever call comes next),
        so the steps in flight cannot be trusted, and it is a fault as a failed wait is. A
        refusal after the verify picked is raised as one (``_ran_in_part``)."""
        try:
            return self._launch()
        except DeviceError as exc:
            self._drop_all()
            self.host.fault(self.host.owner.launches, 0, exc)
            raise

    def _launch(self) -> bool:
        host, k = self.host, self.k
        owner = host.owner  # the launch count and the masks' flag
        launch = owner.launches
        if host.waiting and len(host.running) < host.max_rows:
            host.admit(launch)
        prev = self.inflight[-1] if self.inflight else None
        running = list(host.running)
        ahead = prev is not None and any(
            prev.index.get(id(r), -1) >= 0 and prev.index[id(r)] not in prev.dead for r in running)
        rows = self._reserve(running, self.reach if ahead else k)
        if not rows:
            return False
        # The slot after the last launched one: it moves on only once this launch is queued,
        # so a launch that raises (a drafter's or the model's error) never leaves a slot of a
        # step still in flight to the next one.
        slot = self.slots[self.next_slot]
        n_rows, stream = len(rows), host.stream
        batch = self._batch
        if batch is None or owner.masks_dirty or batch.rows != rows:
            batch = _Batch(rows, k)
            batch.pen = host.penalties(rows)  # slots for the rows that joined
            self._batch = batch
            owner.masks_dirty = False
        # The buffers of the step's logprobs, made before anything of it is queued: a refused
        # allocation is retried by the next step() with nothing of this one run.
        if batch.top_n:
            slot.top_buffers()
        if batch.logprobs and batch.pen is not None and slot.emitted is None:
            slot.emitted = _core.DeviceBuffer(slot.logit_rows * 4)
        histories = self._histories(rows)
        # Each row's index in the step in flight (its input and advance are there, on the
        # device), or -1: its committed history is current.
        if prev is not None and prev.batch is batch and not prev.dead:
            at = batch.identity  # the same rows as the step in flight: row r is its row r
        else:
            at = [-1] * n_rows
            if prev is not None:
                for row, r in enumerate(rows):
                    i = prev.index.get(id(r), -1)
                    if i not in prev.dead:
                        at[row] = i
        inputs = slot.taken.ptr + n_rows * k * 4
        advanced = prev is not None and (at is batch.identity or any(i >= 0 for i in at))
        if advanced:
            assert prev is not None
            if at is batch.identity:  # every row's input and advance come from the step in flight
                ids = steps = batch.feeds
            else:
                ids = [FeedSource.feed(i) if i >= 0 else FeedSource.host(h[-1])
                       for i, h in zip(at, histories)]
                steps = [FeedSource.feed(i) if i >= 0 else FeedSource.host(0) for i in at]
            _core.resolve_feed(ids, prev.slot.ids, inputs, stream, prev_rows=len(prev.rows))
            _core.resolve_feed(steps, prev.slot.adv, slot.advance, stream,
                               prev_rows=len(prev.rows))
        else:
            _core.resolve_feed([FeedSource.host(h[-1]) for h in histories], slot.ids, inputs,
                               stream, prev_rows=1)
        guard = slot.drafts.ptr + slot.region
        _core.copy_h2d_async(guard, self._guard, stream)  # armed again: a past step may have hit it
        self.drafter.propose(DraftBatch(n_rows, k, inputs, histories, batch.seeds, batch.masks,
                                        at, prev.slot.dst.ptr if advanced and prev else 0),
                             slot.drafts, stream)
        # The drafts the step reads are copied out of the drafter's region, beside the inputs:
        # whatever else the drafter writes there (a padded batch, k + 1 ids a row) changes no
        # input. Its guard words are read back with the cells and checked at the step's wait.
        _core.copy_d2d_async(slot.taken, slot.drafts, n_rows * k * 4, stream)
        _core.copy_d2h_async(guard, slot.guard, stream)
        _core.resolve_feed(self._gather(n_rows), slot.taken, slot.fed, stream,
                           prev_rows=n_rows * (k + 1))
        model: Any = host.model  # a verify-capable model (checked at construction)
        extra = {"advance": slot.advance} if advanced else {}
        logits = model.decode_batch_verify(slot.fed, batch.seqs, k, stream, **extra)
        pen, raw = batch.pen, None
        # Position j judged with the drafts before it (docs/speculative.md): in the verify's own
        # call, or over a split vocabulary (each rank its slice) as the apply and the update.
        one = pen is not None and host.shard is None
        if pen is not None:
            if batch.logprobs:  # the raw logits, before the penalties change them
                raw = pen.snapshot(logits, n_rows * (k + 1), stream)
            if not one:
                pen.apply(logits, stream, slot.taken)  # the drafts: taken's first n_rows * k words
        params = batch.params
        if params is not None:
            # Read before the verify's launch returns, so rewriting it each launch changes no step
            # in flight: the first emitted id's position as far as the host knows; a row in
            # the step in flight adds that step's count on the device (the advance its forward
            # reads), so its draws are keyed as at depth 1.
            params["position"] = [len(h) for h in histories]
        # Each row's grammar state word, gathered when the rows changed (docs/pipeline.md,
        # "Structured outputs"): a draft its state forbids is rejected like any mismatch.
        grammar = host.grammar(rows)
        shard = host.shard  # greedy rows: one exchange; sampled ones: a sampled call's rounds
        lp = batch.logprobs and raw is None
        vocab = host.vocab if shard is None else shard.width
        top = batch.top_n
        later = top or raw is not None  # the step's event after the logprobs' copies
        # The verify, described once (a PickStep) and launched whole, as the router's steps are.
        _core.pick_to_feed(_core.PickStep(
            "verify", logits=logits, drafts=slot.taken, cells=slot.cells, dst=slot.dst,
            event=None if later else slot.done, stream=stream, k=k, masks=batch.vmasks,
            params=params, rows=n_rows, logprobs=slot.lp if lp else None,
            logprobs_dst=slot.lp_dst if lp else None, vocab=vocab, dtype=host.info.logits_dtype,
            row_stride=self._row_stride, shard=shard, grammar=grammar,
            advance=slot.advance if advanced and params is not None else None,
            penalties=pen.launch if one else None))
        # The verify has picked: its cells hold this step, and a count update made again would
        # count it twice. Anything refused from here on is a failed step, never a retry
        # (docs/pipeline.md, "Faults").
        try:
            if pen is not None and not one:  # the emitted ids (the cells), never the rejected drafts
                pen.update(stream, slot.cells)
            if later:  # every logit row's (submit refuses them over a shard), then the step's event
                lrows = n_rows * (k + 1)
                out = slot.top if top else None
                chosen: Dict[str, Any] = {}
                if raw is not None:  # each emitted id's logprob under its position's raw logits
                    _core.resolve_feed(self._emitted(n_rows), slot.cells, slot.emitted, stream,
                                       prev_rows=n_rows * (k + 2))
                    chosen = dict(ids=slot.emitted, chosen=slot.lp)
                _core.top_logprobs(logits if raw is None else raw, out, stream, n=top, rows=lrows,
                                   vocab=vocab, dtype=host.info.logits_dtype,
                                   row_stride=self._row_stride, **chosen)
                if raw is not None:
                    _core.copy_d2h_async(slot.lp, memoryview(slot.lp_dst)[: lrows * 4], stream)
                if top:
                    _core.copy_d2h_async(out, memoryview(slot.top_dst)[: lrows * top * 8], stream)
                _core.event_record(slot.done, stream)
            if self.depth > 1:  # what the next launch reads before this one's counts are known
                _core.resolve_verified(slot.cells, slot.ids, slot.adv, stream, rows=n_rows, k=k)
        except Exception as exc:
            raise _ran_in_part("what follows its verify (the counts, logprobs, next inputs)",
                               exc) from exc
        self.next_slot = (self.next_slot + 1) % len(self.slots)
        owner.launches = launch + 1
        self.launches += 1
        if self.inflight:
            self.ahead_launches += 1
        self.inflight.append(_Flight(batch, slot, launch))
        return True

    def _histories(self, rows: List["Request"]) -> List[List[int]]:
        """Each row's ids so far (prompt and committed tokens), kept per request and extended
        by the tokens committed since its last step, not copied whole each step. The drafter
        reads them during ``propose`` (they grow after it)."""
        kept = self._history
        out = []
        for r in rows:
            h = kept.get(r)
            if h is None:
                h = kept[r] = list(r.prompt) + r.tokens
            else:
                new = len(r.prompt) + len(r.tokens) - len(h)
                if new:  # committed tokens only grow while it runs, preempted or not
                    h += r.tokens[-new:]
            out.append(h)
        return out

    def _emitted(self, n_rows: int) -> List[int]:
        """Each logit row's emitted id in a verify's cells (``NO_TOKEN`` past its row's ``n``),
        as FeedSource words: position ``j`` of row ``r`` is cell ``r * (k + 2) + 1 + j``."""
        sources = self._emitted_at.get(n_rows)
        if sources is None:
            k = self.k
            sources = self._emitted_at[n_rows] = [FeedSource.feed(r * (k + 2) + 1 + j)
                                                  for r in range(n_rows) for j in range(k + 1)]
        return sources

    def _gather(self, n_rows: int) -> List[int]:
        """The fed ids' sources, row r's input then its k drafts (the same for a row count)."""
        sources = self._gathers.get(n_rows)
        if sources is None:
            k = self.k
            sources = self._gathers[n_rows] = []
            for row in range(n_rows):
                sources.append(FeedSource.feed(n_rows * k + row))
                sources.extend(FeedSource.feed(row * k + j) for j in range(k))
        return sources

    # ---- awaiting ----

    def await_oldest(self) -> None:
        """Wait for the oldest step in flight (the step's one host wait) and commit it."""
        host = self.host
        flight = self.inflight.popleft()
        host.stats.steps += 1
        try:
            self.host_syncs += 1
            flight.slot.done.synchronize()
        except BaseException as exc:
            self._drop_all()
            host.fault(flight.launch, 0, exc)
            raise
        if _core.read_pinned_u32(flight.slot.guard.ptr, len(_GUARD)) != _GUARD:
            overrun = FeedError(
                f"the drafter ({type(self.drafter).__name__}) wrote past its region in launch "
                f"{flight.launch}: propose may write at most max_rows * (k + 1) = "
                f"{flight.slot.region // 4} words of out (its rows * k drafts first); the words "
                f"after them are guards (docs/speculative.md)")
            self._drop_all()
            host.fault(flight.launch, 0, overrun)
            raise overrun
        got = _core.read_pinned_u32(flight.slot.dst.ptr, len(flight.rows) * (self.k + 2))
        lps = tops = None
        if flight.batch.logprobs:  # complete with the cells (the same event)
            import numpy as np

            n = len(flight.rows) * (self.k + 1)
            lps = np.frombuffer(flight.slot.lp_dst, np.float32, n).tolist()
            if flight.batch.top_n:  # (id, logprob) records, top_n a logit row
                records = np.frombuffer(flight.slot.top_dst, np.uint32, n * flight.batch.top_n * 2)
                tops = (records[0::2].tolist(), records[1::2].view(np.float32).tolist())
                del records  # a view of the pinned buffer: an error raised below keeps this frame
        self._commit(flight, got, lps, tops)

    def _drop_all(self) -> None:
        """After a fault: the steps still in flight are waited for and thrown away."""
        for later in self.inflight:
            try:
                later.slot.done.synchronize()
            except Exception:
                pass  # the same fault, reported again: nothing of it is kept either way
            self.host.stats.steps += 1
            self.host.stats.rows_discarded += len(later.rows) - len(later.dead)
        self.inflight.clear()

    def _commit(self, flight: _Flight, got: Sequence[int], lps: Optional[List[float]] = None,
                tops: Optional[Tuple[List[int], List[float]]] = None) -> None:
        from .request import RequestStatus

        k, stats, host = self.k, self.host.stats, self.host
        later = self.inflight[0] if self.inflight else None
        error: Optional[BaseException] = None
        for i, req in enumerate(flight.rows):
            if i in flight.dead or req.status is not RequestStatus.RUNNING:
                continue
            at = i * (k + 2)
            n = got[at]
            stats.drafted += k
            stats.accepted += n - 1
            stats.emitted += n
            req._base += n  # the input and the n - 1 accepted drafts now hold committed KV
            finish = None
            automaton, end = req._grammar, False
            if automaton is not None:
                from .grammar import walk
            for j in range(n):
                token = got[at + 1 + j]
                # No id it may pick: NO_TOKEN, or (a greedy row) a stop id while min_tokens bans
                # it, its every candidate -inf; nothing of it is committed.
                if token == NO_TOKEN or (token in req.stop_ids
                                         and len(req.tokens) < req.min_tokens):
                    finish = (RequestStatus.FINISHED_NO_CANDIDATE if automaton is None
                              else RequestStatus.FINISHED_GRAMMAR)
                    stats.spec_discarded += n - j
                    break
                if automaton is not None:  # the host's walk (docs/pipeline.md)
                    state, end = walk(automaton, req._gstate, token)
                    if state is None:  # the device's state and the host's disagree: never kept
                        finish = RequestStatus.FINISHED_GRAMMAR
                        stats.spec_discarded += n - j
                        break
                    req._gstate = state
                req.tokens.append(token)
                if req.logprobs is not None and lps is not None:  # the raw logprob at its position
                    req.logprobs.append(lps[i * (k + 1) + j])
                    if req.top_logprobs is not None and tops is not None:  # its first _top_n
                        at_top = (i * (k + 1) + j) * flight.batch.top_n
                        ids, values = tops
                        req.top_logprobs.append(list(zip(ids[at_top: at_top + req._top_n],
                                                         values[at_top: at_top + req._top_n])))
                if token in req.stop_ids and len(req.tokens) >= req.min_tokens or (
                        automaton is not None and end):  # or no outgoing transition
                    finish = RequestStatus.FINISHED_STOPPED
                elif len(req.tokens) >= req.max_new_tokens:
                    finish = RequestStatus.FINISHED_LENGTH
                if finish is not None:
                    stats.spec_discarded += n - 1 - j  # emitted past the stop: never shown
                    break
            # A return of blocks or of a penalty slot that raises stops no other row: each row's
            # ids are committed (the device has advanced it, and a step in flight reads them),
            # and the first such error is raised once all are (as the plain pipeline's).
            try:
                if finish is not None:
                    host.finish(req, finish)
                else:
                    ahead = later is not None and later.index.get(id(req), -1) >= 0 and \
                        later.index[id(req)] not in later.dead
                    self._trim(req, ahead)
            except Exception as exc:
                if error is None:
                    error = exc
        if error is not None:
            try:
                raise error
            finally:  # no cycle through this frame: its traceback would keep it until a collection
                error = None

    def close(self) -> None:
        """Wait for the work queued, free the buffers and the drafter's (its ``close``): all of
        them, whatever failed before or fails here (the first error is raised after)."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self.drafter, "close", None)
        close_each([self._settle] + [slot.close for slot in self.slots] + [self._guard.close]
                   + ([close] if callable(close) else []))

    def _settle(self) -> None:
        """Wait for the steps in flight, then for the stream: a wait that was interrupted (Ctrl-C,
        a failed synchronize; its step is no longer in flight) or a launch that raised part-way
        leaves work queued, and its copies hold views of pinned buffers (the drafter's, the top
        logprobs') until they pass, which would refuse their close. A fault reported here is the
        one reported already, or one of work whose results are thrown away."""
        self._drop_all()
        try:
            _core.stream_synchronize(self.host.stream)
        except Exception:
            pass
