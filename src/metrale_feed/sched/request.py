"""A submitted request and its state (docs/pipeline.md, "A request's status"): ``RequestStatus``, the
``Request`` that ``DecodePipeline.submit`` returns, and the read-only views of its committed tokens
that a model sees as its ``SequenceState``. The pipeline's loop thread is the one writer of all
of it; the launch numbers kept here are what the pipeline derives positions and lengths from.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

from .. import _checks
from ..errors import FeedError
from ..feed import NO_TOKEN, RowMask
from ..kv import SequenceState
from ..params import SamplingParams

__all__ = ["Request", "RequestStatus", "RequestOwner"]

_UNMASKED_PAIR = (NO_TOKEN, NO_TOKEN)
_GREEDY = SamplingParams()  # the argmax, no penalties, no logprobs


class RequestStatus(enum.Enum):
    """Where a ``Request`` is: ``WAITING`` (submitted, not yet admitted), ``RUNNING`` (in every
    launch from its admission on), ``PREEMPTED`` (its blocks given back when the pool ran dry;
    it resumes by recompute), then one finished state. The finished states' values are the
    ``finish_reason`` strings; ``FINISHED_ERROR`` is a device-side fault of a step the request
    was in (docs/pipeline.md, "Faults"); ``FINISHED_NO_CANDIDATE``, a step that left it no id it
    may pick (docs/pipeline.md, "No candidate"); ``FINISHED_GRAMMAR``, the same for a request
    with a grammar (docs/pipeline.md, "Structured outputs").

    Examples
    --------
    >>> import metrale_feed as mf
    >>> from metrale_feed.testing.reference import ReferenceModel
    >>> model = ReferenceModel(1000, max_rows=2)
    >>> with mf.DecodePipeline(model, 2) as pipe:
    ...     req = pipe.submit([7, 8], max_new_tokens=2)
    ...     before = req.status
    ...     finished = pipe.run()
    >>> model.close()
    >>> before, req.status, req.status.finished
    (<RequestStatus.WAITING: 'waiting'>, <RequestStatus.FINISHED_LENGTH: 'length'>, True)
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a device-side fault: none of its tokens after the fault is kept
    # A step left it no id it may pick (every allowed logit not finite): none of it is committed.
    FINISHED_NO_CANDIDATE = "no_candidate"
    # Its grammar allowed no id it may pick (its ban or min_tokens removed the last one).
    FINISHED_GRAMMAR = "grammar"

    @property
    def finished(self) -> bool:
        """Whether it is one of the finished states."""
        return self.value not in ("waiting", "running", "preempted")


_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


def _order_of(req: "Request") -> int:
    return req._order


class RequestOwner:
    """All a request shares with the pipeline that owns it, in place of the pipeline itself:
    the vocabulary its ``ban`` is checked against, how many steps were launched (a running
    request's ``seq_len`` is derived from it) and the flag a new ban raises so the next launch
    gathers the rows' masks again. The pipeline makes one, is the one writer of ``launches``
    and clears ``masks_dirty``; its requests read it and set ``masks_dirty``, nothing more, so
    a request never reaches up into the pipeline.

    Parameters
    ----------
    vocab : int
        The pipeline's vocabulary.
    """

    __slots__ = ("vocab", "launches", "masks_dirty")

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.launches = 0  # launch numbers given out so far
        self.masks_dirty = True  # a row's mask changed since the last launch gathered them


def check_ban(ban: Any, vocab: int) -> Optional[RowMask]:
    """A ban (``submit(ban=)`` or ``Request.ban``) as a ``RowMask``, or None; TypeError or
    ValueError for anything that is not a pair of ids of the vocabulary (``NO_TOKEN`` where
    unused) or that leaves the argmax no candidate."""
    if ban is None:
        return None
    a, b = ban  # a pair; anything else is a TypeError or ValueError here
    pair = [_checks.integer(a, "ban id"), _checks.integer(b, "ban id")]
    for token in pair:
        if token != NO_TOKEN and not 0 <= token < vocab:
            raise ValueError(f"ban id {token} is outside the vocabulary of {vocab} ids")
    if vocab <= 2 and set(range(vocab)) <= set(pair):
        # The argmax would answer NO_TOKEN: a placeholder must never become an input id.
        raise ValueError(f"the ban {pair} leaves no candidate in a vocabulary of {vocab}")
    return RowMask(pair[0], pair[1])


