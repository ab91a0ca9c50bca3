"""The readback ring and the routers beneath the decode pipeline (docs/router.md, "The router
protocol"; docs/pipeline.md).

``AsyncDeviceIo`` keeps up to two decode steps in flight: each launch runs the model's step and
the masked argmax into the feed cells, copies the ids into one slot of a page-locked ring and
records that slot's event; ``await_result`` reads a slot only after its event has completed.
``SyncDeviceIo`` has the same calls and settles every step before returning.
"""

from __future__ import annotations

import warnings
from array import array
from itertools import chain
from operator import index
from typing import Any, Dict, List, Optional, Sequence, Tuple, TypeVar

from .. import _checks, _core
from .._core import _router_step
from ..contract import DefersForward, DescribesFeed, FeedInfo, HostTokenDecode, feed_info_of, require
from ..errors import FeedError
from ..runtime import _ran_in_part, _rows_of
from ..feed import _HOST_BIT, NO_TOKEN
from ..kv import SequenceState
from ..trait import ModelDeviceFeed
from .budget import KvBudget, Reservation

__all__ = ["AsyncDeviceIo", "SyncDeviceIo", "RouterStats", "Ticket", "Reservation"]

RING_SLOTS = 3  # two steps in flight plus the one being read
SPIN_QUERIES = 64  # event_query polls before a wait blocks in event_synchronize


class RouterStats:
    """Counters of a router: ``launches``, ``ahead_launches`` (fed steps launched before the
    previous one was read) and ``host_syncs`` are its own; ``reserved_blocks``,
    ``reserved_in_flight``, ``peak_reserved_in_flight``, ``rollbacks`` and ``blocks_rolled_back``
    are read from its ``KvBudget``. ``stats["name"]`` and ``as_dict()`` read them.
    """
    __slots__ = ("launches", "ahead_launches", "host_syncs", "_budget")
    NAMES = ("launches", "ahead_launches", "reserved_blocks", "reserved_in_flight",
             "peak_reserved_in_flight", "rollbacks", "blocks_rolled_back", "host_syncs")
    _FROM_BUDGET = frozenset(NAMES[2:7])
    # For type checkers only (set in __init__): counters, all ints.
    launches: int
    ahead_launches: int
    host_syncs: int  # waits of the host on the device: one per awaited step, and at teardown

    def __init__(self, budget: Optional[KvBudget] = None) -> None:
        self.launches = self.ahead_launches = self.host_syncs = 0
        self._budget = budget if budget is not None else KvBudget(None)

    @property
    def reserved_blocks(self) -> int:
        return self._budget.reserved_blocks

    @property
    def reserved_in_flight(self) -> int:
        return self._budget.reserved_in_flight

    @property
    def peak_reserved_in_flight(self) -> int:
        return self._budget.peak_reserved_in_flight

    @property
    def rollbacks(self) -> int:
        return self._budget.rollbacks

    @property
    def blocks_rolled_back(self) -> int:
        return self._budget.blocks_rolled_back

    def __getitem__(self, name: str) -> int:
        if name not in self.NAMES:
            raise KeyError(name)
        value: int = getattr(self, name)
        return value

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.NAMES}

    def __repr__(self) -> str:
        return f"RouterStats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


class Ticket:
    """A launched step: which slot holds its ids, how many rows, whether it was fed. ``gen`` is
    the slot's generation at the launch: a ticket whose slot has been awaited (and perhaps handed
    to a newer step since) is refused, never answered with another step's ids."""

    __slots__ = ("step", "slot", "gen", "rows", "fed", "reservations", "router", "logprobs",
                 "top_n", "top")

    def __init__(self, step: int, slot: int, rows: int, fed: bool, router: Any = None,
                 gen: int = 0, logprobs: bool = False, top_n: int = 0) -> None:
        self.router = router  # the router that launched it: only that one can await it
        self.step = step
        self.slot = slot
        self.gen = gen
        self.rows = rows
        self.fed = fed
        self.reservations: Sequence[Reservation] = ()
        # A step launched with logprobs: True until it is awaited, then each row's chosen-token
        # logprob (read from the slot with the ids); None for a step without.
        self.logprobs: Any = True if logprobs else None
        # With top_n: at the await, (ids, logprobs), each rows * top_n values, row r's at
        # [r * top_n, (r + 1) * top_n).
        self.top_n = top_n
        self.top: Any = None

    def __repr__(self) -> str:
        return f"Ticket(step={self.step}, slot={self.slot}, rows={self.rows}, fed={self.fed})"


