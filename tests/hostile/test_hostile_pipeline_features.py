"""Hostile tests of DecodePipeline's speculative decoding, logprobs and penalties, as a demanding
serving-engine user drives them: tokens and logprobs against independent oracles (the pipeline
without speculation, the host rule ``host_next_token``, a float64 numpy ``log_softmax`` of the
reference logits), bad input refused before anything is queued, no leaks after errors, aborts
and closes with steps in flight, and hangs or crashes caught in a child interpreter."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline, FeedError
from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import ReferenceModel, _widened_logits, host_next_token

from helpers.child import run_python

VOCAB = 211


def model_for(rows=4, num_blocks=200, block_size=4, vocab=VOCAB, **kw):
    return ReferenceModel(vocab, block_size=block_size, num_blocks=num_blocks, max_rows=rows, **kw)


def greedy(prompt, max_new, stops=(), vocab=VOCAB):
    """Greedy decoding of the request alone, by the host rule; the stop id committed last."""
    history, out = list(prompt), []
    while len(out) < max_new:
        token = host_next_token(history, vocab)
        out.append(token)
        history.append(token)
        if token in stops:
            break
    return out


def log_softmax_oracle(prompt, tokens, vocab=VOCAB):
    """float64 numpy log_softmax of the reference logits at each committed step: per token,
    its logprob and the row (for top-n checks)."""
    history, lps, rows = list(prompt), [], []
    for token in tokens:
        row = _widened_logits(history, vocab, "float32").astype(np.float64)
        top = row.max()
        lsm = row - top - np.log(np.exp(row - top).sum())
        lps.append(lsm[token])
        rows.append(lsm)
        history.append(token)
    return np.array(lps), rows


def _prompts(n, seed=0, lo=2, hi=12):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# ---- speculative decoding: a drafter that fails ----

class _FlakyDrafter(ReferenceDrafter):
    """Raises from ``propose`` on the calls listed in ``fail`` (1-based)."""

    def __init__(self, *args, fail=()):
        super().__init__(*args)
        self.fail, self.calls = set(fail), 0

    def propose(self, batch, out, stream):
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError("drafter failed")
        super().propose(batch, out, stream)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fail", [(2,), (2, 3), (3, 4), (2, 3, 4)])
def test_a_drafter_that_raises_leaves_the_pipeline_exact(host, no_leaks, depth, fail):
    """A drafter's error reaches the caller of step(); the next step() carries on and every
    request still gets exactly the greedy tokens (before the fix, two failed launches in a row
    at depth 2 reused the buffers of the verify step still in flight: wrong tokens)."""
    ps = _prompts(4, seed=1)
    with model_for() as model:
        drafter = _FlakyDrafter(VOCAB, 3, 0.6, fail=fail)
        with DecodePipeline(model, 4, depth=depth, speculative=drafter) as pipe:
            reqs = [pipe.submit(p, max_new_tokens=15) for p in ps]
            errors = 0
            while not pipe.idle:
                try:
                    pipe.step()
                except RuntimeError as exc:
                    assert "drafter failed" in str(exc)
                    errors += 1
            assert errors == len(fail)
        assert model.pool.free_count == model.pool.num_blocks
    for req, p in zip(reqs, ps):
        assert req.tokens == greedy(p, 15) and req.finish_reason == "length"


# ---- logprobs: bad input ----

@pytest.mark.parametrize("vocab, n", [(1, 2), (5, 6), (5, 20)])
def test_top_logprobs_beyond_the_vocabulary_is_refused(host, no_leaks, vocab, n):
    """A vocabulary smaller than ``top_logprobs`` has no ``n`` ids to return: before the fix
    the request ran and its top lists ended in (NO_TOKEN, NaN) placeholders."""
    with model_for(1, vocab=vocab) as model, DecodePipeline(model, 1) as pipe:
        with pytest.raises(ValueError, match="vocabulary"):
            pipe.submit([0], max_new_tokens=2, logprobs=True, top_logprobs=n)
        assert pipe.idle
        ok = pipe.submit([0], max_new_tokens=2, logprobs=True, top_logprobs=vocab)
        pipe.run()
    assert len(ok.top_logprobs) == 2
    for entry in ok.top_logprobs:
        assert sorted(i for i, _ in entry) == list(range(vocab))
        assert all(np.isfinite(lp) and lp <= 0.0 for _, lp in entry)
