"""``ModelDeviceFeed``: the engine's trait, with its default bodies (docs/router.md, the trait
table).

A model that runs decode steps ahead of the host overrides what it supports; everything else keeps
the engine's defaults: ``False`` for ``supports_device_token_feed``, ``True`` for ``event_query``,
no-ops for ``fed_step_settled``, ``event_synchronize`` and ``destroy_event``, and a
``NoDeviceTokenFeed`` error (``<method>: this model has no device token feed``) for the rest.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Sequence

from .errors import NoDeviceTokenFeed

if TYPE_CHECKING:
    from .kv import SequenceState

__all__ = ["ModelDeviceFeed"]


def _no_feed(method: str) -> NoDeviceTokenFeed:
    return NoDeviceTokenFeed(f"{method}: this model has no device token feed")


class ModelDeviceFeed(abc.ABC):
    """The trait a model implements to decode with its input ids read on the device.

    Every method keeps the engine's default unless overridden: ``False`` for
    ``supports_device_token_feed``, ``True`` for ``event_query``, no-ops for ``fed_step_settled``,
    ``event_synchronize`` and ``destroy_event``, and ``NoDeviceTokenFeed`` for the rest (the table
    is in docs/router.md). Handles (events, streams) are ints or this package's objects; device
    pointers are ints or objects the runtime accepts. ``RuntimeFeedMixin`` implements the runtime
    methods on the active backend.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> class NoFeed(mf.ModelDeviceFeed):
    ...     pass
    >>> model = NoFeed()
    >>> model.supports_device_token_feed(), model.event_query(0)
    (False, True)
    >>> try:
    ...     model.create_event()
    ... except mf.NoDeviceTokenFeed as error:
    ...     print(error)
    create_event: this model has no device token feed
    """

    def supports_device_token_feed(self) -> bool:
        """Whether the model can run ``decode_batch_fed`` and answer it with
        ``argmax_batch_to_feed``. ``AsyncDeviceIo`` refuses a model that says False."""
        return False

    def decode_batch_fed(self, sources: Sequence[int], seqs: Sequence["SequenceState"],
                         stream: Any) -> int:
        """The decode step over ``seqs`` with each row's input id read on the device from
        ``sources`` (FeedSource words): forward, KV write at position ``seq.seq_len`` and block
        allocation, but no push of the token and no advance of ``seq_len`` (the scheduler core
        does that once the previous step commits). Returns the logits' device pointer."""
        raise _no_feed("decode_batch_fed")

    def argmax_batch_to_feed(self, logits: Any, masks: Any, dst: Any, event: Any,
                             stream: Any, *, logprobs: Any = None, logprobs_dst: Any = None,
                             top_logprobs: Any = None, top_logprobs_dst: Any = None,
                             top_n: int = 0, raw_logits: Any = None, penalties: Any = None) -> None:
        """Masked argmax over ``len(masks)`` rows of ``logits`` into the feed cells, an async
        D2H copy of the ids into pinned ``dst`` and a record of ``event``, all on ``stream``. It
        never synchronises: ``dst`` is valid once ``event`` completes. ``logprobs`` (device,
        one float32 per row) and ``logprobs_dst`` (pinned): the chosen ids' logprobs, as
        ``argmax_to_feed`` takes them. ``top_logprobs`` (device, ``rows * top_n`` records of
        ``_core.top_logprobs``) and ``top_logprobs_dst`` (pinned): each row's ``top_n`` most
        likely ids of the raw logits, copied back before the event too. ``raw_logits`` (with
        ``logprobs``): a copy of the logits before something changed them (the penalties), which
        both logprobs are then taken from, the ids still from ``logits``. The decode pipeline
        passes them only for a request that asks (``submit(logprobs=True, top_logprobs=n)``),
        so a model may leave them out of its signature. ``penalties``: a ``PenaltyLaunch`` of the
        step's rows, applied to ``logits`` before the pick and updated with the chosen ids after
        it (``argmax_to_feed(penalties=)``, docs/penalties.md); the pipeline passes it only to a
        model whose feed methods name it, and queues the two calls around them otherwise.
        Anything refused after the pick was queued (the cells then hold this step) is raised as
        ``DeviceError``: the decode pipeline retries a refused launch only when nothing of its
        pick ran (docs/pipeline.md, "Faults")."""
        raise _no_feed("argmax_batch_to_feed")

    def sample_batch_to_feed(self, logits: Any, params: Any, masks: Any, dst: Any, event: Any,
                             stream: Any, *, logprobs: Any = None, logprobs_dst: Any = None,
                             top_logprobs: Any = None, top_logprobs_dst: Any = None,
                             top_n: int = 0, raw_logits: Any = None, penalties: Any = None) -> None:
        """As ``argmax_batch_to_feed`` with a sampled id per row: ``params`` holds one
        ``SAMPLING_PARAMS_DTYPE`` record per row (temperature 0 is the argmax)."""
        raise _no_feed("sample_batch_to_feed")

    def reserve_decode_block(self, seq: "SequenceState") -> int:
        """Allocate the KV block for position ``seq.seq_len`` if the block table lacks it;
        returns the blocks added (0 or 1). Raises ``KvPoolExhausted`` when the pool is empty."""
        raise _no_feed("reserve_decode_block")

    def release_decode_blocks(self, seq: "SequenceState", blocks: int) -> None:
        """Return the last ``blocks`` entries of the block table (added by
        ``reserve_decode_block`` for a discarded step) to the pool."""
        raise _no_feed("release_decode_blocks")

    def fed_step_settled(self) -> None:
        """A fed step has completed on the device (its CUDA graph may be evicted)."""

    def event_query(self, event: Any) -> bool:
        """Whether the work recorded against ``event`` has completed; never blocks."""
        return True

    def event_synchronize(self, event: Any) -> None:
        """Block the host until the work recorded against ``event`` has completed."""

    def destroy_event(self, event: Any) -> None:
        """Destroy an event made by ``create_event``."""

    def create_event(self) -> int:
        """A new event handle, for the router's readback slots."""
        raise _no_feed("create_event")

    def copy_d2h_async(self, src: Any, dst: Any, stream: Any) -> None:
        """Async device-to-host copy of ``len(dst)`` bytes on ``stream``; ``dst`` must stay valid
        and unread until the stream has passed the copy."""
        raise _no_feed("copy_d2h_async")

    def alloc_host_pinned(self, nbytes: int) -> int:
        """Zeroed page-locked host memory (an int pointer) for the router's readback ring."""
        raise _no_feed("alloc_host_pinned")

    def free_host_pinned(self, ptr: int, nbytes: int) -> None:
        """Free what ``alloc_host_pinned`` returned."""
        raise _no_feed("free_host_pinned")
