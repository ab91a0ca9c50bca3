"""``DecodePipeline``: the scheduler core that owns the overlap protocol (docs/pipeline.md).

The routers launch steps and read their ids back; what to launch, which token a row commits, when
a row's step in flight is thrown away and where its KV blocks go is decided here, in one place:

- a request's committed tokens are ``Request.tokens`` and nothing else; its ``SequenceState`` is a
  read-only view of them (``_SeqView``): ``seq_len`` counts the positions whose ids are known and
  whose KV the launched steps wrote, so no model, router or caller pushes tokens (a model's push
  of an id the pipeline holds is checked, any other write raises);
- every running row is in every launch from the one it joins to its last, so a row's position,
  its block boundaries and its length limit are known from the launch number alone, and a step
  costs Python work per row only to hand each row its token.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from functools import partial
from typing import (Any, Callable, Deque, Dict, FrozenSet, Iterable, List, Optional, Sequence,
                    Set, Tuple, Union)

from .. import _checks, _core
from ..contract import BatchPrefill, HostTokenDecode, Prefill, feed_info_of, require
from ..errors import DeviceError, FeedError, KvPoolExhausted
from ..feed import NO_TOKEN, FeedSource, RowMask
from ..kv import SequenceState
from ..trait import ModelDeviceFeed
from .budget import KvBudget
from .penalized import PipelinePenalties
from ..params import SAMPLING_FIELDS, SamplingParams
from .request import (_PREEMPTED, _RUNNING, _UNMASKED_PAIR, Request, RequestStatus, _order_of,
                      _SeqView)
from .router import AsyncDeviceIo, SyncDeviceIo, Ticket

__all__ = ["DecodePipeline", "Request", "RequestStatus", "PipelineStats"]

_drain: "partial[Deque[Any]]" = partial(deque, maxlen=0)  # runs an iterator out, keeping nothing
_IDENTITY: Dict[int, List[FeedSource]] = {}  # rows -> [feed(0), feed(1), ...], made once


def _identity(rows: int) -> List[FeedSource]:
    sources = _IDENTITY.get(rows)
    if sources is None:
        sources = _IDENTITY[rows] = [FeedSource.feed(i) for i in range(rows)]
    return sources

class _Step:
    """A launched step: its ticket, its rows (requests), their sources, and the rows whose
    result will be thrown away (finished, aborted or preempted while it was in flight)."""

    __slots__ = ("ticket", "launch", "rows", "lists", "sources", "dead", "debug_slot", "taken",
                 "lp", "gram")

    def __init__(self, ticket: Ticket, launch: int, rows: List[Request], lists: List[List[int]],
                 sources: Any) -> None:
        self.ticket = ticket
        self.lists = lists  # the rows' token lists, where their ids are committed
        self.launch = launch
        self.rows = rows
        self.sources = sources
        self.dead: Optional[Set[int]] = None  # row indices
        self.debug_slot = -1
        # The rows the budget gave a KV block for it (known block size), one block each, still
        # counted in flight until it is read (a list only when there are some).
        self.taken: Sequence[Request] = ()
        self.lp: Optional[List[Tuple[int, List[float], Any, int]]] = None  # DecodePipeline._lp
        self.gram: Optional[List[Tuple[int, Request]]] = None  # DecodePipeline._gram_rows


class PipelineStats:
    """The router's counters plus the pipeline's own: ``steps`` (awaited), ``host_syncs`` (every
    wait of the host on the device: the router's, the model's and the pipeline's),
    ``rows_discarded`` (results thrown away for rows that finished, were aborted or preempted
    with a step in flight), ``preemptions``, ``admitted``, ``finished``; with ``speculative=``
    (docs/speculative.md): ``drafted`` (draft slots verified, ``k`` a row a step), ``accepted``
    (drafts the target agreed with), ``emitted`` (ids the verify steps emitted, ``accepted`` plus
    one a row a step), ``spec_discarded`` (emitted past a stop or ``max_new_tokens``, never
    committed) and ``spec_blocks_returned`` (KV blocks that held only rejected positions)."""

    _OWN = ("steps", "rows_discarded", "preemptions", "admitted", "finished", "drafted",
            "accepted", "emitted", "spec_discarded", "spec_blocks_returned")

    def __init__(self, pipe: "DecodePipeline") -> None:
        self._pipe = pipe
        self.steps = 0
        self.rows_discarded = 0
        self.preemptions = 0
        self.admitted = 0
        self.finished = 0
        self.drafted = 0
        self.accepted = 0
        self.emitted = 0
        self.spec_discarded = 0
        self.spec_blocks_returned = 0

    @property
    def host_syncs(self) -> int:
        pipe = self._pipe
        model_syncs = getattr(pipe.model, "host_syncs", 0) - pipe._model_syncs_at_start
        spec = pipe._spec
        spec_syncs = 0 if spec is None else spec.host_syncs + getattr(spec.drafter, "host_syncs", 0)
        return pipe.io.stats.host_syncs + model_syncs + spec_syncs

    # A speculative step is launched by the pipeline's delegate, not through the ring: its
    # launches are counted there and added to the router's, never written into them.
    @property
    def launches(self) -> int:
        spec = self._pipe._spec
        return self._pipe.io.stats.launches + (0 if spec is None else spec.launches)

    @property
    def ahead_launches(self) -> int:
        spec = self._pipe._spec
        return self._pipe.io.stats.ahead_launches + (0 if spec is None else spec.ahead_launches)

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._pipe.io.stats[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> int:
        try:
            value: int = getattr(self, name)
        except AttributeError:
            raise KeyError(name) from None
        return value

    def as_dict(self) -> Dict[str, int]:
        out = self._pipe.io.stats.as_dict()
        for name in ("launches", "ahead_launches", "host_syncs"):
            out[name] = getattr(self, name)
        out.update((name, getattr(self, name)) for name in self._OWN)
        return out

    def __repr__(self) -> str:
        return f"PipelineStats({', '.join(f'{k}={v}' for k, v in self.as_dict().items())})"


class _LoopLock:
    """The loop's lock, knowing which thread holds it: a loop call (``step``, ``run``,
    ``admit``, ``close``) made by the thread already inside one (a drafter's ``propose`` or a
    model's method calling back into the pipeline) would wait for itself forever, so it raises
    instead. ``acquire(blocking=False)`` and ``release`` are the inbox's, as a Lock's."""

    __slots__ = ("_lock", "owner", "what")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: Optional[int] = None
        self.what = "step"

    def __call__(self, what: str) -> "_LoopLock":
        if self.owner == threading.get_ident():
            raise FeedError(f"{what}() was called from inside one of this pipeline's own calls "
                            f"(a drafter's propose or a model's method): it would wait for itself; "
                            f"call it once that returns (abort() and submit() may be called there)")
        return self

    def __enter__(self) -> None:
        self._lock.acquire()
        self.owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self.owner = None
        self._lock.release()

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking)

    def release(self) -> None:
        self._lock.release()


class DecodePipeline:
    """Greedy or sampled decoding of many requests through a ``ModelDeviceFeed``, ``depth``
    steps deep.

    Parameters
    ----------
    model : ModelDeviceFeed
        Also needs ``prefill(seq, ids, stream)`` and a vocabulary (``feed_vocab``, as the
        runtime mixin has, or ``vocab=``). A model that exposes ``block_size`` and ``pool`` (a
        ``BlockPool``) gets admission by free blocks and the never-fits check at submit.
    max_rows : int
        The most requests running at once; more wait, first come first served.
    depth : {1, 2}
        Steps in flight: 2 launches step k+1 before reading step k; 1 settles each step.
    stream : stream-like
        Where prefills and steps run (one stream: KV writes stay in order).
    vocab : int, optional
        The vocabulary, when the model has no ``feed_vocab``.
    debug : bool, optional
        Poison consumed feed cells with ``NO_TOKEN`` and check every step's resolved input ids
        (default: the ``METRALE_FEED_DEBUG`` environment variable is ``1``).
    shard : VocabShard, optional
        Run SPMD over a vocabulary split across ranks (docs/tensor-parallel.md): every rank makes
        the same pipeline and submits the same requests in the same order, and every rank's
        requests get the same tokens as the unsharded pipeline. The model must feed through this
        shard (``init_device_feed(..., shard=)``, as ``ReferenceModel(..., shard=)`` does).
    penalty_capacity : int, optional
        Distinct ids a request with penalties may see (its distinct prompt ids plus
        ``max_new_tokens``); sizes the device tables, made at the first such request:
        ``max_rows * (32 + 8 * penalty_capacity + 2912)`` bytes (docs/penalties.md). Default 4096.
    speculative : Drafter, optional
        Speculative decoding (docs/speculative.md): each step the drafter proposes ``k`` ids a
        row (``drafter.k``), the model's ``decode_batch_verify`` runs the ``k + 1`` positions of
        every row in one forward, ``verify_to_feed`` keeps the accepted run, and the run is
        committed up to a stop or ``max_new_tokens``. Greedy requests get exactly the tokens of
        decoding without it. At depth 2 the next verify step is launched before the last one's
        counts are read (its inputs and positions come from the device, and a sampled
        request's draws are those of depth 1). Needs a model with ``block_size`` and ``pool``
        (and, with a shard, requests without logprobs; without one, logprobs are
        ``verify_to_feed``'s and top logprobs ``top_logprobs``' over the verify's logits, or
        over their copy before the penalties with penalties). Penalties, ``logit_bias`` and
        ``min_tokens`` judge each position with the drafts before it (docs/speculative.md).
        With a shard, sampled requests need the
        shard's fixed rounds on the cuda backend (``FilterRounds``). Default None: one token a
        row a step.

    Raises
    ------
    FeedError
        ``depth=2`` with a model whose ``supports_device_token_feed()`` is False.
    ValueError, TypeError
        A bad depth, ``max_rows``, or a model without prefill or vocabulary; a ``speculative``
        that is not a drafter (no ``propose``, a ``k`` outside ``1..MAX_DRAFTS``) or that this
        pipeline cannot run (see ``speculative``).

    Examples
    --------
    >>> import metrale_feed as mf
    >>> from metrale_feed.testing.reference import ReferenceModel, host_next_token
    >>> model = ReferenceModel(1000, max_rows=8)
    >>> with mf.DecodePipeline(model, 8) as pipe:
    ...     req = pipe.submit([3, 1, 4], max_new_tokens=4)
    ...     finished = pipe.run()
    >>> model.close()
    >>> req.finish_reason, len(req.tokens)
    ('length', 4)
    >>> req.tokens[0] == host_next_token([3, 1, 4], 1000)
    True
    """

    def __init__(self, model: ModelDeviceFeed, max_rows: int, *, depth: int = 2, stream: Any = 0,
                 vocab: Optional[int] = None, debug: Optional[bool] = None,
                 shard: Any = None, penalty_capacity: int = 4096, speculative: Any = None) -> None:
        self._spec: Any = None  # the SpeculativeStep (set last: close() needs the rest first)
        max_rows = _checks.integer(max_rows, "max_rows")
        # What the model can do is declared (metrale_feed.contract), read here once.
        require(model, "DecodePipeline", Prefill)
        info = feed_info_of(model, None if vocab is None else _checks.integer(vocab, "vocab"))
        self.info = info
        penalty_capacity = _checks.integer(penalty_capacity, "penalty_capacity")
        if not 1 <= penalty_capacity <= _core.MAX_PENALTY_TABLE:
            raise ValueError(f"penalty_capacity must be in [1, {_core.MAX_PENALTY_TABLE}], got "
                             f"{penalty_capacity}")
        if shard is not None:
            if info.shard is not shard:
                raise ValueError("DecodePipeline(shard=) needs a model that feeds through that shard "
                                 "(init_device_feed(..., shard=shard))")
            if max_rows > shard.max_rows:
                raise ValueError(f"max_rows {max_rows} is more than the shard's {shard.max_rows}")
        self.shard = shard
        depth = _checks.integer(depth, "depth")
        if depth not in (1, 2):
            raise ValueError(f"depth must be 1 or 2, got {depth}")
        vocab = info.vocab
        if not 1 <= vocab:
            raise ValueError(f"the vocabulary must hold at least 1 id, got {vocab}")
        if info.max_rows is not None and max_rows > info.max_rows:
            raise ValueError(f"max_rows {max_rows} is more than the model's {info.max_rows}")
        self.fed = model.supports_device_token_feed()
        if depth == 2 and not self.fed:
            raise FeedError("depth=2 needs a model whose supports_device_token_feed() is True; "
                            "use depth=1")
        if not self.fed:
            require(model, "DecodePipeline over a model without the device feed", HostTokenDecode)
        if debug is None:
            debug = os.environ.get("METRALE_FEED_DEBUG", "") == "1"
        self.model = model
        self.max_rows = max_rows
        self.depth = depth
        self.stream = stream
        self.vocab = vocab
        self.debug = bool(debug)
        self._block_size: Optional[int] = info.block_size
        self._pool = info.pool if info.block_size else None
        self._prefill_many = model.prefill_many if isinstance(model, BatchPrefill) else None
        self._model_syncs_at_start = getattr(model, "host_syncs", 0)
        self.io: Union[AsyncDeviceIo, SyncDeviceIo] = (
            AsyncDeviceIo(model, max_rows, stream=stream) if depth == 2
            else SyncDeviceIo(model, max_rows, stream=stream))
        self.budget: KvBudget = self.io.budget  # the one owner of the blocks in flight
        self.stats = PipelineStats(self)
        self._waiting: Deque[Request] = deque()
        self._running: List[Request] = []
        self._inflight: Deque[_Step] = deque()
        self._launches = 0
        self._orders = 0
        self._boundary: Dict[int, List[Request]] = {}  # launch -> rows that cross a block there
        self._ending: Dict[int, List[Request]] = {}  # launch -> rows whose last step it is
        self._stop_union: FrozenSet[int] = frozenset()
        self._finished: List[Request] = []  # finished since the last step() returned
        self._dirty = True  # the batch changed since the last launch: rebuild rows and sources
        self._masks_dirty = True
        self._rows: List[Request] = []  # the last launch's rows
        self._seqs: Optional[List[SequenceState]] = None  # and their sequences
        self._lists: Optional[List[List[int]]] = None  # and their token lists
        self._masks: Any = None
        self._taking: List[Request] = []  # rows given a block for the launch being made
        self._prev_ids: List[int] = []  # debug: the last awaited step's ids
        self._closed = False
        self._debug = _Debug(self) if self.debug and self.fed else None
        # Sampling, as the model declares it (FeedInfo.sampling); a step with a sampled row
        # passes one params record per row (``_params``), rebuilt with the batch.
        self._can_sample = info.sampling
        self._params: Any = None  # SAMPLING_PARAMS_DTYPE records of self._rows, or None
        # self._rows' (row, its logprobs, its top logprobs or None, its n) and the batch's n
        self._lp: Optional[List[Tuple[int, List[float], Any, int]]] = None
        self._top_n = 0
        # Running requests that sample and that keep logprobs: a batch rebuild scans its rows
        # for either only while there are some.
        self._sampled = self._with_lp = 0
        self._positions: Any = None  # per row: its position at launch 0 (int64)
        # Threads: the loop (step, run, admit, close) holds _lock for each call; submit and
        # abort post to _inbox (deque appends are atomic) and apply it at once when the lock is
        # free, else the loop applies it at the start and end of its current call. So every
        # change of the pipeline's state is made under the lock, in posting order.
        self._lock = _LoopLock()
        self._inbox: Deque[Tuple[Callable[[Request], None], Request]] = deque()
        # Penalties: the device tables, made at the first request that has any.
        self._penalty_capacity = penalty_capacity
        self._penalised = False
        self._pen: Optional[PipelinePenalties] = None
        self._hook: Optional[PipelinePenalties] = None  # the last launch's, for the router
        # Structured outputs (docs/pipeline.md): the state words and the joined automaton, made
        # at the first launch with a grammar; the running requests that have one; the last
        # launch's grammar= and its (row, request) of the rows with a grammar.
        self._gram: Any = None
        self._constrained = 0
        self._gram_call: Any = None
        self._gram_rows: Optional[List[Tuple[int, Request]]] = None
        # Speculative decoding: each step drafts and verifies k positions past the input, so a
        # request's KV may reach k positions past its last token's.
        self._view: Any = _SeqView  # the running requests' KV views
        self._extra_positions = 0
        if speculative is not None:
            from .speculative import SpeculativeStep, _SpecView

            try:
                self._spec = SpeculativeStep(self, speculative)
            except BaseException:
                self._closed = True
                self.io.teardown()
                if self._debug is not None:
                    self._debug.close()
                raise
            self._view = _SpecView
            self._extra_positions = self._spec.reach

    # ---- submission ----

    def _token(self, value: Any, what: str) -> int:
        token = _checks.integer(value, what)
        if not 0 <= token < self.vocab:
            raise ValueError(f"{what} {token} is outside the vocabulary of {self.vocab} ids")
        return token

    def _check_ban(self, ban: Any) -> Optional[RowMask]:
        if ban is None:
            return None
        a, b = ban  # a pair; anything else is a TypeError or ValueError here
        pair = [_checks.integer(a, "ban id"), _checks.integer(b, "ban id")]
        for token in pair:
            if token != NO_TOKEN:
                self._token(token, "ban id")
        if self.vocab <= 2 and set(range(self.vocab)) <= set(pair):
            # The argmax would answer NO_TOKEN: a placeholder must never become an input id.
            raise ValueError(f"the ban {pair} leaves no candidate in a vocabulary of {self.vocab}")
        return RowMask(pair[0], pair[1])

    def _refuse_no_candidate(self, mask: Optional[RowMask], stops: FrozenSet[int],
                             min_tokens: int) -> None:
        """Refuse a request (or a ban set on one) that leaves no id a row may pick while
        ``min_tokens`` bans its stop ids: a sampled row would draw ``NO_TOKEN`` and a greedy one
        a stop id at ``-inf``, never a token it may commit."""
        if not min_tokens or len(stops) + 2 < self.vocab:
            return
        banned = set(stops)
        if mask is not None:
            banned.update(t for t in mask if t != NO_TOKEN)
        if len(banned) >= self.vocab:
            raise ValueError(f"min_tokens={min_tokens} bans the stop ids {sorted(stops)}, which "
                             f"with the ban {None if mask is None else list(mask)} leave no id "
                             f"of the vocabulary of {self.vocab} to pick before it")

    def submit(self, prompt_ids: Iterable[int], params: Optional[SamplingParams] = None, *,
               max_new_tokens: int, stop_ids: Iterable[int] = (), ban: Any = None,
               grammar: Any = None, **keywords: Any) -> Request:
        """Queue a request; it joins the batch at the next launch with room for it.

        How it decodes is one ``SamplingParams``: ``params``, or the keywords below, which make
        one (``params`` and any of them together is a TypeError).

        Parameters
        ----------
        prompt_ids : iterable of int
            At least one id, each in the vocabulary.
        params : SamplingParams, optional
            Its sampler, penalties and logprobs, checked when it was made; this call checks
            what depends on the pipeline (the vocabulary, ``max_new_tokens``, the model).
        max_new_tokens : int
            At least 1.
        stop_ids : iterable of int
            Ids that finish the request (committed as its last token).
        ban : pair of int, optional
            A ``RowMask``: ids the row may not answer (``NO_TOKEN`` where unused).
        grammar : TokenAutomaton, optional
            Structured output (docs/pipeline.md, "Structured outputs"): every generated id is one
            the automaton allows from the state the tokens before it reach, masked, picked and
            advanced on the device (no host wait). After a token whose state has no outgoing
            transition the request finishes ``"stop"``; one left with no allowed id it may pick
            (its ban or ``min_tokens`` removed the last) finishes ``"grammar"``.

        Other Parameters
        ----------------
        temperature : float, optional
            0 (the default): greedy decoding, the argmax. Above 0: each id is drawn from
            ``softmax(logit / temperature)`` over the ids the filters below keep, by the
            model's ``sample_batch_to_feed`` (docs/kernels.md, "Sampling"). Finite, at least 0.
        top_k : int, optional
            Keep the ``top_k`` most probable ids; 0 (the default) keeps all. Below 2**32.
        top_p : float, optional
            Keep the smallest set of the most probable ids whose probability reaches ``top_p``;
            in (0, 1], default 1.0 (all).
        min_p : float, optional
            Keep the ids whose probability is at least ``min_p`` times the largest; in [0, 1),
            default 0.0 (all).
        seed : int, optional
            The key of the counter-based draw, in [0, 2**64). The draw of each token depends on
            the seed, the logits and the position ``len(prompt) + len(tokens)`` alone, so a
            request gets the same tokens whatever the batch, its row, the depth or a
            preemption.
        repetition_penalty : float, optional
            Over the prompt's and the generated ids, each distinct id once: a positive logit is
            divided by it, any other multiplied. Finite, above 0; default 1.0 (off).
        presence_penalty : float, optional
            Subtracted once from the logit of each id generated so far; in [-2, 2], default 0.
        frequency_penalty : float, optional
            Subtracted from each generated id's logit once per occurrence; in [-2, 2], default 0.
        logit_bias : mapping of int to float, optional
            Added to those ids' logits, first; at most 300 ids of the vocabulary.
        min_tokens : int, optional
            Until this many tokens were generated the stop ids cannot be drawn (their logits
            are ``-inf``); in [0, max_new_tokens], default 0. At most 64 stop ids with it.

            vLLM v1's rules and order: ``logit_bias`` and ``min_tokens``, then the three
            penalties, then temperature and the filters, greedy rows included; applied on the
            device in stream order with no host synchronisation (docs/penalties.md).
        logprobs : bool, optional
            Keep each committed token's logprob in ``Request.logprobs``: ``log_softmax`` of the
            raw logits of its step (vLLM v1's default, ``raw_logprobs``: before masks,
            temperature and the filters), computed by the feed method on the device and read
            back with the ids, so no step waits for it. With penalties, ``logit_bias`` or
            ``min_tokens`` too, the logits are copied before the penalties change them and the
            logprobs taken from the copy (each rank's slice of it over a split vocabulary).
            Default False.
        top_logprobs : int, optional
            In [0, 20], above 0 only with ``logprobs=True`` (the OpenAI API's rule): also keep,
            per committed token, the ``top_logprobs`` most likely ids of the raw distribution
            and their logprobs in ``Request.top_logprobs`` (ties by the smaller id); at most
            the vocabulary. With a split vocabulary (``shard=``), every rank gets the same lists
            (``VocabShard.top_logprobs``). Default 0.

        Returns
        -------
        Request

        Raises
        ------
        ValueError, TypeError
            Bad input (sampling parameters included, checked as float32 values; a str, a bool
            or None where a number goes is a TypeError), or a request that could never fit the
            KV pool; nothing is queued. A ``grammar`` that is not a ``TokenAutomaton`` (TypeError),
            or one for another vocabulary or whose initial state allows nothing (ValueError).
        FeedError
            The pipeline is closed, a sampled request for a model without
            ``sample_batch_to_feed``, or a grammar for a model whose feed methods take none
            (``FeedInfo.grammar``).

        Notes
        -----
        Any thread may call it, while another runs ``step()``: the request is queued at once
        when no step runs, else when the running one ends (``status`` stays ``WAITING``).

        Examples
        --------
        >>> import metrale_feed as mf
        >>> from metrale_feed.testing.reference import ReferenceModel
        >>> model = ReferenceModel(1000, max_rows=2)
        >>> with mf.DecodePipeline(model, 2) as pipe:
        ...     a = pipe.submit([5, 6], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1)
        ...     b = pipe.submit([5, 6], max_new_tokens=4, temperature=0.8, top_p=0.9, seed=1)
        ...     finished = pipe.run()
        >>> model.close()
        >>> a.tokens == b.tokens, len(a.tokens)     # same prompt, params and seed: same draws
        (True, 4)
        """
        if self._closed:
            raise FeedError("the pipeline is closed")
        prompt = tuple(self._token(t, "prompt id") for t in prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty: a request needs at least one id")
        max_new = _checks.integer(max_new_tokens, "max_new_tokens")
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new}")
        stops = frozenset(self._token(t, "stop id") for t in stop_ids)
        mask = self._check_ban(ban)
        automaton = None if grammar is None else self._check_grammar(grammar)
        params = self._params_of(params, keywords, max_new)
        sampling = (params.temperature, params.top_k, params.top_p, params.min_p, params.seed)
        pen = params._penalties if params.penalised else None
        lp = (params.logprobs, params.top_logprobs)
        if params.penalised:
            self._refuse_no_candidate(mask, stops, params.min_tokens)
        self._refuse_unrunnable(prompt, max_new, stops, sampling, pen, lp)
        req = Request(self, prompt, max_new, stops, mask, 0, params)
        req._grammar = automaton
        self._post(self._enqueue, req)
        return req

    def _check_grammar(self, grammar: Any) -> Any:
        """``submit``'s grammar, checked against this pipeline: a ``TokenAutomaton`` for its
        vocabulary whose initial state allows some id, on a model whose feed methods take
        ``grammar=`` (a speculative pipeline's verify is its own call)."""
        from ..grammar.automaton import TokenAutomaton

        if not isinstance(grammar, TokenAutomaton):
            raise TypeError(f"grammar must be a metrale_feed.TokenAutomaton, not "
                            f"{type(grammar).__name__}")
        if grammar.vocab != self.vocab:
            raise ValueError(f"the grammar's automaton is for a vocabulary of {grammar.vocab} "
                             f"ids; the pipeline's is {self.vocab}")
        if grammar.final(grammar.initial):
            raise ValueError("the grammar's initial state allows no id: the request could "
                             "generate nothing")
        if not self.info.grammar and self._spec is None:
            raise FeedError(f"{type(self.model).__name__}'s feed methods take no grammar= (its "
                            f"feed_info() says grammar=False): a request with a grammar cannot "
                            f"run on it")
        return grammar

    def _params_of(self, params: Optional[SamplingParams], keywords: Dict[str, Any],
                   max_new: int) -> SamplingParams:
        """``submit``'s ``SamplingParams``, given or made from its keywords, checked against
        this pipeline: ``logit_bias``'s ids in the vocabulary, ``min_tokens`` within
        ``max_new_tokens``."""
        if params is None:
            unknown = sorted(set(keywords) - set(SAMPLING_FIELDS))
            if unknown:
                raise TypeError(f"submit() got an unexpected keyword argument {unknown[0]!r}")
            params = SamplingParams(**keywords)
        elif keywords:
            raise TypeError(f"submit() takes params= or the per-request keywords, not both "
                            f"(got params and {', '.join(sorted(keywords))})")
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a metrale_feed.SamplingParams, not "
                            f"{type(params).__name__}")
        bias = params.logit_bias or {}
        for token in bias:
            if token >= self.vocab:
                raise ValueError(f"logit_bias id {token} is outside the vocabulary of "
                                 f"{self.vocab} ids")
        if params.min_tokens > max_new:
            raise ValueError(f"min_tokens must be in [0, max_new_tokens = {max_new}], got "
                             f"{params.min_tokens}")
        return params

    def _refuse_unrunnable(self, prompt: Tuple[int, ...], max_new: int, stops: FrozenSet[int],
                           sampling: _checks.Sampling, pen: Optional[_checks.Penalties],
                           lp: Tuple[bool, int]) -> None:
        """Refuse a request whose parameters are valid (checked) but that this pipeline cannot
        run, the most specific refusal first: what speculative decoding cannot run on any
        model, then the vocabulary's and the shard's limits, then what this model declares it
        lacks (its ``FeedInfo``), then what could never fit (the penalty table, the KV pool).
        So a user is never sent after a fix that would not help."""
        spec = self._spec
        if spec is not None:
            # Before the model's logprobs capabilities and the vocabulary: a verify step's
            # logprobs are verify_to_feed's, whatever the model's feed methods take.
            if lp[0] and self.shard is not None:
                raise ValueError("logprobs are not returned with speculative decoding over a split "
                                 "vocabulary yet (a sampled verify's records carry masses): "
                                 "submit the request without logprobs (or to a pipeline without "
                                 "speculative=)")
            if self.shard is not None and sampling[0] > 0:  # its verify: a sampled call's rounds
                self.shard._refuse_unfixed_rounds("speculative verifies of sampled requests")
        rounds = getattr(self.shard, "filters", None)
        why = rounds.refusal(sampling[1], sampling[2]) if rounds is not None and sampling[0] > 0 else None
        if why is not None:  # else the step's first decision faults the shard, every row with it
            raise ValueError(f"{why}: this pipeline's shard cannot sample the request")
        info, name = self.info, type(self.model).__name__
        if lp[1] > self.vocab:  # else the lists would end in (NO_TOKEN, NaN) placeholders
            raise ValueError(f"top_logprobs={lp[1]} is more than the vocabulary of {self.vocab} "
                             f"ids")
        if lp[1] and not info.top_logprobs and spec is None:
            raise FeedError(f"{name}'s feed methods take no top_logprobs= (its feed_info() says "
                            f"top_logprobs=False): a request with top_logprobs > 0 cannot run "
                            f"on it")
        if lp[0] and pen is not None and not info.raw_logits and spec is None:
            raise FeedError(f"{name}'s feed methods take no raw_logits= (its feed_info() says "
                            f"raw_logits=False): logprobs=True with penalties, logit_bias or "
                            f"min_tokens cannot run on it (the penalties change the logits in "
                            f"place)")
        if lp[0] and not info.logprobs and spec is None:
            raise FeedError(f"{name}'s feed methods take no logprobs= and logprobs_dst= (its "
                            f"feed_info() says logprobs=False): a request with logprobs=True "
                            f"cannot run on it")
        if sampling[0] > 0.0 and not self._can_sample:
            raise FeedError(f"{name} declares no sampling (its feed_info() says sampling=False: "
                            "no sample_batch_to_feed): a request with temperature > 0 cannot "
                            "run on it")
        if pen is not None:
            PipelinePenalties.check(self, prompt, max_new, stops, pen[4], self._penalty_capacity)
        blocks = self._blocks_for(len(prompt) + max_new - 1 + self._extra_positions)
        if blocks is not None and self._pool is not None and blocks > self._pool.num_blocks:
            raise ValueError(f"the request needs {blocks} KV blocks at most (prompt "
                             f"{len(prompt)} + {max_new} new tokens); the pool has "
                             f"{self._pool.num_blocks}")

    def _enqueue(self, req: Request) -> None:
        if self._closed:  # submitted by another thread while close() ran
            req.status = RequestStatus.FINISHED_ABORTED
            return
        self._orders += 1
        req._order = self._orders
        if req._pen is not None:
            self._penalised = True
        self._waiting.append(req)

    # ---- the inbox of other threads' calls ----

    def _post(self, apply: Callable[[Request], None], req: Request) -> None:
        """``apply(req)`` under the lock: now when no call of the loop holds it, else by the
        loop at the end of its call (``_drain``). Never waits for a step."""
        self._inbox.append((apply, req))
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self) -> None:
        """Apply the posted submits and aborts, in posting order (the lock is held)."""
        inbox = self._inbox
        while inbox:
            apply, req = inbox.popleft()
            apply(req)

    def _blocks_for(self, positions: int) -> Optional[int]:
        bs = self._block_size
        return None if bs is None else -(-positions // bs)

    # ---- the step ----

    @property
    def idle(self) -> bool:
        """Nothing waiting (or posted by another thread), running or in flight."""
        return not (self._inbox or self._waiting or self._running or self._inflight
                    or (self._spec is not None and self._spec.inflight))

    def step(self) -> List[Request]:
        """Advance one step: launch (up to ``depth`` in flight), then read the oldest.

        Returns
        -------
        list of Request
            The requests that finished during it (and any aborted since the last call), in
            finish order.

        Raises
        ------
        FeedError
            The pipeline is closed; or the step's wait (or its debug check) failed: a
            device-side fault. Then no token of that step or of the steps in flight after it is
            committed, and every running request finishes with ``"error"`` (``req.error`` says
            why; reported by the next ``step()``). Waiting requests stay queued.
        """
        with self._lock("step"):  # a second thread's step() waits for this one
            if self._closed:
                raise FeedError("the pipeline is closed")
            if self._inbox:  # checked here: most steps have nothing posted
                self._drain()
            try:
                spec = self._spec
                if spec is not None:
                    while len(spec.inflight) < self.depth and spec.launch():
                        pass
                    ran = bool(spec.inflight)
                    if ran:
                        spec.await_oldest()
                else:
                    while len(self._inflight) < self.depth and self._launch():
                        pass
                    ran = bool(self._inflight)
                    if ran:
                        self._await()
                if not ran and self._waiting and not self._running:
                    head = self._waiting[0]
                    raise FeedError(f"cannot admit {head!r}: the KV pool has too few free blocks "
                                    f"({self.budget.free_count}) and nothing runs")
                done = self._finished
                if done:
                    self._finished = []
                    return done
                return []
            finally:
                if self._inbox:  # what other threads posted during the step
                    self._drain()

    def run(self) -> List[Request]:
        """Step until idle; every request that finished, in finish order."""
        self._lock("run")  # from inside a step: raises here, not at the first step()
        out: List[Request] = []
        while not self.idle:
            out.extend(self.step())
        with self._lock("run"):
            out.extend(self._finished)
            self._finished = []
        return out

    def admit(self) -> int:
        """Admit waiting requests now, as ``step()`` would at its next launch (first come, first
        served, while rows and blocks allow), so their prefill is queued before the next step.

        Returns
        -------
        int
            How many joined the batch.
        """
        with self._lock("admit"):
            if self._closed:
                raise FeedError("the pipeline is closed")
            self._drain()
            before = len(self._running)
            self._admit(self._launches)
            return len(self._running) - before

    def _admit(self, launch: int) -> None:
        """First come, first served: the oldest waiting requests join while there are rows and
        (when the pool is known) blocks for their histories and their first step. A model with
        ``prefill_many`` prefills them in one call (one forward for the reference model), so an
        admission does not fill the model's queue with forwards."""
        waiting = self._waiting
        room = self.max_rows - len(self._running)
        pool = self._pool
        free = pool.free_count if pool is not None else 0
        # Keep blocks for the running rows that cross a block boundary at this launch, so an
        # admitted request is not preempted at once.
        free -= len(self._boundary.get(launch, ()))
        batch: List[Request] = []
        for req in waiting:
            if len(batch) >= room:
                break
            if pool is not None:
                need = self._blocks_for(len(req.prompt) + len(req.tokens)
                                        + self._extra_positions) or 0
                if free < need:
                    break
                free -= need
            batch.append(req)
        if not batch:
            return
        prefill_many = self._prefill_many
        if prefill_many is None:  # one request at a time; stop at the first that does not fit
            for count, req in enumerate(batch):
                try:
                    prefill = self.model.prefill  # type: ignore[attr-defined]
                    fits = self._prefill([req], prefill, False)
                except BaseException:
                    for done in batch[:count]:  # they stay waiting, so with no view or block
                        self._release(done)
                    raise
                if not fits:
                    batch = batch[:count]
                    break
        elif not self._prefill(batch, prefill_many, True):
            return
        for req in batch:
            waiting.popleft()
            self._join(req, launch)
            req.status = _RUNNING
            self._running.append(req)
        self.stats.admitted += len(batch)
        self._dirty = True

    def _prefill(self, reqs: List[Request], prefill: Any, many: bool) -> bool:
        """Prefill each request's history but its last id into a fresh sequence view; False
        (and nothing kept) when the pool ran out (a pool the pipeline cannot see). A prefill
        that raises anything else keeps nothing either: the requests stay waiting, with no
        view and no block, and the error propagates."""
        views, histories = [], []
        for req in reqs:
            req._seq = self._view(req, req._order)
            req._base = 0
            views.append(req._seq)
            histories.append((list(req.prompt) + req.tokens)[:-1])
        try:
            if many:
                prefill(views, histories, self.stream)
            else:
                prefill(views[0], histories[0], self.stream)
        except KvPoolExhausted:
            for req in reqs:
                self._release(req)
            return False
        except BaseException:
            for req in reqs:
                self._release(req)
            raise
        return True

    def _join(self, req: Request, launch: int) -> None:
        req._join = launch
        req._last = launch + req.max_new_tokens - len(req.tokens) - 1
        # The step of launch L draws token len(tokens) + (L - launch): its position is known
        # from the launch number, and after a preemption it resumes from the committed tokens.
        req._pos0 = len(req.prompt) + len(req.tokens) - launch
        self._ending.setdefault(req._last, []).append(req)
        self._sampled += req.temperature > 0.0
        self._with_lp += req.logprobs is not None
        self._constrained += req._grammar is not None
        if req.stop_ids:
            self._stop_union = self._stop_union | req.stop_ids
        bs = self._block_size
        if bs is not None and self._spec is None:  # the first launch whose position starts a block
            self._schedule(req, launch + (-req._base) % bs)

    def _schedule(self, req: Request, launch: int) -> None:
        if launch <= req._last:
            req._bound = launch
            self._boundary.setdefault(launch, []).append(req)

    def _launch(self) -> bool:
        launch = self._launches
        if self._waiting and len(self._running) < self.max_rows:
            self._admit(launch)
        if (launch - 1) in self._ending:
            self._dirty = True  # rows whose last step was the previous launch leave the batch
        if self._dirty:
            rows = [r for r in self._running if r._last >= launch]
        else:
            rows = self._rows
        rows = self._reserve(rows, launch)  # adds to self._taking
        if not rows:
            return False
        # A batch that changed is derived again, in C-speed passes where one will do: the rows
        # without a ban share one pair object, so counting it finds whether any row has one,
        # and the sampling and logprobs scans run only while a running request asks for them.
        if self._dirty or self._masks_dirty or rows is not self._rows:
            masks: Any = [r._mask for r in rows]
            if masks.count(_UNMASKED_PAIR) == len(masks):
                masks = None
            self._masks = masks
        masks = self._masks
        if self._dirty or rows is not self._rows:
            self._params = self._sampling_params(rows)
            self._hook = self._penalties(rows)
            self._lp, self._top_n = None, 0
            if self._with_lp:
                self._lp = [(i, r.logprobs, r.top_logprobs, r._top_n)
                            for i, r in enumerate(rows) if r.logprobs is not None] or None
                self._top_n = max((r._top_n for r in rows), default=0)
            self._gram_call = self._grammar(rows)
        params = self._params
        if params is not None:
            # Host params are read before the feed method returns, so rewriting the one array
            # each launch never changes what a step in flight draws.
            params["position"] = self._positions + launch
        if self.fed:
            if self._dirty or rows is not self._rows:
                # Each row's source: its row of the last launch (the kept FeedSource.feed(i)
                # objects, made once), or its last committed id when it joined now.
                # (Requests hash by identity, so they key the map themselves: no id() call.)
                old = self._rows if self._launches else []
                get = dict(zip(old, _identity(len(old)))).get
                sources: Any = [get(r, -1) if r._join < launch else -1 for r in rows]
                if -1 in sources:  # joined now (at the end of the batch): the host's id
                    for i in range(sources.index(-1), len(rows)):
                        if sources[i] < 0:
                            r = rows[i]
                            sources[i] = FeedSource.host(r.tokens[-1] if r.tokens
                                                         else r.prompt[-1])
                identity = _identity(len(rows))
                if sources == identity:
                    sources = identity
            else:  # the same rows as the last launch: each reads its own row's cell
                sources = _identity(len(rows))
            debug = self._debug
            if debug is not None:
                slot = debug.before(sources, len(rows))
            ticket = self._queue(launch, True, sources, rows, masks, params)
            if debug is not None:
                debug.after(len(rows))
        else:
            sources = [r.tokens[-1] if r.tokens else r.prompt[-1] for r in rows]
            ticket = self._queue(launch, False, sources, rows, masks, params)
        self._launches = launch + 1
        if rows is not self._rows or self._lists is None:
            self._lists = [r.tokens for r in rows]
        step = _Step(ticket, launch, rows, self._lists, sources)
        step.lp = self._lp
        step.gram = self._gram_rows
        # Blocks reserved for a launch that raised stay in their tables and count for the
        # launch that follows, so the in-flight figure comes back to 0.
        if self._taking:
            step.taken, self._taking = self._taking, []
        if self._debug is not None:
            step.debug_slot = slot
        self._inflight.append(step)
        self._rows = rows
        self._dirty = self._masks_dirty = False
        return True

    def _queue(self, launch: int, fed: bool, sources: Any, rows: List[Request], masks: Any,
               params: Any) -> Ticket:
        """The router's launch. One that raises before the router queued the step (it counts
        it only once queued) is retried by the next ``step()``, unless it raised
        ``DeviceError``: earlier work failed (on cuda a kernel's fault surfaces at whichever
        call comes next), so the steps in flight cannot be trusted. That, or one queued whose
        settle then failed (``SyncDeviceIo``, depth 1), is a fault of this step."""
        io = self.io
        queued = io.stats.launches
        try:
            if rows is not self._rows or self._seqs is None:
                self._seqs = [r._seq for r in rows]  # type: ignore[misc]
            return io.launch(sources, self._seqs, masks, fed=fed, params=params,
                             trusted=True, hook=self._hook, logprobs=self._lp is not None,
                             top_n=self._top_n, grammar=self._gram_call)
        except BaseException as exc:
            if io.stats.launches != queued or isinstance(exc, DeviceError):
                self._launches = launch + 1
                taken, self._taking = self._taking, []
                self.stats.steps += 1
                self._fault(launch, len(taken), exc)
            raise

    def _sampling_params(self, rows: List[Request]) -> Any:
        """One ``SAMPLING_PARAMS_DTYPE`` record per row when any row samples (positions are set
        at each launch), else None: an all-greedy step keeps the argmax and imports no numpy."""
        if not self._sampled or not any(r.temperature > 0.0 for r in rows):
            self._positions = None
            return None
        import numpy as np

        from ..sampling import SAMPLING_PARAMS_DTYPE

        params = np.zeros(len(rows), SAMPLING_PARAMS_DTYPE)
        for field in ("temperature", "top_k", "top_p", "min_p", "seed"):
            params[field] = [getattr(r, field) for r in rows]
        self._positions = np.array([r._pos0 for r in rows], np.int64)
        return params

    def _grammar(self, rows: List[Request]) -> Any:
        """A batch's ``grammar=`` (None when no row has a grammar; ``_gram_rows`` lists the rows
        that have one), its state words gathered in stream order when the rows changed
        (``PipelineGrammar``, made at the first such batch)."""
        gram = self._gram
        if not self._constrained:
            self._gram_rows = None
            return None if gram is None else gram.call(rows)
        if gram is None:
            from .grammar import PipelineGrammar

            gram = self._gram = PipelineGrammar(self, 0 if self._spec is None else self._spec.k)
        self._gram_rows = [(i, r) for i, r in enumerate(rows) if r._grammar is not None] or None
        return gram.call(rows)

    def _penalties(self, rows: List[Request]) -> Optional[PipelinePenalties]:
        """The router's hook for a batch (docs/penalties.md), None when no row has penalties."""
        pen = self._pen
        if pen is None:
            if not self._penalised:
                return None
            pen = self._pen = PipelinePenalties(self, self._penalty_capacity,
                                                0 if self._spec is None else self._spec.k)
        return pen.rows(rows)

    def _reserve(self, rows: List[Request], launch: int) -> List[Request]:
        """KV blocks for this launch's positions, through the budget; returns the rows left
        (``_reserve_or_preempt``).

        With a known block size the pipeline reserves only for the rows its schedule says cross
        a block boundary, and keeps the in-flight accounting itself: a discarded step's block
        always leaves with its request (finish, abort or preemption return every block), so
        there is no single reservation to roll back and the router's ledger is not needed. A
        model that does not say its block size decides per row, through the budget's ledger (so
        a discarded step's reservation can be rolled back exactly)."""
        if self._block_size is None:
            budget = self.budget
            return self._reserve_or_preempt(
                rows, rows, lambda due: budget.reserve_many([r._seq for r in due]))  # type: ignore[misc]
        due = self._boundary.pop(launch, None)
        if not due:
            return rows
        try:
            rows = self._reserve_or_preempt(rows, due, self._take_due)
        except BaseException:
            # A model's reserve that raised (not a full pool) took nothing for the rows it did
            # not serve: they stay due at this launch, which the next step() makes again (the
            # rows served before it have their block, and the retry finds it there).
            again = [r for r in due if r.status is _RUNNING]
            if again:
                self._boundary[launch] = again
            raise
        self._reschedule(due, launch + self._block_size)
        return rows

    def _take_due(self, due: List[Request]) -> int:
        """The block of each of ``due`` for the launch being made, in one budget call (the
        rows given one join ``_taking``); the index of the first the pool could not serve, or
        -1."""
        served, missed = self.budget.take_many([r._seq for r in due])  # type: ignore[misc]
        if served:
            self._taking += (due[:served] if not missed else
                             [r for i, r in enumerate(due[:served]) if i not in missed])
        return served if served < len(due) else -1

    def _reserve_or_preempt(self, rows: List[Request], due: List[Request],
                            reserve: Callable[[List[Request]], int]) -> List[Request]:
        """The one place a full pool preempts (the plain step's and the speculative step's):
        ``reserve(due)`` takes the blocks of each of ``due`` in order and returns the index of
        the first one the pool could not serve (-1: all served). Then the youngest running row
        of ``rows`` gives its blocks back and waits to resume (recompute), and the rest of
        ``due`` is asked again. Returns the rows left."""
        while due:
            failed = reserve(due)
            if failed < 0:
                break
            victim = max((r for r in rows if r.status is _RUNNING), key=_order_of)
            if victim in self._taking:  # its block for the launch being made goes back with
                self._taking.remove(victim)  # the rest of its blocks, never reserved for it
                self.budget.untake(1)
            self._preempt(victim)
            rows = [r for r in rows if r is not victim]
            due = [r for r in due[failed:] if r is not victim]
        return rows

    def _reschedule(self, reqs: List[Request], launch: int) -> None:
        """``reqs`` crossed a block boundary at this launch: the ones still running cross the
        next one at ``launch``; the others are due nowhere (one pass: it runs every step)."""
        keep = []
        for r in reqs:
            if r.status is _RUNNING and r._last >= launch:
                r._bound = launch
                keep.append(r)
            else:
                r._bound = -1
        if keep:
            entries = self._boundary.get(launch)
            if entries is None:
                self._boundary[launch] = keep
            else:
                entries += keep

    def _await(self) -> None:
        step = self._inflight.popleft()
        self.stats.steps += 1
        try:
            ids = self.io.await_result(step.ticket)
        except BaseException as exc:
            self._fault(step.launch, len(step.taken), exc)
            raise
        if step.taken:
            self.budget.settle(len(step.taken))
        if self._debug is not None:
            try:
                self._debug.check(step, self._prev_ids)
            except FeedError as exc:
                self._fault(step.launch, 0, exc)
                raise
            self._prev_ids = ids
        rows, dead, lists = step.rows, step.dead, step.lists
        finishing: List[Tuple[Request, RequestStatus]] = []
        hits = self._stop_union.intersection(ids) if self._stop_union else None
        if NO_TOKEN in ids or (hits and self._penalised):
            dead = self._no_candidate(rows, ids, dead, hits, finishing)
        ends: Optional[List[Request]] = None
        if step.gram is not None:
            dead, ends = self._walk(step.gram, ids, dead, finishing)
        if dead is None:
            _drain(map(list.append, lists, ids))  # each row's token, in a C loop
        else:  # the same C loop over the runs between the few rows thrown away
            lo = 0
            for at in sorted(dead):
                _drain(map(list.append, lists[lo:at], ids[lo:at]))
                lo = at + 1
            _drain(map(list.append, lists[lo:], ids[lo:]))
        if step.lp is not None:  # with the tokens, so each list keeps one entry per token
            ticket = step.ticket
            values, top, n = ticket.logprobs, ticket.top, ticket.top_n
            for i, out, tops, k in step.lp:
                if dead is None or i not in dead:
                    out.append(values[i])
                    if tops is not None:
                        at = i * n
                        tops.append(list(zip(top[0][at:at + k], top[1][at:at + k])))
        if hits:
            for i, (req, token) in enumerate(zip(rows, ids)):
                if token in hits and token in req.stop_ids and req.status is _RUNNING and (
                        dead is None or i not in dead) and len(req.tokens) >= req.min_tokens:
                    finishing.append((req, RequestStatus.FINISHED_STOPPED))
        if ends:  # a state with no outgoing transition: "stop", unless a stop id said so first
            done = {id(req) for req, _ in finishing}
            finishing += [(req, RequestStatus.FINISHED_STOPPED) for req in ends
                          if id(req) not in done]
        for req in self._ending.pop(step.launch, ()):
            if req.status is _RUNNING and req._last == step.launch and (
                    not finishing or all(req is not done for done, _ in finishing)):
                finishing.append((req, RequestStatus.FINISHED_LENGTH))
        if finishing:
            self._finish_all(finishing)

    def _walk(self, gram: List[Tuple[int, Request]], ids: List[int], dead: Optional[Set[int]],
              finishing: List[Tuple[Request, RequestStatus]]
              ) -> Tuple[Optional[Set[int]], List[Request]]:
        """The host's walk of each row with a grammar over the id its step picked, before the
        ids are committed: the request's state after its committed tokens (what a row that
        joins again takes as its word), and the requests whose state now has no outgoing
        transition (returned). An id its state does not allow (the device's state word and the
        host's disagree) is never committed: the request finishes ``"grammar"`` and the row
        joins the returned set of rows thrown away."""
        from .grammar import walk

        ends: List[Request] = []
        copied = False
        for i, req in gram:
            if (dead is not None and i in dead) or req.status is not _RUNNING:
                continue
            state, end = walk(req._grammar, req._gstate, ids[i])
            if state is None:
                if not copied:  # a copy: the step's own set keeps what was thrown away
                    dead, copied = set(dead or ()), True
                dead.add(i)  # type: ignore[union-attr]
                finishing.append((req, RequestStatus.FINISHED_GRAMMAR))
                continue
            req._gstate = state
            if end:
                ends.append(req)
        return dead, ends

    def _no_candidate(self, rows: List[Request], ids: List[int], dead: Optional[Set[int]],
                      hits: Any, finishing: List[Tuple[Request, RequestStatus]]
                      ) -> Optional[Set[int]]:
        """The rows of an awaited step that had no id they may pick: ``NO_TOKEN`` (a sampled
        row whose every allowed logit was not finite), or a stop id while ``min_tokens`` bans it
        (a greedy row whose every candidate was ``-inf``: the argmax answers the lowest). None
        of it is committed nor fed to a later step: each finishes ``"no_candidate"``
        (``"grammar"`` with a grammar: its state allowed no id it may pick). Returns the rows
        whose ids are not committed."""
        out: Optional[Set[int]] = None  # a copy: the step's own set keeps what was thrown away
        for i, (req, token) in enumerate(zip(rows, ids)):
            if (token == NO_TOKEN or (hits and token in hits and token in req.stop_ids
                                      and len(req.tokens) < req.min_tokens)) and (
                    dead is None or i not in dead) and req.status is _RUNNING:
                if out is None:
                    out = set(dead or ())
                out.add(i)
                finishing.append((req, RequestStatus.FINISHED_NO_CANDIDATE if req._grammar is None
                                  else RequestStatus.FINISHED_GRAMMAR))
        return dead if out is None else out

    def _fault(self, launch: int, added: int, exc: BaseException) -> None:
        """A step whose wait failed (a device-side fault: a host function that raised, a
        kernel fault) or whose debug check failed. Its ids cannot be trusted, nor those of the
        steps in flight after it (they were fed from its cells, and their forwards ran behind
        the fault), nor the KV its forward should have written: every running request is in it
        or joined after it, so each one finishes with ``"error"`` and returns its blocks. The
        steps still in flight are waited for (their ring slots come back) and thrown away.
        Waiting requests are untouched: their prefills come after the fault in stream order."""
        budget = self.budget
        budget.settle(added)  # the failed step's blocks, returned below with their requests
        for later in self._inflight:
            try:
                self.io.await_result(later.ticket)
            except Exception:
                pass  # the same fault, reported again: nothing of it is kept either way
            self.stats.steps += 1
            budget.settle(len(later.taken))
            self.stats.rows_discarded += len(later.rows) - len(later.dead or ())
        self._inflight.clear()
        reason = f"step {launch} failed: {type(exc).__name__}: {exc}"
        for req in self._running:
            req.error = reason
        self._rows, self._seqs, self._lists = [], None, None  # the next launch starts afresh
        self._prev_ids = []
        self._dirty = True
        try:
            self._finish_all([(req, RequestStatus.FINISHED_ERROR) for req in self._running])
        except Exception:
            pass  # a return refused after the fault: they finished, and the fault is the news

    # ---- finishing, aborts and preemption ----

    def _discard_in_flight(self, req: Request) -> None:
        """Mark ``req``'s rows in the steps still in flight as thrown away."""
        for step in self._inflight:
            if step.launch <= req._last and step.launch >= req._join:
                try:
                    at = step.rows.index(req)
                except ValueError:
                    continue
                if step.dead is None:
                    step.dead = set()
                step.dead.add(at)
                self.stats.rows_discarded += 1
                if req in step.taken:  # its block for this step goes back with the rest
                    step.taken.remove(req)  # type: ignore[attr-defined]
                    self.budget.discard(1)

    def _release(self, req: Request) -> None:
        """Every uncommitted reservation rolled back, every block back to the pool. ``req`` has a
        view: it runs, or its prefill is being undone (a request has one exactly then)."""
        self.budget.free(req._seq)  # type: ignore[arg-type]
        req._seq = None

    def _leave(self, req: Request) -> None:
        # Out of the launch schedules, so a long-running pipeline keeps no stale entries.
        for table, key in ((self._ending, req._last), (self._boundary, req._bound)):
            entries = table.get(key)
            if entries is not None and req in entries:
                entries.remove(req)
                if not entries:
                    del table[key]
        req._bound = -1
        self._sampled -= req.temperature > 0.0
        self._with_lp -= req.logprobs is not None
        self._constrained -= req._grammar is not None
        if not self._constrained and self._gram is not None:
            self._gram.release()  # the joined automaton, after the steps queued with it
        self._discard_in_flight(req)
        if self._spec is not None:
            self._spec.discard(req)
        self._running.remove(req)
        self._dirty = True
        # Its blocks and its penalty slot last: one the model or the stream refuses raises with
        # the request already out of the batch, never left running with no view.
        try:
            self._release(req)
        finally:
            if self._pen is not None:
                self._pen.leave(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        try:
            if req.status is _RUNNING:
                self._leave(req)
            else:  # waiting or preempted: in the queue, with no view and no block
                self._waiting.remove(req)
        finally:
            req.status = status
            self.stats.finished += 1
            self._finished.append(req)

    def _finish_all(self, finishing: Iterable[Tuple[Request, RequestStatus]]) -> None:
        """Finish each one; a return of blocks or of a penalty slot that raises does not stop
        the others (a row left running past its last launch would never finish): the first such
        error is raised once all have finished."""
        error: Optional[BaseException] = None
        for req, status in finishing:
            try:
                self._finish(req, status)
            except Exception as exc:
                if error is None:
                    error = exc
        if error is not None:
            raise error

    def _preempt(self, req: Request) -> None:
        try:
            self._leave(req)
        finally:
            req.status = _PREEMPTED
            self._waiting.appendleft(req)  # first in line to resume
            self.stats.preemptions += 1

    def abort(self, req: Request) -> None:
        """Finish ``req`` now (reason ``"abort"``): its steps in flight are discarded and its
        blocks returned. A finished request is left as it is. It is reported by the next
        ``step()``.

        Any thread may call it: while another thread's ``step()`` runs, the abort applies when
        that step ends (the request may still commit that step's token, or finish first).

        Raises
        ------
        FeedError
            ``req`` belongs to another pipeline.
        """
        if not isinstance(req, Request) or req._pipe is not self:
            raise FeedError(f"{req!r} was not submitted to this pipeline")
        self._post(self._abort_now, req)

    def _abort_now(self, req: Request) -> None:
        if not req.status.finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    # ---- closing ----

    def close(self) -> None:
        """Abort whatever runs or waits, return every KV block and ring slot (after the steps
        in flight)."""
        with self._lock("close"):
            if self._closed:
                return
            try:
                self._drain()
                for req in list(self._running) + list(self._waiting):
                    self._abort_now(req)
                self._inflight.clear()
            finally:
                # Even when an abort failed (a model's release raised), the ring and the debug
                # buffers go: nothing else would free them.
                self._closed = True
                close_each([self.io.teardown]
                           + [part.close for part in (self._debug, self._pen, self._spec,
                                                      self._gram)
                              if part is not None])

    def __del__(self) -> None:
        # Dropped without close(): the model would keep the requests' KV blocks.
        if not getattr(self, "_closed", True):
            try:
                warnings.warn("DecodePipeline was not closed; closing on collection (call "
                              "close() or use it as a context manager)", ResourceWarning,
                              stacklevel=2)
                self.close()
            except Exception:
                pass  # interpreter shutdown: the runtime may be gone already

    def __enter__(self) -> "DecodePipeline":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()  # frees everything whatever it raises
        except Exception as err:
            # The exception that ended the block is what the caller must see (a Ctrl-C, a
            # failed wait), not one of close's that it caused; close's is noted on it.
            note = getattr(exc, "add_note", None)
            if note is not None:
                note(f"and closing the pipeline raised {type(err).__name__}: {err}")


def close_each(closers: Iterable[Callable[[], Any]]) -> None:
    """Call every closer, whatever the ones before raised, then raise the first error: one part
    that fails to close never leaves the others' events and memory behind."""
    first: Optional[BaseException] = None
    for closer in closers:
        try:
            closer()
        except BaseException as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first


class _Debug:
    """Debug mode: after each launch every feed cell that step's argmax did not write is set to
    ``NO_TOKEN`` (so a stale read shows), and the step's inputs are resolved a second time, in
    stream order before its forward, into a buffer read back with the step: at its await, every
    input id must be in the vocabulary and equal to what the pipeline meant, or the step raises
    ``FeedError`` before any of its ids is committed. No wait is added: the readback completes
    with the step's own event."""

    def __init__(self, pipe: DecodePipeline) -> None:
        self.pipe = pipe
        rows = pipe.max_rows
        cells = getattr(pipe.model, "feed_cells", None)
        self.cells = cells
        self.capacity = cells.nbytes // 4 if cells is not None else 0
        self.poison = _core.DeviceBuffer(max(1, self.capacity) * 4)
        self.poison.memset_async(0xFF, pipe.stream)  # NO_TOKEN in every word
        slots = pipe.depth + 1
        self.dev = [_core.DeviceBuffer(rows * 4) for _ in range(slots)]
        self.host = [_core.PinnedBuffer(rows * 4) for _ in range(slots)]
        self.next = 0

    def before(self, sources: Any, rows: int) -> int:
        if self.cells is None:
            return -1
        slot = self.next
        self.next = (slot + 1) % len(self.dev)
        prev = getattr(self.pipe.model, "feed_prev_rows", 0)
        stream = self.pipe.stream
        _core.resolve_feed(sources, self.cells, self.dev[slot], stream, prev_rows=prev)
        _core.copy_d2h_async(self.dev[slot], self.host[slot], stream)
        return slot

    def after(self, rows: int) -> None:
        if self.cells is None or rows >= self.capacity:
            return
        _core.copy_d2d_async(self.cells.ptr + rows * 4, self.poison, (self.capacity - rows) * 4,
                             self.pipe.stream)

    def check(self, step: _Step, prev_ids: List[int]) -> None:
        if step.debug_slot < 0:
            return
        rows = len(step.rows)
        got = _core.read_pinned_u32(self.host[step.debug_slot].ptr, rows)
        vocab = self.pipe.vocab
        for row, (source, token) in enumerate(zip(step.sources, got)):
            source = FeedSource(source)
            meant = source.value if source.is_host else (
                prev_ids[source.value] if source.value < len(prev_ids) else None)
            if token == meant == NO_TOKEN and step.dead and row in step.dead:
                continue  # its request had no candidate in the step before and left
            if token >= vocab or (meant is not None and token != meant):
                raise FeedError(f"debug: row {row} of launch {step.launch} read input id "
                                f"{token:#x} from {source!r} (expected {meant}); vocabulary "
                                f"{vocab}")

    def close(self) -> None:
        close_each(buf.close for buf in self.dev + self.host + [self.poison])
