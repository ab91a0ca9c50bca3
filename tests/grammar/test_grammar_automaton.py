"""TokenAutomaton's host side and device copy, against references of the tests' own: the
transition map it was given, decoded back from the two device arrays by the layout's rules, and
walked by a plain dict lookup; the device copy read back byte for byte."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import numpy as np
import pytest

import metrale_feed as mf
from helpers.child import run_python
from metrale_feed.grammar import DEAD, EDGE_DTYPE, FINAL, STATE_DTYPE, TokenAutomaton


# ---- references ----

def renumbered(transitions, initial):
    """The map as the automaton numbers it: the initial state 0, the others in increasing order."""
    order = [initial] + sorted(s for s in transitions if s != initial)
    number = {s: i for i, s in enumerate(order)}
    return {number[s]: {t: number[n] for t, n in transitions[s].items()} for s in order}


def decode(states, edges, vocab):
    """The transition map the two arrays encode, read by the layout's rules, checking them."""
    out = {}
    for s, (first, count, fallback, flags) in enumerate(states.tolist()):
        segment = edges[first:first + count].tolist()
        tokens = [t for t, _ in segment]
        assert tokens == sorted(set(tokens)), f"state {s}: edges not strictly increasing"
        assert all(0 <= t < vocab for t in tokens)
        moves = {} if fallback == DEAD else dict.fromkeys(range(vocab), fallback)
        for token, nxt in segment:
            if nxt == DEAD:
                moves.pop(token, None)
            else:
                moves[token] = nxt
        assert flags in (0, FINAL) and bool(flags & FINAL) == (not moves), f"state {s}: flags"
        out[s] = moves
    return out


def reference_walk(table, tokens, state=0):
    for token in tokens:
        state = table[state].get(token)
        if state is None:
            return None
    return state


def random_transitions(rng):
    """A random automaton with sparse, dense, full and empty states (keys anywhere in int64)."""
    vocab = int(rng.choice([1, 2, 5, 33, 64, 100]))
    keys = [int(k) for k in rng.choice(1 << 40, int(rng.integers(1, 9)), replace=False) - (1 << 39)]
    table = {}
    for key in keys:
        kind = int(rng.integers(0, 4))
        if kind == 0:
            table[key] = {}
        elif kind == 1:  # a few ids, anywhere
            ids = rng.choice(vocab, int(rng.integers(1, min(vocab, 4) + 1)), replace=False)
            table[key] = {int(t): keys[int(rng.integers(len(keys)))] for t in ids}
        elif kind == 2:  # most ids, most of them to one state
            main = keys[int(rng.integers(len(keys)))]
            ids = [t for t in range(vocab) if rng.random() < 0.9]
            table[key] = {t: main if rng.random() < 0.8 else keys[int(rng.integers(len(keys)))]
                          for t in ids}
        else:  # every id to one state
            table[key] = dict.fromkeys(range(vocab), keys[int(rng.integers(len(keys)))])
    return table, keys[int(rng.integers(len(keys)))], vocab


@lru_cache(maxsize=None)
def automata(count=150, seed=7):
    rng = np.random.default_rng(seed)
    return [random_transitions(rng) for _ in range(count)]


# ---- construction ----

GOOD = {3: {0: 4, 2: 3}, 4: {}}


@pytest.mark.parametrize("transitions, initial, vocab, error, words", [
    ([(3, {})], 3, 4, TypeError, "mapping"),
    ({3: [(0, 3)]}, 3, 4, TypeError, "state 3's transitions"),
    ({"3": {}}, "3", 4, TypeError, "a state of transitions must be an int"),
    ({True: {}}, True, 4, TypeError, "a state of transitions must be an int"),
    ({3: {0.0: 3}}, 3, 4, TypeError, "a token id of state 3"),
    ({3: {False: 3}}, 3, 4, TypeError, "a token id of state 3"),
    ({3: {0: "3"}}, 3, 4, TypeError, "a next state of state 3"),
    ({3: {0: 3.0}}, 3, 4, TypeError, "a next state of state 3"),
    (GOOD, 3.0, 4, TypeError, "initial"),
    (GOOD, 4, 2.5, TypeError, "vocab"),
    ({3: {0: 5}}, 3, 4, ValueError, "goes to 5, which is not a state"),
    (GOOD, 5, 4, ValueError, "initial state 5 is not a state"),
    ({}, 0, 4, ValueError, "initial state 0 is not a state"),
    ({3: {4: 3}}, 3, 4, ValueError, "token id 4, outside [0, 4)"),
    ({3: {-1: 3}}, 3, 4, ValueError, "token id -1, outside [0, 4)"),
    ({3: {1 << 70: 3}}, 3, 4, ValueError, "outside [0, 4)"),
    (GOOD, 3, 0, ValueError, "vocab must be in [1,"),
    (GOOD, 3, mf.MAX_VOCAB + 1, ValueError, "vocab must be in [1,"),
])
def test_bad_transitions_are_refused(transitions, initial, vocab, error, words):
    with pytest.raises(error) as raised:
        TokenAutomaton(transitions, initial=initial, vocab=vocab)
    assert words in str(raised.value)


