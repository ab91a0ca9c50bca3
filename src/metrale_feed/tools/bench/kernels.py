"""The kernels on the host backend: the masked argmax against numpy and the memory bandwidth, the
pick's options, sampling against the argmax (flat and peaked logits), and penalties."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Optional

import metrale_feed as mf
from metrale_feed import _core

from .report import LARGE, row, section, timed
from .pipeline import PENALTIES, pipeline_step_us

# Each kernel's floor (feed.h's mf_host_floor): a loop of only its rule's per-id arithmetic, eight
# lanes at a time, no bookkeeping, over the same logits. The race's floor is the counter hash of
# every id ("hash"; the log of its score is drawn only where an exact bound cannot rule the id
# out, "race" draws it for every id); top_p's adds every id's mass against the row's max
# ("top_p"; "top_p_log" with the log too); the logprobs' is the max and the fixed-order sum.
FLOORS = {"temperature": ("hash", "race"), "top_p": ("top_p", "top_p_log"), "logprobs": ("stats",)}


def floor_runs(arr: Any) -> Dict[str, Callable[[], Any]]:
    """The floor loops over ``arr`` (C-contiguous float32 rows), as timed calls; none where the
    CPU has no vector path for them."""
    if _core._host_floor("hash", arr[:1, :16]) is None:
        return {}
    names = sorted({n for group in FLOORS.values() for n in group})
    return {f"floor/{n}": (lambda n=n: _core._host_floor(n, arr)) for n in names}


def floor_note(kernel_ms: float, floors: Dict[str, float], case: str) -> str:
    """The kernel against its floors, for a row's note: "floor hash 4.1x argmax, kernel 1.2x it"."""
    parts = [f"floor {n} {floors[n]:.2f}x, kernel {kernel_ms / floors[n]:.2f}x it"
             for n in FLOORS.get(case, ()) if n in floors]
    return "; ".join(parts)


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
            one = min(one, timed(a.max))
            many = min(many, timed(lambda: list(pool.map(np.max, blocks))))
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
                times.setdefault(f"{d}/{threads}", []).append(timed(ours[d]))
            arr = arrays[ref[d]]
            times.setdefault(f"np/{d}", []).append(timed(lambda: arr.argmax(axis=1)))
            if torch is not None:
                t = torch.from_numpy(arrays[d])
                t = t.view(torch.bfloat16) if d == "bfloat16" else t
                times.setdefault(f"torch/{d}", []).append(timed(lambda: torch.argmax(t, dim=1)))
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
        row(f"{short} {e['rows']}x{e['vocab']} {'1 thread' if n == '1' else 'all cores'}",
             f"{e[f'ms_{n}']:.2f} ms", f"numpy {'f32(wide)' if short == 'bf16' else short} "
             f"{e['numpy_ms']:.2f} ms", f"{e[f'ratio_{n}']:.2f}x", target, note)
        if e["dtype"] == "bfloat16":
            row("", "", f"numpy f16 {e['numpy_f16_ms']:.2f} ms", f"{e[f'ratio_f16_{n}']:.2f}x",
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
    section(f"read bandwidth ({bw['method']} over {bw['bytes'] / 1e6:.0f} MB, "
             f"best of {bw_repeats})")
    row("1 thread", f"{bw['gbps_1']:.1f} GB/s")
    row(f"{threads} threads", f"{bw['gbps_all']:.1f} GB/s")
    section(f"masked argmax_to_feed + event sync, host backend (median of {repeats}); "
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
        runs.update(floor_runs(arr))
        times: Dict[str, List[float]] = {k: [] for k in runs}
        for _ in range(repeats):
            for k, run in runs.items():
                times[k].append(timed(run))
    finally:
        for b in (dev, cells, dst, ev, lp_dev, lp_dst, *bit_dev.values()):
            b.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    floors = {k[len("floor/"):]: med[k] / med["argmax"] for k in med if k.startswith("floor/")}
    result = {"rows": rows, "vocab": vocab, "checked": checked, "ms": med,
              "ratio": {k: med[k] / med["argmax"] for k in ("bitmask", "logprobs", "temperature", "top_p")},
              "floor_ratio": floors}
    section(f"argmax options at {rows}x{vocab} float32, host backend (median of {repeats}); "
             "ratio = time / the masked argmax's; floor = the rule's own arithmetic alone, as a ratio")
    row("masked argmax", f"{med['argmax']:.2f} ms")
    for k, target in (("bitmask", "<= 1.15x"), ("logprobs", "<= 2x"), ("temperature", "<= 1.5x"), ("top_p", "<= 3x")):
        label = {"bitmask": "+ bitmask (random words)", "logprobs": "+ logprobs (with readback)",
                 "temperature": "sample, temperature 1",
                 "top_p": "sample, top_p 0.9"}[k]
        row(label, f"{med[k]:.2f} ms", "", f"{result['ratio'][k]:.2f}x", target,
            floor_note(result["ratio"][k], floors, k))
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
    runs.update(floor_runs(arr))
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
                    times[k].append(timed(run))
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
        # The floors of the cases without top_k (with it, the bounded selection skips the rest).
        case = {"temperature 1": "temperature", "top_p 0.9": "top_p"}.get(name, "")
        e["floor_ratio"] = {n: statistics.median([f / a for f, a in zip(times[f"floor/{n}"], times["argmax"])])
                            for n in FLOORS.get(case, ()) if f"floor/{n}" in times}
        e["floor_note"] = floor_note(e["ratio"], e["floor_ratio"], case)
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
    section(f"sample_to_feed against the masked argmax over the same float32 logits, host backend, "
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
            row(f"{kind} {rows}x{vocab}: argmax", f"{block[0]['argmax_ms']:.2f} ms")
            for e in block:
                row(f"  {e['case']}", f"{e['ms']:.2f} ms", "", f"{e['ratio']:.2f}x", e["target"],
                     f"minima {e['ratio_of_minima']:.2f}x"
                     + (f"; {e['floor_note']}" if e["floor_note"] else "")
                     + ("" if e["checked"] else "; IDS DIFFER from the portable path"))
                if e["torch_ms"] is not None:
                    row("", f"{e['torch_ms']:.2f} ms", "torch recipe, 1 thread", f"{e['torch_ratio']:.2f}x")
    return {"entries": entries, "torch": getattr(torch, "__version__", None), "repeats": repeats,
            "checked": all(e["checked"] for e in entries)}



# ---- penalties ----

def _penalty_step(rows: int, vocab: int, generated: int, np: Any) -> Dict[str, Any]:
    """A step's device work at ``rows`` x ``vocab`` float32, with and without penalties on every
    row: argmax_to_feed and its event sync, and with penalties either in the pick's own call
    (``penalties=``, what the pipeline queues) or as the apply before it and the update after it.
    Each request has a 200-id prompt, ``generated`` tokens (the table's entries) and 300 logit
    biases. The plain pick is checked against numpy; the two penalised ways, once each on their
    own copy of the logits and their own tables, must leave the same ids, logits and counts."""
    from ...penalties import PenaltyState

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
            times["one_call"].append(timed(one_call))
            times["three_calls"].append(timed(three_calls))
            times["plain"].append(timed(plain))
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
        plain = min(plain, pipeline_step_us(rows, n_steps, repeats, penalties=False))
        penalised = min(penalised, pipeline_step_us(rows, n_steps, repeats, penalties=True))
        two = min(two, pipeline_step_us(rows, n_steps, repeats, penalties=True, two_calls=True))
    r = {"step": step, "pipeline_us": plain, "pipeline_penalised_us": penalised,
         "pipeline_ratio": penalised / plain, "pipeline_two_calls_us": two,
         "pipeline_two_calls_ratio": two / plain, "checked": step["checked"]}
    section(f"penalties: every row with repetition, presence, frequency and 300 logit biases, "
             f"{step['generated']} generated tokens a request (median of {step['repeats']})")
    row(f"step {step['rows']}x{step['vocab']} f32", f"{step['penalised_ms']:.2f} ms",
         f"no penalties {step['plain_ms']:.2f} ms", f"{step['ratio']:.2f}x", "<= 1.2x",
         "argmax_to_feed(penalties=) + event sync" + ("" if step["checked"] else "; RESULTS DIFFER"))
    row("  as three calls", f"{step['three_calls_ms']:.2f} ms", f"no penalties {step['plain_ms']:.2f} ms",
         f"{step['three_calls_ratio']:.2f}x", "", "apply, argmax_to_feed, update: the rows' applies all at once")
    row(f"pipeline Python/step, {rows} rows", f"{penalised:.1f} us", f"no penalties {plain:.1f} us",
         f"{r['pipeline_ratio']:.2f}x", "<= 1.1x", "stub with a real pick over 256 ids, penalties in its call")
    row("  as two more calls a step", f"{two:.1f} us", f"no penalties {plain:.1f} us",
         f"{r['pipeline_two_calls_ratio']:.2f}x", "", "a model whose feed methods take no penalties=")
    return r