def _mask_rows(masks: Any, rows: int) -> int:
    """Rows a masks argument covers, checked before the step so a mismatch launches nothing:
    None (no masks) covers any; a buffer holds two uint32 per row; a sequence one pair per row."""
    return rows if masks is None else _rows_of(masks)


def _words(values: Any, what: str) -> "array[int]":
    """``values`` as uint32 words, converted in C (a float is a TypeError, not truncated)."""
    try:
        return array("I", values)
    except OverflowError:
        raise ValueError(f"{what}: a token id must be a uint32") from None


def _mask_words(masks: Any) -> "array[int]":
    """The mask ids of a buffer or a sequence of pairs, flat."""
    try:
        view = memoryview(masks)
    except TypeError:
        ids = _words(chain.from_iterable(masks), "masks")
        if len(ids) != 2 * len(masks):
            bad = next(i for i, pair in enumerate(masks) if len(pair) != 2)
            raise ValueError(f"masks[{bad}] must be a pair of ids") from None
        return ids
    with view:
        return array("I", view.cast("B").cast("I"))


def _check_inputs(fed: bool, inputs: Sequence[int], masks: Any, vocab: Optional[int],
                  prev_rows: int) -> None:
    """Refuse a launch whose inputs the model would refuse only after its forward (or after a
    block boundary took a block): host ids and mask ids in the vocabulary, feed rows inside the
    previous step. Nothing has been reserved or launched when this raises. Whole-array min/max
    first, so a batch costs C-speed work unless something is wrong or host and feed mix."""
    words = _words(inputs, "inputs")
    if words:
        lo, hi = min(words), max(words)
        limit = NO_TOKEN if vocab is None else vocab
        if not fed:
            if hi >= limit:
                raise ValueError(f"input id {hi} is outside the vocabulary of {vocab} ids")
        elif hi < _HOST_BIT:  # all feed rows
            if hi >= prev_rows:
                raise ValueError(f"FeedSource.feed({hi}) is beyond the previous step's "
                                 f"{prev_rows} rows")
        elif lo >= _HOST_BIT:  # all host ids
            if hi - _HOST_BIT >= limit:
                raise ValueError(f"input id {hi - _HOST_BIT} is outside the vocabulary of "
                                 f"{vocab} ids")
        else:
            for value in words:
                if value & _HOST_BIT:
                    if value - _HOST_BIT >= limit:
                        raise ValueError(f"input id {value - _HOST_BIT} is outside the "
                                         f"vocabulary of {vocab} ids")
                elif value >= prev_rows:
                    raise ValueError(f"FeedSource.feed({value}) is beyond the previous step's "
                                     f"{prev_rows} rows")
    if masks is not None and vocab is not None:
        ids = _mask_words(masks)
        if ids and max(ids) >= vocab:
            for at, token in enumerate(ids):
                if vocab <= token != NO_TOKEN:  # the kernel's words, said before any launch
                    raise ValueError(f"mask id {token} of row {at // 2} is not below vocab {vocab}")


