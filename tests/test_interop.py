"""Interop with the tensor ecosystem (docs/interop.md): DLPack exports and typed views, tensors
as device memory, dtype spellings, foreign streams and host functions in stream order. numpy is
the tensor library here; tests/test_interop_torch.py repeats the essentials with torch."""

from __future__ import annotations

import ctypes
import gc
import threading
import time
import weakref

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import NO_TOKEN, DeviceBuffer, Event, FeedError, PinnedBuffer, Stream, _core
from metrale_feed.testing.oracle import reference_argmax
from test_regressions import run_child

host_only = pytest.mark.skipif(mf.backend() == "cuda", reason="CPU arrays are device memory only on the host backend")

_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def device_bytes(buf, n=None):
    out = bytearray(buf.nbytes if n is None else n)
    mf.copy_d2h_async(buf, out)
    mf.stream_synchronize()
    return bytes(out)


# ---- exports ----

@host_only
def test_buffers_export_uint8_on_cpu_zero_copy():
    dev, pin = DeviceBuffer(32), PinnedBuffer(16)
    assert dev.__dlpack_device__() == (1, 0) and pin.__dlpack_device__() == (1, 0)
    a = np.from_dlpack(dev)
    assert a.dtype == np.uint8 and a.shape == (32,) and a.ctypes.data == dev.ptr
    a[:] = np.arange(32, dtype=np.uint8)
    assert device_bytes(dev) == bytes(range(32))  # the package's copy sees numpy's writes
    p = np.from_dlpack(pin)
    p[3] = 9
    assert bytes(pin)[3] == 9


@host_only
def test_view_is_typed_shaped_and_keeps_its_buffer_alive():
    def live():
        gc.collect()
        return mf.live_objects()["device_bytes"]

    base = live()
    dev = DeviceBuffer(4 * 6)
    view = dev.view("f32", (2, 3))
    assert view.base is dev and view.dtype == "float32" and view.shape == (2, 3) and view.nbytes == 24
    del dev
    assert live() == base + 24  # the view holds it
    arr = np.from_dlpack(view)
    assert arr.dtype == np.float32 and arr.shape == (2, 3) and arr.ctypes.data == view.ptr
    arr[:] = [[1, 2, 3], [4, 5, 6]]
    keep = view.base
    assert np.frombuffer(device_bytes(keep), np.float32).tolist() == [1, 2, 3, 4, 5, 6]
    del view, keep
    assert live() == base + 24  # and so does the array made from it
    del arr
    assert live() == base


def test_view_refuses_what_does_not_fit():
    dev = DeviceBuffer(16)
    with pytest.raises(ValueError, match="needs 20 bytes"):
        dev.view("float32", 5)
    with pytest.raises(ValueError, match="multiple"):
        dev.view("float32", 1, offset=2)
    with pytest.raises(ValueError, match="unknown dtype"):
        dev.view("complex64")
    with pytest.raises(ValueError, match="byte order"):
        dev.view(np.dtype(">f4"))
    assert dev.view("f16").shape == (8,)
    assert dev.view("u32", offset=8).shape == (2,)
    assert dev.view("bf16", (2, 2)).dtype == "bfloat16"


def test_close_is_refused_while_a_tensor_is_exported():
    dev = DeviceBuffer(8)
    cap = dev.__dlpack__()
    with pytest.raises(BufferError, match="exported"):
        dev.close()
    del cap  # an unconsumed capsule frees its tensor
    gc.collect()
    dev.close()
    assert dev.closed


def test_capsule_names_follow_the_requested_version():
    dev = DeviceBuffer(8)
    assert _capsule_valid(dev.__dlpack__(), b"dltensor")
    assert _capsule_valid(dev.__dlpack__(max_version=(0, 8)), b"dltensor")
    assert _capsule_valid(dev.__dlpack__(max_version=(1, 1)), b"dltensor_versioned")
    assert _capsule_valid(dev.__dlpack__(stream=-1), b"dltensor")  # never waits
    with pytest.raises(BufferError, match="copy"):
        dev.__dlpack__(copy=True)
    with pytest.raises(BufferError, match="device"):
        dev.__dlpack__(dl_device=(2, 0) if mf.backend() != "cuda" else (1, 0))
    gc.collect()
    dev.close()


