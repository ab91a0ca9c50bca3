"""Hostile matrix: The kernels: argmax_to_feed, resolve_feed, reference_forward. Bad input, one call per case, run in child interpreters by
_matrix.py (see its docstring)."""

from __future__ import annotations

import ctypes
import gc
import time

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import DeviceBuffer, Event, FeedError, PinnedBuffer, Stream
from metrale_feed._core import reference_forward

from _matrix import (FOREIGN, NT, add, case, closed_event, closed_stream, dev_bytes, dev_with,
                     drained, hostile_test, pinned_with, raises, _destroyed_handle, _model)

ROWS, VOCAB = 2, 8
CELL_SENTINEL = b"\xaa" * 16  # 4 cells
DST_SENTINEL = b"\xbb" * 16


class ArgmaxSetup:
    """Valid arguments for a 2 x 8 float32 argmax, and sentinels in the cells and dst."""

    def __init__(self):
        rng = np.random.default_rng(1)
        self.values = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
        self.logits = dev_with(self.values.tobytes())
        self.cells = dev_with(CELL_SENTINEL)
        self.dst = pinned_with(DST_SENTINEL)
        self.event = Event()
        self.kw = dict(rows=ROWS, vocab=VOCAB, dtype="float32")

    def call(self, **changes):
        args = dict(logits=self.logits, masks=[(NT, NT)] * ROWS, cells=self.cells, dst=self.dst,
                    event=self.event, stream=0, **self.kw)
        args.update(changes)
        mf.argmax_to_feed(args.pop("logits"), args.pop("masks"), args.pop("cells"),
                          args.pop("dst"), args.pop("event"), args.pop("stream"), **args)

    def untouched(self):
        drained()
        assert dev_bytes(self.cells) == CELL_SENTINEL, "a refused argmax wrote the feed cells"
        assert bytes(memoryview(self.dst)) == DST_SENTINEL, "a refused argmax copied into dst"
        assert self.event.query() is True


def argmax_refused(exc, match, bug=None, **changes):
    def run():
        s = ArgmaxSetup()
        resolved = {k: (v(s) if callable(v) else v) for k, v in changes.items()}
        raises(exc, match, s.call, **resolved)
        s.untouched()
    return run


def _freed_dev(nbytes=64):
    d = DeviceBuffer(nbytes)
    p = d.ptr
    d.close()
    return p


