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

// Philox's ten rounds on two groups of four blocks, each word in the low half of a 64-bit lane:
// _mm256_mul_epu32 then gives the full 64-bit product in place (the high halves of the inputs
// are ignored, so what they hold never matters). One group's rounds are a chain of dependent
// multiplies; two side by side keep the multipliers busy. Scalars, not arrays: the compiler then
// keeps all eight words in registers. (a0..a3, b0..b3): each group's words 0-3, in and out.
struct Philox8 {
    __m256i a0, a1, a2, a3, b0, b1, b2, b3;
};
MF_VEC_AVX2 inline void philox_rounds(Philox8 &c, const PhiloxKeys &k) {
    const __m256i m0 = _mm256_set1_epi64x(0xD2511F53u), m1 = _mm256_set1_epi64x(0xCD9E8D57u);
    __m256i a0 = c.a0, a1 = c.a1, a2 = c.a2, a3 = c.a3, b0 = c.b0, b1 = c.b1, b2 = c.b2, b3 = c.b3;
    for (int round = 0; round < 10; ++round) {
        const __m256i pa0 = _mm256_mul_epu32(a0, m0), pa1 = _mm256_mul_epu32(a2, m1);
        const __m256i pb0 = _mm256_mul_epu32(b0, m0), pb1 = _mm256_mul_epu32(b2, m1);
        a0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pa1, 32), a1), k.k0[round]);
        b0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pb1, 32), b1), k.k0[round]);
        a2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pa0, 32), a3), k.k1[round]);
        b2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pb0, 32), b3), k.k1[round]);
        a1 = pa1;
        b1 = pb1;
        a3 = pa0;
        b3 = pb0;
    }
    c = Philox8{a0, a1, a2, a3, b0, b1, b2, b3};
}

// Blocks (i / 4 + b, position, 0, 0) for b = 0..7 through the rounds (i a multiple of 4).
MF_VEC_AVX2 inline Philox8 philox8(const PhiloxKeys &k, uint32_t position, uint32_t i) {
    const __m256i base = _mm256_set1_epi64x(i >> 2), pos = _mm256_set1_epi64x(position), zero = _mm256_setzero_si256();
    Philox8 c{_mm256_add_epi64(base, _mm256_setr_epi64x(0, 1, 2, 3)), pos, zero, zero,
              _mm256_add_epi64(base, _mm256_setr_epi64x(4, 5, 6, 7)), pos, zero, zero};
    philox_rounds(c, k);
    return c;
}

// A group's words 0 and 1 (w 0) or 2 and 3 (w 2) of its four blocks as eight 32-bit lanes:
// [block 0 word w, block 0 word w + 1, block 1 word w, ...].
MF_VEC_AVX2 inline __m256i philox_pair(__m256i lo_word, __m256i hi_word) {
    return _mm256_blend_epi32(lo_word, _mm256_slli_epi64(hi_word, 32), 0xAA);
}

// The 32 random words of ids [i, i + 32) (i a multiple of 4), in id order: philox.h's blocks
// (i / 4 + b, position, 0, 0) for b = 0..7, as [block 0 words 0-3 | block 1 ...] in out[0], blocks
// 2 and 3 in out[1], and so on.
MF_VEC_AVX2 inline void philox32(const PhiloxKeys &k, uint32_t position, uint32_t i, __m256i out[4]) {
    const Philox8 c = philox8(k, position, i);
    const __m256i t[4] = {philox_pair(c.a0, c.a1), philox_pair(c.a2, c.a3), philox_pair(c.b0, c.b1),
                          philox_pair(c.b2, c.b3)};
    for (int n = 0; n < 2; ++n) {  // per block: w0 w1 | w2 w3 -> id order
        const __m256i lo = _mm256_unpacklo_epi64(t[2 * n], t[2 * n + 1]), hi = _mm256_unpackhi_epi64(t[2 * n], t[2 * n + 1]);
        out[2 * n] = _mm256_permute2x128_si256(lo, hi, 0x20);
        out[2 * n + 1] = _mm256_permute2x128_si256(lo, hi, 0x31);
    }
}

}  // namespace mf::host
#endif
