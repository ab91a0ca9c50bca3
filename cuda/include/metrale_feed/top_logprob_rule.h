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

/* ---- a split vocabulary (feed.h's MF_TOP_PARTIAL and mf_top_logprobs_combine) ----
 * Each slice sends its own n greatest ids (global) with their logits, its (m, s) and the logit of
 * the row's asked-for id if it holds it. The row's n greatest ids are among the slices' lists, and
 * the packed word of a global id is the same whichever slice holds it, so merging the lists by
 * word gives the unsplit ids in the unsplit order; each logprob then takes the row's (M, S) as the
 * sharded chosen-token logprob combines them (mf_combine_stats), bit for bit. */

/* A top block's header operation: n and whether the calls had ids belong to it, so slices that
 * disagree on either are MF_FAULT_TAG; its records always carry (m, s). */
MF_HD uint32_t mf_top_partial_op(uint32_t n, int ids) {
    return mf_partial_op(MF_PARTIAL_TOP_LOGPROBS | (n << 8) | (ids ? 1u << 16 : 0u), 1);
}

/* Row r's list in a top block of `rows` rows (its first record at `records`, after the header). */
MF_HD mf_partial_cand *mf_top_list(mf_partial_record *records, uint32_t rows, uint32_t n, uint32_t r) {
    return (mf_partial_cand *)(records + rows) + (uint64_t)r * n;
}

/* A slice's list entry from a word of its list (slice columns; 0: none). */
MF_HD mf_partial_cand mf_top_cand(uint64_t w, const void *row, int dtype, uint32_t start) {
    mf_partial_cand c;
    c.id = w ? start + mf_unpack_id(w) : MF_NO_TOKEN;
    c.logit_bits = w ? mf_logit_bits(row, dtype, mf_unpack_id(w)) : 0u;
    return c;
}

/* Whether the slice of header `h` holds global id `id` (never MF_NO_TOKEN). */
MF_HD int mf_top_holds(const mf_partial_header *h, uint32_t id) { return id - h->start < h->stop - h->start; }

/* A slice's row record: (m, s), the asked-for global id `id` (MF_NO_TOKEN: none asked; every slice
 * sends it, so the combine sees slices asked other ids) and its logit when the slice
 * [start, start + width) holds it, else 0. */
MF_HD mf_partial_record mf_top_slice_record(const void *row, int dtype, uint32_t start, uint32_t width,
                                            uint32_t id, float m, double s) {
    mf_partial_record rec;
    const int mine = id != MF_NO_TOKEN && id - start < width; /* wraps above width below start */
    rec.id = id;
    rec.logit_bits = mine ? mf_logit_bits(row, dtype, id - start) : 0u;
    rec.max = m;
    rec.sum = (float)s;
    return rec;
}

/* Row r of a combine: `records` is slice 0's first row record (its header the two records before
 * it), slice w's `stride` records further. Writes out[0 .. n) and, when `chosen` is not NULL,
 * *chosen; a header fault gives (MF_NO_TOKEN, NaN) and NaN. Returns whether the slices were asked
 * other ids in this row (its chosen logprob is then NaN: no slice's answer is the row's). */
MF_HD int mf_top_combined_row(const mf_partial_record *records, uint32_t world, uint32_t stride,
                              uint32_t rows, uint32_t n, uint32_t r, uint32_t fault,
                              mf_top_logprob *out, float *chosen) {
    uint64_t words[MF_MAX_TOP_LOGPROBS];
    uint32_t bits[MF_MAX_TOP_LOGPROBS];
    for (uint32_t j = 0; j < n; ++j) words[j] = 0, bits[j] = 0;
    float m = mf_neg_inf();
    double s = 0.0;
    uint32_t id = fault ? MF_NO_TOKEN : records[r].id, id_bits = 0;
    int differ = 0, held = 0; /* an id no slice holds (past the vocabulary) has no logprob */
    if (!fault) {
        mf_combine_stats(records + r, world, stride, &m, &s);
        for (uint32_t w = 0; w < world; ++w) {
            const mf_partial_record *slice = records + (uint64_t)w * stride;
            const mf_partial_header *h = (const mf_partial_header *)(slice - MF_PARTIAL_HEADER_RECORDS);
            differ |= slice[r].id != id;
            if (id != MF_NO_TOKEN && mf_top_holds(h, id)) id_bits = slice[r].logit_bits, held = 1;
            const mf_partial_cand *list = mf_top_list((mf_partial_record *)slice, rows, n, r);
            for (uint32_t j = 0; j < n && list[j].id != MF_NO_TOKEN; ++j) {
                /* mf_top_insert, with each word's logit bits moved beside it */
                const uint64_t word = mf_pack(mf_key_f32(list[j].logit_bits), list[j].id);
                if (word <= words[n - 1u]) break; /* the list is in decreasing order */
                uint32_t at = n - 1u;
                while (at > 0u && words[at - 1u] < word) {
                    words[at] = words[at - 1u];
                    bits[at] = bits[at - 1u];
                    --at;
                }
                words[at] = word;
                bits[at] = list[j].logit_bits;
            }
        }
    }
    for (uint32_t j = 0; j < n; ++j) {
        out[j].id = words[j] ? mf_unpack_id(words[j]) : MF_NO_TOKEN;
        out[j].logprob = mf_logprob_finish(out[j].id, bits[j], m, s);
    }
    if (chosen) *chosen = mf_logprob_finish(differ || !held ? MF_NO_TOKEN : id, id_bits, m, s);
    return differ;
}

#endif
