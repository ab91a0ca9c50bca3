// The host twins of the CUDA kernels. They run on a stream's worker, spread over the pool.
#pragma once

#include <optional>
#include <vector>

#include "metrale_feed/argmax_rule.h"
#include "metrale_feed/feed.h"
#include "metrale_feed/partial_layout.h"

namespace mf::host {

// One penalty launch (penalty_host.cpp): host slots copied, device ones read when it runs.
struct PenaltyJob {
    PenaltyJob(const mf_penalty_args &a, bool upd) : args(a), update(upd) {
        if (!(a.flags & MF_PENALTY_SLOTS_DEVICE)) {
            slots.assign(a.slots, a.slots + a.rows);
            args.slots = nullptr;
        }
    }
    const uint32_t *slot_words() const { return args.slots ? args.slots : slots.data(); }
    mf_penalty_args args;
    bool update;
    std::vector<uint32_t> slots;
};
// What one argmax/sample launch needs when the worker runs it. Host-resident masks and params are
// copied here (the caller may reuse them once the launch returns); device-resident ones stay
// pointers and are read when the job runs, as the GPU kernel reads them. `apply`: the step's
// penalties in the same job (Ops::argmax_penalised), their host slots copied too.
struct ArgmaxJob {
    explicit ArgmaxJob(const mf_argmax_args &a, const mf_penalty_args *apply = nullptr) : args(a) {
        args.penalties = nullptr;  // the caller's descriptor: `penalties` holds the checked one
        if (apply) penalties.emplace(*apply, false);
        if (!(a.flags & MF_ARGS_MASKS_DEVICE)) {
            masks.assign(a.masks, a.masks + 2 * (size_t)a.rows);
            args.masks = nullptr;
        }
        if (a.params && !(a.flags & MF_ARGS_PARAMS_DEVICE)) {
            params.assign(a.params, a.params + a.rows);
            args.params = nullptr;
        }
    }
    const uint32_t *mask_words() const { return args.masks ? args.masks : masks.data(); }
    const mf_sampling_params *row_params() const {
        return args.params ? args.params : (params.empty() ? nullptr : params.data());
    }
    mf_argmax_args args;
    std::vector<uint32_t> masks;
    std::vector<mf_sampling_params> params;
    std::optional<PenaltyJob> penalties;
};

void run_argmax(const ArgmaxJob &job);
void run_resolve(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                 uint32_t *out);
void run_reference_forward(const mf_reference_args &args);

// One row under the rule (masks and bitmask), for the dispatch: the portable path and the best.
uint32_t argmax_row_portable(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule);
uint32_t argmax_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule);
// A float32 argmax scan continued over ids [lo, hi) of a row of `vocab` under its rule: `best` is
// the packed maximum of the ids below lo (argmax_rule.h; 0: none), the result that of the ids below
// hi. Chunk after chunk, the row's argmax_row, bit for bit, at the cost of one pass.
uint64_t argmax_f32_above(const uint32_t *row, uint32_t vocab, const mf_row_rule *rule, uint32_t lo, uint32_t hi,
                          uint64_t best);
const char *argmax_isa();
bool use_portable_argmax(bool portable);  // for tests of both paths; false: no vector path here
bool vector_paths();                      // the vector paths run now (none forced portable)

// One sampled row (sample_host.cpp); temperature 0 never reaches it. `vector`: the AVX2 helpers
// may decide what to skip (the portable path when the argmax path is forced portable). `base`:
// the global id of the row's first element when it is a slice of a split row (Philox draws by
// global id, so the race is the same however the row is split).
uint32_t sample_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                    const mf_sampling_params &p, bool vector, uint32_t base = 0);