@host_only
def test_no_cuda_array_interface_on_host():
    assert not hasattr(DeviceBuffer(4), "__cuda_array_interface__")
    assert not hasattr(DeviceBuffer(4).view("f32"), "__cuda_array_interface__")


# ---- imports: argmax ----

def _logits(rows, vocab, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.choice(np.array([-1.0, 0.0, 0.5, 1.0, 2.0], np.float32), size=(rows, vocab)).astype(dtype)


@host_only
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_argmax_takes_a_cpu_tensor_with_its_own_shape_and_dtype(dtype):
    logits = _logits(5, 37, dtype)
    masks = [(1, NO_TOKEN), (NO_TOKEN, NO_TOKEN), (0, 36), (4, 5), (NO_TOKEN, 2)]
    cells = np.full(8, 7, np.uint32)
    dst = PinnedBuffer(20)
    assert mf.argmax_to_feed(logits, masks, cells, dst, None) == 5
    mf.stream_synchronize()
    expect = reference_argmax(logits, np.array(masks, np.uint32))
    assert np.frombuffer(dst, np.uint32).tolist() == list(expect)
    assert cells[:5].tolist() == list(expect) and cells[5:].tolist() == [7, 7, 7]


@host_only
def test_argmax_follows_a_row_stride_and_takes_int32_cells():
    wide = _logits(4, 50, seed=3)
    logits = wide[:, :20]  # row stride 50, vocab 20
    cells = np.zeros(4, np.int32)
    mf.argmax_to_feed(logits, None, cells, None, None)
    mf.stream_synchronize()
    assert cells.view(np.uint32).tolist() == list(reference_argmax(np.ascontiguousarray(logits), None))
    one = _logits(1, 9, seed=4)[0]  # 1-D: one row
    c = np.zeros(1, np.uint32)
    mf.argmax_to_feed(one, None, c, None, None)
    mf.stream_synchronize()
    assert c[0] == int(np.argmax(one))


@host_only
def test_argmax_given_arguments_must_agree_with_the_tensor():
    logits, cells = _logits(2, 8), np.zeros(2, np.uint32)
    mf.argmax_to_feed(logits, None, cells, None, None, rows=2, vocab=8, dtype="f32", row_stride=8)
    for bad in (dict(rows=3), dict(vocab=7), dict(dtype="bf16"), dict(row_stride=9)):
        with pytest.raises(ValueError, match="disagrees"):
            mf.argmax_to_feed(logits, None, cells, None, None, **bad)
    with pytest.raises(ValueError, match="masks hold 3 rows"):
        mf.argmax_to_feed(logits, [(0, 1)] * 3, cells, None, None)


@host_only
def test_argmax_refuses_bad_tensors_before_queueing():
    cells = np.full(4, 9, np.uint32)
    event = Event()
    cases = [
        (TypeError, "float32, float16 or bfloat16", dict(logits=np.zeros((2, 8), np.float64))),
        (TypeError, "float32, float16 or bfloat16", dict(logits=np.zeros((2, 8), np.int32))),
        (ValueError, "unit stride", dict(logits=np.zeros((2, 16), np.float32)[:, ::2])),
        (ValueError, "overlap", dict(logits=np.lib.stride_tricks.as_strided(
            np.zeros(16, np.float32), (2, 8), (4, 4)))),
        (ValueError, "1-D .* or 2-D", dict(logits=np.zeros((2, 1, 8), np.float32))),
        (ValueError, "capacity", dict(cells=np.zeros(1, np.uint32))),
        (TypeError, "uint32 ids", dict(cells=np.zeros(4, np.float32))),
        (ValueError, "contiguous", dict(cells=np.zeros(8, np.uint32)[::2])),
        (TypeError, "DLPack", dict(logits=np.array([[None] * 8] * 2, dtype=object))),
        (ValueError, "page-locked", dict(logits=PinnedBuffer(64).view("f32", (2, 8)))),
        (FeedError, "stream", dict(stream=0x1234560)),
    ]
    readonly = np.zeros(4, np.uint32)
    readonly.flags.writeable = False
    cases.append(((ValueError, TypeError), "read-only|readonly", dict(cells=readonly)))
    for exc, match, over in cases:
        args = dict(logits=np.ones((2, 8), np.float32), cells=cells, stream=0)
        args.update(over)
        with pytest.raises(exc, match=match):
            mf.argmax_to_feed(args["logits"], None, args["cells"], None, event, args["stream"])
        assert event.query()  # nothing recorded: nothing was queued
    mf.stream_synchronize()
    assert cells.tolist() == [9] * 4


def _logits_readers():
    """Every launcher that takes a logits tensor, as (name, call(logits)): each reads it through
    the one check (the extension's tensor_rows)."""
    from metrale_feed.penalties import PenaltyState

    state = PenaltyState(2, capacity=8)
    return state, [
        ("argmax_to_feed", lambda t: mf.argmax_to_feed(t, None, np.zeros(2, np.uint32), None, None)),
        ("top_logprobs", lambda t: _core.top_logprobs(t, _core.DeviceBuffer(2 * 8 * 2), n=2)),
        ("penalties_apply", lambda t: state.apply(t, [0, mf.NO_TOKEN])),
    ]


@host_only
@pytest.mark.parametrize("reader", ["argmax_to_feed", "top_logprobs", "penalties_apply"])
def test_every_launcher_refuses_the_same_bad_logits_tensors(reader):
    state, readers = _logits_readers()
    call = dict(readers)[reader]
    readonly = np.zeros((2, 8), np.float32)
    readonly.flags.writeable = False
    cases = [
        (TypeError, "float32, float16 or bfloat16", np.zeros((2, 8), np.float64)),
        (ValueError, "unit stride", np.zeros((2, 16), np.float32)[:, ::2]),
        (ValueError, "overlap or run backwards",
         np.lib.stride_tricks.as_strided(np.zeros(16, np.float32), (2, 8), (4, 4))),
        (ValueError, "2-D", np.zeros((2, 1, 8), np.float32)),
    ]
    if reader == "penalties_apply":  # the one launcher that writes the logits
        cases.append((ValueError, "read-only", readonly))
    with state:
        for exc, match, bad in cases:
            with pytest.raises(exc, match=match):
                call(bad)
        call(np.zeros((2, 8), np.float32))  # the same call with a good tensor is queued
        mf.stream_synchronize()


@host_only
def test_a_foreign_tensor_is_kept_alive_until_its_work_has_run():
    mf.configure_host(lag_us=30_000)
    try:
        logits = np.zeros((2, 8), np.float32)
        logits[:, 5] = 1
        alive = weakref.ref(logits)
        cells = np.zeros(2, np.uint32)
        s = Stream()
        mf.argmax_to_feed(logits, None, cells, None, None, s)
        del logits
        gc.collect()
        assert alive() is not None  # the queued argmax still reads it
        s.synchronize()
        mf.live_objects()  # releases what passed
        gc.collect()
        assert alive() is None
        assert cells.tolist() == [5, 5]
    finally:
        mf.configure_host()


class _DLPackOnly:
    """The same array offered through DLPack alone (no buffer protocol): the reference reading."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def _outcome(call, *arrays):
    """The call's ids, or its error as the numpy array's would read (the type's name aside)."""
    try:
        rows = call()
        mf.stream_synchronize()
        return "queued", rows, [a.array.tolist() if isinstance(a, _DLPackOnly) else a.tolist()
                                for a in arrays]
    except Exception as error:
        return type(error).__name__, str(error).replace(_DLPackOnly.__name__, "ndarray")


def _odd_arrays(kind):
    """Logits or cells arrays of every kind a caller may hand over, made afresh at each call."""
    base = np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)
    like = base[:, :8] if kind == "logits" else np.arange(2)
    readonly = np.array(like, np.float32 if kind == "logits" else np.uint32)
    readonly.flags.writeable = False
    arrays = [np.array(like, dtype=t) for t in (
        np.float32, np.float16, np.float64, np.int32, np.uint32, np.int64, np.uint16, np.int8,
        np.bool_, np.complex64, ">f4", ">u4", "<f4", "=u4", [("a", np.uint32)])]
    arrays += [
        readonly, base[:, ::2], base.T, base[:1], base.reshape(2, 1, 16), base.reshape(-1)[:8],
        np.zeros((0, 8), np.float32), np.zeros((1,) * 9, np.float32), np.zeros(0, np.uint32),
        np.zeros(2, np.uint32)[::-1], np.zeros(4, np.uint32)[::2], np.zeros((2, 1), np.uint32),
        np.zeros((2, 1), np.int32).T, np.array([[None] * 8] * 2, dtype=object),
        # strides that are not whole elements: DLPack cannot say them
        np.lib.stride_tricks.as_strided(np.zeros(32, np.float32), (2, 8), (34, 4)),
        np.lib.stride_tricks.as_strided(np.zeros(8, np.uint32), (2,), (6,)),
    ]
    try:
        import ml_dtypes

        arrays.append(np.array(like, ml_dtypes.bfloat16))
    except ImportError:
        pass
    return arrays


@host_only
@pytest.mark.parametrize("kind", ["logits", "cells"])
def test_a_numpy_array_is_read_as_its_dlpack_export_says(kind):
    """numpy arrays are read through the buffer protocol on the host backend (about half the
    cost of their DLPack export): every array must come out as the DLPack reading of the same
    array does, the same ids written or the same error, raised before anything is queued."""
    logits = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)
    seen = set()
    for array, same in zip(_odd_arrays(kind), _odd_arrays(kind)):
        if kind == "logits":
            outcomes = [_outcome(lambda: mf.argmax_to_feed(given, None, cells, None, None), cells)
                        for given, cells in ((array, np.zeros(16, np.uint32)),
                                             (_DLPackOnly(same), np.zeros(16, np.uint32)))]
        else:
            outcomes = [_outcome(lambda: mf.argmax_to_feed(logits, None, given, None, None), mine)
                        for given, mine in ((array, array), (_DLPackOnly(same), same))]
        assert outcomes[0] == outcomes[1], (kind, array.dtype, array.shape, array.strides)
        seen.add(outcomes[0][0])
    assert {"queued", "TypeError", "ValueError"} <= seen  # both ways, every kind of answer