ARGMAX_BAD = [
    # masks
    ("mask_id_at_vocab", ValueError, "mask id 8 of row 0 is not below vocab 8", dict(masks=[(8, NT), (NT, NT)])),
    ("mask_id_huge", ValueError, "not below vocab", dict(masks=[(NT, NT), (NT, 0xFFFFFFFE)])),
    ("mask_negative", ValueError, "outside uint32", dict(masks=[(-1, NT), (NT, NT)])),
    ("mask_beyond_u32", ValueError, "outside uint32", dict(masks=[(2**32, NT), (NT, NT)])),
    ("mask_triple", ValueError, "must be a pair", dict(masks=[(1, 2, 3), (NT, NT)])),
    ("mask_single", ValueError, "must be a pair", dict(masks=[(1,), (NT, NT)])),
    ("mask_not_sequence", TypeError, "uint32 buffer or a sequence", dict(masks=5)),
    ("mask_item_int", TypeError, "masks", dict(masks=[1, 2])),
    ("mask_item_str", TypeError, "masks", dict(masks=[("a", "b"), (NT, NT)])),
    ("mask_rows_mismatch", ValueError, "masks hold 1 rows, not 2", dict(masks=[(NT, NT)])),
    ("mask_float32_array", TypeError, "uint32 buffer, not format 'f'", dict(masks=np.zeros((2, 2), np.float32))),
    ("mask_int64_array", TypeError, "uint32 buffer", dict(masks=np.zeros((2, 2), np.int64))),
    ("mask_uint16_array", TypeError, "uint32 buffer", dict(masks=np.zeros((2, 4), np.uint16))),
    ("mask_odd_u32_array", ValueError, "masks hold", dict(masks=np.full(3, NT, np.uint32))),
    ("mask_u32_array_bad_id", ValueError, "not below vocab", dict(masks=np.array([[9, NT], [NT, NT]], np.uint32))),
    ("mask_strided", (ValueError, BufferError), "contiguous",
     dict(masks=np.full((2, 4), NT, np.uint32)[:, ::2])),
    ("masks_none_no_rows", ValueError, "rows is required", dict(masks=None, rows=None)),
    # rows, vocab, dtype, row_stride
    ("rows_zero", ValueError, r"rows must be in \[1, 4096\]", dict(rows=0)),
    ("rows_negative", ValueError, r"rows must be in \[1, 4096\]", dict(rows=-1)),
    ("rows_over_max", ValueError, r"rows must be in \[1, 4096\]", dict(rows=4097)),
    ("rows_str", TypeError, "not supported|str", dict(rows="2")),
    ("rows_over_capacity", ValueError, "exceed the feed cells' capacity of 4",
     dict(rows=5, masks=None, dst=None, logits=lambda s: dev_with(bytes(5 * VOCAB * 4)))),
    ("vocab_zero", ValueError, r"vocab must be in \[1, 2\*\*24\]", dict(vocab=0)),
    ("vocab_over_max", ValueError, r"vocab must be in \[1, 2\*\*24\]", dict(vocab=(1 << 24) + 1)),
    ("vocab_str", TypeError, "not supported|str", dict(vocab="8")),
    ("dtype_int8", ValueError, "unknown logits dtype 'int8'", dict(dtype="int8")),
    ("dtype_float64", ValueError, "unknown logits dtype", dict(dtype="float64")),
    ("dtype_none", TypeError, "dtype is required unless logits is a tensor", dict(dtype=None)),
    ("dtype_numpy_int32", ValueError, "unknown logits dtype", dict(dtype=np.dtype("int32"))),
    ("row_stride_below_vocab", ValueError, "row_stride 7 is less than vocab 8", dict(row_stride=7)),
    ("row_stride_negative", ValueError, "row_stride must be in", dict(row_stride=-1)),
    ("row_stride_too_long", ValueError, "run past the end", dict(row_stride=VOCAB + 1)),
    # logits
    ("logits_too_small", ValueError, "logits: 64 bytes run past the end .*60 left",
     dict(logits=lambda s: s.logits.ptr + 4)),
    ("logits_f16_span", ValueError, "run past the end",
     dict(dtype="float16", logits=lambda s: dev_with(bytes(31)))),
    ("logits_misaligned", ValueError, "misaligned", dict(logits=lambda s: s.logits.ptr + 1)),
    ("logits_misaligned_f16", ValueError, "misaligned",
     dict(dtype="bfloat16", logits=lambda s: s.logits.ptr + 1)),
    ("logits_freed", FeedError, "logits 0x.* is not a live device allocation", dict(logits=lambda s: _freed_dev())),
    ("logits_foreign", FeedError, "not a live device allocation", dict(logits=FOREIGN.ctypes.data)),
    ("logits_pinned", ValueError, "page-locked", dict(logits=lambda s: PinnedBuffer(64))),
    ("logits_null", ValueError, "logits is a null pointer", dict(logits=0)),
    ("logits_str", TypeError, "expected a DeviceBuffer", dict(logits="x")),
    # A CPU array stands for device memory on the host backend (test_interop), but must agree.
    ("logits_numpy_disagrees", ValueError, "disagrees", dict(logits=np.zeros((2, 9), np.float32))),
    # cells
    ("cells_freed", FeedError, "feed cells 0x.* is not a live device allocation", dict(cells=lambda s: _freed_dev())),
    ("cells_misaligned", ValueError, "misaligned", dict(cells=lambda s: s.cells.ptr + 2)),
    ("cells_interior_small", ValueError, "exceed the feed cells' capacity of 1",
     dict(cells=lambda s: s.cells.ptr + 12)),
    ("cells_pinned", ValueError, "page-locked", dict(cells=lambda s: PinnedBuffer(16))),
    ("cells_none", TypeError, "expected a DeviceBuffer", dict(cells=None)),
    # dst
    ("dst_too_small", ValueError, "dst holds 4 bytes; 2 ids need 8", dict(dst=lambda s: PinnedBuffer(4))),
    ("dst_bytearray_small", ValueError, "dst holds 7 bytes", dict(dst=lambda s: bytearray(7))),
    ("dst_read_only", BufferError, "not writable", dict(dst=b"\x00" * 16)),
    ("dst_ptr_freed", FeedError, "is not live pinned memory",
     dict(dst=lambda s: (lambda p: (mf.free_host_pinned(p, 64), p)[1])(mf.alloc_host_pinned(64)))),
    ("dst_ptr_foreign", FeedError, "is not live pinned memory", dict(dst=FOREIGN.ctypes.data)),
    ("dst_ptr_small", ValueError, "8 bytes run past the end of the pinned allocation",
     dict(dst=lambda s: s.dst.ptr + 12)),
    ("dst_ptr_device", FeedError, "is not live pinned memory", dict(dst=lambda s: DeviceBuffer(16).ptr)),
    ("dst_device_buffer", TypeError, "must be a buffer", dict(dst=lambda s: DeviceBuffer(16))),
    ("dst_closed", FeedError, "the pinned buffer is closed",
     dict(dst=lambda s: (lambda b: (b.close(), b)[1])(PinnedBuffer(16)))),
    # event, stream
    ("event_destroyed", FeedError, "unknown or destroyed event", dict(event=lambda s: _destroyed_handle())),
    ("event_closed", FeedError, "the event is closed", dict(event=lambda s: closed_event())),
    ("event_str", TypeError, "expected an Event", dict(event="e")),
    ("event_stream_handle", FeedError, "unknown or destroyed event",
     dict(event=lambda s: Stream().handle)),
    ("stream_unknown", FeedError, "unknown or destroyed stream", dict(stream=0xF00D)),
    ("stream_closed", FeedError, "the stream is closed", dict(stream=lambda s: closed_stream())),
    ("stream_float", TypeError, "expected a Stream", dict(stream=0.0)),
]
for _label, _exc, _match, _changes in ARGMAX_BAD:
    add("argmax", _label, argmax_refused(_exc, _match, **_changes))


