"""The scheduler's layers talk through public calls (issue 24): the pipeline launches through
the router's ``launch`` and reads nothing private of it; a speculative step's launches are
counted beside the router's, not written into them."""

from __future__ import annotations

import ast
import pathlib

import pytest

from metrale_feed import NO_TOKEN, DecodePipeline
from metrale_feed.sched.speculative import NGramDrafter

from conftest import VOCAB, greedy_tokens, model_for, prompts

SCHED = pathlib.Path(__file__).resolve().parents[2] / "src" / "metrale_feed" / "sched"


@pytest.mark.parametrize("depth", [1, 2])
def test_every_step_goes_through_the_routers_public_launch(host, no_leaks, depth):
    calls = []
    with model_for(rows=3) as model, DecodePipeline(model, 3, depth=depth) as pipe:
        public = pipe.io.launch

        def launch(*args, **kw):
            calls.append(kw["fed"])
            return public(*args, **kw)

        pipe.io.launch = launch  # type: ignore[method-assign]
        reqs = [pipe.submit(p, max_new_tokens=5) for p in prompts(3, seed=depth)]
        pipe.run()
        launches = pipe.stats.launches
    assert len(calls) == launches > 0
    assert all(calls)  # the reference model feeds at both depths
    for req, prompt in zip(reqs, prompts(3, seed=depth)):
        assert req.tokens == greedy_tokens(prompt, 5, VOCAB)


def _private_uses(path, owners):
    """``owner._name`` attribute reads in ``path`` where ``owner`` ends one of ``owners``
    (``io``, ``self.io``, ``pipe.io``, ``router``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = node.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if name in owners:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_pipeline_uses_no_private_member_of_the_router():
    uses = []
    for name in ("pipeline.py", "speculative.py", "penalized.py", "request.py"):
        uses += _private_uses(SCHED / name, {"io", "router"})
    assert uses == []


def test_speculative_launches_are_counted_beside_the_routers(host, no_leaks):
    with model_for(rows=2) as model, \
            DecodePipeline(model, 2, speculative=NGramDrafter(2)) as pipe:
        for p in prompts(2, seed=3):
            pipe.submit(p, max_new_tokens=6)
        pipe.run()
        stats = pipe.stats.as_dict()
        assert pipe.io.stats.launches == 0  # no verify step went through the ring
        assert stats["launches"] == pipe.stats.launches == stats["steps"] > 0
        assert stats["ahead_launches"] == pipe.stats["ahead_launches"] > 0


def test_requests_are_distinct_by_identity(host, no_leaks):
    """The pipeline keys its maps by the request objects themselves: two requests with the
    same parameters are two keys."""
    with model_for(rows=2) as model, DecodePipeline(model, 2) as pipe:
        a = pipe.submit([1, 2], max_new_tokens=2)
        b = pipe.submit([1, 2], max_new_tokens=2)
        assert a != b and len({a, b}) == 2
        pipe.run()
    assert a.tokens == b.tokens == greedy_tokens([1, 2], 2, VOCAB)


def _reachable(start, skip):
    """Every object reachable from ``start`` through ``gc.get_referents``, not entering types,
    modules, functions or code (their globals reach everything)."""
    import gc
    import types

    seen, todo, found = {id(start)}, [start], []
    opaque = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.CodeType)
    while todo:
        obj = todo.pop()
        found.append(obj)
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, opaque) and ref is not skip:
                seen.add(id(ref))
                todo.append(ref)
    return found


def test_a_request_holds_no_reference_to_its_pipeline(host, no_leaks):
    """A request reaches the pipeline's shared counters (``RequestOwner``), never the pipeline:
    not before it runs, while it runs (its KV view) nor after; and a ban set on it still
    reaches the next launch and is refused with the pipeline's messages."""
    with model_for(rows=2) as model, DecodePipeline(model, 2, depth=2) as pipe:
        req = pipe.submit([1, 2, 3], max_new_tokens=6)
        assert not any(obj is pipe for obj in _reachable(req, model))
        pipe.step()
        assert req._seq is not None
        assert not any(obj is pipe for obj in _reachable(req, model))
        with pytest.raises(ValueError, match=f"outside the vocabulary of {VOCAB} ids"):
            req.ban = (VOCAB, NO_TOKEN)
        with pytest.raises(TypeError):
            req.ban = 5
        banned = greedy_tokens([1, 2, 3], 6, VOCAB)[3]  # what it answers without the ban
        req.ban = (banned, NO_TOKEN)  # applies from the next launched step (token 2) on
        pipe.run()
        assert not any(obj is pipe for obj in _reachable(req, model))
    assert req.finish_reason == "length" and len(req.tokens) == 6
    assert banned not in req.tokens[2:]


