// The sampler's block-wide pieces, shared by the sampling kernel (sample_feed.cu) and the
// verifier (verify_feed.cu): a fixed-shape block reduction, a row's candidates, and the radix
// select of the top_k/top_p thresholds (sample_rule.h). Blocks of kThreads threads.
#pragma once

#include "cuda/block.cuh"
#include "metrale_feed/sample_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kThreads = 256;

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

// The argmax rule over the row's allowed ids, whatever their values (a packed word; 0: every id
// masked); every thread gets it.
__device__ uint64_t block_argmax(const Row &row) {
    uint64_t best = 0;
    for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x)
        if (i != row.rule.m0 && i != row.rule.m1 && mf_bit_allowed(row.rule.bits, row.base + i))
            best = mf_pack_max(best, mf_pack(mf_key_at(row.logits, row.dtype, i), i));
    return block_reduce(best, true);
}

// The row's greatest candidate (a packed word, 0: none) and how many it has; every thread gets both.
struct TopCount {
    uint64_t top, count;
};
__device__ TopCount top_and_count(const Row &row) {
    uint64_t top = 0, count = 0;
    for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x) {
        uint32_t bits;
        if (!row.candidate(i, &bits)) continue;
        top = mf_pack_max(top, mf_pack(mf_key_f32(bits), i));
        ++count;
    }
    top = block_reduce(top, true);
    return TopCount{top, block_reduce(count, false)};
}

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
}  // namespace MF_KERNELS
}  // namespace mf
