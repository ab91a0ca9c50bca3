// The masked argmax on the CPU. The portable path is argmax_rule.h's mf_reduce_row itself. The
// AVX2 paths keep its order with integer compares only, so no floating-point mode (FTZ/DAZ set by
// some library in the process) can change an answer: each value becomes a signed key (its
// magnitude, negated for a negative sign, so -0.0 == +0.0), NaN the lowest key of a candidate and
// an id the bitmask disallows lower still. float32 runs in one pass (per lane, the greatest key and
// where it was first seen); the 16-bit types find the greatest key, then its first candidate.
#include <atomic>
#include <climits>
#include <cstring>
#include <vector>

#include "kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/select_rule.h"
#include "metrale_feed/verify_rule.h"
#include "queue.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MF_X86 1
#endif

namespace mf::host {

#ifdef MF_X86
IeeeFpGuard::IeeeFpGuard() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }  // FTZ | DAZ
IeeeFpGuard::~IeeeFpGuard() { _mm_setcsr(saved); }
#else
IeeeFpGuard::IeeeFpGuard() : saved(0) {}
IeeeFpGuard::~IeeeFpGuard() {}
#endif

namespace {

#ifdef MF_X86
// The bitmask bits of ids [i, i + 32) (fewer at the row's end), lowest id in bit 0; all set when
// the row has no bitmask. `words` bounds the reads to the row's own words.
inline uint32_t bits_from(const uint32_t *bits, uint32_t words, uint32_t i) {
    if (!bits) return 0xFFFFFFFFu;
    const uint32_t w = i >> 5, sh = i & 31u;
    uint64_t window = bits[w];
    if (w + 1 < words) window |= (uint64_t)bits[w + 1] << 32;
    return (uint32_t)(window >> sh);
}

// Lanes whose bit in `b` (one per lane, lane 0 in bit 0) is clear.
__attribute__((target("avx2"))) inline __m256i disallowed32(uint32_t b) {
    const __m256i pick = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)b), pick), _mm256_setzero_si256());
}
__attribute__((target("avx2"))) inline __m256i disallowed16(uint32_t b) {
    const __m256i pick = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                           8192, 16384, (short)0x8000);
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)b), pick), _mm256_setzero_si256());
}

constexpr int32_t kOut32 = INT32_MIN, kNan32 = INT32_MIN + 1;  // disallowed < NaN < -inf

inline int32_t skey32(uint32_t bits) {
    uint32_t mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return kNan32;
    return (bits >> 31) ? -(int32_t)mag : (int32_t)mag;
}

// The greatest signed key of [lo, hi) and the lowest id holding it (key kOut32: no candidate).
struct Best32 {
    int32_t key;
    uint32_t id;
};

// Per lane, the greatest key so far and where it was first seen (a strict '>' keeps the first).
struct LaneBest {
    __m256i k0, k1, i0, i1;
};

