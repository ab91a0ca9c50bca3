"""Sampling filters over a vocabulary split across ranks: the rounds of one sharded call
(docs/kernels.md, "Filters need global thresholds"; docs/tensor-parallel.md).

top_k and top_p are thresholds on the packed word (logit key, ~id) of the whole row. min_p and
the masses need the row's zmax: the first exchange carries each slice's greatest finite
candidate. The last exchange is the race winners over the survivors, which the ordinary combine
joins into the feed cells. Between them, per row:

- ``top_k <= SELECT_CANDS_MAX`` (with or without top_p and min_p): one exchange of candidate
  lists. Each slice lists its greatest ``min(top_k, count)`` candidates; the row's global top_k
  are among them, so every rank's race stage merges the gathered lists and applies top_k, then
  top_p, over them itself (``mf_cands_threshold``, sample_rule.h): 3 exchanges in all.
- a larger top_k, or top_p alone: a radix select, which splits across slices as a maximum does:
  per round each slice histograms the next 8-bit digit of the logit key among its candidates
  still in range (counts for top_k, integer masses for top_p), every rank sums the all-gathered
  histograms and picks the same digit as ``mf_select_digit`` would on the whole row. Four rounds
  fix the boundary key K and the weight above it; the ids at K are cut without a round, since
  slices are in id order. top_p alone: 6 exchanges.
- min_p alone: nothing between the first exchange and the race (2 exchanges).

The decisions between the exchanges are C (select_rule.h): ``ops.select_decide`` queues them
on the stream, a kernel on cuda and simt and a loop on the host backend's worker, reading the
gathered blocks and the params in device memory and writing the stages' state. No Python runs
between the rounds; this module only sizes the buffers and queues the stages, exchanges and
decisions.

Without fixed rounds, every exchange has a size fixed by the shard (``max_rows``) and the number
of rounds follows from the params, which every rank must share: the first exchange carries a
digest of them in its call word, so ranks that disagree all see it there (the first decision's
header check), and all skip the rest of the call (its rows get ``NO_TOKEN`` and its event a
``FeedError``) instead of issuing mismatched collectives (host backend). With fixed rounds
(``FilterRounds``, rounds.py) every exchange runs, each sized by the shard, and the first
decision's fault (each TOP record carries its row's params digest) reaches the combine instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from typing import Any

import numpy as np

from .. import _core
from ..errors import FeedError
from ..sampling import SAMPLING_PARAMS_DTYPE
from . import ops
from .rounds import CANDS_MAX, ROUNDS, FilterRounds

_HEADER = _core.PARTIAL_HEADER_BYTES
# Ids a row's list holds (the candidates left once the key's top 8 bits are fixed): 8 KiB a row of
# scratch; a row whose ids do not fit rescans its slice in the later rounds.
LIST_CAP = 2048


def hist_block_bytes(rows: int) -> int:
    """Bytes of one round's block: the header, then BINS uint64 weights a row."""
    return _HEADER + rows * _core.SELECT_HIST_BYTES


def cands_block_bytes(rows: int, cap: int) -> int:
    """Bytes of one candidates block: the header, then ``cap`` entries a row."""
    return _HEADER + rows * cap * _core.PARTIAL_CAND_BYTES


def call_bytes(block: int, rows: int, cap: int, selects: int) -> int:
    """Bytes one sampled call sends from a rank: TOP and RACE blocks of ``block`` bytes (the
    shard's, set by max_rows), a candidates block of ``cap`` entries a row (none when 0) and
    ``selects`` radix selects of ``ROUNDS`` histogram rounds, over ``rows`` rows."""
    return (2 * block + (cands_block_bytes(rows, cap) if cap else 0)
            + selects * ROUNDS * hist_block_bytes(rows))


def plan_of(params: np.ndarray) -> np.ndarray:
    """Per row, the ``_core._PLAN_*`` bits of ``mf_plan_sampling``'s reading of its record (the C
    rule itself, so the rounds plan what the kernels do)."""
    records = np.ascontiguousarray(params)
    return np.frombuffer(ops.sampling_plan(records), np.uint8)


