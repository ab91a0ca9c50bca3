// Sampling one row on the CPU, under sample_rule.h. The filters are thresholds on the packed word
// (logit key, ~id). The vector path finds them in short lists: with top_k (up to kBoundedTopK), a
// bounded selection in one pass over the row keeps the k greatest words, and top_p, min_p and the
// race run over those k; without top_k, after the argmax pass a second pass lists the ids near
// the top (the only ones that can win the race, and all but a bounded sliver of top_p's mass).
// The portable path, and the vector path where a list does not settle the answer, find them by a
// radix select over the candidates, narrowed digit by digit; both give the same survivors. The
// whole-row race draws exact scores only for ids that could still beat the best score so far:
// first the exact bound z + MF_GUMBEL_BOUND, then (AVX2, float32 rows) a necessary condition on
// the id's uniform, g = -log(-log U) <= -log(1 - U), checked 32 ids at a time with a vector
// Philox. Every skip is a
// proof that the id cannot win, and every id that is not skipped is scored by the scalar rule, so
// both paths give the rule's id (tests compare them); the vector code only decides what to skip,
// except the masses of top_p, whose vector exp repeats sample_rule.h's operations one for one.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/sample_rule.h"
#include "metrale_feed/verify_rule.h"
#include "vec_exp.hpp"
#include "vec_philox.hpp"

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

// Narrows a radix select over c[0, n) (elements sharing the bits above `shift + 8` of `*prefix`)
// digit by digit down to the whole 64-bit threshold, overwriting them. The last digit overlaps
// bits already fixed, which every element left shares, so it still selects the right low nibble.
uint64_t radix_finish(Cand *c, size_t n, uint64_t target, uint64_t above, uint64_t prefix, int shift) {
    for (;; shift = shift >= 8 ? shift - 8 : 0) {
        uint64_t bins[256] = {0};
        for (size_t j = 0; j < n; ++j) bins[(c[j].packed >> shift) & 0xFFu] += c[j].weight;
        const uint32_t digit = mf_select_digit(bins, &above, target);
        prefix |= (uint64_t)digit << shift;
        size_t kept = 0;
        for (size_t j = 0; j < n; ++j)
            if (((c[j].packed >> shift) & 0xFFu) == digit) c[kept++] = c[j];
        n = kept;
        if (shift == 0) return prefix;
    }
}

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

// The uniform test of race_f32 below, one lane at a time: the exponent field of fl(1 - U) for the
// random word whose top 24 bits are r, and c = ceil((z - s) log2 e) (z - s clamped to [-200, 0]),
// by the same float operations as the vector code.
inline uint32_t one_minus_u_exponent(int32_t r) {
    const float u = mf_fmul(mf_fadd((float)r, 0.5f), 5.96046448e-08f);
    return mf_to_bits(mf_fsub(1.0f, u)) >> 23;
}
inline int32_t gap_exponent(float z, float s) {
    float gap = mf_fsub(z, s);
    gap = gap > -200.0f ? gap : -200.0f;
    gap = gap < 0.0f ? gap : 0.0f;
    return (int32_t)__builtin_ceilf(mf_fmul(gap, 1.44269504f));
}

// The greatest r in [0, 2**24) whose exponent field above is >= `e_out`, or -1 for none: the
// exponent falls as r grows, so every r up to it fails the uniform test at that bound.
int32_t uniform_out_below(int32_t e_out) {
    if (one_minus_u_exponent(0) < (uint32_t)std::max(e_out, 0)) return -1;
    int32_t lo = 0, hi = 1 << 24;  // lo passes, hi does not exist
    while (hi - lo > 1) {
        const int32_t mid = lo + (hi - lo) / 2;
        (one_minus_u_exponent(mid) >= (uint32_t)std::max(e_out, 0) ? lo : hi) = mid;
    }
    return lo;
}

// uniform_out_below of every e_out from 0 to 129 (gap_exponent is at most 0), made once.
const int32_t *uniform_out_table() {
    static const std::vector<int32_t> table = [] {
        std::vector<int32_t> t(130);
        for (int32_t e = 0; e < 130; ++e) t[e] = uniform_out_below(e);
        return t;
    }();
    return table.data();
}

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

MF_AVX2 void race_f32(Race &race, uint32_t top_id) {
    const float *p = (const float *)race.v.row;
    const uint32_t *bitmask = race.v.rule->bits;
    RaceGroups groups(race);
    uint32_t i = 0;
    for (; i + 32 <= race.v.vocab; i += 32) {
        const uint32_t allowed = bitmask ? bitmask[i >> 5] : 0xFFFFFFFFu;  // i is a word's first id
        if (!allowed) continue;
        unsigned pass = groups.pass(p, i) & allowed;
        while (pass) {
            const uint32_t id = i + (uint32_t)__builtin_ctz(pass);
            pass &= pass - 1;
            if (id != top_id) race.offer(id);
        }
    }
    for (; i < race.v.vocab; ++i)
        if (i != top_id) race.offer(i);
}

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

// Calls f(id, packed, weight) for each candidate of a float32 row at or above `floor` with a
// weight > 0 (1, or the mass: mass 0 moves no threshold) whose key `keys` takes. The lane tests
// (finite, masks, bitmask, key, weight) are vector, the weight's only for lanes the others left
// (a narrow select skips most exponentials); exp is exp_neg8, which repeats the rule's operations,
// and the mass the rule's conversion.
template <class F>
MF_AVX2 void for_weighted_f32(const RowView &v, bool use_mass, float zmax, uint64_t floor, KeyMask keys_in,
                              F &&f) {
    const float *p = (const float *)v.row;
    const __m256 t = _mm256_set1_ps(v.inv_t), zm = _mm256_set1_ps(zmax);
    const __m256 scale = _mm256_set1_ps(549755813888.0f), one = _mm256_set1_ps(1.0f);
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i bias = _mm256_set1_epi32(INT32_MIN), want = _mm256_set1_epi32((int)keys_in.value);
    const __m256i kmask = _mm256_set1_epi32((int)keys_in.mask);
    // The floor's key as a signed key (mf_key_f32 minus 2**31): lanes below it are out; those at
    // it are left to the packed compare.
    const __m256i floor_key = _mm256_set1_epi32((int)((uint32_t)(floor >> 32) ^ 0x80000000u));
    const uint32_t words = mf_bitmask_words(v.vocab);
    uint32_t i = 0;
    alignas(32) float w[8];
    alignas(32) uint32_t keys[8];
    for (; i + 8 <= v.vocab; i += 8) {
        const __m256 l = _mm256_loadu_ps(p + i);
        const __m256i b = _mm256_castps_si256(l);
        __m256i bad = not_candidates8(v, b, i, words);
        const __m256i m = _mm256_and_si256(b, mag_mask);
        const __m256i signed_key = _mm256_sign_epi32(m, b);
        const __m256i key = _mm256_add_epi32(signed_key, bias);  // mf_key_f32, finite
        if (floor) bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(floor_key, signed_key));
        if (keys_in.mask)
            bad = _mm256_or_si256(bad, _mm256_xor_si256(_mm256_cmpeq_epi32(_mm256_and_si256(key, kmask), want),
                                                        _mm256_set1_epi32(-1)));
        unsigned some = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(bad)) ^ 0xFFu;
        if (!some) continue;
        __m256 wv = one;
        if (use_mass) {
            wv = _mm256_mul_ps(exp_neg8(_mm256_sub_ps(_mm256_mul_ps(l, t), zm)), scale);
            bad = _mm256_or_si256(bad, _mm256_castps_si256(_mm256_cmp_ps(wv, one, _CMP_NGE_UQ)));
            some = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(bad)) ^ 0xFFu;
            if (!some) continue;
        }
        _mm256_store_ps(w, wv);
        _mm256_store_si256((__m256i *)keys, key);
        while (some) {
            const uint32_t j = (uint32_t)__builtin_ctz(some), id = i + j;
            some &= some - 1;
            const uint64_t packed = mf_pack(keys[j], id);
            if (packed >= floor) f(id, packed, (uint64_t)(int64_t)w[j]);  // = mf_mass(e): w is e * 2**39
        }
    }
    for (; i < v.vocab; ++i) {
        uint32_t bits;
        if (!v.candidate(i, &bits)) continue;
        const uint64_t packed = mf_pack(mf_key_f32(bits), i);
        const uint64_t wt = use_mass ? mf_survivor_mass(bits, v.inv_t, zmax) : 1u;
        if (packed >= floor && wt && keys_in.takes(mf_key_f32(bits))) f(i, packed, wt);
    }
}

