"""TokenAutomaton built through outlines-core, against independent references: the outlines
Index it came from (walked state by state beside it), Python's ``re`` on the decoded text, and
``json.loads`` of the outputs a JSON schema allows. Skipped without outlines-core."""

from __future__ import annotations

import doctest
import json
import re
from collections import deque
from itertools import product

import pytest

outlines_core = pytest.importorskip("outlines_core")

from metrale_feed.grammar import TokenAutomaton  # noqa: E402
from metrale_feed.tools.bench_grammar import SCHEMA, synthetic_vocabulary  # noqa: E402

# A tokenizer by hand: single characters, a few merges, and the end id after a gap of two ids
# that no token uses (the model's vocabulary is wider than the tokenizer's).
TEXTS = list('abcx-.0129red{}":,[] \\y+') + ["ab", "12", "red", "re", '{"', '":', '",', "true",
                                          "name", "age", "color", "scores", "green", "blue",
                                          "gn", "lu", "o", "l", "s", "m", "g", "u", "n", "5"]
EOS = len(TEXTS) + 2
VOCAB = EOS + 1


def vocabulary():
    return outlines_core.Vocabulary(EOS, {text: [i] for i, text in enumerate(TEXTS)})


def text_of(ids):
    return "".join(TEXTS[i] for i in ids)


def tokenize(text, longest=True):
    """Ids of ``text``: one character a token, or the longest token first."""
    ids, at = [], 0
    by_text = {t: i for i, t in enumerate(TEXTS)}
    while at < len(text):
        size = max((len(t) for t in by_text if text.startswith(t, at)), default=0) if longest else 1
        ids.append(by_text[text[at:at + size]])
        at += size
    return ids


def completion(automaton, state):
    """The shortest ids from ``state`` to a state that allows the end id (the automaton's own)."""
    queue, seen = deque([(state, [])]), {state}
    while queue:
        s, path = queue.popleft()
        if EOS in automaton.allowed(s):
            return path
        for token in automaton.allowed(s):
            nxt = automaton.next(s, token)
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, path + [token]))
    return None


# Regexes whose outlines-core index accepts exactly what ``re`` does: none goes on from a match
# through text that does not match, which outlines-core's index cuts ("0(\.5)?" allows "0" and
# then only the end; from_outlines keeps the index as it is, tested below).
REGEXES = ["a+b", "(ab)+c", "[ab]+", r"-?(0|[1-9][0-9]*)\.[0-9]+", "(red|green|blue)",
           "x?[0-9]{1,3}"]


@pytest.mark.parametrize("pattern", REGEXES)
def test_a_regex_allows_what_re_matches(pattern):
    automaton = TokenAutomaton.from_regex(pattern, vocabulary())
    assert automaton.vocab == VOCAB
    done = {}
    for length in range(4):
        for ids in product(range(len(TEXTS)), repeat=length):
            text = text_of(ids)
            state = automaton.walk(ids)
            accepted = state is not None and automaton.next(state, EOS) is not None
            assert accepted == (re.fullmatch(pattern, text) is not None), (pattern, text)
            if state is None:
                continue
            # Every state a prefix reaches can still end in a match.
            if state not in done:
                done[state] = completion(automaton, state)
            assert done[state] is not None
            assert re.fullmatch(pattern, text + text_of(done[state])), (pattern, text)
            if accepted:  # the end id ends the output
                end = automaton.next(state, EOS)
                assert automaton.final(end) and automaton.allowed(end) == []
    # No id the tokenizer leaves out is ever allowed.
    assert all(set(automaton.allowed(s)).isdisjoint({EOS - 2, EOS - 1})
               for s in range(automaton.num_states))


