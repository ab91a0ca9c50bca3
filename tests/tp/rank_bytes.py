"""The bytes a sharded call sends (rank_main.py runs it; ``h`` is that module, with the rank, the
world and the helpers): every call's ``shard.stats`` against the sizes docs/tensor-parallel.md
gives each exchange ("Bytes per step"), computed here from those sizes alone, and within
``shard.max_call_bytes`` (exactly it for a sampled call with fixed rounds), across filter mixes,
adaptive and fixed rounds, logprobs or not, and a call of fewer rows than ``max_rows``."""

import numpy as np

import metrale_feed as mf
from metrale_feed.testing.oracle import reference_logprobs
from metrale_feed.tp.rounds import FilterRounds

from helpers.accuracy import assert_close

HEADER, RECORD, CAND, BINS_BYTES, ROUNDS, CANDS_MAX = 32, 16, 8, 256 * 8, 4, 1024


def mixes(rows, rng):
    """name: params of ``rows`` rows. "lists+top_p" is the mix of the report that found 8,478
    bytes a row: candidate lists at top_k 30 beside top_p alone, 7 exchanges."""
    def params(**kw):
        return mf.sampling_params(rows, temperature=rng.uniform(0.5, 1.5, rows),
                                  seed=rng.integers(0, 2**63, rows),
                                  position=rng.integers(0, 10**6, rows), **kw)

    out = {"temperature": params(), "min_p": params(min_p=0.05), "top_k 5": params(top_k=5),
           "top_k 1024 + top_p": params(top_k=1024, top_p=0.9), "top_p": params(top_p=0.8)}
    p = params(top_p=0.9)
    p["top_k"][::2] = 30
    out["lists+top_p"] = p
    p = params(min_p=0.01)
    p["top_k"][0::3], p["top_k"][1::3], p["top_p"][2::3] = CANDS_MAX, 2000, 0.85
    out["every select"] = p  # the lists at their most, a larger top_k and top_p alone: 11
    p = params(top_k=7, top_p=0.5)
    p["temperature"] = 0.0
    out["greedy with filters"] = p  # filters set, nothing sampled: the plain call's one exchange
    return out


def expected(params, m, rounds):
    """(exchanges, bytes) of one sampled call from the documented sizes: TOP and RACE a header and
    16 bytes a row of max_rows; the candidate lists a header and 8 bytes an entry, cap a row; a
    radix select 4 rounds of a header and 2 KiB a row. Fixed rounds: every exchange, each sized
    by max_rows. Adaptive: those the rows' filters need, sized by the call's rows; temperature
    alone one block."""
    block = HEADER + RECORD * m
    if rounds is not None:
        cap, selects, r = rounds.top_k, int(rounds.top_p), m
    else:
        t = params["temperature"]
        sampled = (t > 0) & np.isfinite(t)
        k, tp = params["top_k"], params["top_p"]
        mp = params["min_p"]
        if not np.any(sampled & ((k != 0) | ((tp > 0) & (tp < 1)) | ((mp > 0) & (mp < 1)))):
            return 1, block  # no sampled row filters: a greedy row's filter fields are never read
        lists = sampled & (k != 0) & (k <= CANDS_MAX)
        cap = int(k[lists].max()) if lists.any() else 0
        radix_p = sampled & (tp > 0) & (tp < 1) & ~lists
        selects = int(np.any(sampled & (k > CANDS_MAX))) + int(np.any(radix_p))
        r = len(params)
    exchanges = 2 + (cap > 0) + ROUNDS * selects
    sent = 2 * block + (HEADER + CAND * cap * r if cap else 0) + selects * ROUNDS * (HEADER + BINS_BYTES * r)
    return exchanges, sent


def served(params, rounds):
    """Whether fixed rounds serve every sampled row (else the call is the rounds' fault)."""
    t = params["temperature"]
    sampled = (t > 0) & np.isfinite(t)
    k, tp = params["top_k"][sampled], params["top_p"][sampled]
    alone = (k == 0) & (tp > 0) & (tp < 1)
    return bool(np.all(k <= rounds.top_k) and (rounds.top_p or not alone.any()))


def scenario_bytes(h):
    vocab, m = 3000, 16
    worst_row = 2 * RECORD + CAND * CANDS_MAX + 2 * ROUNDS * BINS_BYTES
    assert worst_row == 24608  # the figure the docs give
    for rounds in (None, FilterRounds(), FilterRounds(top_k=30, top_p=True), FilterRounds(top_k=64),
                   FilterRounds(top_k=CANDS_MAX, top_p=True)):
        shard = mf.VocabShard(None, vocab, max_rows=m, filters=rounds)
        through = shard.world > 1 or shard._force_exchange
        block = HEADER + RECORD * m
        b = h.boundary(shard.offsets, vocab)
        if not through:
            assert shard.max_call_bytes == 0
        elif rounds is None:  # 11 exchanges: 24,608 bytes a row and a header each
            assert shard.max_call_bytes == 11 * HEADER + m * worst_row, shard.max_call_bytes
        else:
            assert shard.max_call_bytes == expected(None, m, rounds)[1], (rounds, shard.max_call_bytes)
        rng = np.random.default_rng(h.zlib.crc32(f"bytes{rounds}".encode()))
        most = 0
        for rows in (m, 5):
            x = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
            x[0, b - 3:b + 3] = x[0].max() + 1  # ties across a slice boundary
            for name, params in mixes(rows, rng).items():
                if rounds is not None and not served(params, rounds):
                    continue  # the rounds' fault (rank_rounds.py); its bytes are the same
                for logprobs in (True, False):
                    want, _ = h.whole(x, params=params)
                    before = dict(shard.stats)
                    ids, lp, *_ = h.sharded(shard, x, params=params, logprobs=logprobs)
                    what = (str(rounds), rows, name, logprobs)
                    assert np.array_equal(ids, want), (what, ids, want)
                    if logprobs:
                        assert_close(lp, reference_logprobs(x, ids))
                    calls = shard.stats["collectives"] - before["collectives"]
                    sent = shard.stats["bytes_sent"] - before["bytes_sent"]
                    if not through:
                        assert (calls, sent) == (0, 0), (what, calls, sent)
                        continue
                    assert (calls, sent) == expected(params, m, rounds), (what, calls, sent, expected(params, m, rounds))
                    assert sent <= shard.max_call_bytes, (what, sent, shard.max_call_bytes)
                    if rounds is not None:  # one shape whatever the params
                        assert sent == shard.max_call_bytes, (what, sent)
                    most = max(most, sent)
            # The greedy call: one block, within the bound.
            before = dict(shard.stats)
            ids, *_ = h.sharded(shard, x)
            assert np.array_equal(ids, h.whole(x)[0])
            sent = shard.stats["bytes_sent"] - before["bytes_sent"]
            assert sent == (block if through else 0) and sent <= shard.max_call_bytes, sent
        if through and rounds is None:  # the mix of every select at max_rows rows reaches the bound
            assert most == shard.max_call_bytes, (most, shard.max_call_bytes)
        shard.close()


SCENARIOS = {"bytes": scenario_bytes}
