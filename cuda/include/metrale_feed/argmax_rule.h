/* The masked-argmax order and the reference logits, shared verbatim by the CUDA kernels and the
 * host backend so that the host tests check the very rule the GPU runs.
 *
 * Each value becomes an ordered 32-bit key (NaN lowest, -0.0 == +0.0, then IEEE order), and a
 * candidate is packed as (key << 32) | ~id: the greatest packed word is the greatest value with
 * the lowest id, and 0 (no candidate) unpacks to MF_NO_TOKEN. */
#ifndef METRALE_FEED_ARGMAX_RULE_H
#define METRALE_FEED_ARGMAX_RULE_H

#include <stdint.h>

#if defined(__CUDACC__)
#define MF_HD __host__ __device__ __forceinline__
#else
#define MF_HD static inline
#endif

/* Ordered key of IEEE bits with `sign` the sign bit and `inf` the +inf pattern of the width. */
MF_HD uint32_t mf_ordered_key(uint32_t bits, uint32_t sign, uint32_t inf) {
    uint32_t mag = bits & (sign - 1u);
    if (mag > inf) return 0u;                   /* NaN: below every number */
    if (mag == 0u) return sign;                 /* -0.0 and +0.0 meet in the middle */
    return (bits & sign) ? (sign - mag) : (sign + mag);
}

MF_HD uint32_t mf_key_f32(uint32_t bits) { return mf_ordered_key(bits, 0x80000000u, 0x7F800000u); }
MF_HD uint32_t mf_key_f16(uint16_t bits) { return mf_ordered_key(bits, 0x8000u, 0x7C00u); }
MF_HD uint32_t mf_key_bf16(uint16_t bits) { return mf_ordered_key(bits, 0x8000u, 0x7F80u); }

MF_HD uint64_t mf_pack(uint32_t key, uint32_t id) { return ((uint64_t)key << 32) | (uint32_t)~id; }
MF_HD uint32_t mf_unpack_id(uint64_t packed) { return ~(uint32_t)packed; }
MF_HD uint64_t mf_pack_max(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* Bytes of one logit of an mf_dtype (feed.h): the one source of that fact; 0 for an unknown one. */
MF_HD uint32_t mf_dtype_size(int dtype) { return dtype == 0 ? 4u : (dtype == 1 || dtype == 2) ? 2u : 0u; }

/* Candidates of a row are [0, vocab) without its two mask ids: at most three spans. A mask id
 * >= vocab masks nothing (device-resident masks are not checked before the kernel runs). */
typedef struct mf_spans {
    uint32_t lo[3];
    uint32_t hi[3];
    uint32_t count;
} mf_spans;

MF_HD mf_spans mf_candidate_spans(uint32_t vocab, uint32_t m0, uint32_t m1) {
    mf_spans s;
    uint32_t a = m0 < m1 ? m0 : m1, b = m0 < m1 ? m1 : m0; /* NO_TOKEN sorts last, >= vocab */
    uint32_t start = 0u;
    s.count = 0u;
    uint32_t cut[2] = {a, b};
    for (int i = 0; i < 2; ++i) {
        uint32_t c = cut[i];
        if (c >= vocab || c < start) continue; /* unused, or the same id twice */
        if (c > start) { s.lo[s.count] = start; s.hi[s.count] = c; ++s.count; }
        start = c + 1u;
    }
    if (start < vocab) { s.lo[s.count] = start; s.hi[s.count] = vocab; ++s.count; }
    return s;
}

/* ---- the one per-row reduction ----
 * A row's rule is its two mask ids and, optionally, its bitmask words (xgrammar's convention: bit
 * v % 32 of word v / 32 set means id v is allowed). Everything that picks one id per row (the
 * argmax, and the sampler's race, whose key is a score instead of the logit) is the maximum of
 * packed words over the allowed ids, so partial maxima over any split of the ids (threads, blocks,
 * ranks) combine with mf_pack_max into the same answer. */
typedef struct mf_row_rule {
    uint32_t m0, m1;
    const uint32_t *bits; /* the row's ceil(vocab / 32) words, or NULL: every id allowed */
} mf_row_rule;

MF_HD uint32_t mf_bitmask_words(uint32_t vocab) { return (vocab + 31u) >> 5; }

MF_HD int mf_bit_allowed(const uint32_t *bits, uint32_t v) {
    return bits == 0 || ((bits[v >> 5] >> (v & 31u)) & 1u) != 0u;
}

/* The ordered key of element i of a row of `dtype` (0 f32, 1 f16, 2 bf16: mf_dtype's codes). */
MF_HD uint32_t mf_key_at(const void *row, int dtype, uint32_t i) {
    if (dtype == 0) return mf_key_f32(((const uint32_t *)row)[i]);
    uint16_t b = ((const uint16_t *)row)[i];
    return dtype == 1 ? mf_key_f16(b) : mf_key_bf16(b);
}

/* The packed maximum over the allowed ids of [lo, hi): 0 (NO_TOKEN) when there is none. The
 * portable host path is exactly this; vector and GPU paths are this split over lanes/threads. */
MF_HD uint64_t mf_reduce_row(const void *row, int dtype, uint32_t lo, uint32_t hi,
                             const mf_row_rule *rule) {
    uint64_t best = 0u;
    for (uint32_t i = lo; i < hi; ++i)
        if (i != rule->m0 && i != rule->m1 && mf_bit_allowed(rule->bits, i))
            best = mf_pack_max(best, mf_pack(mf_key_at(row, dtype, i), i));
    return best;
}

/* ---- the reference model's logits (docs/router.md, bit for bit) ---- */
#define MF_FNV_OFFSET 0x811C9DC5u
#define MF_FNV_PRIME 0x01000193u

MF_HD uint32_t mf_fnv_step(uint32_t h, uint32_t token) { return (h ^ token) * MF_FNV_PRIME; }

MF_HD uint32_t mf_fmix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    x ^= x >> 16;
    return x;
}

/* The logit as float32 bits: (fmix32(h + v*golden) >> 8) / 2**24, exact in float32. */
MF_HD float mf_reference_logit(uint32_t h, uint32_t v) {
    return (float)(mf_fmix32(h + v * 0x9E3779B9u) >> 8) * (1.0f / 16777216.0f);
}

/* float32 -> bfloat16 bits, round to nearest even, for finite values (infinity where they
 * round up into it). */
MF_HD uint16_t mf_f32_to_bf16(uint32_t bits) {
    uint32_t lsb = (bits >> 16) & 1u;
    return (uint16_t)((bits + 0x7FFFu + lsb) >> 16);
}

/* float32 bits -> float16 bits, round to nearest even, for every value: overflow to inf, NaN a
 * quiet NaN, tiny values to subnormals or zero. */
MF_HD uint16_t mf_f32_to_f16(uint32_t bits) {
    uint32_t sign = (bits >> 16) & 0x8000u, mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (mag >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520: rounds to inf */
    if (mag < 0x33000001u) return (uint16_t)sign;              /* <= 2**-25: rounds to zero */
    int32_t exp = (int32_t)(mag >> 23) - 127 + 15;
    uint32_t mant = mag & 0x7FFFFFu;
    if (exp <= 0) { /* a subnormal half */
        mant |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - exp);
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u))) ++half;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)exp << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half; /* carries into exp correctly */
    return (uint16_t)(sign | half);
}

#endif
