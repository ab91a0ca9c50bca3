#!/usr/bin/env python3
"""Soak: a long run of the asynchronous router on the reference model, two steps deep, with
sequences that finish and restart, checking that memory and live objects stay flat.

Every generated token is checked against the host computation of the reference logits
(``metrale_feed.testing.reference.host_next_token``) unless ``--verify-every`` thins it out. A row ends at
its stop id or when its sequence reaches ``--max-len``; its KV blocks go back to the pool and a new
prompt takes its place in the next launch, fed from a host id while the other rows are fed from
the previous step's cells. Resident memory and ``live_objects()`` are sampled at 10% of the steps
and at the end, in the same phase of the pipeline.

    python tools/soak.py                 # 1,000,000 steps, the README's figures
    python tools/soak.py --steps 20000   # what tests/test_soak.py runs by default
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections import deque
from typing import Any, Dict, List, Optional

NO_TOKEN = 0xFFFFFFFF


def resident_bytes() -> int:
    """Current resident set size of this process (not the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource  # no /proc (macOS): the peak is the best there is

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class Row:
    """One request in a batch slot: prompt, mask, stop id, the history the host has accepted."""

    __slots__ = ("seq", "prompt", "history", "mask", "stop", "limit", "generated", "done",
                 "launched", "released")

    def __init__(self, seq: Any, prompt: List[int], mask: tuple, stop: int, limit: int) -> None:
        self.seq, self.prompt, self.mask, self.stop, self.limit = seq, prompt, mask, stop, limit
        self.history = list(prompt)
        self.generated = 0
        self.done = False
        self.launched = 0
        self.released = False


class Soak:
    """The scheduler loop: launch step k+1 fed from step k's cells, then read step k."""

    def __init__(self, steps: int, *, rows: int = 4, vocab: int = 64, block_size: int = 4,
                 max_len: int = 24, seed: int = 0, dtype: str = "float32",
                 verify_every: int = 1, stream: Any = 0) -> None:
        import metrale_feed
        from metrale_feed.testing.reference import ReferenceModel
        from metrale_feed.sched.router import AsyncDeviceIo

        if max_len < 4:
            raise ValueError("max_len must leave room for a prompt and a token")
        self.mf = metrale_feed
        self.steps, self.rows, self.vocab, self.dtype = steps, rows, vocab, dtype
        self.max_len, self.verify_every = max_len, max(1, verify_every)
        self.rng = random.Random(seed)
        # Every row at its longest, plus the block a discarded step ahead may hold.
        self.num_blocks = rows * (max_len // block_size + 2) + 2
        self.model = ReferenceModel(vocab, block_size=block_size, num_blocks=self.num_blocks,
                                    max_rows=rows, logits_dtype=dtype, stream=stream)
        self.io = AsyncDeviceIo(self.model, rows, stream=stream)
        self.live: Dict[int, Row] = {}  # rows whose blocks are not yet back in the pool
        self.joining: List[Row] = [self._new_row() for _ in range(rows)]
        self.inflight: deque = deque()
        self.done_steps = 0
        self.tokens = 0
        self.checked = 0
        self.restarts = 0

    # ---- requests ----

    def _new_row(self) -> Row:
        from metrale_feed.kv import SequenceState
        from metrale_feed.testing.reference import host_next_token

        rng = self.rng
        prompt = [rng.randrange(self.vocab) for _ in range(rng.randint(2, 6))]
        mask = (NO_TOKEN, NO_TOKEN)
        if rng.random() < 0.5:  # ban the unmasked winner, so a lost mask shows in the tokens
            mask = (host_next_token(prompt, self.vocab, self.dtype), rng.randrange(self.vocab))
        stop = rng.randrange(self.vocab) if rng.random() < 0.25 else NO_TOKEN
        row = Row(SequenceState(0), prompt, mask, stop, self.max_len - len(prompt))
        self.model.prefill(row.seq, prompt[:-1])
        self.live[id(row)] = row
        return row

    def _release(self, row: Row) -> None:
        row.released = True
        del self.live[id(row)]
        self.model.release_sequence(row.seq)

    # ---- one step ----

    def _launch(self) -> None:
        from metrale_feed.feed import FeedSource

        ahead: List[Row] = []
        sources: List[int] = []
        if self.inflight:
            newest = self.inflight[-1][1]
            for index, r in enumerate(newest):
                if not r.done and r.launched < r.limit:
                    ahead.append(r)
                    sources.append(FeedSource.feed(index))
        joining, self.joining = self.joining, []
        sources += [FeedSource.host(r.prompt[-1]) for r in joining]
        order = ahead + joining
        if not order:
            return
        for r in order:
            self.io.reserve_kv(r.seq)
            r.launched += 1
        ticket = self.io.launch_fed(sources, [r.seq for r in order], [r.mask for r in order])
        for r in joining:  # a host-known input: the core pushes it at once
            r.seq.tokens.append(r.prompt[-1])
            r.seq.seq_len += 1
        self.inflight.append((ticket, order))

    def _verify(self, r: Row, token: int) -> None:
        from metrale_feed.testing.reference import host_next_token

        self.tokens += 1
        if self.tokens % self.verify_every:
            return
        want = host_next_token(r.history, self.vocab, self.dtype, r.mask)
        self.checked += 1
        if token != want:
            raise AssertionError(f"step {self.done_steps}: token {token}, the host reference says "
                                 f"{want} after history {r.history} under mask {r.mask}")

    def _read(self) -> None:
        ticket, order = self.inflight.popleft()
        ids = self.io.await_result(ticket)
        self.done_steps += 1
        next_rows = {id(r) for r in self.inflight[0][1]} if self.inflight else set()
        for r, token in zip(order, ids):
            if r.done:
                continue  # a discarded step launched before the row stopped
            self._verify(r, token)
            r.history.append(token)
            r.generated += 1
            if token == r.stop or r.generated >= r.limit:
                r.done = True
            if id(r) in next_rows:
                if r.done:
                    self.io.rollback(r.seq)  # its step ahead is discarded
                else:
                    r.seq.tokens.append(token)  # the step ahead wrote this id's KV
                    r.seq.seq_len += 1
        for r in order:
            if r.done and not r.released:
                # Work still queued on this stream that reads these blocks runs before anything
                # a new sequence queues into them, so they may go back to the pool now.
                self._release(r)
                self.restarts += 1
                self.joining.append(self._new_row())

    def step(self) -> None:
        if not self.inflight:  # the start, or every row ended in the step just read
            self._launch()
        if len(self.inflight) < 2:  # the step ahead, fed from the newest step's cells
            self._launch()
        self._read()

    # ---- the run ----

    def sample(self) -> Dict[str, Any]:
        gc.collect()
        return {"step": self.done_steps, "rss": resident_bytes(), "live": self.mf.live_objects(),
                "pool_free": self.model.pool.free_count}

    def run(self, sample_at: float = 0.1, progress: Optional[Any] = None) -> Dict[str, Any]:
        first_sample = max(1, int(self.steps * sample_at))
        samples = []
        start = time.perf_counter()
        while self.done_steps < self.steps:
            self.step()
            if self.done_steps == first_sample and not samples:
                samples.append(self.sample())
            if progress and self.done_steps % 10000 == 0:
                progress(self)
        samples.append(self.sample())
        elapsed = time.perf_counter() - start
        looped = self.done_steps
        while self.inflight:  # drain what is still launched, verifying it too
            self._read()
        self.close()
        return {"steps": looped, "drained": self.done_steps - looped, "tokens": self.tokens, "checked": self.checked,
                "restarts": self.restarts, "seconds": elapsed, "samples": samples,
                "stats": self.io.stats.as_dict(), "pool_free_at_end": self.model.pool.free_count,
                "num_blocks": self.num_blocks, "live_after_close": self._settled_live()}

    def _settled_live(self, timeout: float = 2.0) -> dict:
        """live_objects() once nothing is live, or after ``timeout``: a free is performed once
        every stream has passed the work queued before it (docs/lifetimes.md, rule 5)."""
        deadline = time.monotonic() + timeout
        while True:
            live = self.mf.live_objects()
            if not any(live.values()) or time.monotonic() > deadline:
                return live
            time.sleep(0.005)

    def close(self) -> None:
        self.io.teardown()
        for r in list(self.live.values()):
            self._release(r)
        self.joining = []
        self.inflight.clear()
        self.model.close()


def report(result: Dict[str, Any]) -> str:
    first, last = result["samples"][0], result["samples"][-1]
    mib = 1 << 20
    lines = [
        f"soak: {result['steps']} router steps (+{result['drained']} drained), "
        f"{result['tokens']} tokens "
        f"({result['checked']} checked against the host reference), {result['restarts']} "
        f"sequence restarts, {result['seconds']:.1f} s "
        f"({result['seconds'] / max(1, result['steps']) * 1e6:.1f} us/step)",
        f"  RSS at step {first['step']}: {first['rss'] / mib:.2f} MiB; at step {last['step']}: "
        f"{last['rss'] / mib:.2f} MiB; growth {(last['rss'] - first['rss']) / 1024:+.0f} KiB",
        f"  live_objects at step {first['step']}: {first['live']}",
        f"  live_objects at step {last['step']}: {last['live']}",
        f"  KV pool free at the samples: {first['pool_free']}, {last['pool_free']}; at the end "
        f"{result['pool_free_at_end']} of {result['num_blocks']}",
        f"  router stats: {result['stats']}",
        f"  live_objects after teardown and close: {result['live_after_close']}",
    ]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--max-len", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify-every", type=int, default=1,
                        help="check every Nth token against the host reference (1: all)")
    parser.add_argument("--rss-bound-kib", type=int, default=2048,
                        help="fail when RSS grows more than this between the samples")
    args = parser.parse_args(argv)

    import metrale_feed

    if metrale_feed.backend() != "host":
        metrale_feed.set_backend("host")
    soak = Soak(args.steps, rows=args.rows, vocab=args.vocab, block_size=args.block_size,
                max_len=args.max_len, seed=args.seed, verify_every=args.verify_every)

    def progress(s: Soak) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{s.done_steps}/{s.steps} steps")
            sys.stderr.flush()

    result = soak.run(progress=progress)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    print(report(result))
    first, last = result["samples"][0], result["samples"][-1]
    flat = (last["rss"] - first["rss"] <= args.rss_bound_kib * 1024 and first["live"] == last["live"]
            and result["pool_free_at_end"] == result["num_blocks"]
            and not any(result["live_after_close"].values()))
    print(f"flat: {flat}")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
