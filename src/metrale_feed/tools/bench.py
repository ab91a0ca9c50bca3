"""``metrale-feed bench``: the performance record, measured side by side in one run.

Every figure is printed beside a baseline measured in the same run (a plain Python call, numpy,
the synchronous router), with the ratio and the target. These machines are noisy, so compared
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
from metrale_feed.contract import FeedInfo
from metrale_feed.kv import PagedKvMixin

NO_TOKEN = mf.NO_TOKEN
LARGE = (256, 152064)


def _section(title: str) -> None:
    print(f"\n== {title}")
    _row("figure", "value", "baseline", "ratio", "target", mark="result")


_TARGET = re.compile(r"^(<=|>=|<|>)\s*(\d+(?:\.\d+)?)\s*(x|ns|us|ms|s)$")
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(x|ns|us|ms|s)\b")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_VERDICTS: List[Any] = []  # (row, verdict) of every printed row with a target, in order
_LAST_NAME = ""


def verdict(value: str, ratio: str, target: str) -> str:
    """Whether a printed figure meets its printed target: "met", "MISSED", "not measured", or ""
    for a row without a target. A target in ``x`` reads the ratio column; one in a time unit reads
    the value column (in any time unit); a word target ("no") must equal the value."""
    if not target:
        return ""
    rule = _TARGET.match(target.strip())
    if rule is None:
        return "met" if value.strip() == target.strip() else "MISSED"
    op, bound, unit = rule.group(1), float(rule.group(2)), rule.group(3)
    figure = _NUMBER.match(ratio if unit == "x" else value)
    if figure is None or (unit == "x") != (figure.group(2) == "x"):
        return "not measured"
    got = float(figure.group(1))
    if unit != "x":
        got, bound = got * _SECONDS[figure.group(2)], bound * _SECONDS[unit]
    ok = {"<=": got <= bound, ">=": got >= bound, "<": got < bound, ">": got > bound}[op]
    return "met" if ok else "MISSED"


def _row(name: str, value: str, base: str = "", ratio: str = "", target: str = "",
         note: str = "", mark: Optional[str] = None) -> None:
    global _LAST_NAME
    if mark is None:
        # A row without a name is a second baseline of the row above.
        label = name.strip() or f"{_LAST_NAME} vs {' '.join(base.split()[:2])}"
        _LAST_NAME = name.strip() or _LAST_NAME
        mark = verdict(value, ratio, target)
        if mark:
            _VERDICTS.append((label, mark))
    line = f"  {name:<30} {value:>11}  {base:<26} {ratio:>10}  {target:<10} {mark:<12} {note}"
    print(line.rstrip(), flush=True)


def cimport_reason(reason: str) -> str:
    """The cimport row's failure, with what to install when that is the cause."""
    if "no module named cython" in reason.lower():
        return "Cython is not installed: pip install 'metrale-feed[cython]'"
    if reason.startswith("compiler"):
        return f"{reason} (a C compiler is needed: install gcc or clang)"
    return reason


