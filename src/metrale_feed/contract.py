"""What a model declares to the scheduler (docs/design.md, "The model contract").

``ModelDeviceFeed`` (``metrale_feed.trait``) is the engine's trait, with its default bodies. The
scheduler above it (``sched/``) asks for capabilities, not attributes: each is a runtime-checkable
``Protocol`` below, and the facts it needs about a model's KV cache and logits come in one
``FeedInfo``, read once when a router or a pipeline is made (as an engine's scheduler is handed
its KV configuration). ``require`` refuses, at that construction, a model that lacks a method the
caller needs, naming it.

=======================  ==============================================================
``DeviceTokenFeed``      every method of the trait (``ModelDeviceFeed``): ``decode_batch_fed``,
                         the feed methods, the events and the readback ring's pinned memory
``HostTokenDecode``      ``decode_batch(tokens, seqs, stream)``: a step whose inputs the host
                         knows; it pushes each id and advances ``seq_len``
``Prefill``              ``prefill(seq, ids, stream)``
``BatchPrefill``         ``prefill_many(seqs, id_lists, stream)``: one forward for many
``DescribesFeed``        ``feed_info() -> FeedInfo``
``VerifyStep``           ``decode_batch_verify(input_ids, seqs, k, stream, advance=None)``:
                         a speculative step's forward over ``k + 1`` positions a row
``ReservesAhead``        ``reserve_blocks_through(seq, last)``: the blocks up to position
                         ``last``, all or none (a speculative step's reservation)
=======================  ==============================================================

What a model's methods accept beyond the Protocols' positional calls is declared too, in
``FeedInfo``, never read from their signatures: ``sampling`` (its ``sample_batch_to_feed``
draws), ``logprobs``, ``top_logprobs`` and ``raw_logits`` (its feed methods take those
keywords), ``verify_advance`` (its ``decode_batch_verify`` takes ``advance=``), ``penalties``,
``grammar`` and ``bitmask`` (its feed methods take those keywords too). One rule gives each its default:
what the trait and the Protocols above declare. The trait's feed methods and ``VerifyStep`` take
the first keywords, so those default to True (a model whose methods lack them says False); the
trait's ``sample_batch_to_feed`` draws nothing and its feed methods are older than
``penalties=``, ``grammar=`` and ``bitmask=``, so those default to False (the runtime mixin says True).
"""

from __future__ import annotations