def refuse_no_candidate(mask: Optional[RowMask], stops: FrozenSet[int], min_tokens: int,
                        vocab: int) -> None:
    """Refuse a request (or a ban set on one) that leaves no id a row may pick while
    ``min_tokens`` bans its stop ids: a sampled row would draw ``NO_TOKEN`` and a greedy one
    a stop id at ``-inf``, never a token it may commit (ValueError)."""
    if not min_tokens or len(stops) + 2 < vocab:
        return
    banned = set(stops)
    if mask is not None:
        banned.update(t for t in mask if t != NO_TOKEN)
    if len(banned) >= vocab:
        raise ValueError(f"min_tokens={min_tokens} bans the stop ids {sorted(stops)}, which "
                         f"with the ban {None if mask is None else list(mask)} leave no id "
                         f"of the vocabulary of {vocab} to pick before it")


class Request:
    """One submitted request. ``tokens`` holds its committed generated ids only.

    Made by ``DecodePipeline.submit``, never directly.

    Parameters
    ----------
    owner : RequestOwner
        What it shares with the pipeline that owns it (it holds no reference to the pipeline).
    prompt : tuple of int
    max_new_tokens : int
    stop_ids : frozenset of int
    ban : RowMask or None
    order : int
        Its place in submission order (first come, first served).
    params : SamplingParams, optional
        How it decodes, checked against the pipeline by ``submit``; greedy by default.

    Attributes
    ----------
    prompt : tuple of int
    tokens : list of int
        Committed generated ids, never a speculative one.
    max_new_tokens : int
    stop_ids : frozenset of int
    status : RequestStatus
        ``WAITING``, ``RUNNING`` (``PREEMPTED`` while it waits to resume), then a finished
        state. The pipeline's loop thread is its one writer.
    finished : bool
        ``status`` is a finished state.
    finish_reason : {"stop", "length", "abort", "error", "no_candidate", "grammar"} or None
        The finished state's value; ``"error"``: a device-side fault of a step it was in;
        ``"no_candidate"``: a step left it no id it may pick; ``"grammar"``: the same with a
        grammar (``"stop"`` when its grammar's state after a token allows nothing more).
    error : str or None
        With ``"error"``: what the fault was.
    ban : RowMask or None
        The row's mask; may be set between steps and applies from the next launched step (a
        ban that leaves no id it may pick is refused, ``ValueError``).
    params : SamplingParams
        How it decodes (``submit``'s keywords or its ``params``).
    grammar : TokenAutomaton, HostGrammar or None
        The automaton or host matcher its tokens follow (``submit(grammar=)``).
    temperature, top_k, top_p, min_p, seed
        Its sampling parameters (``params``'s); ``temperature == 0`` is greedy decoding.
    sampled : bool
        ``temperature > 0``.
    repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens
        Its penalties (``params``'s; docs/penalties.md), as float32 values; ``logit_bias`` a
        dict, empty when none.
    logprobs : list of float or None
        With ``submit(logprobs=True)``: the logprob of each committed token under the raw
        distribution of its step (``log_softmax`` of the model's logits, before masks,
        temperature and filters), one per entry of ``tokens``; None when not asked.
    top_logprobs : list of list of (int, float), or None
        With ``submit(top_logprobs=n)``: per committed token, the ``n`` most likely ids of the
        same raw distribution and their logprobs, most likely first, ties by the smaller id;
        None when not asked.

    Examples
    --------
    ``DecodePipeline.submit`` makes them:

    >>> import metrale_feed as mf
    >>> from metrale_feed.testing.reference import ReferenceModel
    >>> model = ReferenceModel(1000, max_rows=2)
    >>> with mf.DecodePipeline(model, 2) as pipe:
    ...     req = pipe.submit([7, 8], max_new_tokens=2)
    ...     req.finished
    ...     finished = pipe.run()
    False
    >>> model.close()
    >>> req.finished, req.finish_reason, len(req.tokens)
    (True, 'length', 2)
    >>> req.status
    <RequestStatus.FINISHED_LENGTH: 'length'>
    """

    __slots__ = ("prompt", "tokens", "max_new_tokens", "stop_ids", "status", "error", "_ban", "_mask", "_owner", "_seq", "_join", "_last", "_base", "_order", "_bound",
                 "_pos0", "params", "temperature", "top_k", "top_p", "min_p", "seed", "_pen",
                 "_pslot", "logprobs", "top_logprobs", "_top_n", "_grammar", "_gstate",
                 "_host")

    def __init__(self, owner: RequestOwner, prompt: Tuple[int, ...], max_new_tokens: int,
                 stop_ids: FrozenSet[int], ban: Optional[RowMask], order: int = 0,
                 params: SamplingParams = _GREEDY) -> None:
        self.prompt = prompt
        self.tokens: List[int] = []
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop_ids
        self.status = _WAITING
        self.error: Optional[str] = None
        self._ban = ban
        self._mask = ban if ban is not None else _UNMASKED_PAIR
        self._owner = owner
        # What ``status`` says is not repeated here: a request has a view (``_seq``) exactly
        # while it is RUNNING (and during its prefill), and the launch numbers below are set
        # when it joins and read only while it runs. -1 is "no such launch".
        self._seq: Optional[_RequestView] = None  # its KV view, from its prefill until it leaves
        self._join = 0  # the launch number of its first step since (re)admission
        self._last = -1  # the launch number of its last possible step
        self._base = 0  # positions whose KV prefill wrote
        self._order = order  # submission order (set when the loop takes it in): the youngest
        # running one is preempted first
        self._bound = -1  # the launch at which its next KV block is reserved, if one is due
        self._pos0 = 0  # its position at launch L is _pos0 + L (set when it joins)
        self.params = params
        # The sampler's fields are read for every row of every step: plain attributes, copied
        # from ``params`` once.
        self.temperature, self.top_k, self.top_p = params.temperature, params.top_k, params.top_p
        self.min_p, self.seed = params.min_p, params.seed
        # Penalties (docs/penalties.md): None when every one is neutral (no slot, no op).
        self._pen: Optional[_checks.Penalties] = params._penalties if params.penalised else None
        self._pslot = -1  # its PenaltyState slot while it runs
        # One logprob per committed token, appended with it (docs/pipeline.md, "Logprobs").
        self.logprobs: Optional[List[float]] = [] if params.logprobs else None
        self._top_n = params.top_logprobs
        self.top_logprobs: Optional[List[List[Tuple[int, float]]]] = [] if self._top_n else None
        # Structured outputs (docs/pipeline.md): its automaton, and the state its committed
        # tokens reach (the host's walk; the device's word runs ahead of it by the steps in flight).
        self._grammar: Any = None
        self._gstate = 0
        self._host: Any = None  # or its HostGrammar (sched/host_grammar.py)

    @property
    def finished(self) -> bool:
        """Whether it has finished (stop, length, abort or error)."""
        return self.status.finished

    @property
    def finish_reason(self) -> Optional[str]:
        """``"stop"``, ``"length"``, ``"abort"``, ``"error"``, ``"no_candidate"`` or
        ``"grammar"``; None until it finishes."""
        status = self.status
        return status.value if status.finished else None

    @property
    def repetition_penalty(self) -> float:
        return self.params.repetition_penalty

    @property
    def presence_penalty(self) -> float:
        return self.params.presence_penalty

    @property
    def frequency_penalty(self) -> float:
        return self.params.frequency_penalty

    @property
    def logit_bias(self) -> Dict[int, float]:
        return dict(self.params.logit_bias or {})

    @property
    def min_tokens(self) -> int:
        return self.params.min_tokens

    @property
    def grammar(self) -> Any:
        """The ``TokenAutomaton`` or ``HostGrammar`` its tokens follow, or None."""
        return self._grammar if self._host is None else self._host

    @property
    def sampled(self) -> bool:
        """Whether its ids are drawn (``temperature > 0``) rather than the argmax."""
        return self.params.sampled

    @property
    def ban(self) -> Optional[RowMask]:
        return self._ban

    @ban.setter
    def ban(self, value: Any) -> None:
        owner = self._owner
        ban = check_ban(value, owner.vocab)
        if len(self.tokens) < self.min_tokens:  # (with a step in flight it may be over already)
            refuse_no_candidate(ban, self.stop_ids, self.min_tokens, owner.vocab)
        self._ban = ban
        self._mask = ban if ban is not None else _UNMASKED_PAIR
        owner.masks_dirty = True

    @property
    def position(self) -> int:
        """``len(prompt) + len(tokens)``: the position of the next generated id (what a sampler
        keys its randomness on)."""
        return len(self.prompt) + len(self.tokens)

    def __repr__(self) -> str:
        state = self.status.value
        return f"Request(prompt={len(self.prompt)} ids, tokens={len(self.tokens)}, {state})"


