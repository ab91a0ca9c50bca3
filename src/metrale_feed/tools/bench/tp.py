"""``metrale-feed bench --tp N``: the sharded argmax beside the two ways engines do it today.

N local ranks (separate processes, one gloo group on 127.0.0.1) each hold a slice of
``rows x 152064`` float32 logits. Measured side by side, the same ranks and group, one run:
the sharded ``argmax_to_feed`` (16 bytes a row), (a) all-gathering the logits then the argmax,
(b) the same sharded reduction by hand with torch ops (local max, all-gather of (value, id),
pick). Then a greedy ``verify_to_feed`` with k = 3 over the same logit rows beside the sharded argmax
over them. Then the sharded ``top_logprobs`` (n = 20) beside all-gathering the logits then the
unsharded call on every rank. Then sampling with ``top_k=50, top_p=0.9``: the sharded call (its exchange of per-row
candidate lists) beside (a) all-gathering the logits then the unsharded ``sample_to_feed`` on every
rank, and (b) the unsharded call on the whole rows on one rank; with its collectives per call and
the cost of one small gloo collective on this machine (what each exchange's rendezvous costs); the
same for ``top_p=0.9`` alone (a radix select: 4 rounds of histograms, each followed by a decision
on the stream), and for ``top_k=50, top_p=0.9`` in a shard's fixed rounds
(``FilterRounds(top_k=64, top_p=True)``: 7 exchanges whatever the params, what NCCL needs).
Needs torch and numpy.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

from ...tp.local_ranks import result_of, run_local_ranks

VOCAB = 152064
# The simt backend runs the CUDA kernels on the CPU, a few hundred times slower than the host
# backend: there the ranks check the calls over a vocabulary this size, and their times say little.
SIMT_VOCAB = 16384


def _rank(rank: int, world: int, port: int, sizes: List[int], repeats: int) -> None:
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    import metrale_feed as mf

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo")  # the shard's own; the barriers use the default one
    out: Dict[str, Any] = {"sizes": [], "backend": mf.backend()}
    vocab = SIMT_VOCAB if mf.backend() == "simt" else VOCAB
    for rows in sizes:
        full = np.random.default_rng(rows).standard_normal((rows, vocab), dtype=np.float32)
        want = full.argmax(axis=1)
        shard = mf.VocabShard(group, vocab, max_rows=rows)
        lo, hi = shard.start, shard.stop
        part = np.ascontiguousarray(full[:, lo:hi])
        tpart = torch.from_numpy(part)
        buf = mf.DeviceBuffer(part.nbytes)
        mf.copy_h2d_async(buf, part)
        mf.stream_synchronize(0)
        cells, ids = mf.DeviceBuffer(rows * 4), np.zeros(rows, np.uint32)
        done = mf.Event()
        width = -(-vocab // world)

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
            return torch.cat(slices, dim=1)[:, :vocab].argmax(dim=1).numpy()

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
        verify = _verify(group, full, rows, repeats)
        top = _top(group, full, rows, repeats)
        filtered = _filtered(rank, group, full, rows, repeats)
        radix = _filtered(rank, group, full, rows, repeats, "radix", dict(top_p=0.9))
        fixed = _filtered(rank, group, full, rows, repeats, "fixed", None,
                          mf.FilterRounds(top_k=64, top_p=True))
        out["sizes"].append({
            "rows": rows, "vocab": vocab, "world": world, "checked": checked,
            "sharded_ms": statistics.median(times["sharded"]) * 1e3,
            "gather_ms": statistics.median(times["gather"]) * 1e3,
            "hand_ms": statistics.median(times["hand"]) * 1e3,
            "sharded_bytes_per_step": 16 * (rows + 2),
            "gather_bytes_per_step": rows * width * 4,
            "hand_bytes_per_step": rows * 16,
            "shard_stats": sent,
            **verify,
            **top,
            **filtered,
            **radix,
            **fixed,
        })
        done.close(), cells.close(), buf.close()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)


VERIFY_K = 3


def _verify(group: Any, full: Any, rows: int, repeats: int) -> Dict[str, Any]:
    """A greedy verify of ``rows / (k + 1)`` rows with k = 3 (the logits' rows are its positions;
    every other row rejects its second draft) beside the sharded argmax over the same logit rows,
    on the same shard: the one exchange both make, and what the verify combine adds."""
    import numpy as np
    import torch.distributed as dist

    import metrale_feed as mf

    vocab = full.shape[1]
    k = VERIFY_K
    n = rows // (k + 1)
    shard = mf.VocabShard(group, vocab, max_rows=rows)
    part = np.ascontiguousarray(full[:, shard.start:shard.stop])
    buf = mf.DeviceBuffer(part.nbytes)
    mf.copy_h2d_async(buf, part)
    mf.stream_synchronize(0)
    best = full[: n * (k + 1)].argmax(axis=1).reshape(n, k + 1)
    drafts = best[:, :k].astype(np.uint32)
    drafts[::2, 1] = (drafts[::2, 1] + 1) % vocab
    want = np.full((n, k + 2), mf.NO_TOKEN, np.uint32)  # the greedy rule's cells
    for r in range(n):
        m = 2 if r % 2 == 0 else k + 1
        want[r, 0], want[r, 1: 1 + m] = m, best[r, :m]
    cells_v, dst_v = mf.DeviceBuffer(n * (k + 2) * 4), np.zeros(n * (k + 2), np.uint32)
    cells_a, dst_a = mf.DeviceBuffer(n * (k + 1) * 4), np.zeros(n * (k + 1), np.uint32)
    times: Dict[str, List[float]] = {"verify": [], "argmax": []}
    sent = calls = 0
    with mf.Event() as done:
        for _ in range(repeats):
            for name in ("verify", "argmax"):
                dist.barrier()
                before = dict(shard.stats)
                t0 = time.perf_counter()
                if name == "verify":
                    mf.verify_to_feed(buf, drafts, cells_v, dst_v, done, k=k, rows=n, dtype="float32",
                                      shard=shard)
                else:
                    mf.argmax_to_feed(buf, None, cells_a, dst_a, done, rows=n * (k + 1), dtype="float32",
                                      shard=shard)
                done.synchronize()
                times[name].append(time.perf_counter() - t0)
                if name == "verify":
                    sent = shard.stats["bytes_sent"] - before["bytes_sent"]
                    calls = shard.stats["collectives"] - before["collectives"]
    sampled = _verify_sampled(shard, buf, full, n, k, repeats)
    shard.close()
    cells_v.close(), cells_a.close(), buf.close()
    return {**sampled, "verify_rows": n, "verify_k": k,
            "verify_ms": statistics.median(times["verify"]) * 1e3,
            "verify_argmax_ms": statistics.median(times["argmax"]) * 1e3,
            "verify_collectives_per_call": calls, "verify_bytes_per_call": sent,
            "verify_checked": bool(np.array_equal(dst_v.reshape(n, k + 2), want))
            and bool(np.array_equal(dst_a.reshape(n, k + 1), best))}


def _verify_sampled(shard: Any, buf: Any, full: Any, n: int, k: int, repeats: int) -> Dict[str, Any]:
    """A sampled verify (temperature 0.8, drafts the positions' argmax) beside the sharded
    sample_to_feed over the same logit rows on the same shard: the same two exchanges (TOP and
    RACE), and what the drafts add (the survivors' masses, the race without a draft, the verify
    combine). Cells checked against the unsharded verify on the whole logits."""
    import numpy as np
    import torch.distributed as dist

    import metrale_feed as mf
    from ...tp.verify_args import logit_row_params

    params = mf.sampling_params(n, temperature=0.8, seed=np.arange(n) + 11, position=5)
    each = logit_row_params(params, n, k)
    drafts = full[: n * (k + 1)].argmax(axis=1).reshape(n, k + 1)[:, :k].astype(np.uint32).ravel()
    whole = mf.DeviceBuffer(full[: n * (k + 1)].nbytes)
    mf.copy_h2d_async(whole, np.ascontiguousarray(full[: n * (k + 1)]))
    want = np.zeros(n * (k + 2), np.uint32)
    cells_v, dst_v = mf.DeviceBuffer(n * (k + 2) * 4), np.zeros(n * (k + 2), np.uint32)
    cells_s, dst_s = mf.DeviceBuffer(n * (k + 1) * 4), np.zeros(n * (k + 1), np.uint32)
    times: Dict[str, List[float]] = {"verify": [], "sample": []}
    sent = calls = 0
    with mf.Event() as done:
        mf.verify_to_feed(whole, drafts, cells_v, want, done, k=k, rows=n, params=params, vocab=full.shape[1],
                          dtype="float32")
        done.synchronize()
        for _ in range(repeats):
            for name in ("verify", "sample"):
                dist.barrier()
                before = dict(shard.stats)
                t0 = time.perf_counter()
                if name == "verify":
                    mf.verify_to_feed(buf, drafts, cells_v, dst_v, done, k=k, rows=n, params=params,
                                      dtype="float32", shard=shard)
                else:
                    mf.sample_to_feed(buf, each, cells_s, dst_s, done, dtype="float32", shard=shard)
                done.synchronize()
                times[name].append(time.perf_counter() - t0)
                if name == "verify":
                    sent = shard.stats["bytes_sent"] - before["bytes_sent"]
                    calls = shard.stats["collectives"] - before["collectives"]
    for b in (whole, cells_v, cells_s):
        b.close()
    return {"verify_sampled_ms": statistics.median(times["verify"]) * 1e3,
            "verify_sample_ms": statistics.median(times["sample"]) * 1e3,
            "verify_sampled_collectives_per_call": calls, "verify_sampled_bytes_per_call": sent,
            "verify_sampled_checked": bool(np.array_equal(dst_v, want))}


TOP_N = 20


def _top(group: Any, full: Any, rows: int, repeats: int) -> Dict[str, Any]:
    """The sharded top_logprobs (n = 20: each rank's own 20 ids and its (m, s), one all-gather,
    the merge kernel) beside all-gathering the logits then the unsharded call on every rank; the
    ids checked against numpy's order (ties by the smaller id)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    import metrale_feed as mf
    from metrale_feed import _core

    n, world = TOP_N, dist.get_world_size(group)
    vocab = full.shape[1]
    shard = mf.VocabShard(group, vocab, max_rows=rows)
    width = -(-vocab // world)
    part = np.ascontiguousarray(full[:, shard.start:shard.stop])
    mine = np.full((rows, width), -np.inf, np.float32)  # equal sizes for the gather: pad the slice
    mine[:, : part.shape[1]] = part
    buf, whole = mf.DeviceBuffer(part.nbytes), mf.DeviceBuffer(rows * vocab * 4)
    mf.copy_h2d_async(buf, part)
    mf.stream_synchronize(0)
    want = np.argsort(-full, axis=1, kind="stable")[:, :n]
    record = np.dtype([("id", "<u4"), ("logprob", "<f4")])
    out, got = mf.DeviceBuffer(rows * n * 8), np.zeros(rows * n, record)
    checked = True
    times: Dict[str, List[float]] = {"sharded": [], "gather": []}
    sent = calls = 0
    with mf.Event() as done:
        def sharded() -> None:
            shard.top_logprobs(buf, out, n=n, rows=rows, dtype="float32", event=done)

        def gather() -> None:
            slices = [torch.empty((rows, width), dtype=torch.float32) for _ in range(world)]
            dist.all_gather(slices, torch.from_numpy(mine), group=group)
            joined = np.ascontiguousarray(torch.cat(slices, dim=1)[:, :vocab].numpy())
            mf.copy_h2d_async(whole, joined)
            _core.top_logprobs(whole, out, n=n, rows=rows, vocab=vocab, dtype="float32")
            mf.event_record(done)

        for _ in range(repeats):
            for name, fn in (("sharded", sharded), ("gather", gather)):
                dist.barrier()
                before = dict(shard.stats)
                t0 = time.perf_counter()
                fn()
                done.synchronize()
                times[name].append(time.perf_counter() - t0)
                mf.copy_d2h_async(out, got)
                mf.stream_synchronize(0)
                checked = checked and bool(np.array_equal(got["id"].reshape(rows, n), want))
                if name == "sharded":
                    sent = shard.stats["bytes_sent"] - before["bytes_sent"]
                    calls = shard.stats["collectives"] - before["collectives"]
    shard.close()
    out.close(), whole.close(), buf.close()
    return {"top_n": n, "top_sharded_ms": statistics.median(times["sharded"]) * 1e3,
            "top_gather_ms": statistics.median(times["gather"]) * 1e3,
            "top_collectives_per_call": calls, "top_bytes_per_call": sent, "top_checked": checked}


def _filtered(rank: int, group: Any, full: Any, rows: int, repeats: int, name: str = "filtered",
              filters: Any = None, rounds: Any = None) -> Dict[str, Any]:
    """Sampling with ``filters`` (default top_k 50 and top_p 0.9): the sharded call on every rank
    (a shard with fixed ``rounds``, or none), then the unsharded call on rank 0 alone (the others
    wait at a barrier), the same ids; the figures' keys start with ``name``."""
    import numpy as np
    import torch.distributed as dist

    import metrale_feed as mf

    import torch

    vocab = full.shape[1]
    shard = mf.VocabShard(group, vocab, max_rows=rows, filters=rounds)
    world = shard.world
    part = np.ascontiguousarray(full[:, shard.start:shard.stop])
    width = -(-vocab // world)
    tpart = torch.from_numpy(part)
    gathered = mf.DeviceBuffer(rows * vocab * 4)
    gathered_ids = np.zeros(rows, np.uint32)
    params = mf.sampling_params(rows, temperature=1.0, seed=np.arange(rows), position=np.arange(rows),
                                **(filters or dict(top_k=50, top_p=0.9)))
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
        whole = torch.cat(slices, dim=1)[:, :vocab].contiguous().numpy()
        mf.copy_h2d_async(gathered, whole)
        mf.sample_to_feed(gathered, params, cells, gathered_ids, done, rows=rows, vocab=vocab,
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
                mf.sample_to_feed(bufs[1], params, cells, whole_ids, done, rows=rows, vocab=vocab,
                                  dtype="float32")
                done.synchronize()
                whole_s.append(time.perf_counter() - t0)
    shard.close()
    cells.close(), bufs[0].close(), bufs[1].close(), gathered.close()
    figures = {"sharded_ms": statistics.median(sharded_s) * 1e3,
               "unsharded_ms": statistics.median(whole_s) * 1e3 if whole_s else None,
               "gather_ms": statistics.median(gather_s) * 1e3, "collectives_per_call": calls,
               "bytes_per_call": sent,
               "checked": bool(np.array_equal(ids, gathered_ids))
               and (rank != 0 or bool(np.array_equal(ids, whole_ids)))}
    out = {f"{name}_{k}": v for k, v in figures.items()}
    out["gloo_collective_us"] = statistics.median(small_s) * 1e6
    return out


# The rows of each measured size; --quick's smaller ones keep the check of every call's ids and
# collectives under a minute on the simt backend, where the kernels run as CPU code.
SIZES = (64, 256)
QUICK_SIZES = (16, 64)


def run(world: int, quick: bool) -> Dict[str, Any]:
    """Start ``world`` ranks (on the backend METRALE_FEED_BACKEND gives them) and return rank 0's
    figures."""
    sizes = QUICK_SIZES if quick else SIZES
    ranks = run_local_ranks("metrale_feed.tools.bench.tp", world,
                            ["3" if quick else "7", ",".join(map(str, sizes))])
    for returncode, _, stderr in ranks:
        if returncode != 0:
            raise RuntimeError(f"a bench rank failed (exit {returncode}):\n{stderr[-2000:]}")
    result = result_of(ranks[0][1])
    if result is None:
        raise RuntimeError("bench rank 0 printed no RESULT line")
    return result


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), [int(n) for n in sys.argv[5].split(",")],
          int(sys.argv[4]))
