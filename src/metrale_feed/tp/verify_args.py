"""The arguments of a sharded ``verify_to_feed``, checked before anything is queued
(docs/tensor-parallel.md, "Verify"). Greedy rows take the greedy call's one exchange: their rule
at a position is the argmax, which it combines exactly. A call with sampled rows (host params
that sample one, or device params, which the host cannot read) takes the rounds of a sampled call
over its ``rows * (k + 1)`` logit rows, with the drafts in their first and last stages
(verify_rule.h); the logit rows' params are written on the device from the rows' and the device
``advance`` (``mf_verify_logit_params``). Still refused here: ``draft_probs``, and logprobs with
sampled rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _checks, _core
from ..errors import FeedError
from ..sampling import SAMPLING_PARAMS_DTYPE
from . import ops
from .call_args import _device_params, _precheck_host

# The high word of a verify call's header word: this bit and k. A rank that runs the plain argmax
# over the same logit rows, or another k, then carries another word, which the combine refuses on
# every rank (select_rounds.call_word sets the bit above it).
_VERIFY_BIT = 0x40000000


def call_word(counter: int, k: int) -> int:
    """The word every block of a verify call carries: the call counter, and k above it."""
    return (counter & 0xFFFFFFFF) | ((_VERIFY_BIT | k) << 32)


@dataclass(frozen=True)
class Sampled:
    """What a verify's sampled call reads: the rows' params (a host copy of ``rows`` records, or
    device memory) and the device ``advance`` (None: none), from which the call's own copy of the
    logit rows' params is written on the device; ``logit_rows``: those params expanded on the host
    (host params only), which the adaptive rounds follow and digest."""
    params: Any
    device: bool
    advance: Any
    logit_rows: np.ndarray | None


@dataclass(frozen=True)
class VerifyCall:
    k: int
    rows: int
    logit_rows: int
    host_drafts: np.ndarray | None  # None: device drafts, read when the combine runs
    sampled: Sampled | None  # a call with sampled rows (or device params); None: greedy


def _index(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return int(value)


def _params(params: Any, draft_probs: Any, advance: Any, rows: int) -> bool:
    """What a split verify takes at all: one-hot drafts, params (host or device; True: device)
    and a device ``advance`` with params."""

    if draft_probs is not None:
        raise FeedError("a sharded verify_to_feed takes one-hot drafts (draft_probs is not built "
                        "over a split vocabulary yet)")
    if advance is not None:  # checked whether or not a row samples: the call takes it or refuses it
        if params is None:
            raise ValueError("advance needs params (it moves the sampled rows' positions)")
        _device_words(advance, rows, "advance")
    if params is None:
        return False
    if _device_params(params):
        _device_words(params, rows * SAMPLING_PARAMS_DTYPE.itemsize // 4, "params", ids=False)
        return True
    # The values too: a sampled call's stages read the call's device copy, which no check reads.
    _checks.records(params, rows)
    return False


def _device_words(buf: Any, words: int, what: str, ids: bool = True) -> None:
    """Device memory of at least ``words`` 4-byte words (uint32 or int32 elements when ``ids``),
    as the unsharded call takes it, checked where its size or type is known here: a DeviceBuffer,
    an int pointer into this package's allocations, or a tensor."""

    if not _device_params(buf):
        raise TypeError(f"{what} must be device memory (read when the call runs), not "
                        f"{type(buf).__name__}")
    if type(buf) is _core.DeviceBuffer:
        have = int(buf.nbytes)
    elif isinstance(buf, int):
        left = ops.device_bytes_left(buf)
        # None: foreign memory on cuda, trusted as the C layer does; 0, a pointer the layer does
        # not know on host and simt, is the C layer's to refuse (before any exchange).
        have = left if left else None
    else:
        dtype = str(getattr(buf, "dtype", "")).rsplit(".", 1)[-1]
        if ids and dtype not in ("uint32", "int32"):
            raise TypeError(f"{what} must hold uint32 ids, not {dtype or type(buf).__name__}")
        size = getattr(buf, "numel", None)
        count = size() if callable(size) else getattr(buf, "size", None)
        itemsize = getattr(getattr(buf, "dtype", None), "itemsize", None) or 4
        have = None if count is None else int(count) * int(itemsize)
    if have is not None and have < words * 4:
        raise ValueError(f"{what} holds {have} bytes; {words * 4} are needed")