def filters_of(params: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: sampled with top_k, with top_p, with min_p (``mf_plan_sampling``'s reading)."""
    plan = plan_of(params)
    return ((plan & ops.PLAN_TOP_K) != 0, (plan & ops.PLAN_TOP_P) != 0,
            (plan & ops.PLAN_MIN_P) != 0)


def call_word(counter: int, params: np.ndarray | None, tag: bytes = b"") -> int:
    """The call counter with a digest of the params above it: what the first exchange's header
    carries, so that ranks with other params (so other rounds) see the difference there. None:
    device params, which the host cannot read (one digest for all of them: a rank with host params
    still differs). ``tag``: what else the ranks must agree on (a verify's k)."""
    data = (b"device params" if params is None else params.tobytes()) + tag
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")
    return (counter & 0xFFFFFFFF) | ((digest | 0x80000000) << 32)


class FilteredCall:
    """One sharded ``sample_to_feed`` with filters: its buffers, and the stages, exchanges and
    decisions it queues. ``rounds`` (a ``FilterRounds``): the shard's fixed rounds, buffers sized
    by ``max_rows`` and reused from call to call (``start``); None: rounds and buffers follow
    this call's params and rows. ``device``: ``params`` are device memory (fixed rounds only).
    ``verify``: (verify_args.Sampled, k) of a sampled verify over ``rows`` logit rows, whose copy
    of their params is written on the device from its rows' params and advance."""

    def __init__(self, shard: Any, params: Any, rows: int, call: int,
                 rounds: FilterRounds | None = None, device: bool = False, verify: Any = None) -> None:
        self.shard = shard
        self.fixed = rounds is not None
        if rounds is not None:
            capacity, self.cap, self.selects = shard.max_rows, rounds.top_k, list(rounds.selects)
        else:
            capacity = rows
            head = params[:rows]
            top_k, top_p, _ = filters_of(head)
            k = head["top_k"]
            # Which selects run is the same on every rank whose params agree (the digest): the
            # candidate lists serve top_k <= CANDS_MAX (and top_p with it); radix selects the rest.
            cands_rows = top_k & (k <= CANDS_MAX)
            self.cap = int(k[cands_rows].max()) if cands_rows.any() else 0
            radix = {"k": top_k & ~cands_rows, "p": top_p & ~cands_rows}
            self.selects = [s for s in _core.SELECTS if radix[s].any()]
        self.decided: Any = None
        self.block = shard._block
        # Blocks after the first are sized by the capacity and the rounds: with fixed rounds the
        # shard's; else this call's, which the first exchange checks across the group (a
        # disagreement skips the rest on every rank alike, host backend).
        self.hblock = hist_block_bytes(capacity) if self.selects else 0
        self.cblock = cands_block_bytes(capacity, self.cap) if self.cap else 0
        world = shard.world
        self.buffers = []
        try:
            for size in (capacity * _core.SELECT_ROW_BYTES, self.block, self.block * world, self.hblock,
                         self.hblock * world, self.cblock, self.cblock * world, capacity * LIST_CAP * 4,
                         capacity * _core.SELECT_PLAN_BYTES, capacity * SAMPLING_PARAMS_DTYPE.itemsize,
                         capacity * SAMPLING_PARAMS_DTYPE.itemsize, 4):
                self.buffers.append(_core.DeviceBuffer(max(size, 8)))
            self.buffers.append(_core.PinnedBuffer(4))
        except BaseException:
            self.close()
            raise
        (self.state_buf, self.top, self.gathered, self.hist, self.hgathered, self.cands,
         self.cgathered, self.id_list, self.plan, self.params_dev, self.verify_rows, self.decided,
         self.fault_word) = self.buffers
        self.start(params, rows, call, device, verify)

    def start(self, params: Any, rows: int, call: int, device: bool = False, verify: Any = None) -> None:
        """Take the next call: its params (copied into ``params_dev`` in stream order: device
        memory, kept until the call completes, or host records, copied here first so that the
        caller may refill its array at once; a verify's are written from its rows'), rows and call
        word."""
        self.params = params if device else np.array(params[:rows], copy=True)
        self.device = device
        self.verify = verify
        self.rows, self.call = rows, call
        self._why: str | None = None  # a fault seen here (a failed exchange, a refused decision)
        self._reported = False  # whether an event has carried it yet

    def __iter__(self) -> Any:
        return iter(self.buffers)

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()

    @property
    def fault(self) -> str | None:
        """Why the call's later exchanges are skipped (None: they run): a failed exchange, or the
        first decision's refusal, read from its fault word on the stream's worker (final by the
        time an exchange after it runs; host and simt backends). Every rank sees a refusal alike."""
        if self._why is None and self.decided is not None:
            word = ctypes.c_uint32.from_address(self.decided.ptr).value
            if word:
                try:
                    ops.check_partials_fault(struct.pack("<I", word))
                except FeedError as exc:
                    self._why = f"sharded sampling with filters {exc}"
                if self.shard._fault is None:
                    self.shard._fault = self._why
        return self._why

    @fault.setter
    def fault(self, why: str) -> None:
        self._why = why
        self._reported = True  # set by the exchange that failed, which raises it itself

    def report(self) -> None:
        """Raise the fault once, for the event of the host function that first sees it."""
        if self.fault is not None and not self._reported:
            self._reported = True
            raise FeedError(self._why)

    def queue(self, stream: Any, launch: Any) -> None:
        """Queue every stage, exchange and decision on ``stream``; ``launch(stage, partials)``
        queues one stage's kernel. The first launch checks every argument; a later failure leaves
        the peers ahead of this rank, so the caller treats it as a fault of the shard."""
        shard = self.shard
        # Fixed rounds run every exchange whatever the decisions found (their fault reaches the
        # combine on the device); the rounds of one call's params may skip the rest (host backend).
        skip = None if self.fixed else self
        # The call's copy of the params: the decisions read it, and with fixed rounds the stages
        # and the combine too, host params as device ones (no check on one rank alone may refuse
        # them); without, the stages take the host records.
        if self.verify is not None:  # a verify's logit rows: its rows' params, advanced, at + j
            sampled, k = self.verify
            rows = self.rows // (k + 1)
            src = sampled.params
            if not sampled.device:  # the host copy verify_args took, kept until the call completes
                _core.copy_h2d_async(self.verify_rows, src, stream)
                src = self.verify_rows
            ops.verify_logit_params(src, sampled.advance, self.params_dev, stream, rows=rows, k=k)
        elif self.device:
            _core.copy_d2d_async(self.params_dev, self.params, self.rows * SAMPLING_PARAMS_DTYPE.itemsize, stream)
        else:
            _core.copy_h2d_async(self.params_dev, self.params, stream)
        launch("top", self.top)
        shard._exchange(stream, self.top, self.gathered, skip)
        ops.select_decide(*self.world_args(self.gathered, self.block), stream, step="top",
                             vocab=shard.vocab, call=self.call,
                             next=self.selects[0] if self.selects else None,
                             rounds=(self.cap, "p" in self.selects) if self.fixed else None)
        if self.cap:
            launch("cands", self.cands)
            shard._exchange(stream, self.cands, self.cgathered, skip)
        for i, sel in enumerate(self.selects):
            for j in range(ROUNDS):
                launch("hist", self.hist)
                shard._exchange(stream, self.hist, self.hgathered, skip)
                after = self.selects[i + 1] if j == ROUNDS - 1 and i + 1 < len(self.selects) else None
                ops.select_decide(*self.world_args(self.hgathered, self.hblock), stream, step="round",
                                     sel=sel, round=j, next=after)
        launch("race", self.top)
        shard._exchange(stream, self.top, self.gathered, skip)

    def world_args(self, gathered: Any, block: int) -> tuple[Any, ...]:
        """A decision's positional arguments over ``gathered`` blocks of ``block`` bytes."""
        shard = self.shard
        return (gathered, block, shard.world, shard.rank, self.rows, self.params_dev, self.state_buf,
                self.plan, self.decided)
