"""AsyncDeviceIo and SyncDeviceIo against the host computation of the reference logits."""

import random

import pytest

import metrale_feed
from metrale_feed import AsyncDeviceIo, DecodePipeline, FeedError, FeedSource, SyncDeviceIo
from metrale_feed.tools.demo import host_reference, make_requests
from metrale_feed.feed import NO_TOKEN
from metrale_feed.kv import KvPoolExhausted, SequenceState
from metrale_feed.testing.reference import ReferenceModel, host_next_token
from helpers.leaks import assert_counts_back

VOCAB = 600


def model_for(rows, dtype="float32", num_blocks=None, block_size=4):
    return ReferenceModel(VOCAB, block_size=block_size, num_blocks=num_blocks or rows * 40,
                          max_rows=rows, logits_dtype=dtype)


def pipeline_tokens(model, requests, max_new, depth, order):
    """The requests through a DecodePipeline, submitted in ``order``; tokens in request order."""
    with DecodePipeline(model, len(requests), depth=depth) as pipe:
        reqs = {}
        for i in order:
            r = requests[i]
            stops = () if r["stop"] == NO_TOKEN else (r["stop"],)
            ban = None if tuple(r["mask"]) == (NO_TOKEN, NO_TOKEN) else r["mask"]
            reqs[i] = pipe.submit(r["prompt"], max_new_tokens=max_new, stop_ids=stops, ban=ban)
        pipe.run()
        return [reqs[i].tokens for i in range(len(requests))], pipe.stats.as_dict()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_async_equals_sync_equals_host_with_stops_reorders_and_drops(host, no_leaks, dtype, seed):
    rows, max_new = 12, 24
    requests = make_requests(rows, max_new, VOCAB, dtype, seed)
    expected = [host_reference(r["prompt"], r["mask"], r["stop"], max_new, VOCAB, dtype) for r in requests]
    assert any(len(e) < max_new for e in expected), "some rows must stop early"
    assert any(r["mask"][0] != NO_TOKEN for r in requests)
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    with model_for(rows, dtype) as model:
        start = model.pool.free_count
        fast, fast_stats = pipeline_tokens(model, requests, max_new, 2, order)
        assert model.pool.free_count == start
        slow, slow_stats = pipeline_tokens(model, requests, max_new, 1, order)
        assert model.pool.free_count == start
    assert fast == expected
    assert slow == expected
    assert fast_stats["ahead_launches"] > 0 and fast_stats["rows_discarded"] > 0
    assert fast_stats["reserved_in_flight"] == 0
    assert slow_stats["ahead_launches"] == 0


def test_masks_that_ban_the_winner_change_the_token(host, no_leaks):
    with model_for(2) as model, AsyncDeviceIo(model, 2) as io:
        seqs = [SequenceState(0), SequenceState(1)]
        prompt = [3, 1, 4]
        for seq in seqs:
            model.prefill(seq, prompt[:-1])
        winner = host_next_token(prompt, VOCAB)
        ticket = io.launch_decode([4, 4], seqs, [(NO_TOKEN, NO_TOKEN), (winner, NO_TOKEN)])
        ids = io.await_result(ticket)
        assert ids[0] == winner
        assert ids[1] == host_next_token(prompt, VOCAB, mask=(winner, NO_TOKEN)) != winner
        for seq in seqs:
            model.release_sequence(seq)


def test_fed_rows_read_the_previous_steps_cells_by_from_row(host, no_leaks):
    """A fed step mixing host ids and reordered from_rows, checked against the host."""
    with model_for(3) as model, AsyncDeviceIo(model, 3) as io:
        seqs = [SequenceState(i) for i in range(3)]
        prompts = [[1, 2], [3, 4, 5], [6]]
        for seq, p in zip(seqs, prompts):
            model.prefill(seq, p[:-1])
        t0 = io.launch_decode([p[-1] for p in prompts], seqs, [(NO_TOKEN, NO_TOKEN)] * 3)
        # Row order of step 1: seq 2 (fed from row 2), seq 0 (host id 77), seq 1 (fed from row 1).
        order = [seqs[2], seqs[0], seqs[1]]
        for seq in order:
            io.reserve_kv(seq)
        t1 = io.launch_fed([FeedSource.feed(2), FeedSource.host(77), FeedSource.feed(1)], order,
                           [(NO_TOKEN, NO_TOKEN)] * 3)
        g0 = io.await_result(t0)
        inputs = {0: 77, 1: g0[1], 2: g0[2]}
        for seq in order:
            seq.tokens.append(inputs[seq.slot_idx])
            seq.seq_len += 1
        g1 = io.await_result(t1)
        expected = [host_next_token(prompts[s.slot_idx] + [inputs[s.slot_idx]], VOCAB) for s in order]
        assert g1 == expected
        assert g0 == [host_next_token(p, VOCAB) for p in prompts]
        assert model.settled_steps == 1  # one fed step settled
        for seq in seqs:
            model.release_sequence(seq)


