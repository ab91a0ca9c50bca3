// A split row's filter stages (MF_ARGS_SELECT) and the decisions between them (select_rule.h).
//
// The stages: one block a row, with the candidates, weights, cut and race of the host backend's
// select_row and cands_row (sample_host.cpp), so every backend writes the same blocks bit for bit
// (the tests compare them). TOP and RACE leave each row's local id where the records go, for the
// stats kernel to finish (logprob_feed.cu); HIST and CANDS write their block whole.
//
// The decisions: a thread a row. Each is a few hundred integer operations a row (a ROUND sums
// `world` histograms of 256 weights), so one small launch after each exchange, on the stream,
// with no host in between.
#include <algorithm>

#include "cuda/kernels.hpp"
#include "metrale_feed/select_rule.h"
#include "metrale_feed/verify_rule.h"
#include "sample_block.cuh"

namespace mf {
namespace MF_KERNELS {
namespace {

constexpr uint32_t kSelectRowsPerLaunch = 256;  // 256 * (32 + 8) bytes of parameters

struct SelectInputs {  // host params and host masks, by value
    mf_sampling_params params[kSelectRowsPerLaunch];
    uint32_t masks[2 * kSelectRowsPerLaunch];
};

// One launch's rows of a stage, every pointer at its first row.
struct SelectStage {
    const char *logits;
    uint64_t row_bytes;
    int dtype;
    uint32_t vocab, start, stage, bit_words;
    const uint32_t *device_masks;  // NULL: the inputs' host masks
    const mf_sampling_params *device_params;  // NULL: the inputs' host params
    const uint32_t *bitmask;
    uint32_t *ids;                 // TOP, RACE: the local id of row r at ids[4 * r] (its record)
    mf_select_row *select;
    char *payload;                 // HIST: MF_SELECT_BINS weights a row; CANDS: cands_cap entries a row
    uint32_t cands_cap, cands_world;
    const char *cands;             // RACE: slice 0's gathered CANDS entries of row 0 (NULL: none)
    uint64_t cands_stride;
    mf_partial_header *header;     // HIST, CANDS: written by the first row's block (NULL: another launch's)
    mf_partial_header h;
    const uint32_t *drafts;        // a sampled verify's drafts (select_drafts; NULL: none), k a row
    uint32_t k, row0;              // row0: this launch's first logit row
};

// The cut at `key` (select_rule.h): the lowest-id candidates at `key`, at or above `floor`, while
// the weight taken before each is below `need`; the packed threshold that keeps them (and all
// above `key`), never below `floor`. The ids go by in chunks of the block in id order: a chunk
// whose weight does not reach `need` is taken whole, and in the one that does, a scan finds the id.
__device__ uint64_t block_cut(const Row &row, bool use_mass, float inv_t, float zmax, uint64_t floor, uint32_t key,
                              uint64_t need) {
    __shared__ unsigned long long scan[kThreads];
    __shared__ unsigned long long found;
    if (!need) return mf_pack_max(mf_cut_none(key), floor);
    if (threadIdx.x == 0) found = 0ull;
    __syncthreads();
    uint64_t taken = 0;
    for (uint32_t c0 = 0; c0 < row.vocab; c0 += blockDim.x) {
        const uint32_t i = c0 + threadIdx.x;
        uint32_t bits;
        uint64_t w = 0, packed = 0;
        if (i < row.vocab && row.candidate(i, &bits) && mf_key_f32(bits) == key) {
            packed = mf_pack(key, i);
            if (packed >= floor) w = select_weight(use_mass, bits, inv_t, zmax);
        }
        const uint64_t sum = block_reduce(w, false);  // every thread gets it: the branch is uniform
        if (taken + sum < need) {
            taken += sum;
            continue;
        }
        scan[threadIdx.x] = w;
        __syncthreads();
        for (uint32_t o = 1; o < blockDim.x; o <<= 1) {  // inclusive, in id order
            const uint64_t before = threadIdx.x >= o ? scan[threadIdx.x - o] : 0ull;
            __syncthreads();
            scan[threadIdx.x] += before;
            __syncthreads();
        }
        const uint64_t through = taken + scan[threadIdx.x];
        if (w && through >= need && through - w < need) found = packed;  // the one id that reaches it
        __syncthreads();
        break;
    }
    return mf_pack_max(found ? found : mf_cut_all(key), floor);
}

// A CANDS row: the slice's greatest min(top_k, cap) candidates in the rule's order (packed words
// descending) as global ids, padded with MF_NO_TOKEN. The k-th greatest word is a radix select
// away (packed words are distinct), the words at or above it are listed, and each one's place is
// the count of greater ones.
__device__ void cands_row(const Row &row, uint32_t k, mf_partial_cand *out, uint32_t cap) {
    __shared__ unsigned long long list[MF_SELECT_CANDS_MAX];
    __shared__ unsigned int listed;
    uint32_t len = 0;
    if (k) {
        const uint64_t count = top_and_count(row).count;
        const uint64_t t = count > k ? block_select(row, 0, false, 1.0f, 0.0f, k) : 0ull;
        if (threadIdx.x == 0) listed = 0u;
        __syncthreads();
        for (uint32_t i = threadIdx.x; i < row.vocab; i += blockDim.x) {
            uint32_t bits;
            if (!row.candidate(i, &bits)) continue;
            const uint64_t packed = mf_pack(mf_key_f32(bits), i);
            if (packed >= t) list[atomicAdd(&listed, 1u)] = packed;
        }
        __syncthreads();
        len = listed;
        for (uint32_t j = threadIdx.x; j < len; j += blockDim.x) {
            uint32_t place = 0;
            for (uint32_t x = 0; x < len; ++x) place += list[x] > list[j];
            const uint32_t id = mf_unpack_id(list[j]);
            out[place] = mf_partial_cand{row.base + id, mf_logit_bits(row.logits, row.dtype, id)};
        }
    }
    for (uint32_t j = len + threadIdx.x; j < cap; j += blockDim.x) out[j] = mf_partial_cand{MF_NO_TOKEN, 0u};
}

// The race of a sampled row over its survivors (packed >= floor, and min_p against the whole
// row's zmax); the slice's top candidate `top` is raced first, since its score bounds the others.
// MF_NO_TOKEN when the top is filtered out (then nothing in the slice survives).
__device__ uint32_t race_row(const Row &row, const mf_sample_plan &p, uint64_t top, float zmax, uint64_t floor) {
    const uint32_t top_id = mf_unpack_id(top), bits = mf_logit_bits(row.logits, row.dtype, top_id);
    const float ztop = mf_scaled(bits, p.inv_t);
    if (!mf_finite_bits(mf_to_bits(ztop)) || !mf_finite_bits(mf_to_bits(zmax))) return top_id;  // the top is the draw
    if (!mf_survives(bits, top_id, floor, &p, zmax)) return MF_NO_TOKEN;
    return block_race(row, p, top_id, ztop, zmax, floor, MF_NO_TOKEN);
}

__global__ void __launch_bounds__(kThreads)
    mf_select_stage_kernel(const SelectStage s, const __grid_constant__ SelectInputs in) {
    __shared__ unsigned long long hist[MF_SELECT_BINS];
    __shared__ unsigned long long cands_floor;
    const uint32_t r = blockIdx.x;
    const uint32_t *m = s.device_masks ? s.device_masks + 2 * r : in.masks + 2 * r;
    const Row row{s.logits + r * s.row_bytes, s.dtype, s.vocab,
                  mf_row_rule{m[0] - s.start, m[1] - s.start, s.bitmask ? s.bitmask + (uint64_t)r * s.bit_words : nullptr},
                  s.start};
    const mf_sampling_params *params = s.device_params ? &s.device_params[r] : &in.params[r];
    const mf_sample_plan p = mf_plan_sampling(params);
    const bool sampled = s.vocab && !p.greedy;  // uniform across the block, as every branch below
    if (s.header && r == 0 && threadIdx.x == 0) *s.header = s.h;
    // A sampled verify's draft at this position, as this slice's id (>= vocab: none here).
    const uint32_t draft = mf_verify_local_draft(s.drafts, s.k, (uint64_t)s.row0 + r, s.start);
    if (s.stage == MF_SELECT_TOP && threadIdx.x == 0) {  // the record's free words (select_rule.h)
        uint32_t bits;
        s.ids[4 * (uint64_t)r + 2] = draft < s.vocab && row.candidate(draft, &bits) ? bits : MF_VERIFY_NO_BITS;
        s.ids[4 * (uint64_t)r + 3] = mf_params_digest(params);
    }
    if (s.stage == MF_SELECT_RACE && s.drafts && threadIdx.x == 0) {  // a verify's mass word: none yet
        s.ids[4 * (uint64_t)r + 2] = 0u;
        s.ids[4 * (uint64_t)r + 3] = 0u;
    }
    if (s.stage == MF_SELECT_CANDS) {
        const bool listed = sampled && (s.select[r].flags & MF_SELECT_ROW_CANDS);
        const uint32_t k = !listed ? 0u : p.top_k < s.cands_cap ? p.top_k : s.cands_cap;
        cands_row(row, k, reinterpret_cast<mf_partial_cand *>(s.payload) + (uint64_t)r * s.cands_cap, s.cands_cap);
        return;
    }
    uint64_t *bins = reinterpret_cast<uint64_t *>(s.payload) + (uint64_t)r * MF_SELECT_BINS;
    if (!sampled) {  // a greedy row: no histogram, no TOP candidate, the argmax rule in the race
        if (s.stage == MF_SELECT_HIST) {
            for (uint32_t d = threadIdx.x; d < MF_SELECT_BINS; d += blockDim.x) bins[d] = 0ull;
            return;
        }
        const uint64_t best = s.stage == MF_SELECT_RACE && s.vocab ? block_argmax(row) : 0ull;
        if (threadIdx.x == 0) s.ids[4 * (uint64_t)r] = best ? mf_unpack_id(best) : MF_NO_TOKEN;
        return;
    }
    if (s.stage == MF_SELECT_TOP) {
        const uint64_t top = top_and_count(row).top;
        if (threadIdx.x == 0) s.ids[4 * (uint64_t)r] = top ? mf_unpack_id(top) : MF_NO_TOKEN;
        return;
    }
    mf_select_row st = s.select[r];  // every thread's copy; the block's thread 0 writes it back
    const float zmax = (st.flags & MF_SELECT_ROW_TOP) ? mf_scaled(st.top_bits, p.inv_t) : mf_neg_inf();
    if (s.stage == MF_SELECT_RACE && s.cands && (st.flags & MF_SELECT_ROW_CANDS)) {
        if (threadIdx.x == 0)
            cands_floor = mf_floor_local(mf_cands_threshold(s.cands + (uint64_t)r * s.cands_cap * MF_PARTIAL_CAND_BYTES,
                                                            s.cands_stride, s.cands_world, s.cands_cap, &p, zmax),
                                         s.start, s.vocab);
        __syncthreads();
        st.floor = mf_pack_max(st.floor, cands_floor);
    }
    if (st.flags & MF_SELECT_ROW_CUT) {
        st.floor = block_cut(row, st.flags & MF_SELECT_ROW_CUT_MASS, p.inv_t, zmax, st.floor, st.cut_key, st.cut_need);
        st.flags &= ~(uint32_t)MF_SELECT_ROW_CUT;
    }
    __syncthreads();  // every thread has read the row's state before it is written back
    if (threadIdx.x == 0) s.select[r] = st;
    if (s.stage == MF_SELECT_HIST) {
        for (uint32_t d = threadIdx.x; d < MF_SELECT_BINS; d += blockDim.x) hist[d] = 0ull;
        __syncthreads();
        if (st.flags & MF_SELECT_ROW_HIST) {
            const bool mass = st.flags & MF_SELECT_ROW_MASS;
            for (uint32_t i = threadIdx.x; i < s.vocab; i += blockDim.x) {
                uint32_t bits;
                if (!row.candidate(i, &bits)) continue;
                const uint32_t key = mf_key_f32(bits);
                if (mf_pack(key, i) < st.floor || !mf_select_in_prefix(key, st.prefix, st.shift)) continue;
                const uint64_t w = select_weight(mass, bits, p.inv_t, zmax);
                if (w) atomicAdd(&hist[mf_select_digit8(key, st.shift)], (unsigned long long)w);
            }
        }
        __syncthreads();
        for (uint32_t d = threadIdx.x; d < MF_SELECT_BINS; d += blockDim.x) bins[d] = hist[d];
        return;
    }
    const uint64_t top = top_and_count(row).top;
    uint32_t id = top ? race_row(row, p, top, zmax, st.floor) : MF_NO_TOKEN;
    if (s.drafts && s.stage == MF_SELECT_RACE) {  // a sampled verify's race (verify_rule.h)
        uint64_t mass = 0;
        if (mf_verify_draft_at(s.drafts, s.k, (uint64_t)s.row0 + r) != MF_NO_TOKEN && (st.flags & MF_SELECT_ROW_TOP) &&
            mf_finite_bits(mf_to_bits(zmax))) {
            mass = block_survivor_mass(row, p, st.floor, zmax);  // the slice's survivors' total mass
            uint32_t bits;
            if (survives(row, p, st.floor, zmax, draft, &bits)) mass |= MF_VERIFY_SURVIVES;
            if (id == draft && draft < row.vocab) {  // the winner is the draft: the race again without it
                const uint32_t top_id = mf_unpack_id(top);
                id = block_race(row, p, top_id, mf_scaled(mf_logit_bits(row.logits, row.dtype, top_id), p.inv_t), zmax,
                                st.floor, draft);
            }
        }
        if (threadIdx.x == 0) {  // (after the zeros above, by the same thread)
            s.ids[4 * (uint64_t)r + 2] = (uint32_t)mass;
            s.ids[4 * (uint64_t)r + 3] = (uint32_t)(mass >> 32);
        }
    }
    if (threadIdx.x == 0) s.ids[4 * (uint64_t)r] = id;
}

__global__ void mf_select_decide_kernel(const char *gathered, uint64_t block_bytes, uint32_t world, uint32_t rank,
                                        uint32_t rows, uint32_t vocab, uint64_t call, uint32_t step,
                                        const mf_sampling_params *params, mf_select_row *select,
                                        mf_select_plan *plan, uint32_t *fault, uint32_t sel, uint32_t round,
                                        uint32_t next, uint32_t rounds) {
    const uint32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    if (step == MF_DECIDE_TOP) {
        const uint32_t f = mf_check_headers(reinterpret_cast<const mf_partial_header *>(gathered), world,
                                            (uint32_t)(block_bytes / MF_PARTIAL_RECORD_BYTES),
                                            mf_partial_op(MF_PARTIAL_TOP, 0), rows, call, vocab);
        // The word was zeroed before the launch: a header fault is written by row 0 alone (every
        // row sees it, and none then checks the rounds); else any unserved row may set it.
        if (r == 0 && f) *fault = f;
        const auto *rec = reinterpret_cast<const mf_partial_record *>(gathered) + MF_PARTIAL_HEADER_RECORDS + r;
        const uint32_t row_fault = mf_decide_top_row(rec, world, (uint32_t)(block_bytes / MF_PARTIAL_RECORD_BYTES), f,
                                                     &params[r], next, rounds, &select[r], &plan[r]);
        if (row_fault) atomicCAS(fault, 0u, row_fault | (r << 8));
        return;
    }
    if (*fault) return;  // refused at the TOP decision: nothing changes any more
    const auto *bins = reinterpret_cast<const uint64_t *>(gathered + MF_PARTIAL_HEADER_BYTES) + (uint64_t)r * MF_SELECT_BINS;
    mf_decide_round_row(bins, block_bytes / 8u, world, rank, &params[r], sel, round, next, &select[r], &plan[r]);
}

}  // namespace

cudaError_t launch_select_stage(const mf_argmax_args &a, cudaStream_t stream) {
    const IdSink sink = id_sink(a);
    const bool dmasks = a.flags & MF_ARGS_MASKS_DEVICE, dparams = a.flags & MF_ARGS_PARAMS_DEVICE;
    const uint64_t row_bytes = (uint64_t)a.row_stride * mf_dtype_size(a.dtype);
    const uint64_t payload_row = a.select_stage == MF_SELECT_HIST    ? MF_SELECT_BINS * 8ull
                                 : a.select_stage == MF_SELECT_CANDS ? (uint64_t)a.select_cands_cap * MF_PARTIAL_CAND_BYTES
                                                                     : 0ull;
    const uint64_t cands_row = (uint64_t)a.select_cands_cap * MF_PARTIAL_CAND_BYTES;
    const char *cands = a.select_cands ? static_cast<const char *>(a.select_cands) + MF_PARTIAL_HEADER_BYTES : nullptr;
    char *payload = static_cast<char *>(a.partials) + MF_PARTIAL_HEADER_BYTES;
    for (uint32_t row0 = 0; row0 < a.rows; row0 += kSelectRowsPerLaunch) {
        const uint32_t n = std::min(a.rows - row0, kSelectRowsPerLaunch);
        SelectInputs in;
        if (!dparams) std::copy(a.params + row0, a.params + row0 + n, in.params);
        if (!dmasks) std::copy(a.masks + 2 * (uint64_t)row0, a.masks + 2 * (uint64_t)(row0 + n), in.masks);
        const uint32_t words = mf_bitmask_words(sink.total);
        const SelectStage s{static_cast<const char *>(a.logits) + row0 * row_bytes, row_bytes, (int)a.dtype, a.vocab,
                            a.start, a.select_stage, words, dmasks ? a.masks + 2 * (uint64_t)row0 : nullptr,
                            dparams ? a.params + row0 : nullptr,
                            a.bitmask ? a.bitmask + (uint64_t)row0 * words : nullptr,
                            sink.ids + (uint64_t)row0 * sink.stride, a.select + row0, payload + row0 * payload_row,
                            a.select_cands_cap, a.select_cands_world, cands ? cands + row0 * cands_row : nullptr,
                            a.select_cands_stride,
                            row0 == 0 && payload_row ? static_cast<mf_partial_header *>(a.partials) : nullptr,
                            mf_partial_call_header(&a, true), a.select_drafts, a.select_k, row0};
        MF_LAUNCH(n, kThreads, 0, stream, mf_select_stage_kernel)(s, in);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t launch_select_decide(const mf_select_decide_args &a, cudaStream_t stream) {
    (void)stream;  // unused by the simt launch
    if (a.step == MF_DECIDE_TOP) {
        const cudaError_t e = cudaMemsetAsync(a.fault, 0, 4, stream);
        if (e != cudaSuccess) return e;
    }
    MF_LAUNCH((a.rows + 127) / 128, 128, 0, stream, mf_select_decide_kernel)(
        static_cast<const char *>(a.gathered), a.block_bytes, a.world, a.rank, a.rows, a.vocab, a.call, a.step,
        a.params, a.select, a.plan, a.fault, a.select_k_p, a.round, a.next, a.rounds);
    return cudaGetLastError();
}

}  // namespace MF_KERNELS
}  // namespace mf
