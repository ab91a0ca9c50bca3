"""The sharded ``verify_to_feed`` scenarios of one rank (rank_main.py runs them; ``h`` is that
module, with the rank, the world and the shared helpers). Every rank checks its own cells against
the unsharded call on the whole logits, computed in the same process, and a numpy oracle of the
greedy verify rule built on ``reference_argmax``."""

import numpy as np

import metrale_feed as mf
from metrale_feed.errors import FeedError
from metrale_feed.testing.oracle import reference_argmax, reference_logprobs

from helpers.accuracy import assert_close

K = 3


def oracle_cells(logits, masks, bitmask, drafts, rows, k, vocab):
    """numpy: the greedy verify rule's cells, from the argmax rule at every position."""
    t = reference_argmax(logits, masks, bitmask).reshape(rows, k + 1)
    cells = np.full((rows, k + 2), mf.NO_TOKEN, np.uint32)
    for r in range(rows):
        n = 0
        for j in range(k + 1):
            x = drafts[r, j] if j < k else mf.NO_TOKEN
            cells[r, 1 + n] = t[r, j]
            n += 1
            if x == mf.NO_TOKEN or x >= vocab or x != t[r, j] or t[r, j] == mf.NO_TOKEN:
                break
        cells[r, 0] = n
        if any(drafts[r, j] == mf.NO_TOKEN for j in range(n - 1)):
            raise AssertionError("the oracle walked past a row's last draft")
    return cells


def drafts_for(logits, masks, bitmask, rows, k, vocab, rng):
    """Drafts that exercise every outcome: all accepted, a mismatch at each position, an early
    NO_TOKEN, an id at or beyond vocab (device drafts only)."""
    t = reference_argmax(logits, masks, bitmask).reshape(rows, k + 1)
    d = t[:, :k].copy()
    for r in range(rows):
        kind = r % 4
        if kind == 1:
            j = int(rng.integers(0, k))
            d[r, j] = (int(t[r, j]) + 1) % vocab
        elif kind == 2:
            d[r, int(rng.integers(1, k))] = mf.NO_TOKEN
        elif kind == 3:
            d[r, 0] = (int(t[r, 0]) + 7) % vocab
    return d.astype(np.uint32)


def whole_verify(h, logits, drafts, masks, bitmask, k, params=None, advance=None):
    rows_all, vocab = logits.shape
    rows = rows_all // (k + 1)
    buf, cells = h.upload(logits), mf.DeviceBuffer(rows * (k + 2) * 4)
    bm = h.upload(bitmask) if bitmask is not None else None
    lp_dev = mf.DeviceBuffer(rows_all * 4)
    dst, lp = np.zeros(rows * (k + 2), np.uint32), np.full(rows_all, 7.0, np.float32)
    with mf.Event() as done:
        mf.verify_to_feed(buf, drafts.reshape(-1), cells, dst, done, k=k, masks=masks, bitmask=bm,
                          params=params, logprobs=lp_dev, logprobs_dst=lp, rows=rows, vocab=vocab,
                          dtype=np.dtype(logits.dtype).name, advance=advance)
        done.synchronize()
    return dst.reshape(rows, k + 2), lp.reshape(rows, k + 1)


def sharded_verify(h, shard, logits, drafts, masks, bitmask, k, *, pad=0, device_drafts=False,
                   params=None, rows=None, wait=True, logprobs=True, advance=None):
    lo, hi = shard.start, shard.stop
    n = logits.shape[0]
    nrows = n // (k + 1)
    part = np.zeros((n, hi - lo + pad), logits.dtype)
    part[:, : hi - lo] = logits[:, lo:hi]
    sl = h.upload(part) if hi > lo else None
    bm = h.upload(bitmask) if bitmask is not None else None
    dr = h.upload(drafts) if device_drafts else drafts.reshape(-1)
    cells = mf.DeviceBuffer(nrows * (k + 2) * 4)
    lp_dev = mf.DeviceBuffer(n * 4) if logprobs else None
    dst = np.zeros(nrows * (k + 2), np.uint32)
    lp = np.full(n, 7.0, np.float32) if logprobs else None
    done = mf.Event()
    got = mf.verify_to_feed(sl, dr, cells, dst, done, k=k, masks=masks, bitmask=bm, params=params,
                            logprobs=lp_dev, logprobs_dst=lp, rows=nrows if rows is None else rows,
                            dtype=np.dtype(logits.dtype).name,
                            row_stride=hi - lo + pad if pad and hi > lo else None, shard=shard,
                            advance=advance)
    assert got == (nrows if rows is None else rows), got
    if wait:
        done.synchronize()
    return dst.reshape(nrows, k + 2), None if lp is None else lp.reshape(nrows, k + 1), done, (sl, bm, dr, cells, lp_dev)


