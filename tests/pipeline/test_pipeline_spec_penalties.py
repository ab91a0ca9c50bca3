"""Penalties, logit_bias and min_tokens with speculative decoding (docs/speculative.md,
"Penalties"): greedy requests get the tokens of the pipeline without speculation (and of the
numpy oracle of each request alone) whatever the drafter proposes, at depth 1 and 2, with
preemption; sampled requests follow the verify rule over the penalised logits of each request
alone, and the target distribution; raw logprobs; no host synchronisation added."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DecodePipeline
from metrale_feed.feed import NO_TOKEN
from metrale_feed.sched.speculative import HostDrafter, NGramDrafter
from metrale_feed.testing.drafter import ReferenceDrafter
from metrale_feed.testing.reference import host_logits

from conftest import VOCAB, model_for, prompts
from helpers.penalty_oracle import penalize
from pipeline.test_pipeline_penalties import PEN, oracle
from pipeline.test_pipeline_speculative import sampled_speculation

# Per request: penalties whose effect shows within a few tokens (a bias makes an id win, the
# penalties on the generated ids push it back), min_tokens banning stop ids, and none.
KWS = PEN[:4] + [dict(min_tokens=6, logit_bias={11: 0.9}, frequency_penalty=0.3), {}]
STOPS = [(), (), (), (), (11, 5), ()]


def pen_of(kw, stops):
    return dict(repetition_penalty=kw.get("repetition_penalty", 1.0),
                presence_penalty=kw.get("presence_penalty", 0.0),
                frequency_penalty=kw.get("frequency_penalty", 0.0),
                logit_bias=kw.get("logit_bias"), min_tokens=kw.get("min_tokens", 0),
                stop_ids=sorted(stops))


class Adversary(HostDrafter):
    """Drafts built to catch a wrong walk: the oracle's own next ids under the request's
    penalties (so runs are accepted and a later position depends on the drafts before it),
    then, by the row's seed and position, a repeat of an earlier draft, a stop id, or the
    unpenalised argmax (what a walk that ignores the drafts would accept)."""

    def __init__(self, k, requests):
        super().__init__(k)
        self.by_prompt = {tuple(p): (kw, stops) for p, kw, stops in requests}

    def draft(self, history, k, seed, mask):
        for n in range(len(history), 0, -1):  # the request: its prompt is a prefix
            if tuple(history[:n]) in self.by_prompt:
                prompt, (kw, stops) = history[:n], self.by_prompt[tuple(history[:n])]
                break
        pen = pen_of(kw, stops)
        h, out = list(history), []
        for j in range(k):
            t = int(np.argmax(penalize(host_logits(h, VOCAB), prompt, h[len(prompt):], **pen)))
            kind = (len(h) * 7 + j) % 5
            if kind == 1 and out:
                t = out[0]  # a draft equal to an earlier one
            elif kind == 2 and stops:
                t = stops[j % len(stops)]  # a stop id, banned while min_tokens holds
            elif kind == 3:
                t = int(np.argmax(host_logits(h, VOCAB)))  # the unpenalised pick
            out.append(t)
            h.append(t)
        return out


def run(model, requests, drafter=None, depth=1, rows=6, max_new=14, **submit):
    with DecodePipeline(model, rows, depth=depth, speculative=drafter) as pipe:
        reqs = [pipe.submit(p, max_new_tokens=max_new, stop_ids=s, **kw, **submit)
                for p, kw, s in requests]
        pipe.run()
        stats = pipe.stats.as_dict()
    return reqs, stats


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("which", ["adversary", "ngram", "a1", "a0.5"])
def test_greedy_tokens_equal_the_pipeline_without_speculation(host, no_leaks, depth, which):
    k = 3
    requests = list(zip(prompts(len(KWS), seed=21), KWS, STOPS))
    drafter = {"adversary": lambda: Adversary(k, requests), "ngram": lambda: NGramDrafter(k),
               "a1": lambda: ReferenceDrafter(VOCAB, k, 1.0),
               "a0.5": lambda: ReferenceDrafter(VOCAB, k, 0.5)}[which]()
    with model_for(6) as model:
        plain, plain_stats = run(model, requests, depth=depth)
        spec, stats = run(model, requests, drafter, depth=depth)
        assert model.pool.free_count == model.pool.num_blocks
    drafter.close()
    for a, b, (p, kw, s) in zip(plain, spec, requests):
        assert b.tokens == a.tokens == oracle(p, 14, stops=s, **kw), kw
        assert b.finish_reason == a.finish_reason
    assert stats["host_syncs"] == stats["steps"]  # one wait a step: the counts stay on the device
    assert (stats["ahead_launches"] > 0) == (depth == 2)
    if which in ("adversary", "a1"):
        assert stats["accepted"] > stats["steps"], stats  # runs accepted: the walk mattered


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_rebuilds_the_counts_from_the_committed_tokens(host, no_leaks, depth):
    ps = prompts(4, seed=11, lo=3, hi=6)
    requests = list(zip(ps, [dict(frequency_penalty=0.4, repetition_penalty=1.5, logit_bias={7: 0.6}),
                             dict(presence_penalty=0.6, logit_bias={3: 0.8}), {},
                             dict(repetition_penalty=2.0, logit_bias={1: 0.7})], [()] * 4))
    drafter = Adversary(2, requests)
    runs = []
    for blocks in (14, 200):
        with model_for(4, num_blocks=blocks, block_size=2) as model:
            reqs, stats = run(model, requests, drafter, depth=depth, rows=4, max_new=12)
            assert (stats["preemptions"] > 0) == (blocks == 14), stats
            runs.append([r.tokens for r in reqs])
    drafter.close()
    assert runs[0] == runs[1] == [oracle(p, 12, **kw) for p, kw, _ in requests]


def spec_oracle(prompt, max_new, drafter, pen, *, temperature, seed, stops=()):
    """A sampled request alone: each step the drafter's drafts, the reference logits of its
    k + 1 positions after vLLM's rules with the drafts before each position as generated (the
    numpy oracle), one host verify_to_feed row; the emitted ids committed up to max_new or a
    stop id."""
    k, history, out = drafter.k, list(prompt), []
    with mf.DeviceBuffer((k + 1) * VOCAB * 4) as logits, mf.DeviceBuffer((k + 2) * 4) as cells, \
            mf.Event() as done:
        while len(out) < max_new:
            drafts = drafter.draft(history, k, seed, (NO_TOKEN, NO_TOKEN))
            rows = np.stack([penalize(host_logits(history + drafts[:j], VOCAB), prompt,
                                      out + drafts[:j], **pen) for j in range(k + 1)])
            mf.copy_h2d_async(logits, np.ascontiguousarray(rows))
            params = mf.sampling_params(1, temperature=temperature, seed=seed, position=len(history))
            dst = np.zeros(k + 2, np.uint32)
            mf.verify_to_feed(logits, np.asarray(drafts, np.uint32), cells, dst, done, k=k,
                              params=params, rows=1, vocab=VOCAB, dtype="float32")
            done.synchronize()
            for token in dst[1:1 + int(dst[0])].tolist():
                out.append(token)
                history.append(token)
                if (token in stops and len(out) >= pen["min_tokens"]) or len(out) >= max_new:
                    return out
    return out


@pytest.mark.parametrize("depth", [1, 2])
def test_sampled_rows_follow_the_verify_rule_over_the_penalised_logits(host, no_leaks, depth):
    drafter = ReferenceDrafter(VOCAB, 3, 0.5)
    requests = list(zip(prompts(5, seed=31), KWS[:5], STOPS[:5]))
    with model_for(5) as model:
        reqs, stats = run(model, requests, drafter, depth=depth, rows=5, max_new=10,
                          temperature=0.01, seed=5)
    assert 0 < stats["accepted"] < stats["drafted"] and stats["host_syncs"] == stats["steps"]
    for req, (p, kw, s) in zip(reqs, requests):
        assert req.tokens == spec_oracle(p, 10, drafter, pen_of(kw, s), temperature=0.01, seed=5,
                                         stops=s), kw
    drafter.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_sampled_speculation_with_penalties_emits_the_target_distribution(host, no_leaks, depth):
    """2000 requests of one prompt (each its own seed) with frequency and presence penalties and a
    bias: the ids at positions 1 to 3 follow the distribution of sampling each position from the
    penalised logits of its prefix (chi-square per position and over the first two's pairs)."""
    from helpers.chisq import assert_sequences_follow, prefix_distributions
    from metrale_feed.testing.oracle import reference_survivors

    vocab, k, temperature, n_req, new = 8, 3, 0.5, 2000, 3
    prompt = [3, 1, 4, 1, 5]
    pen = dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3,
               logit_bias={2: 0.5})

    def target(prefix):
        logits = penalize(host_logits(prompt + list(prefix), vocab), prompt, list(prefix), **pen)
        ids, p = reference_survivors(logits, np.ones(vocab, bool), temperature)
        full = np.zeros(vocab)
        full[ids] = p
        return full

    marginals, joint = prefix_distributions(target, vocab, new)
    tokens, stats = sampled_speculation(prompt, vocab, k, depth, n_req, new,
                                        temperature=temperature, **pen)
    assert_sequences_follow(tokens, marginals, joint, vocab)
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("depth", [1, 2])
def test_logprobs_are_the_raw_logits_ones_as_without_speculation(host, no_leaks, depth):
    """With penalties the verify reads penalised logits: each token's logprob and top logprobs
    are taken from their copy before the penalties, bit for bit the plain pipeline's."""
    requests = list(zip(prompts(4, seed=8), KWS[:4], [()] * 4))
    lp = dict(logprobs=True, top_logprobs=3)
    with model_for(4) as model:
        plain, _ = run(model, requests, depth=depth, rows=4, max_new=10, **lp)
        drafter = Adversary(3, requests)
        spec, stats = run(model, requests, drafter, depth=depth, rows=4, max_new=10, **lp)
        drafter.close()
    assert stats["accepted"] > 0 and stats["host_syncs"] == stats["steps"]
    for a, b in zip(plain, spec):
        assert b.tokens == a.tokens
        assert b.logprobs == a.logprobs and b.top_logprobs == a.top_logprobs
