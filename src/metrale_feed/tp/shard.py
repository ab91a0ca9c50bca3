"""A vocabulary split across the ranks of a ``torch.distributed`` process group (docs/tensor-parallel.md).

Each rank reduces its own slice of every row into a fixed-size partial block (``_argmax_partial``
or ``_sample_partial``; sampling filters add the rounds of ``select_rounds``), one all-gather of
those blocks runs in stream order (``_exchange``: gloo on the stream's worker on the host backend,
NCCL on the caller's stream on the cuda backend), and the combine (``_combine_partials``) writes,
on every rank, the cells, ids and logprobs the unsharded call gives on the whole rows. Only this
module imports torch, and only when a shard
is made.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import threading
from typing import Any, Sequence

from .. import _core
from ..errors import FeedError
from ..step import PickStep
from . import ops
from .call_args import _close_slot, _stream_key, _device_params, _check_host_params, _precheck_host
from .rounds import FilterRounds
from .shard_grammar import GrammarPicks
from .shard_top import TopLogprobs

_EXTRA = "pip install 'metrale-feed[torch]'"
# A partial block: a header (the fingerprint the combine checks) and a record a row; its layout
# is partial_layout.h's, through the extension.
_RECORD_BYTES = _core.PARTIAL_RECORD_BYTES
# Completed calls' buffers kept for reuse: pending calls beyond this many get fresh ones, so a
# depth-2 pipeline allocates nothing per step (on the cuda backend a free synchronises the device).
_RING = 4
_FILTERED = "filtered"  # the ring of fixed rounds' FilteredCalls (the others are keyed by block size)


def _torch() -> Any:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # torch is an optional extra
        raise ImportError(f"VocabShard needs torch.distributed: {_EXTRA}") from exc
    return torch, dist


def _default_offsets(vocab: int, world: int) -> list[int]:
    step = -(-vocab // world)
    return [min(vocab, r * step) for r in range(world + 1)]


def _check_offsets(offsets: Sequence[int], vocab: int, world: int) -> list[int]:
    offs = [int(o) for o in offsets]
    if len(offs) != world + 1:
        raise ValueError(f"offsets has {len(offs)} entries; a world of {world} needs {world + 1}")
    if offs[0] != 0:
        raise ValueError(f"offsets must start at 0, not {offs[0]}")
    if offs[-1] != vocab:
        raise ValueError(f"offsets must end at the vocabulary size {vocab}, not {offs[-1]}")
    for a, b in zip(offs, offs[1:]):
        if b < a:
            raise ValueError(f"offsets must not decrease ({a} then {b})")
    return offs


def _host_view(torch: Any, ptr: int, nbytes: int) -> Any:
    """A uint8 tensor over host-backend device memory (plain host memory there)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)


