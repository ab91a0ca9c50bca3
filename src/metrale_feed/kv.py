"""KV-cache bookkeeping (docs/router.md, "KV bookkeeping"; docs/pipeline.md): sequences, block
tables, the pool, and ``PagedKvMixin``, the paged-KV half of a model that the reference model, the
Hugging Face example and the bench share."""

from __future__ import annotations

from operator import index
from typing import Any, List, Sequence

from .errors import FeedError, KvPoolExhausted

__all__ = ["SequenceState", "BlockPool", "PagedKvMixin", "KvPoolExhausted"]


class SequenceState:
    """One sequence's KV state: what the scheduler and the model share.

    Attributes
    ----------
    slot_idx : int
        The row slot the scheduler gave it.
    tokens : list of int
        The ids whose KV is written, in order.
    seq_len : int
        The next position to write.
    block_table : list of int
        Block ids of its KV, in order.

    Parameters
    ----------
    slot_idx : int

    Examples
    --------
    >>> from metrale_feed import SequenceState
    >>> SequenceState(0)
    SequenceState(slot_idx=0, seq_len=0, blocks=0)
    """

    __slots__ = ("slot_idx", "tokens", "seq_len", "block_table", "__weakref__")

    def __init__(self, slot_idx: int) -> None:
        self.slot_idx = slot_idx
        self.tokens: List[int] = []
        self.seq_len = 0
        self.block_table: List[int] = []

    def _undo_push(self) -> None:
        """Take back a host-token step's push (``decode_batch`` pushed its input and advanced
        ``seq_len``) when the step never ran. A scheduler's view of its own tokens overrides it."""
        self.tokens.pop()
        self.seq_len -= 1

    def __repr__(self) -> str:
        return (f"SequenceState(slot_idx={self.slot_idx}, seq_len={self.seq_len}, "
                f"blocks={len(self.block_table)})")


