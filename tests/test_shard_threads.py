"""A VocabShard used by several threads of one rank. A sharded call is a collective: a lock would
order two threads' calls within a rank but not across ranks (each rank's n-th call could be the
other thread's, paired with unrelated blocks whose fingerprints agree), so a shard takes calls
from the thread that made it alone; another thread's call is a FeedError before anything is
queued, and close() may come from any thread. In a child interpreter with a timeout (tests/tp
runs the same on 2 and 3 gloo ranks: rank_threads.py)."""

from __future__ import annotations

import pytest

from helpers.child import run_python, world_of_one

pytest.importorskip("torch.distributed")

PRELUDE = r"""
import sys, threading
import numpy as np
sys.setswitchinterval(1e-6)  # thread switches anywhere, so a race shows
import metrale_feed as mf
from metrale_feed.errors import FeedError

CALLS = 60

def call(shard, rng):
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    want = logits.argmax(axis=1).tolist()  # the independent reference
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(16) as cells, mf.Event() as done:
        mf.copy_h2d_async(dev, logits.view(np.uint8))
        dst = np.zeros(4, np.uint32)
        mf.argmax_to_feed(dev, None, cells, dst, done, 0, rows=4, vocab=300, dtype="float32",
                          shard=shard)
        done.synchronize()
    return dst.tolist(), want
"""


@pytest.mark.parametrize("through", [True, False], ids=["exchange", "unsharded"])
def test_a_thread_that_did_not_make_the_shard_gets_feed_error_never_an_id(through):
    code = world_of_one(PRELUDE + rf"""
shard = mf.VocabShard(None, 300, max_rows=4)
shard._force_exchange = {through!r}  # the path of every world (partial, exchange, combine)
seen = {{"owner": [0, [], []], "other": [0, [], []]}}  # exact, wrong, refused
go = threading.Barrier(2)

def work(name, seed):
    rng = np.random.default_rng(seed)
    go.wait()
    for i in range(CALLS):
        try:
            got, want = call(shard, rng)
        except FeedError as exc:
            seen[name][2].append(str(exc))
            continue
        if got == want:
            seen[name][0] += 1
        else:
            seen[name][1].append((i, got, want))

other = threading.Thread(target=work, args=("other", 1), name="second", daemon=True)
other.start()
work("owner", 0)
other.join(90)
assert not other.is_alive(), "the other thread is stuck"
assert seen["owner"][0] == CALLS and not seen["owner"][1] and not seen["owner"][2], seen["owner"]
assert seen["other"][0] == 0 and not seen["other"][1], seen["other"]
assert len(seen["other"][2]) == CALLS, seen["other"]
assert all("belongs to thread 'MainThread'" in why and "'second'" in why for why in seen["other"][2])
assert shard._calls == (CALLS if {through!r} else 0), shard._calls
assert shard.stats["collectives"] == (CALLS if {through!r} else 0), shard.stats
shard.close()
""")
    result = run_python(code, timeout=150)
    assert "OK" in result.stdout, result.describe()


def test_close_from_another_thread_while_the_owner_calls():
    # The lock's other use: close() waits for the call being queued, frees what the pending
    # calls hold, and the owner's next call is refused as closed; every id before it is exact.
    code = world_of_one(PRELUDE + r"""
shard = mf.VocabShard(None, 300, max_rows=4)
shard._force_exchange = True
rng = np.random.default_rng(0)
closer = threading.Thread(target=shard.close, name="closer", daemon=True)
exact, refused = 0, None
for i in range(CALLS):
    if i == 5:
        closer.start()
    try:
        got, want = call(shard, rng)
    except FeedError as exc:
        refused = str(exc)
        break
    assert got == want, (i, got, want)
    exact += 1
closer.join(60)
assert not closer.is_alive(), "close() is stuck"
if refused is None:  # the owner finished first: closed now
    try:
        call(shard, rng)
    except FeedError as exc:
        refused = str(exc)
assert refused is not None and "closed" in refused, refused
assert exact >= 5 and not shard._pending and not shard._rings, (exact, shard._pending)
""")
    result = run_python(code, timeout=150)
    assert "OK" in result.stdout, result.describe()


def test_a_grammar_call_from_another_thread_queues_no_mask():
    # A pick with grammar= queues its mask before the pick: the thread check comes first, so
    # another thread's call leaves the automaton's scratch and the state words as they were.
    code = world_of_one(PRELUDE + r"""
from metrale_feed import TokenAutomaton
shard = mf.VocabShard(None, 300, max_rows=4)
shard._force_exchange = True
auto = TokenAutomaton({0: {5: 0, 7: 0}}, initial=0, vocab=300)
auto.to_device()
logits = np.random.default_rng(1).standard_normal((4, 300)).astype(np.float32)
words = 4 * ((300 + 31) // 32)
marker = np.full(words, 0xA5A5A5A5, np.uint32)
with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(16) as cells, \
        mf.DeviceBuffer(16) as states, mf.DeviceBuffer(words * 4) as scratch:
    mf.copy_h2d_async(dev, logits.view(np.uint8))
    mf.copy_h2d_async(states, np.zeros(4, np.uint32))
    mf.copy_h2d_async(scratch, marker)
    mf.stream_synchronize(0)
    outcome = []

    def other():
        try:
            mf.argmax_to_feed(dev, None, cells, None, None, 0, rows=4, vocab=300,
                              dtype="float32", shard=shard, grammar=(auto, states, scratch))
            outcome.append("ran")
        except FeedError as error:
            outcome.append(str(error))

    t = threading.Thread(target=other)
    t.start(); t.join()
    mf.stream_synchronize(0)
    back = np.zeros(words, np.uint32)
    mf.copy_d2h_async(scratch, back)
    st = np.ones(4, np.uint32)
    mf.copy_d2h_async(states, st)
    mf.stream_synchronize(0)
    assert outcome and "belongs to thread" in outcome[0], outcome
    assert (back == marker).all(), "the other thread's mask was queued"
    assert st.tolist() == [0, 0, 0, 0]
auto.close()
shard.close()
""")
    done = run_python(code, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
