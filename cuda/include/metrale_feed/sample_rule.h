/* The sampling rule, shared verbatim by the CUDA kernel and the host kernel, written so that both
 * compute the same bits: every floating-point operation is one IEEE operation in round-to-nearest
 * (on the device through the _rn intrinsics, which the compiler never fuses; on the host the
 * library is built with -ffp-contract=off and runs with FTZ/DAZ cleared), exp and log are our own
 * polynomials rather than a math library's, and every sum is an integer sum, so its order does
 * not matter.
 *
 * A row's candidates are the ids its masks and bitmask allow whose logit is finite. With
 * z = logit * (1 / temperature) (the reciprocal rounded once per row: a multiply per id, and
 * still monotone in the logit) and zmax the greatest z:
 * - the weight of id v is e(v) = exp(z(v) - zmax) in (0, 1], its mass floor(e(v) * 2**39) (an
 *   integer: 2**24 ids of mass <= 2**39 sum without overflow, in any order);
 * - top_k keeps the k greatest packed words (logit key, ~id): ties at the boundary to the lower id;
 * - top_p keeps, in that order, the shortest prefix whose mass reaches ceil(total * top_p);
 * - min_p keeps the ids with e(v) >= min_p (e(v) is the probability over the largest's);
 * - the survivor with the greatest race score z(v) + g(v) wins, ties to the lower id, where
 *   g(v) = -log(-log U(seed, position, v)) is a Gumbel variate from Philox (philox.h). This
 *   "exponential race" is an exact draw from softmax(z) renormalised over the survivors, and
 *   each id's score depends on that id alone, so the winner is the same however the row is split.
 * Every filter is a threshold on the packed word, found by a radix select (no sort). */
#ifndef METRALE_FEED_SAMPLE_RULE_H
#define METRALE_FEED_SAMPLE_RULE_H

#include "metrale_feed/argmax_rule.h"
#include "metrale_feed/partial_layout.h"
#include "metrale_feed/philox.h"

#if defined(__CUDA_ARCH__)
MF_HD float mf_fadd(float a, float b) { return __fadd_rn(a, b); }
MF_HD float mf_fsub(float a, float b) { return __fsub_rn(a, b); }
MF_HD float mf_fmul(float a, float b) { return __fmul_rn(a, b); }
MF_HD float mf_fdiv(float a, float b) { return __fdiv_rn(a, b); }
MF_HD float mf_floor(float a) { return floorf(a); }
#else
MF_HD float mf_fadd(float a, float b) { return a + b; }
MF_HD float mf_fsub(float a, float b) { return a - b; }
MF_HD float mf_fmul(float a, float b) { return a * b; }
MF_HD float mf_fdiv(float a, float b) { return a / b; }
MF_HD float mf_floor(float a) { return __builtin_floorf(a); } /* exact: no rounding involved */
#endif

MF_HD float mf_from_bits(uint32_t b) {
    union { uint32_t u; float f; } c;
    c.u = b;
    return c.f;
}
MF_HD uint32_t mf_to_bits(float f) {
    union { float f; uint32_t u; } c;
    c.f = f;
    return c.u;
}
MF_HD float mf_neg_inf(void) { return mf_from_bits(0xFF800000u); }

#define MF_MASS_BITS 39
/* Above every Gumbel variate this rule can produce: U >= 2**-25, so -log U >= ~2**-25 and
 * g <= 25 ln 2 ~ 17.33 (plus rounding). A candidate whose z trails the best score by more than
 * this cannot win the race, so it is skipped without drawing its noise. */
#define MF_GUMBEL_BOUND 18.0f

/* float16 bits -> float32 bits, exactly (subnormal halves become normal floats). */
MF_HD uint32_t mf_f16_to_f32_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0x1Fu) return sign | 0x7F800000u | (mant << 13);
    if (exp == 0u) {
        if (mant == 0u) return sign;
        int e = -1;
        do { mant <<= 1; ++e; } while (!(mant & 0x400u));
        return sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FFu) << 13);
    }
    return sign | ((exp + 112u) << 23) | (mant << 13);
}

/* Element i of a row as float32 bits (mf_dtype codes: 0 f32, 1 f16, 2 bf16). */
MF_HD uint32_t mf_logit_bits(const void *row, int dtype, uint32_t i) {
    if (dtype == 0) return ((const uint32_t *)row)[i];
    uint16_t b = ((const uint16_t *)row)[i];
    return dtype == 2 ? (uint32_t)b << 16 : mf_f16_to_f32_bits(b);
}