// Sweep 1 of select_threshold on a float32 row with no floor: adds each candidate's weight to
// hist[(top 12 key bits) * 4 + id % 4]. The bucket indices are computed 8 at a time; only the adds
// stay scalar. The same candidates and weights as for_weighted_f32 (the tests compare the paths).
MF_AVX2 void histogram_f32(const RowView &v, bool use_mass, float zmax, uint64_t *hist) {
    const float *p = (const float *)v.row;
    const __m256 t = _mm256_set1_ps(v.inv_t), zm = _mm256_set1_ps(zmax);
    const __m256 scale = _mm256_set1_ps(549755813888.0f), one = _mm256_set1_ps(1.0f);
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i bias = _mm256_set1_epi32(INT32_MIN), lane4 = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3);
    const uint32_t words = mf_bitmask_words(v.vocab);
    alignas(32) float w[8];
    alignas(32) uint32_t slot[8];
    uint32_t i = 0;
    for (; i + 8 <= v.vocab; i += 8) {
        const __m256 l = _mm256_loadu_ps(p + i);
        const __m256i b = _mm256_castps_si256(l);
        __m256i bad = not_candidates8(v, b, i, words);
        const __m256i key = _mm256_add_epi32(_mm256_sign_epi32(_mm256_and_si256(b, mag_mask), b), bias);
        __m256 wv = one;
        if (use_mass) {
            wv = _mm256_mul_ps(exp_neg8(_mm256_sub_ps(_mm256_mul_ps(l, t), zm)), scale);
            bad = _mm256_or_si256(bad, _mm256_castps_si256(_mm256_cmp_ps(wv, one, _CMP_NGE_UQ)));
        }
        unsigned some = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(bad)) ^ 0xFFu;
        if (!some) continue;
        // i is a multiple of 8, so id % 4 is the lane's index % 4.
        _mm256_store_si256((__m256i *)slot, _mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(key, 20), 2), lane4));
        _mm256_store_ps(w, wv);
        if (some == 0xFFu) {
            for (int j = 0; j < 8; ++j) hist[slot[j]] += (uint64_t)(int64_t)w[j];
        } else {
            while (some) {
                const uint32_t j = (uint32_t)__builtin_ctz(some);
                some &= some - 1;
                hist[slot[j]] += (uint64_t)(int64_t)w[j];
            }
        }
    }
    for (; i < v.vocab; ++i) {
        uint32_t bits;
        if (!v.candidate(i, &bits)) continue;
        const uint64_t wt = use_mass ? mf_survivor_mass(bits, v.inv_t, zmax) : 1u;
        if (wt) hist[((mf_key_f32(bits) >> 20) << 2) | (i & 3u)] += wt;
    }
}
#endif

// Calls f(id, packed, weight) for each candidate at or above `floor` with a weight > 0: 1 for
// top_k, the mass for top_p.
template <class F>
void for_weighted(const RowView &v, bool use_mass, float zmax, uint64_t floor, KeyMask keys_in, bool vector,
                  F &&f) {
#ifdef MF_X86
    if (vector) return for_weighted_f32(v, use_mass, zmax, floor, keys_in, f);
#else
    (void)vector;
#endif
    for (uint32_t i = 0; i < v.vocab; ++i) {
        uint32_t bits;
        if (!v.candidate(i, &bits)) continue;
        const uint64_t packed = mf_pack(mf_key_f32(bits), i);
        if (packed < floor || !keys_in.takes(mf_key_f32(bits))) continue;
        const uint64_t w = use_mass ? mf_survivor_mass(bits, v.inv_t, zmax) : 1u;
        if (w) f(i, packed, w);
    }
}

// The top_k (use_mass false, target k) or top_p threshold over the candidates at or above
// `floor`: the smallest packed t whose candidates at or above it weigh >= the target, or `floor`
// when all of them together do not exceed k. One sweep histograms the key's top 12 bits; a second
// collects only that digit's candidates for the radix select of the rest.
uint64_t select_threshold(const RowView &v, bool use_mass, float zmax, uint64_t floor, uint32_t k,
                          float top_p, bool vector) {
    // Four interleaved histograms: dense rows pile into a few buckets, and one histogram would
    // chain every add through the same memory word.
    thread_local std::vector<uint64_t> bins;
    bins.assign(4 * 4096, 0);
    uint64_t *hist = bins.data();
#ifdef MF_X86
    if (vector && floor == 0)
        histogram_f32(v, use_mass, zmax, hist);
    else
#endif
        for_weighted(v, use_mass, zmax, floor, KeyMask::top12(-1), vector, [hist](uint32_t id, uint64_t packed, uint64_t w) {
            hist[((packed >> 52) << 2) | (id & 3u)] += w;
        });
    uint64_t total = 0;  // summed here, not per element: a running sum would alias the stores
    for (uint32_t d = 0; d < 4096; ++d) {
        hist[d] = hist[4 * d] + hist[4 * d + 1] + hist[4 * d + 2] + hist[4 * d + 3];
        total += hist[d];
    }
    if (!use_mass && total <= k) return floor;
    const uint64_t target = use_mass ? mf_top_p_target(total, top_p) : k;
    uint64_t above = 0;
    uint32_t digit = 4095;
    for (; digit > 0 && above + bins[digit] < target; --digit) above += bins[digit];
    thread_local std::vector<Cand> cand;
    cand.clear();
    for_weighted(v, use_mass, zmax, floor, KeyMask::top12((int)digit), vector,
                 [](uint32_t, uint64_t packed, uint64_t w) { cand.push_back(Cand{packed, w}); });
    return radix_finish(cand.data(), cand.size(), target, above, (uint64_t)digit << 52, 44);
}

// The greatest finite candidate of a row, packed (0: none). The argmax rule's winner is it when
// finite (+inf ranks above it, NaN and -inf below); otherwise a scalar pass.
uint64_t top_candidate(const RowView &v) {
    const uint32_t top_id = argmax_row(v.row, (mf_dtype)v.dt, v.vocab, v.rule);
    if (top_id != MF_NO_TOKEN && mf_finite_bits(mf_logit_bits(v.row, v.dt, top_id)))
        return mf_pack(mf_key_f32(mf_logit_bits(v.row, v.dt, top_id)), top_id);
    uint64_t top = 0;
    for (uint32_t i = 0; i < v.vocab; ++i) {
        uint32_t bits;
        if (v.candidate(i, &bits)) top = mf_pack_max(top, mf_pack(mf_key_f32(bits), i));
    }
    return top;
}

