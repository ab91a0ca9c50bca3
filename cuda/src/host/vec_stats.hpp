// logprob_rule.h's row statistics on 8 AVX2 lanes: the row's max and its fixed-order sum of
// exponentials. One definition for the logprob kernel (logprob_host.cpp) and the bench's floor
// (floor_host.cpp), so the floor times the kernel's own loop.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "metrale_feed/logprob_rule.h"
#include "vec_exp.hpp"

namespace mf::host {

// The greatest value of a float32 row (NaN never wins: a NaN lane keeps the running max).
__attribute__((target("avx2"))) inline float row_max8(const float *p, uint32_t n) {
    __m256 top = _mm256_set1_ps(mf_neg_inf());
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) top = _mm256_max_ps(_mm256_loadu_ps(p + i), top);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    float m = mf_neg_inf();
    for (float x : lanes) m = x > m ? x : m;
    for (; i < n; ++i) m = p[i] > m ? p[i] : m;
    return m;
}

// The sum of exp(x - m) over a float32 row in logprob_rule.h's order: MF_STATS_LANES strided
// float64 lanes, then mf_stats_fold. The lanes are summed 32 at a time: for each strip of 32
// lanes, eight vectors of four float64 sums stay in registers while the strip walks every full
// block of MF_STATS_LANES ids (from cache after the first; an array of 256 sums in L1 would cost
// a load and a store an add, more than the rereads). exp_neg8 gives mf_exp_neg's bits; each
// lane's adds stay in id order, and the ids past the last full block are added last, as the
// portable loop adds them.
__attribute__((target("avx2"))) inline double stats_sum8(const float *p, uint32_t n, float m) {
    alignas(32) double lanes[MF_STATS_LANES];
    const __m256 mv = _mm256_set1_ps(m);
    const uint32_t full = n / MF_STATS_LANES * MF_STATS_LANES;
    for (uint32_t j = 0; j < MF_STATS_LANES; j += 32) {
        __m256d acc[8];
        for (__m256d &a : acc) a = _mm256_setzero_pd();
        for (uint32_t base = 0; base < full; base += MF_STATS_LANES)
            for (int q = 0; q < 4; ++q) {
                const __m256 e = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + base + j + 8 * q), mv));
                acc[2 * q] = _mm256_add_pd(acc[2 * q], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
                acc[2 * q + 1] = _mm256_add_pd(acc[2 * q + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
            }
        for (int q = 0; q < 8; ++q) _mm256_store_pd(lanes + j + 4 * q, acc[q]);
    }
    for (uint32_t i = full; i < n; ++i) lanes[i - full] += (double)mf_exp_neg(mf_fsub(p[i], m));
    return mf_stats_fold(lanes);
}

}  // namespace mf::host
#endif
