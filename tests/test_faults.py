"""Faults injected with ``configure_host`` at each kind of operation inside the router loop.

For every fault: the error reaches the caller as ``FeedError`` (``KvPoolExhausted`` for the KV
pool), no ring slot, KV block or runtime object leaks (``pool.free_count``, ``io.stats`` and
``live_objects()`` after teardown and close), and the router then either *continues* (the next
step runs and its tokens are exact) or *refuses cleanly* (nothing was made, and a new attempt
works). Each test's docstring says which of the two happens, and what the caller must do.

The scheduler here (``Pipeline``) keeps two steps in flight like ``demo.run_async``, checks every
token against ``host_next_token`` over the true history, and knows how to recover: roll back the
reservations of a launch that failed, abort (roll back and release) rows whose result was lost.
"""

from __future__ import annotations

import gc
import random
import weakref
from collections import deque

import pytest

import metrale_feed as mf
from metrale_feed import FeedError, FeedSource, KvPoolExhausted
from metrale_feed.kv import SequenceState
from metrale_feed.testing.reference import ReferenceModel, host_next_token
from metrale_feed.sched.router import AsyncDeviceIo

NT = mf.NO_TOKEN
VOCAB = 48

class Row:
    def __init__(self, index, prompt, mask):
        self.seq = SequenceState(index)
        self.prompt = prompt
        self.history = list(prompt)  # the true history: prompt + accepted tokens
        self.mask = mask
        self.uncommitted = 0  # reserve_kv calls whose step has not been awaited successfully


class Pipeline:
    """Two steps in flight over the rows of ``self.active``, with exact checks."""

    def __init__(self, rows=3, *, block_size=4, num_blocks=64, max_rows=None, seed=0, **model_kw):
        self.rng = random.Random(seed)
        self.model = ReferenceModel(VOCAB, block_size=block_size, num_blocks=num_blocks,
                                    max_rows=max_rows or rows, **model_kw)
        self.io = AsyncDeviceIo(self.model, max_rows or rows)
        self.active = []
        self.inflight = deque()  # (ticket, rows)
        self.checked = 0
        for _ in range(rows):
            self.add_row()

    def add_row(self, prompt_len=None):
        rng = self.rng
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len or rng.randint(2, 6))]
        mask = (host_next_token(prompt, VOCAB), NT) if rng.random() < 0.5 else (NT, NT)
        row = Row(len(self.active), prompt, mask)
        self.model.prefill(row.seq, prompt[:-1])
        self.active.append(row)
        return row

    # ---- launch: fed from the newest step's cells where it has the row, else a host id ----

    def launch(self, rows=None):
        rows = list(self.active if rows is None else rows)
        newest = {id(r): i for i, r in enumerate(self.inflight[-1][1])} if self.inflight else {}
        sources = [FeedSource.feed(newest[id(r)]) if id(r) in newest else FeedSource.host(r.history[-1])
                   for r in rows]
        reserved = []
        try:
            for r in rows:
                self.io.reserve_kv(r.seq)
                r.uncommitted += 1
                reserved.append(r)
            ticket = self.io.launch_fed(sources, [r.seq for r in rows], [r.mask for r in rows])
        except BaseException:
            for r in reversed(reserved):  # the failed launch's reservations go back to the pool
                self.io.rollback(r.seq)
                r.uncommitted -= 1
            raise
        for r, s in zip(rows, sources):
            if s.is_host:  # a host-known input: pushed at launch
                r.seq.tokens.append(r.history[-1])
                r.seq.seq_len += 1
        self.inflight.append((ticket, rows))
        return ticket

    # ---- read the oldest step ----

    def read(self):
        ticket, rows = self.inflight.popleft()
        ids = self.io.await_result(ticket)  # on failure the caller decides (see abort)
        ahead = {id(r) for r in self.inflight[0][1]} if self.inflight else set()
        for r, token in zip(rows, ids):
            r.uncommitted -= 1
            want = host_next_token(r.history, VOCAB, mask=r.mask)
            assert token == want, f"row {r.seq.slot_idx}: token {token}, host reference {want}"
            self.checked += 1
            r.history.append(token)
            if id(r) in ahead:  # the step ahead wrote this id's KV
                r.seq.tokens.append(token)
                r.seq.seq_len += 1
        return ids

    def step(self):
        if not self.inflight:
            self.launch()
        if len(self.inflight) < 2:
            self.launch()
        return self.read()

    def run(self, steps):
        for _ in range(steps):
            self.step()

    def drain(self):
        while self.inflight:
            self.read()

    # ---- recovery ----

    def abort(self, rows):
        """Give up on ``rows`` (their result was lost): return every uncommitted reservation and
        every block, and drop them from the batch."""
        for r in rows:
            while r.uncommitted:
                self.io.rollback(r.seq)
                r.uncommitted -= 1
            self.model.release_sequence(r.seq)
            self.active.remove(r)
        self.inflight = deque((t, [r for r in rs if r not in rows]) for t, rs in self.inflight)

    def blocks_held(self):
        return sum(len(r.seq.block_table) for r in self.active)

    def assert_pool_consistent(self):
        assert self.model.pool.free_count + self.blocks_held() == self.model.pool.num_blocks

    def close(self):
        self.io.teardown()
        for r in self.active:
            self.model.release_sequence(r.seq)
        assert self.model.pool.free_count == self.model.pool.num_blocks, "KV blocks leaked"
        self.model.close()