_OWNED = ("the pipeline owns a running request's committed tokens (Request.tokens): its "
          "SequenceState.tokens is a read-only view of them")


class _CommittedTokens(list):  # type: ignore[type-arg]
    """``SequenceState.tokens`` of a running request: a snapshot of the first ``seq_len`` ids of
    ``prompt + tokens``. A model may push the ids it writes (``append``/``extend``, as it does on
    a ``SequenceState`` of its own) when each one is the id the pipeline already holds at that
    position: the pipeline commits it itself, so the push only checks. Any other write raises
    ``FeedError``: a dropped write would be a silent loss of what the model meant."""

    __slots__ = ("_history",)

    def __init__(self, history: List[int], length: int) -> None:
        super().__init__(history[:length])
        self._history = history

    def append(self, token: Any) -> None:
        at = len(self)
        history = self._history
        if at >= len(history) or history[at] != token:
            known = history[at] if at < len(history) else "not known yet"
            raise FeedError(f"{_OWNED}; a push of id {token!r} at position {at} differs from "
                            f"the pipeline's ({known})")
        super().append(token)

    def extend(self, tokens: Iterable[Any]) -> None:
        for token in tokens:
            self.append(token)

    def __iadd__(self, tokens: Iterable[Any]) -> "_CommittedTokens":  # type: ignore[override,misc]
        self.extend(tokens)
        return self

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise FeedError(f"{_OWNED}: only a push of the id it holds is accepted")

    insert = pop = remove = clear = sort = reverse = _refuse  # type: ignore[assignment]
    __setitem__ = __delitem__ = __imul__ = _refuse  # type: ignore[assignment]


