// The penalty kernels (penalty_rule.h): one block per logit row. The apply kernel runs the rule's
// three stages with a barrier between them (an id may be in more than one list); within a stage the
// ids are distinct, so the threads never touch one logit twice. A verify's position (k > 0) walks
// its row's drafts: the table's ids take their counts plus the walked drafts', then, after a
// barrier, the walked drafts' ids the table lacks (each once: distinct from the table's and from
// each other) are penalised too. The update kernel finds the counted id in the slot's table (the
// threads scan it in strides; the ids there are distinct, so at most one thread finds it) and
// thread 0 counts it, once per id a verify emitted. Host slots travel by value in the parameters,
// as the resolve kernel's sources do; device slots are read when the kernel runs.
#include <algorithm>

#include "cuda/kernels.hpp"
#include "metrale_feed/penalty_rule.h"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr int kApplyThreads = 256;
constexpr int kUpdateThreads = 128;

template <int N>
struct SlotWords {
    uint32_t words[N];
};

template <int N>
__global__ void __launch_bounds__(kApplyThreads)
    mf_penalty_apply_kernel(const mf_penalty_args a, const uint32_t *device_slots, const __grid_constant__ SlotWords<N> host) {
    __shared__ uint32_t walked[MF_MAX_DRAFTS];  // a verify position's drafts
    __shared__ uint32_t known[MF_MAX_DRAFTS];   // each in the table or an earlier draft's id
    const uint32_t k = a.k;
    const uint32_t lr = blockIdx.x, r = lr / (k + 1u);
    const uint32_t slot = device_slots ? device_slots[r] : host.words[r];
    if (slot >= a.slot_count) return;  // the whole block: no barrier is reached
    const uint32_t *drafts = k ? a.drafts + (uint64_t)r * k : nullptr;
    const uint32_t w = k ? mf_penalty_walked(drafts, k, lr % (k + 1u)) : 0u;
    const mf_penalty_slot s = mf_penalty_walk_slot(mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap), w);
    const mf_penalty_item *items = a.items + (uint64_t)slot * a.item_cap;
    const mf_penalty_entry *table = a.table + (uint64_t)slot * a.table_cap;
    const int dtype = (int)a.dtype;
    void *row = static_cast<char *>(a.logits) + (uint64_t)lr * a.row_stride * mf_dtype_size(dtype);
    for (uint32_t u = threadIdx.x; u < w; u += blockDim.x) {
        walked[u] = drafts[u];
        known[u] = mf_penalty_draft_repeats(drafts, u);
    }
    for (uint32_t i = threadIdx.x; i < s.biases; i += blockDim.x) {
        const uint32_t col = items[i].id - a.start;
        if (col < a.vocab) mf_penalty_bias_at(row, dtype, col, items[i].value);
    }
    __syncthreads();
    if (mf_penalty_bans_stops(&s))
        for (uint32_t i = s.biases + threadIdx.x; i < s.biases + s.stops; i += blockDim.x) {
            const uint32_t col = items[i].id - a.start;
            if (col < a.vocab) mf_penalty_store(row, dtype, col, mf_neg_inf());
        }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < s.entries; i += blockDim.x) {
        const uint32_t id = table[i].id;
        uint32_t more = 0u;
        for (uint32_t u = 0; u < w; ++u)
            if (walked[u] == id) {
                ++more;
                known[u] = 1u;  // every writer writes 1
            }
        const uint32_t col = id - a.start;
        if (col < a.vocab) mf_penalize_at(row, dtype, col, &s, mf_penalty_count_plus(table[i].count, more));
    }
    if (!w) return;  // the whole block: w is the block's
    __syncthreads();
    for (uint32_t u = threadIdx.x; u < w; u += blockDim.x) {
        const uint32_t col = walked[u] - a.start;
        if (col < a.vocab && mf_penalty_draft_joins(known, u, s.entries, a.table_cap))
            mf_penalize_at(row, dtype, col, &s, mf_penalty_draft_count(walked, w, walked[u]));
    }
}

