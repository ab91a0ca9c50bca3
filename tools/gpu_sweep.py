#!/usr/bin/env python3
"""Timing sweep of metrale_feed.argmax_to_feed against torch.argmax(dim=1) on a CUDA device.

For each rows x vocab x dtype it checks the feed ids against torch.argmax on NaN-free random
logits (plain, and with each row's winner masked), then times both with device events and prints
us per call, GB/s, the fraction of the H200's 4.8 TB/s and the ratio to torch. Our call includes
its rows*4-byte copy to pinned memory and the event record; torch's does not. A second table
times the options at 256 rows against the plain argmax: a bitmask of random words, and
sample_to_feed with temperature alone and with top_p = 0.9 (target: at most 2x the argmax), and
checks that temperature 0 gives the argmax's ids. Results go to $OUT/gpu_sweep.json when OUT is
set. Exit status 1 when any result differs.
"""
import json
import os
import sys
import time

import numpy as np

try:
    import torch
except ImportError:
    sys.exit("gpu_sweep: needs torch with CUDA")

import metrale_feed as mf

PEAK_BYTES_PER_S = 4.8e12
ROWS = (1, 8, 64, 256, 1024)
VOCABS = (32000, 152064, 262144)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NO_TOKEN = 0xFFFFFFFF
CAPACITY = 4096


def elapsed_ms(start, end):
    if hasattr(start, "elapsed_ms"):
        return start.elapsed_ms(end)
    return mf.elapsed_ms(start, end)


