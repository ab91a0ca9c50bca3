// ---- top_p without top_k on a flat row: the masses and the race in one pass ----
// On a row too flat for the near list, the threshold lies among many ids, and its exact select
// (select_threshold) takes a mass histogram of every id (a scalar add each) and a pass for the
// threshold's digit before the race's pass. Here one pass sums the masses and runs the race, with
// a cut key `hi` from a sample of the row, meant to lie above the threshold: the race takes its
// best score only from ids at or above hi, and an id under it that could beat that score is
// scored and kept aside. The pass sums every candidate's mass (exactly) and bounds the mass of
// those at or above hi (add_block); when mass(>= hi) < target, every id at or above hi survives, so the best among them
// is the rule's unless one kept aside has a greater score and survives: a second pass sums the
// masses above those few (their survival: the mass above a word is under the target). The sample
// only decides hi, never the answer: where the check fails the caller takes the exact paths.


#include <cmath>
#include <vector>

#include "sample_host.hpp"

#ifdef MF_X86
namespace mf::host::sampler {
namespace {

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

// The ids of one pass's block: 32 groups of 32, 4 KiB of float32 (L1-resident between its loops).
constexpr uint32_t kBlock = 1024;

// The one pass's masses of ids [b, e) (whole groups of 8) into `total`, exactly, and those of
// logit >= `hi_value` into `upper` as float32 sums, one a lane, each added to its float64 lane at
// the block's end (exactly); with kBitmask the non-candidates weigh 0 (the caller takes the
// masked ids out otherwise). A float32 sum of at most kBlock / 8 nonnegative terms is within a
// factor (1 +- 2**-16) of theirs (at most 127 roundings of relative error 2**-24 each: under
// 127 * 2**-24 / (1 - 127 * 2**-24) < 2**-17), so `upper` is too (upper_bounds). That is all the
// check needs, and it saves the two conversions and adds of an exact sum for every 8 ids.
template <bool kBitmask>
MF_AVX2 inline void add_block(const RowView &v, uint32_t b, uint32_t e, float zmax, float hi_value, __m256d total[2],
                              __m256d upper[2]) {
    const float *row = (const float *)v.row;
    const uint32_t words = mf_bitmask_words(v.vocab);
    const __m256 t = _mm256_set1_ps(v.inv_t), zm = _mm256_set1_ps(zmax), hi = _mm256_set1_ps(hi_value);
    const __m256 scale = _mm256_set1_ps(549755813888.0f);
    __m256d acc[2] = {total[0], total[1]};
    __m256 up = _mm256_setzero_ps();
    for (uint32_t i = b; i < e; i += 8) {
        const __m256 l = _mm256_loadu_ps(row + i);
        const __m256 w = _mm256_mul_ps(exp_neg8(_mm256_sub_ps(_mm256_mul_ps(l, t), zm)), scale);
        __m256 whole = _mm256_round_ps(w, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        if (kBitmask)
            whole = _mm256_andnot_ps(_mm256_castsi256_ps(not_candidates8(v, _mm256_castps_si256(l), i, words)), whole);
        add_masses(acc, whole);
        up = _mm256_add_ps(up, _mm256_and_ps(whole, _mm256_cmp_ps(l, hi, _CMP_GE_OQ)));
    }
    total[0] = acc[0], total[1] = acc[1];
    add_masses(upper, up);  // a float32 sum is an integer (each term is, and so is its rounding)
}
static_assert(kBlock / 8 - 1 <= 127, "add_block's bound counts at most 127 roundings a lane");

// Bounds of the exact sum whose float32 block sums add up to `sum` (add_block): within
// sum * 2**-16 either way, plus 1 for the floating-point of the bound itself.
inline void upper_bounds(uint64_t sum, uint64_t *lo, uint64_t *hi) {
    const uint64_t slack = (sum >> 16) + 1;
    *lo = sum > slack ? sum - slack : 0;
    *hi = sum + slack;
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

}  // namespace


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
    // Key >= hi as a float compare, x >= the value of key hi (the key's order is IEEE order but
    // NaN's, which is no candidate); NaN for 2**32, which no key reaches.
    const float hi_value_1 = hi >> 32 ? mf_from_bits(0x7FC00000u) : key_value((uint32_t)hi);
    // Not a candidate: a non-finite logit (its mass here is 0: exp_neg8 gives 0 for NaN and
    // for +-inf's differences), a masked id, a bitmask bit clear. Without a bitmask the masked ids
    // are left in (fewer operations a lane) and their masses taken out after the pass.
    const bool bitmask = v.rule->bits != nullptr;
    __m256d total[2], upper[2];
    total[0] = total[1] = upper[0] = upper[1] = _mm256_setzero_pd();
    RaceGroups groups(race);
    // A block's masses, then its race: two loops over the block (from L1), each with its own
    // registers, where one loop doing both spilled the exp's constants and the race's.
    const uint32_t vector_end = v.vocab & ~31u;
    for (uint32_t b = 0, e; b < vector_end; b = e) {
        e = vector_end - b > kBlock ? b + kBlock : vector_end;
        if (bitmask) add_block<true>(v, b, e, zmax, hi_value_1, total, upper);
        else add_block<false>(v, b, e, zmax, hi_value_1, total, upper);
        for (uint32_t i = b; i < e; i += 32) {
            unsigned pass = groups.pass(row, i);
            while (pass) {
                const uint32_t lane = (uint32_t)__builtin_ctz(pass), at = i + lane;
                pass &= pass - 1;
                if (at == top_id) continue;
                if (row[at] >= hi_value_1) race.offer(at);
                else offer_aside(at);
            }
        }
    }
    uint32_t i = vector_end;
    uint64_t all = 0, upper_sum = 0, high_lo, high_hi;  // mass(>= hi) lies in [high_lo, high_hi]
    if (!sum_masses(total, &all) || !sum_masses(upper, &upper_sum)) return false;
    upper_bounds(upper_sum, &high_lo, &high_hi);
    if (!v.rule->bits) {  // the masked ids, summed above when finite
        for (uint32_t m : {v.rule->m0, v.rule->m1 == v.rule->m0 ? MF_NO_TOKEN : v.rule->m1}) {
            if (m >= vector_end || !mf_finite_bits(mf_logit_bits(v.row, v.dt, m))) continue;
            const uint32_t bits = mf_logit_bits(v.row, v.dt, m);
            const uint64_t mass = mf_survivor_mass(bits, v.inv_t, zmax);
            all -= mass;
            if (mf_key_f32(bits) >= hi) {
                high_lo = high_lo > mass ? high_lo - mass : 0u;
                high_hi -= mass;  // >= mass: the exact sum, which holds it, is at most high_hi
            }
        }
    }
    for (; i < v.vocab; ++i) {  // the tail, by the scalar rule
        uint32_t bits;
        const uint32_t key = mf_key_f32(mf_logit_bits(v.row, v.dt, i));
        if (v.candidate(i, &bits)) {
            const uint64_t mass = mf_survivor_mass(bits, v.inv_t, zmax);
            all += mass;
            if (key >= hi) high_lo += mass, high_hi += mass;
        }
        if (i == top_id) continue;
        if (key >= hi) race.offer(i);
        else offer_aside(i);
    }
    const uint64_t target = mf_top_p_target(all, p.top_p);
    if (high_hi >= target) return false;  // the threshold may lie at or above hi
    size_t n = 0;  // those kept aside that beat the best
    for (const Aside &a : aside)
        if (a.score > race.best) aside[n++] = a;
    uint64_t best = race.best;
    if (n) {
        uint64_t above[kMaxAside];
        if (n > kMaxAside || !masses_above(v, zmax, hi, aside.data(), n, above)) return false;
        for (size_t j = 0; j < n; ++j) {  // it survives when the mass above its word is under the target
            if (high_lo + above[j] < target && high_hi + above[j] >= target) return false;  // undecided
            if (high_hi + above[j] < target && aside[j].score > best) best = aside[j].score;
        }
    }
    *id = mf_unpack_id(best);
    return true;
}

}  // namespace mf::host::sampler
#endif
