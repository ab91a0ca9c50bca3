// Sampling into the feed cells: cells[r] = the id sample_rule.h draws for row r. One block per row,
// every pass a strided scan of the row; the top_k and top_p thresholds come from a radix select
// over the packed words (eight 8-bit digits, a 256-bin histogram in shared memory per digit),
// never a sort of the vocabulary. Integer histograms and sums make the answer independent of the
// order threads add in, so it is bit for bit the host kernel's (sample_host.cpp).
#include <algorithm>

#include "cuda/block.cuh"
#include "cuda/kernels.hpp"
#include "metrale_feed/sample_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kThreads = 256;
constexpr uint32_t kSampleRowsPerLaunch = 256;  // 256 * (32 + 8) bytes of parameters

struct SampleInputs {
    mf_sampling_params params[kSampleRowsPerLaunch];
    uint32_t masks[2 * kSampleRowsPerLaunch];
};

// The block's greatest packed word, or its sum (every thread gets it). The sums are of integers
// (counts, masses in fixed point), so their order cannot change a bit.
__device__ unsigned long long block_reduce(unsigned long long v, bool is_max) {
    __shared__ unsigned long long slots[kThreads / 32];
    return is_max ? block_fold(v, MaxPacked(), slots) : block_fold(v, Sum(), slots);
}

// A row, or a slice of a split row: local ids, global mask ids (shifted into local ones), bitmask
// bits and Philox draws at `base + id`.
struct Row {
    const void *logits;
    int dtype;
    uint32_t vocab;
    mf_row_rule rule;
    uint32_t base;
    __device__ bool candidate(uint32_t i, uint32_t *bits) const {
        if (i == rule.m0 || i == rule.m1 || !mf_bit_allowed(rule.bits, base + i)) return false;
        *bits = mf_logit_bits(logits, dtype, i);
        return mf_finite_bits(*bits);
    }
};

// The smallest packed threshold t with weight(packed >= t) >= target over the candidates with
// packed >= floor; weight is 1 (use_mass false) or the mass exp(z - zmax) in 2**-39 units.
__device__ uint64_t block_select(const Row &row, uint64_t floor, bool use_mass, float inv_t,
                                 float zmax, uint64_t target) {
    __shared__ unsigned long long bins[256];
    __shared__ unsigned long long above, prefix;
    if (threadIdx.x == 0) { above = 0ull; prefix = 0ull; }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (uint32_t d = threadIdx.x; d < 256; d += blockDim.x) bins[d] = 0ull;
        __syncthreads();
        const uint64_t want = prefix;
        for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x) {
            uint32_t bits;
            if (!row.candidate(i, &bits)) continue;
            const uint64_t packed = mf_pack(mf_key_f32(bits), i);
            if (packed < floor) continue;
            if (shift < 56 && (packed >> (shift + 8)) != (want >> (shift + 8))) continue;
            const uint64_t w = use_mass ? mf_mass(mf_exp_neg(mf_fsub(
                                              mf_scaled(bits, inv_t), zmax)))
                                        : 1ull;
            if (w) atomicAdd(&bins[(packed >> shift) & 0xFFu], (unsigned long long)w);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint64_t a = above;
            const uint32_t digit = mf_select_digit(reinterpret_cast<const uint64_t *>(bins), &a, target);
            above = a;
            prefix = want | ((uint64_t)digit << shift);
        }
        __syncthreads();
    }
    return prefix;
}

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
        uint64_t best = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x)
            if (i != row.rule.m0 && i != row.rule.m1 && mf_bit_allowed(row.rule.bits, id_base + i))
                best = mf_pack_max(best, mf_pack(mf_key_at(row.logits, dtype, i), i));
        best = block_reduce(best, true);
        if (threadIdx.x == 0) cells[0] = mf_unpack_id(best);
        return;
    }
    uint64_t top = 0, count = 0;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        uint32_t bits;
        if (!row.candidate(i, &bits)) continue;
        top = mf_pack_max(top, mf_pack(mf_key_f32(bits), i));
        ++count;
    }
    top = block_reduce(top, true);
    count = block_reduce(count, false);
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
    uint64_t threshold = 0;
    if (p.top_k && count > p.top_k)
        threshold = block_select(row, 0, false, p.inv_t, zmax, p.top_k);
    if (p.use_top_p) {
        uint64_t total = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
            uint32_t bits;
            if (!row.candidate(i, &bits) || mf_pack(mf_key_f32(bits), i) < threshold) continue;
            total += mf_mass(mf_exp_neg(mf_fsub(mf_scaled(bits, p.inv_t), zmax)));
        }
        total = block_reduce(total, false);
        threshold = block_select(row, threshold, true, p.inv_t, zmax,
                                 mf_top_p_target(total, p.top_p));
    }
    // The race. The top candidate's score bounds the others: z + MF_GUMBEL_BOUND below it cannot win.
    const float s0 = mf_fadd(zmax, mf_gumbel(p.seed, p.position, id_base + top_id));
    uint64_t best = mf_pack(mf_key_f32(mf_to_bits(s0)), top_id);
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        uint32_t bits;
        if (i == top_id || !row.candidate(i, &bits)) continue;
        const float z = mf_scaled(bits, p.inv_t);
        if (mf_fadd(z, MF_GUMBEL_BOUND) < s0) continue;
        if (threshold && mf_pack(mf_key_f32(bits), i) < threshold) continue;
        if (p.use_min_p && !(mf_exp_neg(mf_fsub(z, zmax)) >= p.min_p)) continue;
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, id_base + i));
        best = mf_pack_max(best, mf_pack(mf_key_f32(mf_to_bits(score)), i));
    }
    best = block_reduce(best, true);
    if (threadIdx.x == 0) cells[0] = mf_unpack_id(best);
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
