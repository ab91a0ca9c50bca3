"""``metrale-feed bench``'s speculative-decoding section (docs/speculative.md), side by side in
one run: ``verify_to_feed`` over ``rows * (k + 1)`` logit rows against ``argmax_to_feed`` over the
same rows, and the pipeline's tokens per second with speculation against without, on the
reference model, with the tokens checked equal."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import metrale_feed as mf

from .report import row, section


def _median_ms(fn: Any, repeats: int) -> float:
    times: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def _verify_beside_argmax(rows: int, k: int, vocab: int, repeats: int,
                          agree: float) -> Dict[str, Any]:
    import numpy as np

    logit_rows = rows * (k + 1)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((logit_rows, vocab), dtype=np.float32)
    # Drafts that are the argmax at their position with probability ``agree`` (1: every
    # position of every row is decided, the most work).
    best = logits.argmax(axis=1).astype(np.uint32).reshape(rows, k + 1)[:, :k]
    drafts = np.where(rng.random((rows, k)) < agree, best, (best + 1) % vocab).astype(np.uint32)
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(logit_rows * 4) as cells, \
            mf.DeviceBuffer(rows * k * 4) as ddrafts, mf.PinnedBuffer(logit_rows * 4) as out, \
            mf.DeviceBuffer(rows * (k + 2) * 4) as vcells, \
            mf.PinnedBuffer(rows * (k + 2) * 4) as vout, mf.Event() as done:
        mf.copy_h2d_async(dev, logits)
        mf.copy_h2d_async(ddrafts, drafts)
        mf.stream_synchronize()

        def argmax() -> None:
            mf.argmax_to_feed(dev, None, cells, out, done, rows=logit_rows, vocab=vocab,
                              dtype="float32")
            done.synchronize()

        def verify() -> None:
            mf.verify_to_feed(dev, ddrafts, vcells, vout, done, k=k, rows=rows, vocab=vocab,
                              dtype="float32")
            done.synchronize()

        argmax()
        verify()
        # Copies, so no view of the pinned buffers outlives them.
        ids = np.frombuffer(out, np.uint32)[:logit_rows].reshape(rows, k + 1).copy()
        cell = np.frombuffer(vout, np.uint32).reshape(rows, k + 2).copy()
        checked = True  # the verify cells against the argmax ids of the same rows
        for r in range(rows):
            m = 0
            while m < k and drafts[r, m] == ids[r, m]:
                m += 1
            want = [m + 1] + list(ids[r, : m + 1]) + [mf.NO_TOKEN] * (m < k)  # k + 2 words
            checked &= cell[r, : len(want)].tolist() == [int(x) for x in want]
        t_argmax = _median_ms(argmax, repeats)
        t_verify = _median_ms(verify, repeats)
    return {"rows": rows, "k": k, "vocab": vocab, "agree": agree, "argmax_ms": t_argmax,
            "verify_ms": t_verify,
            "ratio": t_verify / t_argmax, "checked": bool(checked)}


def _verify_penalised(rows: int, k: int, vocab: int, repeats: int) -> Dict[str, Any]:
    """A verify of ``rows * (k + 1)`` float32 logit rows with penalties on every row, then the
    event sync, against the same verify without: in the verify's own call
    (``verify_to_feed(penalties=)``, what the pipeline queues), and as three calls (the apply
    that walks each row's drafts, the verify, the update with its cells). Each side's drafts are
    its own rule's picks at every position (the penalised ones found position by position, each
    with the drafts before it), so both decide every position: the most verify work. Every
    penalised repeat starts from the same logits and counts (copied back untimed), and its cells
    are checked."""
    import numpy as np

    from ...penalties import PenaltyState
    from .pipeline import PENALTIES

    logit_rows = rows * (k + 1)
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((logit_rows, vocab), dtype=np.float32)
    slots = list(range(rows))
    plain_drafts = logits.argmax(axis=1).astype(np.uint32).reshape(rows, k + 1)[:, :k].copy()
    nbytes = logits.nbytes
    state = PenaltyState(rows, capacity=1300)
    bufs = [mf.DeviceBuffer(nbytes) for _ in range(2)]  # the logits as given; the penalised copy
    saved = [mf.DeviceBuffer(b.nbytes) for b in (state.state, state.table)]
    with mf.DeviceBuffer(rows * k * 4) as dplain, mf.DeviceBuffer(rows * k * 4) as dpen, \
            mf.DeviceBuffer(rows * (k + 2) * 4) as vcells, mf.PinnedBuffer(rows * (k + 2) * 4) as vout, \
            mf.Event() as done:
        try:
            lines = 0  # the distinct 64-byte lines of a row that a slot's penalties write
            for r in range(rows):
                req = dict(prompt=rng.integers(0, vocab, 200).tolist(),
                           generated=rng.integers(0, vocab, 1000).tolist(),
                           logit_bias={int(t): 0.5 for t in rng.choice(vocab, 300, replace=False)})
                state.set(r, **req, **PENALTIES)
                touched = set(req["prompt"]) | set(req["generated"]) | set(req["logit_bias"])
                lines += len({t * 4 // 64 for t in touched})
            mf.copy_h2d_async(bufs[0], logits)
            mf.copy_h2d_async(dplain, plain_drafts)
            for dst, src in zip(saved, (state.state, state.table)):
                mf.copy_d2d_async(dst, src, src.nbytes)
            launch = state.prepare(slots, vocab=vocab, dtype="float32", k=k)
            # The penalised picks position by position: position j's walk reads drafts 0 .. j-1,
            # found before it (a float32 argmax, first maximum: the verify's greedy rule).
            drafts = plain_drafts.copy()
            penalised = np.empty_like(logits)
            for j in range(k + 1):
                mf.copy_h2d_async(dpen, drafts)
                mf.copy_d2d_async(bufs[1], bufs[0], nbytes)
                launch.apply(bufs[1], 0, dpen)
                mf.copy_d2h_async(bufs[1], penalised)
                mf.stream_synchronize()
                if j < k:
                    drafts[:, j] = penalised.reshape(rows, k + 1, vocab)[:, j].argmax(axis=1)
            mf.copy_h2d_async(dpen, drafts)
            want = np.concatenate([np.full((rows, 1), k + 1, np.uint32),
                                   penalised.argmax(axis=1).astype(np.uint32).reshape(rows, k + 1)], axis=1)

            def restore() -> None:  # untimed: the same logits and counts for every repeat
                mf.copy_d2d_async(bufs[1], bufs[0], nbytes)
                for src, dst in zip(saved, (state.state, state.table)):
                    mf.copy_d2d_async(dst, src, src.nbytes)
                mf.stream_synchronize()

            def plain() -> None:
                mf.verify_to_feed(bufs[0], dplain, vcells, vout, done, k=k, rows=rows, vocab=vocab,
                                  dtype="float32")
                done.synchronize()

            def with_penalties() -> None:  # one call
                mf.verify_to_feed(bufs[1], dpen, vcells, vout, done, k=k, rows=rows, vocab=vocab,
                                  dtype="float32", penalties=launch)
                done.synchronize()

            def three_calls() -> None:
                launch.apply(bufs[1], 0, dpen)
                mf.verify_to_feed(bufs[1], dpen, vcells, vout, None, k=k, rows=rows, vocab=vocab,
                                  dtype="float32")
                launch.update(vcells, 0)
                done.record(0)
                done.synchronize()

            times: Dict[str, List[float]] = {"plain": [], "penalised": [], "three_calls": []}
            checked, counted = True, True
            for _ in range(repeats):  # interleaved
                for name, fn in (("penalised", with_penalties), ("three_calls", three_calls)):
                    restore()
                    times[name].append(_median_ms(fn, 1))
                    cells = np.frombuffer(vout, np.uint32).reshape(rows, k + 2).copy()
                    checked &= bool((cells == want).all())
                    # the update: the emitted ids
                    counted &= state.read(0)["generated"] == 1000 + k + 1
                times["plain"].append(_median_ms(plain, 1))
                cells = np.frombuffer(vout, np.uint32).reshape(rows, k + 2).copy()
                checked &= bool((cells[:, 0] == k + 1).all())
        finally:
            mf.stream_synchronize()
            for obj in (state, *bufs, *saved):
                obj.close()
    med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    return {"rows": rows, "k": k, "vocab": vocab, "plain_ms": med["plain"],
            "penalised_ms": med["penalised"], "ratio": med["penalised"] / med["plain"],
            "three_calls_ms": med["three_calls"],
            "three_calls_ratio": med["three_calls"] / med["plain"],
            # What the lines the penalties write would add to a verify bound by memory bandwidth
            # if none of their write-back overlapped the verify's reads: each goes back to memory
            # once more (k + 1 logit rows a slot). An upper bound, not a floor: written behind
            # the stream's reads, most of it overlaps them (docs/speculative.md, "Penalties").
            "written_lines_per_row": lines / rows,
            "floor_ratio": 1 + lines * 64 / (rows * vocab * 4),
            "checked": bool(checked and counted), "repeats": repeats}


def _pipeline_tps(vocab: int, rows: int, max_new: int, k: int, acceptance: float,
                  repeats: int) -> Dict[str, Any]:
    from ...testing.drafter import ReferenceDrafter
    from ...testing.reference import ReferenceModel

    prompts = [[i + 1, 2, 3, i % 7] for i in range(rows)]
    runs: Dict[str, Any] = {}
    with ReferenceModel(vocab, max_rows=rows, block_size=16, num_blocks=4096) as model:
        for _ in range(repeats):  # interleaved; the best of each
            for name, depth, spec in (("plain depth 2", 2, None), ("plain depth 1", 1, None),
                                      ("speculative", 1, ReferenceDrafter(vocab, k, acceptance)),
                                      ("speculative depth 2", 2,
                                       ReferenceDrafter(vocab, k, acceptance))):
                with mf.DecodePipeline(model, rows, depth=depth, speculative=spec) as pipe:
                    reqs = [pipe.submit(p, max_new_tokens=max_new) for p in prompts]
                    start = time.perf_counter()
                    pipe.run()
                    seconds = time.perf_counter() - start
                    stats = pipe.stats.as_dict()
                tokens = [r.tokens for r in reqs]
                if name not in runs or seconds < runs[name]["seconds"]:
                    runs[name] = {"seconds": seconds, "tokens": tokens, "steps": stats["steps"],
                                  "host_syncs": stats["host_syncs"],
                                  "accepted": stats["accepted"], "drafted": stats["drafted"]}
    total = rows * max_new
    same = all(run["tokens"] == runs["plain depth 1"]["tokens"] for run in runs.values())
    out: Dict[str, Any] = {"rows": rows, "vocab": vocab, "max_new": max_new, "k": k,
                           "acceptance": acceptance, "same_tokens": same}
    for name, run in runs.items():
        key = name.replace(" ", "_")
        out[f"{key}_tps"] = total / run["seconds"]
        out[f"{key}_steps"] = run["steps"]
    spec = runs["speculative"]
    out["accepted_fraction"] = spec["accepted"] / max(1, spec["drafted"])
    deep = runs["speculative depth 2"]
    out["host_syncs_equal_steps"] = deep["host_syncs"] == deep["steps"]  # at depth 2
    out["depth_2_host_syncs"], out["depth_2_steps"] = deep["host_syncs"], deep["steps"]
    return out


def bench_speculative(quick: bool) -> Dict[str, Any]:
    """The section's figures (printed, and returned for the JSON record)."""
    repeats = 3 if quick else 7
    rows, k = 64, 4
    vocab = 32000 if quick else 152064
    section(f"speculative decoding: verify_to_feed against argmax_to_feed over the same "
             f"{rows} x {k + 1} logit rows of {vocab} float32, host backend (median of {repeats})")
    verifies = []
    for agree in (1.0, 0.5):
        v = _verify_beside_argmax(rows, k, vocab, repeats, agree)
        verifies.append(v)
        row(f"verify, drafts agree {agree:.0%}", f"{v['verify_ms']:.2f} ms",
             f"argmax {v['argmax_ms']:.2f} ms", f"{v['ratio']:.2f}x",
             "<= 1.3x" if agree == 1.0 else "",
             note=("cells checked" if v["checked"] else "WRONG CELLS")
             + ("" if agree == 1.0 else "; a row stops at its first rejection"))
    pv = _verify_penalised(rows, k, vocab, repeats)
    row("verify with penalties on every row", f"{pv['penalised_ms']:.2f} ms",
         f"without {pv['plain_ms']:.2f} ms", f"{pv['ratio']:.2f}x", "<= 1.2x",
         note=("cells checked" if pv["checked"] else "WRONG CELLS")
         + "; verify_to_feed(penalties=), each row's apply in the verify's pass; every "
           "position decided")
    row("  as three calls", f"{pv['three_calls_ms']:.2f} ms", f"without {pv['plain_ms']:.2f} ms",
         f"{pv['three_calls_ratio']:.2f}x", "",
         note="apply walking the drafts, verify, update with the cells")
    row("  the written lines, unoverlapped", "", "", f"{pv['floor_ratio']:.2f}x", "",
         note=f"{pv['written_lines_per_row']:.0f} of a row's {vocab * 4 // 64} lines written, "
              "each back to memory once more, if none overlapped the verify's reads")
    p = _pipeline_tps(1000 if quick else 32000, 16, 32 if quick else 64, k, 0.8,
                      2 if quick else 3)
    section(f"speculative decoding through the pipeline, reference model ({p['rows']} rows, "
             f"vocab {p['vocab']}, {p['max_new']} new tokens, k = {k}, acceptance 0.8); "
             f"tokens checked equal")
    row("speculative", f"{p['speculative_tps']:.0f} tok/s",
         f"plain depth 1 {p['plain_depth_1_tps']:.0f}",
         f"{p['speculative_tps'] / p['plain_depth_1_tps']:.2f}x",
         note=f"{p['speculative_steps']} steps against {p['plain_depth_1_steps']}; accepted "
              f"{p['accepted_fraction']:.0%} of drafts")
    row("speculative depth 2", f"{p['speculative_depth_2_tps']:.0f} tok/s",
         f"plain depth 2 {p['plain_depth_2_tps']:.0f}",
         f"{p['speculative_depth_2_tps'] / p['plain_depth_2_tps']:.2f}x",
         note="the reference forward costs the host CPU per position (k + 1 a row), and the "
              "reference drafter computes every draft's logits on the host: fewer steps, not "
              "less work")
    row("host syncs at depth 2", f"{p['depth_2_host_syncs']}", f"steps {p['depth_2_steps']}",
         target=f"{p['depth_2_steps']}", note="one wait a step, speculation on")
    return {"verify": verifies, "verify_penalised": pv, "pipeline": p,
            "checked": all(v["checked"] for v in verifies) and pv["checked"] and p["same_tokens"]
            and p["host_syncs_equal_steps"]}
