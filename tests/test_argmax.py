"""The feed kernels: ``argmax_to_feed`` against the numpy oracle (the rule of docs/encodings.md,
stated independently of the C code), its validation before launch, and ``resolve_feed``."""

from __future__ import annotations

import array
import gc
import os
import re
import shutil
import subprocess
import threading
import weakref

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metrale_feed as mf
from metrale_feed import NO_TOKEN, DeviceBuffer, Event, FeedError, FeedSource, PinnedBuffer, RowMask, Stream
from metrale_feed.testing.oracle import reference_argmax

DTYPES = ["float32", "float16", "bfloat16"]
HOST_BIT = 0x80000000


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def bits_dtype(name):
    return np.dtype(np.uint32 if name == "float32" else np.uint16)


def from_bits(bits, name):
    return np.asarray(bits, dtype=bits_dtype(name)).view(np_dtype(name))


def pos_inf(name):
    return from_bits([{"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}[name]], name)[0]


def run_argmax(dev, logits, masks, *, vocab=None, dtype=None, dst_kind="pinned", rows="auto",
               stream=0, check_cells=True, masks_arg=None):
    """Upload ``logits`` (rows, row_stride), launch argmax_to_feed over its first ``vocab``
    columns, wait for the event, and return the ids read from dst (checked equal to the cells)."""
    n_rows, stride = logits.shape
    vocab = stride if vocab is None else vocab
    mask_value = masks if masks_arg is None else masks_arg
    if rows == "auto":
        rows = n_rows if mask_value is None else None
    dtype = logits.dtype.name if dtype is None else dtype
    d = dev.upload(logits)
    cells = DeviceBuffer(n_rows * 4)
    dst_holder = None
    if dst_kind == "pinned":
        dst = dst_holder = PinnedBuffer(n_rows * 4)
    elif dst_kind == "int":
        dst = mf.alloc_host_pinned(n_rows * 4)
    elif dst_kind == "numpy":
        dst = np.full(n_rows, 0xABABABAB, np.uint32)
    elif dst_kind == "bytearray":
        dst = bytearray(n_rows * 4)
    elif dst_kind is None:
        dst = None
    else:
        raise AssertionError(dst_kind)
    try:
        with Event() as e:
            mf.argmax_to_feed(d, mask_value, cells, dst, e, stream,
                              rows=rows, vocab=vocab, dtype=dtype, row_stride=stride)
            e.synchronize()
            assert e.query()
            if dst_kind == "pinned":
                got = np.frombuffer(dst, np.uint32).copy()
            elif dst_kind == "int":
                got = np.array(mf.read_pinned_u32(dst, n_rows), np.uint32)
            elif dst_kind == "numpy":
                got = dst.copy()
            elif dst_kind == "bytearray":
                got = np.frombuffer(bytes(dst), np.uint32).copy()
            else:
                got = None
        cell_ids = dev.download(cells, np.uint32, n_rows)
        if got is None:
            got = cell_ids
        elif check_cells:
            assert np.array_equal(got, cell_ids), "dst differs from the feed cells"
        return got
    finally:
        if dst_kind == "int":
            mf.free_host_pinned(dst, n_rows * 4)
        if dst_holder is not None:
            dst_holder.close()
        d.close()
        cells.close()


def check(dev, logits, masks=None, vocab=None, **kw):
    """Launch and compare with the oracle over the first ``vocab`` columns."""
    vocab = logits.shape[1] if vocab is None else vocab
    expected = reference_argmax(logits[:, :vocab], masks)
    got = run_argmax(dev, logits, masks, vocab=vocab, **kw)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, (
        f"{bad.size} rows differ, first row {bad[0]}: got {got[bad[0]]}, expected {expected[bad[0]]}"
        if bad.size else "")
    return got


def tie_heavy(rng, rows, vocab, name, specials=True):
    """Values from a small set (many ties), with NaN, infinities and signed zeros mixed in."""
    pool = [-2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 1.5, 2.0]
    if specials:
        pool += [np.inf, -np.inf, np.nan]
    values = rng.choice(np.array(pool, np.float64), size=(rows, vocab))
    return values.astype(np.float32).astype(np_dtype(name))


def random_masks(rng, rows, vocab):
    """Per row: NO_TOKEN, 0, vocab - 1, a random id, or both equal."""
    choices = np.array([NO_TOKEN, 0, vocab - 1, NO_TOKEN], np.int64)
    masks = np.empty((rows, 2), np.uint32)
    for r in range(rows):
        kind = rng.integers(0, 6)
        if kind < 4:
            a, b = choices[rng.integers(0, 4)], rng.integers(0, vocab)
        elif kind == 4:
            a = b = rng.integers(0, vocab)
        else:
            a, b = NO_TOKEN, NO_TOKEN
        masks[r] = (a, b) if rng.integers(0, 2) else (b, a)
    return masks


# ---------------------------------------------------------------------------------------------
# The oracle itself, on tiny hand-checked rows
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", DTYPES)
def test_oracle_hand_checked(name):
    nan, inf = np.nan, np.inf
    rows = [
        ([nan, 1.0, nan], None, 1),
        ([nan, -inf], None, 1),  # NaN ranks below -inf
        ([-inf, -inf, -inf], None, 0),
        ([nan, nan, nan], None, 0),
        ([nan, nan, nan], (0, NO_TOKEN), 1),
        ([-0.0, 0.0], None, 0),
        ([0.0, -0.0], None, 0),
        ([1.0, inf, inf], None, 1),
        ([3.0, 2.0, 3.0], (0, NO_TOKEN), 2),
        ([3.0, 2.0, 3.0], (0, 2), 1),
        ([5.0, 4.0], (1, 0), NO_TOKEN),
        ([5.0], (0, 0), NO_TOKEN),
        ([5.0], (NO_TOKEN, NO_TOKEN), 0),
        ([5.0, 4.0], (1, 1), 0),
    ]
    for values, mask, want in rows:
        logits = np.array([values], np.float32).astype(np_dtype(name))
        masks = None if mask is None else [mask]
        assert reference_argmax(logits, masks)[0] == want, (values, mask)
    with pytest.raises(ValueError):
        reference_argmax(np.zeros((1, 3), np.float32), [(3, NO_TOKEN)])


# ---------------------------------------------------------------------------------------------
# Exact agreement with the oracle
# ---------------------------------------------------------------------------------------------

VOCABS = [(1, 9), (2, 9), (3, 9), (17, 33), (1000, 33), (32000, 5), (151936, 3), (262144, 2)]


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("vocab,rows", VOCABS, ids=[str(v) for v, _ in VOCABS])
def test_matches_oracle(host, dev, name, vocab, rows):
    rng = np.random.default_rng(vocab * 7 + DTYPES.index(name))
    if vocab >= 32000:
        # A continuous-valued row with a planted maximum (and a masked bigger one), plus
        # tie-heavy rows: the large vocabs cross every chunk boundary of the kernels.
        logits = rng.standard_normal((rows, vocab)).astype(np.float32).astype(np_dtype(name))
        masks = random_masks(rng, rows, vocab)
        for r in range(rows):
            spot = rng.integers(0, vocab)
            logits[r, spot] = 8.0
            if masks[r, 0] != NO_TOKEN:
                logits[r, masks[r, 0]] = 9.0  # the masked id holds the greatest value
        logits[-1] = tie_heavy(rng, 1, vocab, name)[0]
    else:
        logits = tie_heavy(rng, rows, vocab, name)
        masks = random_masks(rng, rows, vocab)
    check(dev, logits, masks)
    check(dev, logits, None)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("vocab,extra", [(1, 3), (17, 3), (1000, 5), (4099, 1), (32000, 3)])
def test_row_stride_beyond_vocab(host, dev, name, vocab, extra):
    """Padding past vocab holds +inf: a kernel that reads it answers an id >= vocab."""
    rng = np.random.default_rng(vocab + extra)
    rows = 5
    logits = np.full((rows, vocab + extra), pos_inf(name), np_dtype(name))
    logits[:, :vocab] = tie_heavy(rng, rows, vocab, name, specials=False)
    masks = random_masks(rng, rows, vocab)
    got = check(dev, logits, masks, vocab=vocab)
    assert (got < vocab).all() or vocab <= 2


def _special_values(dev, name):
    f = np_dtype(name)
    nan, inf = np.nan, np.inf
    cases = [
        [nan, 1.0, nan, 0.5],
        [nan, -inf, nan, nan],
        [-inf, -inf, -inf, -inf],
        [nan, nan, nan, nan],
        [-0.0, 0.0, -0.0, 0.0],
        [0.0, -0.0, -1.0, -0.0],
        [-1.0, -0.0, 0.0, -2.0],
        [1.0, inf, inf, 1.0],
        [-inf, nan, -inf, nan],
        [nan, nan, -inf, nan],
        [2.0, 2.0, 2.0, 2.0],
    ]
    logits = np.array(cases, np.float32).astype(f)
    want = [1, 1, 0, 0, 0, 0, 1, 1, 0, 2, 0]  # hand-checked
    assert list(reference_argmax(logits)) == want
    assert list(check(dev, logits)) == want
    # The same rows with the first id masked.
    masks = [(0, NO_TOKEN)] * len(cases)
    assert list(check(dev, logits, masks)) == [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 1]


@pytest.mark.parametrize("name", DTYPES)
def test_special_values(host, dev, name):
    _special_values(dev, name)


def _nan_payloads_and_extremes(dev, name):
    """Every NaN encoding (quiet, signalling, negative) ranks below -inf; subnormals and the
    largest finite value order correctly."""
    if name == "float32":
        nans = [0x7FC00000, 0x7F800001, 0xFFC00000, 0xFFFFFFFF, 0x7FFFFFFF]
        neg_inf, pos_inf_, max_fin, neg_sub, pos_sub, neg_zero = (
            0xFF800000, 0x7F800000, 0x7F7FFFFF, 0x80000001, 0x00000001, 0x80000000)
    elif name == "float16":
        nans = [0x7E00, 0x7C01, 0xFE00, 0xFFFF, 0x7FFF]
        neg_inf, pos_inf_, max_fin, neg_sub, pos_sub, neg_zero = (0xFC00, 0x7C00, 0x7BFF, 0x8001, 0x0001, 0x8000)
    else:
        nans = [0x7FC0, 0x7F81, 0xFFC0, 0xFFFF, 0x7FFF]
        neg_inf, pos_inf_, max_fin, neg_sub, pos_sub, neg_zero = (0xFF80, 0x7F80, 0x7F7F, 0x8001, 0x0001, 0x8000)
    rows = [
        nans + [neg_inf],                       # 5
        [neg_inf] + nans,                       # 0
        nans + [neg_sub],                       # 5
        [neg_sub, neg_zero] + nans[:4],         # 1: -0.0 > the negative subnormal
        [neg_zero, pos_sub] + nans[:4],         # 1
        [max_fin, nans[1], pos_inf_, nans[2], max_fin, pos_inf_],  # 2
        nans + [nans[0]],                       # 0: all NaN
    ]
    logits = from_bits(rows, name)
    want = [5, 0, 5, 1, 1, 2, 0]
    assert list(reference_argmax(logits)) == want
    assert list(check(dev, logits)) == want


@pytest.mark.parametrize("name", DTYPES)
def test_nan_payloads_and_extremes(host, dev, name):
    _nan_payloads_and_extremes(dev, name)


def _all_masked_and_tiny_vocab(dev, name):
    f = np_dtype(name)
    one = np.array([[3.0]] * 4, np.float32).astype(f)
    got = check(dev, one, [(0, NO_TOKEN), (NO_TOKEN, 0), (0, 0), (NO_TOKEN, NO_TOKEN)])
    assert list(got) == [NO_TOKEN, NO_TOKEN, NO_TOKEN, 0]
    two = np.array([[1.0, 2.0]] * 6, np.float32).astype(f)
    got = check(dev, two, [(0, 1), (1, 0), (1, 1), (0, 0), (1, NO_TOKEN), (NO_TOKEN, NO_TOKEN)])
    assert list(got) == [NO_TOKEN, NO_TOKEN, 0, 1, 0, 1]
    three = np.array([[np.nan, np.nan, np.nan]] * 3, np.float32).astype(f)
    assert list(check(dev, three, [(0, 1), (2, 0), (1, 2)])) == [2, 1, 0]


@pytest.mark.parametrize("name", DTYPES)
def test_all_masked_and_tiny_vocab(host, dev, name):
    _all_masked_and_tiny_vocab(dev, name)


@pytest.mark.parametrize("name", DTYPES)
def test_masks_that_ban_the_winner(host, dev, name):
    rng = np.random.default_rng(5)
    rows, vocab = 40, 200
    logits = tie_heavy(rng, rows, vocab, name, specials=False)
    unmasked = reference_argmax(logits)
    second = reference_argmax(logits, [(int(w), NO_TOKEN) for w in unmasked])
    masks = np.stack([unmasked, second], axis=1).astype(np.uint32)
    got = check(dev, logits, masks)
    assert not np.any(got == unmasked) and not np.any(got == second)


def _max_near_span_boundaries(dev, name):
    """The greatest value planted at, just before and just after each mask id, at the row ends,
    and at SIMD-width boundaries; a masked id holding the greatest value must be skipped."""
    rng = np.random.default_rng(17)
    f = np_dtype(name)
    rows_l, masks_l = [], []
    for vocab_case in range(120):
        vocab = 300
        m0, m1 = sorted(rng.choice(vocab, size=2, replace=False))
        row = rng.choice(np.array([0.0, 0.25, 0.5], np.float32), size=vocab)
        spots = [m0 - 1, m0, m0 + 1, m1 - 1, m1, m1 + 1, 0, vocab - 1, 7, 8, 15, 16, 31, 32,
                 m0 + 8, m0 + 16, m1 - 8, m1 - 16]
        k = rng.integers(1, 4)
        for spot in rng.choice(spots, size=k):
            if 0 <= spot < vocab:
                row[spot] = 1.0
        row[m0] = 2.0 if rng.integers(0, 2) else row[m0]  # the masked id may hold the max
        rows_l.append(row)
        masks_l.append((m0, m1) if rng.integers(0, 2) else (m1, m0))
    logits = np.array(rows_l, np.float32).astype(f)
    check(dev, logits, masks_l)


@pytest.mark.parametrize("name", DTYPES)
def test_max_near_span_boundaries(host, dev, name):
    _max_near_span_boundaries(dev, name)


@pytest.mark.parametrize("name", DTYPES)
def test_max_rows(host, dev, name):
    rng = np.random.default_rng(4096)
    logits = tie_heavy(rng, 4096, 17, name)
    check(dev, logits, random_masks(rng, 4096, 17))


@pytest.mark.parametrize("threads", [1, 2, 0])
def test_kernel_thread_count_does_not_change_results(host, dev, threads):
    set_threads = getattr(mf, "host_kernel_threads", None)
    if set_threads is None:
        pytest.skip("this build has no host_kernel_threads")
    set_threads(threads)
    rng = np.random.default_rng(99)
    logits = tie_heavy(rng, 1000, 40, "bfloat16")
    check(dev, logits, random_masks(rng, 1000, 40))


def test_one_row(host, dev):
    logits = np.array([[0.0, 3.0, 1.0, 3.0]], np.float32)
    assert list(check(dev, logits)) == [1]
    assert list(check(dev, logits, [(1, NO_TOKEN)])) == [3]


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_rows_match_oracle(host, dev, data):
    name = data.draw(st.sampled_from(DTYPES))
    vocab = data.draw(st.integers(1, 80))
    extra = data.draw(st.integers(0, 5))
    rows = data.draw(st.integers(1, 6))
    pool = [-1.0, -0.0, 0.0, 1.0, 2.0, np.inf, -np.inf, np.nan]
    values = data.draw(st.lists(st.lists(st.sampled_from(pool), min_size=vocab + extra,
                                         max_size=vocab + extra), min_size=rows, max_size=rows))
    mask_id = st.one_of(st.just(NO_TOKEN), st.integers(0, vocab - 1))
    masks = data.draw(st.lists(st.tuples(mask_id, mask_id), min_size=rows, max_size=rows))
    logits = np.array(values, np.float32).astype(np_dtype(name))
    check(dev, logits, masks, vocab=vocab)


# ---------------------------------------------------------------------------------------------
# Argument forms
# ---------------------------------------------------------------------------------------------

def _forms_case():
    rng = np.random.default_rng(23)
    logits = tie_heavy(rng, 6, 50, "float32")
    masks = random_masks(rng, 6, 50)
    return logits, masks, reference_argmax(logits, masks)


@pytest.mark.parametrize("form", ["pairs", "rowmask", "numpy2d", "numpy1d", "array", "tuple"])
def test_mask_forms(host, dev, no_leaks, form):
    logits, masks, expected = _forms_case()
    as_list = [(int(a), int(b)) for a, b in masks]
    arg = {
        "pairs": as_list,
        "rowmask": [RowMask(a, b) for a, b in as_list],
        "numpy2d": masks,
        "numpy1d": masks.reshape(-1).copy(),
        "array": array.array("I", masks.reshape(-1).tolist()),
        "tuple": tuple(as_list),
    }[form]
    got = run_argmax(dev, logits, None, masks_arg=arg)
    assert np.array_equal(got, expected)


def test_masks_none_needs_rows(host, dev, no_leaks):
    logits, _, _ = _forms_case()
    got = run_argmax(dev, logits, None, rows=6)
    assert np.array_equal(got, reference_argmax(logits))
    assert RowMask() == (NO_TOKEN, NO_TOKEN)
    with pytest.raises(ValueError):
        run_argmax(dev, logits, None, rows=None)


@pytest.mark.parametrize("dst_kind", ["pinned", "int", "numpy", "bytearray", None])
def test_dst_forms(host, dev, no_leaks, dst_kind):
    logits, masks, expected = _forms_case()
    got = run_argmax(dev, logits, masks, dst_kind=dst_kind)
    assert np.array_equal(got, expected)


def test_event_forms_and_stream(host, dev, no_leaks):
    logits, masks, expected = _forms_case()
    d = dev.upload(logits)
    cells = DeviceBuffer(6 * 4)
    out = PinnedBuffer(6 * 4)
    host.configure_host(lag_us=20_000)
    with Stream() as s:
        h = mf.event_create()
        mf.argmax_to_feed(d, masks, cells, out, h, s, vocab=50, dtype="float32")
        assert not mf.event_query(h)
        mf.event_synchronize(h)
        assert np.array_equal(np.frombuffer(out, np.uint32), expected)
        mf.destroy_event(h)
        np.frombuffer(out, np.uint32)[:] = 0
        mf.argmax_to_feed(d, masks, cells, out, None, s, vocab=50, dtype=np.dtype("float32"))
        s.synchronize()
        assert np.array_equal(np.frombuffer(out, np.uint32), expected)
    for b in (out, cells, d):
        b.close()


def test_masks_reusable_at_once_under_lag(host, dev, no_leaks):
    rng = np.random.default_rng(31)
    rows, vocab = 32, 100
    logits = tie_heavy(rng, rows, vocab, "float32", specials=False)
    masks = random_masks(rng, rows, vocab)
    expected = reference_argmax(logits, masks)
    d = dev.upload(logits)
    cells = DeviceBuffer(rows * 4)
    out = PinnedBuffer(rows * 4)
    host.configure_host(lag_us=100_000)
    with Stream() as s, Event() as e:
        mf.argmax_to_feed(d, masks, cells, out, e, s, vocab=vocab, dtype="float32")
        assert not e.query()
        masks[:, 0] = expected  # ban every original winner: a late read of masks changes results
        masks[:, 1] = NO_TOKEN
        e.synchronize()
        got = np.frombuffer(out, np.uint32).copy()
    assert not np.array_equal(reference_argmax(logits, masks), expected)
    assert np.array_equal(got, expected)
    for b in (out, cells, d):
        b.close()


def test_foreign_dst_kept_alive_until_copy_passed(host, dev, no_leaks):
    logits, masks, expected = _forms_case()
    d = dev.upload(logits)
    cells = DeviceBuffer(6 * 4)
    dst = np.zeros(6, np.uint32)
    ref = weakref.ref(dst)
    gate = threading.Event()
    with Stream() as s:
        # The stream's worker waits at the gate, so the copy stays queued however slowly this
        # thread runs (a lag in time let a loaded machine run the copy before the check).
        mf.launch_host_func(s, gate.wait, 60)
        mf.argmax_to_feed(d, masks, cells, dst, None, s, vocab=50, dtype="float32")
        del dst
        gc.collect()
        alive = ref() is not None
        gate.set()
        assert alive, "the destination was let go while its copy was queued"
        kept = ref()
        s.synchronize()  # the copy has passed: the package lets the buffer go here
        assert np.array_equal(kept, expected)
        del kept
        gc.collect()
        assert ref() is None, "the destination is still held after its copy was synchronized"
    cells.close()
    d.close()


def test_launches_in_flight_keep_their_own_results(host, dev, no_leaks):
    """Three launches queued back to back on one stream into three destinations, under lag: each
    destination holds its own launch's ids (the copy follows its own argmax in stream order)."""
    rng = np.random.default_rng(37)
    rows, vocab = 16, 64
    d = DeviceBuffer(3 * rows * vocab * 4)
    cells = DeviceBuffer(rows * 4)
    batches = [tie_heavy(rng, rows, vocab, "float32") for _ in range(3)]
    for k, b in enumerate(batches):
        dev.write(d, b, offset=k * b.nbytes)
    outs = [PinnedBuffer(rows * 4) for _ in range(3)]
    events = [Event() for _ in range(3)]
    host.configure_host(lag_us=5_000)
    with Stream() as s:
        for k in range(3):
            mf.argmax_to_feed(d.ptr + k * batches[0].nbytes, None, cells, outs[k], events[k], s,
                              rows=rows, vocab=vocab, dtype="float32")
        events[2].synchronize()
        for k in range(3):
            assert events[k].query()
            assert np.array_equal(np.frombuffer(outs[k], np.uint32), reference_argmax(batches[k]))
    for x in outs + events + [cells, d]:
        x.close()


# ---------------------------------------------------------------------------------------------
# Validation before launch: nothing is queued, dst and cells stay untouched
# ---------------------------------------------------------------------------------------------

class Setup:
    """A valid launch under lag, to be broken one argument at a time."""

    def __init__(self, dev, rows=4, vocab=17, name="float32"):
        rng = np.random.default_rng(41)
        self.dev = dev
        self.rows, self.vocab, self.name = rows, vocab, name
        self.logits = tie_heavy(rng, rows, vocab, name, specials=False)
        self.d = dev.upload(self.logits)
        self.cells = dev.upload(np.full(rows, 0xCDCDCDCD, np.uint32))
        self.dst = PinnedBuffer(rows * 4)
        np.frombuffer(self.dst, np.uint32)[:] = 0xABABABAB
        self.event = Event()
        self.stream = Stream()
        self.masks = [(NO_TOKEN, NO_TOKEN)] * rows
        self.kwargs = dict(vocab=vocab, dtype=name)

    def call(self, **over):
        args = dict(logits=self.d, masks=self.masks, cells=self.cells, dst=self.dst,
                    event=self.event, stream=self.stream)
        kwargs = dict(self.kwargs)
        for key, value in over.items():
            (args if key in args else kwargs)[key] = value
        return mf.argmax_to_feed(args["logits"], args["masks"], args["cells"], args["dst"],
                                 args["event"], args["stream"], **kwargs)

    def refused(self, exc, **over):
        before = mf.live_objects()
        with pytest.raises(exc):
            self.call(**over)
        assert self.event.query(), "the event was recorded by a refused launch"
        self.stream.synchronize()
        mf.stream_synchronize(0)
        assert (np.frombuffer(self.dst, np.uint32) == 0xABABABAB).all(), "dst was written"
        assert (self.dev.download(self.cells, np.uint32) == 0xCDCDCDCD).all(), "cells were written"
        assert mf.live_objects() == before

    def close(self):
        for x in (self.event, self.stream, self.dst, self.cells, self.d):
            x.close()


@pytest.fixture
def setup(host, dev, no_leaks):
    host.configure_host(lag_us=10_000)
    s = Setup(dev)
    yield s
    s.close()


def test_the_setup_is_valid(setup):
    """The positive control of the refusal tests: unbroken, the launch runs."""
    setup.call()
    setup.event.synchronize()
    assert np.array_equal(np.frombuffer(setup.dst, np.uint32), reference_argmax(setup.logits))


def test_refuses_mask_ids_at_or_beyond_vocab(setup):
    v = setup.vocab
    for bad in (v, v + 1, 0xFFFFFFFE, 0x80000000):
        setup.refused(ValueError, masks=[(NO_TOKEN, NO_TOKEN)] * 3 + [(0, bad)])
        setup.refused(ValueError, masks=np.array([[bad, NO_TOKEN]] * 4, np.uint32))


def test_refuses_rows_beyond_cell_capacity(setup, dev):
    small = DeviceBuffer(4 * (setup.rows - 1))
    setup.refused(ValueError, cells=small)
    setup.refused(ValueError, cells=setup.cells.ptr + 4)  # an interior pointer: rows - 1 cells
    small.close()


def test_refuses_bad_row_counts(setup):
    setup.refused(ValueError, masks=[])
    setup.refused(ValueError, masks=None, rows=0)
    setup.refused(ValueError, masks=None, rows=4097)
    setup.refused(ValueError, masks=None, rows=-1)
    setup.refused(ValueError, rows=3)  # 4 mask pairs for 3 rows
    setup.refused(ValueError, masks=[(NO_TOKEN, NO_TOKEN)] * 3, rows=4)
    setup.refused(ValueError, masks=None)  # rows unknown


def test_refuses_4097_rows_even_with_room(host, dev, no_leaks):
    d = DeviceBuffer(4097 * 4)
    cells = DeviceBuffer(4097 * 4)
    out = PinnedBuffer(4097 * 4)
    with pytest.raises(ValueError):
        mf.argmax_to_feed(d, [(NO_TOKEN, NO_TOKEN)] * 4097, cells, out, None, vocab=1, dtype="float32")
    mf.stream_synchronize(0)
    assert not np.frombuffer(out, np.uint8).any()
    for b in (out, cells, d):
        b.close()


def test_refuses_small_dst(setup):
    small = PinnedBuffer(setup.rows * 4 - 1)
    setup.refused(ValueError, dst=small)
    small.close()
    setup.refused(ValueError, dst=np.zeros(setup.rows - 1, np.uint32))
    setup.refused(ValueError, dst=bytearray(setup.rows * 4 - 4))
    setup.refused((TypeError, BufferError, ValueError), dst=bytes(setup.rows * 4))  # read-only


def test_refuses_small_int_pinned_dst_with_value_error(setup):
    p = mf.alloc_host_pinned(setup.rows * 4 - 4)
    try:
        setup.refused(ValueError, dst=p)
    finally:
        mf.free_host_pinned(p, setup.rows * 4 - 4)


def test_refuses_bad_int_dst(setup):
    p = mf.alloc_host_pinned(setup.rows * 4 - 4)
    mf.free_host_pinned(p, setup.rows * 4 - 4)
    setup.refused(FeedError, dst=p)  # freed
    foreign = np.zeros(16, np.uint32)
    setup.refused(FeedError, dst=foreign.ctypes.data)
    setup.refused((FeedError, ValueError), dst=setup.cells.ptr)  # device memory


def test_refuses_unknown_dtype(setup):
    for bad in ("int8", "float64", "bf16x", "", np.dtype("int32"), np.dtype(">f4"), 3):
        setup.refused(ValueError, dtype=bad)
    setup.refused(TypeError, dtype=None)  # only a tensor's own dtype may stand in


def test_accepts_dtype_spellings(setup):
    for good in ("float32", np.dtype("float32"), "f4"):
        setup.call(dtype=good)
        setup.event.synchronize()
        assert np.array_equal(np.frombuffer(setup.dst, np.uint32), reference_argmax(setup.logits))


def test_refuses_row_stride_below_vocab(setup):
    setup.refused(ValueError, row_stride=setup.vocab - 1)
    setup.refused(ValueError, row_stride=0)


def test_refuses_bad_vocab(setup):
    setup.refused(ValueError, vocab=0)
    setup.refused(ValueError, vocab=(1 << 24) + 1)


def test_refuses_misaligned_logits(setup):
    setup.refused(ValueError, logits=setup.d.ptr + 1)
    setup.refused(ValueError, logits=setup.d.ptr + 2)
    setup.refused(ValueError, cells=setup.cells.ptr + 1, rows=1, masks=[(NO_TOKEN, NO_TOKEN)])


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_misaligned_half_logits(host, dev, no_leaks, name):
    s = Setup(dev, name=name)
    try:
        s.refused(ValueError, logits=s.d.ptr + 1)
        # Two bytes in is aligned for a half type: one row fits past the offset.
        s.call(logits=s.d.ptr + 2, rows=1, masks=[(NO_TOKEN, NO_TOKEN)], vocab=s.vocab - 1)
        s.event.synchronize()
        want = reference_argmax(s.logits[:1, 1:])
        assert np.frombuffer(s.dst, np.uint32)[0] == want[0]
    finally:
        s.close()


def test_refuses_logits_past_the_end(host, dev, no_leaks):
    rows, vocab, stride = 3, 10, 13
    need = ((rows - 1) * stride + vocab) * 4
    rng = np.random.default_rng(43)
    flat = rng.standard_normal(need // 4).astype(np.float32)
    exact = dev.upload(flat)
    short = DeviceBuffer(need - 4)
    cells = DeviceBuffer(rows * 4)
    out = PinnedBuffer(rows * 4)
    with pytest.raises(ValueError):
        mf.argmax_to_feed(short, None, cells, out, None, rows=rows, vocab=vocab, dtype="float32",
                          row_stride=stride)
    with pytest.raises(ValueError):
        mf.argmax_to_feed(exact.ptr + 4, None, cells, out, None, rows=rows, vocab=vocab,
                          dtype="float32", row_stride=stride)
    with pytest.raises(ValueError):
        mf.argmax_to_feed(exact, None, cells, out, None, rows=rows, vocab=vocab, dtype="float32",
                          row_stride=stride + 1)
    mf.stream_synchronize(0)
    assert not np.frombuffer(out, np.uint8).any()
    # The exact fit runs, and reads only the rows' spans.
    mf.argmax_to_feed(exact, None, cells, out, None, rows=rows, vocab=vocab, dtype="float32",
                      row_stride=stride)
    mf.stream_synchronize(0)
    padded = np.concatenate([flat, np.zeros(stride - vocab, np.float32)]).reshape(rows, stride)
    assert np.array_equal(np.frombuffer(out, np.uint32), reference_argmax(padded[:, :vocab]))
    for b in (out, cells, short, exact):
        b.close()


def test_refuses_bad_memory_and_types(setup):
    freed = DeviceBuffer(setup.logits.nbytes)
    ptr = freed.ptr
    freed.close()
    setup.refused(FeedError, logits=freed)
    setup.refused(FeedError, logits=ptr)
    if mf.backend() == "cuda":  # host memory is not device memory (the host backend takes it: test_interop)
        setup.refused(ValueError, logits=setup.logits)
    setup.refused((ValueError, FeedError), logits=setup.dst.ptr)  # pinned, not device
    setup.refused(TypeError, logits="x")
    setup.refused(TypeError, cells=None)
    setup.refused(TypeError, masks=np.zeros((4, 2), np.int32))
    setup.refused(TypeError, masks=np.zeros((4, 2), np.float32))
    setup.refused(TypeError, masks=np.zeros((4, 2), np.uint64))
    setup.refused(TypeError, masks=5)
    setup.refused(ValueError, masks=[(0, 1, 2)] * 4)
    setup.refused(ValueError, masks=[(-1, 0)] * 4)
    setup.refused(ValueError, masks=[(2**32, 0)] * 4)
    setup.refused(TypeError, masks=[("a", 0)] * 4)
    setup.refused(TypeError, event="e")
    setup.refused(TypeError, event=1.5)
    setup.refused(TypeError, stream="s")


def test_refuses_dead_handles(setup):
    h = mf.event_create()
    mf.destroy_event(h)
    setup.refused(FeedError, event=h)
    closed = Event()
    closed.close()
    setup.refused(FeedError, event=closed)
    setup.refused(FeedError, stream=987654321)
    gone = Stream()
    gone.close()
    setup.refused(FeedError, stream=gone)


# ---------------------------------------------------------------------------------------------
# resolve_feed
# ---------------------------------------------------------------------------------------------

def expected_resolve(sources, cells):
    src = np.asarray(sources, np.uint64).astype(np.uint32)
    host = (src & HOST_BIT) != 0
    out = np.where(host, src & 0x7FFFFFFF, 0).astype(np.uint32)
    out[~host] = cells[src[~host]]
    return out


def test_feed_source_helpers():
    assert FeedSource.host(5) == HOST_BIT | 5
    assert FeedSource.host(0) == HOST_BIT
    assert FeedSource.host(2**31 - 1) == 0xFFFFFFFF
    assert FeedSource.feed(3) == 3
    assert FeedSource.host(5).is_host and not FeedSource.feed(5).is_host
    assert FeedSource.host(7).value == 7 and FeedSource.feed(9).value == 9
    assert isinstance(FeedSource.host(1), int)
    assert repr(FeedSource.host(4)) == "FeedSource.host(4)"
    assert repr(FeedSource.feed(2)) == "FeedSource.feed(2)"
    for bad in (-1, 2**31, 2**32):
        with pytest.raises(ValueError):
            FeedSource.host(bad)
        with pytest.raises(ValueError):
            FeedSource.feed(bad)


@pytest.mark.parametrize("form", ["feedsource", "ints", "numpy", "array"])
def test_resolve_mixed_sources(host, dev, no_leaks, form):
    rng = np.random.default_rng(53)
    prev_rows, n = 40, 64
    cells_np = rng.integers(0, 2**31, size=prev_rows, dtype=np.uint32)
    cells = dev.upload(cells_np)
    raw = []
    for i in range(n):
        if rng.integers(0, 2):
            raw.append(FeedSource.host(int(rng.integers(0, 2**31))))
        else:
            raw.append(FeedSource.feed(int(rng.integers(0, prev_rows))))
    raw[0], raw[1] = FeedSource.feed(prev_rows - 1), FeedSource.host(2**31 - 1)
    sources = {
        "feedsource": raw,
        "ints": [int(x) for x in raw],
        "numpy": np.array(raw, np.uint32),
        "array": array.array("I", [int(x) for x in raw]),
    }[form]
    out = DeviceBuffer(n * 4)
    host.configure_host(lag_us=5_000)
    with Stream() as s:
        mf.resolve_feed(sources, cells, out, s, prev_rows=prev_rows)
        if form == "numpy":
            sources[:] = 0  # the sources are read before the call returns
        s.synchronize()
    got = dev.download(out, np.uint32)
    assert np.array_equal(got, expected_resolve(raw, cells_np))
    out.close()
    cells.close()


def test_resolve_after_argmax_in_stream_order(host, dev, no_leaks):
    """Step N's argmax feeds step N+1's inputs on the device, with no host sync between."""
    rng = np.random.default_rng(59)
    rows, vocab = 8, 120
    logits = tie_heavy(rng, rows, vocab, "float32")
    d = dev.upload(logits)
    cells = DeviceBuffer(rows * 4)
    inputs = DeviceBuffer(rows * 4)
    host.configure_host(lag_us=10_000)
    sources = [FeedSource.feed(rows - 1 - i) if i % 3 else FeedSource.host(1000 + i) for i in range(rows)]
    with Stream() as s:
        mf.argmax_to_feed(d, None, cells, None, None, s, rows=rows, vocab=vocab, dtype="float32")
        mf.resolve_feed(sources, cells, inputs, s, prev_rows=rows)
        s.synchronize()
    ids = reference_argmax(logits)
    assert np.array_equal(dev.download(inputs, np.uint32), expected_resolve(sources, ids))
    for b in (inputs, cells, d):
        b.close()


def test_resolve_refuses_before_launch(host, dev, no_leaks):
    cells = dev.upload(np.arange(10, dtype=np.uint32))
    out = dev.upload(np.full(4, 0xEEEEEEEE, np.uint32))
    host.configure_host(lag_us=10_000)

    def refused(exc, sources, prev_rows=10, out_=None, cells_=None, stream=0):
        with pytest.raises(exc):
            mf.resolve_feed(sources, cells if cells_ is None else cells_, out if out_ is None else out_,
                            stream, prev_rows=prev_rows)
        mf.stream_synchronize(0)
        assert (dev.download(out, np.uint32) == 0xEEEEEEEE).all()

    refused(ValueError, [FeedSource.host(1), FeedSource.feed(10)])
    refused(ValueError, [FeedSource.feed(3)], prev_rows=3)
    refused(ValueError, [0], prev_rows=0)
    refused(ValueError, [])
    refused(ValueError, [FeedSource.host(1)] * 5)  # out holds 4
    refused(ValueError, [FeedSource.feed(0)], prev_rows=11)  # cells hold 10
    refused(ValueError, [FeedSource.host(1)], prev_rows=-1)
    refused(ValueError, [FeedSource.host(1)] * 4097, out_=DeviceBuffer(4097 * 4))
    refused(TypeError, np.zeros(2, np.int64))
    refused(TypeError, 7)
    refused(ValueError, [-1])
    refused(FeedError, [FeedSource.host(1)], stream=55555)
    freed = DeviceBuffer(16)
    freed.close()
    refused(FeedError, [FeedSource.host(1)], out_=freed)
    refused(ValueError, [FeedSource.host(1)], out_=out.ptr + 2)
    # prev_rows 0 with only host ids is fine.
    mf.resolve_feed([FeedSource.host(9)] * 4, cells, out, prev_rows=0)
    mf.stream_synchronize(0)
    assert list(dev.download(out, np.uint32)) == [9] * 4
    out.close()
    cells.close()


# ---------------------------------------------------------------------------------------------
# The cuda backend (skipped without a device) and the built kernels
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("vocab,rows", VOCABS + [(17, 4096)], ids=[str(v) for v, _ in VOCABS] + ["17x4096"])
def test_cuda_matches_oracle(dev, no_leaks, name, vocab, rows):
    rng = np.random.default_rng(vocab + rows)
    logits = tie_heavy(rng, rows, vocab + 3, name)
    masks = random_masks(rng, rows, vocab)
    check(dev, logits, masks, vocab=vocab)
    cont = rng.standard_normal((rows, vocab)).astype(np.float32).astype(np_dtype(name))
    check(dev, cont, masks)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DTYPES)
def test_cuda_special_values_and_boundaries(dev, no_leaks, name):
    _special_values(dev, name)
    _nan_payloads_and_extremes(dev, name)
    _all_masked_and_tiny_vocab(dev, name)
    _max_near_span_boundaries(dev, name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", DTYPES)
def test_cuda_matches_torch_argmax(no_leaks, name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
    rows, vocab = 64, 151936
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(rows, vocab, device="cuda", generator=g).to(tdt)
    masks = torch.randint(0, vocab, (rows, 2), device="cuda", generator=g)
    masks[::4, 1] = masks[::4, 0]
    masked = logits.clone()
    masked.scatter_(1, masks, float("-inf"))
    want = torch.argmax(masked, dim=1).to(torch.int64).cpu().numpy()
    cells = torch.zeros(rows, dtype=torch.int32, device="cuda")
    out = PinnedBuffer(rows * 4)
    mask_np = masks.cpu().numpy().astype(np.uint32)
    with Event() as e:
        mf.argmax_to_feed(logits, mask_np, cells, out, e, torch.cuda.current_stream(), vocab=vocab,
                          dtype=tdt)
        e.synchronize()
    got = np.frombuffer(out, np.uint32).astype(np.int64)
    assert np.array_equal(got, want)
    assert np.array_equal(cells.cpu().numpy().view(np.uint32), got.astype(np.uint32))
    ref = logits.float().cpu().numpy().astype(np.float32).astype(np_dtype(name))
    assert np.array_equal(got.astype(np.uint32), reference_argmax(ref, mask_np))
    out.close()


@pytest.mark.gpu
def test_cuda_resolve(dev, no_leaks):
    rng = np.random.default_rng(61)
    cells_np = rng.integers(0, 2**31, size=300, dtype=np.uint32)
    cells = dev.upload(cells_np)
    sources = [FeedSource.feed(int(rng.integers(0, 300))) if rng.integers(0, 2)
               else FeedSource.host(int(rng.integers(0, 2**31))) for _ in range(4096)]
    out = DeviceBuffer(4096 * 4)
    mf.resolve_feed(sources, cells, out, prev_rows=300)
    mf.stream_synchronize(0)
    assert np.array_equal(dev.download(out, np.uint32), expected_resolve(sources, cells_np))
    out.close()
    cells.close()


KERNEL_STEMS = ("mf_argmax", "mf_resolve", "mf_reference")


def _cuda_extension():
    info = mf.build_info()
    if not info["cuda"]:
        pytest.skip("this build has no CUDA backend (build_info()['cuda'] is False)")
    return info, mf._core.__file__


def _tool(name):
    found = shutil.which(name)
    if found is None:
        for var in ("CUDA_HOME", "CUDA_PATH"):
            home = os.environ.get(var)
            if home and os.access(os.path.join(home, "bin", name), os.X_OK):
                return os.path.join(home, "bin", name)
    return found


def test_built_kernel_names():
    """Each kernel of the C layer is compiled into the extension: nvcc's host stubs
    (__device_stub__<kernel>) are in its symbol table, or cuobjdump lists the device functions."""
    _, path = _cuda_extension()
    kernels = set()
    nm = _tool("nm")
    if nm:
        symbols = subprocess.run([nm, path], capture_output=True, text=True).stdout
        kernels = set(re.findall(r"__device_stub__\w+", symbols))
    if not kernels:
        cuobjdump = _tool("cuobjdump")
        if cuobjdump is None:
            pytest.skip("no nm symbols (stripped?) and no cuobjdump on PATH to read the fatbin")
        dump = subprocess.run([cuobjdump, "--dump-elf-symbols", path], capture_output=True, text=True)
        kernels = set(re.findall(r"\S*mf_\w+", dump.stdout))
    for stem in KERNEL_STEMS:
        assert any(re.search(rf"\d{stem}\w*", name) for name in kernels), (
            f"no kernel named {stem}* among {sorted(kernels)[:20]}")


def fatbin_entries(path):
    """(kind, sm) of every image in the file's fatbins, read from their headers: kind 1 is PTX,
    2 is SASS (an ELF cubin). The layout: a 16-byte header (magic 0xBA55ED50, version 1, header
    size 16, payload size), then entries of (kind u16, u16, header size u32, payload size u64, ...,
    sm u32 at byte 28)."""
    import struct

    data = open(path, "rb").read()
    magic, entries, at = struct.pack("<I", 0xBA55ED50), set(), 0
    while (start := data.find(magic, at)) >= 0:
        version, header, size = struct.unpack_from("<HHQ", data, start + 4)
        at = start + 4
        if version != 1 or header != 16:
            continue
        entry, end = start + header, start + header + size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            entries.add((kind, struct.unpack_from("<I", data, entry + 28)[0]))
            entry += entry_header + payload
        at = end
    return entries


def test_built_architectures():
    """Every architecture build_info() names has SASS (and PTX where it is not -real) in the
    extension's fatbin: listed by cuobjdump when the toolkit has it, else read from the fatbin
    headers directly; and nothing else is there."""
    info, path = _cuda_extension()
    cuobjdump = _tool("cuobjdump")
    if cuobjdump is not None:
        elf = subprocess.run([cuobjdump, "--list-elf", path], capture_output=True, text=True)
        ptx = subprocess.run([cuobjdump, "--list-ptx", path], capture_output=True, text=True)
        sass_archs = set(re.findall(r"sm_(\d+)", elf.stdout))
        ptx_archs = set(re.findall(r"(?:sm|compute)_(\d+)", ptx.stdout))
    else:
        entries = fatbin_entries(path)
        sass_archs = {str(sm) for kind, sm in entries if kind == 2}
        ptx_archs = {str(sm) for kind, sm in entries if kind == 1}
        named = {re.sub(r"\D", "", a) for a in info["architectures"]}
        assert sass_archs | ptx_archs == named, f"fatbin holds {entries}, build names {named}"
        elf = ptx = subprocess.CompletedProcess([], 0, stdout=str(sorted(entries)))
    assert info["architectures"], "a CUDA build must name its architectures"
    for arch in info["architectures"]:
        # "sm_90" (SASS), "compute_120" (PTX), or CMake's "90-real", "90-virtual", "90" (both).
        match = re.fullmatch(r"(sm_|compute_)?(\d+)(-real|-virtual)?", arch)
        assert match, f"unrecognised architecture {arch!r}"
        prefix, number, suffix = match.groups()
        wants_sass = prefix == "sm_" or (prefix is None and suffix != "-virtual")
        wants_ptx = prefix == "compute_" or (prefix is None and suffix != "-real")
        if wants_sass:
            assert number in sass_archs, f"no SASS for {arch}: {elf.stdout}"
        if wants_ptx:
            assert number in ptx_archs, f"no PTX for {arch}: {ptx.stdout}"
