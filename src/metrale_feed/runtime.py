"""``RuntimeFeedMixin``: the runtime half of ``ModelDeviceFeed`` on the active backend, so a model
author writes only the forward and the KV methods.

Put it before ``ModelDeviceFeed`` in the bases and call ``init_device_feed`` once::

    class MyModel(RuntimeFeedMixin, ModelDeviceFeed):
        def __init__(self):
            self.init_device_feed(vocab=32000, logits_dtype="bfloat16", max_rows=256)
"""

from __future__ import annotations

from typing import Any, Optional

from . import _core
from .contract import FeedInfo
from .dtypes import logits_dtype as logits_dtypes
from .errors import DeviceError, FeedError

__all__ = ["RuntimeFeedMixin"]


def _rows_of(masks: Any) -> int:
    """The rows a masks argument covers: pairs, or a buffer of two uint32 ids a row."""
    try:
        view = memoryview(masks)
    except TypeError:
        return len(masks)
    with view:
        return view.nbytes // 8


def _step_rows(step: Any) -> int:
    """The rows of a model's step: its params' records, else its masks' pairs (read only where
    the top logprobs need them, not on every step)."""
    return len(step.params) if step.params is not None else _rows_of(step.masks)


def _top_before_penalties(penalties: Any) -> None:
    # The top lists would be read before the call applies the penalties, the chosen id after.
    if penalties is not None:
        raise ValueError("top_logprobs with penalties= needs raw_logits (the logits before the "
                         "penalties), which both logprobs are then taken from")


def _ran_in_part(what: str, exc: BaseException) -> DeviceError:
    """The error of a step refused after its pick was queued: the feed cells (and with penalties
    the counts) already hold this step, so a retry would not be the same step. ``DeviceError``,
    which a scheduler treats as a failed step, never as a refusal to retry (docs/pipeline.md,
    "Faults"); the refusal is its ``__cause__``."""
    return DeviceError(f"the step's ids were picked, then {what} was refused "
                       f"({type(exc).__name__}: {exc}): the step ran in part and cannot be retried")


