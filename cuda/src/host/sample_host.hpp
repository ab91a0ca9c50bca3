// The host sampler's shared pieces (sample_host.cpp, sample_list.cpp, sample_top_p.cpp): a row as
// the rule reads it, the race's state and its scalar offer, and on x86 the race's 32-id vector
// test and the vector candidate test. Each file's own comment says what its paths do.
#pragma once

#include <stdint.h>

#include <vector>

#include "kernels.hpp"
#include "metrale_feed/sample_rule.h"
#include "vec_exp.hpp"
#include "vec_philox.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MF_X86 1
#endif

namespace mf::host::sampler {

// Which logit keys a sweep takes: (key & mask) == value (mask 0: every key).
struct KeyMask {
    uint32_t mask, value;
    static KeyMask top12(int digit) {  // the key's top 12 bits are `digit` (any when digit < 0)
        return digit < 0 ? KeyMask{0u, 0u} : KeyMask{0xFFF00000u, (uint32_t)digit << 20};
    }
    bool takes(uint32_t key) const { return (key & mask) == value; }
};

struct RowView {
    const void *row;
    int dt;
    uint32_t vocab;
    const mf_row_rule *rule;
    float inv_t;
    uint32_t base;  // the global id of local id 0 (a slice of a split row): Philox draws by global id
    bool candidate(uint32_t i, uint32_t *bits) const { return mf_candidate(row, dt, rule, i, bits); }
    float z(uint32_t bits) const { return mf_scaled(bits, inv_t); }
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
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, v.base + i));
        const uint64_t packed = mf_pack(mf_key_f32(mf_to_bits(score)), i);
        if (packed > best) {
            best = packed;
            best_score = score;
        }
    }
};

#ifdef MF_X86
#define MF_AVX2 __attribute__((target("avx2")))

// The bitmask bits of ids [i, i + 32), lowest id in bit 0 (reads stay inside the row's words).
inline uint32_t bits_word(const uint32_t *bits, uint32_t words, uint32_t i) {
    const uint32_t w = i >> 5, sh = i & 31u;
    uint64_t window = bits[w];
    if (w + 1 < words) window |= (uint64_t)bits[w + 1] << 32;
    return (uint32_t)(window >> sh);
}

// The uniform test of RaceGroups::pass below, one lane at a time: the exponent field of fl(1 - U) for the
// random word whose top 24 bits are r, and c = ceil((z - s) log2 e) (z - s clamped to [-200, 0]),
// by the same float operations as the vector code.
inline uint32_t one_minus_u_exponent(int32_t r) {
    const float u = mf_fmul(mf_fadd((float)r, 0.5f), 5.96046448e-08f);
    return mf_to_bits(mf_fsub(1.0f, u)) >> 23;
}
// gap_exponent is in registers: a call to ceilf in the race's loop would spill every vector
// register live there. maxss and minss give their second operand unless the first is greater or
// less: NaN goes to -200, and -0 to +0, as the compares `gap > -200 ? gap : -200`, then
// `gap < 0 ? gap : 0` would.
MF_AVX2 inline int32_t gap_exponent(float z, float s) {
    __m128 gap = _mm_sub_ss(_mm_set_ss(z), _mm_set_ss(s));
    gap = _mm_min_ss(_mm_max_ss(gap, _mm_set_ss(-200.0f)), _mm_setzero_ps());
    gap = _mm_mul_ss(gap, _mm_set_ss(1.44269504f));
    return _mm_cvttss_si32(_mm_ceil_ss(gap, gap));
}

// uniform_out_below of every e_out from 0 to 129 (gap_exponent is at most 0), made once
// (sample_host.cpp).
const int32_t *uniform_out_table();

// The race over a float32 row, 32 ids at a time: offers only the ids that pass the two necessary
// conditions (z + bound >= best score; 1 - U <= exp(z - best score), up to a factor of two),
// everything else to the scalar rule. Both are tested first for the 32 ids at once, the common
// case of a row most of whose ids are near the top costing a few operations beside the hash:
// the first with the group's greatest logit (NaN never taken: the lanes start at -inf); the
// second with the top's z for every id's (no candidate's is greater; a non-candidate skipped is
// refused by offer() anyway), where a word whose top 24 bits are at most `r_out` fails it, so one
// integer compare per 8 ids, on the words as the rounds leave them, leaves the per-lane tests to
// a few groups. RaceGroups holds what the groups share; pass() tests one group. With a bitmask,
// a group whose word allows none of its ids is skipped whole and the lanes it clears are not
// offered (offer() would refuse them): a grammar's row that allows a few ids costs its few words,
// whose best score, over few ids, rarely rules a group out.
struct RaceGroups {
    const Race &race;
    __m256 t, bound, low;
    __m256i exp_mask, mag_mask;
    // The threshold's key, signed (mf_key_f32 minus 2**31): an id whose key is below it is
    // filtered out, so it is skipped before its Philox block (those at it go to offer()).
    __m256i floor_key;
    PhiloxKeys keys;
    const int32_t *r_outs;  // uniform_out_table()

