"""``metrale-feed bench``: the performance record, measured side by side in one run.

Every figure is printed beside a baseline measured in the same run (a plain Python call, numpy,
the synchronous router), with the ratio and the target. These machines are noisy, so compared
pairs are interleaved and each figure is a best or a median over repeats. Needs numpy. One module
per thing measured: ``calls`` (import, per call, cimport), ``kernels`` (argmax, sampling,
penalties), ``pipeline`` (router, pipeline, graphs), ``interop``, ``spec`` (speculative
decoding), ``grammar`` (structured outputs), ``tp`` (tensor parallelism, ``--tp N``); ``report``
prints the rows.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Dict

import metrale_feed as mf

from .report import cimport_reason, machine, row, section, verdict
from .calls import bench_calls, bench_cimport, bench_import
from .interop import bench_interop
from .kernels import (SAMPLE_CASES, bench_argmax, bench_penalties, bench_pick_options,
                      bench_sampling, peaked_logits, torch_sampler)

from .pipeline import bench_graphs, bench_router
from .report import VERDICTS

__all__ = ["main", "verdict", "cimport_reason", "bench_sampling", "SAMPLE_CASES", "peaked_logits",
           "torch_sampler"]

def bench_tp(world: int, quick: bool) -> Dict[str, Any]:
    """``--tp N``: the sharded argmax over N local ranks beside its two baselines (tp.py)."""
    from . import tp

    result = tp.run(world, quick)
    vocab = result["sizes"][0]["vocab"] if result["sizes"] else tp.VOCAB
    section(f"tensor parallel, {world} ranks x {vocab // world} ids, float32, gloo, "
             f"ranks on the {result['backend']} backend")
    for e in result["sizes"]:
        name = f"sharded argmax {e['rows']}x{e['vocab']}"
        row(name, f"{e['sharded_ms']:.2f} ms", f"gather logits {e['gather_ms']:.2f} ms",
             f"{e['gather_ms'] / e['sharded_ms']:.1f}x", ">= 10x")
        row("", "", f"torch by hand {e['hand_ms']:.2f} ms", f"{e['hand_ms'] / e['sharded_ms']:.1f}x",
             ">= 2x")
        row("  bytes sent per rank", f"{e['sharded_bytes_per_step']}",
             f"gather {e['gather_bytes_per_step']}", "", "",
             f"by hand {e['hand_bytes_per_step']}; ids {'checked' if e['checked'] else 'DIFFER'}")
        row(f"sharded verify {e['verify_rows']} rows k {e['verify_k']}", f"{e['verify_ms']:.2f} ms",
             f"sharded argmax, same {e['rows']} rows {e['verify_argmax_ms']:.2f} ms",
             f"{e['verify_ms'] / e['verify_argmax_ms']:.2f}x", "",
             f"{e['verify_collectives_per_call']} collective, {e['verify_bytes_per_call']} B; cells "
             f"{'checked' if e['verify_checked'] else 'DIFFER'}")
        row("  sampled, temperature 0.8", f"{e['verify_sampled_ms']:.2f} ms",
             f"sharded sample, same {e['rows']} rows {e['verify_sample_ms']:.2f} ms",
             f"{e['verify_sampled_ms'] / e['verify_sample_ms']:.2f}x", "",
             f"{e['verify_sampled_collectives_per_call']} collectives, {e['verify_sampled_bytes_per_call']} B; "
             f"cells {'checked' if e['verify_sampled_checked'] else 'DIFFER'}")
        row(f"sharded top_logprobs n {e['top_n']} {e['rows']} rows", f"{e['top_sharded_ms']:.2f} ms",
             f"gather logits + unsharded {e['top_gather_ms']:.2f} ms",
             f"{e['top_gather_ms'] / e['top_sharded_ms']:.2f}x", "",
             f"{e['top_collectives_per_call']} collective, {e['top_bytes_per_call'] / e['rows']:.0f} B/row; "
             f"ids {'checked' if e['top_checked'] else 'DIFFER'}")
        row(f"sharded top_k 50 top_p 0.9 {e['rows']} rows", f"{e['filtered_sharded_ms']:.2f} ms",
             f"gather logits + unsharded {e['filtered_gather_ms']:.2f} ms",
             f"{e['filtered_gather_ms'] / e['filtered_sharded_ms']:.2f}x", ">= 3x",
             f"{e['filtered_collectives_per_call']} collectives, "
             f"{e['filtered_bytes_per_call'] / e['rows']:.0f} B/row; ids "
             f"{'checked' if e['filtered_checked'] else 'DIFFER'}")
        row("", "", f"unsharded, 1 rank {e['filtered_unsharded_ms']:.2f} ms",
             f"{e['filtered_unsharded_ms'] / e['filtered_sharded_ms']:.2f}x", "",
             f"one gloo all-gather of 16 B: {e['gloo_collective_us']:.0f} us")
        row(f"sharded top_p 0.9 alone {e['rows']} rows", f"{e['radix_sharded_ms']:.2f} ms",
             f"gather logits + unsharded {e['radix_gather_ms']:.2f} ms",
             f"{e['radix_gather_ms'] / e['radix_sharded_ms']:.2f}x", ">= 3x",
             f"{e['radix_collectives_per_call']} collectives (4 rounds, decided on the stream), "
             f"{e['radix_bytes_per_call'] / e['rows']:.0f} B/row; ids "
             f"{'checked' if e['radix_checked'] else 'DIFFER'}")
        row("", "", f"unsharded, 1 rank {e['radix_unsharded_ms']:.2f} ms",
             f"{e['radix_unsharded_ms'] / e['radix_sharded_ms']:.2f}x", "", "")
        row(f"sharded top_k 50 top_p 0.9, fixed rounds (top_k 64, top_p) {e['rows']} rows",
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
        missed = [name for name, mark in VERDICTS if mark != "met"]
        print(f"\ntargets: {len(VERDICTS) - len(missed)} of {len(VERDICTS)} met"
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
    record["import"] = bench_import(3 if args.quick else 7)
    record["calls"] = bench_calls(args.quick)
    record["cimport"] = bench_cimport(args.quick)
    record.update(bench_argmax(args.quick))
    record["argmax_options"] = bench_pick_options(args.quick)
    record["sampling"] = bench_sampling(args.quick, bool(getattr(args, "peaked", False)))
    record["router"] = bench_router(args.quick)
    record["penalties"] = bench_penalties(args.quick)
    record["interop"] = bench_interop(args.quick)
    record["graphs"] = bench_graphs(args.quick)
    from .spec import bench_speculative

    record["speculative"] = bench_speculative(args.quick)
    from .grammar import bench_grammar

    grammar = bench_grammar(args.quick)
    record["grammar"] = grammar
    record["seconds"] = time.perf_counter() - start
    missed = [name for name, mark in VERDICTS if mark != "met"]
    record["targets"] = {"met": len(VERDICTS) - len(missed), "missed": missed}
    print(f"\ntargets: {len(VERDICTS) - len(missed)} of {len(VERDICTS)} met"
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
          and record["speculative"]["checked"]
          and grammar["checked"])
    if not ok:
        print("a correctness check failed: argmax ids or router tokens differ (sampled ones "
              "included)", file=sys.stderr)
    return 0 if ok else 1