def iterations(nbytes):
    # About 20 GB of logits per measurement, within [20, 1000] calls.
    return int(min(1000, max(20, 2e10 // max(nbytes, 1))))


class Feed:
    """The buffers argmax_to_feed writes, shared by every configuration."""

    def __init__(self):
        self.cells = mf.DeviceBuffer(CAPACITY * 4)
        self.dst = mf.PinnedBuffer(CAPACITY * 4)
        self.event = mf.Event(timing=True)
        self.stream = mf.Stream()
        self.start = mf.Event(timing=True)
        self.end = mf.Event(timing=True)

    def call(self, x, masks, dtype):
        rows, vocab = x.shape
        mf.argmax_to_feed(x.data_ptr(), masks, self.cells, self.dst, self.event, self.stream,
                          rows=rows, vocab=vocab, dtype=dtype)

    def ids(self, rows):
        self.event.synchronize()
        with memoryview(self.dst) as view:  # release the export before the next call
            ids = np.frombuffer(view, dtype=np.uint32, count=rows)
            out = ids.copy()
            del ids
        return out

    def time(self, x, masks, dtype, n):
        for _ in range(3):  # warm-up; the first few-row call on a stream allocates its scratch
            self.call(x, masks, dtype)
        self.start.record(self.stream)
        t0 = time.perf_counter()
        for _ in range(n):
            self.call(x, masks, dtype)
        host_s = time.perf_counter() - t0
        self.end.record(self.stream)
        self.end.synchronize()
        return elapsed_ms(self.start, self.end) * 1e3 / n, host_s * 1e6 / n


def time_torch(x, n):
    for _ in range(3):
        torch.argmax(x, dim=1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        torch.argmax(x, dim=1)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def check(feed, x, dtype):
    """Mismatch count: unmasked, then with each row's torch winner masked out."""
    rows = x.shape[0]
    free = np.full((rows, 2), NO_TOKEN, dtype=np.uint32)
    want = torch.argmax(x, dim=1)
    feed.call(x, free, dtype)
    bad = int((feed.ids(rows) != want.cpu().numpy().astype(np.uint32)).sum())

    masked = free.copy()
    masked[:, 0] = want.cpu().numpy()
    y = x.clone()
    y[torch.arange(rows, device=x.device), want] = float("-inf")
    want2 = torch.argmax(y, dim=1).cpu().numpy().astype(np.uint32)
    del y
    feed.call(x, masked, dtype)
    bad += int((feed.ids(rows) != want2).sum())
    return bad


def sweep_options(feed, gen):
    """The argmax's options side by side at 256 rows; returns (rows of figures, failures)."""
    rows, results, failures = 256, [], 0
    print(f"\n{'rows':>5} {'vocab':>7} {'dtype':>9} {'argmax_us':>10} {'bitmask':>8} {'temp':>8} "
          f"{'top_p':>8}  check")
    for vocab in (32000, 152064):
        base = torch.randn(rows, vocab, device="cuda", generator=gen, dtype=torch.float32) * 3
        words = (vocab + 31) // 32
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), device="cuda", generator=gen,
                                dtype=torch.int32)
        free = np.full((rows, 2), NO_TOKEN, dtype=np.uint32)
        params = {k: mf.sampling_params(rows, seed=7, position=np.arange(rows), **kw)
                  for k, kw in (("greedy", dict(temperature=0.0)), ("temp", dict(temperature=1.0)),
                                ("top_p", dict(temperature=1.0, top_p=0.9)))}
        for name, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            x = base.to(tdtype)
            torch.cuda.synchronize()
            runs = {
                "argmax": lambda: feed.call(x, free, name),
                "bitmask": lambda: mf.argmax_to_feed(x.data_ptr(), free, feed.cells, feed.dst, feed.event,
                                                     feed.stream, rows=rows, vocab=vocab, dtype=name,
                                                     bitmask=bitmask.data_ptr()),
            }
            for k in ("temp", "top_p"):
                runs[k] = (lambda p: lambda: mf.sample_to_feed(
                    x.data_ptr(), p, feed.cells, feed.dst, feed.event, feed.stream, rows=rows,
                    vocab=vocab, dtype=name))(params[k])
            feed.call(x, free, name)
            want = feed.ids(rows)
            mf.sample_to_feed(x.data_ptr(), params["greedy"], feed.cells, feed.dst, feed.event,
                              feed.stream, rows=rows, vocab=vocab, dtype=name)
            bad = int((feed.ids(rows) != want).sum())
            failures += bad > 0
            us = {}
            for k, run in runs.items():
                for _ in range(3):
                    run()
                feed.start.record(feed.stream)
                for _ in range(50):
                    run()
                feed.end.record(feed.stream)
                feed.end.synchronize()
                us[k] = elapsed_ms(feed.start, feed.end) * 1e3 / 50
            row = dict(rows=rows, vocab=vocab, dtype=name, us=us,
                       ratio={k: us[k] / us["argmax"] for k in ("bitmask", "temp", "top_p")},
                       greedy_mismatches=bad)
            results.append(row)
            r = row["ratio"]
            print(f"{rows:>5} {vocab:>7} {name:>9} {us['argmax']:>10.2f} {r['bitmask']:>7.2f}x "
                  f"{r['temp']:>7.2f}x {r['top_p']:>7.2f}x  {'ok' if bad == 0 else f'{bad} MISMATCHES'}")
            del x
        del base, bitmask
        torch.cuda.empty_cache()
    return results, failures


def main():
    if not torch.cuda.is_available():
        sys.exit("gpu_sweep: torch sees no CUDA device")
    print(f"metrale_feed backend={mf.backend()} device={torch.cuda.get_device_name()}")
    feed = Feed()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    results, failures = [], 0
    header = f"{'rows':>5} {'vocab':>7} {'dtype':>9} {'us':>9} {'host_us':>8} {'GB/s':>8} " \
             f"{'peak':>6} {'torch_us':>9} {'vs_torch':>8}  check"
    print(header)
    for rows in ROWS:
        for vocab in VOCABS:
            base = torch.randn(rows, vocab, device="cuda", generator=gen, dtype=torch.float32)
            for name, tdtype in DTYPES.items():
                x = base.to(tdtype)
                torch.cuda.synchronize()  # the data is made on torch's stream, read on ours
                bad = check(feed, x, name)
                failures += bad > 0
                nbytes = x.numel() * x.element_size()
                n = iterations(nbytes)
                free = np.full((rows, 2), NO_TOKEN, dtype=np.uint32)
                us, host_us = feed.time(x, free, name, n)
                torch_us = time_torch(x, n)
                gbps = nbytes / (us * 1e-6) / 1e9
                row = dict(rows=rows, vocab=vocab, dtype=name, us=us, host_us=host_us,
                           gb_per_s=gbps, peak_fraction=gbps * 1e9 / PEAK_BYTES_PER_S,
                           torch_us=torch_us, speedup_vs_torch=torch_us / us, mismatches=bad,
                           iterations=n)
                results.append(row)
                print(f"{rows:>5} {vocab:>7} {name:>9} {us:>9.2f} {host_us:>8.2f} {gbps:>8.1f} "
                      f"{row['peak_fraction']:>6.1%} {torch_us:>9.2f} {torch_us / us:>7.2f}x  "
                      f"{'ok' if bad == 0 else f'{bad} MISMATCHES'}")
                del x
            del base
            torch.cuda.empty_cache()
    options, option_failures = sweep_options(feed, gen)
    failures += option_failures
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_sweep.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results,
                       "options": options}, f, indent=1)
    print("all results match torch.argmax" if failures == 0 else f"{failures} configs mismatched")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
