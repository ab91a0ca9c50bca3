"""DecodePipeline.submit(grammar=<HostGrammar>) (docs/pipeline.md, "Structured outputs").

The oracle is xgrammar's own matcher loop on the host, independent of the pipeline: a fresh
matcher per request fills the bitmask, numpy's masked argmax of the reference logits
(``reference_argmax``, the ban included) picks, the matcher accepts; a terminated matcher or a
stop id ends the request "stop", a bitmask that leaves nothing "grammar". Sampled rows: the host
backend's ``sample_to_feed`` over one row with that bitmask, at the row's position. One request
decoded alone must give it, so batches of free rows, ``TokenAutomaton`` rows and host-grammar
rows, preemptions, compaction and aborts, at depth 1 and 2, must give it too. The grammars are
recursive (JSON, nested lists): no finite automaton holds them."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from metrale_feed import DecodePipeline, FeedError, HostGrammar
from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.oracle import reference_argmax
from metrale_feed.testing.reference import ReferenceModel, host_logits

from conftest import VOCAB, greedy_tokens, model_for, prompts
from helpers.child import run_python, world_of_one
from helpers.json_schema import SCHEMA
from helpers.masked_sample import sample_one
from test_pipeline_grammar import automaton, decode

xgr = pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install xgrammar)")

# Pieces of JSON, then two-character fillers up to the pipeline tests' vocabulary; the last id is
# the stop token.
_BASE = ['{', '}', '[', ']', ',', ':', '"', '"ok"', '"n"', '"tag"', 'ok', 'n', 'tag', 'true',
         'false', 'null', '0', '1', '7', '42', '-', '.', 'e', ' ', '\n', '"x', 'y"', 'x', 'y',
         'tr', 'ue', 'fa', 'lse', '"a"', '"b"', 'a', 'b', '}}', '::', '[[', ']]', '],', '[]',
         '{}', '"k"', '3', '9', '":', ',"']
_FILL = [a + b for a in "abcdxyz0123456789" for b in "abxy019,[]{}" if a + b not in _BASE]
PIECES = (_BASE + _FILL)[:VOCAB - 1] + ['</s>']
assert len(PIECES) == VOCAB and len(set(PIECES)) == VOCAB
STOP = VOCAB - 1
WORDS = (VOCAB + 31) // 32
# Lists of digits and lists, nested to any depth: no finite automaton holds it.
NESTED = 'root ::= "[" (item ("," item)*)? "]"\nitem ::= root | [0-9]'

_COMPILED = {}


def compiled(name):
    """The grammar ``name`` ("schema", "nested" or "json") compiled once over ``PIECES``."""
    if name not in _COMPILED:
        info = xgr.TokenizerInfo(PIECES, xgr.VocabType.RAW, vocab_size=VOCAB,
                                 stop_token_ids=[STOP])
        compiler = xgr.GrammarCompiler(info, max_threads=1)
        _COMPILED[name] = (compiler.compile_json_schema(SCHEMA, any_whitespace=False)
                           if name == "schema" else compiler.compile_grammar(NESTED)
                           if name == "nested" else compiler.compile_builtin_json_grammar())
    return _COMPILED[name]


def matcher_loop(name, prompt, max_new, *, ban=None, stops=(), min_tokens=0, **sampling):
    """(tokens, finish reason) of one request alone, by xgrammar's own loop (``min_tokens``: the
    stop ids banned before it, greedy only)."""
    m = xgr.GrammarMatcher(compiled(name))
    bits = np.zeros((1, WORDS), np.int32)
    history, out = list(prompt), []
    while len(out) < max_new:
        m.fill_next_token_bitmask(bits)
        if sampling.get("temperature", 0.0) > 0.0:
            banned = np.zeros(WORDS * 32, bool)
            banned[[t for t in (ban or ()) if t != NO_TOKEN]] = True
            allowed = np.unpackbits(bits.view(np.uint8), bitorder="little").astype(bool) & ~banned
            token = sample_one(history, np.packbits(allowed, bitorder="little").view("<i4"),
                               VOCAB, **sampling) if allowed.any() else NO_TOKEN
        else:
            masks = None if ban is None else [tuple(ban)]
            if len(out) < min_tokens:
                assert ban is None and len(stops) == 1
                masks = [(stops[0], NO_TOKEN)]
            token = int(reference_argmax(host_logits(history, VOCAB)[None, :], masks, bits)[0])
        if token == NO_TOKEN:
            return out, "grammar"
        assert m.accept_token(token), (token, out)
        out.append(token)
        history.append(token)
        if token in stops or m.is_terminated():
            return out, "stop"
    return out, "length"


class Counting(ReferenceModel):
    """The reference model, noting for each pick whether it got a ``bitmask=`` and how many
    steps were still in flight (launched, not yet settled) when it was queued."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.launched = self.settled = 0
        self.picks = []

    def decode_batch_fed(self, sources, seqs, stream):
        self.launched += 1
        return super().decode_batch_fed(sources, seqs, stream)

    def fed_step_settled(self):
        self.settled += 1
        super().fed_step_settled()

    def _note(self, extra):
        self.picks.append((extra.get("bitmask") is not None, self.launched - 1 - self.settled))

    def argmax_batch_to_feed(self, logits, masks, dst, event, stream, **extra):
        self._note(extra)
        super().argmax_batch_to_feed(logits, masks, dst, event, stream, **extra)

    def sample_batch_to_feed(self, logits, params, masks, dst, event, stream, **extra):
        self._note(extra)
        super().sample_batch_to_feed(logits, params, masks, dst, event, stream, **extra)

    def extra_syncs(self):
        """The steps whose bitmask was filled with a step in flight: each read it first."""
        return sum(1 for given, ahead in self.picks if given and ahead > 0)


