"""The package's modules import one another in one direction (docs/design.md, "How data flows"):
no circle among the modules of ``src/metrale_feed``, and no arrow from a lower layer up (the
extension imports nothing of ``tp``, ``sched``, ``tools`` or ``testing``; ``tp`` nothing of
``sched``; neither ``tp`` nor ``sched`` anything of ``tools``). Read from the sources (``ast``),
every import counted: at module level, inside a function (a lazy import is an arrow all the
same) or under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "src" / "metrale_feed"
ROOT = "metrale_feed"


def _module_of(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    return {_module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name, path, known):
    """The package's modules that ``name`` (at ``path``) imports: ``from X import y`` counts
    ``X.y`` when that is a module, else ``X``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` names a.b.c's module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _circles(graph):
    """Each strongly connected set of more than one module (Tarjan's, iterative)."""
    index, low, on, stack, found = {}, {}, set(), [], []
    counter = [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


# Modules that only re-export other layers' names under a documented path, in no layer: the
# package itself, and ``metrale_feed.reference`` (the reference model's import path, which lives
# in ``testing``).
FACADES = {"metrale_feed", "metrale_feed.reference"}


def _layer(name):
    """Which layer a module is in (None for a facade)."""
    if name in FACADES:
        return None
    parts = name.split(".")
    return parts[1] if parts[1] in ("tp", "sched", "tools", "testing") else "base"


# What each layer may not import (``base`` is the extension's Python neighbours: errors, feed,
# params, runtime, ...; the extension itself is checked from its Cython sources below).
FORBIDDEN = {"base": {"tp", "sched", "tools", "testing"}, "tp": {"sched", "tools", "testing"},
             "sched": {"tools", "testing"}}


def test_the_graph_is_read():
    # The reader finds arrows it must find: it can fail.
    graph = _graph()
    assert "metrale_feed.sched.request" in graph["metrale_feed.sched.pipeline"]
    assert "metrale_feed._checks" in graph["metrale_feed.sched.request"]
    assert "metrale_feed.sched.speculative" in graph["metrale_feed.sched.pipeline"]  # lazy
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    assert _layer("metrale_feed.tp.shard") == "tp" and _layer("metrale_feed.feed") == "base"


def test_no_circle_among_the_modules():
    assert _circles(_graph()) == []


def test_no_arrow_from_a_lower_layer_up():
    up = []
    for name, targets in _graph().items():
        banned = FORBIDDEN.get(_layer(name), set())
        up += [f"{name} -> {t}" for t in sorted(targets) if _layer(t) in banned]
    assert up == []


_CYTHON_UP = re.compile(r"^\s*(?:from|import|cimport)\s+(?:metrale_feed)?\.*(tp|sched|tools|testing)\b"
                        r"|import_module\(\s*['\"]metrale_feed\.(tp|sched|tools|testing)")


def test_the_extension_imports_nothing_above_it():
    sources = sorted(PACKAGE.glob("*.pyx")) + sorted(PACKAGE.glob("*.pxi")) \
        + sorted(PACKAGE.glob("*.pxd"))
    assert any(p.name == "_core.pyx" for p in sources)
    up = []
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith((">>>", "...", "#")):
                continue  # a doctest or a comment
            if _CYTHON_UP.search(line):
                up.append(f"{path.name}:{number}: {line.strip()}")
    assert up == []


def _imported_under(parent, stderr):
    """The modules ``-X importtime`` shows imported while ``parent`` was (its nested lines)."""
    lines = [m for m in re.finditer(r"import time:\s*\d+\s*\|\s*\d+\s*\|( *)(\S+)", stderr)]
    for at, m in enumerate(lines):
        if m.group(2) == parent:
            depth, out = len(m.group(1)), []
            for prev in reversed(lines[:at]):  # children are printed before their parent
                if len(prev.group(1)) <= depth:
                    break
                out.append(prev.group(2))
            return out
    raise AssertionError(f"{parent} is not in the -X importtime output:\n{stderr}")


def test_the_extensions_init_imports_only_what_it_needs():
    """The hot import stays light (``metrale-feed bench``'s import row times it): the
    extension's init loads no ``collections.abc`` (Cython's typed memoryviews would), no
    ``collections``, ``weakref``, ``typing`` or numpy."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import metrale_feed"],
                          capture_output=True, text=True, timeout=120, check=True)
    under = _imported_under("metrale_feed._core", done.stderr)
    assert "metrale_feed.errors" in under  # the reader finds its children
    heavy = {"collections", "collections.abc", "weakref", "typing", "numpy"}
    assert sorted(heavy.intersection(under)) == []
    assert _imported_under("b", "import time: 5 | 5 |   a\nimport time: 9 | 14 | b\n") == ["a"]


def _private_core_reads(path):
    """``_core._name`` reads in a module's code (docstrings and comments are not read)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                and node.value.id == "_core"):
            out.append(f"{path.name}:{node.lineno}: _core.{node.attr}")
    return out


def test_tp_reaches_the_extensions_private_api_only_through_ops():
    """``tp/ops.py`` lists the extension's entry points for a split vocabulary, each documented
    there: the one module of ``tp`` that names a private member of ``_core``."""
    tp = PACKAGE / "tp"
    assert len(_private_core_reads(tp / "ops.py")) >= 10  # the reader finds them
    elsewhere = [read for path in sorted(tp.glob("*.py")) if path.name != "ops.py"
                 for read in _private_core_reads(path)]
    assert elsewhere == []
