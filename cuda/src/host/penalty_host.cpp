// The host twins of the penalty kernels (penalty_feed.cu): the same rule (penalty_rule.h), the
// same stage order; the rows spread over the pool.
#include "host/kernels.hpp"
#include "host/queue.hpp"
#include "metrale_feed/penalty_rule.h"

namespace mf::host {
namespace {

void apply_row(const mf_penalty_args &a, uint32_t r, uint32_t slot) {
    const mf_penalty_slot s = mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap);
    const mf_penalty_item *items = a.items + (size_t)slot * a.item_cap;
    const mf_penalty_entry *table = a.table + (size_t)slot * a.table_cap;
    const int dtype = (int)a.dtype;
    const size_t esize = mf_dtype_size(dtype);
    char *row = static_cast<char *>(a.logits) + (size_t)r * a.row_stride * esize;
    const uint32_t start = a.start, vocab = a.vocab;
    // The ids are scattered over the row: ask for every line first, so the misses overlap
    // instead of costing one memory latency per id (a row's few thousand lines fit in L2).
    for (uint32_t i = 0; i < s.biases; ++i)
        if (items[i].id - start < vocab) __builtin_prefetch(row + (size_t)(items[i].id - start) * esize, 1);
    for (uint32_t i = 0; i < s.entries; ++i)
        if (table[i].id - start < vocab) __builtin_prefetch(row + (size_t)(table[i].id - start) * esize, 1);
    for (uint32_t i = 0; i < s.biases; ++i) {  // 1. logit_bias
        const uint32_t col = items[i].id - start;  // wraps above vocab for ids below start
        if (col < vocab) mf_penalty_bias_at(row, dtype, col, items[i].value);
    }
    if (mf_penalty_bans_stops(&s))  // 2. min_tokens
        for (uint32_t i = s.biases; i < s.biases + s.stops; ++i) {
            const uint32_t col = items[i].id - start;
            if (col < vocab) mf_penalty_store(row, dtype, col, mf_neg_inf());
        }
    for (uint32_t i = 0; i < s.entries; ++i) {  // 3. repetition, frequency, presence
        const uint32_t col = table[i].id - start;
        if (col < vocab) mf_penalize_at(row, dtype, col, &s, table[i].count);
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
    if (job.update) {  // a scan of each row's table: cheap, and rows may not share a slot
        for (uint32_t r = 0; r < a.rows; ++r)
            if (slots[r] < a.slot_count) count_row(a, r, slots[r]);
        return;
    }
    // Rows are independent (each writes its own logits), so they spread over the pool.
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard pool_ieee;  // on each pool thread too
        for (uint32_t r = begin; r < end; ++r)
            if (slots[r] < a.slot_count) apply_row(a, r, slots[r]);  // NO_TOKEN: no penalties
    });
}

}  // namespace mf::host
