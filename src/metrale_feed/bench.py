"""``metrale-feed bench``: the performance record, measured side by side in one run.

Every figure is printed beside a baseline measured in the same run (a plain Python call, numpy,
the synchronous router), with the ratio and the target. The machines are noisy, so compared
pairs are interleaved and each figure is a best or a median over repeats. Needs numpy.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import timeit
from typing import Any, Callable, Dict, List, Optional

import metrale_feed as mf
from metrale_feed import _core

NO_TOKEN = mf.NO_TOKEN
LARGE = (256, 152064)


class Table:
    """Rows printed as they are measured: figure, value, baseline, ratio, target, note."""

    def section(self, title: str) -> None:
        print(f"\n== {title}")
        self.row("figure", "value", "baseline", "ratio", "target", "")

    def row(self, name: str, value: str, base: str = "", ratio: str = "", target: str = "",
            note: str = "") -> None:
        print(f"  {name:<30} {value:>11}  {base:<26} {ratio:>9}  {target:<18} {note}".rstrip())
        sys.stdout.flush()


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _x(r: Optional[float]) -> str:
    return "-" if r is None else f"{r:.2f}x"


# ---- 1. import time ----

_IMPORT_LINE = re.compile(r"import time:\s*\d+\s*\|\s*(\d+)\s*\|(\s*)(\S+)")


def _import_run(module: str) -> Dict[str, Any]:
    """One fresh interpreter under ``-X importtime``: the module's cumulative µs and every
    module that import pulled in."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, text=True, check=True)
    names, us = [], None
    for match in _IMPORT_LINE.finditer(done.stderr):
        names.append(match.group(3))
        if match.group(3) == module:
            us = int(match.group(1))
    return {"us": us, "modules": names}


def bench_import(runs: int, table: Table) -> Dict[str, Any]:
    _import_run("metrale_feed")  # a warm-up: the first interpreter may still compile .pyc files
    ours, numpy_us, pulled_numpy = [], [], False
    for _ in range(runs):  # interleaved pairs
        run = _import_run("metrale_feed")
        ours.append(run["us"])
        pulled_numpy |= any(n == "numpy" or n.startswith("numpy.") for n in run["modules"])
        numpy_us.append(_import_run("numpy")["us"])
    result = {"metrale_feed_us": statistics.median(ours), "numpy_us": statistics.median(numpy_us),
              "imports_numpy": pulled_numpy, "runs": runs, "target_us": 10_000}
    result["ratio"] = _ratio(result["metrale_feed_us"], result["numpy_us"])
    table.section(f"import time (median of {runs} fresh interpreters, -X importtime)")
    table.row("import metrale_feed", f"{result['metrale_feed_us'] / 1e3:.2f} ms",
              f"numpy {result['numpy_us'] / 1e3:.2f} ms", _x(result["ratio"]), "< 10 ms")
    table.row("imports numpy", "yes" if pulled_numpy else "no", "", "", "no")
    return result


# ---- 2. per-call cost ----

def _plain() -> None:
    pass


class _Obj:
    def m(self) -> None:
        pass


# (figure, statement, batched): a batched call enqueues work, so it runs in batches with the
# stream synchronised between them, outside the timed part.
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
CALL_TARGETS = {"Event.query()": "<= 60 ns"}


def _call_namespace() -> Dict[str, Any]:
    from array import array

    ev = mf.Event()
    ev.record(0)
    ev.synchronize()
    handle = mf.event_create()
    mf.event_record(handle)
    mf.event_synchronize(handle)
    return {"f": _plain, "obj": _Obj(), "ev": ev, "handle": handle, "rec": mf.Event(),
            "ev_arg": mf.Event(), "event_query": mf.event_query,
            "copy_d2h_async": mf.copy_d2h_async, "argmax_to_feed": mf.argmax_to_feed,
            "src4": mf.DeviceBuffer(4), "dst4": mf.PinnedBuffer(4), "cells1": mf.DeviceBuffer(4),
            "logits16": mf.DeviceBuffer(16 * 4), "masks1": array("I", [3, NO_TOKEN])}


def _close_namespace(ns: Dict[str, Any]) -> None:
    mf.stream_synchronize(0)
    mf.destroy_event(ns["handle"])
    for key in ("ev", "rec", "ev_arg", "src4", "dst4", "cells1", "logits16"):
        ns[key].close()


