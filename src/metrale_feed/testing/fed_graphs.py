"""The reference model's fed step as a captured graph (``ReferenceModel(..., graphs=True)``).

A fed step is ``resolve_feed`` (device-resident sources) + the forward + ``argmax_to_feed``
(device-resident masks) + the readback into the ring slot + its event record. ``decode_batch_fed``
only checks and keeps the step; ``argmax_batch_to_feed`` writes its host inputs into the pinned
staging of the step's readback slot and launches the graph of its shape, captured on first use.
A graph bakes in its pointers and sizes, so one is kept per (rows, previous rows, readback
pointer, event); ``fed_step_settled`` evicts the least recently used beyond ``max_graphs`` whose
last launch has completed. docs/graphs.md, "The reference model's graphs".
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import _core
from ..errors import FeedError

_HOST_BIT = 0x80000000


class _GraphStaging:
    """Pinned host inputs of one readback slot's fed steps and their device twins. Each graph
    copies them in at its launch; ``ready`` (recorded in the graph after the copies) says when the
    pinned side may be rewritten."""

    def __init__(self, max_rows: int, table_words: int) -> None:
        sizes = (max_rows, max_rows, 2 * max_rows, table_words, 2 * max_rows)  # sources, ids, meta, tables, masks
        self.host = [_core.PinnedBuffer(n * 4) for n in sizes]
        self.dev = [_core.DeviceBuffer(n * 4) for n in sizes]
        self.words = [memoryview(buf).cast("I") for buf in self.host]
        self.ready = _core.Event()

    def close(self) -> None:
        for view in self.words:
            view.release()
        for buf in self.host + self.dev:
            buf.close()
        self.ready.close()


class _Step:
    """A fed step kept by ``decode_batch_fed`` until its readback slot is known."""

    __slots__ = ("sources", "seqs", "meta", "tables", "prev_rows", "stream")

    def __init__(self, sources: List[int], seqs: Sequence[Any], meta: List[int], tables: List[int],
                 prev_rows: int, stream: Any) -> None:
        self.sources, self.seqs, self.meta, self.tables = sources, seqs, meta, tables
        self.prev_rows, self.stream = prev_rows, stream


class FedGraphs:
    """The graphs of one model, its staging per readback slot, and the step waiting for its slot."""

    def __init__(self, model: Any, max_graphs: int) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        self.model = model
        self.max_graphs = max_graphs
        self.graphs: "OrderedDict[Tuple[int, int, int, int], Tuple[Any, int]]" = OrderedDict()
        self.staging: Dict[int, _GraphStaging] = {}
        self.pending: Optional[_Step] = None
        self.launches = 0
        self.captures = 0
        self._stream: Optional[_core.Stream] = None  # the capture stream (never the default one)
        self._warm_cells: Optional[_core.DeviceBuffer] = None

    # ---- decode_batch_fed: check and keep ----

    def keep(self, sources: Sequence[int], seqs: Sequence[Any], stream: Any) -> None:
        model = self.model
        prev_rows = model.feed_prev_rows
        words = []
        for i, word in enumerate(sources):  # the checks resolve_feed makes on host sources
            word = int(word)
            if not 0 <= word <= 0xFFFFFFFF:
                raise ValueError(f"source {i} is not a uint32 FeedSource word")
            if not word & _HOST_BIT and word >= prev_rows:
                raise ValueError(f"source {i} reads feed cell {word}, beyond the previous step's "
                                 f"{prev_rows} rows")
            words.append(word)
        model.check_decode_blocks(seqs)  # the scheduler reserved them; the model takes none
        meta: List[int] = []
        tables: List[int] = []
        offsets: Dict[int, int] = {}
        for seq in seqs:
            offset = offsets.get(id(seq))
            if offset is None:
                offset = offsets[id(seq)] = len(tables)
                tables.extend(seq.block_table)
            meta += (seq.seq_len, offset)
        self.pending = _Step(words, seqs, meta, tables, prev_rows, stream)

    def flush(self) -> None:
        """Run a kept step as the eager path does (before any other work of the model)."""
        step, self.pending = self.pending, None
        if step is not None:
            self.model._decode_fed_eager(step.sources, step.seqs, step.stream)

    # ---- argmax_batch_to_feed: stage and launch ----

    def launch(self, masks: Any, dst: Any, event: Any, stream: Any) -> bool:
        """Launch the kept step's graph; False (nothing done) when it cannot be a graph: no kept
        step, or a readback target that is not an int pinned pointer and an event handle."""
        step = self.pending
        if step is None:
            return False
        if not (isinstance(dst, int) and isinstance(event, (int, _core.Event))):
            self.flush()
            return False
        model = self.model
        rows = len(step.sources)
        try:
            flat = self._mask_words(masks, rows, model.feed_vocab)
        except BaseException:
            self.flush()  # the forward runs, as on the default path, where it was queued already
            raise
        event_handle = event.handle if isinstance(event, _core.Event) else event
        staging = self._staging_for(dst)
        staging.ready.synchronize()  # the last launch through this slot has copied its inputs
        sources, _ids, meta, tables, mask_words = staging.words
        sources[:rows] = _u32(step.sources)
        meta[: 2 * rows] = _u32(step.meta)
        tables[: len(step.tables)] = _u32(step.tables)
        mask_words[: 2 * rows] = _u32(flat)
        key = (rows, step.prev_rows, dst, event_handle)
        entry = self.graphs.get(key)
        if entry is None:
            entry = (self._capture(staging, rows, step.prev_rows, dst, event_handle), event_handle)
            self.graphs[key] = entry
        self.graphs.move_to_end(key)
        self.pending = None
        entry[0].launch(stream)
        self.launches += 1
        model.feed_prev_rows = rows
        return True

    def _staging_for(self, dst: int) -> _GraphStaging:
        staging = self.staging.get(dst)
        if staging is None:
            model = self.model
            staging = _GraphStaging(model.feed_max_rows, max(1, model.pool.num_blocks))
            self.staging[dst] = staging
        return staging

    def _capture_stream(self) -> _core.Stream:
        if self._stream is None:
            model = self.model
            self._stream = _core.Stream()
            # cuda: a few-row argmax allocates its stream's scratch at its first launch, which a
            # capture cannot do; one eager 1-row launch (the most split plan) does it now.
            self._warm_cells = _core.DeviceBuffer(4)
            _core.argmax_to_feed(model.logits, None, self._warm_cells, None, None, self._stream,
                                 rows=1, vocab=model.feed_vocab, dtype=model.feed_logits_dtype)
            self._stream.synchronize()
        return self._stream

    def _capture(self, staging: _GraphStaging, rows: int, prev_rows: int, dst: int, event: int) -> Any:
        model = self.model
        stream = self._capture_stream()
        dev = staging.dev
        with _core.graph_capture(stream) as graph:
            _core.copy_h2d_async(dev[0], staging.host[0], stream)
            _core.resolve_feed(dev[0], model.feed_cells, dev[1], stream, prev_rows=prev_rows, rows=rows)
            _core.copy_h2d_async(dev[2], staging.host[2], stream)
            _core.copy_h2d_async(dev[3], staging.host[3], stream)
            _core.copy_h2d_async(dev[4], staging.host[4], stream)
            staging.ready.record(stream)
            _core.reference_forward(dev[1], dev[2], dev[3], model.kv,
                                    model.pool.num_blocks * model.block_size, model.block_size, rows,
                                    model.feed_vocab, model.feed_logits_dtype, model.logits, stream)
            _core.argmax_to_feed(model.logits, dev[4], model.feed_cells, dst, event, stream, rows=rows,
                                 vocab=model.feed_vocab, dtype=model.feed_logits_dtype)
        self.captures += 1
        return graph

    @staticmethod
    def _mask_words(masks: Any, rows: int, vocab: int) -> List[int]:
        """The masks as 2 * rows ids, checked as argmax_to_feed checks host masks."""
        if masks is None:
            flat = [0xFFFFFFFF] * (2 * rows)
        else:
            try:
                view = memoryview(masks)
            except TypeError:
                flat = [int(i) for i in chain.from_iterable(masks)]
            else:
                with view:
                    flat = list(view.cast("B").cast("I")) if view.nbytes % 4 == 0 else []
        if len(flat) != 2 * rows:
            raise ValueError(f"masks hold {len(flat) // 2} rows, not {rows}")
        for i, mask_id in enumerate(flat):
            if mask_id != 0xFFFFFFFF and not 0 <= mask_id < vocab:
                raise ValueError(f"mask id {mask_id} of row {i // 2} is not below vocab {vocab}")
        return flat

    # ---- eviction and close ----

    def evict(self) -> None:
        """Close the least recently used graphs beyond ``max_graphs`` whose last launch is done."""
        for key in list(self.graphs):
            if len(self.graphs) <= self.max_graphs:
                break
            graph, event = self.graphs[key]
            try:
                done = _core.event_query(event)
            except FeedError:  # its event is gone (a router torn down waits for its slots first)
                done = True
            if done:
                del self.graphs[key]
                graph.close()
        used = {key[2] for key in self.graphs}
        for dst in [d for d in self.staging if d not in used]:
            staging = self.staging.pop(dst)
            staging.ready.synchronize()
            staging.close()

    def close(self) -> None:
        self.pending = None
        for graph, _event in self.graphs.values():
            graph.close()
        self.graphs.clear()
        if self._stream is not None:
            self._stream.synchronize()
        _core.stream_synchronize(0)
        for staging in self.staging.values():
            staging.ready.synchronize()
            staging.close()
        self.staging.clear()
        if self._warm_cells is not None:
            self._warm_cells.close()
            self._warm_cells = None
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _u32(values: Sequence[int]) -> Any:
    from array import array

    return array("I", values)
