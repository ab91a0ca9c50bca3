"""Structured outputs on the host backend: a step whose rows are all constrained by a JSON schema's
``TokenAutomaton`` beside the same step without grammar, and beside what engines do (the bitmask
filled on the host from each row's state, uploaded, picked with: the host must have read the
previous step's ids first, one host sync a step the next launch waits behind); then the pipeline
on the reference model at depth 2 with every row constrained beside none.

The automaton is ``bench_grammar``'s schema over its synthetic vocabulary (no download), built by
outlines-core: without it (the ``grammar`` extra) the section says so and measures nothing.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any, Callable, Dict, List

import metrale_feed as mf
from metrale_feed import _core

from .report import LARGE, row, section, timed

ROWS = 64  # the step's rows, of LARGE[1] ids


def _automaton(vocab: int) -> Any:
    """The representative schema's automaton over a synthetic vocabulary of ``vocab`` ids (its
    last id the end-of-sequence one)."""
    from ..bench_grammar import SCHEMA, synthetic_vocabulary

    return mf.TokenAutomaton.from_json_schema(SCHEMA, synthetic_vocabulary(vocab), vocab=vocab)


def _leaving(automaton: Any, s: int) -> Any:
    """The ids that take state ``s`` elsewhere, among its edges (a dense state's others stay)."""
    lo = int(automaton.states["first"][s])
    edges = automaton.edges[lo:lo + int(automaton.states["count"][s])]
    return edges["token"][(edges["next"] != 0xFFFFFFFF) & (edges["next"] != s)]


def output_states(automaton: Any, rng: Any, limit: int = 2000) -> List[int]:
    """The states one random output passes through, in order: at a state whose most ids stay in
    it (a JSON string's) it stays for 1 to 16 ids drawn from those, then takes one that leaves;
    elsewhere it draws among the allowed ids. At most ``limit`` states."""
    fallback = automaton.states["fallback"]
    seen: List[int] = []
    s, stay, budget = automaton.initial, 0, int(rng.integers(1, 17))
    while not automaton.final(s) and len(seen) < limit:
        seen.append(s)
        string = int(fallback[s]) == s
        leaving = _leaving(automaton, s) if string and stay >= budget else None
        if leaving is not None and len(leaving):
            t, stay, budget = int(rng.choice(leaving)), 0, int(rng.integers(1, 17))
        elif string:
            t = int(rng.integers(automaton.vocab))
            while automaton.next(s, t) != s:  # most ids stay: a few draws
                t = int(rng.integers(automaton.vocab))
            stay += 1
        else:
            t = int(rng.choice(automaton.allowed(s)))
        s = automaton.next(s, t)
    return seen


def row_states(automaton: Any, rows: int, np: Any, seed: int = 0) -> Any:
    """A state word a row: each row at a random position of a random output (``output_states``),
    as rows of a served batch are, most inside a string."""
    rng = np.random.default_rng(seed)
    outputs = [output_states(automaton, rng) for _ in range(8)]
    flat = [s for states in outputs for s in states]
    return np.array([flat[i] for i in rng.integers(0, len(flat), rows)], np.uint32)


def _step(quick: bool, np: Any) -> Dict[str, Any]:
    rows, vocab = ROWS, LARGE[1]
    repeats = 3 if quick else 9
    start = time.perf_counter()
    automaton = _automaton(vocab)
    build_s = time.perf_counter() - start
    automaton.to_device()
    words = row_states(automaton, rows, np)
    dense = automaton.states["fallback"][words] != 0xFFFFFFFF
    bits = np.stack([automaton.bitmask(int(s)) for s in words])
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    logits = np.random.default_rng(vocab).standard_normal((rows, vocab), dtype=np.float32)
    nwords = bits.shape[1]
    dev, cells, dst, ev = (mf.DeviceBuffer(logits.nbytes), mf.DeviceBuffer(rows * 4),
                           mf.PinnedBuffer(rows * 4), mf.Event())
    state_dev, start_dev, bit_dev = (mf.DeviceBuffer(rows * 4), mf.DeviceBuffer(rows * 4),
                                     mf.DeviceBuffer(bits.nbytes))
    scratch = mf.DeviceBuffer(bits.nbytes)
    mf.copy_h2d_async(dev, logits)
    mf.copy_h2d_async(start_dev, words)
    mf.stream_synchronize()
    params = mf.sampling_params(rows, temperature=1.0, seed=np.arange(rows, dtype=np.uint64) * 7919 + 1,
                                position=np.arange(rows))
    pick: Dict[str, Any] = dict(rows=rows, vocab=vocab, dtype="float32")
    cache = {int(s): automaton.bitmask(int(s)) for s in np.unique(words)}

    def ids() -> List[int]:
        return mf.read_pinned_u32(dst.ptr, rows)

    def argmax(grammar: bool = False, bitmask: Any = None) -> List[int]:
        if grammar:  # every repeat from the same states: the call advances them
            mf.copy_d2d_async(state_dev, start_dev, rows * 4)
        mf.argmax_to_feed(dev, None, cells, dst, ev, 0, bitmask=bitmask,
                          grammar=(automaton, state_dev, scratch) if grammar else None, **pick)
        ev.synchronize()
        return ids()

    def sample(grammar: bool = False, bitmask: Any = None) -> List[int]:
        if grammar:
            mf.copy_d2d_async(state_dev, start_dev, rows * 4)
        mf.sample_to_feed(dev, params, cells, dst, ev, 0, bitmask=bitmask,
                          grammar=(automaton, state_dev, scratch) if grammar else None, **pick)
        ev.synchronize()
        return ids()

    def engine(fill: Callable[[List[int]], Any]) -> List[int]:
        """What engines do a step: the host's states (known after reading the previous step's
        ids: the host sync) filled into a bitmask, uploaded, picked with, and advanced on the
        host by the ids read back."""
        states = words.tolist()
        mask = fill(states)
        mf.copy_h2d_async(bit_dev, mask)
        picked = argmax(bitmask=bit_dev)
        for r, t in enumerate(picked):
            states[r] = automaton.next(states[r], t)
        return picked

    def fill_each(states: List[int]) -> Any:
        return np.stack([automaton.bitmask(s) for s in states])

    def fill_cached(states: List[int]) -> Any:
        return np.stack([cache[s] for s in states])

    def mask_alone() -> None:
        state, edges = automaton.device_arrays
        _core._grammar_mask(state, edges, start_dev, scratch, num_states=automaton.num_states,
                            num_edges=len(automaton.edges), vocab=vocab, rows=rows)
        mf.stream_synchronize()

    threads = mf.host_kernel_threads(1)  # one kernel thread: the pick rows' convention here
    try:
        # Checks: the constrained argmax is numpy's over the allowed ids, its advance is the
        # automaton's, the engine's pick is the same; the constrained draw is sample_to_feed's
        # with the equivalent bitmask.
        expect = np.where(allowed, logits, -np.inf).argmax(axis=1).tolist()
        got = argmax(grammar=True)
        after = np.zeros(rows, np.uint32)
        mf.copy_d2h_async(state_dev, after)
        mf.stream_synchronize()
        drawn = sample(grammar=True)
        checked = (got == expect == engine(fill_each) == engine(fill_cached)
                   and after.tolist() == [automaton.next(int(s), t) for s, t in zip(words, got)]
                   and drawn == sample(bitmask=bit_dev)
                   and all(allowed[r, t] for r, t in enumerate(drawn)))
        runs: Dict[str, Callable[[], Any]] = {
            "argmax": argmax, "argmax_grammar": lambda: argmax(grammar=True),
            "sample": sample, "sample_grammar": lambda: sample(grammar=True),
            "engine": lambda: engine(fill_each), "engine_cached": lambda: engine(fill_cached),
            "mask": mask_alone}
        times: Dict[str, List[float]] = {k: [] for k in runs}
        for _ in range(repeats):  # interleaved
            for k, run in runs.items():
                times[k].append(timed(run))
    finally:
        mf.host_kernel_threads(threads)
        automaton.close()
        for b in (dev, cells, dst, ev, state_dev, start_dev, bit_dev, scratch):
            b.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    # Each ratio is the median over the repeats of two calls made back to back.
    ratio = {k: statistics.median([g / p for g, p in zip(times[f"{k}_grammar"], times[k])])
             for k in ("argmax", "sample")}
    return {"rows": rows, "vocab": vocab, "states": automaton.num_states, "bytes": automaton.nbytes,
            "build_s": build_s, "string_rows": int(dense.sum()),
            "allowed_mean": float(allowed.sum(axis=1).mean()), "bitmask_bytes": int(bits.nbytes),
            "words": nwords, "ms": med, "ratio": ratio, "repeats": repeats, "checked": bool(checked),
            "engine_ratio": med["engine"] / med["argmax_grammar"],
            "engine_cached_ratio": med["engine_cached"] / med["argmax_grammar"]}


def _bounded_strings(np: Any, repeats: int) -> Dict[str, Any]:
    """The same argmax step with every row inside a string of at most 64 characters, each row at
    its own length: each length is a state of its own, and over a byte-pair vocabulary its ids
    go to as many next states as token lengths, so each such state lists most of the vocabulary
    as edges (the fallback covers one length's ids). The mask reads them all."""
    from ..bench_grammar import SCHEMA, synthetic_vocabulary

    rows, vocab = ROWS, LARGE[1]
    schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], name={"type": "string", "maxLength": 64}))
    automaton = mf.TokenAutomaton.from_json_schema(schema, synthetic_vocabulary(vocab), vocab=vocab)
    automaton.to_device()
    strings = np.flatnonzero(automaton.states["fallback"] != 0xFFFFFFFF)
    words = strings[np.arange(rows) % len(strings)].astype(np.uint32)
    logits = np.random.default_rng(vocab).standard_normal((rows, vocab), dtype=np.float32)
    allowed = np.stack([np.unpackbits(automaton.bitmask(int(s)).view(np.uint8), bitorder="little")[:vocab]
                        for s in words]).astype(bool)
    dev, cells, dst, ev = (mf.DeviceBuffer(logits.nbytes), mf.DeviceBuffer(rows * 4),
                           mf.PinnedBuffer(rows * 4), mf.Event())
    state_dev, start_dev = mf.DeviceBuffer(rows * 4), mf.DeviceBuffer(rows * 4)
    mf.copy_h2d_async(dev, logits)
    mf.copy_h2d_async(start_dev, words)

    def argmax(grammar: bool) -> List[int]:
        if grammar:
            mf.copy_d2d_async(state_dev, start_dev, rows * 4)
        mf.argmax_to_feed(dev, None, cells, dst, ev, 0, rows=rows, vocab=vocab, dtype="float32",
                          grammar=(automaton, state_dev) if grammar else None)
        ev.synchronize()
        return mf.read_pinned_u32(dst.ptr, rows)

    threads = mf.host_kernel_threads(1)
    try:
        checked = argmax(True) == np.where(allowed, logits, -np.inf).argmax(axis=1).tolist()
        times: Dict[bool, List[float]] = {False: [], True: []}
        for _ in range(repeats):
            for grammar in (False, True):
                times[grammar].append(timed(lambda: argmax(grammar)))
    finally:
        mf.host_kernel_threads(threads)
        automaton.close()
        for b in (dev, cells, dst, ev, state_dev, start_dev):
            b.close()
    return {"states": automaton.num_states, "string_states": len(strings), "bytes": automaton.nbytes,
            "edges_per_string": float(automaton.states["count"][strings].mean()),
            "plain_ms": statistics.median(times[False]), "grammar_ms": statistics.median(times[True]),
            "ratio": statistics.median([g / p for g, p in zip(times[True], times[False])]),
            "checked": bool(checked)}