def scenario_verify(h):
    """Greedy rows over every split: the unsharded cells on every rank, the oracle's, logprobs
    those of the sharded argmax at the emitted positions, one exchange a call."""
    vocab, rows, k = 1000, 4, K
    n = rows * (k + 1)
    for dtype, name, shard, rng in h.each_split(vocab, "verify"):
        logits = h.nasty(rng, n, vocab, h.DTYPES[dtype], shard.offsets)
        masks = rng.integers(0, vocab, (n, 2)).astype(np.uint32)
        masks[::3] = mf.NO_TOKEN
        bitmask = rng.integers(-2**31, 2**31, (n, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        bitmask[: k + 1] = -1
        bitmask[k] = 0  # row 0 keeps its drafts; its bonus position has no candidate: NO_TOKEN
        drafts = drafts_for(logits, masks, bitmask, rows, k, vocab, rng)
        want, want_lp = whole_verify(h, logits, drafts, masks, bitmask, k)
        oracle = oracle_cells(logits, masks, bitmask, drafts, rows, k, vocab)
        assert np.array_equal(want, oracle), (dtype, name, want, oracle)
        assert len({int(c) for c in want[:, 0]}) > 1, want  # rows end at different counts
        # The sharded argmax over the same positions: the logprobs' reference bits.
        ids, argmax_lp, *_ = h.sharded(shard, logits, masks, bitmask)
        for pad, device in ((0, False), (3, True)):
            before = shard.stats["collectives"]
            got, lp, *_ = sharded_verify(h, shard, logits, drafts, masks, bitmask, k, pad=pad,
                                         device_drafts=device)
            assert np.array_equal(got, want), (dtype, name, pad, got, want)
            assert shard.stats["collectives"] - before == (1 if WORLD_SPLIT(h) else 0)
            for r in range(rows):
                m = int(got[r, 0])
                assert np.array_equal(lp[r, :m], argmax_lp[r * (k + 1): r * (k + 1) + m], equal_nan=True)
                assert np.isnan(lp[r, m:]).all(), lp[r]
                assert_close(lp[r, :m], reference_logprobs(logits[r * (k + 1): r * (k + 1) + m],
                                                           got[r, 1: 1 + m]))
        # Greedy host params (temperature 0) are the same call; an id past vocab in device
        # drafts is never accepted.
        bad = drafts.copy()
        bad[0, 0] = vocab + 5
        got, *_ = sharded_verify(h, shard, logits, bad, masks, bitmask, k, device_drafts=True,
                                 params=mf.sampling_params(rows, temperature=0.0))
        assert np.array_equal(got, oracle_cells(logits, masks, bitmask, bad, rows, k, vocab)), got
        assert got[0, 0] == 1
        shard.close()


def WORLD_SPLIT(h):
    return h.WORLD > 1 or h.FORCE_EXCHANGE


SAMPLED_FILTERS = (  # per row: temperature-only, candidate lists, a radix select with top_p, min_p
    dict(),
    dict(top_k=[5, 1, 40, 3, 0, 0], top_p=[1.0, 1.0, 0.8, 0.6, 0.9, 1.0]),
    dict(top_k=[0, 700, 0, 0, 0, 0], top_p=[0.9, 1.0, 0.5, 1.0, 1.0, 0.99], min_p=[0.0, 0.0, 0.0, 0.1, 0.02, 0.0]),
)


def sampled_drafts(h, logits, rows, k, params, rng):
    """Drafts a sampled verify judges every way: the position's argmax (mostly kept), its own draw
    (rejected now and then, then raced without), an unlikely id, an early NO_TOKEN."""
    n, vocab = logits.shape
    whole = h.upload(logits)
    own = np.zeros(n, np.uint32)
    with mf.DeviceBuffer(n * 4) as cells, mf.Event() as done:
        from metrale_feed.tp.verify_args import logit_row_params

        mf.sample_to_feed(whole, logit_row_params(params, rows, k), cells, own, done, vocab=vocab,
                          dtype=np.dtype(logits.dtype).name)
        done.synchronize()
    top = reference_argmax(logits, None, None)
    d = np.empty((rows, k), np.uint32)
    for r in range(rows):
        for j in range(k):
            lr = r * (k + 1) + j
            d[r, j] = (top[lr], own[lr], rng.integers(0, vocab))[int(rng.integers(0, 3))]
    d[1, 1] = mf.NO_TOKEN
    return d


def scenario_verify_sampled(h):
    """Sampled rows over every split, with every kind of filter round, greedy rows and a row whose
    zmax is infinite in the call, host params with and without a device advance, and with fixed
    rounds device params too: every rank gets the unsharded call's cells, bit for bit."""
    vocab, rows, k = 1000, 6, K
    n = rows * (k + 1)
    judged = 0
    for dtype, name, shard, rng in h.each_split(vocab, "verify-sampled", max_rows=32):
        logits = h.nasty(rng, n, vocab, h.DTYPES[dtype], shard.offsets)
        masks = rng.integers(0, vocab, (n, 2)).astype(np.uint32)
        masks[::3] = mf.NO_TOKEN
        for i, filters in enumerate(SAMPLED_FILTERS):
            params = mf.sampling_params(rows, temperature=[0.8, 1.0, 0.0, 1.3, 1e-38, 0.6],
                                        seed=rng.integers(0, 2**40, rows), position=rng.integers(0, 10**6, rows),
                                        **filters)
            drafts = sampled_drafts(h, logits, rows, k, params, rng)
            # Odd calls: a device advance (wrapping past 2**32 on row 3), read when the call runs.
            adv = h.upload(np.array([0, 1, 2, 2**32 - 1, 3, 1], np.uint32)) if i % 2 else None
            want, _ = whole_verify(h, logits, drafts, masks, None, k, params=params, advance=adv)
            before = dict(shard.stats)
            got, *_ = sharded_verify(h, shard, logits, drafts, masks, None, k, params=params, logprobs=False,
                                     device_drafts=bool(i % 2), advance=adv)
            assert np.array_equal(got, want), (dtype, name, filters, got, want)
            calls = shard.stats["collectives"] - before["collectives"]
            assert (calls >= 2) == WORLD_SPLIT(h)  # TOP, the filters' rounds, RACE
            if not filters and WORLD_SPLIT(h):  # temperature only: two 16-byte records a position
                sent = shard.stats["bytes_sent"] - before["bytes_sent"]
                assert calls == 2 and sent == 2 * 16 * (shard.max_rows + 2), (calls, sent)
            judged += int(want[:, 0].sum())
        shard.close()
    assert judged > 0
    # Fixed rounds (the cuda backend's only way): the same cells, the rounds' collectives each call.
    rounds = mf.FilterRounds(top_k=64, top_p=True)
    shard = mf.VocabShard(None, vocab, max_rows=32, filters=rounds)
    rng = np.random.default_rng(77)
    logits = h.nasty(rng, n, vocab, np.float32, shard.offsets)
    changed = 0
    for filters in SAMPLED_FILTERS[:2]:
        params = mf.sampling_params(rows, temperature=[0.8, 1.0, 0.0, 1.3, 1e-38, 0.6], seed=5, position=9, **filters)
        drafts = sampled_drafts(h, logits, rows, k, params, rng)
        adv = h.upload(rng.integers(0, 5, rows).astype(np.uint32))
        plain = whole_verify(h, logits, drafts, None, None, k, params=params)[0]
        want, _ = whole_verify(h, logits, drafts, None, None, k, params=params, advance=adv)
        changed += not np.array_equal(plain, want)  # the advance moved some draw
        # Host params, then device ones (the host cannot tell which rows they sample), each with
        # and without the advance.
        for given, moved in ((params, None), (params, adv), (h.upload(params), None), (h.upload(params), adv)):
            before = shard.stats["collectives"]
            got, *_ = sharded_verify(h, shard, logits, drafts, None, None, k, params=given, logprobs=False,
                                     advance=moved)
            assert np.array_equal(got, want if moved is not None else plain), (filters, got, want)
            assert shard.stats["collectives"] - before == (rounds.collectives if WORLD_SPLIT(h) else 0)
    assert changed
    # Greedy host params take the fixed rounds too (a rank's values never change the collectives).
    greedy = mf.sampling_params(rows, temperature=0.0)
    before = shard.stats["collectives"]
    got, *_ = sharded_verify(h, shard, logits, drafts, None, None, k, params=greedy, logprobs=False)
    assert np.array_equal(got, whole_verify(h, logits, drafts, None, None, k)[0]), got
    assert shard.stats["collectives"] - before == (rounds.collectives if WORLD_SPLIT(h) else 0)
    # Captured with device params, drafts and advance: each replay reads the advance it finds.
    lo, hi = shard.start, shard.stop
    sl = h.upload(np.ascontiguousarray(logits[:, lo:hi])) if hi > lo else None
    dev_params, dev_drafts = h.upload(params), h.upload(drafts)
    adv, staged = mf.DeviceBuffer(rows * 4), mf.PinnedBuffer(rows * 4)
    cells, dst, done, stream = mf.DeviceBuffer(rows * (k + 2) * 4), mf.PinnedBuffer(rows * (k + 2) * 4), mf.Event(), mf.Stream()
    with mf.graph_capture(stream) as graph:
        mf.copy_h2d_async(adv, staged, stream)
        mf.verify_to_feed(sl, dev_drafts, cells, dst, done, stream, k=k, rows=rows, dtype="float32",
                          params=dev_params, advance=adv, shard=shard)
    for seed in range(3):
        moved = np.random.default_rng(seed).integers(0, 6, rows).astype(np.uint32)
        np.frombuffer(staged, np.uint32)[:] = moved
        graph.launch(stream)
        done.synchronize()
        want, _ = whole_verify(h, logits, drafts, None, None, k, params=params, advance=h.upload(moved))
        assert np.array_equal(np.frombuffer(dst, np.uint32).reshape(rows, k + 2), want), (seed, want)
    graph.close()
    stream.close()
    shard.close()


def scenario_verify_refused(h):
    """What a sharded verify refuses, before anything is queued (so every rank goes on alike)."""
    vocab, rows, k = 1000, 2, K
    n = rows * (k + 1)
    shard = mf.VocabShard(None, vocab, max_rows=8)
    rng = np.random.default_rng(3)
    logits = h.nasty(rng, n, vocab, np.float32, shard.offsets)
    drafts = drafts_for(logits, None, None, rows, k, vocab, rng)
    sampled = mf.sampling_params(rows, temperature=0.7, seed=1)
    bad = sampled.copy()
    bad["top_p"][1] = 1.5  # the unsharded call refuses it: so does every rank, before any exchange
    greedy = mf.sampling_params(rows, temperature=0.0)
    cases = [
        (ValueError, "top_p", dict(params=bad, logprobs=False)),
        # advance is checked though no row samples (the greedy call never reads it)
        (ValueError, "advance holds", dict(params=greedy, advance=mf.DeviceBuffer(4), logprobs=False)),
        (TypeError, "device memory", dict(params=greedy, advance=np.ones(rows, np.uint32), logprobs=False)),
        (FeedError, "no logprobs", dict(params=sampled)),  # sampled rows: logprobs not built
        (ValueError, "max_rows", dict(rows=3)),  # 3 * 4 logit rows > 8
        (ValueError, "advance needs params", dict(advance=h.upload(np.ones(rows, np.uint32)), logprobs=False)),
        (TypeError, "device memory", dict(params=sampled, advance=np.ones(rows, np.uint32), logprobs=False)),
        (ValueError, "advance holds", dict(params=sampled, advance=mf.DeviceBuffer(4), logprobs=False)),
    ]
    for exc, needle, kw in cases:
        before = dict(shard.stats)
        try:
            sharded_verify(h, shard, np.tile(logits, (2, 1)) if kw.get("rows") == 3 else logits,
                           drafts if kw.get("rows") != 3 else np.tile(drafts, (2, 1)), None, None, k,
                           **kw)
        except exc as e:
            assert needle in str(e), e
        else:
            raise AssertionError(f"{kw} was taken")
        assert shard.stats == before, (shard.stats, before)
    lo, hi = shard.start, shard.stop
    sl = h.upload(np.ascontiguousarray(logits[:, lo:hi])) if hi > lo else None
    with mf.DeviceBuffer(rows * (k + 2) * 4) as cells:
        device_params = h.upload(sampled)
        for exc, kw in ((FeedError, dict(draft_probs=mf.DeviceBuffer(rows * k * vocab * 4))),
                        (ValueError, dict(drafts=np.array([[vocab, 0, 0]] * rows))),
                        # Device params: the rounds cannot follow them without FilterRounds.
                        (FeedError, dict(params=device_params)),
                        (FeedError, dict(params=device_params, logprobs=mf.DeviceBuffer(n * 4)))):
            args = dict(k=k, rows=rows, dtype="float32", shard=shard)
            args.update(kw)
            before = dict(shard.stats)
            try:
                mf.verify_to_feed(sl, args.pop("drafts", drafts.reshape(-1)), cells, None, None, **args)
            except exc:
                pass
            else:
                raise AssertionError(f"{list(kw)} was taken")
            assert shard.stats == before, (kw, shard.stats, before)
    # The shard is still usable: the refusals queued nothing.
    got, *_ = sharded_verify(h, shard, logits, drafts, None, None, k)
    assert np.array_equal(got, whole_verify(h, logits, drafts, None, None, k)[0]), got


def scenario_verify_mismatch(h):
    """Rank 0 verifies where the others run the plain argmax over the same logit rows (or another
    k): the header words differ, so FeedError from the event on every rank, never a wrong token."""
    vocab, rows, k = 1000, 2, K
    n = rows * (k + 1)
    rng = np.random.default_rng(4)
    for other in ("argmax", "k"):
        shard = mf.VocabShard(None, vocab, max_rows=16)
        logits = h.nasty(rng, n, vocab, np.float32, shard.offsets)
        drafts = drafts_for(logits, None, None, rows, k, vocab, rng)
        if h.RANK == 0:
            got, lp, done, held = sharded_verify(h, shard, logits, drafts, None, None, k, wait=False)
            h.expect_fault(done, "", f"a verify against a plain argmax gave no error: {got}")
            assert (got[:, 1] == mf.NO_TOKEN).all() and (got[:, 0] == 1).all(), got
        elif other == "argmax":
            ids, lp, done, *_ = h.sharded(shard, logits, wait=False)
            h.expect_fault(done, "", f"an argmax against a verify gave no error: {ids}")
            assert (ids == mf.NO_TOKEN).all(), ids
        else:  # the same 8 logit rows as 4 rows of k = 1
            got, lp, done, held = sharded_verify(h, shard, logits, np.zeros((4, 1), np.uint32), None,
                                                 None, 1, wait=False)
            h.expect_fault(done, "", f"another k gave no error: {got}")
        h.expect_refused(lambda: h.sharded(shard, logits), "the shard took a call after a fault")


def scenario_verify_graph(h):
    """Every rank captures a sharded verify whose logits and drafts are copied in from pinned
    buffers, then replays it on new ones: the unsharded cells and logprobs each time, one
    collective each. Host drafts cannot be captured: refused before anything is queued."""
    vocab, rows, k = 1000, 2, K
    n = rows * (k + 1)
    offsets = {1: None, 2: [0, 333, vocab], 3: [0, 600, vocab, vocab]}.get(h.WORLD)  # an empty slice
    shard = mf.VocabShard(None, vocab, offsets=offsets, max_rows=n)
    lo, hi = shard.start, shard.stop
    width = max(1, hi - lo)
    sl, staged = mf.DeviceBuffer(n * width * 4), mf.PinnedBuffer(n * width * 4)
    drafts_dev, drafts_staged = mf.DeviceBuffer(rows * k * 4), mf.PinnedBuffer(rows * k * 4)
    cells, lp_dev = mf.DeviceBuffer(rows * (k + 2) * 4), mf.DeviceBuffer(n * 4)
    dst, lp = mf.PinnedBuffer(rows * (k + 2) * 4), mf.PinnedBuffer(n * 4)
    done, stream = mf.Event(), mf.Stream()

    def step(drafts=drafts_dev):
        mf.copy_h2d_async(sl, staged, stream)  # pinned: read at each launch
        mf.copy_h2d_async(drafts_dev, drafts_staged, stream)
        mf.verify_to_feed(sl if hi > lo else None, drafts, cells, dst, done, stream, k=k, rows=rows,
                          dtype="float32", logprobs=lp_dev, logprobs_dst=lp, shard=shard)

    def fill(seed):
        rng = np.random.default_rng(seed)
        logits = h.nasty(rng, n, vocab, np.float32, shard.offsets)
        drafts = drafts_for(logits, None, None, rows, k, vocab, rng)
        np.frombuffer(staged, np.float32)[: n * (hi - lo)] = logits[:, lo:hi].ravel()
        np.frombuffer(drafts_staged, np.uint32)[:] = drafts.ravel()
        return logits, drafts

    def check(logits, drafts):
        got = np.frombuffer(dst, np.uint32).reshape(rows, k + 2).copy()
        want, want_lp = whole_verify(h, logits, drafts, None, None, k)
        assert np.array_equal(got, want), (got, want)
        mine = np.frombuffer(lp, np.float32).reshape(rows, k + 1)
        for r in range(rows):
            m = int(want[r, 0])
            assert np.isnan(mine[r, m:]).all()
            assert_close(mine[r, :m], want_lp[r, :m])

    step(fill(1)[1].ravel())  # once eagerly, with host drafts
    done.synchronize()
    before = dict(shard.stats)
    with mf.graph_capture(stream) as graph:
        step()
    assert shard.stats == before, (shard.stats, before)  # a capture issues no collective
    with mf.graph_capture(stream) as refused:
        try:
            step(np.zeros(rows * k, np.uint32))
        except ValueError as exc:
            assert "device drafts" in str(exc), exc
        else:
            raise AssertionError("a sharded verify with host drafts was captured")
    refused.close()
    assert shard.stats == before, (shard.stats, before)
    for i in range(3):
        logits, drafts = fill(100 + i)
        graph.launch(stream)
        done.synchronize()
        check(logits, drafts)
        split = h.WORLD > 1 or h.FORCE_EXCHANGE
        assert shard.stats["collectives"] == before["collectives"] + (i + 1) * split, shard.stats
    graph.close()
    stream.close()


SCENARIOS = {"verify": scenario_verify, "verify-graph": scenario_verify_graph, "verify-refused": scenario_verify_refused,
             "verify-mismatch": scenario_verify_mismatch, "verify-sampled": scenario_verify_sampled}


def scenario_pipeline_spec(h):
    """The SPMD pipeline with speculative decoding over the split: every rank's greedy requests
    get the tokens of the unsharded pipeline without speculation, and its sampled requests (with
    and without filters) the tokens of the unsharded speculative pipeline at depth 1, at depth 1
    and 2, with drafts accepted and rejected, bans, stops inside accepted runs and a pool that
    preempts; at least one exchange a verify step."""
    from metrale_feed.sched.speculative import NGramDrafter
    from metrale_feed.testing.drafter import ReferenceDrafter
    from metrale_feed.testing.reference import ReferenceModel, host_next_token

    vocab, k = 1000, 3
    offsets = {1: None, 2: [0, 333, vocab], 3: [0, 600, vocab, vocab]}.get(h.WORLD)
    adaptive = mf.VocabShard(None, vocab, offsets=offsets, max_rows=4 * (k + 1))
    # The cuda backend's way (its rounds cannot follow the params): fixed rounds serving them.
    fixed = mf.VocabShard(None, vocab, offsets=offsets, max_rows=4 * (k + 1),
                          filters=mf.FilterRounds(top_k=64, top_p=True))
    shard = adaptive
    sampled = (dict(temperature=0.7, seed=11), dict(temperature=1.3, top_k=40, top_p=0.9, seed=12),
               dict(temperature=0.9, min_p=0.05, seed=13))

    def decode(depth, sharded, drafter, blocks=64, with_sampled=False):
        model = ReferenceModel(vocab, max_rows=4 * (k + 1), block_size=2, num_blocks=blocks,
                               shard=shard if sharded else None)
        with mf.DecodePipeline(model, 4, depth=depth, shard=shard if sharded else None,
                               speculative=drafter) as pipe:
            reqs = [pipe.submit([3, 1, 4 + i], max_new_tokens=5 + 2 * i,
                                ban=(7, 500) if i == 2 else None,
                                stop_ids=[want_stop[i]] if want_stop and i % 3 == 1 else ())
                    for i in range(7)]
            if with_sampled:
                reqs += [pipe.submit([2, 7, 1 + i], max_new_tokens=9, **kw) for i, kw in enumerate(sampled)]
            pipe.run()
            stats = (pipe.stats.steps, pipe.stats.host_syncs, pipe.stats.accepted, pipe.stats.drafted,
                     pipe.stats.preemptions)
        model.close()
        return [r.tokens for r in reqs], stats

    want_stop = None
    for depth in (1, 2):
        want, _ = decode(depth, False, None)
        want_stop = [t[len(t) // 2] if t else 0 for t in want]  # a stop inside most runs
        want, _ = decode(depth, False, None)
        hist = [3, 1, 4]
        for t in decode(depth, False, None)[0][0]:
            assert t == host_next_token(hist, vocab), (hist, t)
            hist.append(t)
        # Sampled requests join the runs whose drafts are not all accepted (a sampled row may
        # reject even the reference rule's id), the preempting one among them.
        for drafter, blocks, mixed, shard in ((ReferenceDrafter(vocab, k, 0.5), 20, True, adaptive),
                                              (ReferenceDrafter(vocab, k, 1.0), 64, False, adaptive),
                                              (NGramDrafter(k), 64, True, fixed)):
            # The sampled requests' tokens: the unsharded speculative pipeline's, at depth 1.
            want_sampled = decode(1, False, drafter, with_sampled=True)[0][len(want):] if mixed else []
            before = shard.stats["collectives"]
            got, (steps, syncs, accepted, drafted, preempted) = decode(depth, True, drafter, blocks, mixed)
            assert got[:len(want)] == want, (depth, type(drafter).__name__, got, want)
            assert got[len(want):] == want_sampled, (depth, type(drafter).__name__, got, want_sampled)
            assert all(len(t) == 9 for t in want_sampled), want_sampled
            assert (preempted > 0) == (blocks < 64), (blocks, preempted)  # the small pool preempts
            if isinstance(drafter, ReferenceDrafter):
                assert accepted > 0 and (drafted > accepted) == (drafter.acceptance < 1), (accepted, drafted)
            if depth == 2:
                assert syncs == steps, (syncs, steps)
            assert h.WORLD == 1 or shard.stats["collectives"] - before >= steps, (shard.stats, steps)
            every = [None] * h.WORLD
            h.dist.all_gather_object(every, got)
            assert all(e == got for e in every), "the ranks' tokens differ"


SCENARIOS["pipeline-spec"] = scenario_pipeline_spec


def scenario_pipeline_spec_nccl(h):
    """On the cuda backend NCCL issues a call's collectives as it is queued, so a sampled verify's
    rounds must not follow its params: without the shard's fixed rounds, submit refuses a sampled
    request (not the step that would verify it), and a greedy one still runs. Logprobs are
    refused over the split, and with fixed rounds a request they do not serve."""
    from metrale_feed.testing.drafter import ReferenceDrafter
    from metrale_feed.testing.reference import ReferenceModel, host_next_token

    vocab = 1000
    rounds = mf.VocabShard(None, vocab, max_rows=16, filters=mf.FilterRounds(top_k=8))
    model = ReferenceModel(vocab, max_rows=16, block_size=2, num_blocks=64, shard=rounds)
    with mf.DecodePipeline(model, 4, depth=2, shard=rounds, speculative=ReferenceDrafter(vocab, 3, 0.5)) as pipe:
        for kw, needle in ((dict(top_k=40), "top_k=40"), (dict(top_p=0.9), "top_p=True")):  # not served
            try:
                pipe.submit([1, 2], max_new_tokens=3, temperature=0.7, **kw)
            except ValueError as exc:
                assert needle in str(exc), exc
            else:
                raise AssertionError(f"{kw} was taken by a shard whose rounds do not serve it")
        served = [pipe.submit([1, 2], max_new_tokens=3, temperature=0.7, **kw)  # served: taken
                  for kw in (dict(top_k=8, top_p=0.9), dict(min_p=0.1), dict(top_p=1.0))]
        pipe.run()
        assert all(len(req.tokens) == 3 for req in served), [req.tokens for req in served]
    model.close()
    rounds.close()
    shard = mf.VocabShard(None, vocab, max_rows=16)
    shard._nccl = True  # what a shard over an NCCL group says
    drafter = ReferenceDrafter(vocab, 3, 0.5)
    model = ReferenceModel(vocab, max_rows=16, block_size=2, num_blocks=64, shard=shard)
    with mf.DecodePipeline(model, 4, depth=2, shard=shard, speculative=drafter) as pipe:
        try:
            pipe.submit([1, 2], max_new_tokens=3, temperature=0.7)
        except FeedError as exc:
            assert "FilterRounds" in str(exc), exc
        else:
            raise AssertionError("a sampled request was taken without fixed rounds over NCCL")
        try:  # a sampled verify's records carry masses, not a slice's (m, s)
            pipe.submit([1, 2], max_new_tokens=3, logprobs=True)
        except ValueError as exc:
            assert "split vocabulary" in str(exc), exc
        else:
            raise AssertionError("logprobs were taken by a sharded speculative pipeline")
        assert pipe.idle
        shard._nccl = False  # the greedy request's exchange runs on gloo (the refusals were at submit)
        req = pipe.submit([1, 2], max_new_tokens=3)
        pipe.run()
    hist = [1, 2]
    for t in req.tokens:
        assert t == host_next_token(hist, vocab), (hist, t)
        hist.append(t)
    assert len(req.tokens) == 3, req.tokens
    model.close()
    drafter.close()
    shard.close()


SCENARIOS["pipeline-spec-nccl"] = scenario_pipeline_spec_nccl


def scenario_pipeline_spec_penalties(h):
    """Penalties with speculative decoding over the split (docs/speculative.md, "Penalties"):
    each rank applies its own columns, walking the drafts, and counts the combined cells; the
    greedy requests get the unsharded pipeline's tokens without speculation and the sampled ones
    the unsharded speculative pipeline's, on every rank, at depth 1 and 2 with a pool that
    preempts; the exchanges a step are those of the same requests without penalties."""
    from metrale_feed.testing.drafter import ReferenceDrafter
    from metrale_feed.testing.reference import ReferenceModel

    vocab, k = 1000, 3
    offsets = {1: None, 2: [0, 333, vocab], 3: [0, 600, vocab, vocab]}.get(h.WORLD)
    shard = mf.VocabShard(None, vocab, offsets=offsets, max_rows=4 * (k + 1))
    pens = [dict(logit_bias={7: 0.6, 700: 0.7}, frequency_penalty=0.15),
            dict(logit_bias={3: 0.8, 400: 0.7}, presence_penalty=0.5),
            dict(logit_bias={9: 1.0, 990: 0.9}, repetition_penalty=3.0),
            dict(min_tokens=5, logit_bias={11: 0.9}, frequency_penalty=0.3), {}]
    sampled = [dict(temperature=0.7, seed=11, logit_bias={5: 0.8, 805: 0.8}, presence_penalty=0.4)]

    def decode(depth, sharded, drafter, blocks):
        model = ReferenceModel(vocab, max_rows=4 * (k + 1), block_size=2, num_blocks=blocks,
                               shard=shard if sharded else None)
        before = shard.stats["collectives"]
        with mf.DecodePipeline(model, 4, depth=depth, shard=shard if sharded else None,
                               speculative=drafter) as pipe:
            reqs = [pipe.submit([3, 1, 4 + i], max_new_tokens=10, stop_ids=[11, 12] if i == 3 else (),
                                **kw)
                    for i, kw in enumerate(pens + (sampled if isinstance(drafter, ReferenceDrafter)
                                                   and drafter.acceptance < 1 else []))]
            pipe.run()
            stats = (pipe.stats.steps, pipe.stats.host_syncs, pipe.stats.preemptions,
                     shard.stats["collectives"] - before)
        model.close()
        return [r.tokens for r in reqs], stats

    for depth in (1, 2):
        want = decode(depth, False, None, 64)[0]
        # Greedy rows alone: the greedy verify's one exchange a step, as without penalties.
        got, (steps, _, _, exchanges) = decode(depth, True, ReferenceDrafter(vocab, k, 1.0), 64)
        assert got == want, (depth, got, want)
        assert h.WORLD == 1 or exchanges == steps, (exchanges, steps)
        drafter = ReferenceDrafter(vocab, k, 0.5)
        want_sampled = decode(1, False, drafter, 64)[0][len(want):]
        for blocks in (64, 22):
            got, (steps, syncs, preempted, exchanges) = decode(depth, True, drafter, blocks)
            assert got[:len(want)] == want, (depth, blocks, got, want)
            assert got[len(want):] == want_sampled, (depth, blocks, got, want_sampled)
            assert (preempted > 0) == (blocks < 64), (blocks, preempted)
            if depth == 2:
                assert syncs == steps, (syncs, steps)
            assert exchanges >= steps, (exchanges, steps)  # the sampled rows' rounds on top
            every = [None] * h.WORLD
            h.dist.all_gather_object(every, got)
            assert all(e == got for e in every), "the ranks' tokens differ"
        drafter.close()
    shard.close()


SCENARIOS["pipeline-spec-penalties"] = scenario_pipeline_spec_penalties
