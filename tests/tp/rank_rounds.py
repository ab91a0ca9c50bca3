"""Sharded filters in fixed rounds (``VocabShard(..., filters=FilterRounds(...))``), which the cuda
backend's NCCL exchange needs: every filtered call makes the same exchanges, sized by the shard,
whatever its params; a decision's fault reaches the combine on the device instead of skipping
exchanges (rank_main.py runs them; ``h`` is that module, with the rank, the world and the helpers)."""

import numpy as np

import metrale_feed as mf
from metrale_feed.errors import FeedError
from metrale_feed.testing.oracle import reference_logprobs
from metrale_feed.tp import select_rounds
from metrale_feed.tp.select_rounds import FilterRounds

from helpers.accuracy import assert_close


def _through(shard):
    """Whether the shard's calls go through the exchange (a world of one is the unsharded call,
    unless forced through it, as the NCCL world of one on a GPU is)."""
    return shard.world > 1 or shard._force_exchange


def _delta(shard, before):
    return (shard.stats["collectives"] - before["collectives"], shard.stats["bytes_sent"] - before["bytes_sent"])


def _expect_rounds_fault(h, shard, rounds, logits, params, masks=None, bitmask=None):
    """A call with a row the rounds do not serve: through the exchange, the rounds' collectives,
    then NO_TOKEN rows and a FeedError on every rank, and the shard refuses calls; a world of one
    (the unsharded call) draws the unsharded ids."""
    if not _through(shard):
        ids, *_ = h.sharded(shard, logits, masks, bitmask, params)
        assert np.array_equal(ids, h.whole(logits, masks, bitmask, params)[0])
        return
    before = dict(shard.stats)
    ids, lp, done, *_ = h.sharded(shard, logits, masks, bitmask, params, wait=False)
    h.expect_fault(done, "fixed rounds do not serve", f"a row the rounds do not serve was drawn: {ids}")
    assert (ids == mf.NO_TOKEN).all(), ids
    assert _delta(shard, before)[0] == rounds.collectives, (shard.stats, before)
    h.expect_refused(lambda: h.sharded(shard, logits), "the shard took a call after a fault")


