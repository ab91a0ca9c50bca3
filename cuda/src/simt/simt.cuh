// The CUDA that the kernels use, for the host C++ compiler: the .cu sources compile unchanged
// against this header (MF_SIMT) and run on the simt executor (executor.hpp). Only what the kernels
// use is here, and each piece keeps CUDA's meaning: a shuffle waits for the lanes its mask names,
// a barrier for every live thread of the block, an atomic is a real atomic (sequentially
// consistent, so ThreadSanitizer sees the order __threadfence gives on a GPU).
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simt/executor.hpp"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// Shared memory: storage of the OS thread that runs the block (every fiber of it runs there).
#define __shared__ static thread_local

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr operator ::mf::simt::Dim() const { return ::mf::simt::Dim{x, y, z}; }
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

#define threadIdx (::mf::simt::tl_where.thread)
#define blockIdx (::mf::simt::tl_where.block)
#define blockDim (::mf::simt::tl_where.block_dim)
#define gridDim (::mf::simt::tl_where.grid_dim)

typedef int cudaError_t;
typedef void *cudaStream_t;
enum : int { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorLaunchFailure = 719 };
struct cudaFuncAttributes {
    int unused;
};
template <class F>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *, F) { return cudaSuccess; }
// A launch runs before it returns, so the last error is that launch's fault (take_fault() says why).
inline cudaError_t cudaGetLastError() { return ::mf::simt::peek_fault() ? cudaErrorLaunchFailure : cudaSuccess; }
// On the stream that runs the launch, so stream order is program order here.
inline cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t) {
    std::memset(p, value, n);
    return cudaSuccess;
}

#define __syncthreads() ::mf::simt::syncthreads(__FILE__, __LINE__)
#define __threadfence() std::atomic_thread_fence(std::memory_order_seq_cst)

namespace mf::simt {
template <class T>
T from_word(uint64_t w) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    T v;
    std::memcpy(&v, &w, sizeof(T));
    return v;
}
template <class T>
uint64_t to_word(T v) {
    uint64_t w = 0;
    std::memcpy(&w, &v, sizeof(T));
    return w;
}
template <class T>
T shfl(ShuffleKind kind, uint32_t mask, T v, int arg, int width, const char *file, int line) {
    return from_word<T>(shuffle(kind, mask, to_word(v), arg, width, file, line));
}
template <class T>
T atomic_add(T *p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
T atomic_cas(T *p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;  // the old value, as CUDA's atomicCAS returns it
}
}  // namespace mf::simt

#define MF_SIMT_WIDTH(...) __VA_OPT__(, __VA_ARGS__)
#define __shfl_sync(mask, v, lane, ...) \
    ::mf::simt::shfl(::mf::simt::kIdx, mask, v, lane, ::mf::simt::width_of(32 MF_SIMT_WIDTH(__VA_ARGS__)), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, lanes, ...) \
    ::mf::simt::shfl(::mf::simt::kXor, mask, v, lanes, ::mf::simt::width_of(32 MF_SIMT_WIDTH(__VA_ARGS__)), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, delta, ...) \
    ::mf::simt::shfl(::mf::simt::kUp, mask, v, delta, ::mf::simt::width_of(32 MF_SIMT_WIDTH(__VA_ARGS__)), __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, delta, ...) \
    ::mf::simt::shfl(::mf::simt::kDown, mask, v, delta, ::mf::simt::width_of(32 MF_SIMT_WIDTH(__VA_ARGS__)), __FILE__, __LINE__)
namespace mf::simt {
constexpr int width_of(int, int w) { return w; }
constexpr int width_of(int w) { return w; }
}  // namespace mf::simt

#define atomicAdd(p, v) ::mf::simt::atomic_add(p, v)
#define atomicCAS(p, e, d) ::mf::simt::atomic_cas(p, e, d)

template <class T>
inline T __ldg(const T *p) { return *p; }
template <class T>
inline T __ldcg(const T *p) { return *p; }  // ordered by the acquiring atomic before it

inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
}
// Round-to-nearest arithmetic, never fused (the simt build has -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

// CUDA's integer min and max of the kernels (the same type on both sides, as the kernels use them).
template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }

// kernel<<<grid, block, shared, stream>>>(args) is MF_LAUNCH(grid, block, shared, stream, kernel)(args).
#define MF_LAUNCH(grid, block, shared, stream, ...) \
    ::mf::simt::launcher(#__VA_ARGS__, __FILE__, __LINE__, dim3(grid), dim3(block), shared, __VA_ARGS__)