def _timed(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


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
    ours, numpy_us, pulled_numpy = [], [], False
    for _ in range(runs):  # interleaved pairs
        run = _import_run("metrale_feed")
        ours.append(run["us"])
        pulled_numpy |= any(n.split(".")[0] == "numpy" for n in run["modules"])
        numpy_us.append(_import_run("numpy")["us"])
    r = {"metrale_feed_us": statistics.median(ours), "numpy_us": statistics.median(numpy_us),
         "imports_numpy": pulled_numpy, "runs": runs, "target_us": 10_000}
    r["ratio"] = r["metrale_feed_us"] / r["numpy_us"]
    _section(f"import time (median of {runs} fresh interpreters, -X importtime cumulative)")
    _row("import metrale_feed", f"{r['metrale_feed_us'] / 1e3:.2f} ms",
         f"import numpy {r['numpy_us'] / 1e3:.2f} ms", f"{r['ratio']:.2f}x", "< 10 ms")
    _row("it imports numpy", "yes" if pulled_numpy else "no", "", "", "no")
    return r


# ---- 2. per-call cost from Python ----

def _plain() -> None:
    pass


class _Obj:
    def m(self) -> None:
        pass


# (figure, statement, enqueues): an enqueueing call is timed in batches (see _time_call).
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


def _call_namespace() -> Dict[str, Any]:
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


def _time_call(stmt: str, enqueues: bool, ns: Dict[str, Any], number: int) -> float:
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
    ns = _call_namespace()
    rounds, number = (25, 20_000) if quick else (60, 50_000)
    best: Dict[Any, float] = {}
    try:
        for r in range(rounds):
            for name, stmt, enqueues in CALLS:
                # NVTX on and off back to back, in alternating order, so drift hits both alike.
                for nvtx in ((True, False) if r % 2 == 0 else (False, True)):
                    _core.nvtx_enable(nvtx)
                    t = _time_call(stmt, enqueues, ns, number)
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
    _section(f"per-call cost from Python, host backend (best of {rounds} timeit runs; "
             f"enqueues in batches of {BATCH})")
    for name, _, _ in CALLS:
        on, off = best[name, True], best[name, False]
        result[name] = {"ns": on, "ns_nvtx_off": off, "nvtx_ratio": on / off, "vs_f": on / plain}
        _row(name, f"{on:.1f} ns", f"NVTX off {off:.1f} ns ({(on / off - 1) * 100:+.1f}%)",
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
    _section(f"C-level event_query_c through cimport (nogil loop of {n:,}, best of {repeats})")
    if result["ns"] is None:
        _row("event_query_c", "null", "", "", "<= 15 ns", cimport_reason(result["reason"]))
    else:
        _row("event_query_c", f"{result['ns']:.1f} ns", f"NVTX off {result['ns_nvtx_off']:.1f} ns",
             f"{result['ns'] / result['ns_nvtx_off']:.2f}x", "<= 15 ns")
    return result


# ---- 3. masked argmax against numpy ----

def _arrays(rows: int, vocab: int, np: Any) -> Dict[str, Any]:
    """The same logits in each dtype: bfloat16 as the upper halves of the float32 bits, with its
    exact widening back to float32 (numpy's comparison for it); float16 rounded."""
    f32 = np.random.default_rng(rows * vocab).standard_normal((rows, vocab), dtype=np.float32)
    bf16 = (f32.view(np.uint32) >> 16).astype(np.uint16)
    return {"float32": f32, "float16": f32.astype(np.float16), "bfloat16": bf16,
            "bf16_wide": (bf16.astype(np.uint32) << 16).view(np.float32)}


def bench_bandwidth(a: Any, np: Any, threads: int, repeats: int) -> Dict[str, Any]:
    """Read bandwidth: ``a.max()`` over float32 logits (numpy's SIMD max, memory-bound at this
    size), on 1 thread and on ``threads`` row blocks at once (numpy drops the GIL to reduce)."""
    from concurrent.futures import ThreadPoolExecutor

    blocks = np.array_split(a, threads)
    one, many = float("inf"), float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            one = min(one, _timed(a.max))
            many = min(many, _timed(lambda: list(pool.map(np.max, blocks))))
    # All cores read at least as fast as one: one core may saturate the memory already.
    return {"method": "float32 a.max()", "bytes": a.nbytes, "threads": threads,
            "gbps_1": a.nbytes / one / 1e6, "gbps_all": a.nbytes / min(one, many) / 1e6}


def _launcher(arr: Any, dtype: str, np: Any) -> Any:
    """``arr`` in a DeviceBuffer and a call that runs the masked argmax on it and waits; checked
    once, unmasked, so the figures are of a real argmax."""
    rows, vocab = arr.shape
    dev, cells, dst, ev = (mf.DeviceBuffer(arr.nbytes), mf.DeviceBuffer(rows * 4),
                           mf.PinnedBuffer(rows * 4), mf.Event())
    mf.copy_h2d_async(dev, arr)
    masks = np.random.default_rng(vocab).integers(0, vocab, (rows, 2), dtype=np.uint32)

    def run(m: Any = masks) -> None:
        mf.argmax_to_feed(dev, m, cells, dst, ev, 0, rows=rows, vocab=vocab, dtype=dtype)
        ev.synchronize()

    run(None)
    run.ids, run.buffers = mf.read_pinned_u32(dst.ptr, rows), (dev, cells, dst, ev)
    return run


def _shape_entries(rows: int, vocab: int, repeats: int, bw: Dict[str, Any], np: Any,
                   torch: Any) -> List[Dict[str, Any]]:
    arrays = _arrays(rows, vocab, np)
    ref = {"float32": "float32", "float16": "float16", "bfloat16": "bf16_wide"}  # numpy's twin
    ours = {d: _launcher(arrays[d], d, np) for d in ref}
    checked = all(ours[d].ids == arrays[ref[d]].argmax(axis=1).tolist() for d in ref)
    times: Dict[str, List[float]] = {}
    for _ in range(repeats):  # every contender once per repeat: interleaved
        for d in ref:
            for threads in (1, 0):
                mf.host_kernel_threads(threads)
                times.setdefault(f"{d}/{threads}", []).append(_timed(ours[d]))
            arr = arrays[ref[d]]
            times.setdefault(f"np/{d}", []).append(_timed(lambda: arr.argmax(axis=1)))
            if torch is not None:
                t = torch.from_numpy(arrays[d])
                t = t.view(torch.bfloat16) if d == "bfloat16" else t
                times.setdefault(f"torch/{d}", []).append(_timed(lambda: torch.argmax(t, dim=1)))
    for d in ref:
        for buffer in ours[d].buffers:
            buffer.close()
    med = {key: statistics.median(v) for key, v in times.items()}
    entries = []
    for d in ref:
        e = {"dtype": d, "rows": rows, "vocab": vocab, "bytes": arrays[d].nbytes,
             "checked": checked, "ms_1": med[f"{d}/1"], "ms_all": med[f"{d}/0"],
             "numpy_ms": med[f"np/{d}"], "torch_ms": med.get(f"torch/{d}"),
             "numpy_what": ("float32 argmax of the widened values" if d == "bfloat16"
                            else f"{d} argmax")}
        for n in ("1", "all"):
            e[f"ratio_{n}"] = e["numpy_ms"] / e[f"ms_{n}"]
            e[f"bw_fraction_{n}"] = e["bytes"] / e[f"ms_{n}"] / 1e6 / bw[f"gbps_{n}"]
            if d == "bfloat16":
                e["numpy_f16_ms"] = med["np/float16"]
                e[f"ratio_f16_{n}"] = med["np/float16"] / e[f"ms_{n}"]
        entries.append(e)
    return entries


TARGETS = {("float32", "1"): ">= 1.0x", ("float32", "all"): ">= 1.3x",
           ("bfloat16", "1"): ">= 1.5x", ("bfloat16", "all"): ">= 1.5x"}


def _print_argmax(e: Dict[str, Any]) -> None:
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[e["dtype"]]
    large = (e["rows"], e["vocab"]) == LARGE  # the targets are for this shape
    for n in ("1", "all"):
        target = TARGETS.get((e["dtype"], n), "") if large else ""
        note = f"bw {e[f'bw_fraction_{n}'] * 100:.0f}%"
        note += f", torch {e['torch_ms']:.2f} ms" if e["torch_ms"] else ""
        _row(f"{short} {e['rows']}x{e['vocab']} {'1 thread' if n == '1' else 'all cores'}",
             f"{e[f'ms_{n}']:.2f} ms", f"numpy {'f32(wide)' if short == 'bf16' else short} "
             f"{e['numpy_ms']:.2f} ms", f"{e[f'ratio_{n}']:.2f}x", target, note)
        if e["dtype"] == "bfloat16":
            _row("", "", f"numpy f16 {e['numpy_f16_ms']:.2f} ms", f"{e[f'ratio_f16_{n}']:.2f}x",
                 ">= 10x" if large else "")


def bench_argmax(quick: bool) -> Dict[str, Any]:
    import numpy as np

    try:
        import torch
    except ImportError:
        torch = None
    shapes = [LARGE, (64, 32000)] if quick else [(1, 152064), (64, 32000), LARGE]
    repeats = 3 if quick else 7
    threads = mf.host_kernel_threads(0)  # what "all cores" means for the host kernels
    bw_repeats = 4 * repeats  # cheap, and a low best would inflate every fraction below
    bw = bench_bandwidth(_arrays(*LARGE, np)["float32"], np, threads, bw_repeats)
    _section(f"read bandwidth ({bw['method']} over {bw['bytes'] / 1e6:.0f} MB, "
             f"best of {bw_repeats})")
    _row("1 thread", f"{bw['gbps_1']:.1f} GB/s")
    _row(f"{threads} threads", f"{bw['gbps_all']:.1f} GB/s")
    _section(f"masked argmax_to_feed + event sync, host backend (median of {repeats}); "
             "ratio = numpy time / ours; bw = fraction of the read bandwidth above (a "
             "cache-resident shape can pass 100%)")
    entries: List[Dict[str, Any]] = []
    try:
        for rows, vocab in shapes:
            entries += _shape_entries(rows, vocab, repeats, bw, np, torch)
            for e in entries[-3:]:
                _print_argmax(e)
    finally:
        mf.host_kernel_threads(0)
    return {"argmax": entries, "bandwidth": bw, "torch": getattr(torch, "__version__", None)}


def bench_pick_options(quick: bool) -> Dict[str, Any]:
    """At 256 x 152064 float32 (standard normal logits, the argmax section's), side by side: the
    masked argmax, the same with a bitmask (random words: no word all ones or all zeros, the
    dearest case), the same with chosen-token logprobs, and sampling with temperature alone and
    with top_p = 0.9. Checked: an all-ones bitmask, temperature 0 and asking for logprobs give the
    argmax's ids."""
    import numpy as np

    rows, vocab = LARGE
    repeats = 3 if quick else 7
    arr = _arrays(rows, vocab, np)["float32"]
    rng = np.random.default_rng(11)
    words = (vocab + 31) // 32
    dev, cells, dst, ev = (mf.DeviceBuffer(arr.nbytes), mf.DeviceBuffer(rows * 4),
                           mf.PinnedBuffer(rows * 4), mf.Event())
    bits = {"random": rng.integers(-2**31, 2**31, (rows, words)).astype(np.int32),
            "ones": np.full((rows, words), -1, np.int32)}
    bit_dev = {k: mf.DeviceBuffer(v.nbytes) for k, v in bits.items()}
    lp_dev, lp_dst = mf.DeviceBuffer(rows * 4), mf.PinnedBuffer(rows * 4)
    mf.copy_h2d_async(dev, arr)
    for k, v in bits.items():
        mf.copy_h2d_async(bit_dev[k], v)
    masks = rng.integers(0, vocab, (rows, 2), dtype=np.uint32)
    params = {name: mf.sampling_params(rows, seed=5, position=np.arange(rows), **kw)
              for name, kw in (("greedy", dict(temperature=0.0)), ("temperature", dict(temperature=1.0)),
                               ("top_p", dict(temperature=1.0, top_p=0.9)))}

    def argmax(bitmask: Any = None, logprobs: bool = False) -> List[int]:
        mf.argmax_to_feed(dev, masks, cells, dst, ev, 0, vocab=vocab, dtype="float32", bitmask=bitmask,
                          logprobs=lp_dev if logprobs else None, logprobs_dst=lp_dst if logprobs else None)
        ev.synchronize()
        return mf.read_pinned_u32(dst.ptr, rows)

    def sample(p: Any) -> List[int]:
        mf.sample_to_feed(dev, p, cells, dst, ev, 0, masks=masks, vocab=vocab, dtype="float32")
        ev.synchronize()
        return mf.read_pinned_u32(dst.ptr, rows)

    try:
        plain = argmax()
        checked = (argmax(bit_dev["ones"]) == plain and sample(params["greedy"]) == plain
                   and argmax(logprobs=True) == plain)
        runs = {"argmax": argmax, "bitmask": lambda: argmax(bit_dev["random"]),
                "logprobs": lambda: argmax(logprobs=True),
                "temperature": lambda: sample(params["temperature"]),
                "top_p": lambda: sample(params["top_p"])}
        times: Dict[str, List[float]] = {k: [] for k in runs}
        for _ in range(repeats):
            for k, run in runs.items():
                times[k].append(_timed(run))
    finally:
        for b in (dev, cells, dst, ev, lp_dev, lp_dst, *bit_dev.values()):
            b.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"rows": rows, "vocab": vocab, "checked": checked, "ms": med,
              "ratio": {k: med[k] / med["argmax"] for k in ("bitmask", "logprobs", "temperature", "top_p")}}
    _section(f"argmax options at {rows}x{vocab} float32, host backend (median of {repeats}); "
             "ratio = time / the masked argmax's")
    _row("masked argmax", f"{med['argmax']:.2f} ms")
    for k, target in (("bitmask", "<= 1.15x"), ("logprobs", ""), ("temperature", "<= 1.5x"), ("top_p", "<= 3x")):
        label = {"bitmask": "+ bitmask (random words)", "logprobs": "+ logprobs (with readback)",
                 "temperature": "sample, temperature 1",
                 "top_p": "sample, top_p 0.9"}[k]
        _row(label, f"{med[k]:.2f} ms", "", f"{result['ratio'][k]:.2f}x", target)
    return result


# ---- 3b. sampling against the argmax, flat and peaked logits ----

SAMPLE_ROWS = (64, 256)  # x LARGE[1], float32
SAMPLE_CASES = (  # (name, filters, target on flat logits, target on peaked logits)
    ("temperature 1", {}, "", "<= 2.5x"),
    ("top_k 50", {"top_k": 50}, "<= 2x", "<= 2x"),
    ("top_k 50, top_p 0.9", {"top_k": 50, "top_p": 0.9}, "<= 2x", "<= 2x"),
    ("top_p 0.9", {"top_p": 0.9}, "", "<= 4x"),
)


def peaked_logits(rows: int, vocab: int, np: Any, seed: int = 0) -> Any:
    """LM-like logits: a bulk of ``N(0, 2)`` with, in each row, a head of 16 random ids at 30 and
    below in steps of ``Exp(1.5)`` (the top id holds about half the mass at temperature 1, top_p
    0.9 keeps a handful). Almost every bulk id trails the top by more than the race's reach
    (18 + 2.86, docs/kernels.md), as in a trained model's distribution."""
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(2.0)
    head = min(16, vocab)
    ids = np.argsort(rng.random((rows, vocab)), axis=1)[:, :head] if vocab <= 4096 else \
        np.stack([rng.choice(vocab, head, replace=False) for _ in range(rows)])
    steps = np.cumsum(rng.exponential(1.5, (rows, head)), axis=1)
    np.put_along_axis(out, ids, (30.0 - (steps - steps[:, :1])).astype(np.float32), axis=1)
    return out


def torch_sampler(torch: Any, logits: Any, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Any:
    """The usual torch CPU recipe (vLLM's CPU sampler): scale; top_k alone by ``topk``'s k-th
    value, otherwise top_k and top_p by one ascending sort with a cumulative sum of the sorted
    softmax; then the exponential race ``argmax(probs / Exp(1))``."""
    x = logits / temperature
    if top_k and top_p >= 1.0:  # top_k alone: torch.topk's k-th value, no sort
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    elif top_k or top_p < 1.0:
        srt, order = x.sort(dim=-1, descending=False)
        if top_k:
            kth = srt.gather(1, torch.full((x.shape[0], 1), x.shape[1] - top_k, dtype=torch.long))
            srt = srt.masked_fill(srt < kth, float("-inf"))
        if top_p < 1.0:
            cum = srt.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= 1.0 - top_p
            drop[:, -1] = False
            srt = srt.masked_fill(drop, float("-inf"))
        x = srt.scatter(-1, order, srt)
    probs = x.softmax(dim=-1)
    return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)


def _sample_entries(arr: Any, kind: str, repeats: int, torch_repeats: int, np: Any,
                    torch: Any) -> List[Dict[str, Any]]:
    """One logits array: the masked argmax and each sampling case side by side (interleaved,
    best of ``repeats``; the torch recipe, far slower, in the first ``torch_repeats``), one kernel
    thread; the sampled ids checked against the portable path
    (the radix selects and the whole-row race) and temperature 0 against the argmax."""
    rows, vocab = arr.shape
    dev, cells, dst, ev = (mf.DeviceBuffer(arr.nbytes), mf.DeviceBuffer(rows * 4),
                           mf.PinnedBuffer(rows * 4), mf.Event())
    mf.copy_h2d_async(dev, arr)
    masks = np.random.default_rng(vocab).integers(0, vocab, (rows, 2), dtype=np.uint32)
    seeds = np.random.default_rng(rows).integers(0, 2**63, rows, dtype=np.uint64)
    params = {name: mf.sampling_params(rows, temperature=1.0, seed=seeds, position=np.arange(rows), **kw)
              for name, kw, _, _ in SAMPLE_CASES}

    def argmax() -> List[int]:
        mf.argmax_to_feed(dev, masks, cells, dst, ev, 0, vocab=vocab, dtype="float32")
        ev.synchronize()
        return mf.read_pinned_u32(dst.ptr, rows)

    def sample(p: Any) -> List[int]:
        mf.sample_to_feed(dev, p, cells, dst, ev, 0, masks=masks, vocab=vocab, dtype="float32")
        ev.synchronize()
        return mf.read_pinned_u32(dst.ptr, rows)

    runs: Dict[str, Callable[[], Any]] = {"argmax": argmax}
    runs.update({name: (lambda p=p: sample(p)) for name, p in params.items()})
    if torch is not None:
        t = torch.from_numpy(arr)
        for name, kw, _, _ in SAMPLE_CASES:
            runs[f"torch/{name}"] = lambda kw=kw: torch_sampler(torch, t, 1.0, **kw)
    threads = torch.get_num_threads() if torch is not None else None
    try:
        mf.host_kernel_threads(1)
        if torch is not None:
            torch.set_num_threads(1)
        plain = argmax()
        checked = sample(mf.sampling_params(rows, temperature=0.0)) == plain
        fast = {name: sample(p) for name, p in params.items()}
        mf.host_argmax_path(True)
        try:
            checked = checked and all(sample(p) == fast[name] for name, p in params.items())
        finally:
            mf.host_argmax_path(False)
        times: Dict[str, List[float]] = {k: [] for k in runs}
        for rep in range(repeats):
            for k, run in runs.items():
                if rep < torch_repeats or not k.startswith("torch/"):  # the peer is slow: fewer
                    times[k].append(_timed(run))
    finally:
        mf.host_kernel_threads(0)
        if torch is not None:
            torch.set_num_threads(threads)
        for b in (dev, cells, dst, ev):
            b.close()
    best = {k: min(v) for k, v in times.items()}
    entries = []
    for name, kw, flat_target, peaked_target in SAMPLE_CASES:
        # Each repeat's ratio is of two calls made back to back; on a loaded machine their median
        # moves far less than the ratio of two minima taken at different moments.
        per_repeat = [t / a for t, a in zip(times[name], times["argmax"])]
        e = {"logits": kind, "rows": rows, "vocab": vocab, "case": name, "filters": dict(kw),
             "checked": checked, "ms": best[name], "argmax_ms": best["argmax"],
             "ratio": statistics.median(per_repeat), "ratio_of_minima": best[name] / best["argmax"],
             "target": peaked_target if kind == "peaked" else flat_target,
             "torch_ms": best.get(f"torch/{name}")}
        e["torch_ratio"] = None if e["torch_ms"] is None else e["torch_ms"] / best["argmax"]
        entries.append(e)
    return entries


def bench_sampling(quick: bool, peaked: bool, rows_list: Any = SAMPLE_ROWS, vocab: int = LARGE[1],
                   repeats: Optional[int] = None) -> Dict[str, Any]:
    """``sample_to_feed`` beside the masked argmax over the same float32 logits, one kernel
    thread: temperature alone, top_k 50, top_k 50 with top_p 0.9, and top_p 0.9, on standard
    normal ("flat") logits and, with ``peaked``, on ``peaked_logits``; the torch recipe
    (``torch_sampler``, one torch thread) beside each when torch is importable."""
    import numpy as np

    try:
        import torch
    except ImportError:
        torch = None
    repeats = repeats or (3 if quick else 15)
    rows_list = rows_list[:1] if quick else rows_list
    kinds = ("flat", "peaked") if peaked else ("flat",)
    _section(f"sample_to_feed against the masked argmax over the same float32 logits, host backend, "
             f"1 kernel thread (best of {repeats}); ratio = the median over the repeats of time / the "
             "argmax's time in the same repeat")
    if torch is None:
        print("  (torch is not importable: the torch recipe rows are skipped)")
    else:
        print(f"  (the torch recipe, torch {torch.__version__}, at {rows_list[0]} rows only)")
    entries: List[Dict[str, Any]] = []
    for rows in rows_list:
        for kind in kinds:
            arr = (peaked_logits(rows, vocab, np, rows) if kind == "peaked"
                   else np.random.default_rng(rows * vocab).standard_normal((rows, vocab), dtype=np.float32))
            # The torch recipe at the first shape only: its sort costs seconds at the second.
            block = _sample_entries(arr, kind, repeats, 1 if quick else 2, np,
                                    torch if rows == rows_list[0] else None)
            entries += block
            _row(f"{kind} {rows}x{vocab}: argmax", f"{block[0]['argmax_ms']:.2f} ms")
            for e in block:
                _row(f"  {e['case']}", f"{e['ms']:.2f} ms", "", f"{e['ratio']:.2f}x", e["target"],
                     f"minima {e['ratio_of_minima']:.2f}x"
                     + ("" if e["checked"] else "; IDS DIFFER from the portable path"))
                if e["torch_ms"] is not None:
                    _row("", f"{e['torch_ms']:.2f} ms", "torch recipe, 1 thread", f"{e['torch_ratio']:.2f}x")
    return {"entries": entries, "torch": getattr(torch, "__version__", None), "repeats": repeats,
            "checked": all(e["checked"] for e in entries)}


# ---- 4. router ----

PIPELINE_ROWS = (16, 64, 256, 1024)  # the pipeline's cost per step at these batch sizes
SAMPLED = {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "min_p": 0.0}  # the sampled rows'

class _StubModel(mf.RuntimeFeedMixin, mf.ModelDeviceFeed):
    """No device work, so a step costs only the router's Python; events and pinned memory are
    the mixin's real ones."""

    def supports_device_token_feed(self) -> bool:
        return True

    def decode_batch(self, tokens: Any, seqs: Any, stream: Any) -> int:
        return 0

    def decode_batch_fed(self, sources: Any, seqs: Any, stream: Any) -> int:
        return 0

    def argmax_batch_to_feed(self, logits: Any, masks: Any, dst: Any, event: Any,
                             stream: Any) -> None:
        pass

    def sample_batch_to_feed(self, logits: Any, params: Any, masks: Any, dst: Any, event: Any,
                             stream: Any) -> None:
        pass

    def event_query(self, event: Any) -> bool:
        return True

    def reserve_decode_block(self, seq: Any) -> int:
        return 0

    def feed_info(self) -> Any:
        # Its feed methods take none of the logprobs keywords: it says so.
        lacks = dict(logprobs=False, top_logprobs=False, raw_logits=False)
        if getattr(self, "feed_cells", None) is not None:
            return super().feed_info()._replace(**lacks)
        return FeedInfo(vocab=32000, sampling=True, **lacks)  # the router's stub, no feed cells


class _StubPagedModel(PagedKvMixin, _StubModel):
    """The stub with the models' paged KV bookkeeping (``PagedKvMixin``: a block pool, block
    tables, prefill that allocates), so the pipeline's own cost per step includes reservation,
    commit and release."""

    def __init__(self, rows: int, vocab: int, block_size: int, num_blocks: int) -> None:
        self.init_device_feed(vocab=vocab, max_rows=rows)
        self.init_paged_kv(block_size=block_size, num_blocks=num_blocks)

    def prefill(self, seq: Any, ids: Any, stream: Any = None) -> None:
        self.take_prefill_blocks([seq], [ids])
        seq.seq_len += len(ids)


class _StubLogitsModel(_StubPagedModel):
    """The paged stub with real logits memory and the mixin's own pick over it (a small
    vocabulary: the worker's time stays under the step's Python), for steps whose penalties
    touch the logits: the penalties ride on the pick (one call a step), as on a real model."""

    def __init__(self, rows: int, vocab: int, block_size: int, num_blocks: int) -> None:
        super().__init__(rows, vocab, block_size, num_blocks)
        self.logits = mf.DeviceBuffer(rows * vocab * 4)

    def decode_batch_fed(self, sources: Any, seqs: Any, stream: Any) -> int:
        return self.logits.ptr

    argmax_batch_to_feed = mf.RuntimeFeedMixin.argmax_batch_to_feed
    sample_batch_to_feed = mf.RuntimeFeedMixin.sample_batch_to_feed

    def close_device_feed(self) -> None:
        self.logits.close()
        super().close_device_feed()


class _StubTwoCallModel(_StubLogitsModel):
    """The same stub saying its feed methods take no ``penalties=``: the pipeline queues the
    apply and the update around them (the path before one call a step)."""

    def feed_info(self) -> Any:
        return super().feed_info()._replace(penalties=False)


PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}