def launch_one(io, model, seq):
    return io.launch_decode([1], [seq], [(NO_TOKEN, NO_TOKEN)])


def test_ring_exhaustion_raises_before_launching(host, no_leaks):
    with model_for(1) as model, AsyncDeviceIo(model, 1) as io:
        seq = SequenceState(0)
        tickets = [launch_one(io, model, seq) for _ in range(3)]
        seq_len = seq.seq_len
        with pytest.raises(FeedError, match="readback ring exhausted"):
            launch_one(io, model, seq)
        assert seq.seq_len == seq_len  # nothing was launched
        io.await_result(tickets[0])
        tickets.append(launch_one(io, model, seq))  # a slot is free again
        for t in tickets[1:]:
            io.await_result(t)
        with pytest.raises(FeedError, match="already awaited"):
            io.await_result(tickets[1])
        model.release_sequence(seq)


def test_event_query_fault_surfaces_releases_the_slot_and_the_ring_works_on(host, no_leaks):
    with model_for(1) as model, AsyncDeviceIo(model, 1) as io:
        seq = SequenceState(0)
        metrale_feed.configure_host(lag_us=2000, fail_event_query_at=1)
        ticket = launch_one(io, model, seq)
        with pytest.raises(FeedError, match="fault injected"):
            io.await_result(ticket)
        metrale_feed.configure_host()
        # All three slots are usable again: the failed wait released its slot.
        tickets = [launch_one(io, model, seq) for _ in range(3)]
        history = [1] * seq.seq_len
        results = [io.await_result(t) for t in tickets]
        assert results[-1] == [host_next_token(history, VOCAB)]
        model.release_sequence(seq)


def test_kv_exhaustion_in_the_router_is_clear_and_leaks_nothing(host, no_leaks):
    with model_for(2, num_blocks=2, block_size=2) as model, AsyncDeviceIo(model, 2) as io:
        a, b = SequenceState(0), SequenceState(1)
        model.prefill(a, [1, 2])
        model.prefill(b, [1, 2])
        assert model.pool.free_count == 0
        with pytest.raises(KvPoolExhausted):
            io.reserve_kv(a)
        with pytest.raises(KvPoolExhausted):
            io.launch_decode([3, 3], [a, b], [(NO_TOKEN, NO_TOKEN)] * 2)
        assert (a.seq_len, b.seq_len) == (2, 2) and io.stats.launches == 0
        model.release_sequence(a)
        model.release_sequence(b)
        assert model.pool.free_count == 2


def test_rollback_returns_exactly_the_latest_reservation(host, no_leaks):
    with model_for(1, block_size=2) as model, AsyncDeviceIo(model, 1) as io:
        seq = SequenceState(0)
        model.prefill(seq, [5])                     # seq_len 1, one block
        t0 = launch_one(io, model, seq)             # writes position 1, seq_len 2
        assert io.reserve_kv(seq) == 1              # position 2 needs block 2
        t1 = io.launch_fed([FeedSource.feed(0)], [seq], [(NO_TOKEN, NO_TOKEN)])
        io.await_result(t0)
        assert io.stats.reserved_in_flight == 1
        assert io.rollback(seq) == 1                # the row stopped: step 1 is discarded
        assert len(seq.block_table) == 1 and io.stats.blocks_rolled_back == 1
        assert io.rollback(seq) == 0                # nothing more to return
        io.await_result(t1)
        assert io.stats.reserved_in_flight == 0
        model.release_sequence(seq)
        assert model.pool.free_count == model.pool.num_blocks


def test_teardown_with_a_step_in_flight(host, no_leaks):
    metrale_feed.configure_host(lag_us=3000)
    model = model_for(1)
    io = AsyncDeviceIo(model, 1)
    seq = SequenceState(0)
    launch_one(io, model, seq)
    io.teardown()
    io.teardown()  # idempotent
    with pytest.raises(FeedError, match="torn down"):
        launch_one(io, model, seq)
    model.release_sequence(seq)
    model.close()


def test_sync_router_settles_each_step_and_refuses_fed_without_feed(host, no_leaks):
    with model_for(1) as model:
        with SyncDeviceIo(model, 1) as io:
            seq = SequenceState(0)
            ticket = launch_one(io, model, seq)
            # Settled: the ids are there without any wait.
            assert io.await_result(ticket) == [host_next_token([1], VOCAB)]
            model.release_sequence(seq)