template <int N>
__global__ void __launch_bounds__(kUpdateThreads)
    mf_penalty_update_kernel(const mf_penalty_args a, const uint32_t *device_slots, const __grid_constant__ SlotWords<N> host) {
    __shared__ uint32_t found;
    const uint32_t r = blockIdx.x;
    const uint32_t slot = device_slots ? device_slots[r] : host.words[r];
    if (slot >= a.slot_count) return;  // the whole block
    // A pick's id, or the n ids a verify emitted (its cells), counted in order.
    uint32_t n = 1u, last;
    const uint32_t *ids = a.ids + r;
    if (a.k) {
        ids = a.ids + (uint64_t)r * (a.k + 2u);
        mf_verify_resolve(ids, a.k, &last, &n);
        ++ids;
    }
    mf_penalty_entry *table = a.table + (uint64_t)slot * a.table_cap;
    for (uint32_t t = 0; t < n; ++t) {
        const uint32_t id = ids[t];
        if (id == MF_NO_TOKEN) continue;  // the whole block
        mf_penalty_slot s = mf_penalty_clamped(a.state[slot], a.table_cap, a.item_cap);
        if (threadIdx.x == 0) found = a.table_cap;
        __syncthreads();
        for (uint32_t i = threadIdx.x; i < s.entries; i += blockDim.x)
            if (table[i].id == id) found = i;  // distinct ids: one writer at most
        __syncthreads();
        if (threadIdx.x == 0) {
            mf_penalty_count(&s, table, a.table_cap, id, found);
            a.state[slot].generated = s.generated;
            a.state[slot].entries = s.entries;
        }
        __syncthreads();  // the next id reads the state and the table thread 0 wrote
    }
}

template <int N>
cudaError_t launch_chunk(const mf_penalty_args &a, bool update, cudaStream_t stream) {
    const bool dslots = a.flags & MF_PENALTY_SLOTS_DEVICE;
    SlotWords<N> host;
    if (!dslots) std::copy(a.slots, a.slots + a.rows, host.words);
    const uint32_t *device_slots = dslots ? a.slots : nullptr;
    if (update)
        MF_LAUNCH(a.rows, kUpdateThreads, 0, stream, mf_penalty_update_kernel<N>)(a, device_slots, host);
    else  // a block per logit row: k + 1 a row of a verify's
        MF_LAUNCH(a.rows * (a.k + 1), kApplyThreads, 0, stream, mf_penalty_apply_kernel<N>)(a, device_slots, host);
    return cudaGetLastError();
}

}  // namespace

cudaError_t launch_penalties(const mf_penalty_args &a, bool update, cudaStream_t stream) {
    const uint32_t esize = update ? 0u : mf_dtype_size((int)a.dtype);
    for (uint32_t row0 = 0; row0 < a.rows; row0 += kPenaltyRowsPerLaunch) {
        mf_penalty_args part = a;
        part.rows = std::min(a.rows - row0, kPenaltyRowsPerLaunch);
        part.slots = a.slots + row0;
        if (update) part.ids = a.ids + (uint64_t)row0 * (a.k ? a.k + 2 : 1);
        else part.logits = static_cast<char *>(a.logits) + (uint64_t)row0 * (a.k + 1) * a.row_stride * esize;
        if (a.drafts) part.drafts = a.drafts + (uint64_t)row0 * a.k;
        // A small tier keeps the usual decode batch's parameter block small.
        const bool small = part.rows <= 256 || (a.flags & MF_PENALTY_SLOTS_DEVICE);
        cudaError_t e = small ? launch_chunk<256>(part, update, stream)
                              : launch_chunk<kPenaltyRowsPerLaunch>(part, update, stream);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

}  // namespace MF_KERNELS
}  // namespace mf
