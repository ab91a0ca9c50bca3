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

// What a select weighs a candidate: 1 (top_k), or its mass against the row's zmax (top_p).
__device__ uint64_t select_weight(bool use_mass, uint32_t bits, float inv_t, float zmax) {
    return use_mass ? mf_survivor_mass(bits, inv_t, zmax) : 1ull;
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
            const uint64_t w = select_weight(use_mass, bits, inv_t, zmax);
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

// A sampled row's top_k then top_p threshold on the packed word (0: nothing cut), sample_rule.h's:
// `count` candidates, the greatest scaled logit zmax (finite).
__device__ uint64_t block_threshold(const Row &row, const mf_sample_plan &p, uint64_t count, float zmax) {
    uint64_t threshold = 0;
    if (p.top_k && count > p.top_k) threshold = block_select(row, 0, false, p.inv_t, zmax, p.top_k);
    if (p.use_top_p) {
        uint64_t total = 0;
        for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x) {
            uint32_t bits;
            if (!row.candidate(i, &bits) || mf_pack(mf_key_f32(bits), i) < threshold) continue;
            total += mf_survivor_mass(bits, p.inv_t, zmax);
        }
        total = block_reduce(total, false);
        threshold = block_select(row, threshold, true, p.inv_t, zmax, mf_top_p_target(total, p.top_p));
    }
    return threshold;
}

// Whether local id `i` of the row survives the filters (mf_survives), and its logit `bits` then.
__device__ bool survives(const Row &row, const mf_sample_plan &p, uint64_t threshold, float zmax, uint32_t i,
                         uint32_t *bits) {
    return i < row.vocab && row.candidate(i, bits) && mf_survives(*bits, i, threshold, &p, zmax);
}

// The integer mass of the row's survivors (sample_rule.h's masses, summed as integers); every
// thread gets it. A verify weighs its draft against it (verify_rule.h), whole or one slice's.
__device__ uint64_t block_survivor_mass(const Row &row, const mf_sample_plan &p, uint64_t threshold, float zmax) {
    uint64_t total = 0;
    for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x) {
        uint32_t bits;
        if (survives(row, p, threshold, zmax, i, &bits)) total += mf_survivor_mass(bits, p.inv_t, zmax);
    }
    return block_reduce(total, false);
}

// The race over the row's survivors (mf_survives: packed >= threshold, min_p against zmax) other
// than `skip` (MF_NO_TOKEN: none skipped): sample_rule.h's score z + Gumbel at each global id
// (row.base + id). The top candidate `top_id`, whose scaled logit is `ztop`, races first when it
// is not skipped: its score bounds which others can still win. The winner's local id.
__device__ uint32_t block_race(const Row &row, const mf_sample_plan &p, uint32_t top_id, float ztop, float zmax,
                               uint64_t threshold, uint32_t skip) {
    const bool first = top_id != skip;
    const float s0 = first ? mf_fadd(ztop, mf_gumbel(p.seed, p.position, row.base + top_id)) : mf_neg_inf();
    uint64_t best = first ? mf_pack(mf_key_f32(mf_to_bits(s0)), top_id) : 0ull;
    for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x) {
        uint32_t bits;
        if (i == top_id || i == skip || !row.candidate(i, &bits)) continue;
        const float z = mf_scaled(bits, p.inv_t);
        if (mf_fadd(z, MF_GUMBEL_BOUND) < s0) continue;  // its score cannot beat the top's
        if (!mf_survives(bits, i, threshold, &p, zmax)) continue;
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, row.base + i));
        best = mf_pack_max(best, mf_pack(mf_key_f32(mf_to_bits(score)), i));
    }
    return mf_unpack_id(block_reduce(best, true));
}

}  // namespace
}  // namespace MF_KERNELS
}  // namespace mf