@host_only
def test_int_pointers_to_foreign_memory_are_still_refused_on_host():
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(FeedError, match="not a live device allocation"):
        mf.argmax_to_feed(logits.ctypes.data, None, np.zeros(2, np.uint32), None, None, rows=2, vocab=8,
                          dtype="f32")
    # and a borrow lasts one call: the same pointer is refused again after a tensor call
    mf.argmax_to_feed(logits, None, np.zeros(2, np.uint32), None, None)
    with pytest.raises(FeedError, match="not a live device allocation"):
        mf.argmax_to_feed(logits.ctypes.data, None, np.zeros(2, np.uint32), None, None, rows=2, vocab=8,
                          dtype="f32")
    mf.stream_synchronize()


# ---- imports: copies and resolve ----

@host_only
def test_copies_and_resolve_take_cpu_tensors():
    dev = np.zeros(16, np.uint8)
    mf.copy_h2d_async(dev, bytes(range(16)))
    back = bytearray(16)
    mf.copy_d2h_async(dev, back)
    other = np.zeros(4, np.uint32)
    mf.copy_d2d_async(other, dev, 16)
    mf.stream_synchronize()
    assert bytes(back) == bytes(range(16)) and other.tobytes() == bytes(range(16))
    cells = np.array([10, 11, 12], np.uint32)
    out = np.zeros(3, np.uint32)
    mf.resolve_feed([mf.FeedSource.feed(2), mf.FeedSource.host(5), mf.FeedSource.feed(0)], cells, out,
                    prev_rows=3)
    mf.stream_synchronize()
    assert out.tolist() == [12, 5, 10]
    with pytest.raises(ValueError, match="run past the end"):
        mf.copy_h2d_async(np.zeros(8, np.uint8), bytes(9))
    with pytest.raises(ValueError, match="run past the end"):
        mf.resolve_feed([mf.FeedSource.host(1)] * 4, cells, np.zeros(3, np.uint32), prev_rows=3)
    ro = np.zeros(16, np.uint8)
    ro.flags.writeable = False
    with pytest.raises((ValueError, TypeError), match="read-only|readonly"):
        mf.copy_h2d_async(ro, bytes(16))


