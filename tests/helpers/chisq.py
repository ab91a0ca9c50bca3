"""Pearson's chi-square against a known distribution, without scipy (the tests' CI has none)."""

from __future__ import annotations

import math

import numpy as np


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty: the chi-square quantile at p = 1 - 3e-5 (z = 4), within a few percent
    of the exact one from 1 degree of freedom on (a false alarm about once in 30000 runs)."""
    z = 4.0
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts, probs, pool: float = 0.0):
    """(statistic, degrees of freedom) of ``counts`` against ``probs``. A count where the
    probability is 0 fails the caller's assert at once (no statistic could be small enough).
    ``pool``: bins expected to hold fewer draws are merged into one, so the statistic's
    chi-square approximation holds where many bins are small."""
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    expected = counts.sum() * probs
    keep = expected > 0
    assert counts[~keep].sum() == 0, "an id outside the survivors was emitted"
    counts, expected = counts[keep], expected[keep]
    small = expected < pool
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(((counts - expected) ** 2 / expected).sum()), int(counts.size) - 1