@case("argmax")
def missing_keywords():
    s = ArgmaxSetup()
    raises(TypeError, "vocab", mf.argmax_to_feed, s.logits, None, s.cells, None, None, rows=2,
           dtype="float32")
    raises(TypeError, "dtype", mf.argmax_to_feed, s.logits, None, s.cells, None, None, rows=2,
           vocab=8)
    s.untouched()


@case("argmax")
def row_stride_wraps_span():
    s = ArgmaxSetup()
    logits = DeviceBuffer(256)
    raises((ValueError, OverflowError), None, s.call, logits=logits, masks=None, dst=None,
           vocab=1 << 24, row_stride=(1 << 62) - (1 << 24))
    s.untouched()


@case("argmax")
def float_arguments():
    s = ArgmaxSetup()
    raises(TypeError, None, s.call, row_stride=8.0)
    raises(TypeError, None, s.call, masks=[(0.5, NT), (NT, NT)])
    s.untouched()


@case("argmax")
def control_valid_call_writes():
    # The sentinels of this group can see a launch: the same arguments, valid, change them.
    s = ArgmaxSetup()
    s.call(masks=[(int(np.argmax(s.values[0])), NT), (NT, NT)])
    s.event.synchronize()
    got = list(np.frombuffer(memoryview(s.dst), np.uint32)[:ROWS])
    want = [int(np.argsort(-s.values[0], kind="stable")[1]), int(np.argmax(s.values[1]))]
    assert got == want
    assert dev_bytes(s.cells)[8:] == CELL_SENTINEL[8:]  # only `rows` cells written


# ---------------------------------------------------------------------------------------------
# resolve_feed
# ---------------------------------------------------------------------------------------------

OUT_SENTINEL = b"\xcc" * 16


class ResolveSetup:
    def __init__(self):
        self.cells = dev_with(np.array([10, 11, 12, 13], np.uint32).tobytes())
        self.out = dev_with(OUT_SENTINEL)

    def call(self, sources=(0, 1), cells=None, out=None, stream=0, **kw):
        kw.setdefault("prev_rows", 4)
        mf.resolve_feed(list(sources) if isinstance(sources, tuple) else sources,
                        self.cells if cells is None else cells, self.out if out is None else out,
                        stream, **kw)

    def untouched(self):
        drained()
        assert dev_bytes(self.out) == OUT_SENTINEL, "a refused resolve wrote its output"


def resolve_refused(exc, match, **changes):
    def run():
        s = ResolveSetup()
        resolved = {k: (v(s) if callable(v) else v) for k, v in changes.items()}
        raises(exc, match, s.call, **resolved)
        s.untouched()
    return run


