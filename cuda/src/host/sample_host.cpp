// Sampling one row on the CPU, under sample_rule.h. The filters are thresholds on the packed word
// (logit key, ~id) found by a radix select over the candidates, narrowed digit by digit. The race
// draws exact scores only for ids that could still beat the best score so far: first the exact
// bound z + MF_GUMBEL_BOUND, then (AVX2, float32 rows) a necessary condition on the id's uniform,
// g = -log(-log U) <= -log(1 - U), checked 32 ids at a time with a vector Philox. Every skip is a
// proof that the id cannot win, and every id that is not skipped is scored by the scalar rule, so
// both paths give the rule's id (tests compare them); the vector code only decides what to skip,
// except the masses of top_p, whose vector exp repeats sample_rule.h's operations one for one.
#include <vector>

#include "kernels.hpp"
#include "metrale_feed/sample_rule.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MF_X86 1
#endif

namespace mf::host {
namespace {

struct Cand {
    uint64_t packed;  // mf_pack(logit key, id)
    uint64_t weight;  // what the select counts: 1 (top_k) or the mass (top_p)
};

// The smallest packed threshold t such that the candidates with packed >= t weigh >= target
// (1 <= target <= their total weight). Consumes `c`.
uint64_t radix_select(std::vector<Cand> &c, uint64_t target) {
    uint64_t above = 0, prefix = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        uint64_t bins[256] = {0};
        for (const Cand &x : c) bins[(x.packed >> shift) & 0xFFu] += x.weight;
        const uint32_t digit = mf_select_digit(bins, &above, target);
        prefix |= (uint64_t)digit << shift;
        size_t kept = 0;
        for (const Cand &x : c)
            if (((x.packed >> shift) & 0xFFu) == digit) c[kept++] = x;
        c.resize(kept);
    }
    return prefix;
}

struct RowView {
    const void *row;
    int dt;
    uint32_t vocab;
    const mf_row_rule *rule;
    float temperature;
    bool candidate(uint32_t i, uint32_t *bits) const {
        if (i == rule->m0 || i == rule->m1 || !mf_bit_allowed(rule->bits, i)) return false;
        *bits = mf_logit_bits(row, dt, i);
        return mf_finite_bits(*bits);
    }
    float z(uint32_t bits) const { return mf_fdiv(mf_from_bits(bits), temperature); }
};

// The race's state: the best packed score and its score, raised by offer().
struct Race {
    const RowView &v;
    const mf_sample_plan &p;
    float zmax;
    uint64_t threshold;
    uint64_t best;
    float best_score;
    // The scalar rule for one id (any id: non-candidates and filtered ids are refused here).
    void offer(uint32_t i) {
        uint32_t bits;
        if (!v.candidate(i, &bits)) return;
        const float z = v.z(bits);
        if (mf_fadd(z, MF_GUMBEL_BOUND) < best_score) return;  // score <= z + bound: cannot win
        if (threshold && mf_pack(mf_key_f32(bits), i) < threshold) return;
        if (p.use_min_p && !(mf_exp_neg(mf_fsub(z, zmax)) >= p.min_p)) return;
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, i));
        const uint64_t packed = mf_pack(mf_key_f32(mf_to_bits(score)), i);
        if (packed > best) {
            best = packed;
            best_score = score;
        }
    }
};

#ifdef MF_X86
#define MF_AVX2 __attribute__((target("avx2")))

// sample_rule.h's mf_exp_neg on 8 lanes: the same IEEE operations in the same order (no FMA in
// this target), so the same bits.
MF_AVX2 inline __m256 exp_neg8(__m256 x) {
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

MF_AVX2 inline void mulhilo8(__m256i a, uint32_t m, __m256i *hi, __m256i *lo) {
    const __m256i mv = _mm256_set1_epi32((int)m);
    const __m256i even = _mm256_mul_epu32(a, mv), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), mv);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// The 32 random words of ids [i, i + 32) (i a multiple of 4), in id order: philox.h's blocks
