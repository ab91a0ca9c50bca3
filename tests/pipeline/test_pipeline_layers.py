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


def test_the_speculative_step_uses_only_what_step_host_declares():
    """``SpeculativeStep`` (and the debug mode and the grammar's words, which take the same
    host) read of the pipeline only the members ``StepHost`` declares."""
    declared = _host_members()
    assert {"_admit", "_fault", "_owner", "budget", "stats"} <= declared
    used = []
    for name in ("speculative.py", "debug.py", "grammar.py"):
        for node in ast.walk(ast.parse((SCHED / name).read_text())):
            if isinstance(node, ast.Attribute):
                base = node.value
                owner = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
                if owner == "pipe":
                    used.append((name, node.lineno, node.attr))
    assert used  # the reader finds them
    assert [u for u in used if u[2] not in declared] == []


def test_the_pipeline_implements_step_host(host, no_leaks):
    with model_for(rows=2) as model, \
            DecodePipeline(model, 2, speculative=NGramDrafter(2)) as pipe:
        missing = [name for name in _host_members() if not hasattr(pipe, name)]
        assert missing == []
        assert pipe._spec.pipe is pipe
