"""Hostile matrix: ReferenceModel, BlockPool and FeedSource. Bad input, one call per case, run in child interpreters by
_matrix.py (see its docstring)."""

from __future__ import annotations

import ctypes
import gc
import time

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DeviceBuffer, Event, FeedError, PinnedBuffer, Stream
from metrale_feed._core import reference_forward

from _matrix import (FOREIGN, NT, add, case, closed_event, closed_stream, dev_bytes, dev_with,
                     drained, hostile_test, pinned_with, raises, _destroyed_handle, _model)

# ---------------------------------------------------------------------------------------------
# ReferenceModel
# ---------------------------------------------------------------------------------------------


MODEL_BAD = [
    ("vocab_zero", dict(vocab=0), ValueError, r"vocab must be in \[1, 2\*\*24\]"),
    ("vocab_over_max", dict(vocab=(1 << 24) + 1), ValueError, "vocab must be in"),
    ("vocab_str", dict(vocab="16"), TypeError, "not supported|str"),
    ("block_size_zero", dict(block_size=0), ValueError, "block_size must be at least 1"),
    ("block_size_negative", dict(block_size=-4), ValueError, "block_size must be at least 1"),
    ("num_blocks_zero", dict(num_blocks=0), ValueError, "num_blocks must be in"),
    ("num_blocks_negative", dict(num_blocks=-3), ValueError, "num_blocks must be in"),
    ("max_rows_zero", dict(max_rows=0), ValueError, r"max_rows must be in \[1, 4096\]"),
    ("max_rows_over", dict(max_rows=4097), ValueError, "max_rows must be in"),
    ("dtype_unknown", dict(logits_dtype="int8"), ValueError, "unknown logits dtype"),
    ("dtype_none", dict(logits_dtype=None), ValueError, "unknown logits dtype"),
    # 2**50 slots of KV: more than any address space, refused by the allocator at once.
    ("kv_huge", dict(block_size=1 << 40, num_blocks=1024), (ValueError, FeedError), "failed|kv|block"),
]
for _label, _kw, _exc, _match in MODEL_BAD:
    add("model", _label, lambda k=_kw, x=_exc, m=_match: raises(x, m, _model, **k))


@case("model")
def decode_bad_shapes():
    from metrale_feed.kv import SequenceState

    m = _model()
    s = SequenceState(0)
    m.prefill(s, [1, 2])
    free = m.pool.free_count
    raises(ValueError, "2 inputs for 1 sequences", m.decode_batch, [1, 2], [s])
    raises(ValueError, "a step takes 1 to 4 rows, got 0", m.decode_batch, [], [])
    raises(ValueError, "a step takes 1 to 4 rows, got 5", m.decode_batch, [1] * 5, [s] * 5)
    raises(ValueError, "inputs for", m.decode_batch_fed, [0x80000001] * 2, [s])
    assert (s.seq_len, s.tokens, m.pool.free_count) == (2, [1, 2], free)
    m.release_sequence(s)
    m.close()


@case("model")
def decode_fed_bad_source():
    from metrale_feed.kv import SequenceState

    m = _model()
    s = SequenceState(0)
    m.prefill(s, [1, 2])
    raises(ValueError, "beyond the previous step's 0 rows", m.decode_batch_fed, [0], [s])
    raises(ValueError, "outside uint32", m.decode_batch_fed, [2**32], [s])
    assert (s.seq_len, s.tokens) == (2, [1, 2])
    m.release_sequence(s)
    m.close()


@case("model")
def decode_fed_refused_takes_no_block():
    # The model takes no block in decode_batch_fed (the scheduler's budget does): a step refused
    # for a bad source, or for a row whose block was not reserved, leaves the pool and the table.
    from metrale_feed.kv import SequenceState

    m = _model()
    s = SequenceState(0)
    m.prefill(s, [1, 2, 3, 4])  # the next position needs a new block
    free, table = m.pool.free_count, list(s.block_table)
    try:
        raises(FeedError, "row 0: no KV block reserved for position 4", m.decode_batch_fed,
               [0x80000001], [s])
        assert (s.seq_len, s.block_table, m.pool.free_count) == (4, table, free)
        assert m.reserve_decode_block(s) == 1
        raises(ValueError, "beyond the previous step's 0 rows", m.decode_batch_fed, [0], [s])
        assert (s.seq_len, len(s.block_table), m.pool.free_count) == (4, len(table) + 1, free - 1)
    finally:
        m.release_sequence(s)
        m.close()


@case("model")
def decode_bad_token_keeps_no_block():
    from metrale_feed.kv import SequenceState

    m = _model()
    s = SequenceState(0)
    m.prefill(s, [1, 2, 3, 4])  # the next position needs a new block
    free, table = m.pool.free_count, list(s.block_table)
    try:
        raises(ValueError, "token id must be a uint32", m.decode_batch, [-1], [s])
        assert (s.seq_len, s.block_table, m.pool.free_count) == (4, table, free)
    finally:
        m.release_sequence(s)
        m.close()


