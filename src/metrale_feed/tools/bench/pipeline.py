"""The scheduler's layers: the router and the pipeline per step (stub models, sampled beside greedy),
and graphs of fed steps."""

from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

import metrale_feed as mf
from metrale_feed.contract import FeedInfo
from metrale_feed.kv import PagedKvMixin

from .report import NO_TOKEN, row, section

# ---- 4. router ----

PIPELINE_ROWS = (16, 64, 256, 1024)  # the pipeline's cost per step at these batch sizes
SAMPLED = {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "min_p": 0.0}  # the sampled rows'

class _StubModel(mf.RuntimeFeedMixin, mf.ModelDeviceFeed):
    """No device work, so a step costs only the router's Python; events and pinned memory are
    the mixin's real ones."""

    def supports_device_token_feed(self) -> bool:
        return True

    def decode_batch(self, tokens: Any, seqs: Any, stream: Any) -> int:
        return 0

    def decode_batch_fed(self, sources: Any, seqs: Any, stream: Any) -> int:
        return 0

    def argmax_batch_to_feed(self, logits: Any, masks: Any, dst: Any, event: Any,
                             stream: Any) -> None:
        pass

    def sample_batch_to_feed(self, logits: Any, params: Any, masks: Any, dst: Any, event: Any,
                             stream: Any) -> None:
        pass

    def event_query(self, event: Any) -> bool:
        return True

    def reserve_decode_block(self, seq: Any) -> int:
        return 0

    def feed_info(self) -> Any:
        # Its feed methods take none of the logprobs keywords: it says so.
        lacks = dict(logprobs=False, top_logprobs=False, raw_logits=False)
        if getattr(self, "feed_cells", None) is not None:
            return super().feed_info()._replace(**lacks)
        return FeedInfo(vocab=32000, sampling=True, **lacks)  # the router's stub, no feed cells


class _StubPagedModel(PagedKvMixin, _StubModel):
    """The stub with the models' paged KV bookkeeping (``PagedKvMixin``: a block pool, block
    tables, prefill that allocates), so the pipeline's own cost per step includes reservation,
    commit and release."""

    def __init__(self, rows: int, vocab: int, block_size: int, num_blocks: int) -> None:
        self.init_device_feed(vocab=vocab, max_rows=rows)
        self.init_paged_kv(block_size=block_size, num_blocks=num_blocks)

    def prefill(self, seq: Any, ids: Any, stream: Any = None) -> None:
        self.take_prefill_blocks([seq], [ids])
        seq.seq_len += len(ids)


class _StubLogitsModel(_StubPagedModel):
    """The paged stub with real logits memory and the mixin's own pick over it (a small
    vocabulary: the worker's time stays under the step's Python), for steps whose penalties
    touch the logits: the penalties ride on the pick (one call a step), as on a real model."""

    def __init__(self, rows: int, vocab: int, block_size: int, num_blocks: int) -> None:
        super().__init__(rows, vocab, block_size, num_blocks)
        self.logits = mf.DeviceBuffer(rows * vocab * 4)

    def decode_batch_fed(self, sources: Any, seqs: Any, stream: Any) -> int:
        return self.logits.ptr

    argmax_batch_to_feed = mf.RuntimeFeedMixin.argmax_batch_to_feed
    sample_batch_to_feed = mf.RuntimeFeedMixin.sample_batch_to_feed

    def close_device_feed(self) -> None:
        self.logits.close()
        super().close_device_feed()


class _StubTwoCallModel(_StubLogitsModel):
    """The same stub saying its feed methods take no ``penalties=``: the pipeline queues the
    apply and the update around them (the path before one call a step)."""

    def feed_info(self) -> Any:
        return super().feed_info()._replace(penalties=False)


PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}


