"""Speculative decoding through ``DecodePipeline`` (docs/speculative.md).

A drafter proposes ``k`` ids a row into a device buffer, in stream order; the model's verify
step runs the ``k + 1`` positions of each row (its input, then its drafts) in one forward;
``verify_to_feed`` keeps the longest prefix the target rule agrees with and emits one id of the
target's own, so a row advances ``1 <= n <= k + 1`` positions a step. ``SpeculativeStep`` is the
pipeline's delegate for such steps: it reserves KV for the ``k + 1`` positions, gives back the
blocks that hold only rejected positions once the counts are read, and commits the emitted ids up
to a stop or ``max_new_tokens`` (the ids past it are discarded, never shown).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from .. import _checks, _core
from ..errors import FeedError, KvPoolExhausted
from ..feed import NO_TOKEN, FeedSource
from ..kv import SequenceState

if TYPE_CHECKING:
    from .pipeline import DecodePipeline, Request

__all__ = ["DraftBatch", "Drafter", "HostDrafter", "NGramDrafter", "SpeculativeStep", "check_drafter"]


class DraftBatch:
    """What a drafter is given for one step.

    Parameters
    ----------
    rows, k : int
    inputs : DeviceBuffer
    histories : list of list of int
    seeds : list of int
    masks : list of (int, int)

    Attributes
    ----------
    rows : int
        Rows of the step.
    k : int
        Drafts a row to write.
    inputs : DeviceBuffer
        ``rows`` uint32: each row's input id of this step (its last committed id), written in
        stream order before ``propose`` is called: what a device-side head (EAGLE, MTP) reads.
    histories : list of list of int
        Each row's ids so far (prompt and committed tokens), the input id last.
    seeds : list of int
        Each request's ``seed``.
    masks : list of (int, int)
        Each row's ban pair (``NO_TOKEN`` where unused).
    """

    __slots__ = ("rows", "k", "inputs", "histories", "seeds", "masks")

    def __init__(self, rows: int, k: int, inputs: Any, histories: List[List[int]],
                 seeds: List[int], masks: List[Tuple[int, int]]) -> None:
        self.rows, self.k, self.inputs = rows, k, inputs
        self.histories, self.seeds, self.masks = histories, seeds, masks


@runtime_checkable
class Drafter(Protocol):
    """What ``DecodePipeline(..., speculative=)`` takes: ``k`` drafts a row a step.

    ``propose(batch, out, stream)`` writes ``batch.rows * batch.k`` uint32 ids into the device
    memory ``out`` (row ``r``'s drafts at words ``r * k ..``; ``NO_TOKEN`` ends a row's drafts
    early), in stream order on ``stream``: the verify step queued after the call reads them. It
    must not synchronise the host with the device (a host-side drafter stages its ids in pinned
    memory and copies them asynchronously, as ``HostDrafter`` does).

    Attributes
    ----------
    k : int
        Drafts a row, 1 to ``MAX_DRAFTS``.
    """

    k: int

    def propose(self, batch: DraftBatch, out: Any, stream: Any) -> None:
        ...


def check_drafter(drafter: Any) -> int:
    """The drafter's ``k``, checked; a clear error for anything that is not a drafter."""
    if not callable(getattr(drafter, "propose", None)):
        raise TypeError(f"speculative= takes a drafter with propose(batch, out, stream) and k; "
                        f"{type(drafter).__name__} has no propose method")
    if not hasattr(drafter, "k"):
        raise TypeError(f"speculative= takes a drafter with a k attribute (drafts a row); "
                        f"{type(drafter).__name__} has none")
    k = _checks.integer(drafter.k, "the drafter's k")
    if not 1 <= k <= _core.MAX_DRAFTS:
        raise ValueError(f"the drafter's k must be in [1, {_core.MAX_DRAFTS}], got {k}")
    return k


