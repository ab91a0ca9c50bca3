// The host twins of the penalty kernels (penalty_feed.cu): the same rule (penalty_rule.h), the
// same stage order; the rows spread over the pool. A pick that carries its step's penalties
// (Ops::argmax_penalised) calls apply_penalties_row for each row just before it picks the row, and
// count_penalties once every row is picked (argmax_host.cpp, run_argmax); a verify that carries
// them (Ops::verify_penalised), apply_verify_penalties_row for each logit row, or for a greedy
// float32 one argmax_penalised_row, its penalties inside its argmax's pass (verify_host.cpp).
#include "host/kernels.hpp"
#include "host/queue.hpp"
#include "metrale_feed/penalty_rule.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MF_X86 1
#endif

namespace mf::host {
namespace {

#ifdef MF_X86
// Stages 1 and 3 of penalty_rule.h eight ids at a time on a float32 row: the same operations in
// the same order give every logit the bits the scalar rule gives it (tests compare both paths:
// use_portable_argmax), without the scalar rule's branch on the sign of a logit, which picks
// division or multiplication and mispredicts half the time. A slot's ids are distinct within a
// stage, so no two lanes write one column.
struct Lanes8 {
    __m256i cols;  // the ids' columns in the slice
    __m256i in;    // col < vocab (unsigned: an id below start wraps above vocab); the others are not touched
};

__attribute__((target("avx2"))) inline Lanes8 lanes8(__m256i ids, uint32_t start, uint32_t vocab) {
    const __m256i cols = _mm256_sub_epi32(ids, _mm256_set1_epi32((int)start));
    const __m256i flip = _mm256_set1_epi32(INT32_MIN);
    return Lanes8{cols, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(vocab ^ 0x80000000u)), _mm256_xor_si256(cols, flip))};
}

__attribute__((target("avx2"))) inline __m256i gather8(const uint32_t *row, const Lanes8 &at) {
    return _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)row, at.cols, at.in, 4);
}

// mf_penalty_saturate, and a NaN left as it was: the words to store for logits `bits` whose rule
// result is v.
__attribute__((target("avx2"))) inline __m256i finish8(__m256i bits, __m256 v) {
    const __m256 top = _mm256_set1_ps(mf_penalty_max(0)), bottom = _mm256_set1_ps(-mf_penalty_max(0));
    const __m256i inf = _mm256_set1_epi32(0x7F800000);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    __m256 clamped = _mm256_blendv_ps(v, top, _mm256_cmp_ps(v, top, _CMP_GT_OQ));
    clamped = _mm256_blendv_ps(clamped, bottom, _mm256_cmp_ps(v, bottom, _CMP_LT_OQ));
    v = _mm256_blendv_ps(v, clamped, _mm256_castsi256_ps(_mm256_cmpgt_epi32(inf, mag)));  // finite before
    return _mm256_blendv_epi8(_mm256_castps_si256(v), bits, _mm256_cmpgt_epi32(mag, inf));
}

__attribute__((target("avx2"))) inline void scatter8(uint32_t *row, const Lanes8 &at, __m256i words) {
    alignas(32) uint32_t w[8], c[8];
    _mm256_store_si256((__m256i *)w, words);
    _mm256_store_si256((__m256i *)c, at.cols);
    const unsigned stored = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(at.in));
    for (unsigned j = 0; j < 8; ++j)
        if (stored >> j & 1u) row[c[j]] = w[j];
}

// Eight 8-byte (id, 32-bit word) records, split into their ids and their words.
__attribute__((target("avx2"))) inline void split8(const void *records, __m256i &ids, __m256i &words) {
    const __m256i evens = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i e0 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)records), evens);
    const __m256i e1 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)records + 1), evens);
    ids = _mm256_permute2x128_si256(e0, e1, 0x20);
    words = _mm256_permute2x128_si256(e0, e1, 0x31);
}

// The lines of eight records' ids, asked for kAhead groups of eight before the gathers need them:
// the misses of several groups overlap (a gather waits for its own eight), without asking for so
// many at once that the CPU's outstanding misses are full. An id outside the slice asks for a line
// it will not touch: harmless (the address is formed as an integer, a prefetch never faults).
constexpr uint32_t kAhead = 4;
template <class Record>
inline void prefetch8(const uint32_t *row, const Record *records, uint32_t start) {
    for (int j = 0; j < 8; ++j)
        __builtin_prefetch((const void *)((uintptr_t)row + (uintptr_t)(records[j].id - start) * 4u), 1);
}