def test_numpy_integers_and_any_int_states_are_taken():
    table = {np.int64(-7): {np.uint32(1): 1 << 62}, 1 << 62: {}}
    automaton = TokenAutomaton(table, initial=np.int16(-7), vocab=np.int32(3))
    assert (automaton.num_states, automaton.vocab, automaton.initial) == (2, 3, 0)
    assert automaton.allowed(0) == [1] and automaton.next(0, 1) == 1 and automaton.final(1)


def test_the_package_exports_it_lazily():
    assert mf.TokenAutomaton is TokenAutomaton
    assert "TokenAutomaton" in dir(mf)
    assert STATE_DTYPE.itemsize == 16 and EDGE_DTYPE.itemsize == 8


# ---- the encoding ----

@pytest.mark.parametrize("case", range(150))
def test_the_arrays_decode_to_the_transitions(case):
    transitions, initial, vocab = automata()[case]
    automaton = TokenAutomaton(transitions, initial=initial, vocab=vocab)
    expected = renumbered(transitions, initial)
    assert automaton.num_states == len(transitions) and automaton.initial == 0
    assert decode(automaton.states, automaton.edges, vocab) == expected
    # Each state takes the smaller encoding (ties: sparse), as the layout says.
    for s, moves in expected.items():
        first, count, fallback, _ = automaton.states[s].tolist()
        common = max(Counter(moves.values()).values(), default=0)
        dense = vocab - common < len(moves)
        assert count == (vocab - common if dense else len(moves))
        assert (fallback != DEAD) == dense
    assert automaton.nbytes == 16 * automaton.num_states + 8 * max(len(automaton.edges), 1)
    assert not automaton.states.flags.writeable and not automaton.edges.flags.writeable