def counts_now():
    gc.collect()
    mf.stream_synchronize(0)
    return mf.live_objects()


# ---------------------------------------------------------------------------------------------
# fail_alloc_at
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("at", [1, 2, 3])
def test_alloc_fault_while_building_the_router(host, no_leaks, at):
    """Refuses cleanly: the Nth pinned allocation of the readback ring fails, the FeedError
    reaches the caller, the slots made so far are freed, and a new AsyncDeviceIo works."""
    model = ReferenceModel(VOCAB, block_size=4, num_blocks=32, max_rows=2)
    before = counts_now()
    host.configure_host(fail_alloc_at=at)
    with pytest.raises(FeedError, match="alloc_host_pinned: fault injected"):
        AsyncDeviceIo(model, 2)
    host.configure_host()
    assert counts_now() == before, "a half-built ring leaked"
    seq = SequenceState(0)
    model.prefill(seq, [1, 2])
    with AsyncDeviceIo(model, 2) as io:
        assert io.await_result(io.launch_decode([3], [seq], [(NT, NT)])) == [host_next_token([1, 2, 3], VOCAB)]
    model.release_sequence(seq)
    model.close()


def test_alloc_knob_past_the_ring_does_not_fire_in_it(host, no_leaks):
    """The ring makes exactly three allocations: with the knob at 4 it is built, and the knob
    then fires in the model's next allocation (here a staging slot), as a FeedError."""
    model = ReferenceModel(VOCAB, block_size=4, num_blocks=32, max_rows=2)
    host.configure_host(fail_alloc_at=4)
    io = AsyncDeviceIo(model, 2)
    seq = SequenceState(0)
    with pytest.raises(FeedError, match="fault injected"):
        model.prefill(seq, [1, 2, 3])
    assert host.host_faults()["fail_alloc_at"] == 0
    io.teardown()
    model.release_sequence(seq)
    model.close()


@pytest.mark.parametrize("at", [1, 2, 3])
def test_alloc_fault_while_building_the_model(host, no_leaks, at):
    """Refuses cleanly: ReferenceModel's feed cells, KV cache or logits allocation fails; the
    FeedError reaches the caller and nothing the half-built model allocated stays live."""
    host.configure_host(fail_alloc_at=at)
    with pytest.raises(FeedError, match="fault injected"):
        ReferenceModel(VOCAB, block_size=4, num_blocks=8, max_rows=2)
    host.configure_host()


def _grown_pipeline():
    """A model whose four staging slots exist at 64 rows, and a router of 100 rows: the next
    100-row launch has to grow a staging slot."""
    return Pipeline(rows=100, max_rows=100, num_blocks=400, seed=3)


def test_alloc_fault_while_growing_staging_is_refused(host, no_leaks):
    """Refuses cleanly: growing a staging slot fails in the launch; the FeedError reaches the
    caller before anything is queued, the rows are not advanced, the caller's rollback returns
    the step's blocks, and after teardown and close nothing is live."""
    pipe = _grown_pipeline()
    seq_state = [(r.seq.seq_len, list(r.seq.tokens)) for r in pipe.active]
    host.configure_host(fail_alloc_at=1)
    with pytest.raises(FeedError, match="fault injected"):
        pipe.launch()
    host.configure_host()
    assert [(r.seq.seq_len, list(r.seq.tokens)) for r in pipe.active] == seq_state
    assert all(r.uncommitted == 0 for r in pipe.active)
    assert pipe.io.stats.reserved_in_flight == 0 and pipe.io.stats.launches == 0
    pipe.assert_pool_consistent()
    pipe.close()