def same_as_index(automaton, index, eos=None, end=EOS):
    """Walk the index and the automaton side by side from their initial states: the same ids
    allowed at every pair, one automaton state for each index state. With ``eos``, the end id
    of a final state leads to a state that allows nothing; without, it loops, as the index's
    table has it (``end``: the index's end id)."""
    pairs = {automaton.initial: index.get_initial_state()}
    queue = deque(pairs.items())
    while queue:
        ours, theirs = queue.popleft()
        allowed = sorted(index.get_allowed_tokens(theirs))
        assert automaton.allowed(ours) == allowed
        for token in allowed:
            nxt = automaton.next(ours, token)
            if eos is not None and token == eos and index.is_final_state(theirs):
                assert automaton.final(nxt) and automaton.allowed(nxt) == []
                continue
            other = index.get_next_state(theirs, token)
            if other is None and token == end and index.is_final_state(theirs):
                # get_next_state refuses the end id; the index's table loops it.
                assert index.get_transitions()[theirs][token] == theirs
                other = theirs
            if nxt in pairs:
                assert pairs[nxt] == other, "two index states in one automaton state"
            else:
                pairs[nxt] = other
                queue.append((nxt, other))
    assert len(set(pairs.values())) == len(pairs)
    return len(pairs)


@pytest.mark.parametrize("eos", [None, "end"])
@pytest.mark.parametrize("pattern", REGEXES + ["(ab)+", "(a|bc)+", r"0(\.5)?"])
def test_from_outlines_is_the_index(pattern, eos):
    index = outlines_core.Index(pattern, vocabulary())
    automaton = TokenAutomaton.from_outlines(index, VOCAB, eos=EOS if eos else None)
    reached = same_as_index(automaton, index, EOS if eos else None)
    # Every state the index has (reachable or not), and the end state when the end id ends it.
    assert automaton.num_states == len(index.get_transitions()) + (1 if eos else 0)
    assert reached <= automaton.num_states


def test_from_outlines_encodes_what_the_constructor_does_with_the_index_table():
    index = outlines_core.Index(r"-?[0-9]+(, ?[a-c]+)*", vocabulary())
    table = index.get_transitions()
    built = TokenAutomaton(table, initial=index.get_initial_state(), vocab=VOCAB)
    read = TokenAutomaton.from_outlines(index, VOCAB)
    assert built.states.tobytes() == read.states.tobytes()
    assert built.edges.tobytes() == read.edges.tobytes()


def test_a_json_schema_over_a_byte_level_vocabulary_is_the_index():
    words = synthetic_vocabulary(2000)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, words)
    automaton = TokenAutomaton.from_json_schema(SCHEMA, words)
    assert automaton.vocab == 2000
    same_as_index(automaton, index, 1999, 1999)
    # The string's state allows most of the vocabulary, and is stored as what it excludes.
    widest = max(range(automaton.num_states), key=lambda s: len(automaton.allowed(s)))
    assert len(automaton.allowed(widest)) > 1500
    assert automaton.states[widest]["count"] < 2000 - len(automaton.allowed(widest)) + 200


VALID = ['{"name":"ab","age":12,"color":"red","scores":[1,2.5]}',
         '{ "name": "", "age": -0, "color": "blue", "scores": [] }',
         '{"name":"x\\"y","age":9,"color":"green","scores":[0.5, 1e-2]}']
INVALID = ['{"name":"ab","age":1.5,"color":"red","scores":[]}',
           '{"name":"ab","age":1,"color":"blu","scores":[]}',
           '{"name":"ab","color":"red","age":1,"scores":[]}',
           '{"name":"ab","age":01,"color":"red","scores":[]}']


@pytest.mark.parametrize("as_text", [False, True])
def test_a_json_schema_allows_its_instances(as_text):
    automaton = TokenAutomaton.from_json_schema(json.dumps(SCHEMA) if as_text else SCHEMA,
                                                vocabulary())
    for text in VALID:
        json.loads(text)
        for longest in (False, True):
            state = automaton.walk(tokenize(text, longest))
            assert state is not None and automaton.allowed(state) == [EOS], text
            assert automaton.final(automaton.next(state, EOS))
    for text in INVALID:
        for longest in (False, True):
            state = automaton.walk(tokenize(text, longest))
            assert state is None or EOS not in automaton.allowed(state), text
    # Any allowed path that ends is valid JSON for the schema (the shortest from each state).
    for state in range(automaton.num_states):
        path = completion(automaton, state)
        if path is not None and state == automaton.initial:
            value = json.loads(text_of(path))
            assert set(value) == {"name", "age", "color", "scores"}