def _pipeline(quick: bool, np: Any) -> Dict[str, Any]:
    """The reference model through ``DecodePipeline`` at depth 2, every row with the automaton
    against none (interleaved, the best of each); the constrained tokens checked against the
    automaton (each allowed where the ones before it lead; "stop" only at its end)."""
    from ...testing.reference import ReferenceModel

    rows, vocab, max_new, repeats = (16, 1000, 32, 2) if quick else (64, 32000, 64, 3)
    automaton = _automaton(vocab)
    prompts = [[i + 1, 2, 3, i % 7] for i in range(rows)]
    best: Dict[str, Dict[str, Any]] = {}
    try:
        with ReferenceModel(vocab, max_rows=rows, block_size=16, num_blocks=4096) as model:
            for _ in range(repeats):
                for name, grammar in (("free", None), ("grammar", automaton)):
                    with mf.DecodePipeline(model, rows, depth=2) as pipe:
                        reqs = [pipe.submit(p, max_new_tokens=max_new, grammar=grammar) for p in prompts]
                        start = time.perf_counter()
                        pipe.run()
                        seconds = time.perf_counter() - start
                        stats = pipe.stats.as_dict()
                    tokens = sum(len(r.tokens) for r in reqs)
                    run = {"tps": tokens / seconds, "tokens": tokens, "steps": stats["steps"],
                           "host_syncs": stats["host_syncs"],
                           "finish": sorted({r.finish_reason for r in reqs})}
                    if grammar is not None:
                        ends = [automaton.walk(r.tokens) for r in reqs]
                        run["checked"] = all(
                            end is not None and (r.finish_reason != "stop" or automaton.final(end))
                            for end, r in zip(ends, reqs))
                    if name not in best or run["tps"] > best[name]["tps"]:
                        best[name] = run
    finally:
        automaton.close()
    return {"rows": rows, "vocab": vocab, "max_new": max_new, "free": best["free"],
            "grammar": best["grammar"], "ratio": best["grammar"]["tps"] / best["free"]["tps"],
            "checked": bool(best["grammar"]["checked"])}


