/* Chosen-token logprobs and the partial records of a row split, shared verbatim by the CUDA kernels
 * and the host backend (docs/kernels.md, "Logprobs" and "Partial records and the combine").
 *
 * A row's log-sum-exp is carried as (m, s): m the greatest logit (NaN counts as -inf; +inf when
 * any logit is +inf; -inf when there is no finite one) and s the sum of exp(logit - m) over the
 * finite logits, accumulated in float64. Slices combine exactly as one row would:
 * M = max m_r, S = sum_r s_r exp(m_r - M), and the chosen id's logprob is
 * logit - (M + log S), evaluated in float64. Each term exp(logit - m) is mf_exp_neg (a few ulps of
 * float32), so S is within ~1e-7 relative of the true sum and the logprob within ~2e-7 absolute
 * plus the rounding of the result: far inside the 2e-5 contract, whatever the split. */
#ifndef METRALE_FEED_LOGPROB_RULE_H
#define METRALE_FEED_LOGPROB_RULE_H

#include <math.h>

#include "metrale_feed/feed.h"
#include "metrale_feed/partial_layout.h"
#include "metrale_feed/sample_rule.h"

/* FILTERED: race winners over global thresholds (MF_ARGS_SELECT's RACE stage); TOP, HIST and
 * CANDS: its other stages' blocks (feed.h); TOP_LOGPROBS: mf_top_logprobs's MF_TOP_PARTIAL blocks
 * (top_logprob_rule.h). */
enum { MF_PARTIAL_ARGMAX = 1u, MF_PARTIAL_SAMPLE = 2u, MF_PARTIAL_FILTERED = 3u, MF_PARTIAL_TOP = 4u,
       MF_PARTIAL_HIST = 5u, MF_PARTIAL_CANDS = 6u, MF_PARTIAL_TOP_LOGPROBS = 7u };
/* Or'ed into a header's operation when its records carry (m, s) (MF_ARGS_PARTIAL_LOGPROBS): a
 * combine that writes logprobs expects it in every header and one that does not expects it in
 * none, so ranks that disagree on logprobs get a fault, never a logprob from a zero sum. A bit
 * above every operation's code. */
#define MF_PARTIAL_LOGPROBS 0x80u
/* Why a combine refused its partials (the low byte of the fault word; the slice is in bits 8+). */
enum {
    MF_FAULT_NONE = 0u,
    MF_FAULT_TAG = 1u,   /* not a partial block, or another operation */
    MF_FAULT_ROWS = 2u,  /* another row count */
    MF_FAULT_CALL = 3u,  /* another call: a slice from an earlier or later step */
    MF_FAULT_VOCAB = 4u, /* another vocabulary */
    MF_FAULT_SPLIT = 5u, /* the slices do not tile [0, vocab) in order */
    MF_FAULT_LOGPROBS = 6u, /* the same operation with the other logprobs setting */
    MF_FAULT_FILTERS = 7u,  /* device params set a filter on a sampled split row (bits 8+: the row) */
    MF_FAULT_IDS = 8u,      /* a top logprobs combine's slices were asked other ids (bits 8+: the row) */
    MF_FAULT_ROUNDS = 9u,   /* params ask a split row for a filter its fixed rounds do not serve (bits 8+: the row) */
    MF_FAULT_PARAMS = 10u   /* the slices' params of a split row differ (bits 8+: the row) */
};

/* Whether a sampled row of a MF_PARTIAL_SAMPLE combine has a filter its slices could not apply:
 * only device-resident params can get here (host ones are refused before launch), and the values
 * count as the unsplit call would read them (mf_plan_sampling: out of range is off). */
MF_HD int mf_plan_filtered(const mf_sample_plan *p) {
    return !p->greedy && (p->top_k != 0u || p->use_top_p || p->use_min_p);
}


MF_HD float mf_nan(void) { return mf_from_bits(0x7FC00000u); }

/* The logprob of a chosen id with logit `bits` under a row (or gathered slices) of (M, S); NaN
 * for NO_TOKEN, a +inf anywhere and a row with no finite logit; -inf for a -inf or NaN choice. */