def pipeline_step_us(rows: int, steps: int, repeats: int, sampled: bool = False,
                      penalties: Optional[bool] = None, two_calls: bool = False) -> float:
    """Best µs per DecodePipeline.step() of ``rows`` running requests beside the stub: a launch
    ahead, an await, the commit of every row's token, block reservations as rows cross block
    boundaries (block size 16; prompt lengths spread so that a sixteenth of the rows cross at
    each step, as in a batch of requests that arrived at different times). ``sampled``: every
    request samples (``SAMPLED``), so each launch also sets its params' positions.
    ``penalties`` (not None): the stub with logits and a real pick; ``two_calls``: one that takes
    no ``penalties=``."""
    block_size = 16
    per_request = (steps * (repeats + 1) + 16) // block_size + 2
    stub = _StubPagedModel if penalties is None else _StubTwoCallModel if two_calls else _StubLogitsModel
    model = stub(rows, 32000 if penalties is None else 256, block_size, rows * per_request)
    pipe = mf.DecodePipeline(model, rows, penalty_capacity=steps * (repeats + 1) + 32)
    best = float("inf")
    try:
        for i in range(rows):
            pipe.submit([1] * (1 + i % block_size), max_new_tokens=steps * (repeats + 1),
                        **(dict(SAMPLED, seed=i) if sampled else {}),
                        **(dict(PENALTIES, logit_bias={5: 1.0, 9: -1.0}) if penalties else {}))
        for _ in range(steps):  # admission, prefill and warm-up
            pipe.step()
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                pipe.step()
            best = min(best, (time.perf_counter() - start) / steps * 1e6)
    finally:
        pipe.close()
        model.close_device_feed()
    return best


def _stub_step_us(rows: int, steps: int, repeats: int, reserve: bool, masks: bool = True) -> float:
    """Best µs per launch_fed + await_result of ``rows`` rows (after ``rows`` reserve_kv calls;
    ``masks=False``: no mask list, as the pipeline launches a step without bans)."""
    seqs = [mf.SequenceState(i) for i in range(rows)]
    sources = [mf.FeedSource.feed(i) for i in range(rows)]
    mask_list = [(NO_TOKEN, NO_TOKEN)] * rows if masks else None
    io, best = mf.AsyncDeviceIo(_StubModel(), rows), float("inf")
    try:
        io.await_result(io.launch_decode([1] * rows, seqs, mask_list))  # feed rows exist from here
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                for seq in seqs if reserve else ():
                    io.reserve_kv(seq)
                io.await_result(io.launch_fed(sources, seqs, mask_list))
            best = min(best, (time.perf_counter() - start) / steps * 1e6)
    finally:
        io.teardown()
    return best


def _router_level(model: Any, requests: Any, max_new: int, work: float, kind: str,
                  repeats: int) -> Dict[str, Any]:
    from .. import demo

    fast, slow = [], []
    for _ in range(repeats):  # async and sync interleaved; the best of each
        fast.append(demo.run_async(model, requests, max_new, work, work_kind=kind))
        slow.append(demo.run_sync(model, requests, max_new, work, work_kind=kind))
    a, s = min(fast, key=lambda r: r["seconds"]), min(slow, key=lambda r: r["seconds"])
    tokens = sum(len(t) for t in a["tokens"])
    return {"host_work_us": work, "kind": kind, "tokens": tokens,
            "async_tps": tokens / a["seconds"], "sync_tps": tokens / s["seconds"],
            "speedup": s["seconds"] / a["seconds"], "same_tokens": a["tokens"] == s["tokens"],
            "sync_step_us": s["seconds"] / s["steps"] * 1e6}


def _sampled_beside_greedy(model: Any, rows: int, vocab: int, max_new: int,
                           repeats: int) -> Dict[str, Any]:
    """The pipeline two steps deep on the reference model with no host work, every request
    greedy, then every request sampled (``SAMPLED``, a seed each): tokens per second side by
    side, and the sampled tokens checked, async == sync == the host sampler over each request
    alone (the demo's reference)."""
    from .. import demo

    greedy = demo.make_requests(rows, max_new, vocab, "float32", 0)
    sampled = demo.make_requests(rows, max_new, vocab, "float32", 0, SAMPLED)
    expected = [demo.host_reference(r["prompt"], r["mask"], r["stop"], max_new, vocab,
                                    "float32", r["sampling"]) for r in sampled]
    best: Dict[str, Any] = {}
    for _ in range(repeats):  # interleaved; the best of each
        for name, reqs in (("greedy", greedy), ("sampled", sampled)):
            run = demo.run_async(model, reqs, max_new)
            if name not in best or run["seconds"] < best[name]["seconds"]:
                best[name] = run
    slow = demo.run_sync(model, sampled, max_new)
    out: Dict[str, Any] = {"rows": rows, "params": dict(SAMPLED),
                           "checked": best["sampled"]["tokens"] == slow["tokens"] == expected}
    for name, run in best.items():
        tokens = sum(len(t) for t in run["tokens"])
        out[f"{name}_tps"] = tokens / run["seconds"]
        out[f"{name}_step_us"] = run["seconds"] / max(1, run["steps"]) * 1e6
    out["ratio"] = out["sampled_step_us"] / out["greedy_step_us"]
    return out


