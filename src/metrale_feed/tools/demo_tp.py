"""``metrale-feed demo --tp N``: the demo's requests decoded SPMD by N local ranks, each holding a
slice of the vocabulary (docs/tensor-parallel.md), checked against the single-rank run.

The ranks are separate processes in one gloo group on 127.0.0.1; every rank makes the same
sharded ``ReferenceModel`` and ``DecodePipeline`` and submits the same requests. Needs torch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

from ..tp.local_ranks import result_of, run_local_ranks
from ..feed import NO_TOKEN


def _decode(requests: List[Dict[str, Any]], max_new: int, vocab: int, dtype: str,
            block_size: int, shard: Any) -> List[List[int]]:
    from ..sched.pipeline import DecodePipeline
    from ..testing.reference import ReferenceModel

    rows = len(requests)
    model = ReferenceModel(vocab, block_size=block_size,
                           num_blocks=rows * ((24 + max_new) // block_size + 3), max_rows=rows,
                           logits_dtype=dtype, shard=shard)
    try:
        with DecodePipeline(model, rows, depth=2, shard=shard) as pipe:
            reqs = []
            for r in requests:
                stops = () if r["stop"] == NO_TOKEN else (r["stop"],)
                ban = None if tuple(r["mask"]) == (NO_TOKEN, NO_TOKEN) else tuple(r["mask"])
                reqs.append(pipe.submit(r["prompt"], max_new_tokens=max_new, stop_ids=stops,
                                        ban=ban, **(r.get("sampling") or {})))
            pipe.run()
        return [list(q.tokens) for q in reqs]
    finally:
        model.close()


def _rank(rank: int, world: int, port: int, spec: Dict[str, Any]) -> None:
    import datetime

    import torch.distributed as dist

    from ..tp.shard import VocabShard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    shard = VocabShard(None, spec["vocab"], max_rows=len(spec["requests"]))
    start = time.perf_counter()
    tokens = _decode(spec["requests"], spec["max_new"], spec["vocab"], spec["dtype"],
                     spec["block_size"], shard)
    seconds = time.perf_counter() - start
    every: List[Any] = [None] * world
    dist.all_gather_object(every, tokens)
    print("RESULT " + json.dumps({"tokens": tokens, "ranks_agree": all(e == tokens for e in every),
                                  "seconds": seconds, "stats": shard.stats,
                                  "slice": [shard.start, shard.stop]}), flush=True)
    os._exit(0)


def run(world: int, requests: List[Dict[str, Any]], max_new: int, vocab: int, dtype: str,
        block_size: int) -> int:
    """Decode on ``world`` ranks and on one; print whether every rank's tokens equal the
    single-rank run's. Returns the exit status (0: equal)."""
    single = _decode(requests, max_new, vocab, dtype, block_size, None)
    spec = {"requests": requests, "max_new": max_new, "vocab": vocab, "dtype": dtype,
            "block_size": block_size}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "spec.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        ranks = run_local_ranks("metrale_feed.tools.demo_tp", world, [path])
    results = []
    for returncode, out, err in ranks:
        res = result_of(out)
        if returncode != 0 or res is None:
            print(f"a rank failed (exit {returncode}):\n{err[-2000:]}", file=sys.stderr)
            return 1
        results.append(res)
    for r, res in enumerate(results):
        print(f"rank {r}: ids [{res['slice'][0]}, {res['slice'][1]}), "
              f"{sum(len(t) for t in res['tokens'])} tokens in {res['seconds']:.2f} s, "
              f"{res['stats']['collectives']} collectives, {res['stats']['bytes_sent']} bytes sent")
    same = all(res["tokens"] == single and res["ranks_agree"] for res in results)
    print(f"tokens equal the single-rank run on all {world} ranks: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    with open(sys.argv[4]) as spec_file:
        spec_read = json.load(spec_file)
    _rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), spec_read)
