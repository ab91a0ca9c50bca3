"""DecodePipeline.submit(grammar=<TokenAutomaton>) (docs/pipeline.md, "Structured outputs").

The oracles are independent of the pipeline: greedy, numpy's argmax of the reference logits over
``automaton.allowed(state)`` (less the ban) step by step, walking the automaton by ``next``;
sampled, the host backend's ``sample_to_feed`` over one row with ``automaton.bitmask(state)``
as its bitmask, at the row's position. Each is what one request decoded alone must give, so a
batch of constrained and free rows, several automata, preemptions, compaction and aborts, at
depth 1 and 2 and with speculation, must give it too."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from metrale_feed import DecodePipeline, FeedError, TokenAutomaton
from metrale_feed.feed import NO_TOKEN
from metrale_feed.sched.speculative import HostDrafter
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import ReferenceModel, host_logits

from conftest import VOCAB, greedy_tokens, model_for, prompts
from helpers.child import run_python, world_of_one
from helpers.masked_sample import sample_one


def automaton(seed, vocab=VOCAB, states=7, end=0.06):
    """Sparse states of 2 to 40 ids, one dense state (most of the vocabulary), and a state with
    no transition that a few ids lead to (about ``end`` of them)."""
    rng = np.random.default_rng(seed)
    final = states + 1
    table = {}
    for s in range(states):
        ids = rng.choice(vocab, size=int(rng.integers(2, 41)), replace=False)
        table[s] = {int(t): (final if rng.random() < end else int(rng.integers(0, states + 1)))
                    for t in ids}
    table[states] = {t: int(rng.integers(0, states)) for t in range(vocab) if t % 13}  # dense
    table[final] = {}
    return TokenAutomaton(table, initial=0, vocab=vocab)


def decode(auto, prompt, max_new, *, ban=None, stops=(), step=None):
    """(tokens, finish reason) of one request alone: ``step(history, allowed)`` picks each id
    from the allowed ones (default: numpy's argmax of the reference logits, ties to the lowest)."""
    banned = set() if ban is None else {t for t in ban if t != NO_TOKEN}
    history, out, state = list(prompt), [], auto.initial
    while len(out) < max_new:
        allowed = [t for t in auto.allowed(state) if t not in banned]
        if not allowed:
            return out, "grammar"
        if step is None:
            logits = host_logits(history, VOCAB)
            token = allowed[int(np.argmax(logits[allowed]))]
        else:
            token = step(history, allowed)
            if token == NO_TOKEN:
                return out, "grammar"
        assert token in allowed
        out.append(token)
        history.append(token)
        state = auto.next(state, token)
        if token in stops or auto.final(state):
            return out, "stop"
    return out, "length"


def sampler(**sampling):
    """The host sampler over one row with the allowed ids as its bitmask, at the row's position
    ``len(history)`` (what ``sample_to_feed`` draws for the row alone)."""
    def step(history, allowed):
        bits = np.zeros(-(-VOCAB // 32) * 32, bool)
        bits[allowed] = True
        return sample_one(history, np.packbits(bits, bitorder="little").view("<u4"), VOCAB,
                          **sampling)
    return step


def check_allowed(req):
    """Every committed token is one the automaton allows where the ones before it lead."""
    state = req.grammar.initial
    for token in req.tokens:
        state = req.grammar.next(state, token)
        assert state is not None, (req.tokens, token)


def batch(n, seed, automata, free_every=3):
    """``n`` requests (prompt, max_new_tokens, automaton or None): every ``free_every``-th one
    unconstrained, the others cycling through ``automata``."""
    rng = random.Random(seed)
    out = []
    for i, prompt in enumerate(prompts(n, seed=seed)):
        auto = None if i % free_every == free_every - 1 else automata[i % len(automata)]
        out.append((prompt, rng.choice([1, 3, 6, 11, 17]), auto))
    return out


def check(reqs, requests, **sampling):
    step = sampler(**sampling) if sampling.get("temperature", 0.0) > 0.0 else None
    for req, (prompt, max_new, auto) in zip(reqs, requests):
        if auto is None:
            if step is None:
                assert req.tokens == greedy_tokens(prompt, max_new, VOCAB), req
            continue
        check_allowed(req)
        if req.finish_reason == "abort":
            want, _ = decode(auto, prompt, max_new, step=step)
            assert req.tokens == want[:len(req.tokens)]
            continue
        assert (req.tokens, req.finish_reason) == decode(auto, prompt, max_new, step=step), req


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_rows_follow_their_automata(host, no_leaks, depth):
    """Constrained and free rows mixed, two automata in one batch, requests finishing at
    different times (the batch compacts) and joining as rows free up."""
    automata = [automaton(1), automaton(2)]
    requests = batch(14, depth, automata)
    model = model_for(rows=4)
    with DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=m, grammar=a) for p, m, a in requests]
        pipe.run()
        assert pipe.stats.admitted == len(reqs)
        # No running row has a grammar: the pipeline holds none of the automata.
        assert pipe._gram.joined is None and not pipe._gram.offsets
    model.close()
    check(reqs, requests)
    reasons = {r.finish_reason for r, (_, _, a) in zip(reqs, requests) if a is not None}
    assert reasons == {"stop", "length"}, reasons


def test_automata_come_and_go(host, no_leaks):
    """Six automata of different sizes through three rows: each joined one keeps its range of
    states while a running request uses it, ranges never overlap, a new one takes a gap left
    by one no request uses any more, and every request gets the oracle's tokens."""
    automata = [automaton(30 + i, states=3 + 5 * (i % 3)) for i in range(6)]
    requests = [(p, 4 + (i * 7) % 9, automata[i % 6]) for i, p in enumerate(prompts(18, seed=5))]
    model = model_for(rows=3)
    reused = False
    with DecodePipeline(model, 3, depth=2) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=m, grammar=a) for p, m, a in requests]
        seen = {}
        while not pipe.idle:
            pipe.step()
            gram = pipe._gram
            spans = sorted((off, off + a.num_states) for a, off in gram.offsets.items())
            assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans
            for a, off in gram.offsets.items():
                reused |= any(b is not a and lo <= off < hi for b, (lo, hi) in seen.items())
                seen[a] = (off, off + a.num_states)
            running = {r.grammar for r in pipe._running}
            assert running <= set(gram.offsets) or not running
    model.close()
    assert reused  # a range freed by one automaton was taken by another
    check(reqs, requests)