def _time_call(stmt: str, batched: bool, ns: Dict[str, Any], number: int) -> float:
    """Best ns per call of a few timeit runs (batches of 2000 for an enqueueing call)."""
    timer = timeit.Timer(stmt, globals=ns)
    if not batched:
        return timer.timeit(number) / number * 1e9
    best = float("inf")
    for _ in range(max(1, number // 20_000)):
        best = min(best, timer.timeit(2000) / 2000 * 1e9)
        mf.stream_synchronize(0)  # the host queue grows with every enqueue
    return best


def bench_calls(quick: bool, table: Table) -> Dict[str, Any]:
    ns = _call_namespace()
    rounds, number = (15, 20_000) if quick else (40, 50_000)
    best: Dict[Any, float] = {}
    try:
        for r in range(rounds):
            for name, stmt, batched in CALLS:
                # NVTX on and off back to back, in alternating order, so drift hits both alike.
                for nvtx in ((True, False) if r % 2 == 0 else (False, True)):
                    _core.nvtx_enable(nvtx)
                    t = _time_call(stmt, batched, ns, number)
                    best[name, nvtx] = min(best.get((name, nvtx), t), t)
    finally:
        _core.nvtx_enable(True)
        _close_namespace(ns)
    plain = best["f()", True]
    result = {"nvtx_built": mf.build_info()["nvtx"], "rounds": rounds, "number": number}
    table.section(f"per-call cost from Python, host backend (best of {rounds} timeit runs)")
    for name, _, _ in CALLS:
        on, off = best[name, True], best[name, False]
        result[name] = {"ns": on, "ns_nvtx_off": off, "nvtx_ratio": on / off,
                        "vs_f": on / plain}
        table.row(name, f"{on:.1f} ns", f"NVTX off {off:.1f} ns ({(on / off - 1) * 100:+.1f}%)",
                  f"{on / plain:.2f}x f()", CALL_TARGETS.get(name, "NVTX within 5%"))
    return result


# ---- 2b. the C-level call through cimport ----

_CIMPORT_PYX = """
# cython: language_level=3
from libc.stdint cimport uint64_t
from metrale_feed._core cimport event_query_c

def query_loop(uint64_t handle, Py_ssize_t n):
    # The GIL is released once; each iteration is one C-level query through the C-API table.
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
    source = os.path.join(folder, "mf_bench_cimport.pyx")
    with open(source, "w") as f:
        f.write(_CIMPORT_PYX)
    c_file = source[:-4] + ".c"
    steps = [[sys.executable, "-m", "cython", "-3", "-I", mf.get_include(), source, "-o", c_file]]
    target = source[:-4] + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    linker = shlex.split(os.environ.get("LDSHARED") or sysconfig.get_config_var("LDSHARED")
                         or "cc -shared")
    steps.append(linker + ["-fPIC", "-O2", "-I", sysconfig.get_paths()["include"],
                           "-I", mf.get_include(), "-I", mf.get_c_include(), c_file, "-o", target])
    for command in steps:
        try:
            done = subprocess.run(command, capture_output=True, text=True, cwd=folder)
        except OSError as error:
            raise RuntimeError(f"{command[0]}: {error}") from None
        if done.returncode:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["failed"]
            raise RuntimeError(f"{os.path.basename(command[0])}: {tail[0]}")
    spec = importlib.util.spec_from_file_location("mf_bench_cimport", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_cimport(quick: bool, table: Table) -> Dict[str, Any]:
    result: Dict[str, Any] = {"ns": None, "reason": None, "target_ns": 15}
    n, repeats = (2_000_000, 5) if quick else (10_000_000, 7)
    with tempfile.TemporaryDirectory(prefix="mf-bench-") as folder:
        try:
            module = _build_cimport(folder)
        except Exception as error:  # no Cython, no compiler, no headers: say which
            result["reason"] = str(error) or type(error).__name__
        else:
            ev = mf.Event()
            ev.record(0)
            ev.synchronize()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                assert module.query_loop(ev.handle, n) == n  # every query saw a completed event
                best = min(best, time.perf_counter() - start)
            ev.close()
            result["ns"], result["calls"] = best / n * 1e9, n
    table.section("C-level event_query_c through cimport (nogil loop)")
    value = f"{result['ns']:.1f} ns" if result["ns"] else "null"
    table.row("event_query_c", value, "", "", "<= 15 ns", result["reason"] or "")
    return result


# ---- 3. masked argmax against numpy ----

def _arrays(rows: int, vocab: int, np: Any) -> Dict[str, Any]:
    """The same logits in each dtype: bfloat16 as the upper halves of the float32 bits (its exact
    widening back to float32 is numpy's comparison), float16 rounded."""
    f32 = np.random.default_rng(rows * vocab).standard_normal((rows, vocab), dtype=np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    return {"float32": f32, "float16": f32.astype(np.float16), "bfloat16": bf16,
            "bf16_wide": (bf16.astype(np.uint32) << 16).view(np.float32)}


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def bench_bandwidth(a: Any, np: Any, threads: int, repeats: int) -> Dict[str, Any]:
    """Read bandwidth: the faster of two SIMD max reductions over the logits' bytes (memory-bound
    at this size), on 1 thread and on ``threads`` row blocks at once (numpy drops the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    ways = {"float32 a.max()": a, "uint32 a.view(uint32).max()": a.view(np.uint32)}
    best: Dict[str, float] = {}
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            for name, arr in ways.items():
                blocks = np.array_split(arr, threads)
                for key, fn in ((name, arr.max), (name + "/all",
                                                  lambda: list(pool.map(np.max, blocks)))):
                    best[key] = min(best.get(key, float("inf")), _timed(fn))
    method = min(ways, key=lambda n: best[n])
    one = a.nbytes / best[method] / 1e6
    # All cores read at least as fast as one: a memory-bound machine saturates with one core.
    return {"method": method, "bytes": a.nbytes, "threads": threads, "gbps_1": one,
            "gbps_all": max(one, a.nbytes / best[method + "/all"] / 1e6),
            "ms": {k: v for k, v in best.items()}}


def _ours(arr: Any, dtype: str, np: Any) -> Dict[str, Any]:
    rows, vocab = arr.shape
    dev = mf.DeviceBuffer(arr.nbytes)
    mf.copy_h2d_async(dev, arr)
    mf.stream_synchronize(0)
    masks = np.random.default_rng(vocab).integers(0, vocab, (rows, 2), dtype=np.uint32)
    cells, dst, ev = mf.DeviceBuffer(rows * 4), mf.PinnedBuffer(rows * 4), mf.Event()

    def run(m: Any = masks) -> None:
        mf.argmax_to_feed(dev, m, cells, dst, ev, 0, rows=rows, vocab=vocab, dtype=dtype)
        ev.synchronize()

    run(None)  # unmasked once, checked against numpy: the figures are of a real argmax
    ids = mf.read_pinned_u32(dst.ptr, rows)
    return {"run": run, "ids": ids, "close": [dev, cells, dst, ev]}


def _shape_entries(rows: int, vocab: int, repeats: int, threads: int, bw: Dict[str, Any],
                   np: Any, torch: Any) -> List[Dict[str, Any]]:
    arrays = _arrays(rows, vocab, np)
    numpy_of = {"float32": arrays["float32"], "float16": arrays["float16"],
                "bf16_wide": arrays["bf16_wide"]}
    ours = {d: _ours(arrays[d], d, np) for d in ("float32", "float16", "bfloat16")}
    checked = all(ours[d]["ids"] == numpy_of["bf16_wide" if d == "bfloat16" else d]
                  .argmax(axis=1).tolist() for d in ours)
    times: Dict[str, List[float]] = {}
    for _ in range(repeats):  # every contender once per repeat: interleaved
        for d, o in ours.items():
            for n in (1, 0):
                mf.host_kernel_threads(n)
                times.setdefault(f"{d}/{n}", []).append(_timed(o["run"]))
        for key, arr in numpy_of.items():
            times.setdefault(f"np/{key}", []).append(_timed(lambda: arr.argmax(axis=1)))
        if torch is not None:
            for d in ours:
                t = torch.from_numpy(arrays[d])
                t = t.view(torch.bfloat16) if d == "bfloat16" else t
                times.setdefault(f"torch/{d}", []).append(_timed(lambda: torch.argmax(t, dim=1)))
    for o in ours.values():
        for thing in o["close"]:
            thing.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    entries = []
    for d in ours:
        nbytes = arrays[d].nbytes
        e = {"dtype": d, "rows": rows, "vocab": vocab, "bytes": nbytes, "checked": checked,
             "ms_1": med[f"{d}/1"], "ms_all": med[f"{d}/0"], "threads_all": threads,
             "numpy_ms": med["np/" + ("bf16_wide" if d == "bfloat16" else d)],
             "numpy_what": "float32 argmax of the widened values" if d == "bfloat16"
             else f"{d} argmax", "torch_ms": med.get(f"torch/{d}")}
        for n in ("1", "all"):
            e[f"ratio_{n}"] = e["numpy_ms"] / e[f"ms_{n}"]
            e[f"bw_fraction_{n}"] = nbytes / e[f"ms_{n}"] / 1e6 / bw[f"gbps_{n}"]
            if d == "bfloat16":
                e["numpy_f16_ms"] = med["np/float16"]
                e[f"ratio_f16_{n}"] = med["np/float16"] / e[f"ms_{n}"]
        entries.append(e)
    return entries


ARGMAX_TARGETS = {("float32", "1"): ">= 1.0x", ("float32", "all"): ">= 1.3x",
                  ("bfloat16", "1"): ">= 1.5x", ("bfloat16", "all"): ">= 1.5x"}


def _print_argmax(entries: List[Dict[str, Any]], table: Table) -> None:
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
    for e in entries:
        for n in ("1", "all"):
            label = f"{short[e['dtype']]} {e['rows']}x{e['vocab']} {'1 thr' if n == '1' else 'all'}"
            base = f"np {'f32(wide)' if e['dtype'] == 'bfloat16' else short[e['dtype']]} {e['numpy_ms']:.2f} ms"
            note = f"bw {e[f'bw_fraction_{n}'] * 100:.0f}%"
            if e["torch_ms"]:
                note += f", torch {e['torch_ms']:.2f} ms"
            target = ARGMAX_TARGETS.get((e["dtype"], n), "") if e["rows"] * e["vocab"] == LARGE[0] * LARGE[1] else ""
            table.row(label, f"{e[f'ms_{n}']:.2f} ms", base, _x(e[f"ratio_{n}"]), target, note)
            if e["dtype"] == "bfloat16":
                table.row("", "", f"np f16 {e['numpy_f16_ms']:.2f} ms", _x(e[f"ratio_f16_{n}"]),
                          ">= 10x" if target else "")


def bench_argmax(quick: bool, table: Table) -> Dict[str, Any]:
    import numpy as np

    try:
        import torch
    except ImportError:
        torch = None
    shapes = [LARGE, (64, 32000)] if quick else [(1, 152064), (64, 32000), LARGE]
    repeats = 3 if quick else 7
    threads = mf.host_kernel_threads(0)  # what "all cores" means for the host kernels
    bw = bench_bandwidth(_arrays(*LARGE, np)["float32"], np, threads, repeats)
    table.section(f"bandwidth ({bw['method']}, {bw['bytes'] / 1e6:.0f} MB, best of {repeats})")
    table.row("read bandwidth 1 thread", f"{bw['gbps_1']:.1f} GB/s")
    table.row(f"read bandwidth {threads} threads", f"{bw['gbps_all']:.1f} GB/s")
    table.section(f"masked argmax_to_feed + event sync, host backend (median of {repeats}); "
                  "ratio = numpy time / ours")
    entries = []
    try:
        for rows, vocab in shapes:
            entries += _shape_entries(rows, vocab, repeats, threads, bw, np, torch)
            _print_argmax(entries[-3:], table)
    finally:
        mf.host_kernel_threads(0)
    return {"argmax": entries, "bandwidth": bw, "torch": None if torch is None else torch.__version__}


# ---- 4. router ----

class _StubModel(mf.ModelDeviceFeed):
    """Does no device work, so a step costs only the router's own Python."""

    def supports_device_token_feed(self) -> bool:
        return True

    def decode_batch_fed(self, sources: Any, seqs: Any, stream: Any) -> int:
        return 0

    def argmax_batch_to_feed(self, logits: Any, masks: Any, dst: Any, event: Any, stream: Any) -> None:
        pass

    def event_query(self, event: Any) -> bool:
        return True

    def reserve_decode_block(self, seq: Any) -> int:
        return 0

    def create_event(self) -> int:
        return mf.event_create()

    def destroy_event(self, event: Any) -> None:
        mf.destroy_event(event)

    def alloc_host_pinned(self, nbytes: int) -> int:
        return mf.alloc_host_pinned(nbytes)

    def free_host_pinned(self, ptr: int, nbytes: int) -> None:
        mf.free_host_pinned(ptr, nbytes)


def _stub_step_us(rows: int, steps: int, repeats: int, reserve: bool) -> float:
    seqs = [mf.SequenceState(i) for i in range(rows)]
    sources = [mf.FeedSource.feed(i) for i in range(rows)]
    masks = [(NO_TOKEN, NO_TOKEN)] * rows
    io = mf.AsyncDeviceIo(_StubModel(), rows)
    best = float("inf")
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                if reserve:
                    for seq in seqs:
                        io.reserve_kv(seq)
                io.await_result(io.launch_fed(sources, seqs, masks))
            best = min(best, time.perf_counter() - start)
    finally:
        io.teardown()
    return best / steps * 1e6


def _router_pair(model: Any, requests: Any, max_new: int, work: float, kind: str,
                 repeats: int) -> Dict[str, Any]:
    from . import demo

    fast, slow = [], []
    for _ in range(repeats):  # async and sync interleaved; best of each
        fast.append(demo.run_async(model, requests, max_new, work, work_kind=kind))
        slow.append(demo.run_sync(model, requests, max_new, work, work_kind=kind))
    a, s = min(fast, key=lambda r: r["seconds"]), min(slow, key=lambda r: r["seconds"])
    tokens = sum(len(t) for t in a["tokens"])
    return {"host_work_us": work, "kind": kind, "async_tps": tokens / a["seconds"],
            "sync_tps": tokens / s["seconds"], "speedup": s["seconds"] / a["seconds"],
            "same_tokens": a["tokens"] == s["tokens"], "tokens": tokens}


def bench_router(quick: bool, table: Table) -> Dict[str, Any]:
    from . import demo
    from .reference import ReferenceModel

    rows, vocab, max_new = 64, 32000, 32 if quick else 64
    repeats = 3 if quick else 5
    requests = demo.make_requests(rows, max_new, vocab, "float32", 0)
    mf.host_kernel_threads(1)  # the simulated device gets one core, the scheduler the other
    model = ReferenceModel(vocab, block_size=16, num_blocks=rows * ((24 + max_new) // 16 + 3),
                           max_rows=rows)
    try:
        warm = [demo.run_sync(model, requests, max_new) for _ in range(2)]
        step_us = min(r["seconds"] / r["steps"] for r in warm) * 1e6
        levels = [(0.0, "sleep"), (step_us, "sleep"), (2 * step_us, "sleep"), (step_us, "spin")]
        result = {"rows": rows, "vocab": vocab, "max_new": max_new, "device_threads": 1,
                  "step_us": step_us, "repeats": repeats,
                  "levels": [_router_pair(model, requests, max_new, w, k, repeats) for w, k in levels]}
    finally:
        model.close()
        mf.host_kernel_threads(0)
    steps = 2000 if quick else 10000
    result["stub_us_per_step"] = _stub_step_us(rows, steps, repeats, False)
    result["stub_us_per_step_reserve"] = _stub_step_us(rows, steps // 4, repeats, True)
    table.section(f"router on the reference model: {rows} rows, vocab {vocab}, {max_new} new "
                  f"tokens, 1 device thread (best of {repeats})")
    table.row("sync step time (no host work)", f"{step_us:.0f} us")
    for i, lv in enumerate(result["levels"]):
        target = {0: ">= 0.95x", 1: ">= 1.6x"}.get(i, "")
        table.row(f"host work {lv['host_work_us']:.0f} us {lv['kind']}", f"{lv['async_tps']:.0f} tok/s",
                  f"sync {lv['sync_tps']:.0f} tok/s", _x(lv["speedup"]), target,
                  "" if lv["same_tokens"] else "TOKENS DIFFER")
    table.row("router Python per step (stub)", f"{result['stub_us_per_step']:.1f} us",
              f"step {step_us:.0f} us", _x(result["stub_us_per_step"] / step_us), "<= 30 us")
    table.row("  + 64 reserve_kv", f"{result['stub_us_per_step_reserve']:.1f} us",
              "", _x(result["stub_us_per_step_reserve"] / step_us), "<= 30 us")
    return result


# ---- the command ----

def machine() -> Dict[str, Any]:
    import numpy as np

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_count": os.cpu_count(), "cpus_usable": affinity, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "backend": mf.backend(), "build": mf.build_info(), "metrale_feed": mf.__version__}


def main(args: Any) -> int:
    start = time.perf_counter()
    table = Table()
    default = mf.backend()
    if default != "host":
        mf.set_backend("host")  # the record is of the host backend, also on a GPU machine
    info = machine()
    info["default_backend"] = default
    print(f"metrale-feed bench{' --quick' if args.quick else ''}: backend host, "
          f"{info['cpu_count']} CPUs, numpy {info['numpy']}, Python {info['python']}")
    record: Dict[str, Any] = {"machine": info, "quick": bool(args.quick)}
    record["import"] = bench_import(3 if args.quick else 5, table)
    record["calls"] = bench_calls(args.quick, table)
    record["cimport"] = bench_cimport(args.quick, table)
    record.update(bench_argmax(args.quick, table))
    record["router"] = bench_router(args.quick, table)
    record["seconds"] = time.perf_counter() - start
    print(f"\n{record['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"figures written to {args.json}")
    ok = all(e["checked"] for e in record["argmax"]) and all(
        lv["same_tokens"] for lv in record["router"]["levels"])
    if not ok:
        print("a correctness check failed: argmax ids or router tokens differ", file=sys.stderr)
    return 0 if ok else 1
