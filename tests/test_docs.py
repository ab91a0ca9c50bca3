"""The documentation stands alone: nothing cites a design file outside the repository, every link
between the README, docs/ and the sources resolves (anchors included), docs/README.md indexes every
page, and the Python blocks of docs/ run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
# Pages the index links that land with the decode pipeline, the host backend and interop work.
PENDING = {"pipeline.md", "host-backend.md", "interop.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="not a source checkout: no docs/")


def pages():
    return sorted(DOCS.glob("*.md")) + [REPO / "README.md"]


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs git to list the project's files")
    return [REPO / name for name in filter(None, out.split("\0")) if (REPO / name).is_file()]


def test_nothing_cites_a_design_file_outside_the_repository():
    outside = "DESIGN" + ".md"  # spelled apart so this file does not cite it
    citing = []
    for path in tracked_files():
        try:
            if outside in path.read_text(errors="ignore"):
                citing.append(str(path.relative_to(REPO)))
        except OSError:
            continue
    assert not citing, citing


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        name, _, fragment = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        if not path.exists() and path.name in PENDING and path.parent == DOCS:
            continue  # checked by test_pending_pages_once_merged
        assert path.exists(), f"{page.name}: {target} does not exist"
        if fragment:
            assert fragment in anchors(path), f"{page.name}: no heading #{fragment} in {name}"


@pytest.mark.parametrize("name", sorted(PENDING))
def test_pending_pages_once_merged(name):
    if not (DOCS / name).exists():
        pytest.skip(f"docs/{name} is not in this checkout yet")
    assert f"]({name})" in (DOCS / "README.md").read_text()


def test_the_index_links_every_page():
    index = (DOCS / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not link {page.name}"


def sources():
    return sorted((REPO / "src" / "metrale_feed").rglob("*.p*"))


def test_docs_the_sources_cite_exist():
    cited = set()
    for path in sources():
        cited |= set(re.findall(r"docs/([\w.-]+\.md)", path.read_text()))
    assert cited, "the docstrings point to docs/"
    missing = [name for name in cited if not (DOCS / name).exists() and name not in PENDING]
    assert not missing, missing


def titles(path):
    """A page's heading anchors and its paragraphs' bold leads (``**Lead.** ...``), slugged."""
    leads = re.findall(r"^\*\*([^*]+?)\.?\*\*", path.read_text(), re.M)
    return anchors(path) | {slug(lead) for lead in leads}


def test_the_sections_the_sources_cite_exist():
    """``docs/page.md, "Heading"`` in a source names a heading of that page (or the start of
    one: "Verify" for "Verify: speculative decoding's check"), or a paragraph's bold lead."""
    cited = set()
    for path in sources():
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text())  # a citation split over lines
        cited |= {(page, heading, path.name) for page, heading in
                  re.findall(r"docs/([\w.-]+\.md), \"([^\"]+)\"", text)}
    assert cited, "the docstrings cite sections of docs/"
    missing = [f"{src}: docs/{page}, {heading!r}" for page, heading, src in sorted(cited)
               if (DOCS / page).exists() and not any(
                   a.startswith(slug(heading)) for a in titles(DOCS / page))]
    assert not missing, missing


def python_blocks():
    return [(page.name, i, body) for page in sorted(DOCS.glob("*.md"))
            for i, (lang, body) in enumerate(FENCE.findall(page.read_text())) if lang == "python"]


@pytest.mark.parametrize("name, index, code", python_blocks(),
                         ids=[f"{n}-{i}" for n, i, _ in python_blocks()])
def test_docs_python_block_runs(name, index, code, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_FEED_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, f"docs/{name} block {index}:\n{done.stderr[-3000:]}"


# ---- docstrings: numpydoc sections on the public API, and their examples run ----

def public_api():
    import inspect
    import types

    import metrale_feed
    from metrale_feed import reference

    found = {name: getattr(metrale_feed, name) for name in dir(metrale_feed)
             if not name.startswith("_") and name != "NO_TOKEN"}
    found.update(ReferenceModel=reference.ReferenceModel, host_next_token=reference.host_next_token,
                 host_logits=reference.host_logits)
    return {name: obj for name, obj in sorted(found.items())
            if not isinstance(obj, types.ModuleType) and (inspect.isclass(obj) or callable(obj))}


def takes_arguments(obj):
    import inspect

    try:
        target = obj.__init__ if inspect.isclass(obj) else obj
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a Cython class without a signature: its text says
        return "(" in (obj.__doc__ or "") or True
    names = [p for p in signature.parameters.values() if p.name not in ("self", "cls")
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return bool(names)


@pytest.mark.parametrize("name", sorted(public_api()))
def test_public_docstring_has_numpydoc_sections(name):
    import inspect

    import metrale_feed

    obj = public_api()[name]
    doc = obj.__doc__ or ""
    assert doc.strip(), f"{name} has no docstring"
    assert "DESIGN" not in doc
    is_error = inspect.isclass(obj) and issubclass(obj, BaseException)
    assert "Examples\n" in doc, f"{name}: no Examples section"
    if not is_error and takes_arguments(obj) and obj is not metrale_feed.ModelDeviceFeed:
        assert "Parameters\n" in doc, f"{name}: no Parameters section"


def test_the_docstring_examples_run(tmp_path):
    # In a child on the host backend: some examples switch backends or set host knobs.
    code = """
import doctest, inspect, sys
import metrale_feed, metrale_feed._core as core
from metrale_feed import errors, feed, kv, params, runtime, trait
from metrale_feed.grammar import automaton
from metrale_feed.sched import router, speculative
from metrale_feed.testing import drafter, oracle, reference
failed = attempted = 0
finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
for module in (metrale_feed, errors, feed, kv, oracle, params, reference, router, runtime, trait,
               speculative, drafter, automaton):
    for test in finder.find(module):
        result = runner.run(test)
        failed, attempted = failed + result.failed, attempted + result.attempted
parser = doctest.DocTestParser()
for name, obj in vars(core).items():  # the extension's objects: their docstrings directly
    if name.startswith("_"):
        continue
    members = [obj] + [m for k, m in vars(obj).items() if not k.startswith("_")] if inspect.isclass(obj) else [obj]
    for member in members:
        doc = member.__doc__ if isinstance(getattr(member, "__doc__", None), str) else ""
        test = parser.get_doctest(doc, {}, name, None, 0)
        if test.examples:
            result = runner.run(test)
            failed, attempted = failed + result.failed, attempted + result.attempted
print("attempted", attempted, "failed", failed)
sys.exit(1 if failed or attempted < 60 else 0)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_FEED_")}
    env["METRALE_FEED_BACKEND"] = "host"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


def test_the_license_files_are_in_the_checkout_and_the_installed_metadata():
    from importlib.metadata import distribution

    for name in ("LICENSE-MIT", "LICENSE-APACHE"):
        assert (REPO / name).is_file(), name
    dist = distribution("metrale-feed")
    assert dist.metadata["License"] == "MIT OR Apache-2.0"
    shipped = {Path(str(f)).name for f in dist.files or []}
    assert {"LICENSE-MIT", "LICENSE-APACHE"} <= shipped, sorted(shipped)[:20]
    assert "Permission is hereby granted" in (REPO / "LICENSE-MIT").read_text()
    assert "Apache License" in (REPO / "LICENSE-APACHE").read_text()