@case("model")
def kv_release_bad():
    from metrale_feed.kv import SequenceState

    m = _model()
    s = SequenceState(0)
    m.prefill(s, [1, 2, 3])
    raises(ValueError, "cannot release 2 of 1 blocks", m.release_decode_blocks, s, 2)
    raises(ValueError, "cannot release -1 of 1 blocks", m.release_decode_blocks, s, -1)
    assert len(s.block_table) == 1
    m.release_sequence(s)
    assert m.pool.free_count == 8
    m.close()


@case("model")
def kv_exhausted():
    from metrale_feed.kv import SequenceState

    m = _model(num_blocks=2)
    a, b = SequenceState(0), SequenceState(1)
    m.prefill(a, [1, 2, 3, 4, 5])  # two blocks: the pool is empty
    raises(mf.KvPoolExhausted, "exhausted", m.prefill, b, [1])
    raises(mf.KvPoolExhausted, "exhausted", m.reserve_decode_block, SequenceState(2))
    assert isinstance(mf.KvPoolExhausted("x"), FeedError)
    assert (b.block_table, b.seq_len, m.pool.free_count) == ([], 0, 0)
    m.release_sequence(a)
    m.close()


@case("model")
def closed_model():
    from metrale_feed.kv import SequenceState

    m = _model()
    s = SequenceState(0)
    m.prefill(s, [1, 2])
    m.release_sequence(s)
    m.close()
    raises(FeedError, "the reference model is closed", m.decode_batch, [1], [s])
    raises(FeedError, "the reference model is closed", m.decode_batch_fed, [0x80000001], [s])
    raises(FeedError, "call init_device_feed first", m.argmax_batch_to_feed, 0, [(NT, NT)], None, None, 0)
    assert m.supports_device_token_feed() is False
    m.close()  # a second close is a no-op


@case("model")
def prefill_on_closed_model():
    from metrale_feed.kv import SequenceState

    m = _model()
    m.close()
    before = mf.live_objects()
    raises(FeedError, "closed", m.prefill, SequenceState(0), [1, 2, 3])
    assert mf.live_objects() == before, "prefill on a closed model allocated"


@case("model")
def model_runtime_methods_bad():
    # The runtime half of the trait forwards to the package's checks.
    m = _model()
    raises(FeedError, "unknown or destroyed event", m.event_query, 0xBAD)
    raises(FeedError, "unknown or destroyed event", m.event_synchronize, 0xBAD)
    raises(FeedError, "unknown or destroyed event", m.destroy_event, 0xBAD)
    raises(FeedError, "not a live pinned allocation", m.free_host_pinned, FOREIGN.ctypes.data, 4)
    raises(ValueError, "at least 1 byte", m.alloc_host_pinned, 0)
    raises(TypeError, "must be a buffer", m.copy_d2h_async, m.logits, 5, 0)
    raises(ValueError, "not below vocab", m.argmax_batch_to_feed, m.logits, [(16, NT)], None, None, 0)
    m.close()


# ---------------------------------------------------------------------------------------------
# BlockPool and FeedSource
# ---------------------------------------------------------------------------------------------

@case("kv")
def block_pool_bad():
    raises(ValueError, "num_blocks must be in", mf.BlockPool, 0)
    raises(ValueError, "num_blocks must be in", mf.BlockPool, -1)
    raises(TypeError, "not supported|str", mf.BlockPool, "3")
    raises(TypeError, "float", mf.BlockPool, 2.5)
    pool = mf.BlockPool(2)
    a = pool.alloc()
    raises(FeedError, "block 1 is not allocated", pool.free, 1)
    raises(FeedError, "block -1 is not allocated", pool.free, -1)
    raises(FeedError, "block 2 is not allocated", pool.free, 2)
    raises(TypeError, "not supported|str", pool.free, "0")
    raises(TypeError, "float|integer", pool.free, 0.0)
    pool.free(a)
    raises(FeedError, f"block {a} is not allocated", pool.free, a)  # double free
    pool.alloc(), pool.alloc()
    raises(mf.KvPoolExhausted, "exhausted", pool.alloc)
    assert pool.free_count == 0


@case("kv")
def block_pool_huge():
    raises(ValueError, None, mf.BlockPool, 2**40)


@case("kv")
def feed_source_bad():
    FS = mf.FeedSource
    raises(ValueError, r"host id must be in \[0, 2\*\*31\)", FS.host, -1)
    raises(ValueError, "host id must be in", FS.host, 2**31)
    raises(ValueError, r"from_row must be in \[0, 2\*\*31\)", FS.feed, -1)
    raises(ValueError, "from_row must be in", FS.feed, 2**31)
    for bad in ("1", None, [1]):
        raises(TypeError, "not supported|NoneType|list|str", FS.host, bad)
        raises(TypeError, "not supported|NoneType|list|str", FS.feed, bad)
    raises(TypeError, "float", FS.host, 1.5)


@case("kv")
def row_mask_bad():
    raises(ValueError, "a mask id must be a uint32, got -1", mf.RowMask, -1)
    raises(ValueError, "must be a uint32, got 4294967296", mf.RowMask, 0, 2**32)
    raises(TypeError, "not supported|str", mf.RowMask, "a")
    assert mf.RowMask() == (NT, NT)


@case("kv")
def feed_source_float_row():
    raises(TypeError, None, mf.FeedSource.feed, 1.5)


# ---------------------------------------------------------------------------------------------


test_hostile = hostile_test(__name__)