def bench_grammar(quick: bool) -> Dict[str, Any]:
    """The section's figures (printed, and returned for the JSON record)."""
    import numpy as np

    if importlib.util.find_spec("outlines_core") is None:
        section("structured outputs")
        print("  (outlines-core is not importable: pip install 'metrale-feed[grammar]'; "
              "the grammar rows are skipped)")
        return {"skipped": "outlines-core is not installed", "checked": True}
    s = _step(quick, np)
    ms, ratio = s["ms"], s["ratio"]
    section(f"structured outputs: {s['rows']} x {s['vocab']} float32, every row constrained by a JSON "
            f"schema's automaton ({s['states']} states, {s['bytes']} device bytes, built in "
            f"{s['build_s']:.1f} s), host backend, 1 kernel thread (median of {s['repeats']}); ratio "
            "= the median over the repeats of time / the baseline's in the same repeat")
    print(f"  (rows: {s['string_rows']} inside a string, {s['rows'] - s['string_rows']} at other "
          f"states; {s['allowed_mean']:.0f} allowed ids a row on average)")
    check = "" if s["checked"] else "; IDS OR STATES DIFFER"
    row("argmax_to_feed, grammar", f"{ms['argmax_grammar']:.2f} ms", f"no grammar {ms['argmax']:.2f} ms",
        f"{ratio['argmax']:.2f}x", "<= 1.3x",
        f"mask, pick, advance in one call; ids = numpy's over the allowed ids, states advanced{check}")
    row("sample_to_feed t=1, grammar", f"{ms['sample_grammar']:.2f} ms", f"no grammar {ms['sample']:.2f} ms",
        f"{ratio['sample']:.2f}x", "<= 1.3x", f"ids = sample_to_feed with the same bitmask{check}")
    row("  the mask alone", f"{ms['mask']:.2f} ms", "", "", "",
        f"{s['rows']} bitmask rows of {s['words']} words from the state words")
    row("host fill + upload + pick", f"{ms['engine']:.2f} ms", f"grammar in the call {ms['argmax_grammar']:.2f}",
        f"{s['engine_ratio']:.2f}x", "",
        f"what engines do: automaton.bitmask of each row's state, {s['bitmask_bytes'] // 1024} KiB "
        "uploaded, argmax_to_feed(bitmask=), the host's states advanced; +1 host sync a step "
        "(the ids read before the next fill), none in the call")
    row("  fill from a state cache", f"{ms['engine_cached']:.2f} ms", f"grammar in the call {ms['argmax_grammar']:.2f}",
        f"{s['engine_cached_ratio']:.2f}x", "", "each state's bitmask made once beforehand; the same sync")
    b = None if quick else _bounded_strings(np, s["repeats"])
    if b is not None:
        row("  every row in a bounded string", f"{b['grammar_ms']:.2f} ms", f"no grammar {b['plain_ms']:.2f} ms",
            f"{b['ratio']:.2f}x", "",
            f"maxLength 64: {b['string_states']} string states of {b['edges_per_string']:.0f} edges each "
            f"({b['bytes'] / 1e6:.0f} MB), each row its own; the mask reads every edge"
            + ("" if b["checked"] else "; IDS DIFFER"))
    p = _pipeline(quick, np)
    free, gram = p["free"], p["grammar"]
    section(f"structured outputs through the pipeline, reference model, depth 2 ({p['rows']} rows, "
            f"vocab {p['vocab']}, up to {p['max_new']} new tokens; best of the interleaved runs)")
    row("every row constrained", f"{gram['tps']:.0f} tok/s", f"unconstrained {free['tps']:.0f}",
        f"{p['ratio']:.2f}x", "",
        f"{gram['tokens']} tokens in {gram['steps']} steps ({', '.join(gram['finish'])}) against "
        f"{free['tokens']} in {free['steps']}; tokens allowed by the automaton: "
        f"{'checked' if p['checked'] else 'NOT ALLOWED'}")
    row("  host syncs, constrained", f"{gram['host_syncs']}", f"steps {gram['steps']}", "",
        f"{gram['steps']}", f"{gram['host_syncs'] / gram['steps']:.2f} a step")
    row("  host syncs, unconstrained", f"{free['host_syncs']}", f"steps {free['steps']}", "",
        f"{free['steps']}", f"{free['host_syncs'] / free['steps']:.2f} a step")
    return {"step": s, "bounded_strings": b, "pipeline": p,
            "checked": s["checked"] and p["checked"] and (b is None or b["checked"])}
