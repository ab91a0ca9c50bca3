"""Hypothesis schedules through DecodePipeline against the host oracle: random submissions
between steps, prompts of 1 to 40 ids, stops (on the first generated token too), one new token,
aborts with steps in flight, more requests than rows, pools small enough to force preemption,
host lag, depth 1 and 2."""

from __future__ import annotations


from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metrale_feed as mf
from metrale_feed import DecodePipeline
from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.reference import ReferenceModel, host_next_token
from helpers.leaks import assert_counts_back

from conftest import check_greedy, greedy_tokens, play


@st.composite
def schedules(draw):
    vocab = draw(st.integers(3, 300))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    block_size = draw(st.integers(1, 5))
    max_rows = draw(st.integers(1, 5))
    ops, longest = [], 1
    for _ in range(draw(st.integers(1, 9))):
        kind = draw(st.sampled_from(["submit", "submit", "step", "abort"]))
        if kind != "submit":
            ops.append((kind, draw(st.integers(0, 50))))
            continue
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
        max_new = draw(st.sampled_from([1, 2, draw(st.integers(1, 14))]))
        ban = None
        ban_kind = draw(st.sampled_from(["none", "none", "winner", "random"]))
        if ban_kind == "winner":
            ban = (host_next_token(prompt, vocab, dtype), NO_TOKEN)
        elif ban_kind == "random":
            ban = (draw(st.integers(0, vocab - 1)), draw(st.integers(0, vocab - 1)))
        stops = ()
        stop_kind = draw(st.sampled_from(["none", "first", "later", "other"]))
        if stop_kind != "none":
            trajectory = greedy_tokens(prompt, max_new, vocab, dtype, ban=ban)
            if stop_kind == "first":
                stops = (trajectory[0],)
            elif stop_kind == "later":
                stops = (trajectory[draw(st.integers(0, len(trajectory) - 1))],)
            else:
                stops = tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=3)))
        longest = max(longest, len(prompt) + max_new - 1)
        ops.append(("submit", (prompt, max_new, stops, ban)))
    need = -(-longest // block_size)
    # A pool from exactly the largest request (preemption whenever two share it) to roomy.
    num_blocks = draw(st.sampled_from([need, need + 1, need * 2, need * max_rows + 8]))
    return vocab, dtype, block_size, max_rows, num_blocks, ops


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(schedules(), st.sampled_from([1, 2]), st.sampled_from([0, 0, 50]), st.booleans())
def test_schedules_match_greedy_decoding(host, schedule, depth, lag_us, debug):
    vocab, dtype, block_size, max_rows, num_blocks, ops = schedule
    mf.configure_host(lag_us=lag_us)
    before = mf.live_objects()
    submitted = []
    try:
        with ReferenceModel(vocab, block_size=block_size, num_blocks=num_blocks,
                            max_rows=max_rows, logits_dtype=dtype) as model:
            with DecodePipeline(model, max_rows, depth=depth, debug=debug) as pipe:
                play(pipe, ops, submitted)
                assert pipe.stats.reserved_in_flight == 0
                if debug and depth == 2:
                    assert pipe.stats.host_syncs == pipe.stats.steps
            assert model.pool.free_count == num_blocks, "KV blocks leaked"
        check_greedy(submitted, vocab, dtype)
    finally:
        mf.configure_host()
    assert_counts_back(before)


def test_a_pool_that_forces_preemption_in_every_schedule_shape(host, no_leaks):
    """Preemption happens (not just may happen): three long requests over a pool that holds
    little more than one, at both depths, under lag."""
    vocab = 97
    prompts = [[i + 1] * (5 + i) for i in range(3)]
    for depth in (1, 2):
        mf.configure_host(lag_us=100)
        with ReferenceModel(vocab, block_size=2, num_blocks=10, max_rows=3) as model:
            with DecodePipeline(model, 3, depth=depth) as pipe:
                reqs = [pipe.submit(p, max_new_tokens=12) for p in prompts]
                pipe.run()
                assert pipe.stats.preemptions >= 2
                assert [r.tokens for r in reqs] == [greedy_tokens(p, 12, vocab) for p in prompts]
            assert model.pool.free_count == 10
        mf.configure_host()
