"""``metrale-feed demo``: requests through the decode pipeline two steps deep and settled step by
step, on the reference model, checked against the host computation of the reference logits."""

from __future__ import annotations

import contextlib
import random
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .. import _core
from .._core import stream_synchronize
from ..feed import NO_TOKEN
from ..sched.pipeline import DecodePipeline
from ..sched.request import Request
from ..testing.reference import ReferenceModel, host_next_token, reference_tokens
from .timeline import Recorder



def settled_live_objects(timeout=2.0):
    """live_objects() once nothing is live, or after ``timeout`` seconds: a free is performed
    once every stream has passed the work queued before it (docs/lifetimes.md, rule 5), so
    memory freed at teardown may still be counted for a moment."""
    deadline = time.monotonic() + timeout
    while True:
        live = _core.live_objects()
        if not any(live.values()) or time.monotonic() > deadline:
            return live
        time.sleep(0.005)

def host_reference(prompt: List[int], mask: Tuple[int, int], stop: int, max_new: int, vocab: int,
                   dtype: str, sampling: Optional[Dict[str, Any]] = None) -> List[int]:
    """The tokens of one request decoded alone, on the host: ``reference_tokens`` (the one
    reference-token oracle, shared with the tests) with one stop id (``NO_TOKEN``: none). A
    sampled request (``sampling``: ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``;
    temperature above 0) draws on the active backend (``main`` makes it the host backend)."""
    return reference_tokens(prompt, max_new, vocab, dtype, mask=mask, stops=(stop,),
                            sampling=sampling)


@contextlib.contextmanager
def on_host_backend(needed: bool = True) -> Iterator[None]:
    """The host backend for the block (when ``needed``), the previous one back after it: the
    sampled references run on the host whatever backend the demo decodes on. On simt they run on
    simt, which gives the host backend's bits by contract (tests/simt checks it byte for byte)
    and shares its runtime: a switch would only race the objects the demo still holds."""
    import metrale_feed

    previous = metrale_feed.backend()
    if not needed or previous in ("host", "simt"):
        yield
        return
    metrale_feed.set_backend("host")
    try:
        yield
    finally:
        metrale_feed.set_backend(previous)