def _pipeline_step_us(rows: int, steps: int, repeats: int, sampled: bool = False,
                      penalties: Optional[bool] = None, two_calls: bool = False) -> float:
    """Best µs per DecodePipeline.step() of ``rows`` running requests beside the stub: a launch
    ahead, an await, the commit of every row's token, block reservations as rows cross block
    boundaries (block size 16; prompt lengths spread so that a sixteenth of the rows cross at
    each step, as in a batch of requests that arrived at different times). ``sampled``: every
    request samples (``SAMPLED``), so each launch also sets its params' positions.
    ``penalties`` (not None): the stub with logits and a real pick; ``two_calls``: one that takes
    no ``penalties=``."""
    block_size = 16
    per_request = (steps * (repeats + 1) + 16) // block_size + 2
    stub = _StubPagedModel if penalties is None else _StubTwoCallModel if two_calls else _StubLogitsModel
    model = stub(rows, 32000 if penalties is None else 256, block_size, rows * per_request)
    pipe = mf.DecodePipeline(model, rows, penalty_capacity=steps * (repeats + 1) + 32)
    best = float("inf")
    try:
        for i in range(rows):
            pipe.submit([1] * (1 + i % block_size), max_new_tokens=steps * (repeats + 1),
                        **(dict(SAMPLED, seed=i) if sampled else {}),
                        **(dict(PENALTIES, logit_bias={5: 1.0, 9: -1.0}) if penalties else {}))
        for _ in range(steps):  # admission, prefill and warm-up
            pipe.step()
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                pipe.step()
            best = min(best, (time.perf_counter() - start) / steps * 1e6)
    finally:
        pipe.close()
        model.close_device_feed()
    return best


