"""The C API capsule (``metrale_feed/capi.h``): a plain CPython extension built at test time, with
no link to the C layer, reaches the package's backend, handles and allocations through
``mf_import_capi()``."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap

import pytest

import metrale_feed as mf
from test_cimport import build_extension

C_SOURCE = textwrap.dedent(
    r"""
    #define PY_SSIZE_T_CLEAN
    #include <Python.h>
    #include <metrale_feed/capi.h>
    #include <string.h>

    static const mf_capi *feed;

    static PyObject *table_info(PyObject *self, PyObject *args) {
        return Py_BuildValue("(IIn)", feed->version, feed->size, (Py_ssize_t)sizeof(mf_capi));
    }

    static PyObject *active_backend(PyObject *self, PyObject *args) {
        return PyLong_FromLong((long)feed->active_backend());
    }

    static PyObject *last_error(PyObject *self, PyObject *args) {
        return PyUnicode_DecodeUTF8(feed->last_error(), (Py_ssize_t)strlen(feed->last_error()),
                                    "replace");
    }

    /* (status, handle) */
    static PyObject *event_create(PyObject *self, PyObject *args) {
        mf_event_t event = 0;
        mf_status status = feed->event_create(0, &event);
        return Py_BuildValue("(iK)", (int)status, (unsigned long long)event);
    }

    static PyObject *event_record(PyObject *self, PyObject *args) {
        unsigned long long event, stream;
        if (!PyArg_ParseTuple(args, "KK", &event, &stream)) return NULL;
        return PyLong_FromLong((long)feed->event_record(event, stream));
    }

    /* (status, done) */
    static PyObject *event_query(PyObject *self, PyObject *args) {
        unsigned long long event;
        int done = -1;
        if (!PyArg_ParseTuple(args, "K", &event)) return NULL;
        mf_status status = feed->event_query(event, &done);
        return Py_BuildValue("(ii)", (int)status, done);
    }

    static PyObject *event_synchronize(PyObject *self, PyObject *args) {
        unsigned long long event;
        mf_status status;
        if (!PyArg_ParseTuple(args, "K", &event)) return NULL;
        Py_BEGIN_ALLOW_THREADS
        status = feed->event_synchronize(event);
        Py_END_ALLOW_THREADS
        return PyLong_FromLong((long)status);
    }

    static PyObject *event_destroy(PyObject *self, PyObject *args) {
        unsigned long long event;
        if (!PyArg_ParseTuple(args, "K", &event)) return NULL;
        return PyLong_FromLong((long)feed->event_destroy(event));
    }

    /* (status, ptr, all bytes zero): page-locked memory, then ids 0..n-1 written into it. */
    static PyObject *host_alloc(PyObject *self, PyObject *args) {
        Py_ssize_t nbytes;
        void *ptr = NULL;
        int zeroed = 1;
        if (!PyArg_ParseTuple(args, "n", &nbytes)) return NULL;
        mf_status status = feed->host_alloc((size_t)nbytes, 0, &ptr);
        if (status == MF_SUCCESS) {
            for (Py_ssize_t i = 0; i < nbytes; i++) zeroed &= ((unsigned char *)ptr)[i] == 0;
            for (Py_ssize_t i = 0; i < nbytes / 4; i++) ((uint32_t *)ptr)[i] = (uint32_t)i;
        }
        return Py_BuildValue("(iKi)", (int)status, (unsigned long long)(uintptr_t)ptr, zeroed);
    }

    static PyObject *host_free(PyObject *self, PyObject *args) {
        unsigned long long ptr;
        Py_ssize_t nbytes;
        if (!PyArg_ParseTuple(args, "Kn", &ptr, &nbytes)) return NULL;
        return PyLong_FromLong((long)feed->host_free((void *)(uintptr_t)ptr, (size_t)nbytes));
    }

    /* bytes -> device -> pinned on a new stream, ordered by an event: the copy's result. */
    static PyObject *roundtrip(PyObject *self, PyObject *args) {
        const char *data;
        Py_ssize_t n;
        mf_stream_t stream = 0;
        mf_event_t event = 0;
        void *dev = NULL, *pinned = NULL;
        PyObject *result = NULL;
        mf_status st;
        if (!PyArg_ParseTuple(args, "y#", &data, &n)) return NULL;
        if ((st = feed->stream_create(MF_STREAM_NON_BLOCKING, &stream)) ||
            (st = feed->event_create(0, &event)) ||
            (st = feed->device_alloc((size_t)n, &dev)) ||
            (st = feed->host_alloc((size_t)n, 0, &pinned)) ||
            (st = feed->copy_h2d_async(dev, data, (size_t)n, stream)) ||
            (st = feed->copy_d2h_async(pinned, dev, (size_t)n, stream)) ||
            (st = feed->event_record(event, stream)) ||
            (st = feed->event_synchronize(event))) {
            PyErr_Format(PyExc_RuntimeError, "status %d: %s", (int)st, feed->last_error());
        } else {
            result = PyBytes_FromStringAndSize((const char *)pinned, n);
        }
        /* data is the caller's bytes: the stream must have passed the H2D copy before return. */
        if (stream) feed->stream_synchronize(stream);
        if (pinned) feed->host_free(pinned, (size_t)n);
        if (dev) feed->device_free(dev);
        if (event) feed->event_destroy(event);
        if (stream) feed->stream_destroy(stream);
        return result;
    }

    static int host_func_runs;
    static void count_run(void *data) { (void)data; ++host_func_runs; }

    /* A captured argmax (its masks moved to device memory: a graph reads no host inputs) and host
     * function, the graph launched twice on a new stream. */
    static mf_status argmax_graph(const mf_argmax_args *host_args, mf_event_t event) {
        mf_stream_t stream = 0;
        mf_graph_t graph = 0;
        void *masks = NULL;
        mf_argmax_args a = *host_args;
        mf_status st;
        host_func_runs = 0;
        if ((st = feed->stream_create(MF_STREAM_NON_BLOCKING, &stream))) return st;
        /* The caller copied the logits on stream 0, which this non-blocking stream does not wait
         * for: wait for that copy here, or the graph's launches may read the logits before it. */
        if (!(st = feed->device_alloc(a.rows * 8u, &masks)) &&
            !(st = feed->copy_h2d_async(masks, a.masks, a.rows * 8u, stream)) &&
            !(st = feed->stream_synchronize(stream)) && !(st = feed->stream_synchronize(0)) &&
            !(st = feed->graph_begin(stream))) {
            a.masks = (const uint32_t *)masks;
            a.flags |= MF_ARGS_MASKS_DEVICE;
            mf_status queued = feed->argmax_to_feed(&a, stream);
            if (!queued) queued = feed->launch_host_func(stream, count_run, NULL);
            st = feed->graph_end(stream, queued ? NULL : &graph);
            if (queued) st = queued;
        }
        if (!st) st = feed->graph_launch(graph, stream);
        if (!st) st = feed->graph_launch(graph, stream);
        if (!st) st = feed->event_record(event, stream);
        if (!st) st = feed->event_synchronize(event);
        if (graph) feed->graph_destroy(graph);
        feed->stream_synchronize(stream);
        if (masks) feed->device_free(masks);
        feed->stream_destroy(stream);
        return st;
    }

    /* The masked argmax of float32 rows through the table: the ids copied into pinned memory.
     * entry 2: version 2's argmax_to_feed; 1: version 1's, given a version 1 descriptor followed
     * by junk (what an extension built against version 1 passes: the fields after its end are
     * whatever the caller's memory holds); 3: version 2's inside a graph launched twice. */
    static PyObject *argmax(PyObject *self, PyObject *args) {
        const char *logits;
        Py_ssize_t nbytes;
        unsigned int rows, vocab, mask0, entry;
        mf_argmax_args a;
        union { mf_argmax_args_v1 v1; unsigned char room[sizeof(mf_argmax_args)]; } old;
        uint32_t masks[2 * 16];
        void *dev_logits = NULL, *cells = NULL, *dst = NULL;
        mf_event_t event = 0;
        PyObject *result = NULL;
        mf_status st;
        if (!PyArg_ParseTuple(args, "y#IIII", &logits, &nbytes, &rows, &vocab, &mask0, &entry))
            return NULL;
        if (rows < 1 || rows > 16 || (size_t)nbytes != (size_t)rows * vocab * 4) {
            PyErr_SetString(PyExc_ValueError, "rows in [1, 16] of vocab float32 logits");
            return NULL;
        }
        for (unsigned r = 0; r < rows; r++) { masks[2 * r] = mask0; masks[2 * r + 1] = MF_NO_TOKEN; }
        if ((st = feed->event_create(0, &event)) ||
            (st = feed->device_alloc((size_t)nbytes, &dev_logits)) ||
            (st = feed->device_alloc(rows * 4, &cells)) ||
            (st = feed->host_alloc(rows * 4, 0, &dst)) ||
            (st = feed->copy_h2d_async(dev_logits, logits, (size_t)nbytes, 0))) {
            goto fail;
        }
        mf_argmax_args_init(&a);
        a.logits = dev_logits;
        a.dtype = MF_DTYPE_F32;
        a.rows = rows;
        a.vocab = vocab;
        a.row_stride = vocab;
        a.masks = masks;
        a.cells = (uint32_t *)cells;
        a.cell_capacity = rows;
        a.host_dst = dst;
        a.event = event;
        feed->nvtx_push("capi-test argmax");
        if (entry == 1) {
            memset(&old, 0xA5, sizeof old);
            old.v1.logits = a.logits;
            old.v1.dtype = a.dtype;
            old.v1.rows = a.rows;
            old.v1.vocab = a.vocab;
            old.v1.row_stride = a.row_stride;
            old.v1.masks = a.masks;
            old.v1.cells = a.cells;
            old.v1.cell_capacity = a.cell_capacity;
            old.v1.host_dst = a.host_dst;
            old.v1.event = a.event;
            st = feed->argmax_to_feed_v1(&old.v1, 0);
        } else if (entry == 3) {
            st = argmax_graph(&a, event);
        } else {
            st = feed->argmax_to_feed(&a, 0);
        }
        feed->nvtx_pop();
        if (st || (entry != 3 && (st = feed->event_synchronize(event)))) goto fail;
        result = PyList_New(rows);
        for (unsigned r = 0; result && r < rows; r++)
            PyList_SET_ITEM(result, r, PyLong_FromUnsignedLong(((uint32_t *)dst)[r]));
        goto done;
    fail:
        PyErr_Format(PyExc_RuntimeError, "status %d: %s", (int)st, feed->last_error());
    done:
        feed->stream_synchronize(0);
        if (dst) feed->host_free(dst, rows * 4);
        if (cells) feed->device_free(cells);
        if (dev_logits) feed->device_free(dev_logits);
        if (event) feed->event_destroy(event);
        return result;
    }

    static PyObject *host_func_runs_of(PyObject *self, PyObject *args) {
        return PyLong_FromLong(host_func_runs);
    }

    /* Version 3's entries, each given a NULL descriptor (or no cells): their statuses. */
    static PyObject *v3_null_statuses(PyObject *self, PyObject *args) {
        return Py_BuildValue("(iiiiii)", (int)feed->verify_to_feed(NULL, 0),
                             (int)feed->resolve_verified(NULL, 1, 1, NULL, NULL, 0),
                             (int)feed->penalties_apply(NULL, 0), (int)feed->penalties_update(NULL, 0),
                             (int)feed->top_logprobs(NULL, 0), (int)feed->top_logprobs_combine(NULL, 0));
    }

    /* top_logprobs through the table over device logits the caller made: out's address too. */
    static PyObject *top_logprobs(PyObject *self, PyObject *args) {
        unsigned long long logits, out;
        unsigned rows, vocab, n;
        mf_top_logprobs_args a;
        if (!PyArg_ParseTuple(args, "KIIIK", &logits, &rows, &vocab, &n, &out)) return NULL;
        mf_top_logprobs_args_init(&a);
        a.logits = (const void *)(uintptr_t)logits;
        a.dtype = MF_DTYPE_F32;
        a.rows = rows;
        a.vocab = vocab;
        a.row_stride = vocab;
        a.n = n;
        a.out = (mf_top_logprob *)(uintptr_t)out;
        return PyLong_FromLong((long)feed->top_logprobs(&a, 0));
    }

    static PyMethodDef methods[] = {
        {"table_info", table_info, METH_NOARGS, NULL},
        {"active_backend", active_backend, METH_NOARGS, NULL},
        {"last_error", last_error, METH_NOARGS, NULL},
        {"event_create", event_create, METH_NOARGS, NULL},
        {"event_record", event_record, METH_VARARGS, NULL},
        {"event_query", event_query, METH_VARARGS, NULL},
        {"event_synchronize", event_synchronize, METH_VARARGS, NULL},
        {"event_destroy", event_destroy, METH_VARARGS, NULL},
        {"host_alloc", host_alloc, METH_VARARGS, NULL},
        {"host_free", host_free, METH_VARARGS, NULL},
        {"roundtrip", roundtrip, METH_VARARGS, NULL},
        {"argmax", argmax, METH_VARARGS, NULL},
        {"host_func_runs", host_func_runs_of, METH_NOARGS, NULL},
        {"v3_null_statuses", v3_null_statuses, METH_NOARGS, NULL},
        {"top_logprobs", top_logprobs, METH_VARARGS, NULL},
        {NULL, NULL, 0, NULL}};

    static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "mf_capi_user", NULL, -1, methods};

    PyMODINIT_FUNC PyInit_mf_capi_user(void) {
        feed = mf_import_capi();
        if (!feed) return NULL;
        return PyModule_Create(&module);
    }
    """
)

SUCCESS = 0
INVALID_VALUE, INVALID_HANDLE = 1, 2  # MF_ERROR_INVALID_VALUE, MF_ERROR_INVALID_HANDLE (feed.h)


@pytest.fixture(scope="module")
def capi(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("capi")
    source = tmp_path / "mf_capi_user.c"
    source.write_text(C_SOURCE)
    return build_extension(tmp_path, "mf_capi_user", source)


def test_table_matches_header(capi):
    version, size, compiled_size = capi.table_info()
    assert version >= 1
    assert size == compiled_size  # the package and this extension agree on the layout
    assert capi.active_backend() == {"host": 0, "cuda": 1, "simt": 2}[mf.backend()]


def test_version_three_entries_are_the_c_layers(host, no_leaks, capi):
    """Version 3's slots: each refuses a NULL descriptor as the C layer does, and top_logprobs
    through the table writes what ``_core.top_logprobs`` writes."""
    import numpy as np

    assert capi.table_info()[0] >= 3
    assert capi.v3_null_statuses() == (INVALID_VALUE,) * 6
    logits = np.random.default_rng(3).standard_normal((3, 50)).astype(np.float32)
    rec = np.dtype([("id", "<u4"), ("logprob", "<f4")])
    with mf.DeviceBuffer(logits.nbytes) as dev, mf.DeviceBuffer(3 * 4 * 8) as out, \
            mf.DeviceBuffer(3 * 4 * 8) as want:
        addresses = dev.ptr, out.ptr
        mf.copy_h2d_async(dev, logits)
        assert capi.top_logprobs(dev.ptr, 3, 50, 4, out.ptr) == SUCCESS
        mf._core.top_logprobs(dev, want, n=4, rows=3, vocab=50, dtype="float32")
        got, ref = np.zeros(12, rec), np.zeros(12, rec)
        mf.copy_d2h_async(out, got)
        mf.copy_d2h_async(want, ref)
        mf.stream_synchronize()
    assert got.tobytes() == ref.tobytes()
    assert got["id"].reshape(3, 4).tolist() == np.argsort(-logits, axis=1)[:, :4].tolist()
    mf.stream_synchronize()  # the deferred frees done: the memory is the C layer's no more
    assert capi.top_logprobs(addresses[0], 3, 50, 4, addresses[1]) == INVALID_HANDLE  # refused
    assert "logits" in capi.last_error(), capi.last_error()


def test_extension_does_not_link_the_c_layer(capi):
    nm = shutil.which("nm")
    if nm is None or not capi.__file__.endswith(".so"):
        pytest.skip("nm is needed to list the extension's undefined symbols")
    undefined = subprocess.run([nm, "-u", capi.__file__], capture_output=True, text=True).stdout
    names = {line.split()[-1].lstrip("_") for line in undefined.splitlines() if line.strip()}
    assert not {name for name in names if name.startswith("mf_")}, names


def test_capsule_event_is_the_packages(host, no_leaks, capi):
    before = mf.live_objects()["events"]
    status, handle = capi.event_create()
    assert status == SUCCESS and handle
    try:
        assert mf.live_objects()["events"] == before + 1
        host.configure_host(lag_us=50_000)
        assert capi.event_record(handle, 0) == SUCCESS
        assert mf.event_query(handle) is False  # the package sees the pending record
        assert capi.event_query(handle) == (SUCCESS, 0)
        assert capi.event_synchronize(handle) == SUCCESS
        assert mf.event_query(handle) is True
        assert capi.event_query(handle) == (SUCCESS, 1)
    finally:
        assert capi.event_destroy(handle) == SUCCESS
    assert mf.live_objects()["events"] == before
    with pytest.raises(mf.FeedError):
        mf.event_query(handle)  # destroyed through the capsule: unknown to the package too
    status, _ = capi.event_query(handle)
    assert status != SUCCESS and capi.last_error()


def test_python_event_through_capsule(host, no_leaks, capi):
    host.configure_host(lag_us=50_000)
    with mf.Stream() as stream, mf.Event() as event:
        event.record(stream)
        assert capi.event_query(event.handle) == (SUCCESS, 0)
        assert capi.event_synchronize(event.handle) == SUCCESS
        assert event.query() is True
        assert capi.event_query(event.handle) == (SUCCESS, 1)
    assert capi.event_query(0)[0] != SUCCESS


def test_pinned_memory_through_capsule(host, no_leaks, capi):
    before = mf.live_objects()["pinned_bytes"]
    status, ptr, zeroed = capi.host_alloc(64)
    assert status == SUCCESS and ptr and zeroed
    try:
        assert mf.live_objects()["pinned_bytes"] == before + 64
        # The package recognises the capsule's allocation as its own pinned memory.
        assert mf.read_pinned_u32(ptr, 16) == list(range(16))
        assert capi.host_free(ptr, 32) != SUCCESS  # the size must match
    finally:
        assert capi.host_free(ptr, 64) == SUCCESS
    assert mf.live_objects()["pinned_bytes"] == before
    assert capi.host_free(ptr, 64) != SUCCESS  # a double free is refused, not a crash
    with pytest.raises(mf.FeedError):
        mf.read_pinned_u32(ptr, 1)
    # And the other way: Python's allocation freed through the capsule.
    ptr = mf.alloc_host_pinned(128)
    assert capi.host_free(ptr, 128) == SUCCESS
    with pytest.raises(mf.FeedError):
        mf.free_host_pinned(ptr, 128)


def test_copies_through_capsule(host, no_leaks, capi):
    payload = os.urandom(4096)
    assert capi.roundtrip(payload) == payload
    host.configure_host(lag_us=2_000)  # the copies really are queued behind the lag
    assert capi.roundtrip(payload[:100]) == payload[:100]


ENTRY_V1, ENTRY_V2, ENTRY_GRAPH = 1, 2, 3


@pytest.mark.parametrize("entry", [ENTRY_V2, ENTRY_V1, ENTRY_GRAPH], ids=["v2", "v1", "graph"])
def test_argmax_through_capsule(host, no_leaks, capi, entry):
    from array import array

    rows, vocab = 3, 8
    values = [[(7 * r + 3 * v) % 11 / 10 for v in range(vocab)] for r in range(rows)]
    logits = array("f", [x for row in values for x in row]).tobytes()
    assert capi.argmax(logits, rows, vocab, mf.NO_TOKEN, entry) == \
        [row.index(max(row)) for row in values]
    masked = capi.argmax(logits, rows, vocab, 1, entry)
    for row, got in zip(values, masked):
        candidates = [v for v in range(vocab) if v != 1]
        assert got == max(candidates, key=lambda v: (row[v], -v))
    if entry == ENTRY_GRAPH:
        assert capi.host_func_runs() == 2  # the captured host function ran at each launch


def test_version_one_descriptor_reads_no_further_than_its_end(capi):
    """An extension built against version 1 passes the shorter descriptor: through its own entry
    the junk after it is never read as a bitmask, params or logprobs pointer (through the whole
    descriptor's entry the same bytes are refused)."""
    from array import array

    logits = array("f", [0.0, 1.0, 0.5, 0.25]).tobytes()
    assert capi.argmax(logits, 1, 4, mf.NO_TOKEN, ENTRY_V1) == [1]
    assert capi.table_info()[0] >= 2
