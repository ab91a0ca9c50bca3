"""Properties, with hypothesis, on the host backend:

1. random sequences of runtime operations (events, streams, copies, pinned and device memory,
   valid and invalid) against a small Python model of what should be live and what must raise;
2. random argmax inputs (raw bit patterns, NaN payloads, infinities, signed zeros, ties, padding,
   masks) against ``metrale_feed.testing.oracle.reference_argmax``;
3. random schedules through the decode pipeline (stops, masks, submission orders) on the
   reference model against ``metrale_feed.testing.reference.host_next_token``.

Example counts are modest so the file runs in well under a minute on two cores.
"""

from __future__ import annotations

import gc
import random
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 multiple, precondition, rule, run_state_machine_as_test)

import metrale_feed as mf
from metrale_feed import DeviceBuffer, Event, FeedError, PinnedBuffer, Stream
from metrale_feed.tools.demo import host_reference
from metrale_feed.testing.oracle import reference_argmax
from metrale_feed.testing.reference import ReferenceModel, host_next_token
from helpers.leaks import assert_counts_back

NT = mf.NO_TOKEN

# ---------------------------------------------------------------------------------------------
# 1. The runtime against a model of its state
# ---------------------------------------------------------------------------------------------


class DevBuf:
    """A DeviceBuffer, what its bytes should be, and a fence: an event recorded after the last
    operation on it, on the stream that ran it, so an operation on another stream waits for it."""

    def __init__(self, nbytes, fill):
        self.buf = DeviceBuffer(nbytes)
        self.want = bytearray([fill]) * nbytes
        self.fence = Event()
        self.fence_stream = None
        self.ptr = self.buf.ptr