// Offers the 16 ids at p[0..16) (ids at..at+15); `allowed` holds their bitmask bits (bit j: id
// at + j). Most blocks cannot raise any lane's best: their raw signed keys (NaN still high)
// are checked first, and only a block that might is keyed fully (NaN low, disallowed lowest).
__attribute__((target("avx2"))) inline void offer16(LaneBest &lb, const uint32_t *p, uint32_t at,
                                                   uint32_t allowed) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i b0 = _mm256_loadu_si256((const __m256i *)p), b1 = _mm256_loadu_si256((const __m256i *)(p + 8));
    __m256i m0 = _mm256_and_si256(b0, mag_mask), m1 = _mm256_and_si256(b1, mag_mask);
    __m256i r0 = _mm256_sign_epi32(m0, b0), r1 = _mm256_sign_epi32(m1, b1);
    __m256i up = _mm256_or_si256(_mm256_cmpgt_epi32(r0, lb.k0), _mm256_cmpgt_epi32(r1, lb.k1));
    if (_mm256_testz_si256(up, up)) return;
    const __m256i inf = _mm256_set1_epi32(0x7F800000), nan_key = _mm256_set1_epi32(kNan32);
    __m256i x0 = _mm256_blendv_epi8(r0, nan_key, _mm256_cmpgt_epi32(m0, inf));
    __m256i x1 = _mm256_blendv_epi8(r1, nan_key, _mm256_cmpgt_epi32(m1, inf));
    if (allowed != 0xFFFFu) {  // a disallowed id's key: below every candidate's
        const __m256i pick = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128), zero = _mm256_setzero_si256();
        const __m256i out_key = _mm256_set1_epi32(kOut32);
        __m256i d0 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(allowed & 0xFFu)), pick), zero);
        __m256i d1 = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(allowed >> 8)), pick), zero);
        x0 = _mm256_blendv_epi8(x0, out_key, d0);
        x1 = _mm256_blendv_epi8(x1, out_key, d1);
    }
    const __m256i at0 = _mm256_add_epi32(_mm256_set1_epi32((int)at), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i at1 = _mm256_add_epi32(at0, _mm256_set1_epi32(8));
    __m256i up0 = _mm256_cmpgt_epi32(x0, lb.k0), up1 = _mm256_cmpgt_epi32(x1, lb.k1);
    lb.k0 = _mm256_max_epi32(x0, lb.k0);
    lb.k1 = _mm256_max_epi32(x1, lb.k1);
    lb.i0 = _mm256_blendv_epi8(lb.i0, at0, up0);
    lb.i1 = _mm256_blendv_epi8(lb.i1, at1, up1);
}

// With a bitmask the scan walks whole 32-id words: one word load per 32 ids, and a word of zeros
// skips its logits entirely (grammar masks are mostly such words).
// floor: only keys above it count (a scan continued past ids whose best key it is: an id of
// that key here is a later one, so it loses). Returns {floor, UINT32_MAX} when none is above.
__attribute__((target("avx2"))) Best32 best_f32(const uint32_t *p, uint32_t lo, uint32_t hi,
                                                const uint32_t *bits, uint32_t words, int32_t floor = kOut32) {
    (void)words;
    const __m256i start_key = _mm256_set1_epi32(floor), no_id = _mm256_set1_epi32(-1);
    LaneBest lb{start_key, start_key, no_id, no_id};  // a lane never raised loses every tie
    Best32 best{floor, UINT32_MAX};
    uint32_t i = lo;
    if (!bits) {
        for (; i + 16 <= hi; i += 16) offer16(lb, p + i, i, 0xFFFFu);
    } else {
        for (; i < hi && (i & 31u); ++i)  // scalar up to a word boundary
            if (mf_bit_allowed(bits, i) && skey32(p[i]) > best.key) best = Best32{skey32(p[i]), i};
        for (; i + 32 <= hi; i += 32) {
            const uint32_t w = bits[i >> 5];
            if (w == 0u) continue;
            offer16(lb, p + i, i, w & 0xFFFFu);
            offer16(lb, p + i + 16, i + 16, w >> 16);
        }
    }
    alignas(32) int32_t keys[16];
    alignas(32) uint32_t ids[16];
    _mm256_store_si256((__m256i *)keys, lb.k0);
    _mm256_store_si256((__m256i *)(keys + 8), lb.k1);
    _mm256_store_si256((__m256i *)ids, lb.i0);
    _mm256_store_si256((__m256i *)(ids + 8), lb.i1);
    // The scalar head (ids below every lane's) wins ties against the lanes.
    for (int lane = 0; lane < 16; ++lane)
        if (keys[lane] > best.key || (keys[lane] == best.key && keys[lane] != kOut32 && ids[lane] < best.id))
            best = Best32{keys[lane], ids[lane]};
    for (; i < hi; ++i) {
        if (!mf_bit_allowed(bits, i)) continue;
        int32_t k = skey32(p[i]);
        if (k > best.key) best = Best32{k, i};
    }
    return best;
}

// 16-bit keys: magnitude negated for a negative sign; NaN above the disallowed marker.
constexpr int16_t kOut16 = INT16_MIN, kNan16 = INT16_MIN + 1;