def scenario_fixed(h):
    """The unsharded ids for every filter mix the rounds serve, with masks, a bitmask and
    logprobs; the same collectives and bytes for every call (min_p alone and a temperature-only
    call with filters off included); a row the rounds cannot serve a fault on every rank;
    completed calls' buffers reused (no allocation a step)."""
    vocab = 1000
    rounds = FilterRounds(top_k=64, top_p=True)
    for dtype in h.DTYPES:
        for name, offsets in h.splits(vocab):
            shard = mf.VocabShard(None, vocab, offsets=offsets, max_rows=16, filters=rounds)
            rng = np.random.default_rng(h.zlib.crc32(f"fixed{dtype}{name}".encode()))
            logits, params = h.filter_rows(rng, vocab, h.DTYPES[dtype], shard.offsets)
            params["top_k"] = np.minimum(params["top_k"], 64)  # what the rounds serve
            rows = logits.shape[0]
            masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
            masks[::4] = mf.NO_TOKEN
            bitmask = np.full((rows, (vocab + 31) // 32), -1, np.int32)
            bitmask[15] = 0
            mp = mf.sampling_params(rows, temperature=1.0, min_p=0.3, seed=np.arange(rows))
            plain = mf.sampling_params(rows, temperature=0.7, seed=np.arange(rows))  # no filter at all
            # Host params are read as device ones are: a value out of range is its neutral
            # setting (NaN temperature: greedy; top_p 0: off), never a refusal on one rank.
            odd = params.copy()
            odd["temperature"][3], odd["top_p"][4] = np.nan, 0.0
            spent = set()
            # (A world of one is the unsharded call, which refuses them.)
            trials = (params, mp, plain, odd, params) if _through(shard) else (params, mp, plain, params)
            for trial, p in enumerate(trials):
                p = p.copy()
                p["seed"] = rng.integers(0, 2**63, rows)
                with h.upload(p) as dparams:
                    want, _ = h.whole(logits, masks, bitmask, dparams)
                before = dict(shard.stats)
                ids, lp, *_ = h.sharded(shard, logits, masks, bitmask, p, pad=3 if trial else 0)
                assert np.array_equal(ids, want), (dtype, name, trial, ids, want)
                assert_close(lp, reference_logprobs(logits, ids))
                spent.add(_delta(shard, before))
            # One shape for every call: the rounds' collectives, and bytes set by max_rows alone.
            if _through(shard):
                assert len(spent) == 1 and next(iter(spent))[0] == rounds.collectives, spent
            # A row the rounds do not serve (a top_k above theirs): a fault on every rank after
            # the rounds' collectives, never a draw (a world of one is the unsharded call).
            bad = params.copy()
            bad["top_k"][4] = 65
            _expect_rounds_fault(h, shard, rounds, logits, bad, masks, bitmask)
            shard.close()
    # top_p alone is served by rounds with top_p only.
    shard = mf.VocabShard(None, vocab, max_rows=4, filters=FilterRounds(top_k=8))
    x = np.random.default_rng(3).standard_normal((4, vocab)).astype(np.float32)
    both = mf.sampling_params(4, temperature=1.0, top_k=8, top_p=0.5)
    ids, *_ = h.sharded(shard, x, params=both)
    assert np.array_equal(ids, h.whole(x, params=both)[0])
    assert not _through(shard) or shard.stats["collectives"] == (h.WORLD > 1) + 3  # the agreement, 3 exchanges
    _expect_rounds_fault(h, shard, FilterRounds(top_k=8), x, mf.sampling_params(4, temperature=1.0, top_p=0.5))
    shard.close()
    # Steady state: the filtered calls reuse completed calls' buffers (on the cuda backend a free
    # would synchronise the device): one set of them for calls that each complete before the next.
    shard = mf.VocabShard(None, vocab, max_rows=8, filters=FilterRounds(top_k=16))
    x = np.random.default_rng(4).standard_normal((8, vocab)).astype(np.float32)
    p = mf.sampling_params(8, temperature=0.8, top_k=16, min_p=0.01, seed=np.arange(8))
    made = []
    init = select_rounds.FilteredCall.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        init(self, *args, **kwargs)

    select_rounds.FilteredCall.__init__ = counting
    try:
        for _ in range(6):
            ids, *_ = h.sharded(shard, x, params=p)  # waits for its event: the call is complete
            assert np.array_equal(ids, h.whole(x, params=p)[0])
    finally:
        select_rounds.FilteredCall.__init__ = init
    assert len(made) == _through(shard), made
    shard.close()


def scenario_fixed_mismatch(h):
    """Fixed rounds with params that differ between ranks: every rank still makes the rounds'
    collectives (NCCL could not skip them), gets NO_TOKEN rows and a FeedError from the event,
    and the shard then refuses calls. Ranks that declare other rounds cannot make a shard."""
    vocab = 1000
    rounds = FilterRounds(top_k=8, top_p=True)
    shard = mf.VocabShard(None, vocab, max_rows=8, filters=rounds)
    logits = h.nasty(np.random.default_rng(8), 5, vocab, np.float32, shard.offsets)
    params = mf.sampling_params(5, temperature=1.0, top_k=3 if h.RANK == 0 else 0,
                                top_p=0.9 if h.RANK == h.WORLD - 1 else 1.0)
    before = dict(shard.stats)
    ids, lp, done, held, took = h.sharded(shard, logits, params=params, wait=False)
    h.expect_fault(done, "refused", f"mismatched params gave no error: {ids}")
    assert (ids == mf.NO_TOKEN).all() and np.isnan(lp).all(), (ids, lp)
    assert _delta(shard, before)[0] == rounds.collectives, (shard.stats, before)
    h.expect_refused(lambda: h.sharded(shard, logits), "the shard took a call after a fault")
    shard.close()
    # A rank whose params ask for more than the rounds serve, the others' not (host params, then
    # device ones), or whose host params hold a value out of range (which would be a ValueError
    # unsharded): no rank refuses alone, so the collectives still match; the first records'
    # digests show the difference, and every rank gets the fault.
    for case in ("host", "device", "out of range"):
        shard = mf.VocabShard(None, vocab, max_rows=8, filters=rounds)
        params = mf.sampling_params(5, temperature=5.0 if h.RANK == 0 else 1.0,
                                    top_k=1 if h.RANK == 0 else 9, seed=np.arange(5))
        if case == "out of range":
            params = mf.sampling_params(5, temperature=1.0, top_k=2, seed=np.arange(5))
            if h.RANK == h.WORLD - 1:
                params["top_p"][2] = 0.0
        before = dict(shard.stats)
        held = h.upload(params) if case == "device" else None
        ids, lp, done, *_ = h.sharded(shard, logits, params=held if held is not None else params, wait=False)
        h.expect_fault(done, "with other params", f"params that differ between ranks gave no error ({case}): {ids}")
        assert (ids == mf.NO_TOKEN).all(), ids
        assert _delta(shard, before)[0] == rounds.collectives, (shard.stats, before)
        h.expect_refused(lambda: h.sharded(shard, logits), "the shard took a call after a fault")
        shard.close()
        if held is not None:
            held.close()
    try:
        mf.VocabShard(None, vocab, max_rows=8, filters=FilterRounds(top_k=8 + (h.RANK == 0)))
    except FeedError as exc:
        assert "filters differ" in str(exc), exc
    else:
        raise AssertionError("ranks declaring other rounds made a shard")


def scenario_fixed_graph(h):
    """A sharded sample_to_feed with filters in device params, captured whole with fixed rounds:
    each replay reads the logits and the params the buffers hold then (new filters, seeds and
    temperatures each time) and draws the unsharded ids, making the rounds' collectives again.
    Host params are refused in a capture; a replay whose params ask for a filter the rounds do not
    serve is a FeedError on every rank with NO_TOKEN rows, never a draw without its filter."""
    vocab, rows = 1000, 6
    offsets = {2: [0, 333, vocab], 3: [0, 600, vocab, vocab]}.get(h.WORLD)  # 3: an empty slice
    rounds = FilterRounds(top_k=16, top_p=True)
    shard = mf.VocabShard(None, vocab, offsets=offsets, max_rows=8, filters=rounds)
    lo, hi = shard.start, shard.stop
    width = max(1, hi - lo)
    sl, staged = mf.DeviceBuffer(rows * width * 4), mf.PinnedBuffer(rows * width * 4)
    pdev, pstaged = mf.DeviceBuffer(rows * 32), mf.PinnedBuffer(rows * 32)
    cells, lp_dev = mf.DeviceBuffer(rows * 4), mf.DeviceBuffer(rows * 4)
    ids, lp = mf.PinnedBuffer(rows * 4), mf.PinnedBuffer(rows * 4)
    done, stream = mf.Event(), mf.Stream()

    def launch(params):
        mf.sample_to_feed(sl if hi > lo else None, params, cells, ids, done, stream, rows=rows,
                          dtype="float32", logprobs=lp_dev, logprobs_dst=lp, shard=shard)

    def step():
        mf.copy_h2d_async(sl, staged, stream)  # pinned: read at each launch
        mf.copy_h2d_async(pdev, pstaged, stream)
        launch(pdev)

    def fill(seed, **change):
        """New logits and params with filters (the same on every rank: one seed), staged."""
        rng = np.random.default_rng(seed)
        logits = h.nasty(rng, rows, vocab, np.float32, shard.offsets)
        params = mf.sampling_params(rows, temperature=rng.uniform(0.5, 2.0, rows),
                                    top_k=rng.choice([0, 1, 5, 16], rows), top_p=rng.choice([1.0, 0.9, 0.6], rows),
                                    min_p=rng.choice([0.0, 0.05], rows), seed=rng.integers(0, 2**63, rows),
                                    position=rng.integers(0, 10**6, rows))
        params["temperature"][1] = 0.0  # greedy
        params["top_k"][4], params["top_p"][4] = 0, 0.7  # top_p alone: its radix select
        for field, (row, value) in change.items():
            params[field][row] = value
        np.frombuffer(staged, np.float32)[: rows * (hi - lo)] = logits[:, lo:hi].ravel()
        np.frombuffer(pstaged, params.dtype)[:] = params
        return logits, params

    def unsharded(logits, params):
        with h.upload(params) as dparams:
            return h.whole(logits, params=dparams)[0]

    def check(logits, params):
        got = np.frombuffer(ids, np.uint32).copy()
        assert np.array_equal(got, unsharded(logits, params)), (got, unsharded(logits, params))
        assert_close(np.frombuffer(lp, np.float32).copy(), reference_logprobs(logits, got))
        return got

    graph, stale = h.capture_and_replay(shard, stream, done, step, fill, check, unsharded, 3,
                                        rounds.collectives if _through(shard) else 0)
    assert stale >= 2, stale
    # Host params in a capture: refused before anything is queued (a replay would reuse them).
    _, params = fill(200)
    with mf.graph_capture(stream) as refused:
        try:
            launch(params)
        except (ValueError, FeedError) as exc:
            assert "captur" in str(exc), exc
        else:
            raise AssertionError("a sharded sample with host params was captured")
    refused.close()
    # A replay whose params ask for more than the rounds serve: a fault on every rank.
    logits, params = fill(300, top_k=(3, 17))
    graph.launch(stream)
    if _through(shard):
        h.expect_fault(done, "fixed rounds do not serve", "a top_k above the rounds' was drawn")
        assert (np.frombuffer(ids, np.uint32) == mf.NO_TOKEN).all()
        h.expect_refused(step, "the shard took a call after a rounds fault")
    graph.close()
    stream.close()


SCENARIOS = {"fixed": scenario_fixed, "fixed-mismatch": scenario_fixed_mismatch, "fixed-graph": scenario_fixed_graph}
