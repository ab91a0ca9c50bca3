"""The pipeline's debug mode (``DecodePipeline(debug=True)``): stale reads of feed cells made
visible, and each step's inputs resolved twice and compared."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

from .. import _core
from ..errors import FeedError
from ..feed import NO_TOKEN, FeedSource

from .lifecycle import close_each

if TYPE_CHECKING:
    from .host import StepHost


class _Debug:
    """Debug mode: after each launch every feed cell that step's argmax did not write is set to
    ``NO_TOKEN`` (so a stale read shows), and the step's inputs are resolved a second time, in
    stream order before its forward, into a buffer read back with the step: at its await, every
    input id must be in the vocabulary and equal to what the pipeline meant, or the step raises
    ``FeedError`` before any of its ids is committed. No wait is added: the readback completes
    with the step's own event."""

    def __init__(self, host: "StepHost") -> None:
        self.step_host = host  # (self.host: the pinned readback buffers)
        rows = host.max_rows
        cells = getattr(host.model, "feed_cells", None)
        self.cells = cells
        self.capacity = cells.nbytes // 4 if cells is not None else 0
        self.poison = _core.DeviceBuffer(max(1, self.capacity) * 4)
        self.poison.memset_async(0xFF, host.stream)  # NO_TOKEN in every word
        slots = host.depth + 1
        self.dev = [_core.DeviceBuffer(rows * 4) for _ in range(slots)]
        self.host = [_core.PinnedBuffer(rows * 4) for _ in range(slots)]
        self.next = 0

    def before(self, sources: Any, rows: int) -> int:
        if self.cells is None:
            return -1
        slot = self.next
        self.next = (slot + 1) % len(self.dev)
        prev = getattr(self.step_host.model, "feed_prev_rows", 0)
        stream = self.step_host.stream
        _core.resolve_feed(sources, self.cells, self.dev[slot], stream, prev_rows=prev)
        _core.copy_d2h_async(self.dev[slot], self.host[slot], stream)
        return slot

    def after(self, rows: int) -> None:
        if self.cells is None or rows >= self.capacity:
            return
        _core.copy_d2d_async(self.cells.ptr + rows * 4, self.poison, (self.capacity - rows) * 4,
                             self.step_host.stream)

    def check(self, step: Any, prev_ids: List[int]) -> None:
        if step.debug_slot < 0:
            return
        rows = len(step.rows)
        got = _core.read_pinned_u32(self.host[step.debug_slot].ptr, rows)
        vocab = self.step_host.vocab
        for row, (source, token) in enumerate(zip(step.sources, got)):
            source = FeedSource(source)
            meant = source.value if source.is_host else (
                prev_ids[source.value] if source.value < len(prev_ids) else None)
            if token == meant == NO_TOKEN and step.dead and row in step.dead:
                continue  # its request had no candidate in the step before and left
            if token >= vocab or (meant is not None and token != meant):
                raise FeedError(f"debug: row {row} of launch {step.launch} read input id "
                                f"{token:#x} from {source!r} (expected {meant}); vocabulary "
                                f"{vocab}")

    def close(self) -> None:
        close_each(buf.close for buf in self.dev + self.host + [self.poison])
