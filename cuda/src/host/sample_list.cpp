// The vector path's selections (sample_host.hpp): one pass into a short list of candidates.
// Both lists below hold packed words (logit key, ~id), so sorting them descending is the rule's
// order (greatest logit first, ties to the lower id), and z is non-increasing along them.

#include <algorithm>
#include <functional>
#include <vector>

#include "sample_host.hpp"

#ifdef MF_X86
namespace mf::host::sampler {
namespace {

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

}  // namespace


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

namespace {

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

}  // namespace


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

}  // namespace mf::host::sampler
#endif
