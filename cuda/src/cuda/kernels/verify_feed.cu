// Speculative verification into the feed cells (verify_rule.h): one block per row, its positions
// in order, each judged by the sampler's block-wide pieces (sample_block.cuh) over its logit row,
// until the first position that emits an id of its own. Every decision is a block-wide value (a
// reduction every thread receives), so all threads take the same path through the positions.
// Integer masses and fixed-shape reductions make the ids bit for bit the host kernel's
// (verify_host.cpp).
#include <algorithm>

#include "cuda/block.cuh"
#include "cuda/kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/verify_rule.h"
#include "sample_block.cuh"

namespace mf {
namespace MF_KERNELS {
namespace {

// Host inputs travel by value: at most 256 logit rows (and 128 rows) per launch, 7 KiB.
constexpr uint32_t kVerifyLogitRowsPerLaunch = 256;
constexpr uint32_t kVerifyRowsPerLaunch = 128;

struct VerifyInputs {
    mf_sampling_params params[kVerifyRowsPerLaunch];
    uint32_t drafts[kVerifyLogitRowsPerLaunch];
    uint32_t masks[2 * kVerifyLogitRowsPerLaunch];
};


// The draw from max(0, p - q) after a rejection under a general draft distribution q
// (verify_rule.h); none positive: the race over p (sample_to_feed's draw).
__device__ uint32_t block_residual_race(const Row &row, const mf_sample_plan &p, uint32_t top_id, float zmax,
                                        uint64_t threshold, uint64_t total, const float *q) {
    uint64_t best = 0;
    for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x) {
        uint32_t bits;
        if (!row.candidate(i, &bits) || !mf_survives(bits, i, threshold, &p, zmax)) continue;
        const float w = mf_verify_residual(mf_verify_p(mf_survivor_mass(bits, p.inv_t, zmax), total), mf_verify_q(q[i]));
        if (w == 0.0f) continue;
        best = mf_pack_max(best, mf_pack(mf_key_f32(mf_to_bits(mf_verify_residual_score(w, p.seed, p.position, i))), i));
    }
    best = block_reduce(best, true);
    return best ? mf_unpack_id(best) : block_race(row, p, top_id, zmax, zmax, threshold, MF_NO_TOKEN);
}

// One sampled position with draft x (MF_NO_TOKEN: the bonus position) and the drafter's
// distribution q there (NULL: one-hot at x): whether x is accepted; else *emit is the position's
// own id. The filters are the sampling kernel's, step for step.
__device__ bool sampled_position(const Row &row, const mf_sampling_params &params, uint32_t x, const float *q,
                                 uint32_t *emit) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    const TopCount tc = top_and_count(row);
    const uint64_t top = tc.top, count = tc.count;
    if (count == 0) {
        *emit = MF_NO_TOKEN;
        return false;
    }
    const uint32_t top_id = mf_unpack_id(top);
    const float zmax = mf_scaled(mf_logit_bits(row.logits, row.dtype, top_id), p.inv_t);
    if (!mf_finite_bits(mf_to_bits(zmax))) {  // sample_to_feed answers the top
        *emit = top_id;
        return mf_verify_accepts(1, top_id, x, 0u, 0u, 0u, 0u);
    }
    const uint64_t threshold = block_threshold(row, p, count, zmax);
    if (x != MF_NO_TOKEN) {
        const uint64_t total = block_survivor_mass(row, p, threshold, zmax);
        uint32_t bits;
        const uint64_t mass_x = survives(row, p, threshold, zmax, x, &bits) ? mf_survivor_mass(bits, p.inv_t, zmax) : 0u;
        if (!q) {
            if (mf_verify_accepts(0, top_id, x, p.seed, p.position, mass_x, total)) return true;
        } else {
            const double qx = mf_verify_q(x < row.vocab ? q[x] : 0.0f);
            if (mf_verify_accepts_q(p.seed, p.position, mf_verify_p(mass_x, total), qx)) return true;
            *emit = block_residual_race(row, p, top_id, zmax, threshold, total, q);
            return false;
        }
    }
    *emit = block_race(row, p, top_id, zmax, zmax, threshold, x);
    return false;
}

__global__ void __launch_bounds__(kThreads)
    mf_verify_kernel(const char *logits, int dtype, uint64_t row_bytes, uint32_t vocab, uint32_t k,
                     uint32_t *cells, float *logprobs, const uint32_t *device_drafts,
                     const uint32_t *device_masks, const mf_sampling_params *device_params,
                     bool has_params, const uint32_t *advance, const uint32_t *bitmask, uint32_t bit_words,
                     const float *draft_probs, const __grid_constant__ VerifyInputs in) {
    __shared__ uint32_t ids[MF_MAX_DRAFTS + 1];
    __shared__ float fslots[kThreads / 32];
    __shared__ double dslots[kThreads / 32];
    const uint32_t r = blockIdx.x;
    const uint32_t *x = device_drafts ? device_drafts + (uint64_t)r * k : in.drafts + r * k;
    const uint32_t d = mf_verify_drafts(x, k);
    mf_sampling_params params{};
    if (has_params) params = mf_verify_row_params(device_params ? &device_params[r] : &in.params[r], advance, r);
    const bool sampled = has_params && !mf_plan_sampling(&params).greedy;
    uint32_t n = 0;
    for (uint32_t j = 0; j <= d; ++j) {
        const uint64_t lr = (uint64_t)r * (k + 1) + j;
        const uint32_t *m = device_masks ? device_masks + 2 * lr : in.masks + 2 * lr;
        const Row row{logits + lr * row_bytes, dtype, vocab,
                      mf_row_rule{m[0], m[1], bitmask ? bitmask + lr * bit_words : nullptr}, 0u};
        const uint32_t draft = j < d ? x[j] : MF_NO_TOKEN;
        uint32_t emit = MF_NO_TOKEN;
        bool accepted;
        if (sampled) {
            const float *q = draft_probs && j < d ? draft_probs + ((uint64_t)r * k + j) * vocab : nullptr;
            accepted = sampled_position(row, mf_verify_params_at(&params, j), draft, q, &emit);
        } else {
            emit = mf_unpack_id(block_argmax(row));
            accepted = mf_verify_accepts(1, emit, draft, 0u, 0u, 0u, 0u);
        }
        if (threadIdx.x == 0) ids[n] = accepted ? draft : emit;
        ++n;
        if (!accepted) break;
    }
    __syncthreads();
    if (threadIdx.x == 0) mf_verify_write_cells(cells + (uint64_t)r * (k + 2), k, ids, n);
    if (!logprobs) return;
    for (uint32_t i = 0; i < n; ++i) {  // n is the same in every thread
        const void *row = logits + ((uint64_t)r * (k + 1) + i) * row_bytes;
        float mx = mf_neg_inf();
        for (uint32_t v = threadIdx.x; v < vocab; v += blockDim.x) mx = MaxFloat()(mx, mf_from_bits(mf_logit_bits(row, dtype, v)));
        mx = block_fold(mx, MaxFloat(), fslots);
        double s = 0.0;
        if (mx > mf_neg_inf() && mf_finite_bits(mf_to_bits(mx))) {
            for (uint32_t v = threadIdx.x; v < vocab; v += blockDim.x)
                s += (double)mf_exp_neg(mf_fsub(mf_from_bits(mf_logit_bits(row, dtype, v)), mx));
            s = block_fold(s, Sum(), dslots);
        }
        if (threadIdx.x == 0) {
            const uint32_t id = ids[i];
            const uint32_t bits = id == MF_NO_TOKEN ? 0u : mf_logit_bits(row, dtype, id);
            logprobs[(uint64_t)r * (k + 1) + i] = mf_logprob_finish(id, bits, mx, s);
        }
    }
    if (threadIdx.x == 0)
        for (uint32_t i = n; i < k + 1; ++i) logprobs[(uint64_t)r * (k + 1) + i] = mf_nan();
}

__global__ void mf_resolve_verified_kernel(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                                           uint32_t *out_advance) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    uint32_t id, n;
    mf_verify_resolve(cells + (uint64_t)r * (k + 2), k, &id, &n);
    if (out_ids) out_ids[r] = id;
    if (out_advance) out_advance[r] = n;
}