def test_router_continues_after_a_staging_growth_fault(host, no_leaks):
    """Should continue: after the failed growth the same launch is retried, and the following
    steps (which come round to every staging slot) run with exact tokens."""
    pipe = _grown_pipeline()
    host.configure_host(fail_alloc_at=1)
    with pytest.raises(FeedError):
        pipe.launch()
    host.configure_host()
    try:
        pipe.run(8)
        pipe.drain()
        assert pipe.checked == 9 * 100  # eight steps read, and the one left in flight
    finally:
        pipe.inflight.clear()
        pipe.close()


# ---------------------------------------------------------------------------------------------
# fail_copy_at
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("at", [1, 2, 3])
def test_copy_fault_in_a_fed_launch(host, no_leaks, at):
    """Continues. A fed launch makes three copies: the forward's meta and block tables (1, 2),
    and the ids from the feed cells to the readback slot (3, queued after the argmax). The
    FeedError reaches the caller, who rolls back the launch's reservations; the step already in
    flight is awaited with exact tokens, and the launch is made again. Since the argmax of the
    failed launch may already have overwritten the feed cells (at 3), it is made again from the
    host ids just read, not from the cells."""
    pipe = Pipeline(rows=3, seed=at)
    pipe.run(3)  # steady state: one step in flight after each read
    assert len(pipe.inflight) == 1
    free = pipe.model.pool.free_count
    host.configure_host(fail_copy_at=at)
    with pytest.raises(FeedError, match="copy_async: fault injected"):
        pipe.launch()
    host.configure_host()
    assert pipe.model.pool.free_count == free, "the failed launch kept a block"
    pipe.read()  # the step in flight is intact
    assert not pipe.inflight
    pipe.run(6)  # relaunched from host ids, then fed from cells again
    pipe.drain()
    assert pipe.checked == 3 * (3 + 1 + 6 + 1)
    assert pipe.io.stats.reserved_in_flight == 0
    pipe.close()


@pytest.mark.parametrize("at", [1, 2, 3, 4])
def test_copy_fault_in_a_decode_launch(host, no_leaks, at):
    """Should refuse cleanly: a decode launch (host-known inputs) makes four copies: input ids,
    meta, block tables (1-3) and the argmax ids into the readback slot (4). The FeedError
    reaches the caller with the sequence not advanced, so the same launch can be made again and
    gives the exact token."""
    model = ReferenceModel(VOCAB, block_size=4, num_blocks=16, max_rows=1)
    seq = SequenceState(0)
    model.prefill(seq, [5, 6, 7])
    try:
        with AsyncDeviceIo(model, 1) as io:
            host.configure_host(fail_copy_at=at)
            with pytest.raises(FeedError, match="fault injected"):
                io.launch_decode([8], [seq], [(NT, NT)])
            host.configure_host()
            assert (seq.seq_len, seq.tokens) == (3, [5, 6, 7]), "the failed launch advanced the sequence"
            assert io.await_result(io.launch_decode([8], [seq], [(NT, NT)])) == \
                [host_next_token([5, 6, 7, 8], VOCAB)]
    finally:
        model.release_sequence(seq)
        model.close()


# ---------------------------------------------------------------------------------------------
# fail_event_query_at / fail_synchronize_at in await_result
# ---------------------------------------------------------------------------------------------

def _lost_await(pipe, knob, lag_us=0):
    """Two steps in flight; the await of the older one fails through ``knob``. With ``lag_us``
    the steps are still queued when it waits, so the wait reaches event_synchronize."""
    mf.configure_host(lag_us=lag_us)
    pipe.run(2)
    pipe.launch()  # the step ahead: two in flight
    assert len(pipe.inflight) == 2
    mf.configure_host(lag_us=lag_us, **{knob: 1})
    lost_ticket, lost_rows = pipe.inflight.popleft()
    with pytest.raises(FeedError, match="fault injected"):
        pipe.io.await_result(lost_ticket)
    mf.configure_host()
    return lost_ticket, lost_rows