class _Ring:
    """Readback slots of ``max_rows`` ids in the model's pinned memory, one event each. Each slot
    has a generation, bumped when it is handed to a new step."""

    def __init__(self, model: ModelDeviceFeed, max_rows: int, slots: int) -> None:
        self.model = model
        self.nbytes = max_rows * 4
        self.ptrs: List[int] = []
        self.events: List[Any] = []
        self.busy = [False] * slots
        self.gen = [0] * slots
        # Per slot, the chosen ids' logprobs on the device and their pinned readback, made at
        # the first step that asks for them (docs/pipeline.md, "Logprobs").
        self.lp_dev: List[Any] = []
        self.lp_host: List[Any] = []
        self.top_dev: List[Any] = []  # and the top logprobs' records, MAX_TOP_LOGPROBS a row
        self.top_host: List[Any] = []
        try:
            for _ in range(slots):
                self.ptrs.append(model.alloc_host_pinned(self.nbytes))
                self.events.append(model.create_event())
        except BaseException:
            self.close()
            raise

    def acquire(self) -> int:
        for slot, busy in enumerate(self.busy):
            if not busy:
                return slot
        raise FeedError(f"readback ring exhausted: all {len(self.busy)} slots hold unread results; "
                        "await a ticket before launching another step")

    def logprobs(self, slot: int) -> Tuple[Any, Any]:
        """The slot's logprobs buffers (device, pinned), made for every slot at the first call."""
        if not self.lp_dev:
            self.lp_dev, self.lp_host = self._pairs(self.nbytes)
        return self.lp_dev[slot], self.lp_host[slot]

    def _pairs(self, nbytes: int) -> Tuple[List[Any], List[Any]]:
        """A device and a pinned buffer of ``nbytes`` for every slot; on a failure, the ones made
        here are freed and nothing else (buffers made before may be in use by a step in flight)."""
        dev: List[Any] = []
        host: List[Any] = []
        try:
            for _ in range(len(self.busy)):
                dev.append(_core.DeviceBuffer(nbytes))
                host.append(_core.PinnedBuffer(nbytes))
        except BaseException:
            for buf in dev + host:
                buf.close()
            raise
        return dev, host

    def read_logprobs(self, slot: int, rows: int) -> List[float]:
        with memoryview(self.lp_host[slot]) as raw, raw.cast("f") as floats:
            return floats[:rows].tolist()

    def top(self, slot: int) -> Tuple[Any, Any]:
        """The slot's top-logprobs records (device, pinned), made for every slot at the first
        call: room for ``MAX_TOP_LOGPROBS`` 8-byte records a row."""
        if not self.top_dev:
            self.top_dev, self.top_host = self._pairs(self.nbytes * 2 * _core.MAX_TOP_LOGPROBS)
        return self.top_dev[slot], self.top_host[slot]

    def read_top(self, slot: int, count: int) -> Tuple[List[int], List[float]]:
        with memoryview(self.top_host[slot]) as raw, raw.cast("I") as words, \
                raw.cast("f") as floats:
            return words[0:2 * count:2].tolist(), floats[1:2 * count:2].tolist()

    def _close_logprobs(self) -> None:
        for buf in self.lp_dev + self.lp_host + self.top_dev + self.top_host:
            buf.close()
        self.lp_dev, self.lp_host, self.top_dev, self.top_host = [], [], [], []

    def close(self) -> None:
        self._close_logprobs()
        for event in self.events:
            self.model.destroy_event(event)
        for ptr in self.ptrs:
            self.model.free_host_pinned(ptr, self.nbytes)
        self.events, self.ptrs = [], []


