// The masked argmax on the CPU. The portable path is argmax_rule.h's packed-key maximum, element
// by element; the AVX2 path computes the same keys eight or sixteen at a time (as signed integers:
// key ^ 0x80000000), finds the row's greatest key, then the first candidate holding it.
#include <atomic>
#include <cstring>

#include "kernels.hpp"
#include "metrale_feed/argmax_rule.h"
#include "queue.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MF_X86 1
#endif

namespace mf::host {
namespace {

uint32_t key_at(const void *row, mf_dtype dtype, uint32_t i) {
    if (dtype == MF_DTYPE_F32) {
        uint32_t bits;
        std::memcpy(&bits, (const char *)row + 4 * (size_t)i, 4);
        return mf_key_f32(bits);
    }
    uint16_t bits;
    std::memcpy(&bits, (const char *)row + 2 * (size_t)i, 2);
    return dtype == MF_DTYPE_F16 ? mf_key_f16(bits) : mf_key_bf16(bits);
}

#ifdef MF_X86
// Greatest signed key over [lo, hi) and, in a second pass over the (now cached) row, the first
// id that holds it: the same answer as the packed maximum, since ties go to the lowest id.
__attribute__((target("avx2"))) int32_t max_key_f32(const uint32_t *p, uint32_t lo, uint32_t hi) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i lowest = _mm256_set1_epi32(INT32_MIN);
    __m256i best0 = lowest, best1 = lowest;
    uint32_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256i b0 = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(p + i + 8));
        __m256i m0 = _mm256_and_si256(b0, mag_mask), m1 = _mm256_and_si256(b1, mag_mask);
        __m256i k0 = _mm256_blendv_epi8(_mm256_sign_epi32(m0, b0), lowest, _mm256_cmpgt_epi32(m0, inf));
        __m256i k1 = _mm256_blendv_epi8(_mm256_sign_epi32(m1, b1), lowest, _mm256_cmpgt_epi32(m1, inf));
        best0 = _mm256_max_epi32(best0, k0);
        best1 = _mm256_max_epi32(best1, k1);
    }
    alignas(32) int32_t lanes[8];
    _mm256_store_si256((__m256i *)lanes, _mm256_max_epi32(best0, best1));
    int32_t best = INT32_MIN;
    for (int32_t lane : lanes) best = lane > best ? lane : best;
    for (; i < hi; ++i) {
        int32_t key = (int32_t)(mf_key_f32(p[i]) ^ 0x80000000u);
        best = key > best ? key : best;
    }
    return best;
}

__attribute__((target("avx2"))) int32_t max_key_h(const uint16_t *p, uint32_t lo, uint32_t hi,
                                                  uint16_t inf_bits, bool is_f16) {
    const __m256i mag_mask = _mm256_set1_epi16(0x7FFF), inf = _mm256_set1_epi16((short)inf_bits);
    const __m256i lowest = _mm256_set1_epi16(INT16_MIN);
    __m256i best = lowest;
    uint32_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i m = _mm256_and_si256(b, mag_mask);
        __m256i k = _mm256_blendv_epi8(_mm256_sign_epi16(m, b), lowest, _mm256_cmpgt_epi16(m, inf));
        best = _mm256_max_epi16(best, k);
    }
    alignas(32) int16_t lanes[16];
    _mm256_store_si256((__m256i *)lanes, best);
    int32_t result = INT32_MIN;
    for (int16_t lane : lanes) result = lane > result ? lane : result;
    for (; i < hi; ++i) {
        int32_t key = (int32_t)(is_f16 ? mf_key_f16(p[i]) : mf_key_bf16(p[i])) - 0x8000;
        result = key > result ? key : result;
    }
    return result;
}

// First id in [lo, hi) whose signed key equals `key`, or hi.
__attribute__((target("avx2"))) uint32_t find_key_f32(const uint32_t *p, uint32_t lo, uint32_t hi,
                                                      int32_t key) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i lowest = _mm256_set1_epi32(INT32_MIN), want = _mm256_set1_epi32(key);
    uint32_t i = lo;
    for (; i + 8 <= hi; i += 8) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i m = _mm256_and_si256(b, mag_mask);
        __m256i k = _mm256_blendv_epi8(_mm256_sign_epi32(m, b), lowest, _mm256_cmpgt_epi32(m, inf));
        int hits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(k, want)));
        if (hits) return i + (uint32_t)__builtin_ctz((unsigned)hits);
    }
    for (; i < hi; ++i)
        if ((int32_t)(mf_key_f32(p[i]) ^ 0x80000000u) == key) return i;
    return hi;
}