// A stage over records [0, 8 * floor(n / 8)) eight at a time: rule(l, words, ids) is the stage's
// result for the logits l of eight records whose ids and second words those are. Returns the
// records done.
template <class Record, class Rule>
__attribute__((target("avx2"))) inline uint32_t stage8(uint32_t *row, const Record *records, uint32_t n,
                                                       uint32_t start, uint32_t vocab, const Rule &rule) {
    static_assert(sizeof(Record) == 8, "split8 reads 8-byte records");
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        if (i + 8 * kAhead + 8 <= n) prefetch8(row, records + i + 8 * kAhead, start);
        __m256i ids, words;
        split8(records + i, ids, words);
        const Lanes8 at = lanes8(ids, start, vocab);
        const __m256i bits = gather8(row, at);
        scatter8(row, at, finish8(bits, rule(_mm256_castsi256_ps(bits), words, ids)));
    }
    return i;
}

// Stage 1: l + bias (the item's second word).
struct Bias8 {
    __attribute__((target("avx2"))) __m256 operator()(__m256 l, __m256i bias, __m256i) const {
        return _mm256_add_ps(l, _mm256_castsi256_ps(bias));
    }
};

// Stage 3: l > 0 ? l / rep : l * rep, then, with a count n (the entry's second word, less
// MF_PENALTY_PROMPT, plus the id's walked drafts: mf_penalty_count_plus), (l - freq * n) - presence.
struct Penalty8 {
    const mf_penalty_slot &s;
    const uint32_t *drafts = nullptr;  // a verify position's walked drafts
    uint32_t w = 0;
    __attribute__((target("avx2"))) __m256 operator()(__m256 l, __m256i counts, __m256i ids) const {
        const __m256 rep = _mm256_set1_ps(s.repetition);
        const __m256 v = _mm256_blendv_ps(_mm256_mul_ps(l, rep), _mm256_div_ps(l, rep),
                                          _mm256_cmp_ps(l, _mm256_setzero_ps(), _CMP_GT_OQ));
        __m256i n = _mm256_and_si256(counts, _mm256_set1_epi32((int)~MF_PENALTY_PROMPT));
        if (w) {  // + the drafts equal to each id (a compare's -1 subtracted), saturating
            __m256i more = _mm256_setzero_si256();
            for (uint32_t u = 0; u < w; ++u)
                more = _mm256_sub_epi32(more, _mm256_cmpeq_epi32(ids, _mm256_set1_epi32((int)drafts[u])));
            n = _mm256_min_epu32(_mm256_add_epi32(n, more), _mm256_set1_epi32((int)~MF_PENALTY_PROMPT));
        }  // n is below 2**31:
        const __m256 nf = _mm256_cvtepi32_ps(n);  // converts as the unsigned count does
        const __m256 counted = _mm256_sub_ps(_mm256_sub_ps(v, _mm256_mul_ps(_mm256_set1_ps(s.frequency), nf)),
                                             _mm256_set1_ps(s.presence));
        return _mm256_blendv_ps(v, counted, _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, _mm256_setzero_si256())));
    }
};

// The first of table entries [0, 8 * floor(n / 8)) that holds id, or that bound when none does.
__attribute__((target("avx2"))) uint32_t find_avx2(const mf_penalty_entry *table, uint32_t n, uint32_t id) {
    const __m256i want = _mm256_set1_epi32((int)id);
    uint32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i ids, counts;
        split8(table + i, ids, counts);
        const unsigned hits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(ids, want)));
        if (hits) return i + (uint32_t)__builtin_ctz(hits);
    }
    return i;
}
#endif

// Whether the eight-id paths may run: the CPU has AVX2 and no test forced the portable paths.
bool eight_ids() {
#ifdef MF_X86
    static const bool avx2 = __builtin_cpu_supports("avx2");
    return avx2 && vector_paths();
#else
    return false;
#endif
}

