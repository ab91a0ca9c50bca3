/* The penalty rules (vLLM v1's logit processors), shared verbatim by the CUDA kernel and the host
 * backend so that both change a logit to the same bits: every step is one IEEE float32 operation
 * in round-to-nearest (the _rn intrinsics on the device, -ffp-contract=off on the host), and
 * float16/bfloat16 logits are rounded to nearest even when stored back.
 *
 * Per row, in this order (each stage sees the previous one's stored values):
 *   1. logit_bias:  l = l + bias                           (each biased id once)
 *   2. min_tokens:  l = -inf for each stop id while generated < min_tokens
 *   3. penalties, for each id the prompt or the generated tokens hold (each distinct id once):
 *      repetition: l = l > 0 ? l / rep : l * rep           (prompt or generated)
 *      frequency:  l = l - freq * count                    (generated, count > 0)
 *      presence:   l = l - presence                        (generated, count > 0)
 * A finite logit that stage 1 or 3 would take past the dtype's largest finite value saturates
 * there (mf_penalty_saturate). The neutral values (bias 0, rep 1, freq 0, presence 0) leave every value's bits as they are, so
 * an id needs no test of which penalties are on. Stages 1 and 3 leave a NaN logit as it is, bits
 * and all: an operation on a NaN gives the canonical NaN on the GPU but keeps (and quiets) its
 * payload on the CPU, so only not touching it gives every backend the same bits. */
#ifndef METRALE_FEED_PENALTY_RULE_H
#define METRALE_FEED_PENALTY_RULE_H

#include "metrale_feed/feed.h"
#include "metrale_feed/sample_rule.h"
#include "metrale_feed/verify_rule.h"

/* float32 bits -> bfloat16 bits, round to nearest even; NaN stays a (quiet) NaN. */
MF_HD uint16_t mf_round_bf16(uint32_t bits) {
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return mf_f32_to_bf16(bits); /* rounds up into inf when it should */
}

MF_HD float mf_penalty_load(const void *row, int dtype, uint32_t i) {
    return mf_from_bits(mf_logit_bits(row, dtype, i));
}

MF_HD void mf_penalty_store(void *row, int dtype, uint32_t i, float v) {
    uint32_t bits = mf_to_bits(v);
    if (dtype == 0) ((uint32_t *)row)[i] = bits;
    else ((uint16_t *)row)[i] = dtype == 2 ? mf_round_bf16(bits) : mf_f32_to_f16(bits);
}

MF_HD int mf_penalty_is_nan(float l) { return (mf_to_bits(l) & 0x7FFFFFFFu) > 0x7F800000u; }

/* Stage 3 for one id of the table: `count` is its mf_penalty_entry.count. */
MF_HD float mf_penalize(float l, const mf_penalty_slot *s, uint32_t count) {
    const uint32_t n = count & ~MF_PENALTY_PROMPT;
    l = l > 0.0f ? mf_fdiv(l, s->repetition) : mf_fmul(l, s->repetition);
    if (n) {
        l = mf_fsub(l, mf_fmul(s->frequency, (float)n));
        l = mf_fsub(l, s->presence);
    }
    return l;
}

/* The largest finite value of the row's dtype (float32, float16, bfloat16), as a float32. */
MF_HD float mf_penalty_max(int dtype) {
    return mf_from_bits(dtype == 0 ? 0x7F7FFFFFu : dtype == 2 ? 0x7F7F0000u : 0x477FE000u);
}

/* Stages 1 and 3 never make a finite logit infinite: a result past the dtype's largest finite
 * value (a float32 overflow, or one that would round up into inf when stored) saturates there.
 * Else the argmax would take the +inf id while the sampler, whose candidates are the finite
 * logits, never draws it. A logit that was already infinite keeps the rule's result. */
MF_HD float mf_penalty_saturate(float before, float v, int dtype) {
    if (!mf_finite_bits(mf_to_bits(before))) return v;
    const float m = mf_penalty_max(dtype);
    return v > m ? m : v < -m ? -m : v;
}

/* Stage 1 at column `col` of a row: add `bias`; a NaN is not touched (not even stored back). */
MF_HD void mf_penalty_bias_at(void *row, int dtype, uint32_t col, float bias) {
    const float l = mf_penalty_load(row, dtype, col);
    if (!mf_penalty_is_nan(l))
        mf_penalty_store(row, dtype, col, mf_penalty_saturate(l, mf_fadd(l, bias), dtype));
}

