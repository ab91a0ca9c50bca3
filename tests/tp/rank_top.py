"""Top and raw logprobs over a split vocabulary, in a graph and through the SPMD pipeline with
penalties (rank_main.py runs them; ``h`` is that module, with the rank, the world and the shared
helpers). The merge is a kernel (``mf_top_logprobs_combine``), so the sharded call is captured like
the others; with penalties the logprobs come from each rank's slice of the raw copy, with the
chosen ids the sharded combine wrote."""

import numpy as np

import metrale_feed as mf
from metrale_feed.testing.oracle import reference_logprobs

from helpers.accuracy import assert_close


def scenario_top_graph(h):
    """Every rank captures a sharded top_logprobs with chosen ids, then replays it on new logits
    and new ids written into the captured buffers: the unsharded records each time (the numpy
    oracle's ids, its logprobs within the contract), one collective a replay."""
    vocab, rows, n = 1000, 6, 4
    offsets = {1: None, 2: [0, 333, vocab], 3: [0, 600, vocab, vocab]}.get(h.WORLD)  # 3: an empty slice
    shard = mf.VocabShard(None, vocab, offsets=offsets, max_rows=8)
    lo, hi = shard.start, shard.stop
    width = hi - lo
    sl = mf.DeviceBuffer(max(1, rows * width * 4))
    staged = mf.PinnedBuffer(max(1, rows * width * 4))
    ids_dev, ids_host = mf.DeviceBuffer(rows * 4), mf.PinnedBuffer(rows * 4)
    out, chosen = mf.DeviceBuffer(rows * n * 8), mf.DeviceBuffer(rows * 4)
    got_out, got_chosen = mf.PinnedBuffer(rows * n * 8), mf.PinnedBuffer(rows * 4)
    done, stream = mf.Event(), mf.Stream()

    def step():
        mf.copy_h2d_async(sl, staged, stream)  # pinned: read at each launch
        mf.copy_h2d_async(ids_dev, ids_host, stream)
        shard.top_logprobs(sl if width else None, out, stream, n=n, rows=rows, dtype="float32",
                           ids=ids_dev, chosen=chosen)
        mf.copy_d2h_async(out, got_out, stream)
        mf.copy_d2h_async(chosen, got_chosen, stream)
        mf.event_record(done, stream)

    def fill(seed):
        rng = np.random.default_rng(seed)
        logits = h.nasty(rng, rows, vocab, np.float32, shard.offsets)
        if width:
            np.frombuffer(staged, np.float32)[: rows * width] = logits[:, lo:hi].ravel()
        ids = rng.integers(0, vocab, rows).astype(np.uint32)
        ids[1] = mf.NO_TOKEN
        ids[2] = vocab + 5  # past the vocabulary: NaN, as the unsharded call gives
        ids[3] = shard.offsets[-2]  # the last non-empty slice's first id
        np.frombuffer(ids_host, np.uint32)[:] = ids
        return logits, ids

    def check(logits, ids):
        got = np.frombuffer(got_out, h.TOP).reshape(rows, n)
        want = h.whole_top(logits, n)
        o_ids, o_lp = h.oracle_top(logits, n)
        assert np.array_equal(got["id"], want["id"]) and np.array_equal(got["id"], o_ids), got
        assert_close(got["logprob"].ravel(), o_lp.ravel())
        lp = np.frombuffer(got_chosen, np.float32).copy()
        valid = ids < vocab
        assert np.isnan(lp[~valid]).all(), lp
        assert_close(lp[valid], reference_logprobs(logits[valid], ids[valid]))
        h.same_on_every_rank(got)
        h.same_on_every_rank(lp)

    # The combine's outputs are checked before anything is queued (else this rank alone would
    # fault after its collective, and its peers would wait for it at the next one).
    before = dict(shard.stats)
    for bad, match in ((dict(out=out, chosen=out), "overlap"), (dict(out=out, chosen=out.ptr + 1), "aligned"),
                       (dict(out=out, chosen=0x1000), "need")):
        try:
            shard.top_logprobs(sl if width else None, n=n, rows=rows, dtype="float32", ids=ids_dev,
                               stream=stream, **bad)
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"{bad} was taken")
    assert shard.stats == before, shard.stats
    logits, ids = fill(1)
    step()  # once eagerly: the shard still takes calls
    done.synchronize()
    check(logits, ids)
    before = dict(shard.stats)
    with mf.graph_capture(stream) as graph:
        step()
    assert shard.stats == before, (shard.stats, before)  # a capture issues no collective
    for k in range(3):
        logits, ids = fill(100 + k)
        graph.launch(stream)
        done.synchronize()
        check(logits, ids)
        if h.WORLD > 1 or h.FORCE_EXCHANGE:
            assert shard.stats["collectives"] == before["collectives"] + k + 1, shard.stats
            assert shard.stats["bytes_sent"] == before["bytes_sent"] + \
                (k + 1) * mf._core._top_block_bytes(8, n), shard.stats
    graph.close()
    shard.close()
    for buf in (sl, staged, ids_dev, ids_host, out, chosen, got_out, got_chosen, done, stream):
        buf.close()