// The race over the survivors (packed >= threshold, and e >= min_p against zmax), the row's top
// candidate `top` first: its score bounds which others can still win. The top is the greatest
// packed word and the greatest z, so when it is filtered out nothing survives.
uint32_t race_row(const RowView &v, const mf_sample_plan &p, uint64_t top, float zmax, uint64_t threshold,
                  bool vector) {
    const uint32_t top_id = mf_unpack_id(top);
    const float ztop = v.z(mf_logit_bits(v.row, v.dt, top_id));
    if (top < threshold || (p.use_min_p && !(mf_exp_neg(mf_fsub(ztop, zmax)) >= p.min_p))) return MF_NO_TOKEN;
    const float s0 = mf_fadd(ztop, mf_gumbel(p.seed, p.position, v.base + top_id));
    Race race{v, p, zmax, threshold, mf_pack(mf_key_f32(mf_to_bits(s0)), top_id), s0};
#ifdef MF_X86
    if (vector && v.base % 4u == 0u) {  // the vector Philox draws whole blocks of four ids
        race_f32(race, top_id);
        return mf_unpack_id(race.best);
    }
#else
    (void)vector;
#endif
    for (uint32_t i = 0; i < v.vocab; ++i)
        if (i != top_id) race.offer(i);
    return mf_unpack_id(race.best);
}

// A 16-bit row widened to float32 once (exactly: mf_logit_bits), so the vector helpers serve
// every dtype; the rule reads the same values either way.
const void *widened(const void *row, mf_dtype *dtype, uint32_t vocab, bool *vector) {
#ifdef MF_X86
    thread_local std::vector<uint32_t> wide;
    if (*vector && *dtype != MF_DTYPE_F32) {
        wide.resize(vocab);
        for (uint32_t i = 0; i < vocab; ++i) wide[i] = mf_logit_bits(row, (int)*dtype, i);
        *dtype = MF_DTYPE_F32;
        return wide.data();
    }
#else
    *vector = false;
#endif
    return row;
}

// for_weighted over a list of ids (ascending) instead of the whole row: the scalar rule, so the
// same candidates and weights.
template <class F>
void for_listed(const RowView &v, bool use_mass, float zmax, uint64_t floor, KeyMask keys_in,
                const uint32_t *list, uint32_t len, F &&f) {
    for (uint32_t k = 0; k < len; ++k) {
        const uint32_t i = list[k];
        uint32_t bits;
        if (i >= v.vocab || !v.candidate(i, &bits)) continue;
        const uint32_t key = mf_key_f32(bits);
        const uint64_t packed = mf_pack(key, i);
        if (packed < floor || !keys_in.takes(key)) continue;
        const uint64_t w = use_mass ? mf_survivor_mass(bits, v.inv_t, zmax) : 1u;
        if (w) f(i, packed, w);
    }
}

// A row's list scratch (feed.h's select_list): the ids in range once the key's top 8 bits are
// fixed, so that a select's later rounds and its cut skip the rest of the slice.
struct IdList {
    uint32_t *ids;
    uint32_t cap;
    uint32_t &len;  // the row state's list_len
    bool usable() const { return ids && len <= cap; }
};

// One digit's histogram over the candidates at or above `floor` whose key bits above the digit
// are `prefix`'s (a split select's round; sample_rule.h).
void select_histogram(const RowView &v, bool use_mass, float zmax, uint64_t floor, uint32_t prefix,
                      uint32_t shift, bool vector, uint64_t *bins, IdList list) {
    const KeyMask in = shift >= 24u ? KeyMask{0u, 0u} : KeyMask{~0u << (shift + 8u), prefix & (~0u << (shift + 8u))};
    auto add = [&](uint32_t, uint64_t packed, uint64_t w) {
        bins[mf_select_digit8((uint32_t)(packed >> 32), shift)] += w;
    };
    if (shift < 16u && list.usable()) return for_listed(v, use_mass, zmax, floor, in, list.ids, list.len, add);
    if (shift == 16u && list.ids) {  // list what this round takes, while it fits
        uint32_t n = 0;
        for_weighted(v, use_mass, zmax, floor, in, vector, [&](uint32_t id, uint64_t packed, uint64_t w) {
            add(id, packed, w);
            if (n < list.cap) list.ids[n] = id;
            ++n;
        });
        list.len = n <= list.cap ? n : MF_SELECT_NO_LIST;
        return;
    }
#ifdef MF_X86
    if (vector && floor == 0 && shift == 24u) {  // the first round: the 12-bit sweep, folded
        thread_local std::vector<uint64_t> wide;
        wide.assign(4 * 4096, 0);
        histogram_f32(v, use_mass, zmax, wide.data());
        for (uint32_t d = 0; d < 4 * 4096; ++d) bins[d >> 6] += wide[d];  // (key >> 20) * 4 + id % 4
        return;
    }
#endif
    for_weighted(v, use_mass, zmax, floor, in, vector, add);
}

// The cut at `key`: the lowest-id candidates at `key` (at or above `floor`) while the weight taken
// before each is below `need`; the packed threshold that keeps them (and everything above `key`).
// It ends its select: the list is dropped.
uint64_t select_cut(const RowView &v, bool use_mass, float zmax, uint64_t floor, uint32_t key, uint64_t need,
                    bool vector, IdList list) {
    uint64_t cut = mf_cut_none(key);
    if (need) {
        uint64_t taken = 0, found = 0;
        auto walk = [&](uint32_t, uint64_t packed, uint64_t w) {
            if (found) return;
            taken += w;
            if (taken >= need) found = packed;  // ids ascend: the last one kept
        };
        if (list.usable())
            for_listed(v, use_mass, zmax, floor, KeyMask{~0u, key}, list.ids, list.len, walk);
        else
            for_weighted(v, use_mass, zmax, floor, KeyMask{~0u, key}, vector, walk);
        cut = found ? found : mf_cut_all(key);
    }
    list.len = MF_SELECT_NO_LIST;
    return cut > floor ? cut : floor;
}

#ifdef MF_X86
// ---- the vector path's selections: one pass into a short list of candidates ----
// Both lists below hold packed words (logit key, ~id), so sorting them descending is the rule's
// order (greatest logit first, ties to the lower id), and z is non-increasing along them.

// The largest top_k served by the bounded selection; a larger one takes the radix select.
constexpr uint32_t kBoundedTopK = 4096;
// A near list longer than this (plus vocab / 64) is dropped for the whole-row paths: such a
// row is flat, and the list would cost more than it saves.
constexpr size_t kNearCap = 2048;
// The near list's margin in z: an id whose z trails zmax by more cannot win the race (below)
// and weighs at most kFarMass in top_p's integer masses.
constexpr float kNearMargin = 24.0f;
// mf_mass(mf_exp_neg(x)) for x <= -24: mf_exp_neg is p(r) * 2**n with n <= -35 and
// p(r) < 2 for |r| <= 0.36, so the mass is at most 2**(39 - 35 + 1).
constexpr uint64_t kFarMass = 32;

// A floor's key as a signed key (mf_key_f32 minus 2**31, as _mm256_sign_epi32 gives it for a
// finite value), on 8 lanes: a lane whose key is below it is below the floor whatever its id.
MF_AVX2 __m256i floor_key8(uint64_t floor) {
    return _mm256_set1_epi32((int)((uint32_t)(floor >> 32) ^ 0x80000000u));
}

// Keeps the k greatest of list[0, n) in list[0, k) (any order); returns the k-th greatest.
uint64_t keep_greatest(uint64_t *list, size_t n, uint32_t k) {
    std::nth_element(list, list + (k - 1), list + n, std::greater<uint64_t>());
    return list[k - 1];
}

