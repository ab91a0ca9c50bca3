// Thread-local last error: the success path writes nothing, so it costs no lock and no GIL.
#include <cstdarg>
#include <cstdio>

#include "backend.hpp"

namespace {
thread_local char t_message[512] = "";
thread_local int t_cuda_code = 0;
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
mf_status fail_cuda(int code, const char *what) {
    cudaError_t err = (cudaError_t)code;
    fail(MF_ERROR_CUDA, "%s: %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err));
    set_cuda_code(code);
    return MF_ERROR_CUDA;
}
}  // namespace mf

extern "C" const char *mf_cuda_error_name(int code) { return cudaGetErrorName((cudaError_t)code); }
#else
extern "C" const char *mf_cuda_error_name(int code) { return code ? "cudaErrorUnknown" : "cudaSuccess"; }
#endif
