"""top_p without top_k on flat rows (too flat for the near list, at least 8192 ids): the vector
path sums the masses and runs the race in one pass, with a cut placed from a sample of the row and
checked exactly, and settles the ids under the cut that beat the race's best by their masses. Its
draws must be the portable path's (the radix select, then the whole-row race), bit for bit, on
rows where the sample places the cut well, where it misleads it (periodic rows: the check fails
and the exact paths answer), with ties, special values, masked tops and bitmasks. The draws are
also checked against the float64 survivors of metrale_feed.testing.oracle."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.testing.oracle import reference_survivors

from test_sampling_paths import assert_in_survivors, both_paths


def params_for(rng, draws, top_p, min_p=0.0, temperature=None):
    return mf.sampling_params(
        draws, temperature=rng.uniform(0.4, 2.0, draws) if temperature is None else temperature,
        top_p=top_p, min_p=min_p, seed=rng.integers(0, 2**63, draws), position=rng.integers(0, 2**31, draws))


@pytest.mark.parametrize("vocab", [8192, 9001, 20011, 40000])
def test_flat_rows_agree(vector, dev, vocab):
    rng = np.random.default_rng(vocab)
    rows = 32
    scale = np.where(np.arange(rows) % 2, 1.0, 3.0).astype(np.float32)[:, None]
    logits = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    masks[::4, 0] = np.argmax(logits[::4], axis=1)  # the top masked: the next one leads
    masks[1::4, 1] = masks[1::4, 0]                   # one id masked twice
    masks[2::4] = mf.NO_TOKEN
    for top_p in (rng.uniform(0.02, 0.999, rows), 0.9, 0.5, 0.99, 1e-6, 0.9999):
        for min_p in (0.0, np.where(rng.random(rows) < 0.5, 0.02, 0.0)):
            params = params_for(rng, rows, top_p, min_p)
            fast, slow = both_paths(dev, logits, params, masks)
            assert np.array_equal(fast, slow), (top_p, min_p)
            assert_in_survivors(logits, params, masks, None, fast)


@pytest.mark.parametrize("top_p", [0.9, 0.5, 0.99, 0.2])
def test_many_draws_on_one_flat_row(vector, dev, top_p):
    """1500 draws of one row (seed and position vary): the ids just under the cut that beat the
    best above it, and those near the threshold, are settled by their masses every few draws."""
    rng = np.random.default_rng(int(top_p * 100))
    vocab, draws = 20000, 1500
    row = rng.standard_normal(vocab).astype(np.float32)
    fast, slow = both_paths(dev, np.tile(row, (draws, 1)), params_for(rng, draws, top_p, temperature=1.0))
    assert np.array_equal(fast, slow)
    # The draws follow the survivors' masses: the threshold's neighbourhood is drawn too.
    keep, _ = reference_survivors(row, np.ones(vocab, bool), 1.0, 0, top_p)
    assert np.isin(fast, keep).all()
    assert (row[fast] < np.quantile(row[keep], 0.05)).sum() > 0


@pytest.mark.parametrize("period", [256, 512, 1024, 2048, 4096])
def test_periodic_rows_that_mislead_a_sample(vector, dev, period):
    """Rows whose first 32 ids of every `period` stand far above (or below) the rest: a sample
    taken on such a period sees a different row, the cut lands on the wrong side of the threshold,
    and the exact paths must answer; on other periods the sample is fair."""
    rng = np.random.default_rng(period)
    rows, vocab = 24, 32768
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    bump = (np.arange(vocab) % period) < 32
    logits[: rows // 2, bump] += 4.0
    logits[rows // 2:, bump] -= 4.0
    for top_p in (0.9, 0.5, 0.999):
        params = params_for(rng, rows, top_p)
        fast, slow = both_paths(dev, logits, params)
        assert np.array_equal(fast, slow), top_p


def test_ties_and_special_values(vector, dev):
    """Logits on a grid of quarter steps (every threshold falls inside a run of equal logits,
    ties to the lower id), with NaN, -inf and +inf ids, rows with a bitmask, and a length that is
    not a multiple of 8 (the scalar tail)."""
    rng = np.random.default_rng(21)
    rows, vocab = 32, 12005
    logits = (np.round(rng.standard_normal((rows, vocab)) * 4) / 4).astype(np.float32)
    logits[rng.integers(0, rows, 400), rng.integers(0, vocab, 400)] = np.nan
    logits[rng.integers(0, rows, 400), rng.integers(0, vocab, 400)] = -np.inf
    logits[rng.integers(0, rows, 30), rng.integers(0, vocab, 30)] = np.inf  # never a candidate
    logits[3, -5:] = 9.0  # the top in the tail
    words = (vocab + 31) // 32
    masks = rng.integers(0, vocab, (rows, 2)).astype(np.uint32)
    for bitmask in (None, rng.integers(-2**31, 2**31, (rows, words)).astype(np.int32),
                    np.full((rows, words), -1, np.int32)):
        for top_p in (0.9, 0.3, 0.995):
            params = params_for(rng, rows, top_p, np.where(rng.random(rows) < 0.3, 0.05, 0.0))
            fast, slow = both_paths(dev, logits, params, masks, bitmask)
            assert np.array_equal(fast, slow), (top_p, bitmask is None)
            assert_in_survivors(logits, params, masks, bitmask, fast)


@pytest.mark.parametrize("period", [512, 1024, 2048])
def test_a_run_of_ties_at_the_cut(vector, dev, period):
    """The cut falls at a value a run of ids holds exactly, with the threshold inside the run:
    the first 32 ids of every `period` (where a sample would look) stand at 0.49 over a low bulk,
    and a run of equal logits at 0.5, a 12-bit key boundary, holds most of the mass elsewhere. The
    ids at the cut's own value count as at or above it, so the exact paths answer here."""
    rng = np.random.default_rng(period + 7)
    vocab, draws = 32768, 400
    row = (rng.standard_normal(vocab) * 0.5 - 3.0).astype(np.float32)
    ids = np.arange(vocab)
    row[ids % period < 32] = 0.49
    row[(ids % period >= 32) & (ids % 5 == 0)] = 0.5
    for top_p in (0.3, 0.6, 0.9):
        params = params_for(rng, draws, top_p, temperature=1.0)
        fast, slow = both_paths(dev, np.tile(row, (draws, 1)), params)
        assert np.array_equal(fast, slow), top_p