@pytest.mark.parametrize("knob,lag_us", [("fail_event_query_at", 0), ("fail_synchronize_at", 5000)])
def test_await_fault(host, no_leaks, knob, lag_us):
    """Continues. The wait for the older step fails (its first event_query, or, with the step
    held back by lag, the event_synchronize after the spin); the FeedError reaches the caller and
    the ring slot is released anyway. The step after it, fed on the device from the lost step's
    cells, is awaited normally and its ids are exact (checked against the true history). The host
    never learnt the lost tokens, so the caller aborts those rows: rolls back their uncommitted
    reservations and releases their blocks. The router then runs new rows with exact tokens, and
    all three ring slots take a launch again."""
    pipe = Pipeline(rows=3, seed=7)
    lost_ticket, lost_rows = _lost_await(pipe, knob, lag_us)
    with pytest.raises(FeedError, match="already awaited"):
        pipe.io.await_result(lost_ticket)  # its slot is free, not wedged
    next_ticket, next_rows = pipe.inflight.popleft()
    expected = []  # what the device had as each row's history: the lost token included
    for r in next_rows:
        lost_token = host_next_token(r.history, VOCAB, mask=r.mask)
        expected.append(host_next_token(r.history + [lost_token], VOCAB, mask=r.mask))
    assert pipe.io.await_result(next_ticket) == expected
    for r in next_rows:
        r.uncommitted -= 1
    pipe.abort(lost_rows)
    assert not pipe.active
    assert pipe.io.stats.reserved_in_flight == 0
    assert pipe.model.pool.free_count == pipe.model.pool.num_blocks
    for _ in range(3):
        pipe.add_row()
    pipe.run(5)
    pipe.drain()
    assert pipe.checked == 3 * 2 + 3 * 6
    # Every ring slot is usable: three steps launched before any is awaited, a fourth refused.
    seq = SequenceState(99)
    pipe.model.prefill(seq, [1, 2])
    tickets = [pipe.io.launch_decode([t], [seq], [(NT, NT)]) for t in (3, 4, 5)]
    with pytest.raises(FeedError, match="ring exhausted"):
        pipe.io.launch_decode([6], [seq], [(NT, NT)])
    assert [pipe.io.await_result(t) for t in tickets] == \
        [[host_next_token([1, 2, 3], VOCAB)], [host_next_token([1, 2, 3, 4], VOCAB)],
         [host_next_token([1, 2, 3, 4, 5], VOCAB)]]
    pipe.model.release_sequence(seq)
    pipe.close()


@pytest.mark.parametrize("knob,lag_us", [("fail_event_query_at", 0), ("fail_synchronize_at", 5000)])
def test_await_fault_leaves_no_reservation_behind(host, no_leaks, knob, lag_us):
    """After the lost step's rows are aborted (the next step awaited, then one rollback per row
    for the lost step's reservation, then the blocks released), the router holds nothing of them:
    no reservation in flight and no reference to their sequences. Block size 1, so that every
    step's reservation is a block and a wrong one shows in the counts."""
    pipe = Pipeline(rows=3, block_size=1, seed=13)
    try:
        lost_ticket, lost_rows = _lost_await(pipe, knob, lag_us)
        next_ticket, next_rows = pipe.inflight.popleft()
        pipe.io.await_result(next_ticket)
        for r in next_rows:
            r.uncommitted -= 1
        rolled_back = pipe.io.stats.blocks_rolled_back
        pipe.abort(lost_rows)
        assert pipe.io.stats.blocks_rolled_back - rolled_back == len(lost_rows)
        assert pipe.io.stats.reserved_in_flight == 0, "reservations of aborted rows are still counted"
        refs = [weakref.ref(r.seq) for r in lost_rows]
        del lost_ticket, next_ticket, lost_rows, next_rows, r
        gc.collect()
        assert all(ref() is None for ref in refs), "the router keeps the aborted sequences"
    finally:
        pipe.inflight.clear()
        pipe.close()


def test_await_fault_then_teardown_with_a_step_in_flight(host, no_leaks):
    """Refuses cleanly: after a failed wait the scheduler gives up on the batch; teardown with
    the other step still in flight waits for it, frees the ring and destroys its events."""
    pipe = Pipeline(rows=2, seed=11)
    _lost_await(pipe, "fail_synchronize_at", lag_us=5000)
    pipe.abort(list(pipe.active))
    pipe.close()


# ---------------------------------------------------------------------------------------------
# KV exhaustion
# ---------------------------------------------------------------------------------------------

def test_kv_exhaustion_in_the_router_loop(host, no_leaks):
    """Refuses cleanly, then continues. With few blocks, reserve_kv raises KvPoolExhausted (a
    FeedError) before anything is launched; the scheduler rolls back the launch's earlier
    reservations, preempts the row that could not grow (aborts it: its blocks go back), and the
    other rows continue with exact tokens. The pool is whole at the end."""
    pipe = Pipeline(rows=4, block_size=2, num_blocks=14, seed=5)
    exhausted = 0
    for _ in range(40):
        if not pipe.active:
            break
        try:
            pipe.step()
        except KvPoolExhausted as error:
            assert isinstance(error, FeedError) and "exhausted" in str(error)
            exhausted += 1
            pipe.assert_pool_consistent()
            pipe.drain()  # the step in flight is intact
            victim = max(pipe.active, key=lambda r: len(r.seq.block_table))
            pipe.abort([victim])
            pipe.assert_pool_consistent()
    assert exhausted >= 2, "the pool never ran out: the test did not test exhaustion"
    assert pipe.checked > 40
    pipe.drain()
    assert pipe.io.stats.reserved_in_flight == 0
    pipe.close()


