"""``KvBudget``: the one owner of KV block reservations while steps are in flight (docs/pipeline.md,
"Who owns what").

A router owns one; the decode pipeline asks its router's. Every block a decode step needs is taken
here, through the model's ``reserve_decode_block``, before the model's step is called (the model
only checks that the block is there), and every block of a discarded step is given back here. So
the counters (reserved, in flight, its peak, rollbacks) have one writer, and a refused launch
leaves the pool and every block table as they were.

Two ways to account for a reservation, for two callers:

- the **ledger** (``reserve``, ``cover``, ``attach``, ``commit``, ``rollback``, ``drop``): per
  sequence, its uncommitted reservations in launch order, so ``rollback(seq)`` returns exactly the
  latest one. The router's public calls use it.
- **by the step** (``take``, ``take_many``, ``settle``, ``discard``): the pipeline knows the block size, so it
  knows which launch each block is for; it counts a step's blocks itself and settles or discards
  them as a whole. A discarded step's block always leaves with its request (``free``), so there is
  no single entry to find.

A speculative step (docs/speculative.md) writes up to ``2k + 2`` positions past a row's committed
ones: ``extend`` covers them (through the model's ``reserve_blocks_through``, all or none) and
``trim`` gives back the blocks that hold only rejected positions once the step's counts are read.
The model's block calls are made from here only.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import KvPoolExhausted
from ..kv import SequenceState

__all__ = ["KvBudget", "Reservation"]


class Reservation:
    """One ledger entry: the blocks ``reserve`` added to ``seq`` for one step (0 or 1), and that
    step's number (None until the launch that uses it)."""

    __slots__ = ("seq", "step", "blocks")

    def __init__(self, seq: SequenceState, blocks: int) -> None:
        self.seq = seq
        self.step: Optional[int] = None
        self.blocks = blocks

    def __repr__(self) -> str:
        return f"Reservation(step={self.step}, blocks={self.blocks})"


