// The sampler's block-wide pieces, shared by the sampling kernel (sample_feed.cu) and the
// verifier (verify_feed.cu): a fixed-shape block reduction, a row's candidates, and the radix
// select of the top_k/top_p thresholds (sample_rule.h). Blocks of kThreads threads.
#pragma once

#include "metrale_feed/sample_rule.h"

namespace mf {
namespace cudak {
namespace {

constexpr int kThreads = 256;

__device__ unsigned long long block_reduce(unsigned long long v, bool is_max) {
    __shared__ unsigned long long slots[kThreads / 32];
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long other = __shfl_xor_sync(0xFFFFFFFFu, v, o);
        v = is_max ? mf_pack_max(v, other) : v + other;
    }
    __syncthreads();  // slots may still be read by a previous reduction
    if (lane == 0) slots[warp] = v;
    __syncthreads();
    v = is_max ? 0ull : 0ull;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) v = is_max ? mf_pack_max(v, slots[w]) : v + slots[w];
    return v;  // every thread has it
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

}  // namespace
}  // namespace cudak
}  // namespace mf