def test_kv_exhaustion_in_decode_batch_is_all_or_none(host, no_leaks):
    """Refuses cleanly: a decode step whose third row finds the pool empty returns the blocks
    it took for the first two rows, launches nothing, and advances no row."""
    model = ReferenceModel(VOCAB, block_size=2, num_blocks=8, max_rows=3)
    seqs = [SequenceState(i) for i in range(3)]
    for s in seqs:
        model.prefill(s, [1, 2])  # one full block each: the next position needs a new block
    hog = SequenceState(9)
    model.prefill(hog, [3, 4, 5, 6])  # takes 2 of the 5 left
    with AsyncDeviceIo(model, 3) as io:
        free = model.pool.free_count
        tables = [list(s.block_table) for s in seqs]
        assert free == 3
        spare = model.pool.alloc()  # leave two: the third row cannot get one
        with pytest.raises(KvPoolExhausted):
            io.launch_decode([7, 7, 7], seqs, [(NT, NT)] * 3)
        assert model.pool.free_count == 2 and [s.block_table for s in seqs] == tables
        assert [s.seq_len for s in seqs] == [2, 2, 2] and io.stats.launches == 0
        model.pool.free(spare)
        ids = io.await_result(io.launch_decode([7, 7, 7], seqs, [(NT, NT)] * 3))
        assert ids == [host_next_token([1, 2, 7], VOCAB)] * 3
    for s in seqs + [hog]:
        model.release_sequence(s)
    assert model.pool.free_count == model.pool.num_blocks
    model.close()


def test_prefill_exhaustion_returns_its_blocks(host, no_leaks):
    """Refuses cleanly: a prefill that runs out of blocks part-way returns the blocks it took,
    and the sequence is as before, also when it is longer than max_rows ids (a prefill takes
    its blocks all or none before it writes anything)."""
    model = ReferenceModel(VOCAB, block_size=2, num_blocks=3, max_rows=8)
    seq = SequenceState(0)
    model.prefill(seq, [1, 2])
    with pytest.raises(KvPoolExhausted):
        model.prefill(seq, [3, 4, 5, 6, 7])  # needs 3 more blocks, 2 are free
    assert (seq.seq_len, seq.tokens, len(seq.block_table), model.pool.free_count) == (2, [1, 2], 1, 2)
    model.prefill(seq, [3, 4])
    assert seq.seq_len == 4
    model.release_sequence(seq)
    model.close()

    model = ReferenceModel(VOCAB, block_size=2, num_blocks=3, max_rows=4)
    seq = SequenceState(0)
    model.prefill(seq, [1, 2])
    with pytest.raises(KvPoolExhausted):
        model.prefill(seq, [3, 4, 5, 6, 7])  # more ids than max_rows; 3 blocks needed, 2 free
    assert (seq.seq_len, seq.tokens, len(seq.block_table), model.pool.free_count) == (2, [1, 2], 1, 2)
    model.prefill(seq, [3, 4, 5, 6])  # longer than max_rows and fits: one forward
    assert (seq.seq_len, seq.tokens, len(seq.block_table), model.pool.free_count) == \
        (6, [1, 2, 3, 4, 5, 6], 3, 0)
    model.release_sequence(seq)
    assert model.pool.free_count == 3
    model.close()


def test_a_failed_top_logprobs_allocation_keeps_the_logprobs_buffers(host, no_leaks):
    """The ring makes its top-logprobs buffers at the first request for them; when one of those
    allocations fails, only the ones made there are freed: the logprobs buffers, which a step in
    flight may still be copying into, stay open."""
    model = ReferenceModel(VOCAB, block_size=4, num_blocks=32, max_rows=2)
    io = AsyncDeviceIo(model, 2)
    ring = io._ring
    lp = ring.logprobs(0)
    host.configure_host(fail_alloc_at=2)  # the first top pair's pinned half
    with pytest.raises(FeedError, match="fault injected"):
        ring.top(0)
    host.configure_host()
    assert ring.logprobs(0) == lp and all(buf.ptr for buf in lp), "the logprobs buffers were freed"
    assert not ring.top_dev and not ring.top_host
    top = ring.top(1)  # and a later request makes them
    assert all(buf.ptr for buf in top)
    io.teardown()
    model.close()