@pytest.mark.parametrize("depth", [1, 2])
def test_sampled_rows_draw_what_the_sampler_draws_over_the_allowed_ids(host, no_leaks, depth):
    automata = [automaton(3), automaton(4)]
    requests = batch(9, 10 + depth, automata)
    sampling = dict(temperature=0.9, top_p=0.95, seed=5)
    model = model_for(rows=3)
    with DecodePipeline(model, 3, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=m, grammar=a, **sampling) for p, m, a in requests]
        pipe.run()
    model.close()
    check(reqs, requests, **sampling)


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_resumes_from_the_committed_tokens(host, no_leaks, depth):
    """A KV pool too small for every running row: the youngest is preempted and resumes by
    recompute, its state word rebuilt on the host from its committed tokens."""
    automata = [automaton(5, end=0.0), automaton(6, end=0.0)]
    requests = [(p, 20, automata[i % 2] if i % 4 else None)
                for i, p in enumerate(prompts(8, seed=3, lo=4, hi=9))]
    model = model_for(rows=4, num_blocks=14, block_size=4)
    with DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=m, grammar=a) for p, m, a in requests]
        pipe.run()
        assert pipe.stats.preemptions > 0
        assert pipe.budget.free_count == 14
    model.close()
    check(reqs, requests)


@pytest.mark.parametrize("depth", [1, 2])
def test_aborts_free_what_they_hold(host, no_leaks, depth):
    """Aborted mid-run, requests keep a prefix of their tokens; once none with a grammar runs,
    the pipeline holds no automaton (the joined one freed after the steps queued with it)."""
    automata = [automaton(7, end=0.0), automaton(8, end=0.0)]
    requests = [(p, 30, automata[i % 2]) for i, p in enumerate(prompts(6, seed=4))]
    model = model_for(rows=4)
    with DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=m, grammar=a) for p, m, a in requests]
        for _ in range(3):
            pipe.step()
        for r in reqs[::2]:
            pipe.abort(r)
        for _ in range(2):
            pipe.step()
        for r in reqs:
            pipe.abort(r)
        pipe.run()
        gram = pipe._gram
        assert gram.joined is None and not gram.offsets and gram.last is None
        # And a new request with a grammar runs as if it were the first.
        again = automaton(9)
        req = pipe.submit([5, 6, 7], max_new_tokens=9, grammar=again)
        pipe.run()
    model.close()
    assert (req.tokens, req.finish_reason) == decode(again, [5, 6, 7], 9)