// The survivors of a sampled row as sample_row filters them (sample_host.cpp): top is the
// greatest finite candidate, packed (0: none); zmax its z (not finite: sample_row answers the top);
// threshold the top_k/top_p packed threshold (0: none). For the verifier.
struct SampleTarget {
    uint64_t top;
    float zmax;
    uint64_t threshold;
};
SampleTarget sample_target(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                           const mf_sampling_params &p, bool vector);
// The total mass of the survivors of t, min_p included (verify_rule.h's p(x) = mass / total).
uint64_t survivor_mass(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                       const mf_sampling_params &p, const SampleTarget &t, bool vector);

// A row's gathered CANDS lists (feed.h's select_cands): slice 0's list of the row at `first`, the
// next slice's `stride` bytes on, `cap` entries each; first NULL: none.
struct CandsView {
    const char *first;
    uint64_t stride;
    uint32_t world, cap;
};

// One stage of a split row's filters on a slice (feed.h's MF_ARGS_SELECT): TOP returns the
// slice's greatest finite candidate (local id), HIST adds the digit's weights to
// bins[MF_SELECT_BINS], RACE returns the race winner over the survivors (local id), its floor
// raised first by the gathered CANDS lists for a row with MF_SELECT_ROW_CANDS; a pending cut in
// `st` is applied first.
uint32_t select_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                    const mf_sampling_params &p, bool vector, uint32_t base, uint32_t stage,
                    mf_select_row &st, uint64_t *bins, uint32_t *list, uint32_t list_cap, CandsView cands);
// A RACE stage's row of a sampled verify (mf_argmax_args.select_drafts): select_row's race without
// the draft x (global id, or MF_NO_TOKEN), and *mass the slice's survivors' total mass with
// MF_VERIFY_SURVIVES when x is this slice's and survives (verify_rule.h).
uint32_t verify_race_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                         const mf_sampling_params &params, bool vector, uint32_t base, mf_select_row &st,
                         uint32_t *list_ids, uint32_t list_cap, CandsView cands, uint32_t x, uint64_t *mass);
// A CANDS stage's row: the slice's greatest min(top_k, count) candidates (global ids, the rule's
// order) in out[0, cap), padded with MF_NO_TOKEN.
void cands_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
               const mf_sampling_params &p, bool vector, uint32_t base, mf_partial_cand *out, uint32_t cap);

// A row's (m, s) for logprobs (logprob_rule.h), over n elements: vector or portable, both
// deterministic (a fixed order of float64 adds).
struct RowStats {
    float m;
    double s;
};
RowStats row_stats(const void *row, mf_dtype dtype, uint32_t n, bool vector);

// What one combine needs when the worker runs it (host params copied now).
struct CombineJob {
    // Host params are copied (the caller may reuse them); device ones are read when the job runs.
    explicit CombineJob(const mf_combine_args &a) : args(a) {
        if (a.params && !(a.flags & MF_COMBINE_PARAMS_DEVICE)) {
            params.assign(a.params, a.params + a.rows);
            args.params = nullptr;
        }
    }
    const mf_sampling_params *row_params() const {
        return args.params ? args.params : (params.empty() ? nullptr : params.data());
    }
    mf_combine_args args;
    std::vector<mf_sampling_params> params;
};
void run_combine(const CombineJob &job);

// What one verify launch needs when the worker runs it: host drafts, masks and params copied now.
// `apply`: the step's penalties in the same job (Ops::verify_penalised), their host slots copied.
struct VerifyJob {
    explicit VerifyJob(const mf_verify_args &a, const mf_penalty_args *apply = nullptr) : args(a) {
        args.penalties = nullptr;  // the caller's descriptor: `penalties` holds the checked one
        if (apply) penalties.emplace(*apply, false);
        const size_t logit_rows = (size_t)a.rows * (a.k + 1);
        if (!(a.flags & MF_VERIFY_DRAFTS_DEVICE)) {
            drafts.assign(a.drafts, a.drafts + (size_t)a.rows * a.k);
            args.drafts = nullptr;
        }
        if (!(a.flags & MF_ARGS_MASKS_DEVICE)) {
            masks.assign(a.masks, a.masks + 2 * logit_rows);
            args.masks = nullptr;
        }
        if (a.params && !(a.flags & MF_ARGS_PARAMS_DEVICE)) {
            params.assign(a.params, a.params + a.rows);
            args.params = nullptr;
        }
    }
    const uint32_t *draft_ids() const { return args.drafts ? args.drafts : drafts.data(); }
    const uint32_t *mask_words() const { return args.masks ? args.masks : masks.data(); }
    const mf_sampling_params *row_params() const {
        return args.params ? args.params : (params.empty() ? nullptr : params.data());
    }
    mf_verify_args args;
    std::vector<uint32_t> drafts, masks;
    std::vector<mf_sampling_params> params;
    std::optional<PenaltyJob> penalties;
};
void run_verify(const VerifyJob &job);
void run_resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                          uint32_t *out_advance);
void run_verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows, uint32_t k,
                             mf_sampling_params *out);

