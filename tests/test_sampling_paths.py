"""The host sampler's vector path (a bounded top_k selection in one pass; without top_k, a short
list of the ids near the top) against its portable path (radix selects over the whole row, then
the race over the whole row), which is the rule as first written: the drawn ids must be the same,
bit for bit, on every kind of row. The draws are also checked against the float64 survivors of
metrale_feed.testing.oracle (an id outside them is a wrong filter, whichever path made it)."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core
from metrale_feed.tools.bench import peaked_logits
from metrale_feed.testing.oracle import reference_allowed, reference_survivors

from helpers.calls import both_paths, sample

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def random_params(rng, rows, *, top_k=None, top_p=None, min_p=None, temperature=None):
    """Each row its own seed, position and filters (a filter off in some rows)."""
    pick = lambda off, on: np.where(rng.random(rows) < 0.3, off, on)  # noqa: E731
    return mf.sampling_params(
        rows,
        temperature=rng.uniform(0.3, 2.0, rows) if temperature is None else temperature,
        top_k=pick(0, rng.integers(1, 80, rows)) if top_k is None else top_k,
        top_p=pick(1.0, rng.uniform(0.3, 0.99, rows)) if top_p is None else top_p,
        min_p=pick(0.0, rng.uniform(0.0, 0.3, rows)) if min_p is None else min_p,
        seed=rng.integers(0, 2**63, rows), position=rng.integers(0, 2**31, rows))


def assert_in_survivors(logits, params, masks, bitmask, ids):
    """Every drawn id is one of the float64 survivors of its row (or NO_TOKEN where none)."""
    rows, vocab = logits.shape
    allowed = reference_allowed(masks, bitmask, rows, vocab)
    for r in range(rows):
        p = params[r]
        keep, _ = reference_survivors(logits[r], allowed[r], float(p["temperature"]), int(p["top_k"]),
                                      float(p["top_p"]), float(p["min_p"]))
        if keep.size == 0:
            assert ids[r] == mf.NO_TOKEN, r
        else:
            assert ids[r] in keep, (r, ids[r], keep[:10])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("vocab", [5, 33, 1000, 20011])
def test_paths_agree_on_random_rows(vector, dev, dtype, kind, vocab):
    rng = np.random.default_rng(vocab * 7 + len(dtype) + len(kind))
    rows = 64 if vocab <= 1000 else 24
    logits = (peaked_logits(rows, vocab, np, vocab) if kind == "peaked"
              else rng.standard_normal((rows, vocab)).astype(np.float32) * 3)
    logits = logits.astype(DTYPES[dtype])
    params = random_params(rng, rows)
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    masks[::3] = mf.NO_TOKEN
    fast, slow = both_paths(dev, logits, params, masks)
    assert np.array_equal(fast, slow)
    assert_in_survivors(logits, params, masks, None, fast)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_paths_agree_with_bitmasks_and_special_values(vector, dev, dtype):
    rng = np.random.default_rng(3)
    rows, vocab = 48, 3001
    logits = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    logits[rng.integers(0, rows, 300), rng.integers(0, vocab, 300)] = np.nan
    logits[rng.integers(0, rows, 300), rng.integers(0, vocab, 300)] = -np.inf
    logits[rng.integers(0, rows, 40), rng.integers(0, vocab, 40)] = np.inf  # never a candidate
    logits[0] = np.nan                       # no finite logit
    logits[1] = -np.inf
    logits[2, :] = np.nan
    logits[2, 17] = 1.0                      # one candidate
    logits[3, ::2] = -np.inf                 # half the row out
    logits = logits.astype(DTYPES[dtype])
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, (rows, words)).astype(np.int32)
    bitmask[4] = 0                           # nothing allowed
    bitmask[5] = 0
    bitmask[5, 3] = 1 << 7                   # only id 103
    bitmask[6] = np.where(rng.random(words) < 0.05, -1, 0)  # sparse words
    bitmask[7] = -1
    bitmask[2] = -1
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    masks[[2, 5]] = mf.NO_TOKEN
    for top_k in (0, 1, 3, 50):
        params = random_params(rng, rows, top_k=top_k)
        fast, slow = both_paths(dev, logits, params, masks, bitmask)
        assert np.array_equal(fast, slow), top_k
        assert fast[0] == fast[1] == fast[4] == mf.NO_TOKEN
        assert fast[2] == 17 and fast[5] == 103
        assert_in_survivors(logits, params, masks, bitmask, fast)


def test_paths_agree_on_a_grammars_rows(vector, dev):
    """Bitmask rows as a grammar's states make them (a few allowed ids in scattered words, whole
    words allowed, most of the row allowed), on flat logits at temperature 1 and above: the
    whole-row race, which skips the words that allow nothing. Drawn again and again (seeds and
    positions), so the draws land across the allowed ids."""
    rng = np.random.default_rng(43)
    rows, vocab = 32, 20011  # the last word partly past the row
    words = (vocab + 31) // 32
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    bitmask = np.zeros((rows, words), np.uint32)
    for r in range(rows):
        kind = r % 4
        if kind == 0:  # a structural state: a few ids
            bitmask[r] = 0
            for t in rng.choice(vocab, int(rng.integers(1, 6)), replace=False):
                bitmask[r, t // 32] |= np.uint32(1 << (t % 32))
        elif kind == 1:  # a few whole words and a lone id in the last one
            bitmask[r, rng.choice(words - 1, 3, replace=False)] = 0xFFFFFFFF
            bitmask[r, -1] = 1 << ((vocab - 1) % 32)
        elif kind == 2:  # a string's state: most of the row
            bitmask[r] = rng.integers(0, 2**32, words, dtype=np.uint64).astype(np.uint32) | 0xFFFF0FFF
        else:  # a digit's state: ids in one word
            bitmask[r, 7] = 0x3FF
    bitmask = bitmask.view(np.int32)
    for temperature in (1.0, 2.5):
        for draw in range(6):
            params = mf.sampling_params(rows, temperature=temperature, seed=rng.integers(0, 2**63, rows),
                                        position=draw)
            fast, slow = both_paths(dev, logits, params, None, bitmask)
            assert np.array_equal(fast, slow), (temperature, draw)
            assert_in_survivors(logits, params, None, bitmask, fast)


@pytest.mark.parametrize("top_k", [1, 2, 7, 31, 64, 500])
def test_ties_at_the_kth_boundary_go_to_the_lower_id(vector, dev, top_k):
    """Rows of a few distinct values, so the k-th boundary falls inside a run of equal logits:
    the lower ids of the run survive (the packed key), on both paths."""
    rng = np.random.default_rng(top_k)
    rows, vocab = 40, 4099
    pool = np.array([-1.0, 0.0, -0.0, 0.5, 1.0, 2.0], np.float32)
    logits = pool[rng.integers(0, len(pool), (rows, vocab))]
    logits[::4, :] = 1.0                     # every id tied
    logits[1::4, rng.integers(0, vocab, 20)] = 3.0  # a few above one long tie
    params = random_params(rng, rows, top_k=top_k, temperature=rng.uniform(0.5, 50.0, rows))
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    fast, slow = both_paths(dev, logits, params, masks)
    assert np.array_equal(fast, slow)
    assert_in_survivors(logits, params, masks, None, fast)
    # Every id tied, top_k alone: the survivors are ids [0, k) (less the masked ones).
    alone = mf.sampling_params(rows, temperature=1.0, top_k=top_k, seed=np.arange(rows), position=5)
    fast, slow = both_paths(dev, logits, alone, masks)
    assert np.array_equal(fast, slow)
    for r in range(0, rows, 4):
        allowed = np.setdiff1d(np.arange(vocab), masks[r])
        assert fast[r] in allowed[:top_k]


@pytest.mark.parametrize("top_k", [1, 4095, 4096, 4097, 100000, 2**32 - 1])
def test_k_at_and_past_the_bounded_selection(vector, dev, top_k):
    """k at the bounded selection's limit, past it (the radix select), and past the candidates."""
    rng = np.random.default_rng(top_k % 1000)
    rows, vocab = 16, 9001
    logits = (rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    logits[: rows // 2] = np.sort(logits[: rows // 2], axis=1)  # ascending: every id raises the floor
    logits[rows // 2:, ::3] = np.nan
    params = random_params(rng, rows, top_k=top_k)
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    fast, slow = both_paths(dev, logits, params, masks)
    assert np.array_equal(fast, slow)
    assert_in_survivors(logits, params, masks, None, fast)


def test_many_seeds_on_one_row(vector, dev):
    """One flat row and one peaked row, 2000 draws each (seed and position vary): the same ids."""
    rng = np.random.default_rng(9)
    vocab = 7000
    flat = rng.standard_normal(vocab).astype(np.float32)
    peaked = peaked_logits(1, vocab, np, 9)[0]
    for row in (flat, peaked):
        for kw in (dict(top_k=50), dict(top_k=50, top_p=0.9), dict(top_p=0.9), dict(), dict(min_p=0.05),
                   dict(top_k=5, min_p=0.2), dict(top_p=0.999)):
            draws = 2000
            params = mf.sampling_params(draws, temperature=1.0, seed=rng.integers(0, 2**63, draws),
                                        position=rng.integers(0, 2**31, draws), **kw)
            fast, slow = both_paths(dev, np.tile(row, (draws, 1)), params)
            assert np.array_equal(fast, slow), kw


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_race_bounds_on_nearly_even_rows(vector, dev, dtype):
    """Rows whose logits all lie within a hair of the top (and one of equal logits, ties to the lower
    id), with NaN, -inf and +inf ids, masked ids and a vocabulary that is not a multiple of 32: the
    whole-row race's group tests (the group's greatest logit against the best score, the row's
    uniform bound from the top's z) are tight here for every id, so a bound a little too eager
    skips winners. 600 draws a row, seed and position varying."""
    rng = np.random.default_rng(12)
    vocab, draws = 4099, 600
    even = np.zeros(vocab, np.float32)
    near = (rng.random(vocab) * 1e-3).astype(np.float32)
    special = near.copy()
    special[rng.integers(0, vocab, 40)] = np.nan
    special[rng.integers(0, vocab, 40)] = -np.inf
    special[rng.integers(0, vocab, 3)] = np.inf
    for row in (even, near, special):
        logits = np.tile(row, (draws, 1)).astype(DTYPES[dtype])
        params = mf.sampling_params(draws, temperature=rng.uniform(0.5, 1.5, draws),
                                    seed=rng.integers(0, 2**63, draws), position=rng.integers(0, 2**31, draws),
                                    min_p=np.where(rng.random(draws) < 0.2, 0.5, 0.0))
        masks = rng.integers(0, vocab, (draws, 2)).astype(np.uint32)
        fast, slow = both_paths(dev, logits, params, masks)
        assert np.array_equal(fast, slow)
        assert (fast != mf.NO_TOKEN).all()


def test_full_width_rows(vector, dev):
    """The bench's shape of row (152064 ids), flat and peaked, every filter combination."""
    rng = np.random.default_rng(10)
    rows, vocab = 8, 152064
    logits = np.concatenate([rng.standard_normal((rows // 2, vocab)).astype(np.float32),
                             peaked_logits(rows // 2, vocab, np, 10)])
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    for kw in (dict(), dict(top_k=50), dict(top_k=1), dict(top_k=64, top_p=0.9), dict(top_p=0.9),
               dict(min_p=0.1), dict(top_p=0.5, min_p=0.01)):
        params = mf.sampling_params(rows, temperature=rng.uniform(0.5, 1.5, rows),
                                    seed=rng.integers(0, 2**63, rows), position=rng.integers(0, 2**31, rows), **kw)
        fast, slow = both_paths(dev, logits, params, masks)
        assert np.array_equal(fast, slow), kw
        assert_in_survivors(logits, params, masks, None, fast)


def test_extreme_scales(vector, dev):
    """Temperatures that make z overflow (the top is the draw) or huge logits (past the near
    list's bound, so the whole-row paths), and tiny ones (every id within reach)."""
    rng = np.random.default_rng(11)
    rows, vocab = 24, 2000
    base = rng.standard_normal((rows, vocab)).astype(np.float32)
    for scale, temperature in ((1.0, 1e-38), (1e30, 1.0), (3e6, 1.0), (1e-30, 1.0), (1.0, 1e4),
                               (50.0, 0.01)):
        logits = (base * np.float32(scale)).astype(np.float32)
        for top_k in (0, 10):
            params = random_params(rng, rows, top_k=top_k, temperature=temperature)
            fast, slow = both_paths(dev, logits, params)
            assert np.array_equal(fast, slow), (scale, temperature, top_k)


@pytest.mark.parametrize("offsets", [[0, 4097, 9001], [0, 3, 4001, 9001], [0, 1, 2, 9001]])
def test_sliced_rows_draw_by_global_id(vector, dev, offsets):
    """A row split into slices (temperature alone: each slice races its own ids, by global id,
    from a base that need not be a multiple of 4) gives the unsharded draw on both paths."""
    rng = np.random.default_rng(len(offsets))
    rows, vocab = 32, 9001
    logits = np.concatenate([(rng.standard_normal((rows // 2, vocab)) * 3).astype(np.float32),
                             peaked_logits(rows // 2, vocab, np, 12)])
    params = random_params(rng, rows, top_k=0, top_p=1.0, min_p=0.0)
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    whole = sample(dev, logits, params, masks)
    world = len(offsets) - 1
    block = _core._partial_bytes(rows)
    for portable in (False, True):
        mf.host_argmax_path(portable)
        parts, cells = mf.DeviceBuffer(block * world), mf.DeviceBuffer(rows * 4)
        slices = []
        try:
            for w in range(world):
                lo, hi = offsets[w], offsets[w + 1]
                slices.append(dev.upload(np.ascontiguousarray(logits[:, lo:hi])))
                _core._sample_partial(slices[-1], params, parts.ptr + w * block, masks=masks, rows=rows,
                                      start=lo, stop=hi, vocab=vocab, dtype="float32", call=3)
            ids, fault = np.zeros(rows, np.uint32), mf.PinnedBuffer(4)
            with mf.Event() as done:
                _core._combine_partials(parts, world, cells, ids, done, rows=rows, vocab=vocab, call=3,
                                        fault_dst=fault, params=params)
                done.synchronize()
            _core._check_partials_fault(fault)
            fault.close()
        finally:
            mf.host_argmax_path(False)
            for b in (parts, cells, *slices):
                b.close()
        assert np.array_equal(ids, whole), portable


def test_the_near_list_holds_every_possible_winner(vector, dev):
    """3000 ids 9 below the top win about a third of the draws between them: the near list (ids
    within 24 of the top in z) must hold them all, or the vector path's ids would differ."""
    vocab, draws = 100000, 300
    row = np.full(vocab, -100.0, np.float32)
    rng = np.random.default_rng(13)
    group = rng.choice(np.arange(1, vocab), 3000, replace=False)
    row[group] = -9.0
    row[0] = 0.0
    params = mf.sampling_params(draws, temperature=1.0, seed=rng.integers(0, 2**63, draws),
                                position=np.arange(draws))
    fast, slow = both_paths(dev, np.tile(row, (draws, 1)), params)
    assert np.array_equal(fast, slow)
    assert 30 < np.isin(fast, group).sum() < 200  # the group does win: the test tests something


def test_top_p_undecided_by_the_near_list(vector, dev):
    """top_p between two targets: with the mass of 100000 ids far below the top (each under the
    near list's bound of 32) the threshold takes the second id, without it only the top. The
    vector path cannot decide it from the list and must weigh the whole row."""
    vocab, draws = 100002, 300
    row = np.full(vocab, -24.05, np.float32)
    row[0], row[1] = 0.0, -1.0
    far_mass = np.floor(np.exp(np.float64(np.float32(-24.05))) * 2.0**39) * (vocab - 2)
    assert 1.5e6 < far_mass < 32 * (vocab - 2)
    top, second = 2.0**39, np.floor(np.exp(-1.0) * 2.0**39)
    # ceil(p * (top + second)) <= top < ceil(p * (top + second + far)): the middle of that range.
    lo, hi = top / (top + second + far_mass), top / (top + second)
    top_p = np.float32((lo + hi) / 2)
    assert lo < top_p < hi
    rng = np.random.default_rng(14)
    params = mf.sampling_params(draws, temperature=1.0, top_p=top_p, seed=rng.integers(0, 2**63, draws),
                                position=np.arange(draws))
    fast, slow = both_paths(dev, np.tile(row, (draws, 1)), params)
    assert np.array_equal(fast, slow)
    assert set(fast.tolist()) == {0, 1}  # the second id survives top_p


def test_temperature_alone_races_without_the_argmax_pass(vector, dev):
    """Temperature alone on a float32 row races the whole row with no argmax pass first, from no
    best score: rows whose scores are all far below zero, whose top is id 0 or the last id, with
    masks, a bitmask, NaN and infinities, and rows whose top z overflows (+inf: the top is the
    draw, though lower ids share its infinite z) or underflows, where that path must hand the row
    back. The same ids as the portable path, every draw a survivor of the float64 oracle."""
    rng = np.random.default_rng(15)
    vocab, draws = 4099, 200
    flat = rng.standard_normal(vocab).astype(np.float32)
    low = flat - np.float32(1000.0)
    first, last = flat.copy(), flat.copy()
    first[0], last[-1] = 6.0, 6.0
    special = flat.copy()
    special[rng.integers(0, vocab, 40)] = np.nan
    special[rng.integers(0, vocab, 40)] = -np.inf
    special[rng.integers(0, vocab, 3)] = np.inf
    huge = flat * np.float32(1e30)  # z = logit * 1e9 overflows: +inf from id ~0 on, -inf below
    tiny = np.full(vocab, -1e30, np.float32)  # every z -inf
    tiny[7] = -1e29
    bitmask = np.zeros((draws, (vocab + 31) // 32), np.uint32)
    bitmask[:, ::3] = rng.integers(0, 2**32, (draws, bitmask.shape[1]))[:, ::3].astype(np.uint32)
    for row, temperature in ((flat, 1.0), (low, 1.0), (low, 0.05), (first, 1.0), (last, 1.0), (special, 0.7),
                             (huge, 1e-9), (tiny, 1e-9)):
        logits = np.tile(row, (draws, 1))
        params = mf.sampling_params(draws, temperature=temperature, seed=rng.integers(0, 2**63, draws),
                                    position=rng.integers(0, 2**31, draws))
        masks = rng.integers(0, vocab, (draws, 2)).astype(np.uint32)
        for bits in (None, bitmask):
            fast, slow = both_paths(dev, logits, params, masks, bits)
            assert np.array_equal(fast, slow), (temperature, bits is None)
            if np.isfinite(row).all() and temperature >= 0.05:
                assert_in_survivors(logits, params, masks, bits, fast)
    # The overflowing row's draw is its top candidate, not the lowest id of infinite z.
    params = mf.sampling_params(4, temperature=1e-9, seed=np.arange(4), position=np.arange(4))
    none = np.full((4, 2), mf.NO_TOKEN, np.uint32)
    top = np.argmax(huge)
    assert (both_paths(dev, np.tile(huge, (4, 1)), params, none)[0] == top).all()
    with np.errstate(over="ignore"):
        assert (np.flatnonzero(huge * np.float32(1e9) == np.inf) < top).any()