class _RequestView(SequenceState):
    """A running request's KV bookkeeping, derived from the request, so the pipeline is the one
    owner of its tokens: ``tokens`` reads ``_CommittedTokens`` (a push of the id the pipeline
    holds is checked and accepted, ``seq.tokens += ids`` too; any other write raises
    ``FeedError``, ``seq.tokens = ...`` too), and a subclass says what ``seq_len`` is."""

    __slots__ = ("req",)

    def __init__(self, req: Request, slot_idx: int) -> None:
        # SequenceState.__init__ would assign tokens and seq_len: both are derived here.
        self.req = req
        self.slot_idx = slot_idx
        self.block_table: List[int] = []

    @property
    def tokens(self) -> List[int]:
        req = self.req
        return _CommittedTokens(list(req.prompt) + req.tokens, self.seq_len)

    @tokens.setter
    def tokens(self, value: List[int]) -> None:
        if isinstance(value, _CommittedTokens):
            return  # ``seq.tokens += ids``: each id was checked by the push
        raise FeedError(f"{_OWNED}: it cannot be assigned")

    def _undo_push(self) -> None:
        """The router's undo of a pushed step that never ran: the push changed nothing here."""


class _SeqView(_RequestView):
    """``seq_len`` follows the request's committed tokens and the steps launched for it. Writes
    to ``seq_len`` count only while prefill fills the cache; after the first launch a model's
    own advance (the synchronous ``decode_batch`` path) changes nothing: the launch number says
    it. A model's push of each step's input is checked by ``tokens`` (``_CommittedTokens``)."""

    __slots__ = ()

    @property
    def seq_len(self) -> int:
        # Read by the model for every row it reserves or writes: plain comparisons, no min().
        req = self.req
        status = req.status
        if status is not _RUNNING and (status is _WAITING or status is _PREEMPTED):
            return req._base  # being prefilled
        launched = req._owner.launches
        if launched > req._last:
            launched = req._last + 1
        written = req._base + launched - req._join
        known = len(req.prompt) + len(req.tokens)
        return written if written < known else known

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        status = self.req.status
        if status is _WAITING or status is _PREEMPTED:
            self.req._base = value
