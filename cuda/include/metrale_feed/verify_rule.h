/* Speculative verification (verify_to_feed, feed.h), shared verbatim by the CUDA kernel and the
 * host kernel: what a position decides is these functions on both.
 *
 * Position j of a row is judged under the rule sample_to_feed would apply there: its params with
 * position + j (the argmax rule when greedy). With one-hot draft distributions q_j (draft x_j
 * has probability 1) the speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023)
 * becomes: accept x_j with probability p_j(x_j); at the first rejection emit a draw from p_j
 * without x_j, renormalised; after the last accepted draft emit a draw from p_j itself. Each
 * emitted id is then distributed as p_j, whatever the drafts were.
 *
 * p_j(x) is a survivor's mass over the survivors' total (sample_rule.h's integer masses, so the
 * sum is the same in any order); the draw without x is sample_rule.h's exponential race over the
 * survivors other than x, so a rejected position emits sample_to_feed's own id at position + j
 * unless that id is x, in which case it emits the race's runner-up.
 *
 * Counter streams: the race's Gumbel of id v at position P uses Philox block (v / 4, P, 0, 0)
 * (philox.h). The accept uniform of position P uses block (0, P, 1, 0), word 0: the third counter
 * word is 1 in this stream and 0 in every race's, so no accept uniform is ever a race's draw and
 * the accept decision is independent of the residual draw. */
#ifndef METRALE_FEED_VERIFY_RULE_H
#define METRALE_FEED_VERIFY_RULE_H

#include "metrale_feed/feed.h"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/sample_rule.h"

#define MF_VERIFY_STREAM 1u /* the third Philox counter word of the accept uniforms */

/* The 32 random bits of the accept uniform at (seed, position). */
MF_HD uint32_t mf_verify_uniform_bits(uint64_t seed, uint32_t position) {
    mf_philox4 c;
    c.v[0] = 0u;
    c.v[1] = position;
    c.v[2] = MF_VERIFY_STREAM;
    c.v[3] = 0u;
    return mf_philox4x32_10(c, (uint32_t)seed, (uint32_t)(seed >> 32)).v[0];
}

/* A row's drafts in use: those before the first MF_NO_TOKEN, at most k. */
MF_HD uint32_t mf_verify_drafts(const uint32_t *drafts, uint32_t k) {
    uint32_t d = 0u;
    while (d < k && drafts[d] != MF_NO_TOKEN) ++d;
    return d;
}

/* Row r's params, its position advanced by advance[r] (advance NULL: as given). The advance is
 * read where the rule runs, so a step queued before the last one's counts are known draws at the
 * positions that step reached (mod 2**32, as the counter is). */
MF_HD mf_sampling_params mf_verify_row_params(const mf_sampling_params *p, const uint32_t *advance, uint32_t r) {
    mf_sampling_params q = *p;
    if (advance) q.position = p->position + advance[r];
    return q;
}

/* The params of position j of a row: the row's, at position + j (mod 2**32, as the counter is). */
MF_HD mf_sampling_params mf_verify_params_at(const mf_sampling_params *p, uint32_t j) {
    mf_sampling_params q = *p;
    q.position = p->position + j;
    return q;
}

/* The params of logit row i of a verify with k drafts a row: row r = i / (k + 1)'s, advanced, at
 * its position j = i % (k + 1). A split verify's stages and combine read one record per logit row
 * (mf_verify_logit_params writes them), so each is its own sampled call at that position. */
MF_HD mf_sampling_params mf_verify_logit_row_params(const mf_sampling_params *rows, const uint32_t *advance,
                                                   uint32_t k, uint32_t i) {
    const uint32_t r = i / (k + 1);
    const mf_sampling_params q = mf_verify_row_params(&rows[r], advance, r);
    return mf_verify_params_at(&q, i - r * (k + 1));
}


/* Whether the accept uniform U = (u24 + 1/2) / 2**24 (u24 its top 24 bits, sample_rule.h's
 * mf_uniform) is below mass_x / total, in integers: (2 u24 + 1) * total < mass_x * 2**25. Both
 * sides are below 2**89, compared as (high, low 32 bits) pairs; total < 2**63, mass_x <= 2**39. */
MF_HD int mf_verify_accept(uint32_t bits, uint64_t mass_x, uint64_t total) {
    const uint64_t a = 2u * (uint64_t)(bits >> 8) + 1u;
    const uint64_t lo = (total & 0xFFFFFFFFull) * a, hi = (total >> 32) * a;
    const uint64_t l_hi = hi + (lo >> 32), l_lo = lo & 0xFFFFFFFFull;
    const uint64_t r_hi = mass_x >> 7, r_lo = (mass_x & 0x7Full) << 25;
    return l_hi < r_hi || (l_hi == r_hi && l_lo < r_lo);
}

