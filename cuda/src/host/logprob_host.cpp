// Logprob statistics of a row and the combine of partial records, on the CPU (logprob_rule.h).
// The sum of exponentials is accumulated in float64 in a fixed order (per vector lane, then the
// lanes in order), never a sequential float32 sum: the same inputs give the same bits, and the
// error stays ~1e-7 relative at 152k ids.
#include <cmath>
#include <vector>

#include "kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "vec_exp.hpp"

namespace mf::host {
namespace {

RowStats stats_portable(const void *row, int dt, uint32_t n) {
    float m = mf_neg_inf();
    for (uint32_t i = 0; i < n; ++i) {
        const float x = mf_from_bits(mf_logit_bits(row, dt, i));
        if (x > m) m = x;  // false for NaN
    }
    double s = 0.0;
    if (m > mf_neg_inf() && mf_finite_bits(mf_to_bits(m))) {
        double acc[4] = {0.0, 0.0, 0.0, 0.0};  // four chains, summed in order at the end
        for (uint32_t i = 0; i < n; ++i)
            acc[i & 3u] += (double)mf_exp_neg(mf_fsub(mf_from_bits(mf_logit_bits(row, dt, i)), m));
        s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
    return RowStats{m, s};
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2"))) RowStats stats_f32(const float *p, uint32_t n) {
    __m256 top = _mm256_set1_ps(mf_neg_inf());
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) top = _mm256_max_ps(_mm256_loadu_ps(p + i), top);  // NaN keeps `top`
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    float m = mf_neg_inf();
    for (float x : lanes) m = x > m ? x : m;
    for (; i < n; ++i) m = p[i] > m ? p[i] : m;
    if (!(m > mf_neg_inf()) || !mf_finite_bits(mf_to_bits(m))) return RowStats{m, 0.0};
    const __m256 mv = _mm256_set1_ps(m);
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    for (i = 0; i + 16 <= n; i += 16) {
        const __m256 e0 = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + i), mv));
        const __m256 e1 = exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(p + i + 8), mv));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e0)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e0, 1)));
        a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(e1)));
        a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(e1, 1)));
    }
    alignas(32) double d[16];
    _mm256_store_pd(d, a0);
    _mm256_store_pd(d + 4, a1);
    _mm256_store_pd(d + 8, a2);
    _mm256_store_pd(d + 12, a3);
    for (int w = 8; w >= 1; w /= 2)  // pairwise over the 16 lanes, a fixed tree
        for (int j = 0; j < w; ++j) d[j] += d[j + w];
    double s = d[0];
    for (; i < n; ++i) s += (double)mf_exp_neg(mf_fsub(p[i], m));
    return RowStats{m, s};
}
#endif

// The record of row `r` of block `base`, whose blocks lie `stride` records apart.
const mf_partial_record *records_of(const mf_combine_args &a, uint32_t r) {
    return (const mf_partial_record *)a.partials + MF_PARTIAL_HEADER_RECORDS + r;
}

}  // namespace

RowStats row_stats(const void *row, mf_dtype dtype, uint32_t n, bool vector) {
#if defined(__x86_64__) || defined(__i386__)
    if (vector) {
        if (dtype == MF_DTYPE_F32) return stats_f32((const float *)row, n);
        // 16-bit rows widened once (exactly), so one vector path serves every dtype.
        thread_local std::vector<uint32_t> wide;
        wide.resize(n);
        for (uint32_t i = 0; i < n; ++i) wide[i] = mf_logit_bits(row, (int)dtype, i);
        return stats_f32((const float *)wide.data(), n);
    }
#else
    (void)vector;
#endif
    return stats_portable(row, (int)dtype, n);
}

void run_combine(const CombineJob &job) {
    const mf_combine_args &a = job.args;
    IeeeFpGuard ieee;
    const uint32_t fault = mf_check_headers((const mf_partial_header *)a.partials, a.world, a.slice_stride,
                                            a.op, a.rows, a.call, a.vocab);
    *a.fault = fault;
    for (uint32_t r = 0; r < a.rows; ++r) {
        const mf_partial_record *rec = records_of(a, r);
        uint32_t id = MF_NO_TOKEN, bits = 0;
        float m = mf_neg_inf();
        double s = 0.0;
        if (!fault) {
            mf_sample_plan plan;
            const bool sampled = !job.params.empty() && !(plan = mf_plan_sampling(&job.params[r])).greedy;
            id = mf_combine_pick(rec, a.world, a.slice_stride, sampled ? &plan : nullptr);
            for (uint32_t w = 0; w < a.world; ++w)
                if (id != MF_NO_TOKEN && rec[(uint64_t)w * a.slice_stride].id == id)
                    bits = rec[(uint64_t)w * a.slice_stride].logit_bits;
            mf_combine_stats(rec, a.world, a.slice_stride, &m, &s);
        }
        a.cells[r] = id;
        if (a.logprobs) a.logprobs[r] = mf_logprob_finish(id, bits, m, s);
    }
}

}  // namespace mf::host
