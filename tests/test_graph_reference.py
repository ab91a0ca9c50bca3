"""ReferenceModel(graphs=True): the fed step as a captured graph gives the tokens of the default
path and of the host reference, through the two-deep pipeline with stops, reorders and drops (the
row count changes, so several graphs are captured), and leaks nothing."""

import random

import pytest

from metrale_feed import AsyncDeviceIo, FeedSource
from metrale_feed.tools.demo import host_reference, make_requests, run_async
from metrale_feed.feed import NO_TOKEN
from metrale_feed.kv import SequenceState
from metrale_feed.testing.reference import ReferenceModel, host_next_token

VOCAB = 600


def model_for(rows, graphs, dtype="float32", **kw):
    return ReferenceModel(VOCAB, block_size=4, num_blocks=rows * 40, max_rows=rows,
                          logits_dtype=dtype, graphs=graphs, **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", [0, 3])
def test_graph_tokens_equal_eager_tokens_equal_host(backend, no_leaks, dtype, seed):
    rows, max_new = 10, 20
    requests = make_requests(rows, max_new, VOCAB, dtype, seed)
    expected = [host_reference(r["prompt"], r["mask"], r["stop"], max_new, VOCAB, dtype) for r in requests]
    assert any(len(e) < max_new for e in expected), "rows must stop early: the row count changes"
    results = {}
    for graphs in (False, True):
        with model_for(rows, graphs, dtype, max_graphs=4) as model:
            start = model.pool.free_count
            results[graphs] = run_async(model, requests, max_new, shuffle=random.Random(seed))
            assert model.pool.free_count == start
            if graphs:
                stats = model.graph_stats
                assert stats["launches"] > stats["captures"] > 1, stats  # replays, several shapes
                assert stats["live"] <= 4 + 1  # evicted at fed_step_settled (the last may stay)
            else:
                assert model.graph_stats == {}
    assert results[True]["tokens"] == results[False]["tokens"] == expected


def test_graph_steps_read_new_masks_and_sources_each_replay(backend, no_leaks):
    """Same shape every step (one graph, replayed), masks that change every step, and rows fed
    from permuted rows of the previous step: each replay reads the new values."""
    rows = 3
    with model_for(rows, True) as model, AsyncDeviceIo(model, rows) as io:
        seqs = [SequenceState(i) for i in range(rows)]
        prompts = [[5, 9], [1, 2, 3], [7]]
        history = {}
        for seq, p in zip(seqs, prompts):
            model.prefill(seq, p[:-1])
            history[seq.slot_idx] = list(p)
        first = io.launch_decode([p[-1] for p in prompts], seqs, None)
        last = io.await_result(first)
        rng = random.Random(1)
        for step in range(8):
            order = seqs[:]
            rng.shuffle(order)
            prev_rows = {seq.slot_idx: r for r, seq in enumerate(seqs)}
            masks = []
            for seq in order:
                want = host_next_token(history[seq.slot_idx] + [last[prev_rows[seq.slot_idx]]], VOCAB)
                masks.append((want, NO_TOKEN) if rng.random() < 0.5 else (NO_TOKEN, NO_TOKEN))
            for seq in order:
                io.reserve_kv(seq)
            ticket = io.launch_fed([FeedSource.feed(prev_rows[s.slot_idx]) for s in order], order, masks)
            for seq in order:
                token = last[prev_rows[seq.slot_idx]]
                seq.tokens.append(token)
                seq.seq_len += 1
                history[seq.slot_idx].append(token)
            got = io.await_result(ticket)
            want = [host_next_token(history[s.slot_idx], VOCAB, mask=m) for s, m in zip(order, masks)]
            assert got == want, step
            seqs, last = order, got
        assert model.graph_stats["captures"] <= 3  # one per readback slot: the shape never changed
        assert model.graph_stats["launches"] == 8
        for seq in seqs:
            model.release_sequence(seq)


def test_bad_masks_in_graph_mode_are_refused_and_the_step_still_runs(backend, no_leaks):
    with model_for(1, True) as model, AsyncDeviceIo(model, 1) as io:
        seq = SequenceState(0)
        model.prefill(seq, [4])
        ids = io.await_result(io.launch_decode([2], [seq], None))
        io.reserve_kv(seq)
        with pytest.raises(ValueError, match="not below vocab"):
            io.launch_fed([FeedSource.feed(0)], [seq], [(VOCAB, NO_TOKEN)])
        assert model._fed_graphs.pending is None
        seq.tokens.append(ids[0])
        seq.seq_len += 1
        model.release_sequence(seq)


def test_graph_mode_is_refused_without_a_positive_cap(backend, no_leaks):
    with pytest.raises(ValueError, match="max_graphs"):
        ReferenceModel(VOCAB, max_rows=1, graphs=True, max_graphs=0)