    MF_AVX2 explicit RaceGroups(const Race &r)
        : race(r), t(_mm256_set1_ps(r.v.inv_t)),
          bound(_mm256_set1_ps(MF_GUMBEL_BOUND)), low(_mm256_set1_ps(mf_neg_inf())),
          exp_mask(_mm256_set1_epi32(0x7F800000)), mag_mask(_mm256_set1_epi32(0x7FFFFFFF)),
          floor_key(_mm256_set1_epi32((int)((uint32_t)(r.threshold >> 32) ^ 0x80000000u))),
          keys(philox_keys(r.p.seed)), r_outs(uniform_out_table()) {}

    // The lanes of ids [i, i + 32) that may still win, bit j for id i + j (`row` the float32 row;
    // its logits are loaded here, so that a caller's loop keeps fewer registers live).
    MF_AVX2 __attribute__((always_inline)) unsigned pass(const float *row, uint32_t i) {
        const __m256 s = _mm256_set1_ps(race.best_score);
        __m256 l[4];
        __m256 top = low;
        for (int j = 0; j < 4; ++j) {
            l[j] = _mm256_loadu_ps(row + i + 8 * j);
            top = _mm256_max_ps(l[j], top);  // NaN keeps `top`
        }
        // max(l) * inv_t = max(z) (the product is monotone): no z of the group is near.
        const __m256 ztops = _mm256_mul_ps(top, t);
        if (!_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(ztops, bound), s, _CMP_GE_OQ))) return 0;
        // The group's greatest z bounds every lane's uniform test.
        __m128 zg = _mm_max_ps(_mm256_castps256_ps128(ztops), _mm256_extractf128_ps(ztops, 1));
        zg = _mm_max_ps(zg, _mm_movehl_ps(zg, zg));
        zg = _mm_max_ss(zg, _mm_shuffle_ps(zg, zg, 1));
        const int32_t e_out = gap_exponent(_mm_cvtss_f32(zg), race.best_score) + 129;
        const __m256i r_out = _mm256_set1_epi32(r_outs[e_out > 0 ? e_out : 0]);
        if (race.threshold) {  // every id of the group under the threshold's key
            __m256i top_key = _mm256_set1_epi32(INT32_MIN);
            for (int j = 0; j < 4; ++j) {
                const __m256i b = _mm256_castps_si256(l[j]);
                top_key = _mm256_max_epi32(top_key, _mm256_sign_epi32(_mm256_and_si256(b, mag_mask), b));
            }
            const __m256i under = _mm256_cmpgt_epi32(floor_key, top_key);
            if (_mm256_testc_si256(under, _mm256_set1_epi32(-1))) return 0;
        }
        const Philox8 c = philox8(keys, race.p.position, race.v.base + i);
        __m256i w[4] = {philox_pair(c.a0, c.a1), philox_pair(c.a2, c.a3), philox_pair(c.b0, c.b1),
                        philox_pair(c.b2, c.b3)};
        // Some word's top 24 bits above r_out: the greatest word's are (the shift is monotone).
        const __m256i most = _mm256_max_epu32(_mm256_max_epu32(w[0], w[1]), _mm256_max_epu32(w[2], w[3]));
        if (!_mm256_movemask_epi8(_mm256_cmpgt_epi32(_mm256_srli_epi32(most, 8), r_out))) return 0;
        // A few groups: the words in id order, and every lane's tests.
        for (int n = 0; n < 2; ++n) {
            const __m256i lo = _mm256_unpacklo_epi64(w[2 * n], w[2 * n + 1]), hi = _mm256_unpackhi_epi64(w[2 * n], w[2 * n + 1]);
            w[2 * n] = _mm256_permute2x128_si256(lo, hi, 0x20);
            w[2 * n + 1] = _mm256_permute2x128_si256(lo, hi, 0x31);
        }
        unsigned pass = 0;
        for (int j = 0; j < 4; ++j) {
            const __m256i b = _mm256_castps_si256(l[j]);
            __m256i finite = _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_and_si256(b, exp_mask), exp_mask),
                                              _mm256_set1_epi32(-1));
            if (race.threshold) {
                const __m256i signed_key = _mm256_sign_epi32(_mm256_and_si256(b, mag_mask), b);
                finite = _mm256_andnot_si256(_mm256_cmpgt_epi32(floor_key, signed_key), finite);
            }
            const __m256 z = _mm256_mul_ps(l[j], t);
            const __m256 close = _mm256_cmp_ps(_mm256_add_ps(z, bound), s, _CMP_GE_OQ);
            // An id can win only if g >= s - z, and g <= -log(1 - U): out when 1 - U > exp(z - s).
            // Checked by powers of two: with E the exponent of fl(1 - U) and c = ceil((z - s) log2 e),
            // E >= c + 2 proves 1 - U > exp(z - s) with a factor of two to spare for every rounding.
            const __m256 u = _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w[j], 8)),
                                                         _mm256_set1_ps(0.5f)),
                                           _mm256_set1_ps(5.96046448e-08f));
            const __m256i e_bits = _mm256_srli_epi32(_mm256_castps_si256(_mm256_sub_ps(_mm256_set1_ps(1.0f), u)), 23);
            const __m256 gap = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(z, s), _mm256_set1_ps(-200.0f)),
                                             _mm256_setzero_ps());
            const __m256i ce = _mm256_cvttps_epi32(_mm256_ceil_ps(_mm256_mul_ps(gap, _mm256_set1_ps(1.44269504f))));
            // out: (e_bits - 127) >= c + 2, i.e. e_bits > c + 128
            const __m256i out = _mm256_cmpgt_epi32(e_bits, _mm256_add_epi32(ce, _mm256_set1_epi32(128)));
            const __m256 keep = _mm256_andnot_ps(_mm256_castsi256_ps(out), _mm256_and_ps(close, _mm256_castsi256_ps(finite)));
            pass |= (unsigned)_mm256_movemask_ps(keep) << (8 * j);
        }
        return pass;
    }
};

