"""The device grammar's two operations (feed.h's mf_grammar_mask and mf_grammar_advance) against
an oracle of the layout written here from its definition (docs/kernels.md, "Grammar"): the arrays
decoded into a dict of edges and a fallback per state, ids looked up in the dict, bitmask rows
packed by numpy. The kernels' binary searches and word-at-a-time fills meet it only through the
bytes they write. Each case runs on host, simt and cuda (where a device is usable)."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

N = mf.NO_TOKEN
DEAD = _core.GRAMMAR_DEAD


# ---- the layout, built and read by the tests ----

def encode(transitions, vocab):
    """(states, edges) arrays of ``transitions`` ({state: {token: next}}, states 0..n-1), each
    state encoded as the layout's builder does: sparse (its allowed ids, fallback DEAD) or dense
    (fallback d, the most common next state; edges for the allowed ids going elsewhere and DEAD
    edges for the ids not allowed), whichever has fewer edges, sparse on a tie."""
    states, edges = [], []
    for s in range(len(transitions)):
        allowed = transitions[s]
        if allowed:
            nexts, counts = np.unique(list(allowed.values()), return_counts=True)
            d = int(nexts[np.argmax(counts)])
            dense = len(allowed) - int(counts.max()) + vocab - len(allowed)
        if not allowed or len(allowed) <= dense:
            mine = sorted(allowed.items())
            fallback = DEAD
        else:
            mine = sorted([(t, n) for t, n in allowed.items() if n != d] +
                          [(t, DEAD) for t in range(vocab) if t not in allowed])
            fallback = d
        states.append((len(edges), len(mine), fallback, 0 if allowed else _core.GRAMMAR_FINAL))
        edges.extend(mine)
    return (np.array(states, np.uint32).reshape(-1, 4),
            np.array(edges, np.uint32).reshape(-1, 2))


class Oracle:
    """The layout's meaning, from the arrays: state s allows t iff t is one of its edges with a
    next other than DEAD, or is none of them and its fallback is not DEAD. Edge ranges past the
    array hold what is inside it (Python's slice)."""

    def __init__(self, states, edges, vocab):
        self.vocab, self.num_states = vocab, len(states)
        self.table = []
        for first, count, fallback, _ in states.tolist():
            self.table.append(({t: n for t, n in edges[first:first + count].tolist()}, fallback))

    def step(self, s, t):
        """(allowed, next state word)."""
        if s == N:
            return True, N
        if s >= self.num_states or t >= self.vocab:
            return False, None
        mine, fallback = self.table[s]
        n = mine.get(t, fallback)
        return n != DEAD, n

    def allowed(self, s):
        row = np.zeros(self.vocab, bool)
        if s == N:
            row[:] = True
        elif s < self.num_states:
            mine, fallback = self.table[s]
            row[:] = fallback != DEAD
            for t, n in mine.items():
                if t < self.vocab:
                    row[t] = n != DEAD
        return row

    def mask(self, words, drafts, k, bitmask_in=None):
        """The rows * (k + 1) bitmask rows of mf_grammar_mask."""
        rows = []
        for r, s in enumerate(words):
            for j in range(k + 1):
                state = s
                for d in (drafts[r * k:r * k + j] if k else []):
                    ok, n = self.step(state, int(d))
                    if not ok:
                        break
                    state = n
                rows.append(pack(self.allowed(state)))
        out = np.array(rows, np.uint32)
        return out if bitmask_in is None else out & bitmask_in.reshape(out.shape)

    def advance(self, words, cells, k):
        out = []
        for r, s in enumerate(words):
            if k == 0:
                ids = [cells[r]]
            else:
                n = cells[r * (k + 2)]
                ids = cells[r * (k + 2) + 1:r * (k + 2) + 1 + n] if 1 <= n <= k + 1 else []
            for t in ids:
                ok, nxt = self.step(s, int(t))
                if ok:
                    s = nxt
            out.append(s)
        return np.array(out, np.uint32)


def pack(allowed):
    """A bool row as bitmask words: bit v % 32 of word v // 32, the bits past the row clear."""
    padded = np.zeros(-(-len(allowed) // 32) * 32, bool)
    padded[:len(allowed)] = allowed
    return np.packbits(padded.reshape(-1, 32), axis=1, bitorder="little").view("<u4").reshape(-1)


def random_automaton(rng, num_states, vocab):
    """Transitions mixing few-id states, most-of-the-vocabulary states (dense encodings, with DEAD
    edges and edges leaving the fallback) and final states."""
    transitions = {}
    for s in range(num_states):
        kind = s % 4
        if kind == 3 and s:
            transitions[s] = {}
        elif kind == 1:  # a string state: most ids stay, a few leave, a few are excluded
            ids = rng.permutation(vocab)
            stay, leave = ids[: vocab * 3 // 4], ids[vocab * 3 // 4: vocab * 3 // 4 + 5]
            transitions[s] = {int(t): s for t in stay}
            transitions[s].update({int(t): int(rng.integers(num_states)) for t in leave})
        else:
            ids = rng.choice(vocab, size=min(vocab, int(rng.integers(1, 9))), replace=False)
            transitions[s] = {int(t): int(rng.integers(num_states)) for t in ids}
    return transitions


class Device:
    """The automaton's arrays and a call's buffers on the device, closed together."""

    def __init__(self, dev):
        self.dev, self.held = dev, []

    def up(self, array):
        buf = self.dev.upload(np.ascontiguousarray(array))
        self.held.append(buf)
        return buf

    def new(self, nbytes, fill=0xA5A5A5A5):
        return self.up(np.full(max(1, nbytes // 4), fill, np.uint32))

    def close(self):
        for buf in self.held:
            buf.close()


@pytest.fixture
def device(dev):
    d = Device(dev)
    yield d
    d.close()


def run_mask(device, states, edges, vocab, words, k=0, drafts=None, bitmask_in=None):
    rows = len(words)
    nwords = -(-vocab // 32)
    out = device.new(rows * (k + 1) * nwords * 4)
    _core._grammar_mask(device.up(states), device.up(edges) if len(edges) else None,
                        device.up(np.array(words, np.uint32)), out, num_states=len(states),
                        num_edges=len(edges), vocab=vocab, rows=rows, k=k,
                        drafts=None if drafts is None else device.up(np.array(drafts, np.uint32)),
                        bitmask_in=None if bitmask_in is None else device.up(bitmask_in))
    return device.dev.download(out, np.uint32, rows * (k + 1) * nwords).reshape(rows * (k + 1), nwords)


def run_advance(device, states, edges, vocab, words, cells, k=0):
    buf = device.up(np.array(words, np.uint32))
    _core._grammar_advance(device.up(states), device.up(edges) if len(edges) else None,
                           device.up(np.array(cells, np.uint32)), buf, num_states=len(states),
                           num_edges=len(edges), vocab=vocab, rows=len(words), k=k)
    return device.dev.download(buf, np.uint32, len(words))


# ---- the test's builder means what its transitions say ----

def test_the_encoding_holds_the_transitions():
    rng = np.random.default_rng(0)
    vocab = 77
    transitions = random_automaton(rng, 12, vocab)
    states, edges = encode(transitions, vocab)
    oracle = Oracle(states, edges, vocab)
    kinds = set()
    for s, allowed in transitions.items():
        kinds.add("dense" if states[s, 2] != DEAD else "sparse")
        for t in range(vocab):
            ok, n = oracle.step(s, t)
            assert ok == (t in allowed) and (not ok or n == allowed[t])
        assert bool(states[s, 3] & _core.GRAMMAR_FINAL) == (not allowed)
    assert kinds == {"dense", "sparse"}
    assert (edges[states[states[:, 2] != DEAD, 0], 1] == DEAD).any()  # dense states list DEAD edges
    assert len(edges) < len(transitions) * vocab // 2  # never a row per state


# ---- the mask ----

@pytest.mark.parametrize("vocab", [1, 31, 32, 77, 1000])
def test_plain_step_masks_every_kind_of_state_word(backend, device, vocab):
    """k = 0: each row's state's allowed ids, sparse and dense states alike, bits past vocab
    clear; NO_TOKEN allows every id, a word at or past num_states none."""
    rng = np.random.default_rng(vocab)
    transitions = random_automaton(rng, 9, vocab)
    states, edges = encode(transitions, vocab)
    words = list(range(9)) + [N, 9, 2**31, DEAD - 1]
    got = run_mask(device, states, edges, vocab, words)
    want = Oracle(states, edges, vocab).mask(words, [], 0)
    assert got.tobytes() == want.tobytes()
    assert not got[-3:].any() and (got[9] == pack(np.ones(vocab, bool))).all()


@pytest.mark.parametrize("vocab", [77, 1000])
def test_drafts_walk_and_stop_at_a_draft_their_state_refuses(backend, device, vocab):
    """k > 0: logit row j of a row holds the state its first j drafts reach; a draft its state
    does not allow (an id outside the state, NO_TOKEN, an id >= vocab) stops the walk and the later
    positions keep the state where it stopped; an unconstrained row allows everything throughout."""
    rng = np.random.default_rng(vocab + 1)
    transitions = random_automaton(rng, 10, vocab)
    states, edges = encode(transitions, vocab)
    oracle = Oracle(states, edges, vocab)
    k = 4

    def walk(s, length):  # drafts the automaton allows, from state s
        out = []
        for _ in range(length):
            allowed = np.flatnonzero(oracle.allowed(s))
            if not len(allowed):
                break
            t = int(rng.choice(allowed))
            out.append(t)
            s = oracle.step(s, t)[1]
        return out + [N] * (length - len(out))

    refused = next(t for t in range(vocab) if not oracle.step(0, t)[0])
    rows = [
        (0, walk(0, k)),                         # every draft allowed
        (1, walk(1, k)),                         # a dense state's walk
        (0, [refused] + walk(0, k - 1)),         # refused at once
        (2, walk(2, 2)[:2] + [N, 5]),            # NO_TOKEN mid-way: an id after it is not walked
        (4, walk(4, 1) + [vocab, vocab + 7, 0]),  # ids past the vocabulary stop it
        (N, [vocab + 3, N, 1, 2]),               # unconstrained: drafts do not matter
        (10, walk(0, k)),                        # out of range: nothing, at every position
    ]
    # A disallowed draft mid-way: walk two, then an id the state reached does not allow.
    two = walk(3 % 10, 2)
    s = 3 % 10
    for t in two:
        if t != N:
            s = oracle.step(s, t)[1]
    bad = next((t for t in range(vocab) if not oracle.step(s, t)[0]), vocab)
    rows.append((3 % 10, two + [bad, 0]))
    words = [w for w, _ in rows]
    drafts = [int(d) for _, ds in rows for d in ds]
    got = run_mask(device, states, edges, vocab, words, k=k, drafts=drafts)
    want = oracle.mask(words, drafts, k)
    assert got.tobytes() == want.tobytes()
    assert (got[2 * (k + 1):3 * (k + 1)] == got[2 * (k + 1)]).all()  # refused at once: one state throughout


def test_bitmask_in_is_anded(backend, device):
    rng = np.random.default_rng(5)
    vocab, k = 333, 2
    states, edges = encode(random_automaton(rng, 6, vocab), vocab)
    words = [0, 1, N, 7]
    drafts = rng.integers(0, vocab, len(words) * k)
    nwords = -(-vocab // 32)
    bitmask_in = rng.integers(0, 2**32, (len(words) * (k + 1), nwords), dtype=np.uint64).astype(np.uint32)
    got = run_mask(device, states, edges, vocab, words, k=k, drafts=drafts, bitmask_in=bitmask_in)
    want = Oracle(states, edges, vocab).mask(words, drafts, k, bitmask_in)
    assert got.tobytes() == want.tobytes()
    assert (got[2 * (k + 1)] == bitmask_in[2 * (k + 1)] & pack(np.ones(vocab, bool))).all()  # NO_TOKEN row


def test_records_past_the_arrays_are_read_in_bounds(backend, device):
    """Device data is not checked when queued: a state whose edges pass the edge array has the
    edges inside it, one whose first edge is past it has none, and a next state past the table
    allows nothing (and the advance goes there)."""
    vocab = 100
    states = np.array([[0, 2, DEAD, 0],         # (4, 1), (9, 3)
                       [1, 50, DEAD, 0],        # count past the array: (9, 3), (20, 0), (30, 5)
                       [7, 3, 0, 0],            # first past the array: no edges, fallback 0
                       [2, 2, DEAD, 0]],        # (20, 0), (30, 5): 5 is past the table
                      np.uint32)
    edges = np.array([[4, 1], [9, 3], [20, 0], [30, 5]], np.uint32)
    oracle = Oracle(states, edges, vocab)
    words, k = [0, 1, 2, 3, 5], 2
    drafts = [9, 30, 20, 4, 55, 9, 30, 1, 4, 4]
    got = run_mask(device, states, edges, vocab, words, k=k, drafts=drafts)
    assert got.tobytes() == oracle.mask(words, drafts, k).tobytes()
    assert not got[2].any() and not got[3 * (k + 1) + 1:].any()  # past the table: nothing
    assert got[2 * (k + 1)].tolist() == pack(np.ones(vocab, bool)).tolist()  # the fallback, no edges
    cells = [9, 30, 77, 30, 4]
    got = run_advance(device, states, edges, vocab, [0, 1, 2, 3, 5], cells)
    assert got.tolist() == oracle.advance([0, 1, 2, 3, 5], cells, 0).tolist() == [3, 5, 0, 5, 5]


@pytest.mark.parametrize("threads", [1, 3])
def test_many_rows_in_few_states_over_a_wide_vocabulary(backend, device, threads):
    """A batch as a served one has it: many rows in a few states (more distinct states than the
    host's copy of a recent row holds, interleaved so it forgets and rebuilds them), over a
    vocabulary of many words; sparse states whose edges pass ``vocab`` (ids the rule never reads,
    inside the last word and past it), with and without ``bitmask_in``, drafts included."""
    rng = np.random.default_rng(threads)
    vocab, k = 5001, 2  # the last word holds 9 ids
    transitions = random_automaton(rng, 14, vocab)
    states, edges = encode(transitions, vocab)
    # State 14: sorted edges at vocab - 1, then ids past it (in the last word, then past it).
    first = len(edges)
    extra = np.array([[vocab - 1, 0], [vocab + 2, 1], [vocab + 40, 2]], np.uint32)
    edges = np.concatenate([edges, extra])
    states = np.concatenate([states, np.array([[first, 3, DEAD, 0]], np.uint32)])
    oracle = Oracle(states, edges, vocab)
    words = [int(w) for w in rng.permutation(np.tile(np.arange(15), 5))] + [N, 1, N, 1]
    mf.host_kernel_threads(threads)
    try:
        got = run_mask(device, states, edges, vocab, words)
        assert got.tobytes() == oracle.mask(words, [], 0).tobytes()
        drafts = [int(t) for t in rng.integers(0, vocab, len(words) * k)]
        nwords = -(-vocab // 32)
        bitmask_in = rng.integers(0, 2**32, (len(words) * (k + 1), nwords), dtype=np.uint64).astype(np.uint32)
        got = run_mask(device, states, edges, vocab, words, k=k, drafts=drafts)
        assert got.tobytes() == oracle.mask(words, drafts, k).tobytes()
        got = run_mask(device, states, edges, vocab, words, k=k, drafts=drafts, bitmask_in=bitmask_in)
        assert got.tobytes() == oracle.mask(words, drafts, k, bitmask_in).tobytes()
    finally:
        mf.host_kernel_threads(0)


def _mask_on(name, states, edges, vocab, words, helpers):
    """mf_grammar_mask's rows on backend ``name`` (host or simt)."""
    previous = mf.backend()
    mf.set_backend(name)
    try:
        d = Device(helpers)
        try:
            return run_mask(d, states, edges, vocab, words)
        finally:
            d.close()
    finally:
        mf.set_backend(previous)


def test_edges_out_of_order_give_the_kernels_bits_on_the_host(host, dev):
    """No encoder writes a state's edges out of order, but the arrays are device data nobody
    checks: the host's one-pass row must then give what the CUDA kernel's word-at-a-time rule
    gives (simt runs that kernel's source), not what a sorted table would mean."""
    if mf.backend() != "host":
        pytest.skip("compares the host backend with simt")
    vocab = 200
    edges = np.array([[40, 0], [3, 0], [150, 1], [70, 0], [71, 0],    # state 0: out of order
                      [5, 0], [5, 1], [90, 0],                          # state 1: a repeated id
                      [10, 0], [190, 1], [60, DEAD], [61, 0]],          # state 2: dense, out of order
                     np.uint32)
    states = np.array([[0, 5, DEAD, 0], [5, 3, DEAD, 0], [8, 4, 0, 0]], np.uint32)
    words = [0, 1, 2, 0, 2, 1]
    got = _mask_on("host", states, edges, vocab, words, dev)
    want = _mask_on("simt", states, edges, vocab, words, dev)
    assert got.tobytes() == want.tobytes()
    # Not vacuous: the dict reading of the arrays disagrees with the rule somewhere.
    assert want.tobytes() != Oracle(states, edges, vocab).mask(words, [], 0).tobytes()


# ---- the advance ----

def test_plain_advance_steps_each_row_by_its_id(backend, device):
    """k = 0: the state after cells[r]; NO_TOKEN (no candidate), an id the state refuses and an
    id >= vocab leave it; NO_TOKEN rows stay unconstrained; words past the table stay."""
    rng = np.random.default_rng(7)
    vocab = 300
    transitions = random_automaton(rng, 8, vocab)
    states, edges = encode(transitions, vocab)
    oracle = Oracle(states, edges, vocab)
    words, cells = [], []
    for s in range(8):
        allowed = np.flatnonzero(oracle.allowed(s))
        refused = np.flatnonzero(~oracle.allowed(s))
        if len(allowed):
            words.append(s), cells.append(int(rng.choice(allowed)))
        if len(refused):
            words.append(s), cells.append(int(rng.choice(refused)))
        words.append(s), cells.append(N)
        words.append(s), cells.append(vocab + s)
    words += [N, N, 8, 2**31]
    cells += [5, N, 5, 5]
    got = run_advance(device, states, edges, vocab, words, cells)
    want = oracle.advance(words, cells, 0)
    assert got.tolist() == want.tolist()
    assert got.tolist()[-4:] == [N, N, 8, 2**31]


@pytest.mark.parametrize("k", [1, 3])
def test_verify_advance_takes_the_emitted_ids_in_order(backend, device, k):
    """k > 0: verify_to_feed's cells, n then the n ids, for every n from 1 to k + 1, and n outside
    that range (another call's cells) as no ids; each id steps the state on its own."""
    rng = np.random.default_rng(k)
    vocab = 150
    transitions = random_automaton(rng, 8, vocab)
    states, edges = encode(transitions, vocab)
    oracle = Oracle(states, edges, vocab)
    words, cells = [], []
    for n in list(range(0, k + 3)) + [2**31]:
        for s in (0, 1, 2, N):
            ids, state = [], s
            for _ in range(k + 1):
                allowed = np.flatnonzero(oracle.allowed(state))
                t = int(rng.choice(allowed)) if len(allowed) and rng.random() < 0.8 else int(rng.integers(vocab))
                ids.append(t)
                state = oracle.step(state, t)[1] if oracle.step(state, t)[0] else state
            if n == 2 and k > 1:
                ids[0] = N  # a NO_TOKEN id first: the next one still steps
            words.append(s)
            cells += [n] + ids
    got = run_advance(device, states, edges, vocab, words, cells, k=k)
    want = oracle.advance(words, cells, k)
    assert got.tolist() == want.tolist()
    moved = [(w, g) for w, g in zip(words, got.tolist()) if w != g]
    assert moved  # the case steps states, not only leaves them


def test_mask_then_advance_on_one_stream_needs_no_sync(backend, device):
    """The advance reads the cells and writes the words in stream order: a mask queued after it
    sees the new state, with nothing synchronised in between."""
    vocab = 64
    transitions = {0: {1: 1, 2: 0}, 1: {3: 2}, 2: {}}
    states, edges = encode(transitions, vocab)
    s_buf, e_buf = device.up(states), device.up(edges)
    words = device.up(np.array([0, 0], np.uint32))
    cells = device.up(np.array([1, 2], np.uint32))
    out = device.new(2 * 2 * 4)
    kw = dict(num_states=3, num_edges=len(edges), vocab=vocab, rows=2)
    with mf.Stream() as stream:
        _core._grammar_advance(s_buf, e_buf, cells, words, stream, **kw)
        _core._grammar_mask(s_buf, e_buf, words, out, stream, **kw)
        stream.synchronize()
    got = device.dev.download(out, np.uint32, 4).reshape(2, 2)
    assert got.tolist() == [[1 << 3, 0], [(1 << 1) | (1 << 2), 0]]


def test_a_captured_mask_and_advance_replay_with_the_states_they_find(backend, device):
    """Both ops read their device inputs when they run: a graph of mask then advance, launched
    again and again, masks each launch by the states the launch before it left and steps them
    by the cells as they are at that launch."""
    vocab = 64
    transitions = {0: {1: 1, 2: 0}, 1: {3: 2, 4: 0}, 2: {5: 0}}
    states, edges = encode(transitions, vocab)
    oracle = Oracle(states, edges, vocab)
    s_buf, e_buf = device.up(states), device.up(edges)
    words = device.up(np.array([0, N], np.uint32))
    cells = device.up(np.array([1, 9], np.uint32))
    out = device.new(2 * 2 * 4)
    kw = dict(num_states=3, num_edges=len(edges), vocab=vocab, rows=2)
    with mf.Stream() as stream:
        with mf.graph_capture(stream) as graph:
            _core._grammar_mask(s_buf, e_buf, words, out, stream, **kw)
            _core._grammar_advance(s_buf, e_buf, cells, words, stream, **kw)
        state = 0
        for step, token in enumerate([1, 3, 5, 2, 1, 4]):
            device.dev.write(cells, np.array([token, 9], np.uint32), stream=stream)
            graph.launch(stream)
            stream.synchronize()
            got = device.dev.download(out, np.uint32, 4, stream=stream).reshape(2, 2)
            assert got[0].tolist() == pack(oracle.allowed(state)).tolist(), step
            assert got[1].tolist() == [0xFFFFFFFF, 0xFFFFFFFF], step
            state = oracle.step(state, token)[1]
            assert device.dev.download(words, np.uint32, 2, stream=stream).tolist() == [state, N], step
        graph.close()


# ---- refusals: each before anything is queued ----

def refused(call, match, case):
    """``call`` raises ValueError (or TypeError for a non-device argument) matching ``match`` and
    queues nothing: the host trace records no op of it."""
    mf.stream_synchronize(0)
    _core.trace_enable()
    try:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
            pytest.fail(f"case {case} ({match}) was not refused")
        mf.stream_synchronize(0)
        records, _ = _core.trace_read()
    finally:
        _core.trace_enable(0)
    assert not [r for r in records if r[0].startswith("grammar")], records


def test_every_refusal_queues_nothing(host, device):
    vocab, rows, k = 100, 3, 2
    states, edges = encode({0: {1: 1, 2: 0}, 1: {3: 2}, 2: {}}, vocab)
    nwords = -(-vocab // 32)
    S, E = device.up(states), device.up(edges)
    W = device.up(np.zeros(rows, np.uint32))
    D = device.up(np.zeros(rows * k, np.uint32))
    out = device.new(rows * (k + 1) * nwords * 4)
    cells = device.up(np.zeros(rows * (k + 2), np.uint32))
    big = device.new(4096 * 4 * nwords + 4096)
    auto = dict(num_states=3, num_edges=len(edges), vocab=vocab)
    mask = dict(auto, rows=rows, k=k, drafts=D)

    def m(**changes):
        kw = dict(mask)
        args = dict(states=S, edges=E, state_words=W, bitmask_out=out)
        for key in list(changes):
            if key in args:
                args[key] = changes.pop(key)
        kw.update(changes)
        return lambda: _core._grammar_mask(args["states"], args["edges"], args["state_words"],
                                           args["bitmask_out"], **kw)

    def a(**changes):
        kw = dict(auto, rows=rows, k=k)
        args = dict(states=S, edges=E, cells=cells, state_words=W)
        for key in list(changes):
            if key in args:
                args[key] = changes.pop(key)
        kw.update(changes)
        return lambda: _core._grammar_advance(args["states"], args["edges"], args["cells"], args["state_words"], **kw)

    with mf.PinnedBuffer(4096) as pinned:
        for case, (call, match) in enumerate([
            # shapes and counts
            (m(rows=0), "rows"), (m(rows=4096 // (k + 1) + 1, bitmask_out=big), "rows"),
            (m(k=mf.MAX_DRAFTS + 1), "k must be"), (m(vocab=0), "vocab"),
            (m(vocab=mf.MAX_VOCAB + 1), "vocab"), (m(num_states=0), "num_states"),
            (m(num_states=DEAD), "num_states"),
            (m(k=0), "drafts are given exactly when k > 0"),
            (m(drafts=None), "drafts are given exactly when k > 0"),
            # null and misaligned pointers
            (m(states=0), "states or edges"), (m(edges=None), "states or edges"),
            (m(states=S.ptr + 2), "states or edges"), (m(edges=E.ptr + 4 + 2), "states or edges"),
            (m(state_words=0), "state_words"), (m(state_words=W.ptr + 1), "state_words"),
            (m(drafts=D.ptr + 2), "drafts"), (m(bitmask_out=0), "bitmask_out"),
            (m(bitmask_in=out.ptr + 1, bitmask_out=big), "bitmask_in"),
            # extents and memory kinds
            (m(num_states=4), "grammar states"), (m(num_edges=len(edges) + 1), "grammar edges"),
            (m(rows=rows + 1, k=1, drafts=D), "grammar state words"),
            (m(rows=1, k=7, drafts=D), "drafts"),
            (m(vocab=vocab + 32), "bitmask_out"), (m(bitmask_in=W, bitmask_out=big), "bitmask_in"),
            (m(states=pinned.ptr), "grammar states"), (m(bitmask_out=pinned.ptr), "bitmask_out"),
            (m(bitmask_out=pinned), "page-locked"),
            (m(bitmask_out=np.zeros(3, np.uint32)), "run past the end of the tensor"),
            (m(states=np.zeros(4, np.float32)), "run past the end of the tensor"),
            # the output over an input
            (m(states=big.ptr, bitmask_out=big), "overlap"), (m(edges=big.ptr + 64, bitmask_out=big), "overlap"),
            (m(state_words=big.ptr + 4, bitmask_out=big), "overlap"),
            (m(drafts=big.ptr + 16, bitmask_out=big), "overlap"),
            (m(bitmask_out=big, bitmask_in=big.ptr + 4), "overlap"),
            (m(bitmask_out=out, bitmask_in=out), "overlap"),
            # the advance
            (a(rows=0), "rows"), (a(k=mf.MAX_DRAFTS + 1), "k must be"), (a(rows=2049, k=1), "rows"),
            (a(vocab=0), "vocab"), (a(num_states=0), "num_states"), (a(edges=None), "states or edges"),
            (a(cells=0), "cells or state_words"), (a(cells=cells.ptr + 2), "cells or state_words"),
            (a(state_words=W.ptr + 2), "cells or state_words"),
            (a(k=k + 1), "cells"), (a(rows=rows * (k + 2) + 1, k=0, state_words=big), "cells"),
            (a(rows=rows + 1, k=0), "grammar state words"), (a(state_words=pinned.ptr), "grammar state words"),
            (a(state_words=S), "overlap"), (a(state_words=E), "overlap"), (a(state_words=cells), "overlap"),
        ]):
            refused(call, match, case)
