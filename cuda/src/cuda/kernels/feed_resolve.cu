// Feed resolve: out[i] = the host id of sources[i] (bit 31 set) or cells[from_row]. Host sources
// travel by value in the kernel parameters, so the host array may be reused as soon as the launch
// returns, with no staging copy or sync (graph-capturable); their from_row was validated by the
// caller. Device-resident sources are read when the kernel runs, which bounds from_row itself.
#include <algorithm>

#include "cuda/kernels.hpp"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kThreads = 256;

template <int N>
struct Sources {
    uint32_t words[N];
};

template <int N>
__global__ void __launch_bounds__(kThreads)
    mf_resolve_kernel(const uint32_t *cells, uint32_t prev_rows, uint32_t *out, uint32_t n,
                      const uint32_t *device_sources, const __grid_constant__ Sources<N> src) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint32_t s = device_sources ? device_sources[i] : src.words[i];
    out[i] = (s & MF_FEED_HOST_BIT) ? (s & ~MF_FEED_HOST_BIT) : s < prev_rows ? cells[s] : MF_NO_TOKEN;
}

template <int N>
cudaError_t launch_chunk(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                         uint32_t prev_rows, uint32_t *out, bool on_device, cudaStream_t stream) {
    Sources<N> src;
    if (!on_device) std::copy(sources, sources + n, src.words);
    const unsigned blocks = (n + kThreads - 1) / kThreads;
    MF_LAUNCH(blocks, kThreads, 0, stream, mf_resolve_kernel<N>)(cells, prev_rows, out, n,
                                                          on_device ? sources : nullptr, src);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                           uint32_t prev_rows, uint32_t *out, bool on_device, cudaStream_t stream) {
    for (uint32_t off = 0; off < n; off += kResolvePerLaunch) {
        const uint32_t k = std::min(n - off, kResolvePerLaunch);
        // A small tier keeps the usual decode batch's parameter block at 1 KiB.
        cudaError_t e = k <= 256 || on_device
                            ? launch_chunk<256>(sources + off, k, cells, prev_rows, out + off,
                                                on_device, stream)
                            : launch_chunk<kResolvePerLaunch>(sources + off, k, cells, prev_rows,
                                                              out + off, on_device, stream);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t kernels_loadable() {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, mf_resolve_kernel<256>);
}

}  // namespace MF_KERNELS
}  // namespace mf
