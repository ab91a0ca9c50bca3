"""The readback ring and the routers (docs/router.md, "The router protocol").

``AsyncDeviceIo`` keeps up to two decode steps in flight: each launch runs the model's step and
the masked argmax into the feed cells, copies the ids into one slot of a page-locked ring and
records that slot's event; ``await_result`` reads a slot only after its event has completed.
``SyncDeviceIo`` has the same calls and settles every step before returning.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _core
from .errors import FeedError
from .feed import NO_TOKEN
from .kv import SequenceState
from .trait import ModelDeviceFeed

__all__ = ["AsyncDeviceIo", "SyncDeviceIo", "RouterStats", "Ticket"]

RING_SLOTS = 3  # two steps in flight plus the one being read
SPIN_QUERIES = 64  # event_query polls before a wait blocks in event_synchronize


class RouterStats:
    """Counters of a router: ``launches``, ``ahead_launches`` (fed steps launched before the
    previous one was read), ``reserved_blocks``, ``reserved_in_flight``,
    ``peak_reserved_in_flight``, ``rollbacks`` and ``blocks_rolled_back``. ``stats["name"]`` and
    ``as_dict()`` read them.
    """
    __slots__ = ("launches", "ahead_launches", "reserved_blocks", "reserved_in_flight",
                 "peak_reserved_in_flight", "rollbacks", "blocks_rolled_back")
    # For type checkers only (set in __init__): counters, all ints.
    launches: int
    ahead_launches: int
    reserved_blocks: int
    reserved_in_flight: int
    peak_reserved_in_flight: int
    rollbacks: int
    blocks_rolled_back: int

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def __getitem__(self, name: str) -> int:
        if name not in self.__slots__:
            raise KeyError(name)
        value: int = getattr(self, name)
        return value

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __repr__(self) -> str:
        return f"RouterStats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


class Ticket:
    """A launched step: which slot holds its ids, how many rows, whether it was fed."""

    __slots__ = ("step", "slot", "rows", "fed", "reservations", "router")

    def __init__(self, step: int, slot: int, rows: int, fed: bool, router: Any = None) -> None:
        self.router = router  # the router that launched it: only that one can await it
        self.step = step
        self.slot = slot
        self.rows = rows
        self.fed = fed
        self.reservations: List[Tuple[SequenceState, List[Any]]] = []

    def __repr__(self) -> str:
        return f"Ticket(step={self.step}, slot={self.slot}, rows={self.rows}, fed={self.fed})"


def _mask_rows(masks: Any, rows: int) -> int:
    """Rows a masks argument covers, checked before the step so a mismatch launches nothing:
    None (no masks) covers any; a buffer holds two uint32 per row; a sequence one pair per row."""
    if masks is None:
        return rows
    try:
        view = memoryview(masks)
    except TypeError:
        return len(masks)
    with view:
        return view.nbytes // 8


class _Ring:
    """Readback slots of ``max_rows`` ids in the model's pinned memory, one event each."""

    def __init__(self, model: ModelDeviceFeed, max_rows: int, slots: int) -> None:
        self.model = model
        self.nbytes = max_rows * 4
        self.ptrs: List[int] = []
        self.events: List[Any] = []
        self.busy = [False] * slots
        try:
            for _ in range(slots):
                self.ptrs.append(model.alloc_host_pinned(self.nbytes))
                self.events.append(model.create_event())
        except BaseException:
            self.close()
            raise

    def acquire(self) -> int:
        for index, busy in enumerate(self.busy):
            if not busy:
                return index
        raise FeedError(f"readback ring exhausted: all {len(self.busy)} slots hold unread results; "
                        "await a ticket before launching another step")

    def close(self) -> None:
        for event in self.events:
            self.model.destroy_event(event)
        for ptr in self.ptrs:
            self.model.free_host_pinned(ptr, self.nbytes)
        self.events, self.ptrs = [], []