# ---- bad buffers (object arrays, byte order, counts past uint32) ----

def test_object_arrays_are_refused_as_copy_destinations():
    dev = DeviceBuffer(16)
    dst = np.empty(2, dtype=object)
    with pytest.raises(TypeError, match="Python objects"):
        mf.copy_d2h_async(dev, dst)
    with pytest.raises(TypeError, match="Python objects"):
        mf.copy_h2d_async(dev, np.array([None, None], dtype=object))
    assert dst.tolist() == [None, None]


def test_non_native_byte_order_is_refused():
    with pytest.raises(ValueError, match="byte order"):
        mf.dtype(np.dtype(">f4"))
    with pytest.raises(ValueError, match="byte order"):
        mf.dtype(">f2")
    logits, cells = DeviceBuffer(32), DeviceBuffer(8)
    with pytest.raises(ValueError, match="byte order"):
        mf.argmax_to_feed(logits, None, cells, None, None, rows=1, vocab=8, dtype=np.dtype(">f4"))
    with pytest.raises(TypeError, match="uint32"):
        mf.resolve_feed(np.zeros(2, ">u4"), cells, DeviceBuffer(8), prev_rows=2)


def test_counts_past_uint32_are_refused_not_truncated():
    try:
        huge = np.zeros(2**32 + 2, np.uint32)  # zero pages: no memory is touched
    except MemoryError:
        pytest.skip("no address space for 2**32 + 2 ids")
    huge[1] = mf.FeedSource.host(7)
    huge[0] = mf.FeedSource.host(3)
    out = DeviceBuffer(16)
    with pytest.raises(ValueError, match="4096"):
        mf.resolve_feed(huge, DeviceBuffer(8), out, prev_rows=2)
    with pytest.raises(ValueError, match="4096"):
        mf.argmax_to_feed(DeviceBuffer(64), huge, DeviceBuffer(8), None, None, vocab=8, dtype="f32")
    del huge