def _stub_step_us(rows: int, steps: int, repeats: int, reserve: bool, masks: bool = True) -> float:
    """Best µs per launch_fed + await_result of ``rows`` rows (after ``rows`` reserve_kv calls;
    ``masks=False``: no mask list, as the pipeline launches a step without bans)."""
    seqs = [mf.SequenceState(i) for i in range(rows)]
    sources = [mf.FeedSource.feed(i) for i in range(rows)]
    mask_list = [(NO_TOKEN, NO_TOKEN)] * rows if masks else None
    io, best = mf.AsyncDeviceIo(_StubModel(), rows), float("inf")
    try:
        io.await_result(io.launch_decode([1] * rows, seqs, mask_list))  # feed rows exist from here
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                for seq in seqs if reserve else ():
                    io.reserve_kv(seq)
                io.await_result(io.launch_fed(sources, seqs, mask_list))
            best = min(best, (time.perf_counter() - start) / steps * 1e6)
    finally:
        io.teardown()
    return best


def _router_level(model: Any, requests: Any, max_new: int, work: float, kind: str,
                  repeats: int) -> Dict[str, Any]:
    from . import demo

    fast, slow = [], []
    for _ in range(repeats):  # async and sync interleaved; the best of each
        fast.append(demo.run_async(model, requests, max_new, work, work_kind=kind))
        slow.append(demo.run_sync(model, requests, max_new, work, work_kind=kind))
    a, s = min(fast, key=lambda r: r["seconds"]), min(slow, key=lambda r: r["seconds"])
    tokens = sum(len(t) for t in a["tokens"])
    return {"host_work_us": work, "kind": kind, "tokens": tokens,
            "async_tps": tokens / a["seconds"], "sync_tps": tokens / s["seconds"],
            "speedup": s["seconds"] / a["seconds"], "same_tokens": a["tokens"] == s["tokens"],
            "sync_step_us": s["seconds"] / s["steps"] * 1e6}