/* The order of a row's sum of exponentials, fixed so every backend gets the same bits: lane t of
 * MF_STATS_LANES sums the terms of ids t, t + MF_STATS_LANES, ... in id order (float64); the 32
 * lanes of each warp then meet in a butterfly (round o = 16, 8, 4, 2, 1: each lane adds the lane
 * o away), and the warps' totals are added in warp order. The GPU kernel does this with threads
 * and shuffles (logprob_feed.cu), the host backend with arrays (logprob_host.cpp). */
#define MF_STATS_LANES 256u
MF_HD double mf_stats_fold(double *lanes) {
    for (uint32_t w = 0; w < MF_STATS_LANES; w += 32u)
        for (uint32_t o = 16u; o > 0u; o >>= 1) {
            double next[32];
            for (uint32_t l = 0; l < 32u; ++l) next[l] = lanes[w + l] + lanes[w + (l ^ o)];
            for (uint32_t l = 0; l < 32u; ++l) lanes[w + l] = next[l];
        }
    double s = lanes[0];
    for (uint32_t w = 32u; w < MF_STATS_LANES; w += 32u) s = s + lanes[w];
    return s;
}

MF_HD float mf_logprob_finish(uint32_t id, uint32_t bits, float m, double s) {
    if (id == MF_NO_TOKEN || !(m > mf_neg_inf()) || !mf_finite_bits(mf_to_bits(m))) return mf_nan();
    if (!mf_finite_bits(bits)) return mf_neg_inf(); /* +inf would have made m +inf */
    return (float)((double)mf_from_bits(bits) - ((double)m + log(s)));
}

/* The packed key of a slice's record in the combine (0: no candidate). Greedy: (logit, id), the
 * argmax order (float32 keys order widened 16-bit values as their own keys do). */
MF_HD uint64_t mf_record_logit_key(const mf_partial_record *r) {
    return r->id == MF_NO_TOKEN ? 0ull : mf_pack(mf_key_f32(r->logit_bits), r->id);
}

/* The combined id of one row from its `world` records (rec[w * stride]). A sampled row's records
 * are race winners, except that a slice whose greatest scaled logit z is not finite keeps its top
 * (sample_rule.h's early return); so: any candidate whose z is neither finite nor -inf means the
 * whole row's zmax is not finite (the top wins); all at -inf likewise; otherwise the greatest race
 * score, recomputed from (logit, global id) by the rule's own operations, wins. */
MF_HD uint32_t mf_combine_pick(const mf_partial_record *rec, uint32_t world, uint32_t stride,
                               const mf_sample_plan *plan) {
    uint64_t best = 0, top_hot = 0, top_all = 0, race = 0;
    int any_hot = 0, all_cold = 1, any = 0;
    for (uint32_t w = 0; w < world; ++w) {
        const mf_partial_record *r = rec + (uint64_t)w * stride;
        const uint64_t key = mf_record_logit_key(r);
        best = mf_pack_max(best, key);
        if (!plan || !key) continue;
        any = 1;
        const float z = mf_scaled(r->logit_bits, plan->inv_t);
        const int cold = z == mf_neg_inf();
        if (!cold && !mf_finite_bits(mf_to_bits(z))) {
            any_hot = 1;
            top_hot = mf_pack_max(top_hot, key);
        }
        all_cold &= cold;
        top_all = mf_pack_max(top_all, key);
        const float score = mf_fadd(z, mf_gumbel(plan->seed, plan->position, r->id));
        race = mf_pack_max(race, mf_pack(mf_key_f32(mf_to_bits(score)), r->id));
    }
    if (!plan) return mf_unpack_id(best);
    if (!any) return MF_NO_TOKEN;
    return mf_unpack_id(any_hot ? top_hot : all_cold ? top_all : race);
}

/* The logit bits the slice that holds `id` sent with it (0 for MF_NO_TOKEN), for its logprob. */
MF_HD uint32_t mf_combine_bits(const mf_partial_record *rec, uint32_t world, uint32_t stride, uint32_t id) {
    uint32_t bits = 0;
    for (uint32_t w = 0; w < world; ++w)
        if (id != MF_NO_TOKEN && rec[(uint64_t)w * stride].id == id) bits = rec[(uint64_t)w * stride].logit_bits;
    return bits;
}

