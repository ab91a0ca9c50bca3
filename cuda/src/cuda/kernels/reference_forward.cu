// The reference model's forward (docs/router.md): per row, write the input id into the paged KV
// cache, hash the history read back through the block table, then write the row's logits.
#include "cuda/kernels.hpp"
#include "metrale_feed/argmax_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kThreads = 256;

// KV slot of position `pos` through the row's block table; kv_slots (out of range) when the
// table points past the cache, so a bad table cannot write outside it.
__device__ __forceinline__ uint32_t slot_of(const uint32_t *tables, uint32_t table_words,
                                            uint32_t offset, uint32_t pos, uint32_t bs,
                                            uint32_t kv_slots) {
    const uint64_t entry = (uint64_t)offset + pos / bs;
    if (entry >= table_words) return kv_slots;  // corrupt metadata reads nothing it does not own
    const uint64_t slot = (uint64_t)tables[entry] * bs + pos % bs;
    return slot < kv_slots ? (uint32_t)slot : kv_slots;
}

// Raw output bits of a logit for each dtype.
struct OutF32 {
    using T = float;
    __device__ static T conv(float x) { return x; }
};
struct OutF16 {
    using T = uint16_t;
    __device__ static T conv(float x) { return mf_f32_to_f16(__float_as_uint(x)); }
};
struct OutBF16 {
    using T = uint16_t;
    __device__ static T conv(float x) { return mf_f32_to_bf16(__float_as_uint(x)); }
};

// One block per row. Warp 0 folds the hash (sequential by nature): each lane loads one history
// id, then every lane applies the 32 steps in order from shuffles.
template <class O>
__global__ void __launch_bounds__(kThreads)
    mf_reference_kernel(const uint32_t *input_ids, const uint32_t *meta, const uint32_t *tables,
                        uint32_t table_words, uint32_t *kv, uint32_t kv_slots, uint32_t bs,
                        uint32_t vocab, uint32_t start, typename O::T *logits,
                        const uint32_t *advance, uint32_t advance_group) {
    __shared__ uint32_t row_hash;
    const uint32_t r = blockIdx.x, offset = meta[2 * r + 1];
    // A speculative step's advance (the last verify's n) is known on the device only.
    const uint32_t pos = meta[2 * r] + (advance ? advance[r / advance_group] : 0u);
    if (threadIdx.x == 0) {
        const uint32_t slot = slot_of(tables, table_words, offset, pos, bs, kv_slots);
        if (slot < kv_slots) kv[slot] = input_ids[r];
    }
    if (logits == nullptr) return;  // a prefill: the KV write alone (uniform across the block)
    __syncthreads();  // the write above is read back below, by other threads of the block

    if (threadIdx.x == 0 && pos >= kv_slots) row_hash = MF_FNV_OFFSET;  // no history in the cache
    if (threadIdx.x < 32 && pos < kv_slots) {
        const uint32_t lane = threadIdx.x;
        uint32_t h = MF_FNV_OFFSET;
        for (uint64_t base = 0; base <= pos; base += 32) {
            const uint64_t t = base + lane;
            uint32_t tok = MF_NO_TOKEN;
            if (t <= pos) {
                const uint32_t slot = slot_of(tables, table_words, offset, (uint32_t)t, bs, kv_slots);
                if (slot < kv_slots) tok = kv[slot];
            }
            const uint32_t steps = (uint32_t)(pos - base >= 31 ? 32 : pos - base + 1);
            for (uint32_t j = 0; j < steps; ++j)
                h = mf_fnv_step(h, __shfl_sync(0xFFFFFFFFu, tok, j));
        }
        if (lane == 0) row_hash = h;
    }
    __syncthreads();

    const uint32_t h = row_hash;
    typename O::T *out = logits + (uint64_t)r * vocab;
    for (uint32_t v = threadIdx.x; v < vocab; v += blockDim.x)
        out[v] = O::conv(mf_reference_logit(h, start + v));
}

template <class O>
cudaError_t launch(const mf_reference_args &a, cudaStream_t stream) {
    MF_LAUNCH(a.rows, kThreads, 0, stream, mf_reference_kernel<O>)(
        a.input_ids, a.meta, a.tables, a.table_words, a.kv, a.kv_slots, a.block_size, a.vocab,
        a.start, static_cast<typename O::T *>(a.logits), a.advance, a.advance_group);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_reference(const mf_reference_args &a, cudaStream_t stream) {
    switch (a.dtype) {
    case MF_DTYPE_F32: return launch<OutF32>(a, stream);
    case MF_DTYPE_F16: return launch<OutF16>(a, stream);
    case MF_DTYPE_BF16: return launch<OutBF16>(a, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace MF_KERNELS
}  // namespace mf