// Which of ids [i, i + 8) of a float32 row (logit bits `b`) are not candidates: a non-finite
// logit, a masked id, a bitmask bit clear. RowView::candidate, eight lanes at a time.
MF_AVX2 inline __m256i not_candidates8(const RowView &v, __m256i b, uint32_t i, uint32_t words) {
    const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
    const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32((int)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i bad = _mm256_or_si256(
        _mm256_cmpeq_epi32(_mm256_and_si256(b, exp_mask), exp_mask),
        _mm256_or_si256(_mm256_cmpeq_epi32(ids, _mm256_set1_epi32((int)v.rule->m0)),
                        _mm256_cmpeq_epi32(ids, _mm256_set1_epi32((int)v.rule->m1))));
    if (v.rule->bits) {
        const __m256i allowed = _mm256_set1_epi32((int)(bits_word(v.rule->bits, words, i) & 0xFFu));
        const __m256i pick = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(allowed, pick), _mm256_setzero_si256()));
    }
    return bad;
}

// mf_key_f32's inverse on the keys of numbers (not NaN's): +0 for the key of both zeros.
inline float key_value(uint32_t key) {
    return mf_from_bits(key >= 0x80000000u ? key - 0x80000000u : 0x80000000u | (0x80000000u - key));
}

// The largest top_k served by the bounded selection; a larger one takes the radix select.
constexpr uint32_t kBoundedTopK = 4096;

// The vector paths of other files, each described where it is defined.
MF_AVX2 bool collect_f32(const RowView &v, uint64_t floor, uint32_t k, size_t cap, std::vector<uint64_t> &out);
MF_AVX2 uint64_t seed_floor(const RowView &v, uint32_t k);
MF_AVX2 uint32_t sample_top_k(const RowView &v, const mf_sample_plan &p);
MF_AVX2 bool sample_near(const RowView &v, const mf_sample_plan &p, uint64_t top, float zmax, uint32_t *id);
MF_AVX2 bool sample_top_p_f32(const RowView &v, const mf_sample_plan &p, uint64_t top, float zmax, uint32_t *id);
#endif

}  // namespace mf::host::sampler