/* Stage 3 at column `col`, for a table entry's `count`; a NaN is not touched. */
MF_HD void mf_penalize_at(void *row, int dtype, uint32_t col, const mf_penalty_slot *s, uint32_t count) {
    const float l = mf_penalty_load(row, dtype, col);
    if (!mf_penalty_is_nan(l))
        mf_penalty_store(row, dtype, col, mf_penalty_saturate(l, mf_penalize(l, s, count), dtype));
}

/* Whether min_tokens bans the stop ids now. */
MF_HD int mf_penalty_bans_stops(const mf_penalty_slot *s) { return s->generated < s->min_tokens; }

/* A slot's counts as the kernels use them: clamped to the capacities, so no state reaches past
 * the slot's part of the tables. */
MF_HD mf_penalty_slot mf_penalty_clamped(mf_penalty_slot s, uint32_t table_cap, uint32_t item_cap) {
    if (s.entries > table_cap) s.entries = table_cap;
    if (s.biases > item_cap) s.biases = item_cap;
    if (s.stops > item_cap - s.biases) s.stops = item_cap - s.biases;
    return s;
}

/* The update of one counted id at table index `found` (table_cap: not there): true when the
 * table changed. A full table drops a new id (the caller sizes tables so that never happens). */
MF_HD int mf_penalty_count(mf_penalty_slot *s, mf_penalty_entry *table, uint32_t table_cap, uint32_t id,
                           uint32_t found) {
    if (s->generated != 0xFFFFFFFFu) ++s->generated;
    if (found < table_cap) {
        if ((table[found].count & ~MF_PENALTY_PROMPT) != ~MF_PENALTY_PROMPT) ++table[found].count;
        return 1;
    }
    if (s->entries >= table_cap) return 0;
    table[s->entries].id = id;
    table[s->entries].count = 1u;
    ++s->entries;
    return 1;
}

/* ---- a verify's logit rows (feed.h: mf_penalty_args.k > 0) ----
 * Position j of a row is judged with what its first j drafts would leave had they been generated:
 * the walk counts drafts [0, w), w = min(j, the row's drafts in use), a MF_NO_TOKEN draft ending
 * them as it ends the verify's (mf_verify_drafts: no position past it is read). Each walked draft
 * adds one to its id's count and to `generated`, as mf_penalty_count would, so the values are the
 * ones mf_penalties_apply gives once those drafts are counted: the same function of the same
 * counts, so the same bits. */
MF_HD uint32_t mf_penalty_walked(const uint32_t *drafts, uint32_t k, uint32_t j) {
    const uint32_t d = mf_verify_drafts(drafts, k);
    return j < d ? j : d;
}

/* How many of the walked drafts [0, w) are `id`. */
MF_HD uint32_t mf_penalty_draft_count(const uint32_t *drafts, uint32_t w, uint32_t id) {
    uint32_t n = 0u;
    for (uint32_t u = 0; u < w; ++u) n += drafts[u] == id;
    return n;
}

/* A table entry's count word after `more` counts of its id (mf_penalty_count's saturation). */
MF_HD uint32_t mf_penalty_count_plus(uint32_t count, uint32_t more) {
    const uint32_t n = count & ~MF_PENALTY_PROMPT, room = ~MF_PENALTY_PROMPT - n;
    return (count & MF_PENALTY_PROMPT) | (n + (more < room ? more : room));
}

/* The slot's `generated` after w counted drafts (saturating, as mf_penalty_count's). */
MF_HD mf_penalty_slot mf_penalty_walk_slot(mf_penalty_slot s, uint32_t w) {
    s.generated = s.generated > 0xFFFFFFFFu - w ? 0xFFFFFFFFu : s.generated + w;
    return s;
}

/* Whether walked draft u's id is one of the drafts before it. */
MF_HD int mf_penalty_draft_repeats(const uint32_t *drafts, uint32_t u) {
    for (uint32_t v = 0; v < u; ++v)
        if (drafts[v] == drafts[u]) return 1;
    return 0;
}

/* Whether walked draft u's id joins the table: known[v] is nonzero when draft v's id is in the
 * table or repeats an earlier draft's (mf_penalty_draft_repeats), so the drafts with known[v] 0 are
 * the new ids in the order the counts would append them, and a table of `entries` keeps those
 * that fit (a full table drops a new id, as mf_penalty_count does). Stage 3 penalises each id that
 * joins with its count among the walked drafts and no prompt bit, beside the table's own ids. */
MF_HD int mf_penalty_draft_joins(const uint32_t *known, uint32_t u, uint32_t entries, uint32_t table_cap) {
    if (known[u]) return 0;
    uint32_t before = 0u;
    for (uint32_t v = 0; v < u; ++v) before += !known[v];
    return entries < table_cap && before < table_cap - entries;
}

#endif
