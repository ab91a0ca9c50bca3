"""Hypothesis schedules through DecodePipeline with grammar rows (docs/pipeline.md, "Structured
outputs"): requests constrained by one of three automata mixed with free ones, submitted between
steps, aborted with steps in flight, more requests than rows, pools small enough to force
preemption by recompute, depth 1 and 2, plain and speculative (the drafter's own continuation,
with or without a forbidden id among it). Each request must get what it gets decoded alone: the
grammar-aware host loop ``decode`` of test_pipeline_grammar.py for a constrained one, greedy
decoding for a free one, a prefix of it when it was aborted."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_feed import DecodePipeline
from metrale_feed.testing.reference import ReferenceModel
from helpers.leaks import assert_counts_back
from helpers.schedules import play_ops

import metrale_feed as mf
from conftest import VOCAB, greedy_tokens
from test_pipeline_grammar import GrammarDrafter, automaton, decode

# A sparse one that ends now and then, one that never ends, a small one that ends often.
AUTOMATA = [automaton(40), automaton(41, end=0.0), automaton(42, states=3, end=0.3)]


@st.composite
def schedules(draw):
    k = draw(st.sampled_from([None, None, 1, 2, 3]))  # speculative with k drafts or not
    block_size = draw(st.integers(1, 5))
    max_rows = draw(st.integers(1, 5))
    ops, longest = [], 1
    for _ in range(draw(st.integers(2, 12))):
        kind = draw(st.sampled_from(["submit", "submit", "step", "abort"]))
        if kind != "submit":
            ops.append((kind, draw(st.integers(0, 50))))
            continue
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
        max_new = draw(st.sampled_from([1, 2, draw(st.integers(1, 20)), draw(st.integers(1, 20))]))
        grammar = draw(st.sampled_from([None, 0, 0, 1, 2]))
        longest = max(longest, len(prompt) + max_new - 1)
        ops.append(("submit", (prompt, max_new, grammar)))
    # Speculative, a request's KV reaches past its last token (2 k + 1 positions at depth 2).
    need = -(-(longest + (2 * k + 1 if k else 0)) // block_size)
    # A pool from exactly the largest request (preemption whenever two share it) to roomy.
    num_blocks = draw(st.sampled_from([need, need + 1, need * 2, need * max_rows + 8]))
    return k, block_size, max_rows, num_blocks, ops


def play(pipe, ops, drafter):
    """The schedule's submits, steps and aborts, then ``run()``: [(request, submit args)]."""
    submitted = []

    def one(arg):
        prompt, max_new, grammar = arg
        req = pipe.submit(prompt, max_new_tokens=max_new, seed=len(submitted),
                          grammar=None if grammar is None else AUTOMATA[grammar])
        if drafter is not None:
            drafter.know(req)
        return req

    play_ops(pipe, ops, one, submitted)
    return submitted


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(schedules(), st.sampled_from([1, 2]), st.sampled_from([None, 0, 1]))
def test_grammar_schedules_match_the_oracle(host, schedule, depth, forbidden):
    k, block_size, max_rows, num_blocks, ops = schedule
    drafter = None if k is None else GrammarDrafter(k, forbidden=forbidden)
    before = mf.live_objects()
    with ReferenceModel(VOCAB, block_size=block_size, num_blocks=num_blocks,
                        max_rows=max_rows) as model:
        with DecodePipeline(model, max_rows, depth=depth, speculative=drafter) as pipe:
            submitted = play(pipe, ops, drafter)
            assert pipe.stats.reserved_in_flight == 0
            gram = pipe._gram  # no running row has a grammar: the pipeline holds no automaton
            assert gram is None or (gram.joined is None and not gram.offsets)
        assert model.pool.free_count == num_blocks, "KV blocks leaked"
    for req, (prompt, max_new, grammar) in submitted:
        assert req.finished
        if grammar is None:
            want = (greedy_tokens(prompt, max_new, VOCAB), "length")
        else:
            want = decode(AUTOMATA[grammar], prompt, max_new)
        if req.finish_reason == "abort":
            assert req.tokens == want[0][:len(req.tokens)], (req, want)
            continue
        assert (req.tokens, req.finish_reason) == want, (req, want)
    assert_counts_back(before)