class _DeviceIo:
    """What both routers share: the ring, the KV budget (with its ledger of reservations), the
    launch and the teardown. ``AsyncDeviceIo`` lets steps run ahead; ``SyncDeviceIo`` settles
    each one."""

    _ring: Optional[_Ring] = None  # so __del__ of a half-made router finds nothing to free

    def _init_state(self, model: ModelDeviceFeed, max_rows: int, stream: Any, slots: int) -> None:
        max_rows = index(max_rows)
        if not 1 <= max_rows <= _core.MAX_ROWS:
            raise ValueError(f"max_rows must be in [1, {_core.MAX_ROWS}], got {max_rows}")
        self.model = model
        self.max_rows = max_rows
        self.stream = stream
        # What the model declares, read once: its vocabulary for the checks before a launch, its
        # block size and pool for the budget. A model that declares nothing is checked by its
        # own calls.
        self.info: Optional[FeedInfo] = (feed_info_of(model) if isinstance(model, DescribesFeed)
                                         else None)
        info = self.info
        self.budget = KvBudget(model, info.block_size if info else None,
                               info.pool if info else None)
        self.stats = RouterStats(self.budget)
        self._vocab: Optional[int] = info.vocab if info else None
        self._host_decode = isinstance(model, HostTokenDecode)
        self._defers = isinstance(model, DefersForward)
        self._feeds_steps = bool(info and info.step)
        self._prev_rows = 0  # the rows of the last launch: the feed rows the next one may read
        self._ring = _Ring(model, max_rows, slots)
        self._step = 0
        self._unread = 0

    # ---- launches ----

    def launch(self, inputs: Sequence[int], seqs: Sequence[SequenceState], masks: Any = None, *,
               fed: bool, params: Any = None, trusted: bool = False, hook: Any = None,
               logprobs: bool = False, top_n: int = 0, grammar: Any = None,
               bitmask: Any = None) -> Ticket:
        """Launch one step: ``launch_fed`` (``fed=True``) or ``launch_decode`` (``fed=False``).

        The one launch path: ``launch_fed``, ``launch_decode`` and the decode pipeline all come
        here.

        Parameters
        ----------
        inputs : sequence of int
            FeedSource words (``fed``) or host ids, one per row.
        seqs : sequence of SequenceState
        masks : sequence of (int, int), uint32 buffer, or None
        fed : bool
            Whether the inputs are resolved on the device.
        params : numpy.ndarray, optional
            One ``SAMPLING_PARAMS_DTYPE`` record per row (the model's ``sample_batch_to_feed``
            answers the step); None: the argmax.
        trusted : bool, optional
            The caller (the decode pipeline) built inputs, masks and params from values it
            checked once, and reserved every row's block through this router's ``budget``: the
            per-row checks and the budget's ``cover`` are skipped.
        hook : optional
            The decode pipeline's penalties (docs/penalties.md), or None:
            ``hook.apply(logits, stream)`` is queued between the forward and the feed method and
            ``hook.update(stream)`` after it, or, when ``hook.fused``, the feed method takes
            ``penalties=hook.launch`` and queues both itself; with ``logprobs`` too,
            ``hook.snapshot(logits, rows, stream)`` first, passed as ``raw_logits``.
        logprobs : bool, optional
            The feed method also writes each row's chosen-token logprob into the slot's
            logprobs buffers, copied back with the ids before the event; ``await_result`` sets
            ``ticket.logprobs``.
        top_n : int, optional
            With ``logprobs``: each row's ``top_n`` most likely ids too (``ticket.top``).
        grammar : tuple, optional
            ``(automaton, states, scratch)`` for the feed method's ``grammar=`` (docs/kernels.md,
            "Grammar in a pick"; the decode pipeline's, docs/pipeline.md, "Structured
            outputs"), given only to a model whose ``FeedInfo.grammar`` says it takes it.
        bitmask : callable, optional
            Called once the forward is queued (so the device runs it while the host works),
            before anything else of the step; it returns the step's bitmask (device int32 words,
            ``ceil(vocab / 32)`` a row), passed to the feed method as ``bitmask=``: the decode
            pipeline's host grammars (docs/pipeline.md, "Structured outputs"), given only to a
            model whose ``FeedInfo.bitmask`` says it takes it.

        Returns
        -------
        Ticket

        Raises
        ------
        ValueError, TypeError, FeedError, KvPoolExhausted
            As ``launch_fed`` and ``launch_decode`` say. A refused launch leaves the pool and
            every block table as they were.
        """
        ring = self._ring  # the checks of launch and await_result are inline: they run each step
        if ring is None:
            raise FeedError("the router has been torn down")
        rows = len(seqs)
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"a step takes 1 to {self.max_rows} rows, got {rows}")
        if masks is None:  # the shared buffer of unused masks: no count to read, no id to check
            masks = unmasked(rows)
            mask_rows = rows
        else:
            mask_rows = _mask_rows(masks, rows)
        if len(inputs) != rows or mask_rows != rows:
            raise ValueError(f"{len(inputs)} inputs and {mask_rows} masks for {rows} rows")
        if not fed and not self._host_decode:
            require(self.model, "launch_decode", HostTokenDecode)
        if not trusted:
            _check_inputs(fed, inputs, None if masks is _UNMASKED.get(rows) else masks,
                          self._vocab, self._prev_rows)
            if params is not None:
                _checks.records(params, rows)
        slot = ring.acquire()  # before anything is launched: exhaustion launches nothing
        model = self.model
        # The blocks the rows still lack come from the budget, before the model's step: the
        # model takes none itself, so a step it refuses is undone here, exactly.
        covered = () if trusted else self.budget.cover(seqs)
        try:
            if fed:
                logits = model.decode_batch_fed(inputs, seqs, self.stream)
            else:
                logits = model.decode_batch(inputs, seqs, self.stream)  # type: ignore[attr-defined]
        except BaseException:
            if covered:
                self.budget.uncover(covered)  # type: ignore[arg-type]
            raise
        try:
            bits = raw = fused = lp = lp_dst = top = top_dst = None
            if bitmask is not None:
                if self._defers:  # the forward runs on the device while the host fills the mask
                    model.flush_forward(self.stream)  # type: ignore[attr-defined]
                bits = bitmask()
            if hook is not None:
                if self._defers:  # the logits must hold this step's forward before they change
                    model.flush_forward(self.stream)  # type: ignore[attr-defined]
                if logprobs:  # the raw logits, before the penalties change them
                    raw = hook.snapshot(logits, rows, self.stream)
                if hook.fused:  # the feed method queues the apply and the update itself
                    fused = hook.launch
                else:
                    hook.apply(logits, self.stream)
            if logprobs:
                lp, lp_dst = ring.logprobs(slot)
                if top_n:
                    top, top_dst = ring.top(slot)
            # The step, built once: the model's pick_to_feed takes it whole; a model without one
            # gets the trait's call with the keywords the step sets.
            step = _router_step("argmax" if params is None else "sample", logits, masks, params,
                                ring.ptrs[slot], ring.events[slot], self.stream, lp, lp_dst, top,
                                top_dst, top_n if top is not None else 0, raw, fused, grammar,
                                bits)
            if self._feeds_steps:
                model.pick_to_feed(step)  # type: ignore[attr-defined]
            else:
                _feed_by_keywords(model, step)
            if hook is not None and not hook.fused:
                try:
                    hook.update(self.stream)
                except Exception as exc:  # after the pick: retrying would count it twice
                    raise _ran_in_part("the penalties' count update", exc) from exc
        except BaseException:
            if not fed:  # decode_batch pushed the inputs: a step that never ran pushes nothing
                for seq in seqs:
                    seq._undo_push()
            if covered:
                self.budget.uncover(covered)  # type: ignore[arg-type]
            raise
        ring.busy[slot] = True
        ring.gen[slot] += 1
        ticket = Ticket(self._step, slot, rows, fed, self, ring.gen[slot], logprobs, top_n)
        self._step += 1
        self._prev_rows = rows
        if self._unread:
            self.stats.ahead_launches += 1
        self._unread += 1
        self.stats.launches += 1
        ticket.reservations = self.budget.attach(ticket.step)
        return ticket

    def launch_decode(self, tokens: Sequence[int], seqs: Sequence[SequenceState], masks: Any, *,
                      params: Any = None) -> Ticket:
        """Launch a step whose input ids the host knows (a first step, or after a settle).

        The model's ``decode_batch`` pushes each id to its sequence and advances ``seq_len``.

        Parameters
        ----------
        tokens : sequence of int
            One input id per row.
        seqs : sequence of SequenceState
            The rows' sequences, as many as ``tokens``.
        masks : sequence of (int, int), uint32 buffer, or None
            Two banned ids per row (``NO_TOKEN`` where unused); None bans nothing.
        params : numpy.ndarray, optional
            One ``SAMPLING_PARAMS_DTYPE`` record per row: the step's ids are drawn by the
            model's ``sample_batch_to_feed`` (docs/kernels.md, "Sampling"). None (the default):
            the argmax, by ``argmax_batch_to_feed``. Read before the call returns.

        Returns
        -------
        Ticket
            Pass it to ``await_result``.

        Raises
        ------
        ValueError
            No rows, more than ``max_rows``, row counts that disagree, ids outside the
            model's vocabulary, or fewer params than rows; nothing is launched.
        TypeError
            ``params`` that are not ``SAMPLING_PARAMS_DTYPE`` records; nothing is launched.
        FeedError
            Every readback slot holds an unread result, or the router was torn down.
        KvPoolExhausted
            The model found no free KV block.
        """
        return self.launch(tokens, seqs, masks, fed=False, params=params)

    def launch_fed(self, sources: Sequence[int], seqs: Sequence[SequenceState], masks: Any, *,
                   params: Any = None) -> Ticket:
        """Launch a step whose inputs are resolved on the device from FeedSource words.

        ``FeedSource.feed(r)`` takes the id row ``r`` of the previous step wrote to the feed cells;
        ``FeedSource.host(id)`` an id the host supplies (a newly admitted row). The model writes KV at
        ``seq.seq_len`` but does not push the id: the caller appends it to ``seq.tokens`` and advances
        ``seq.seq_len`` once the previous step's result is read.

        Parameters
        ----------
        sources : sequence of int
            One FeedSource word per row.
        seqs : sequence of SequenceState
        masks : sequence of (int, int), uint32 buffer, or None
        params : numpy.ndarray, optional
            As for ``launch_decode``: sampling parameters per row, or None for the argmax.

        Returns
        -------
        Ticket

        Raises
        ------
        ValueError
            No rows, more than ``max_rows``, lengths that disagree, a ``from_row`` beyond the
            previous step's rows, or fewer params than rows; nothing is launched and no block
            is taken.
        TypeError
            ``params`` that are not ``SAMPLING_PARAMS_DTYPE`` records.
        FeedError
            The ring is exhausted, or the router was torn down.
        """
        return self.launch(sources, seqs, masks, fed=True, params=params)

    # ---- readback ----

    def _wait(self, event: Any) -> None:
        self.stats.host_syncs += 1
        model = self.model
        for _ in range(SPIN_QUERIES):
            if model.event_query(event):
                return
        model.event_synchronize(event)

    def peek(self, ticket: Ticket) -> List[int]:
        """The ids of a step still in flight, once its event has completed, without settling it
        (``await_result`` still reads it and settles it): one host sync, counted in
        ``host_syncs``. The decode pipeline's host grammars read the step before the one they
        fill a bitmask for (docs/pipeline.md, "Structured outputs").

        Raises
        ------
        FeedError
            As ``await_result``: a ticket of another router or one already awaited, or a failed
            wait.
        """
        ring = self._ring_of(ticket)
        self._wait(ring.events[ticket.slot])
        return _core.read_pinned_u32(ring.ptrs[ticket.slot], ticket.rows)

    def _ring_of(self, ticket: Ticket) -> Any:
        """The ring whose slot ``ticket`` holds, unawaited; FeedError otherwise."""
        ring = self._ring
        if ring is None:
            raise FeedError("the router has been torn down")
        if not isinstance(ticket, Ticket) or ticket.router is not self:
            raise FeedError(f"{ticket!r} was not launched by this router")
        if not ring.busy[ticket.slot] or ring.gen[ticket.slot] != ticket.gen:
            raise FeedError(f"{ticket!r} was already awaited")
        return ring

    def await_result(self, ticket: Ticket) -> List[int]:
        """The step's ids, one per row, once its event has completed.

        It polls ``event_query`` a bounded number of times, then blocks in ``event_synchronize`` with
        the GIL released. The slot is released even when the wait fails, so a fault cannot wedge the
        ring.

        Parameters
        ----------
        ticket : Ticket
            From this router's ``launch_decode`` or ``launch_fed``, not yet awaited.

        Returns
        -------
        list of int
            The argmax of each row (``NO_TOKEN`` for a row with no candidate).

        Raises
        ------
        FeedError
            A ticket of another router, one already awaited (even when its slot now holds a
            newer step), or a failed wait.
        """
        ring = self._ring_of(ticket)
        try:
            self._wait(ring.events[ticket.slot])
            ids = _core.read_pinned_u32(ring.ptrs[ticket.slot], ticket.rows)
            if ticket.logprobs is not None:
                ticket.logprobs = ring.read_logprobs(ticket.slot, ticket.rows)
                if ticket.top_n:
                    ticket.top = ring.read_top(ticket.slot, ticket.rows * ticket.top_n)
        finally:
            ring.busy[ticket.slot] = False
            self._unread -= 1
        # Settled: its reservations leave the ledger. After a failed wait they stay, so the
        # scheduler can roll back exactly that step's blocks for the rows it gives up on.
        if ticket.reservations:
            self.budget.commit(ticket.reservations)
        if ticket.fed:
            self.model.fed_step_settled()
        return ids

    # ---- KV ----

    def reserve_kv(self, seq: SequenceState) -> int:
        """Reserve the KV block for ``seq``'s next position ahead of a launch.

        The reservation is written in the router's ledger, so ``rollback(seq)`` can return exactly it
        when the step is discarded.

        Parameters
        ----------
        seq : SequenceState

        Returns
        -------
        int
            Blocks added, 0 or 1.

        Raises
        ------
        KvPoolExhausted
            The pool is empty; nothing is recorded.
        FeedError
            The router was torn down.
        """
        if self._ring is None:
            raise FeedError("the router has been torn down")
        return self.budget.reserve(seq)

    def rollback(self, seq: SequenceState) -> int:
        """Return ``seq``'s latest uncommitted reservation (its discarded step) to the pool.

        Returns
        -------
        int
            The blocks returned (0 when that step needed no new block).
        """
        return self.budget.rollback(seq)

    def drop(self, seq: SequenceState) -> int:
        """Roll back every uncommitted reservation of ``seq``, newest first (all its steps in
        flight are discarded: the row finished, was aborted or preempted); the blocks returned."""
        return self.budget.drop(seq)

    # ---- teardown ----

    def teardown(self) -> None:
        """Destroy the events and free the ring, after any step still in flight. Idempotent; also
        what leaving a ``with`` block does.
        """
        ring = self._ring
        if ring is None:
            return
        self._ring = None
        try:
            for slot, busy in enumerate(ring.busy):
                if busy:  # the copy into this slot may still be running
                    self.stats.host_syncs += 1
                    self.model.event_synchronize(ring.events[slot])
        finally:
            ring.close()

    def __del__(self) -> None:
        # A router dropped without teardown() would leak its events and pinned ring.
        if self._ring is not None:
            try:
                warnings.warn(f"{type(self).__name__} was not torn down; tearing down on "
                              "collection (call teardown() or use it as a context manager)",
                              ResourceWarning, stacklevel=2)
                self.teardown()
            except Exception:
                pass  # interpreter shutdown: the runtime may be gone already

    def __enter__(self: _IoT) -> _IoT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


