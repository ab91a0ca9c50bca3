"""``StepHost``: what a step kind that runs in place of the pipeline's own step
(``SpeculativeStep``) may read and call of the ``DecodePipeline`` it runs in, declared in one
place. ``DecodePipeline`` implements it; the step kind names this protocol, never the pipeline
class (which imports it), so the modules of ``sched`` import one another in one direction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Deque, List, Optional, Protocol

if TYPE_CHECKING:
    from ..contract import FeedInfo
    from .budget import KvBudget
    from .penalized import PipelinePenalties
    from .request import Request, RequestOwner, RequestStatus
    from .stats import PipelineStats

__all__ = ["StepHost"]


class StepHost(Protocol):
    """The members of ``DecodePipeline`` a step kind uses, and nothing else.

    Attributes
    ----------
    model, info, depth, max_rows, shard, stream, vocab
        The pipeline's configuration, as its constructor checked it (``info`` is the model's
        ``FeedInfo``: its block size, pool, logits dtype, and whether its verify advances).
    stats : PipelineStats
        The step kind counts its steps, discarded rows and returned blocks there.
    budget : KvBudget
        The one owner of the KV blocks in flight.
    _owner : RequestOwner
        The launch count (the step kind's launch takes the next number and writes it back) and
        the masks' flag (set by a ban; the launch that gathers the masks clears it).
    _running, _waiting
        The running requests (in launch order) and the queue; read, never written.
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
    _owner: "RequestOwner"
    _running: List["Request"]
    _waiting: Deque["Request"]

    def _admit(self, launch: int) -> None:
        """Admit waiting requests (first come, first served) for launch ``launch``."""

    def _reserve_or_preempt(self, rows: List["Request"], due: List["Request"],
                            reserve: Callable[[List["Request"]], int]) -> List["Request"]:
        """Take blocks through ``reserve``, preempting the youngest row while the pool is dry;
        the rows left."""
        ...

    def _penalties(self, rows: List["Request"]) -> Optional["PipelinePenalties"]:
        """The penalties' hook for a batch, None when no row has penalties."""

    def _grammar(self, rows: List["Request"]) -> Any:
        """A batch's ``grammar=`` argument, None when no row has a grammar."""

    def _finish(self, req: "Request", status: "RequestStatus") -> None:
        """Finish ``req`` with ``status``: it leaves the batch and gives its blocks back."""

    def _fault(self, launch: int, added: int, exc: BaseException) -> None:
        """A failed step: every running request finishes with ``"error"``."""
