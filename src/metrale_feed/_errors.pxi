# Status codes to exceptions. The C layer keeps the message thread-locally, so the success path
# below never touches it.

cdef int raise_status(mf_status status) except -1:
    message = mf_last_error().decode("utf-8", "replace")
    cdef int code = mf_last_cuda_error()
    if status == MF_ERROR_INVALID_VALUE:
        raise ValueError(message)
    if status == MF_ERROR_CUDA or code != 0:
        raise CudaError(message, code, mf_cuda_error_name(code).decode())
    raise FeedError(message)


cdef inline int check(mf_status status) except -1:
    if status != MF_SUCCESS:
        raise_status(status)
    return 0


cdef const char *error_message() noexcept nogil:
    return mf_last_error()
