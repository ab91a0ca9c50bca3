"""``cimport metrale_feed._core`` from other Cython code: the shipped .pxd files and headers are
enough to build an extension at test time that calls the C-level API in a ``nogil`` loop and
shares the package's handles (no linking of the C layer)."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
import timeit

import pytest

import metrale_feed as mf

from helpers.modules import load_file

N_CALLS = 200_000

PYX = textwrap.dedent(
    """
    # cython: language_level=3
    from libc.stdint cimport uint64_t
    from metrale_feed._cfeed cimport mf_status, MF_SUCCESS
    from metrale_feed._core cimport Event, event_query_c, error_message


    def query_many(uint64_t handle, Py_ssize_t n):
        # (done count, last status): every call is one C-level query, with the GIL released.
        cdef Py_ssize_t i
        cdef Py_ssize_t done_count = 0
        cdef int done = 0
        cdef mf_status status = MF_SUCCESS
        with nogil:
            for i in range(n):
                done = 0
                status = event_query_c(handle, &done)
                if status != MF_SUCCESS:
                    break
                if done:
                    done_count += 1
        return done_count, <int>status


    def handle_of(Event event):
        # The cdef class from the .pxd: its fields are read directly, so the layout must match.
        return event._handle


    def query_once(uint64_t handle):
        cdef int done = 0
        cdef mf_status status
        with nogil:
            status = event_query_c(handle, &done)
        message = error_message().decode("utf-8", "replace") if status != MF_SUCCESS else ""
        return <int>status, done, message
    """
)


@functools.lru_cache(maxsize=None)
def _compiler():
    """A C compiler command that can build an object file here, or None. CC is honoured, but a
    candidate is kept only if it really compiles (CC=false and broken toolchains fall through)."""
    candidates = [os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"]
    probe_dir = tempfile.mkdtemp(prefix="mf-cc-probe-")
    source = os.path.join(probe_dir, "probe.c")
    with open(source, "w") as f:
        f.write("int probe(void) { return 0; }\n")
    try:
        for candidate in candidates:
            if not candidate:
                continue
            command = shlex.split(candidate)
            if shutil.which(command[0]) is None:
                continue
            result = subprocess.run(command + ["-c", source, "-o", source + ".o"],
                                    capture_output=True, cwd=probe_dir)
            if result.returncode == 0:
                return tuple(command)
        return None
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)


def build_extension(tmp_path, name, c_source):
    """Compile ``c_source`` (a file in tmp_path) into an importable extension module ``name``
    with the Python headers and metrale_feed's C include folder; import it and return it."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no working C compiler")
    py_include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(py_include, "Python.h")):
        pytest.skip(f"no Python.h in {py_include} (Python development headers missing)")
    target = tmp_path / (name + sysconfig.get_config_var("EXT_SUFFIX"))
    flags = ["-shared", "-fPIC", "-O2", "-I", py_include, "-I", mf.get_c_include()]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]  # symbols come from the interpreter at load
    result = subprocess.run(list(cc) + flags + [str(c_source), "-o", str(target)], capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 0, f"compiling {name} failed:\n{result.stdout}\n{result.stderr}"
    return load_file(name, target)


def test_shipped_pxd_and_headers():
    # What `cimport metrale_feed._core` and `#include <metrale_feed/capi.h>` need, installed.
    package = os.path.join(mf.get_include(), "metrale_feed")
    assert os.path.samefile(package, os.path.dirname(mf.__file__))
    for name in ("_core.pxd", "_cfeed.pxd"):
        assert os.path.isfile(os.path.join(package, name)), f"{name} is not installed"
    for name in ("feed.h", "capi.h", "argmax_rule.h"):
        assert os.path.isfile(os.path.join(mf.get_c_include(), "metrale_feed", name)), \
            f"include/metrale_feed/{name} is not installed"
    assert {"event_query_c", "event_record_c", "event_synchronize_c", "copy_d2h_async_c",
            "copy_h2d_async_c", "argmax_to_feed_c", "resolve_feed_c",
            "error_message"} <= set(mf._core.__pyx_capi__)


@pytest.fixture(scope="module")
def cimporter(tmp_path_factory):
    pytest.importorskip("Cython", reason="Cython is needed to build a cimport user")
    tmp_path = tmp_path_factory.mktemp("cimport")
    pyx = tmp_path / "mf_cimport_user.pyx"
    pyx.write_text(PYX)
    c_file = tmp_path / "mf_cimport_user.c"
    if _compiler() is None:
        pytest.skip("no working C compiler")
    # Only the shipped include folder: the .pxd files must come from the installed package.
    result = subprocess.run([sys.executable, "-m", "cython", "-3", "-I", mf.get_include(),
                             str(pyx), "-o", str(c_file)], capture_output=True, text=True)
    assert result.returncode == 0, f"cython failed:\n{result.stdout}\n{result.stderr}"
    return build_extension(tmp_path, "mf_cimport_user", c_file)


def test_nogil_query_loop_on_completed_event(host, no_leaks, cimporter):
    with mf.Event() as event:
        event.record(0)
        event.synchronize()
        handle = event.handle

        start = time.perf_counter_ns()
        done_count, status = cimporter.query_many(handle, N_CALLS)
        c_ns = (time.perf_counter_ns() - start) / N_CALLS
        assert status == 0
        assert done_count == N_CALLS

        # Best of a few repeats for both paths, so a stall on a loaded machine does not decide.
        c_best = min(timeit.repeat(lambda: cimporter.query_many(handle, N_CALLS), number=1,
                                   repeat=5)) / N_CALLS * 1e9
        py_best = min(timeit.repeat(event.query, number=N_CALLS // 4, repeat=5)) / (N_CALLS // 4) * 1e9
        print(f"\ncimport event_query_c: {min(c_ns, c_best):.1f} ns/call (nogil loop); "
              f"Event.query(): {py_best:.1f} ns/call")
        # The Python path is the same C call plus method dispatch: it cannot be cheaper.
        assert min(c_ns, c_best) < py_best


def test_cdef_class_layout_shared(host, no_leaks, cimporter):
    with mf.Event() as event:
        assert cimporter.handle_of(event) == event.handle
    with pytest.raises(TypeError):
        cimporter.handle_of(object())


def test_pending_event_reports_not_done(host, no_leaks, cimporter):
    host.configure_host(lag_us=50_000)
    with mf.Stream() as stream, mf.Event() as event:
        event.record(stream)
        status, done, _ = cimporter.query_once(event.handle)
        assert (status, done) == (0, 0)
        event.synchronize()
        assert cimporter.query_once(event.handle)[:2] == (0, 1)


def test_unknown_handle_fails(host, no_leaks, cimporter):
    event = mf.Event()
    handle = event.handle
    event.close()
    for bad in (handle, 0):
        status, done, message = cimporter.query_once(bad)
        assert status != 0, f"handle {bad:#x} was accepted"
        assert message
    done_count, status = cimporter.query_many(handle, 10)
    assert done_count == 0 and status != 0