def test_router_validates_rows_and_lengths(host, no_leaks):
    with model_for(2) as model, AsyncDeviceIo(model, 2) as io:
        seqs = [SequenceState(i) for i in range(3)]
        with pytest.raises(ValueError):
            io.launch_decode([1, 2, 3], seqs, [(NO_TOKEN, NO_TOKEN)] * 3)  # more than max_rows
        with pytest.raises(ValueError):
            io.launch_decode([1], seqs[:2], [(NO_TOKEN, NO_TOKEN)] * 2)
        with pytest.raises(ValueError):
            AsyncDeviceIo(model, 0)
        assert io.stats.launches == 0


def test_live_objects_back_to_zero_after_a_pipeline_run(host):
    before = metrale_feed.live_objects()
    requests = make_requests(4, 8, VOCAB, "float32", 5)
    with model_for(4) as model:
        pipeline_tokens(model, requests, 8, 2, range(4))
    assert_counts_back(before)


def test_masks_as_flat_and_2d_uint32_buffers(host, no_leaks):
    """The router takes masks as pairs, a (rows, 2) buffer or a flat one; a count that does not
    match the rows is refused before the step touches any sequence."""
    from array import array

    import numpy as np

    with model_for(2) as model, AsyncDeviceIo(model, 2) as io:
        seqs = [SequenceState(0), SequenceState(1)]
        winner = host_next_token([9], VOCAB)
        flat = array("I", [winner, NO_TOKEN, NO_TOKEN, NO_TOKEN])
        grid = np.array([[winner, NO_TOKEN], [NO_TOKEN, NO_TOKEN]], np.uint32)
        for masks in (flat, grid):
            ticket = io.launch_decode([9, 9], seqs, masks)
            assert io.await_result(ticket) == [host_next_token([9], VOCAB, mask=(winner, NO_TOKEN)), winner]
            for seq in seqs:
                model.release_sequence(seq)
                seq.tokens, seq.seq_len = [], 0
        with pytest.raises(ValueError, match="masks"):
            io.launch_decode([9, 9], seqs, array("I", [NO_TOKEN] * 2))
        assert [s.seq_len for s in seqs] == [0, 0]


def test_stats_read_by_name_and_attribute(host, no_leaks):
    with model_for(1) as model, AsyncDeviceIo(model, 1) as io:
        seq = SequenceState(0)
        io.await_result(launch_one(io, model, seq))
        assert io.stats["launches"] == io.stats.launches == 1
        with pytest.raises(KeyError):
            io.stats["nope"]
        model.release_sequence(seq)


def test_resolve_defaults_to_the_rows_of_the_last_argmax(host, no_leaks, dev):
    import numpy as np

    logits = np.eye(3, 5, dtype=np.float32)  # row r's argmax is r
    buf = dev.upload(logits)
    cells = metrale_feed.DeviceBuffer(8 * 4)
    out = metrale_feed.DeviceBuffer(4 * 4)
    with pytest.raises(ValueError, match="prev_rows is required"):
        metrale_feed.resolve_feed([FeedSource.feed(0)], cells, out)
    assert metrale_feed.argmax_to_feed(buf, None, cells, None, None, rows=3, vocab=5,
                                       dtype="float32") == 3
    with pytest.raises(ValueError, match="beyond the previous step's 3 rows"):
        metrale_feed.resolve_feed([FeedSource.feed(3)], cells, out)
    metrale_feed.resolve_feed([FeedSource.feed(2), FeedSource.host(41), FeedSource.feed(0), FeedSource.feed(1)],
                              cells, out)
    assert list(dev.download(out, "uint32")) == [2, 41, 0, 1]
    for b in (buf, cells, out):
        b.close()


def test_interior_cells_are_forgotten_when_their_buffer_is_freed(host, no_leaks, dev):
    """Interior cell pointers' defaults go with their buffer (a new allocation at the address
    must not inherit one), and the table does not grow per call."""
    import numpy as np

    core = metrale_feed._core
    before = core._cell_rows_len()
    buf = dev.upload(np.eye(1, 5, dtype=np.float32))
    cells = metrale_feed.DeviceBuffer(600 * 4)
    out = metrale_feed.DeviceBuffer(4)
    for i in range(500):  # 500 distinct interior pointers of one buffer
        metrale_feed.argmax_to_feed(buf, None, cells.ptr + 4 * i, None, None, rows=1, vocab=5,
                                    dtype="float32")
    metrale_feed.resolve_feed([FeedSource.feed(0)], cells.ptr + 4 * 499, out)  # the default
    assert list(dev.download(out, "uint32")) == [0]
    assert core._cell_rows_len() == before + 500
    metrale_feed.stream_synchronize(0)
    cells.close()
    assert core._cell_rows_len() == before
    for b in (buf, out):
        b.close()


