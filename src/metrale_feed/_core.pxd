# C-level API of metrale_feed._core, for `cimport metrale_feed._core` from other Cython code.
# The cdef functions below are exported through Cython's C-API table, so a downstream extension
# reaches this extension's backend and state without linking the C layer itself.
from libc.stdint cimport uint32_t, uint64_t

from metrale_feed._cfeed cimport mf_status, mf_argmax_args


cdef class Event:
    cdef uint64_t _handle
    cdef bint _owned
    cdef bint _timing
    cdef int _check_open(self) except -1
    cdef int _record(self, uint64_t stream) except -1
    cdef bint _query(self) except -1
    cdef int _synchronize(self) except -1


cdef class Stream:
    cdef uint64_t _handle
    cdef bint _owned
    cdef bint _closed
    cdef object _owner  # the foreign stream object a wrapped Stream keeps alive (Stream.wrap)
    cdef object __weakref__
    cdef int _check_open(self) except -1


cdef class PinnedBuffer:
    cdef void *_ptr
    cdef size_t _nbytes
    cdef Py_ssize_t _exports
    cdef Py_ssize_t _shape[1]
    cdef int _check_open(self) except -1


cdef class DeviceBuffer:
    cdef void *_ptr
    cdef size_t _nbytes
    cdef Py_ssize_t _exports
    cdef int _check_open(self) except -1


# Raw C-level calls: typed, nogil, no exception; the status says whether they worked and
# error_message() says why not.
cdef mf_status event_record_c(uint64_t event, uint64_t stream) noexcept nogil
cdef mf_status event_query_c(uint64_t event, int *done) noexcept nogil
cdef mf_status event_synchronize_c(uint64_t event) noexcept nogil
cdef mf_status copy_d2h_async_c(void *dst, const void *src, size_t nbytes, uint64_t stream) noexcept nogil
cdef mf_status copy_h2d_async_c(void *dst, const void *src, size_t nbytes, uint64_t stream) noexcept nogil
cdef mf_status argmax_to_feed_c(const mf_argmax_args *args, uint64_t stream) noexcept nogil
cdef mf_status resolve_feed_c(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, uint64_t stream) noexcept nogil
cdef const char *error_message() noexcept nogil