RESOLVE_BAD = [
    ("from_row_at_prev_rows", ValueError, "source 1 reads feed cell 2, beyond the previous step's 2 rows",
     dict(sources=(0, 2), prev_rows=2)),
    ("from_row_no_prev_step", ValueError, "beyond the previous step's 0 rows", dict(prev_rows=0)),
    ("from_row_huge", ValueError, "beyond the previous step's", dict(sources=(0x7FFFFFFF,))),
    ("prev_rows_negative", ValueError, "prev_rows must not be negative", dict(prev_rows=-1)),
    ("prev_rows_beyond_u32", ValueError, "prev_rows must be in", dict(prev_rows=2**32)),
    ("prev_rows_past_cells", ValueError, "feed cells: 20 bytes run past the end", dict(prev_rows=5)),
    ("prev_rows_missing", ValueError, "prev_rows is required", dict(prev_rows=None)),
    ("sources_empty", ValueError, r"rows must be in \[1, 4096\], got 0", dict(sources=[])),
    ("sources_too_many", ValueError, r"rows must be in \[1, 4096\], got 4097",
     dict(sources=[0x80000000] * 4097)),
    ("sources_negative", ValueError, "outside uint32", dict(sources=[-1])),
    ("sources_beyond_u32", ValueError, "outside uint32", dict(sources=[2**32])),
    ("sources_str", TypeError, "sources", dict(sources="ab")),
    ("sources_int", TypeError, "uint32 buffer or a sequence", dict(sources=3)),
    ("sources_float_array", TypeError, "uint32 buffer", dict(sources=np.zeros(2, np.float32))),
    ("sources_int64_array", TypeError, "uint32 buffer", dict(sources=np.zeros(2, np.int64))),
    ("out_too_small", ValueError, "resolve output: 8 bytes run past the end", dict(out=lambda s: DeviceBuffer(4))),
    ("out_freed", FeedError, "resolve output 0x.* is not a live device allocation", dict(out=lambda s: _freed_dev())),
    ("out_misaligned", ValueError, "misaligned", dict(out=lambda s: s.out.ptr + 1)),
    ("out_pinned", ValueError, "page-locked", dict(out=lambda s: PinnedBuffer(16))),
    ("out_foreign", FeedError, "not a live device allocation", dict(out=FOREIGN.ctypes.data)),
    ("cells_freed", FeedError, "feed cells 0x.* is not a live device allocation", dict(cells=lambda s: _freed_dev())),
    ("cells_misaligned", ValueError, "misaligned", dict(cells=lambda s: s.cells.ptr + 3)),
    ("cells_str", TypeError, "expected a DeviceBuffer", dict(cells="c")),
    ("stream_unknown", FeedError, "unknown or destroyed stream", dict(stream=0xF00D)),
    ("stream_closed", FeedError, "the stream is closed", dict(stream=lambda s: closed_stream())),
]
for _label, _exc, _match, _changes in RESOLVE_BAD:
    if _changes.get("prev_rows", 0) is None:
        # A missing keyword: call without it.
        def _missing(exc=_exc, match=_match):
            s = ResolveSetup()
            raises(exc, match, mf.resolve_feed, [0], s.cells, s.out)
            s.untouched()
        add("resolve", _label, _missing)
    else:
        add("resolve", _label, resolve_refused(_exc, _match, **_changes))


@case("resolve")
def sources_float():
    s = ResolveSetup()
    raises(TypeError, None, s.call, sources=[0.5])
    s.untouched()


@case("resolve")
def control_resolve_writes():
    s = ResolveSetup()
    s.call(sources=(mf.FeedSource.feed(3), mf.FeedSource.host(7)), prev_rows=4)
    drained()
    assert list(np.frombuffer(dev_bytes(s.out), np.uint32)) == [13, 7, 0xCCCCCCCC, 0xCCCCCCCC]


# ---------------------------------------------------------------------------------------------
# reference_forward (the reference model's kernel)
# ---------------------------------------------------------------------------------------------

KV_SENTINEL = b"\xdd" * 64
LOGITS_SENTINEL = b"\xee" * 64


