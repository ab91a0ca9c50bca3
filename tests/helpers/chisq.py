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


def prefix_distributions(target, vocab: int, n: int):
    """The distribution of the first ``n`` ids of a sequence drawn an id at a time, each from
    ``target(prefix)`` (a probability vector over ``vocab`` ids, given the tuple of ids drawn
    before it), by enumerating the prefixes.

    Returns
    -------
    marginals : list of numpy.ndarray
        The distribution of each position.
    joint : numpy.ndarray or None
        ``vocab x vocab``: the distribution of the first two ids (None when ``n < 2``).
    """
    marginals, joint, layer = [], None, {(): 1.0}
    for _ in range(n):
        marginal, deeper = np.zeros(vocab), {}
        for prefix, weight in layer.items():
            p = target(prefix)
            marginal += weight * p
            for t in np.flatnonzero(p):
                deeper[prefix + (int(t),)] = weight * p[t]
        marginals.append(marginal)
        layer = deeper
        if len(marginals) == 2:
            joint = np.zeros((vocab, vocab))
            for (a, b), weight in layer.items():
                joint[a, b] = weight
    return marginals, joint


def assert_sequences_follow(tokens, marginals, joint, vocab: int):
    """Each position of the drawn ``tokens`` (one sequence a row) follows its marginal, and the
    pairs of the first two ids their joint (chi-square at ``chi2_critical``, the pairs' small bins
    pooled)."""
    for j in range(len(marginals)):
        stat, df = chi2(np.bincount(tokens[:, j], minlength=vocab), marginals[j])
        assert stat < chi2_critical(df), f"position {j + 1}: chi2 {stat:.1f} on {df} df"
    pairs = np.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    stat, df = chi2(pairs, joint, pool=5.0)
    assert stat < chi2_critical(df), f"pairs: chi2 {stat:.1f} on {df} df"
