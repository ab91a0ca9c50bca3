"""Top logprobs over a split vocabulary (docs/tensor-parallel.md, "Top logprobs").

Each rank lists its slice's ``n`` greatest ids by the argmax's packed word (``_core.top_logprobs``
on the slice, integer comparisons only) and the slice's ``(m, s)`` (the partial argmax's logprob
fields, the same values the sharded chosen-token logprob combines); one all-gather of a block of
``8 * (n + 1)`` bytes a row; then every rank merges the ``world`` lists by the same packed words
(so the same ids in the same order, ties by the smaller global id, NaN below ``-inf``) and writes
each logprob as ``logit - (M + log S)`` with ``(M, S)`` combined as ``mf_combine_stats`` does.
The pack and the merge run on the stream's worker (host and simt backends): host functions in
stream order, never a wait in the calling thread.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

from .. import _core

# The block's header: the fingerprint the merge checks on every slice before it reads a row.
HEADER = np.dtype([("tag", "<u4"), ("rows", "<u4"), ("call", "<u8"), ("n", "<u4"),
                   ("vocab", "<u4"), ("start", "<u4"), ("stop", "<u4")])
TAG = 0x544C5052  # not a partial block's tag: an argmax block never passes for this one
RECORD = np.dtype([("id", "<u4"), ("bits", "<u4")])  # mf_top_logprob's layout, a logit for a logprob
OUT = np.dtype([("id", "<u4"), ("logprob", "<f4")])
_NEG_INF = np.float32(-np.inf)


def block_bytes(max_rows: int, n: int) -> int:
    """One slice's block: the header, ``(m, s)`` as two float32 a row, then ``n`` records a row.
    Sized by ``max_rows`` and ``n`` (never the call's rows): ranks making the same calls send the
    same sizes."""
    return HEADER.itemsize + max_rows * 8 * (n + 1)


def _view(ptr: int, nbytes: int) -> Any:
    """A uint8 array over host-backend device memory (plain host memory there)."""
    if not nbytes:
        return np.zeros(0, np.uint8)
    return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)), np.uint8)


def keys_f32(bits: np.ndarray) -> np.ndarray:
    """argmax_rule.h's ordered key of float32 bits: NaN 0, -0.0 == +0.0, then IEEE order."""
    bits = bits.astype(np.uint32)
    mag = bits & np.uint32(0x7FFFFFFF)
    neg = (bits & np.uint32(0x80000000)) != 0
    key = np.where(neg, np.uint32(0x80000000) - mag, np.uint32(0x80000000) + mag).astype(np.uint32)
    key[mag == 0] = 0x80000000
    key[mag > 0x7F800000] = 0
    return key


def logit_bits(ptr: int, dtype: str, stride: int, rows: int, ids: np.ndarray) -> np.ndarray:
    """The float32 bits of ``ids`` (slice columns; ``NO_TOKEN`` gives 0) of ``rows`` rows of
    ``stride`` elements at ``ptr``: float16 widened exactly, bfloat16 as its high half."""
    item = 4 if dtype == "float32" else 2
    valid = ids != _core.NO_TOKEN
    where = (np.arange(rows, dtype=np.int64)[:, None] * stride + np.where(valid, ids, 0)).astype(np.int64)
    span = int(where.max()) + 1 if where.size else 0
    raw = _view(ptr, span * item)
    if dtype == "float32":
        bits = raw.view("<u4")[where]
    elif dtype == "float16":
        bits = raw.view("<f2")[where].astype(np.float32).view("<u4")
    else:
        bits = raw.view("<u2")[where].astype(np.uint32) << np.uint32(16)
    return np.where(valid, bits, 0).astype(np.uint32)


def pack(block: Any, local: Any, partial: Any, logits_ptr: int, dtype: str, stride: int,
         rows: int, n: int, call: int, vocab: int, start: int, stop: int, max_rows: int,
         logits: Any = None) -> None:
    """On the worker, after the slice's top and partial argmax: this slice's block (``logits``
    is kept alive by being an argument; its columns are read at ``logits_ptr``)."""
    out = _view(block.ptr, block.nbytes)
    head = out[: HEADER.itemsize].view(HEADER)
    head[0] = (TAG, rows, call, n, vocab, start, stop)
    stats = out[HEADER.itemsize: HEADER.itemsize + max_rows * 8].view("<f4").reshape(max_rows, 2)
    recs = out[HEADER.itemsize + max_rows * 8:].view(RECORD).reshape(max_rows, n)
    fields = _core.PARTIAL_RECORD_FIELDS
    part = _view(partial.ptr, partial.nbytes)[_core.PARTIAL_HEADER_BYTES:]
    part = part[: rows * _core.PARTIAL_RECORD_BYTES].reshape(rows, _core.PARTIAL_RECORD_BYTES)
    stats[:rows, 0] = part[:, fields["max"][0]: fields["max"][0] + 4].copy().view("<f4")[:, 0]
    stats[:rows, 1] = part[:, fields["sum"][0]: fields["sum"][0] + 4].copy().view("<f4")[:, 0]
    if stop == start:
        recs[:rows] = (_core.NO_TOKEN, 0)
        return
    top = _view(local.ptr, rows * n * 8).view(OUT).reshape(rows, n)
    ids = top["id"].copy()
    bits = logit_bits(logits_ptr, dtype, stride, rows, ids)
    recs["id"][:rows] = np.where(ids != _core.NO_TOKEN, ids + np.uint32(start), _core.NO_TOKEN)
    recs["bits"][:rows] = bits


def fault_of(heads: np.ndarray, rows: int, n: int, call: int, vocab: int) -> str | None:
    """Why the gathered headers disagree with this rank's call (None: they agree)."""
    at = 0
    for w, h in enumerate(heads):
        what = ("another operation" if h["tag"] != TAG else "another row count" if h["rows"] != rows
                else "another n" if h["n"] != n else "another call counter" if h["call"] != call
                else "another vocabulary" if h["vocab"] != vocab
                else "slices that do not tile the vocabulary" if h["start"] != at or h["stop"] < at
                or (w == len(heads) - 1 and h["stop"] != vocab) else None)
        if what:
            return f"slice {w} has {what}"
        at = int(h["stop"])
    return None


def combine_stats(m: np.ndarray, s: np.ndarray) -> tuple[float, float]:
    """logprob_rule.h's mf_combine_stats for one row: (M, S) from the slices' (m, s), in slice
    order, in float64 (the chosen-token combine's own sum, so the two logprobs agree)."""
    top = _NEG_INF
    for x in m:
        top = x if x > top else top
    total = 0.0
    if top > _NEG_INF and math.isfinite(top):
        for x, y in zip(m, s):
            if x > _NEG_INF:
                total += float(y) * math.exp(float(x) - float(top))
    return float(top), total


def merge(gathered: Any, out_ptr: int, world: int, max_rows: int, rows: int, n: int, call: int,
          vocab: int) -> str | None:
    """On the worker, after the all-gather: every rank's same ``rows * n`` records into ``out``;
    a fault (every record ``(NO_TOKEN, NaN)``) returns its reason."""
    size = block_bytes(max_rows, n)
    raw = _view(gathered.ptr, size * world).reshape(world, size)
    out = _view(out_ptr, rows * n * 8).view(OUT).reshape(rows, n)
    heads = raw[:, : HEADER.itemsize].copy().view(HEADER)[:, 0]
    fault = fault_of(heads, rows, n, call, vocab)
    if fault is not None:
        out["id"], out["logprob"] = _core.NO_TOKEN, np.nan
        return fault
    stats = raw[:, HEADER.itemsize: HEADER.itemsize + max_rows * 8].copy().view("<f4")
    stats = stats.reshape(world, max_rows, 2)[:, :rows]
    lists = raw[:, HEADER.itemsize + max_rows * 8:].copy().view(RECORD).reshape(world, max_rows, n)
    recs = lists[:, :rows].transpose(1, 0, 2).reshape(rows, world * n)  # a row's world lists
    # The packed word of the argmax rule, (key << 32) | ~id, 0 for no id: unique per id, so the
    # n greatest are one answer on every rank, whatever the split.
    live = recs["id"] != _core.NO_TOKEN
    words = (keys_f32(recs["bits"]).astype(np.uint64) << np.uint64(32)) | \
        (~recs["id"]).astype(np.uint64)
    words[~live] = 0
    order = np.argsort(words, axis=1)[:, ::-1][:, :n]
    best = np.take_along_axis(words, order, 1)
    ids = np.where(best != 0, (~best & np.uint64(0xFFFFFFFF)).astype(np.uint32),
                   np.uint32(_core.NO_TOKEN)).astype(np.uint32)
    sorted_bits = np.take_along_axis(recs["bits"], order, 1)
    logit = sorted_bits.view("<f4").astype(np.float64)
    lp = np.full((rows, n), np.nan, np.float32)
    for r in range(rows):
        m, s = combine_stats(stats[:, r, 0], stats[:, r, 1])
        # mf_logprob_finish: NaN without a finite M, -inf for a logit that is not finite.
        if not (m > -math.inf and math.isfinite(m)):
            continue
        base = m + math.log(s)
        fin = np.isfinite(logit[r])
        lp[r] = np.where(fin, (logit[r] - base).astype(np.float32), np.float32(-np.inf))
    lp[ids == _core.NO_TOKEN] = np.nan
    out["id"], out["logprob"] = ids, lp
    return None