def bench_router(quick: bool) -> Dict[str, Any]:
    from .. import demo
    from ...testing.reference import ReferenceModel

    rows, vocab, max_new, repeats = 64, 32000, 32 if quick else 64, 3 if quick else 5
    requests = demo.make_requests(rows, max_new, vocab, "float32", 0)
    mf.host_kernel_threads(1)  # the simulated device gets one core, the scheduler the other
    model = ReferenceModel(vocab, block_size=16, num_blocks=rows * ((24 + max_new) // 16 + 3),
                           max_rows=rows)
    try:
        demo.run_async(model, requests, max_new)  # a warm-up: first touches of the buffers
        levels = [_router_level(model, requests, max_new, 0.0, "sleep", repeats)]
        step = levels[0]["sync_step_us"]  # the device step: settled, with no host work
        levels += [_router_level(model, requests, max_new, w, k, repeats)
                   for w, k in ((step, "sleep"), (2 * step, "sleep"), (step, "spin"))]
        r = {"rows": rows, "vocab": vocab, "max_new": max_new, "device_threads": 1,
             "step_us": step, "repeats": repeats, "levels": levels,
             "sampling": _sampled_beside_greedy(model, rows, vocab, max_new, repeats)}
    finally:
        model.close()
        mf.host_kernel_threads(0)
    steps = 2000 if quick else 10000
    r["stub_us_per_step"] = _stub_step_us(rows, steps, repeats, False)
    r["stub_us_per_step_reserve"] = _stub_step_us(rows, steps // 4, repeats, True)
    r["pipeline_us_per_step"], r["router_us_per_step_at"] = {}, {}
    for n in PIPELINE_ROWS:  # the pipeline beside the bare router of as many rows, interleaved
        n_steps = max(100, (steps // 4) * 64 // n)
        r["router_us_per_step_at"][n] = _stub_step_us(n, n_steps, repeats, False, masks=False)
        r["pipeline_us_per_step"][n] = pipeline_step_us(n, n_steps, repeats)
        if n == rows:
            r["pipeline_us_per_step_sampled"] = pipeline_step_us(n, n_steps, repeats, True)
    section(f"router, reference model: {rows} rows, vocab {vocab}, {max_new} new tokens, "
             f"1 device thread (best of {repeats}); ratio = async / sync")
    row("sync step, no host work", f"{step:.0f} us")
    for i, lv in enumerate(r["levels"]):
        row(f"host work {lv['host_work_us']:.0f} us {lv['kind']}", f"{lv['async_tps']:.0f} tok/s",
             f"sync {lv['sync_tps']:.0f} tok/s", f"{lv['speedup']:.2f}x",
             {0: ">= 0.95x", 1: ">= 1.8x"}.get(i, ""), "" if lv["same_tokens"] else "TOKENS DIFFER")
    row(f"router Python/step, {rows} rows", f"{r['stub_us_per_step']:.1f} us",
         f"device step {step:.0f} us", f"{r['stub_us_per_step'] / step:.3f}x", "<= 30 us",
         "stub model")
    row(f"  with {rows} reserve_kv", f"{r['stub_us_per_step_reserve']:.1f} us", "",
         f"{r['stub_us_per_step_reserve'] / step:.3f}x", "<= 30 us")
    for n, us in r["pipeline_us_per_step"].items():
        base = r["router_us_per_step_at"][n]
        row(f"pipeline Python/step, {n} rows", f"{us:.1f} us", f"router alone {base:.1f} us",
             f"{us / base:.2f}x", "<= 20 us" if n == 256 else "",
             f"{us / n * 1e3:.0f} ns/row; stub model, KV reservation and commit included")
        if n == rows:
            sampled_us = r["pipeline_us_per_step_sampled"]
            row(f"  every row sampled, {n} rows", f"{sampled_us:.1f} us", f"greedy {us:.1f} us",
                 f"{sampled_us / us:.2f}x", "", "stub model: the params' cost alone")
    sm = r["sampling"]
    row(f"pipeline sampled, {rows} rows", f"{sm['sampled_tps']:.0f} tok/s",
         f"greedy {sm['greedy_tps']:.0f} tok/s", f"{sm['ratio']:.2f}x",
         "", f"step {sm['sampled_step_us']:.0f} us vs {sm['greedy_step_us']:.0f} us; top_p "
         f"{SAMPLED['top_p']}, temperature {SAMPLED['temperature']}; ratio = step time"
         + ("" if sm["checked"] else "; TOKENS DIFFER from the host sampler"))
    return r



# ---- 5. graphs ----

def _fed_steps(graphs: bool, rows: int, vocab: int, steps: int) -> Dict[str, Any]:
    """``steps`` fed steps of the reference model through the trait, one at a time: the host time
    to queue each (decode_batch_fed + argmax_batch_to_feed) and the time until its event, and the
    ids of every step."""
    from ...feed import FeedSource
    from ...kv import SequenceState
    from ...testing.reference import ReferenceModel

    model = ReferenceModel(vocab, block_size=16, num_blocks=rows * (steps // 16 + 3), max_rows=rows,
                           graphs=graphs)
    seqs = [SequenceState(r) for r in range(rows)]
    dst, event = mf.PinnedBuffer(rows * 4), mf.Event()
    sources = [FeedSource.feed(r) for r in range(rows)]
    masks = [(NO_TOKEN, NO_TOKEN)] * rows
    queue_us: List[float] = []
    step_us: List[float] = []
    ids: List[List[int]] = []
    try:
        for r, seq in enumerate(seqs):
            model.prefill(seq, [r + 1, 2 * r + 3])
        model.decode_batch([5] * rows, seqs)
        model.argmax_batch_to_feed(model.logits.ptr, masks, dst.ptr, event.handle, 0)
        event.synchronize()
        last = mf.read_pinned_u32(dst.ptr, rows)
        for _ in range(steps):
            model.cover_decode_blocks(seqs)  # the scheduler's reservation, outside the timing
            start = time.perf_counter()
            logits = model.decode_batch_fed(sources, seqs, 0)
            model.argmax_batch_to_feed(logits, masks, dst.ptr, event.handle, 0)
            queued = time.perf_counter()
            event.synchronize()
            done = time.perf_counter()
            queue_us.append((queued - start) * 1e6)
            step_us.append((done - start) * 1e6)
            for seq, token in zip(seqs, last):
                seq.tokens.append(token)
                seq.seq_len += 1
            last = mf.read_pinned_u32(dst.ptr, rows)
            ids.append(last)
            model.fed_step_settled()
        stats = model.graph_stats
    finally:
        model.close()
        dst.close()
        event.close()
    return {"queue_us": statistics.median(queue_us[1:]), "step_us": statistics.median(step_us[1:]),
            "ids": ids, "stats": stats}


def bench_graphs(quick: bool) -> Dict[str, Any]:
    """The reference model's fed step (resolve, forward, argmax, readback, event) launched as one
    graph vs the same operations queued one by one, on the host backend. Small rows and vocabulary,
    so the figure is the cost of queueing, not of the kernels. Checked: the same ids."""
    rows, vocab, steps = 8, 4096, 40 if quick else 200
    eager = _fed_steps(False, rows, vocab, steps)
    graph = _fed_steps(True, rows, vocab, steps)
    r = {"rows": rows, "vocab": vocab, "steps": steps, "checked": eager["ids"] == graph["ids"],
         "eager_queue_us": eager["queue_us"], "graph_queue_us": graph["queue_us"],
         "eager_step_us": eager["step_us"], "graph_step_us": graph["step_us"],
         "captures": graph["stats"]["captures"], "launches": graph["stats"]["launches"]}
    section(f"graphs, reference model fed step: {rows} rows, vocab {vocab}, host backend "
             f"(median of {steps} steps); ratio = graph / one by one")
    row("queue the step, one by one", f"{r['eager_queue_us']:.0f} us")
    row("queue the step, graph launch", f"{r['graph_queue_us']:.0f} us", "one by one",
         f"{r['graph_queue_us'] / r['eager_queue_us']:.2f}x", "",
         "host re-issues each call" if r["checked"] else "IDS DIFFER")
    row("step until its event, one by one", f"{r['eager_step_us']:.0f} us")
    row("step until its event, graph", f"{r['graph_step_us']:.0f} us", "one by one",
         f"{r['graph_step_us'] / r['eager_step_us']:.2f}x")
    return r


