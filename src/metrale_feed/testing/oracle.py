"""A plain numpy statement of the masked-argmax rule (docs/encodings.md), for tests and for
checking a backend.

It is written from the rule itself, not from the C code (``argmax_rule.h``):

1. the candidates of a row are the ids in ``[0, vocab)`` other than the row's two mask ids;
2. the winner is the candidate with the greatest value, where NaN ranks below every number and
   ``-0.0 == +0.0``;
3. ties go to the lowest id, so a row whose candidates are all ``-inf``, or all NaN, answers its
   lowest candidate;
4. a row with no candidate answers ``NO_TOKEN``.

This module is loaded lazily (``metrale_feed.reference_argmax``), so importing numpy here does not
make ``import metrale_feed`` import it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["NO_TOKEN", "reference_argmax", "reference_allowed", "reference_logprobs",
           "reference_survivors"]

NO_TOKEN = 0xFFFFFFFF


def _as_float64(logits) -> np.ndarray:
    """The logits as an exact float64 array (float32, float16 and bfloat16 all embed exactly)."""
    array = np.asarray(logits)
    if array.ndim != 2:
        raise ValueError(f"logits must be a 2-D (rows, vocab) array, got {array.ndim} dimension(s)")
    name = array.dtype.name
    with np.errstate(invalid="ignore"):  # signalling NaNs stay NaN (quieted)
        if name in ("float32", "float16"):
            return array.astype(np.float64)
        if name == "bfloat16":
            import ml_dtypes  # noqa: F401  (the dtype's home; numpy converts through it)

            return array.astype(np.float32).astype(np.float64)
    raise TypeError(f"logits dtype must be float32, float16 or bfloat16, not {array.dtype}")


def _as_masks(masks, rows: int, vocab: int) -> np.ndarray:
    if masks is None:
        return np.full((rows, 2), NO_TOKEN, dtype=np.int64)
    if isinstance(masks, np.ndarray):
        array = masks.astype(np.int64).reshape(-1, 2) if masks.ndim == 1 else masks.astype(np.int64)
    else:
        pairs = [tuple(int(v) for v in pair) for pair in masks]
        if any(len(pair) != 2 for pair in pairs):
            raise ValueError("every mask must be a pair of ids")
        array = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    if array.shape != (rows, 2):
        raise ValueError(f"masks must be ({rows}, 2), got {array.shape}")
    bad = (array != NO_TOKEN) & ((array < 0) | (array >= vocab))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"mask id {array[r, c]} of row {r} is neither NO_TOKEN nor below vocab {vocab}")
    return array


def reference_allowed(masks, bitmask, rows: int, vocab: int) -> np.ndarray:
    """(rows, vocab) bool: the ids neither mask names and the bitmask (int32 words, bit v % 32 of
    word v // 32 set = allowed; None: all) allows."""
    mask_ids = _as_masks(masks, rows, vocab)
    ids = np.arange(vocab, dtype=np.int64)
    allowed = (ids[None, :] != mask_ids[:, 0:1]) & (ids[None, :] != mask_ids[:, 1:2])
    if bitmask is not None:
        words = np.asarray(bitmask).view(np.uint32).reshape(rows, -1)
        allowed &= ((words[:, ids // 32] >> (ids % 32).astype(np.uint32)) & 1).astype(bool)
    return allowed


def reference_survivors(row, allowed, temperature: float, top_k: int = 0, top_p: float = 1.0,
                        min_p: float = 0.0):
    """The survivors of one row's sampling filters and their renormalised probabilities, in
    float64 from the definitions: candidates are allowed ids with a finite logit; keep the top_k
    greatest (ties to the lower id), then the shortest most-probable prefix whose probability
    under softmax(logit / T) reaches top_p, then those with probability >= min_p * the largest.
    Returns (ids ascending, probabilities)."""
    values = _as_float64(np.asarray(row)[None, :])[0]
    cand = np.flatnonzero(np.asarray(allowed) & np.isfinite(values))
    if cand.size == 0:
        return cand, np.zeros(0)
    order = cand[np.lexsort((cand, -values[cand]))]  # greatest first, ties to the lower id
    if top_k and order.size > top_k:
        order = order[:top_k]
    z = values[order] / temperature
    w = np.exp(z - z.max())
    if top_p < 1.0:
        cum = np.cumsum(w / w.sum())
        order, w = order[: int(np.searchsorted(cum, top_p)) + 1], w[: int(np.searchsorted(cum, top_p)) + 1]
    if min_p > 0.0:
        keep = w >= min_p * w.max()
        order, w = order[keep], w[keep]
    sort = np.argsort(order)
    return order[sort], (w / w.sum())[sort]


def reference_argmax(logits, masks=None, bitmask=None) -> np.ndarray:
    """The masked argmax of each row, stated in plain numpy (docs/encodings.md).

    Parameters
    ----------
    logits : array_like, shape (rows, vocab)
        float32, float16 or bfloat16 (``ml_dtypes.bfloat16``).
    masks : None, array_like of shape (rows, 2), or sequence of (int, int), optional
        Two banned ids per row, ``NO_TOKEN`` where unused; None bans nothing.
    bitmask : None or array_like of shape (rows, ceil(vocab / 32)), optional
        int32 words; bit ``v % 32`` of word ``v // 32`` set allows id ``v``; None allows all.

    Returns
    -------
    numpy.ndarray
        ``rows`` uint32 ids.

    Raises
    ------
    ValueError
        A mask id that is neither ``NO_TOKEN`` nor below ``vocab`` (as the kernels do), or masks
        that do not have one pair per row.
    TypeError
        Logits of another dtype.

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> mf.reference_argmax(np.array([[0.0, np.nan, 2.0, 2.0]], np.float32), [(3, mf.NO_TOKEN)]).tolist()
    [2]
    """
    values = _as_float64(logits)
    rows, vocab = values.shape
    # candidate[r, v]: v is neither of row r's mask ids, and the bitmask allows it.
    candidate = reference_allowed(masks, bitmask, rows, vocab)
    # A number (not NaN) among the candidates; -inf counts as a number.
    numeric = candidate & ~np.isnan(values)

    result = np.full(rows, NO_TOKEN, dtype=np.uint32)
    for r in range(rows):
        if numeric[r].any():
            best = values[r][numeric[r]].max()  # -0.0 and +0.0 compare equal here
            winners = np.flatnonzero(numeric[r] & (values[r] == best))
            result[r] = winners[0]  # the lowest id holding the greatest value
        elif candidate[r].any():
            result[r] = np.flatnonzero(candidate[r])[0]  # all NaN: the lowest candidate
        # else: no candidate at all, NO_TOKEN
    return result


def reference_logprobs(logits, ids) -> np.ndarray:
    """Each row's ``log_softmax`` at its chosen id, in float64 (docs/kernels.md, "Logprobs").

    Over all ids of the row, at temperature 1 and before any mask: NaN logits count as ``-inf``.
    A ``-inf`` or NaN choice gives ``-inf``; a ``NO_TOKEN`` row, a row with no finite logit and a
    row with a ``+inf`` logit give NaN.

    Parameters
    ----------
    logits : array_like, shape (rows, vocab)
        float32, float16 or bfloat16.
    ids : array_like of int, shape (rows,)
        The chosen id of each row, or ``NO_TOKEN``.

    Returns
    -------
    numpy.ndarray
        ``rows`` float64 logprobs.

    Examples
    --------
    >>> import numpy as np, metrale_feed.testing.oracle as o
    >>> round(float(o.reference_logprobs(np.array([[0.0, 0.0]], np.float32), [1])[0]), 6)
    -0.693147
    """
    values = _as_float64(logits)
    ids = np.asarray(ids, dtype=np.int64)
    out = np.full(values.shape[0], np.nan)
    for r, row in enumerate(values):
        v = np.where(np.isnan(row), -np.inf, row)
        if ids[r] == NO_TOKEN or np.isposinf(v).any() or not np.isfinite(v).any():
            continue
        chosen = row[ids[r]]
        if not np.isfinite(chosen):
            out[r] = -np.inf
            continue
        top = v.max()
        out[r] = chosen - (top + np.log(np.exp(v[np.isfinite(v)] - top).sum()))
    return out