inline int32_t skey16(uint16_t b, uint16_t inf) {
    uint16_t mag = b & 0x7FFFu;
    if (mag > inf) return kNan16;
    return (b >> 15) ? -(int32_t)mag : (int32_t)mag;
}

__attribute__((target("avx2"))) inline __m256i keys16(__m256i b, __m256i inf) {
    const __m256i mag_mask = _mm256_set1_epi16(0x7FFF), nan_key = _mm256_set1_epi16(kNan16);
    __m256i m = _mm256_and_si256(b, mag_mask);
    return _mm256_blendv_epi8(_mm256_sign_epi16(m, b), nan_key, _mm256_cmpgt_epi16(m, inf));
}

__attribute__((target("avx2"))) int32_t max_key_h(const uint16_t *p, uint32_t lo, uint32_t hi,
                                                  uint16_t inf_bits, const uint32_t *bits,
                                                  uint32_t words) {
    const __m256i inf = _mm256_set1_epi16((short)inf_bits), out_key = _mm256_set1_epi16(kOut16);
    __m256i best0 = out_key, best1 = out_key;
    uint32_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        __m256i x0 = keys16(_mm256_loadu_si256((const __m256i *)(p + i)), inf);
        __m256i x1 = keys16(_mm256_loadu_si256((const __m256i *)(p + i + 16)), inf);
        if (bits) {
            uint32_t b = bits_from(bits, words, i);
            x0 = _mm256_blendv_epi8(x0, out_key, disallowed16(b & 0xFFFFu));
            x1 = _mm256_blendv_epi8(x1, out_key, disallowed16(b >> 16));
        }
        best0 = _mm256_max_epi16(best0, x0);
        best1 = _mm256_max_epi16(best1, x1);
    }
    alignas(32) int16_t lanes[16];
    _mm256_store_si256((__m256i *)lanes, _mm256_max_epi16(best0, best1));
    int32_t result = kOut16;
    for (int16_t lane : lanes) result = lane > result ? lane : result;
    for (; i < hi; ++i)
        if (mf_bit_allowed(bits, i)) {
            int32_t key = skey16(p[i], inf_bits);
            result = key > result ? key : result;
        }
    return result;
}

// First allowed id in [lo, hi) whose signed 16-bit key equals `key` (> kOut16), or hi.
__attribute__((target("avx2"))) uint32_t find_key_h(const uint16_t *p, uint32_t lo, uint32_t hi,
                                                    int32_t key, uint16_t inf_bits,
                                                    const uint32_t *bits, uint32_t words) {
    const __m256i inf = _mm256_set1_epi16((short)inf_bits), want = _mm256_set1_epi16((short)key);
    const __m256i out_key = _mm256_set1_epi16(kOut16);
    uint32_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256i k = keys16(_mm256_loadu_si256((const __m256i *)(p + i)), inf);
        if (bits) k = _mm256_blendv_epi8(k, out_key, disallowed16(bits_from(bits, words, i) & 0xFFFFu));
        // Two mask bits per 16-bit lane.
        unsigned hits = (unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi16(k, want));
        if (hits) return i + (uint32_t)__builtin_ctz(hits) / 2;
    }
    for (; i < hi; ++i)
        if (mf_bit_allowed(bits, i) && skey16(p[i], inf_bits) == key) return i;
    return hi;
}

