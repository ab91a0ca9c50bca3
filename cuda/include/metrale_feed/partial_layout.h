/* The layout of a partial block, the one place it is written (docs/kernels.md, "Partial records
 * and the combine"): the kernels, the host backend and the combine use these structs, and Python
 * reads the sizes and offsets below through the extension (_core.PARTIAL_LAYOUT), never its own
 * copy. A block is a 32-byte header (the fingerprint the combine checks) followed by one 16-byte
 * record per row (or, for a select's histogram stage, MF_SELECT_BINS uint64 weights per row, and
 * for its candidates stage select_cands_cap mf_partial_cand per row). */
#ifndef METRALE_FEED_PARTIAL_LAYOUT_H
#define METRALE_FEED_PARTIAL_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#define MF_PARTIAL_TAG 0x3150464Du /* "MFP1" */
#define MF_PARTIAL_RECORD_BYTES 16u
#define MF_PARTIAL_HEADER_RECORDS 2u
#define MF_PARTIAL_HEADER_BYTES (MF_PARTIAL_HEADER_RECORDS * MF_PARTIAL_RECORD_BYTES)

/* The first 32 bytes of a slice's partial block: what the combine checks before trusting it. */
typedef struct mf_partial_header {
    uint32_t tag; /* MF_PARTIAL_TAG ^ mf_partial_op(...) */
    uint32_t rows;
    uint64_t call;
    uint32_t vocab; /* the whole vocabulary */
    uint32_t start, stop;
    /* Unused by the slice that writes it. In the gathered blocks, slice 0's is where the shard
     * points the combine's fault word (mf_combine_args.fault): the gathered buffer is the
     * combine's own, so the word needs no allocation of its own. */
    uint32_t reserved;
} mf_partial_header;

/* Byte offsets of the header's fields (checked against the struct below). */
#define MF_PARTIAL_OFF_TAG 0u
#define MF_PARTIAL_OFF_ROWS 4u
#define MF_PARTIAL_OFF_CALL 8u
#define MF_PARTIAL_OFF_VOCAB 16u
#define MF_PARTIAL_OFF_START 20u
#define MF_PARTIAL_OFF_STOP 24u
#define MF_PARTIAL_OFF_FAULT 28u /* the reserved word */

/* One row of one slice, 16 bytes. id/logit_bits: the slice's candidate (the argmax, or the race
 * winner of a sampled row) as a global id and its logit widened exactly to float32 bits (the
 * combine rebuilds the packed key from them, and a sampled row's race score too, so a sampled
 * record still carries the chosen logit for its logprob); MF_NO_TOKEN when the slice has none.
 * max/sum: the slice's (m, s) over all its ids, masks and bitmask ignored, when the call asked for
 * them (MF_ARGS_PARTIAL_LOGPROBS); both 0 otherwise, so that the partial argmax costs what the
 * plain argmax over the slice costs. */
typedef struct mf_partial_record {
    uint32_t id;
    uint32_t logit_bits;
    float max;
    float sum;
} mf_partial_record;

#define MF_RECORD_OFF_ID 0u
#define MF_RECORD_OFF_LOGIT_BITS 4u
#define MF_RECORD_OFF_MAX 8u
#define MF_RECORD_OFF_SUM 12u

/* One entry of a CANDS block's row (feed.h's MF_SELECT_CANDS): a candidate as a global id and its
 * logit widened to float32 bits; id MF_NO_TOKEN pads a row whose slice has fewer candidates. */
typedef struct mf_partial_cand {
    uint32_t id;
    uint32_t logit_bits;
} mf_partial_cand;
#define MF_PARTIAL_CAND_BYTES 8u

/* Top logprobs blocks (feed.h's MF_TOP_PARTIAL): the header, then rows mf_partial_records (the
 * slice's (m, s) in max/sum; id/logit_bits the global id asked for in that row and its logit when
 * the slice holds it, else MF_NO_TOKEN and 0), then rows * n mf_partial_cands (row r's list at
 * entry r * n: the slice's greatest ids in the argmax order, MF_NO_TOKEN past its last), padded to
 * whole records. Sized by the rows it holds: a shard sizes every block by its max_rows, so ranks
 * making the same calls send the same bytes. */
static inline uint64_t mf_top_block_records(uint32_t rows, uint32_t n) {
    return MF_PARTIAL_HEADER_RECORDS + (uint64_t)rows + ((uint64_t)rows * n + 1u) / 2u;
}

#ifdef __cplusplus
#define MF_LAYOUT_ASSERT(c, m) static_assert(c, m)
#else
#define MF_LAYOUT_ASSERT(c, m) _Static_assert(c, m)
#endif
MF_LAYOUT_ASSERT(sizeof(mf_partial_header) == MF_PARTIAL_HEADER_BYTES, "header size");
MF_LAYOUT_ASSERT(sizeof(mf_partial_record) == MF_PARTIAL_RECORD_BYTES, "record size");
MF_LAYOUT_ASSERT(sizeof(mf_partial_cand) == MF_PARTIAL_CAND_BYTES, "cand size");
MF_LAYOUT_ASSERT(offsetof(mf_partial_header, rows) == MF_PARTIAL_OFF_ROWS, "rows");
MF_LAYOUT_ASSERT(offsetof(mf_partial_header, call) == MF_PARTIAL_OFF_CALL, "call");
MF_LAYOUT_ASSERT(offsetof(mf_partial_header, vocab) == MF_PARTIAL_OFF_VOCAB, "vocab");
MF_LAYOUT_ASSERT(offsetof(mf_partial_header, start) == MF_PARTIAL_OFF_START, "start");
MF_LAYOUT_ASSERT(offsetof(mf_partial_header, stop) == MF_PARTIAL_OFF_STOP, "stop");
MF_LAYOUT_ASSERT(offsetof(mf_partial_header, reserved) == MF_PARTIAL_OFF_FAULT, "fault word");
MF_LAYOUT_ASSERT(offsetof(mf_partial_record, logit_bits) == MF_RECORD_OFF_LOGIT_BITS, "logit_bits");
MF_LAYOUT_ASSERT(offsetof(mf_partial_record, max) == MF_RECORD_OFF_MAX, "max");
MF_LAYOUT_ASSERT(offsetof(mf_partial_record, sum) == MF_RECORD_OFF_SUM, "sum");
#undef MF_LAYOUT_ASSERT

#endif