class BlockPool:
    """Hands out KV block ids ``0 .. num_blocks - 1``, lowest first, so runs are reproducible.

    Parameters
    ----------
    num_blocks : int
        1 to 2**31.

    Raises
    ------
    ValueError
        ``num_blocks`` out of range.

    Examples
    --------
    >>> from metrale_feed import BlockPool
    >>> pool = BlockPool(2)
    >>> pool.alloc(), pool.alloc(), pool.free_count
    (0, 1, 0)
    >>> pool.free(0); pool.free_count
    1
    """

    def __init__(self, num_blocks: int) -> None:
        num_blocks = index(num_blocks)  # an int, never a truncated float
        if not 1 <= num_blocks <= 1 << 31:
            raise ValueError(f"num_blocks must be in [1, 2**31] (ids are uint32), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest
        self._used = bytearray(num_blocks)

    @property
    def free_count(self) -> int:
        """Blocks not handed out.
        """
        return len(self._free)

    def alloc(self) -> int:
        """Take the lowest free block.

        Returns
        -------
        int

        Raises
        ------
        KvPoolExhausted
            No block is free.
        """
        try:  # a pop that fails costs nothing until the pool is empty
            block = self._free.pop()
        except IndexError:
            raise KvPoolExhausted(f"the KV block pool is exhausted ({self.num_blocks} blocks in "
                                  "use)") from None
        self._used[block] = 1
        return block

    def free(self, block: int) -> None:
        """Give ``block`` back.

        Parameters
        ----------
        block : int

        Raises
        ------
        FeedError
            ``block`` is not currently allocated from this pool (a double free, or a foreign id).
        TypeError
            ``block`` is not an int.
        """
        block = index(block)  # an int: a str or float is a TypeError, not a block number
        if not 0 <= block < self.num_blocks or not self._used[block]:
            raise FeedError(f"block {block} is not allocated from this pool")
        self._used[block] = 0
        self._free.append(block)


class PagedKvMixin:
    """A model's paged KV bookkeeping: its ``BlockPool``, the trait's block calls and the
    checks its forward makes. Put it first in the bases (before ``RuntimeFeedMixin``) and call
    ``init_paged_kv`` once.

    The scheduler (its ``KvBudget``) is the one caller of ``reserve_decode_block`` and
    ``release_decode_blocks`` during decoding: a model's ``decode_batch_fed`` never takes a block,
    it checks with ``check_decode_blocks`` that every row's block is there, so a step refused for
    any reason leaves the pool and every block table as they were. ``prefill`` takes the blocks
    of the ids it writes with ``take_prefill_blocks`` (all or none). ``feed_info()`` adds the
    block size and the pool to the runtime mixin's.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> from metrale_feed.kv import PagedKvMixin
    >>> class Model(PagedKvMixin, mf.RuntimeFeedMixin, mf.ModelDeviceFeed):
    ...     def __init__(self):
    ...         self.init_device_feed(vocab=100, max_rows=2)
    ...         self.init_paged_kv(block_size=4, num_blocks=8)
    >>> model = Model()
    >>> seq = mf.SequenceState(0)
    >>> model.take_prefill_blocks([seq], [[1, 2, 3, 4, 5]])  # positions 0..4: two blocks
    >>> seq.seq_len = 5
    >>> model.reserve_decode_block(seq), model.feed_info().block_size
    (0, 4)
    >>> model.release_sequence(seq); model.pool.free_count
    8
    >>> model.close_device_feed()
    """

    block_size: int
    pool: BlockPool

    def init_paged_kv(self, *, block_size: int, num_blocks: int) -> None:
        """Make the pool: ``num_blocks`` blocks of ``block_size`` positions.

        Raises
        ------
        ValueError
            ``block_size`` below 1 or ``num_blocks`` outside [1, 2**31].
        """
        block_size = index(block_size)
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    def feed_info(self) -> Any:
        info = super().feed_info()  # type: ignore[misc]
        return info._replace(block_size=self.block_size, pool=self.pool)

    def reserve_decode_block(self, seq: SequenceState) -> int:
        table = seq.block_table
        if seq.seq_len // self.block_size >= len(table):
            table.append(self.pool.alloc())
            return 1
        return 0

    def reserve_blocks_through(self, seq: SequenceState, last: int) -> int:
        """The blocks ``seq``'s table lacks to cover position ``last`` (a speculative step's
        ``k + 1`` positions), all or none: ``KvPoolExhausted`` leaves the table and the pool as
        they were. Returns the blocks added."""
        bs, table = self.block_size, seq.block_table
        first = len(table)
        try:
            while last // bs >= len(table):
                table.append(self.pool.alloc())
        except BaseException:
            self.release_decode_blocks(seq, len(table) - first)
            raise
        return len(table) - first

    def release_decode_blocks(self, seq: SequenceState, blocks: int) -> None:
        if not 0 <= blocks <= len(seq.block_table):
            raise ValueError(f"cannot release {blocks} of {len(seq.block_table)} blocks")
        for _ in range(blocks):
            self.pool.free(seq.block_table.pop())

    def release_sequence(self, seq: SequenceState) -> None:
        """Return all of a finished sequence's blocks to the pool."""
        self.release_decode_blocks(seq, len(seq.block_table))

    def check_decode_blocks(self, seqs: Sequence[SequenceState]) -> None:
        """Refuse a step with a row whose block for position ``seq_len`` was not reserved.

        Raises
        ------
        FeedError
            Naming the row; nothing has been taken or queued.
        """
        bs = self.block_size
        for row, seq in enumerate(seqs):
            if seq.seq_len // bs >= len(seq.block_table):
                raise FeedError(f"row {row}: no KV block reserved for position {seq.seq_len} "
                                f"({len(seq.block_table)} blocks of {bs}); reserve it first "
                                "(the router's reserve_kv, or its launch)")

    def check_verify_blocks(self, seqs: Sequence[SequenceState], k: int, advanced: bool) -> None:
        """Refuse a verify step (``decode_batch_verify``) with a row whose block table does not
        cover the last position it may write: ``seq_len + k``, or with a device ``advance``
        (depth 2, the step in flight's ids not yet counted) ``seq_len + 2k + 1``.

        Raises
        ------
        ValueError
            Naming the row's sequence and the position; nothing has been taken or queued.
        """
        reach = 2 * k + 1 if advanced else k
        for seq in seqs:
            if (seq.seq_len + reach) // self.block_size >= len(seq.block_table):
                raise ValueError(f"the block table of {seq!r} does not cover position "
                                 f"{seq.seq_len + reach}: reserve the positions first")

    def cover_decode_blocks(self, seqs: Sequence[SequenceState]) -> None:
        """The block of each row's position ``seq_len``, all or none (a host-token
        ``decode_batch`` called with no scheduler around it)."""
        added: List[SequenceState] = []
        try:
            for seq in seqs:
                if self.reserve_decode_block(seq):
                    added.append(seq)
        except BaseException:
            for seq in added:
                self.release_decode_blocks(seq, 1)
            raise

    def take_prefill_blocks(self, seqs: Sequence[SequenceState],
                            id_lists: Sequence[Sequence[Any]]) -> None:
        """The blocks for writing each list of ids at its sequence's ``seq_len..``, for all of
        them or none (``KvPoolExhausted`` leaves every table as it was)."""
        bs = self.block_size
        taken: List[Any] = []  # (seq, blocks added)
        try:
            for seq, ids in zip(seqs, id_lists):
                first = len(seq.block_table)
                taken.append((seq, 0))
                while ids and (seq.seq_len + len(ids) - 1) // bs >= len(seq.block_table):
                    seq.block_table.append(self.pool.alloc())
                    taken[-1] = (seq, len(seq.block_table) - first)
        except BaseException:
            for seq, blocks in taken:
                self.release_decode_blocks(seq, blocks)
            raise
