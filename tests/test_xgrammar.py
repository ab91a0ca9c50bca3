"""Constrained decoding with xgrammar: a JSON grammar compiled over a small vocabulary of our own
(no download), its bitmask filled each step and copied to the device, greedy decoding through the
feed (argmax_to_feed with bitmask=) on the reference model's logits, eagerly and as a replayed
graph. Every emitted id is accepted by the grammar's matcher, each equals the numpy oracle's
choice under the same bitmask, and the output parses as JSON. The reference model's logits are
arbitrary: the grammar does the steering."""

import json

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.kv import SequenceState
from metrale_feed.testing.oracle import reference_argmax
from metrale_feed.testing.reference import ReferenceModel, host_logits

from helpers.json_schema import SCHEMA

xgr = pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install xgrammar)")

# Pieces of JSON and some that never fit it; not a multiple of 32, so the last bitmask word is
# partial. The last id is the stop token.
PIECES = ['{', '}', '[', ']', ',', ':', '"', '"ok"', '"n"', '"tag"', 'ok', 'n', 'tag', 'true',
          'false', 'null', '0', '1', '7', '42', '-', '.', 'e', ' ', '\n', '"x', 'y"', '"', 'x',
          'y', 'tr', 'ue', 'fa', 'lse', '"a"', '"b"', 'a', 'b', '}}', '::', '<s>', '</s>']
STOP = len(PIECES) - 1
VOCAB = len(PIECES)
WORDS = (VOCAB + 31) // 32


def matcher():
    info = xgr.TokenizerInfo(PIECES, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[STOP])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(SCHEMA, any_whitespace=False)
    return xgr.GrammarMatcher(compiled)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("prompt", [[3, 1, 4], [27, 18], [40]])
def test_greedy_json_through_the_feed(backend, no_leaks, graphs, prompt):
    m = matcher()
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)  # int32 [rows, ceil(vocab / 32)]
    assert tuple(bitmask.shape) == (1, WORDS)
    out = []
    with ReferenceModel(VOCAB, max_rows=1, block_size=4, num_blocks=64) as model, \
            mf.Stream() as stream, mf.PinnedBuffer(WORDS * 4) as host_bits, \
            mf.DeviceBuffer(WORDS * 4) as bits, mf.DeviceBuffer(4) as cells, \
            mf.PinnedBuffer(4) as dst, mf.Event() as done:
        seq = SequenceState(0)
        model.prefill(seq, prompt[:-1], stream=stream)
        token, history = prompt[-1], list(prompt)

        def pick():
            mf.copy_h2d_async(bits, host_bits, stream)
            mf.argmax_to_feed(model.logits, None, cells, dst, done, stream, rows=1, vocab=VOCAB,
                              dtype="float32", bitmask=bits)

        graph = None
        if graphs:
            pick()  # warm-up (cuda's first few-row argmax allocates its scratch)
            done.synchronize()
            with mf.graph_capture(stream) as graph:
                pick()
        for _ in range(64):
            assert m.fill_next_token_bitmask(bitmask)
            words = bitmask.numpy().copy()
            np.frombuffer(host_bits, np.int32)[:] = words.ravel()
            model.decode_batch([token], [seq], stream)
            if graph is not None:
                graph.launch(stream)
            else:
                pick()
            done.synchronize()
            chosen = int(np.frombuffer(dst, np.uint32)[0])
            assert chosen == reference_argmax(host_logits(history, VOCAB)[None, :], bitmask=words)[0]
            assert m.accept_token(chosen), (chosen, PIECES[chosen], out)
            if m.is_terminated():
                assert chosen == STOP
                break
            out.append(PIECES[chosen])
            token = chosen
            history.append(chosen)
        else:
            pytest.fail(f"the grammar did not finish in 64 steps: {''.join(out)!r}")
        if graph is not None:
            graph.close()
        model.release_sequence(seq)
        stream.synchronize()
    value = json.loads("".join(out))
    assert set(value) == {"ok", "n", "tag"} and isinstance(value["ok"], bool)
    assert 0 <= value["n"] <= 99 and value["tag"] in ("a", "b")
