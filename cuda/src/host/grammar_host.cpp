// The host twins of the grammar kernels (grammar_feed.cu): the same rule (grammar_rule.h), a
// logit row's words one after another, its walk through the drafts done once; the rows spread
// over the pool. The advance is a loop over the rows.

#include "host/kernels.hpp"
#include "host/queue.hpp"
#include "metrale_feed/grammar_rule.h"

namespace mf::host {

void run_grammar_mask(const mf_grammar_mask_args &a) {
    const mf_grammar g{a.states, a.edges, a.num_states, a.num_edges, a.vocab};
    const uint32_t words = mf_bitmask_words(a.vocab), per = a.k + 1u;
    parallel_rows(a.rows * per, [&](uint32_t begin, uint32_t end) {
        for (uint32_t lr = begin; lr < end; ++lr) {
            const uint32_t r = lr / per, j = lr % per;
            const uint32_t s = mf_grammar_walk(&g, a.state_words[r], a.drafts ? a.drafts + (size_t)r * a.k : nullptr, j);
            uint32_t *out = a.bitmask_out + (size_t)lr * words;
            const uint32_t *in = a.bitmask_in ? a.bitmask_in + (size_t)lr * words : nullptr;
            for (uint32_t w = 0; w < words; ++w) out[w] = mf_grammar_word(&g, s, w) & (in ? in[w] : 0xFFFFFFFFu);
        }
    });
}

void run_grammar_advance(const mf_grammar_advance_args &a) {
    const mf_grammar g{a.states, a.edges, a.num_states, a.num_edges, a.vocab};
    for (uint32_t r = 0; r < a.rows; ++r) {
        uint32_t n;
        const uint32_t *ids = mf_grammar_row_ids(a.cells, a.k, r, &n);
        a.state_words[r] = mf_grammar_advance_row(&g, a.state_words[r], ids, n);
    }
}

}  // namespace mf::host