_IoT = TypeVar("_IoT", bound=_DeviceIo)


class AsyncDeviceIo(_DeviceIo):
    """Pipelines decode steps through ``model``, up to two steps in flight.

    Each launch runs the model's step and the masked argmax into its feed cells, copies the ids
    into one slot of a three-slot page-locked readback ring and records that slot's event;
    ``await_result`` reads a slot only once its event has completed. The protocol is in
    docs/router.md, "The router protocol".

    Parameters
    ----------
    model : ModelDeviceFeed
        A model whose ``supports_device_token_feed()`` is True (``RuntimeFeedMixin`` supplies the
        runtime half).
    max_rows : int
        The most rows a step may have, 1 to ``metrale_feed.MAX_ROWS`` (4096); sizes the ring.
    stream : Stream, int or stream-like, optional
        The stream of the readback copies and events. Default 0.
    slots : int, optional
        Readback slots; the default 3 is two steps in flight plus the one being read.

    Raises
    ------
    FeedError
        The model has no device token feed.
    ValueError
        ``max_rows`` outside 1..``MAX_ROWS``.

    See Also
    --------
    SyncDeviceIo : the same calls, every step settled.

    Examples
    --------
    The loop two steps deep: step ``k + 1`` is launched from step ``k``'s feed cells before step
    ``k`` is read (docs/router.md, "The loop, two steps deep", has the version with the checks).

    >>> import metrale_feed as mf
    >>> from metrale_feed.testing.reference import ReferenceModel
    >>> model = ReferenceModel(1000, max_rows=2)
    >>> seqs = [mf.SequenceState(0), mf.SequenceState(1)]
    >>> prompts = [[5, 6, 7], [8, 9]]
    >>> for seq, prompt in zip(seqs, prompts):
    ...     model.prefill(seq, prompt[:-1])
    >>> masks, out = [(mf.NO_TOKEN, mf.NO_TOKEN)] * 2, [[], []]
    >>> with mf.AsyncDeviceIo(model, 2) as io:
    ...     ticket = io.launch_decode([p[-1] for p in prompts], seqs, masks)
    ...     for step in range(4):
    ...         ahead = None
    ...         if step < 3:
    ...             for seq in seqs:
    ...                 _ = io.reserve_kv(seq)
    ...             ahead = io.launch_fed([mf.FeedSource.feed(0), mf.FeedSource.feed(1)], seqs, masks)
    ...         for r, token in enumerate(io.await_result(ticket)):
    ...             out[r].append(token)
    ...             if ahead is not None:   # the step ahead wrote this id's KV: commit it
    ...                 seqs[r].tokens.append(token)
    ...                 seqs[r].seq_len += 1
    ...         ticket = ahead
    >>> model.close()
    >>> [len(tokens) for tokens in out]
    [4, 4]
    """

    def __init__(self, model: ModelDeviceFeed, max_rows: int, *, stream: Any = 0,
                 slots: int = RING_SLOTS) -> None:
        if not model.supports_device_token_feed():
            raise FeedError("AsyncDeviceIo needs a model whose supports_device_token_feed() is True")
        self._init_state(model, max_rows, stream, slots)


