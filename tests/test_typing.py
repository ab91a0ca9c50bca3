"""Typing: the installed package ships py.typed and _core.pyi, a user's code type-checks under
``mypy --strict`` (examples/typed_usage.py), and the stub agrees with the built extension."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import metrale_feed as mf

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "typed_usage.py"

# What stubtest may find on one side only: Cython's pickling helpers and C-API table, and the
# PEP 688 buffer dunders, which exist at runtime from Python 3.12 but are declared for every
# version so that type checkers see PinnedBuffer as a Buffer.
STUBTEST_ALLOWLIST = r"""
metrale_feed\._core\.(.*\.)?__reduce_cython__
metrale_feed\._core\.(.*\.)?__setstate_cython__
metrale_feed\._core\.__pyx_capi__
metrale_feed\._core\.__test__
metrale_feed\._core\.PinnedBuffer\.__buffer__
metrale_feed\._core\.PinnedBuffer\.__release_buffer__
"""


def _need_mypy():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")


def _env():
    # The backend choice must not depend on the caller's environment.
    return {k: v for k, v in os.environ.items() if not k.startswith("METRALE_FEED_")}


def test_marker_and_stub_installed():
    package = Path(mf.__file__).parent
    assert (package / "py.typed").is_file()
    assert (package / "_core.pyi").is_file()


def test_example_passes_mypy_strict(tmp_path):
    _need_mypy()
    if not EXAMPLE.is_file():
        pytest.skip(f"{EXAMPLE} is not part of this checkout")
    # The interpreter of the installed package, so mypy reads its py.typed and _core.pyi.
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"),
         str(EXAMPLE.relative_to(REPO))],
        cwd=REPO, capture_output=True, text=True, env=_env(), timeout=600)
    assert result.returncode == 0, f"mypy --strict failed:\n{result.stdout}\n{result.stderr}"


def test_stub_matches_extension(tmp_path):
    _need_mypy()
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text(STUBTEST_ALLOWLIST)
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "metrale_feed._core", "--allowlist", str(allowlist),
         "--ignore-unused-allowlist", "--mypy-config-file", os.devnull],
        cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=600)
    assert result.returncode == 0, f"_core.pyi disagrees with the extension:\n{result.stdout}\n{result.stderr}"


def test_stub_names_every_public_export():
    # Independent of mypy: each public name of _core (and its classes) appears in the stub.
    stub = (Path(mf.__file__).parent / "_core.pyi").read_text()
    for name in dir(mf._core):
        if name.startswith("__") or (name.startswith("_") and name != "_C_API"):
            continue
        if name in ("CudaError", "FeedError"):
            assert f"{name} as {name}" in stub
            continue
        assert f"def {name}(" in stub or f"class {name}" in stub or f"{name}:" in stub, \
            f"_core.{name} is missing from _core.pyi"


def test_example_runs(tmp_path):
    if not EXAMPLE.is_file():
        pytest.skip(f"{EXAMPLE} is not part of this checkout")
    result = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True,
                            text=True, env=_env(), timeout=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "generated" in result.stdout
