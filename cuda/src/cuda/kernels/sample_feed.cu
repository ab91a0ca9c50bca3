// Sampling into the feed cells: cells[r] = the id sample_rule.h draws for row r. One block per row,
// every pass a strided scan of the row; the top_k and top_p thresholds come from a radix select
// over the packed words (eight 8-bit digits, a 256-bin histogram in shared memory per digit),
// never a sort of the vocabulary. Integer histograms and sums make the answer independent of the
// order threads add in, so it is bit for bit the host kernel's (sample_host.cpp).
#include <algorithm>

#include "cuda/block.cuh"
#include "cuda/kernels.hpp"
#include "metrale_feed/sample_rule.h"
#include "sample_block.cuh"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr uint32_t kSampleRowsPerLaunch = 256;  // 256 * (32 + 8) bytes of parameters

struct SampleInputs {
    mf_sampling_params params[kSampleRowsPerLaunch];
    uint32_t masks[2 * kSampleRowsPerLaunch];
};

__global__ void __launch_bounds__(kThreads)
    mf_sample_kernel(const char *logits, int dtype, uint64_t row_bytes, uint32_t vocab,
                     uint32_t *cells, const uint32_t *device_masks,
                     const mf_sampling_params *device_params, const uint32_t *bitmask,
                     uint32_t id_base, uint32_t cell_stride, uint32_t bit_words,
                     const __grid_constant__ SampleInputs in) {
    const uint32_t r = blockIdx.x;
    const mf_sampling_params params = device_params ? device_params[r] : in.params[r];
    const uint32_t *m = device_masks ? device_masks + 2 * r : in.masks + 2 * r;
    Row row{logits + r * row_bytes, dtype, vocab,
            mf_row_rule{m[0] - id_base, m[1] - id_base, bitmask ? bitmask + (uint64_t)r * bit_words : nullptr},
            id_base};
    cells += (uint64_t)r * cell_stride;
    const mf_sample_plan p = mf_plan_sampling(&params);

    if (p.greedy) {  // the argmax rule itself
        const uint64_t best = block_argmax(row);
        if (threadIdx.x == 0) cells[0] = mf_unpack_id(best);
        return;
    }
    const TopCount tc = top_and_count(row);
    const uint64_t top = tc.top, count = tc.count;
    if (count == 0) {
        if (threadIdx.x == 0) cells[0] = MF_NO_TOKEN;
        return;
    }
    const uint32_t top_id = mf_unpack_id(top);
    const float zmax = mf_scaled(mf_logit_bits(row.logits, dtype, top_id), p.inv_t);
    if (!mf_finite_bits(mf_to_bits(zmax))) {
        if (threadIdx.x == 0) cells[0] = top_id;
        return;
    }
    const uint64_t threshold = block_threshold(row, p, count, zmax);
    // The race, the top first (its z is zmax): its score bounds which others can win.
    const uint32_t id = block_race(row, p, top_id, zmax, zmax, threshold, MF_NO_TOKEN);
    if (threadIdx.x == 0) cells[0] = id;
}

}  // namespace

cudaError_t launch_sample(const mf_argmax_args &a, cudaStream_t stream) {
    const uint64_t esize = a.dtype == MF_DTYPE_F32 ? 4u : 2u;
    const bool dmasks = a.flags & MF_ARGS_MASKS_DEVICE, dparams = a.flags & MF_ARGS_PARAMS_DEVICE;
    for (uint32_t row0 = 0; row0 < a.rows; row0 += kSampleRowsPerLaunch) {
        const uint32_t n = std::min(a.rows - row0, kSampleRowsPerLaunch);
        SampleInputs in;
        if (!dparams) std::copy(a.params + row0, a.params + row0 + n, in.params);
        if (!dmasks) std::copy(a.masks + 2 * (uint64_t)row0, a.masks + 2 * (uint64_t)(row0 + n), in.masks);
        const IdSink sink = id_sink(a);
        const uint32_t words = mf_bitmask_words(sink.total);
        MF_LAUNCH(n, kThreads, 0, stream, mf_sample_kernel)(
            static_cast<const char *>(a.logits) + row0 * a.row_stride * esize, (int)a.dtype,
            a.row_stride * esize, a.vocab, sink.ids + (uint64_t)row0 * sink.stride,
            dmasks ? a.masks + 2 * (uint64_t)row0 : nullptr, dparams ? a.params + row0 : nullptr,
            a.bitmask ? a.bitmask + (uint64_t)row0 * words : nullptr, sink.base, sink.stride, words, in);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

}  // namespace MF_KERNELS
}  // namespace mf