class _Upload:
    """Host-computed drafts staged in pinned memory and copied to the device in stream order; a
    slot is rewritten only once the event recorded after its copy says the copy has run."""

    _SLOTS = 3

    def __init__(self) -> None:
        self.slots: List[Optional[Tuple[Any, Any]]] = [None] * self._SLOTS
        self.next = 0
        self.host_syncs = 0

    def send(self, words: List[int], out: Any, stream: Any) -> None:
        at = self.next
        self.next = (at + 1) % self._SLOTS
        slot = self.slots[at]
        nbytes = 4 * len(words)
        if slot is not None:
            if not slot[1].query():  # only with more than _SLOTS proposals queued
                self.host_syncs += 1
                slot[1].synchronize()
            if slot[0].nbytes < nbytes:
                slot[0].close()
                slot[1].close()
                slot = None
        if slot is None:
            self.slots[at] = None  # a failed allocation leaves no closed slot behind
            slot = (_core.PinnedBuffer(max(nbytes, 256)), _core.Event())
            self.slots[at] = slot
        view = memoryview(slot[0]).cast("B")
        try:
            view[:nbytes] = array("I", words).tobytes()
            _core.copy_h2d_async(out, view[:nbytes], stream)
        finally:
            view.release()
        slot[1].record(stream)

    def close(self) -> None:
        for slot in self.slots:
            if slot is not None:
                slot[0].close()
                slot[1].close()
        self.slots = [None] * self._SLOTS


class HostDrafter:
    """A drafter that computes its ids on the host from the rows' histories (``draft``) and
    copies them to the device asynchronously, through a small ring of pinned buffers.

    Parameters
    ----------
    k : int
        Drafts a row, 1 to ``MAX_DRAFTS``.
    """

    def __init__(self, k: int) -> None:
        k = _checks.integer(k, "k")
        if not 1 <= k <= _core.MAX_DRAFTS:
            raise ValueError(f"k must be in [1, {_core.MAX_DRAFTS}], got {k}")
        self.k = k
        self._upload = _Upload()

    def draft(self, history: Sequence[int], k: int, seed: int, mask: Tuple[int, int]) -> List[int]:
        """``k`` drafts after ``history`` (the input id last); ``NO_TOKEN`` past the last."""
        raise NotImplementedError

    def propose(self, batch: DraftBatch, out: Any, stream: Any) -> None:
        """Write ``draft`` of every row into ``out`` in stream order (see ``Drafter``)."""
        words: List[int] = []
        for history, seed, mask in zip(batch.histories, batch.seeds, batch.masks):
            ids = list(self.draft(history, batch.k, seed, mask))[: batch.k]
            words.extend(ids + [NO_TOKEN] * (batch.k - len(ids)))
        self._upload.send(words, out, stream)

    @property
    def host_syncs(self) -> int:
        """Waits for a pinned slot still being copied (none while at most 3 steps are queued)."""
        return self._upload.host_syncs

    def close(self) -> None:
        """Free the pinned ring (the pipeline calls it at its close)."""
        self._upload.close()


class NGramDrafter(HostDrafter):
    """Prompt lookup: the ids that followed the latest earlier occurrence of the row's last
    ``n`` ids (``n`` from ``max_n`` down to ``min_n``), up to ``k`` of them; ``NO_TOKEN`` where
    none was found. Deterministic (one-hot drafts), no second model.

    Parameters
    ----------
    k : int
        Drafts a row, 1 to ``MAX_DRAFTS``.
    max_n, min_n : int, optional
        The longest and shortest suffix looked up (default 3 and 1).

    Raises
    ------
    ValueError
        ``k`` out of range, or not ``1 <= min_n <= max_n``.

    Examples
    --------
    >>> from metrale_feed.sched.speculative import NGramDrafter
    >>> NGramDrafter(3).lookup([5, 6, 7, 9, 5, 6], 3)
    [7, 9, 5]
    """

    def __init__(self, k: int, max_n: int = 3, min_n: int = 1) -> None:
        max_n, min_n = _checks.integer(max_n, "max_n"), _checks.integer(min_n, "min_n")
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} and max_n={max_n}")
        super().__init__(k)
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, history: Sequence[int], k: int) -> List[int]:
        """The ``k`` drafts after ``history`` (``NO_TOKEN`` past what the lookup found)."""
        h = list(history)
        for n in range(min(self.max_n, len(h) - 1), self.min_n - 1, -1):
            suffix = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):  # the latest earlier occurrence first
                if h[start:start + n] == suffix:
                    found = h[start + n:start + n + k]
                    return found + [NO_TOKEN] * (k - len(found))
        return [NO_TOKEN] * k

    def draft(self, history: Sequence[int], k: int, seed: int, mask: Tuple[int, int]) -> List[int]:
        return self.lookup(history, k)


