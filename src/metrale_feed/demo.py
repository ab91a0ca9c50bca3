"""``metrale-feed demo``: sequences through the async router two steps deep and through the sync
router, on the reference model, checked against the host computation of the reference logits."""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from typing import Any, Dict, List, Optional, Tuple

from .feed import NO_TOKEN, FeedSource
from .kv import SequenceState
from .reference import ReferenceModel, host_next_token
from .router import AsyncDeviceIo, SyncDeviceIo
from .timeline import Recorder


class Row:
    """One request: its prompt, mask, stop id and what it has generated so far."""

    __slots__ = ("index", "prompt", "mask", "stop", "max_new", "seq", "out", "done", "launched")

    def __init__(self, index: int, prompt: List[int], mask: Tuple[int, int], stop: int, max_new: int) -> None:
        self.index, self.prompt, self.mask, self.stop, self.max_new = index, prompt, mask, stop, max_new
        self.seq: SequenceState = SequenceState(index)
        self.out: List[int] = []
        self.done = False
        self.launched = 0

    def accept(self, token: int) -> None:
        self.out.append(token)
        if token == self.stop or len(self.out) >= self.max_new:
            self.done = True


def host_reference(prompt: List[int], mask: Tuple[int, int], stop: int, max_new: int, vocab: int,
                   dtype: str) -> List[int]:
    history, out = list(prompt), []  # type: List[int], List[int]
    while len(out) < max_new:
        token = host_next_token(history, vocab, dtype, mask)
        out.append(token)
        history.append(token)
        if token == stop:
            break
    return out


def make_requests(rows: int, max_new: int, vocab: int, dtype: str, seed: int) -> List[Dict[str, Any]]:
    """Random prompts and masks; a quarter of the rows stop on an id they would generate."""
    rng = random.Random(seed)
    requests = []
    for index in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 24))]
        mask = (NO_TOKEN, NO_TOKEN)
        if index % 2:  # ban the unmasked winner, so a wrong mask shows in the tokens
            mask = (host_next_token(prompt, vocab, dtype), rng.randrange(vocab))
        stop = NO_TOKEN
        if index % 4 == 3 and max_new > 1:
            trajectory = host_reference(prompt, mask, NO_TOKEN, max_new, vocab, dtype)
            stop = trajectory[rng.randrange(max_new - 1)]
        requests.append({"prompt": prompt, "mask": mask, "stop": stop})
    return requests


def host_work(us: float, kind: str = "sleep") -> None:
    """The scheduler's own time per step: "sleep" is time off the CPU (waiting on the network or
    another process); "spin" is Python work holding the GIL and a core."""
    if us <= 0:
        return
    if kind == "sleep":
        time.sleep(us / 1e6)
        return
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


class _Timed:
    """Host spans and device marks for a Recorder; free when there is none."""

    __slots__ = ("recorder",)

    def __init__(self, recorder: Optional[Recorder]) -> None:
        self.recorder = recorder

    def start(self, name: str) -> Any:
        if self.recorder is None:
            return None
        pair = self.recorder.mark_device(name)
        if pair is not None:
            pair[0].record(0)
        return (name, self.recorder.begin(), pair)

    def stop(self, mark: Any) -> None:
        if mark is not None:
            name, begin, pair = mark
            if pair is not None:
                pair[1].record(0)
            self.recorder.end(name, begin)  # type: ignore[union-attr]

    def host_work(self, us: float, kind: str) -> None:
        mark = self.start("host work")
        host_work(us, kind)
        self.stop(mark)


def _rows(model: ReferenceModel, requests: List[Dict[str, Any]], max_new: int) -> List[Row]:
    rows = [Row(i, r["prompt"], r["mask"], r["stop"], max_new) for i, r in enumerate(requests)]
    for row in rows:
        model.prefill(row.seq, row.prompt[:-1])
    return rows


def _result(model: ReferenceModel, rows: List[Row], io: AsyncDeviceIo, seconds: float,
            steps: int) -> Dict[str, Any]:
    """What a run produced; its sequences' blocks go back to the pool."""
    for r in rows:
        model.release_sequence(r.seq)
    return {"tokens": [r.out for r in rows], "seconds": seconds, "steps": steps,
            "stats": io.stats.as_dict()}


def run_async(model: ReferenceModel, requests: List[Dict[str, Any]], max_new: int,
              host_work_us: float = 0.0, progress: Optional[Any] = None,
              shuffle: Optional[random.Random] = None, work_kind: str = "sleep",
              recorder: Optional[Recorder] = None) -> Dict[str, Any]:
    """The two-deep pipeline: launch step k+1 (fed from step k's cells), then read step k."""
    rows = _rows(model, requests, max_new)
    io = AsyncDeviceIo(model, len(rows))
    rec = _Timed(recorder)
    start = time.perf_counter()
    steps = 0
    try:
        first = list(rows)
        mark = rec.start("launch decode")
        inflight = deque([(io.launch_decode([r.prompt[-1] for r in first], [r.seq for r in first],
                                            [r.mask for r in first]), first)])
        rec.stop(mark)
        for r in first:
            r.launched = 1
        while inflight:
            newest = inflight[-1][1]
            if len(inflight) < 2:
                ahead = [r for r in newest if not r.done and r.launched < r.max_new]
                if shuffle is not None:
                    shuffle.shuffle(ahead)
                if ahead:
                    mark = rec.start("launch fed")
                    where = {id(r): i for i, r in enumerate(newest)}
                    for r in ahead:
                        io.reserve_kv(r.seq)
                        r.launched += 1
                    ticket = io.launch_fed([FeedSource.feed(where[id(r)]) for r in ahead],
                                           [r.seq for r in ahead], [r.mask for r in ahead])
                    inflight.append((ticket, ahead))
                    rec.stop(mark)
            ticket, order = inflight.popleft()
            mark = rec.start("await")
            ids = io.await_result(ticket)
            rec.stop(mark)
            steps += 1
            rec.host_work(host_work_us, work_kind)
            next_rows = {id(r) for r in inflight[0][1]} if inflight else set()
            for r, token in zip(order, ids):
                if r.done:
                    continue  # a discarded step launched before the row stopped
                r.accept(token)
                if id(r) in next_rows:
                    if r.done:
                        io.rollback(r.seq)  # its step ahead is discarded
                    else:
                        r.seq.tokens.append(token)  # the step ahead wrote this id's KV
                        r.seq.seq_len += 1
            if progress:
                progress(sum(len(r.out) for r in rows))
        elapsed = time.perf_counter() - start
    finally:
        io.teardown()
    return _result(model, rows, io, elapsed, steps)