class SyncDeviceIo(_DeviceIo):
    """The router's calls with every step settled before the launch returns: no step is ahead.

    It works with models that lack the device feed (through ``launch_decode``), and is the baseline
    ``metrale-feed demo`` compares the async router with.

    Parameters
    ----------
    model : ModelDeviceFeed
    max_rows : int
        1 to ``metrale_feed.MAX_ROWS`` (4096).
    stream : Stream, int or stream-like, optional

    Raises
    ------
    ValueError
        ``max_rows`` outside 1..``MAX_ROWS``.
    TypeError
        A model with neither the device feed nor ``decode_batch`` (``HostTokenDecode``).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> from metrale_feed.testing.reference import ReferenceModel, host_next_token
    >>> model = ReferenceModel(1000, max_rows=1)
    >>> seq = mf.SequenceState(0)
    >>> model.prefill(seq, [5, 6])
    >>> with mf.SyncDeviceIo(model, 1) as io:
    ...     ids = io.await_result(io.launch_decode([7], [seq], None))
    >>> model.close()
    >>> ids == [host_next_token([5, 6, 7], 1000)]
    True
    """

    def __init__(self, model: ModelDeviceFeed, max_rows: int, *, stream: Any = 0) -> None:
        # No feed check: a model without the device feed may still settle launch_decode steps,
        # which it must then declare (HostTokenDecode).
        if not model.supports_device_token_feed():
            require(model, "SyncDeviceIo over a model without the device feed", HostTokenDecode)
        self._init_state(model, max_rows, stream, 1)
        self._results: Dict[int, List[int]] = {}

    def launch(self, inputs: Sequence[int], seqs: Sequence[SequenceState], masks: Any = None, *,
               fed: bool, params: Any = None, trusted: bool = False, hook: Any = None,
               logprobs: bool = False, top_n: int = 0, grammar: Any = None,
               bitmask: Any = None) -> Ticket:
        if fed and not self.model.supports_device_token_feed():
            raise FeedError("launch_fed needs the device feed; with a settled step the inputs are "
                            "host-known, so use launch_decode")
        ticket = super().launch(inputs, seqs, masks, fed=fed, params=params, trusted=trusted,
                                hook=hook, logprobs=logprobs, top_n=top_n, grammar=grammar,
                                bitmask=bitmask)
        self._results[ticket.step] = super().await_result(ticket)
        self.stats.ahead_launches = 0
        return ticket

    def await_result(self, ticket: Ticket) -> List[int]:
        if not isinstance(ticket, Ticket) or ticket.router is not self:
            raise FeedError(f"{ticket!r} was not launched by this router")
        try:
            ids: List[int] = self._results.pop(ticket.step)
            return ids
        except KeyError:
            raise FeedError(f"{ticket!r} was already awaited") from None