/* One position's verdict on draft x. `exact`: the position's id is fixed (greedy, or a sampled
 * row whose zmax is not finite, where sample_to_feed answers its top candidate `t`), so x is
 * accepted when it is t. Otherwise the accept uniform against x's mass (0 when x is not a
 * survivor) over the survivors' total. */
MF_HD int mf_verify_accepts(int exact, uint32_t t, uint32_t x, uint64_t seed, uint32_t position,
                            uint64_t mass_x, uint64_t total) {
    if (exact) return x == t && t != MF_NO_TOKEN;
    return mass_x != 0u && mf_verify_accept(mf_verify_uniform_bits(seed, position), mass_x, total);
}

/* ---- general draft distributions (draft_probs) ----
 * q(v) is the drafter's probability of v at the position, a float32 read as given (a value that is
 * not finite and > 0 counts as 0); p(v) = mass(v) / total over the survivors, in float64. Draft x
 * is accepted with probability min(1, p(x) / q(x)): when U * q(x) < p(x) (U the accept uniform;
 * q(x) = 0 with p(x) > 0 accepts). A rejection draws from max(0, p - q), renormalised, by the
 * same exponential race over the weights w(v) = p(v) - q(v) that are positive in float32: the
 * score of v is log w(v) + g(v), with g(v) sample_rule.h's Gumbel of v. Every step is one IEEE
 * operation in round-to-nearest (the _rn intrinsics on the device), so both backends agree. */
#if defined(__CUDA_ARCH__)
MF_HD double mf_dsub(double a, double b) { return __dsub_rn(a, b); }
MF_HD double mf_dmul(double a, double b) { return __dmul_rn(a, b); }
MF_HD double mf_ddiv(double a, double b) { return __ddiv_rn(a, b); }
#else
MF_HD double mf_dsub(double a, double b) { return a - b; }
MF_HD double mf_dmul(double a, double b) { return a * b; }
MF_HD double mf_ddiv(double a, double b) { return a / b; }
#endif

MF_HD double mf_verify_q(float q) { return q > 0.0f && q <= 3.4e38f ? (double)q : 0.0; } /* NaN: 0 */

MF_HD double mf_verify_p(uint64_t mass, uint64_t total) { return mf_ddiv((double)mass, (double)total); }

MF_HD int mf_verify_accepts_q(uint64_t seed, uint32_t position, double px, double qx) {
    return px > 0.0 && mf_dmul((double)mf_uniform(mf_verify_uniform_bits(seed, position)), qx) < px;
}

/* The residual weight of v as a positive normal float32, or 0 (v does not race). */
MF_HD float mf_verify_residual(double pv, double qv) {
    const float w = (float)mf_dsub(pv, qv);
    return w >= 1.17549435e-38f ? w : 0.0f; /* FLT_MIN: mf_log_pos takes normal numbers */
}

MF_HD float mf_verify_residual_score(float w, uint64_t seed, uint32_t position, uint32_t v) {
    return mf_fadd(mf_log_pos(w), mf_gumbel(seed, position, v));
}

/* Row r's cells: n, the n ids, then MF_NO_TOKEN up to k + 2 words. */
MF_HD void mf_verify_write_cells(uint32_t *row_cells, uint32_t k, const uint32_t *ids, uint32_t n) {
    row_cells[0] = n;
    for (uint32_t i = 0; i < k + 1u; ++i) row_cells[1u + i] = i < n ? ids[i] : MF_NO_TOKEN;
}

/* The next step's input id of a verified row (its last emitted id) and its advance n; a cell
 * word n outside [1, k + 1] (cells another call wrote) gives MF_NO_TOKEN and 0. */
MF_HD void mf_verify_resolve(const uint32_t *row_cells, uint32_t k, uint32_t *id, uint32_t *n) {
    const uint32_t c = row_cells[0];
    const int ok = c >= 1u && c <= k + 1u;
    *id = ok ? row_cells[c] : MF_NO_TOKEN;
    *n = ok ? c : 0u;
}

