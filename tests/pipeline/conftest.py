"""Fixtures of the decode pipeline tests: the greedy oracle over ``host_next_token``."""

from __future__ import annotations

import pytest

from metrale_feed.feed import NO_TOKEN
from metrale_feed.testing.reference import ReferenceModel, host_next_token

VOCAB = 211  # the pipeline tests' vocabulary: prime, so no row width is a vector multiple


def model_for(rows=4, num_blocks=200, block_size=4, **kw):
    """The reference model the pipeline tests drive: ``rows`` rows over ``VOCAB`` ids."""
    return ReferenceModel(VOCAB, block_size=block_size, num_blocks=num_blocks, max_rows=rows, **kw)


def prompts(n, seed=0, lo=1, hi=20):
    """``n`` random prompts of ``lo`` to ``hi`` ids below ``VOCAB``, the same for a seed."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy_tokens(prompt, max_new, vocab, dtype="float32", stops=(), ban=None, switch=None):
    """What greedy decoding of the request alone gives: ``host_next_token`` step by step, the
    stop id committed as the last token. ``switch=(k, ban2)``: tokens from index ``k`` on are
    taken under ``ban2``."""
    history, out = list(prompt), []
    while len(out) < max_new:
        mask = ban
        if switch is not None and len(out) >= switch[0]:
            mask = switch[1]
        token = host_next_token(history, vocab, dtype, tuple(mask) if mask else (NO_TOKEN, NO_TOKEN))
        out.append(token)
        history.append(token)
        if token in stops:
            break
    return out


@pytest.fixture
def greedy():
    return greedy_tokens


def sampled_tokens(prompt, max_new, vocab, dtype="float32", stops=(), ban=None, *,
                   temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    """What decoding of the request alone gives: at each step the host backend's
    ``sample_to_feed`` over one row, the reference model's logits (``host_logits``) at position
    ``len(prompt) + len(tokens)``; the stop id committed as the last token. Needs the host
    backend active (the ``host`` fixture)."""
    import numpy as np

    import metrale_feed as mf
    from metrale_feed.testing.reference import host_logits

    assert mf.backend() in ("host", "simt")
    mask = np.array([tuple(ban) if ban else (NO_TOKEN, NO_TOKEN)], np.uint32)
    history, out = list(prompt), []
    itemsize = 4 if dtype == "float32" else 2
    with mf.DeviceBuffer(vocab * itemsize) as logits, mf.DeviceBuffer(4) as cells, \
            mf.Event() as done:
        while len(out) < max_new:
            row = np.ascontiguousarray(host_logits(history, vocab, dtype)).view(np.uint8)
            mf.copy_h2d_async(logits, row)
            params = mf.sampling_params(1, temperature=temperature, top_k=top_k, top_p=top_p,
                                        min_p=min_p, seed=seed, position=len(history))
            dst = np.zeros(1, np.uint32)
            mf.sample_to_feed(logits, params, cells, dst, done, masks=mask, vocab=vocab,
                              dtype=dtype)
            done.synchronize()
            token = int(dst[0])
            out.append(token)
            history.append(token)
            if token in stops:
                break
    return out


@pytest.fixture
def sampled():
    return sampled_tokens