__attribute__((target("avx2"))) uint32_t argmax_row_avx2(const void *row, mf_dtype dtype,
                                                         uint32_t vocab, const mf_row_rule *rule) {
    mf_spans spans = mf_candidate_spans(vocab, rule->m0, rule->m1);
    const uint32_t words = mf_bitmask_words(vocab);
    if (dtype == MF_DTYPE_F32) {
        const uint32_t *p = (const uint32_t *)row;
        Best32 best{kOut32, UINT32_MAX};
        for (uint32_t s = 0; s < spans.count; ++s) {  // spans ascend: '>' keeps the lowest id
            Best32 span = best_f32(p, spans.lo[s], spans.hi[s], rule->bits, words);
            if (span.key > best.key) best = span;
        }
        return best.key == kOut32 ? MF_NO_TOKEN : best.id;
    }
    const uint16_t *p = (const uint16_t *)row;
    const uint16_t inf = dtype == MF_DTYPE_F16 ? 0x7C00 : 0x7F80;
    int32_t best = kOut16;
    for (uint32_t s = 0; s < spans.count; ++s) {
        int32_t span_best = max_key_h(p, spans.lo[s], spans.hi[s], inf, rule->bits, words);
        best = span_best > best ? span_best : best;
    }
    if (best == kOut16) return MF_NO_TOKEN;
    for (uint32_t s = 0; s < spans.count; ++s) {
        uint32_t found = find_key_h(p, spans.lo[s], spans.hi[s], best, inf, rule->bits, words);
        if (found < spans.hi[s]) return found;
    }
    return MF_NO_TOKEN;  // unreachable: the greatest key belongs to some candidate
}
#endif

using RowFn = uint32_t (*)(const void *, mf_dtype, uint32_t, const mf_row_rule *);

RowFn pick_row_fn() {
#ifdef MF_X86
    if (__builtin_cpu_supports("avx2")) return argmax_row_avx2;
#endif
    return argmax_row_portable;
}

const RowFn g_best_fn = pick_row_fn();
std::atomic<RowFn> g_row_fn{g_best_fn};

}  // namespace

bool use_portable_argmax(bool portable) {
    g_row_fn.store(portable ? argmax_row_portable : g_best_fn, std::memory_order_relaxed);
    return g_best_fn != argmax_row_portable;  // whether a vector path exists at all
}

uint32_t argmax_row_portable(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule) {
    return mf_unpack_id(mf_reduce_row(row, (int)dtype, 0, vocab, rule));
}

uint32_t argmax_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule) {
    return g_row_fn.load(std::memory_order_relaxed)(row, dtype, vocab, rule);
}

bool vector_paths() { return g_row_fn.load(std::memory_order_relaxed) != argmax_row_portable; }

uint64_t argmax_f32_above(const uint32_t *row, uint32_t vocab, const mf_row_rule *rule, uint32_t lo, uint32_t hi,
                          uint64_t best) {
#ifdef MF_X86
    if (g_row_fn.load(std::memory_order_relaxed) == argmax_row_avx2) {
        // The packed key as best_f32's signed one (mf_key_f32: sign +- magnitude; 0 a NaN).
        const uint32_t key = (uint32_t)(best >> 32);
        const int32_t floor = !best ? kOut32 : key == 0u ? kNan32 : (int32_t)(key - 0x80000000u);
        const mf_spans spans = mf_candidate_spans(vocab, rule->m0, rule->m1);
        Best32 b{floor, UINT32_MAX};
        for (uint32_t s = 0; s < spans.count; ++s) {  // spans ascend: '>' keeps the lowest id
            const uint32_t l = spans.lo[s] > lo ? spans.lo[s] : lo, h = spans.hi[s] < hi ? spans.hi[s] : hi;
            if (l >= h) continue;
            const Best32 span = best_f32(row, l, h, rule->bits, mf_bitmask_words(vocab), b.key);
            if (span.key > b.key) b = span;
        }
        return b.key > floor ? mf_pack(mf_key_f32(row[b.id]), b.id) : best;
    }
#endif
    return mf_pack_max(best, mf_reduce_row(row, MF_DTYPE_F32, lo, hi, rule));
}

const char *argmax_isa() {
    return g_row_fn.load(std::memory_order_relaxed) == argmax_row_portable ? "portable" : "avx2";
}

