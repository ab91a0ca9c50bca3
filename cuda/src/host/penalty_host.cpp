// The host twins of the penalty kernels (penalty_feed.cu): the same rule (penalty_rule.h), the
// same stage order, one row after another on the stream's worker. A row touches a few thousand
// ids at most, so the pool is not worth waking for it.
#include "host/kernels.hpp"
#include "metrale_feed/penalty_rule.h"

namespace mf::host {
namespace {

void apply_row(const mf_penalty_args &a, uint32_t r, uint32_t slot) {
    const mf_penalty_slot s = mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap);
    const mf_penalty_item *items = a.items + (size_t)slot * a.item_cap;
    const mf_penalty_entry *table = a.table + (size_t)slot * a.table_cap;
    void *row = static_cast<char *>(a.logits) + (size_t)r * a.row_stride * mf_dtype_size((int)a.dtype);
    const int dtype = (int)a.dtype;
    const uint32_t start = a.start, vocab = a.vocab;
    for (uint32_t i = 0; i < s.biases; ++i) {  // 1. logit_bias
        const uint32_t col = items[i].id - start;  // wraps above vocab for ids below start
        if (col < vocab) mf_penalty_store(row, dtype, col, mf_fadd(mf_penalty_load(row, dtype, col), items[i].value));
    }
    if (mf_penalty_bans_stops(&s))  // 2. min_tokens
        for (uint32_t i = s.biases; i < s.biases + s.stops; ++i) {
            const uint32_t col = items[i].id - start;
            if (col < vocab) mf_penalty_store(row, dtype, col, mf_neg_inf());
        }
    for (uint32_t i = 0; i < s.entries; ++i) {  // 3. repetition, frequency, presence
        const uint32_t col = table[i].id - start;
        if (col < vocab) mf_penalty_store(row, dtype, col, mf_penalize(mf_penalty_load(row, dtype, col), &s, table[i].count));
    }
}

void count_row(const mf_penalty_args &a, uint32_t r, uint32_t slot) {
    const uint32_t id = a.ids[r];
    if (id == MF_NO_TOKEN) return;
    mf_penalty_slot s = mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap);
    mf_penalty_entry *table = a.table + (size_t)slot * a.table_cap;
    uint32_t found = a.table_cap;
    for (uint32_t i = 0; i < s.entries; ++i)
        if (table[i].id == id) {
            found = i;
            break;
        }
    mf_penalty_count(&s, table, a.table_cap, id, found);
    a.state[slot].generated = s.generated;
    a.state[slot].entries = s.entries;
}

}  // namespace

void run_penalties(const PenaltyJob &job) {
    IeeeFpGuard ieee;  // the rule's arithmetic needs subnormals
    const mf_penalty_args &a = job.args;
    const uint32_t *slots = job.slot_words();
    for (uint32_t r = 0; r < a.rows; ++r) {
        const uint32_t slot = slots[r];
        if (slot >= a.slot_count) continue;  // NO_TOKEN: no penalties; a device slot out of range: none
        if (job.update) count_row(a, r, slot);
        else apply_row(a, r, slot);
    }
}

}  // namespace mf::host