def run_sync(model: ReferenceModel, requests: List[Dict[str, Any]], max_new: int,
             host_work_us: float = 0.0, progress: Optional[Any] = None,
             work_kind: str = "sleep", recorder: Optional[Recorder] = None) -> Dict[str, Any]:
    """Every step settled before the next: the inputs are host-known, so launch_decode."""
    rows = _rows(model, requests, max_new)
    io = SyncDeviceIo(model, len(rows))
    rec = _Timed(recorder)
    start = time.perf_counter()
    steps = 0
    try:
        inputs = {r.index: r.prompt[-1] for r in rows}
        while True:
            live = [r for r in rows if not r.done]
            if not live:
                break
            mark = rec.start("launch decode + settle")
            ticket = io.launch_decode([inputs[r.index] for r in live], [r.seq for r in live],
                                      [r.mask for r in live])
            ids = io.await_result(ticket)
            rec.stop(mark)
            steps += 1
            rec.host_work(host_work_us, work_kind)
            for r, token in zip(live, ids):
                r.accept(token)
                inputs[r.index] = token
            if progress:
                progress(sum(len(r.out) for r in rows))
        elapsed = time.perf_counter() - start
    finally:
        io.teardown()
    return _result(model, rows, io, elapsed, steps)


class Progress:
    """A one-line progress bar on stderr (no dependency)."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled, self.last = label, max(1, total), enabled, -1

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        filled = 30 * done // self.total
        if filled != self.last:
            self.last = filled
            sys.stderr.write(f"\r{self.label:>6} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total}")
            sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def main(args: Any) -> int:
    import metrale_feed

    if args.backend != "auto":
        metrale_feed.set_backend(args.backend)
    device = "GPU"
    if metrale_feed.backend() == "host":
        device = f"{metrale_feed.host_kernel_threads(args.device_threads)} device thread(s)"
    print(f"metrale-feed demo: backend {metrale_feed.backend()} ({device}), {args.rows} rows, up to "
          f"{args.tokens} new tokens, vocab {args.vocab}, {args.dtype}, seed {args.seed}")
    requests = make_requests(args.rows, args.tokens, args.vocab, args.dtype, args.seed)
    expected = [host_reference(r["prompt"], r["mask"], r["stop"], args.tokens, args.vocab, args.dtype)
                for r in requests]
    total = sum(len(e) for e in expected)
    show = not args.quiet and sys.stderr.isatty()
    model = ReferenceModel(args.vocab, block_size=args.block_size,
                           num_blocks=args.rows * ((24 + args.tokens) // args.block_size + 3),
                           max_rows=args.rows, logits_dtype=args.dtype)
    try:
        free_at_start = model.pool.free_count
        timed = bool(args.trace or args.plot)
        recorders: List[Optional[Recorder]] = [None, None]
        bar = Progress("async", total, show)
        if timed:  # each recorder starts the host trace afresh, so make it just before its run
            recorders[0] = Recorder("async router (two steps deep)")
        fast = run_async(model, requests, args.tokens, args.host_work_us, bar, work_kind=args.host_work,
                         recorder=recorders[0])
        if recorders[0]:
            recorders[0].finish()
        bar.finish()
        bar = Progress("sync", total, show)
        if timed:
            recorders[1] = Recorder("sync router")
        slow = run_sync(model, requests, args.tokens, args.host_work_us, bar, work_kind=args.host_work,
                        recorder=recorders[1])
        if recorders[1]:
            recorders[1].finish()
        bar.finish()
        pool_ok = model.pool.free_count == free_at_start
    finally:
        model.close()
    same = fast["tokens"] == slow["tokens"] == expected
    for name, run in (("async", fast), ("sync", slow)):
        per_step = run["seconds"] / max(1, run["steps"]) * 1e6
        print(f"{name:>6}: {total / run['seconds']:10.0f} tokens/s  {run['steps']:4d} steps  "
              f"{per_step:8.1f} us/step")
    print(f"speedup async/sync: {slow['seconds'] / fast['seconds']:.2f}x "
          f"(host work {args.host_work_us:g} us/step, {args.host_work})")
    print(f"router stats: {fast['stats']}")
    print(f"tokens: async == sync == host reference: {same}; {total} tokens; KV pool back to start: {pool_ok}")
    if args.trace:
        from .timeline import write_trace

        write_trace(args.trace, [r for r in recorders if r is not None])
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
    if args.plot:
        from .timeline import plot

        plot(args.plot, [r for r in recorders if r is not None])
        print(f"plot: {args.plot}")
    live = metrale_feed.live_objects()
    print(f"live objects after teardown: {live}")
    return 0 if same and pool_ok and not any(live.values()) else 1