def _sampled_beside_greedy(model: Any, rows: int, vocab: int, max_new: int,
                           repeats: int) -> Dict[str, Any]:
    """The pipeline two steps deep on the reference model with no host work, every request
    greedy, then every request sampled (``SAMPLED``, a seed each): tokens per second side by
    side, and the sampled tokens checked, async == sync == the host sampler over each request
    alone (the demo's reference)."""
    from . import demo

    greedy = demo.make_requests(rows, max_new, vocab, "float32", 0)
    sampled = demo.make_requests(rows, max_new, vocab, "float32", 0, SAMPLED)
    expected = [demo.host_reference(r["prompt"], r["mask"], r["stop"], max_new, vocab,
                                    "float32", r["sampling"]) for r in sampled]
    best: Dict[str, Any] = {}
    for _ in range(repeats):  # interleaved; the best of each
        for name, reqs in (("greedy", greedy), ("sampled", sampled)):
            run = demo.run_async(model, reqs, max_new)
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    slow = demo.run_sync(model, sampled, max_new)
    out: Dict[str, Any] = {"rows": rows, "params": dict(SAMPLED),
                           "checked": best["sampled"]["tokens"] == slow["tokens"] == expected}
    for name, run in best.items():
        tokens = sum(len(t) for t in run["tokens"])
        out[f"{name}_tps"] = tokens / run["seconds"]
        out[f"{name}_step_us"] = run["seconds"] / max(1, run["steps"]) * 1e6
    out["ratio"] = out["sampled_step_us"] / out["greedy_step_us"]
    return out


