// Feed resolve: out[i] = the host id of sources[i] (bit 31 set) or cells[from_row]. The sources
// travel by value in the kernel parameters, so the host array may be reused as soon as the launch
// returns, with no staging copy or sync (graph-capturable). from_row was validated by the caller.
#include <algorithm>

#include "cuda/kernels.hpp"

namespace mf {
namespace cudak {
namespace {

constexpr int kThreads = 256;

template <int N>
struct Sources {
    uint32_t words[N];
};

template <int N>
__global__ void __launch_bounds__(kThreads)
    mf_resolve_kernel(const uint32_t *cells, uint32_t *out, uint32_t n,
                      const __grid_constant__ Sources<N> src) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint32_t s = src.words[i];
    out[i] = (s & MF_FEED_HOST_BIT) ? (s & ~MF_FEED_HOST_BIT) : cells[s];
}

template <int N>
cudaError_t launch_chunk(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                         uint32_t *out, cudaStream_t stream) {
    Sources<N> src;
    std::copy(sources, sources + n, src.words);
    const unsigned blocks = (n + kThreads - 1) / kThreads;
    mf_resolve_kernel<N><<<blocks, kThreads, 0, stream>>>(cells, out, n, src);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                           uint32_t *out, cudaStream_t stream) {
    for (uint32_t off = 0; off < n; off += kResolvePerLaunch) {
        const uint32_t k = std::min(n - off, kResolvePerLaunch);
        // A small tier keeps the usual decode batch's parameter block at 1 KiB.
        cudaError_t e = k <= 256 ? launch_chunk<256>(sources + off, k, cells, out + off, stream)
                                 : launch_chunk<kResolvePerLaunch>(sources + off, k, cells,
                                                                   out + off, stream);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t kernels_loadable() {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, mf_resolve_kernel<256>);
}

}  // namespace cudak
}  // namespace mf
