"""What ``DecodePipeline.submit`` checks before a request is queued: its ids, its ban, its
``SamplingParams`` against the pipeline, its grammar, and what the model, the shard and the KV pool
can run. A mixin of ``DecodePipeline``: the checks read the pipeline's configuration and queue
nothing."""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterable, Optional, Tuple

from .. import _checks
from ..errors import FeedError
from ..feed import RowMask
from .penalized import PipelinePenalties
from ..params import SAMPLING_FIELDS, SamplingParams
from .request import Request, check_ban, refuse_no_candidate


class Submission:
    """``DecodePipeline``'s submission half (``submit`` and the checks behind it)."""

    # ---- submission ----

    def _token(self, value: Any, what: str) -> int:
        token = _checks.integer(value, what)
        if not 0 <= token < self.vocab:
            raise ValueError(f"{what} {token} is outside the vocabulary of {self.vocab} ids")
        return token

    def _check_ban(self, ban: Any) -> Optional[RowMask]:
        return check_ban(ban, self.vocab)

    def _refuse_no_candidate(self, mask: Optional[RowMask], stops: FrozenSet[int],
                             min_tokens: int) -> None:
        refuse_no_candidate(mask, stops, min_tokens, self.vocab)

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
        grammar : TokenAutomaton or HostGrammar, optional
            Structured output (docs/pipeline.md, "Structured outputs"): every generated id is one
            the automaton allows from the state the tokens before it reach, masked, picked and
            advanced on the device (no host wait). After a token whose state has no outgoing
            transition the request finishes ``"stop"``; one left with no allowed id it may pick
            (its ban or ``min_tokens`` removed the last) finishes ``"grammar"``. A
            ``HostGrammar`` (an xgrammar matcher, one per request) is the same with the row's
            bitmask filled on the host from the matcher after the tokens before it: at depth 2
            a step with such a row first reads the one in flight (one host sync more); its
            request finishes ``"stop"`` once the matcher has terminated.

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
            KV pool; nothing is queued. A ``grammar`` that is neither a ``TokenAutomaton`` nor a
            ``HostGrammar`` (TypeError), or one for another vocabulary or whose initial state
            allows nothing (ValueError); a ``HostGrammar`` whose request has not finished, or on
            a pipeline with ``shard=`` or ``speculative=`` (ValueError).
        FeedError
            The pipeline is closed, a sampled request for a model without
            ``sample_batch_to_feed``, or a grammar for a model whose feed methods take none
            (``FeedInfo.grammar``; ``FeedInfo.bitmask`` for a ``HostGrammar``).

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
        automaton, host = (None, None) if grammar is None else self._check_grammar(grammar)
        params = self._params_of(params, keywords, max_new)
        if params.penalised:
            self._refuse_no_candidate(mask, stops, params.min_tokens)
        self._refuse_unrunnable(prompt, max_new, stops, params)
        req = Request(self._owner, prompt, max_new, stops, mask, 0, params)
        req._grammar = automaton
        if host is not None:  # one live request a HostGrammar (checked above)
            req._host = host
            host._claim(req)
        self._post(self._enqueue, req)
        return req

    def _check_grammar(self, grammar: Any) -> Tuple[Any, Any]:
        """``submit``'s grammar, checked against this pipeline, as (automaton, host grammar): a
        ``TokenAutomaton`` for its vocabulary whose initial state allows some id, on a model
        whose feed methods take ``grammar=`` (a speculative pipeline's verify is its own call),
        or a ``HostGrammar`` (``_check_host``)."""
        from ..grammar.automaton import TokenAutomaton
        from ..grammar.host import HostGrammar

        if isinstance(grammar, HostGrammar):
            self._check_host(grammar)
            return None, grammar
        if not isinstance(grammar, TokenAutomaton):
            raise TypeError(f"grammar must be a metrale_feed.TokenAutomaton or "
                            f"metrale_feed.HostGrammar, not {type(grammar).__name__}")
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
        return grammar, None

    def _check_host(self, grammar: Any) -> None:
        """A ``HostGrammar`` no live request holds, for this vocabulary, on a pipeline without
        a shard nor speculative decoding, over a model whose feed methods take ``bitmask=``."""
        live = grammar._request
        if live is not None and not live.finished:
            raise ValueError(f"this HostGrammar constrains {live!r}, which has not finished: a "
                             f"matcher holds one request's state, so make one HostGrammar per "
                             f"request")
        if grammar.vocab != self.vocab:
            raise ValueError(f"the HostGrammar is for a vocabulary of {grammar.vocab} ids; the "
                             f"pipeline's is {self.vocab}")
        if self.shard is not None:
            raise ValueError("a HostGrammar's bitmask is filled on the host for the whole "
                             "vocabulary, once a step: a pipeline over a split vocabulary "
                             "(shard=) takes a TokenAutomaton grammar instead")
        if self._spec is not None:
            raise ValueError("a HostGrammar does not run with speculative decoding: each draft "
                             "position would need the matcher's bitmask after the drafts before "
                             "it, which the host knows only once they are read back; use a "
                             "TokenAutomaton (judged on the device) or a pipeline without "
                             "speculative=")
        if not self.info.bitmask:
            raise FeedError(f"{type(self.model).__name__}'s feed methods take no bitmask= (its "
                            f"feed_info() says bitmask=False): a request with a HostGrammar "
                            f"cannot run on it")

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
                           params: SamplingParams) -> None:
        """Refuse a request whose ``params`` are valid (checked when made) but that this
        pipeline cannot run, the most specific refusal first: what speculative decoding cannot
        run on any model, then the vocabulary's and the shard's limits, then what this model
        declares it lacks (its ``FeedInfo``), then what could never fit (the penalty table, the
        KV pool). So a user is never sent after a fix that would not help."""
        spec = self._spec
        if spec is not None:
            # Before the model's logprobs capabilities and the vocabulary: a verify step's
            # logprobs are verify_to_feed's, whatever the model's feed methods take.
            if params.logprobs and self.shard is not None:
                raise ValueError("logprobs are not returned with speculative decoding over a split "
                                 "vocabulary yet (a sampled verify's records carry masses): "
                                 "submit the request without logprobs (or to a pipeline without "
                                 "speculative=)")
            if self.shard is not None and params.sampled:  # a sampled call's rounds
                self.shard._refuse_unfixed_rounds("speculative verifies of sampled requests")
        rounds = getattr(self.shard, "filters", None)
        why = (rounds.refusal(params.top_k, params.top_p)
               if rounds is not None and params.sampled else None)
        if why is not None:  # else the step's first decision faults the shard, every row with it
            raise ValueError(f"{why}: this pipeline's shard cannot sample the request")
        info, name = self.info, type(self.model).__name__
        n = params.top_logprobs
        if n > self.vocab:  # else the lists would end in (NO_TOKEN, NaN) placeholders
            raise ValueError(f"top_logprobs={n} is more than the vocabulary of {self.vocab} ids")
        if n and not info.top_logprobs and spec is None:
            raise FeedError(f"{name}'s feed methods take no top_logprobs= (its feed_info() says "
                            f"top_logprobs=False): a request with top_logprobs > 0 cannot run "
                            f"on it")
        if params.logprobs and params.penalised and not info.raw_logits and spec is None:
            raise FeedError(f"{name}'s feed methods take no raw_logits= (its feed_info() says "
                            f"raw_logits=False): logprobs=True with penalties, logit_bias or "
                            f"min_tokens cannot run on it (the penalties change the logits in "
                            f"place)")
        if params.logprobs and not info.logprobs and spec is None:
            raise FeedError(f"{name}'s feed methods take no logprobs= and logprobs_dst= (its "
                            f"feed_info() says logprobs=False): a request with logprobs=True "
                            f"cannot run on it")
        if params.sampled and not self._can_sample:
            raise FeedError(f"{name} declares no sampling (its feed_info() says sampling=False: "
                            "no sample_batch_to_feed): a request with temperature > 0 cannot "
                            "run on it")
        if params.penalised:
            PipelinePenalties.check(self.model, spec is not None, prompt, max_new, stops,
                                    params.min_tokens, self._penalty_capacity)
        blocks = self._blocks_for(len(prompt) + max_new - 1 + self._extra_positions)
        if blocks is not None and self._pool is not None and blocks > self._pool.num_blocks:
            raise ValueError(f"the request needs {blocks} KV blocks at most (prompt "
                             f"{len(prompt)} + {max_new} new tokens); the pool has "
                             f"{self._pool.num_blocks}")
