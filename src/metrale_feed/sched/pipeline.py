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
import warnings
from collections import deque
from functools import partial
from typing import (Any, Callable, Deque, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple,
                    Union)

from .. import _checks, _core
from ..contract import BatchPrefill, HostTokenDecode, Prefill, feed_info_of, require
from ..errors import DeviceError, FeedError
from ..feed import NO_TOKEN, FeedSource
from ..kv import SequenceState
from ..trait import ModelDeviceFeed
from .budget import KvBudget
from .penalized import PipelinePenalties
from .request import _RUNNING, _UNMASKED_PAIR, Request, RequestOwner, RequestStatus, _SeqView
from .router import AsyncDeviceIo, SyncDeviceIo, Ticket
from .debug import _Debug
from .host import PipelineHost
from .admission import Admission
from .finishing import Finishing
from .lifecycle import _LoopLock, close_each
from .stats import PipelineStats
from .submission import Submission

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
                 "lp", "gram", "host")

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
        self.host: Optional[List[Tuple[int, Request]]] = None  # DecodePipeline._host_rows


class DecodePipeline(Submission, Admission, Finishing):
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
        self.io: Union[AsyncDeviceIo, SyncDeviceIo] = (
            AsyncDeviceIo(model, max_rows, stream=stream) if depth == 2
            else SyncDeviceIo(model, max_rows, stream=stream))
        self.budget: KvBudget = self.io.budget  # the one owner of the blocks in flight
        self.stats = PipelineStats(self.io.stats, model)
        self._waiting: Deque[Request] = deque()
        self._running: List[Request] = []
        self._inflight: Deque[_Step] = deque()
        # What the requests share of the pipeline (the launch count, the masks' flag): they
        # hold it, not the pipeline.
        self._owner = RequestOwner(vocab)
        # What the step kinds (speculative, debug, grammar, penalties) see of the pipeline: its
        # configuration, the objects above (never rebound) and its operations, held weakly.
        self._host = PipelineHost(
            model=model, info=info, depth=depth, max_rows=max_rows, shard=shard, stream=stream,
            vocab=vocab, stats=self.stats, budget=self.budget, owner=self._owner,
            running=self._running, waiting=self._waiting, admit=self._admit,
            reserve_or_preempt=self._reserve_or_preempt, penalties=self._penalties,
            grammar=self._grammar, finish=self._finish, fault=self._fault)
        self._orders = 0
        self._boundary: Dict[int, List[Request]] = {}  # launch -> rows that cross a block there
        self._ending: Dict[int, List[Request]] = {}  # launch -> rows whose last step it is
        self._stop_union: FrozenSet[int] = frozenset()
        self._finished: List[Request] = []  # finished since the last step() returned
        self._dirty = True  # the batch changed since the last launch: rebuild rows and sources
        self._rows: List[Request] = []  # the last launch's rows
        self._seqs: Optional[List[SequenceState]] = None  # and their sequences
        self._lists: Optional[List[List[int]]] = None  # and their token lists
        self._masks: Any = None
        self._taking: List[Request] = []  # rows given a block for the launch being made
        self._prev_ids: List[int] = []  # debug: the last awaited step's ids
        self._closed = False
        self._debug = _Debug(self._host) if self.debug and self.fed else None
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
        # Host grammars (sched/host_grammar.py): the bitmask buffers, made at the first launch
        # with one; the running requests that have one; the last launch's rows that have one.
        self._hmasks: Any = None
        self._hosted = 0
        self._host_rows: Optional[List[Tuple[int, Request]]] = None
        # Speculative decoding: each step drafts and verifies k positions past the input, so a
        # request's KV may reach k positions past its last token's.
        self._view: Any = _SeqView  # the running requests' KV views
        self._extra_positions = 0
        if speculative is not None:
            from .speculative import SpeculativeStep, _SpecView

            try:
                self._spec = SpeculativeStep(self._host, speculative)
            except BaseException:
                self._closed = True
                self.io.teardown()
                if self._debug is not None:
                    self._debug.close()
                raise
            self.stats.add_speculative(self._spec)
            self._view = _SpecView
            self._extra_positions = self._spec.reach

    # The launch counter and the masks' flag live in the ``RequestOwner`` its requests hold.

    @property
    def _launches(self) -> int:
        return self._owner.launches

    @_launches.setter
    def _launches(self, value: int) -> None:
        self._owner.launches = value

    @property
    def _masks_dirty(self) -> bool:
        return self._owner.masks_dirty

    @_masks_dirty.setter
    def _masks_dirty(self, value: bool) -> None:
        self._owner.masks_dirty = value

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
            self._host_rows = None if not self._hosted else (
                [(i, r) for i, r in enumerate(rows) if r._host is not None] or None)
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
        step.host = self._host_rows
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
                             top_n=self._top_n, grammar=self._gram_call,
                             bitmask=None if self._host_rows is None else self._host_fill(rows))
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
        if not self._sampled or not any(r.sampled for r in rows):
            self._positions = None
            return None
        import numpy as np

        from ..sampling import step_records

        params = step_records([r.params for r in rows])
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

            gram = self._gram = PipelineGrammar(self._host,
                                                0 if self._spec is None else self._spec.k)
        self._gram_rows = [(i, r) for i, r in enumerate(rows) if r._grammar is not None] or None
        return gram.call(rows)

    def _host_fill(self, rows: List[Request]) -> Any:
        """The router's ``bitmask=`` of a launch with host grammars (``HostMasks``, made at the
        first): it reads the step in flight, if any, once the forward is queued."""
        if self._hmasks is None:
            from .host_grammar import HostMasks

            self._hmasks = HostMasks(self.max_rows, self.vocab, self.io, self.stream)
        return self._hmasks.bind(len(rows), self._host_rows,
                                 self._inflight[-1] if self._inflight else None)

    def _penalties(self, rows: List[Request]) -> Optional[PipelinePenalties]:
        """The router's hook for a batch (docs/penalties.md), None when no row has penalties."""
        pen = self._pen
        if pen is None:
            if not self._penalised:
                return None
            pen = self._pen = PipelinePenalties(self._host, self._penalty_capacity,
                                                0 if self._spec is None else self._spec.k)
        return pen.rows(rows)

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
        if step.host is not None:
            from .host_grammar import walk

            dead, more = walk(step.host, ids, dead, finishing)
            ends = more if not ends else ends + more
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
        if not isinstance(req, Request) or req._owner is not self._owner:
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
                                                      self._gram, self._hmasks)
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
