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
  histograms (integer sums, so the order does not matter) and picks the same digit as
  ``mf_select_digit`` would on the whole row. Four rounds fix the boundary key K and the weight
  above it; the ids at K are cut without a round, since slices are in id order: every rank knows
  each slice's weight at K from the last round and takes its own candidates at K while the weight
  before them is short of the target. top_p alone: 6 exchanges.
- min_p alone: nothing between the first exchange and the race (2 exchanges).

Every exchange has a size fixed by the shard (``max_rows``), and the number of rounds follows
from the params, which every rank must share: the first exchange carries a digest of them in its
call word, so ranks that disagree all see it there and all skip the rest of the call (its rows get
``NO_TOKEN`` and its event a ``FeedError``) instead of issuing mismatched collectives. The
decisions between rounds run on the stream's worker (host functions), in stream order; the
per-slice work is the host kernels' (``_core._select_partial``).
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import numpy as np

from .. import _core
from ..errors import FeedError

DIGIT_BITS = _core.SELECT_DIGIT_BITS
BINS = _core.SELECT_BINS
ROUNDS = 32 // DIGIT_BITS  # rounds of one select: the 32-bit logit key, a digit at a time
CANDS_MAX = _core.SELECT_CANDS_MAX  # the largest top_k that the candidate lists serve
_HEADER = _core.PARTIAL_HEADER_BYTES
_NO_TOKEN = 0xFFFFFFFF
_F = _core.SELECT_ROW_FLAGS
_STATE = np.dtype([("floor", "<u8"), ("cut_need", "<u8"), ("top_bits", "<u4"), ("cut_key", "<u4"),
                   ("prefix", "<u4"), ("shift", "<u4"), ("flags", "<u4"), ("list_len", "<u4")])
# Ids a row's list holds (the candidates left once the key's top 8 bits are fixed): 8 KiB a row of
# scratch; a row whose ids do not fit rescans its slice in the later rounds.
LIST_CAP = 2048
assert _STATE.itemsize == _core.SELECT_ROW_BYTES

def _layout_dtype(fields: dict[str, tuple[int, str]], size: int) -> np.dtype:
    """A numpy view of a C struct from its offsets as the extension exports them."""
    names = list(fields)
    return np.dtype({"names": names, "formats": [fields[n][1] for n in names],
                     "offsets": [fields[n][0] for n in names], "itemsize": size})


_HEADER_DTYPE = _layout_dtype(_core.PARTIAL_HEADER_FIELDS, _HEADER)
_RECORD_DTYPE = _layout_dtype(_core.PARTIAL_RECORD_FIELDS, _core.PARTIAL_RECORD_BYTES)


def hist_block_bytes(rows: int) -> int:
    """Bytes of one round's block: the header, then BINS uint64 weights a row."""
    return _HEADER + rows * _core.SELECT_HIST_BYTES


def cands_block_bytes(rows: int, cap: int) -> int:
    """Bytes of one candidates block: the header, then ``cap`` entries a row."""
    return _HEADER + rows * cap * _core.PARTIAL_CAND_BYTES


