"""Interop: a call given a tensor, and a real model through the feed."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict

import metrale_feed as mf

from .report import NO_TOKEN, row, section
from .calls import call_namespace, time_call

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

    ns = call_namespace()
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
                t = time_call(stmt, True, ns, 0)
                best[name] = min(best.get(name, t), t)
    finally:
        mf.stream_synchronize(0)
    return best


def _llama_level(hf: Any, model: Any, prompts: Any, bans: Any, max_new: int, work: float,
                 kind: str, repeats: int) -> Dict[str, Any]:
    from .. import demo

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
    section("a call given a tensor: argmax_to_feed of 1 x 16 float32 (best ns per call, worker parked)")
    for name, t in calls.items():
        row(name, f"{t:.0f} ns", "" if name == "DeviceBuffer" else f"DeviceBuffer {base:.0f} ns",
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
    section(f"a transformers Llama (2 layers, vocab 256) through the feed: {rows} rows, {max_new} new "
             f"tokens, 1 torch thread, 1 device thread (best of {repeats}); ratio = async / sync")
    row("sync step, no host work", f"{step:.0f} us")
    for i, lv in enumerate(levels):
        row(f"host work {lv['host_work_us']:.0f} us {lv['kind']}", f"{lv['async_tps']:.0f} tok/s",
             f"sync {lv['sync_tps']:.0f} tok/s", f"{lv['speedup']:.2f}x", ">= 1.6x" if i == 1 else "",
             "" if lv["same_tokens"] else "TOKENS DIFFER")
    return r


