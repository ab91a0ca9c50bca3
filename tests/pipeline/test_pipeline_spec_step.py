"""The speculative step launches its verify as one ``PickStep`` handed to ``pick_to_feed``: every
launch of a speculative pipeline is such a step (op "verify", the drafter's ``k``, the batch's
rows and params), and the tokens are still the oracle's."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_feed import DecodePipeline, PickStep, _core
from metrale_feed.testing.drafter import ReferenceDrafter

from conftest import VOCAB, greedy_tokens, model_for, prompts


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_verify_is_one_step_handed_to_pick_to_feed(host, no_leaks, monkeypatch, depth,
                                                         sampled):
    launched = []
    pick_to_feed = _core.pick_to_feed

    def recording(step):
        assert type(step) is PickStep
        launched.append((step.op, step.k, step.rows, step.params, step.cells, step.drafts))
        return pick_to_feed(step)

    monkeypatch.setattr(_core, "pick_to_feed", recording)
    k = 3
    submit = dict(temperature=0.7, seed=4) if sampled else {}
    asked = prompts(6, seed=depth)
    with model_for() as model:
        with DecodePipeline(model, 4, depth=depth,
                            speculative=ReferenceDrafter(VOCAB, k, 0.5)) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=9, **submit) for p in asked]
            pipe.run()
            stats = pipe.stats.as_dict()
    assert stats["launches"] > 1 and len(launched) == stats["launches"]
    for op, step_k, rows, params, cells, drafts in launched:
        assert (op, step_k) == ("verify", k) and 1 <= rows <= 4
        assert cells is not None and drafts is not None
        if sampled:
            assert len(params) >= rows and np.all(params["temperature"][:rows] == np.float32(0.7))
        else:
            assert params is None
    for r, p in zip(reqs, asked):
        assert len(r.tokens) == 9
        if not sampled:
            assert r.tokens == greedy_tokens(p, 9, VOCAB)