// The rule of a slice [start, start + width) of a row whose masks hold global ids and whose
// bitmask is the whole row's: mask ids shift down (those outside wrap past the width and mask
// nothing), and the bitmask words are realigned to the slice's first id in `local`.
static mf_row_rule slice_rule(uint32_t m0, uint32_t m1, const uint32_t *row_bits, uint32_t total_words,
                       uint32_t start, uint32_t width, std::vector<uint32_t> &local) {
    mf_row_rule rule{m0 - start, m1 - start, nullptr};
    if (!row_bits) return rule;
    if (start % 32u == 0u) {
        rule.bits = row_bits + start / 32u;
        return rule;
    }
    const uint32_t words = mf_bitmask_words(width), w0 = start / 32u, sh = start % 32u;
    local.resize(words + 1);
    for (uint32_t j = 0; j < words; ++j) {
        const uint32_t lo = row_bits[w0 + j], hi = w0 + j + 1 < total_words ? row_bits[w0 + j + 1] : 0u;
        local[j] = (lo >> sh) | (hi << (32u - sh));
    }
    rule.bits = local.data();
    return rule;
}

// Row r's list scratch of a select stage (NULL: none).
static uint32_t *list_of(const mf_argmax_args &a, uint32_t r) {
    return a.select_list ? a.select_list + (size_t)r * a.select_list_cap : nullptr;
}