class RuntimeFeedMixin:
    """The runtime half of ``ModelDeviceFeed`` on the active backend: events, async copies, pinned
    memory, and the masked argmax into this model's feed cells (``feed_cells``).

    Put it before ``ModelDeviceFeed`` in the bases and call ``init_device_feed`` once; the model
    then writes its forward (``decode_batch_fed``) and its KV methods.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> class MyModel(mf.RuntimeFeedMixin, mf.ModelDeviceFeed):
    ...     def __init__(self):
    ...         self.init_device_feed(vocab=32000, logits_dtype="bfloat16", max_rows=8)
    >>> model = MyModel()
    >>> model.feed_cells.nbytes     # one uint32 feed cell per row
    32
    >>> model.close_device_feed()
    """

    feed_vocab: int
    feed_logits_dtype: str
    feed_max_rows: int
    feed_cells: Optional[_core.DeviceBuffer] = None
    feed_prev_rows: int = 0  # rows the last argmax wrote: the from_row bound of the next step
    feed_shard: Any = None  # a VocabShard: the logits hold its slice's columns
    feed_row_stride: Optional[int] = None  # elements between the logits' rows, when not the width

    def init_device_feed(self, *, vocab: int, logits_dtype: Any = "float32", max_rows: int = 256,
                         shard: Any = None, row_stride: Optional[int] = None) -> None:
        """Allocate the feed cells and fix the logits' shape.

        Parameters
        ----------
        vocab : int
            Logits per row, 1 to ``metrale_feed.MAX_VOCAB`` (2**24).
        logits_dtype : dtype spelling, optional
            Any spelling ``metrale_feed.dtype`` knows: ``"float32"`` (default), ``"bf16"``,
            ``numpy.float16``, ``torch.bfloat16``, ...
        max_rows : int, optional
            The most rows a step may have, 1 to ``metrale_feed.MAX_ROWS`` (4096). Default 256.
        shard : VocabShard, optional
            A vocabulary split across ranks (docs/tensor-parallel.md), passed to both feed
            methods: the logits then hold the slice's ``shard.width`` columns, while
            ``vocab`` stays the whole vocabulary (ids are global), equal to ``shard.vocab``.
        row_stride : int, optional
            Elements between the logits' rows when wider than their columns (padded heads).

        Raises
        ------
        ValueError
            An argument out of range.
        """
        if not 1 <= max_rows <= _core.MAX_ROWS:
            raise ValueError(f"max_rows must be in [1, {_core.MAX_ROWS}], got {max_rows}")
        if not 1 <= vocab <= _core.MAX_VOCAB:
            raise ValueError(f"vocab must be in [1, 2**24], got {vocab}")
        if shard is not None:
            if shard.vocab != vocab:
                raise ValueError(f"the shard's vocabulary is {shard.vocab}, not {vocab}")
            if max_rows > shard.max_rows:
                raise ValueError(f"max_rows {max_rows} is more than the shard's {shard.max_rows}")
        self.feed_shard = shard
        self.feed_row_stride = row_stride
        self.feed_vocab = vocab
        self.feed_logits_dtype = logits_dtypes(logits_dtype).name
        self.feed_max_rows = max_rows
        self.feed_cells = _core.DeviceBuffer(max_rows * 4)
        self.feed_prev_rows = 0

    def feed_info(self) -> FeedInfo:
        """What the scheduler reads once at construction (``metrale_feed.contract.FeedInfo``):
        the vocabulary, the row limit, the shard, the logits' dtype, sampling (True: the mixin's
        ``sample_batch_to_feed`` draws), penalties, grammar and bitmask (True while both feed
        methods and ``pick_to_feed`` are the mixin's, which take ``penalties=``, ``grammar=`` and
        ``bitmask=``; a subclass that overrides one says so itself once its override passes the
        keywords on), step (True while both feed methods are the mixin's, which build a step and
        hand it to ``pick_to_feed``: the scheduler then hands it its own).
        ``PagedKvMixin`` adds the block size and pool."""
        cls = type(self)
        # The trait's methods build a step and call pick_to_feed: while they are the mixin's, the
        # scheduler may hand its step to pick_to_feed (the model's own, overridden or not).
        steps = (cls.argmax_batch_to_feed is RuntimeFeedMixin.argmax_batch_to_feed
                 and cls.sample_batch_to_feed is RuntimeFeedMixin.sample_batch_to_feed)
        own = steps and cls.pick_to_feed is RuntimeFeedMixin.pick_to_feed
        return FeedInfo(vocab=self.feed_vocab, max_rows=self.feed_max_rows, shard=self.feed_shard,
                        logits_dtype=self.feed_logits_dtype, sampling=True, penalties=own,
                        grammar=own, bitmask=own, step=steps)

    def close_device_feed(self) -> None:
        """Free the feed cells (after queued work). Idempotent.
        """
        if self.feed_cells is not None:
            self.feed_cells.close()
            self.feed_cells = None

    def supports_device_token_feed(self) -> bool:
        return self.feed_cells is not None

    def _top_logprobs(self, logits: Any, rows: int, top_logprobs: Any, top_logprobs_dst: Any,
                      top_n: int, stream: Any) -> None:
        """The raw logits' top ids and their copy back, queued before the feed method's event
        record (and before anything may change the logits)."""
        if top_logprobs is None:
            return
        if self.feed_shard is not None:
            # Each rank's own top n, merged alike on every rank (VocabShard.top_logprobs), queued
            # before the sharded feed call on the same stream, as the shard's calls must be.
            self.feed_shard.top_logprobs(logits, top_logprobs, stream, n=top_n, rows=rows,
                                         dtype=self.feed_logits_dtype,
                                         row_stride=self.feed_row_stride)
            _core.copy_d2h_async(top_logprobs, top_logprobs_dst, stream)
            return
        _core.top_logprobs(logits, top_logprobs, stream, n=top_n, rows=rows, vocab=self.feed_vocab,
                           dtype=self.feed_logits_dtype, row_stride=self.feed_row_stride)
        _core.copy_d2h_async(top_logprobs, top_logprobs_dst, stream)

    def _raw_logprobs(self, raw_logits: Any, rows: int, logprobs: Any, logprobs_dst: Any,
                      top_logprobs: Any, top_logprobs_dst: Any, top_n: int, event: Any,
                      stream: Any) -> None:
        """After an argmax or a draw over changed logits (no event recorded yet): the chosen
        ids' logprobs (the cells) and the top ids, from the raw copy, their copies back, then
        the event, so all are final when it completes. The pick was queued before: anything
        refused here is raised as ``DeviceError`` (``_ran_in_part``)."""
        n = top_n if top_logprobs is not None else 0
        try:
            if self.feed_shard is not None:
                # Each rank's slice of the raw copy, merged alike on every rank; the ids are the
                # cells the sharded call just wrote, the same on every rank.
                self.feed_shard.top_logprobs(raw_logits, top_logprobs, stream, n=n, rows=rows,
                                             dtype=self.feed_logits_dtype,
                                             row_stride=self.feed_row_stride, ids=self.feed_cells,
                                             chosen=logprobs)
            else:
                _core.top_logprobs(raw_logits, top_logprobs, stream, n=n, rows=rows,
                                   vocab=self.feed_vocab, dtype=self.feed_logits_dtype,
                                   row_stride=self.feed_row_stride, ids=self.feed_cells,
                                   chosen=logprobs)
            _core.copy_d2h_async(logprobs, logprobs_dst, stream)
            if top_logprobs is not None:
                _core.copy_d2h_async(top_logprobs, top_logprobs_dst, stream)
            if event is not None:
                _core.event_record(event, stream)
        except Exception as exc:
            raise _ran_in_part("its raw logprobs", exc) from exc

    def pick_to_feed(self, step: "_core.PickStep") -> None:
        """Launch the scheduler's step (a ``PickStep``, argmax or sample) on this model's feed.

        The one feed method: the trait's ``argmax_batch_to_feed`` and ``sample_batch_to_feed``
        build a step from their keywords and come here. Queues the step's top logprobs (from
        ``raw_logits`` after the pick when given, else from the logits before it), completes the
        step with this model's feed (``PickStep.on``: the cells, the vocabulary or the shard's
        width, the dtype, the row stride, the shard) and hands it to ``metrale_feed.pick_to_feed``.
        """
        if self.feed_cells is None:
            raise FeedError(f"{step.op}_batch_to_feed: call init_device_feed first")
        shard = self.feed_shard
        on_feed = step.on(self.feed_cells, self.feed_vocab if shard is None else shard.width,
                          self.feed_logits_dtype, self.feed_row_stride, shard)
        if step.raw_logits is not None and step.logprobs is not None:
            self.feed_prev_rows = _core.pick_to_feed(
                on_feed.replace(event=None, logprobs=None, logprobs_dst=None))
            self._raw_logprobs(step.raw_logits, _step_rows(step), step.logprobs,
                               step.logprobs_dst, step.top_logprobs, step.top_logprobs_dst,
                               step.top_n, step.event, step.stream)
            return
        if step.top_logprobs is not None:
            _top_before_penalties(step.penalties)
            self._top_logprobs(step.logits, _step_rows(step), step.top_logprobs,
                               step.top_logprobs_dst, step.top_n, step.stream)
        self.feed_prev_rows = _core.pick_to_feed(on_feed)

    def argmax_batch_to_feed(self, logits: Any, masks: Any, dst: Any, event: Any, stream: Any,
                             *, logprobs: Any = None, logprobs_dst: Any = None,
                             top_logprobs: Any = None, top_logprobs_dst: Any = None,
                             top_n: int = 0, raw_logits: Any = None, penalties: Any = None,
                             grammar: Any = None, bitmask: Any = None) -> None:
        self.pick_to_feed(_core.PickStep(
            "argmax", logits=logits, masks=masks, dst=dst, event=event, stream=stream,
            logprobs=logprobs, logprobs_dst=logprobs_dst, top_logprobs=top_logprobs,
            top_logprobs_dst=top_logprobs_dst, top_n=top_n, raw_logits=raw_logits,
            penalties=penalties, grammar=grammar, bitmask=bitmask))

    def sample_batch_to_feed(self, logits: Any, params: Any, masks: Any, dst: Any, event: Any,
                             stream: Any, *, logprobs: Any = None, logprobs_dst: Any = None,
                             top_logprobs: Any = None, top_logprobs_dst: Any = None,
                             top_n: int = 0, raw_logits: Any = None, penalties: Any = None,
                             grammar: Any = None, bitmask: Any = None) -> None:
        self.pick_to_feed(_core.PickStep(
            "sample", logits=logits, params=params, masks=masks, dst=dst, event=event,
            stream=stream, logprobs=logprobs, logprobs_dst=logprobs_dst,
            top_logprobs=top_logprobs, top_logprobs_dst=top_logprobs_dst, top_n=top_n,
            raw_logits=raw_logits, penalties=penalties, grammar=grammar, bitmask=bitmask))

    def create_event(self) -> int:
        return _core.event_create()

    def event_query(self, event: Any) -> bool:
        return _core.event_query(event)

    def event_synchronize(self, event: Any) -> None:
        _core.event_synchronize(event)

    def destroy_event(self, event: Any) -> None:
        _core.destroy_event(event)

    def copy_d2h_async(self, src: Any, dst: Any, stream: Any) -> None:
        _core.copy_d2h_async(src, dst, stream)

    def alloc_host_pinned(self, nbytes: int) -> int:
        return _core.alloc_host_pinned(nbytes)

    def free_host_pinned(self, ptr: int, nbytes: int) -> None:
        _core.free_host_pinned(ptr, nbytes)
