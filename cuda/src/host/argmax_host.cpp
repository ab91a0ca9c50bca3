// The masked argmax on the CPU. The portable path is argmax_rule.h's packed-key maximum, element
// by element. The AVX2 path keeps the same order: float32 in one pass with IEEE compares (which
// skip NaN); the 16-bit types as argmax_rule.h's keys, signed (key - 0x8000), sixteen at a time,
// the greatest key first, then the first candidate holding it in a pass over the cached row.
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
// float32 in one pass: per lane, the greatest value so far and where it was first seen. A strict
// IEEE '>' never takes NaN and keeps the first of equal values (-0.0 == +0.0), so across lanes
// the answer is the greatest value at its lowest id. No lane above -inf means every candidate is
// -inf or NaN: the caller then takes the first -inf, else the lowest candidate.
struct F32Best {
    float value;
    uint32_t id;  // UINT32_MAX: nothing above -inf in the span
};

__attribute__((target("avx2"))) F32Best best_f32(const float *p, uint32_t lo, uint32_t hi) {
    const __m256 floor = _mm256_set1_ps(-__builtin_inff());
    const __m256i step = _mm256_set1_epi32(16), none = _mm256_set1_epi32(-1);
    __m256 v0 = floor, v1 = floor;
    __m256i i0 = none, i1 = none;
    __m256i at0 = _mm256_add_epi32(_mm256_set1_epi32((int)lo), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i at1 = _mm256_add_epi32(at0, _mm256_set1_epi32(8));
    uint32_t i = lo;
    for (; i + 16 <= hi; i += 16) {
        __m256 x0 = _mm256_loadu_ps(p + i), x1 = _mm256_loadu_ps(p + i + 8);
        __m256 up0 = _mm256_cmp_ps(x0, v0, _CMP_GT_OQ), up1 = _mm256_cmp_ps(x1, v1, _CMP_GT_OQ);
        v0 = _mm256_max_ps(x0, v0);  // = the blend on `up`: maxps keeps v for NaN and for ties
        v1 = _mm256_max_ps(x1, v1);
        i0 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i0), _mm256_castsi256_ps(at0), up0));
        i1 = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i1), _mm256_castsi256_ps(at1), up1));
        at0 = _mm256_add_epi32(at0, step);
        at1 = _mm256_add_epi32(at1, step);
    }
    alignas(32) float values[16];
    alignas(32) uint32_t ids[16];
    _mm256_store_ps(values, v0);
    _mm256_store_ps(values + 8, v1);
    _mm256_store_si256((__m256i *)ids, i0);
    _mm256_store_si256((__m256i *)(ids + 8), i1);
    F32Best best{-__builtin_inff(), UINT32_MAX};
    for (int lane = 0; lane < 16; ++lane)
        if (ids[lane] != UINT32_MAX &&
            (values[lane] > best.value || (values[lane] == best.value && ids[lane] < best.id)))
            best = F32Best{values[lane], ids[lane]};
    for (; i < hi; ++i)
        if (p[i] > best.value) best = F32Best{p[i], i};
    return best;
}

__attribute__((target("avx2"))) int32_t max_key_h(const uint16_t *p, uint32_t lo, uint32_t hi,
                                                  uint16_t inf_bits, bool is_f16) {
    const __m256i mag_mask = _mm256_set1_epi16(0x7FFF), inf = _mm256_set1_epi16((short)inf_bits);
    const __m256i lowest = _mm256_set1_epi16(INT16_MIN);
    __m256i best0 = lowest, best1 = lowest;
    uint32_t i = lo;
    for (; i + 32 <= hi; i += 32) {
        __m256i b0 = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i b1 = _mm256_loadu_si256((const __m256i *)(p + i + 16));
        __m256i m0 = _mm256_and_si256(b0, mag_mask), m1 = _mm256_and_si256(b1, mag_mask);
        best0 = _mm256_max_epi16(best0, _mm256_blendv_epi8(_mm256_sign_epi16(m0, b0), lowest,
                                                           _mm256_cmpgt_epi16(m0, inf)));
        best1 = _mm256_max_epi16(best1, _mm256_blendv_epi8(_mm256_sign_epi16(m1, b1), lowest,
                                                           _mm256_cmpgt_epi16(m1, inf)));
    }
    for (; i + 16 <= hi; i += 16) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + i));
        __m256i m = _mm256_and_si256(b, mag_mask);
        best0 = _mm256_max_epi16(best0, _mm256_blendv_epi8(_mm256_sign_epi16(m, b), lowest,
                                                           _mm256_cmpgt_epi16(m, inf)));
    }
    alignas(32) int16_t lanes[16];
    _mm256_store_si256((__m256i *)lanes, _mm256_max_epi16(best0, best1));
    int32_t result = INT32_MIN;
    for (int16_t lane : lanes) result = lane > result ? lane : result;
    for (; i < hi; ++i) {
        int32_t key = (int32_t)(is_f16 ? mf_key_f16(p[i]) : mf_key_bf16(p[i])) - 0x8000;
        result = key > result ? key : result;
    }
    return result;
}

// First id in [lo, hi) whose signed 16-bit key equals `key`, or hi.
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
    if (dtype == MF_DTYPE_F32) {
        const float *p = (const float *)row;
        F32Best best{-__builtin_inff(), UINT32_MAX};
        for (uint32_t s = 0; s < spans.count; ++s) {  // spans ascend: '>' keeps the lowest id
            F32Best span = best_f32(p, spans.lo[s], spans.hi[s]);
            if (span.id != UINT32_MAX && span.value > best.value) best = span;
        }
        if (best.id != UINT32_MAX) return best.id;
        for (uint32_t s = 0; s < spans.count; ++s)  // all -inf or NaN: the first -inf wins
            for (uint32_t i = spans.lo[s]; i < spans.hi[s]; ++i)
                if (p[i] == -__builtin_inff()) return i;
        return spans.lo[0];  // all NaN: the lowest candidate
    }
    const uint16_t *p = (const uint16_t *)row;
    const uint16_t inf = dtype == MF_DTYPE_F16 ? 0x7C00 : 0x7F80;
    const bool is_f16 = dtype == MF_DTYPE_F16;
    int32_t best = INT32_MIN;
    for (uint32_t s = 0; s < spans.count; ++s) {
        int32_t span_best = max_key_h(p, spans.lo[s], spans.hi[s], inf, is_f16);
        best = span_best > best ? span_best : best;
    }
    for (uint32_t s = 0; s < spans.count; ++s) {
        uint32_t found = find_key_h(p, spans.lo[s], spans.hi[s], best, inf, is_f16);
        if (found < spans.hi[s]) return found;
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