# ---- dtypes ----

class _TorchLike:  # a torch dtype is recognised by its name
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


@pytest.mark.parametrize("spelling,name", [
    ("float32", "float32"), ("f32", "float32"), ("f4", "float32"), (np.float32, "float32"),
    (np.dtype("<f4"), "float32"), ("float16", "float16"), ("f16", "float16"), ("half", "float16"),
    (np.float16, "float16"), ("bfloat16", "bfloat16"), ("bf16", "bfloat16"),
    ("torch.bfloat16", "bfloat16"), ("uint32", "uint32"), (np.dtype("uint8"), "uint8"),
])
def test_dtype_spellings(spelling, name):
    assert mf.dtype(spelling).name == name


def test_torch_dtypes_by_name_without_torch():
    class dtype:  # str() is all torch.dtype offers: "torch.bfloat16"
        def __init__(self, text):
            self.text = text

        def __str__(self):
            return self.text

    assert mf.dtype(dtype("torch.bfloat16")).name == "bfloat16"
    assert mf.dtype(dtype("torch.float16")).name == "float16"
    with pytest.raises(ValueError, match="unknown dtype"):
        mf.dtype(dtype("torch.complex64"))


def test_one_dtype_table_gives_the_facts():
    from metrale_feed import dtypes

    assert [dtypes.TABLE[n].code for n in ("float32", "float16", "bfloat16")] == [0, 1, 2]
    assert dtypes.TABLE["bfloat16"].dl_code == 4 and dtypes.TABLE["bfloat16"].itemsize == 2
    assert dtypes.BY_DLPACK[(2, 32)].name == "float32"


def test_runtime_mixin_takes_dtype_spellings():
    from metrale_feed import RuntimeFeedMixin

    m = RuntimeFeedMixin()
    m.init_device_feed(vocab=8, logits_dtype="bf16", max_rows=2)
    assert m.feed_logits_dtype == "bfloat16"
    m.init_device_feed(vocab=8, logits_dtype=np.float16, max_rows=2)
    assert m.feed_logits_dtype == "float16"
    with pytest.raises(ValueError):
        m.init_device_feed(vocab=8, logits_dtype="int8", max_rows=2)
    m.close_device_feed()