/* ---- sampled rows over a split vocabulary (docs/tensor-parallel.md, "Verify") ----
 * The select stages of the sampled call run over the R * (k + 1) logit rows, each logit row with
 * its position's params and its draft (mf_verify_draft_at). The TOP records carry the draft's
 * logit bits from the slice that holds it, which the first decision keeps in the row's state
 * (draft_bits); the RACE records carry each slice's race without the draft, and in their last 8
 * bytes the slice's survivors' total mass, bit 63 set by the slice whose draft survives. So the
 * combine has, on every rank alike, all that the unsplit position uses: the draft's mass (from its
 * bits and zmax), the survivors' total (an integer sum, the same in any order), and the race
 * without the draft, the greatest packed score over the slices' winners. */
#define MF_VERIFY_SURVIVES 0x8000000000000000ull

/* The draft of logit row lr of a verify with k drafts a row: position j = lr % (k + 1) of row
 * r = lr / (k + 1) has draft x_j while j is below the row's drafts in use, else none (its bonus
 * position, or past an early MF_NO_TOKEN). */
MF_HD uint32_t mf_verify_draft_at(const uint32_t *drafts, uint32_t k, uint64_t lr) {
    const uint64_t r = lr / (k + 1u);
    const uint32_t j = (uint32_t)(lr % (k + 1u));
    return j < mf_verify_drafts(drafts + r * k, k) ? drafts[r * k + j] : MF_NO_TOKEN;
}

/* The draft of logit row lr in the slice [start, start + vocab) as the slice's own id: at or above
 * vocab when the position has none, or when it is another slice's (drafts NULL: none). A TOP record
 * carries the draft's logit bits in its third word when it is a finite candidate there, else
 * MF_VERIFY_NO_BITS (select_rule.h, mf_top_record_draft_bits). */
MF_HD uint32_t mf_verify_local_draft(const uint32_t *drafts, uint32_t k, uint64_t lr, uint32_t start) {
    return drafts ? mf_verify_draft_at(drafts, k, lr) - start : MF_NO_TOKEN; /* wraps above vocab */
}

/* A RACE record's last 8 bytes (its m and s words), as the mass word of a verify. */
MF_HD uint64_t mf_verify_mass_word(const mf_partial_record *rec) {
    const uint32_t *w = (const uint32_t *)rec;
    return (uint64_t)w[2] | ((uint64_t)w[3] << 32);
}
MF_HD void mf_verify_set_mass_word(mf_partial_record *rec, uint64_t word) {
    uint32_t *w = (uint32_t *)rec;
    w[2] = (uint32_t)word;
    w[3] = (uint32_t)(word >> 32);
}

/* The race over the slices' winners: the greatest packed score (sample_rule.h's race), which is
 * the race over the survivors every slice raced (0: none). Unlike mf_combine_pick this has no
 * early answer for scores that are not finite: with zmax finite no score is +inf, and a race
 * without the draft over survivors whose scores are all -inf (the draft was the top) takes the
 * lowest id, as the unsplit race does. */
MF_HD uint32_t mf_verify_race_pick(const mf_partial_record *rec, uint32_t world, uint32_t stride,
                                   const mf_sample_plan *p) {
    uint64_t race = 0;
    for (uint32_t w = 0; w < world; ++w) {
        const mf_partial_record *r = rec + (uint64_t)w * stride;
        if (!mf_record_logit_key(r)) continue;
        const float score = mf_fadd(mf_scaled(r->logit_bits, p->inv_t), mf_gumbel(p->seed, p->position, r->id));
        race = mf_pack_max(race, mf_pack(mf_key_f32(mf_to_bits(score)), r->id));
    }
    return mf_unpack_id(race);
}

/* One position of a row verified over a split vocabulary: its RACE records `rec`, its params (at
 * its position), this rank's state there, its draft x (MF_NO_TOKEN: the bonus position). Returns
 * whether x is accepted; else *emit is the position's own id: what the unsplit verify decides. */
