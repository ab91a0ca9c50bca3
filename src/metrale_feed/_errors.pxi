# Status codes to exceptions. The C layer keeps the message thread-locally, so the success path
# below never touches it.

from metrale_feed.errors import STATUS_ERRORS as _STATUS_ERRORS


cdef int raise_status(mf_status status) except -1:
    # The one place a status becomes an exception: each mf_status has its FeedError subclass
    # (errors.py), so callers tell faults apart by type; a bad argument stays a ValueError.
    # The CUDA code goes with MF_ERROR_CUDA only: every other failure resets it (error.cpp), and a
    # code left from an earlier call must not turn another status into a CudaError.
    message = mf_last_error().decode("utf-8", "replace")
    cdef int code
    if status == MF_ERROR_INVALID_VALUE:
        raise ValueError(message)
    if status == MF_ERROR_CUDA:
        code = mf_last_cuda_error()
        raise CudaError(message, code, mf_cuda_error_name(code).decode())
    raise _STATUS_ERRORS.get(<int>status, FeedError)(message)


cdef inline int check(mf_status status) except -1:
    if status != MF_SUCCESS:
        raise_status(status)
    return 0


cdef const char *error_message() noexcept nogil:
    return mf_last_error()


def _status_error(int status):
    """The exception a failed C call returning ``status`` raises, with the calling thread's last
    error message (for tests: each ``mf_status`` has its class)."""
    try:
        raise_status(<mf_status>status)
    except Exception as error:
        return error