# Rows with penalties and logprobs, rows with either, greedy and sampled (docs/penalties.md).
PEN = [dict(logprobs=True, top_logprobs=3, logit_bias={7: 0.6, 990: 0.4}, frequency_penalty=0.15),
       dict(logit_bias={3: 0.8, 700: 0.7}, presence_penalty=0.5),
       dict(logprobs=True, logit_bias={9: 1.0}, repetition_penalty=3.0, temperature=0.8, seed=4),
       dict(logprobs=True, top_logprobs=2),
       dict(logprobs=True, min_tokens=4, logit_bias={5: 0.9}, stop_ids=[5]),
       dict(logprobs=True, top_logprobs=20, repetition_penalty=0.5, temperature=1.1, seed=9,
            top_k=20)]


def scenario_pipeline_penalties(h):
    """The SPMD pipeline with penalties and logprobs over the split (each rank penalises its own
    slice and takes the raw logprobs from its slice of the raw copy): every rank gets the tokens,
    logprobs and top logprobs of the unsharded pipeline, at depth 1 and 2, with a pool that
    preempts, and the logprobs are the raw distribution's (the oracle's), not the penalised one's;
    no host synchronisation beyond a step's."""
    from metrale_feed.testing.reference import ReferenceModel

    vocab = 1000
    offsets = {1: None, 2: [0, 333, vocab], 3: [0, 600, vocab, vocab]}.get(h.WORLD)
    shard = mf.VocabShard(None, vocab, offsets=offsets, max_rows=8)

    def decode(depth, sharded, blocks):
        model = ReferenceModel(vocab, max_rows=8, block_size=2, num_blocks=blocks,
                               shard=shard if sharded else None)
        with mf.DecodePipeline(model, len(PEN), depth=depth, shard=shard if sharded else None) as pipe:
            reqs = [pipe.submit([3, 1, 4 + i, 2 * i], max_new_tokens=8, **kw)
                    for i, kw in enumerate(PEN)]
            pipe.run()
            stats = (pipe.stats.steps, pipe.stats.host_syncs, pipe.stats.preemptions)
        model.close()
        return [(r.tokens, r.logprobs, r.top_logprobs) for r in reqs], stats

    raw_differs = False
    for depth in (1, 2):
        for blocks in (200, 12):
            want, _ = decode(depth, False, blocks)
            before = shard.stats["collectives"]
            got, (steps, syncs, preempted) = decode(depth, True, blocks)
            assert (preempted > 0) == (blocks == 12), (blocks, preempted)
            if depth == 2:
                assert syncs == steps, (syncs, steps)
            assert h.WORLD == 1 or shard.stats["collectives"] - before >= steps, shard.stats
            for i, ((tokens, lp, top), (w_tokens, w_lp, w_top)) in enumerate(zip(got, want)):
                what = (depth, blocks, i)
                assert tokens == w_tokens, (what, tokens, w_tokens)
                assert (lp is None) == (w_lp is None) == (not PEN[i].get("logprobs")), what
                assert (top is None) == (w_top is None) == (not PEN[i].get("top_logprobs")), what
                if lp is None:
                    continue
                # The raw distribution's logprobs (the oracle's, from the unpenalised logits).
                ref = h.raw_logprobs([3, 1, 4 + i, 2 * i], tokens, vocab)
                assert_close(np.array(lp), ref)
                assert_close(np.array(w_lp), ref)
                for step, (a, b) in enumerate(zip(top or [], w_top or [])):
                    h.assert_same_top(a, b, (what, step))
                    raw_differs |= a[0][0] != tokens[step]
            every = [None] * h.WORLD
            h.dist.all_gather_object(every, got)
            assert all(e == got for e in every), "the ranks' tokens or logprobs differ"
    assert raw_differs  # else the test could not tell raw from penalised logprobs
    shard.close()


SCENARIOS = {"top-graph": scenario_top_graph, "pipeline-penalties": scenario_pipeline_penalties}