// Appends to `out` the packed word of every candidate of a float32 row above `floor`. One
// signed-key compare per 8 ids rejects what cannot be above the floor (the candidate tests run
// only for lanes it lets through). With k > 0 the list is a bounded selection: whenever it holds
// `cap` words it keeps its k greatest and the floor rises to the k-th, so the ids under the
// running k-th are skipped by that compare; it then ends with at least the row's k greatest
// candidates. With k == 0 the floor stays, and the list gives up (false) past `cap` words.
MF_AVX2 bool collect_f32(const RowView &v, uint64_t floor, uint32_t k, size_t cap, std::vector<uint64_t> &out) {
    const float *p = (const float *)v.row;
    const uint32_t words = mf_bitmask_words(v.vocab);
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i fk = floor_key8(floor);
    if (!k) {
        // A flat row would fill the list only to give it up: counted first, 32 ids at a time
        // and with no candidate test (every lane counted is at or above the floor's key, so the
        // count bounds the list from above), its first 2 * cap ids tell so for a few operations
        // each. The whole-row paths then take the row, as they would have.
        size_t above = 0;
        for (uint32_t i = 0; i + 32 <= v.vocab && i < 2 * cap; i += 32) {
            unsigned lanes = 0;
            for (int j = 0; j < 4; ++j) {
                const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(p + i + 8 * j));
                const __m256i signed_key = _mm256_sign_epi32(_mm256_and_si256(b, mag_mask), b);
                lanes |= (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(fk, signed_key))) << (8 * j);
            }
            above += 32 - (size_t)__builtin_popcount(lanes);
        }
        if (above > cap) {
            out.clear();
            return false;
        }
    }
    out.resize(cap);
    uint64_t *list = out.data();
    size_t n = 0;
    // Takes one word; false when a fixed floor's list is full. Inline, with no call in the
    // common case: a function of another target would cost a call and a vzeroupper a word.
#define MF_TAKE(packed)                                              \
    do {                                                             \
        const uint64_t word_ = (packed);                             \
        if (word_ > floor) {                                         \
            list[n++] = word_;                                       \
            if (n == cap) {                                          \
                if (!k) {                                            \
                    out.resize(n);                                   \
                    return false;                                    \
                }                                                    \
                floor = keep_greatest(list, n, k); /* the k-th kept */ \
                n = k;                                               \
                fk = floor_key8(floor);                              \
            }                                                        \
        }                                                            \
    } while (0)
    uint32_t i = 0;
    for (; i + 32 <= v.vocab; i += 32) {
        __m256i b[4];
        unsigned pass = 0;
        for (int j = 0; j < 4; ++j) {
            b[j] = _mm256_castps_si256(_mm256_loadu_ps(p + i + 8 * j));
            const __m256i signed_key = _mm256_sign_epi32(_mm256_and_si256(b[j], mag_mask), b[j]);
            pass |= ((unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(fk, signed_key))) ^ 0xFFu)
                    << (8 * j);
        }
        if (!pass) continue;
        for (int j = 0; j < 4; ++j) {
            unsigned lanes = (pass >> (8 * j)) & 0xFFu;
            if (!lanes) continue;
            lanes &= ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(not_candidates8(v, b[j], i + 8 * j, words)));
            alignas(32) uint32_t bits[8];
            _mm256_store_si256((__m256i *)bits, b[j]);
            while (lanes) {
                const uint32_t lane = (uint32_t)__builtin_ctz(lanes);
                lanes &= lanes - 1;
                MF_TAKE(mf_pack(mf_key_f32(bits[lane]), i + 8 * (uint32_t)j + lane));
            }
        }
    }
    for (; i < v.vocab; ++i) {
        uint32_t bits;
        if (v.candidate(i, &bits)) MF_TAKE(mf_pack(mf_key_f32(bits), i));
    }
#undef MF_TAKE
    out.resize(n);
    return true;
}

// A floor under the k-th greatest candidate of a float32 row, to start the bounded selection
// high: the least of the greatest keys of k groups of ids (each group's greatest candidate is
// a distinct candidate at or above it, so k of them are). The groups take about an eighth of
// the row, once through the candidate tests; the selection's pass then reads them again from
// cache, and lets through a few ids where it would let through every one until its list first
// filled. 0 (no floor) for a short row or one whose groups lack candidates.
MF_AVX2 uint64_t seed_floor(const RowView &v, uint32_t k) {
    const uint32_t group = (v.vocab / (8 * k)) & ~7u;
    if (group < 32) return 0;
    const float *p = (const float *)v.row;
    const uint32_t words = mf_bitmask_words(v.vocab);
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF), none = _mm256_set1_epi32(INT32_MIN);
    int32_t lowest = INT32_MAX;
    uint32_t found = 0;
    for (uint32_t start = 0; found < k && start + group <= v.vocab; start += group) {
        __m256i best = none;
        for (uint32_t i = start; i < start + group; i += 8) {
            const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(p + i));
            const __m256i signed_key = _mm256_sign_epi32(_mm256_and_si256(b, mag_mask), b);
            best = _mm256_max_epi32(best, _mm256_blendv_epi8(signed_key, none, not_candidates8(v, b, i, words)));
        }
        alignas(32) int32_t lanes[8];
        _mm256_store_si256((__m256i *)lanes, best);
        int32_t m = lanes[0];
        for (int j = 1; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
        if (m == INT32_MIN) continue;  // no candidate (a finite key is never INT32_MIN)
        lowest = m < lowest ? m : lowest;
        ++found;
    }
    if (found < k) return 0;
    return ((uint64_t)((uint32_t)lowest ^ 0x80000000u) << 32) - 1u;  // keeps that key's words
}

// mf_key_f32's inverse on the keys of numbers (not NaN's): +0 for the key of both zeros.
float key_value(uint32_t key) {
    return mf_from_bits(key >= 0x80000000u ? key - 0x80000000u : 0x80000000u | (0x80000000u - key));
}

// The smallest logit key whose z is near zmax: fl(fl(x * inv_t) + kNearMargin) >= zmax, found by
// bisection over the finite keys (the test is monotone in x). `top_key` is the key of zmax's
// logit, which passes.
uint32_t near_key(float inv_t, float zmax, uint32_t top_key) {
    auto near = [&](uint32_t key) { return mf_fadd(mf_fmul(key_value(key), inv_t), kNearMargin) >= zmax; };
    uint32_t lo = mf_key_f32(0xFF7FFFFFu), hi = top_key;  // -FLT_MAX; near(hi)
    if (near(lo)) return lo;
    while (hi - lo > 1) {  // near(hi), !near(lo)
        const uint32_t mid = lo + (hi - lo) / 2;
        (near(mid) ? hi : lo) = mid;
    }
    return hi;
}

// The race over a list whose first word is the row's top candidate (the greatest z, zmax):
// every id not listed is either filtered out or cannot win. The same offers as Race::offer; in a
// list sorted descending (z non-increasing), the first id whose z + bound trails the best score
// ends it.
uint32_t race_list(const RowView &v, const mf_sample_plan &p, const uint64_t *list, size_t n, float zmax,
                   bool sorted) {
    const uint32_t top_id = mf_unpack_id(list[0]);
    const float ztop = v.z(mf_logit_bits(v.row, v.dt, top_id));
    if (p.use_min_p && !(mf_exp_neg(mf_fsub(ztop, zmax)) >= p.min_p)) return MF_NO_TOKEN;
    float best_score = mf_fadd(ztop, mf_gumbel(p.seed, p.position, v.base + top_id));
    uint64_t best = mf_pack(mf_key_f32(mf_to_bits(best_score)), top_id);
    for (size_t j = 1; j < n; ++j) {
        const uint32_t i = mf_unpack_id(list[j]);
        const float z = v.z(mf_logit_bits(v.row, v.dt, i));
        if (mf_fadd(z, MF_GUMBEL_BOUND) < best_score) {
            if (sorted) break;  // and so every later one
            continue;
        }
        if (p.use_min_p && !(mf_exp_neg(mf_fsub(z, zmax)) >= p.min_p)) continue;
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, v.base + i));
        const uint64_t packed = mf_pack(mf_key_f32(mf_to_bits(score)), i);
        if (packed > best) {
            best = packed;
            best_score = score;
        }
    }
    return mf_unpack_id(best);
}

