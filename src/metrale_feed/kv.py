"""KV-cache bookkeeping (docs/router.md, "KV bookkeeping"; docs/pipeline.md): sequences, block
tables and the pool."""

from __future__ import annotations

from operator import index
from typing import List

from .errors import FeedError, KvPoolExhausted

__all__ = ["SequenceState", "BlockPool", "KvPoolExhausted"]


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
        if not self._free:
            raise KvPoolExhausted(f"the KV block pool is exhausted ({self.num_blocks} blocks in use)")
        block = self._free.pop()
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
