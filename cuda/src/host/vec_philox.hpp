// philox.h's Philox4x32-10 on AVX2 lanes: four blocks at a time, the same integer operations, so
// the same words as mf_philox_bits (tests compare the sampler's paths).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <stdint.h>

#define MF_VEC_AVX2 __attribute__((target("avx2")))

namespace mf::host {

// The round keys of a seed: philox.h's Weyl schedule, broadcast once per row.
struct PhiloxKeys {
    __m256i k0[10], k1[10];
};

MF_VEC_AVX2 inline PhiloxKeys philox_keys(uint64_t seed) {
    PhiloxKeys k;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        k.k0[round] = _mm256_set1_epi64x(k0);
        k.k1[round] = _mm256_set1_epi64x(k1);
    }
    return k;
}

// Four Philox blocks, each word in the low half of a 64-bit lane: _mm256_mul_epu32 then gives
// the full 64-bit product in place (the high halves of the inputs are ignored, so what they
// hold never matters). Returns the 16 words in id order: [block 0 words 0-3 | block 1 ...] in
// out[0], blocks 2 and 3 in out[1].
MF_VEC_AVX2 inline void philox4(__m256i c0, __m256i c1, const PhiloxKeys &k, __m256i out[2]) {
    const __m256i m0 = _mm256_set1_epi64x(0xD2511F53u), m1 = _mm256_set1_epi64x(0xCD9E8D57u);
    __m256i c2 = _mm256_setzero_si256(), c3 = c2;
    for (int round = 0; round < 10; ++round) {
        const __m256i p0 = _mm256_mul_epu32(c0, m0), p1 = _mm256_mul_epu32(c2, m1);
        c0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c1), k.k0[round]);
        c1 = p1;
        c2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c3), k.k1[round]);
        c3 = p0;
    }
    const __m256i t01 = _mm256_blend_epi32(c0, _mm256_slli_epi64(c1, 32), 0xAA);  // per block: w0 w1
    const __m256i t23 = _mm256_blend_epi32(c2, _mm256_slli_epi64(c3, 32), 0xAA);  // per block: w2 w3
    const __m256i lo = _mm256_unpacklo_epi64(t01, t23), hi = _mm256_unpackhi_epi64(t01, t23);
    out[0] = _mm256_permute2x128_si256(lo, hi, 0x20);
    out[1] = _mm256_permute2x128_si256(lo, hi, 0x31);
}

// The 32 random words of ids [i, i + 32) (i a multiple of 4), in id order: philox.h's blocks
// (i / 4 + b, position, 0, 0) for b = 0..7.
MF_VEC_AVX2 inline void philox32(const PhiloxKeys &k, uint32_t position, uint32_t i, __m256i out[4]) {
    const __m256i base = _mm256_set1_epi64x(i >> 2), pos = _mm256_set1_epi64x(position);
    philox4(_mm256_add_epi64(base, _mm256_setr_epi64x(0, 1, 2, 3)), pos, k, out);
    philox4(_mm256_add_epi64(base, _mm256_setr_epi64x(4, 5, 6, 7)), pos, k, out + 2);
}

}  // namespace mf::host
#endif