// top_p over a list sorted descending, which holds the row's candidates at or above some word
// in the rule's order; `far` bounds the total mass of the candidates below (0: the list holds
// every candidate the select weighs). Returns the survivors' count (a prefix of the list), or 0
// when the bound leaves the threshold undecided (the caller takes the exact whole-row select).
size_t top_p_prefix(const RowView &v, const mf_sample_plan &p, const uint64_t *list, size_t n, float zmax,
                    uint64_t far) {
    thread_local std::vector<uint64_t> mass;
    mass.resize(n);
    uint64_t total = 0;
    for (size_t j = 0; j < n; ++j) {
        const float z = v.z(mf_logit_bits(v.row, v.dt, mf_unpack_id(list[j])));
        total += mass[j] = mf_mass(mf_exp_neg(mf_fsub(z, zmax)));
    }
    // The target lies in [lo, hi] (mf_top_p_target is monotone in the total); the threshold is
    // decided when the running mass first reaches both at the same word.
    const uint64_t lo = mf_top_p_target(total, p.top_p), hi = far ? mf_top_p_target(total + far, p.top_p) : lo;
    uint64_t taken = 0;
    for (size_t j = 0; j < n; ++j) {
        taken += mass[j];
        if (taken >= lo) return taken >= hi ? j + 1 : 0;
    }
    return 0;
}

// Survivors of top_k (k <= kBoundedTopK), then top_p and min_p, then the race: the bounded
// selection's one pass, and the rest over the k words it keeps.
MF_AVX2 uint32_t sample_top_k(const RowView &v, const mf_sample_plan &p) {
    thread_local std::vector<uint64_t> list;
    collect_f32(v, seed_floor(v, p.top_k), p.top_k, std::max<size_t>(4 * (size_t)p.top_k, 256), list);
    if (list.empty()) return MF_NO_TOKEN;
    if (list.size() > p.top_k) {
        std::nth_element(list.begin(), list.begin() + (p.top_k - 1), list.end(), std::greater<uint64_t>());
        list.resize(p.top_k);
    }
    std::sort(list.begin(), list.end(), std::greater<uint64_t>());
    const uint32_t top_id = mf_unpack_id(list[0]);
    const float zmax = v.z(mf_logit_bits(v.row, v.dt, top_id));
    if (!mf_finite_bits(mf_to_bits(zmax))) return top_id;  // as sample_row
    size_t n = list.size();
    if (p.use_top_p) n = top_p_prefix(v, p, list.data(), n, zmax, 0);  // exact: never 0
    return race_list(v, p, list.data(), n, zmax, true);
}

// Without top_k, given the row's top candidate: the candidates near zmax in one more pass over
// the row (from cache), then top_p over them when its threshold is decided there, then the race
// over the survivors. False when the row is too flat for a short list, or the threshold is
// undecided, or zmax too large for the race bound below: the caller takes the whole-row paths.
//
// Why the race needs no id off the list: such an id has fl(z + 24) < zmax, so z < zmax - 24,
// while the top's score is zmax + g with g >= -2.86 (U >= 2**-25). With |zmax| <= 2**20 the
// roundings of z + 18 and of the top's score are under 1/4 each, so fl(z + 18) stays below the
// top's score, and Race::offer would skip the id too.
MF_AVX2 bool sample_near(const RowView &v, const mf_sample_plan &p, uint64_t top, float zmax, uint32_t *id) {
    if (!(zmax >= -1048576.0f && zmax <= 1048576.0f)) return false;
    thread_local std::vector<uint64_t> list;
    const uint32_t key = near_key(v.inv_t, zmax, (uint32_t)(top >> 32));
    if (!collect_f32(v, ((uint64_t)key << 32) - 1u, 0, kNearCap + v.vocab / 64, list)) return false;
    size_t n = list.size();
    if (p.use_top_p) {
        std::sort(list.begin(), list.end(), std::greater<uint64_t>());  // list[0] is `top`
        // Off the list, fl(z - zmax) <= -24: at most kFarMass each, and at most vocab - n ids.
        n = top_p_prefix(v, p, list.data(), n, zmax, (uint64_t)(v.vocab - list.size()) * kFarMass);
        if (!n) return false;
        *id = race_list(v, p, list.data(), n, zmax, true);
        return true;
    }
    std::swap(*std::find(list.begin(), list.end(), top), list[0]);  // the race needs no other order
    *id = race_list(v, p, list.data(), n, zmax, false);
    return true;
}

// ---- top_p without top_k on a flat row: the masses and the race in one pass ----
// On a row too flat for the near list, the threshold lies among many ids, and its exact select
// (select_threshold) takes a mass histogram of every id (a scalar add each) and a pass for the
// threshold's digit before the race's pass. Here one pass sums the masses and runs the race, with
// a cut key `hi` from a sample of the row, meant to lie above the threshold: the race takes its
// best score only from ids at or above hi, and an id under it that could beat that score is
// scored and kept aside. The pass sums every candidate's mass and those at or above hi; when
// mass(>= hi) < target (exact integers), every id at or above hi survives, so the best among them
// is the rule's unless one kept aside has a greater score and survives: a second pass sums the
// masses above those few (their survival: the mass above a word is under the target). The sample
// only decides hi, never the answer: where the check fails the caller takes the exact paths.

// The sample: 32 ids of every kSampleStride, from id 0. A row under kCutVocab ids takes the
// whole-row paths (the sample would be too small to place the cut near the threshold).
constexpr uint32_t kSampleStride = 1024;
constexpr uint32_t kCutVocab = 8192;
// The cut's margin above the sample's estimate, in standard errors of its mass fraction.
constexpr double kCutSigmas = 5.0;
// The most ids kept aside that beat the best, whose survival the second pass decides.
constexpr size_t kMaxAside = 8;