def test_the_resolve_default_keeps_the_most_recent_cells(host, no_leaks, dev):
    """Past CELL_ROWS_KEPT addresses the least recently written is forgotten (its resolve then
    asks for prev_rows, a clear error); cells written every step stay."""
    import numpy as np

    core = metrale_feed._core
    kept = core.CELL_ROWS_KEPT
    buf = dev.upload(np.eye(1, 5, dtype=np.float32))
    cells = metrale_feed.DeviceBuffer((kept + 200) * 4)
    out = metrale_feed.DeviceBuffer(4)
    hot = cells.ptr + 4 * (kept + 100)

    def write(ptr):
        metrale_feed.argmax_to_feed(buf, None, ptr, None, None, rows=1, vocab=5, dtype="float32")

    for i in range(kept + 50):
        write(cells.ptr + 4 * i)
        if i % 64 == 0:
            write(hot)  # a pipeline's cells: rewritten all along
    assert core._cell_rows_len() <= kept
    metrale_feed.resolve_feed([FeedSource.feed(0)], hot, out)
    with pytest.raises(ValueError, match="prev_rows is required"):
        metrale_feed.resolve_feed([FeedSource.feed(0)], cells.ptr, out)  # the oldest: forgotten
    metrale_feed.resolve_feed([FeedSource.feed(0)], cells.ptr, out, prev_rows=1)
    metrale_feed.stream_synchronize(0)
    for b in (buf, cells, out):
        b.close()


def test_a_ticket_awaited_twice_is_refused_after_its_slot_was_reused(host, no_leaks):
    """await(t1), a launch that reuses t1's slot, await(t1) again: FeedError, never the newer
    step's ids; the newer ticket still reads its own ids."""
    with model_for(1) as model, AsyncDeviceIo(model, 1) as io:
        seq = SequenceState(0)
        t1 = launch_one(io, model, seq)
        first = io.await_result(t1)
        t2 = launch_one(io, model, seq)
        assert t2.slot == t1.slot  # the same slot, a newer generation
        with pytest.raises(FeedError, match="already awaited"):
            io.await_result(t1)
        assert io.await_result(t2) == [host_next_token([1, 1], VOCAB)]
        assert first == [host_next_token([1], VOCAB)]
        with SyncDeviceIo(model, 1) as other:
            with pytest.raises(FeedError, match="not launched by this router"):
                other.await_result(t2)
        model.release_sequence(seq)


@pytest.mark.parametrize("fed", [False, True])
def test_a_refused_launch_at_a_block_boundary_takes_no_block_and_runs_nothing(host, no_leaks, fed):
    """A bad FeedSource or a mask id outside the vocabulary, at a position that starts a block:
    refused before the model reserves a block or runs its forward."""
    with model_for(2, block_size=2) as model, AsyncDeviceIo(model, 2) as io:
        seqs = [SequenceState(0), SequenceState(1)]
        for seq in seqs:
            model.prefill(seq, [3])
        io.await_result(io.launch_decode([5, 5], seqs, None))  # seq_len 2: position 2 starts block 2
        free, lens = model.pool.free_count, [s.seq_len for s in seqs]
        tables = [list(s.block_table) for s in seqs]
        launch = io.launch_fed if fed else io.launch_decode
        good = [FeedSource.feed(0), FeedSource.feed(1)] if fed else [6, 6]
        bad_inputs = ([FeedSource.feed(2), FeedSource.feed(0)], [FeedSource.host(VOCAB), FeedSource.feed(0)]) \
            if fed else ([VOCAB, 1],)
        for inputs in bad_inputs:
            with pytest.raises(ValueError, match="previous step|vocabulary"):
                launch(inputs, seqs, None)
        with pytest.raises(ValueError, match="mask id"):
            launch(good, seqs, [(VOCAB, NO_TOKEN), (NO_TOKEN, NO_TOKEN)])
        assert model.pool.free_count == free
        assert [s.seq_len for s in seqs] == lens and [s.block_table for s in seqs] == tables
        assert io.stats.launches == 1 and model.settled_steps == 0
        # The same launch with good inputs runs, and its tokens are exact.
        ids = io.await_result(launch(good, seqs, None))
        assert len(ids) == 2 and model.pool.free_count == free - 2
        for seq in seqs:
            model.release_sequence(seq)


def test_a_router_dropped_without_teardown_tears_down_on_collection(host, no_leaks):
    import gc

    metrale_feed.configure_host(lag_us=2000)
    with model_for(1) as model:
        io = AsyncDeviceIo(model, 1)
        seq = SequenceState(0)
        launch_one(io, model, seq)  # a step in flight
        during = metrale_feed.live_objects()
        with pytest.warns(ResourceWarning, match="not torn down"):
            del io
            gc.collect()
        after = metrale_feed.live_objects()
        # The ring's three events and three 4-byte slots are gone; the model's own are not.
        assert after["events"] == during["events"] - 3
        assert after["pinned_bytes"] == during["pinned_bytes"] - 3 * 4
        model.release_sequence(seq)