class ForwardSetup:
    """One row at position 0, block size 4, a 16-slot KV cache, vocab 8 (float32)."""

    def __init__(self):
        self.ids = dev_with(np.array([5], np.uint32).tobytes())
        self.meta = dev_with(np.array([0, 0], np.uint32).tobytes())
        self.tables = dev_with(np.array([1], np.uint32).tobytes())
        self.kv = dev_with(KV_SENTINEL)
        self.logits = dev_with(LOGITS_SENTINEL[:32])

    def call(self, **changes):
        args = dict(input_ids=self.ids, meta=self.meta, tables=self.tables, kv=self.kv, kv_slots=16,
                    block_size=4, rows=1, vocab=8, dtype="float32", logits=self.logits, stream=0)
        args.update(changes)
        reference_forward(**args)

    def untouched(self):
        drained()
        assert dev_bytes(self.kv) == KV_SENTINEL, "a refused forward wrote the KV cache"
        assert dev_bytes(self.logits) == LOGITS_SENTINEL[:32], "a refused forward wrote logits"


def forward_refused(exc, match, **changes):
    def run():
        s = ForwardSetup()
        resolved = {k: (v(s) if callable(v) else v) for k, v in changes.items()}
        raises(exc, match, s.call, **resolved)
        s.untouched()
    return run


FORWARD_BAD = [
    ("dtype_unknown", ValueError, "unknown logits dtype", dict(dtype="int4")),
    ("rows_zero", ValueError, "rows must be in", dict(rows=0)),
    ("rows_over_max", ValueError, "rows must be in", dict(rows=4097)),
    ("vocab_zero", ValueError, "vocab must be in", dict(vocab=0)),
    ("vocab_over_max", ValueError, "vocab must be in", dict(vocab=(1 << 24) + 1)),
    ("block_size_zero", ValueError, "block_size must be in", dict(block_size=0)),
    ("rows_negative", ValueError, "rows must be in", dict(rows=-1)),
    ("kv_slots_beyond_u32", ValueError, "kv_slots must be in", dict(kv_slots=2**32)),
    ("kv_slots_past_kv", ValueError, "kv cache: 68 bytes run past the end", dict(kv_slots=17)),
    ("logits_too_small", ValueError, "logits: 64 bytes run past the end", dict(vocab=16)),
    ("ids_too_small", ValueError, "input ids: 8 bytes run past the end",
     dict(rows=2, logits=lambda s: DeviceBuffer(64))),
    ("meta_too_small", ValueError, "row meta: 8 bytes run past the end",
     dict(meta=lambda s: DeviceBuffer(4))),
    ("kv_freed", FeedError, "kv cache 0x.* is not a live device allocation", dict(kv=lambda s: _freed_dev())),
    ("tables_foreign", FeedError, "block tables 0x.* is not a live device allocation", dict(tables=FOREIGN.ctypes.data)),
    ("ids_pinned", ValueError, "page-locked", dict(input_ids=lambda s: PinnedBuffer(4))),
    ("ids_str", TypeError, "expected a DeviceBuffer", dict(input_ids="x")),
    ("kv_slots_str", TypeError, "integer|str", dict(kv_slots="16")),
    ("stream_unknown", FeedError, "unknown or destroyed stream", dict(stream=0xF00D)),
]
for _label, _exc, _match, _changes in FORWARD_BAD:
    add("forward", _label, forward_refused(_exc, _match, **_changes))


@case("forward")
def corrupt_table_offset_is_contained():
    # Device contents cannot be checked before launch; the kernel must still stay inside the
    # tables' allocation. Either a refusal or a completed forward is fine; a crash is not.
    s = ForwardSetup()
    mf.copy_h2d_async(s.meta, np.array([0, 0xFFFFFFF0], np.uint32).tobytes())
    drained()
    try:
        s.call()
    except (ValueError, FeedError):
        pass
    drained()


@case("forward")
def forward_float_arguments():
    s = ForwardSetup()
    raises(TypeError, None, s.call, rows=1.5)
    s.untouched()


@case("forward")
def control_forward_writes():
    s = ForwardSetup()
    s.call()
    drained()
    kv = np.frombuffer(dev_bytes(s.kv), np.uint32)
    assert kv[4] == 5 and kv[0] == 0xDDDDDDDD  # block 1, slot 0: the input id
    from metrale_feed.testing.reference import host_logits

    assert np.frombuffer(dev_bytes(s.logits), np.float32).tolist() == host_logits([5], 8).tolist()


# ---------------------------------------------------------------------------------------------
# configure_host / host_kernel_threads
# ---------------------------------------------------------------------------------------------


test_hostile = hostile_test(__name__)
