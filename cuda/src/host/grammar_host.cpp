// The host twins of the grammar kernels (grammar_feed.cu): the same rule (grammar_rule.h), the rows
// spread over the pool. The advance is a loop over the rows.
//
// The mask builds a row in one pass over its state's edges rather than a word at a time: the GPU
// kernel gives each word a thread and a binary search, but on a core that search per word is what
// a step over a 152k vocabulary would spend its time on (64 rows: ten times the pick itself). The
// pass is the word rule's answer whenever a state's edges increase, which every encoder writes;
// edges out of order take the word rule itself, so the bits are the CUDA kernel's whatever the
// arrays hold. Rows in the same state (a batch's rows inside a JSON string) copy the first one's.

#include <algorithm>
#include <cstring>

#include "host/kernels.hpp"
#include "host/queue.hpp"
#include "metrale_feed/grammar_rule.h"

namespace mf::host {
namespace {

// State word s's bitmask row, `words` words: mf_grammar_word of each word.
void state_row(const mf_grammar &g, uint32_t s, uint32_t words, uint32_t *out) {
    const uint32_t left = g.vocab - (words - 1u) * 32u;  // ids in the last word, 1 .. 32
    const uint32_t last = left >= 32u ? 0xFFFFFFFFu : (1u << left) - 1u;
    if (s == MF_NO_TOKEN || s >= g.num_states) {
        std::fill(out, out + words, s == MF_NO_TOKEN ? 0xFFFFFFFFu : 0u);
        out[words - 1] &= last;
        return;
    }
    uint32_t lo, hi, fallback;
    mf_grammar_edges_of(&g, s, &lo, &hi, &fallback);
    for (uint32_t i = lo + 1u; i < hi; ++i) {
        if (g.edges[i].token <= g.edges[i - 1u].token) {  // out of order: the word rule's answer
            for (uint32_t w = 0; w < words; ++w) out[w] = mf_grammar_word(&g, s, w);
            return;
        }
    }
    std::fill(out, out + words, fallback != MF_GRAMMAR_DEAD ? 0xFFFFFFFFu : 0u);
    const uint64_t end = (uint64_t)words * 32u;  // the word rule reads no edge at or past it
    for (uint32_t i = lo; i < hi && g.edges[i].token < end; ++i) {
        const uint32_t t = g.edges[i].token, bit = 1u << (t % 32u);
        if (g.edges[i].next != MF_GRAMMAR_DEAD) out[t / 32u] |= bit;
        else out[t / 32u] &= ~bit;
    }
    out[words - 1] &= last;
}

}  // namespace

void run_grammar_mask(const mf_grammar_mask_args &a) {
    const mf_grammar g{a.states, a.edges, a.num_states, a.num_edges, a.vocab};
    const uint32_t words = mf_bitmask_words(a.vocab), per = a.k + 1u;
    parallel_rows(a.rows * per, [&](uint32_t begin, uint32_t end) {
        // The last few states this slice built, each with the row that holds it (not with
        // bitmask_in: that row has its own input ANDed in).
        constexpr uint32_t kRecent = 8;
        uint32_t seen_state[kRecent], seen_row[kRecent], seen = 0;
        for (uint32_t lr = begin; lr < end; ++lr) {
            const uint32_t r = lr / per, j = lr % per;
            const uint32_t s = mf_grammar_walk(&g, a.state_words[r], a.drafts ? a.drafts + (size_t)r * a.k : nullptr, j);
            uint32_t *out = a.bitmask_out + (size_t)lr * words;
            if (a.bitmask_in) {
                const uint32_t *in = a.bitmask_in + (size_t)lr * words;
                state_row(g, s, words, out);
                for (uint32_t w = 0; w < words; ++w) out[w] &= in[w];
                continue;
            }
            const uint32_t *hit = std::find(seen_state, seen_state + std::min(seen, kRecent), s);
            if (hit != seen_state + std::min(seen, kRecent)) {
                std::memcpy(out, a.bitmask_out + (size_t)seen_row[hit - seen_state] * words, (size_t)words * 4);
                continue;
            }
            state_row(g, s, words, out);
            seen_state[seen % kRecent] = s;
            seen_row[seen % kRecent] = lr;
            ++seen;
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