def bench_router(quick: bool) -> Dict[str, Any]:
    from . import demo
    from ..testing.reference import ReferenceModel

    rows, vocab, max_new, repeats = 64, 32000, 32 if quick else 64, 3 if quick else 5
    requests = demo.make_requests(rows, max_new, vocab, "float32", 0)
    mf.host_kernel_threads(1)  # the simulated device gets one core, the scheduler the other
    model = ReferenceModel(vocab, block_size=16, num_blocks=rows * ((24 + max_new) // 16 + 3),
                           max_rows=rows)
    try:
        demo.run_async(model, requests, max_new)  # a warm-up: first touches of the buffers
        levels = [_router_level(model, requests, max_new, 0.0, "sleep", repeats)]
        step = levels[0]["sync_step_us"]  # the device step: settled, with no host work
        levels += [_router_level(model, requests, max_new, w, k, repeats)
                   for w, k in ((step, "sleep"), (2 * step, "sleep"), (step, "spin"))]
        r = {"rows": rows, "vocab": vocab, "max_new": max_new, "device_threads": 1,
             "step_us": step, "repeats": repeats, "levels": levels,
             "sampling": _sampled_beside_greedy(model, rows, vocab, max_new, repeats)}
    finally:
        model.close()
        mf.host_kernel_threads(0)
    steps = 2000 if quick else 10000
    r["stub_us_per_step"] = _stub_step_us(rows, steps, repeats, False)
    r["stub_us_per_step_reserve"] = _stub_step_us(rows, steps // 4, repeats, True)
    r["pipeline_us_per_step"], r["router_us_per_step_at"] = {}, {}
    for n in PIPELINE_ROWS:  # the pipeline beside the bare router of as many rows, interleaved
        n_steps = max(100, (steps // 4) * 64 // n)
        r["router_us_per_step_at"][n] = _stub_step_us(n, n_steps, repeats, False, masks=False)
        r["pipeline_us_per_step"][n] = _pipeline_step_us(n, n_steps, repeats)
        if n == rows:
            r["pipeline_us_per_step_sampled"] = _pipeline_step_us(n, n_steps, repeats, True)
    _section(f"router, reference model: {rows} rows, vocab {vocab}, {max_new} new tokens, "
             f"1 device thread (best of {repeats}); ratio = async / sync")
    _row("sync step, no host work", f"{step:.0f} us")
    for i, lv in enumerate(r["levels"]):
        _row(f"host work {lv['host_work_us']:.0f} us {lv['kind']}", f"{lv['async_tps']:.0f} tok/s",
             f"sync {lv['sync_tps']:.0f} tok/s", f"{lv['speedup']:.2f}x",
             {0: ">= 0.95x", 1: ">= 1.8x"}.get(i, ""), "" if lv["same_tokens"] else "TOKENS DIFFER")
    _row(f"router Python/step, {rows} rows", f"{r['stub_us_per_step']:.1f} us",
         f"device step {step:.0f} us", f"{r['stub_us_per_step'] / step:.3f}x", "<= 30 us",
         "stub model")
    _row(f"  with {rows} reserve_kv", f"{r['stub_us_per_step_reserve']:.1f} us", "",
         f"{r['stub_us_per_step_reserve'] / step:.3f}x", "<= 30 us")
    for n, us in r["pipeline_us_per_step"].items():
        base = r["router_us_per_step_at"][n]
        _row(f"pipeline Python/step, {n} rows", f"{us:.1f} us", f"router alone {base:.1f} us",
             f"{us / base:.2f}x", "<= 20 us" if n == 256 else "",
             f"{us / n * 1e3:.0f} ns/row; stub model, KV reservation and commit included")
        if n == rows:
            sampled_us = r["pipeline_us_per_step_sampled"]
            _row(f"  every row sampled, {n} rows", f"{sampled_us:.1f} us", f"greedy {us:.1f} us",
                 f"{sampled_us / us:.2f}x", "", "stub model: the params' cost alone")
    sm = r["sampling"]
    _row(f"pipeline sampled, {rows} rows", f"{sm['sampled_tps']:.0f} tok/s",
         f"greedy {sm['greedy_tps']:.0f} tok/s", f"{sm['ratio']:.2f}x",
         "", f"step {sm['sampled_step_us']:.0f} us vs {sm['greedy_step_us']:.0f} us; top_p "
         f"{SAMPLED['top_p']}, temperature {SAMPLED['temperature']}; ratio = step time"
         + ("" if sm["checked"] else "; TOKENS DIFFER from the host sampler"))
    return r


# ---- penalties ----

def _penalty_step(rows: int, vocab: int, generated: int, np: Any) -> Dict[str, Any]:
    """A step's device work at ``rows`` x ``vocab`` float32, with and without penalties on every
    row: argmax_to_feed and its event sync, and with penalties either in the pick's own call
    (``penalties=``, what the pipeline queues) or as the apply before it and the update after it.
    Each request has a 200-id prompt, ``generated`` tokens (the table's entries) and 300 logit
    biases. The plain pick is checked against numpy; the two penalised ways, once each on their
    own copy of the logits and their own tables, must leave the same ids, logits and counts."""
    from ..penalties import PenaltyState

    rng = np.random.default_rng(26)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    bufs = [mf.DeviceBuffer(logits.nbytes) for _ in range(2)]  # one call / three calls
    cells = [mf.DeviceBuffer(rows * 4) for _ in range(2)]
    dst, ev = [mf.PinnedBuffer(rows * 4) for _ in range(2)], mf.Event()
    states = [PenaltyState(rows, capacity=generated + 256) for _ in range(2)]
    slots = np.arange(rows, dtype=np.uint32)
    pick = dict(rows=rows, vocab=vocab, dtype="float32")
    try:
        for r in range(rows):
            req = dict(prompt=rng.integers(0, vocab, 200).tolist(),
                       generated=rng.integers(0, vocab, generated).tolist(),
                       logit_bias={int(t): 0.5 for t in rng.choice(vocab, 300, replace=False)}, **PENALTIES)
            for state in states:
                state.set(r, **req)
        for buf in bufs:
            mf.copy_h2d_async(buf, logits)
        launch, apart = (state.prepare(slots, vocab=vocab, dtype="float32") for state in states)

        def plain() -> None:
            mf.argmax_to_feed(bufs[0], None, cells[0], dst[0], ev, 0, **pick)
            ev.synchronize()

        def one_call(buf: Any = bufs[0]) -> None:
            mf.argmax_to_feed(buf, None, cells[0], dst[0], ev, 0, penalties=launch, **pick)
            ev.synchronize()

        def three_calls(buf: Any = bufs[0]) -> None:
            apart.apply(buf)
            mf.argmax_to_feed(buf, None, cells[1], dst[1], None, 0, **pick)
            apart.update(cells[1])
            mf.stream_synchronize()  # the update included, as the one call's event follows it

        plain()
        checked = mf.read_pinned_u32(dst[0].ptr, rows) == logits.argmax(axis=1).tolist()
        one_call(bufs[0])
        three_calls(bufs[1])
        checked = (checked and bytes(dst[0]) == bytes(dst[1]) and _same_bytes(bufs, logits.nbytes, np)
                   and all(states[0].read(r) == states[1].read(r) for r in range(rows)))
        repeats = 7
        times: Dict[str, List[float]] = {"plain": [], "one_call": [], "three_calls": []}
        # Interleaved, all on one tensor of logits already in memory: reloading them before each
        # call would make whichever op runs first pay the write-back of the 39 MB copy, and a
        # second tensor would be colder in the caches. The penalties pile up over the repeats,
        # which changes values, not the work (the same ids every time).
        for _ in range(repeats):
            times["one_call"].append(_timed(one_call))
            times["three_calls"].append(_timed(three_calls))
            times["plain"].append(_timed(plain))
        mf.stream_synchronize()
    finally:
        for obj in (*states, *bufs, *cells, *dst, ev):
            obj.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rows": rows, "vocab": vocab, "generated": generated, "checked": checked,
            "plain_ms": med["plain"], "penalised_ms": med["one_call"], "three_calls_ms": med["three_calls"],
            "ratio": med["one_call"] / med["plain"], "three_calls_ratio": med["three_calls"] / med["plain"],
            "repeats": repeats}


def _same_bytes(bufs: List[Any], nbytes: int, np: Any) -> bool:
    """Whether two device buffers hold the same ``nbytes`` bytes (copied back to the host)."""
    out = [np.empty(nbytes, np.uint8) for _ in bufs]
    for host, buf in zip(out, bufs):
        mf.copy_d2h_async(buf, host)
    mf.stream_synchronize()
    return bool((out[0] == out[1]).all())


def bench_penalties(quick: bool) -> Dict[str, Any]:
    """docs/penalties.md: a device step with penalties on every row against the same step
    without, and the pipeline's host cost per step with penalties against without."""
    import numpy as np

    step = _penalty_step(64, 152064, 1000, np)
    rows, repeats = 64, 3 if quick else 5
    n_steps = 200 if quick else 1000
    plain, penalised, two = float("inf"), float("inf"), float("inf")
    for _ in range(3):  # interleaved runs; the best of each
        plain = min(plain, _pipeline_step_us(rows, n_steps, repeats, penalties=False))
        penalised = min(penalised, _pipeline_step_us(rows, n_steps, repeats, penalties=True))
        two = min(two, _pipeline_step_us(rows, n_steps, repeats, penalties=True, two_calls=True))
    r = {"step": step, "pipeline_us": plain, "pipeline_penalised_us": penalised,
         "pipeline_ratio": penalised / plain, "pipeline_two_calls_us": two,
         "pipeline_two_calls_ratio": two / plain, "checked": step["checked"]}
    _section(f"penalties: every row with repetition, presence, frequency and 300 logit biases, "
             f"{step['generated']} generated tokens a request (median of {step['repeats']})")
    _row(f"step {step['rows']}x{step['vocab']} f32", f"{step['penalised_ms']:.2f} ms",
         f"no penalties {step['plain_ms']:.2f} ms", f"{step['ratio']:.2f}x", "<= 1.2x",
         "argmax_to_feed(penalties=) + event sync" + ("" if step["checked"] else "; RESULTS DIFFER"))
    _row("  as three calls", f"{step['three_calls_ms']:.2f} ms", f"no penalties {step['plain_ms']:.2f} ms",
         f"{step['three_calls_ratio']:.2f}x", "", "apply, argmax_to_feed, update: the rows' applies all at once")
    _row(f"pipeline Python/step, {rows} rows", f"{penalised:.1f} us", f"no penalties {plain:.1f} us",
         f"{r['pipeline_ratio']:.2f}x", "<= 1.1x", "stub with a real pick over 256 ids, penalties in its call")
    _row("  as two more calls a step", f"{two:.1f} us", f"no penalties {plain:.1f} us",
         f"{r['pipeline_two_calls_ratio']:.2f}x", "", "a model whose feed methods take no penalties=")
    return r


# ---- interop: a call given a tensor, and a real model through the feed ----

def _find_example(name: str) -> Any:
    """examples/<name> of a source checkout (the working directory's, or the package's), or None."""
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.getcwd(), os.path.join(here, "..", "..")):
        path = os.path.join(root, "examples", name)
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(name[:-3], path)
            module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
            spec.loader.exec_module(module)  # type: ignore[union-attr]
            return module
    return None


def _tensor_call_ns(quick: bool) -> Dict[str, Any]:
    """Best ns per argmax_to_feed of one 16-id row given a DeviceBuffer, a numpy array and (when
    installed) a torch tensor: the same call, interleaved, with the worker parked."""
    from array import array

    import numpy as np

    ns = _call_namespace()
    ns["np_logits"] = np.zeros((1, 16), np.float32)
    ns["np_cells"] = np.zeros(1, np.uint32)
    calls = [("DeviceBuffer", "argmax_to_feed(logits16, masks1, cells1, dst4, None, rows=1, vocab=16, "
                              "dtype='float32')"),
             ("numpy array", "argmax_to_feed(np_logits, masks1, cells1, dst4, None)"),
             ("numpy array, numpy cells", "argmax_to_feed(np_logits, masks1, np_cells, dst4, None)")]
    if importlib.util.find_spec("torch") is not None:
        import torch

        ns["t_logits"] = torch.zeros(1, 16)
        ns["t_cells"] = torch.zeros(1, dtype=torch.int32)
        calls += [("torch tensor", "argmax_to_feed(t_logits, masks1, cells1, dst4, None)"),
                  ("torch tensor, torch cells", "argmax_to_feed(t_logits, masks1, t_cells, dst4, None)")]
    ns["masks1"] = array("I", [3, NO_TOKEN])
    best: Dict[str, float] = {}
    try:
        for _ in range(15 if quick else 40):
            for name, stmt in calls:
                t = _time_call(stmt, True, ns, 0)
                best[name] = min(best.get(name, t), t)
    finally:
        mf.stream_synchronize(0)
    return best


def _llama_level(hf: Any, model: Any, prompts: Any, bans: Any, max_new: int, work: float,
                 kind: str, repeats: int) -> Dict[str, Any]:
    from . import demo

    fast, slow = [], []
    for _ in range(repeats):  # interleaved; the best of each
        for router, out in (("async", fast), ("sync", slow)):
            feed = hf.HfLlamaFeed(model, max_rows=len(prompts))
            requests = [{"prompt": p, "mask": b, "stop": NO_TOKEN} for p, b in zip(prompts, bans)]
            run = demo.run_async if router == "async" else demo.run_sync
            try:
                out.append(run(feed, requests, max_new, work, work_kind=kind))
            finally:
                feed.close()
    a, s = min(fast, key=lambda r: r["seconds"]), min(slow, key=lambda r: r["seconds"])
    tokens = sum(len(t) for t in a["tokens"])
    return {"host_work_us": work, "kind": kind, "async_tps": tokens / a["seconds"],
            "sync_tps": tokens / s["seconds"], "speedup": s["seconds"] / a["seconds"],
            "same_tokens": a["tokens"] == s["tokens"], "sync_step_us": s["seconds"] / s["steps"] * 1e6}


def bench_interop(quick: bool) -> Dict[str, Any]:
    calls = _tensor_call_ns(quick)
    base = calls["DeviceBuffer"]
    _section("a call given a tensor: argmax_to_feed of 1 x 16 float32 (best ns per call, worker parked)")
    for name, t in calls.items():
        _row(name, f"{t:.0f} ns", "" if name == "DeviceBuffer" else f"DeviceBuffer {base:.0f} ns",
             "" if name == "DeviceBuffer" else f"{t / base:.2f}x", "" if name == "DeviceBuffer" else "<= 2x")
    r: Dict[str, Any] = {"call_ns": calls}
    hf = None
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
        hf = _find_example("hf_llama.py")
    if hf is None:
        print("  (real model skipped: needs torch, transformers and a source checkout's examples/)")
        return r
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one torch thread; the simulated device gets one core
    mf.host_kernel_threads(1)
    try:
        model = hf.small_llama(torch.float32)
        rows, max_new, repeats = 4, 16 if quick else 32, 2 if quick else 3
        prompts = [[1 + r, 2, 3 + r, 4] for r in range(rows)]
        bans = [(NO_TOKEN, NO_TOKEN)] * rows
        _llama_level(hf, model, prompts, bans, 4, 0.0, "sleep", 1)  # warm-up
        levels = [_llama_level(hf, model, prompts, bans, max_new, 0.0, "sleep", repeats)]
        step = levels[0]["sync_step_us"]
        levels += [_llama_level(hf, model, prompts, bans, max_new, step, k, repeats) for k in ("sleep", "spin")]
    finally:
        torch.set_num_threads(threads)
        mf.host_kernel_threads(0)
    r["llama"] = {"rows": rows, "max_new": max_new, "step_us": step, "levels": levels}
    _section(f"a transformers Llama (2 layers, vocab 256) through the feed: {rows} rows, {max_new} new "
             f"tokens, 1 torch thread, 1 device thread (best of {repeats}); ratio = async / sync")
    _row("sync step, no host work", f"{step:.0f} us")
    for i, lv in enumerate(levels):
        _row(f"host work {lv['host_work_us']:.0f} us {lv['kind']}", f"{lv['async_tps']:.0f} tok/s",
             f"sync {lv['sync_tps']:.0f} tok/s", f"{lv['speedup']:.2f}x", ">= 1.6x" if i == 1 else "",
             "" if lv["same_tokens"] else "TOKENS DIFFER")
    return r


# ---- 5. graphs ----

def _fed_steps(graphs: bool, rows: int, vocab: int, steps: int) -> Dict[str, Any]:
    """``steps`` fed steps of the reference model through the trait, one at a time: the host time
    to queue each (decode_batch_fed + argmax_batch_to_feed) and the time until its event, and the
    ids of every step."""
    from ..feed import FeedSource
    from ..kv import SequenceState
    from ..testing.reference import ReferenceModel

    model = ReferenceModel(vocab, block_size=16, num_blocks=rows * (steps // 16 + 3), max_rows=rows,
                           graphs=graphs)
    seqs = [SequenceState(r) for r in range(rows)]
    dst, event = mf.PinnedBuffer(rows * 4), mf.Event()
    sources = [FeedSource.feed(r) for r in range(rows)]
    masks = [(NO_TOKEN, NO_TOKEN)] * rows
    queue_us: List[float] = []
    step_us: List[float] = []
    ids: List[List[int]] = []
    try:
        for r, seq in enumerate(seqs):
            model.prefill(seq, [r + 1, 2 * r + 3])
        model.decode_batch([5] * rows, seqs)
        model.argmax_batch_to_feed(model.logits.ptr, masks, dst.ptr, event.handle, 0)
        event.synchronize()
        last = mf.read_pinned_u32(dst.ptr, rows)
        for _ in range(steps):
            model.cover_decode_blocks(seqs)  # the scheduler's reservation, outside the timing
            start = time.perf_counter()
            logits = model.decode_batch_fed(sources, seqs, 0)
            model.argmax_batch_to_feed(logits, masks, dst.ptr, event.handle, 0)
            queued = time.perf_counter()
            event.synchronize()
            done = time.perf_counter()
            queue_us.append((queued - start) * 1e6)
            step_us.append((done - start) * 1e6)
            for seq, token in zip(seqs, last):
                seq.tokens.append(token)
                seq.seq_len += 1
            last = mf.read_pinned_u32(dst.ptr, rows)
            ids.append(last)
            model.fed_step_settled()
        stats = model.graph_stats
    finally:
        model.close()
        dst.close()
        event.close()
    return {"queue_us": statistics.median(queue_us[1:]), "step_us": statistics.median(step_us[1:]),
            "ids": ids, "stats": stats}


def bench_graphs(quick: bool) -> Dict[str, Any]:
    """The reference model's fed step (resolve, forward, argmax, readback, event) launched as one
    graph vs the same operations queued one by one, on the host backend. Small rows and vocabulary,
    so the figure is the cost of queueing, not of the kernels. Checked: the same ids."""
    rows, vocab, steps = 8, 4096, 40 if quick else 200
    eager = _fed_steps(False, rows, vocab, steps)
    graph = _fed_steps(True, rows, vocab, steps)
    r = {"rows": rows, "vocab": vocab, "steps": steps, "checked": eager["ids"] == graph["ids"],
         "eager_queue_us": eager["queue_us"], "graph_queue_us": graph["queue_us"],
         "eager_step_us": eager["step_us"], "graph_step_us": graph["step_us"],
         "captures": graph["stats"]["captures"], "launches": graph["stats"]["launches"]}
    _section(f"graphs, reference model fed step: {rows} rows, vocab {vocab}, host backend "
             f"(median of {steps} steps); ratio = graph / one by one")
    _row("queue the step, one by one", f"{r['eager_queue_us']:.0f} us")
    _row("queue the step, graph launch", f"{r['graph_queue_us']:.0f} us", "one by one",
         f"{r['graph_queue_us'] / r['eager_queue_us']:.2f}x", "",
         "host re-issues each call" if r["checked"] else "IDS DIFFER")
    _row("step until its event, one by one", f"{r['eager_step_us']:.0f} us")
    _row("step until its event, graph", f"{r['graph_step_us']:.0f} us", "one by one",
         f"{r['graph_step_us'] / r['eager_step_us']:.2f}x")
    return r


# ---- the command ----

def machine() -> Dict[str, Any]:
    import numpy as np

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "backend": mf.backend(),
            "build": mf.build_info(), "metrale_feed": mf.__version__}


def bench_tp(world: int, quick: bool) -> Dict[str, Any]:
    """``--tp N``: the sharded argmax over N local ranks beside its two baselines (bench_tp.py)."""
    from . import bench_tp as tp

    result = tp.run(world, quick)
    vocab = result["sizes"][0]["vocab"] if result["sizes"] else tp.VOCAB
    _section(f"tensor parallel, {world} ranks x {vocab // world} ids, float32, gloo, "
             f"ranks on the {result['backend']} backend")
    for e in result["sizes"]:
        name = f"sharded argmax {e['rows']}x{e['vocab']}"
        _row(name, f"{e['sharded_ms']:.2f} ms", f"gather logits {e['gather_ms']:.2f} ms",
             f"{e['gather_ms'] / e['sharded_ms']:.1f}x", ">= 10x")
        _row("", "", f"torch by hand {e['hand_ms']:.2f} ms", f"{e['hand_ms'] / e['sharded_ms']:.1f}x",
             ">= 2x")
        _row("  bytes sent per rank", f"{e['sharded_bytes_per_step']}",
             f"gather {e['gather_bytes_per_step']}", "", "",
             f"by hand {e['hand_bytes_per_step']}; ids {'checked' if e['checked'] else 'DIFFER'}")
        _row(f"sharded verify {e['verify_rows']} rows k {e['verify_k']}", f"{e['verify_ms']:.2f} ms",
             f"sharded argmax, same {e['rows']} rows {e['verify_argmax_ms']:.2f} ms",
             f"{e['verify_ms'] / e['verify_argmax_ms']:.2f}x", "",
             f"{e['verify_collectives_per_call']} collective, {e['verify_bytes_per_call']} B; cells "
             f"{'checked' if e['verify_checked'] else 'DIFFER'}")
        _row("  sampled, temperature 0.8", f"{e['verify_sampled_ms']:.2f} ms",
             f"sharded sample, same {e['rows']} rows {e['verify_sample_ms']:.2f} ms",
             f"{e['verify_sampled_ms'] / e['verify_sample_ms']:.2f}x", "",
             f"{e['verify_sampled_collectives_per_call']} collectives, {e['verify_sampled_bytes_per_call']} B; "
             f"cells {'checked' if e['verify_sampled_checked'] else 'DIFFER'}")
        _row(f"sharded top_logprobs n {e['top_n']} {e['rows']} rows", f"{e['top_sharded_ms']:.2f} ms",
             f"gather logits + unsharded {e['top_gather_ms']:.2f} ms",
             f"{e['top_gather_ms'] / e['top_sharded_ms']:.2f}x", "",
             f"{e['top_collectives_per_call']} collective, {e['top_bytes_per_call'] / e['rows']:.0f} B/row; "
             f"ids {'checked' if e['top_checked'] else 'DIFFER'}")
        _row(f"sharded top_k 50 top_p 0.9 {e['rows']} rows", f"{e['filtered_sharded_ms']:.2f} ms",
             f"gather logits + unsharded {e['filtered_gather_ms']:.2f} ms",
             f"{e['filtered_gather_ms'] / e['filtered_sharded_ms']:.2f}x", ">= 3x",
             f"{e['filtered_collectives_per_call']} collectives, "
             f"{e['filtered_bytes_per_call'] / e['rows']:.0f} B/row; ids "
             f"{'checked' if e['filtered_checked'] else 'DIFFER'}")
        _row("", "", f"unsharded, 1 rank {e['filtered_unsharded_ms']:.2f} ms",
             f"{e['filtered_unsharded_ms'] / e['filtered_sharded_ms']:.2f}x", "",
             f"one gloo all-gather of 16 B: {e['gloo_collective_us']:.0f} us")
        _row(f"sharded top_p 0.9 alone {e['rows']} rows", f"{e['radix_sharded_ms']:.2f} ms",
             f"gather logits + unsharded {e['radix_gather_ms']:.2f} ms",
             f"{e['radix_gather_ms'] / e['radix_sharded_ms']:.2f}x", ">= 3x",
             f"{e['radix_collectives_per_call']} collectives (4 rounds, decided on the stream), "
             f"{e['radix_bytes_per_call'] / e['rows']:.0f} B/row; ids "
             f"{'checked' if e['radix_checked'] else 'DIFFER'}")
        _row("", "", f"unsharded, 1 rank {e['radix_unsharded_ms']:.2f} ms",
             f"{e['radix_unsharded_ms'] / e['radix_sharded_ms']:.2f}x", "", "")
        _row(f"sharded top_k 50 top_p 0.9, fixed rounds (top_k 64, top_p) {e['rows']} rows",
             f"{e['fixed_sharded_ms']:.2f} ms", f"gather logits + unsharded {e['fixed_gather_ms']:.2f} ms",
             f"{e['fixed_gather_ms'] / e['fixed_sharded_ms']:.2f}x", ">= 3x",
             f"{e['fixed_collectives_per_call']} collectives whatever the params, "
             f"{e['fixed_bytes_per_call'] / e['rows']:.0f} B/row; ids "
             f"{'checked' if e['fixed_checked'] else 'DIFFER'}")
    return result


def main(args: Any) -> int:
    start = time.perf_counter()
    if getattr(args, "tp", None):
        print(f"metrale-feed bench --tp {args.tp}{' --quick' if args.quick else ''}")
        record = {"tp": bench_tp(args.tp, args.quick), "seconds": time.perf_counter() - start}
        missed = [name for name, mark in _VERDICTS if mark != "met"]
        print(f"\ntargets: {len(_VERDICTS) - len(missed)} of {len(_VERDICTS)} met"
              + (f"; missed or not measured: {', '.join(missed)}" if missed else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
        return 0 if all(e["checked"] for e in record["tp"]["sizes"]) else 1
    default = mf.backend()
    if default != "host":
        mf.set_backend("host")  # the record is of the host backend, on a GPU machine too
    info = dict(machine(), default_backend=default)
    print(f"metrale-feed bench{' --quick' if args.quick else ''}: host backend, "
          f"{info['cpu_count']} CPUs, numpy {info['numpy']}, Python {info['python']}")
    record: Dict[str, Any] = {"machine": info, "quick": bool(args.quick)}
    record["import"] = bench_import(3 if args.quick else 5)
    record["calls"] = bench_calls(args.quick)
    record["cimport"] = bench_cimport(args.quick)
    record.update(bench_argmax(args.quick))
    record["argmax_options"] = bench_pick_options(args.quick)
    record["sampling"] = bench_sampling(args.quick, bool(getattr(args, "peaked", False)))
    record["router"] = bench_router(args.quick)
    record["penalties"] = bench_penalties(args.quick)
    record["interop"] = bench_interop(args.quick)
    record["graphs"] = bench_graphs(args.quick)
    from .bench_spec import bench_speculative

    record["speculative"] = bench_speculative(args.quick)
    record["seconds"] = time.perf_counter() - start
    missed = [name for name, mark in _VERDICTS if mark != "met"]
    record["targets"] = {"met": len(_VERDICTS) - len(missed), "missed": missed}
    print(f"\ntargets: {len(_VERDICTS) - len(missed)} of {len(_VERDICTS)} met"
          + (f"; missed or not measured: {', '.join(missed)}" if missed else ""))
    print(f"{record['seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"figures written to {args.json}")
    ok = (all(e["checked"] for e in record["argmax"]) and record["argmax_options"]["checked"]
          and record["sampling"]["checked"]
          and all(lv["same_tokens"] for lv in record["router"]["levels"])
          and all(lv["same_tokens"] for lv in record["interop"].get("llama", {}).get("levels", []))
          and record["router"]["sampling"]["checked"]
          and record["penalties"]["checked"]
          and record["graphs"]["checked"]
          and record["speculative"]["checked"])
    if not ok:
        print("a correctness check failed: argmax ids or router tokens differ (sampled ones "
              "included)", file=sys.stderr)
    return 0 if ok else 1
