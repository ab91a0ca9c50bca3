"""``metrale-feed demo``: requests through the decode pipeline two steps deep and settled step by
step, on the reference model, checked against the host computation of the reference logits."""

from __future__ import annotations

import random
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from ._core import stream_synchronize
from .feed import NO_TOKEN
from .pipeline import DecodePipeline, Request
from .reference import ReferenceModel, host_next_token
from .timeline import Recorder


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


def _run(model: ReferenceModel, requests: List[Dict[str, Any]], max_new: int, depth: int,
         host_work_us: float, progress: Optional[Any], shuffle: Optional[random.Random],
         work_kind: str, recorder: Optional[Recorder], span: str) -> Dict[str, Any]:
    """Every request through a DecodePipeline of ``depth``, the host work after each step; the
    tokens in the order of ``requests`` (``shuffle`` changes the order they are submitted in)."""
    order = list(range(len(requests)))
    if shuffle is not None:
        shuffle.shuffle(order)
    rec = _Timed(recorder)
    steps = 0
    with DecodePipeline(model, len(requests), depth=depth) as pipe:
        reqs: Dict[int, Request] = {}
        for i in order:
            r = requests[i]
            stops = () if r["stop"] == NO_TOKEN else (r["stop"],)
            ban = None if tuple(r["mask"]) == (NO_TOKEN, NO_TOKEN) else r["mask"]
            reqs[i] = pipe.submit(r["prompt"], max_new_tokens=max_new, stop_ids=stops, ban=ban)
        # Prefill before the clock starts (and has run: a harness may wait): decode is timed.
        pipe.admit()
        stream_synchronize(pipe.stream)
        start = time.perf_counter()
        while not pipe.idle:
            mark = rec.start(span)
            pipe.step()
            rec.stop(mark)
            steps += 1
            rec.host_work(host_work_us, work_kind)
            if progress:
                progress(sum(len(q.tokens) for q in reqs.values()))
        elapsed = time.perf_counter() - start
        stats = pipe.stats.as_dict()
    return {"tokens": [reqs[i].tokens for i in range(len(requests))], "seconds": elapsed,
            "steps": steps, "stats": stats}


def run_async(model: ReferenceModel, requests: List[Dict[str, Any]], max_new: int,
              host_work_us: float = 0.0, progress: Optional[Any] = None,
              shuffle: Optional[random.Random] = None, work_kind: str = "sleep",
              recorder: Optional[Recorder] = None) -> Dict[str, Any]:
    """Two steps deep: the pipeline launches step k+1 (fed from step k's cells), then reads
    step k, so the host work after a step overlaps the device's next one."""
    return _run(model, requests, max_new, 2, host_work_us, progress, shuffle, work_kind,
                recorder, "step (launch ahead + await)")


def run_sync(model: ReferenceModel, requests: List[Dict[str, Any]], max_new: int,
             host_work_us: float = 0.0, progress: Optional[Any] = None,
             work_kind: str = "sleep", recorder: Optional[Recorder] = None) -> Dict[str, Any]:
    """Every step settled before the next (depth 1)."""
    return _run(model, requests, max_new, 1, host_work_us, progress, None, work_kind,
                recorder, "launch decode + settle")


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