# ---- streams ----

def test_stream_protocol_and_from_handle():
    s = Stream()
    assert s.__cuda_stream__() == (0, s.handle)

    class Foreign:
        def __cuda_stream__(self):
            return (0, s.handle)

    w = Stream.from_handle(Foreign())
    assert w == s
    w.close()  # non-owning: the stream lives on
    got = []
    mf.launch_host_func(Foreign(), got.append, 1)
    s.synchronize()
    assert got == [1]
    s.close()


def test_a_wrapped_stream_keeps_its_foreign_owner():
    # A torch or CuPy stream object destroys its handle when it is collected: the Stream made
    # from it keeps it alive, and lets it go when closed or dropped (never an int: nothing owns it).
    import gc
    import weakref

    class Foreign:
        def __init__(self, stream):
            self.stream = stream  # the owner of the handle, as a torch stream owns its cudaStream_t

        def __cuda_stream__(self):
            return (0, self.stream.handle)

    for close in (True, False):
        owner = Foreign(Stream())
        alive = weakref.ref(owner)
        wrapped = Stream.wrap(owner)
        del owner
        gc.collect()
        assert alive() is not None
        wrapped.synchronize()  # the handle is still the owner's live stream
        if close:
            wrapped.close()
        else:
            del wrapped
        gc.collect()
        assert alive() is None
    s = Stream()
    assert Stream.wrap(s.handle) == s
    s.close()


@host_only
def test_a_handle_the_host_backend_never_made_is_a_feed_error():
    with pytest.raises(FeedError, match="unknown or destroyed stream"):
        Stream.from_handle(0xDEAD0)

    class Foreign:
        def __cuda_stream__(self):
            return (0, 0xDEAD0)

    with pytest.raises(FeedError, match="unknown or destroyed stream"):
        mf.launch_host_func(Foreign(), print)
    with pytest.raises(FeedError, match="unknown or destroyed stream"):
        mf.copy_h2d_async(DeviceBuffer(4), bytes(4), Foreign())


# ---- host functions ----

def test_host_functions_run_in_stream_order():
    s = Stream()
    dev = DeviceBuffer(4)
    mf.configure_host(lag_us=2000)
    try:
        seen = []
        mf.copy_h2d_async(dev, b"\x01\x02\x03\x04", s)
        mf.launch_host_func(s, lambda: seen.append(device_bytes_now(dev)))
        mf.copy_h2d_async(dev, b"\x09\x09\x09\x09", s)
        order = []
        for i in range(20):
            mf.launch_host_func(s, order.append, i)
        assert seen == [] or len(order) < 20  # queued, not run at the call
        s.synchronize()
        assert seen == [b"\x01\x02\x03\x04"] and order == list(range(20))
    finally:
        mf.configure_host()
        s.close()


def device_bytes_now(dev):
    # Inside a host function on the host backend, device memory is host memory: read it directly.
    return bytes(np.from_dlpack(dev)) if mf.backend() != "cuda" else None


def test_work_queued_after_a_host_function_waits_for_it():
    s = Stream()
    e = Event()
    release = threading.Event()
    mf.launch_host_func(s, release.wait, 5)
    e.record(s)
    time.sleep(0.05)
    assert not e.query() and not s.query()
    release.set()
    e.synchronize()
    s.close()