// The masses of 8 lanes as float e * 2**39 (mf_mass before its conversion) and the lanes that are
// not candidates (RowView::candidate).
struct Masses8 {
    __m256 w;
    __m256i bad;
};
MF_AVX2 inline Masses8 masses8(const RowView &v, __m256 l, uint32_t i, uint32_t words, __m256 t, __m256 zm) {
    const __m256 w = _mm256_mul_ps(exp_neg8(_mm256_sub_ps(_mm256_mul_ps(l, t), zm)), _mm256_set1_ps(549755813888.0f));
    return Masses8{w, not_candidates8(v, _mm256_castps_si256(l), i, words)};
}
// The lanes' masses as whole floats, 0 where no candidate: floor(w) is the rule's conversion
// (w < 2**39), and a lane under 1 weighs 0 as it does there.
MF_AVX2 inline __m256 whole8(const Masses8 &m) {
    return _mm256_andnot_ps(_mm256_castsi256_ps(m.bad), _mm256_round_ps(m.w, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
}

// Adds 8 whole masses into float64 lanes: exact while a lane stays under 2**53, which
// sum_masses checks (the sums only grow).
MF_AVX2 inline void add_masses(__m256d acc[2], __m256 whole) {
    acc[0] = _mm256_add_pd(acc[0], _mm256_cvtps_pd(_mm256_castps256_ps128(whole)));
    acc[1] = _mm256_add_pd(acc[1], _mm256_cvtps_pd(_mm256_extractf128_ps(whole, 1)));
}
MF_AVX2 inline bool sum_masses(const __m256d acc[2], uint64_t *sum) {
    alignas(32) double lanes[8];
    _mm256_store_pd(lanes, acc[0]);
    _mm256_store_pd(lanes + 4, acc[1]);
    for (double x : lanes) {
        if (!(x < 9007199254740992.0)) return false;  // 2**53: a sum may have rounded
        *sum += (uint64_t)x;
    }
    return true;
}

// The signed key (mf_key_f32 minus 2**31) of 8 float32 lanes' bits, and the operand that takes
// keys >= `key` (at most 2**32, which takes none) as signed key > it.
MF_AVX2 inline __m256i signed_key8(__m256i b) {
    return _mm256_sign_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)), b);
}
MF_AVX2 inline __m256i key_gt8(uint64_t key) {
    return _mm256_set1_epi32((int)((uint32_t)(key - 1) ^ 0x80000000u));
}

// The cut key where a sample of the row puts the mass at or above it a margin under top_p's
// fraction (2**32: none, the margin is the whole); false when the sample holds no mass.
MF_AVX2 bool sample_cut(const RowView &v, float zmax, float top_p, uint64_t *hi) {
    thread_local std::vector<uint64_t> hist;
    hist.assign(4096, 0);
    const float *p = (const float *)v.row;
    const uint32_t words = mf_bitmask_words(v.vocab);
    const __m256 t = _mm256_set1_ps(v.inv_t), zm = _mm256_set1_ps(zmax);
    const __m256i bias = _mm256_set1_epi32(INT32_MIN);
    uint64_t sum = 0;
    double squares = 0.0;
    alignas(32) float w[8];
    alignas(32) uint32_t keys[8];
    for (uint32_t start = 0; start + 32 <= v.vocab; start += kSampleStride)
        for (uint32_t i = start; i < start + 32; i += 8) {
            const __m256 l = _mm256_loadu_ps(p + i);
            _mm256_store_ps(w, whole8(masses8(v, l, i, words, t, zm)));
            _mm256_store_si256((__m256i *)keys, _mm256_add_epi32(signed_key8(_mm256_castps_si256(l)), bias));
            for (int j = 0; j < 8; ++j) {
                hist[keys[j] >> 20] += (uint64_t)w[j];
                sum += (uint64_t)w[j];
                squares += (double)w[j] * (double)w[j];
            }
        }
    if (!sum) return false;
    // The fraction of the mass at or above a key, estimated from a weighted sample: its standard
    // error is about sqrt(f (1 - f) / n) with n = sum**2 / squares, the sample's effective size.
    const double f = top_p, n = (double)sum * (double)sum / squares;
    const double upper = (f - kCutSigmas * std::sqrt(f * (1.0 - f) / n) - 1.0 / n) * (double)sum;
    if (upper <= 0.0) {
        *hi = (uint64_t)1 << 32;
        return true;
    }
    double above = 0.0;
    int d = 4095;
    for (; d >= 0 && above + (double)hist[d] < upper; --d) above += (double)hist[d];
    *hi = (uint64_t)(d + 1) << 20;  // the buckets above d hold under `upper`
    return true;
}

// A candidate kept aside by the race: its packed word and its packed score.
struct Aside {
    uint64_t word, score;
};

