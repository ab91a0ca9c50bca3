"""Timelines of a run: host spans (launches, waits, scheduler work) beside what the device ran,
as a Chrome trace (opens in Perfetto) and, with matplotlib, a picture of the lanes.

On the host backend the device lane is the stream workers' own record of each op (start and end);
on CUDA it is a timing-event pair around each launched step."""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import _core

Span = Tuple[str, int, int]  # name, start ns, end ns


class Recorder:
    """Collects host spans of one run; ``device()`` collects the device lane at the end."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.host: List[Span] = []
        self.device_spans: List[Span] = []
        self._cuda_marks: List[Tuple[str, Any, Any]] = []
        self._on_cuda = _core.backend() == "cuda"
        if not self._on_cuda:
            _core.trace_enable(1 << 20)

    def begin(self) -> int:
        return time.perf_counter_ns()

    def end(self, name: str, start: int) -> None:
        self.host.append((name, start, time.perf_counter_ns()))

    def mark_device(self, name: str, stream: Any = 0) -> Optional[Tuple[Any, Any]]:
        """On CUDA, timing events to record before and after a launch's device work."""
        if not self._on_cuda:
            return None
        pair = (_core.Event(timing=True), _core.Event(timing=True))
        self._cuda_marks.append((name, pair[0], pair[1]))
        return pair

    def finish(self) -> None:
        if not self._on_cuda:
            records, _dropped = _core.trace_read()
            _core.trace_enable(0)
            self.device_spans = [(name, start, end) for name, _stream, _queued, start, end in records]
            return
        if not self._cuda_marks:
            return
        # CUDA events carry device time only relative to each other: anchor at the first one.
        origin = self.host[0][1] if self.host else time.perf_counter_ns()
        first = self._cuda_marks[0][1]
        for name, start, end in self._cuda_marks:
            end.synchronize()
            begin_ns = origin + int(first.elapsed_ms(start) * 1e6)
            self.device_spans.append((name, begin_ns, begin_ns + int(start.elapsed_ms(end) * 1e6)))
            start.close()
            end.close()


def chrome_trace(recorders: List[Recorder]) -> Dict[str, Any]:
    """One process per run (async, sync), a host thread and a device thread in each."""
    origin = min((s[1] for r in recorders for s in r.host + r.device_spans), default=0)
    events: List[Dict[str, Any]] = []
    for pid, rec in enumerate(recorders, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": rec.label}})
        for tid, lane in ((1, "host"), (2, "device")):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        for tid, spans in ((1, rec.host), (2, rec.device_spans)):
            for name, start, end in spans:
                events.append({"ph": "X", "name": name, "pid": pid, "tid": tid,
                               "ts": (start - origin) / 1e3, "dur": max(end - start, 1) / 1e3})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, recorders: List[Recorder]) -> None:
    with open(path, "w") as handle:
        json.dump(chrome_trace(recorders), handle)


def plot(path: str, recorders: List[Recorder], window_ms: float = 40.0) -> None:
    """Host and device lanes of each run over its first ``window_ms`` after the first step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"launch": "tab:blue", "await": "tab:gray", "host work": "tab:orange",
               "reference_forward": "tab:green", "argmax": "tab:red", "resolve_feed": "tab:purple",
               "copy": "tab:olive"}
    fig, axes = plt.subplots(len(recorders), 1, figsize=(12, 2.2 * len(recorders)), sharex=True)
    for ax, rec in zip(list(axes) if len(recorders) > 1 else [axes], recorders):
        start = min(s[1] for s in rec.host) if rec.host else 0
        for lane, spans in ((1, rec.host), (0, rec.device_spans)):
            for name, begin, end in spans:
                x = (begin - start) / 1e6
                if x > window_ms:
                    continue
                key = next((k for k in colours if name.startswith(k)), None)
                ax.broken_barh([(x, max((end - begin) / 1e6, 0.01))], (lane - 0.4, 0.8),
                               color=colours.get(key or "", "tab:olive"))
        ax.set_yticks([0, 1], ["device", "host"])
        ax.set_title(rec.label, loc="left", fontsize=10)
        ax.set_xlim(0, window_ms)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    fig.legend(handles, list(colours), loc="upper right", ncol=6, fontsize=8)
    axes_list = list(axes) if len(recorders) > 1 else [axes]
    axes_list[-1].set_xlabel("ms")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
