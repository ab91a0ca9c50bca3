# How the kernels read a row's sampling parameters, asked of the C rule itself
# (sample_rule.h, mf_plan_sampling) instead of restated in Python: which rows sample, and which
# filters each sampled row applies. The tensor-parallel layer plans its rounds from it.

_PLAN_SAMPLED = 1  # the row draws (0 < temperature <= 3.4e38f); else the argmax rule
_PLAN_TOP_K = 2    # a sampled row's top_k is on
_PLAN_TOP_P = 4    # a sampled row's top_p is on (0 < top_p < 1)
_PLAN_MIN_P = 8    # a sampled row's min_p is on (0 < min_p < 1)


def _sampling_plan(params, rows=None):
    """One byte a row: ``_PLAN_*`` bits of ``mf_plan_sampling``'s reading of each record, as every
    backend's kernels read them (a value out of range is its neutral setting).

    Parameters
    ----------
    params : buffer of SAMPLING_PARAMS_DTYPE records
        Host records (a numpy array of them).
    rows : int, optional
        The first ``rows`` records; default all.

    Returns
    -------
    bytes
    """
    # A buffer of bytes through the buffer protocol, not a typed memoryview: those bring
    # Cython's memoryview type, whose set-up imports collections.abc at every import of _core.
    cdef Py_buffer raw
    PyObject_GetBuffer(memoryview(params).cast("B"), &raw, PyBUF_SIMPLE)
    cdef const unsigned char *data = <const unsigned char *> raw.buf
    cdef Py_ssize_t size = sizeof(mf_sampling_params)
    cdef Py_ssize_t n
    cdef mf_sampling_params record
    cdef mf_sample_plan plan
    cdef Py_ssize_t r
    cdef unsigned char *flags
    try:
        n = raw.len // size if rows is None else rows
        if n < 0 or n * size > raw.len:
            raise ValueError(f"params hold {raw.len // size} records, fewer than {rows}")
        out = bytearray(n)
        flags = <unsigned char *> PyByteArray_AS_STRING(out)
        for r in range(n):
            memcpy(&record, data + r * size, size)  # records of a view may be unaligned
            plan = mf_plan_sampling(&record)
            if not plan.greedy:
                flags[r] = (_PLAN_SAMPLED | (_PLAN_TOP_K if plan.top_k != 0 else 0)
                            | (_PLAN_TOP_P if plan.use_top_p else 0)
                            | (_PLAN_MIN_P if plan.use_min_p else 0))
    finally:
        PyBuffer_Release(&raw)
    return bytes(out)
