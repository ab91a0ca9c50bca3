"""The SPMD pipeline with structured outputs over the split vocabulary (rank_main.py runs it;
``h`` is that module, with the rank and the world). Every rank masks its slice by the same
state words and advances them by the combined ids, so every rank's requests must get what one
request decoded alone gives: the grammar-aware host loop of tests/pipeline/test_pipeline_grammar.py
(numpy's argmax of the reference logits over the automaton's allowed ids, walking it by
``next``), computed here with no shard, and the unsharded pipeline's tokens."""

import os
import sys

import metrale_feed as mf

# The pipeline tests' oracle, automata and drafter (their conftest first on the path).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipeline"))
from conftest import VOCAB, greedy_tokens, prompts  # noqa: E402
from test_pipeline_grammar import GrammarDrafter, automaton, decode  # noqa: E402


def scenario_pipeline_grammar(h):
    """Constrained rows (two automata) mixed with free ones, plain and speculative (a drafter
    whose second draft is an id the state forbids), depth 1 and 2, over uneven splits (on 3 ranks
    also one whose last slice is empty): every rank's tokens and finish reasons are the oracle's,
    and the unsharded pipeline's; at least one exchange a run."""
    from metrale_feed.testing.reference import ReferenceModel

    automata = [automaton(20), automaton(21)]

    def run(shard, depth, spec, requests):
        drafter = GrammarDrafter(2, forbidden=1) if spec else None
        model = ReferenceModel(VOCAB, block_size=4, num_blocks=200, max_rows=4, shard=shard)
        with mf.DecodePipeline(model, 4, depth=depth, shard=shard, speculative=drafter) as pipe:
            reqs = []
            for i, (p, m, a) in enumerate(requests):
                reqs.append(pipe.submit(p, max_new_tokens=m, grammar=a, seed=i))
                if drafter is not None:
                    drafter.know(reqs[-1])
            pipe.run()
            stats = pipe.stats
        model.close()
        return [(r.tokens, r.finish_reason) for r in reqs], stats

    # Uneven splits; on 3 ranks also one whose last slice is empty (that rank masks no column).
    splits = {1: [None], 2: [[0, 97, VOCAB]], 3: [[0, 70, 150, VOCAB], [0, 120, VOCAB, VOCAB]]}
    for offsets in splits[h.WORLD]:
        shard = mf.VocabShard(None, VOCAB, offsets=offsets, max_rows=16)
        through = shard.world > 1 or shard._force_exchange
        for depth in (1, 2):
            for spec in (False, True):
                requests = [(p, 3 + (5 * i) % 11, None if i % 3 == 2 else automata[i % 2])
                            for i, p in enumerate(prompts(8, seed=depth + 2 * spec))]
                want = [(greedy_tokens(p, m, VOCAB), "length") if a is None else decode(a, p, m)
                        for p, m, a in requests]
                assert "stop" in {r for _, r in want}, want  # some rows end on the automaton
                before = shard.stats["collectives"]
                got, stats = run(shard, depth, spec, requests)
                assert shard.stats["collectives"] > before or not through, shard.stats
                for i, (g, w) in enumerate(zip(got, want)):
                    assert g == w, (h.RANK, offsets, depth, spec, i, g, w)
                if spec:  # drafts accepted, and rejected (the forbidden ones at least)
                    assert stats.accepted > 0 and stats.drafted > stats.accepted, stats
                assert run(None, depth, spec, requests)[0] == want, (depth, spec)
        shard.close()


SCENARIOS = {"pipeline-grammar": scenario_pipeline_grammar}