// Logit row r of slot `slot`; a verify position's first w drafts (penalty_rule.h's walk) count
// as generated. known: w words of scratch (mf_penalty_draft_joins).
void apply_row(const mf_penalty_args &a, uint32_t r, uint32_t slot, bool vector, const uint32_t *drafts = nullptr,
               uint32_t w = 0, uint32_t *known = nullptr) {
    const mf_penalty_slot s = mf_penalty_walk_slot(mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap), w);
    const mf_penalty_item *items = a.items + (size_t)slot * a.item_cap;
    const mf_penalty_entry *table = a.table + (size_t)slot * a.table_cap;
    const int dtype = (int)a.dtype;
    const size_t esize = mf_dtype_size(dtype);
    char *row = static_cast<char *>(a.logits) + (size_t)r * a.row_stride * esize;
    const uint32_t start = a.start, vocab = a.vocab;
    const bool f32x8 = vector && dtype == MF_DTYPE_F32;
    // The ids are scattered over the row: the scalar path asks for every line first, so the misses
    // overlap instead of costing one memory latency per id. (The eight-id path asks a few groups
    // ahead instead: a thousand prefetches at once cost more instructions than they hide.)
    for (uint32_t i = 0; i < s.biases && !f32x8; ++i)
        if (items[i].id - start < vocab) __builtin_prefetch(row + (size_t)(items[i].id - start) * esize, 1);
    for (uint32_t i = 0; i < s.entries && !f32x8; ++i)
        if (table[i].id - start < vocab) __builtin_prefetch(row + (size_t)(table[i].id - start) * esize, 1);
    uint32_t i = 0;  // 1. logit_bias
#ifdef MF_X86
    if (f32x8) i = stage8(reinterpret_cast<uint32_t *>(row), items, s.biases, start, vocab, Bias8{});
#endif
    for (; i < s.biases; ++i) {
        const uint32_t col = items[i].id - start;  // wraps above vocab for ids below start
        if (col < vocab) mf_penalty_bias_at(row, dtype, col, items[i].value);
    }
    if (mf_penalty_bans_stops(&s))  // 2. min_tokens
        for (uint32_t i = s.biases; i < s.biases + s.stops; ++i) {
            const uint32_t col = items[i].id - start;
            if (col < vocab) mf_penalty_store(row, dtype, col, mf_neg_inf());
        }
    i = 0;  // 3. repetition, frequency, presence
#ifdef MF_X86
    if (f32x8) i = stage8(reinterpret_cast<uint32_t *>(row), table, s.entries, start, vocab, Penalty8{s, drafts, w});
#else
    (void)f32x8;
#endif
    for (; i < s.entries; ++i) {
        const uint32_t col = table[i].id - start;
        if (col < vocab)
            mf_penalize_at(row, dtype, col, &s, w ? mf_penalty_count_plus(table[i].count, mf_penalty_draft_count(drafts, w, table[i].id))
                                                  : table[i].count);
    }
    if (!w) return;
    // The walked drafts' ids the table lacks, each once, as the counts would append them.
    for (uint32_t u = 0; u < w; ++u) {
        uint32_t at = 0;
#ifdef MF_X86
        if (vector) at = find_avx2(table, s.entries, drafts[u]);
#endif
        while (at < s.entries && table[at].id != drafts[u]) ++at;
        known[u] = at < s.entries || mf_penalty_draft_repeats(drafts, u);
    }
    for (uint32_t u = 0; u < w; ++u) {
        const uint32_t col = drafts[u] - start;
        if (col < vocab && mf_penalty_draft_joins(known, u, s.entries, a.table_cap))
            mf_penalize_at(row, dtype, col, &s, mf_penalty_draft_count(drafts, w, drafts[u]));
    }
}

// Counts `id` into the slot (MF_NO_TOKEN: nothing).
void count_id(const mf_penalty_args &a, uint32_t slot, uint32_t id, bool vector) {
    if (id == MF_NO_TOKEN) return;
    mf_penalty_slot s = mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap);
    mf_penalty_entry *table = a.table + (size_t)slot * a.table_cap;
    uint32_t i = 0;
#ifdef MF_X86
    if (vector) i = find_avx2(table, s.entries, id);
#endif
    while (i < s.entries && table[i].id != id) ++i;
    const uint32_t found = i < s.entries ? i : a.table_cap;
    mf_penalty_count(&s, table, a.table_cap, id, found);
    a.state[slot].generated = s.generated;
    a.state[slot].entries = s.entries;
}

// Row r's ids: a pick's cell, or (k > 0) the n ids a verify emitted, in order.
void count_row(const mf_penalty_args &a, uint32_t r, uint32_t slot, bool vector) {
    if (!a.k) return count_id(a, slot, a.ids[r], vector);
    uint32_t last, n;
    const uint32_t *cells = a.ids + (size_t)r * (a.k + 2);
    mf_verify_resolve(cells, a.k, &last, &n);
    for (uint32_t i = 0; i < n; ++i) count_id(a, slot, cells[1 + i], vector);
}

}  // namespace

