// Masked argmax into the feed cells: cells[r] = the rule of argmax_rule.h over row r.
//
// Many rows: one block per row. Few rows (rows < 2 * SM count): each row is split across several
// blocks; each writes a packed partial to per-stream scratch and the last block to arrive (an
// atomic counter per row) combines them and resets the counter, so no memset between calls.
// Host masks travel by value in the kernel parameters (no staging copy, no host sync, capturable);
// device-resident masks and the bitmask are read by the kernel when it runs.
#include <algorithm>

#include "cuda/block.cuh"
#include "cuda/kernels.hpp"
#include "metrale_feed/argmax_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread per iteration
constexpr uint32_t kChunkAlign = 64;

// The masks of one launch; the tiers keep small launches' parameter blocks small.
template <int MaxRows>
struct RowMasks {
    uint32_t ids[2 * MaxRows];
};

// Element traits: the raw bits type and its ordered key.
struct F32 {
    using T = uint32_t;
    __device__ static uint32_t key(uint32_t bits) { return mf_key_f32(bits); }
};
struct F16 {
    using T = uint16_t;
    __device__ static uint32_t key(uint32_t bits) { return mf_key_f16((uint16_t)bits); }
};
struct BF16 {
    using T = uint16_t;
    __device__ static uint32_t key(uint32_t bits) { return mf_key_bf16((uint16_t)bits); }
};

// A thread's best candidate. Each thread visits its ids in increasing order, so a strict `>` on
// the key alone keeps the lowest id of a tie; key1 = key + 1 so that 0 means "no candidate yet"
// (keys are at most 0xFF800000). pack() gives exactly mf_pack(key, id), or 0 for none.
struct Best {
    uint32_t key1 = 0u;
    uint32_t id = 0u;
    __device__ void offer(uint32_t key, uint32_t i) {
        if (key + 1u > key1) { key1 = key + 1u; id = i; }
    }
    __device__ unsigned long long pack() const {
        return key1 ? (unsigned long long)mf_pack(key1 - 1u, id) : 0ull;
    }
};

// One 16-byte vector starting at id `base`; lower ids sit in lower bytes (little-endian).
// `bits`: the row's bitmask words or nullptr, where local id i is bit `bit0 + i` (bit0: a slice's
// first global id); an id it disallows is never offered.
template <class E>
__device__ __forceinline__ void offer_vec(Best &b, uint4 v, uint32_t base, const uint32_t *bits,
                                          uint32_t bit0) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    if (sizeof(typename E::T) == 4) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (mf_bit_allowed(bits, bit0 + base + j)) b.offer(E::key(w[j]), base + j);
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (mf_bit_allowed(bits, bit0 + base + 2 * j)) b.offer(E::key(w[j] & 0xFFFFu), base + 2 * j);
            if (mf_bit_allowed(bits, bit0 + base + 2 * j + 1)) b.offer(E::key(w[j] >> 16), base + 2 * j + 1);
        }
    }
}

// Scans ids [lo, hi) of `row` with the whole block: a scalar head up to the first 16-byte
// boundary, 16-byte vector loads, then a scalar tail. Works for any element-aligned row start.
template <class E>
__device__ void scan_range(const typename E::T *__restrict__ row, uint32_t lo, uint32_t hi,
                           const uint32_t *bits, uint32_t bit0, Best &b) {
    using T = typename E::T;
    constexpr uint32_t V = 16 / sizeof(T);
    if (lo >= hi) return;
    const uint32_t t = threadIdx.x, B = blockDim.x;
    uint32_t head = (uint32_t)((16u - ((uintptr_t)(row + lo) & 15u)) & 15u) / sizeof(T);
    head = min(head, hi - lo);
    if (t < head && mf_bit_allowed(bits, bit0 + lo + t)) b.offer(E::key(__ldg(row + lo + t)), lo + t);

    const uint32_t vlo = lo + head, nvec = (hi - vlo) / V;
    const uint4 *vp = reinterpret_cast<const uint4 *>(row + vlo);
    uint32_t i = t;
    for (; i + (kUnroll - 1) * B < nvec; i += kUnroll * B) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = __ldg(vp + i + u * B);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) offer_vec<E>(b, v[u], vlo + (i + u * B) * V, bits, bit0);
    }
    for (; i < nvec; i += B) offer_vec<E>(b, __ldg(vp + i), vlo + i * V, bits, bit0);

    const uint32_t tail = vlo + nvec * V;
    if (tail + t < hi && mf_bit_allowed(bits, bit0 + tail + t)) b.offer(E::key(__ldg(row + tail + t)), tail + t);
}

