"""A VocabShard used by several threads of one rank: each sharded call is queued whole (its
call counter, its slot and its collectives never interleave with another thread's), so the
ids are exact and the call counter, which every rank must agree on, counts every call. In a
child interpreter with a timeout."""

from __future__ import annotations

import os

import pytest

from helpers.child import run_python

pytest.importorskip("torch.distributed")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_two_threads_on_one_shard_get_exact_ids_and_one_counter():
    code = rf"""
import sys, threading
import numpy as np
import torch.distributed as dist
sys.path.insert(0, {HERE!r})
sys.setswitchinterval(1e-6)  # thread switches anywhere, so a race shows
from helpers.child import free_port
import metrale_feed as mf

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0,
                        world_size=1)
shard = mf.VocabShard(None, 300, max_rows=4)
shard._force_exchange = True  # a world of one runs the partial, the exchange and the combine
CALLS = 120
errors, wrong = [], []

def work(seed):
    rng = np.random.default_rng(seed)
    try:
        for i in range(CALLS):
            logits = rng.standard_normal((4, 300)).astype(np.float32)
            want = logits.argmax(axis=1).tolist()  # the independent reference
            with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(16) as cells, \
                    mf.Event() as done:
                mf.copy_h2d_async(dev, logits.view(np.uint8))
                dst = np.zeros(4, np.uint32)
                mf.argmax_to_feed(dev, None, cells, dst, done, 0, rows=4, vocab=300,
                                  dtype="float32", shard=shard)
                done.synchronize()
                if dst.tolist() != want:
                    wrong.append((seed, i, dst.tolist(), want))
    except BaseException as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(90)
assert not any(t.is_alive() for t in threads), "a thread is stuck"
assert not errors, errors
assert not wrong, wrong[:3]
assert shard._calls == 2 * CALLS, (shard._calls, 2 * CALLS)
assert shard.stats["collectives"] == 2 * CALLS
shard.close()
dist.destroy_process_group()
print("OK")
"""
    result = run_python(code, timeout=150)
    assert "OK" in result.stdout, result.describe()