def filters_of(params: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: sampled with top_k, with top_p, with min_p (``mf_plan_sampling``'s reading)."""
    t = params["temperature"]
    sampled = (t > 0) & (t <= np.float32(3.4e38))
    return (sampled & (params["top_k"] != 0), sampled & (params["top_p"] > 0) & (params["top_p"] < 1),
            sampled & (params["min_p"] > 0) & (params["min_p"] < 1))


def call_word(counter: int, params: np.ndarray) -> int:
    """The call counter with a digest of the params above it: what the first exchange's header
    carries, so that ranks with other params (so other rounds) see the difference there."""
    digest = int.from_bytes(hashlib.blake2b(params.tobytes(), digest_size=4).digest(), "little")
    return (counter & 0xFFFFFFFF) | ((digest | 0x80000000) << 32)


def _view(buf: Any, dtype: Any, offset: int = 0, count: int = -1) -> np.ndarray:
    """A numpy view over host-backend device memory (plain host memory there)."""
    raw = (ctypes.c_uint8 * buf.nbytes).from_address(buf.ptr)
    return np.frombuffer(raw, dtype=dtype, count=count, offset=offset)


def _keys(bits: np.ndarray) -> np.ndarray:
    """``mf_key_f32`` of finite float32 bits (uint32 -> uint64, so 0 can mean no candidate)."""
    mag = (bits & 0x7FFFFFFF).astype(np.uint64)
    neg = (bits >> 31).astype(bool)
    return np.where(mag == 0, 0x80000000, np.where(neg, 0x80000000 - mag, 0x80000000 + mag)).astype(np.uint64)


def _top_p_target(total: int, top_p: np.float32) -> int:
    """``mf_top_p_target``: ceil(total * top_p) with top_p as a 32-bit binary fraction, at least 1."""
    frac = 1 << 32 if top_p >= 1 else int(float(top_p) * 4294967296.0)
    return max(1, -(-total * frac >> 32))


class FilteredCall:
    """One sharded ``sample_to_feed`` with filters: its buffers, the rounds it queues, and the
    decisions between them (run on the stream's worker)."""

    def __init__(self, shard: Any, params: np.ndarray, rows: int, call: int) -> None:
        self.shard, self.rows, self.call = shard, rows, call
        self.params = params[:rows].copy()  # the decisions read them on the worker
        top_k, top_p, _ = filters_of(self.params)
        k = self.params["top_k"]
        # Rows whose top_k the candidate lists serve (top_p with them too); the radix selects
        # take the rest. What runs is the same on every rank whose params agree (the digest).
        self.cands_rows = top_k & (k <= CANDS_MAX)
        self.cap = int(k[self.cands_rows].max()) if self.cands_rows.any() else 0
        self.radix = {"k": top_k & ~self.cands_rows, "p": top_p & ~self.cands_rows}
        self.selects = [s for s in ("k", "p") if self.radix[s].any()]
        self.fault: str | None = None
        self.block = shard._block
        # Blocks after the first are sized by `rows` and the params, which the first exchange
        # checks across the group (a disagreement skips the rest on every rank alike).
        self.hblock = hist_block_bytes(rows) if self.selects else 0
        self.cblock = cands_block_bytes(rows, self.cap) if self.cap else 0
        world = shard.world
        self.buffers = []
        try:
            for size in (rows * _STATE.itemsize, self.block, self.block * world, self.hblock,
                         self.hblock * world, self.cblock, self.cblock * world, rows * LIST_CAP * 4):
                self.buffers.append(_core.DeviceBuffer(max(size, 8)))
            self.buffers.append(_core.PinnedBuffer(4))
        except BaseException:
            self.close()
            raise
        (self.state_buf, self.top, self.gathered, self.hist, self.hgathered, self.cands,
         self.cgathered, self.id_list, self.fault_word) = self.buffers
        self.state = _view(self.state_buf, _STATE)

    def close(self) -> None:
        for buf in self.buffers:
            buf.close()

    def exchanges(self) -> int:
        return 2 + (1 if self.cap else 0) + ROUNDS * len(self.selects)

    def bytes_per_call(self) -> int:
        return 2 * self.block + self.cblock + ROUNDS * len(self.selects) * self.hblock

    def queue(self, stream: Any, launch: Any) -> None:
        """Queue every stage and exchange on ``stream``; ``launch(stage, partials)`` queues one
        stage's kernel. The first launch checks every argument; a later failure leaves the peers
        ahead of this rank, so the caller treats it as a fault of the shard."""
        shard = self.shard
        launch("top", self.top)
        shard._exchange(stream, self.top, self.gathered, self)
        _core.launch_host_func(stream, self._decide, self._after_top)
        if self.cap:
            launch("cands", self.cands)
            shard._exchange(stream, self.cands, self.cgathered, self)
        for sel in self.selects:
            for j in range(ROUNDS):
                launch("hist", self.hist)
                shard._exchange(stream, self.hist, self.hgathered, self)
                _core.launch_host_func(stream, self._decide, self._after_round, sel, j)
        launch("race", self.top)
        shard._exchange(stream, self.top, self.gathered, self)

    # ---- on the stream's worker ----

    def _decide(self, step: Any, *args: Any) -> None:
        """One decision between exchanges. Every rank runs the same code on the same gathered
        data, so an error here is every rank's: it refuses the call alike (never a half-done
        select feeding the race)."""
        if self.fault is not None:
            return
        try:
            step(*args)
        except FeedError:
            raise
        except BaseException as exc:
            self._refuse(f"sharded sampling with filters failed between rounds: {exc!r}")

    def _refuse(self, why: str) -> None:
        self.fault = why
        self.state["flags"] = 0  # the stages left do nothing that matters: the call is refused
        if self.shard._fault is None:
            self.shard._fault = why
        raise FeedError(why)

    def _after_top(self) -> None:
        """The first exchange: agree on the call (or refuse it everywhere), then each row's zmax
        candidate and the first round's state."""
        if self.fault is not None:
            return
        shard, n = self.shard, self.rows
        heads = np.stack([_view(self.gathered, _HEADER_DTYPE, w * self.block, 1)[0] for w in range(shard.world)])
        expect = _core.PARTIAL_TAG ^ _core.PARTIAL_OPS["top"]
        for w, h in enumerate(heads):
            why = ("another operation" if h["tag"] != expect else "another row count" if h["rows"] != n
                   else "other sampling parameters or another call" if h["call"] != self.call
                   else "another vocabulary" if h["vocab"] != shard.vocab
                   else "another split" if (h["start"], h["stop"]) != shard.offsets[w:w + 2] else None)
            if why:
                self._refuse(f"sharded sampling with filters refused: rank {w} has {why}; every row "
                             "got NO_TOKEN")
        rec = np.stack([_view(self.gathered, _RECORD_DTYPE, w * self.block + _HEADER, n)
                        for w in range(shard.world)])
        ids, bits = rec["id"], rec["logit_bits"]
        keys = np.where(ids != _NO_TOKEN, _keys(bits), 0)
        best = keys.argmax(0)
        has = keys.max(0) > 0
        top_bits = bits[best, np.arange(n)]
        st = self.state
        st["floor"] = 0
        st["cut_need"] = 0
        st["list_len"] = 0xFFFFFFFF  # MF_SELECT_NO_LIST
        st["top_bits"] = top_bits
        st["flags"] = np.where(has, _F["top"], 0)
        # Rows whose zmax is not finite draw their top whatever the filters (sample_rule.h):
        # no rounds for them, nor for rows with no candidate.
        t = self.params["temperature"]
        with np.errstate(all="ignore"):
            inv_t = np.float32(1) / np.where(t > 0, t, np.float32(1)).astype(np.float32)
            zmax = top_bits.view(np.float32) * inv_t
        self.live = has & np.isfinite(zmax)
        top_k, top_p, _ = filters_of(self.params)
        self.want = {s: self.radix[s] & self.live for s in ("k", "p")}
        st["flags"] |= np.where(self.cands_rows & self.live, np.uint32(_F["cands"]), np.uint32(0))
        if self.selects:
            self._start(self.selects[0])

    def _start(self, sel: str) -> None:
        """The state of a select's first round."""
        self.sel_rows = self.want[sel].copy()
        n = self.rows
        self.target = np.zeros(n, np.uint64)
        self.above = np.zeros(n, np.uint64)
        self.prefix = np.zeros(n, np.uint64)
        self._round_state(sel, 0)

    def _round_state(self, sel: str, j: int) -> None:
        st = self.state
        flags = st["flags"] & ~np.uint32(_F["hist"] | _F["mass"])
        on = np.uint32(_F["hist"] | (_F["mass"] if sel == "p" else 0))
        st["flags"] = np.where(self.sel_rows, flags | on, flags)
        st["prefix"] = self.prefix.astype(np.uint32)
        st["shift"] = 32 - DIGIT_BITS * (j + 1)

    def _after_round(self, sel: str, j: int) -> None:
        """One round's histograms: every rank picks the same digit for every row in the select."""
        if self.fault is not None:
            return
        n, world = self.rows, self.shard.world
        bins = np.stack([_view(self.hgathered, "<u8", w * self.hblock + _HEADER, BINS * n).reshape(n, BINS)
                         for w in range(world)])
        total = bins.sum(0, dtype=np.uint64)  # integer sums: the same whatever the order
        rows = self.sel_rows
        if j == 0:
            whole = total.sum(1, dtype=np.uint64)
            if sel == "k":
                k = self.params["top_k"].astype(np.uint64)
                rows &= whole > k  # all of them fit: no top_k filter (the rule's `floor`)
                self.target = k
            else:
                tp = self.params["top_p"]
                self.target = np.array([_top_p_target(int(whole[r]), tp[r]) if rows[r] else 0
                                        for r in range(n)], np.uint64)
        # mf_select_digit: from the greatest digit down, the first where the weight reaches target.
        rev = total[:, ::-1]
        cum = self.above[:, None] + np.cumsum(rev, axis=1, dtype=np.uint64)
        reach = cum >= self.target[:, None]
        idx = np.where(reach.any(1), reach.argmax(1), BINS - 1)
        excl = cum - rev  # the weight of the greater digits
        digit = (BINS - 1 - idx).astype(np.uint64)
        shift = 32 - DIGIT_BITS * (j + 1)
        self.above = np.where(rows, excl[np.arange(n), idx], self.above)
        self.prefix = np.where(rows, self.prefix | (digit << np.uint64(shift)), self.prefix)
        if j + 1 < ROUNDS:
            self._round_state(sel, j + 1)
            return
        # The boundary key K is found: each rank cuts its own candidates at K by id. The slices
        # are in id order, so the weight at K before this rank's is the lower ranks' bins.
        st, me = self.state, self.shard.rank
        at_k = bins[:, np.arange(n), BINS - 1 - idx]  # [world, n]: each slice's weight at K
        before = at_k[:me].sum(0, dtype=np.uint64) if me else np.zeros(n, np.uint64)
        need = np.zeros(n, np.uint64)
        for r in np.flatnonzero(rows):  # Python ints: target - above - before may be negative
            need[r] = max(0, int(self.target[r]) - int(self.above[r]) - int(before[r]))
        cut = np.uint32(_F["cut"] | (_F["cut_mass"] if sel == "p" else 0))
        flags = st["flags"] & ~np.uint32(_F["hist"] | _F["mass"] | _F["cut_mass"])
        st["flags"] = np.where(rows, flags | cut, flags)
        st["cut_key"] = np.where(rows, self.prefix, st["cut_key"]).astype(np.uint32)
        st["cut_need"] = np.where(rows, need, st["cut_need"])
        nxt = self.selects.index(sel) + 1
        if nxt < len(self.selects):
            self._start(self.selects[nxt])
