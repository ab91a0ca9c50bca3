"""Import time, the per-call cost of the Python API, and the C-level call through ``cimport``."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import timeit
from typing import Any, Dict

import metrale_feed as mf
from metrale_feed import _core

from .report import NO_TOKEN, cimport_reason, row, section

# ---- 1. import time ----

_IMPORT_LINE = re.compile(r"import time:\s*\d+\s*\|\s*(\d+)\s*\|\s*(\S+)")


def _import_run(module: str) -> Dict[str, Any]:
    """A fresh interpreter under ``-X importtime``: the module's cumulative µs, and every module
    that its import loaded."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, text=True, check=True)
    lines = [(m.group(2), int(m.group(1))) for m in _IMPORT_LINE.finditer(done.stderr)]
    return {"us": dict(lines).get(module), "modules": [name for name, _ in lines]}


def bench_import(runs: int) -> Dict[str, Any]:
    _import_run("metrale_feed")  # a warm-up: the first interpreter may still write .pyc files
    ours, numpy_us, pulled_numpy, editable = [], [], False, False
    for _ in range(runs):  # interleaved pairs
        run = _import_run("metrale_feed")
        ours.append(run["us"])
        pulled_numpy |= any(n.split(".")[0] == "numpy" for n in run["modules"])
        # An editable install's finder (loaded at start-up) adds its own imports to the
        # package's: the figure the target is for is an installed wheel's.
        editable |= any(n.startswith("_editable") for n in run["modules"])
        numpy_us.append(_import_run("numpy")["us"])
    r = {"metrale_feed_us": statistics.median(ours), "numpy_us": statistics.median(numpy_us),
         "imports_numpy": pulled_numpy, "editable": editable, "runs": runs, "target_us": 5_000}
    r["ratio"] = r["metrale_feed_us"] / r["numpy_us"]
    section(f"import time (median of {runs} fresh interpreters, -X importtime cumulative"
            + (", an editable install: its finder adds to it)" if editable else ")"))
    row("import metrale_feed", f"{r['metrale_feed_us'] / 1e3:.2f} ms",
         f"import numpy {r['numpy_us'] / 1e3:.2f} ms", f"{r['ratio']:.2f}x", "< 5 ms")
    row("it imports numpy", "yes" if pulled_numpy else "no", "", "", "no")
    return r


# ---- 2. per-call cost from Python ----

def _plain() -> None:
    pass


class _Obj:
    def m(self) -> None:
        pass


# (figure, statement, enqueues): an enqueueing call is timed in batches (see time_call).
CALLS = [
    ("loop overhead (pass)", "pass", False),
    ("f()", "f()", False),
    ("obj.m()", "obj.m()", False),
    ("Event.query()", "ev.query()", False),
    ("event_query(handle_int)", "event_query(handle)", False),
    ("event_query(Event)", "event_query(ev)", False),
    ("Event.record(0)", "rec.record(0)", True),
    ("copy_d2h_async 4 B", "copy_d2h_async(src4, dst4)", True),
    ("argmax_to_feed 1x16 launch", "argmax_to_feed(logits16, masks1, cells1, dst4, ev_arg, 0, "
     "rows=1, vocab=16, dtype='float32')", True),
]
BATCH = 2000
# The hot queries of a completed event: a method call's cost over a plain call, and the int
# handle's validated path in absolute time.
CALL_TARGETS = {"Event.query()": "<= 1.2x", "event_query(handle_int)": "<= 60 ns"}


def call_namespace() -> Dict[str, Any]:
    from array import array

    ev, handle = mf.Event(), mf.event_create()
    ev.record(0)
    mf.event_record(handle)
    mf.stream_synchronize(0)  # both events completed: the queries below answer True
    return {"f": _plain, "obj": _Obj(), "ev": ev, "handle": handle, "rec": mf.Event(),
            "ev_arg": mf.Event(), "park": mf.Event(), "event_query": mf.event_query,
            "copy_d2h_async": mf.copy_d2h_async, "argmax_to_feed": mf.argmax_to_feed,
            "src4": mf.DeviceBuffer(4), "dst4": mf.PinnedBuffer(4), "cells1": mf.DeviceBuffer(4),
            "logits16": mf.DeviceBuffer(16 * 4), "masks1": array("I", [3, NO_TOKEN])}


def _park_worker(ns: Dict[str, Any]) -> None:
    """Put the default stream's worker to sleep (off the CPU) for 5 ms, so a batch of enqueues
    is timed without the worker draining it on the other core at the same time, as beside a
    GPU: one op is queued under a lag, and the lag is lifted for every op after it."""
    knobs = mf.host_faults()
    mf.configure_host(**dict(knobs, lag_us=5000))
    ns["park"].record(0)
    time.sleep(0.0005)  # the worker takes the lagged op before the lag is lifted
    mf.configure_host(**knobs)


def time_call(stmt: str, enqueues: bool, ns: Dict[str, Any], number: int) -> float:
    """ns per call of one timeit run; an enqueueing call runs BATCH times with the worker parked,
    then the queue is drained outside the timed part (it grows with every enqueue)."""
    timer = timeit.Timer(stmt, globals=ns)
    if not enqueues:
        return timer.timeit(number) / number * 1e9
    _park_worker(ns)
    ns_per_call = timer.timeit(BATCH) / BATCH * 1e9
    mf.stream_synchronize(0)
    return ns_per_call