void run_penalties(const PenaltyJob &job);
// A pick's penalties (ArgmaxJob::penalties): row r's apply, on the pool thread that picks it, and
// the update once every row is picked (args.ids: the pick's cells).
void apply_penalties_row(const mf_penalty_args &args, uint32_t r, uint32_t slot);
// A verify's penalties (VerifyJob::penalties, args.k > 0): logit row r * (k + 1) + j, walking row
// r's drafts before position j, on the pool thread that reads it.
void apply_verify_penalties_row(const mf_penalty_args &args, uint32_t r, uint32_t j, uint32_t slot);
// Asks for the lines logit row lr's apply will touch (verify_host.cpp: the next row's, while the
// verify reads this one).
void prefetch_penalties_row(const mf_penalty_args &args, uint32_t lr, uint32_t slot);
void count_penalties(const mf_penalty_args &args, const uint32_t *slots);
// A greedy float32 verify row's penalties applied inside its argmax's pass (penalty_host.cpp): a
// slot's biases, stops and table entries sorted into the chunks of the row their ids fall in, once
// for the row's k + 1 positions.
struct PenaltyChunks {
    std::vector<mf_penalty_item> items;      // each chunk's biases, then each chunk's stops
    std::vector<mf_penalty_entry> entries;   // each chunk's table entries
    std::vector<uint32_t> bias_at, stop_at, entry_at;  // chunk c's records: [at[c], at[c + 1]), padded to eight
    std::vector<uint32_t> next;                        // the sort's scratch
};
// Whether a verify's greedy rows may take that pass (float32 rows, the eight-id paths).
bool chunked_penalties(const mf_penalty_args &args);
void sort_penalty_chunks(const mf_penalty_args &args, uint32_t slot, PenaltyChunks &out);
// Logit row r * (k + 1) + j's argmax under `rule`, its penalties (walking the drafts before j)
// applied in the same pass: the logits end as apply_verify_penalties_row leaves them, the id is
// argmax_row's over those logits.
uint32_t argmax_penalised_row(const mf_penalty_args &args, const PenaltyChunks &chunks, uint32_t r,
                              uint32_t j, uint32_t slot, const mf_row_rule *rule);

// The top logprobs of each row, or a slice's top block (top_logprob_host.cpp), and the combine of
// gathered top blocks: nothing host-side to copy.
void run_top_logprobs(const mf_top_logprobs_args &args);
void run_top_combine(const mf_top_combine_args &args);

// The decisions between a split row's filter stages (select_host.cpp): device state only.
void run_select_decide(const mf_select_decide_args &args);

// The device grammar (grammar_host.cpp): a mask of each logit row, and each row's state advanced.
void run_grammar_mask(const mf_grammar_mask_args &args);
void run_grammar_advance(const mf_grammar_advance_args &args);

// Clears FTZ/DAZ for the lifetime of the guard: the rules are defined on IEEE arithmetic with
// subnormals, whatever a library loaded into the process did to this thread's MXCSR.
struct IeeeFpGuard {
    IeeeFpGuard();
    ~IeeeFpGuard();
    unsigned saved;
};

}  // namespace mf::host