def requests_of(n, seed, kinds=("schema", "nested", "json", None, "auto")):
    """``n`` requests (prompt, max_new_tokens, kind): host grammars, free rows (None) and
    ``TokenAutomaton`` rows ("auto") mixed."""
    rng = random.Random(seed)
    return [(p, rng.choice([3, 9, 17, 30]), kinds[i % len(kinds)])
            for i, p in enumerate(prompts(n, seed=seed))]


def submit(pipe, requests, **keywords):
    autos = {}
    reqs = []
    for p, m, kind in requests:
        if kind == "auto":
            grammar = autos.setdefault(len(autos) % 2, automaton(40 + len(autos) % 2))
        elif kind is not None:
            grammar = HostGrammar(compiled(kind))
        else:
            grammar = None
        reqs.append(pipe.submit(p, max_new_tokens=m, grammar=grammar, **keywords))
    return reqs


def check(reqs, requests, **sampling):
    for req, (prompt, max_new, kind) in zip(reqs, requests):
        if kind is None:
            if not sampling:
                assert req.tokens == greedy_tokens(prompt, max_new, VOCAB), req
            continue
        if kind == "auto":
            if not sampling:
                want = decode(req.grammar, prompt, max_new)
                if req.finish_reason == "abort":
                    assert req.tokens == want[0][:len(req.tokens)]
                else:
                    assert (req.tokens, req.finish_reason) == want, req
            continue
        want = matcher_loop(kind, prompt, max_new, **sampling)
        if req.finish_reason == "abort":
            assert req.tokens == want[0][:len(req.tokens)], (req, want)
        else:
            assert (req.tokens, req.finish_reason) == want, (kind, req, want)
        if kind == "schema" and req.finish_reason == "stop":
            value = json.loads("".join(PIECES[t] for t in req.tokens[:-1]))
            assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
            assert 0 <= value["n"] <= 99 and value["tag"] in ("a", "b")
        if kind == "json" and req.finish_reason == "stop":
            json.loads("".join(PIECES[t] for t in req.tokens[:-1]))


@pytest.mark.parametrize("depth", [1, 2])
def test_mixed_batches_equal_the_matcher_loop(host, no_leaks, depth):
    """Host grammars, automata and free rows in one batch, finishing at different times (the
    batch compacts) and joining as rows free up; host syncs: one a step, and one more for each
    step whose bitmask was filled while the step before was in flight (never at depth 1)."""
    requests = requests_of(15, depth)
    model = Counting(VOCAB, block_size=4, num_blocks=200, max_rows=4)
    with DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = submit(pipe, requests)
        pipe.run()
        stats = pipe.stats
        extra = model.extra_syncs()
        assert stats.host_syncs == stats.steps + extra, (stats, extra)
        given = sum(1 for g, _ in model.picks if g)
        assert given >= len(reqs) // 2
        assert extra == (0 if depth == 1 else given - sum(1 for g, a in model.picks
                                                          if g and a == 0))
        assert depth == 1 or extra >= given - 3
    model.close()
    check(reqs, requests)
    reasons = {r.finish_reason for r, (_, _, k) in zip(reqs, requests) if k == "schema"}
    assert "stop" in reasons, reasons


