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
// One pass over memory: the row is taken in chunks that stay in L1; each chunk's max is found
// first, the running sum rescaled by exp(old max - new max) in float64 when it rises (rarely), and
// then the chunk's terms summed from cache. The chunking is fixed, so the bits are too.
constexpr uint32_t kChunk = 2048;

__attribute__((target("avx2"))) float chunk_max(const float *p, uint32_t lo, uint32_t hi) {
    __m256 top = _mm256_set1_ps(mf_neg_inf());
    uint32_t i = lo;
    for (; i + 8 <= hi; i += 8) top = _mm256_max_ps(_mm256_loadu_ps(p + i), top);  // NaN keeps `top`
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    float m = mf_neg_inf();
    for (float x : lanes) m = x > m ? x : m;
    for (; i < hi; ++i) m = p[i] > m ? p[i] : m;
    return m;
}

// exp(x) for x <= 0 with FMA: the same reduction and polynomial as mf_exp_neg, fused (a logprob
// sum needs ~1e-7 relative accuracy and determinism on one machine, not the sampler's bits).
__attribute__((target("avx2,fma"))) inline __m256 exp_neg8_fma(__m256 x) {
    const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-86.0f), _CMP_GE_OQ);  // false for NaN
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269502f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-06f), r);
    __m256 q = _mm256_set1_ps(1.38888889e-03f);
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.33333333e-03f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.16666667e-02f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.66666667e-01f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(0.5f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.0f));
    const __m256i k = _mm256_cvtps_epi32(n);
    const __m256i bits = _mm256_add_epi32(_mm256_castps_si256(q), _mm256_slli_epi32(k, 23));
    const __m256i keep = _mm256_and_si256(_mm256_castps_si256(ok), _mm256_cmpgt_epi32(k, _mm256_set1_epi32(-126)));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, keep));
}

struct ExpAvx2 {
    __attribute__((target("avx2"))) __m256 operator()(__m256 x) const { return exp_neg8(x); }
};
struct ExpFma {
    __attribute__((target("avx2,fma"))) __m256 operator()(__m256 x) const { return exp_neg8_fma(x); }
};

// Compiled for AVX2 + FMA: with -ffp-contract=off the compiler fuses nothing itself, so the
// ExpAvx2 instance holds no FMA instruction and serves AVX2 machines without FMA.
template <class Exp>
__attribute__((target("avx2,fma"))) double chunk_sum(const float *p, uint32_t lo, uint32_t hi, float m) {
    const Exp exp_neg8;
    const __m256 mv = _mm256_set1_ps(m);
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    uint32_t i = lo;
    for (; i + 16 <= hi; i += 16) {
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
    for (; i < hi; ++i) s += (double)mf_exp_neg(mf_fsub(p[i], m));
    return s;
}

template <class Exp>
RowStats stats_f32_with(const float *p, uint32_t n) {
    float m = mf_neg_inf();
    double s = 0.0;
    for (uint32_t lo = 0; lo < n; lo += kChunk) {
        const uint32_t hi = n - lo < kChunk ? n : lo + kChunk;
        const float cm = chunk_max(p, lo, hi);
        if (!mf_finite_bits(mf_to_bits(cm)) && cm > 0.0f) return RowStats{cm, 0.0};  // +inf: NaN row
        if (cm > m) {
            s *= std::exp((double)m - (double)cm);  // 0 while m is -inf (s is 0 then too)
            m = cm;
        }
        if (m > mf_neg_inf()) s += chunk_sum<Exp>(p, lo, hi, m);
    }
    return RowStats{m, s};
}

const bool g_fma = __builtin_cpu_supports("fma");

RowStats stats_f32(const float *p, uint32_t n) {
    return g_fma ? stats_f32_with<ExpFma>(p, n) : stats_f32_with<ExpAvx2>(p, n);
}
#endif

// Row r's record in block 0 (block w's is `slice_stride * w` records further).
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
                                            mf_partial_op(a.op, a.logprobs != nullptr),
                                            a.rows, a.call, a.vocab);
    *a.fault = fault;
    const mf_sampling_params *params = job.row_params();  // device ones: read now, at run time
    for (uint32_t r = 0; r < a.rows; ++r) {
        const mf_partial_record *rec = records_of(a, r);
        uint32_t id = MF_NO_TOKEN, bits = 0;
        float m = mf_neg_inf();
        double s = 0.0;
        mf_sample_plan plan;
        const bool sampled = !fault && params && !(plan = mf_plan_sampling(&params[r])).greedy;
        if (sampled && a.op == MF_PARTIAL_SAMPLE && mf_plan_filtered(&plan)) {
            // A filter the slices could not apply (device params): this row's draw is refused.
            if (!*a.fault) *a.fault = MF_FAULT_FILTERS | (r << 8);
        } else if (!fault) {
            id = mf_combine_pick(rec, a.world, a.slice_stride, sampled ? &plan : nullptr);
            for (uint32_t w = 0; w < a.world; ++w)
                if (id != MF_NO_TOKEN && rec[(uint64_t)w * a.slice_stride].id == id)
                    bits = rec[(uint64_t)w * a.slice_stride].logit_bits;
            if (a.logprobs) mf_combine_stats(rec, a.world, a.slice_stride, &m, &s);
        }
        a.cells[r] = id;
        if (a.logprobs) a.logprobs[r] = mf_logprob_finish(id, bits, m, s);
    }
}

}  // namespace mf::host