MF_HD int mf_finite_bits(uint32_t bits) { return (bits & 0x7F800000u) != 0x7F800000u; }

/* Whether id i of a row is a sampling candidate: not masked, allowed by the bitmask and finite
 * (`bits` gets its logit then). The sampler, the verifier and a split verify's TOP stage ask it. */
MF_HD int mf_candidate(const void *row, int dtype, const mf_row_rule *rule, uint32_t i, uint32_t *bits) {
    if (i == rule->m0 || i == rule->m1 || !mf_bit_allowed(rule->bits, i)) return 0;
    *bits = mf_logit_bits(row, dtype, i);
    return mf_finite_bits(*bits);
}

/* exp(x) for x <= 0: Cody-Waite reduction by ln 2 and a degree-6 polynomial. Results below
 * 2**-125 are 0 here by definition (never a subnormal, whose handling a mode could change). */
MF_HD float mf_exp_neg(float x) {
    if (!(x >= -86.0f)) return 0.0f; /* also NaN */
    float n = mf_floor(mf_fadd(mf_fmul(x, 1.44269502f), 0.5f));
    float r = mf_fsub(mf_fsub(x, mf_fmul(n, 0.693145751953125f)), mf_fmul(n, 1.42860677e-06f));
    float p = 1.38888889e-03f;
    p = mf_fadd(mf_fmul(p, r), 8.33333333e-03f);
    p = mf_fadd(mf_fmul(p, r), 4.16666667e-02f);
    p = mf_fadd(mf_fmul(p, r), 1.66666667e-01f);
    p = mf_fadd(mf_fmul(p, r), 0.5f);
    p = mf_fadd(mf_fmul(p, r), 1.0f);
    p = mf_fadd(mf_fmul(p, r), 1.0f);
    int32_t k = (int32_t)n;
    if (k < -125) return 0.0f;
    return mf_from_bits((uint32_t)((int32_t)mf_to_bits(p) + k * (1 << 23))); /* p * 2**k, exact */
}

/* log(x) for a positive normal x: x = m * 2**e with m in [sqrt(1/2), sqrt(2)), then
 * log m = 2 atanh(s), s = (m - 1) / (m + 1), as an odd series in s. */
MF_HD float mf_log_pos(float x) {
    uint32_t bits = mf_to_bits(x);
    int32_t e = (int32_t)(bits >> 23) - 127;
    uint32_t mant = bits & 0x7FFFFFu;
    if (mant > 0x3504F3u) { /* m > sqrt(2): halve it */
        mant |= 126u << 23;
        e += 1;
    } else {
        mant |= 127u << 23;
    }
    float m = mf_from_bits(mant);
    float f = mf_fsub(m, 1.0f);
    float s = mf_fdiv(f, mf_fadd(m, 1.0f));
    float z = mf_fmul(s, s);
    float q = 0.111111111f;
    q = mf_fadd(mf_fmul(q, z), 0.142857143f);
    q = mf_fadd(mf_fmul(q, z), 0.2f);
    q = mf_fadd(mf_fmul(q, z), 0.333333333f);
    q = mf_fadd(mf_fmul(q, z), 1.0f);
    float logm = mf_fmul(mf_fmul(2.0f, s), q);
    float fe = (float)e;
    return mf_fadd(mf_fmul(fe, 0.693145751953125f), mf_fadd(logm, mf_fmul(fe, 1.42860677e-06f)));
}

/* U in (0, 1) from 32 random bits: (24 bits + 1/2) / 2**24, exact in float32. */
MF_HD float mf_uniform(uint32_t bits) {
    return mf_fmul(mf_fadd((float)(bits >> 8), 0.5f), 5.96046448e-08f);
}

/* The Gumbel variate of id v: -log(-log U(seed, position, v)). */
MF_HD float mf_gumbel(uint64_t seed, uint32_t position, uint32_t v) {
    float u = mf_uniform(mf_philox_bits(seed, position, v));
    return -mf_log_pos(-mf_log_pos(u));
}

/* z of a logit (float32 bits). */
MF_HD float mf_scaled(uint32_t bits, float inv_t) { return mf_fmul(mf_from_bits(bits), inv_t); }

/* floor(e * 2**39); through int64, one conversion instruction on every target (the value is below
 * 2**39, so it is the same integer as a direct unsigned conversion). */
