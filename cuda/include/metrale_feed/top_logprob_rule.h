/* The top logprobs of a row (mf_top_logprobs, feed.h), shared verbatim by the CUDA kernel and the
 * host backend so that both pick the same ids and write the same bits.
 *
 * The order is the argmax's: each id's packed word mf_pack(key, id) (argmax_rule.h: greater value
 * first, ties by the smaller id, NaN below -inf), unique per id, so the n greatest words are the
 * answer whatever the order they are met in. The GPU finds them in n rounds, each the block-wide
 * greatest word below the previous round's; the host keeps a sorted list of n words in one pass
 * (mf_top_insert). Both are integer comparisons: the same ids on every backend. Each id's logprob
 * is mf_logprob_finish over the row's (m, s), whose sum has the one order of logprob_rule.h. */
#ifndef METRALE_FEED_TOP_LOGPROB_RULE_H
#define METRALE_FEED_TOP_LOGPROB_RULE_H

#include "metrale_feed/argmax_rule.h"
#include "metrale_feed/feed.h"
#include "metrale_feed/logprob_rule.h"

/* The packed word of element i of a row: never 0, so 0 means "no id". */
MF_HD uint64_t mf_top_word(const void *row, int dtype, uint32_t i) { return mf_pack(mf_key_at(row, dtype, i), i); }

/* Insert `w` into `list`, n words in decreasing order (0: empty places, at the end). */
MF_HD void mf_top_insert(uint64_t *list, uint32_t n, uint64_t w) {
    if (n == 0u || w <= list[n - 1u]) return;
    uint32_t at = n - 1u;
    while (at > 0u && list[at - 1u] < w) {
        list[at] = list[at - 1u];
        --at;
    }
    list[at] = w;
}

/* One output record: a word of the list (0: none) and the row's (m, s). */
MF_HD mf_top_logprob mf_top_entry(uint64_t w, const void *row, int dtype, float m, double s) {
    mf_top_logprob out;
    out.id = w ? mf_unpack_id(w) : MF_NO_TOKEN;
    out.logprob = mf_logprob_finish(out.id, w ? mf_logit_bits(row, dtype, out.id) : 0u, m, s);
    return out;
}

/* The logprob of a given id (a step's chosen token) under the row: NaN for NO_TOKEN and for an id
 * outside the row's vocab ids, as mf_logprob_finish has it. */
MF_HD float mf_top_chosen(const void *row, int dtype, uint32_t vocab, uint32_t id, float m, double s) {
    if (id >= vocab) id = MF_NO_TOKEN;
    return mf_logprob_finish(id, id == MF_NO_TOKEN ? 0u : mf_logit_bits(row, dtype, id), m, s);
}

#endif