class RuntimeMachine(RuleBasedStateMachine):
    events = Bundle("events")
    dead_events = Bundle("dead_events")
    streams = Bundle("streams")
    pinned = Bundle("pinned")
    devbufs = Bundle("devbufs")

    @initialize()
    def start(self):
        mf.configure_host()
        gc.collect()
        mf.stream_synchronize(0)
        self.base = mf.live_objects()
        self.live_events = set()
        self.live_streams = []
        self.stale_streams = []
        self.live_pinned = {}  # ptr -> nbytes
        self.freed_pinned = []
        self.live_dev = []
        self.freed_dev = []
        self.default = Stream.wrap(0)

    # ---- helpers ----

    def stream_for(self, choice):
        if choice is None or not self.live_streams:
            return self.default
        return self.live_streams[choice % len(self.live_streams)]

    def order_after(self, stream, *bufs):
        """Make ``stream`` wait for each buffer's last operation on another stream."""
        for b in bufs:
            if b.fence_stream is not None and b.fence_stream is not stream:
                stream.wait_event(b.fence)

    def fence(self, stream, *bufs):
        for b in bufs:
            b.fence.record(stream)
            b.fence_stream = stream

    def inside_a_live_allocation(self, ptr):
        """Freed addresses are handed out again: only one inside no live allocation must raise."""
        return (any(d.ptr <= ptr < d.ptr + len(d.want) for d in self.live_dev)
                or any(p <= ptr < p + n for p, n in self.live_pinned.items()))

    # ---- events ----

    @rule(target=events, timing=st.booleans())
    def create_event(self, timing):
        handle = mf.event_create(timing=timing)
        self.live_events.add(handle)
        return handle

    @rule(event=events, choice=st.one_of(st.none(), st.integers(0, 7)))
    def record_event(self, event, choice):
        if event in self.live_events:
            mf.event_record(event, self.stream_for(choice))

    @rule(event=events)
    def query_event(self, event):
        if event in self.live_events:
            assert mf.event_query(event) in (True, False)

    @rule(event=events)
    def synchronize_event(self, event):
        if event in self.live_events:
            mf.event_synchronize(event)
            assert mf.event_query(event) is True  # done once waited for, until recorded again

    @rule(target=dead_events, event=consumes(events))
    def destroy_event(self, event):
        if event not in self.live_events:
            return multiple()
        mf.destroy_event(event)
        self.live_events.discard(event)
        return event

    @rule(event=dead_events, op=st.sampled_from(["query", "synchronize", "record", "destroy", "wait"]))
    def dead_event_raises(self, event, op):
        call = {"query": mf.event_query, "synchronize": mf.event_synchronize,
                "record": mf.event_record, "destroy": mf.destroy_event,
                "wait": self.default.wait_event}[op]
        with pytest.raises(FeedError, match="unknown or destroyed event"):
            call(event)

    # ---- streams ----

    @rule(non_blocking=st.booleans())
    def create_stream(self, non_blocking):
        self.live_streams.append(Stream(non_blocking=non_blocking))

    @precondition(lambda self: self.live_streams)
    @rule(index=st.integers(0, 7), sync_first=st.booleans())
    def destroy_stream(self, index, sync_first):
        s = self.live_streams.pop(index % len(self.live_streams))
        if sync_first:
            s.synchronize()
        handle = s.handle
        s.close()  # queued work still completes
        self.stale_streams.append(handle)
        with pytest.raises(FeedError, match="the stream is closed"):
            s.synchronize()

    @precondition(lambda self: self.stale_streams)
    @rule(index=st.integers(0, 7))
    def stale_stream_handle_raises(self, index):
        handle = self.stale_streams[index % len(self.stale_streams)]
        if any(s.handle == handle for s in self.live_streams):
            return  # a new stream took the address: a pointer-valued handle cannot tell
        with pytest.raises(FeedError, match="unknown or destroyed stream"):
            mf.stream_synchronize(handle)

    # ---- pinned memory ----

    @rule(target=pinned, nbytes=st.integers(1, 9000))
    def alloc_pinned(self, nbytes):
        ptr = mf.alloc_host_pinned(nbytes)
        assert ptr not in self.live_pinned
        assert mf.read_pinned_u32(ptr, min(4, nbytes // 4)) == [0] * min(4, nbytes // 4)  # zeroed
        self.live_pinned[ptr] = nbytes
        return ptr

    @rule(ptr=pinned, delta=st.sampled_from([-1, 1, 4096]))
    def free_pinned_wrong_size(self, ptr, delta):
        if ptr not in self.live_pinned:
            return
        with pytest.raises(ValueError, match="has .* bytes, not"):
            mf.free_host_pinned(ptr, self.live_pinned[ptr] + delta)

    @rule(ptr=consumes(pinned))
    def free_pinned(self, ptr):
        if ptr not in self.live_pinned:
            return
        mf.free_host_pinned(ptr, self.live_pinned.pop(ptr))
        self.freed_pinned.append(ptr)

    @precondition(lambda self: self.freed_pinned)
    @rule(index=st.integers(0, 50))
    def double_free_pinned(self, index):
        ptr = self.freed_pinned[index % len(self.freed_pinned)]
        if self.inside_a_live_allocation(ptr):
            return
        with pytest.raises(FeedError, match="not a live pinned allocation"):
            mf.free_host_pinned(ptr, 64)
        with pytest.raises(FeedError, match="live pinned memory"):
            mf.read_pinned_u32(ptr, 1)

    # ---- device memory and copies ----

    @rule(target=devbufs, nbytes=st.integers(1, 300), fill=st.integers(0, 255),
          choice=st.one_of(st.none(), st.integers(0, 7)))
    def alloc_device(self, nbytes, fill, choice):
        d = DevBuf(nbytes, fill)
        s = self.stream_for(choice)
        mf.copy_h2d_async(d.buf, bytes(d.want), s)
        self.fence(s, d)
        self.live_dev.append(d)
        return d

    @rule(d=devbufs, data=st.data(), choice=st.one_of(st.none(), st.integers(0, 7)))
    def h2d(self, d, data, choice):
        if d not in self.live_dev:
            return
        n = len(d.want)
        offset = data.draw(st.integers(0, n - 1))
        payload = data.draw(st.binary(min_size=0, max_size=n - offset))
        s = self.stream_for(choice)
        self.order_after(s, d)
        mf.copy_h2d_async(d.ptr + offset, bytearray(payload), s)  # a bytearray: held until passed
        self.fence(s, d)
        d.want[offset:offset + len(payload)] = payload

    @rule(d=devbufs, extra=st.integers(1, 64), choice=st.one_of(st.none(), st.integers(0, 7)))
    def h2d_past_end_raises(self, d, extra, choice):
        if d not in self.live_dev:
            return
        with pytest.raises(ValueError, match="run past the end"):
            mf.copy_h2d_async(d.buf, bytes(len(d.want) + extra), self.stream_for(choice))

    @rule(dst=devbufs, src=devbufs, data=st.data(), choice=st.one_of(st.none(), st.integers(0, 7)))
    def d2d(self, dst, src, data, choice):
        if dst not in self.live_dev or src not in self.live_dev or dst is src:
            return
        n = data.draw(st.integers(0, min(len(dst.want), len(src.want))))
        so = data.draw(st.integers(0, len(src.want) - n))
        do = data.draw(st.integers(0, len(dst.want) - n))
        s = self.stream_for(choice)
        self.order_after(s, dst, src)
        mf.copy_d2d_async(dst.ptr + do, src.ptr + so, n, s)
        self.fence(s, dst, src)
        dst.want[do:do + n] = src.want[so:so + n]

    @rule(dst=devbufs, src=devbufs)
    def d2d_past_end_raises(self, dst, src):
        if dst not in self.live_dev or src not in self.live_dev:
            return
        with pytest.raises(ValueError, match="run past the end"):
            mf.copy_d2d_async(dst.buf, src.buf, max(len(dst.want), len(src.want)) + 1)

    @rule(d=devbufs, choice=st.one_of(st.none(), st.integers(0, 7)), into_pinned=st.booleans())
    def check_contents(self, d, choice, into_pinned):
        if d not in self.live_dev:
            return
        s = self.stream_for(choice)
        self.order_after(s, d)
        out = PinnedBuffer(len(d.want)) if into_pinned else bytearray(len(d.want))
        mf.copy_d2h_async(d.buf, out, s)
        self.fence(s, d)
        s.synchronize()
        assert bytes(memoryview(out)) == bytes(d.want)
        if into_pinned:
            out.close()

    @rule(d=consumes(devbufs))
    def free_device(self, d):
        if d not in self.live_dev:
            return
        self.live_dev.remove(d)
        d.buf.close()  # waits for queued work, like cudaFree
        d.fence.close()
        self.freed_dev.append(d.ptr)

    @precondition(lambda self: self.freed_dev)
    @rule(index=st.integers(0, 50))
    def freed_device_pointer_raises(self, index):
        ptr = self.freed_dev[index % len(self.freed_dev)]
        if self.inside_a_live_allocation(ptr):
            return
        with pytest.raises(FeedError, match="not a live device allocation"):
            mf.copy_d2h_async(ptr, bytearray(1))

    @rule(lag=st.sampled_from([0, 0, 30, 200]))
    def set_lag(self, lag):
        mf.configure_host(lag_us=lag)

    # ---- the model's counts ----

    @invariant()
    def live_counts_match(self):
        if not hasattr(self, "base"):
            return
        want = {
            "events": self.base["events"] + len(self.live_events) + len(self.live_dev),
            "streams": self.base["streams"] + len(self.live_streams),
            "graphs": self.base["graphs"],
            "pinned_bytes": self.base["pinned_bytes"] + sum(self.live_pinned.values()),
            "device_bytes": self.base["device_bytes"] + sum(len(d.want) for d in self.live_dev),
        }
        # Copies from Python buffers hold an event until they pass; let queued work finish.
        for s in self.live_streams:
            s.synchronize()
        mf.stream_synchronize(0)
        deadline = time.monotonic() + 20  # polled: a margin for loaded machines
        while True:
            got = mf.live_objects()
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        assert got == want, (f"live_objects() {got}, the model says {want}: {len(self.live_events)} "
                             f"events, {len(self.live_dev)} device buffers (one fence event each), "
                             f"{len(self.live_streams)} streams, {len(self.live_pinned)} pinned")

    def teardown(self):
        mf.configure_host()
        if not hasattr(self, "base"):
            return
        for d in self.live_dev:
            d.buf.close()
            d.fence.close()
        for ptr, n in self.live_pinned.items():
            mf.free_host_pinned(ptr, n)
        for handle in self.live_events:
            mf.destroy_event(handle)
        for s in self.live_streams:
            s.close()
        mf.stream_synchronize(0)
        assert_counts_back(self.base, "objects left after the machine's teardown")


def test_runtime_against_a_model(host):
    run_state_machine_as_test(RuntimeMachine, settings=settings(
        max_examples=60, stateful_step_count=30, deadline=None, database=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow]))


# ---------------------------------------------------------------------------------------------
# 2. argmax_to_feed against the oracle
# ---------------------------------------------------------------------------------------------

BITS = {"float32": (np.uint32, 32), "float16": (np.uint16, 16), "bfloat16": (np.uint16, 16)}
SPECIAL = {
    # +-0, +-inf, quiet and signalling NaNs with payloads and either sign, +-1, the extremes
    "float32": [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF, 0x3F800000, 0xBF800000, 0x00000001,
                0x7F7FFFFF, 0xFF7FFFFF],
    "float16": [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFFFF, 0x3C00, 0xBC00,
                0x0001, 0x7BFF, 0xFBFF],
    "bfloat16": [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x3F80, 0xBF80,
                 0x0001, 0x7F7F, 0xFF7F],
}
POS_INF = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}


