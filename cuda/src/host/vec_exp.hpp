// sample_rule.h's mf_exp_neg on 8 AVX2 lanes, for the sampler's masses and the logprob sums.
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

}  // namespace mf::host
#endif
