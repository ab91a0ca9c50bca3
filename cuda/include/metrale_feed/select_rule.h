/* The decisions between a split row's filter stages (feed.h's mf_select_decide; docs/kernels.md,
 * "Filters need global thresholds"), shared verbatim by the kernel (a thread a row, cuda and simt)
 * and the host backend's loop on the stream's worker: no Python between the exchanges.
 *
 * Every rank runs them on the same gathered blocks with the same params, so every rank reaches the
 * same state: the whole row's zmax after the TOP exchange; then, per radix select, 8 bits of the
 * threshold key a round (mf_select_digit over the summed histograms; integer sums, so the slices'
 * order does not matter), and at the key found a cut by id that each rank computes for its own
 * slice from the weight at that key of the slices before it (slices are in id order). Candidate
 * lists (top_k <= MF_SELECT_CANDS_MAX) need no decision here: the RACE stage reads them itself. */
#ifndef METRALE_FEED_SELECT_RULE_H
#define METRALE_FEED_SELECT_RULE_H

#include "metrale_feed/feed.h"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/verify_rule.h"

#define MF_SELECT_ROUNDS (32u / MF_SELECT_DIGIT_BITS)

/* What a select's round asks of the stages: a histogram of the digit at `round`, of counts (top_k)
 * or masses (top_p), from the rows taking part. Every row gets the prefix and shift. */
MF_HD void mf_select_round_state(mf_select_row *st, const mf_select_plan *plan, uint32_t sel, uint32_t round) {
    uint32_t flags = st->flags & ~(uint32_t)(MF_SELECT_ROW_HIST | MF_SELECT_ROW_MASS);
    if (plan->flags & MF_PLAN_ON)
        flags |= MF_SELECT_ROW_HIST | (sel == MF_SELECT_P ? MF_SELECT_ROW_MASS : 0u);
    st->flags = flags;
    st->prefix = plan->prefix;
    st->shift = 32u - MF_SELECT_DIGIT_BITS * (round + 1u);
}

/* The start of select `sel` (0: none): the rows whose filter it serves take part. */
MF_HD void mf_select_start(mf_select_row *st, mf_select_plan *plan, uint32_t sel) {
    if (!sel) return;
    const uint32_t mine = sel == MF_SELECT_K ? MF_PLAN_K : MF_PLAN_P;
    plan->flags = (plan->flags & ~(uint32_t)MF_PLAN_ON) | ((plan->flags & mine) ? MF_PLAN_ON : 0u);
    plan->target = plan->above = 0u;
    plan->prefix = 0u;
    mf_select_round_state(st, plan, sel, 0u);
}

/* A digest of one row's params (every field but the padding): the TOP stage's records carry it in
 * their free `sum` word (their `max` holds a verify's draft bits, or MF_VERIFY_NO_BITS), so the
 * first decision sees, on every rank alike, whether the slices sampled a row with the same params,
 * host or device ones. */
MF_HD uint32_t mf_params_digest(const mf_sampling_params *p) {
    const uint32_t w[7] = {mf_to_bits(p->temperature), mf_to_bits(p->top_p), mf_to_bits(p->min_p), p->top_k,
                           (uint32_t)p->seed, (uint32_t)(p->seed >> 32), p->position};
    uint32_t h = 0x9E3779B9u;
    for (int i = 0; i < 7; ++i) h = mf_fmix32(h ^ w[i]); /* argmax_rule.h's mixer, a word at a time */
    return h;
}

/* The digest a TOP record carries (its fourth word). */
MF_HD uint32_t mf_top_record_digest(const mf_partial_record *rec) {
    return ((const uint32_t *)rec)[3];
}

/* A TOP record's third word: a verify's draft's logit bits from the slice that holds it as a
 * finite candidate (mf_argmax_args.select_drafts), else MF_VERIFY_NO_BITS. */
MF_HD uint32_t mf_top_record_draft_bits(const mf_partial_record *rec) {
    return ((const uint32_t *)rec)[2];
}


/* Whether fixed rounds (`rounds`, MF_ROUNDS_*; 0: none) serve a sampled row's filters: its top_k
 * from the candidate lists, its top_p alone from top_p's radix select (min_p needs no round). */
MF_HD int mf_rounds_serve(uint32_t rounds, const mf_sample_plan *s) {
    if (!(rounds & MF_ROUNDS_FIXED) || s->greedy) return 1;
    if (s->top_k != 0u) return s->top_k <= (rounds & MF_ROUNDS_CAP_MASK);
    return !s->use_top_p || (rounds & MF_ROUNDS_TOP_P) != 0u;
}

/* After the TOP exchange, row r (`rec`: slice 0's record of the row, slice w's `stride` records
 * further; `fault`: the headers' check): the whole row's greatest finite candidate, and the
 * selects the row takes. A row whose zmax is not finite, or that has no candidate, takes none.
 * Returns 0, or the row's fault (the row then takes none and the call is refused): MF_FAULT_PARAMS
 * when the slices' params digests differ, MF_FAULT_ROUNDS when fixed `rounds` do not serve the
 * row. Both read only what every rank holds alike (the gathered records; the params, equal on
 * every rank once their digests are), so every rank finds the same faults. */