MF_HD int mf_verify_sampled_position(const mf_partial_record *rec, uint32_t world, uint32_t stride,
                                     const mf_sampling_params *params, const mf_select_row *st, uint32_t x,
                                     uint32_t *emit) {
    const mf_sample_plan p = mf_plan_sampling(params);
    if (p.greedy) { /* a greedy row of the call: its RACE records are argmax partials */
        *emit = mf_combine_pick(rec, world, stride, 0);
        return mf_verify_accepts(1, *emit, x, 0u, 0u, 0u, 0u);
    }
    *emit = mf_combine_pick(rec, world, stride, &p); /* sample_to_feed's draw there */
    if (x == MF_NO_TOKEN) return 0;
    if (!(st->flags & MF_SELECT_ROW_TOP)) { /* no candidate at all */
        *emit = MF_NO_TOKEN;
        return 0;
    }
    const float zmax = mf_scaled(st->top_bits, p.inv_t);
    if (!mf_finite_bits(mf_to_bits(zmax))) /* exact: the draw is the top, no slice left the draft out */
        return mf_verify_accepts(1, *emit, x, 0u, 0u, 0u, 0u);
    uint64_t total = 0;
    int survives = 0;
    for (uint32_t w = 0; w < world; ++w) {
        const uint64_t word = mf_verify_mass_word(rec + (uint64_t)w * stride);
        /* A slice's total reaches 2**63 only as 2**24 survivors of mass 2**39 (a whole
         * vocabulary's slice at zmax): that word is the bit alone, read as such a total. Read as
         * a surviving draft of total 0 it would mean a draft of mass 0: rejected either way. */
        if (word == MF_VERIFY_SURVIVES) {
            total += word;
            continue;
        }
        survives |= (word & MF_VERIFY_SURVIVES) != 0u;
        total += word & ~MF_VERIFY_SURVIVES;
    }
    const uint64_t mass_x = survives ? mf_survivor_mass(st->draft_bits, p.inv_t, zmax) : 0u;
    if (mf_verify_accepts(0, MF_NO_TOKEN, x, p.seed, p.position, mass_x, total)) return 1;
    *emit = mf_verify_race_pick(rec, world, stride, &p); /* the race without the draft */
    return 0;
}

/* A row of a sampled verify over a split vocabulary (MF_COMBINE_VERIFY with MF_PARTIAL_FILTERED):
 * position j's records rec[j], params[j] and state st[j]; `fault`: every position then has no
 * candidate (n = 1, MF_NO_TOKEN), as mf_verify_combined_row writes. */
MF_HD void mf_verify_sampled_combined_row(const mf_partial_record *rec, uint32_t world, uint32_t stride,
                                          uint32_t fault, const mf_sampling_params *params,
                                          const mf_select_row *st, const uint32_t *x, uint32_t k,
                                          uint32_t *row_cells) {
    const uint32_t d = mf_verify_drafts(x, k);
    uint32_t n = 0;
    for (uint32_t j = 0; j <= d; ++j) {
        const uint32_t draft = j < d ? x[j] : MF_NO_TOKEN;
        uint32_t emit = MF_NO_TOKEN;
        const int accepted = !fault && mf_verify_sampled_position(rec + j, world, stride, &params[j], &st[j], draft, &emit);
        row_cells[1u + n++] = accepted ? draft : emit;
        if (!accepted) break;
    }
    row_cells[0] = n;
    for (uint32_t i = n; i < k + 1u; ++i) row_cells[1u + i] = MF_NO_TOKEN;
}

/* A greedy row verified over a split vocabulary (mf_combine_partials with MF_COMBINE_VERIFY): its
 * position j's records are rec[j] (block 0; block w's `stride` records further), whose combined
 * argmax is the rule's id t_j there, exactly as the unsplit argmax. The row keeps drafts x_j == t_j
 * and emits t_j at the first mismatch, or after the last draft, so every emitted id is its
 * position's t_j and its logprob that position's combined one. `fault`: the headers disagreed; every
 * position then has no candidate (n = 1, MF_NO_TOKEN, NaN), as the plain combine writes. */
MF_HD void mf_verify_combined_row(const mf_partial_record *rec, uint32_t world, uint32_t stride, uint32_t fault,
                                  const uint32_t *x, uint32_t k, uint32_t *row_cells, float *row_logprobs) {
    const uint32_t d = mf_verify_drafts(x, k);
    uint32_t n = 0;
    for (uint32_t j = 0; j <= d; ++j) {
        const uint32_t t = fault ? MF_NO_TOKEN : mf_combine_pick(rec + j, world, stride, 0);
        row_cells[1u + n++] = t;
        if (row_logprobs) {
            float m = mf_neg_inf();
            double s = 0.0;
            if (!fault) mf_combine_stats(rec + j, world, stride, &m, &s);
            row_logprobs[j] = mf_logprob_finish(t, mf_combine_bits(rec + j, world, stride, t), m, s);
        }
        if (!mf_verify_accepts(1, t, j < d ? x[j] : MF_NO_TOKEN, 0u, 0u, 0u, 0u)) break;
    }
    row_cells[0] = n;
    for (uint32_t i = n; i < k + 1u; ++i) {
        row_cells[1u + i] = MF_NO_TOKEN;
        if (row_logprobs) row_logprobs[i] = mf_nan();
    }
}

#endif
