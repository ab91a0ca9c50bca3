"""A sampled ``verify_to_feed`` over a split vocabulary through the whole protocol in one process
(helpers.calls.split_filtered with drafts: every slice's TOP stage with the drafts' logit bits,
the exchanges as copies, every slice's decisions, the RACE stage without the drafts and with the
slices' survivors' masses, then the verify combine): the unsharded ``verify_to_feed``'s cells, bit
for bit, for every split, on host and simt, with and without filters; and the checks of the new
arguments (docs/tensor-parallel.md, "Verify")."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

from helpers.calls import split_filtered

ml_dtypes = pytest.importorskip("ml_dtypes")

NO = mf.NO_TOKEN
SPLITS = (lambda v: [0, v], lambda v: [0, v // 2, v], lambda v: [0, 1, v // 3, v // 3, v],
          lambda v: [0, 700, 1900, v])
FILTERS = {  # per verified row: rows of one call mix them
    "temperature": {},
    "top_k lists": dict(top_k=[5, 1, 40, 3, 200, 2]),
    "top_k radix + top_p": dict(top_k=[1500, 1200, 0, 1700, 1030, 0], top_p=[0.8, 0.95, 0.6, 1.0, 0.5, 0.9]),
    "everything": dict(top_k=[0, 7, 1500, 0, 30, 2000], top_p=[0.9, 1.0, 0.7, 0.5, 0.8, 0.95],
                       min_p=[0.05, 0.0, 0.01, 0.2, 0.0, 0.001]),
}
ROWS, K, VOCAB = 6, 3, 3000


def expanded(params, k):
    """The logit rows' params: row r's at position + j for its position j (what the stages and the
    combine of a split verify read)."""
    out = np.repeat(params, k + 1)
    out["position"] += np.tile(np.arange(k + 1, dtype=np.uint32), len(params))
    return out


def case(seed, name, dtype):
    """Logits, drafts, params, masks and bitmask of ROWS rows of K drafts: flat and peaked rows,
    ties across slice boundaries, NaN and -inf logits, one greedy row and one whose temperature
    makes zmax infinite (its draw is the top). Position j of row r takes, by (r + j) % 4, the
    likeliest id, an unlikely one, one that is no candidate (a masked id, a bitmask's disallowed
    id, or a NaN or -inf logit), or NO_TOKEN, which the caller replaces by the position's own draw
    (a draft that wins the race: rejected, then raced without); row 1's drafts end early."""
    rng = np.random.default_rng(seed)
    n = ROWS * (K + 1)
    x = (rng.standard_normal((n, VOCAB)) * rng.choice([1.0, 4.0], (n, 1))).astype(np.float32)
    x[0:4, 690:710] = 5.0                   # ties at the top across a slice boundary
    x[4:8, rng.integers(0, VOCAB, 40)] = -np.inf
    x[8:12, rng.integers(0, VOCAB, 40)] = np.nan
    x = x.astype({"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype])
    params = mf.sampling_params(ROWS, temperature=[0.8, 1.0, 0.0, 1.3, 1e-38, 0.6], seed=rng.integers(0, 2**40, ROWS),
                                position=rng.integers(0, 1000, ROWS), **FILTERS[name])
    masks = rng.integers(0, VOCAB, (n, 2)).astype(np.uint32)
    masks[::2] = NO
    bitmask = np.full((n, (VOCAB + 31) // 32), 0xFFFFFFFF, np.uint32)
    bitmask[1::3, rng.integers(0, len(bitmask[0]), 20)] = 0  # some rows disallow a few words
    flat = x.astype(np.float32)
    drafts = np.empty((ROWS, K), np.uint32)
    for r in range(ROWS):
        for j in range(K):
            lr = r * (K + 1) + j
            row = np.where(np.isfinite(flat[lr]), flat[lr], -np.inf)
            kind = (r + 2 * j + 2) % 4  # rows 0 and 4 (sampled) start with no candidate
            if kind == 0:
                drafts[r, j] = int(np.argmax(row))
            elif kind == 1:
                drafts[r, j] = int(rng.integers(0, VOCAB))
            elif kind == 2:  # no candidate here: masked, disallowed, or not finite
                how = (r * K + j) % 3
                if how == 0:
                    masks[lr, 0] = drafts[r, j] = int(rng.integers(0, VOCAB))
                elif how == 1:
                    drafts[r, j] = int(rng.integers(0, VOCAB))
                    bitmask[lr, drafts[r, j] // 32] &= ~np.uint32(1 << int(drafts[r, j] % 32))
                else:
                    bad = np.flatnonzero(~np.isfinite(flat[lr]))
                    drafts[r, j] = int(bad[0]) if bad.size else int(rng.integers(0, VOCAB))
            else:
                drafts[r, j] = NO
    drafts[1, 1:] = NO  # ends row 1's drafts early
    return x, drafts.ravel(), params, masks, bitmask.view(np.int32)


def candidate(x, masks, bitmask, lr, i):
    """Whether id i is a candidate of logit row lr (the rule's masks, bitmask, a finite logit)."""
    bits = bitmask.view(np.uint32)[lr, i // 32]
    return i not in masks[lr] and bool(bits >> np.uint32(i % 32) & 1) and bool(np.isfinite(np.float32(x[lr, i])))


def own_draws(dev, x, params, masks=None, bitmask=None):
    """sample_to_feed's id at every logit row: a draft equal to it is the race's own winner."""
    ids = np.zeros(len(x), np.uint32)
    buf = dev.upload(x)
    bm = dev.upload(bitmask) if bitmask is not None else None
    with mf.DeviceBuffer(len(x) * 4) as cells, mf.Event() as done:
        mf.sample_to_feed(buf, expanded(params, K), cells, ids, done, masks=masks, bitmask=bm, vocab=VOCAB,
                          dtype=np.dtype(x.dtype).name)
        done.synchronize()
    buf.close()
    if bm is not None:
        bm.close()
    return ids


def unsharded(dev, x, drafts, params, masks=None, bitmask=None, vocab=VOCAB, k=K):
    rows = len(x) // (k + 1)
    buf = dev.upload(x)
    bm = dev.upload(bitmask) if bitmask is not None else None
    words = rows * (k + 2)
    out = np.zeros(words, np.uint32)
    with mf.DeviceBuffer(words * 4) as cells, mf.Event() as done:
        assert mf.verify_to_feed(buf, drafts, cells, out, done, k=k, params=params, masks=masks, bitmask=bm,
                                 vocab=vocab, dtype=np.dtype(x.dtype).name) == rows
        done.synchronize()
    buf.close()
    if bm is not None:
        bm.close()
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_the_protocol_verifies_as_the_unsharded_call(backend, dev, dtype, name):
    accepted = rejected = outsiders = 0
    for seed in range(3):
        x, drafts, params, masks, bitmask = case(seed, name, dtype)
        draws = own_draws(dev, x, params, masks, bitmask)
        d = drafts.reshape(ROWS, K)
        for r in range(ROWS):  # the NO_TOKEN drafts but row 1's last: the position's own draw
            for j in range(K):
                if d[r, j] == NO and not (r == 1 and j >= 1):
                    d[r, j] = draws[r * (K + 1) + j]
        want = unsharded(dev, x, drafts, params, masks, bitmask)
        n = want.reshape(ROWS, K + 2)[:, 0].astype(int)
        in_use = [K if NO not in d[r] else list(d[r]).index(NO) for r in range(ROWS)]
        accepted += int((n - 1).sum())
        rejected += sum(int(n[r] <= in_use[r]) for r in range(ROWS))  # stopped at a draft
        outsiders += sum(not candidate(x, masks, bitmask, r * (K + 1) + j, int(d[r, j]))  # judged, no candidate
                         for r in range(ROWS) if params["temperature"][r] > 0 for j in range(min(n[r], in_use[r])))
        for split in SPLITS:
            got, fault, words = split_filtered(dev, x, split(VOCAB), expanded(params, K), drafts=drafts, k=K,
                                               masks=masks, bitmask=bitmask)
            assert bytes(fault) == b"\0" * 4 and words == [0] * (len(split(VOCAB)) - 1)
            assert got.tolist() == want.tolist(), (seed, split(VOCAB))
    assert accepted > 0 and rejected > 0 and outsiders > 0  # every outcome was judged


def test_a_rejected_draft_that_wins_the_race_is_raced_without(backend, dev):
    """Flat rows whose drafts are their own race winners: mostly rejected, each rejection emits the
    race without the draft, found by the slice that holds it racing again."""
    rng = np.random.default_rng(9)
    n = ROWS * (K + 1)
    x = rng.standard_normal((n, VOCAB)).astype(np.float32)
    params = mf.sampling_params(ROWS, temperature=1.0, seed=rng.integers(0, 2**40, ROWS), position=7)
    drafts = own_draws(dev, x, params).reshape(ROWS, K + 1)[:, :K].ravel().copy()
    want = unsharded(dev, x, drafts, params)
    rows = want.reshape(ROWS, K + 2)
    assert (rows[:, 0] == 1).sum() >= 3  # rejected at once ...
    assert all(rows[r, 1] != drafts[r * K] for r in range(ROWS) if rows[r, 0] == 1)  # ... with another id
    for split in SPLITS:
        got, _, _ = split_filtered(dev, x, split(VOCAB), expanded(params, K), drafts=drafts, k=K)
        assert got.tolist() == want.tolist()


def test_the_new_arguments_are_checked_before_queueing(host, dev):
    x = np.zeros((8, 100), np.float32)
    buf = dev.upload(x)
    params = mf.sampling_params(8, temperature=1.0)
    with mf.DeviceBuffer(_core._partial_bytes(8)) as part, mf.DeviceBuffer(8 * _core.SELECT_ROW_BYTES) as state, \
            mf.DeviceBuffer(64) as drafts:
        kw = dict(start=0, stop=100, vocab=100, dtype="float32", call=3)
        for bad, match in ((dict(k=3), "go together"), (dict(drafts=drafts, k=0), "k"),
                           (dict(drafts=drafts, k=2), "multiple of k"),
                           (dict(drafts=drafts, k=3, logprobs=True), "masses, not logprobs"),
                           (dict(drafts=mf.DeviceBuffer(4), k=3), "select drafts")):
            with pytest.raises(ValueError, match=match):
                _core._select_partial(buf, params, part, state, "race", **kw, **bad)
    buf.close()


def test_a_slice_whose_survivors_weigh_two_to_the_63_is_read_as_such(host, dev):
    """A slice of 2**24 ids all at zmax sends a total of 2**63, the survival bit's own pattern: it is
    read as that total (the unsharded call's), never as a surviving draft of total 0, which would
    accept every draft (verify_rule.h)."""
    vocab, k = 1 << 24, 1
    x = np.zeros((k + 1, vocab), np.float32)  # every id has mass 2**39
    params = mf.sampling_params(1, temperature=1.0, seed=1234, position=7)
    drafts = np.array([5], np.uint32)
    want = unsharded(dev, x, drafts, params, vocab=vocab, k=k)
    assert want[0] == 1  # accepted with probability 2**-24: rejected here
    for split in ([0, vocab], [0, vocab, vocab], [0, 1, vocab]):
        got, _, _ = split_filtered(dev, x, split, expanded(params, k), drafts=drafts, k=k)
        assert got.tolist() == want.tolist(), split


def test_the_verify_combine_refuses_what_it_cannot_read(host, dev):
    rows, k, vocab = 4, 1, 100
    params = expanded(mf.sampling_params(2, temperature=1.0), k)
    with mf.DeviceBuffer(_core._partial_bytes(rows)) as parts, mf.DeviceBuffer(2 * (k + 2) * 4) as cells, \
            mf.DeviceBuffer(8) as drafts, mf.DeviceBuffer(rows * _core.SELECT_ROW_BYTES) as state, \
            mf.DeviceBuffer(params.nbytes) as dparams, mf.DeviceBuffer(rows * 4) as lp, mf.PinnedBuffer(4) as fault:
        kw = dict(rows=rows, vocab=vocab, call=1, fault_dst=fault, filtered=True)
        for bad, match in ((dict(params=params, drafts=drafts, k=k, select=state), "device params"),
                           (dict(params=dparams, drafts=drafts, k=k), "select state"),
                           (dict(params=dparams, select=state), "MF_COMBINE_VERIFY"),
                           (dict(params=dparams, drafts=drafts, k=k, select=state, logprobs=lp), "no logprobs")):
            with pytest.raises(ValueError, match=match):
                _core._combine_partials(parts, 1, cells, None, None, **kw, **bad)


def test_the_logit_rows_params_are_expanded_on_the_device(backend, dev):
    """_verify_logit_params (mf_verify_logit_params): row r's record at position + advance[r] + j
    for each of its k + 1 logit rows, wrapping mod 2**32 as the counter does, read from device
    params and a device advance when it runs; every other field is the row's own."""
    rng = np.random.default_rng(4)
    rows, k = 5, 3
    params = mf.sampling_params(rows, temperature=rng.uniform(0, 2, rows), top_k=rng.integers(0, 50, rows),
                                top_p=rng.uniform(0, 1, rows), min_p=rng.uniform(0, 0.1, rows),
                                seed=rng.integers(0, 2**60, rows), position=[0, 7, 2**32 - 2, 2**32 - 1, 99])
    advance = np.array([1, 4, 1, 2**32 - 1, 0], np.uint32)
    src, adv = dev.upload(params), dev.upload(advance)
    size = rows * (k + 1) * params.dtype.itemsize
    with mf.DeviceBuffer(size) as out, mf.DeviceBuffer(size) as plain:
        _core._verify_logit_params(src, adv, out, rows=rows, k=k)
        _core._verify_logit_params(src, None, plain, rows=rows, k=k)
        got = dev.download(out, params.dtype, rows * (k + 1))
        without = dev.download(plain, params.dtype, rows * (k + 1))
    want = expanded(params, k)
    assert without.tobytes() == want.tobytes()
    want["position"] += np.repeat(advance, k + 1)  # uint32: wraps as the counter does
    assert got.tobytes() == want.tobytes()
    assert got["position"][3 * (k + 1):4 * (k + 1)].tolist() == [2**32 - 2, 2**32 - 1, 0, 1]
    for buf in (src, adv):
        buf.close()


def test_the_logit_rows_params_refuse_what_they_cannot_write(host, dev):
    params = dev.upload(mf.sampling_params(4, temperature=1.0))
    with mf.DeviceBuffer(4 * 4 * 32) as out:
        for bad, match in ((dict(rows=0, k=1), "rows"), (dict(rows=2, k=0), "k"),
                           (dict(rows=128, k=63), "logit rows"), (dict(rows=4, k=4), "out holds")):
            with pytest.raises(ValueError, match=match):
                _core._verify_logit_params(params, None, out, **bad)
        with mf.DeviceBuffer(32) as small, pytest.raises(ValueError, match="params holds"):
            _core._verify_logit_params(small, None, out, rows=2, k=1)
        with mf.DeviceBuffer(4) as small, pytest.raises(ValueError, match="advance holds"):
            _core._verify_logit_params(params, small, out, rows=2, k=1)
        with pytest.raises(ValueError, match="out and params overlap"):  # out over its own input
            _core._verify_logit_params(out.ptr + 32, None, out, rows=2, k=1)
    params.close()