class VocabShard(GrammarPicks, TopLogprobs):
    """This rank's slice of a vocabulary split across a process group, for the sharded feed calls.

    Rank ``r`` holds the logits of the global ids ``[offsets[r], offsets[r + 1])``. Passed as
    ``shard=`` to ``argmax_to_feed`` or ``sample_to_feed``, the call reduces the slice locally and
    all-gathers ``16 * (max_rows + 2)`` bytes per rank (never the logits) in stream order, so every
    rank gets the unsharded call's cells and ids without a host synchronisation. Sampled rows with
    ``top_k``, ``top_p`` or ``min_p`` take up to 10 more all-gathers of per-row records: 16 bytes a
    row for the last, ``8 * top_k`` for the candidate lists, 8 KiB for each radix select's rounds;
    ``max_call_bytes`` is the most one call sends (docs/tensor-parallel.md, "Bytes per step").
    Every rank must make its shard with the same
    arguments and issue the same sharded calls, with the same params, in the same order. A
    shard belongs to the thread that made it: its calls are collectives, whose order two threads
    of a rank could not keep the same on every rank, so a call from any other thread is a
    ``FeedError`` before anything is queued (``close()`` and ``stats`` excepted).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup or None
        The group (None: the default group). On the cuda backend an NCCL group (the collective
        runs on the caller's stream, capturable in a graph); on the host backend a gloo group:
        give the shard a group of its own (``dist.new_group(backend="gloo")``) when other
        collectives may run on another thread, since its collectives run on the streams' workers.
    vocab : int
        The whole vocabulary, 1 to ``MAX_VOCAB``.
    offsets : sequence of int, optional
        ``world + 1`` non-decreasing bounds from 0 to ``vocab`` (default: slices of
        ``ceil(vocab / world)`` ids, the last ones shorter or empty).
    max_rows : int
        The most rows a call may have (1 to ``MAX_ROWS``); it sizes every message, so that no
        per-call argument can make two ranks' messages differ.
    filters : FilterRounds, optional
        The filters that sampling calls apply, in exchanges of one shape whatever the params
        (``metrale_feed.FilterRounds``; required for ``top_k``, ``top_p`` and
        ``min_p`` on the cuda backend, whose NCCL collectives are queued with the call). None:
        each call's rounds follow its params (host backend).

    Raises
    ------
    ImportError
        torch is missing (the message names the extra).
    ValueError
        Bad ``vocab``, ``offsets``, ``max_rows`` or ``filters``; checked before any collective.
    FeedError
        The ranks disagree on ``vocab``, ``offsets``, ``max_rows`` or ``filters`` (on every rank); a group
        whose backend does not match the package's (NCCL on the cuda backend, gloo on the host
        backend).

    Examples
    --------
    >>> import torch.distributed as dist, metrale_feed as mf
    >>> dist.init_process_group("gloo")                                # doctest: +SKIP
    >>> shard = mf.VocabShard(None, 152064, max_rows=256)              # doctest: +SKIP
    >>> shard.start, shard.stop                                        # doctest: +SKIP
    (0, 76032)
    """

    def __init__(self, group: Any, vocab: int, *, offsets: Sequence[int] | None = None,
                 max_rows: int = 256, filters: FilterRounds | None = None) -> None:
        if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= _core.MAX_VOCAB:
            raise ValueError(f"vocab must be an int in [1, {_core.MAX_VOCAB}], not {vocab!r}")
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 1 <= max_rows <= _core.MAX_ROWS:
            raise ValueError(f"max_rows must be an int in [1, {_core.MAX_ROWS}], not {max_rows!r}")
        if filters is not None and not isinstance(filters, FilterRounds):
            raise ValueError(f"filters must be a FilterRounds or None, not {filters!r}")
        torch, dist = _torch()
        if not dist.is_available() or not dist.is_initialized():
            raise FeedError("VocabShard needs an initialised torch.distributed process group")
        # The cuda backend's blocks are device memory: NCCL, from the calling thread on the
        # caller's stream. The host backend's are host memory: gloo, on the stream's worker.
        self._nccl = "nccl" in str(dist.get_backend(group)).lower()
        if _core.backend() == "cuda" and not self._nccl:
            raise FeedError("VocabShard on the cuda backend exchanges through NCCL: give it a "
                            "process group whose backend is nccl")
        if _core.backend() != "cuda" and "gloo" not in str(dist.get_backend(group)).lower():
            raise FeedError("VocabShard on the host backend exchanges through gloo: give it a "
                            "process group whose backend is gloo")
        world = dist.get_world_size(group)
        rank = dist.get_rank(group)
        offs = _check_offsets(_default_offsets(vocab, world) if offsets is None else offsets,
                              vocab, world)
        self._torch, self._dist, self._group = torch, dist, group
        self.vocab, self.world, self.rank, self.max_rows = vocab, world, rank, max_rows
        self.filters = filters
        self.offsets = tuple(offs)
        self.start, self.stop = offs[rank], offs[rank + 1]
        self.stats = {"collectives": 0, "bytes_sent": 0}
        self._calls = 0
        # The one thread whose calls the shard takes: the one that made it, whose agreement below
        # is this shard's first collective. A lock orders the calls of two threads within a rank
        # but not across ranks: each rank's n-th call could be another thread's, and the combine
        # would pair blocks of unrelated calls whose fingerprints agree (wrong ids, no error).
        self._thread = threading.current_thread()
        # Held across a call, from its checks to its last queued operation, and by close(), which
        # any thread may call.
        self._lock = threading.Lock()
        # Tests set it: a world of one then runs the partial, the exchange and the combine instead
        # of the unsharded call (the path of every world, testable on one device).
        self._force_exchange = False
        self._fault: str | None = None
        self._pending: list[tuple[Any, tuple[Any, ...]]] = []  # (done event, buffers it holds)
        # Completed calls' (done, buffers), by block size: the feed calls' (self._block), and a
        # top_logprobs call's for each n it was called with.
        self._rings: dict[Any, list[tuple[Any, tuple[Any, ...]]]] = {}
        self._stream = 0  # the stream of the pending calls
        self._block = _core.PARTIAL_HEADER_BYTES + max_rows * _RECORD_BYTES
        # The agreement: every rank sends the same-sized record, so a disagreement is an error on
        # every rank instead of mismatched collectives later.
        digest = hashlib.blake2b(struct.pack(f"<{len(offs)}q", *offs), digest_size=7).digest()
        code = -1 if filters is None else filters.code
        mine = torch.tensor([vocab, int.from_bytes(digest, "little"), max_rows, world, code], dtype=torch.int64,
                            device=f"cuda:{torch.cuda.current_device()}" if self._nccl else "cpu")
        self._streams: dict[int, Any] = {}  # torch's wrappers of the caller's streams (NCCL)
        if world > 1:
            got = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(got, mine, group=group)
            self._count(mine.numel() * 8)
            for r, theirs in enumerate(got):
                if not torch.equal(theirs, mine):
                    a, b = mine.tolist(), theirs.tolist()
                    raise FeedError(
                        f"VocabShard: rank {r} disagrees with rank {rank} (vocab {b[0]} vs {a[0]}, "
                        f"offsets {'differ' if a[1] != b[1] else 'agree'}, max_rows {b[2]} vs {a[2]}, "
                        f"filters {'differ' if a[4] != b[4] else 'agree'})")

    @property
    def width(self) -> int:
        """The ids of this rank's slice, ``stop - start``: the columns its logits hold (0 for an
        empty slice)."""
        return self.stop - self.start

    @property
    def max_call_bytes(self) -> int:
        """The most bytes one feed call (``argmax_to_feed``, ``sample_to_feed``,
        ``verify_to_feed``) sends from this rank, whatever its rows and params; 0 in a world of
        one, whose calls are the unsharded ones.

        A greedy or temperature-only call without fixed rounds sends one block, ``16 * (max_rows
        + 2)`` bytes. With ``filters`` every sampled call sends exactly this: the rounds'
        exchanges, each sized by ``max_rows`` (``FilterRounds``). Without, a sampled call's
        rounds follow its params, and the most is a call whose rows take the candidate lists at
        ``top_k`` 1024, a larger ``top_k`` and ``top_p`` alone: 11 exchanges, 24,608 bytes a row
        and 32 bytes of header an exchange (docs/tensor-parallel.md, "Bytes per step").
        ``top_logprobs`` sends its own block (``16 + 8 * n`` bytes a row).
        """
        if self.world == 1 and not self._force_exchange:
            return 0
        from . import select_rounds

        if self.filters is not None:
            cap, selects = self.filters.top_k, len(self.filters.selects)
        else:  # the candidate lists at their most, and both radix selects
            cap, selects = _core.SELECT_CANDS_MAX, len(_core.SELECTS)
        return select_rounds.call_bytes(self._block, self.max_rows, cap, selects)

    def close(self) -> None:
        """Wait for this rank's pending sharded calls and free their buffers; the shard then
        refuses further calls. Idempotent.

        Raises
        ------
        FeedError
            A pending call failed (its event's error).

        Examples
        --------
        >>> shard.close()  # doctest: +SKIP
        """
        with self._lock:  # after a call another thread is queueing
            pending, self._pending = self._pending + [s for ring in self._rings.values() for s in ring], []
            self._rings = {}
            if self._fault is None:
                self._fault = "the shard is closed"
        for done, held in pending:
            try:
                done.synchronize()
            except FeedError:
                pass  # reported by the caller's own event
            done.close()
            for buf in held:
                buf.close()

    def _count(self, nbytes: int) -> None:
        self.stats["collectives"] += 1
        self.stats["bytes_sent"] += nbytes

    def __repr__(self) -> str:
        return (f"VocabShard(rank={self.rank}, world={self.world}, start={self.start}, "
                f"stop={self.stop}, vocab={self.vocab}, max_rows={self.max_rows}, filters={self.filters})")

    # ---- the calls (argmax_to_feed / sample_to_feed with shard=self dispatch here) ----

    def _rows_of(self, logits: Any, masks: Any, params: Any, rows: Any) -> int:
        if rows is None:
            if masks is not None:
                try:  # a buffer holds two uint32 per row; a sequence one pair per row
                    with memoryview(masks) as view:
                        rows = view.nbytes // 8
                except TypeError:
                    rows = len(masks)
            elif params is not None and not _device_params(params):
                rows = len(params)
            elif hasattr(logits, "shape"):
                rows = int(logits.shape[0])
            else:
                raise ValueError("a sharded call on raw memory needs rows=")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows must be in [1, max_rows={self.max_rows}], not {rows!r}")
        return rows

    def _reap(self) -> None:
        """Move completed calls' buffers to the ring: their done event is recorded after the
        combine and the fault check, the last readers of the block, the gathered blocks and the
        fault word, so nothing queued still uses them. A filtered call's own buffers are freed."""
        pending = []
        for p in self._pending:
            if not _core.event_query(p[0]):
                pending.append(p)
            else:
                self._recycle(p)
        self._pending = pending

    def _recycle(self, slot: tuple[Any, Any]) -> None:
        """A free slot back to the ring of its block size while that ring has room; else freed.
        A filtered call's buffers (a ``FilteredCall``) are reused with fixed rounds only, whose
        sizes are the shard's."""
        held = slot[1]
        if isinstance(held, tuple):
            ring = self._rings.setdefault(held[0].nbytes, [])
        else:
            ring = self._rings.setdefault(_FILTERED, []) if held.fixed else None
        if ring is not None and len(ring) < _RING:
            ring.append(slot)
        else:
            _close_slot(slot)

    def _slot(self, nbytes: int | None = None) -> tuple[Any, tuple[Any, ...]]:
        """A call's (done event, (block, gathered, fault)) with blocks of ``nbytes`` (default the
        feed calls' size, set by max_rows so any call fits any slot): a completed call's from the
        ring of that size, or new ones (so a depth-2 pipeline allocates nothing per step)."""
        size = self._block if nbytes is None else nbytes
        ring = self._rings.get(size)
        if ring:
            return ring.pop()
        block = _core.DeviceBuffer(size)
        try:
            gathered = _core.DeviceBuffer(size * self.world)
            fault = _core.PinnedBuffer(4)
        except BaseException:
            block.close()
            raise
        return _core.Event(), (block, gathered, fault)

    def run_step(self, step: PickStep) -> int:
        """Run one pick over the split vocabulary: what ``argmax_to_feed``, ``sample_to_feed``
        and ``verify_to_feed`` hand the shard given ``shard=self`` (the call described once,
        ``metrale_feed.step.PickStep``). Returns the rows launched."""
        if step.grammar is not None:
            # The shard's thread and state first: a grammar's mask is queued before the pick.
            self._refuse_after_fault()
            return self._with_grammar(step)
        if step.op == "verify":
            return self._verify(step)
        with self._lock:
            return self._call_locked(step)

    def _call_locked(self, step: PickStep) -> int:
        op, logits, masks, params, cells, dst = (step.op, step.logits, step.masks, step.params,
                                                 step.cells, step.dst)
        event, stream, rows, vocab, dtype = step.event, step.stream, step.rows, step.vocab, step.dtype
        row_stride, bitmask, logprobs, logprobs_dst = (step.row_stride, step.bitmask, step.logprobs,
                                                       step.logprobs_dst)
        self._refuse_after_fault()
        width = self.width
        if vocab is not None and vocab != width:
            raise ValueError(f"with a shard, vocab is the slice's width {width}, not {vocab}")
        device_params = params is not None and _device_params(params)
        host_filters = params is not None and not device_params and _check_host_params(params)
        # With fixed rounds every sampled call takes them, filters on or not, host or device
        # params, and nothing about the params is refused here: so no rank's params can change
        # the collectives (NCCL issues them as the call is queued); the device finds a row they
        # do not serve, on every rank alike. Without them, host params with a filter do.
        filtered = params is not None and (self.filters is not None or host_filters)
        if self.world == 1 and not self._force_exchange:  # the unsharded call: the same step
            return int(_core.pick_to_feed(step.replace(shard=None, vocab=self.vocab)))
        n = self._rows_of(logits, masks, params, rows)
        _precheck_host(dst, n, "dst", "I")
        _precheck_host(logprobs_dst, n, "logprobs_dst", "f")
        for buf, what in ((cells, "cells"), (logprobs, "logprobs")):
            if type(buf) is _core.DeviceBuffer and buf.nbytes < n * 4:
                raise ValueError(f"{what} holds {buf.nbytes} bytes; {n} rows need {n * 4}")
        handle, capturing = self._stream_check(stream)
        if (logprobs is None) != (logprobs_dst is None) and logprobs_dst is not None:
            raise ValueError("logprobs_dst needs logprobs (the device buffer it is copied from)")
        # An empty slice takes part with no candidate; a (rows, 0) tensor still gives its dtype
        # (the partial call reads it, and nothing else, from the tensor).
        if filtered:
            return self._call_filtered(logits, masks, params, cells, dst, event, stream, n, dtype,
                                       row_stride, bitmask, logprobs, logprobs_dst, handle, capturing,
                                       device_params)
        call = self._calls + 1
        # logprobs: the records carry (m, s) only when asked for; the header says which, so ranks
        # that disagree get the combine's fault rather than a logprob from another's zero sum.
        kw = dict(start=self.start, stop=self.stop, vocab=self.vocab, dtype=dtype, call=call,
                  rows=n, row_stride=row_stride, bitmask=bitmask, logprobs=logprobs is not None)

        def partial(block: Any) -> None:
            if op == "argmax":
                ops.argmax_partial(logits, masks, block, None, stream, **kw)
            else:
                ops.sample_partial(logits, params, block, None, stream, masks=masks, **kw)

        def combine(gathered: Any, fault: Any) -> None:
            ops.combine_partials(gathered, self.world, cells, dst, None, stream, rows=n,
                                    vocab=self.vocab, call=call, fault_dst=fault,
                                    params=params if op == "sample" else None, logprobs=logprobs,
                                    logprobs_dst=logprobs_dst, slice_stride=self._block // _RECORD_BYTES)

        self._exchanged(call, call, partial, combine, stream, handle, capturing, event)
        return n

    def _refuse_unfixed_rounds(self, what: str) -> None:
        """NCCL's collectives are issued at queue time: rounds that followed each rank's params
        would differ between ranks whose params do (docs/tensor-parallel.md, "Fixed rounds")."""
        if self.filters is None and self._nccl:
            raise FeedError(f"sharded {what} on the cuda backend need rounds of one shape: "
                            "make the shard with filters=FilterRounds(top_k=..., top_p=...)")

    def _refuse_after_fault(self) -> None:
        """Every call's first check, before anything is queued: the calling thread is the
        shard's, and no fault (or close) has stopped it."""
        if threading.current_thread() is not self._thread:
            here, owner = threading.current_thread().name, self._thread.name
            raise FeedError(f"VocabShard: a call from thread {here!r}, but the shard belongs to "
                            f"thread {owner!r}, which made it: a sharded call is a collective, and "
                            "two threads of a rank would pair their calls with other calls on the "
                            "peers; make every call of a shard from its thread (a thread of its own "
                            "needs a shard and a process group of its own)")
        if self._fault is not None:
            raise FeedError(f"VocabShard refuses further calls after a fault: {self._fault}")

    def _stream_check(self, stream: Any) -> tuple[int, bool]:
        """(stream handle, whether it is capturing) of a call about to queue, once this shard's
        calls on another stream have completed (a capture's call is a graph's: _exchanged)."""
        handle = _stream_key(stream)
        capturing = bool(_core.stream_capturing(stream))
        self._reap()
        if self._pending and handle != self._stream and not capturing:
            # Two streams' workers would issue this group's collectives in either order.
            raise ValueError("a shard's calls go on one stream while earlier ones are pending "
                             f"(stream {self._stream:#x}, now {handle:#x})")
        return handle, capturing

    def _verify(self, step: PickStep) -> int:
        """``verify_to_feed(..., shard=self)`` over a split vocabulary (docs/tensor-parallel.md,
        "Verify"). Greedy rows: each rank's argmax partial of every position, the greedy call's
        one all-gather of 16 bytes a position, then a combine that keeps each row's drafts while
        they equal the combined argmax. Sampled rows (or device params, or any params with fixed
        rounds): a sampled call's rounds over the logit rows with the drafts in them
        (_call_filtered). Either way the unsharded call's cells on every rank."""
        logits, drafts, cells, dst, event, stream = (step.logits, step.drafts, step.cells,
                                                     step.dst, step.event, step.stream)
        k, masks, bitmask, params, draft_probs = (step.k, step.masks, step.bitmask, step.params,
                                                  step.draft_probs)
        logprobs, logprobs_dst, rows, vocab = step.logprobs, step.logprobs_dst, step.rows, step.vocab
        dtype, row_stride, advance = step.dtype, step.row_stride, step.advance
        with self._lock:
            self._refuse_after_fault()
            width = self.width
            if vocab is not None and vocab != width:
                raise ValueError(f"with a shard, vocab is the slice's width {width}, not {vocab}")
            if self.world == 1 and not self._force_exchange:  # the unsharded call: the same step
                return int(_core.pick_to_feed(step.replace(shard=None, vocab=self.vocab)))
            from . import verify_args

            v = verify_args.check(self, logits, drafts, cells, dst, k, params, draft_probs,
                                  logprobs, logprobs_dst, rows, advance)
            handle, capturing = self._stream_check(stream)
            if capturing and v.host_drafts is not None:
                raise ValueError("a captured sharded verify_to_feed needs device drafts (a replay "
                                 "reads them where they are)")
            sampled = v.sampled
            if sampled is not None:  # before the drafts' buffer: what the rounds cannot follow
                if capturing and not sampled.device:
                    raise ValueError("a captured sharded verify_to_feed with sampled rows takes device "
                                     "params (a replay would reuse the capture's seeds and positions)")
                self._refuse_unfixed_rounds("a verify with sampled rows")
                if sampled.device and self.filters is None:
                    raise FeedError("a sharded verify_to_feed with device params needs fixed rounds "
                                    "(filters=FilterRounds(...)): the rounds cannot follow params the "
                                    "host does not read")
            upload = _core.DeviceBuffer(v.host_drafts.nbytes) if v.host_drafts is not None else None
            if sampled is not None:  # sampled rows: a sampled call's rounds, with the drafts
                try:
                    if upload is not None:  # before the first stage, which reads them
                        _core.copy_h2d_async(upload, v.host_drafts, stream)
                    self._call_filtered(logits, masks, sampled.params if sampled.device else sampled.logit_rows,
                                        cells, dst, event, stream, v.logit_rows, dtype, row_stride, bitmask,
                                        None, None, handle, capturing, sampled.device,
                                        verify=(drafts if upload is None else upload, v.k, sampled))
                finally:
                    if upload is not None:
                        upload.close()  # freed once the stream has passed the work that reads it
                return v.rows
            counter = self._calls + 1
            call = verify_args.call_word(counter, v.k)  # a plain argmax's header differs
            kw = dict(start=self.start, stop=self.stop, vocab=self.vocab, dtype=dtype, call=call,
                      rows=v.logit_rows, row_stride=row_stride, bitmask=bitmask,
                      logprobs=logprobs is not None)

            def partial(block: Any) -> None:
                ops.argmax_partial(logits, masks, block, None, stream, **kw)

            def combine(gathered: Any, fault: Any) -> None:
                if upload is not None:
                    _core.copy_h2d_async(upload, v.host_drafts, stream)
                ops.combine_partials(gathered, self.world, cells, dst, None, stream,
                                        rows=v.logit_rows, vocab=self.vocab, call=call,
                                        fault_dst=fault, logprobs=logprobs,
                                        logprobs_dst=logprobs_dst,
                                        slice_stride=self._block // _RECORD_BYTES,
                                        drafts=drafts if upload is None else upload, k=v.k)

            try:
                self._exchanged(counter, call, partial, combine, stream, handle, capturing, event)
            finally:
                if upload is not None:
                    upload.close()  # freed once the stream has passed the combine that reads it
            return v.rows

    def _exchanged(self, counter: int, call: int, partial: Any, combine: Any, stream: Any,
                   handle: int, capturing: bool, event: Any, nbytes: int | None = None,
                   outcome: str = "every row got NO_TOKEN") -> None:
        """Queue one exchange's call on ``stream``: ``partial(block)`` (which checks every
        argument and queues nothing when it raises), the all-gather, ``combine(gathered, fault)``,
        the fault check, then ``event``. ``counter``: the shard's call count once it is queued;
        ``call``: the word the blocks' headers carry; ``nbytes``: blocks of this size instead of the
        feed calls' (a ring of slots per size); ``outcome``: what a refused combine wrote, for the fault's message."""
        slot = self._slot(nbytes)
        done, (block, gathered, fault) = slot
        try:
            partial(block)
        except BaseException:
            self._recycle(slot)  # refused before anything was queued: still free
            raise
        # Queued: from here every rank's collective sequence includes this call.
        self._calls = counter
        if not capturing:
            self._stream = handle
        self._exchange(stream, block, gathered)
        try:
            combine(gathered, fault)
        except BaseException as exc:
            # The collective is queued and the peers go on: this rank cannot follow them.
            self._fault = f"the combine was refused on rank {self.rank}: {exc}"
            if not capturing:  # (a capture's graph holds what its exchange names)
                _core.event_record(done, stream)  # the gather still writes the slot: close() waits
                self._pending.append(slot)
            raise
        _core.launch_host_func(stream, self._check, fault, None, outcome)
        if capturing:
            # Captured (docs/graphs.md): the graph's operations name the buffers, so the graph
            # keeps them, and its replays reuse them, with this call's counter (every rank replays
            # the same graphs in the same order, so the counters still agree). The slot leaves the
            # ring for good: neither the reaper nor close() may free or reuse what a replay writes.
            if event is not None:
                _core.event_record(event, stream)
            return
        _core.event_record(done, stream)
        self._pending.append(slot)
        if event is not None:
            _core.event_record(event, stream)

    def _call_filtered(self, logits: Any, masks: Any, params: Any, cells: Any, dst: Any, event: Any,
                       stream: Any, n: int, dtype: Any, row_stride: Any, bitmask: Any,
                       logprobs: Any, logprobs_dst: Any, handle: int, capturing: bool,
                       device_params: bool, verify: tuple[Any, int, Any] | None = None) -> int:
        """A sampled call with top_k, top_p or min_p (or any sampled call, with fixed rounds):
        the rounds of select_rounds, then the ordinary combine of the race winners. With fixed
        rounds the params, host or device ones, are copied into the call's own buffer in stream
        order, which every stage, decision and the combine read when they run (so a call with
        device params is capturable). ``verify``: (device drafts, k, verify_args.Sampled) of a
        sampled verify over ``n`` logit rows (``params``: their host records, which the adaptive
        rounds follow, or the rows' device params): the call's copy of the logit rows' params is
        written on the device from the rows' and their advance, its first and last stages take the
        drafts, and the combine verifies (verify_rule.h)."""
        from . import select_rounds

        fixed = self.filters
        self._refuse_unfixed_rounds("a verify with sampled rows" if verify else "top_k, top_p and min_p")
        if capturing and not device_params:
            raise ValueError("a captured sharded sample_to_feed takes device params (a replay would "
                             "reuse the capture's seeds and positions)")
        # Fixed rounds: the params' place and values are in each row's digest instead (TOP records).
        # A verify's word differs from a plain sampled call's, and by k.
        call = select_rounds.call_word(self._calls + 1, None if device_params or fixed else params[:n],
                                       b"" if verify is None else b"verify k=%d" % verify[1])
        ring = self._rings.get(_FILTERED) if fixed is not None else None
        source = None if verify is None else (verify[2], verify[1])
        if ring:  # a completed call's (done, rounds): the ring holds fixed rounds only
            done, rounds = ring.pop()
            rounds.start(params, n, call, device_params, source)
        else:
            rounds = select_rounds.FilteredCall(self, params, n, call, fixed, device_params, source)
            done = _core.Event()
        # What the stages and the combine read: the call's copy with fixed rounds (read as device
        # params are: no value refused on this rank alone) or for a verify (its advance is there
        # alone; verify_args checked host values), else the host records (checked now).
        read = rounds.params_dev if fixed is not None or verify is not None else params
        kw = dict(start=self.start, stop=self.stop, vocab=self.vocab, dtype=dtype, call=call,
                  rows=n, row_stride=row_stride, bitmask=bitmask, masks=masks)
        queued = False

        def launch(stage: str, partials: Any) -> None:
            nonlocal queued
            # The race's records carry (m, s) when logprobs are asked for (its header says so);
            # it reads the gathered candidate lists, which the "cands" stage writes.
            lists = {}
            if rounds.cap and stage in ("cands", "race"):
                lists = dict(cands_cap=rounds.cap)
                if stage == "race":
                    lists.update(cands=rounds.cgathered, cands_world=self.world,
                                 cands_stride=rounds.cblock)
            if verify is not None and stage in ("top", "race"):
                lists.update(drafts=verify[0], k=verify[1])
            ops.select_partial(logits, read, partials, rounds.state_buf, stage, stream,
                                  id_list=rounds.id_list, list_cap=select_rounds.LIST_CAP,
                                  logprobs=stage == "race" and logprobs is not None, **lists, **kw)
            if not queued:  # the first stage checked every argument: the call is on
                queued = True
                self._calls += 1
                if not capturing:
                    self._stream = handle

        try:
            rounds.queue(stream, launch)
            # A verify's combine reads the logit rows' params from the call's copy, and its state.
            more = {} if verify is None else dict(drafts=verify[0], k=verify[1], select=rounds.state_buf)
            ops.combine_partials(rounds.gathered, self.world, cells, dst, None, stream, rows=n,
                                    vocab=self.vocab, call=call, fault_dst=rounds.fault_word,
                                    params=read, logprobs=logprobs,
                                    logprobs_dst=logprobs_dst, slice_stride=self._block // _RECORD_BYTES,
                                    filtered=True, refused=rounds.decided, **more)
        except BaseException as exc:
            if not queued:  # refused before any collective, after the params' copy was queued
                if fixed is None:  # closed (a buffer that queued work reads is freed once it has run)
                    self._recycle((done, rounds))
                elif not capturing:  # back to the ring once the copy has run
                    self._pending.append((done, rounds))
                    try:
                        _core.event_record(done, stream)
                    except Exception:  # noqa: S110 (the refusal above is the error to raise)
                        pass
                else:  # the graph keeps the copy's buffers: they leave the ring for good
                    done.close()
                raise
            # Some exchanges are queued and the peers go on: this rank cannot follow them.
            self._fault = f"a sharded sampling call failed on rank {self.rank}: {exc}"
            raise
        # Fixed rounds: a decision's fault is the combine's (refused=). Else the exchanges that
        # skipped report it, read on the worker from the decision's word.
        _core.launch_host_func(stream, self._check, rounds.fault_word, None if fixed else rounds)
        if capturing:
            # Captured (docs/graphs.md): the graph's operations name the call's buffers and keep
            # them; they leave the ring for good, and each replay re-runs every round.
            done.close()
            if event is not None:
                _core.event_record(event, stream)
            return n
        _core.event_record(done, stream)
        self._pending.append((done, rounds))
        if event is not None:
            _core.event_record(event, stream)
        return n

    def _exchange(self, stream: Any, src: Any, dst: Any, call: Any = None) -> None:
        """Queue on ``stream`` the all-gather of this rank's block ``src`` into ``dst``.

        ``src`` and ``dst`` are DeviceBuffers; ``dst`` holds ``world`` blocks of ``src.nbytes``
        bytes, rank ``r``'s at byte ``r * src.nbytes``. Every collective of a sharded call goes
        through here, in stream order, and is counted in ``stats`` when it is issued (so a graph's
        replays count too). Every rank must issue the same exchanges, with the same sizes, in the
        same order. ``call``: a filtered call (``select_rounds``) whose ``fault`` is set by the
        time the exchange runs (the ranks disagreed: its first decision's fault word, or an
        exchange that failed) skips the collective on every rank alike and zeroes ``dst`` (host
        backend; the cuda backend refuses filtered calls, see ``_call_filtered``).
        """
        if dst.nbytes < src.nbytes * self.world:
            raise ValueError(f"the gathered buffer holds {dst.nbytes} bytes; {self.world} blocks "
                             f"of {src.nbytes} need {src.nbytes * self.world}")
        if not self._nccl:
            _core.launch_host_func(stream, self._gather, src, dst, call)
            return
        # NCCL: issued now, from this thread, on `stream` (torch's current stream for the call).
        # With async_op=False, torch >= 2.8 launches the kernel on the current stream itself;
        # older versions order their own stream after it and it after theirs; neither waits on
        # the host (unless TORCH_NCCL_BLOCKING_WAIT is set). In a capture the kernel becomes a
        # node of the graph (NCCL >= 2.9), so replays re-issue it without Python.
        torch, n = self._torch, src.nbytes
        handle = _stream_key(stream)
        ext = self._streams.get(handle)
        if ext is None:  # handle 0: the legacy default stream, torch's default stream too
            ext = self._streams[handle] = (torch.cuda.ExternalStream(handle) if handle
                                           else torch.cuda.default_stream())
        inp = torch.from_dlpack(src)  # 1-D uint8 CUDA tensors over the buffers; no copy, no sync
        out = torch.from_dlpack(dst)[: n * self.world]
        try:
            with torch.cuda.stream(ext):
                self._dist.all_gather_into_tensor(out, inp, group=self._group)
        except BaseException as exc:
            # The partial call is queued and the peers go on: this rank cannot follow them.
            self._fault = f"the all-gather could not be issued on rank {self.rank}: {exc}"
            raise FeedError(self._fault) from exc
        if _core.stream_capturing(stream):
            # A host node: counts each replay's collective, and keeps the blocks with the graph
            # (no other operation of the graph names this rank's block).
            _core.launch_host_func(stream, self._issued, src, dst)
        else:
            self._count(n)

    def _issued(self, src: Any, dst: Any) -> None:
        """A graph's NCCL exchange, at each replay: counted in ``stats``."""
        self._count(src.nbytes)

    def _gather(self, src: Any, dst: Any, call: Any = None) -> None:
        """On the stream's worker (host backend): the all-gather ``_exchange`` queued."""
        torch, n = self._torch, src.nbytes
        outs = [_host_view(torch, dst.ptr + w * n, n) for w in range(self.world)]
        if call is not None and call.fault is not None:  # refused on every rank alike: no collective
            for o in outs:
                o.zero_()
            call.report()  # the event's error, once
            return
        self._count(n)
        try:
            self._dist.all_gather(outs, _host_view(torch, src.ptr, n), group=self._group)
        except BaseException as exc:
            for o in outs:  # zero headers: the combine then refuses the blocks (NO_TOKEN rows)
                o.zero_()
            self._fault = f"the all-gather failed on rank {self.rank}: {exc}"
            if call is not None and call.fault is None:
                # A filtered call's later exchanges skip their collectives: against a peer that
                # hangs, each would wait out the group's timeout again.
                call.fault = self._fault
            raise FeedError(self._fault) from exc

    def _check(self, fault: Any, call: Any = None, outcome: str = "every row got NO_TOKEN") -> None:
        """On the stream's worker, after the combine: its fault word as an error of the event
        (once: a call whose rounds were refused has reported it already)."""
        if call is not None and call.fault is not None:
            call.report()  # unless an exchange has
            return
        try:
            ops.check_partials_fault(fault, outcome)
        except FeedError as exc:
            if self._fault is None:
                self._fault = str(exc)
            raise