MF_HD uint32_t mf_decide_top_row(const mf_partial_record *rec, uint32_t world, uint32_t stride, uint32_t fault,
                            const mf_sampling_params *p, uint32_t next, uint32_t rounds, mf_select_row *st,
                            mf_select_plan *plan) {
    uint32_t best = 0, bits = rec[0].logit_bits, draft_bits = MF_VERIFY_NO_BITS;
    for (uint32_t w = 0; w < world; ++w) {
        const mf_partial_record *x = rec + (uint64_t)w * stride;
        const uint32_t key = x->id == MF_NO_TOKEN ? 0u : mf_key_f32(x->logit_bits);
        if (key > best) best = key, bits = x->logit_bits; /* the first greatest: the lowest slice */
        const uint32_t drafted = mf_top_record_draft_bits(x);
        if (drafted != MF_VERIFY_NO_BITS) draft_bits = drafted; /* one slice holds a draft */
    }
    st->draft_bits = draft_bits;
    st->pad_ = 0u;
    st->floor = 0u;
    st->cut_need = 0u;
    st->list_len = MF_SELECT_NO_LIST;
    st->top_bits = bits;
    st->flags = best && !fault ? MF_SELECT_ROW_TOP : 0u;
    plan->target = plan->above = 0u;
    plan->prefix = 0u;
    plan->flags = 0u;
    if (fault) return 0u; /* refused on every rank alike: the stages left do nothing that matters */
    for (uint32_t w = 1; w < world; ++w)
        if (mf_top_record_digest(rec + (uint64_t)w * stride) != mf_top_record_digest(rec)) {
            st->flags = 0u;
            return MF_FAULT_PARAMS;
        }
    const mf_sample_plan s = mf_plan_sampling(p);
    if (!mf_rounds_serve(rounds, &s)) {
        st->flags = 0u;
        return MF_FAULT_ROUNDS;
    }
    /* A sampled row whose zmax is not finite draws its top whatever the filters (sample_rule.h). */
    if (best && !s.greedy && mf_finite_bits(mf_to_bits(mf_scaled(bits, s.inv_t)))) {
        const int listed = s.top_k != 0u && s.top_k <= MF_SELECT_CANDS_MAX;
        if (listed) st->flags |= MF_SELECT_ROW_CANDS;
        if (s.top_k != 0u && !listed) plan->flags |= MF_PLAN_K;
        if (s.use_top_p && !listed) plan->flags |= MF_PLAN_P;
    }
    mf_select_start(st, plan, next);
    return 0u;
}

/* After round `round` of select `sel`, row r: `bins` is slice 0's histogram of the row, slice w's
 * `stride` words further. */
MF_HD void mf_decide_round_row(const uint64_t *bins, uint64_t stride, uint32_t world, uint32_t rank,
                               const mf_sampling_params *p, uint32_t sel, uint32_t round, uint32_t next,
                               mf_select_row *st, mf_select_plan *plan) {
    uint64_t total[MF_SELECT_BINS];
    for (uint32_t d = 0; d < MF_SELECT_BINS; ++d) total[d] = 0u;
    for (uint32_t w = 0; w < world; ++w)
        for (uint32_t d = 0; d < MF_SELECT_BINS; ++d) total[d] += bins[(uint64_t)w * stride + d];
    const uint32_t shift = 32u - MF_SELECT_DIGIT_BITS * (round + 1u);
    if ((plan->flags & MF_PLAN_ON) && round == 0u) {
        uint64_t whole = 0u;
        for (uint32_t d = 0; d < MF_SELECT_BINS; ++d) whole += total[d];
        if (sel == MF_SELECT_K) {
            plan->target = p->top_k;
            if (whole <= p->top_k) plan->flags &= ~(uint32_t)MF_PLAN_ON; /* all of them fit: no cut */
        } else {
            plan->target = mf_top_p_target(whole, p->top_p);
        }
    }
    uint32_t digit = 0u;
    if (plan->flags & MF_PLAN_ON) {
        digit = mf_select_digit(total, &plan->above, plan->target);
        plan->prefix |= digit << shift;
    }
    if (round + 1u < MF_SELECT_ROUNDS) {
        mf_select_round_state(st, plan, sel, round + 1u);
        return;
    }
    /* The key K is found: this slice cuts its own candidates at K by id, after the weight at K of
     * the slices before it (as signed: the target may be reached before this slice). */
    uint32_t flags = st->flags & ~(uint32_t)(MF_SELECT_ROW_HIST | MF_SELECT_ROW_MASS | MF_SELECT_ROW_CUT_MASS);
    if (plan->flags & MF_PLAN_ON) {
        uint64_t before = 0u;
        for (uint32_t w = 0; w < rank; ++w) before += bins[(uint64_t)w * stride + digit];
        const uint64_t taken = plan->above + before;
        flags |= MF_SELECT_ROW_CUT | (sel == MF_SELECT_P ? MF_SELECT_ROW_CUT_MASS : 0u);
        st->cut_key = plan->prefix;
        st->cut_need = plan->target > taken ? plan->target - taken : 0u;
    }
    st->flags = flags;
    mf_select_start(st, plan, next);
}

#endif
