"""What the parts that run beside ``DecodePipeline`` may use of it, declared in one place:
``StepHost``, the interface, and ``PipelineHost``, the one object that implements it, which the
pipeline makes once and hands them in place of itself.

The speculative step (``SpeculativeStep``), the debug mode, the grammar's words
(``PipelineGrammar``) and the penalties (``PipelinePenalties``) take a ``StepHost``; they name
this module, never the pipeline class (which imports them), so the modules of ``sched`` import
one another in one direction. A ``PipelineHost`` holds the pipeline's configuration, the objects
it shares with them (its stats, KV budget, request owner, running list and queue) and its few
operations, each bound to the pipeline through a weak reference: nothing a step kind keeps
reaches the pipeline, so no reference cycle runs through it (a pipeline dropped without
``close()`` is closed, with its warning, when its last reference goes).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Deque, List, Protocol

if TYPE_CHECKING:
    from ..contract import FeedInfo
    from .budget import KvBudget
    from .request import Request, RequestOwner, RequestStatus
    from .stats import PipelineStats

__all__ = ["PipelineHost", "StepHost"]


class StepHost(Protocol):
    """What a step kind may read and call of the pipeline it runs in, and nothing else.

    Attributes
    ----------
    model, info, depth, max_rows, shard, stream, vocab
        The pipeline's configuration, as its constructor checked it (``info`` is the model's
        ``FeedInfo``: its block size, pool, logits dtype, and whether its verify advances).
        Written once, by the pipeline's constructor.
    stats : PipelineStats
        The pipeline's counters: the step kind counts its steps, discarded rows and returned
        blocks there (as the pipeline counts its own).
    budget : KvBudget
        The one owner of the KV blocks in flight (the router's).
    owner : RequestOwner
        What the requests share of the pipeline: the launch count (a step kind's launch takes
        the next number and writes it back) and the masks' flag (set by a ban; the launch that
        gathers the masks clears it).
    running, waiting
        The running requests (in launch order) and the queue, the pipeline's own list and
        deque: written by the pipeline (admission, finishing, preemption), read by the step
        kind.

    Methods
    -------
    admit(launch)
        Admit waiting requests (first come, first served) for launch ``launch``.
    reserve_or_preempt(rows, due, reserve)
        Take blocks through ``reserve``, preempting the youngest row while the pool is dry; the
        rows left.
    penalties(rows)
        The penalties' hook for a batch (``PipelinePenalties``), None when no row has any.
    grammar(rows)
        A batch's ``grammar=`` argument, None when no row has a grammar.
    finish(req, status)
        Finish ``req`` with ``status``: it leaves the batch and gives its blocks back.
    fault(launch, added, exc)
        A failed step: every running request finishes with ``"error"``.
    """

    model: Any
    info: "FeedInfo"
    depth: int
    max_rows: int
    shard: Any
    stream: Any
    vocab: int
    stats: "PipelineStats"
    budget: "KvBudget"
    owner: "RequestOwner"
    running: List["Request"]
    waiting: Deque["Request"]

    def admit(self, launch: int) -> None:
        """Admit waiting requests (first come, first served) for launch ``launch``."""

    def reserve_or_preempt(self, rows: List["Request"], due: List["Request"],
                           reserve: Callable[[List["Request"]], int]) -> List["Request"]:
        """Take blocks through ``reserve``, preempting the youngest row while the pool is dry;
        the rows left."""
        ...

    def penalties(self, rows: List["Request"]) -> Any:
        """The penalties' hook for a batch (a ``PipelinePenalties``), None when no row has
        penalties."""

    def grammar(self, rows: List["Request"]) -> Any:
        """A batch's ``grammar=`` argument, None when no row has a grammar."""

    def finish(self, req: "Request", status: "RequestStatus") -> None:
        """Finish ``req`` with ``status``: it leaves the batch and gives its blocks back."""

    def fault(self, launch: int, added: int, exc: BaseException) -> None:
        """A failed step: every running request finishes with ``"error"``."""


class PipelineHost:
    """The ``StepHost`` a ``DecodePipeline`` makes once and hands to its step kinds.

    Parameters
    ----------
    model, info, depth, max_rows, shard, stream, vocab, stats, budget, owner, running, waiting
        The members ``StepHost`` declares: the pipeline's configuration and the very objects it
        keeps (``running`` and ``waiting`` are its list and deque, never copies; the pipeline
        never rebinds them).
    admit, reserve_or_preempt, penalties, grammar, finish, fault
        Bound methods of one object (the pipeline), kept as a weak reference to it and the
        functions: a call once it is gone raises ``ReferenceError``.
    """

    __slots__ = ("model", "info", "depth", "max_rows", "shard", "stream", "vocab", "stats",
                 "budget", "owner", "running", "waiting", "_ref", "_admit",
                 "_reserve_or_preempt", "_penalties", "_grammar", "_finish", "_fault")

    def __init__(self, *, model: Any, info: "FeedInfo", depth: int, max_rows: int, shard: Any,
                 stream: Any, vocab: int, stats: "PipelineStats", budget: "KvBudget",
                 owner: "RequestOwner", running: List["Request"], waiting: Deque["Request"],
                 admit: Any, reserve_or_preempt: Any, penalties: Any, grammar: Any,
                 finish: Any, fault: Any) -> None:
        self.model, self.info, self.depth, self.max_rows = model, info, depth, max_rows
        self.shard, self.stream, self.vocab = shard, stream, vocab
        self.stats, self.budget, self.owner = stats, budget, owner
        self.running, self.waiting = running, waiting
        methods = (admit, reserve_or_preempt, penalties, grammar, finish, fault)
        target = admit.__self__
        if any(m.__self__ is not target for m in methods):
            raise ValueError("a PipelineHost's operations are bound methods of one object")
        self._ref = weakref.ref(target)
        (self._admit, self._reserve_or_preempt, self._penalties, self._grammar, self._finish,
         self._fault) = (m.__func__ for m in methods)

    def _target(self) -> Any:
        target = self._ref()
        if target is None:
            raise ReferenceError("the DecodePipeline this step kind ran in was collected")
        return target

    def admit(self, launch: int) -> None:
        self._admit(self._target(), launch)

    def reserve_or_preempt(self, rows: List["Request"], due: List["Request"],
                           reserve: Callable[[List["Request"]], int]) -> List["Request"]:
        kept: List["Request"] = self._reserve_or_preempt(self._target(), rows, due, reserve)
        return kept

    def penalties(self, rows: List["Request"]) -> Any:
        return self._penalties(self._target(), rows)

    def grammar(self, rows: List["Request"]) -> Any:
        return self._grammar(self._target(), rows)

    def finish(self, req: "Request", status: "RequestStatus") -> None:
        self._finish(self._target(), req, status)

    def fault(self, launch: int, added: int, exc: BaseException) -> None:
        self._fault(self._target(), launch, added, exc)