def test_vocab_wider_or_narrower_than_the_ids():
    wide = TokenAutomaton.from_regex("a+b", vocabulary(), vocab=VOCAB + 100)
    narrow_ok = TokenAutomaton.from_regex("a+b", vocabulary())
    assert wide.vocab == VOCAB + 100
    for state in range(narrow_ok.num_states):
        assert wide.allowed(state) == narrow_ok.allowed(state)
    with pytest.raises(ValueError, match=rf"token id {EOS}, outside \[0, {EOS}\)"):
        TokenAutomaton.from_regex("a+b", vocabulary(), vocab=EOS)


def test_what_outlines_core_cannot_compile_is_a_value_error_naming_its_message():
    words = vocabulary()
    with pytest.raises(ValueError, match="outlines-core cannot compile the regex 'a{'") as raised:
        TokenAutomaton.from_regex("a{", words)
    assert str(raised.value.__cause__) in str(raised.value)
    unsupported = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    with pytest.raises(ValueError, match="outlines-core cannot compile the JSON schema") as raised:
        TokenAutomaton.from_json_schema(unsupported, words)
    assert "Unsupported JSON Schema structure" in str(raised.value)
    with pytest.raises(ValueError, match="not valid JSON"):
        TokenAutomaton.from_json_schema('{"type": ', words)


def test_bad_arguments_of_the_builders():
    words = vocabulary()
    index = outlines_core.Index("a+b", words)
    for call, words_in_message in [
            (lambda: TokenAutomaton.from_regex(b"a", words), "pattern must be a str"),
            (lambda: TokenAutomaton.from_regex("a", {"a": [0]}), "outlines_core.Vocabulary"),
            (lambda: TokenAutomaton.from_json_schema(3, words), "str or a mapping"),
            (lambda: TokenAutomaton.from_json_schema({"enum": [object()]}, words), "JSON"),
            (lambda: TokenAutomaton.from_outlines("a+b", VOCAB), "outlines_core.Index"),
            (lambda: TokenAutomaton.from_outlines(index, VOCAB, eos=1.0), "eos"),
            (lambda: TokenAutomaton.from_outlines(index, "9"), "vocab")]:
        with pytest.raises(TypeError, match=words_in_message):
            call()
    with pytest.raises(ValueError, match=rf"token id {EOS}, outside \[0, 2\)"):
        TokenAutomaton.from_outlines(index, 2)


@pytest.mark.parametrize("name", ["from_regex", "from_json_schema", "from_outlines"])
def test_the_outlines_examples_run(name):
    # The docstrings skip these examples where outlines-core may be missing; here it is not.
    text = getattr(TokenAutomaton, name).__doc__.replace("  # doctest: +SKIP", "")
    test = doctest.DocTestParser().get_doctest(text, {}, name, None, 0)
    result = doctest.DocTestRunner().run(test)
    assert result.attempted >= 5 and result.failed == 0


def test_the_bench_row_describes_the_automaton_it_built():
    from metrale_feed.tools.bench_grammar import main, measure

    row = measure(1000, repeats=1)
    index = outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(
        json.dumps(SCHEMA)), synthetic_vocabulary(1000))
    # Every index state, and the end state the end id leads to.
    assert row["states"] == len(index.get_transitions()) + 1
    assert row["bytes"] == 16 * row["states"] + 8 * max(row["edges"], 1)
    assert row["dense"] >= 1 and row["bitmask_bytes"] == row["states"] * 32 * 4
    assert main(["--vocab", "600", "--repeats", "1"]) == 0