// The mass of the candidates under `hi` whose packed word is above each of the n words, into
// above[j]; false when a sum may have rounded.
MF_AVX2 bool masses_above(const RowView &v, float zmax, uint64_t hi, const Aside *aside, size_t n, uint64_t *above) {
    const float *p = (const float *)v.row;
    const uint32_t words = mf_bitmask_words(v.vocab);
    const __m256 t = _mm256_set1_ps(v.inv_t), zm = _mm256_set1_ps(zmax);
    uint32_t least = ~0u;
    __m256i key_gt[kMaxAside], key_eq[kMaxAside], id_of[kMaxAside];
    __m256d acc[kMaxAside][2];
    for (size_t j = 0; j < n; ++j) {
        const uint32_t key = (uint32_t)(aside[j].word >> 32);
        least = key < least ? key : least;
        key_gt[j] = key_gt8((uint64_t)key + 1u);
        key_eq[j] = _mm256_set1_epi32((int)(key ^ 0x80000000u));
        id_of[j] = _mm256_set1_epi32((int)mf_unpack_id(aside[j].word));
        acc[j][0] = acc[j][1] = _mm256_setzero_pd();
    }
    const __m256i hi_gt = key_gt8(hi), least_gt = key_gt8(least);
    uint32_t i = 0;
    for (; i + 8 <= v.vocab; i += 8) {
        const __m256 l = _mm256_loadu_ps(p + i);
        const __m256i sk = signed_key8(_mm256_castps_si256(l));
        const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(sk, hi_gt), _mm256_cmpgt_epi32(sk, least_gt));
        if (_mm256_testz_si256(in, in)) continue;
        const __m256 whole = _mm256_and_ps(whole8(masses8(v, l, i, words, t, zm)), _mm256_castsi256_ps(in));
        const __m256i ids = _mm256_add_epi32(_mm256_set1_epi32((int)i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (size_t j = 0; j < n; ++j) {  // packed > word: a greater key, or the key and a lower id
            const __m256i greater = _mm256_or_si256(
                _mm256_cmpgt_epi32(sk, key_gt[j]),
                _mm256_and_si256(_mm256_cmpeq_epi32(sk, key_eq[j]), _mm256_cmpgt_epi32(id_of[j], ids)));
            add_masses(acc[j], _mm256_and_ps(whole, _mm256_castsi256_ps(greater)));
        }
    }
    for (size_t j = 0; j < n; ++j) {
        above[j] = 0;
        if (!sum_masses(acc[j], &above[j])) return false;
    }
    for (; i < v.vocab; ++i) {  // the tail, by the scalar rule
        uint32_t bits;
        if (!v.candidate(i, &bits) || mf_key_f32(bits) >= hi) continue;
        const uint64_t packed = mf_pack(mf_key_f32(bits), i), mass = mf_survivor_mass(bits, v.inv_t, zmax);
        for (size_t j = 0; j < n; ++j)
            if (packed > aside[j].word) above[j] += mass;
    }
    return true;
}

// The draw of a float32 row under top_p (and min_p) without top_k, as above, into *id; false
// when the check fails, a sum may have rounded, or too many ids kept aside beat the best: the
// caller takes the whole-row paths. The race's blocks need base % 4 == 0, as race_f32's.
MF_AVX2 bool sample_top_p_f32(const RowView &v, const mf_sample_plan &p, uint64_t top, float zmax, uint32_t *id) {
    uint64_t hi;
    if (v.vocab < kCutVocab || v.vocab >= (1u << 24) || v.base % 4u || !sample_cut(v, zmax, p.top_p, &hi))
        return false;
    if (hi >> 32) return false;  // no cut under the top: every id would be kept aside
    const uint32_t top_id = mf_unpack_id(top);
    const float ztop = v.z(mf_logit_bits(v.row, v.dt, top_id));
    if (p.use_min_p && !(mf_exp_neg(mf_fsub(ztop, zmax)) >= p.min_p)) return false;  // race_row's answer
    const float s0 = mf_fadd(ztop, mf_gumbel(p.seed, p.position, v.base + top_id));
    Race race{v, p, zmax, 0u, mf_pack(mf_key_f32(mf_to_bits(s0)), top_id), s0};
    thread_local std::vector<Aside> aside;
    aside.clear();
    // Race::offer for an id under hi: into `aside` instead of the best.
    auto offer_aside = [&](uint32_t i) {
        uint32_t bits;
        if (!v.candidate(i, &bits)) return;
        const float z = v.z(bits);
        if (mf_fadd(z, MF_GUMBEL_BOUND) < race.best_score) return;
        if (p.use_min_p && !(mf_exp_neg(mf_fsub(z, zmax)) >= p.min_p)) return;
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, v.base + i));
        const uint64_t packed = mf_pack(mf_key_f32(mf_to_bits(score)), i);
        if (packed > race.best) aside.push_back(Aside{mf_pack(mf_key_f32(bits), i), packed});
    };
    const float *row = (const float *)v.row;
    const uint32_t words = mf_bitmask_words(v.vocab);
    const __m256 t = _mm256_set1_ps(v.inv_t), zm = _mm256_set1_ps(zmax);
    // Key >= hi as a float compare, x >= the value of key hi (the key's order is IEEE order but
    // NaN's, which is no candidate); NaN for 2**32, which no key reaches.
    const float hi_value_1 = hi >> 32 ? mf_from_bits(0x7FC00000u) : key_value((uint32_t)hi);
    const __m256 hi_value = _mm256_set1_ps(hi_value_1);
    const __m256 scale = _mm256_set1_ps(549755813888.0f);
    // Not a candidate: a non-finite logit (its mass here is 0: exp_neg8 gives 0 for NaN and
    // for +-inf's differences), a masked id, a bitmask bit clear. Without a bitmask the masked ids
    // are left in (fewer operations a lane) and their masses taken out after the pass.
    const bool bitmask = v.rule->bits != nullptr;
    __m256d total[2], upper[2];
    total[0] = total[1] = upper[0] = upper[1] = _mm256_setzero_pd();
    RaceGroups groups(race);
    uint32_t i = 0;
    for (; i + 32 <= v.vocab; i += 32) {
        for (int j = 0; j < 4; ++j) {
            const __m256 l = _mm256_loadu_ps(row + i + 8 * j);
            const __m256 w = _mm256_mul_ps(exp_neg8(_mm256_sub_ps(_mm256_mul_ps(l, t), zm)), scale);
            __m256 whole = _mm256_round_ps(w, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
            if (bitmask)
                whole = _mm256_andnot_ps(_mm256_castsi256_ps(not_candidates8(v, _mm256_castps_si256(l), i + 8 * j, words)),
                                         whole);
            add_masses(total, whole);
            add_masses(upper, _mm256_and_ps(whole, _mm256_cmp_ps(l, hi_value, _CMP_GE_OQ)));
        }
        unsigned pass = groups.pass(row, i);
        while (pass) {
            const uint32_t lane = (uint32_t)__builtin_ctz(pass), at = i + lane;
            pass &= pass - 1;
            if (at == top_id) continue;
            if (row[at] >= hi_value_1) race.offer(at);
            else offer_aside(at);
        }
    }
    uint64_t all = 0, high = 0;
    if (!sum_masses(total, &all) || !sum_masses(upper, &high)) return false;
    if (!v.rule->bits) {  // the masked ids, summed above when finite
        const uint32_t vector_end = i;
        for (uint32_t m : {v.rule->m0, v.rule->m1 == v.rule->m0 ? MF_NO_TOKEN : v.rule->m1}) {
            if (m >= vector_end || !mf_finite_bits(mf_logit_bits(v.row, v.dt, m))) continue;
            const uint32_t bits = mf_logit_bits(v.row, v.dt, m);
            const uint64_t mass = mf_survivor_mass(bits, v.inv_t, zmax);
            all -= mass;
            high -= mf_key_f32(bits) >= hi ? mass : 0u;
        }
    }
    for (; i < v.vocab; ++i) {  // the tail, by the scalar rule
        uint32_t bits;
        const uint32_t key = mf_key_f32(mf_logit_bits(v.row, v.dt, i));
        if (v.candidate(i, &bits)) {
            const uint64_t mass = mf_survivor_mass(bits, v.inv_t, zmax);
            all += mass;
            high += key >= hi ? mass : 0u;
        }
        if (i == top_id) continue;
        if (key >= hi) race.offer(i);
        else offer_aside(i);
    }
    const uint64_t target = mf_top_p_target(all, p.top_p);
    if (high >= target) return false;  // the threshold may lie at or above hi
    size_t n = 0;  // those kept aside that beat the best
    for (const Aside &a : aside)
        if (a.score > race.best) aside[n++] = a;
    uint64_t best = race.best;
    if (n) {
        uint64_t above[kMaxAside];
        if (n > kMaxAside || !masses_above(v, zmax, hi, aside.data(), n, above)) return false;
        for (size_t j = 0; j < n; ++j)  // it survives when the mass above its word is under the target
            if (high + above[j] < target && aside[j].score > best) best = aside[j].score;
    }
    *id = mf_unpack_id(best);
    return true;
}
#endif

}  // namespace

uint32_t sample_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                    const mf_sampling_params &params, bool vector, uint32_t base) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    row = widened(row, &dtype, vocab, &vector);
    const RowView v{row, (int)dtype, vocab, rule, p.inv_t, base};
#ifdef MF_X86
    if (vector && p.top_k && p.top_k <= kBoundedTopK) return sample_top_k(v, p);
#endif
    const uint64_t top = top_candidate(v);
    if (!top) return MF_NO_TOKEN;
    const uint32_t top_id = mf_unpack_id(top);
    const float zmax = v.z(mf_logit_bits(row, v.dt, top_id));
    if (!mf_finite_bits(mf_to_bits(zmax))) return top_id;  // temperature too small to matter
#ifdef MF_X86
    uint32_t near_id;
    if (vector && !p.top_k && sample_near(v, p, top, zmax, &near_id)) return near_id;
    if (vector && !p.top_k && p.use_top_p && sample_top_p_f32(v, p, top, zmax, &near_id)) return near_id;
#endif

    // The whole-row paths (the portable path's always): radix selects, then the race.
    uint64_t threshold = 0;  // survivors: packed >= threshold
    if (p.top_k) threshold = select_threshold(v, false, zmax, 0, p.top_k, 1.0f, vector);
    if (p.use_top_p) threshold = select_threshold(v, true, zmax, threshold, 0, p.top_p, vector);
    return race_row(v, p, top, zmax, threshold, vector);
}