def _sampled(params: Any, device: bool, fixed: bool, rows: int, k: int, logprobs: Any,
             advance: Any) -> Sampled | None:
    """The sampled call of a verify whose rows include a sampled one (device params may: the host
    cannot tell; with fixed rounds any params take them, so no rank's values can change the
    collectives), None for greedy rows; refuses what a split verify with one does not take."""
    if params is None:
        return None
    if not device and not fixed:
        plan = np.frombuffer(ops.sampling_plan(np.ascontiguousarray(params[:rows])), np.uint8)
        if not np.any(plan & ops.PLAN_SAMPLED):  # the kernels' own reading of the records
            return None
    if logprobs is not None:
        raise FeedError("a sharded verify_to_feed with sampled rows (or device params, or params with "
                        "fixed rounds) has no logprobs yet (its records carry the survivors' masses)")
    if device:
        return Sampled(params, True, advance, None)
    head = np.array(params[:rows], copy=True)  # the caller may refill its array at once
    return Sampled(head, False, advance, logit_row_params(head, rows, k))


def logit_row_params(params: np.ndarray, rows: int, k: int) -> np.ndarray:
    """The params of the ``rows * (k + 1)`` logit rows: row r's at position + j for its position j
    (mod 2**32, as the counter is), what the adaptive rounds of a split verify follow (the
    device writes the call's own copy, with the advance: mf_verify_logit_params)."""
    out = np.repeat(params[:rows], k + 1)
    out["position"] += np.tile(np.arange(k + 1, dtype=np.uint32), rows)
    return out


def _host_drafts(drafts: Any, vocab: int) -> np.ndarray | None:
    """Host drafts as uint32, checked as the unsharded call checks them; None for device ones."""

    if _device_params(drafts):  # the rule sample_to_feed's params follow: read when it runs
        return None
    arr = np.asarray(drafts)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"drafts must hold integer ids, not {arr.dtype}")
    arr = arr.ravel()
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError("drafts must be uint32 ids")
    arr = np.ascontiguousarray(arr, dtype=np.uint32)
    bad = np.flatnonzero((arr >= vocab) & (arr != _core.NO_TOKEN))
    if bad.size:
        raise ValueError(f"draft {int(bad[0])} is id {int(arr[bad[0]])}, at or beyond vocab {vocab}")
    return arr


def check(shard: Any, logits: Any, drafts: Any, cells: Any, dst: Any, k: Any, params: Any,
          draft_probs: Any, logprobs: Any, logprobs_dst: Any, rows: Any, advance: Any = None) -> VerifyCall:
    """Every check of a sharded verify, before anything is queued."""

    k = _index(k, "k")
    if not 1 <= k <= _core.MAX_DRAFTS:
        raise ValueError(f"k must be in [1, {_core.MAX_DRAFTS}], not {k}")
    host = _host_drafts(drafts, shard.vocab)
    if rows is None:
        if hasattr(logits, "shape") and len(logits.shape) == 2:
            if logits.shape[0] % (k + 1):
                raise ValueError(f"the logits tensor has {logits.shape[0]} rows, not a multiple of "
                                 f"k + 1 = {k + 1}")
            rows = int(logits.shape[0]) // (k + 1)
        elif host is not None:
            if host.size % k:
                raise ValueError(f"drafts hold {host.size} ids, not a multiple of k = {k}")
            rows = host.size // k
        else:
            raise ValueError("rows is required with device-resident drafts and logits that are "
                             "not a tensor")
    rows = _index(rows, "rows")
    logit_rows = rows * (k + 1)
    if not 1 <= rows or logit_rows > shard.max_rows:
        raise ValueError(f"rows * (k + 1) = {logit_rows} logit rows; a sharded call takes 1 to "
                         f"max_rows={shard.max_rows}")
    if host is not None:
        if host.size < rows * k:
            raise ValueError(f"drafts hold {host.size} ids; {rows} rows need {rows * k}")
        host = host[: rows * k]
    _precheck_host(dst, rows * (k + 2), "dst", "I")
    _precheck_host(logprobs_dst, logit_rows, "logprobs_dst", "f")
    for buf, what, words in ((cells, "cells", rows * (k + 2)), (logprobs, "logprobs", logit_rows)):
        if type(buf) is _core.DeviceBuffer and buf.nbytes < words * 4:
            raise ValueError(f"{what} holds {buf.nbytes} bytes; {words * 4} are needed")
    if logprobs_dst is not None and logprobs is None:
        raise ValueError("logprobs_dst needs logprobs (the device buffer it is copied from)")
    device = _params(params, draft_probs, advance, rows)
    return VerifyCall(k, rows, logit_rows, host, _sampled(params, device, shard.filters is not None, rows, k,
                                                          logprobs, advance))