def test_every_row_a_host_grammar_at_depth_2_syncs_once_more_a_step(host, no_leaks):
    """Four rows, each a host grammar, admitted together: every step after the first reads the
    one in flight first, so host_syncs == 2 * steps - 1; without them it is steps."""
    requests = [(p, 12, "schema") for p in prompts(4, seed=8)]
    model = Counting(VOCAB, block_size=4, num_blocks=200, max_rows=4)
    with DecodePipeline(model, 4, depth=2) as pipe:
        reqs = submit(pipe, requests)
        pipe.run()
        stats = pipe.stats
        hosted = sum(1 for g, _ in model.picks if g)
        assert hosted == len(model.picks) == stats.steps  # every launch had one
        assert stats.host_syncs == 2 * stats.steps - 1, stats
        steps, syncs = stats.steps, stats.host_syncs
        free = [pipe.submit(p, max_new_tokens=6) for p in prompts(3, seed=9)]
        pipe.run()
        assert stats.host_syncs - syncs == stats.steps - steps  # nothing added without them
    model.close()
    check(reqs, requests)
    for r in free:
        assert r.tokens == greedy_tokens(r.prompt, 6, VOCAB)


@pytest.mark.parametrize("depth", [1, 2])
def test_sampled_rows_draw_what_the_sampler_draws_over_the_bitmask(host, no_leaks, depth):
    requests = requests_of(8, 20 + depth, kinds=("schema", "nested", None))
    sampling = dict(temperature=0.9, top_p=0.95, seed=5)
    model = model_for(rows=3)
    with DecodePipeline(model, 3, depth=depth) as pipe:
        reqs = submit(pipe, requests, **sampling)
        pipe.run()
    model.close()
    check(reqs, requests, **sampling)


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_rebuilds_the_matcher_from_the_committed_tokens(host, no_leaks, depth):
    """A KV pool too small for every running row: the youngest is preempted (its step in flight
    thrown away after its matcher accepted that step's id) and resumes by recompute."""
    requests = [(p, 24, ("nested", "json", None, "auto")[i % 4])
                for i, p in enumerate(prompts(8, seed=3, lo=4, hi=9))]
    model = model_for(rows=4, num_blocks=14, block_size=4)
    with DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = submit(pipe, requests)
        pipe.run()
        assert pipe.stats.preemptions > 0
        assert pipe.budget.free_count == 14
    model.close()
    check(reqs, requests)


@pytest.mark.parametrize("depth", [1, 2])
def test_aborts_keep_prefixes_and_free_the_grammar(host, no_leaks, depth):
    """Aborted mid-run, requests keep a prefix of the loop's tokens; a HostGrammar whose request
    finished may be submitted again and starts over."""
    requests = requests_of(10, 6 + depth)
    model = model_for(rows=4)
    with DecodePipeline(model, 4, depth=depth) as pipe:
        reqs = submit(pipe, requests)
        for i in range(12):
            pipe.step()
            if i % 3 == 1:
                pipe.abort(reqs[i % len(reqs)])
        pipe.run()
        aborted = [r for r in reqs if r.finish_reason == "abort" and isinstance(r.grammar,
                                                                                HostGrammar)]
        assert aborted
        again = pipe.submit([5, 6, 7], max_new_tokens=20, grammar=aborted[0].grammar)
        pipe.run()
    model.close()
    check(reqs, requests)
    assert (again.tokens, again.finish_reason) == matcher_loop(
        next(k for r, (_, _, k) in zip(reqs, requests) if r is aborted[0]), [5, 6, 7], 20)