def make_requests(rows: int, max_new: int, vocab: int, dtype: str, seed: int,
                  sampling: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Random prompts and masks; a quarter of the rows stop on an id they would generate.
    ``sampling`` (``temperature``, ``top_k``, ``top_p``, ``min_p``): every request samples
    with them and a seed of its own."""
    rng = random.Random(seed)
    requests = []
    for index in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 24))]
        mask = (NO_TOKEN, NO_TOKEN)
        if index % 2:  # ban the unmasked winner, so a wrong mask shows in the tokens
            mask = (host_next_token(prompt, vocab, dtype), rng.randrange(vocab))
        own = None
        if sampling and sampling.get("temperature", 0.0) > 0.0:
            own = dict(sampling, seed=rng.getrandbits(64))
        stop = NO_TOKEN
        if index % 4 == 3 and max_new > 1:
            trajectory = host_reference(prompt, mask, NO_TOKEN, max_new, vocab, dtype, own)
            stop = trajectory[rng.randrange(max_new - 1)]
        requests.append({"prompt": prompt, "mask": mask, "stop": stop, "sampling": own})
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
            reqs[i] = pipe.submit(r["prompt"], max_new_tokens=max_new, stop_ids=stops, ban=ban,
                                  **(r.get("sampling") or {}))
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


def _references(requests: List[Dict[str, Any]], max_new: int, vocab: int, dtype: str,
                show: bool) -> List[List[int]]:
    """The host computation of every row's tokens: what both routers must produce."""
    bar = Progress("check", len(requests), show)
    expected = []
    for i, r in enumerate(requests):
        expected.append(host_reference(r["prompt"], r["mask"], r["stop"], max_new, vocab, dtype,
                                       r.get("sampling")))
        bar(i + 1)
    bar.finish()
    return expected


def measure_step_us(model: ReferenceModel, requests: List[Dict[str, Any]], max_new: int) -> float:
    """One device step of these rows, in microseconds: the sync router with no host work (each
    step settled before the next), best of two short runs after a warm-up."""
    steps = min(max_new, 8)
    run_sync(model, requests, min(max_new, 2))  # first touches of the buffers
    runs = [run_sync(model, requests, steps) for _ in range(2)]
    return float(min(r["seconds"] / max(1, r["steps"]) for r in runs)) * 1e6


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1000 else f"{us:.0f} us"


def _report(args: Any, work_us: float, step_us: Optional[float], fast: Dict[str, Any],
            slow: Dict[str, Any], total: int, checks: Dict[str, bool]) -> None:
    """What the two runs showed and what was checked, in words."""
    for name, run in (("async", fast), ("sync", slow)):
        per_step = run["seconds"] / max(1, run["steps"]) * 1e6
        print(f"{name:>6}: {total / run['seconds']:10.0f} tokens/s  {run['steps']:4d} steps  "
              f"{_ms(per_step):>9}/step")
    speedup = slow["seconds"] / fast["seconds"]
    print(f"result: the async router finished {speedup:.2f}x as fast as the sync one.")
    if work_us > 0:
        print("  The async router launches step k+1 from the feed cells on the device before it "
              "reads step k, so\n  the device computes while the scheduler works; the sync router "
              "waits for each step, then works,\n  so the two add up. With host work equal to a "
              "device step the limit is 2x.")
    else:
        print("  With no host work there is nothing to overlap: both routers wait on the device "
              "alone, so about 1x\n  is expected (the async router must not be slower).")
    stats = fast["stats"]
    print(f"  async router: {stats.get('ahead_launches', 0)} steps launched ahead from the feed "
          f"cells;\n  {stats.get('rollbacks', 0)} rows rolled back (a row stopped with its next step "
          f"already launched: that step is discarded, its KV reservation returned)")
    what = ("the host sampler's draws over the reference logits, each request alone"
            if _sampling_of(args) else "the host computation of the reference model")
    words = {"tokens": f"all {total} tokens of both routers equal {what} (masks and stop ids "
                       f"included)",
             "pool": "every KV block went back to the pool",
             "live": "no event, stream, pinned or device memory is left live after teardown"}
    for key, text in words.items():
        print(f"{'checked' if checks[key] else 'FAILED'}: {text}")
    print("try: --host-work-us 0 (no host work), --host-work spin (host work that holds a core), "
          "--host-work-us N,\n     --rows, --tokens, --vocab, --dtype, --device-threads;"
          "\n     --temperature, --top-k, --top-p, --min-p (sampling); --trace run.json or "
          "--plot run.png to see the lanes")


def _sampling_of(args: Any) -> Optional[Dict[str, Any]]:
    """The sampling options (None when greedy: temperature 0 or not given)."""
    temperature = getattr(args, "temperature", 0.0) or 0.0
    if temperature <= 0.0:
        return None
    return {"temperature": temperature, "top_k": getattr(args, "top_k", 0),
            "top_p": getattr(args, "top_p", 1.0), "min_p": getattr(args, "min_p", 0.0)}


def main(args: Any) -> int:
    """Run ``metrale-feed demo`` with parsed, checked arguments (see ``metrale_feed.tools.cli``).

    Parameters
    ----------
    args : argparse.Namespace
        The options of ``metrale-feed demo``; ``host_work_us`` None means one measured device step.

    Returns
    -------
    int
        0 when both routers produced the host reference's tokens and nothing leaked, else 1.
    """
    import metrale_feed

    if args.backend != "auto":
        metrale_feed.set_backend(args.backend)
    device = "a GPU"
    if metrale_feed.backend() != "cuda":
        threads = metrale_feed.host_kernel_threads(args.device_threads)
        device = (f"a simulated device of {threads} core(s); the other cores are the scheduler's, "
                  f"as beside a GPU")
    print(f"metrale-feed demo: {args.rows} rows, up to {args.tokens} new tokens each, vocab "
          f"{args.vocab}, {args.dtype} logits, seed {args.seed}")
    print(f"backend: {metrale_feed.backend()} ({device})")
    sampling = _sampling_of(args)
    if sampling:
        print(f"sampling: temperature {sampling['temperature']:g}, top_k {sampling['top_k']}, "
              f"top_p {sampling['top_p']:g}, min_p {sampling['min_p']:g}, a seed per request; "
              f"the reference draws on the {'simt' if metrale_feed.backend() == 'simt' else 'host'} "
              f"backend, one request at a time")
    else:
        print("decoding: greedy (the argmax); --temperature above 0 samples")
    show = not args.quiet and sys.stderr.isatty()
    with on_host_backend(sampling is not None):
        requests = make_requests(args.rows, args.tokens, args.vocab, args.dtype, args.seed,
                                 sampling)
        expected = _references(requests, args.tokens, args.vocab, args.dtype, show)
    total = sum(len(e) for e in expected)
    if getattr(args, "tp", None):
        from .demo_tp import run as run_tp

        print(f"tensor parallel: {args.tp} local ranks, each a slice of the vocabulary")
        return run_tp(args.tp, requests, args.tokens, args.vocab, args.dtype, args.block_size)
    model = ReferenceModel(args.vocab, block_size=args.block_size,
                           num_blocks=args.rows * ((24 + args.tokens) // args.block_size + 3),
                           max_rows=args.rows, logits_dtype=args.dtype)
    step_us: Optional[float] = None
    try:
        free_at_start = model.pool.free_count
        work_us = args.host_work_us
        if work_us is None:
            step_us = work_us = measure_step_us(model, requests, args.tokens)
            print(f"measured device step: {_ms(step_us)} (sync router, no host work)")
        spent = {"sleep": "off the CPU (sleeping, as when waiting on the network)",
                 "spin": "spinning in Python (holding the GIL and a core)"}[args.host_work]
        if work_us > 0:
            print(f"scenario: the scheduler's own work takes {_ms(work_us)} per step, "
                  f"{'one device step, ' if step_us is not None else ''}{spent}")
        else:
            print("scenario: no host work between steps")
        timed = bool(args.trace or args.plot)
        recorders: List[Optional[Recorder]] = [None, None]
        bar = Progress("async", total, show)
        if timed:  # each recorder starts the host trace afresh, so make it just before its run
            recorders[0] = Recorder("async router, two steps deep: look for the device lane "
                                    "busy while the host works (orange)")
        fast = run_async(model, requests, args.tokens, work_us, bar, work_kind=args.host_work,
                         recorder=recorders[0])
        if recorders[0]:
            recorders[0].finish()
        bar.finish()
        bar = Progress("sync", total, show)
        if timed:
            recorders[1] = Recorder("sync router: the device idles while the host works, so "
                                    "each step costs both")
        slow = run_sync(model, requests, args.tokens, work_us, bar, work_kind=args.host_work,
                        recorder=recorders[1])
        if recorders[1]:
            recorders[1].finish()
        bar.finish()
        pool_ok = model.pool.free_count == free_at_start
    finally:
        model.close()
    live = settled_live_objects()
    checks = {"tokens": fast["tokens"] == slow["tokens"] == expected, "pool": pool_ok,
              "live": not any(live.values())}
    _report(args, work_us, step_us, fast, slow, total, checks)
    if args.trace:
        from .timeline import write_trace

        write_trace(args.trace, [r for r in recorders if r is not None])
        print(f"trace: {args.trace} (open it in https://ui.perfetto.dev)")
    if args.plot:
        from .timeline import plot

        plot(args.plot, [r for r in recorders if r is not None])
        print(f"plot: {args.plot}")
    if not checks["live"]:
        print(f"live objects after teardown: {live}")
    return 0 if all(checks.values()) else 1