__attribute__((target("avx2"))) uint32_t find_key_h(const uint16_t *p, uint32_t lo, uint32_t hi,
                                                    int32_t key, uint16_t inf_bits, bool is_f16) {
    const __m256i mag_mask = _mm256_set1_epi16(0x7FFF), inf = _mm256_set1_epi16((short)inf_bits);
    const __m256i lowest = _mm256_set1_epi16(INT16_MIN), want = _mm256_set1_epi16((short)key);
    uint32_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i m = _mm256_and_si256(b, mag_mask);
        __m256i k = _mm256_blendv_epi8(_mm256_sign_epi16(m, b), lowest, _mm256_cmpgt_epi16(m, inf));
        // Two mask bits per 16-bit lane.
        unsigned hits = (unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi16(k, want));
        if (hits) return i + (uint32_t)__builtin_ctz(hits) / 2;
    }
    for (; i < hi; ++i)
        if ((int32_t)(is_f16 ? mf_key_f16(p[i]) : mf_key_bf16(p[i])) - 0x8000 == key) return i;
    return hi;
}

__attribute__((target("avx2"))) uint32_t argmax_row_avx2(const void *row, mf_dtype dtype,
                                                         uint32_t vocab, uint32_t m0, uint32_t m1) {
    mf_spans spans = mf_candidate_spans(vocab, m0, m1);
    if (spans.count == 0) return MF_NO_TOKEN;
    int32_t best = INT32_MIN;
    for (uint32_t s = 0; s < spans.count; ++s) {
        int32_t span_best;
        if (dtype == MF_DTYPE_F32)
            span_best = max_key_f32((const uint32_t *)row, spans.lo[s], spans.hi[s]);
        else
            span_best = max_key_h((const uint16_t *)row, spans.lo[s], spans.hi[s],
                                  dtype == MF_DTYPE_F16 ? 0x7C00 : 0x7F80, dtype == MF_DTYPE_F16);
        best = span_best > best ? span_best : best;
    }
    for (uint32_t s = 0; s < spans.count; ++s) {
        uint32_t lo = spans.lo[s], hi = spans.hi[s], found;
        if (dtype == MF_DTYPE_F32)
            found = find_key_f32((const uint32_t *)row, lo, hi, best);
        else
            found = find_key_h((const uint16_t *)row, lo, hi, best,
                               dtype == MF_DTYPE_F16 ? 0x7C00 : 0x7F80, dtype == MF_DTYPE_F16);
        if (found < hi) return found;
    }
    return spans.lo[0];  // unreachable: the greatest key belongs to some candidate
}
#endif

using RowFn = uint32_t (*)(const void *, mf_dtype, uint32_t, uint32_t, uint32_t);

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

uint32_t argmax_row_portable(const void *row, mf_dtype dtype, uint32_t vocab, uint32_t m0, uint32_t m1) {
    mf_spans spans = mf_candidate_spans(vocab, m0, m1);
    uint64_t best = 0;  // unpacks to MF_NO_TOKEN when there is no candidate
    for (uint32_t s = 0; s < spans.count; ++s)
        for (uint32_t i = spans.lo[s]; i < spans.hi[s]; ++i)
            best = mf_pack_max(best, mf_pack(key_at(row, dtype, i), i));
    return mf_unpack_id(best);
}

uint32_t argmax_row(const void *row, mf_dtype dtype, uint32_t vocab, uint32_t m0, uint32_t m1) {
    return g_row_fn.load(std::memory_order_relaxed)(row, dtype, vocab, m0, m1);
}

const char *argmax_isa() {
    return g_row_fn.load(std::memory_order_relaxed) == argmax_row_portable ? "portable" : "avx2";
}

void run_argmax(const ArgmaxJob &job) {
    const mf_argmax_args &a = job.args;
    size_t row_bytes = (size_t)a.row_stride * (a.dtype == MF_DTYPE_F32 ? 4 : 2);
    RowFn row_fn = g_row_fn.load(std::memory_order_relaxed);
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        for (uint32_t r = begin; r < end; ++r)
            a.cells[r] = row_fn((const char *)a.logits + r * row_bytes, a.dtype, a.vocab,
                                  job.masks[2 * r], job.masks[2 * r + 1]);
    });
}

void run_resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t *out) {
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t s = sources[i];
        out[i] = (s & MF_FEED_HOST_BIT) ? (s & ~MF_FEED_HOST_BIT) : cells[s];
    }
}

}  // namespace mf::host
