"""The decode pipeline's penalties (docs/penalties.md): a ``PenaltyState`` slot per running
request that has any, and each step's apply and update of them.

The pipeline calls it at two points: ``rows(rows)`` when a launch's batch changes (a request
joining gets a slot, written from its prompt and committed tokens: a new request has none, one
resuming after a preemption its committed ones) and ``leave(req)`` when a request leaves the
batch (its slot is cleared in stream order and given back). Each step, the router hands the
batch's ``launch`` to the feed method (``penalties=``, one call a step) when the model says it
takes it (``fused``); otherwise it calls ``apply`` between the forward and the argmax or sampler
and ``update`` after it. Either way both read the slots the last ``rows`` gave, so every step
keeps its own rows' slots with no host synchronisation. A speculative pipeline's verify step
calls ``apply`` with the step's drafts (each position judged with the drafts before it) and
``update`` with the verify's cells (the emitted ids, never the rejected drafts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

from ..errors import FeedError
from ..feed import NO_TOKEN
from ..penalties import MAX_PENALTY_STOPS, PenaltyState

if TYPE_CHECKING:
    from .host import StepHost

__all__ = ["PipelinePenalties"]



class PipelinePenalties:
    """Made by the pipeline at the first request with penalties.

    Parameters
    ----------
    host : StepHost
        The pipeline's (``sched/host.py``): its model, ``max_rows``, stream and ``FeedInfo``.
    capacity : int
        Distinct ids one request's table holds (``DecodePipeline(penalty_capacity=)``).
    k : int, optional
        A speculative pipeline's drafts a row: the launches are a verify's (its ``k + 1``
        logit rows a row), whose cells the step passes to ``update``. Default 0.
    """

    def __init__(self, host: "StepHost", capacity: int, k: int = 0) -> None:
        model = host.model
        self.k = k
        self.cells = getattr(model, "feed_cells", None)
        if self.cells is None and not k:  # a verify's cells are the step's own
            raise FeedError(f"{type(model).__name__} has no device feed cells (feed_cells, as "
                            f"RuntimeFeedMixin models have): penalties cannot be applied on it")
        shard = getattr(model, "feed_shard", None)
        self.start = 0 if shard is None else shard.start
        self.vocab = model.feed_vocab if shard is None else shard.width
        self.dtype = model.feed_logits_dtype
        self.row_stride = getattr(model, "feed_row_stride", None)
        self.state = PenaltyState(host.max_rows, capacity=capacity, stream=host.stream)
        self.slots: List[int] = []  # the last launch's rows' slots
        self.launch: Any = None  # their apply and update, coerced once (PenaltyState.prepare)
        self.max_rows = host.max_rows * (k + 1)  # logit rows
        self.raw: Optional[Any] = None  # the raw logits of a step with logprobs (snapshot)
        # One call a step (docs/penalties.md): the feed method takes the launch and queues the
        # apply and the update itself; over a split vocabulary the update needs the combined ids.
        self.fused = host.info.shard is None and host.info.penalties

    @staticmethod
    def check(model: Any, speculative: bool, prompt: Any, max_new_tokens: int, stop_ids: Any,
              min_tokens: int, capacity: int) -> None:
        """What ``submit`` refuses before queuing a request with penalties, on a pipeline over
        ``model`` (with a speculative step or not: a verify's cells are its own)."""
        if getattr(model, "feed_cells", None) is None and not speculative:
            raise FeedError(f"{type(model).__name__} has no device feed cells (feed_cells, "
                            f"as RuntimeFeedMixin models have): penalties cannot be applied on it")
        distinct = len(set(prompt)) + max_new_tokens
        if distinct > capacity:
            raise ValueError(f"a request with penalties may see {distinct} distinct ids (prompt "
                             f"{len(set(prompt))} + {max_new_tokens} new tokens); the pipeline's "
                             f"penalty_capacity is {capacity}")
        if min_tokens and len(stop_ids) > MAX_PENALTY_STOPS:
            raise ValueError(f"min_tokens bans at most {MAX_PENALTY_STOPS} stop ids; the request "
                             f"has {len(stop_ids)}")

    def rows(self, rows: List[Any]) -> Optional["PipelinePenalties"]:
        """The launch's rows: slots for those that joined; self when any row has penalties (the
        router's hook), else None."""
        slots = []
        any_slot = False
        for req in rows:
            pen = req._pen
            if pen is None:
                slots.append(NO_TOKEN)
                continue
            if req._pslot < 0:
                slot = self.state.acquire()
                try:  # checked once, by submit (``check`` and ``_checks.penalties``)
                    self.state.set_checked(slot, req.prompt, req.tokens, pen, req.stop_ids)
                except BaseException:  # never a slot that was not written: it would do nothing
                    self.state.release(slot)
                    raise
                req._pslot = slot
            slots.append(req._pslot)
            any_slot = True
        if slots != self.slots or self.launch is None:  # a batch's steps reuse its coercion
            self.launch = self.state.prepare(slots, vocab=self.vocab, dtype=self.dtype,
                                             row_stride=self.row_stride, start=self.start,
                                             k=self.k)
            self.slots = slots
        return self if any_slot else None

    def leave(self, req: Any) -> None:
        if req._pslot >= 0:
            slot, req._pslot = req._pslot, -1  # the request names it no more, whatever raises
            self.state.release(slot)

    # ---- the router's hook ----

    def snapshot(self, logits: Any, rows: int, stream: Any) -> Any:
        """A copy of the step's raw logits, queued before ``apply`` changes them, for the
        logprobs of the raw distribution (docs/pipeline.md, "Logprobs"): one buffer of
        ``max_rows`` rows, rewritten each step in stream order (a step's readers run before the
        next step's copy)."""
        from .. import _core
        from ..dtypes import logits_dtype

        stride = self.row_stride or self.vocab
        itemsize = logits_dtype(self.dtype).itemsize
        if self.raw is None:  # (an empty slice of a split vocabulary copies nothing)
            self.raw = _core.DeviceBuffer(max(1, self.max_rows * stride * itemsize))
        if self.vocab:
            _core.copy_d2d_async(self.raw, logits, ((rows - 1) * stride + self.vocab) * itemsize,
                                 stream)
        return self.raw

    def apply(self, logits: Any, stream: Any, drafts: Any = None) -> None:
        """The apply before the feed method (only when it does not take the launch itself), or
        before a verify (its ``drafts``, device, read when it runs)."""
        self.launch.apply(logits, stream, drafts)

    def update(self, stream: Any, cells: Any = None) -> None:
        """The count of the step's ids: the model's feed cells, or a verify's ``cells``."""
        self.launch.update(self.cells if cells is None else cells, stream)

    def close(self) -> None:
        self.state.close()
        if self.raw is not None:
            self.raw.close()