def as_floats(bits, dtype):
    return bits.view(np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype))


@st.composite
def argmax_inputs(draw):
    dtype = draw(st.sampled_from(list(BITS)))
    rows = draw(st.integers(1, 6))
    vocab = draw(st.integers(1, 40))
    pad = draw(st.integers(0, 5))
    kind, nbits = BITS[dtype]
    # Few distinct values make ties; raw bits cover every class of number and NaN.
    palette = draw(st.lists(st.one_of(st.sampled_from(SPECIAL[dtype]),
                                      st.integers(0, 2**nbits - 1)), min_size=1, max_size=6))
    cells = draw(st.lists(st.sampled_from(palette), min_size=rows * vocab, max_size=rows * vocab))
    bits = np.full((rows, vocab + pad), POS_INF[dtype], kind)  # padding must never be read
    bits[:, :vocab] = np.array(cells, kind).reshape(rows, vocab)
    mask_id = st.one_of(st.just(NT), st.integers(0, vocab - 1))
    masks = draw(st.one_of(st.none(), st.lists(st.tuples(mask_id, mask_id), min_size=rows,
                                               max_size=rows)))
    return dtype, bits, vocab, masks


@settings(max_examples=400, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argmax_inputs(), st.sampled_from(["pairs", "array"]))
def test_argmax_matches_the_oracle(host, inputs, mask_form):
    dtype, bits, vocab, masks = inputs
    rows, stride = bits.shape
    expected = reference_argmax(as_floats(bits, dtype)[:, :vocab], masks)
    logits = DeviceBuffer(bits.nbytes)
    cells = DeviceBuffer(rows * 4 + 4)
    dst = PinnedBuffer(rows * 4)
    try:
        mf.copy_h2d_async(logits, bits.tobytes())
        mask_arg = masks
        if masks is not None and mask_form == "array":
            mask_arg = np.array(masks, np.uint32).reshape(rows, 2)
        with Event() as e:
            mf.argmax_to_feed(logits, mask_arg, cells, dst, e, rows=rows, vocab=vocab, dtype=dtype,
                              row_stride=stride)
            e.synchronize()
            got = np.frombuffer(dst, np.uint32).copy()
        from_cells = bytearray(rows * 4)
        mf.copy_d2h_async(cells, from_cells)
        mf.stream_synchronize(0)
    finally:
        logits.close()
        cells.close()
        dst.close()
    assert got.tolist() == expected.tolist()
    assert np.frombuffer(bytes(from_cells), np.uint32).tolist() == expected.tolist()