void run_argmax(const ArgmaxJob &job) {
    const mf_argmax_args &a = job.args;
    const size_t row_bytes = (size_t)a.row_stride * (a.dtype == MF_DTYPE_F32 ? 4 : 2);
    const bool partial = a.flags & MF_ARGS_PARTIAL;
    const bool partial_stats = a.flags & MF_ARGS_PARTIAL_LOGPROBS;  // else the records' (m, s) are 0
    const uint32_t start = partial ? a.start : 0u, total = partial ? a.vocab_total : a.vocab;
    const size_t words = mf_bitmask_words(total);
    const uint32_t *masks = job.mask_words();
    const mf_sampling_params *params = job.row_params();
    RowFn row_fn = g_row_fn.load(std::memory_order_relaxed);
    const bool vector = row_fn != argmax_row_portable;
    mf_partial_record *records = nullptr;
    const uint32_t stage = (a.flags & MF_ARGS_SELECT) ? a.select_stage : 0u;
    if (partial) {  // the block's header first: what the combine checks
        const mf_partial_header h = mf_partial_call_header(&a, params != nullptr);
        std::memcpy(a.partials, &h, sizeof h);
        records = (mf_partial_record *)a.partials + MF_PARTIAL_HEADER_RECORDS;
    }
    const mf_penalty_args *pen = job.penalties ? &job.penalties->args : nullptr;  // NULL: none
    const uint32_t *pen_slots = job.penalties ? job.penalties->slot_words() : nullptr;
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard ieee;  // on each pool thread: the sampler's arithmetic needs subnormals
        std::vector<uint32_t> local_bits;
        for (uint32_t r = begin; r < end; ++r) {
            if (pen && pen_slots[r] < pen->slot_count) apply_penalties_row(*pen, r, pen_slots[r]);
            const uint32_t *row_bits = a.bitmask ? a.bitmask + r * words : nullptr;
            const mf_row_rule rule = slice_rule(masks[2 * r], masks[2 * r + 1], row_bits, (uint32_t)words,
                                                start, a.vocab, local_bits);
            const void *row = (const char *)a.logits + r * row_bytes;
            // A temperature that is not finite and > 0 (only device-resident params can hold
            // one) is greedy, as 0 is.
            const bool sampled = params && params[r].temperature > 0.0f && params[r].temperature <= 3.4e38f;
            if (stage == MF_SELECT_CANDS) {  // select_cands_cap candidates a row instead of a record
                mf_partial_cand *out = (mf_partial_cand *)records + (size_t)r * a.select_cands_cap;
                if (sampled && a.vocab && (a.select[r].flags & MF_SELECT_ROW_CANDS))
                    cands_row(row, a.dtype, a.vocab, &rule, params[r], vector, start, out, a.select_cands_cap);
                else
                    for (uint32_t j = 0; j < a.select_cands_cap; ++j) out[j] = mf_partial_cand{MF_NO_TOKEN, 0u};
                continue;
            }
            const CandsView cands{
                a.select_cands ? (const char *)a.select_cands + MF_PARTIAL_HEADER_BYTES +
                                     (size_t)r * a.select_cands_cap * MF_PARTIAL_CAND_BYTES
                               : nullptr,
                a.select_cands_stride, a.select_cands_world, a.select_cands_cap};
            if (stage == MF_SELECT_HIST) {  // MF_SELECT_BINS weights a row instead of a record
                uint64_t *bins = (uint64_t *)records + (size_t)r * MF_SELECT_BINS;
                for (uint32_t d = 0; d < MF_SELECT_BINS; ++d) bins[d] = 0;
                if (sampled && a.vocab)
                    select_row(row, a.dtype, a.vocab, &rule, params[r], vector, start, stage, a.select[r], bins,
                               list_of(a, r), a.select_list_cap, cands);
                continue;
            }
            // A sampled verify's RACE (select_drafts): the race without the position's draft, and
            // the slice's survivors' mass in the record's last 8 bytes (verify_rule.h).
            const bool verify_race = stage == MF_SELECT_RACE && a.select_drafts;
            uint64_t mass = 0;
            uint32_t id = a.vocab == 0   ? MF_NO_TOKEN
                          : !sampled     ? (stage == MF_SELECT_TOP ? MF_NO_TOKEN : row_fn(row, a.dtype, a.vocab, &rule))
                          : verify_race  ? verify_race_row(row, a.dtype, a.vocab, &rule, params[r], vector, start,
                                                           a.select[r], list_of(a, r), a.select_list_cap, cands,
                                                           mf_verify_draft_at(a.select_drafts, a.select_k, r), &mass)
                          : stage        ? select_row(row, a.dtype, a.vocab, &rule, params[r], vector, start, stage,
                                                      a.select[r], nullptr, list_of(a, r), a.select_list_cap, cands)
                                         : sample_row(row, a.dtype, a.vocab, &rule, params[r], vector, start);
            if (stage == MF_SELECT_TOP) {  // the candidate, a verify's draft bits, the params' digest (select_rule.h)
                records[r] = mf_partial_record{id == MF_NO_TOKEN ? MF_NO_TOKEN : start + id,
                                               id == MF_NO_TOKEN ? 0u : mf_logit_bits(row, (int)a.dtype, id),
                                               0.0f, 0.0f};
                const uint32_t draft = mf_verify_local_draft(a.select_drafts, a.select_k, r, start);
                uint32_t draft_bits = MF_VERIFY_NO_BITS, bits;
                if (draft < a.vocab && mf_candidate(row, (int)a.dtype, &rule, draft, &bits))
                    draft_bits = bits;  // a finite candidate of this slice
                const uint32_t free_words[2] = {draft_bits, mf_params_digest(&params[r])};
                std::memcpy(&records[r].max, free_words, 8);
                continue;
            }
            if (!partial) {
                a.cells[r] = id;
                if (a.logprobs) {
                    const RowStats st = row_stats(row, a.dtype, a.vocab, vector);
                    const uint32_t bits = id == MF_NO_TOKEN ? 0u : mf_logit_bits(row, (int)a.dtype, id);
                    a.logprobs[r] = mf_logprob_finish(id, bits, st.m, st.s);
                }
                continue;
            }
            const RowStats st = partial_stats ? row_stats(row, a.dtype, a.vocab, vector) : RowStats{0.0f, 0.0};
            records[r] = mf_partial_record{id == MF_NO_TOKEN ? MF_NO_TOKEN : start + id,
                                           id == MF_NO_TOKEN ? 0u : mf_logit_bits(row, (int)a.dtype, id),
                                           st.m, (float)st.s};
            if (verify_race) mf_verify_set_mass_word(&records[r], mass);  // no logprobs there (feed.h)
        }
    });
    if (pen) {  // the update, with this pick's ids
        mf_penalty_args update = *pen;
        update.ids = a.cells;
        count_penalties(update, pen_slots);
    }
}

void run_resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                 uint32_t *out) {
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t s = sources[i];
        out[i] = (s & MF_FEED_HOST_BIT) ? (s & ~MF_FEED_HOST_BIT) : s < prev_rows ? cells[s] : MF_NO_TOKEN;
    }
}

}  // namespace mf::host
