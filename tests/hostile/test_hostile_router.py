"""Hostile matrix: AsyncDeviceIo. Bad input, one call per case, run in child interpreters by
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
# AsyncDeviceIo
# ---------------------------------------------------------------------------------------------

class RouterSetup:
    def __init__(self, rows=2):
        from metrale_feed.kv import SequenceState
        from metrale_feed.sched.router import AsyncDeviceIo

        self.model = _model(num_blocks=16)
        self.io = AsyncDeviceIo(self.model, rows)
        self.seqs = [SequenceState(i) for i in range(rows)]
        for i, s in enumerate(self.seqs):
            self.model.prefill(s, [i + 1, i + 2, i + 3])

    def state(self):
        return ([(s.seq_len, list(s.tokens), list(s.block_table)) for s in self.seqs],
                self.model.pool.free_count)

    def close(self):
        self.io.teardown()
        for s in self.seqs:
            self.model.release_sequence(s)
        self.model.close()


class _NoFeed(mf.ModelDeviceFeed):
    pass


@case("router")
def router_refuses_models_and_sizes():
    from metrale_feed.sched.router import AsyncDeviceIo

    before = mf.live_objects()
    raises(FeedError, "supports_device_token_feed", AsyncDeviceIo, _NoFeed(), 4)
    m = _model()
    raises(ValueError, r"max_rows must be in \[1, 4096\]", AsyncDeviceIo, m, 0)
    raises(ValueError, "max_rows must be in", AsyncDeviceIo, m, 4097)
    raises(TypeError, "not supported|str", AsyncDeviceIo, m, "4")
    m.close()
    assert mf.live_objects() == before


@case("router")
def launch_bad_shapes():
    r = RouterSetup()
    s0, s1 = r.seqs
    before = r.state()
    raises(ValueError, "a step takes 1 to 2 rows, got 0", r.io.launch_decode, [], [], [])
    raises(ValueError, "a step takes 1 to 2 rows, got 3", r.io.launch_decode, [1] * 3, [s0, s1, s0], [(NT, NT)] * 3)
    raises(ValueError, "1 inputs and 2 masks for 2 rows", r.io.launch_decode, [1], [s0, s1], [(NT, NT)] * 2)
    raises(ValueError, "2 inputs and 1 masks for 2 rows", r.io.launch_fed, [0x80000001] * 2, [s0, s1], [(NT, NT)])
    raises(ValueError, "beyond the previous step's 0 rows", r.io.launch_fed, [0], [s0], [(NT, NT)])
    assert r.state() == before
    assert r.io.stats.launches == 0
    r.close()


@case("router")
def launch_bad_mask_launches_nothing():
    r = RouterSetup()
    try:
        before = r.state()
        raises(ValueError, "not below vocab", r.io.launch_decode, [5], [r.seqs[0]], [(16, NT)])
        raises(ValueError, "must be a pair", r.io.launch_decode, [5], [r.seqs[0]], [(1, 2, 3)])
        assert r.state() == before, "a refused launch advanced the sequence"
    finally:
        r.close()


@case("router")
def launch_bad_token_leaves_sequence():
    r = RouterSetup()
    before = r.state()[0][0][:2]
    raises(ValueError, "token id must be a uint32", r.io.launch_decode, [-1], [r.seqs[0]], [(NT, NT)])
    raises(TypeError, "str|integer", r.io.launch_decode, ["a"], [r.seqs[0]], [(NT, NT)])
    assert r.state()[0][0][:2] == before  # seq_len and tokens: no step happened
    assert r.io.stats.launches == 0
    r.close()


@case("router")
def ring_exhausted_launches_nothing():
    r = RouterSetup(rows=1)
    s = r.seqs[0]
    tickets = [r.io.launch_decode([7], [s], [(NT, NT)]) for _ in range(3)]
    before = r.state()
    raises(FeedError, "readback ring exhausted: all 3 slots", r.io.launch_decode, [7], [s], [(NT, NT)])
    assert r.state() == before and r.io.stats.launches == 3
    ids = [r.io.await_result(t) for t in tickets]
    assert len(ids) == 3
    r.io.launch_decode([7], [s], [(NT, NT)])  # a slot is free again
    r.close()


@case("router")
def await_twice_and_after_teardown():
    r = RouterSetup(rows=1)
    t = r.io.launch_decode([7], [r.seqs[0]], [(NT, NT)])
    r.io.await_result(t)
    raises(FeedError, "already awaited", r.io.await_result, t)
    t2 = r.io.launch_decode([8], [r.seqs[0]], [(NT, NT)])
    r.io.teardown()
    raises(FeedError, "torn down", r.io.await_result, t2)
    raises(FeedError, "torn down", r.io.launch_decode, [7], [r.seqs[0]], [(NT, NT)])
    raises(FeedError, "torn down", r.io.reserve_kv, r.seqs[0])
    r.io.teardown()  # a second teardown is a no-op
    r.close()


@case("router")
def await_forged_ticket():
    from metrale_feed.sched.router import Ticket

    r = RouterSetup(rows=1)
    try:
        raises(FeedError, None, r.io.await_result, Ticket(0, 7, 1, False))
    finally:
        r.close()


@case("router")
def await_ticket_of_another_router():
    from metrale_feed.sched.router import AsyncDeviceIo

    r = RouterSetup(rows=1)
    other = AsyncDeviceIo(r.model, 1)
    mine = r.io.launch_decode([7], [r.seqs[0]], [(NT, NT)])
    theirs = other.launch_decode([9], [r.seqs[0]], [(NT, NT)])
    try:
        assert mine.slot == theirs.slot
        raises(FeedError, None, r.io.await_result, theirs)
    finally:
        other.teardown()
        r.close()


@case("router")
def launch_fed_bad_source_takes_no_block():
    # Each row's next position needs a new block; a launch refused for a bad source (or by the
    # model's own forward) leaves the pool, every block table and the budget as before.
    r = RouterSetup(rows=2)
    for s in r.seqs:
        s.seq_len = 4
    before = (r.state(), r.io.stats.as_dict())
    raises(ValueError, "beyond the previous step's 0 rows", r.io.launch_fed,
           [mf.FeedSource.feed(0), mf.FeedSource.host(1)], r.seqs, None)
    assert (r.state(), r.io.stats.as_dict()) == before

    def refuse(*args):
        raise FeedError("injected: the forward refused")

    r.model.decode_batch_fed = refuse
    raises(FeedError, "injected", r.io.launch, [mf.FeedSource.host(1)] * 2, r.seqs, fed=True)
    assert (r.state(), r.io.stats.as_dict()) == before
    del r.model.decode_batch_fed
    for s in r.seqs:
        s.seq_len = 3
    r.close()


@case("router")
def reserve_kv_exhausted():
    from metrale_feed.kv import SequenceState

    r = RouterSetup(rows=1)
    hog = SequenceState(9)
    r.model.prefill(hog, list(range(4 * r.model.pool.free_count)))  # takes every free block
    s = r.seqs[0]
    s.seq_len = 4  # the next position needs a new block
    before = (len(s.block_table), r.io.stats.reserved_blocks)
    raises(mf.KvPoolExhausted, "exhausted", r.io.reserve_kv, s)
    assert (len(s.block_table), r.io.stats.reserved_blocks) == before
    s.seq_len = 3
    r.model.release_sequence(hog)
    r.close()


# ---------------------------------------------------------------------------------------------


test_hostile = hostile_test(__name__)