class KvBudget:
    """Reserves, rolls back and counts the KV blocks of steps in flight.

    Parameters
    ----------
    model : ModelDeviceFeed
        Its ``reserve_decode_block`` and ``release_decode_blocks`` move the blocks.
    block_size : int, optional
        From the model's ``FeedInfo``: with it ``cover`` asks the model only for the rows that
        lack their block.
    pool : BlockPool, optional
        From the model's ``FeedInfo``: ``free_count`` and ``num_blocks`` read it.

    Attributes
    ----------
    reserved_blocks, reserved_in_flight, peak_reserved_in_flight, rollbacks, blocks_rolled_back
        The counters (``RouterStats`` and ``PipelineStats`` read them).
    """

    __slots__ = ("model", "block_size", "pool", "reserved_blocks", "reserved_in_flight",
                 "peak_reserved_in_flight", "rollbacks", "blocks_rolled_back", "_ledger",
                 "_pending", "_peak_before")

    def __init__(self, model: Any, block_size: Optional[int] = None, pool: Any = None) -> None:
        self.model = model
        self.block_size = block_size
        self.pool = pool
        self.reserved_blocks = 0
        self.reserved_in_flight = 0
        self.peak_reserved_in_flight = 0
        self.rollbacks = 0
        self.blocks_rolled_back = 0
        self._ledger: Dict[SequenceState, List[Reservation]] = {}
        self._pending: List[Reservation] = []  # reserved since the last launch
        self._peak_before = 0  # the peak before the last cover, for its uncover

    @property
    def free_count(self) -> Optional[int]:
        """Free blocks of the pool, None when the model declares none."""
        return None if self.pool is None else self.pool.free_count

    def _count(self, added: int) -> None:
        self.reserved_blocks += added
        self.reserved_in_flight += added
        if self.reserved_in_flight > self.peak_reserved_in_flight:
            self.peak_reserved_in_flight = self.reserved_in_flight

    # ---- the ledger ----

    def _record(self, seq: SequenceState, added: int) -> Reservation:
        entry = Reservation(seq, added)
        entries = self._ledger.get(seq)
        if entries is None:
            self._ledger[seq] = [entry]
        else:
            entries.append(entry)
        self._pending.append(entry)
        return entry

    def reserve(self, seq: SequenceState) -> int:
        """The block for ``seq``'s next position, recorded (even when none was needed, so the
        latest entry is always this step's); the blocks added, 0 or 1. ``KvPoolExhausted``
        records nothing."""
        added: int = self.model.reserve_decode_block(seq)
        self._record(seq, added)
        if added:
            self._count(added)
        return added

    def reserve_many(self, seqs: Sequence[SequenceState]) -> int:
        """``reserve`` for each of ``seqs`` in order; the index of the first one the pool could
        not serve, or -1. The ones before it are reserved and recorded."""
        reserve = self.model.reserve_decode_block
        total = 0
        try:
            for at, seq in enumerate(seqs):
                try:
                    added = reserve(seq)
                except KvPoolExhausted:
                    return at
                self._record(seq, added)
                total += added
        finally:  # whatever else a model's reserve raised, the recorded blocks are counted
            if total:
                self._count(total)
        return -1

    def cover(self, seqs: Sequence[SequenceState]) -> List[Reservation]:
        """Before a launch: the block of each row's position ``seq_len`` that is still missing
        (a caller that did not ``reserve`` first), all or none. Only the rows given a block are
        recorded. Returns those entries, for ``uncover`` when the launch is refused."""
        bs = self.block_size
        reserve = self.model.reserve_decode_block
        added: List[Reservation] = []
        self._peak_before = self.peak_reserved_in_flight
        try:
            for seq in seqs:
                if bs is not None and seq.seq_len // bs < len(seq.block_table):
                    continue
                if reserve(seq):
                    added.append(self._record(seq, 1))
                    self._count(1)
        except BaseException:
            self.uncover(added)
            raise
        return added

    def uncover(self, entries: List[Reservation]) -> None:
        """Undo ``cover`` for a launch that never ran: its blocks back, its counts undone (no
        rollback is counted: there was no step)."""
        for entry in reversed(entries):
            self._unlink(entry)
            if entry.step is None:
                self._pending.remove(entry)
            self.model.release_decode_blocks(entry.seq, entry.blocks)
            self.reserved_blocks -= entry.blocks
            self.reserved_in_flight -= entry.blocks
        self.peak_reserved_in_flight = self._peak_before  # no step: no high-water mark either

    def attach(self, step: int) -> Sequence[Reservation]:
        """The entries reserved since the last launch, now that launch ``step`` uses them."""
        pending = self._pending
        if not pending:
            return ()  # never the pending list itself: it fills again for the next launch
        for entry in pending:
            entry.step = step
        self._pending = []
        return pending

    def _unlink(self, entry: Reservation) -> bool:
        entries = self._ledger.get(entry.seq)
        if not entries:
            return False
        for at, held in enumerate(entries):  # in launch order: a step's is nearly always first
            if held is entry:
                if len(entries) == 1:
                    del self._ledger[entry.seq]
                else:
                    del entries[at]
                return True
        return False

    def commit(self, entries: Sequence[Reservation]) -> None:
        """A step's reservations are kept: out of the ledger, no longer in flight."""
        released = 0
        for entry in entries:
            if self._unlink(entry):  # not rolled back already
                released += entry.blocks
        self.reserved_in_flight -= released

    def _return(self, seq: SequenceState, entry: Reservation) -> int:
        blocks = entry.blocks
        if blocks:
            self.model.release_decode_blocks(seq, blocks)
            self.reserved_in_flight -= blocks
            self.blocks_rolled_back += blocks
        self.rollbacks += 1
        return blocks

    def rollback(self, seq: SequenceState) -> int:
        """Return ``seq``'s latest uncommitted reservation (its discarded step); the blocks
        returned (0 when that step needed no new block)."""
        entries = self._ledger.get(seq)
        if not entries:
            self.rollbacks += 1
            return 0
        entry = entries.pop()
        if not entries:
            del self._ledger[seq]
        if entry.step is None:
            self._pending.remove(entry)
        return self._return(seq, entry)

    def drop(self, seq: SequenceState) -> int:
        """Roll back every uncommitted reservation of ``seq``, newest first; the blocks
        returned."""
        entries = self._ledger.pop(seq, None)
        if not entries:
            return 0
        blocks = 0
        for entry in reversed(entries):
            if entry.step is None:
                self._pending.remove(entry)
            blocks += self._return(seq, entry)
        return blocks

    # ---- by the step (the pipeline, with a known block size) ----

    def take(self, seq: SequenceState) -> int:
        """The block for ``seq``'s next position, counted in flight but not recorded: the caller
        settles or discards it with its step. ``KvPoolExhausted`` takes nothing."""
        added: int = self.model.reserve_decode_block(seq)
        if added:
            self._count(added)
        return added

    def take_many(self, seqs: Sequence[SequenceState]) -> Tuple[int, Sequence[int]]:
        """``take`` for each of ``seqs`` in order, counted once (a step's boundary rows, in one
        call). Returns ``(served, missed)``: the rows, from the first, whose block is there (all
        of them unless the pool ran dry at row ``served``, which takes nothing), and the indices
        among those that needed no new block (empty unless the model had it already). Any other
        error of the model's reserve gives back the blocks this call took, so the caller can ask
        again for the same rows."""
        reserve = self.model.reserve_decode_block
        missed: Sequence[int] = ()
        served = 0
        try:
            for served, seq in enumerate(seqs):
                if not reserve(seq):
                    if not missed:
                        missed = []
                    missed.append(served)  # type: ignore[attr-defined]
            served = len(seqs)
        except KvPoolExhausted:
            pass
        except BaseException:
            release = self.model.release_decode_blocks
            for at in range(served):
                if at not in missed:
                    release(seqs[at], 1)
            raise
        if served - len(missed):
            self._count(served - len(missed))
        return served, missed

    def untake(self, blocks: int) -> None:
        """``blocks`` taken for a launch that will not use them (their request was preempted
        before it): uncounted, as if never reserved (they go back with ``free``)."""
        self.reserved_blocks -= blocks
        self.reserved_in_flight -= blocks

    def settle(self, blocks: int) -> None:
        """``blocks`` taken for a step that was read: kept, no longer in flight."""
        self.reserved_in_flight -= blocks

    def discard(self, blocks: int) -> None:
        """``blocks`` taken for a step whose row was thrown away (they go back with ``free``)."""
        self.reserved_in_flight -= blocks
        self.rollbacks += blocks
        self.blocks_rolled_back += blocks

    # ---- by a speculative step ----

    def extend(self, seq: SequenceState, last: int) -> int:
        """Blocks until ``seq``'s table covers position ``last``, taken through the model's
        ``reserve_blocks_through`` (``ReservesAhead``) and counted as reserved; the blocks
        added. All or none: ``KvPoolExhausted`` leaves the pool, the table and the counters as
        they were (the caller preempts a row and asks again)."""
        added: int = self.model.reserve_blocks_through(seq, last)
        self.reserved_blocks += added
        return added

    def trim(self, seq: SequenceState, positions: int) -> int:
        """Give back the blocks of ``seq`` past its first ``positions`` positions (rejected
        drafts' KV); the blocks returned."""
        if self.block_size is None:
            raise ValueError("KvBudget.trim needs the block size")
        extra = len(seq.block_table) - -(-positions // self.block_size)
        if extra <= 0:
            return 0
        self.model.release_decode_blocks(seq, extra)
        return extra

    # ---- a sequence that leaves ----

    def free(self, seq: SequenceState) -> None:
        """Every block of ``seq`` back to the pool: its uncommitted reservations rolled back
        first, then the rest of its table (a finished, aborted or preempted sequence)."""
        self.drop(seq)
        if seq.block_table:
            self.model.release_decode_blocks(seq, len(seq.block_table))
