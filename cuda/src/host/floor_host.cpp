// The floors of the bench (mf_host_floor): loops that do only the rules' own per-id arithmetic
// over float32 rows, eight lanes at a time, with no bookkeeping (no masks, no ids, no thresholds,
// no lists): what a host kernel could not go below on the same rows. Bench-only; nothing reads
// their results but a checksum that keeps the compiler from dropping the work.
#include <vector>

#include "kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/sample_rule.h"
#include "queue.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include "vec_exp.hpp"
#include "vec_philox.hpp"
#include "vec_stats.hpp"
#define MF_FLOOR_X86 1
#endif

namespace mf::host {
namespace {

#ifdef MF_FLOOR_X86
#define MF_FLOOR_AVX2 __attribute__((target("avx2")))

MF_FLOOR_AVX2 float hsum(__m256 v) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    float s = 0.0f;
    for (float x : lanes) s += x;
    return s;
}

// logprob_rule.h's (m, s) work: the max, then the fixed-order sum, by the logprob kernel's own
// loops (vec_stats.hpp).
MF_FLOOR_AVX2 double stats_floor(const float *p, uint32_t n) {
    const float top = row_max8(p, n);
    return stats_sum8(p, n, top);
}

// sample_rule.h's per-id work of a sampled row at temperature 1, 32 ids (eight Philox blocks) at
// a time: the counter hash of every id; with `log`, the race's score z + g and the greatest one;
// with `mass`, after the max pass, every id's top_p weight floor(exp(z - zmax) * 2**39) summed.
// The words are paired with the ids as the rounds leave them (a fixed permutation, no shuffle).
MF_FLOOR_AVX2 double sample_floor(const float *p, uint32_t n, bool log, bool mass) {
    const PhiloxKeys keys = philox_keys(0x5EEDu);
    const __m256 zmax = _mm256_set1_ps(mass ? row_max8(p, n) : 0.0f), scale = _mm256_set1_ps(549755813888.0f);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256d magic = _mm256_set1_pd(4503599627370496.0);  // 2**52: a double's mantissa as the integer
    __m256 best = _mm256_set1_ps(mf_neg_inf());
    __m256i words_x = _mm256_setzero_si256(), total = _mm256_setzero_si256();
    uint32_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const Philox8 c = philox8(keys, 7u, i);
        const __m256i all[4] = {philox_pair(c.a0, c.a1), philox_pair(c.a2, c.a3), philox_pair(c.b0, c.b1),
                                philox_pair(c.b2, c.b3)};
        for (int h = 0; h < 4; ++h) {
            const __m256i words = all[h];
            const __m256 z = _mm256_mul_ps(_mm256_loadu_ps(p + i + 8 * h), one);  // z = logit / temperature
            if (log) best = _mm256_max_ps(best, _mm256_add_ps(z, gumbel8(words)));
            else words_x = _mm256_xor_si256(words_x, words);
            if (mass) {
                const __m256 e = _mm256_mul_ps(exp_neg8(_mm256_sub_ps(z, zmax)), scale);
                // floor(e * 2**39) < 2**39: as float64 rounded toward zero, then its integer.
                const __m256d lo = _mm256_round_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)), _MM_FROUND_TO_ZERO),
                              hi = _mm256_round_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)), _MM_FROUND_TO_ZERO);
                total = _mm256_add_epi64(total, _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(lo, magic)),
                                                                 _mm256_castpd_si256(magic)));
                total = _mm256_add_epi64(total, _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(hi, magic)),
                                                                 _mm256_castpd_si256(magic)));
            }
        }
    }
    alignas(32) uint32_t wx[8];
    alignas(32) uint64_t tot[4];
    _mm256_store_si256((__m256i *)wx, words_x);
    _mm256_store_si256((__m256i *)tot, total);
    double sum = (log ? hsum(best) : 0.0) + (double)(tot[0] + tot[1] + tot[2] + tot[3]);
    for (uint32_t x : wx) sum += x;
    for (; i < n; ++i) sum += mf_gumbel(0x5EEDu, 7, i);  // the tail, scalar
    return sum;
}
#endif

}  // namespace
}  // namespace mf::host

extern "C" double mf_host_floor(unsigned what, const float *logits, uint32_t rows, uint32_t vocab) {
    using namespace mf::host;
#ifdef MF_FLOOR_X86
    if (!logits || !__builtin_cpu_supports("avx2") || what < 1u || what > MF_HOST_FLOOR_TOP_P_LOG) return mf_nan();
    std::vector<double> out(rows);
    parallel_rows(rows, [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard ieee;
        for (uint32_t r = begin; r < end; ++r) {
            const float *p = logits + (size_t)r * vocab;
            out[r] = what == MF_HOST_FLOOR_STATS ? stats_floor(p, vocab)
                                                 : sample_floor(p, vocab, what == MF_HOST_FLOOR_RACE || what == MF_HOST_FLOOR_TOP_P_LOG,
                                                                what >= MF_HOST_FLOOR_TOP_P);
        }
    });
    double sum = 0.0;
    for (double x : out) sum += x;
    return sum;
#else
    (void)what, (void)logits, (void)rows, (void)vocab;
    return mf_nan();
#endif
}
