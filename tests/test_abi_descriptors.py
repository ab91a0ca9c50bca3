"""Descriptor evolution and NULL descriptors at the C ABI, through every way in: the capsule's
table (C extensions) and ``cimport metrale_feed._core`` (Cython).

A consumer written against the first round's .pxd sets only the first round's fields of a stack
``mf_argmax_args``: the fields added since hold whatever the stack held. Every descriptor now
starts with ``struct_size`` (set by its ``mf_*_args_init``), and a size the layer does not know
is refused before anything is read or queued. Crashes run in child interpreters."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import metrale_feed as mf
from helpers.child import run_python
from test_cimport import _compiler, build_extension

INVALID_VALUE = 1
ROWS, VOCAB = 3, 8

# Written against the first round's .pxd: no struct_size, no init, only its fields.
FIRST_ROUND = textwrap.dedent(
    """
    # cython: language_level=3
    from libc.stdint cimport uint32_t, uint64_t, uintptr_t
    from libc.string cimport memset
    from metrale_feed._cfeed cimport mf_argmax_args, mf_status, MF_DTYPE_F32
    from metrale_feed._core cimport argmax_to_feed_c, error_message


    cdef tuple call(mf_argmax_args *a, uintptr_t logits, uint32_t rows, uint32_t vocab,
                    uintptr_t cells, uintptr_t dst, uint64_t event):
        cdef mf_status st
        a.logits = <const void *>logits
        a.dtype = MF_DTYPE_F32
        a.rows = rows
        a.vocab = vocab
        a.row_stride = vocab
        a.masks = NULL
        a.cells = <uint32_t *>cells
        a.cell_capacity = rows
        a.host_dst = <void *>dst
        a.event = event
        with nogil:
            st = argmax_to_feed_c(a, 0)
        return <int>st, error_message().decode("utf-8", "replace") if st else ""


    def zeroed_but(uintptr_t logits, uint32_t rows, uint32_t vocab, uintptr_t cells, uintptr_t dst,
                   uint64_t event, uintptr_t stale):
        # The stack held zeros, except a live device pointer an earlier frame left where the
        # newer header has `logprobs`.
        cdef mf_argmax_args a
        memset(&a, 0, sizeof(a))
        a.logprobs = <float *>stale
        return call(&a, logits, rows, vocab, cells, dst, event)


    def garbage(uintptr_t logits, uint32_t rows, uint32_t vocab, uintptr_t cells, uintptr_t dst,
                uint64_t event):
        cdef mf_argmax_args a
        memset(&a, 0xA5, sizeof(a))
        return call(&a, logits, rows, vocab, cells, dst, event)


    def null_descriptor():
        cdef mf_status st
        with nogil:
            st = argmax_to_feed_c(NULL, 0)
        return <int>st, error_message().decode("utf-8", "replace")
    """
)

# Written against this .pxd: the init, then the same fields.
CURRENT = textwrap.dedent(
    """
    # cython: language_level=3
    from libc.stdint cimport uint32_t, uint64_t, uintptr_t
    from metrale_feed._cfeed cimport mf_argmax_args, mf_argmax_args_init, mf_status, MF_DTYPE_F32
    from metrale_feed._core cimport argmax_to_feed_c, error_message


    def initialised(uintptr_t logits, uint32_t rows, uint32_t vocab, uintptr_t cells, uintptr_t dst,
                    uint64_t event, int size_change):
        cdef mf_argmax_args a
        cdef mf_status st
        mf_argmax_args_init(&a)
        a.struct_size += size_change
        a.logits = <const void *>logits
        a.dtype = MF_DTYPE_F32
        a.rows = rows
        a.vocab = vocab
        a.row_stride = vocab
        a.cells = <uint32_t *>cells
        a.cell_capacity = rows
        a.host_dst = <void *>dst
        a.event = event
        with nogil:
            st = argmax_to_feed_c(&a, 0)
        return <int>st, error_message().decode("utf-8", "replace") if st else ""


    def zero_filled_size():
        cdef mf_argmax_args a
        mf_argmax_args_init(&a)
        return a.struct_size, sizeof(a), a.flags, <uintptr_t>a.logprobs, <uintptr_t>a.params
    """
)


def cythonize(tmp_path, name, source):
    pytest.importorskip("Cython", reason="Cython is needed to build a cimport user")
    if _compiler() is None:
        pytest.skip("no working C compiler")
    pyx = tmp_path / f"{name}.pyx"
    pyx.write_text(source)
    c_file = tmp_path / f"{name}.c"
    result = subprocess.run([sys.executable, "-m", "cython", "-3", "-I", mf.get_include(), str(pyx),
                             "-o", str(c_file)], capture_output=True, text=True)
    assert result.returncode == 0, f"cython failed:\n{result.stdout}\n{result.stderr}"
    return build_extension(tmp_path, name, c_file)


@pytest.fixture(scope="module")
def first_round(tmp_path_factory):
    return cythonize(tmp_path_factory.mktemp("first_round"), "mf_first_round_user", FIRST_ROUND)


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return cythonize(tmp_path_factory.mktemp("current"), "mf_current_user", CURRENT)


class Call:
    """Float32 logits on the device, cells with a sentinel, a pinned destination, an event."""

    def __init__(self, dev):
        rng = np.random.default_rng(11)
        self.values = rng.standard_normal((ROWS, VOCAB)).astype(np.float32)
        self.logits = dev.upload(self.values)
        self.cells = dev.upload(np.full(ROWS, 0xABABABAB, np.uint32))
        self.dst = mf.PinnedBuffer(ROWS * 4)
        memoryview(self.dst)[:] = b"\xcd" * (ROWS * 4)
        self.event = mf.Event()
        self.args = (self.logits.ptr, ROWS, VOCAB, self.cells.ptr, self.dst.ptr, self.event.handle)

    def ids(self):
        return list(np.frombuffer(bytes(memoryview(self.dst)), np.uint32))

    def untouched(self):
        mf.stream_synchronize(0)
        assert bytes(memoryview(self.dst)) == b"\xcd" * (ROWS * 4), "a refused call copied into dst"
        out = bytearray(ROWS * 4)
        mf.copy_d2h_async(self.cells, out)
        mf.stream_synchronize(0)
        assert bytes(out) == b"\xab" * (ROWS * 4), "a refused call wrote the cells"
        assert self.event.query() is True

    def close(self):
        mf.stream_synchronize(0)
        for obj in (self.event, self.dst, self.cells, self.logits):
            obj.close()


@pytest.fixture
def call(host, no_leaks, dev):
    c = Call(dev)
    yield c
    c.close()


def test_first_round_descriptor_with_stale_pointer_is_refused(first_round, call, dev):
    stale = dev.upload(np.full(16, 7.0, np.float32))  # a live buffer of someone else's
    try:
        status, message = first_round.zeroed_but(*call.args, stale.ptr)
        assert status == INVALID_VALUE and "struct_size" in message and "init" in message, message
        call.untouched()
        out = bytearray(64)
        mf.copy_d2h_async(stale, out)
        mf.stream_synchronize(0)
        assert bytes(out) == np.full(16, 7.0, np.float32).tobytes(), "the stale pointer was written"
    finally:
        stale.close()


def test_first_round_descriptor_with_garbage_is_refused(first_round, call):
    status, message = first_round.garbage(*call.args)
    assert status == INVALID_VALUE and "struct_size" in message, message
    call.untouched()


def test_initialised_descriptor_works(current, call):
    assert current.zero_filled_size()[0] == current.zero_filled_size()[1]
    assert current.zero_filled_size()[2:] == (0, 0, 0)
    status, message = current.initialised(*call.args, 0)
    assert status == 0, message
    call.event.synchronize()
    assert call.ids() == list(call.values.argmax(axis=1))


# The sizes of older versions, read with the fields after them 0: before the pick's grammar was
# appended, 8 bytes less; before a verify's drafts (select_drafts, select_k and the padding after
# them), 16 more; before the pick's penalties, 8 more.
@pytest.mark.parametrize("change", [-8, -24, -32], ids=["before-grammar", "before-verify-drafts", "before-penalties"])
def test_an_older_size_is_read_as_without_the_later_fields(current, call, change):
    status, message = current.initialised(*call.args, change)
    assert status == 0, message
    call.event.synchronize()
    assert call.ids() == list(call.values.argmax(axis=1))


@pytest.mark.parametrize("change", [8, -16, 1], ids=["newer-header", "older-unknown", "odd"])
def test_unknown_sizes_are_refused(current, call, change):
    status, message = current.initialised(*call.args, change)
    assert status == INVALID_VALUE and "struct_size" in message, message
    call.untouched()


# ---- NULL descriptors: a child each, since they crashed ----

def _in_child(module, body):
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(module.__file__)!r})
import metrale_feed as mf
{textwrap.dedent(body)}
print("OK")
"""
    result = run_python(code, timeout=60, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.describe()


def test_null_descriptor_through_cimport(first_round):
    _in_child(first_round, f"""
        import {first_round.__name__} as user
        status, message = user.null_descriptor()
        assert status == {INVALID_VALUE} and "null" in message, (status, message)
    """)


# Through the capsule's table, with ctypes: every slot that takes a pointer, given NULL.
CAPSULE = """
import ctypes
import metrale_feed as mf
get = ctypes.pythonapi.PyCapsule_GetPointer
get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
table = get(mf._C_API, b"metrale_feed._C_API")
SLOTS = ["last_error", "last_cuda_error", "active_backend", "event_create", "event_record",
         "event_query", "event_synchronize", "event_destroy", "stream_create", "stream_synchronize",
         "stream_destroy", "host_alloc", "host_free", "device_alloc", "device_free", "copy_d2h_async",
         "copy_h2d_async", "argmax_to_feed_v1", "resolve_feed", "nvtx_push", "nvtx_pop",
         "argmax_to_feed", "stream_wait_event", "copy_d2d_async", "memset_async", "launch_host_func",
         "combine_partials", "graph_begin", "graph_end", "graph_launch", "graph_destroy"]
P, U64, U32, SZ, I = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int

def slot(name, *argtypes):
    address = ctypes.c_void_p.from_address(table + 8 + 8 * SLOTS.index(name)).value
    return ctypes.CFUNCTYPE(I, *argtypes)(address)

last_error = ctypes.CFUNCTYPE(ctypes.c_char_p)(ctypes.c_void_p.from_address(table + 8).value)

def refused(status):
    assert status == 1, (status, last_error())
    assert b"null" in last_error(), last_error()
"""

NULL_CALLS = {
    "argmax_to_feed": "refused(slot('argmax_to_feed', P, U64)(None, 0))",
    "argmax_to_feed_v1": "refused(slot('argmax_to_feed_v1', P, U64)(None, 0))",
    "combine_partials": "refused(slot('combine_partials', P, U64)(None, 0))",
    "event_create": "refused(slot('event_create', U32, P)(0, None))",
    "event_query": "e = mf.Event(); refused(slot('event_query', U64, P)(e.handle, None)); e.close()",
    "stream_create": "refused(slot('stream_create', U32, P)(0, None))",
    "host_alloc": "refused(slot('host_alloc', SZ, U32, P)(64, 0, None))",
    "device_alloc": "refused(slot('device_alloc', SZ, P)(64, None))",
}


@pytest.mark.parametrize("name", sorted(NULL_CALLS))
def test_null_pointer_through_the_capsule(name):
    code = CAPSULE + NULL_CALLS[name] + """
assert not any(mf.live_objects().values()), mf.live_objects()  # a refused create made nothing
print("OK")
"""
    result = run_python(code, timeout=60, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.describe()