@pytest.mark.parametrize("depth", [1, 2])
def test_terminated_matcher_and_empty_bitmask_finish(host, no_leaks, depth):
    """The matcher terminates on its stop token: "stop", that token committed. A ban of every
    id the bitmask allows at some step, or min_tokens on the one it allows: "grammar", nothing
    of it committed, the other rows run on."""
    schema = compiled("schema")
    probe = xgr.GrammarMatcher(schema)
    bits = np.zeros((1, WORDS), np.int32)
    probe.fill_next_token_bitmask(bits)
    first = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
    assert len(first) == 1  # '{' and nothing else
    ban = (int(first[0]), NO_TOKEN)
    model = model_for(rows=4)
    with DecodePipeline(model, 4, depth=depth) as pipe:
        done = pipe.submit([1, 2], max_new_tokens=60, grammar=HostGrammar(schema))
        stuck = pipe.submit([3, 4], max_new_tokens=6, ban=ban, grammar=HostGrammar(schema))
        free = pipe.submit([3, 4], max_new_tokens=6)
        held = pipe.submit([1, 2], max_new_tokens=60, stop_ids=[STOP], min_tokens=60,
                           grammar=HostGrammar(schema))
        pipe.run()
    model.close()
    # min_tokens bans the stop token the complete object allows alone: "grammar", before it.
    assert held.finish_reason == "grammar" and held.tokens == done.tokens[:-1]
    assert (held.tokens, "grammar") == matcher_loop("schema", [1, 2], 60, stops=[STOP],
                                                    min_tokens=60)
    assert done.finish_reason == "stop" and done.tokens[-1] == STOP
    assert (done.tokens, "stop") == matcher_loop("schema", [1, 2], 60)
    assert done.grammar.matcher.is_terminated()
    assert stuck.finish_reason == "grammar" and stuck.tokens == []
    assert matcher_loop("schema", [3, 4], 6, ban=ban) == ([], "grammar")
    assert free.tokens == greedy_tokens([3, 4], 6, VOCAB)