# ---------------------------------------------------------------------------------------------
# 3. Router schedules against the host reference
# ---------------------------------------------------------------------------------------------

@st.composite
def schedules(draw):
    vocab = draw(st.sampled_from([2, 3, 17, 64, 300]))
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    rows = draw(st.integers(1, 6))
    max_new = draw(st.integers(1, 12))
    requests = []
    for _ in range(rows):
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10))
        mask_kind = draw(st.sampled_from(["none", "winner", "random", "both"]))
        mask = (NT, NT)
        if mask_kind == "winner":  # ban what the row would answer, so a lost mask shows
            mask = (host_next_token(prompt, vocab, dtype), NT)
        elif mask_kind == "random":
            mask = (draw(st.integers(0, vocab - 1)), draw(st.one_of(st.just(NT), st.integers(0, vocab - 1))))
        elif mask_kind == "both":
            mask = (draw(st.integers(0, vocab - 1)), draw(st.integers(0, vocab - 1)))
        stop = NT
        if draw(st.booleans()) and max_new > 1:  # stop on an id the row will generate
            trajectory = host_reference(prompt, mask, NT, max_new, vocab, dtype)
            stop = trajectory[draw(st.integers(0, len(trajectory) - 1))]
        requests.append({"prompt": prompt, "mask": mask, "stop": stop})
    return vocab, dtype, max_new, requests


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(schedules(), st.integers(0, 2**32 - 1), st.integers(1, 5))
def test_router_schedules_match_the_host(host, schedule, seed, block_size):
    vocab, dtype, max_new, requests = schedule
    expected = [host_reference(r["prompt"], r["mask"], r["stop"], max_new, vocab, dtype)
                for r in requests]
    rows = len(requests)
    blocks = rows * ((10 + max_new) // block_size + 3)
    before = mf.live_objects()
    order = list(range(rows))
    random.Random(seed).shuffle(order)
    with ReferenceModel(vocab, block_size=block_size, num_blocks=blocks, max_rows=rows,
                        logits_dtype=dtype) as model:
        with mf.DecodePipeline(model, rows) as pipe:
            reqs = {}
            for i in order:
                r = requests[i]
                stops = () if r["stop"] == NT else (r["stop"],)
                ban = None if tuple(r["mask"]) == (NT, NT) else r["mask"]
                if vocab <= 2 and set(range(vocab)) <= set(r["mask"]):
                    # No candidate left: the argmax would answer NO_TOKEN, a placeholder that
                    # must never become an input id, so the pipeline refuses the request.
                    with pytest.raises(ValueError, match="no candidate"):
                        pipe.submit(r["prompt"], max_new_tokens=max_new, ban=ban)
                    expected[i] = None
                    continue
                reqs[i] = pipe.submit(r["prompt"], max_new_tokens=max_new, stop_ids=stops, ban=ban)
            pipe.run()
            assert pipe.stats.reserved_in_flight == 0
        assert model.pool.free_count == blocks, "KV blocks leaked"
    assert [reqs[i].tokens if i in reqs else None for i in range(rows)] == expected
    assert_counts_back(before)