void apply_penalties_row(const mf_penalty_args &args, uint32_t r, uint32_t slot) {
    apply_row(args, r, slot, eight_ids());
}

// Asks for the lines of logit row lr that the slot's biases, stops and table entries touch (the
// walked drafts' new ids aside: a few), into L2; ids outside the slice are skipped, as the apply
// skips them.
void prefetch_penalties_row(const mf_penalty_args &a, uint32_t lr, uint32_t slot) {
    const mf_penalty_slot s = mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap);
    const mf_penalty_item *items = a.items + (size_t)slot * a.item_cap;
    const mf_penalty_entry *table = a.table + (size_t)slot * a.table_cap;
    const size_t esize = mf_dtype_size((int)a.dtype);
    const char *row = static_cast<const char *>(a.logits) + (size_t)lr * a.row_stride * esize;
    for (uint32_t i = 0; i < s.biases + s.stops; ++i)
        if (items[i].id - a.start < a.vocab) __builtin_prefetch(row + (size_t)(items[i].id - a.start) * esize, 1, 2);
    for (uint32_t i = 0; i < s.entries; ++i)
        if (table[i].id - a.start < a.vocab) __builtin_prefetch(row + (size_t)(table[i].id - a.start) * esize, 1, 2);
}

void apply_verify_penalties_row(const mf_penalty_args &args, uint32_t r, uint32_t j, uint32_t slot) {
    uint32_t known[MF_MAX_DRAFTS];
    const uint32_t k = args.k, *drafts = args.drafts + (size_t)r * k;
    apply_row(args, r * (k + 1) + j, slot, eight_ids(), drafts, mf_penalty_walked(drafts, k, j), known);
}

// ---- a greedy float32 verify row: its penalties inside the argmax's one pass ----
// Applied to the whole row before the verify reads it, the penalties' scattered read-modify-writes
// miss the caches, each line once more than the verify's stream fetches it. Here the row goes a
// chunk at a time: the argmax streams the chunk's raw logits, the chunk's penalties are applied to
// the lines that stream just brought in (cache hits), and only the ids they touched are read
// again. The raw scan's best id u answers for every untouched id: if u's logit came out of the
// apply unchanged, every untouched id of the chunk is at most u's (ties: later ids, losing), so the
// chunk's best is u's or a touched id's; if it changed, the chunk is scanned again (cached). A
// chunk is not scanned after its writes as a rule: a vector load of a word still in the store
// buffer waits for it to commit, and the apply leaves a few hundred there.
// Each id gets the same stages in the same order (bias, stop, penalty, a walked draft's join) and
// the best of the chunks is the row's (argmax_rule.h: partial maxima combine), so the logits and
// the id are bit for bit apply_verify_penalties_row's and argmax_row's.
namespace {

constexpr uint32_t kChunkShift = 12;  // 4096 ids: 16 KiB of float32 logits, well inside L1

// Records whose ids fall in the slice, sorted into the chunks of their columns (a counting sort,
// stable), each chunk's padded to a multiple of `align` with records outside the slice (id
// start - 1: column 2**32 - 1, which the eight-id stages mask and never touch). at[c]: where
// chunk c's records begin; at[chunks]: the end.
template <class Record>
void sort_chunks(const Record *in, uint32_t n, const mf_penalty_args &a, uint32_t chunks, uint32_t align,
                 std::vector<Record> &out, std::vector<uint32_t> &at, std::vector<uint32_t> &next) {
    at.assign(chunks + 1, 0u);
    for (uint32_t i = 0; i < n; ++i) {
        const uint32_t col = in[i].id - a.start;
        if (col < a.vocab) ++at[(col >> kChunkShift) + 1];
    }
    at[0] = (uint32_t)out.size();
    for (uint32_t c = 0; c < chunks; ++c) at[c + 1] = at[c] + (at[c + 1] + align - 1) / align * align;
    Record pad{};
    pad.id = a.start - 1u;
    out.resize(at[chunks], pad);
    next.assign(at.begin(), at.end() - 1);
    for (uint32_t i = 0; i < n; ++i) {
        const uint32_t col = in[i].id - a.start;
        if (col < a.vocab) out[next[col >> kChunkShift]++] = in[i];
    }
}

uint32_t chunk_count(const mf_penalty_args &a) { return (a.vocab + (1u << kChunkShift) - 1) >> kChunkShift; }

#ifdef MF_X86
// The best of `best` and the candidates among n records' columns (a padded bucket: pads skipped).
// Most groups of eight hold nothing at or above the best: one compare of their raw signed keys
// (NaN high: looked at) rules them out; a group that might is offered id by id, under the rule.
template <class Record>
__attribute__((target("avx2"))) uint64_t offer_touched(const uint32_t *row, const Record *records, uint32_t n,
                                                       uint32_t start, uint32_t vocab, const mf_row_rule *rule,
                                                       uint64_t best) {
    for (uint32_t i = 0; i < n; i += 8) {
        __m256i ids, words;
        split8(records + i, ids, words);
        const Lanes8 at = lanes8(ids, start, vocab);
        const __m256i bits = gather8(row, at);
        if (best) {
            // The best's signed key (argmax_host.cpp's: sign and magnitude, a NaN just above the
            // lowest), less one: a lane at or above it might win (a tie, by a lower id).
            const uint32_t key = (uint32_t)(best >> 32);
            const int32_t below = key == 0u ? INT32_MIN : (int32_t)(key - 0x80000000u) - 1;
            const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
            const __m256i raw = _mm256_sign_epi32(mag, bits);  // -0.0 and +0.0 alike
            const __m256i maybe = _mm256_and_si256(at.in, _mm256_cmpgt_epi32(raw, _mm256_set1_epi32(below)));
            if (_mm256_testz_si256(maybe, maybe)) continue;
        }
        for (uint32_t u = 0; u < 8; ++u) {
            const uint32_t col = records[i + u].id - start;
            if (col < vocab && col != rule->m0 && col != rule->m1 && mf_bit_allowed(rule->bits, col))
                best = mf_pack_max(best, mf_pack(mf_key_f32(row[col]), col));
        }
    }
    return best;
}
#endif

}  // namespace