// The greatest packed word of the block (every thread gets it).
__device__ unsigned long long block_max(unsigned long long v) {
    __shared__ unsigned long long warp_best[kMaxThreads / 32];
    return block_fold(v, MaxPacked(), warp_best);
}

// grid = (splits, rows of this launch). Block x scans ids [x * chunk, (x + 1) * chunk). A slice
// of a split row (id_base > 0 or a partial call) has global mask ids and bitmask; its local id
// goes to cells[r * cell_stride] (a partial record's id field), made global by the stats kernel.
template <class E, int MaxRows>
__global__ void __launch_bounds__(kMaxThreads)
    mf_argmax_kernel(const typename E::T *__restrict__ logits, uint64_t row_stride,
                     uint32_t vocab, uint32_t chunk, uint32_t *__restrict__ cells,
                     unsigned long long *partials, unsigned int *counters,
                     const uint32_t *device_masks, const uint32_t *bitmask, uint32_t id_base,
                     uint32_t cell_stride, uint32_t bit_words,
                     const __grid_constant__ RowMasks<MaxRows> masks) {
    const uint32_t r = blockIdx.y, splits = gridDim.x;
    const typename E::T *row = logits + (uint64_t)r * row_stride;
    const uint32_t *m = device_masks ? device_masks + 2 * r : masks.ids + 2 * r;
    const mf_spans s = mf_candidate_spans(vocab, m[0] - id_base, m[1] - id_base);  // outside: wraps past vocab
    const uint32_t *bits = bitmask ? bitmask + (uint64_t)r * bit_words : nullptr;
    const uint32_t lo = blockIdx.x * chunk, hi = min(lo + chunk, vocab);

    Best b;
    for (uint32_t k = 0; k < s.count; ++k)
        scan_range<E>(row, max(lo, s.lo[k]), min(hi, s.hi[k]), bits, id_base, b);
    unsigned long long best = block_max(b.pack());
    if (splits == 1) {
        if (threadIdx.x == 0) cells[(uint64_t)r * cell_stride] = mf_unpack_id(best);
        return;
    }

    __shared__ bool last;
    if (threadIdx.x == 0) {
        partials[(uint64_t)r * splits + blockIdx.x] = best;
        __threadfence();  // publish the partial before counting in
        last = atomicAdd(&counters[r], 1u) == splits - 1u;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other blocks' partials, read below through L2 (__ldcg)
    unsigned long long v = 0ull;
    for (uint32_t i = threadIdx.x; i < splits; i += blockDim.x)
        v = mf_pack_max(v, __ldcg(&partials[(uint64_t)r * splits + i]));
    v = block_max(v);
    if (threadIdx.x == 0) {
        cells[(uint64_t)r * cell_stride] = mf_unpack_id(v);
        counters[r] = 0u;  // ready for the next launch on this stream
    }
}

uint32_t div_up(uint64_t a, uint64_t b) { return (uint32_t)((a + b - 1) / b); }

template <class E, int MaxRows>
cudaError_t launch_tier(const mf_argmax_args &a, const ArgmaxPlan &p, const ArgmaxScratch &s,
                        uint32_t row0, uint32_t n, cudaStream_t stream) {
    RowMasks<MaxRows> m;
    const bool on_device = a.flags & MF_ARGS_MASKS_DEVICE;
    if (!on_device)
        for (uint32_t i = 0; i < 2 * n; ++i) m.ids[i] = a.masks[2 * (uint64_t)row0 + i];
    const auto *logits = static_cast<const typename E::T *>(a.logits) + row0 * a.row_stride;
    const uint32_t *dmasks = on_device ? a.masks + 2 * (uint64_t)row0 : nullptr;
    const IdSink sink = id_sink(a);
    const uint32_t words = mf_bitmask_words(sink.total);
    const uint32_t *bits = a.bitmask ? a.bitmask + (uint64_t)row0 * words : nullptr;
    MF_LAUNCH(dim3(p.splits, n), p.threads, 0, stream, mf_argmax_kernel<E, MaxRows>)(
        logits, a.row_stride, a.vocab, p.chunk, sink.ids + (uint64_t)row0 * sink.stride, s.partials,
        s.counters, dmasks, bits, sink.base, sink.stride, words, m);
    return cudaGetLastError();
}

template <class E>
cudaError_t launch_dtype(const mf_argmax_args &a, const ArgmaxPlan &p, const ArgmaxScratch &s,
                         cudaStream_t stream) {
    for (uint32_t row0 = 0; row0 < a.rows; row0 += kArgmaxRowsPerLaunch) {
        const uint32_t n = std::min(a.rows - row0, kArgmaxRowsPerLaunch);
        // Device-resident masks need no parameter space: the smallest tier.
        cudaError_t e = n <= 32 || (a.flags & MF_ARGS_MASKS_DEVICE)
                               ? launch_tier<E, 32>(a, p, s, row0, n, stream)
                        : n <= 256 ? launch_tier<E, 256>(a, p, s, row0, n, stream)
                                   : launch_tier<E, kArgmaxRowsPerLaunch>(a, p, s, row0, n, stream);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

}  // namespace

ArgmaxPlan argmax_plan(uint32_t rows, uint32_t vocab, mf_dtype dtype, int sm_count) {
    const uint32_t per_vec = dtype == MF_DTYPE_F32 ? 4u : 8u;
    const uint32_t sms = sm_count > 0 ? (uint32_t)sm_count : 1u;
    if (rows < 2 * sms && rows <= kArgmaxRowsPerLaunch) {
        // Aim at ~4 blocks of 256 threads per SM, but give each block at least one full unrolled
        // iteration per thread, or the combine costs more than the split saves.
        const uint32_t threads = 256, per_iter = threads * per_vec * kUnroll;
        uint32_t splits = std::min(div_up(4ull * sms, rows), std::max(1u, vocab / per_iter));
        if (splits > 1) {
            const uint32_t chunk = div_up(div_up(vocab, splits), kChunkAlign) * kChunkAlign;
            splits = div_up(vocab, chunk);
            if (splits > 1) return ArgmaxPlan{splits, chunk, threads};
        }
    }
    // One block per row, sized so that small vocabularies do not leave most threads idle.
    const uint32_t want = div_up(std::max(vocab, 1u), per_vec * kUnroll);
    const uint32_t threads = std::min((uint32_t)kMaxThreads, div_up(want, 32) * 32);
    return ArgmaxPlan{1u, vocab, threads};
}

cudaError_t launch_argmax(const mf_argmax_args &a, const ArgmaxPlan &p, const ArgmaxScratch &s,
                          cudaStream_t stream) {
    switch (a.dtype) {
    case MF_DTYPE_F32: return launch_dtype<F32>(a, p, s, stream);
    case MF_DTYPE_F16: return launch_dtype<F16>(a, p, s, stream);
    case MF_DTYPE_BF16: return launch_dtype<BF16>(a, p, s, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace MF_KERNELS
}  // namespace mf