def test_request_py_names_no_pipeline_member():
    tree = ast.parse((SCHED / "request.py").read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    attrs = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert "DecodePipeline" not in names and "_pipe" not in attrs


def _host_members():
    from metrale_feed.sched.host import StepHost

    declared = set(StepHost.__annotations__)
    declared |= {name for name, value in vars(StepHost).items() if callable(value)
                 and not name.startswith("__")}
    return declared


# The modules that run beside the pipeline and take its host, and the names they hold it by.
STEP_KINDS = ("speculative.py", "debug.py", "grammar.py", "penalized.py", "stats.py")
HOST_NAMES = {"pipe", "host", "self.host", "self.step_host"}


def test_the_step_kinds_use_only_what_step_host_declares():
    """``SpeculativeStep``, the debug mode, the grammar's words and the penalties read of the
    pipeline's host only the members ``StepHost`` declares, and it declares no private name."""
    declared = _host_members()
    assert {"admit", "fault", "owner", "running", "budget", "stats"} <= declared
    assert [name for name in declared if name.startswith("_")] == []
    used = []
    for name in STEP_KINDS:
        for node in ast.walk(ast.parse((SCHED / name).read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in HOST_NAMES:
                used.append((name, node.lineno, node.attr))
    assert {"speculative.py", "debug.py", "grammar.py", "penalized.py"} <= {u[0] for u in used}
    assert [u for u in used if u[2] not in declared] == []


# A request's scheduler fields (request.py: the state the scheduler's modules keep on each
# request) and the automaton's walk, read under these names; any other ``x._name`` is refused.
SHARED_PRIVATE = {
    "req": {"_seq", "_base", "_grammar", "_gstate", "_top_n", "_pen", "_pslot", "_mask", "_ban"},
    "automaton": {"_step", "_flags"},
    "joined": {"_keep"},
}
SHARED_PRIVATE["r"] = SHARED_PRIVATE["self.req"] = SHARED_PRIVATE["req"]


def _foreign_private(name, text):
    """``x._name`` in ``text`` where ``x`` is not ``self`` or ``cls``: (refused, allowed)."""
    refused, allowed = [], []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = ast.unparse(node.value)
            if base in ("self", "cls"):
                continue
            where = f"{name}:{node.lineno}: {ast.unparse(node)}"
            (allowed if node.attr in SHARED_PRIVATE.get(base, ()) else refused).append(where)
    return refused, allowed


def test_the_step_kinds_read_no_private_member_of_another_object():
    """Nothing private of the pipeline (nor of its router, stats or host) is read by the step
    kinds: their own fields, and a request's scheduler fields, only."""
    refused, allowed = [], []
    for name in STEP_KINDS:
        more, shared = _foreign_private(name, (SCHED / name).read_text())
        refused += more
        allowed += shared
    assert refused == []
    assert len(allowed) > 20  # the reader finds the reads it judges


def test_the_private_reader_refuses_a_planted_read():
    text = (SCHED / "speculative.py").read_text()
    planted = text.replace("running = list(host.running)", "running = list(host._running)")
    assert planted != text
    assert _foreign_private("speculative.py", planted)[0] == [
        f"speculative.py:{planted[:planted.index('host._running')].count(chr(10)) + 1}: "
        f"host._running"]


def test_the_step_kinds_hold_no_reference_to_the_pipeline(host, no_leaks):
    """The speculative step, the grammar's words, the penalties, the debug buffers and the
    stats reach the pipeline's host, never the pipeline (its operations are held weakly), so a
    pipeline dropped without ``close()`` is in no cycle: it is closed when it goes."""
    from metrale_feed import TokenAutomaton
    from metrale_feed.sched.host import PipelineHost

    anything = TokenAutomaton({0: {t: 0 for t in range(VOCAB)}}, initial=0, vocab=VOCAB)
    with model_for(rows=2) as model, DecodePipeline(
            model, 2, depth=1, debug=True, speculative=NGramDrafter(2)) as pipe:
        free = pipe.submit([1, 2, 3], max_new_tokens=6, grammar=anything)
        pipe.submit([4, 5], max_new_tokens=6, presence_penalty=0.5)
        pipe.step()
        parts = [pipe._spec, pipe._gram, pipe._pen, pipe._debug, pipe.stats]
        assert all(part is not None for part in parts)
        assert isinstance(pipe._spec.host, PipelineHost) and pipe._spec.host is pipe._host
        assert [name for name in _host_members() if not hasattr(pipe._host, name)] == []
        for part in parts:
            assert not any(obj is pipe for obj in _reachable(part, model)), part
        # what the host was built from does reach it: the reader sees a bound method's self
        assert any(obj is pipe for obj in _reachable(pipe._admit, model))
        pipe.run()
    assert free.tokens == greedy_tokens([1, 2, 3], 6, VOCAB)


def test_a_dropped_pipeline_is_closed_when_it_goes(host, no_leaks):
    """No cycle runs through the pipeline: dropped without ``close()`` (garbage collection
    off), it is closed, with its warning, at once; its host, kept, then refuses to call it."""
    import gc
    import weakref

    with model_for(rows=2) as model:
        pipe = DecodePipeline(model, 2, speculative=NGramDrafter(2))
        req = pipe.submit([1, 2, 3], max_new_tokens=6)
        pipe.step()
        gone, kept = weakref.ref(pipe), pipe._host
        gc.disable()
        try:
            with pytest.warns(ResourceWarning, match="DecodePipeline was not closed"):
                del pipe
            assert gone() is None
        finally:
            gc.enable()
        assert req.finish_reason == "abort"
        with pytest.raises(ReferenceError, match="was collected"):
            kept.admit(0)
