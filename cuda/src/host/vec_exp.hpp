// sample_rule.h's mf_exp_neg and mf_log_pos on 8 AVX2 lanes, for the sampler's masses and race
// scores and the logprob sums.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace mf::host {

// sample_rule.h's mf_exp_neg on 8 lanes: the same IEEE operations in the same order (no FMA in
// this target), so the same bits.
__attribute__((target("avx2"))) inline __m256 exp_neg8(__m256 x) {
    const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-86.0f), _CMP_GE_OQ);  // false for NaN
    __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269502f)), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                             _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-06f)));
    __m256 p = _mm256_set1_ps(1.38888889e-03f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.33333333e-03f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.16666667e-02f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.66666667e-01f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    const __m256i k = _mm256_cvttps_epi32(n);
    const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(k, 23));
    const __m256i keep = _mm256_and_si256(_mm256_castps_si256(ok), _mm256_cmpgt_epi32(k, _mm256_set1_epi32(-126)));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, keep));
}

// sample_rule.h's mf_log_pos on 8 lanes (positive normal inputs): the same IEEE operations in the
// same order, the division included (vdivps rounds as '/' does), so the same bits.
__attribute__((target("avx2"))) inline __m256 log_pos8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i mant = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF));
    const __m256i big = _mm256_cmpgt_epi32(mant, _mm256_set1_epi32(0x3504F3));  // m > sqrt(2): halve it
    const __m256i e = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)), big);
    const __m256 m = _mm256_castsi256_ps(
        _mm256_or_si256(mant, _mm256_blendv_epi8(_mm256_set1_epi32(127 << 23), _mm256_set1_epi32(126 << 23), big)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 s = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
    const __m256 z = _mm256_mul_ps(s, s);
    __m256 q = _mm256_set1_ps(0.111111111f);
    q = _mm256_add_ps(_mm256_mul_ps(q, z), _mm256_set1_ps(0.142857143f));
    q = _mm256_add_ps(_mm256_mul_ps(q, z), _mm256_set1_ps(0.2f));
    q = _mm256_add_ps(_mm256_mul_ps(q, z), _mm256_set1_ps(0.333333333f));
    q = _mm256_add_ps(_mm256_mul_ps(q, z), one);
    const __m256 logm = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(2.0f), s), q);
    const __m256 fe = _mm256_cvtepi32_ps(e);
    return _mm256_add_ps(_mm256_mul_ps(fe, _mm256_set1_ps(0.693145751953125f)),
                         _mm256_add_ps(logm, _mm256_mul_ps(fe, _mm256_set1_ps(1.42860677e-06f))));
}

// sample_rule.h's mf_uniform of 8 random words, then mf_gumbel's -log(-log U).
__attribute__((target("avx2"))) inline __m256 gumbel8(__m256i words) {
    const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(words, 8)), _mm256_set1_ps(0.5f)),
                                   _mm256_set1_ps(5.96046448e-08f));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_xor_ps(log_pos8(_mm256_xor_ps(log_pos8(u), sign)), sign);
}

}  // namespace mf::host
#endif