@pytest.mark.parametrize("case", range(0, 150, 3))
def test_host_methods_equal_a_dict_walk(case):
    transitions, initial, vocab = automata()[case]
    automaton = TokenAutomaton(transitions, initial=initial, vocab=vocab)
    table = renumbered(transitions, initial)
    rng = np.random.default_rng(case)
    for s, moves in table.items():
        assert automaton.allowed(s) == sorted(moves)
        assert automaton.final(s) == (not moves)
        bits = np.unpackbits(automaton.bitmask(s).view(np.uint8), bitorder="little")
        assert len(bits) == 32 * ((vocab + 31) // 32)
        assert np.flatnonzero(bits).tolist() == sorted(moves)
        for token in range(-1, vocab + 2):
            assert automaton.next(s, token) == moves.get(token)
    for _ in range(40):
        tokens = rng.integers(0, vocab + 1, int(rng.integers(0, 7))).tolist()
        start = int(rng.integers(len(table)))
        assert automaton.walk(tokens) == reference_walk(table, tokens)
        assert automaton.walk(tokens, start=start) == reference_walk(table, tokens, start)


def test_a_state_allowing_most_of_a_large_vocabulary_costs_what_it_excludes():
    vocab = 152064
    # A string's state: every id but a few stays, a few close it, a few are excluded.
    closing, excluded = [34, 1034], [92, 7, 151000]
    string = {t: 0 for t in range(vocab) if t not in excluded}
    string.update(dict.fromkeys(closing, 1))
    automaton = TokenAutomaton({0: string, 1: {}}, initial=0, vocab=vocab)
    assert automaton.states[0].tolist() == (0, 5, 0, 0)
    assert automaton.edges.tolist() == sorted([(t, DEAD) for t in excluded] +
                                              [(t, 1) for t in closing])
    assert automaton.nbytes == 2 * 16 + 5 * 8
    assert len(automaton.allowed(0)) == vocab - 3 and automaton.next(0, 34) == 1
    assert automaton.walk([5, 6, 1034]) == 1 and automaton.walk([5, 92]) is None


def test_host_methods_check_their_arguments():
    automaton = TokenAutomaton(GOOD, initial=3, vocab=4)
    for call in (lambda: automaton.allowed(2), lambda: automaton.next(-1, 0),
                 lambda: automaton.final(2), lambda: automaton.bitmask(5),
                 lambda: automaton.walk([0], start=2)):
        with pytest.raises(ValueError, match=r"outside \[0, 2\)"):
            call()
    for call in (lambda: automaton.allowed("0"), lambda: automaton.next(0, 1.0),
                 lambda: automaton.walk([0, None]), lambda: automaton.walk([], start=True)):
        with pytest.raises(TypeError):
            call()
    # Ids outside the vocabulary are never allowed, as on the device.
    assert automaton.next(0, 4) is None and automaton.next(0, -1) is None
    assert automaton.next(0, mf.NO_TOKEN) is None and automaton.walk([2, 2, 0]) == 1


# ---- the device copy ----

def read_back(buffer, dtype, count):
    out = np.zeros(count, dtype)
    mf.copy_d2h_async(buffer, out)
    mf.stream_synchronize()
    return out


@pytest.mark.parametrize("case", [0, 1, 2, 5, 8])
def test_the_device_copy_holds_the_arrays(backend, no_leaks, case):
    transitions, initial, vocab = automata()[case]
    automaton = TokenAutomaton(transitions, initial=initial, vocab=vocab)
    with backend.Stream() as stream:
        states, edges = automaton.to_device(stream)
        assert automaton.to_device(stream) == (states, edges) == automaton.device_arrays
        assert states.nbytes + edges.nbytes == automaton.nbytes
        backend.stream_synchronize(stream)
    assert read_back(states, STATE_DTYPE, automaton.num_states).tobytes() == \
        automaton.states.tobytes()
    edges_back = read_back(edges, EDGE_DTYPE, edges.nbytes // 8)
    if len(automaton.edges):
        assert edges_back.tobytes() == automaton.edges.tobytes()
    else:  # no edge: one record that no state names
        assert edges_back.tolist() == [(DEAD, DEAD)]
    automaton.close()
    assert states.closed and edges.closed and not automaton.on_device
    with pytest.raises(mf.FeedError, match="not on the device"):
        automaton.device_arrays
    automaton.close()  # twice: nothing more


def test_the_upload_is_complete_when_to_device_returns(host, no_leaks):
    # Ops on any stream read an automaton with no event to order them after its upload: the
    # copies on a lagging stream must have run when to_device returns (a graph replayed on
    # another stream once read the arrays half-written).
    transitions, initial, vocab = automata()[5]
    automaton = TokenAutomaton(transitions, initial=initial, vocab=vocab)
    import time

    with mf.Stream() as late:
        mf.launch_host_func(late, time.sleep, 0.3)  # the upload queues behind 0.3 s of work
        states, edges = automaton.to_device(late)
        out = np.zeros(automaton.num_states, STATE_DTYPE)
        with mf.Stream() as other:  # read on another stream, without waiting on `late`
            mf.copy_d2h_async(states, out, other)
            mf.stream_synchronize(other)
    assert out.tobytes() == automaton.states.tobytes()
    automaton.close()


def test_the_context_manager_frees_the_device_copy(backend, no_leaks):
    automaton = TokenAutomaton(GOOD, initial=3, vocab=4)
    with automaton as same:
        assert same is automaton
        first = automaton.to_device()
    assert first[0].closed and not automaton.on_device
    # The host side stays, and a new upload makes new buffers.
    assert automaton.allowed(0) == [0, 2]
    again = automaton.to_device()
    assert again != first and read_back(again[0], STATE_DTYPE, 2).tobytes() == \
        automaton.states.tobytes()
    automaton.close()


def test_without_outlines_core_the_builders_name_the_extra():
    result = run_python("""
        import sys
        sys.modules["outlines_core"] = None  # as if it were not installed
        from metrale_feed import TokenAutomaton
        for build in (lambda: TokenAutomaton.from_regex("a", None),
                      lambda: TokenAutomaton.from_json_schema("{}", None),
                      lambda: TokenAutomaton.from_outlines(None, 4)):
            try:
                build()
            except ImportError as error:
                assert "pip install 'metrale-feed[grammar]'" in str(error), error
            else:
                raise AssertionError("no ImportError")
        print("ok")
    """)
    assert result.stdout.strip() == "ok"
