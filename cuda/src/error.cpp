// Thread-local last error: the success path writes nothing, so it costs no lock and no GIL.
#include <cstdarg>
#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>
#include <system_error>

#include "api.hpp"

namespace {
thread_local char t_message[512] = "";
thread_local int t_cuda_code = 0;

// The C++ runtime keeps each thread's exception state in thread-local storage, which a library
// loaded with dlopen() (as this one is, inside the extension) gets lazily: the first throw in a
// thread allocates it, and glibc ends the process when that allocation fails. Out of memory is
// exactly when guard() (api.hpp) must catch a throw, so the importing thread sets it up now.
const int g_exception_state_ready = std::uncaught_exceptions();
}  // namespace

namespace mf {

mf_status fail(mf_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(t_message, sizeof t_message, fmt, ap);
    va_end(ap);
    t_cuda_code = 0;
    return status;
}

void set_cuda_code(int code) { t_cuda_code = code; }

mf_status need(const void *ptr, const char *what) {
    return ptr ? MF_SUCCESS : fail(MF_ERROR_INVALID_VALUE, "%s is a null pointer", what);
}

mf_status exception_status() noexcept {
    try {
        throw;
    } catch (const std::bad_alloc &) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "out of memory (the call had no effect)");
    } catch (const std::length_error &error) {
        return fail(MF_ERROR_OUT_OF_MEMORY, "out of memory: %s (the call had no effect)", error.what());
    } catch (const std::system_error &error) {
        // Threads and locks: the OS refusing a resource (EAGAIN, ENOMEM) is running out of it.
        const int code = error.code().value();
        if (code == (int)std::errc::resource_unavailable_try_again || code == (int)std::errc::not_enough_memory)
            return fail(MF_ERROR_OUT_OF_MEMORY, "out of resources: %s (the call had no effect)", error.what());
        return fail(MF_ERROR_INTERNAL, "internal error: %s", error.what());
    } catch (const std::exception &error) {
        return fail(MF_ERROR_INTERNAL, "internal error: %s", error.what());
    } catch (...) {
        return fail(MF_ERROR_INTERNAL, "internal error: an unknown C++ exception");
    }
}

}  // namespace mf

extern "C" {
const char *mf_last_error(void) { return t_message; }
int mf_last_cuda_error(void) { return t_cuda_code; }
void mf_clear_error(void) {
    t_message[0] = '\0';
    t_cuda_code = 0;
}
}

#ifdef MF_HAVE_CUDA
#include <cuda_runtime_api.h>

namespace mf {
namespace {
// Faults of work already queued (a kernel that read a bad address, trapped or asserted, ...).
// They leave the context unusable, and the runtime reports them from whichever call comes next,
// often a later launch that itself did nothing wrong: so they are MF_ERROR_DEVICE (DeviceError,
// queued work failed), never a refusal of that call which a caller could retry.
bool queued_work_failed(cudaError_t err) {
    switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
        return true;
    default:
        return false;
    }
}
}  // namespace

mf_status fail_cuda(int code, const char *what) {
    cudaError_t err = (cudaError_t)code;
    // Out of memory is the same status on every backend (FeedMemoryError, a MemoryError), so a
    // caller's handler of it does not depend on which backend ran; the runtime's code stays.
    const mf_status status = err == cudaErrorMemoryAllocation ? MF_ERROR_OUT_OF_MEMORY
                             : queued_work_failed(err)        ? MF_ERROR_DEVICE
                                                              : MF_ERROR_CUDA;
    fail(status, "%s: %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err));
    set_cuda_code(code);
    return status;
}
}  // namespace mf

extern "C" const char *mf_cuda_error_name(int code) { return cudaGetErrorName((cudaError_t)code); }
#else
extern "C" const char *mf_cuda_error_name(int code) { return code ? "cudaErrorUnknown" : "cudaSuccess"; }
#endif