// A CANDS stage's row: the slice's greatest min(top_k, count) candidates in the rule's order, as
// global ids, in `out` (cap entries; the rest padding). A bounded selection: the list keeps its
// k greatest words whenever it holds 4k, so it never grows past that.
void cands_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
               const mf_sampling_params &params, bool vector, uint32_t base, mf_partial_cand *out, uint32_t cap) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    row = widened(row, &dtype, vocab, &vector);
    const RowView v{row, (int)dtype, vocab, rule, p.inv_t, base};
    const uint32_t k = p.top_k < cap ? p.top_k : cap;
    thread_local std::vector<uint64_t> list;
    list.clear();
    if (k) {
#ifdef MF_X86
        if (vector && dtype == MF_DTYPE_F32) {
            collect_f32(v, seed_floor(v, k), k, std::max<size_t>(4 * (size_t)k, 256), list);
        } else
#endif
        {
            uint64_t floor = 0;
            const size_t most = std::max<size_t>(4 * (size_t)k, 256);
            for (uint32_t i = 0; i < vocab; ++i) {
                uint32_t bits;
                if (!v.candidate(i, &bits)) continue;
                const uint64_t word = mf_pack(mf_key_f32(bits), i);
                if (word <= floor) continue;
                list.push_back(word);
                if (list.size() == most) {
                    std::nth_element(list.begin(), list.begin() + (k - 1), list.end(), std::greater<uint64_t>());
                    floor = list[k - 1];
                    list.resize(k);
                }
            }
        }
        if (list.size() > k) {
            std::nth_element(list.begin(), list.begin() + (k - 1), list.end(), std::greater<uint64_t>());
            list.resize(k);
        }
        std::sort(list.begin(), list.end(), std::greater<uint64_t>());
    }
    for (uint32_t j = 0; j < cap; ++j) {
        if (j < list.size()) {
            const uint32_t id = mf_unpack_id(list[j]);
            out[j] = mf_partial_cand{base + id, mf_logit_bits(row, v.dt, id)};
        } else {
            out[j] = mf_partial_cand{MF_NO_TOKEN, 0u};
        }
    }
}

uint32_t select_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                    const mf_sampling_params &params, bool vector, uint32_t base, uint32_t stage,
                    mf_select_row &st, uint64_t *bins, uint32_t *list_ids, uint32_t list_cap, CandsView cands) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    row = widened(row, &dtype, vocab, &vector);
    const RowView v{row, (int)dtype, vocab, rule, p.inv_t, base};
    if (stage == MF_SELECT_TOP) return mf_unpack_id(top_candidate(v));
    // The whole row's zmax: from its greatest finite candidate, whichever slice holds it.
    const float zmax = (st.flags & MF_SELECT_ROW_TOP) ? v.z(st.top_bits) : mf_neg_inf();
    if (stage == MF_SELECT_RACE && cands.first && (st.flags & MF_SELECT_ROW_CANDS))
        st.floor = mf_pack_max(st.floor, mf_floor_local(mf_cands_threshold(cands.first, cands.stride, cands.world,
                                                                           cands.cap, &p, zmax),
                                                        base, vocab));
    const IdList list{list_ids, list_cap, st.list_len};
    if (st.flags & MF_SELECT_ROW_CUT) {
        st.floor = select_cut(v, st.flags & MF_SELECT_ROW_CUT_MASS, zmax, st.floor, st.cut_key, st.cut_need, vector,
                              list);
        st.flags &= ~(uint32_t)MF_SELECT_ROW_CUT;
    }
    if (stage == MF_SELECT_HIST) {
        if (st.flags & MF_SELECT_ROW_HIST)
            select_histogram(v, st.flags & MF_SELECT_ROW_MASS, zmax, st.floor, st.prefix, st.shift, vector, bins,
                             list);
        return MF_NO_TOKEN;
    }
    const uint64_t top = top_candidate(v);
    if (!top) return MF_NO_TOKEN;
    const uint32_t top_id = mf_unpack_id(top);
    // As sample_row: a z that is not finite (here or in another slice) makes the top the draw;
    // the combine sees it from the records (mf_combine_pick).
    if (!mf_finite_bits(mf_to_bits(v.z(mf_logit_bits(row, v.dt, top_id)))) || !mf_finite_bits(mf_to_bits(zmax)))
        return top_id;
    return race_row(v, p, top, zmax, st.floor, vector);
}

// The survivors of a sampled row under sample_row's filters, for the verifier (verify_host.cpp):
// the greatest finite candidate (0: none), zmax (not finite: the draw is the top) and the top_k and
// top_p threshold on the packed word; min_p is per id, against zmax (verify_rule.h).
SampleTarget sample_target(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                           const mf_sampling_params &params, bool vector) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    row = widened(row, &dtype, vocab, &vector);
    const RowView v{row, (int)dtype, vocab, rule, p.inv_t, 0u};
    SampleTarget t{top_candidate(v), 0.0f, 0u};
    if (!t.top) return t;
    t.zmax = v.z(mf_logit_bits(row, v.dt, mf_unpack_id(t.top)));
    if (!mf_finite_bits(mf_to_bits(t.zmax))) return t;
    if (p.top_k) t.threshold = select_threshold(v, false, t.zmax, 0, p.top_k, 1.0f, vector);
    if (p.use_top_p) t.threshold = select_threshold(v, true, t.zmax, t.threshold, 0, p.top_p, vector);
    return t;
}

// The survivors' total mass under t (sample_target's), min_p included: for_weighted's masses, which
// are the rule's (mf_mass of mf_exp_neg), on the vector path where the row allows.
uint64_t survivor_mass(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                       const mf_sampling_params &params, const SampleTarget &t, bool vector) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    row = widened(row, &dtype, vocab, &vector);
    const RowView v{row, (int)dtype, vocab, rule, p.inv_t, 0u};
    uint64_t total = 0;
    for_weighted(v, true, t.zmax, t.threshold, KeyMask::top12(-1), vector, [&](uint32_t id, uint64_t, uint64_t w) {
        if (p.use_min_p && !(mf_exp_neg(mf_fsub(v.z(mf_logit_bits(v.row, v.dt, id)), t.zmax)) >= p.min_p)) return;
        total += w;
    });
    return total;
}

// A RACE stage's row of a sampled verify over a split vocabulary (mf_argmax_args.select_drafts,
// verify_rule.h): select_row's race, but without the position's draft x (a global id; MF_NO_TOKEN:
// none, the bonus position), and into *mass the slice's survivors' total mass, MF_VERIFY_SURVIVES
// set when x is this slice's and survives. A row whose zmax is not finite draws its top as
// select_row does, draft or not, and sends no mass (the combine needs none there).
uint32_t verify_race_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                         const mf_sampling_params &params, bool vector, uint32_t base, mf_select_row &st,
                         uint32_t *list_ids, uint32_t list_cap, CandsView cands, uint32_t x, uint64_t *mass) {
    *mass = 0;
    uint32_t id = select_row(row, dtype, vocab, rule, params, vector, base, MF_SELECT_RACE, st, nullptr, list_ids,
                             list_cap, cands);  // st.floor now holds the slice's whole threshold
    if (x == MF_NO_TOKEN || !(st.flags & MF_SELECT_ROW_TOP)) return id;
    const mf_sample_plan p = mf_plan_sampling(&params);
    const float zmax = mf_scaled(st.top_bits, p.inv_t);
    if (!mf_finite_bits(mf_to_bits(zmax))) return id;
    row = widened(row, &dtype, vocab, &vector);
    const RowView v{row, (int)dtype, vocab, rule, p.inv_t, base};
    const SampleTarget slice{0u, zmax, st.floor};
    *mass = survivor_mass(row, dtype, vocab, rule, params, slice, vector);
    const uint32_t local = x - base;  // wraps above vocab for a draft below the slice
    uint32_t bits;
    if (local < vocab && v.candidate(local, &bits) && mf_survives(bits, local, st.floor, &p, zmax))
        *mass |= MF_VERIFY_SURVIVES;
    if (id != local || local >= vocab) return id;  // the winner is not the draft: it wins without it too
    Race race{v, p, zmax, st.floor, 0u, mf_neg_inf()};
    for (uint32_t i = 0; i < vocab; ++i)
        if (i != local) race.offer(i);
    return race.best ? mf_unpack_id(race.best) : MF_NO_TOKEN;
}

}  // namespace mf::host