def bench_calls(quick: bool) -> Dict[str, Any]:
    ns = call_namespace()
    rounds, number = (25, 20_000) if quick else (60, 50_000)
    best: Dict[Any, float] = {}
    try:
        for r in range(rounds):
            for name, stmt, enqueues in CALLS:
                # NVTX on and off back to back, in alternating order, so drift hits both alike.
                for nvtx in ((True, False) if r % 2 == 0 else (False, True)):
                    _core.nvtx_enable(nvtx)
                    t = time_call(stmt, enqueues, ns, number)
                    best[name, nvtx] = min(best.get((name, nvtx), t), t)
    finally:
        _core.nvtx_enable(True)
        mf.stream_synchronize(0)
        mf.destroy_event(ns["handle"])
        for key in ("ev", "rec", "ev_arg", "park", "src4", "dst4", "cells1", "logits16"):
            ns[key].close()
    plain = best["f()", True]
    result: Dict[str, Any] = {"nvtx_built": mf.build_info()["nvtx"], "rounds": rounds,
                              "number": number, "batch": BATCH}
    section(f"per-call cost from Python, host backend (best of {rounds} timeit runs; "
             f"enqueues in batches of {BATCH})")
    for name, _, _ in CALLS:
        on, off = best[name, True], best[name, False]
        result[name] = {"ns": on, "ns_nvtx_off": off, "nvtx_ratio": on / off, "vs_f": on / plain}
        row(name, f"{on:.1f} ns", f"NVTX off {off:.1f} ns ({(on / off - 1) * 100:+.1f}%)",
             f"{on / plain:.2f}x f()", CALL_TARGETS.get(name, ""),
             "NVTX target: within 5%" if name == "Event.query()" else "")
    return result


# ---- 2b. the C-level call through cimport ----

_CIMPORT_PYX = """
# cython: language_level=3
from libc.stdint cimport uint64_t
from metrale_feed._core cimport event_query_c

def query_loop(uint64_t handle, Py_ssize_t n):
    # The GIL is dropped once; each iteration is one C-level query through the C-API table.
    cdef Py_ssize_t i, done_count = 0
    cdef int done = 0
    with nogil:
        for i in range(n):
            event_query_c(handle, &done)
            done_count += done
    return done_count
"""


def _build_cimport(folder: str) -> Any:
    """Cythonize and compile the loop extension in ``folder``; raises with the reason."""
    pyx = os.path.join(folder, "mf_bench_cimport.pyx")
    with open(pyx, "w") as f:
        f.write(_CIMPORT_PYX)
    c_file, target = pyx[:-4] + ".c", pyx[:-4] + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    link = os.environ.get("LDSHARED") or sysconfig.get_config_var("LDSHARED") or "cc -shared"
    includes = [sysconfig.get_paths()["include"], mf.get_include(), mf.get_c_include()]
    steps = {"cython": [sys.executable, "-m", "cython", "-3", "-I", mf.get_include(), pyx,
                        "-o", c_file],
             "compiler": shlex.split(link) + ["-fPIC", "-O2", c_file, "-o", target]
             + [f"-I{path}" for path in includes]}
    for tool, command in steps.items():
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=folder)
        except OSError as error:
            raise RuntimeError(f"{tool} ({command[0]}): {error}") from None
        if done.returncode:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["failed"]
            raise RuntimeError(f"{tool}: {last[0]}")
    spec = importlib.util.spec_from_file_location("mf_bench_cimport", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _query_loop_ns(module: Any, n: int, repeats: int) -> Dict[bool, float]:
    """Best ns per C-level query of a completed event, with NVTX on and off, interleaved."""
    ev = mf.Event()
    ev.record(0)
    ev.synchronize()
    best = {True: float("inf"), False: float("inf")}
    try:
        for _ in range(repeats):
            for nvtx in (True, False):
                _core.nvtx_enable(nvtx)
                start = time.perf_counter()
                if module.query_loop(ev.handle, n) != n:
                    raise RuntimeError("a query of a completed event answered not done")
                best[nvtx] = min(best[nvtx], (time.perf_counter() - start) / n * 1e9)
    finally:
        _core.nvtx_enable(True)
        ev.close()
    return best


def bench_cimport(quick: bool) -> Dict[str, Any]:
    result: Dict[str, Any] = {"ns": None, "ns_nvtx_off": None, "reason": None, "target_ns": 15}
    n, repeats = (2_000_000, 5) if quick else (10_000_000, 7)
    with tempfile.TemporaryDirectory(prefix="mf-bench-") as folder:
        try:
            best = _query_loop_ns(_build_cimport(folder), n, repeats)
        except Exception as error:  # no Cython, no compiler, no headers: the reason is the figure
            result["reason"] = str(error) or type(error).__name__
        else:
            result.update(ns=best[True], ns_nvtx_off=best[False], calls=n)
    section(f"C-level event_query_c through cimport (nogil loop of {n:,}, best of {repeats})")
    if result["ns"] is None:
        row("event_query_c", "null", "", "", "<= 15 ns", cimport_reason(result["reason"]))
    else:
        row("event_query_c", f"{result['ns']:.1f} ns", f"NVTX off {result['ns_nvtx_off']:.1f} ns",
             f"{result['ns'] / result['ns_nvtx_off']:.2f}x", "<= 15 ns")
    return result