def test_aborted_rows_keep_prefixes_of_the_oracle(host, no_leaks):
    automata = [automaton(10), automaton(11)]
    requests = batch(10, 6, automata)
    model = model_for(rows=4)
    with DecodePipeline(model, 4, depth=2) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=m, grammar=a) for p, m, a in requests]
        for i in range(12):
            pipe.step()
            if i % 3 == 1:
                pipe.abort(reqs[i % len(reqs)])
        pipe.run()
    model.close()
    assert any(r.finish_reason == "abort" for r in reqs)
    check(reqs, requests)


@pytest.mark.parametrize("depth", [1, 2])
def test_logprobs_are_the_raw_distributions(host, no_leaks, depth):
    """Logprobs and top logprobs of constrained rows are those of the raw logits, as without a
    grammar (the mask excludes ids from the pick, not from the distribution)."""
    from metrale_feed.testing.oracle import reference_logprobs
    from helpers.accuracy import assert_close

    auto = automaton(22)
    model = model_for(rows=3)
    with DecodePipeline(model, 3, depth=depth) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=7, grammar=auto, logprobs=True, top_logprobs=3,
                            temperature=0.7 * (i % 2), seed=i)
                for i, p in enumerate(prompts(4, seed=12))]
        pipe.run()
    model.close()
    for req in reqs:
        check_allowed(req)
        history, want, tops = list(req.prompt), [], []
        for token in req.tokens:
            row = host_logits(history, VOCAB)[None]
            want.append(reference_logprobs(row, [token])[0])
            tops.append(np.argsort(-row[0].astype(np.float64), kind="stable")[:3].tolist())
            history.append(token)
        assert len(req.logprobs) == len(req.tokens) == len(req.top_logprobs)
        assert_close(req.logprobs, np.array(want))
        assert [[i for i, _ in top] for top in req.top_logprobs] == tops