def test_a_raising_host_function_is_reported_once_with_its_cause():
    s = Stream()
    before, after = Event(), Event()
    before.record(s)

    def boom(x):
        raise KeyError(x)

    mf.launch_host_func(s, boom, "k")
    after.record(s)
    with pytest.raises(FeedError, match="KeyError") as info:
        after.synchronize()
    assert isinstance(info.value.__cause__, KeyError)
    after.synchronize()  # reported once
    s.synchronize()
    before.synchronize()

    mf.launch_host_func(s, boom, 1)
    with pytest.raises(FeedError, match="KeyError"):
        s.synchronize()
    mf.launch_host_func(s, boom, 2)
    s_done = False
    for _ in range(1000):
        try:
            s_done = s.query()
        except FeedError as error:
            assert isinstance(error.__cause__, KeyError)
            break
        time.sleep(0.001)
    else:
        pytest.fail(f"the failure was never reported (idle={s_done})")
    mf.launch_host_func(s, boom, 3)
    e = mf.event_create()
    mf.event_record(e, s)
    with pytest.raises(FeedError):
        mf.event_synchronize(e)
    mf.destroy_event(e)
    # a SystemExit inside fn is a failure too, never an exit of the worker or the process
    mf.launch_host_func(s, lambda: (_ for _ in ()).throw(SystemExit(3)))
    with pytest.raises(FeedError, match="SystemExit"):
        s.synchronize()
    s.close()


def test_launch_host_func_refuses_before_queueing():
    s = Stream()
    with pytest.raises(TypeError, match="callable"):
        mf.launch_host_func(s, 5)
    s.close()
    with pytest.raises(FeedError, match="closed"):
        mf.launch_host_func(s, print)


def test_host_function_arguments_are_kept_alive():
    s = Stream()
    release = threading.Event()

    class Payload:
        pass

    p = Payload()
    alive = weakref.ref(p)
    got = []
    mf.launch_host_func(s, release.wait, 5)
    mf.launch_host_func(s, got.append, p)
    del p
    gc.collect()
    assert alive() is not None
    release.set()
    s.synchronize()
    assert got[0] is alive()
    got.clear()
    gc.collect()
    assert alive() is None
    s.close()


def test_exit_with_host_functions_queued_is_clean():
    # The interpreter exits while a host function is still queued behind a lagged op: no crash,
    # no hang (the queued function is dropped once Python is finalising).
    out = run_child("""
        import metrale_feed as mf
        mf.configure_host(lag_us=200_000)
        s = mf.Stream()
        for i in range(3):
            mf.launch_host_func(s, print, "ran", i)
        print("exiting")
    """, timeout=30)
    assert "exiting" in out


def test_a_buffer_freed_while_a_host_function_waits_for_the_gil_does_not_deadlock():
    # A free waits for every stream; the host function queued there needs the GIL, so the free
    # must not hold it. A child with a timeout: a deadlock fails instead of hanging the suite.
    out = run_child("""
        import gc, time
        import metrale_feed as mf
        s = mf.Stream()
        mf.configure_host(lag_us=50_000)
        got = []
        mf.launch_host_func(s, got.append, 1)
        b = mf.DeviceBuffer(64)
        del b  # __dealloc__ frees while the host function is queued
        gc.collect()
        p = mf.PinnedBuffer(64)
        del p
        s.synchronize()
        print("done", got)
    """, timeout=30)
    assert "done [1]" in out


def test_an_argmax_event_reports_a_host_function_queued_before_it():
    s = Stream()
    done = Event()

    def boom():
        raise ZeroDivisionError("forward failed")

    dev = DeviceBuffer(4 * 8)
    mf.launch_host_func(s, boom)
    mf.argmax_to_feed(dev, None, DeviceBuffer(4), None, done, s, rows=1, vocab=8, dtype="f32")
    with pytest.raises(FeedError, match="forward failed") as info:
        while not mf.event_query(done.handle):
            time.sleep(0.001)
        done.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    s.close()


def test_exit_while_a_host_function_runs_is_clean():
    # A host function is running (holding the GIL in slices) when the interpreter exits: the exit
    # waits for it (up to 2 s), so it never takes the GIL from a finalising interpreter.
    out = run_child("""
        import time
        import metrale_feed as mf
        s = mf.Stream()
        def slow():
            end = time.monotonic() + 0.3
            while time.monotonic() < end:
                time.sleep(0.001)
            print("finished", flush=True)
        mf.launch_host_func(s, slow)
        time.sleep(0.05)
        print("exiting", flush=True)
    """, timeout=30)
    assert "exiting" in out and "finished" in out


@host_only
def test_zero_byte_copies_with_empty_tensors():
    empty = np.zeros(0, np.uint8)
    mf.copy_h2d_async(empty, b"")
    mf.copy_d2h_async(empty, bytearray())
    mf.stream_synchronize()


