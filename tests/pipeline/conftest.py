"""Fixtures of the decode pipeline tests: the greedy oracle over ``host_next_token``."""

from __future__ import annotations

import pytest

from metrale_feed.feed import NO_TOKEN
from metrale_feed.reference import host_next_token


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