from typing import (TYPE_CHECKING, Any, NamedTuple, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

from .kv import BlockPool, SequenceState
from .trait import ModelDeviceFeed

__all__ = ["FeedInfo", "DeviceTokenFeed", "HostTokenDecode", "Prefill", "BatchPrefill",
           "DescribesFeed", "DefersForward", "VerifyStep", "ReservesAhead", "require", "feed_info_of"]


class FeedInfo(NamedTuple):
    """What the scheduler knows of a model's feed and KV cache, read once at construction.

    Attributes
    ----------
    vocab : int
        Logits per row (the whole vocabulary, with a shard too).
    max_rows : int or None
        The most rows one of its steps may have; None: no limit of its own.
    block_size : int or None
        Positions per KV block; None when the model does not say (then the scheduler asks
        ``reserve_decode_block`` for every row of every step).
    pool : BlockPool or None
        The pool its blocks come from (its ``num_blocks`` and ``free_count``); None when unknown
        (no admission by free blocks, no never-fits check at submit).
    shard : VocabShard or None
        The vocabulary split its feed goes through.
    logits_dtype : str
        The logits' dtype name (``"float32"``, ``"bfloat16"``, ``"float16"``).
    sampling : bool
        Whether ``sample_batch_to_feed`` draws (else a sampled request is refused at submit).
        Default False.
    logprobs : bool
        Whether both feed methods take ``logprobs=`` and ``logprobs_dst=`` (else
        ``submit(logprobs=True)`` is refused). Default True, as the trait declares them.
    top_logprobs : bool
        Whether both take ``top_logprobs=``, ``top_logprobs_dst=`` and ``top_n=`` (else
        ``top_logprobs > 0`` is refused). Default True.
    raw_logits : bool
        Whether both take ``raw_logits=`` (else logprobs with penalties are refused). Default
        True.
    verify_advance : bool
        Whether ``decode_batch_verify`` takes ``advance=`` (else speculative decoding runs at
        depth 1 only). Default True, as ``VerifyStep`` declares it.
    penalties : bool
        Whether both feed methods take ``penalties=`` (a ``PenaltyLaunch``, docs/penalties.md,
        "One call a step"): the pipeline then hands them a step's penalties instead of queuing
        the apply and the update around them. Default False (the trait's methods are older than
        the keyword); ``RuntimeFeedMixin`` says True.
    grammar : bool
        Whether both feed methods take ``grammar=`` (the ops' ``(automaton, states, scratch)``,
        docs/kernels.md, "Grammar in a pick") and pass it to the pick: else a request with a
        grammar is refused at submit (a speculative pipeline's verify is its own call, so it
        needs none). Default False; ``RuntimeFeedMixin`` says True while both are its own.
    bitmask : bool
        Whether both feed methods take ``bitmask=`` (device int32 words, ``ceil(vocab / 32)`` a
        row, bit ``v % 32`` of word ``v // 32`` allowing id ``v``) and pass it to the pick: else a
        request with a ``HostGrammar`` is refused at submit. Default False; ``RuntimeFeedMixin``
        says True while both are its own.
    step : bool
        Whether the model has ``pick_to_feed(step)``, which takes a launch as one ``PickStep``
        (docs/design.md, "How a request's parameters reach the kernel"): the scheduler then hands
        it the step it built instead of calling ``argmax_batch_to_feed`` or
        ``sample_batch_to_feed`` with its fields as keywords. Default False; ``RuntimeFeedMixin``
        says True while its feed methods are its own.

    Examples
    --------
    >>> from metrale_feed.contract import FeedInfo
    >>> info = FeedInfo(vocab=1000)
    >>> info.block_size is None, info.sampling, info.logprobs
    (True, False, True)
    """

    vocab: int
    max_rows: Optional[int] = None
    block_size: Optional[int] = None
    pool: Optional[BlockPool] = None
    shard: Any = None
    logits_dtype: str = "float32"
    sampling: bool = False
    logprobs: bool = True
    top_logprobs: bool = True
    raw_logits: bool = True
    verify_advance: bool = True
    penalties: bool = False
    grammar: bool = False
    bitmask: bool = False
    step: bool = False


def _trait_protocol() -> Any:
    """``DeviceTokenFeed``: the public methods of the trait (``ModelDeviceFeed``, trait.py, the
    one place they are written), as a runtime-checkable Protocol."""
    members = {name: value for name, value in vars(ModelDeviceFeed).items()
               if callable(value) and not name.startswith("_")}
    members.update(__module__=__name__, __qualname__="DeviceTokenFeed", __doc__=(
        "A model that decodes with its input ids read on the device: every method of the trait "
        "(``ModelDeviceFeed``), whose subclasses have them all."))
    return runtime_checkable(type("DeviceTokenFeed", (Protocol,), members))


if TYPE_CHECKING:  # a type checker reads the trait itself
    DeviceTokenFeed = ModelDeviceFeed
else:
    DeviceTokenFeed = _trait_protocol()


@runtime_checkable
class HostTokenDecode(Protocol):
    """A decode step whose input ids the host knows: writes them at each row's ``seq_len``,
    pushes them to ``seq.tokens`` and advances ``seq_len``; returns the logits."""

    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                     stream: Any) -> Any: ...