_UNMASKED: Dict[int, memoryview] = {}
_NO_EXTRA: Dict[str, Any] = {}  # never written: the feed methods' keywords of a plain step
#: The keywords of the trait's feed methods a step may set: passed only when set, since a model's
#: feed methods may not take them (FeedInfo says which it does).
_STEP_KEYWORDS = ("logprobs", "logprobs_dst", "top_logprobs", "top_logprobs_dst", "raw_logits",
                  "penalties", "grammar", "bitmask")


def _feed_by_keywords(model: Any, step: "_core.PickStep") -> None:
    """A step handed to a model without ``pick_to_feed``: the trait's ``argmax_batch_to_feed`` or
    ``sample_batch_to_feed``, with the keywords the step sets."""
    extra = _NO_EXTRA  # read only: a plain step passes no keywords
    if (step.logprobs is not None or step.raw_logits is not None or step.penalties is not None
            or step.grammar is not None or step.bitmask is not None):
        extra = {name: value for name in _STEP_KEYWORDS
                 if (value := getattr(step, name)) is not None}
        if step.top_logprobs is not None:
            extra["top_n"] = step.top_n
    if step.params is None:
        model.argmax_batch_to_feed(step.logits, step.masks, step.dst, step.event, step.stream,
                                   **extra)
    else:
        model.sample_batch_to_feed(step.logits, step.params, step.masks, step.dst, step.event,
                                   step.stream, **extra)


def unmasked(rows: int) -> memoryview:
    """A read-only uint32 buffer of ``rows`` unused masks, made once per row count: a step with
    no ban passes it and skips the mask checks (it cannot change)."""
    words = _UNMASKED.get(rows)
    if words is None:
        words = _UNMASKED[rows] = memoryview(b"\xff" * (8 * rows)).cast("I")
    return words