bool chunked_penalties(const mf_penalty_args &args) { return args.dtype == MF_DTYPE_F32 && eight_ids(); }

void sort_penalty_chunks(const mf_penalty_args &a, uint32_t slot, PenaltyChunks &out) {
    const mf_penalty_slot s = mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap);
    const mf_penalty_item *items = a.items + (size_t)slot * a.item_cap;
    const uint32_t chunks = chunk_count(a);
    out.items.clear();
    out.entries.clear();
    sort_chunks(items, s.biases, a, chunks, 8, out.items, out.bias_at, out.next);
    sort_chunks(items + s.biases, s.stops, a, chunks, 8, out.items, out.stop_at, out.next);
    sort_chunks(a.table + (size_t)slot * a.table_cap, s.entries, a, chunks, 8, out.entries, out.entry_at, out.next);
}

#ifndef MF_X86
uint32_t argmax_penalised_row(const mf_penalty_args &a, const PenaltyChunks &, uint32_t r, uint32_t j,
                              uint32_t slot, const mf_row_rule *rule) {  // never taken: no eight-id paths
    apply_verify_penalties_row(a, r, j, slot);
    return argmax_row(static_cast<const char *>(a.logits) + ((size_t)r * (a.k + 1) + j) * a.row_stride * 4,
                      MF_DTYPE_F32, a.vocab, rule);
}
#else
uint32_t argmax_penalised_row(const mf_penalty_args &a, const PenaltyChunks &pc, uint32_t r, uint32_t j,
                              uint32_t slot, const mf_row_rule *rule) {
    const uint32_t k = a.k, *drafts = a.drafts + (size_t)r * k, w = mf_penalty_walked(drafts, k, j);
    const mf_penalty_slot s = mf_penalty_walk_slot(mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap), w);
    const mf_penalty_entry *table = a.table + (size_t)slot * a.table_cap;
    const uint32_t start = a.start, vocab = a.vocab, chunks = chunk_count(a);
    // The walked drafts' ids the table lacks, each once (apply_row's last stage): their columns
    // and counts, applied in their chunks.
    uint32_t known[MF_MAX_DRAFTS], join_col[MF_MAX_DRAFTS], join_count[MF_MAX_DRAFTS], joins = 0;
    for (uint32_t u = 0; u < w; ++u) {
        uint32_t at = find_avx2(table, s.entries, drafts[u]);
        while (at < s.entries && table[at].id != drafts[u]) ++at;
        known[u] = at < s.entries || mf_penalty_draft_repeats(drafts, u);
    }
    for (uint32_t u = 0; u < w; ++u) {
        const uint32_t col = drafts[u] - start;
        if (col < vocab && mf_penalty_draft_joins(known, u, s.entries, a.table_cap)) {
            join_col[joins] = col;
            join_count[joins++] = mf_penalty_draft_count(drafts, w, drafts[u]);
        }
    }
    uint32_t *row = static_cast<uint32_t *>(a.logits) + ((size_t)r * (k + 1) + j) * a.row_stride;
    const bool bans = mf_penalty_bans_stops(&s);
    const Penalty8 penalty{s, drafts, w};
    uint64_t best = 0;  // packed (argmax_rule.h) over the chunks so far; 0: no candidate yet
    for (uint32_t c = 0; c < chunks; ++c) {
        const uint32_t lo = c << kChunkShift, hi = vocab - lo <= (1u << kChunkShift) ? vocab : lo + (1u << kChunkShift);
        const uint64_t raw = argmax_f32_above(row, vocab, rule, lo, hi, best);  // the stream
        const uint32_t u = raw != best ? mf_unpack_id(raw) : MF_NO_TOKEN, before = u != MF_NO_TOKEN ? row[u] : 0u;
        const mf_penalty_item *biases = pc.items.data() + pc.bias_at[c], *stops = pc.items.data() + pc.stop_at[c];
        const mf_penalty_entry *entries = pc.entries.data() + pc.entry_at[c];
        const uint32_t nb = pc.bias_at[c + 1] - pc.bias_at[c], ns = bans ? pc.stop_at[c + 1] - pc.stop_at[c] : 0u;
        const uint32_t ne = pc.entry_at[c + 1] - pc.entry_at[c];
        stage8(row, biases, nb, start, vocab, Bias8{});  // 1-3 and the joins, on cached lines
        for (uint32_t i = 0; i < ns; ++i)
            if (stops[i].id - start < vocab) mf_penalty_store(row, MF_DTYPE_F32, stops[i].id - start, mf_neg_inf());
        stage8(row, entries, ne, start, vocab, penalty);
        bool joined = false;
        for (uint32_t v = 0; v < joins; ++v)
            if (join_col[v] >> kChunkShift == c) {
                mf_penalize_at(row, MF_DTYPE_F32, join_col[v], &s, join_count[v]);
                joined = true;
            }
        if (u != MF_NO_TOKEN && row[u] != before) {  // the raw best changed: scan the chunk again
            best = argmax_f32_above(row, vocab, rule, lo, hi, best);
            continue;
        }
        best = raw;  // the untouched ids' best; the touched ones offered next
        best = offer_touched(row, biases, nb, start, vocab, rule, best);
        best = offer_touched(row, stops, ns, start, vocab, rule, best);
        best = offer_touched(row, entries, ne, start, vocab, rule, best);
        for (uint32_t v = 0; joined && v < joins; ++v) {
            const uint32_t col = join_col[v];
            if (col >> kChunkShift == c && col != rule->m0 && col != rule->m1 && mf_bit_allowed(rule->bits, col))
                best = mf_pack_max(best, mf_pack(mf_key_f32(row[col]), col));
        }
    }
    return best ? mf_unpack_id(best) : MF_NO_TOKEN;
}
#endif