@runtime_checkable
class Prefill(Protocol):
    """Writes ``ids`` at positions ``seq.seq_len..`` (taking the blocks it needs, all or none),
    appends them to ``seq.tokens`` and advances ``seq_len``; computes no logits."""

    def prefill(self, seq: SequenceState, ids: Sequence[int], stream: Any) -> None: ...


@runtime_checkable
class BatchPrefill(Protocol):
    """``prefill`` of several sequences in one call (blocks for all of them or none)."""

    def prefill_many(self, seqs: Sequence[SequenceState], id_lists: Sequence[Sequence[int]],
                     stream: Any) -> None: ...


@runtime_checkable
class DescribesFeed(Protocol):
    """A model that says its ``FeedInfo`` (the runtime mixin and the paged-KV mixin do)."""

    def feed_info(self) -> FeedInfo: ...


@runtime_checkable
class DefersForward(Protocol):
    """A model whose ``decode_batch_fed`` may hold its forward back, to launch it with the feed
    method as one graph: the logits it returns are written only then. Before anything touches a
    step's logits between the two calls (the penalties, a copy of the raw logits for logprobs),
    the router calls ``flush_forward``, which queues the held-back forward now (the step then
    runs as the eager path does)."""

    def flush_forward(self, stream: Any) -> None: ...


@runtime_checkable
class VerifyStep(Protocol):
    """A speculative step's forward (docs/speculative.md): row ``r`` reads its ``k + 1`` ids
    from the device at ``r * (k + 1) + j`` and writes them at ``seq.seq_len (+ advance[r]) + j``;
    logit row ``r * (k + 1) + j`` is the logits after that position; ``seq_len`` is left as it
    is. ``advance`` (device, one uint32 a row) is needed at depth 2 only."""

    def decode_batch_verify(self, input_ids: Any, seqs: Sequence[SequenceState], k: int,
                            stream: Any = None, advance: Any = None) -> int: ...


@runtime_checkable
class ReservesAhead(Protocol):
    """A model whose blocks can be taken for positions past ``seq_len`` (a speculative step's
    ``k + 1``, and at depth 2 the ones the step in flight writes): ``KvBudget.extend`` takes them
    through it, all or none, so a refused extend leaves the pool and every block table as they
    were (``PagedKvMixin`` has it)."""

    def reserve_blocks_through(self, seq: SequenceState, last: int) -> int: ...


def require(model: Any, who: str, *protocols: Any) -> None:
    """Refuse ``model`` for ``who`` unless it has every method of ``protocols``.

    Raises
    ------
    TypeError
        Naming the first missing method and the capability it belongs to.
    """
    for proto in protocols:
        if isinstance(model, proto):
            continue
        missing = [name for name in _methods(proto) if not callable(getattr(model, name, None))]
        raise TypeError(f"{who} needs a model with {missing[0]}() ({proto.__name__}); "
                        f"{type(model).__name__} has none")


def _methods(proto: Any) -> Tuple[str, ...]:
    return tuple(sorted(name for name in proto.__dict__ if not name.startswith("_")
                        and callable(proto.__dict__[name])))


def feed_info_of(model: Any, vocab: Optional[int] = None) -> FeedInfo:
    """The model's ``FeedInfo``; ``vocab`` (when given) overrides its vocabulary, and stands in
    for the whole of it for a model that declares none.

    Raises
    ------
    TypeError
        Neither the model nor ``vocab`` gives the vocabulary, or ``feed_info()`` returned
        something else than a ``FeedInfo``.
    """
    if isinstance(model, DescribesFeed):
        info = model.feed_info()
        if not isinstance(info, FeedInfo):
            raise TypeError(f"{type(model).__name__}.feed_info() must return a FeedInfo, not "
                            f"{type(info).__name__}")
        return info if vocab is None else info._replace(vocab=vocab)
    if vocab is None:
        raise TypeError(f"the vocabulary is unknown: {type(model).__name__} has no feed_info() "
                        "(the runtime mixin's), so pass vocab=")
    return FeedInfo(vocab=vocab)
