"""``grammar=(automaton, states)`` of argmax_to_feed, sample_to_feed and verify_to_feed: one call
masks each row by its state, picks, and advances the state by the id it picked (docs/kernels.md,
"Grammar in a pick"). The oracles are numpy's: the argmax over the ids ``automaton.allowed``
gives (and the caller's masks and bitmask), the verify's walk written out draft by draft, states
stepped by ``automaton.next``; a sampled row draws what ``sample_to_feed`` draws given the same
allowed ids as a bitmask built on the host. Each case runs on host, simt and cuda (where a device
is usable)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import TokenAutomaton, _core

N = mf.NO_TOKEN
VOCAB = 70


def automaton(vocab=VOCAB, seed=0):
    """Sparse states, a dense one (most of the vocabulary), and a state with no transition."""
    rng = np.random.default_rng(seed)
    table = {}
    for s in range(6):
        ids = rng.choice(vocab, size=int(rng.integers(2, 9)), replace=False)
        table[s] = {int(t): int(rng.integers(0, 8)) for t in ids}
    table[6] = {t: (0 if t % 7 else 3) for t in range(vocab) if t % 11}  # dense
    table[7] = {}  # final: allows nothing
    return TokenAutomaton(table, initial=0, vocab=vocab)


def allowed_rows(auto, words, vocab=VOCAB):
    out = np.ones((len(words), vocab), bool)
    for i, w in enumerate(words):
        if w != N:
            out[i] = False
            out[i, auto.allowed(int(w))] = True
    return out


def pack(allowed):
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), bool)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=1, bitorder="little").view("<u4")


def masked_argmax(logits, allowed):
    masked = np.where(allowed, logits.astype(np.float64), -np.inf)
    out = masked.argmax(axis=1).astype(np.uint32)
    out[~allowed.any(axis=1)] = N
    return out


def stepped(auto, words, ids):
    out = []
    for w, t in zip(words, ids):
        if w == N or t == N or auto.next(int(w), int(t)) is None:
            out.append(int(w))
        else:
            out.append(auto.next(int(w), int(t)))
    return out


def read(buf, n):
    out = np.zeros(n, np.uint32)
    mf.copy_d2h_async(buf, out)
    mf.stream_synchronize()
    return out


WORDS = [0, 1, N, 6, 7, 2, 3, N, 4, 5, 6, 0]  # constrained, free, dense, a state allowing nothing


@pytest.fixture
def auto(backend):
    with automaton() as a:
        a.to_device()
        yield a


@pytest.mark.parametrize("with_masks", [False, True])
def test_argmax_masks_picks_and_advances(auto, with_masks):
    rng = np.random.default_rng(1)
    rows = len(WORDS)
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32)
    allowed = allowed_rows(auto, WORDS)
    masks = bitmask = None
    caller = np.ones((rows, VOCAB), bool)
    if with_masks:  # the caller's masks and bitmask still apply
        masks = [(int(logits[r].argmax()), N) for r in range(rows)]
        caller = rng.random((rows, VOCAB)) < 0.8
        for r, (m, _) in enumerate(masks):
            caller[r, m] = False
    want = masked_argmax(logits, allowed & caller)
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states, mf.DeviceBuffer(rows * 12) as bits, mf.Event() as done:
        mf.copy_h2d_async(dev, logits.view(np.uint8))
        mf.copy_h2d_async(states, np.array(WORDS, np.uint32))
        if with_masks:
            mf.copy_h2d_async(bits, pack(caller))
            bitmask = bits
        out = np.zeros(rows, np.uint32)
        mf.argmax_to_feed(dev, masks, cells, out, done, rows=rows, vocab=VOCAB, dtype="float32",
                          bitmask=bitmask, grammar=(auto, states))
        mf.stream_synchronize()
        assert out.tolist() == want.tolist()
        assert N in want.tolist()  # the state allowing nothing: NO_TOKEN, its state kept
        assert read(states, rows).tolist() == stepped(auto, WORDS, want)
        # Again from the states it left: the call reads them when it runs.
        want2 = masked_argmax(logits, allowed_rows(auto, stepped(auto, WORDS, want)) & caller)
        mf.argmax_to_feed(dev, masks, cells, out, done, rows=rows, vocab=VOCAB, dtype="float32",
                          bitmask=bitmask, grammar=(auto, states))
        mf.stream_synchronize()
        assert out.tolist() == want2.tolist()


def test_sample_draws_as_with_the_equivalent_bitmask(auto):
    rng = np.random.default_rng(2)
    rows = len(WORDS)
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32) * 3
    params = mf.sampling_params(rows, temperature=[0.0, 0.7, 1.0, 1.3] * 3, top_k=[0, 5, 0] * 4,
                                top_p=[1.0, 0.9, 0.8, 1.0] * 3, seed=7, position=list(range(rows)))
    allowed = allowed_rows(auto, WORDS)
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states, mf.DeviceBuffer(allowed.shape[0] * 12) as bits, \
            mf.DeviceBuffer(rows * 4) as lp, mf.Event() as done:
        mf.copy_h2d_async(dev, logits.view(np.uint8))
        mf.copy_h2d_async(bits, pack(allowed))
        want, want_lp = np.zeros(rows, np.uint32), np.zeros(rows, np.float32)
        mf.sample_to_feed(dev, params, cells, want, done, bitmask=bits, vocab=VOCAB,
                          dtype="float32", logprobs=lp, logprobs_dst=want_lp)
        mf.copy_h2d_async(states, np.array(WORDS, np.uint32))
        got, got_lp = np.zeros(rows, np.uint32), np.zeros(rows, np.float32)
        mf.sample_to_feed(dev, params, cells, got, done, vocab=VOCAB, dtype="float32",
                          logprobs=lp, logprobs_dst=got_lp, grammar=(auto, states))
        mf.stream_synchronize()
        assert got.tolist() == want.tolist()
        np.testing.assert_array_equal(got_lp, want_lp)
        for r, t in enumerate(got.tolist()):
            assert t == N if not allowed[r].any() else allowed[r, t]
        assert read(states, rows).tolist() == stepped(auto, WORDS, got)


def walk_verify(auto, logits, drafts, words, k, vocab=VOCAB):
    """Greedy verify with the grammar, written out: position j's argmax over what the state the
    accepted drafts reach allows; a draft is kept while it equals that argmax."""
    rows = len(words)
    cells, after = [], []
    for r in range(rows):
        s, emitted = words[r], []
        for j in range(k + 1):
            allowed = allowed_rows(auto, [s], vocab)[0]
            t = int(masked_argmax(logits[r * (k + 1) + j][None], allowed[None])[0])
            emitted.append(t)
            if t != N and s != N:
                s = auto.next(s, t)
            if t == N or j == k or drafts[r * k + j] != t:
                break
        cells += [len(emitted)] + emitted + [N] * (k + 1 - len(emitted))
        after.append(s)
    return cells, after


@pytest.mark.parametrize("device_drafts", [False, True])
def test_verify_judges_each_draft_against_the_state_before_it(auto, device_drafts):
    rng = np.random.default_rng(3)
    k, rows = 3, len(WORDS)
    logits = rng.standard_normal((rows * (k + 1), VOCAB)).astype(np.float32)
    # Drafts: the grammar's greedy path for some rows (accepted), a forbidden id (rejected) for
    # others, and the unmasked argmax, which the grammar may forbid.
    drafts = []
    for r, w in enumerate(WORDS):
        s = w
        for j in range(k):
            row = logits[r * (k + 1) + j]
            if r % 3 == 0 and s != N and auto.allowed(s):
                t = max(auto.allowed(s), key=lambda i: row[i])
                s = auto.next(s, t)
            elif r % 3 == 1 and s != N and len(auto.allowed(s)) < VOCAB:
                t = min(set(range(VOCAB)) - set(auto.allowed(s)))
            else:
                t = int(row.argmax())
            drafts.append(int(t))
    want_cells, want_states = walk_verify(auto, logits, drafts, WORDS, k)
    assert any(c > 1 for c in want_cells[::k + 2])  # some drafts accepted
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * (k + 2) * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states, mf.DeviceBuffer(rows * k * 4) as ddev, mf.Event() as done:
        mf.copy_h2d_async(dev, logits.view(np.uint8))
        mf.copy_h2d_async(states, np.array(WORDS, np.uint32))
        mf.copy_h2d_async(ddev, np.array(drafts, np.uint32))
        out = np.zeros(rows * (k + 2), np.uint32)
        mf.verify_to_feed(dev, ddev if device_drafts else drafts, cells, out, done, k=k, rows=rows,
                          vocab=VOCAB, dtype="float32", grammar=(auto, states))
        mf.stream_synchronize()
        assert out.tolist() == want_cells
        assert read(states, rows).tolist() == want_states


def test_a_captured_call_replays_with_the_states_it_finds(auto):
    rows = 6
    words = WORDS[:rows]
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((rows, VOCAB)).astype(np.float32)
    with mf.Stream() as s, mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states, mf.PinnedBuffer(rows * 4) as out:
        mf.copy_h2d_async(dev, logits.view(np.uint8), s)
        mf.stream_synchronize(s)
        with mf.graph_capture(s) as graph:
            mf.argmax_to_feed(dev, None, cells, out, None, s, rows=rows, vocab=VOCAB,
                              dtype="float32", grammar=(auto, states))
        cur = list(words)
        mf.copy_h2d_async(states, np.array(cur, np.uint32), s)
        for _ in range(3):
            graph.launch(s)
            mf.stream_synchronize(s)
            want = masked_argmax(logits, allowed_rows(auto, cur))
            assert np.frombuffer(out, np.uint32).tolist() == want.tolist()
            cur = stepped(auto, cur, want)
            assert read(states, rows).tolist() == cur
        graph.close()


def test_refusals_queue_nothing(auto):
    rows = 4
    logits = np.zeros((rows, VOCAB), np.float32)
    other = TokenAutomaton({0: {1: 0}}, initial=0, vocab=VOCAB + 1)
    off = TokenAutomaton({0: {1: 0}}, initial=0, vocab=VOCAB)
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states, mf.DeviceBuffer(4) as small, \
            mf.DeviceBuffer(2 * 3 * 4) as vcells:
        mf.copy_h2d_async(cells, np.full(rows, 9, np.uint32))
        mf.copy_h2d_async(vcells, np.full(6, 9, np.uint32))
        mf.copy_h2d_async(states, np.array([0, 1, 2, 3], np.uint32))
        other.to_device()
        kw = dict(rows=rows, vocab=VOCAB, dtype="float32")
        cases = [
            ((other, states), ValueError, "vocabulary of 71"),
            ((off, states), ValueError, "to_device"),
            ((auto, small), ValueError, r"grammar state words: \d+ bytes run past"),
            ("cells", ValueError, "feed cells and grammar state words overlap"),
            ((auto, np.zeros(rows, np.uint32)), TypeError, "device memory"),
            ((auto,), TypeError, "tuple"),
            (("x", states), TypeError, "TokenAutomaton"),
            ((auto, states, small), ValueError, r"grammar scratch: \d+ bytes run past"),
        ]
        for grammar, kind, words in cases:
            argmax_grammar = (auto, cells) if grammar == "cells" else grammar
            verify_grammar = (auto, vcells) if grammar == "cells" else grammar
            for call in (lambda: mf.argmax_to_feed(dev, None, cells, None, None, grammar=argmax_grammar,
                                                   **kw),
                         lambda: mf.verify_to_feed(dev, [1, 2], vcells, None, None, k=1, rows=2,
                                                   vocab=VOCAB, dtype="float32", grammar=verify_grammar)):
                with pytest.raises(kind, match=words):
                    call()
        other.close()
        # A pick refused by its own checks queues no mask either.
        with pytest.raises(ValueError):
            mf.argmax_to_feed(dev, [(VOCAB, N)] * rows, cells, None, None, grammar=(auto, states), **kw)
        assert read(cells, rows).tolist() == [9] * rows
        assert read(vcells, 6).tolist() == [9] * 6
        assert read(states, rows).tolist() == [0, 1, 2, 3]


def test_scratch_grows_per_stream_and_a_caller_scratch_is_used(auto):
    rng = np.random.default_rng(5)
    for rows in (2, 12):
        words = WORDS[:rows]
        logits = rng.standard_normal((rows, VOCAB)).astype(np.float32)
        with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * 4) as cells, \
                mf.DeviceBuffer(rows * 4) as states, mf.DeviceBuffer(rows * 12) as scratch:
            mf.copy_h2d_async(dev, logits.view(np.uint8))
            for extra in ((), (scratch,)):
                mf.copy_h2d_async(states, np.array(words, np.uint32))
                out = np.zeros(rows, np.uint32)
                mf.argmax_to_feed(dev, None, cells, out, None, rows=rows, vocab=VOCAB,
                                  dtype="float32", grammar=(auto, states) + extra)
                mf.stream_synchronize()
                assert out.tolist() == masked_argmax(logits, allowed_rows(auto, words)).tolist()
    assert len(auto._scratches) == 1 and auto._scratches[0].nbytes >= 12 * 12


# ---- one call: the C layer checks the grammar with the pick, then queues all of it or none ----

def traced(call):
    """``call()``'s exception (it must raise) and the names of the ops the host backend ran for it
    (none on cuda, which has no trace)."""
    mf.stream_synchronize(0)
    _core.trace_enable()
    try:
        with pytest.raises(Exception) as info:
            call()
        mf.stream_synchronize(0)
        records, _ = _core.trace_read()
    finally:
        _core.trace_enable(0)
    return info.value, [r[0] for r in records]


def test_a_pick_the_c_layer_refuses_queues_none_of_its_pieces(auto):
    """Refusals that only the C layer's checks of the pick find (overlaps among its own arrays,
    an event, params, host drafts, the penalties' tables against the state words and the scratch;
    the grammar's own arrays, which it checks with the rest): the cells, the state words,
    the scratch and every array named keep their bytes, and no op of the call ran (no mask)."""
    rows, k = 4, 1
    kw = dict(rows=rows, vocab=VOCAB, dtype="float32")
    logits = np.random.default_rng(6).standard_normal((rows, VOCAB)).astype(np.float32)
    bad = mf.Event()
    bad_handle = bad.handle
    bad.close()
    wild = np.zeros(rows, mf.SAMPLING_PARAMS_DTYPE)
    wild["temperature"], wild["top_p"] = -1.0, 1.0
    from metrale_feed.penalties import PenaltyState
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * (k + 2) * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states, mf.DeviceBuffer(rows * (k + 1) * 12 + rows * k * 4) as scratch, \
            mf.DeviceBuffer(rows * k * 4) as drafts, PenaltyState(rows, capacity=8) as pen:
        ptr = dict(dev=dev, cells=cells, states=states, scratch=scratch, drafts=drafts, table=pen.table)
        fill = {"dev": logits.view(np.uint32).reshape(-1), "cells": np.full(rows * (k + 2), 9, np.uint32),
                "states": np.array([0, 1, 2, 3], np.uint32),
                "scratch": np.full(scratch.nbytes // 4, 0xABABABAB, np.uint32),
                "drafts": np.array([1, 2, 3, 4], np.uint32)}
        for name, words in fill.items():
            mf.copy_h2d_async(ptr[name], words)
        table = read(pen.table, pen.table.nbytes // 4)
        prepared = pen.prepare([N] * rows, vocab=VOCAB, dtype="float32")
        g = (auto, states, scratch)
        cases = [
            # argmax_to_feed and sample_to_feed: the pick's own checks
            ("feed cells", lambda: mf.argmax_to_feed(dev, None, dev.ptr + 16, None, None, grammar=g, **kw)),
            ("destroyed", lambda: mf.argmax_to_feed(dev, None, cells, None, bad_handle, grammar=g, **kw)),
            ("temperature", lambda: mf.sample_to_feed(dev, wild, cells, None, None, grammar=g, **kw)),
            ("logprobs", lambda: mf.argmax_to_feed(dev, None, cells, None, None, grammar=g,
                                                   logprobs=cells.ptr, **kw)),
            # the grammar's arrays against the penalties' tables, which only the C layer sees
            ("penalty table", lambda: mf.argmax_to_feed(dev, None, cells, None, None, penalties=prepared,
                                                        grammar=(auto, pen.table.ptr, scratch), **kw)),
            ("penalty table", lambda: mf.argmax_to_feed(dev, None, cells, None, None, penalties=prepared,
                                                        grammar=(auto, states, pen.table), **kw)),
            # verify_to_feed, host and device drafts
            ("feed cells", lambda: mf.verify_to_feed(dev, [1, 2], dev.ptr + 16, None, None, k=k,
                                                     vocab=VOCAB, dtype="float32", grammar=g)),
            ("destroyed", lambda: mf.verify_to_feed(dev, drafts, cells, None, bad_handle, k=k, rows=2,
                                                    vocab=VOCAB, dtype="float32", grammar=g)),
            ("not below vocab", lambda: mf.verify_to_feed(dev, [1, VOCAB], cells, None, None, k=k,
                                                           vocab=VOCAB, dtype="float32", grammar=g)),
            ("drafts and grammar scratch", lambda: mf.verify_to_feed(
                dev, scratch.ptr + 8, cells, None, None, k=k, rows=2, vocab=VOCAB, dtype="float32", grammar=g)),
            ("grammar state words and grammar scratch", lambda: mf.argmax_to_feed(
                dev, None, cells, None, None, grammar=(auto, scratch.ptr + 4, scratch), **kw)),
        ]
        for case, (words, call) in enumerate(cases):
            error, ran = traced(call)
            assert words in str(error), (case, error)
            assert ran == [] or mf.backend() == "cuda", (case, ran)
            for name, want in fill.items():
                assert read(ptr[name], len(want)).tolist() == want.tolist(), (case, name)
            assert read(pen.table, len(table)).tolist() == table.tolist(), case


def test_the_advance_is_queued_before_the_copies_and_the_event(auto):
    """The mask, the kernel and the advance, then the readback and the event record: an event that
    completed covers the new state words too."""
    if mf.backend() == "cuda":
        pytest.skip("the order is read from the host backend's trace")
    rows, k = 4, 2
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((rows * (k + 1), VOCAB)).astype(np.float32)
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * (k + 2) * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states, mf.DeviceBuffer(rows * 4) as lp, mf.Event() as done:
        mf.copy_h2d_async(dev, logits.view(np.uint8))
        mf.copy_h2d_async(states, np.array(WORDS[:rows], np.uint32))
        out, lp_out = np.zeros(rows * (k + 2), np.uint32), np.zeros(rows, np.float32)
        wanted = ("copy_h2d", "grammar_mask", "grammar_advance", "copy_d2h")
        for call, want in [
            (lambda: mf.argmax_to_feed(dev, None, cells, out[:rows], done, rows=rows, vocab=VOCAB,
                                       dtype="float32", logprobs=lp, logprobs_dst=lp_out,
                                       grammar=(auto, states)),
             ["grammar_mask", "grammar_advance", "copy_d2h", "copy_d2h"]),
            (lambda: mf.verify_to_feed(dev, [1] * (rows * k), cells, out, done, k=k, vocab=VOCAB,
                                       dtype="float32", grammar=(auto, states)),
             ["copy_h2d", "grammar_mask", "grammar_advance", "copy_d2h"]),
        ]:
            mf.stream_synchronize(0)
            _core.trace_enable()
            try:
                call()
                done.synchronize()
                mf.stream_synchronize(0)
                records, _ = _core.trace_read()
            finally:
                _core.trace_enable(0)
            names = [r[0] for r in records]
            assert [n for n in names if n in wanted] == want, names
            # the kernel between the mask and the advance
            assert names.index("grammar_mask") + 1 < names.index("grammar_advance"), names


def test_a_captured_verify_replays_with_the_states_it_finds(auto):
    rows, k = 4, 2
    words = WORDS[:rows]
    rng = np.random.default_rng(8)
    logits = rng.standard_normal((rows * (k + 1), VOCAB)).astype(np.float32)
    drafts = [int(t) for t in rng.integers(0, VOCAB, rows * k)]
    with mf.Stream() as s, mf.DeviceBuffer(logits.nbytes) as dev, \
            mf.DeviceBuffer(rows * (k + 2) * 4) as cells, mf.DeviceBuffer(rows * k * 4) as ddev, \
            mf.DeviceBuffer(rows * 4) as states, mf.PinnedBuffer(rows * (k + 2) * 4) as out:
        mf.copy_h2d_async(dev, logits.view(np.uint8), s)
        mf.copy_h2d_async(ddev, np.array(drafts, np.uint32), s)
        mf.stream_synchronize(s)
        with mf.graph_capture(s) as graph:
            mf.verify_to_feed(dev, ddev, cells, out, None, s, k=k, rows=rows, vocab=VOCAB,
                              dtype="float32", grammar=(auto, states))
        cur = list(words)
        mf.copy_h2d_async(states, np.array(cur, np.uint32), s)
        for _ in range(3):
            graph.launch(s)
            mf.stream_synchronize(s)
            want_cells, cur = walk_verify(auto, logits, drafts, cur, k)
            assert np.frombuffer(out, np.uint32).tolist() == want_cells
            assert read(states, rows).tolist() == cur
        graph.close()


class Borrowed:
    """An automaton the extension has never heard of: only the two methods of its protocol, the
    view of ``view`` (default: the wrapped automaton's) and the wrapped automaton's scratch."""

    def __init__(self, inner, view=None):
        self.inner, self.view = inner, view

    def _device_view(self):
        return self.inner._device_view() if self.view is None else self.view

    def _scratch(self, stream, nbytes):
        return self.inner._scratch(stream, nbytes)


def test_the_extension_takes_an_automaton_by_its_protocol(auto):
    """The ops read an automaton through ``_device_view()`` and ``_scratch()``, not its type: the
    extension imports nothing of the layer that builds automata."""
    rows = len(WORDS)
    logits = np.random.default_rng(9).standard_normal((rows, VOCAB)).astype(np.float32)
    want = masked_argmax(logits, allowed_rows(auto, WORDS))
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(rows * 4) as cells, \
            mf.DeviceBuffer(rows * 4) as states:
        mf.copy_h2d_async(dev, logits.view(np.uint8))
        mf.copy_h2d_async(states, np.array(WORDS, np.uint32))
        out = np.zeros(rows, np.uint32)
        mf.argmax_to_feed(dev, None, cells, out, None, rows=rows, vocab=VOCAB, dtype="float32",
                          grammar=(Borrowed(auto), states))
        mf.stream_synchronize()
        assert out.tolist() == want.tolist()
        assert read(states, rows).tolist() == stepped(auto, WORDS, want)
        table, edges, num_states, num_edges, vocab = auto._device_view()
        for view, kind, words in [
            ((table, edges), TypeError, "must return"),
            ((table, edges, num_states, num_edges, "70"), TypeError, "vocab"),
            ((table, edges, num_states + 1, num_edges, vocab), ValueError, "grammar states"),
            ((table, edges, num_states, num_edges, vocab + 1), ValueError, "vocabulary of 71"),
        ]:
            with pytest.raises(kind, match=words):
                mf.argmax_to_feed(dev, None, cells, None, None, rows=rows, vocab=VOCAB, dtype="float32",
                                  grammar=(Borrowed(auto, view), states))
    src = pathlib.Path(mf.__file__).parent
    for pxi in sorted(src.glob("*.pxi")) + sorted(src.glob("*.pyx")):
        assert "metrale_feed.grammar" not in pxi.read_text(), pxi.name