// (i / 4 + b, position, 0, 0), eight at once, transposed from (word, block) to id order.
MF_AVX2 void philox32(uint64_t seed, uint32_t position, uint32_t i, __m256i out[4]) {
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32((int)(i >> 2)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i c1 = _mm256_set1_epi32((int)position), c2 = _mm256_setzero_si256(), c3 = c2;
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        __m256i hi0, lo0, hi1, lo1;
        mulhilo8(c0, 0xD2511F53u, &hi0, &lo0);
        mulhilo8(c2, 0xCD9E8D57u, &hi1, &lo1);
        c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
        c1 = lo1;
        c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
        c3 = lo0;
    }
    const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    out[0] = _mm256_permute2x128_si256(u0, u1, 0x20);
    out[1] = _mm256_permute2x128_si256(u2, u3, 0x20);
    out[2] = _mm256_permute2x128_si256(u0, u1, 0x31);
    out[3] = _mm256_permute2x128_si256(u2, u3, 0x31);
}

// The race over a float32 row, 32 ids at a time: offers only the ids that pass the two necessary
// conditions (z + bound >= best score; 1 - U <= exp(z - best score) with a margin far above any
// rounding here), everything else to the scalar rule.
MF_AVX2 void race_f32(Race &race, uint32_t top_id) {
    const float *p = (const float *)race.v.row;
    const uint32_t vocab = race.v.vocab;
    const __m256 t = _mm256_set1_ps(race.v.temperature), bound = _mm256_set1_ps(MF_GUMBEL_BOUND);
    const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
    uint32_t i = 0;
    for (; i + 32 <= vocab; i += 32) {
        const __m256 s = _mm256_set1_ps(race.best_score);
        __m256 z[4];
        unsigned near = 0;
        for (int j = 0; j < 4; ++j) {
            const __m256 l = _mm256_loadu_ps(p + i + 8 * j);
            const __m256i finite = _mm256_xor_si256(
                _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(l), exp_mask), exp_mask),
                _mm256_set1_epi32(-1));
            z[j] = _mm256_div_ps(l, t);
            const __m256 close = _mm256_cmp_ps(_mm256_add_ps(z[j], bound), s, _CMP_GE_OQ);
            near |= (unsigned)_mm256_movemask_ps(_mm256_and_ps(close, _mm256_castsi256_ps(finite))) << (8 * j);
        }
        if (!near) continue;
        __m256i bits[4];
        philox32(race.p.seed, race.p.position, i, bits);
        unsigned pass = 0;
        for (int j = 0; j < 4; ++j) {
            const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bits[j], 8)),
                                                         _mm256_set1_ps(0.5f)),
                                           _mm256_set1_ps(5.96046448e-08f));
            const __m256 gap = _mm256_sub_ps(z[j], s);
            const __m256 e = _mm256_mul_ps(exp_neg8(_mm256_min_ps(gap, _mm256_setzero_ps())), _mm256_set1_ps(1.01f));
            const __m256 maybe = _mm256_or_ps(_mm256_cmp_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), u), e, _CMP_LE_OQ),
                                              _mm256_cmp_ps(gap, _mm256_setzero_ps(), _CMP_GE_OQ));
            pass |= (unsigned)_mm256_movemask_ps(maybe) << (8 * j);
        }
        pass &= near;
        while (pass) {
            const uint32_t id = i + (uint32_t)__builtin_ctz(pass);
            pass &= pass - 1;
            if (id != top_id) race.offer(id);
        }
    }
    for (; i < vocab; ++i)
        if (i != top_id) race.offer(i);
}