// A scan of each row's table: cheap. Rows may name one slot (device slots are not checked when
// queued), so one thread counts them, in row order.
void count_penalties(const mf_penalty_args &args, const uint32_t *slots) {
    const bool vector = eight_ids();
    for (uint32_t r = 0; r < args.rows; ++r)
        if (slots[r] < args.slot_count) count_row(args, r, slots[r], vector);
}

void run_penalties(const PenaltyJob &job) {
    IeeeFpGuard ieee;  // the rule's arithmetic needs subnormals
    const mf_penalty_args &a = job.args;
    const uint32_t *slots = job.slot_words();
    if (job.update) return count_penalties(a, slots);
    const bool vector = eight_ids();
    const uint32_t k = a.k;
    // Logit rows are independent (each writes its own logits), so they spread over the pool; a
    // verify's k + 1 positions of a row read its slot alike, each walking its own drafts.
    parallel_rows(a.rows * (k + 1), [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard pool_ieee;  // on each pool thread too
        uint32_t known[MF_MAX_DRAFTS];
        for (uint32_t lr = begin; lr < end; ++lr) {
            const uint32_t r = lr / (k + 1), slot = slots[r];
            if (slot >= a.slot_count) continue;  // NO_TOKEN: no penalties
            const uint32_t *drafts = k ? a.drafts + (size_t)r * k : nullptr;
            apply_row(a, lr, slot, vector, drafts, k ? mf_penalty_walked(drafts, k, lr % (k + 1)) : 0, known);
        }
    });
}

}  // namespace mf::host