MF_HD uint64_t mf_mass(float e) { return (uint64_t)(int64_t)mf_fmul(e, 549755813888.0f); }

/* A candidate's mass (logit `bits`): floor(exp(z - zmax) * 2**39), the weight top_p counts. */
MF_HD uint64_t mf_survivor_mass(uint32_t bits, float inv_t, float zmax) {
    return mf_mass(mf_exp_neg(mf_fsub(mf_scaled(bits, inv_t), zmax)));
}

/* ceil(total * top_p), at least 1, with top_p as a 32-bit binary fraction (integer math). */
MF_HD uint64_t mf_top_p_target(uint64_t total, float top_p) {
    uint64_t frac = top_p >= 1.0f ? (1ull << 32) : (uint64_t)mf_fmul(top_p, 4294967296.0f);
    /* total < 2**63, frac <= 2**32: the 96-bit product in two halves. */
    uint64_t lo = (total & 0xFFFFFFFFull) * frac, hi = (total >> 32) * frac;
    uint64_t low32 = lo & 0xFFFFFFFFull;
    uint64_t q = hi + (lo >> 32); /* floor(total * frac / 2**32) */
    uint64_t t = q + (low32 != 0u);
    return t ? t : 1u;
}

/* A row's sampling parameters, sanitised: device-resident ones are not checked before launch, so
 * a value out of range means its neutral setting. greedy: the argmax rule. */
typedef struct mf_sample_plan {
    float temperature, inv_t, top_p, min_p;
    uint32_t top_k;
    uint64_t seed;
    uint32_t position;
    int greedy, use_top_p, use_min_p;
} mf_sample_plan;

MF_HD mf_sample_plan mf_plan_sampling(const mf_sampling_params *p) {
    mf_sample_plan s;
    s.temperature = p->temperature;
    s.top_p = p->top_p;
    s.min_p = p->min_p;
    s.top_k = p->top_k;
    s.seed = p->seed;
    s.position = p->position;
    s.greedy = !(s.temperature > 0.0f && s.temperature <= 3.4e38f);
    s.inv_t = s.greedy ? 0.0f : mf_fdiv(1.0f, s.temperature);
    s.use_top_p = s.top_p > 0.0f && s.top_p < 1.0f;
    s.use_min_p = s.min_p > 0.0f && s.min_p < 1.0f;
    return s;
}

/* Whether a candidate (finite logit `bits`, local id) survives the filters: packed >= the
 * top_k/top_p threshold (0: none), and min_p against zmax. */
MF_HD int mf_survives(uint32_t bits, uint32_t id, uint64_t threshold, const mf_sample_plan *p, float zmax) {
    if (threshold && mf_pack(mf_key_f32(bits), id) < threshold) return 0;
    return !p->use_min_p || mf_exp_neg(mf_fsub(mf_scaled(bits, p->inv_t), zmax)) >= p->min_p;
}

/* One radix-select step: `bins` holds the weight of each value of the digit at `shift` among the
 * elements above which `above` weight already lies; returns the digit where the running weight
 * first reaches `target` and adds the weight of the greater digits to *above. */
MF_HD uint32_t mf_select_digit(const uint64_t *bins, uint64_t *above, uint64_t target) {
    for (int d = 255; d > 0; --d) {
        if (*above + bins[d] >= target) return (uint32_t)d;
        *above += bins[d];
    }
    return 0u;
}

/* ---- a split row's thresholds (feed.h's MF_ARGS_SELECT; docs/kernels.md) ----
 * A threshold over the whole row is selected 8 bits of the logit key at a time: each slice
 * histograms the next digit of its candidates whose higher key bits equal the digits selected so
 * far, the slices' histograms are summed (integer sums) and mf_select_digit's rule picks the
 * digit. The 32-bit key K so found is cut by id: ids in id order, so a slice takes its own
 * candidates at K, lowest id first, while the weight taken before them is short of the target. */
MF_HD int mf_select_in_prefix(uint32_t key, uint32_t prefix, uint32_t shift) {
    return shift >= 24u || (key >> (shift + 8u)) == (prefix >> (shift + 8u));
}
/* A shift past the key (a state no decision writes) reads digit 0 on every backend alike. */
MF_HD uint32_t mf_select_digit8(uint32_t key, uint32_t shift) { return shift < 32u ? (key >> shift) & 255u : 0u; }
/* The packed threshold that keeps every candidate at key K, or none of them. */
MF_HD uint64_t mf_cut_all(uint32_t key) { return (uint64_t)key << 32; }
MF_HD uint64_t mf_cut_none(uint32_t key) { return ((uint64_t)key + 1u) << 32; }