// The masses of the candidates at or above `threshold` (mass 0 ones left out: they move no
// threshold), for the top_p select; the exp is exp_neg8, the rest the scalar rule.
MF_AVX2 uint64_t masses_f32(const RowView &v, float zmax, uint64_t threshold, std::vector<Cand> &out) {
    const float *p = (const float *)v.row;
    const __m256 t = _mm256_set1_ps(v.temperature), zm = _mm256_set1_ps(zmax);
    const __m256 scale = _mm256_set1_ps(549755813888.0f);
    uint64_t total = 0;
    uint32_t i = 0;
    alignas(32) float e[8];
    for (; i + 8 <= v.vocab; i += 8) {
        const __m256 l = _mm256_loadu_ps(p + i);
        const __m256 ev = exp_neg8(_mm256_sub_ps(_mm256_div_ps(l, t), zm));
        // mass >= 1 (and a finite logit: exp_neg8 of NaN is 0, of +inf - zmax is refused below)
        unsigned some = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(ev, scale), _mm256_set1_ps(1.0f), _CMP_GE_OQ));
        if (!some) continue;
        _mm256_store_ps(e, ev);
        while (some) {
            const uint32_t j = (uint32_t)__builtin_ctz(some), id = i + j;
            some &= some - 1;
            uint32_t bits;
            if (!v.candidate(id, &bits)) continue;
            const uint64_t packed = mf_pack(mf_key_f32(bits), id);
            if (packed < threshold) continue;
            const uint64_t mass = mf_mass(e[j]);
            total += mass;
            out.push_back(Cand{packed, mass});
        }
    }
    for (; i < v.vocab; ++i) {
        uint32_t bits;
        if (!v.candidate(i, &bits)) continue;
        const uint64_t packed = mf_pack(mf_key_f32(bits), i);
        if (packed < threshold) continue;
        const uint64_t mass = mf_mass(mf_exp_neg(mf_fsub(v.z(bits), zmax)));
        if (!mass) continue;
        total += mass;
        out.push_back(Cand{packed, mass});
    }
    return total;
}
#endif

}  // namespace

uint32_t sample_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                    const mf_sampling_params &params, bool vector) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    const RowView v{row, (int)dtype, vocab, rule, p.temperature};
#ifdef MF_X86
    vector = vector && dtype == MF_DTYPE_F32;
#else
    vector = false;
#endif
    // The greatest finite candidate. The argmax rule's winner is it when finite (+inf ranks
    // above it, NaN and -inf below); otherwise a scalar pass.
    uint64_t top = 0;
    uint32_t top_id = argmax_row(row, dtype, vocab, rule);
    if (top_id != MF_NO_TOKEN && mf_finite_bits(mf_logit_bits(row, v.dt, top_id))) {
        top = mf_pack(mf_key_f32(mf_logit_bits(row, v.dt, top_id)), top_id);
    } else {
        for (uint32_t i = 0; i < vocab; ++i) {
            uint32_t bits;
            if (v.candidate(i, &bits)) top = mf_pack_max(top, mf_pack(mf_key_f32(bits), i));
        }
        if (!top) return MF_NO_TOKEN;
        top_id = mf_unpack_id(top);
    }
    const float zmax = v.z(mf_logit_bits(row, v.dt, top_id));
    if (!mf_finite_bits(mf_to_bits(zmax))) return top_id;  // temperature too small to matter

    uint64_t threshold = 0;  // survivors: packed >= threshold
    thread_local std::vector<Cand> cand;
    if (p.top_k) {
        cand.clear();
        for (uint32_t i = 0; i < vocab; ++i) {
            uint32_t bits;
            if (v.candidate(i, &bits)) cand.push_back(Cand{mf_pack(mf_key_f32(bits), i), 1});
        }
        if (cand.size() > p.top_k) threshold = radix_select(cand, p.top_k);
    }
    if (p.use_top_p) {
        cand.clear();
        uint64_t total = 0;
#ifdef MF_X86
        if (vector) total = masses_f32(v, zmax, threshold, cand);
#endif
        if (!vector)
            for (uint32_t i = 0; i < vocab; ++i) {
                uint32_t bits;
                if (!v.candidate(i, &bits)) continue;
                const uint64_t packed = mf_pack(mf_key_f32(bits), i);
                if (packed < threshold) continue;
                const uint64_t mass = mf_mass(mf_exp_neg(mf_fsub(v.z(bits), zmax)));
                if (!mass) continue;  // moves no threshold
                total += mass;
                cand.push_back(Cand{packed, mass});
            }
        threshold = radix_select(cand, mf_top_p_target(total, p.top_p));
    }
    // The race, the greatest logit first: its score bounds which others can still win.
    const float s0 = mf_fadd(zmax, mf_gumbel(p.seed, p.position, top_id));
    Race race{v, p, zmax, threshold, mf_pack(mf_key_f32(mf_to_bits(s0)), top_id), s0};
#ifdef MF_X86
    if (vector) {
        race_f32(race, top_id);
        return mf_unpack_id(race.best);
    }
#endif
    for (uint32_t i = 0; i < vocab; ++i)
        if (i != top_id) race.offer(i);
    return mf_unpack_id(race.best);
}

}  // namespace mf::host