__global__ void mf_verify_logit_params_kernel(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows,
                                              uint32_t k, mf_sampling_params *out) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * (k + 1)) out[i] = mf_verify_logit_row_params(params, advance, k, i);
}

}  // namespace

cudaError_t launch_verify(const mf_verify_args &a, cudaStream_t stream) {
    const uint64_t esize = mf_dtype_size((int)a.dtype);
    const bool ddrafts = a.flags & MF_VERIFY_DRAFTS_DEVICE, dmasks = a.flags & MF_ARGS_MASKS_DEVICE;
    const bool dparams = a.flags & MF_ARGS_PARAMS_DEVICE;
    const uint32_t per = std::min(kVerifyRowsPerLaunch, kVerifyLogitRowsPerLaunch / (a.k + 1));
    const uint32_t words = mf_bitmask_words(a.vocab);
    for (uint32_t row0 = 0; row0 < a.rows; row0 += per) {
        const uint32_t n = std::min(a.rows - row0, per);
        const uint64_t lr0 = (uint64_t)row0 * (a.k + 1);
        VerifyInputs in;
        if (a.params && !dparams) std::copy(a.params + row0, a.params + row0 + n, in.params);
        if (!ddrafts) std::copy(a.drafts + (uint64_t)row0 * a.k, a.drafts + (uint64_t)(row0 + n) * a.k, in.drafts);
        if (!dmasks) std::copy(a.masks + 2 * lr0, a.masks + 2 * (lr0 + (uint64_t)n * (a.k + 1)), in.masks);
        MF_LAUNCH(n, kThreads, 0, stream, mf_verify_kernel)(
            static_cast<const char *>(a.logits) + lr0 * a.row_stride * esize, (int)a.dtype, a.row_stride * esize,
            a.vocab, a.k, a.cells + (uint64_t)row0 * (a.k + 2), a.logprobs ? a.logprobs + lr0 : nullptr,
            ddrafts ? a.drafts + (uint64_t)row0 * a.k : nullptr, dmasks ? a.masks + 2 * lr0 : nullptr,
            dparams ? a.params + row0 : nullptr, a.params != nullptr, a.advance ? a.advance + row0 : nullptr,
            a.bitmask ? a.bitmask + lr0 * words : nullptr,
            words, a.draft_probs ? a.draft_probs + (uint64_t)row0 * a.k * a.vocab : nullptr, in);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t launch_resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                                    uint32_t *out_advance, cudaStream_t stream) {
    MF_LAUNCH((rows + 127) / 128, 128, 0, stream, mf_resolve_verified_kernel)(cells, rows, k, out_ids, out_advance);
    return cudaGetLastError();
}

cudaError_t launch_verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows,
                                       uint32_t k, mf_sampling_params *out, cudaStream_t stream) {
    const uint32_t n = rows * (k + 1);
    MF_LAUNCH((n + 127) / 128, 128, 0, stream, mf_verify_logit_params_kernel)(params, advance, rows, k, out);
    return cudaGetLastError();
}

}  // namespace MF_KERNELS
}  // namespace mf