@pytest.mark.parametrize("ahead", [False, True])
def test_the_matcher_is_brought_to_any_tokens_exactly(ahead):
    """``HostGrammar._sync`` (what a fill and a step's walk call): forward, back past ids thrown
    away (a rollback), to another id in place of the last one accepted, and to nothing (a reset,
    then the ids again); each time the bitmask is a fresh matcher's after the same ids. With
    ``ahead`` the last id is passed apart, as the id of a step in flight is."""
    grammar = compiled("json")
    probe = xgr.GrammarMatcher(grammar)
    rng = random.Random(4)
    walk = []
    bits = np.zeros((1, WORDS), np.int32)
    for _ in range(24):  # a path the grammar allows, picked at random
        probe.fill_next_token_bitmask(bits)
        allowed = [int(t) for t in np.flatnonzero(np.unpackbits(bits.view(np.uint8),
                                                                bitorder="little")) if t < STOP]
        opening = [t for t in allowed if not set(PIECES[t]) & set("]}")]  # never complete
        walk.append(rng.choice(opening or allowed))
        assert probe.accept_token(walk[-1])
    host = HostGrammar(xgr.GrammarMatcher(grammar), vocab=VOCAB)

    def sync(ids):
        return host._sync(ids[:-1], ids[-1]) if ahead and ids else host._sync(ids)

    got, want = np.zeros((1, WORDS), np.int32), np.zeros((1, WORDS), np.int32)
    other = {}  # cut -> another id the grammar allows there, for a step thrown away
    for cut in range(1, 24):
        fresh = xgr.GrammarMatcher(grammar)
        for t in walk[:cut - 1]:
            assert fresh.accept_token(t)
        fresh.fill_next_token_bitmask(bits)
        ids = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:STOP])
        if len(ids) > 1:
            other[cut] = int(ids[ids != walk[cut - 1]][0])
    thrown = sorted(other)[len(other) // 2]
    for cut in (5, 9, 8, 3, 20, 20, 0, 24, 1, -thrown, thrown + 2):
        if cut < 0:  # the last id accepted is thrown away and another takes its place
            target = walk[:-cut - 1] + [other[-cut]]
            assert sync(walk[:-cut])
            assert sync(target)
            host._fill(got, 0)
            fresh = xgr.GrammarMatcher(grammar)
            for t in target:
                assert fresh.accept_token(t)
            fresh.fill_next_token_bitmask(want)
            assert np.array_equal(got, want), cut
            continue
        assert sync(walk[:cut])
        host._fill(got, 0)
        fresh = xgr.GrammarMatcher(grammar)
        for t in walk[:cut]:
            assert fresh.accept_token(t)
        fresh.fill_next_token_bitmask(want)
        assert np.array_equal(got, want), cut
    fresh = xgr.GrammarMatcher(grammar)
    assert fresh.accept_token(walk[0])
    fresh.fill_next_token_bitmask(want)
    refused = next(t for t in range(VOCAB) if not (want[0, t // 32] >> (t % 32)) & 1)
    assert not sync(walk[:1] + [refused])  # refused: it stands after the ids before
    host._fill(got, 0)
    assert np.array_equal(got, want)


def test_refusals_queue_nothing(host, no_leaks):
    schema = compiled("schema")

    class NoBitmask(ReferenceModel):
        def feed_info(self):
            return super().feed_info()._replace(bitmask=False)

    model = model_for(rows=2)
    with DecodePipeline(model, 2) as pipe:
        with pytest.raises(TypeError, match="HostGrammar"):
            pipe.submit([1], max_new_tokens=2, grammar=xgr.GrammarMatcher(schema))
        with pytest.raises(TypeError, match="GrammarMatcher or CompiledGrammar"):
            HostGrammar(object())
        with pytest.raises(ValueError, match="needs vocab="):
            HostGrammar(xgr.GrammarMatcher(schema))
        with pytest.raises(ValueError, match="vocabulary of 211 ids, not 212"):
            HostGrammar(schema, vocab=VOCAB + 1)
        with pytest.raises(ValueError, match="not 8 words"):
            HostGrammar(xgr.GrammarMatcher(schema), vocab=VOCAB + 40)
        # A matcher for another vocabulary of the same bitmask width: refused at submit.
        other = HostGrammar(xgr.GrammarMatcher(schema), vocab=VOCAB + 1)
        with pytest.raises(ValueError, match="vocabulary of 212 ids; the pipeline's is 211"):
            pipe.submit([1], max_new_tokens=2, grammar=other)
        grammar = HostGrammar(schema)
        first = pipe.submit([1], max_new_tokens=3, grammar=grammar)
        with pytest.raises(ValueError, match="one HostGrammar per request"):
            pipe.submit([2], max_new_tokens=3, grammar=grammar)
        pipe.run()
        assert (first.tokens, first.finish_reason) == matcher_loop("schema", [1], 3)
        assert pipe.idle and pipe.stats.admitted == 1
    model.close()
    other_model = NoBitmask(VOCAB, block_size=4, num_blocks=50, max_rows=2)
    with DecodePipeline(other_model, 2) as pipe:
        with pytest.raises(FeedError, match="bitmask=False"):
            pipe.submit([1], max_new_tokens=2, grammar=HostGrammar(schema))
        assert pipe.idle
    other_model.close()


def test_refused_with_speculation(host, no_leaks):
    from metrale_feed.testing.drafter import ReferenceDrafter

    model = model_for(rows=2, num_blocks=60)
    with DecodePipeline(model, 2, speculative=ReferenceDrafter(VOCAB, 2, 0.5)) as pipe:
        with pytest.raises(ValueError, match="speculative"):
            pipe.submit([1], max_new_tokens=2, grammar=HostGrammar(compiled("schema")))
        assert pipe.idle
    model.close()


HERE = os.path.dirname(os.path.abspath(__file__))
SHARDED = world_of_one(r"""
import pytest, metrale_feed as mf
from conftest import VOCAB
from metrale_feed.testing.reference import ReferenceModel
from test_pipeline_host_grammar import compiled

shard = mf.VocabShard(None, VOCAB, max_rows=2)
model = ReferenceModel(VOCAB, block_size=4, num_blocks=60, max_rows=2, shard=shard)
with mf.DecodePipeline(model, 2, shard=shard) as pipe:
    with pytest.raises(ValueError, match="split vocabulary"):
        pipe.submit([1], max_new_tokens=2, grammar=mf.HostGrammar(compiled("schema")))
    assert pipe.idle
model.close()
shard.close()
""", HERE)


def test_refused_on_a_split_vocabulary():
    pytest.importorskip("torch.distributed")
    result = run_python(SHARDED, timeout=300)
    assert "OK" in result.stdout, result.describe()


def test_import_does_not_import_xgrammar():
    out = run_python("import sys, metrale_feed as mf\n"
                     "mf.HostGrammar\n"
                     "print('xgrammar' in sys.modules)\n", timeout=120)
    assert out.stdout.strip().endswith("False"), out.describe()
