"""Chosen-token logprobs against a float64 numpy oracle, and the partial blocks of a row split and
their combine against the unsharded call: ids bit for bit, logprobs within the contract
(2e-5 absolute or 2 float32 ulps of the float64 reference)."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core
from metrale_feed.errors import FeedError
from metrale_feed.testing.oracle import reference_argmax, reference_logprobs

from helpers.accuracy import assert_close
from helpers.calls import pick, split
from helpers.records import SELECT_ROW

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# ---- logprobs of the unsharded call ----

@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("vocab", [1, 2, 17, 1000, 152064])
def test_argmax_logprobs_match_float64(path, no_leaks, dev, dtype, vocab):
    rng = np.random.default_rng(vocab + len(dtype))
    rows = 3 if vocab > 10000 else 12
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(DTYPES[dtype])
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    masks[::2] = mf.NO_TOKEN
    ids, lp = pick(dev, logits, masks)
    assert np.array_equal(ids, reference_argmax(logits, masks))
    assert_close(lp, reference_logprobs(logits, ids))


def test_special_rows(path, dev):
    nan, inf = np.nan, np.inf
    logits = np.array([
        [nan, nan, nan, nan],        # no finite logit: NaN
        [-inf, -inf, -inf, -inf],    # likewise
        [0.0, inf, 1.0, 2.0],        # +inf anywhere: NaN
        [0.0, inf, 1.0, 2.0],        # +inf masked off: still NaN
        [nan, 1.0, -inf, 2.0],       # NaN counts as -inf
        [-inf, 1.0, nan, 3.0],       # masks leave only -inf and NaN: the -inf wins, -inf logprob
        [5.0, 1.0, 2.0, 3.0],        # masks leave only NaN: -inf
        [1.0, 1.0, 1.0, 1.0],        # every id masked: NO_TOKEN, NaN
    ], np.float32)
    N = mf.NO_TOKEN
    masks = np.array([[N, N], [N, N], [N, N], [1, N], [N, N], [1, 3], [0, 1], [0, 1]], np.uint32)
    bitmask = np.full((8, 1), -1, np.int32)
    bitmask[6] = 0b0100  # row 6: only id 2 (set to NaN below) is allowed besides the masks
    bitmask[7] = 0
    logits[6, 2] = nan
    ids, lp = pick(dev, logits, masks, bitmask)
    assert np.array_equal(ids, reference_argmax(logits, masks, bitmask))
    ref = reference_logprobs(logits, ids)
    assert np.isnan(ref[[0, 1, 2, 3, 7]]).all() and np.isneginf(ref[[5, 6]]).all()
    assert_close(lp, ref)


def test_sequential_float32_would_miss(host, dev):
    # 152064 equal logits: a sequential float32 sum of ones stalls far from 152064; the contract
    # holds only with a float64 or pairwise sum.
    logits = np.zeros((2, 152064), np.float32)
    logits[1, 5] = 1e-3
    ids, lp = pick(dev, logits)
    assert_close(lp, reference_logprobs(logits, ids))
    assert abs(lp[0] + np.log(152064)) < 2e-5


def test_same_inputs_same_bits_and_ids_unchanged(path, dev):
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((16, 5000)) * 3).astype(np.float32)
    ids1, lp1 = pick(dev, logits)
    ids2, lp2 = pick(dev, logits)
    ids0, _ = pick(dev, logits, with_logprobs=False)
    assert np.array_equal(ids1, ids0) and np.array_equal(ids1, ids2)
    assert np.array_equal(lp1.view(np.uint32), lp2.view(np.uint32))


def test_pinned_pointer_destination(host, dev):
    logits = np.arange(12, dtype=np.float32).reshape(3, 4)
    buf, cells, lp = dev.upload(logits), mf.DeviceBuffer(12), mf.DeviceBuffer(12)
    ptr = mf.alloc_host_pinned(12)
    with mf.Event() as done:
        mf.argmax_to_feed(buf, None, cells, None, done, rows=3, vocab=4, dtype="float32", logprobs=lp,
                          logprobs_dst=ptr)
        done.synchronize()
    got = np.array(mf.read_pinned_u32(ptr, 3), np.uint32).view(np.float32)
    mf.free_host_pinned(ptr, 12)
    assert_close(got, reference_logprobs(logits, [3, 3, 3]))
    for b in (buf, cells, lp):
        b.close()


def test_padded_row_stride(host, dev):
    rng = np.random.default_rng(8)
    wide = rng.standard_normal((6, 130)).astype(np.float32)
    wide[:, 100:] = 50.0  # padding that must not count
    ids, lp = pick(dev, wide, row_stride=(130, 100))
    assert_close(lp, reference_logprobs(wide[:, :100], ids))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_sampled_logprobs(path, dev, dtype):
    rng = np.random.default_rng(9)
    rows, vocab = 10, 3000
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(DTYPES[dtype])
    params = mf.sampling_params(rows, temperature=0.8, top_p=0.9, top_k=40, seed=5,
                                position=np.arange(rows))
    params["temperature"][0] = 0.0
    ids, lp = pick(dev, logits, params=params)
    plain, _ = pick(dev, logits, params=params, with_logprobs=False)
    assert np.array_equal(ids, plain)
    assert_close(lp, reference_logprobs(logits, ids))


def test_backend_logprobs(backend, dev):
    rng = np.random.default_rng(10)
    logits = (rng.standard_normal((5, 4099)) * 3).astype(np.float32)
    ids, lp = pick(dev, logits)
    assert np.array_equal(ids, reference_argmax(logits))
    assert_close(lp, reference_logprobs(logits, ids))


# ---- bad input: refused before anything is queued ----

def test_bad_logprobs_buffers_raise_before_queueing(host, dev):
    logits = np.ones((4, 10), np.float32)
    buf, cells, small = dev.upload(logits), mf.DeviceBuffer(16), mf.DeviceBuffer(12)
    ok = mf.DeviceBuffer(16)
    ids = np.full(4, 99, np.uint32)
    common = dict(rows=4, vocab=10, dtype="float32")
    with pytest.raises((ValueError, FeedError)):
        mf.argmax_to_feed(buf, None, cells, ids, None, logprobs=small, **common)
    with pytest.raises(TypeError, match="float32"):
        mf.argmax_to_feed(buf, None, cells, ids, None, logprobs=ok, logprobs_dst=np.zeros(4), **common)
    with pytest.raises(ValueError, match="fewer than"):
        mf.argmax_to_feed(buf, None, cells, ids, None, logprobs=ok, logprobs_dst=np.zeros(3, np.float32),
                          **common)
    with pytest.raises(ValueError, match="needs logprobs"):
        mf.argmax_to_feed(buf, None, cells, ids, None, logprobs_dst=np.zeros(4, np.float32), **common)
    with pytest.raises(FeedError):  # an int is a pinned pointer of this package
        mf.argmax_to_feed(buf, None, cells, ids, None, logprobs=ok, logprobs_dst=4096, **common)
    mf.stream_synchronize(0)
    assert (ids == 99).all()  # nothing was queued
    for b in (buf, cells, small, ok):
        b.close()


# feed.h's mf_select_row, as the tests write it (its size checked against the extension's).
_STATE = SELECT_ROW  # mf_select_row


def _select_state(rows, **fields):
    state = np.zeros(rows, _STATE)
    for k, v in fields.items():
        state[k] = v
    return state


def _keys_of(x):
    """mf_key_f32 of float32 values, as int64 (NaN 0)."""
    b = x.astype(np.float32).view(np.uint32).astype(np.int64)
    mag = b & 0x7FFFFFFF
    key = np.where(b >> 31, 0x80000000 - mag, 0x80000000 + mag)
    return np.where(mag > 0x7F800000, 0, np.where(mag == 0, 0x80000000, key))


def test_select_stages_on_a_slice_match_numpy(host, dev):
    """The split filters' stages on one slice [start, stop) of a row: TOP is the greatest finite
    candidate by global id, HIST the digit's counts or masses under the prefix, and a cut keeps the
    lowest ids at the boundary key (checked through the RACE's survivors with top_k-like cuts)."""
    rng = np.random.default_rng(3)
    rows, vocab, start, stop = 4, 300, 37, 260
    x = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    x[0, [50, 51]] = np.inf                       # +inf is no candidate: the finite top is found
    x[1, 40:200] = np.nan
    x[2, :] = 1.5                                 # all tied
    masks = np.array([[60, mf.NO_TOKEN], [mf.NO_TOKEN] * 2, [38, 5], [mf.NO_TOKEN] * 2], np.uint32)
    sl = dev.upload(np.ascontiguousarray(x[:, start:stop]))
    params = mf.sampling_params(rows, temperature=1.0, top_k=5, seed=np.arange(rows))
    kw = dict(start=start, stop=stop, vocab=vocab, dtype="float32", call=9, rows=rows, masks=masks)
    cand = np.isfinite(x)
    cand[np.arange(rows)[:, None], np.where(masks < vocab, masks, 0)] &= masks >= vocab
    cand[:, :start] = cand[:, stop:] = False
    keys = np.where(cand, _keys_of(x), -1)
    state = dev.upload(_select_state(rows))
    top = mf.DeviceBuffer(_core._partial_bytes(rows))
    _core._select_partial(sl, params, top, state, "top", **kw)
    mf.stream_synchronize(0)
    rec = dev.download(top, np.uint32)[_core.PARTIAL_HEADER_BYTES // 4:].reshape(rows, 4)
    want = [int(np.flatnonzero(keys[r] == keys[r].max())[0]) for r in range(rows)]
    assert rec[:, 0].tolist() == want
    # HIST: round 0 counts (the key's top byte), then a later round's counts and masses under a
    # prefix.
    hist = mf.DeviceBuffer(_core.PARTIAL_HEADER_BYTES + rows * _core.SELECT_HIST_BYTES)
    f = _core.SELECT_ROW_FLAGS
    bins, digit = _core.SELECT_BINS, _core.SELECT_DIGIT_BITS
    for shift, prefix, mass in ((24, 0, False), (16, None, False), (8, None, True)):
        pre = [int(keys[r].max()) if prefix is None else prefix for r in range(rows)]
        st = _select_state(rows, top_bits=x[np.arange(rows), want].view(np.uint32), prefix=pre,
                           shift=shift, flags=f["top"] | f["hist"] | (f["mass"] if mass else 0))
        state = dev.upload(st)
        _core._select_partial(sl, params, hist, state, "hist", **kw)
        mf.stream_synchronize(0)
        got = dev.download(hist, np.uint64)[_core.PARTIAL_HEADER_BYTES // 8:].reshape(rows, bins)
        for r in range(rows):
            k = keys[r][keys[r] >= 0]
            inside = k if shift == 32 - digit else k[(k >> (shift + digit)) == (pre[r] >> (shift + digit))]
            counts = np.bincount((inside >> shift) & (bins - 1), minlength=bins)
            if mass:  # every mass is positive here and <= 2**39; their sum by digit
                assert got[r].sum() > 0 and (got[r][counts == 0] == 0).all()
                assert got[r].max() <= 2**39 * inside.size
            else:
                assert got[r].tolist() == counts.tolist(), (r, shift)
    # A cut at the all-tied row's key keeping 3 (counts): the race then draws among the 3 lowest ids.
    k2 = int(keys[2].max())
    seen = set()
    for seed in range(40):
        p = params.copy()
        p["seed"] = seed
        st = _select_state(rows, top_bits=x[np.arange(rows), want].view(np.uint32), cut_key=k2,
                           cut_need=3, flags=f["top"] | f["cut"])
        state = dev.upload(st)
        _core._select_partial(sl, p, top, state, "race", **kw)
        mf.stream_synchronize(0)
        rec = dev.download(top, np.uint32)[_core.PARTIAL_HEADER_BYTES // 4:].reshape(rows, 4)
        seen.add(int(rec[2, 0]))
    ids = np.flatnonzero(keys[2] >= 0)[:3] + 0
    assert seen <= set(ids.tolist()) and len(seen) > 1, (seen, ids)


def test_select_stage_refusals(host, dev):
    rows = 2
    sl = dev.upload(np.ones((rows, 5), np.float32))
    params = mf.sampling_params(rows, temperature=1.0, top_k=3)
    kw = dict(rows=rows, vocab=10, dtype="float32", call=1, start=0, stop=5)
    parts, state = mf.DeviceBuffer(_core._partial_bytes(rows)), mf.DeviceBuffer(rows * _core.SELECT_ROW_BYTES)
    with pytest.raises(ValueError, match="stage"):
        _core._select_partial(sl, params, parts, state, "sort", **kw)
    with pytest.raises((ValueError, FeedError)):  # the state of one row for two
        _core._select_partial(sl, params, parts, mf.DeviceBuffer(_core.SELECT_ROW_BYTES), "top", **kw)
    with pytest.raises((ValueError, FeedError)):  # a histogram needs 128 bytes a row
        _core._select_partial(sl, params, parts, state, "hist", **kw)
    with pytest.raises((ValueError, TypeError)):
        _core._select_partial(sl, None, parts, state, "top", **kw)
    # Candidate lists: a cap in [1, SELECT_CANDS_MAX], a block of cap entries a row, and gathered
    # lists of at least one block a slice.
    with pytest.raises(ValueError, match="cands_cap"):
        _core._select_partial(sl, params, parts, state, "cands", cands_cap=_core.SELECT_CANDS_MAX + 1, **kw)
    with pytest.raises((ValueError, FeedError)):  # 2 rows of 3 entries do not fit a record block
        _core._select_partial(sl, params, parts, state, "cands", cands_cap=3, **kw)
    lists = mf.DeviceBuffer(_core.PARTIAL_HEADER_BYTES + rows * 3 * _core.PARTIAL_CAND_BYTES)
    _core._select_partial(sl, params, lists, state, "cands", cands_cap=3, **kw)
    with pytest.raises((ValueError, FeedError)):  # a stride under one block
        _core._select_partial(sl, params, parts, state, "race", cands=lists, cands_cap=3, cands_world=1,
                              cands_stride=8, **kw)
    with pytest.raises((ValueError, FeedError)):  # two slices' lists where one is
        _core._select_partial(sl, params, parts, state, "race", cands=lists, cands_cap=3, cands_world=2,
                              cands_stride=lists.nbytes, **kw)
    mf.stream_synchronize(0)
    # The combine takes filters only for blocks raced over the global thresholds.
    cells, fault = mf.DeviceBuffer(8), mf.PinnedBuffer(4)
    with pytest.raises(ValueError, match="temperature only"):
        _core._combine_partials(parts, 1, cells, None, None, rows=rows, vocab=10, call=1, fault_dst=fault,
                                params=params)
    _core._combine_partials(parts, 1, cells, None, None, rows=rows, vocab=10, call=1, fault_dst=fault,
                            params=params, filtered=True)
    mf.stream_synchronize(0)


@pytest.mark.parametrize("op", ["argmax", "sample"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_empty_slice_as_a_rows_by_zero_tensor_gives_its_dtype_and_rows(host, dev, op, dtype):
    # The contract's empty slice is (rows, 0): the tensor says its dtype and rows even with no
    # element, so its block is the one the dtype= and rows= form (logits None) writes.
    rows, vocab = 3, 40
    params = mf.sampling_params(rows, temperature=0.7, seed=[1, 2, 3]) if op == "sample" else None
    launch = (_core._argmax_partial if op == "argmax" else
              lambda lg, m, p, **kw: _core._sample_partial(lg, params, p, masks=m, **kw))
    kw = dict(start=vocab, stop=vocab, vocab=vocab, call=5, logprobs=True)
    given, taken = mf.DeviceBuffer(_core._partial_bytes(rows)), mf.DeviceBuffer(_core._partial_bytes(rows))
    dev.write(given, np.full(_core._partial_bytes(rows), 0xEE, np.uint8))
    dev.write(taken, np.full(_core._partial_bytes(rows), 0x11, np.uint8))
    launch(None, None, given, rows=rows, dtype=dtype, **kw)
    empty = np.zeros((rows, 0), dtype)
    launch(empty, None, taken, dtype=None, **kw)  # no rows=, no dtype=: the tensor's
    mf.stream_synchronize()
    assert np.array_equal(dev.download(taken), dev.download(given))
    other = "float16" if dtype == "float32" else "float32"
    for bad, exc, needle in ((dict(dtype=other), ValueError, "disagrees with the logits tensor"),
                             (dict(rows=rows + 1, dtype=None), ValueError, "disagrees with the logits tensor")):
        with pytest.raises(exc, match=needle):
            launch(empty, None, taken, **bad, **kw)
    for logits, exc, needle in ((np.zeros((rows, 1), dtype), ValueError, r"\(rows, 0\) tensor"),
                                (np.zeros(0, dtype), ValueError, r"\(rows, 0\) tensor"),
                                (np.zeros((rows, 0), np.int32), TypeError, "float32, float16 or bfloat16")):
        with pytest.raises(exc, match=needle):
            launch(logits, None, taken, rows=rows, dtype=None, **kw)
    given.close()
    taken.close()


def test_partial_refusals(host, dev):
    rows = 2
    parts, sl = mf.DeviceBuffer(_core._partial_bytes(rows)), dev.upload(np.ones((rows, 5), np.float32))
    kw = dict(rows=rows, vocab=10, dtype="float32", call=1)
    with pytest.raises(ValueError):
        _core._argmax_partial(sl, None, parts, start=6, stop=11, **kw)  # past the vocabulary
    with pytest.raises(ValueError):
        _core._argmax_partial(sl, [(10, mf.NO_TOKEN)] * rows, parts, start=0, stop=5, **kw)
    with pytest.raises(ValueError, match="temperature only"):
        _core._sample_partial(sl, mf.sampling_params(rows, temperature=1.0, top_k=3), parts, start=0,
                              stop=5, **kw)
    with pytest.raises(TypeError, match="logprobs"):
        _core._argmax_partial(sl, None, parts, start=0, stop=5, logprobs=1, **kw)
    tiny = mf.DeviceBuffer(16)
    with pytest.raises((ValueError, FeedError)):
        _core._argmax_partial(sl, None, tiny, start=0, stop=5, **kw)
    cells, fault = mf.DeviceBuffer(8), mf.PinnedBuffer(4)
    with pytest.raises(ValueError):
        _core._combine_partials(parts, 1, cells, None, None, rows=rows, vocab=10, call=1, fault_dst=fault,
                                slice_stride=rows + 1)
    with pytest.raises((ValueError, FeedError)):  # two blocks do not fit in one block's buffer
        _core._combine_partials(parts, 2, cells, None, None, rows=rows, vocab=10, call=1, fault_dst=fault)
    for b in (parts, sl, tiny, cells, fault):
        b.close()


# ---- the split: partial blocks and the combine equal the unsharded call ----

def nasty(rng, rows, vocab, dtype=np.float32):
    x = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    x[rng.random((rows, vocab)) < 0.01] = np.nan
    x[rng.random((rows, vocab)) < 0.01] = -np.inf
    return x.astype(dtype)


SPLITS = {
    "whole": lambda v: [0, v],
    "even": lambda v: [0, v // 2, v],
    "uneven": lambda v: [0, 7, 333, v],
    "custom-empty": lambda v: [0, 100, 100, 517, v],
    "empty-first-last": lambda v: [0, 0, 500, v, v],
}


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("how", sorted(SPLITS))
def test_split_argmax_equals_unsharded(path, no_leaks, dev, dtype, how):
    rng = np.random.default_rng(len(how) * 3 + len(dtype))
    rows, vocab = 9, 1000
    logits = nasty(rng, rows, vocab, DTYPES[dtype])
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)  # ids in every slice
    masks[::3] = mf.NO_TOKEN
    bitmask = rng.integers(-2**31, 2**31, (rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1
    bitmask[1, -1] = -1  # the partial last word: ids past vocab are set and must not count
    bitmask[2] = 0       # nothing allowed: NO_TOKEN in every slice
    want, want_lp = pick(dev, logits, masks, bitmask)
    ids, lp, fault = split(dev, logits, SPLITS[how](vocab), masks, bitmask)
    _core._check_partials_fault(fault)
    assert np.array_equal(ids, want) and ids[2] == mf.NO_TOKEN
    ref = reference_logprobs(logits, ids)
    assert_close(lp, ref)
    assert_close(want_lp, ref)


def test_ties_across_a_slice_boundary_go_to_the_lowest_global_id(path, dev):
    logits = np.zeros((3, 64), np.float32)
    logits[0, [31, 32]] = 5.0   # the boundary at 32
    logits[1, [10, 40, 63]] = 5.0
    logits[2, :] = np.nan       # all NaN: the lowest id, in slice 0
    for offsets in ([0, 32, 64], [0, 11, 33, 64], [0, 0, 32, 32, 64]):
        ids, lp, fault = split(dev, logits, offsets)
        _core._check_partials_fault(fault)
        assert ids.tolist() == [31, 10, 0]
        assert_close(lp, reference_logprobs(logits, ids))


def test_no_slice_has_a_candidate(path, dev):
    logits = np.ones((2, 50), np.float32)
    masks = np.array([[3, 4], [0, mf.NO_TOKEN]], np.uint32)
    bitmask = np.zeros((2, 2), np.int32)
    bitmask[:, 0] = (1 << 3) | (1 << 4)  # only the masked ids are allowed
    bitmask[1, 0] = 1
    ids, lp, _ = split(dev, logits, [0, 3, 25, 50], masks, bitmask)
    assert (ids == mf.NO_TOKEN).all() and np.isnan(lp).all()


def test_padded_slices_and_large_vocab(host, dev):
    rng = np.random.default_rng(12)
    rows, vocab = 2, 152064
    logits = (rng.standard_normal((rows, vocab)) * 5).astype(np.float32)
    want, _ = pick(dev, logits)
    ids, lp, _ = split(dev, logits, [0, 50000, 100001, vocab], pad=13)
    assert np.array_equal(ids, want)
    assert_close(lp, reference_logprobs(logits, ids))


@pytest.mark.parametrize("how", ["even", "uneven", "custom-empty"])
def test_split_temperature_sampling_equals_unsharded(path, dev, how):
    rng = np.random.default_rng(13)
    rows, vocab = 12, 1000
    logits = nasty(rng, rows, vocab)
    params = mf.sampling_params(rows, temperature=rng.uniform(0.3, 2.0, rows), seed=rng.integers(0, 2**63, rows),
                                position=rng.integers(0, 10**6, rows))
    params["temperature"][0] = 0.0   # a greedy row in the batch
    params["temperature"][1] = 1e-38  # z overflows: the top wins
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    bitmask = rng.integers(-2**31, 2**31, (rows, 32), dtype=np.int64).astype(np.int32)
    want, want_lp = pick(dev, logits, masks, bitmask, params=params)
    ids, lp, fault = split(dev, logits, SPLITS[how](vocab), masks, bitmask, params=params)
    _core._check_partials_fault(fault)
    assert np.array_equal(ids, want)
    assert_close(lp, reference_logprobs(logits, ids))


@pytest.mark.parametrize("how", ["uneven", "custom-empty"])
def test_split_sampling_with_device_params_equals_host_params_and_unsharded(path, dev, how):
    # Device-resident params, read when the partial calls and the combine run: the same draws as
    # host params, and as the unsharded call with the same device records (whose out-of-range
    # temperatures are greedy: host params could not hold them).
    rng = np.random.default_rng(21)
    rows, vocab = 12, 1000
    logits = nasty(rng, rows, vocab)
    params = mf.sampling_params(rows, temperature=rng.uniform(0.3, 2.0, rows), seed=rng.integers(0, 2**63, rows),
                                position=rng.integers(0, 10**6, rows))
    params["temperature"][0] = 0.0
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    host_ids, host_lp, fault = split(dev, logits, SPLITS[how](vocab), masks, params=params)
    _core._check_partials_fault(fault)
    with dev.upload(params) as dparams:
        ids, lp, fault = split(dev, logits, SPLITS[how](vocab), masks, params=dparams)
    _core._check_partials_fault(fault)
    assert np.array_equal(ids, host_ids)
    assert np.array_equal(lp.view(np.uint32), host_lp.view(np.uint32))
    assert len(set(ids[1:].tolist())) > 3  # sampled rows, not all one argmax
    torch = pytest.importorskip("torch")
    # A tensor that is not a host buffer is device memory to the host backend: lent per call.
    tensor = torch.from_numpy(params.view(np.uint8).copy())
    ids, _, fault = split(dev, logits, SPLITS[how](vocab), masks, params=tensor)
    _core._check_partials_fault(fault)
    assert np.array_equal(ids, host_ids)
    odd = params.copy()
    odd["temperature"][[2, 3, 4]] = [np.nan, -1.0, np.inf]  # out of range on the device: greedy
    with dev.upload(odd) as dparams:
        want, _ = pick(dev, logits, masks, params=dparams)
        ids, lp, fault = split(dev, logits, SPLITS[how](vocab), masks, params=dparams)
    _core._check_partials_fault(fault)
    assert np.array_equal(ids, want)
    assert np.array_equal(ids[2:5], reference_argmax(logits[2:5], masks[2:5]))
    assert np.array_equal(ids[5:], host_ids[5:])
    assert_close(lp, reference_logprobs(logits, ids))


def test_a_filter_in_device_params_of_a_split_row_is_a_fault(host, dev):
    # The slices cannot apply top_k/top_p/min_p found at run time: that row gets NO_TOKEN and the
    # combine reports the row; rows without a filter (or greedy ones) still get their draws.
    rng = np.random.default_rng(22)
    rows, vocab = 6, 300
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    params = mf.sampling_params(rows, temperature=0.8, seed=rng.integers(0, 2**63, rows), position=5)
    want, _ = pick(dev, logits, params=params)
    for row, field, value in [(3, "top_k", 5), (1, "top_p", 0.5), (4, "min_p", 0.1)]:
        bad = params.copy()
        bad[field][row] = value
        bad["top_k"][0] = 7  # with temperature 0 the row is the argmax: no filter applies
        bad["temperature"][0] = 0.0
        with dev.upload(bad) as dparams:
            ids, lp, fault = split(dev, logits, [0, 100, vocab], params=dparams)
        word = int(np.frombuffer(fault, np.uint32)[0])
        assert word == 7 | (row << 8), hex(word)
        with pytest.raises(FeedError, match=f"row {row} of the device-resident params"):
            _core._check_partials_fault(fault)
        assert ids[row] == mf.NO_TOKEN and np.isnan(lp[row])
        others = [r for r in range(1, rows) if r != row]
        assert np.array_equal(ids[others], want[others])
        assert ids[0] == reference_argmax(logits[:1])[0]


def test_device_params_shorter_than_the_rows_are_refused(host, dev):
    rows = 2
    parts, cells, fault = mf.DeviceBuffer(_core._partial_bytes(rows)), mf.DeviceBuffer(8), mf.PinnedBuffer(4)
    with dev.upload(mf.sampling_params(rows, temperature=1.0)) as dparams:
        with pytest.raises(ValueError, match="params holds 64 bytes; 96"):
            _core._combine_partials(parts, 1, cells, None, None, rows=3, vocab=10, call=1,
                                    fault_dst=fault, params=dparams, slice_stride=rows + 2 + 1)
    for b in (parts, cells, fault):
        b.close()


def test_sampled_race_is_split_invariant_over_many_seeds(path, dev):
    # Many draws of one row: any split gives the unsharded draw, seed by seed.
    rng = np.random.default_rng(14)
    rows, vocab = 64, 300
    row = (rng.standard_normal(vocab)).astype(np.float32)
    logits = np.tile(row, (rows, 1))
    params = mf.sampling_params(rows, temperature=1.0, seed=np.arange(rows) + 1, position=3)
    want, _ = pick(dev, logits, params=params, with_logprobs=False)
    assert len(set(want.tolist())) > 10  # the draws do differ
    ids, _, _ = split(dev, logits, [0, 1, 130, 131, 299, 300], params=params)
    assert np.array_equal(ids, want)


@pytest.mark.parametrize("field,value,reason", [
    ("call", 12, "call counter"),
    ("rows", 2, "row count"),
    ("vocab", 999, "vocabulary"),
])
def test_mismatched_partial_is_a_feed_error(host, dev, field, value, reason):
    rng = np.random.default_rng(15)
    logits = rng.standard_normal((3, 1000)).astype(np.float32)

    def tamper(w):
        if w != 1:
            return {}
        if field == "vocab":
            return {"vocab": value, "stop": min(667, value)}
        return {field: value}

    ids, lp, fault = split(dev, logits, [0, 333, 667, 1000], tamper=tamper)
    with pytest.raises(FeedError, match=f"slice 1 has another {reason}"):
        _core._check_partials_fault(fault)
    assert (ids == mf.NO_TOKEN).all() and np.isnan(lp).all()


def test_slices_that_do_not_tile_and_another_operation(host, dev):
    logits = np.ones((2, 100), np.float32)
    _, _, fault = split(dev, logits, [0, 40, 100], tamper=lambda w: {"start": 41} if w == 1 else {})
    with pytest.raises(FeedError, match="slice 1 has slices that do not tile"):
        _core._check_partials_fault(fault)
    # A sampled block where the combine expects an argmax one.
    params = mf.sampling_params(2, temperature=1.0)
    rows = 2
    block = _core._partial_bytes(rows)
    parts, cells, sl = mf.DeviceBuffer(block * 2), mf.DeviceBuffer(8), dev.upload(logits[:, :50].copy())
    sl2 = dev.upload(logits[:, 50:].copy())
    _core._argmax_partial(sl, None, parts, rows=rows, start=0, stop=50, vocab=100, dtype="float32", call=1)
    _core._sample_partial(sl2, params, parts.ptr + block, rows=rows, start=50, stop=100, vocab=100,
                          dtype="float32", call=1)
    with mf.PinnedBuffer(4) as f, mf.Event() as done:
        _core._combine_partials(parts, 2, cells, None, done, rows=rows, vocab=100, call=1, fault_dst=f)
        done.synchronize()
        with pytest.raises(FeedError, match="slice 1 has another operation"):
            _core._check_partials_fault(f)
    for b in (parts, cells, sl, sl2):
        b.close()


def test_a_slice_with_the_other_logprobs_setting_is_a_feed_error(host, dev):
    # One slice asked for logprobs while the combine did not, or the reverse: the fault, on the
    # combine's side, never a logprob from a zero sum nor a wrong id.
    logits = np.random.default_rng(17).standard_normal((3, 1000)).astype(np.float32)
    for combine_logprobs in (True, False):
        ids, lp, fault = split(dev, logits, [0, 333, 667, 1000], logprobs=combine_logprobs,
                               tamper=lambda w: {"logprobs": not combine_logprobs} if w == 1 else {})
        with pytest.raises(FeedError, match="slice 1 has the other logprobs setting"):
            _core._check_partials_fault(fault)
        assert (ids == mf.NO_TOKEN).all()
        assert lp is None or np.isnan(lp).all()


def read_block(dev, parts, rows):
    """A partial block's header words (tag, rows, call lo, call hi, vocab, start, stop, fault) and
    its records (id, logit bits, max, sum)."""
    raw = dev.download(parts, count=_core._partial_bytes(rows))
    header = raw[:32].view(np.uint32)
    rec = raw[32:].view(np.dtype([("id", "<u4"), ("bits", "<u4"), ("max", "<f4"), ("sum", "<f4")]))
    return header, rec


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_partial_records_carry_max_and_sum_only_when_logprobs_are_asked(path, no_leaks, dev, dtype):
    rng = np.random.default_rng(18 + len(dtype))
    rows, vocab, lo, hi = 5, 1000, 400, 1000
    logits = nasty(rng, rows, vocab, DTYPES[dtype])
    logits[4] = np.nan  # no finite logit in the slice
    part = np.ascontiguousarray(logits[:, lo:hi])
    wide = part.astype(np.float64)
    sl, parts = dev.upload(part), mf.DeviceBuffer(_core._partial_bytes(rows))
    params = mf.sampling_params(rows, temperature=0.9, seed=5, position=np.arange(rows))
    local = reference_argmax(part)
    for sampled in (False, True):
        for logprobs in (False, True):
            kw = dict(rows=rows, start=lo, stop=hi, vocab=vocab, dtype=dtype, call=3, logprobs=logprobs)
            if sampled:
                _core._sample_partial(sl, params, parts, **kw)
            else:
                _core._argmax_partial(sl, None, parts, **kw)
            header, rec = read_block(dev, parts, rows)
            op = (2 if sampled else 1) | (128 if logprobs else 0)  # docs/kernels.md: the logprobs bit
            assert header[0] == 0x3150464D ^ op and header[1] == rows and header[2] == 3
            assert header[4:7].tolist() == [vocab, lo, hi]
            if not sampled:  # the slice's argmax as a global id, its logit's bits
                assert np.array_equal(rec["id"], local + lo)
                chosen = part.astype(np.float32)[np.arange(rows), local]
                assert np.array_equal(rec["bits"].view(np.float32), chosen, equal_nan=True)
            if not logprobs:  # not computed: both 0, whatever the logits
                assert (rec["max"] == 0).all() and (rec["sum"] == 0).all(), rec
                continue
            finite = np.where(np.isnan(wide), -np.inf, wide)
            m = finite.max(axis=1)
            assert np.array_equal(rec["max"][:4], m[:4].astype(np.float32))
            s = np.exp(finite[:4] - m[:4, None]).sum(axis=1)
            assert np.allclose(rec["sum"][:4], s, rtol=1e-6), (rec["sum"], s)
            assert rec["max"][4] == -np.inf and rec["sum"][4] == 0
    for b in (sl, parts):
        b.close()


@pytest.mark.parametrize("how", ["even", "uneven", "custom-empty"])
def test_split_without_logprobs_equals_unsharded(path, dev, how):
    rng = np.random.default_rng(19)
    rows, vocab = 9, 1000
    logits = nasty(rng, rows, vocab)
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    bitmask = rng.integers(-2**31, 2**31, (rows, 32), dtype=np.int64).astype(np.int32)
    bitmask[2] = 0
    params = mf.sampling_params(rows, temperature=rng.uniform(0.3, 2.0, rows), seed=7, position=np.arange(rows))
    for p in (None, params):
        want, _ = pick(dev, logits, masks, bitmask, params=p, with_logprobs=False)
        ids, lp, fault = split(dev, logits, SPLITS[how](vocab), masks, bitmask, params=p, logprobs=False)
        _core._check_partials_fault(fault)
        assert lp is None and np.array_equal(ids, want) and ids[2] == mf.NO_TOKEN


@pytest.mark.gpu
def test_split_on_cuda(backend, dev):
    rng = np.random.default_rng(16)
    logits = nasty(rng, 7, 5000)
    masks = rng.integers(0, 5000, (7, 2)).astype(np.uint32)
    bitmask = rng.integers(-2**31, 2**31, (7, 157), dtype=np.int64).astype(np.int32)
    want, want_lp = pick(dev, logits, masks, bitmask)
    ids, lp, fault = split(dev, logits, [0, 1, 2500, 2500, 4999, 5000], masks, bitmask)
    _core._check_partials_fault(fault)
    assert np.array_equal(ids, want)
    assert_close(lp, reference_logprobs(logits, ids))
    assert_close(want_lp, reference_logprobs(logits, ids))
    params = mf.sampling_params(7, temperature=0.7, seed=3, position=np.arange(7))
    want, _ = pick(dev, logits, masks, bitmask, params=params)
    ids, _, _ = split(dev, logits, [0, 1234, 5000], masks, bitmask, params=params)
    assert np.array_equal(ids, want)


# ---- property: any split, any masks, the unsharded call's answer ----

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


# The fixtures hold for every example: the backend and the helpers carry no per-example state.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_split_equals_unsharded(host, dev, data):
    vocab = data.draw(st.integers(1, 300), label="vocab")
    rows = data.draw(st.integers(1, 6), label="rows")
    cuts = sorted(data.draw(st.lists(st.integers(0, vocab), max_size=5), label="cuts"))
    offsets = [0, *cuts, vocab]
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    dtype = DTYPES[data.draw(st.sampled_from(sorted(DTYPES)), label="dtype")]
    sampled = data.draw(st.booleans(), label="sampled")
    rng = np.random.default_rng(seed)
    pool = np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, 1.0, np.nan, 3.0], np.float32)
    logits = np.where(rng.random((rows, vocab)) < 0.5, pool[rng.integers(0, 8, (rows, vocab))],
                      rng.standard_normal((rows, vocab)).astype(np.float32)).astype(dtype)
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    masks[rng.random((rows, 2)) < 0.3] = mf.NO_TOKEN
    bitmask = None
    if data.draw(st.booleans(), label="bitmask"):
        bitmask = rng.integers(-2**31, 2**31, (rows, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
    params = None
    if sampled:
        params = mf.sampling_params(rows, temperature=rng.uniform(0.2, 3.0, rows), seed=int(seed),
                                    position=np.arange(rows))
    want, _ = pick(dev, logits, masks, bitmask, params=params)
    ids, lp, fault = split(dev, logits, offsets, masks, bitmask, params=params)
    _core._check_partials_fault(fault)
    assert np.array_equal(ids, want)
    assert_close(lp, reference_logprobs(logits, ids))