class AsyncDeviceIo:
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
        The most rows a step may have, 1 to 4096; sizes the ring.
    stream : Stream, int or stream-like, optional
        The stream of the readback copies and events. Default 0.
    slots : int, optional
        Readback slots; the default 3 is two steps in flight plus the one being read.

    Raises
    ------
    FeedError
        The model has no device token feed.
    ValueError
        ``max_rows`` outside 1..4096.

    See Also
    --------
    SyncDeviceIo : the same calls, every step settled.

    Examples
    --------
    The loop two steps deep: step ``k + 1`` is launched from step ``k``'s feed cells before step
    ``k`` is read (docs/router.md, "The loop, two steps deep", has the version with the checks).

    >>> import metrale_feed as mf
    >>> from metrale_feed.reference import ReferenceModel
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
        if not 1 <= max_rows <= _core.MAX_ROWS:
            raise ValueError(f"max_rows must be in [1, {_core.MAX_ROWS}], got {max_rows}")
        self._init_state(model, max_rows, stream, slots)

    def _init_state(self, model: ModelDeviceFeed, max_rows: int, stream: Any, slots: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.stream = stream
        self.stats = RouterStats()
        self._ring: Optional[_Ring] = _Ring(model, max_rows, slots)
        self._step = 0
        self._unread = 0
        # The ledger: per sequence, [step, blocks] of each uncommitted reservation, oldest first;
        # step is None until the launch that uses it.
        self._ledger: Dict[SequenceState, List[List[Any]]] = {}
        self._pending: List[Tuple[SequenceState, List[Any]]] = []  # reserved since the last launch

    # ---- launches ----

    def _open_ring(self) -> _Ring:
        if self._ring is None:
            raise FeedError("the router has been torn down")
        return self._ring

    def _launch(self, fed: bool, inputs: Sequence[int], seqs: Sequence[SequenceState],
                masks: Any) -> Ticket:
        ring = self._open_ring()
        rows = len(seqs)
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"a step takes 1 to {self.max_rows} rows, got {rows}")
        if masks is None:
            masks = [(NO_TOKEN, NO_TOKEN)] * rows
        mask_rows = _mask_rows(masks, rows)
        if len(inputs) != rows or mask_rows != rows:
            raise ValueError(f"{len(inputs)} inputs and {mask_rows} masks for {rows} rows")
        slot = ring.acquire()  # before anything is launched: exhaustion launches nothing
        model = self.model
        if fed:
            logits = model.decode_batch_fed(inputs, seqs, self.stream)
        else:
            logits = model.decode_batch(inputs, seqs, self.stream)  # type: ignore[attr-defined]
        try:
            model.argmax_batch_to_feed(logits, masks, ring.ptrs[slot], ring.events[slot], self.stream)
        except BaseException:
            if not fed:  # decode_batch pushed the inputs: a step that never ran pushes nothing
                for seq in seqs:
                    seq.tokens.pop()
                    seq.seq_len -= 1
            raise
        ring.busy[slot] = True
        ticket = Ticket(self._step, slot, rows, fed, self)
        self._step += 1
        if self._unread:
            self.stats.ahead_launches += 1
        self._unread += 1
        self.stats.launches += 1
        for _seq, entry in self._pending:
            entry[0] = ticket.step
        ticket.reservations, self._pending = self._pending, []
        return ticket

    def launch_decode(self, tokens: Sequence[int], seqs: Sequence[SequenceState], masks: Any) -> Ticket:
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

        Returns
        -------
        Ticket
            Pass it to ``await_result``.

        Raises
        ------
        ValueError
            No rows, more than ``max_rows``, or lengths that disagree; nothing is launched.
        FeedError
            Every readback slot holds an unread result, or the router was torn down.
        KvPoolExhausted
            The model found no free KV block.
        """
        return self._launch(False, tokens, seqs, masks)

    def launch_fed(self, sources: Sequence[int], seqs: Sequence[SequenceState], masks: Any) -> Ticket:
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

        Returns
        -------
        Ticket

        Raises
        ------
        ValueError
            No rows, more than ``max_rows``, lengths that disagree, or a ``from_row`` beyond the
            previous step's rows; nothing is launched.
        FeedError
            The ring is exhausted, or the router was torn down.
        """
        return self._launch(True, sources, seqs, masks)

    # ---- readback ----

    def _wait(self, event: Any) -> None:
        model = self.model
        for _ in range(SPIN_QUERIES):
            if model.event_query(event):
                return
        model.event_synchronize(event)

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
            A ticket of another router, one already awaited, or a failed wait.
        """
        ring = self._open_ring()
        if not isinstance(ticket, Ticket) or ticket.router is not self:
            raise FeedError(f"{ticket!r} was not launched by this router")
        if not ring.busy[ticket.slot]:
            raise FeedError(f"{ticket!r} was already awaited")
        try:
            self._wait(ring.events[ticket.slot])
            ids = _core.read_pinned_u32(ring.ptrs[ticket.slot], ticket.rows)
        finally:
            ring.busy[ticket.slot] = False
            self._unread -= 1
        # Settled: its reservations leave the ledger. After a failed wait they stay, so the
        # scheduler can roll back exactly that step's blocks for the rows it gives up on.
        if ticket.reservations:
            self._commit(ticket.reservations)
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
            The pool is empty.
        FeedError
            The router was torn down.
        """
        if self._ring is None:
            raise FeedError("the router has been torn down")
        added = self.model.reserve_decode_block(seq)
        # Recorded even when no block was needed, so the latest entry is always this step's.
        entry = [None, added]
        entries = self._ledger.get(seq)
        if entries is None:
            self._ledger[seq] = [entry]
        else:
            entries.append(entry)
        self._pending.append((seq, entry))
        if added:
            stats = self.stats
            stats.reserved_blocks += added
            stats.reserved_in_flight += added
            if stats.reserved_in_flight > stats.peak_reserved_in_flight:
                stats.peak_reserved_in_flight = stats.reserved_in_flight
        return added

    def _commit(self, reservations: List[Tuple[SequenceState, List[Any]]]) -> None:
        """A step's reservations are kept: out of the ledger, no longer rollback candidates."""
        ledger = self._ledger
        released = 0
        for seq, entry in reservations:
            entries = ledger.get(seq)
            if not entries:
                continue  # rolled back already
            # Entries are in launch order, so a step's is nearly always the oldest.
            for index, held in enumerate(entries):
                if held is entry:
                    released += entry[1]
                    if len(entries) == 1:
                        del ledger[seq]
                    else:
                        del entries[index]
                    break
        self.stats.reserved_in_flight -= released

    def rollback(self, seq: SequenceState) -> int:
        """Return ``seq``'s latest uncommitted reservation to the pool (its step ahead is discarded).

        Parameters
        ----------
        seq : SequenceState
            A row that stopped while its next step was already launched.

        Returns
        -------
        int
            Blocks returned (0 when that step needed no new block).
        """
        entries = self._ledger.get(seq)
        blocks = entries.pop()[1] if entries else 0
        if entries is not None and not entries:
            del self._ledger[seq]
        if blocks:
            self.model.release_decode_blocks(seq, blocks)
            self.stats.reserved_in_flight -= blocks
            self.stats.blocks_rolled_back += blocks
        self.stats.rollbacks += 1
        return blocks

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
                    self.model.event_synchronize(ring.events[slot])
        finally:
            ring.close()

    def __enter__(self) -> "AsyncDeviceIo":
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()


