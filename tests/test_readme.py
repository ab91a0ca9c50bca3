"""Every code block of the README runs as written: the Python blocks in a fresh interpreter, the
demo's sample output against a real run, and the two shell commands from a fresh copy of the
checkout (slow: a full build each; only with METRALE_FEED_WHEEL_TEST=1, as CI's host pass sets)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(kind):
    if not README.is_file():
        pytest.skip("not a source checkout: no README.md beside the tests")
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == kind]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_FEED_")}
    env.update(extra)
    return env


def test_every_block_says_what_it_is():
    kinds = [lang for lang, _ in FENCE.findall(README.read_text())]
    assert kinds and set(kinds) <= {"python", "sh", "text"}, kinds  # an untagged block is untested


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index, tmp_path):
    code = blocks("python")[index]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=_env())
    assert done.returncode == 0, f"README python block {index}:\n{code}\n{done.stderr[-3000:]}"


def test_the_sample_output_is_what_the_demo_prints():
    script = Path(sys.executable).parent / "metrale-feed"
    done = subprocess.run([str(script), "demo", "--quiet", "--rows", "8", "--tokens", "8",
                           "--vocab", "2000"], capture_output=True, text=True, timeout=120,
                          env=_env(METRALE_FEED_BACKEND="host"))
    assert done.returncode == 0, done.stdout + done.stderr
    digits = re.compile(r"\d+(\.\d+)?")
    printed = {digits.sub("N", line).split()[0] + " " + " ".join(digits.sub("N", line).split()[1:4])
               for line in done.stdout.splitlines() if line.strip()}
    for sample in blocks("text"):
        for line in sample.splitlines():
            shape = digits.sub("N", line).split()
            assert shape[0] + " " + " ".join(shape[1:4]) in printed, (line, done.stdout)


# The part of the suite the copy's test command runs: the whole suite ran in this interpreter's own
# pass already, on the same sources; the copy proves the set-up from nothing (a fresh virtual
# environment, the install, pytest finding the suite and passing), not the tests a second time.
COPY_SUITE = "test_runtime or test_argmax or test_readme"  # a pytest -k expression


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("METRALE_FEED_WHEEL_TEST") != "1",
                    reason="builds the package from a fresh copy; set METRALE_FEED_WHEEL_TEST=1")
def test_both_shell_blocks_run_in_order_in_a_fresh_copy():
    demo, tests = (block.strip() for block in blocks("sh")[:2])
    assert "metrale-feed demo" in demo and "pytest" in tests, (demo, tests)
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to copy the tracked files from")
    files = subprocess.run([git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory(prefix="mf-readme-") as folder:
        clone = Path(folder) / "clone"
        for name in filter(None, files.split("\0")):
            source = REPO / name
            if source.is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, clone / name)
        # The copy's own suite must not build a third copy: the gate is cleared by _env().
        env = {k: v for k, v in _env().items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        # The build kind, where this pass was given one (CI's host-only pass: OFF), as a newcomer
        # would set it; unset, the commands build what the machine allows (nvcc: the CUDA backend).
        if "METRALE_FEED_CUDA" in os.environ:
            env["METRALE_FEED_CUDA"] = os.environ["METRALE_FEED_CUDA"]
        # A newcomer runs the demo's command, then the tests' in the same checkout; the second
        # install finds the first one's build folder (pyproject's build-dir), as it would for them.
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", demo], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=3000)
        assert done.returncode == 0, f"{demo}\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
        assert "checked:" in done.stdout and "FAILED" not in done.stdout, done.stdout
        env["PYTEST_ADDOPTS"] = f"-k '{COPY_SUITE}'"
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", tests], cwd=clone, env=env,
                              capture_output=True, text=True, timeout=3000)
        assert done.returncode == 0, f"{tests}\n{done.stdout[-4000:]}\n{done.stderr[-3000:]}"
        counted = re.search(r"(\d+) passed", done.stdout)
        assert counted and int(counted.group(1)) >= 50, done.stdout[-2000:]