def test_a_final_state_finishes_the_request_stop(host, no_leaks):
    """After a token whose state has no outgoing transition the request finishes "stop", that
    token its last, also when it is the last token max_new_tokens allows."""
    three = TokenAutomaton({0: {10: 1, 11: 1, 12: 1}, 1: {20: 2, 21: 2}, 2: {30: 3}, 3: {}},
                           initial=0, vocab=VOCAB)
    model = model_for(rows=4)
    for depth in (1, 2):
        with DecodePipeline(model, 4, depth=depth) as pipe:
            longer = pipe.submit([1, 2], max_new_tokens=10, grammar=three)
            exact = pipe.submit([3, 4], max_new_tokens=3, grammar=three)
            free = pipe.submit([3, 4], max_new_tokens=6)
            pipe.run()
        for req in (longer, exact):
            assert req.finish_reason == "stop" and len(req.tokens) == 3 and req.tokens[2] == 30
            assert (req.tokens, "stop") == decode(three, req.prompt, req.max_new_tokens)
        assert free.tokens == greedy_tokens([3, 4], 6, VOCAB)
    model.close()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_ban_that_removes_the_last_allowed_id_finishes_grammar(host, no_leaks, depth,
                                                                  temperature):
    """The state after the first token allows only id 40, which the row's ban removes: the
    pick answers NO_TOKEN, nothing of it is committed nor fed, and the request finishes
    "grammar"; the other rows run on."""
    auto = TokenAutomaton({0: {10: 1, 11: 1}, 1: {40: 0}}, initial=0, vocab=VOCAB)
    model = model_for(rows=4)
    with DecodePipeline(model, 4, depth=depth, debug=True) as pipe:
        banned = pipe.submit([1, 2], max_new_tokens=8, ban=(40, NO_TOKEN), grammar=auto,
                             temperature=temperature, seed=3)
        fine = pipe.submit([1, 2], max_new_tokens=8, grammar=auto, temperature=temperature,
                           seed=3)
        free = pipe.submit([5, 6], max_new_tokens=8)
        pipe.run()
    model.close()
    assert banned.finish_reason == "grammar" and len(banned.tokens) == 1, banned.tokens
    assert banned.tokens[0] in (10, 11)
    assert fine.finish_reason == "length" and fine.tokens[1::2] == [40] * 4
    assert free.tokens == greedy_tokens([5, 6], 8, VOCAB)


def test_min_tokens_on_the_one_allowed_stop_id_finishes_grammar(host, no_leaks):
    """A greedy row whose state allows only its stop id while min_tokens bans it: the argmax
    answers the stop id at -inf, which is never committed; the request finishes "grammar"."""
    auto = TokenAutomaton({0: {10: 1, 11: 1}, 1: {7: 0}}, initial=0, vocab=VOCAB)
    model = model_for(rows=2)
    with DecodePipeline(model, 2, depth=2) as pipe:
        req = pipe.submit([1, 2], max_new_tokens=8, stop_ids=[7], min_tokens=4, grammar=auto)
        pipe.run()
    model.close()
    assert req.finish_reason == "grammar" and len(req.tokens) == 1 and req.tokens[0] in (10, 11)


@pytest.mark.parametrize("speculative", [False, True])
def test_host_syncs_equal_steps_at_depth_2(host, no_leaks, speculative):
    """Every row constrained: the state words live and advance on the device, so the host waits
    once a step, admissions, compaction and the joined automaton's rebuilds included."""
    automata = [automaton(12), automaton(13), automaton(14)]
    requests = batch(12, 7, automata, free_every=10 ** 6)
    model = model_for(rows=4, num_blocks=300)
    drafter = GrammarDrafter(2) if speculative else None
    with DecodePipeline(model, 4, depth=2, speculative=drafter) as pipe:
        reqs = []
        for p, m, a in requests:
            reqs.append(pipe.submit(p, max_new_tokens=m, grammar=a, seed=len(reqs)))
            if drafter is not None:
                drafter.know(reqs[-1])
        pipe.run()
        stats = pipe.stats
        assert stats.steps > len(reqs) // 2
        assert stats.host_syncs == stats.steps, stats
    model.close()
    check(reqs, requests)