class SyncDeviceIo(AsyncDeviceIo):
    """The router's calls with every step settled before the launch returns: no step is ahead.

    It works with models that lack the device feed (through ``launch_decode``), and is the baseline
    ``metrale-feed demo`` compares the async router with.

    Parameters
    ----------
    model : ModelDeviceFeed
    max_rows : int
        1 to 4096.
    stream : Stream, int or stream-like, optional

    Raises
    ------
    ValueError
        ``max_rows`` outside 1..4096.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> from metrale_feed.reference import ReferenceModel, host_next_token
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
        # No feed check: a model without the device feed may still settle launch_decode steps.
        self._init_state(model, max_rows, stream, 1)
        self._results: Dict[int, List[int]] = {}

    def _launch(self, fed: bool, inputs: Sequence[int], seqs: Sequence[SequenceState],
                masks: Any) -> Ticket:
        if fed and not self.model.supports_device_token_feed():
            raise FeedError("launch_fed needs the device feed; with a settled step the inputs are "
                            "host-known, so use launch_decode")
        ticket = super()._launch(fed, inputs, seqs, masks)
        self._results[ticket.step] = super().await_result(ticket)
        self.stats.ahead_launches = 0
        return ticket

    def await_result(self, ticket: Ticket) -> List[int]:
        try:
            return self._results.pop(ticket.step)
        except KeyError:
            raise FeedError(f"{ticket!r} was already awaited") from None
