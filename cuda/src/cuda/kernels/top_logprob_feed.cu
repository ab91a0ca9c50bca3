// The top logprobs of each row (top_logprob_rule.h): one block per row. The row's (m, s) first,
// exactly as the chosen-token logprob kernel folds them (logprob_feed.cu), then n rounds, each
// the block-wide greatest packed word below the previous round's: n passes over a row that stays
// in cache, integer comparisons only, so the ids are the host's whatever the thread count.
#include "cuda/block.cuh"
#include "cuda/kernels.hpp"
#include "metrale_feed/top_logprob_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kThreads = MF_STATS_LANES;  // the lanes of the fixed order of a row's sum

__global__ void __launch_bounds__(kThreads)
    mf_top_logprobs_kernel(const char *logits, int dtype, uint64_t row_bytes, uint32_t width, uint32_t n,
                           mf_top_logprob *out, const uint32_t *ids, float *chosen) {
    __shared__ float fslots[kThreads / 32];
    __shared__ double dslots[kThreads / 32];
    __shared__ unsigned long long pslots[kThreads / 32];
    const uint32_t r = blockIdx.x;
    const void *row = logits + r * row_bytes;
    float m = mf_neg_inf();
    for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) m = MaxFloat()(m, mf_from_bits(mf_logit_bits(row, dtype, i)));
    m = block_fold(m, MaxFloat(), fslots);
    double s = 0.0;
    if (m > mf_neg_inf() && mf_finite_bits(mf_to_bits(m))) {  // uniform across the block
        for (uint32_t i = threadIdx.x; i < width; i += blockDim.x)
            s += (double)mf_exp_neg(mf_fsub(mf_from_bits(mf_logit_bits(row, dtype, i)), m));
        s = block_fold(s, Sum(), dslots);
    }
    if (ids && threadIdx.x == 0) chosen[r] = mf_top_chosen(row, dtype, width, ids[r], m, s);
    unsigned long long bound = ~0ull;  // above every word
    for (uint32_t j = 0; j < n; ++j) {
        unsigned long long best = 0ull;
        for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) {
            const unsigned long long w = mf_top_word(row, dtype, i);
            if (w < bound) best = mf_pack_max(best, w);
        }
        best = block_fold(best, MaxPacked(), pslots);
        if (threadIdx.x == 0) out[(uint64_t)r * n + j] = mf_top_entry(best, row, dtype, m, s);
        bound = best;  // 0 once the ids run out: every later round answers none
    }
}

}  // namespace

cudaError_t launch_top_logprobs(const mf_top_logprobs_args &a, cudaStream_t stream) {
    (void)stream;  // unused by the simt launch
    // rows <= MF_MAX_ROWS (checked at the C ABI): one block each, one launch.
    MF_LAUNCH(a.rows, kThreads, 0, stream, mf_top_logprobs_kernel)(
        static_cast<const char *>(a.logits), (int)a.dtype, a.row_stride * mf_dtype_size((int)a.dtype), a.vocab, a.n,
        a.out, a.ids, a.chosen);
    return cudaGetLastError();
}

}  // namespace MF_KERNELS
}  // namespace mf
