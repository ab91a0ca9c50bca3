"""The wheel, end to end: build it from this checkout (host backend only), check what it ships and
what it links, install it into a fresh virtual environment and run the runtime tests there with no
compiler reachable. Slow (a full build): runs only with METRALE_FEED_WHEEL_TEST=1."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("METRALE_FEED_WHEEL_TEST") != "1",
                       reason="builds and installs a wheel; set METRALE_FEED_WHEEL_TEST=1"),
]

SHIPPED = [
    "metrale_feed/__init__.py",
    "metrale_feed/_core.pxd",
    "metrale_feed/_cfeed.pxd",
    "metrale_feed/_core.pyi",
    "metrale_feed/py.typed",
    "metrale_feed/include/metrale_feed/feed.h",
    "metrale_feed/include/metrale_feed/capi.h",
    "metrale_feed/include/metrale_feed/argmax_rule.h",
]
CUDA_LIBRARY = re.compile(r"\blibcuda(rt)?\.so")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("METRALE_FEED_", "PYTHON")) and k != "VIRTUAL_ENV"}
    env.update(extra)
    return env


def _run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, (f"{' '.join(map(str, command))} failed ({result.returncode}):\n"
                                    f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    for module in ("scikit_build_core", "Cython"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is needed to build the wheel without isolation")
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    out = tmp_path_factory.mktemp("wheel")
    # A private build folder, so neither the checkout's build/ nor a developer's build is reused.
    _run([sys.executable, "-m", "pip", "wheel", ".", "-w", str(out / "dist"), "--no-deps",
          "--no-build-isolation", f"-Cbuild-dir={out / 'build'}"],
         cwd=REPO, env=_clean_env(METRALE_FEED_CUDA="OFF"), timeout=1800)
    wheels = sorted((out / "dist").glob("metrale_feed-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [name for name in SHIPPED if name not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    extensions = [n for n in names if re.fullmatch(r"metrale_feed/_core\..*(\.so|\.pyd)", n)]
    assert len(extensions) == 1, f"expected one _core extension, found {extensions}"
    entry_points = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert entry_points and "metrale-feed" in zipfile.ZipFile(wheel).read(entry_points[0]).decode()


def test_no_cuda_runtime_dependency(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        so = next(n for n in archive.namelist() if re.fullmatch(r"metrale_feed/_core\..*\.so", n))
        extension = Path(archive.extract(so, tmp_path))
    readelf = shutil.which("readelf")
    if readelf is not None:
        dynamic = _run([readelf, "-d", str(extension)]).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
        assert not [lib for lib in needed if CUDA_LIBRARY.search(lib)], needed
    if importlib.util.find_spec("auditwheel") is None:
        if readelf is None:
            pytest.skip("neither auditwheel nor readelf is available")
        return
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                           capture_output=True, text=True)
    report = shown.stdout + shown.stderr
    assert shown.returncode == 0, report
    assert not CUDA_LIBRARY.search(report), report


def test_fresh_venv_without_compilers(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / ("python.exe" if os.name == "nt" else "python")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
         env=_clean_env(), timeout=300)
    deps = subprocess.run([str(python), "-m", "pip", "install", "-q", "pytest", "numpy",
                           "hypothesis", "ml_dtypes"], capture_output=True, text=True,
                          env=_clean_env(), timeout=900)
    if deps.returncode != 0:
        pytest.skip(f"cannot install the test dependencies into the fresh venv:\n{deps.stderr[-2000:]}")

    # Only the venv on PATH and the compilers disabled: nothing below may build anything.
    env = _clean_env(PATH=str(bindir), CC="false", CXX="false")
    work = tmp_path / "work"
    work.mkdir()
    where = _run([str(python), "-c", "import metrale_feed; print(metrale_feed.__file__)"],
                 cwd=work, env=env).stdout.strip()
    assert Path(where).resolve().is_relative_to(venv.resolve()), where

    info = _run([str(bindir / "metrale-feed"), "info"], cwd=work, env=env, timeout=120).stdout
    assert "metrale_feed" in info and "host only" in info and "backend: host" in info, info

    # The runtime suite, copied out of the checkout so that nothing of the source tree is seen.
    for name in ("conftest.py", "test_runtime.py"):
        shutil.copy(REPO / "tests" / name, work / name)
    shutil.copytree(REPO / "tests" / "helpers", work / "helpers")  # the one child-process runner
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "test_runtime.py"], cwd=work, env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert re.search(r"\d+ passed", result.stdout), result.stdout[-2000:]