@host_only
def test_numpy_asarray_of_a_device_buffer_is_its_memory():
    dev = DeviceBuffer(8)
    a = np.asarray(dev)
    assert a.dtype == np.uint8 and a.shape == (8,) and a.ctypes.data == dev.ptr  # not a 0-d object
    a[:] = 3
    assert device_bytes(dev) == b"\x03" * 8
    with pytest.raises(BufferError):
        dev.close()
    v = np.asarray(dev.view("u32", 2))
    assert v.tolist() == [0x03030303] * 2
    c = np.asarray(dev, copy=True)
    c[:] = 0
    assert device_bytes(dev) == b"\x03" * 8
    del a, v
    gc.collect()
    dev.close()


@host_only
def test_a_backend_switch_after_tensor_calls_is_not_refused(host):
    """The keep-alive events of a numpy array's passed work are the module's own: a switch right
    after such calls gives them back instead of refusing as if the caller held an event."""
    logits, cells = np.ones((2, 8), np.float32), np.zeros(2, np.uint32)
    for _ in range(3):
        mf.argmax_to_feed(logits, None, cells, None, None)
    mf.stream_synchronize(0)
    before = mf.backend()
    other = "simt" if before == "host" else "host"
    mf.set_backend(other)
    try:
        assert mf.backend() == other
    finally:
        mf.set_backend(before)


# Float values exact in bfloat16 and their bits (the high half of the float32's): an independent
# reference for the conversions below.
BF16_VALUES = [1.0, -2.5, 0.15625, 0.0, -0.0, float("inf"), 2.0 ** 127, -(2.0 ** -126)]
BF16_BITS = (np.array(BF16_VALUES, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def test_numpy_asarray_of_a_bfloat16_view_is_ml_dtypes_bfloat16(backend):
    """numpy has no bfloat16 and its DLPack import refuses one ("Unsupported dtype in DLTensor"):
    the views hand numpy an ml_dtypes.bfloat16 array of the same memory instead."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    n = len(BF16_VALUES)
    pin = PinnedBuffer(2 * n + 2)
    memoryview(pin)[2:] = BF16_BITS.tobytes()
    a = np.asarray(pin.view("bfloat16", (2, n // 2), offset=2))
    assert a.dtype == ml_dtypes.bfloat16 and a.shape == (2, n // 2)
    assert a.astype(np.float32).reshape(-1).view(np.uint32).tolist() == (
        np.array(BF16_VALUES, np.float32).view(np.uint32).tolist())
    assert np.asarray(pin.view("bf16"), dtype=np.float32)[1:].tolist() == BF16_VALUES
    dev = DeviceBuffer(2 * n)
    mf.copy_h2d_async(dev, BF16_BITS)
    mf.stream_synchronize()
    if mf.backend() == "cuda":
        with pytest.raises(TypeError, match="no implicit numpy conversion"):
            np.asarray(dev.view("bfloat16"))
    else:  # the device buffer's own memory, kept open while the array lives
        d = np.asarray(dev.view("bfloat16"))
        assert d.dtype == ml_dtypes.bfloat16 and d.ctypes.data == dev.ptr
        d[0] = ml_dtypes.bfloat16(-4.0)
        assert device_bytes(dev, 2) == (np.array([-4.0], np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        with pytest.raises(BufferError):
            dev.close()
        del d
    del a
    gc.collect()
    dev.close()
    pin.close()


def test_numpy_asarray_of_a_bfloat16_view_without_ml_dtypes_says_to_view_uint16():
    out = run_child("""
        import sys
        sys.modules["ml_dtypes"] = None  # import ml_dtypes then raises ImportError
        import numpy as np
        import metrale_feed as mf
        for buf in (mf.PinnedBuffer(8), mf.DeviceBuffer(8)):
            try:
                np.asarray(buf.view("bfloat16"))
            except TypeError as error:
                print("TypeError:", error)
            np.asarray(buf.view("uint16"))  # what the message says to do
            buf.close()  # no export was left behind
    """)
    lines = out.strip().splitlines()
    assert len(lines) == 2 and all("TypeError" in l and "uint16" in l and "ml_dtypes" in l for l in lines), out
