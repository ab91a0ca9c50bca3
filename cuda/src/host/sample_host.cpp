// Sampling one row on the CPU, under sample_rule.h. The filters are thresholds on the packed word
// (logit key, ~id). The vector path finds them in short lists (sample_list.cpp; top_p alone on a
// flat row in one pass, sample_top_p.cpp): with top_k (up to kBoundedTopK), a
// bounded selection in one pass over the row keeps the k greatest words, and top_p, min_p and the
// race run over those k; without top_k, after the argmax pass a second pass lists the ids near
// the top (the only ones that can win the race, and all but a bounded sliver of top_p's mass).
// The portable path, and the vector path where a list does not settle the answer, find them by a
// radix select over the candidates, narrowed digit by digit; both give the same survivors. The
// whole-row race draws exact scores only for ids that could still beat the best score so far:
// first the exact bound z + MF_GUMBEL_BOUND, then (AVX2, float32 rows) a necessary condition on
// the id's uniform, g = -log(-log U) <= -log(1 - U), checked 32 ids at a time with a vector
// Philox. Every skip is a proof that the id cannot win, and every id that is not skipped is scored by the scalar rule, so
// both paths give the rule's id (tests compare them); the vector code only decides what to skip,
// except the masses of top_p, whose vector exp repeats sample_rule.h's operations one for one.
#include <algorithm>
#include <functional>
#include <vector>

#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/verify_rule.h"
#include "sample_host.hpp"

namespace mf::host {
using namespace sampler;

#ifdef MF_X86
namespace sampler {
namespace {

// The greatest r in [0, 2**24) whose one_minus_u_exponent is >= `e_out`, or -1 for none: the
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
}  // namespace

// uniform_out_below of every e_out from 0 to 129 (gap_exponent is at most 0), made once.
const int32_t *uniform_out_table() {
    static const std::vector<int32_t> table = [] {
        std::vector<int32_t> t(130);
        for (int32_t e = 0; e < 130; ++e) t[e] = uniform_out_below(e);
        return t;
    }();
    return table.data();
}
}  // namespace sampler
#endif

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

#ifdef MF_X86

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

#ifdef MF_X86
// Temperature alone (no filter) on a float32 row: the race over the whole row with no argmax pass
// before it. It starts with no best score, so the first groups offer every id to the scalar rule
// until one scores; from then on RaceGroups::pass skips as race_f32 does after the top's score, a
// little less at first (the best score so far is at most the top's). Every id is offered or
// proved unable to win, so the winner is race_row's. False where the best score is not finite or
// no candidate scored: then the top's z is not finite either (z is monotone in the logit; an
// infinite z scores infinite, and no candidate's score is finite when the top's z is -inf or NaN),
// and sample_row's paths answer as before.
MF_AVX2 bool race_alone_f32(const RowView &v, const mf_sample_plan &p, uint32_t *id) {
    Race race{v, p, 0.0f, 0u, 0u, mf_neg_inf()};
    race_f32(race, MF_NO_TOKEN);
    if (!race.best || !mf_finite_bits(mf_to_bits(race.best_score))) return false;
    *id = mf_unpack_id(race.best);
    return true;
}
#endif

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

}  // namespace

uint32_t sample_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                    const mf_sampling_params &params, bool vector, uint32_t base) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    row = widened(row, &dtype, vocab, &vector);
    const RowView v{row, (int)dtype, vocab, rule, p.inv_t, base};
#ifdef MF_X86
    if (vector && p.top_k && p.top_k <= kBoundedTopK) return sample_top_k(v, p);
    uint32_t alone_id;
    if (vector && !p.top_k && !p.use_top_p && !p.use_min_p && base % 4u == 0u && race_alone_f32(v, p, &alone_id))
        return alone_id;
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