def test_refusals_queue_nothing(host, no_leaks):
    model = model_for(rows=2)
    auto = automaton(15)

    class NoGrammar(ReferenceModel):
        def feed_info(self):
            return super().feed_info()._replace(grammar=False)

    with DecodePipeline(model, 2) as pipe:
        with pytest.raises(TypeError, match="TokenAutomaton"):
            pipe.submit([1], max_new_tokens=2, grammar={0: {1: 0}})
        with pytest.raises(ValueError, match="vocabulary of 212"):
            pipe.submit([1], max_new_tokens=2, grammar=automaton(15, vocab=VOCAB + 1))
        with pytest.raises(ValueError, match="initial state allows no id"):
            pipe.submit([1], max_new_tokens=2,
                        grammar=TokenAutomaton({0: {}}, initial=0, vocab=VOCAB))
        assert pipe.idle
        req = pipe.submit([1], max_new_tokens=3, grammar=auto)
        pipe.run()
        assert (req.tokens, req.finish_reason) == decode(auto, [1], 3)
    model.close()
    other = NoGrammar(VOCAB, block_size=4, num_blocks=50, max_rows=2)
    with DecodePipeline(other, 2) as pipe:
        with pytest.raises(FeedError, match="grammar=False"):
            pipe.submit([1], max_new_tokens=2, grammar=auto)
        assert pipe.idle
    other.close()


