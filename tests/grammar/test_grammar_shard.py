"""``grammar=`` over a split vocabulary: a world of one through the partial calls, the exchange
and the combine (the path of every world), against the unsharded call with the same grammar and
the numpy oracle of tests/grammar/test_grammar_ops.py."""

from __future__ import annotations

import pytest

import os

from helpers.child import run_python, world_of_one

pytest.importorskip("torch.distributed")

HERE = os.path.dirname(os.path.abspath(__file__))

CODE = world_of_one(r"""
import numpy as np, metrale_feed as mf
from test_grammar_ops import automaton, allowed_rows, masked_argmax, stepped, WORDS, VOCAB, walk_verify

shard = mf.VocabShard(None, VOCAB, max_rows=64)
shard._force_exchange = True
auto = automaton(); auto.to_device()
rows, k = len(WORDS), 2
rng = np.random.default_rng(0)
logits = rng.standard_normal((rows * (k + 1), VOCAB)).astype(np.float32)
with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * (k + 2) * 4) as cells, \
        mf.DeviceBuffer(rows * 4) as states, mf.Event() as done:
    mf.copy_h2d_async(dev, logits.view(np.uint8))
    mf.copy_h2d_async(states, np.array(WORDS, np.uint32))
    out = np.zeros(rows, np.uint32)
    mf.argmax_to_feed(dev, None, cells, out, done, rows=rows, vocab=VOCAB, dtype="float32",
                      shard=shard, grammar=(auto, states))
    mf.stream_synchronize()
    want = masked_argmax(logits[:rows], allowed_rows(auto, WORDS))
    assert out.tolist() == want.tolist(), (out, want)
    back = np.zeros(rows, np.uint32); mf.copy_d2h_async(states, back); mf.stream_synchronize()
    assert back.tolist() == stepped(auto, WORDS, want)
    drafts = [int(t) for t in rng.integers(0, VOCAB, rows * k)]
    mf.copy_h2d_async(states, np.array(WORDS, np.uint32))
    vout = np.zeros(rows * (k + 2), np.uint32)
    mf.verify_to_feed(dev, drafts, cells, vout, done, k=k, rows=rows, vocab=VOCAB,
                      dtype="float32", shard=shard, grammar=(auto, states))
    mf.stream_synchronize()
    want_cells, want_states = walk_verify(auto, logits, drafts, WORDS, k)
    assert vout.tolist() == want_cells
    mf.copy_d2h_async(states, back); mf.stream_synchronize()
    assert back.tolist() == want_states
    try:
        mf.argmax_to_feed(dev, None, cells, None, None, rows=rows, vocab=VOCAB, dtype="float32",
                          shard=shard, grammar=(mf.TokenAutomaton({0: {}}, initial=0, vocab=VOCAB + 1), states))
    except ValueError as exc:
        assert "vocabulary of 71" in str(exc)
    else:
        raise AssertionError("another vocabulary's automaton was taken")
shard.close(); auto.close()
""", HERE)


def test_a_sharded_pick_masks_the_whole_vocabulary_and_advances_alike():
    result = run_python(CODE, timeout=150)
    assert "OK" in result.stdout, result.describe()
