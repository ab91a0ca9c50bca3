# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: embedsignature=True
"""The one extension that owns the C layer: events, streams, page-locked and device memory, async
copies and the kernel launchers, on whichever backend is active."""

cimport cython
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.exc cimport PyErr_CheckSignals
from cpython.buffer cimport (PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_ND, PyBUF_SIMPLE,
                             PyBUF_STRIDES, PyBUF_WRITABLE, PyBuffer_Release, PyObject_CheckBuffer,
                             PyObject_GetBuffer)
from cpython.long cimport PyLong_Check, PyLong_CheckExact
from cpython.pycapsule cimport PyCapsule_Destructor, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t, UINT64_MAX
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from metrale_feed._cfeed cimport *

import atexit as _atexit
import os as _os
from _collections import deque as _deque  # collections itself costs milliseconds to import

from metrale_feed.errors import CudaError, FeedError
from metrale_feed.errors import HostFunctionError as _HostFunctionError

NO_TOKEN = MF_NO_TOKEN
MAX_ROWS = MF_MAX_ROWS    # rows one kernel launch takes (feed.h)
MAX_VOCAB = MF_MAX_VOCAB  # the largest vocabulary (feed.h): ids fit a float32 mantissa
MAX_DRAFTS = MF_MAX_DRAFTS  # drafts per row verify_to_feed takes (feed.h)
MAX_LOGIT_BIAS = MF_MAX_LOGIT_BIAS  # logit_bias entries a request may have (feed.h)
MAX_PENALTY_STOPS = MF_MAX_PENALTY_STOPS  # stop ids min_tokens bans
PENALTY_ITEMS = MF_PENALTY_ITEMS  # items per slot: the biases, then the stop ids
MAX_PENALTY_TABLE = MF_MAX_PENALTY_TABLE  # distinct ids one slot's table may hold
MAX_TOP_LOGPROBS = MF_MAX_TOP_LOGPROBS  # ids top_logprobs gives a row at most (feed.h)
PENALTY_PROMPT = MF_PENALTY_PROMPT  # a table entry's count flag: the id is in the prompt


cdef tuple _sampling_params_layout():
    """feed.h's ``mf_sampling_params`` as numpy describes a record: ``((name, format, offset),
    ...)`` and the size, from the C layer's own table of the struct (``mf_sampling_params_layout``;
    ``sampling.SAMPLING_PARAMS_DTYPE`` is made from it). Padding, a C name ending in ``_``, is
    named ``_`` and its stem (``pad_``: ``_pad``), the names no caller sets."""
    cdef mf_record_layout layout
    cdef const mf_record_field *f
    cdef uint32_t i
    mf_record_layout_init(&layout)
    if mf_sampling_params_layout(&layout) != MF_SUCCESS:  # a defect: errors.pxi is not set up yet
        raise RuntimeError(f"mf_sampling_params_layout: {mf_last_error().decode('utf-8', 'replace')}")
    fields = []
    for i in range(layout.count):
        f = <const mf_record_field *>(<const char *>layout.fields + <size_t>i * layout.field_size)
        name = f.name.decode("ascii")
        if name.endswith("_"):
            name = "_" + name[:-1]
        fields.append((name, f.format.decode("ascii"), f.offset))
    return tuple(fields), layout.record_size


_SAMPLING_PARAMS_LAYOUT = _sampling_params_layout()

include "_state.pxi"
include "_errors.pxi"
include "_coerce.pxi"
include "_launch.pxi"
include "_event.pxi"
include "_memory.pxi"
include "_dlpack.pxi"
include "_hostfunc.pxi"
include "_words.pxi"
include "_plan.pxi"
include "_step.pxi"
include "_kernels.pxi"
include "_verify.pxi"
include "_penalties.pxi"
include "_top_logprobs.pxi"
include "_shard.pxi"
include "_grammar.pxi"
include "_graph.pxi"
include "_backend.pxi"
include "_capi.pxi"