def test_json_schema_outputs_parse_and_validate(host, no_leaks):
    """A JSON schema through outlines-core over a hand-made vocabulary: every output ends
    within its max_new_tokens, parses with json.loads and has the schema's fields and types."""
    outlines_core = pytest.importorskip("outlines_core")
    texts = (list('{}":,0123456789abcdefghijklmnopqrstuvwxyz -') + ['{"', '":', ',"', '"}', "true",
             "false", "name", "ok", "n", "count", '"name"', '"ok"'])
    eos = len(texts)
    vocabulary = outlines_core.Vocabulary(eos, {t: [i] for i, t in enumerate(texts)})
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"},
        "count": {"enum": [0, 7, 42]}},
        "required": ["name", "ok", "count"]}
    auto = TokenAutomaton.from_json_schema(json.dumps(schema), vocabulary, vocab=VOCAB,
                                           whitespace_pattern="")
    model = model_for(rows=4)
    with DecodePipeline(model, 4, depth=2, speculative=None) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=60, grammar=auto,
                            temperature=0.0 if i % 2 else 1.0, seed=i)
                for i, p in enumerate(prompts(6, seed=8))]
        pipe.run()
        assert pipe.stats.host_syncs == pipe.stats.steps
    model.close()
    for i, req in enumerate(reqs):
        assert req.finish_reason == "stop" and req.tokens[-1] == eos, req
        value = json.loads("".join(texts[t] for t in req.tokens[:-1]))
        assert set(value) == {"name", "ok", "count"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 4
        assert isinstance(value["ok"], bool) and value["count"] in (0, 7, 42)
        if i % 2:
            assert (req.tokens, "stop") == decode(auto, req.prompt, 60)


# ---- speculation ----


class GrammarDrafter(HostDrafter):
    """Drafts a row's own greedy continuation (``decode``; a free row's greedy ids): every
    draft accepted.
    ``forbidden`` puts an id the row's state forbids at draft ``forbidden`` (then the
    continuation as if it were allowed), so the verify must reject it whatever its logit.
    Rows are told apart by their seed (``know``)."""

    def __init__(self, k, forbidden=None):
        super().__init__(k)
        self.forbidden = forbidden
        self.rows = {}

    def know(self, req):
        self.rows[req.seed] = (len(req.prompt), req.grammar)

    def draft(self, history, k, seed, mask):
        plen, auto = self.rows[seed]
        if auto is None:  # the row's unconstrained greedy ids
            return ReferenceDrafter(VOCAB, k, 1.0).draft(history, k, seed, mask)
        state = auto.walk(history[plen:])
        if state is None or auto.final(state):  # the step in flight ends the request
            return []
        out, h = [], list(history)
        for j in range(k):
            allowed = [t for t in auto.allowed(state) if t not in mask]
            if not allowed:
                break
            token = allowed[int(np.argmax(host_logits(h, VOCAB)[allowed]))]
            if j == self.forbidden:
                token = next(t for t in range(VOCAB) if t not in auto.allowed(state))
                out.append(token)
                h.append(token)
                continue
            out.append(token)
            h.append(token)
            state = auto.next(state, token)
            if auto.final(state):
                break
        return out


class ForbiddenDrafter(HostDrafter):
    """Only ids the row's state forbids, the one with the greatest logit first."""

    def __init__(self, k):
        super().__init__(k)
        self.rows = {}

    know = GrammarDrafter.know

    def draft(self, history, k, seed, mask):
        plen, auto = self.rows[seed]
        state = auto.walk(history[plen:])
        if state is None:  # the step in flight ends the request
            return []
        allowed = set(auto.allowed(state))
        logits = host_logits(history, VOCAB)
        return [int(t) for t in np.argsort(-logits, kind="stable") if t not in allowed][:k]


def drafters(k):
    return {"grammar": GrammarDrafter(k), "forbidden-2nd": GrammarDrafter(k, forbidden=1),
            "forbidden": ForbiddenDrafter(k), "reference": ReferenceDrafter(VOCAB, k, 1.0)}


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("which", ["grammar", "forbidden-2nd", "forbidden", "reference"])
def test_speculative_greedy_tokens_equal_the_oracle(host, no_leaks, depth, k, which):
    """Whatever the drafter proposes (the row's own continuation, a forbidden id among it, only
    forbidden ids, the unconstrained greedy ids), the tokens are the oracle's, the state words
    walked through the drafts on the device."""
    automata = [automaton(16), automaton(17)]
    requests = batch(9, 20 + k, automata, free_every=10 ** 6 if which == "forbidden" else 3)
    drafter = drafters(k)[which]
    model = model_for(rows=3, num_blocks=300)
    with DecodePipeline(model, 3, depth=depth, speculative=drafter) as pipe:
        reqs = []
        for p, m, a in requests:
            reqs.append(pipe.submit(p, max_new_tokens=m, grammar=a, seed=len(reqs)))
            if hasattr(drafter, "know"):
                drafter.know(reqs[-1])
        pipe.run()
        stats = pipe.stats
        assert pipe.budget.free_count == 300
    model.close()
    check(reqs, requests)
    if which == "grammar":
        assert stats.accepted > stats.drafted // 2, stats
    if which == "forbidden":
        assert stats.accepted == 0 and stats.drafted > 0, stats


@pytest.mark.parametrize("depth", [1, 2])
def test_speculative_sampled_rows_keep_to_the_automaton(host, no_leaks, depth):
    """Sampled rows under speculation draw by the verify's rule, not the plain pipeline's
    draws: every token is one their automaton allows, and they finish as their tokens say."""
    automata = [automaton(23), automaton(24)]
    drafter = GrammarDrafter(2, forbidden=1)
    model = model_for(rows=3, num_blocks=300)
    with DecodePipeline(model, 3, depth=depth, speculative=drafter) as pipe:
        reqs = []
        for i, p in enumerate(prompts(6, seed=13)):
            reqs.append(pipe.submit(p, max_new_tokens=12, grammar=automata[i % 2],
                                    temperature=1.0, seed=i))
            drafter.know(reqs[-1])
        pipe.run()
        assert pipe.stats.accepted > 0
    model.close()
    for req in reqs:
        check_allowed(req)
        end = req.grammar.final(req.grammar.walk(req.tokens))
        assert req.finish_reason == ("stop" if end else "length"), req
        assert end or len(req.tokens) == 12


@pytest.mark.parametrize("depth", [1, 2])
def test_speculative_preemption_compaction_and_aborts(host, no_leaks, depth):
    automata = [automaton(18, end=0.02), automaton(19, end=0.02)]
    requests = [(p, 18, automata[i % 2] if i % 3 else None)
                for i, p in enumerate(prompts(8, seed=9, lo=3, hi=8))]
    drafter = GrammarDrafter(2, forbidden=1)
    model = model_for(rows=4, num_blocks=18, block_size=4)
    with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
        reqs = []
        for p, m, a in requests:
            reqs.append(pipe.submit(p, max_new_tokens=m, grammar=a, seed=len(reqs)))
            drafter.know(reqs[-1])
        for _ in range(4):
            pipe.step()
        pipe.abort(reqs[1])
        pipe.run()
        assert pipe.stats.preemptions > 0
        assert pipe.budget.free_count == 18
    model.close()
    check(reqs, requests)


@pytest.mark.parametrize("depth", [1, 2])
def test_speculative_stop_and_grammar_finishes(host, no_leaks, depth):
    three = TokenAutomaton({0: {10: 1, 11: 1, 12: 1}, 1: {20: 2, 21: 2}, 2: {30: 3}, 3: {}},
                           initial=0, vocab=VOCAB)
    loop = TokenAutomaton({0: {10: 1, 11: 1}, 1: {40: 0}}, initial=0, vocab=VOCAB)
    stop_loop = TokenAutomaton({0: {10: 1, 11: 1}, 1: {7: 0}}, initial=0, vocab=VOCAB)
    drafter = GrammarDrafter(3)
    model = model_for(rows=4, num_blocks=300)
    with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
        reqs = [pipe.submit([1, 2], max_new_tokens=10, grammar=three, seed=0),
                pipe.submit([1, 2], max_new_tokens=3, grammar=three, seed=1),
                pipe.submit([1, 2], max_new_tokens=8, grammar=loop, ban=(40, NO_TOKEN), seed=2),
                pipe.submit([1, 2], max_new_tokens=8, grammar=stop_loop, stop_ids=[7],
                            min_tokens=4, seed=3)]
        for r in reqs:
            drafter.know(r)
        pipe.run()
    model.close()
    for req in reqs[:2]:
        assert req.finish_reason == "stop" and len(req.tokens) == 3 and req.tokens[2] == 30
    for req in reqs[2:]:
        assert req.finish_reason == "grammar" and len(req.tokens) == 1, req.tokens


# ---- over a split vocabulary ----

HERE = os.path.dirname(os.path.abspath(__file__))

SHARDED = world_of_one(r"""
import metrale_feed as mf
from conftest import VOCAB, prompts
from metrale_feed.testing.reference import ReferenceModel
from test_pipeline_grammar import GrammarDrafter, automaton, decode

shard = mf.VocabShard(None, VOCAB, max_rows=16)
shard._force_exchange = True  # a world of one through the partial, the exchange and the combine
automata = [automaton(20), automaton(21)]
for depth in (1, 2):
    for spec in (False, True):
        drafter = GrammarDrafter(2, forbidden=1) if spec else None
        model = ReferenceModel(VOCAB, block_size=4, num_blocks=200, max_rows=4, shard=shard)
        before = shard.stats["collectives"]
        with mf.DecodePipeline(model, 4, depth=depth, shard=shard, speculative=drafter) as pipe:
            reqs = []
            for i, p in enumerate(prompts(6, seed=depth)):
                reqs.append(pipe.submit(p, max_new_tokens=9, grammar=automata[i % 2], seed=i))
                if drafter is not None:
                    drafter.know(reqs[-1])
            pipe.run()
            assert depth == 1 or pipe.stats.host_syncs == pipe.stats.steps, pipe.stats
        model.close()
        assert shard.stats["collectives"] > before, shard.stats
        for r, p in zip(reqs, prompts(6, seed=depth)):
            assert (r.tokens, r.finish_reason) == decode(r.grammar, p, 9), (depth, spec, r.tokens)
shard.close()
""", HERE)


def test_a_sharded_pipeline_follows_the_automata():
    """A world of one through the exchange (each rank masks the whole vocabulary and advances
    by the combined ids): plain and speculative, depth 1 and 2, the unsharded oracle's tokens.
    Skipped without torch.distributed."""
    pytest.importorskip("torch.distributed")
    result = run_python(SHARDED, timeout=300)
    assert "OK" in result.stdout, result.describe()
