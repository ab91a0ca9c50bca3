"""A VocabShard called from more than one thread of a rank (rank_main.py runs it; ``h`` is that
module, with the rank, the world and the helpers). A sharded call is a collective: a lock orders
two threads' calls within a rank, not across ranks, so each rank's n-th call could be another
thread's and the combine would pair unrelated blocks whose fingerprints agree. A shard belongs
to the thread that made it; any other thread gets a FeedError before anything is queued."""

import sys
import threading

import numpy as np

import metrale_feed as mf
from metrale_feed.errors import FeedError

CALLS = 30


def _expect_other_thread(call, what):
    try:
        call()
    except FeedError as exc:
        assert "belongs to thread" in str(exc), exc
    else:
        raise AssertionError(what)


def scenario_threads(h):
    """Two threads of every rank call one shard at once, each its own logits (the same on every
    rank for the same thread): the thread that made the shard gets numpy's argmax on every call;
    every call of the other thread (argmax, sample, verify, top_logprobs) is a FeedError
    naming both threads, with nothing queued (the counter and the collectives count the owner's
    calls alone), never an id from another call's blocks. close() may come from any thread."""
    sys.setswitchinterval(1e-6)  # thread switches anywhere, so the calls interleave
    vocab, rows = 300, 4
    shard = mf.VocabShard(None, vocab, max_rows=rows)
    through = shard.world > 1 or shard._force_exchange
    before = dict(shard.stats)
    seen = {name: {"exact": 0, "wrong": [], "refused": 0, "errors": []} for name in ("owner", "other")}
    start = threading.Barrier(2)

    def work(name, seed):
        rng = np.random.default_rng(seed)  # per thread, the same on every rank
        got = seen[name]
        start.wait()
        for i in range(CALLS):
            logits = rng.standard_normal((rows, vocab)).astype(np.float32)
            want = logits.argmax(axis=1)  # the independent reference (no ties, no NaN)
            try:  # one operation in both threads: the fingerprints of their calls agree
                ids, *_ = h.sharded(shard, logits, logprobs=False)
            except FeedError as exc:
                if "belongs to thread" not in str(exc):
                    got["errors"].append(repr(exc))
                got["refused"] += 1
                continue
            except BaseException as exc:  # noqa: BLE001 (reported below, with the thread)
                got["errors"].append(repr(exc))
                continue
            if np.array_equal(ids, want):
                got["exact"] += 1
            else:
                got["wrong"].append((i, ids.tolist(), want.tolist()))

    other = threading.Thread(target=work, args=("other", 2), name="other-thread", daemon=True)
    other.start()
    work("owner", 1)
    other.join(120)
    assert not other.is_alive(), "the other thread is stuck"
    owner, second = seen["owner"], seen["other"]
    assert not owner["errors"] and not second["errors"], seen
    assert not owner["wrong"] and not second["wrong"], f"wrong ids with no error: {seen}"
    assert owner["exact"] == CALLS, owner
    assert second["refused"] == CALLS, second
    # Nothing of the refused calls was queued: the call counter and the collectives are the owner's.
    assert shard._calls == (CALLS if through else 0), shard._calls
    assert shard.stats["collectives"] - before["collectives"] == (CALLS if through else 0), shard.stats

    # The other entry points: refused from another thread, before anything is queued.
    k, drafts = 2, np.zeros(2, np.uint32)
    logits = np.random.default_rng(3).standard_normal((rows, vocab)).astype(np.float32)
    lo, hi = shard.start, shard.stop
    width = hi - lo
    with mf.DeviceBuffer(max(1, (k + 1) * width * 4)) as part, mf.DeviceBuffer(rows * 8 * 3) as out, \
            mf.DeviceBuffer((k + 2) * 4) as cells:
        greedy = mf.sampling_params(rows, temperature=0.0)
        refusals = [
            lambda: h.sharded(shard, logits, params=greedy, logprobs=False),
            lambda: shard.top_logprobs(part if width else None, out, n=3, rows=rows, dtype="float32"),
            lambda: mf.verify_to_feed(part if width else None, drafts, cells, None, None, k=k, rows=1,
                                      dtype="float32", shard=shard),
        ]
        failed = []

        def refused_there():
            for i, call in enumerate(refusals):
                try:
                    _expect_other_thread(call, f"entry point {i} took a call from another thread")
                except BaseException as exc:  # noqa: BLE001 (reported in the owner's thread)
                    failed.append(repr(exc))

        t = threading.Thread(target=refused_there, name="verify-thread")
        t.start()
        t.join(60)
        assert not t.is_alive() and not failed, failed
        assert shard._calls == (CALLS if through else 0), shard._calls
        # The owner's shard still works after the other thread's refusals (nothing faulted it).
        ids, *_ = h.sharded(shard, logits, logprobs=False)
        assert np.array_equal(ids, logits.argmax(axis=1)), ids

    # A shard made in a thread belongs to that thread: the main thread's calls are refused.
    made = {}
    maker = threading.Thread(target=lambda: made.update(shard=mf.VocabShard(None, vocab, max_rows=rows)),
                             name="maker-thread")
    maker.start()
    maker.join(60)
    theirs = made["shard"]
    _expect_other_thread(lambda: h.sharded(theirs, logits, logprobs=False),
                         "the main thread called a shard another thread made")
    assert theirs._calls == 0

    # close() waits for the owner's calls from any thread.
    closer = threading.Thread(target=shard.close, name="closer-thread")
    closer.start()
    closer.join(60)
    assert not closer.is_alive()
    theirs.close()
    try:
        h.sharded(shard, logits, logprobs=False)
    except FeedError as exc:
        assert "closed" in str(exc), exc
    else:
        raise AssertionError("a closed shard took a call")


SCENARIOS = {"threads": scenario_threads}