/* A global packed threshold (logit key, ~global id) as the threshold of the slice whose local id 0
 * is global id `start` and which holds `width` ids: at the threshold's key, the slice keeps its
 * ids up to the threshold's id, so all of them when that id lies above the slice and none when
 * it lies below. 0 stays 0 (nothing out). */
MF_HD uint64_t mf_floor_local(uint64_t t, uint32_t start, uint32_t width) {
    if (!t) return 0u;
    const uint32_t key = (uint32_t)(t >> 32), id = mf_unpack_id(t);
    if (id < start) return mf_cut_none(key);
    if (id - start >= width) return mf_cut_all(key);
    return mf_pack(key, id - start);
}

/* A CANDS entry's packed word on global ids (0: padding). */
MF_HD uint64_t mf_cand_word(const mf_partial_cand *c) {
    return c->id == MF_NO_TOKEN ? 0ull : mf_pack(mf_key_f32(c->logit_bits), c->id);
}

/* The most slices whose CANDS lists one row merges (the merge keeps a cursor per slice). */
#define MF_CANDS_MAX_WORLD 64u

/* The next entry of `world` lists merged in the rule's order (the greatest global packed word;
 * every list descends), or 0 when they are spent; advances that list's cursor. List w of the row
 * starts at `first + w * stride` bytes and holds `cap` entries. */
MF_HD uint64_t mf_cands_next(const char *first, uint64_t stride, uint32_t world, uint32_t cap, uint32_t *cur,
                             uint32_t *bits) {
    uint64_t best = 0;
    uint32_t from = 0;
    for (uint32_t w = 0; w < world; ++w) {
        if (cur[w] >= cap) continue;
        const mf_partial_cand *c = (const mf_partial_cand *)(first + (uint64_t)w * stride) + cur[w];
        const uint64_t word = mf_cand_word(c);
        if (word > best) {
            best = word;
            from = w;
            *bits = c->logit_bits;
        }
    }
    if (best) ++cur[from];
    return best;
}

/* A split row's top_k (at most the lists' cap) then top_p threshold, as a global packed word,
 * from every slice's CANDS list: each slice lists its greatest min(top_k, count) candidates, so
 * the lists hold the row's top_k greatest (or all of its candidates, when it has no more), and
 * their merge walks them in the rule's order. top_k keeps the first top_k of the walk; top_p
 * the shortest prefix of those whose mass (against zmax, the row's greatest z) reaches
 * ceil(total * top_p), total over the top_k: the survivors sample_row keeps on the whole row.
 * Two walks of at most top_k steps. Returns 0 when nothing is cut. */
MF_HD uint64_t mf_cands_threshold(const char *first, uint64_t stride, uint32_t world, uint32_t cap,
                                  const mf_sample_plan *p, float zmax) {
    uint32_t cur[MF_CANDS_MAX_WORLD];
    const uint32_t k = p->top_k < cap ? p->top_k : cap;
    uint64_t kth = 0, total = 0;
    uint32_t n = 0, bits = 0;
    for (uint32_t w = 0; w < world; ++w) cur[w] = 0u;
    for (; n < k; ++n) {
        const uint64_t word = mf_cands_next(first, stride, world, cap, cur, &bits);
        if (!word) break;
        kth = word;
        if (p->use_top_p) total += mf_survivor_mass(bits, p->inv_t, zmax);
    }
    /* Fewer than k candidates in the whole row: top_k cuts nothing (the rule's "all of them
     * fit"); k of them: the k-th word keeps exactly them (the lists end at k, so whether more
     * follow is not known here, nor needed). */
    const uint64_t t = n == k ? kth : 0u;
    if (!p->use_top_p || !n) return t;
    const uint64_t target = mf_top_p_target(total, p->top_p);
    uint64_t taken = 0;
    for (uint32_t w = 0; w < world; ++w) cur[w] = 0u;
    for (uint32_t j = 0; j < n; ++j) {
        const uint64_t word = mf_cands_next(first, stride, world, cap, cur, &bits);
        taken += mf_survivor_mass(bits, p->inv_t, zmax);
        if (taken >= target) return word > t ? word : t;
    }
    return t;
}

#endif