/* (M, S) of a row from its slices' records. */
MF_HD void mf_combine_stats(const mf_partial_record *rec, uint32_t world, uint32_t stride, float *m,
                            double *s) {
    float top = mf_neg_inf();
    for (uint32_t w = 0; w < world; ++w) {
        const float x = rec[(uint64_t)w * stride].max;
        top = x > top ? x : top;
    }
    double sum = 0.0;
    if (top > mf_neg_inf() && mf_finite_bits(mf_to_bits(top)))
        for (uint32_t w = 0; w < world; ++w) {
            const mf_partial_record *r = rec + (uint64_t)w * stride;
            if (r->max > mf_neg_inf()) sum += (double)r->sum * exp((double)r->max - (double)top);
        }
    *m = top;
    *s = sum;
}

/* The operation word of a partial block's header (its tag is MF_PARTIAL_TAG ^ it): the operation
 * (MF_PARTIAL_*) and whether its records carry (m, s). */
MF_HD uint32_t mf_partial_op(uint32_t op, int logprobs) { return op | (logprobs ? MF_PARTIAL_LOGPROBS : 0u); }

/* The operation of a partial call's block: its select stage's (MF_ARGS_SELECT: MF_SELECT_*, 0 for
 * none), else a sampled call's or an argmax's. The one mapping the host loop and the kernels use. */
MF_HD uint32_t mf_partial_call_op(uint32_t select_stage, int sampled) {
    return select_stage == MF_SELECT_TOP     ? MF_PARTIAL_TOP
           : select_stage == MF_SELECT_HIST  ? MF_PARTIAL_HIST
           : select_stage == MF_SELECT_RACE  ? MF_PARTIAL_FILTERED
           : select_stage == MF_SELECT_CANDS ? MF_PARTIAL_CANDS
           : sampled                         ? MF_PARTIAL_SAMPLE
                                             : MF_PARTIAL_ARGMAX;
}

/* The header of a partial call's block (mf_argmax_args with MF_ARGS_PARTIAL), as every backend
 * writes it; `sampled`: the call has params (a backend may hold its copy of host params apart). */
MF_HD mf_partial_header mf_partial_call_header(const mf_argmax_args *a, int sampled) {
    const uint32_t stage = (a->flags & MF_ARGS_SELECT) ? a->select_stage : 0u;
    const uint32_t op = mf_partial_call_op(stage, sampled);
    mf_partial_header h = {MF_PARTIAL_TAG ^ mf_partial_op(op, (a->flags & MF_ARGS_PARTIAL_LOGPROBS) != 0),
                           a->rows, a->call, a->vocab_total, a->start, a->start + a->vocab, 0u};
    return h;
}

/* The fault of a set of headers (hdr[w * stride] in records), 0 when they agree. `op` is the
 * combine's own mf_partial_op: a header with the other logprobs bit is MF_FAULT_LOGPROBS. */
MF_HD uint32_t mf_check_headers(const mf_partial_header *first, uint32_t world, uint32_t stride_records,
                                uint32_t op, uint32_t rows, uint64_t call, uint32_t vocab) {
    uint32_t expect_start = 0;
    for (uint32_t w = 0; w < world; ++w) {
        const mf_partial_header *h =
            (const mf_partial_header *)((const char *)first + (uint64_t)w * stride_records * 16u);
        uint32_t code = h->tag == (MF_PARTIAL_TAG ^ op ^ MF_PARTIAL_LOGPROBS) ? MF_FAULT_LOGPROBS
                        : h->tag != (MF_PARTIAL_TAG ^ op) ? MF_FAULT_TAG
                        : h->rows != rows              ? MF_FAULT_ROWS
                        : h->call != call              ? MF_FAULT_CALL
                        : h->vocab != vocab            ? MF_FAULT_VOCAB
                        : (h->start != expect_start || h->stop < h->start || h->stop > vocab ||
                           (w + 1 == world && h->stop != vocab))
                            ? MF_FAULT_SPLIT
                            : MF_FAULT_NONE;
        if (code) return code | (w << 8);
        expect_start = h->stop;
    }
    return MF_FAULT_NONE;
}

/* The fault a combine acts on: its headers' (`headers`), else one found before the last exchange
 * (mf_combine_args.refused, NULL: none), whose rounds every rank still ran. */
MF_HD uint32_t mf_combine_fault(uint32_t headers, const uint32_t *refused) {
    return headers ? headers : refused ? *refused : MF_FAULT_NONE;
}

#endif
