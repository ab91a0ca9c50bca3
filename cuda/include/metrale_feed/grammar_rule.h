/* The device grammar's rule (feed.h, "grammar"), shared verbatim by the CUDA kernels and the host
 * backend: what a state allows, where an id takes it, a row's walk through its drafts and the
 * words of its bitmask row are these functions on every backend.
 *
 * The automaton is device data read when a kernel runs, never checked when a call is queued, so
 * every function stays inside the arrays whatever they hold: a state's edges are clamped to the
 * edge array, a state index >= num_states allows nothing, an id >= vocab is never allowed. Edges
 * out of order give wrong answers, never a read outside the arrays. */
#ifndef METRALE_FEED_GRAMMAR_RULE_H
#define METRALE_FEED_GRAMMAR_RULE_H

#include "metrale_feed/argmax_rule.h"
#include "metrale_feed/feed.h"

/* One automaton as the kernels see it (from either descriptor). */
typedef struct mf_grammar {
    const mf_grammar_state *states;
    const mf_grammar_edge *edges;
    uint32_t num_states;
    uint32_t num_edges;
    uint32_t vocab;
} mf_grammar;

/* State s's (s < num_states) edges [*lo, *hi), clamped to the edge array, and its fallback. */
MF_HD void mf_grammar_edges_of(const mf_grammar *g, uint32_t s, uint32_t *lo, uint32_t *hi, uint32_t *fallback) {
    const mf_grammar_state st = g->states[s];
    const uint32_t first = st.first < g->num_edges ? st.first : g->num_edges;
    const uint32_t room = g->num_edges - first;
    *lo = first;
    *hi = first + (st.count < room ? st.count : room);
    *fallback = st.fallback;
}

/* The first edge in [lo, hi) whose token is >= t (hi: none), by binary search. */
MF_HD uint32_t mf_grammar_lower_bound(const mf_grammar_edge *edges, uint32_t lo, uint32_t hi, uint32_t t) {
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2u;
        if (edges[mid].token < t) lo = mid + 1u;
        else hi = mid;
    }
    return lo;
}

/* Whether state word s allows id t, and then *next, the state word after it. An unconstrained
 * row (MF_NO_TOKEN) allows every id and stays unconstrained; a state >= num_states allows none;
 * so does every state for an id >= vocab (MF_NO_TOKEN included). */
MF_HD int mf_grammar_allows(const mf_grammar *g, uint32_t s, uint32_t t, uint32_t *next) {
    if (s == MF_NO_TOKEN) {
        *next = MF_NO_TOKEN;
        return 1;
    }
    if (s >= g->num_states || t >= g->vocab) return 0;
    uint32_t lo, hi, fallback;
    mf_grammar_edges_of(g, s, &lo, &hi, &fallback);
    const uint32_t i = mf_grammar_lower_bound(g->edges, lo, hi, t);
    const uint32_t n = (i < hi && g->edges[i].token == t) ? g->edges[i].next : fallback;
    *next = n;
    return n != MF_GRAMMAR_DEAD;
}

/* The state a row's first j drafts reach from state word s: the walk stops at the first draft
 * its state does not allow (the verify rejects it there), so later positions keep that state. */
MF_HD uint32_t mf_grammar_walk(const mf_grammar *g, uint32_t s, const uint32_t *drafts, uint32_t j) {
    for (uint32_t i = 0; i < j; ++i) {
        uint32_t next;
        if (!mf_grammar_allows(g, s, drafts[i], &next)) break;
        s = next;
    }
    return s;
}

/* Word w (w < ceil(vocab / 32)) of state word s's bitmask row: bit b set when id 32w + b is
 * allowed, bits >= vocab clear. The fallback sets or clears the whole word, then the state's edges
 * inside it (found by binary search, so each word costs log(edges) reads plus its own edges) set
 * or clear their bit. */
MF_HD uint32_t mf_grammar_word(const mf_grammar *g, uint32_t s, uint32_t w) {
    const uint32_t base = w * 32u;
    const uint32_t left = g->vocab - base; /* >= 1 */
    const uint32_t valid = left >= 32u ? 0xFFFFFFFFu : (1u << left) - 1u;
    if (s == MF_NO_TOKEN) return valid;
    if (s >= g->num_states) return 0u;
    uint32_t lo, hi, fallback;
    mf_grammar_edges_of(g, s, &lo, &hi, &fallback);
    uint32_t word = fallback != MF_GRAMMAR_DEAD ? 0xFFFFFFFFu : 0u;
    /* token - base >= 32 ends the word's edges (and, unsigned, a token below base: out of order) */
    for (uint32_t i = mf_grammar_lower_bound(g->edges, lo, hi, base); i < hi && g->edges[i].token - base < 32u; ++i) {
        const uint32_t bit = 1u << (g->edges[i].token - base);
        word = g->edges[i].next != MF_GRAMMAR_DEAD ? (word | bit) : (word & ~bit);
    }
    return word & valid;
}

/* The state word after ids[0, n) in order, each id stepping it on its own: an id the state does
 * not allow leaves it unchanged (a row with no candidate wrote MF_NO_TOKEN), as does a state word
 * >= num_states; an unconstrained row stays unconstrained. */
MF_HD uint32_t mf_grammar_advance_row(const mf_grammar *g, uint32_t s, const uint32_t *ids, uint32_t n) {
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t next;
        if (mf_grammar_allows(g, s, ids[i], &next)) s = next;
    }
    return s;
}

/* Row r's ids in a pick's cells: k = 0, cells[r]; k > 0 (verify_to_feed's layout), the n ids
 * after cells[r * (k + 2)] = n, none when n is outside [1, k + 1] (as mf_verify_resolve reads it). */
MF_HD const uint32_t *mf_grammar_row_ids(const uint32_t *cells, uint32_t k, uint32_t r, uint32_t *n) {
    if (k == 0u) {
        *n = 1u;
        return cells + r;
    }
    const uint32_t *row = cells + (uint64_t)r * (k + 2u);
    *n = row[0] >= 1u && row[0] <= k + 1u ? row[0] : 0u;
    return row + 1;
}

#endif