class _SpecView(SequenceState):
    """A speculative request's KV view: ``seq_len`` is the positions whose KV holds a committed
    id (``req._base``: the prefilled history, then each step's input and accepted drafts), set
    by prefill while the request waits and by ``SpeculativeStep`` once a step's counts are read."""

    __slots__ = ("req",)

    def __init__(self, req: "Request", slot_idx: int) -> None:
        self.req = req
        super().__init__(slot_idx)

    @property
    def seq_len(self) -> int:
        return self.req._base

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        from .pipeline import RequestStatus

        if self.req.status is not RequestStatus.RUNNING:  # prefill fills the cache
            self.req._base = value

    @property
    def tokens(self) -> List[int]:
        req = self.req
        return (list(req.prompt) + req.tokens)[: req._base]

    @tokens.setter
    def tokens(self, value: List[int]) -> None:
        pass  # derived from the request


class SpeculativeStep:
    """The pipeline's step when ``speculative=`` is given: draft, verify, settle, commit.

    Each step is launched and its counts read in the same ``step()`` call (depth 1: one host
    wait a step), so the next step's inputs and positions are the committed ones.

    Parameters
    ----------
    pipe : DecodePipeline
    drafter : Drafter
    """

    def __init__(self, pipe: "DecodePipeline", drafter: Any) -> None:
        k = check_drafter(drafter)
        model = pipe.model
        if not callable(getattr(model, "decode_batch_verify", None)):
            raise TypeError(f"speculative decoding needs a model with decode_batch_verify(input_ids, "
                            f"seqs, k, stream); {type(model).__name__} has none")
        if pipe._block_size is None or pipe._pool is None:
            raise TypeError("speculative decoding needs a model with block_size and pool (a "
                            "BlockPool): the pipeline reserves the k + 1 positions itself")
        if pipe.shard is not None:
            raise ValueError("speculative decoding is not sharded yet (verify_to_feed takes no shard)")
        if pipe.depth != 1:
            raise ValueError("speculative decoding runs at depth=1 for now (each verify step is "
                             "settled before the next is drafted); pass depth=1")
        rows = pipe.max_rows
        if rows * (k + 1) > _core.MAX_ROWS:
            raise ValueError(f"max_rows x (k + 1) = {rows * (k + 1)} logit rows is more than "
                             f"{_core.MAX_ROWS}")
        self.pipe, self.k, self.drafter = pipe, k, drafter
        self.inputs = _core.DeviceBuffer(rows * 4)
        self.drafts = _core.DeviceBuffer(rows * k * 4)
        self.fed = _core.DeviceBuffer(rows * (k + 1) * 4)
        self.cells = _core.DeviceBuffer(rows * (k + 2) * 4)
        self.dst = _core.PinnedBuffer(rows * (k + 2) * 4)
        self.done = _core.Event()
        self.host_syncs = 0
        self._closed = False

    # ---- KV ----

    def _reserve(self, rows: List["Request"]) -> List["Request"]:
        """Blocks for every row's ``k + 1`` positions; when the pool runs dry the youngest
        running row gives its blocks back and waits to resume (recompute). Returns the rows
        left."""
        from .pipeline import RequestStatus, _order_of

        pipe, bs, pool = self.pipe, self.pipe._block_size, self.pipe._pool
        assert bs is not None and pool is not None
        stats = pipe.io.stats
        for req in list(rows):
            seq = req._seq
            while req.status is RequestStatus.RUNNING and seq is not None and \
                    (req._base + self.k) // bs >= len(seq.block_table):
                try:
                    seq.block_table.append(pool.alloc())
                    stats.reserved_blocks += 1
                except KvPoolExhausted:
                    victim = max((r for r in rows if r.status is RequestStatus.RUNNING),
                                 key=_order_of)
                    pipe._preempt(victim)
                    rows = [r for r in rows if r is not victim]
        return rows

    def _trim(self, req: "Request") -> None:
        """Give back the blocks that hold only rejected positions (at or past ``_base``)."""
        seq, bs = req._seq, self.pipe._block_size
        assert seq is not None and bs is not None
        extra = len(seq.block_table) - -(-req._base // bs)
        if extra > 0:
            self.pipe.model.release_decode_blocks(seq, extra)
            self.pipe.stats.spec_blocks_returned += extra

    # ---- the step ----

    def step(self) -> bool:
        """One verify step of every running row (after admitting); False when none ran."""
        from .pipeline import RequestStatus

        pipe, k = self.pipe, self.k
        launch = pipe._launches
        if pipe._waiting and len(pipe._running) < pipe.max_rows:
            pipe._admit(launch)
        rows = self._reserve(list(pipe._running))
        if not rows:
            return False
        n_rows, stream = len(rows), pipe.stream
        histories = [list(r.prompt) + r.tokens for r in rows]
        masks = [(int(r._mask[0]), int(r._mask[1])) for r in rows]
        inputs = [FeedSource.host(h[-1]) for h in histories]
        _core.resolve_feed(inputs, self.cells, self.inputs, stream, prev_rows=1)
        self.drafter.propose(DraftBatch(n_rows, k, self.inputs, histories,
                                        [r.seed for r in rows], masks), self.drafts, stream)
        # The fed ids, gathered on the device: row r's input, then its k drafts.
        sources: List[int] = []
        for r, source in enumerate(inputs):
            sources.append(source)
            sources.extend(FeedSource.feed(r * k + j) for j in range(k))
        _core.resolve_feed(sources, self.drafts, self.fed, stream, prev_rows=n_rows * k)
        model: Any = pipe.model  # a verify-capable model (checked at construction)
        logits = model.decode_batch_verify(self.fed, [r._seq for r in rows], k, stream)
        vmasks = None
        if any(r._ban is not None for r in rows):
            vmasks = [m for m in masks for _ in range(k + 1)]  # one pair per logit row
        params = None
        if any(r.temperature > 0.0 for r in rows):
            import numpy as np

            from ..sampling import SAMPLING_PARAMS_DTYPE

            params = np.zeros(n_rows, SAMPLING_PARAMS_DTYPE)
            for field in ("temperature", "top_k", "top_p", "min_p", "seed"):
                params[field] = [getattr(r, field) for r in rows]
            params["position"] = [len(h) for h in histories]  # the first emitted id's position
        words = n_rows * (k + 2)
        _core.verify_to_feed(logits, self.drafts, self.cells, self.dst, self.done, stream, k=k,
                             masks=vmasks, params=params, rows=n_rows, vocab=pipe.vocab,
                             dtype=model.feed_logits_dtype,
                             row_stride=getattr(model, "feed_row_stride", None))
        pipe._launches = launch + 1
        pipe.io.stats.launches += 1
        pipe.stats.steps += 1
        try:
            self.host_syncs += 1
            self.done.synchronize()
        except BaseException as exc:
            pipe._fault(launch, 0, exc)
            raise
        got = _core.read_pinned_u32(self.dst.ptr, words)
        self._commit(rows, got)
        return True

    def _commit(self, rows: List["Request"], got: Sequence[int]) -> None:
        from .pipeline import RequestStatus

        k, stats, pipe = self.k, self.pipe.stats, self.pipe
        for i, req in enumerate(rows):
            at = i * (k + 2)
            n = got[at]
            stats.drafted += k
            stats.accepted += n - 1
            stats.emitted += n
            if req.status is not RequestStatus.RUNNING:  # preempted or aborted during the step
                continue
            req._base += n  # the input and the n - 1 accepted drafts now hold committed KV
            finish = None
            for j in range(n):
                token = got[at + 1 + j]
                req.tokens.append(token)
                if token in req.stop_ids and len(req.tokens) >= req.min_tokens:
                    finish = RequestStatus.FINISHED_STOPPED
                elif len(req.tokens) >= req.max_new_tokens:
                    finish = RequestStatus.FINISHED_LENGTH
                if finish is not None:
                    stats.spec_discarded += n - 1 - j  # emitted past the stop: never shown
                    break
            if finish is not None:
                pipe._finish(req, finish)
            else:
                self._trim(req)

    def close(self) -> None:
        """Free the step's buffers and the drafter's (its ``close``, when it has one)."""
        if self._closed:
            return
        self._closed = True
        for buf in (self.inputs, self.drafts, self.fed, self.cells, self.dst):
            buf.close()
        self.done.close()
        close = getattr(self.drafter, "close", None)
        if callable(close):
            close()
