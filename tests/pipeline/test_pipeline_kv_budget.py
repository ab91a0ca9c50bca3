"""The KV budget is the one path to a model's blocks (issue 24): a speculative step's extend
goes through the model's ``reserve_blocks_through``, all or none, and the one
"preempt the youngest" rule serves the plain and the speculative step."""

from __future__ import annotations

import pathlib
import re

import pytest

from metrale_feed import DecodePipeline, KvPoolExhausted, SequenceState
from metrale_feed.sched.budget import KvBudget
from metrale_feed.sched.speculative import NGramDrafter
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import ReferenceModel

from conftest import VOCAB, greedy_tokens, model_for, prompts

SCHED = pathlib.Path(__file__).resolve().parents[2] / "src" / "metrale_feed" / "sched"


def _state(model, seqs, budget):
    return (model.pool.free_count, [list(s.block_table) for s in seqs],
            budget.reserved_blocks, budget.reserved_in_flight)


@pytest.mark.parametrize("free_after", [0, 1, 2])
def test_a_refused_extend_leaves_the_pool_and_every_table_as_they_were(host, free_after):
    bs = 4
    with model_for(block_size=bs, num_blocks=8) as model:
        budget = KvBudget(model, bs, model.pool)
        a, b = SequenceState(0), SequenceState(1)
        model.take_prefill_blocks([a, b], [[1] * 5, [2] * 9])  # 2 and 3 blocks
        a.seq_len, b.seq_len = 5, 9
        # Leave ``free_after`` blocks: fewer than the 4 more ``a`` needs to reach position 23.
        hold = SequenceState(2)
        model.take_prefill_blocks([hold], [[3] * ((3 - free_after) * bs)])
        before = _state(model, [a, b, hold], budget)
        with pytest.raises(KvPoolExhausted):
            budget.extend(a, 23)
        assert _state(model, [a, b, hold], budget) == before
        # One that fits takes exactly the blocks up to its last position, counted as reserved.
        if free_after:
            assert budget.extend(a, 7 + free_after * bs) == free_after
            assert len(a.block_table) == 2 + free_after and model.pool.free_count == 0
            assert budget.reserved_blocks == free_after
        for seq in (a, b, hold):
            model.release_sequence(seq)
        assert model.pool.free_count == model.pool.num_blocks


def test_extend_goes_through_the_models_reservation(host):
    """The budget takes no block from the pool itself: the model's ``reserve_blocks_through``
    decides (here it refuses, so no table changes)."""
    calls = []

    class Counting(ReferenceModel):
        def reserve_blocks_through(self, seq, last):
            calls.append(last)
            return super().reserve_blocks_through(seq, last)

    with Counting(VOCAB, block_size=4, num_blocks=4, max_rows=1) as model:
        budget = KvBudget(model, 4, model.pool)
        seq = SequenceState(0)
        assert budget.extend(seq, 9) == 3 and calls == [9]
        model.release_sequence(seq)


def test_speculation_needs_a_model_that_reserves_ahead(host, no_leaks):
    class NoAhead(ReferenceModel):
        reserve_blocks_through = None  # not callable: the capability is missing

    with NoAhead(VOCAB, block_size=4, num_blocks=40, max_rows=2) as model:
        with pytest.raises(TypeError, match=r"reserve_blocks_through\(\) \(ReservesAhead\)"):
            DecodePipeline(model, 2, speculative=NGramDrafter(2))


def _youngest_checked(pipe, victims):
    preempt = pipe._preempt

    def checked(req):
        running = [r for r in pipe._running if r.status.value == "running"]
        assert req is max(running, key=lambda r: r._order), "not the youngest running request"
        victims.append(req)
        preempt(req)

    pipe._preempt = checked


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_full_pool_preempts_the_youngest_running_request(host, no_leaks, speculative, depth):
    """Plain and speculative steps alike: each preemption takes the youngest running request,
    and every request still gets the tokens it gets alone."""
    ps = prompts(6, seed=7 + depth, lo=3, hi=9)
    drafter = ReferenceDrafter(VOCAB, 2, 0.6) if speculative else None
    victims = []
    with model_for(rows=4, block_size=2, num_blocks=18) as model:
        with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
            _youngest_checked(pipe, victims)
            reqs = [pipe.submit(p, max_new_tokens=14) for p in ps]
            pipe.run()
        assert model.pool.free_count == model.pool.num_blocks
    assert victims, "the pool never ran dry: the test checks nothing"
    for req, p in zip(reqs, ps):
        assert req.tokens == greedy_tokens(p, 14, VOCAB)


def test_the_youngest_is_chosen_in_one_place():
    sources = "".join(path.read_text() for path in SCHED.glob("*.py"))
    assert len(re.findall(r"key=_order_of", sources)) == 1


def test_an_abort_gives_back_the_block_of_its_step_in_flight(host, no_leaks):
    """Block size 1: the step in flight took a block for each row. Aborting a row discards its
    block of that step (counted once as rolled back); the other row keeps its tokens."""
    with model_for(rows=2, block_size=1, num_blocks=80) as model, \
            DecodePipeline(model, 2, depth=2) as pipe:
        keep = pipe.submit([5, 6, 7], max_new_tokens=12)
        gone = pipe.submit([8, 9], max_new_tokens=12)
        pipe.step()
        pipe.step()
        assert len(pipe._inflight) == 1 and gone in pipe._inflight[0].rows
        before = (pipe.stats.blocks_rolled_back, pipe.stats.reserved_in_flight)
        pipe.abort(gone)
        assert (pipe.stats.blocks_rolled_back, pipe.stats.reserved_in_flight) == \
            (before[0] + 1, before[1] - 1)
        pipe.run()
        assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == model.pool.num_blocks
    assert keep.tokens == greedy_tokens([5, 6, 7], 12, VOCAB)
    assert gone.finish_reason == "abort"
    assert gone.tokens == greedy_tokens([8, 9], 12, VOCAB)[:len(gone.tokens)]
