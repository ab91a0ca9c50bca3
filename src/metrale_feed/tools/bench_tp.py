"""``metrale-feed bench --tp N``: the sharded argmax beside the two ways engines do it today.

N local ranks (separate processes, one gloo group on 127.0.0.1) each hold a slice of
``rows x 152064`` float32 logits. Measured side by side, the same ranks and group, one run:
the sharded ``argmax_to_feed`` (16 bytes a row), (a) all-gathering the logits then the argmax,
(b) the same sharded reduction by hand with torch ops (local max, all-gather of (value, id),
pick). Then sampling with ``top_k=50, top_p=0.9``: the sharded call (its exchange of per-row
candidate lists) beside (a) all-gathering the logits then the unsharded ``sample_to_feed`` on every
rank, and (b) the unsharded call on the whole rows on one rank; with its collectives per call and
the cost of one small gloo collective on this machine (what each exchange's rendezvous costs).
Needs torch and numpy.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

from ..tp.local_ranks import result_of, run_local_ranks

VOCAB = 152064


def _rank(rank: int, world: int, port: int, sizes: List[int], repeats: int) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    import metrale_feed as mf

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")  # the shard's own; the barriers use the default one
    out: Dict[str, Any] = {"sizes": []}
    for rows in sizes:
        full = np.random.default_rng(rows).standard_normal((rows, VOCAB), dtype=np.float32)
        want = full.argmax(axis=1)
        shard = mf.VocabShard(group, VOCAB, max_rows=rows)
        lo, hi = shard.start, shard.stop
        part = np.ascontiguousarray(full[:, lo:hi])
        tpart = torch.from_numpy(part)
        buf = mf.DeviceBuffer(part.nbytes)
        mf.copy_h2d_async(buf, part)
        mf.stream_synchronize(0)
        cells, ids = mf.DeviceBuffer(rows * 4), np.zeros(rows, np.uint32)
        done = mf.Event()
        width = -(-VOCAB // world)

        def sharded() -> Any:
            mf.argmax_to_feed(buf, None, cells, ids, done, rows=rows, dtype="float32", shard=shard)
            done.synchronize()
            return ids.astype(np.int64)

        def gather_logits() -> Any:
            slices = [torch.empty((rows, width), dtype=torch.float32) for _ in range(world)]
            mine = torch.zeros((rows, width), dtype=torch.float32)  # equal sizes: pad the slice
            mine[:, : hi - lo] = tpart
            mine[:, hi - lo:] = -float("inf")
            dist.all_gather(slices, mine, group=group)
            return torch.cat(slices, dim=1)[:, :VOCAB].argmax(dim=1).numpy()

        def by_hand() -> Any:
            val, idx = tpart.max(dim=1)
            mine = torch.stack([val.double(), (idx + lo).double()], dim=1)
            got = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(got, mine, group=group)
            both = torch.stack(got)  # [world, rows, 2]
            best = both[:, :, 0].argmax(dim=0)  # the first greatest: the lowest slice
            return both[best, torch.arange(rows), 1].long().numpy()

        times: Dict[str, List[float]] = {"sharded": [], "gather": [], "hand": []}
        checked = True
        for _ in range(repeats):
            for name, fn in (("sharded", sharded), ("gather", gather_logits), ("hand", by_hand)):
                dist.barrier()
                t0 = time.perf_counter()
                got = fn()
                times[name].append(time.perf_counter() - t0)
                checked = checked and bool(np.array_equal(got, want))
        sent = dict(shard.stats)
        filtered = _filtered(rank, group, full, rows, repeats)
        out["sizes"].append({
            "rows": rows, "vocab": VOCAB, "world": world, "checked": checked,
            "sharded_ms": statistics.median(times["sharded"]) * 1e3,
            "gather_ms": statistics.median(times["gather"]) * 1e3,
            "hand_ms": statistics.median(times["hand"]) * 1e3,
            "sharded_bytes_per_step": 16 * (rows + 2),
            "gather_bytes_per_step": rows * width * 4,
            "hand_bytes_per_step": rows * 16,
            "shard_stats": sent,
            **filtered,
        })
        done.close(), cells.close(), buf.close()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


def _filtered(rank: int, group: Any, full: Any, rows: int, repeats: int) -> Dict[str, Any]:
    """Sampling with top_k 50 and top_p 0.9: the sharded call on every rank, then the unsharded
    call on rank 0 alone (the others wait at a barrier), the same ids."""
    import numpy as np
    import torch.distributed as dist

    import metrale_feed as mf

    import torch

    shard = mf.VocabShard(group, VOCAB, max_rows=rows)
    world = shard.world
    part = np.ascontiguousarray(full[:, shard.start:shard.stop])
    width = -(-VOCAB // world)
    tpart = torch.from_numpy(part)
    gathered = mf.DeviceBuffer(rows * VOCAB * 4)
    gathered_ids = np.zeros(rows, np.uint32)
    params = mf.sampling_params(rows, temperature=1.0, top_k=50, top_p=0.9, seed=np.arange(rows),
                                position=np.arange(rows))
    bufs = [mf.DeviceBuffer(max(1, a.nbytes)) for a in (part, full if rank == 0 else part[:0])]
    for b, a in zip(bufs, (part, full)):
        if a.nbytes and b.nbytes == a.nbytes:
            mf.copy_h2d_async(b, a)
    mf.stream_synchronize(0)
    cells, ids, whole_ids = mf.DeviceBuffer(rows * 4), np.zeros(rows, np.uint32), np.zeros(rows, np.uint32)
    sharded_s: List[float] = []
    whole_s: List[float] = []
    gather_s: List[float] = []
    small_s: List[float] = []
    sent = calls = 0
    tiny = torch.zeros(4, dtype=torch.int32)
    tiny_out = [torch.empty_like(tiny) for _ in range(world)]

    def gather_then_sample() -> None:
        """(a): what engines do: all-gather the logits, then the unsharded call on every rank."""
        slices = [torch.empty((rows, width), dtype=torch.float32) for _ in range(world)]
        mine = torch.zeros((rows, width), dtype=torch.float32)  # equal sizes: pad the slice
        mine[:, : tpart.shape[1]] = tpart
        dist.all_gather(slices, mine, group=group)
        whole = torch.cat(slices, dim=1)[:, :VOCAB].contiguous().numpy()
        mf.copy_h2d_async(gathered, whole)
        mf.sample_to_feed(gathered, params, cells, gathered_ids, done, rows=rows, vocab=VOCAB,
                          dtype="float32")
        done.synchronize()

    with mf.Event() as done:
        for _ in range(repeats):
            dist.barrier()
            before = dict(shard.stats)
            t0 = time.perf_counter()
            mf.sample_to_feed(bufs[0], params, cells, ids, done, rows=rows, dtype="float32", shard=shard)
            done.synchronize()
            sharded_s.append(time.perf_counter() - t0)
            sent = shard.stats["bytes_sent"] - before["bytes_sent"]
            calls = shard.stats["collectives"] - before["collectives"]
            dist.barrier()
            t0 = time.perf_counter()
            gather_then_sample()
            gather_s.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(10):  # one small gloo all-gather: the rendezvous an exchange pays
                dist.all_gather(tiny_out, tiny, group=group)
            small_s.append((time.perf_counter() - t0) / 10)
            dist.barrier()
            if rank == 0:
                t0 = time.perf_counter()
                mf.sample_to_feed(bufs[1], params, cells, whole_ids, done, rows=rows, vocab=VOCAB,
                                  dtype="float32")
                done.synchronize()
                whole_s.append(time.perf_counter() - t0)
    shard.close()
    cells.close(), bufs[0].close(), bufs[1].close(), gathered.close()
    return {"filtered_sharded_ms": statistics.median(sharded_s) * 1e3,
            "filtered_unsharded_ms": statistics.median(whole_s) * 1e3 if whole_s else None,
            "filtered_gather_ms": statistics.median(gather_s) * 1e3,
            "filtered_collectives_per_call": calls, "gloo_collective_us": statistics.median(small_s) * 1e6,
            "filtered_bytes_per_call": sent,
            "filtered_checked": bool(np.array_equal(ids, gathered_ids))
            and (rank != 0 or bool(np.array_equal(ids, whole_ids)))}


def run(world: int, quick: bool) -> Dict[str, Any]:
    """Start ``world`` ranks and return rank 0's figures."""
    ranks = run_local_ranks("metrale_feed.tools.bench_tp", world, ["3" if quick else "7"])
    for returncode, _, stderr in ranks:
        if returncode != 0:
            raise RuntimeError(f"a bench rank failed (exit {returncode}):\n{stderr[-2000:]}")
    result = result_of(ranks[0][1])
    if result is None:
        raise RuntimeError("bench rank 0 printed no RESULT line")
    return result


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), [64, 256], int(sys.argv[4]))
