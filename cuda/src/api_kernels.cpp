// Public entry points: the two feed kernels and the reference forward. Every argument is checked
// here, before anything is queued, so a bad call launches nothing. At the end, the sampling
// record's layout as a table (mf_sampling_params_layout).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "api.hpp"
#include "metrale_feed/argmax_rule.h"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/select_rule.h"
#include "metrale_feed/verify_rule.h"

using namespace mf;

namespace {
constexpr uint32_t kMaxRows = MF_MAX_ROWS;
constexpr uint32_t kMaxVocab = MF_MAX_VOCAB;

size_t dtype_size(mf_dtype dtype) { return dtype == MF_DTYPE_F32 ? 4 : 2; }
bool dtype_known(mf_dtype dtype) {
    return dtype == MF_DTYPE_F32 || dtype == MF_DTYPE_F16 || dtype == MF_DTYPE_BF16;
}
bool aligned(const void *ptr, size_t to) { return ((uintptr_t)ptr % to) == 0; }

// A caller's descriptor, copied here before anything reads it (so another thread changing it
// meanwhile cannot make what was checked differ from what runs). struct_size, its first field,
// says which release of the descriptor the caller was built with (mf_*_args_init sets it): a size
// this build knows is read to its end and the fields after it are zero (off); any other size, such
// as the stack garbage of a caller that never called the init, is refused. Every size a release
// shipped stays in `sizes` when fields are appended.
template <class Args, size_t N>
mf_status read_descriptor(const Args *in, Args *out, const char *name, const uint32_t (&sizes)[N]) {
    if (!in) return fail(MF_ERROR_INVALID_VALUE, "the %s descriptor is a null pointer", name);
    const uint32_t size = in->struct_size;
    bool known = false;
    for (uint32_t s : sizes) known |= s == size;
    if (!known)
        return fail(MF_ERROR_INVALID_VALUE,
                    "%s.struct_size is %u, not a size of this build's descriptor (%zu bytes): set the "
                    "descriptor up with %s_init(), which zero-fills it and sets the size",
                    name, size, sizeof(Args), name);
    std::memset(out, 0, sizeof *out);
    std::memcpy(out, in, size);
    return MF_SUCCESS;
}
// The descriptor before the select stages' candidate lists (select_cands_cap on) were appended,
// then before the pick's penalties (penalties), then before a verify's drafts (select_drafts on),
// then before the pick's grammar.
constexpr uint32_t kArgmaxSizes[] = {offsetof(mf_argmax_args, select_cands_cap), offsetof(mf_argmax_args, penalties),
                                     offsetof(mf_argmax_args, select_drafts), offsetof(mf_argmax_args, grammar),
                                     sizeof(mf_argmax_args)};
// The descriptor before MF_COMBINE_VERIFY's fields (drafts, k) were appended, then before refused,
// then before a sampled verify's select state.
constexpr uint32_t kCombineSizes[] = {offsetof(mf_combine_args, drafts), offsetof(mf_combine_args, refused),
                                       offsetof(mf_combine_args, select), sizeof(mf_combine_args)};
// The descriptor before the device position advance (advance, advance_group) was appended.
constexpr uint32_t kReferenceSizes[] = {offsetof(mf_reference_args, advance), sizeof(mf_reference_args)};
// The descriptor before the device position advance (advance) was appended, then before the
// grammar, then before the step's penalties.
constexpr uint32_t kVerifySizes[] = {offsetof(mf_verify_args, advance), offsetof(mf_verify_args, grammar),
                                     offsetof(mf_verify_args, penalties), sizeof(mf_verify_args)};
// The descriptor before a verify's drafts (drafts, k) were appended.
constexpr uint32_t kPenaltySizes[] = {offsetof(mf_penalty_args, drafts), sizeof(mf_penalty_args)};
// The descriptor before a split vocabulary's blocks (flags .. partials) were appended.
constexpr uint32_t kTopSizes[] = {offsetof(mf_top_logprobs_args, flags), sizeof(mf_top_logprobs_args)};
constexpr uint32_t kTopCombineSizes[] = {sizeof(mf_top_combine_args)};
constexpr uint32_t kDecideSizes[] = {sizeof(mf_select_decide_args)};

// ---- the device grammar (feed.h, "grammar"; grammar_rule.h) ----
// The automaton and the state words are device data read when the kernels run: checked here only
// for their extent (the rule keeps every read inside them whatever they hold).
constexpr uint32_t kGrammarMaskSizes[] = {sizeof(mf_grammar_mask_args)};
constexpr uint32_t kGrammarAdvanceSizes[] = {sizeof(mf_grammar_advance_args)};
constexpr uint32_t kGrammarPickSizes[] = {sizeof(mf_grammar_pick)};

// The automaton's fields, common to both descriptors: its two arrays' extents and the vocabulary.
mf_status check_automaton(const char *name, const mf_grammar_state *states, uint32_t num_states,
                          const mf_grammar_edge *edges, uint32_t num_edges, uint32_t vocab) {
    if (vocab == 0 || vocab > kMaxVocab)
        return fail(MF_ERROR_INVALID_VALUE, "%s: vocab must be in [1, %u], got %u", name, kMaxVocab, vocab);
    if (num_states == 0 || num_states == MF_GRAMMAR_DEAD)  // a state index is never NO_TOKEN
        return fail(MF_ERROR_INVALID_VALUE, "%s: num_states must be in [1, %u], got %u", name, MF_GRAMMAR_DEAD - 1,
                    num_states);
    if (!states || !aligned(states, alignof(mf_grammar_state)) || (num_edges && !edges) ||
        !aligned(edges, alignof(mf_grammar_edge)))
        return fail(MF_ERROR_INVALID_VALUE, "%s: states or edges is a null or misaligned pointer", name);
    mf_status st = check_device_range(states, (size_t)num_states * sizeof(mf_grammar_state), "grammar states");
    if (st == MF_SUCCESS && num_edges)
        st = check_device_range(edges, (size_t)num_edges * sizeof(mf_grammar_edge), "grammar edges");
    return st;
}

// The shape of a grammar call: rows with k drafts each, rows * (k + 1) logit rows.
mf_status check_grammar_shape(const char *name, uint32_t rows, uint32_t k) {
    if (k > MF_MAX_DRAFTS) return fail(MF_ERROR_INVALID_VALUE, "%s: k must be in [0, %u], got %u", name, MF_MAX_DRAFTS, k);
    if (rows == 0 || (uint64_t)rows * (k + 1) > kMaxRows)
        return fail(MF_ERROR_INVALID_VALUE, "%s: rows * (k + 1) must be in [1, %u], got %u * %u", name, kMaxRows, rows,
                    k + 1);
    return MF_SUCCESS;
}

// A pick's grammar (mf_argmax_args.grammar, mf_verify_args.grammar): the caller's descriptor read
// and checked for a call of `rows` rows with `k` drafts over `vocab` ids, and the two ops it
// queues around the call's kernel, built from what was checked (the backends trust them). `on`
// is false without one. Its spans join the call's own in the call's one overlap check.
struct GrammarPick {
    bool on = false;
    mf_grammar_pick g{};
    size_t mask_bytes = 0;    // the mask's bitmask rows, at the start of the scratch
    size_t upload_bytes = 0;  // a verify's host drafts, uploaded after them (0: none)
    mf_grammar_mask_args mask{};
    mf_grammar_advance_args advance{};
};

// `drafts`: a verify's drafts (device, or host ones to upload when `host_drafts`); NULL with k = 0.
mf_status read_grammar(const mf_grammar_pick *in, uint32_t rows, uint32_t k, uint32_t vocab, const uint32_t *drafts,
                       bool host_drafts, const uint32_t *bitmask, const uint32_t *cells, GrammarPick *out) {
    mf_status st = read_descriptor(in, &out->g, "mf_grammar_pick", kGrammarPickSizes);
    if (st != MF_SUCCESS) return st;
    const mf_grammar_pick &g = out->g;
    st = check_automaton("grammar", g.states, g.num_states, g.edges, g.num_edges, g.vocab);
    if (st != MF_SUCCESS) return st;
    if (g.vocab != vocab)
        return fail(MF_ERROR_INVALID_VALUE, "grammar: the automaton is for a vocabulary of %u ids; this call's is %u",
                    g.vocab, vocab);
    if (!g.state_words || !aligned(g.state_words, 4) || !g.scratch || !aligned(g.scratch, 4))
        return fail(MF_ERROR_INVALID_VALUE, "grammar: state_words or scratch is a null or misaligned pointer");
    out->mask_bytes = (size_t)rows * (k + 1) * mf_bitmask_words(vocab) * 4;
    out->upload_bytes = host_drafts ? (size_t)rows * k * 4 : 0;
    st = check_device_range(g.state_words, (size_t)rows * 4, "grammar state words");
    if (st == MF_SUCCESS) st = check_device_range(g.scratch, out->mask_bytes + out->upload_bytes, "grammar scratch");
    if (st != MF_SUCCESS) return st;
    mf_grammar_mask_args &m = out->mask;
    mf_grammar_mask_args_init(&m);
    m.states = g.states;
    m.num_states = g.num_states;
    m.edges = g.edges;
    m.num_edges = g.num_edges;
    m.vocab = vocab;
    m.rows = rows;
    m.k = k;
    m.state_words = g.state_words;
    m.drafts = host_drafts ? g.scratch + out->mask_bytes / 4 : drafts;
    m.bitmask_in = bitmask;
    m.bitmask_out = g.scratch;
    mf_grammar_advance_args &a = out->advance;
    mf_grammar_advance_args_init(&a);
    a.states = g.states;
    a.num_states = g.num_states;
    a.edges = g.edges;
    a.num_edges = g.num_edges;
    a.vocab = vocab;
    a.rows = rows;
    a.k = k;
    a.cells = cells;
    a.state_words = g.state_words;
    out->on = true;
    return MF_SUCCESS;
}

// What a pick's grammar writes (the state words, the scratch) and reads (the automaton), for the
// call's overlap check: four spans, null without a grammar.
struct GrammarSpans {
    Span s[4];
    explicit GrammarSpans(const GrammarPick &p) : s{} {
        if (!p.on) return;
        const mf_grammar_pick &g = p.g;
        s[0] = {g.state_words, (size_t)p.mask.rows * 4, "grammar state words", true};
        s[1] = {g.scratch, p.mask_bytes + p.upload_bytes, "grammar scratch", true};
        s[2] = {g.states, (size_t)g.num_states * sizeof(mf_grammar_state), "grammar states", false};
        s[3] = {g.num_edges ? g.edges : nullptr, (size_t)g.num_edges * sizeof(mf_grammar_edge), "grammar edges", false};
    }
};

// Host masks of MF_MAX_ROWS unmasked rows: what masks NULL means. A constant, so a graph that
// captured it replays the same (no) masks.
const uint32_t *no_masks() {
    static const uint32_t *const words = [] {
        static uint32_t table[2 * MF_MAX_ROWS];
        for (uint32_t &w : table) w = MF_NO_TOKEN;
        return table;
    }();
    return words;
}

// Host-resident params are checked row by row here; device-resident ones only for their extent
// (the kernels read an out-of-range value as its neutral setting).
mf_status check_sampling(const mf_argmax_args *a) {
    if (!aligned(a->params, 8)) return fail(MF_ERROR_INVALID_VALUE, "sampling params pointer is misaligned");
    if (a->flags & MF_ARGS_PARAMS_DEVICE)
        return check_device_range(a->params, (size_t)a->rows * sizeof(mf_sampling_params),
                                  "device-resident sampling params");
    for (uint32_t r = 0; r < a->rows; ++r) {
        const mf_sampling_params &p = a->params[r];
        if (!(p.temperature >= 0.0f && p.temperature <= 3.4e38f))  // NaN fails both
            return fail(MF_ERROR_INVALID_VALUE, "row %u: temperature must be finite and >= 0, got %g", r,
                        (double)p.temperature);
        if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
            return fail(MF_ERROR_INVALID_VALUE, "row %u: top_p must be in (0, 1], got %g", r, (double)p.top_p);
        if (!(p.min_p >= 0.0f && p.min_p < 1.0f))
            return fail(MF_ERROR_INVALID_VALUE, "row %u: min_p must be in [0, 1), got %g", r, (double)p.min_p);
    }
    return MF_SUCCESS;
}

// A split row's partial calls and its combine: every sampled row temperature-only, since top_k,
// top_p and min_p need thresholds over the whole row (docs/kernels.md, "Partial records and the
// combine"). Which rows sample and which filters they apply is the kernels' own reading of the
// record (mf_plan_sampling): a greedy row's filter fields are never read.
mf_status check_temperature_only(const mf_sampling_params *params, uint32_t rows) {
    for (uint32_t r = 0; r < rows; ++r) {
        const mf_sample_plan plan = mf_plan_sampling(&params[r]);
        if (!plan.greedy && (plan.top_k != 0u || plan.use_top_p || plan.use_min_p))
            return fail(MF_ERROR_INVALID_VALUE,
                        "row %u: a split row samples with temperature only (top_k, top_p and min_p "
                        "need global thresholds)", r);
    }
    return MF_SUCCESS;
}

// The bytes a partial call writes at `partials`: a header, then a record a row, or a select
// stage's histograms or candidate lists.
size_t partial_block_bytes(const mf_argmax_args *a) {
    const size_t rows = a->rows;
    if (a->flags & MF_ARGS_SELECT) {
        if (a->select_stage == MF_SELECT_HIST) return MF_PARTIAL_HEADER_BYTES + rows * MF_SELECT_BINS * 8;
        if (a->select_stage == MF_SELECT_CANDS)
            return MF_PARTIAL_HEADER_BYTES + rows * a->select_cands_cap * MF_PARTIAL_CAND_BYTES;
    }
    return MF_PARTIAL_HEADER_BYTES + rows * MF_PARTIAL_RECORD_BYTES;
}

mf_status check_partial(const mf_argmax_args *a) {
    if (a->vocab_total == 0 || a->vocab_total > kMaxVocab)
        return fail(MF_ERROR_INVALID_VALUE, "vocab must be in [1, 2**24], got %u", a->vocab_total);
    if (a->start > a->vocab_total || a->vocab > a->vocab_total - a->start)
        return fail(MF_ERROR_INVALID_VALUE, "the slice [%u, %llu) is not inside the vocabulary of %u",
                    a->start, (unsigned long long)a->start + a->vocab, a->vocab_total);
    if (a->cells || a->host_dst || a->logprobs || a->logprobs_dst)
        return fail(MF_ERROR_INVALID_VALUE, "a partial call writes its partial block only: cells, "
                    "host_dst and logprobs belong to the combine");
    if (!a->partials || !aligned(a->partials, 8))
        return fail(MF_ERROR_INVALID_VALUE, "partials is a null or misaligned pointer");
    if (a->flags & MF_ARGS_SELECT) {
        // One stage of the split filters: the filters are applied through the select state, which
        // the decisions write between stages (device params: read when the stage runs). A caller
        // built before select_drafts laid the state out with a smaller mf_select_row.
        if (a->struct_size < sizeof(mf_argmax_args))
            return fail(MF_ERROR_INVALID_VALUE, "MF_ARGS_SELECT with an mf_argmax_args of %u bytes: built against an "
                        "older feed.h, whose mf_select_row is smaller than this build's %zu bytes; rebuild",
                        a->struct_size, sizeof(mf_select_row));
        if (!a->params) return fail(MF_ERROR_INVALID_VALUE, "MF_ARGS_SELECT needs sampling params");
        if (a->select_stage < MF_SELECT_TOP || a->select_stage > MF_SELECT_CANDS)
            return fail(MF_ERROR_INVALID_VALUE, "unknown select stage %u", a->select_stage);
        if (!a->select || !aligned(a->select, 8))
            return fail(MF_ERROR_INVALID_VALUE, "select is a null or misaligned pointer");
        mf_status st = check_device_range(a->select, (size_t)a->rows * sizeof(mf_select_row), "select state");
        if (st != MF_SUCCESS) return st;
        if (a->select_list) {
            if (!aligned(a->select_list, 4) || a->select_list_cap == 0)
                return fail(MF_ERROR_INVALID_VALUE, "select_list is misaligned or has no capacity");
            st = check_device_range(a->select_list, (size_t)a->rows * a->select_list_cap * 4, "select list");
            if (st != MF_SUCCESS) return st;
        }
        const bool lists = a->select_stage == MF_SELECT_CANDS || (a->select_stage == MF_SELECT_RACE && a->select_cands);
        if (lists && (a->select_cands_cap == 0 || a->select_cands_cap > MF_SELECT_CANDS_MAX))
            return fail(MF_ERROR_INVALID_VALUE, "select_cands_cap must be in [1, %u], got %u", MF_SELECT_CANDS_MAX,
                        a->select_cands_cap);
        if (a->select_stage == MF_SELECT_RACE && a->select_cands) {
            const uint64_t block = MF_PARTIAL_HEADER_BYTES + (uint64_t)a->rows * a->select_cands_cap * MF_PARTIAL_CAND_BYTES;
            if (!aligned(a->select_cands, 4) || a->select_cands_world == 0 ||
                a->select_cands_world > MF_CANDS_MAX_WORLD || a->select_cands_stride < block ||
                a->select_cands_stride % 4)
                return fail(MF_ERROR_INVALID_VALUE, "select_cands: a misaligned pointer, a world outside [1, %u] "
                            "or a stride under one block", MF_CANDS_MAX_WORLD);
            st = check_device_range(a->select_cands, (size_t)(a->select_cands_stride * (a->select_cands_world - 1) + block),
                                    "select cands");
            if (st != MF_SUCCESS) return st;
        }
        if (a->select_drafts) {  // a sampled verify's stages (verify_rule.h): rows are R * (k + 1)
            if (a->select_k == 0 || a->select_k > MF_MAX_DRAFTS)
                return fail(MF_ERROR_INVALID_VALUE, "select_k must be in [1, %u], got %u", MF_MAX_DRAFTS, a->select_k);
            if (a->rows % (a->select_k + 1))
                return fail(MF_ERROR_INVALID_VALUE, "a verify's %u logit rows are not a multiple of k + 1 = %u",
                            a->rows, a->select_k + 1);
            if (a->flags & MF_ARGS_PARTIAL_LOGPROBS)
                return fail(MF_ERROR_INVALID_VALUE, "a verify's select stages carry masses, not logprobs");
            if (!aligned(a->select_drafts, 4))
                return fail(MF_ERROR_INVALID_VALUE, "select_drafts is a misaligned pointer");
            st = check_device_range(a->select_drafts, (size_t)a->rows / (a->select_k + 1) * a->select_k * 4,
                                    "select drafts");
            if (st != MF_SUCCESS) return st;
        } else if (a->select_k) {
            return fail(MF_ERROR_INVALID_VALUE, "select_k is select_drafts'");
        }
        if (a->select_stage == MF_SELECT_HIST || a->select_stage == MF_SELECT_CANDS)
            return check_device_range(a->partials, partial_block_bytes(a), "partials");
    } else if (a->select_drafts || a->select_k) {
        return fail(MF_ERROR_INVALID_VALUE, "select_drafts and select_k are MF_ARGS_SELECT's");
    } else if (a->params && !(a->flags & MF_ARGS_PARAMS_DEVICE)) {
        // Device params are read when the kernel runs: a filter there is the combine's fault.
        mf_status st = check_temperature_only(a->params, a->rows);
        if (st != MF_SUCCESS) return st;
    }
    return check_device_range(a->partials, ((size_t)a->rows + MF_PARTIAL_HEADER_RECORDS) * 16, "partials");
}

// What an argmax call writes must not overlap anything else it touches. Host-resident masks and
// params are consumed before the call returns, so only device-resident inputs count.
mf_status refuse_argmax_overlaps(const mf_argmax_args *a, size_t logits_bytes, const GrammarPick &gp) {
    const size_t rows = a->rows;
    const bool partial = a->flags & MF_ARGS_PARTIAL;
    const uint32_t total = partial ? a->vocab_total : a->vocab;
    const size_t block = partial_block_bytes(a);
    const bool select = a->flags & MF_ARGS_SELECT;
    const GrammarSpans g(gp);
    const Span spans[] = {
        {a->cells, partial ? 0 : rows * 4, "feed cells", true},
        {a->host_dst, rows * 4, "argmax destination", true},
        {a->logprobs, rows * 4, "logprobs", true},
        {a->logprobs_dst, rows * 4, "logprobs destination", true},
        {partial ? a->partials : nullptr, block, "partials", true},
        {select ? a->select : nullptr, rows * sizeof(mf_select_row), "select state", true},
        {select ? a->select_list : nullptr, rows * a->select_list_cap * 4, "select list", true},
        {a->vocab ? a->logits : nullptr, logits_bytes, "logits", false},
        {(a->flags & MF_ARGS_MASKS_DEVICE) ? a->masks : nullptr, rows * 8, "device-resident masks", false},
        {a->bitmask, rows * mf_bitmask_words(total) * 4, "bitmask", false},
        {select && a->select_stage == MF_SELECT_RACE ? a->select_cands : nullptr,
         a->select_cands ? (size_t)(a->select_cands_stride * (a->select_cands_world - 1)) + MF_PARTIAL_HEADER_BYTES +
                               rows * a->select_cands_cap * MF_PARTIAL_CAND_BYTES
                         : 0,
         "select cands", false},
        {(a->flags & MF_ARGS_PARAMS_DEVICE) ? a->params : nullptr, rows * sizeof(mf_sampling_params),
         "device-resident sampling params", false},
        {select ? a->select_drafts : nullptr, a->select_k ? rows / (a->select_k + 1) * a->select_k * 4 : 0,
         "select drafts", false},
        g.s[0], g.s[1], g.s[2], g.s[3],
    };
    return refuse_overlaps(spans);
}

// `gp`: the call's grammar, read and checked here when it has one.
mf_status check_argmax(const mf_argmax_args *a, GrammarPick *gp, Slot **event) {
    if (!dtype_known(a->dtype)) return fail(MF_ERROR_INVALID_VALUE, "unknown logits dtype %d", (int)a->dtype);
    if (a->rows == 0 || a->rows > kMaxRows)
        return fail(MF_ERROR_INVALID_VALUE, "rows must be in [1, %u], got %u", kMaxRows, a->rows);
    const bool partial = a->flags & MF_ARGS_PARTIAL;
    if (!partial && a->rows > a->cell_capacity)
        return fail(MF_ERROR_INVALID_VALUE, "%u rows exceed the feed cells' capacity of %u", a->rows,
                    a->cell_capacity);
    if ((a->vocab == 0 && !partial) || a->vocab > kMaxVocab)
        return fail(MF_ERROR_INVALID_VALUE, "vocab must be in [1, 2**24], got %u", a->vocab);
    // Mask ids and the bitmask are global: the whole vocabulary's, in a partial call.
    const uint32_t total = partial ? a->vocab_total : a->vocab;
    if (a->row_stride < a->vocab)
        return fail(MF_ERROR_INVALID_VALUE, "row_stride %llu is less than vocab %u",
                    (unsigned long long)a->row_stride, a->vocab);
    if (a->flags & ~(uint32_t)(MF_ARGS_MASKS_DEVICE | MF_ARGS_PARAMS_DEVICE | MF_ARGS_PARTIAL |
                               MF_ARGS_PARTIAL_LOGPROBS | MF_ARGS_SELECT))
        return fail(MF_ERROR_INVALID_VALUE, "unknown argmax flags 0x%x", a->flags);
    if ((a->flags & MF_ARGS_PARTIAL_LOGPROBS) && !partial)  // an unsplit call asks by `logprobs`
        return fail(MF_ERROR_INVALID_VALUE, "MF_ARGS_PARTIAL_LOGPROBS needs MF_ARGS_PARTIAL");
    if ((a->flags & MF_ARGS_SELECT) && !partial)
        return fail(MF_ERROR_INVALID_VALUE, "MF_ARGS_SELECT is a stage of a partial call (MF_ARGS_PARTIAL)");
    if (!a->masks && (a->flags & MF_ARGS_MASKS_DEVICE))
        return fail(MF_ERROR_INVALID_VALUE, "device-resident masks is a null pointer");
    if (!a->masks) {
        // No masks: mf_argmax_to_feed passes the constant unmasked rows.
    } else if (a->flags & MF_ARGS_MASKS_DEVICE) {
        // Read when the kernel runs: only its extent can be checked now.
        if (!aligned(a->masks, 4)) return fail(MF_ERROR_INVALID_VALUE, "device masks pointer is misaligned");
        mf_status st = check_device_range(a->masks, (size_t)a->rows * 8, "device-resident masks");
        if (st != MF_SUCCESS) return st;
    } else {
        for (uint32_t i = 0; i < 2 * a->rows; ++i) {
            uint32_t id = a->masks[i];
            if (id != MF_NO_TOKEN && id >= total)
                return fail(MF_ERROR_INVALID_VALUE, "mask id %u of row %u is not below vocab %u", id,
                            i / 2, total);
        }
    }
    if (a->bitmask) {
        if (!aligned(a->bitmask, 4)) return fail(MF_ERROR_INVALID_VALUE, "bitmask pointer is misaligned");
        mf_status st = check_device_range(a->bitmask, (size_t)a->rows * mf_bitmask_words(total) * 4,
                                          "bitmask");
        if (st != MF_SUCCESS) return st;
    }
    if (a->params) {
        mf_status st = check_sampling(a);
        if (st != MF_SUCCESS) return st;
    } else if (a->flags & MF_ARGS_PARAMS_DEVICE) {
        return fail(MF_ERROR_INVALID_VALUE, "MF_ARGS_PARAMS_DEVICE without params");
    }
    if (partial) {
        mf_status st = check_partial(a);
        if (st != MF_SUCCESS) return st;
    } else if (a->select_drafts || a->select_k) {
        return fail(MF_ERROR_INVALID_VALUE, "select_drafts and select_k are MF_ARGS_SELECT's");
    } else if (a->logprobs_dst && !a->logprobs) {
        return fail(MF_ERROR_INVALID_VALUE, "logprobs_dst needs logprobs (the device floats it copies)");
    }
    if (a->logprobs) {
        if (!aligned(a->logprobs, 4)) return fail(MF_ERROR_INVALID_VALUE, "logprobs pointer is misaligned");
        mf_status st = check_device_range(a->logprobs, (size_t)a->rows * 4, "logprobs");
        if (st == MF_SUCCESS && a->logprobs_dst)
            st = check_host_range(a->logprobs_dst, (size_t)a->rows * 4, "logprobs destination");
        if (st != MF_SUCCESS) return st;
    }
    size_t esize = dtype_size(a->dtype);
    if (!aligned(a->logits, esize) || !aligned(a->cells, 4))
        return fail(MF_ERROR_INVALID_VALUE, "logits or cells pointer is misaligned");
    // In 128 bits: a huge row_stride must not wrap into a small span that passes the range check.
    unsigned __int128 wide = ((unsigned __int128)(a->rows - 1) * a->row_stride + a->vocab) * esize;
    if (wide > (unsigned __int128)(SIZE_MAX / 2))
        return fail(MF_ERROR_INVALID_VALUE, "rows x row_stride (%u x %llu) spans more memory than exists",
                    a->rows, (unsigned long long)a->row_stride);
    size_t span = (size_t)wide;
    mf_status status = a->vocab ? check_device_range(a->logits, span, "logits") : MF_SUCCESS;
    if (status == MF_SUCCESS && !partial)
        status = check_device_range(a->cells, (size_t)a->cell_capacity * 4, "feed cells");
    if (status == MF_SUCCESS && a->host_dst)
        status = check_host_range(a->host_dst, (size_t)a->rows * 4, "argmax destination");
    if (status == MF_SUCCESS && a->grammar) {
        status = partial ? fail(MF_ERROR_INVALID_VALUE, "grammar with a partial call: each rank queues "
                                "mf_grammar_mask and mf_grammar_advance around its partial calls and the combine")
                         : read_grammar(a->grammar, a->rows, 0, a->vocab, nullptr, false, a->bitmask, a->cells, gp);
    }
    if (status == MF_SUCCESS) status = refuse_argmax_overlaps(a, span, *gp);
    *event = nullptr;
    if (status == MF_SUCCESS && a->event) status = resolve_event(a->event, event);
    return status;
}

// The shape of verified rows, for every op that takes them: k drafts a row, rows * (k + 1) logit rows.
mf_status check_verify_shape(uint32_t rows, uint32_t k) {
    if (k == 0 || k > MF_MAX_DRAFTS) return fail(MF_ERROR_INVALID_VALUE, "k must be in [1, %u], got %u", MF_MAX_DRAFTS, k);
    if (rows == 0 || (uint64_t)rows * (k + 1) > kMaxRows)
        return fail(MF_ERROR_INVALID_VALUE, "rows * (k + 1) logit rows must be in [1, %u], got %u * %u", kMaxRows, rows,
                    k + 1);
    return MF_SUCCESS;
}

// verify_to_feed's arguments, all before anything is queued (feed.h, "verify_to_feed").
mf_status check_verify(const mf_verify_args *a, GrammarPick *gp, Slot **event) {
    if (!dtype_known(a->dtype)) return fail(MF_ERROR_INVALID_VALUE, "unknown logits dtype %d", (int)a->dtype);
    if (mf_status st = check_verify_shape(a->rows, a->k); st != MF_SUCCESS) return st;
    const uint32_t logit_rows = a->rows * (a->k + 1), cell_words = a->rows * (a->k + 2);
    if (a->vocab == 0 || a->vocab > kMaxVocab)
        return fail(MF_ERROR_INVALID_VALUE, "vocab must be in [1, 2**24], got %u", a->vocab);
    if (a->row_stride < a->vocab)
        return fail(MF_ERROR_INVALID_VALUE, "row_stride %llu is less than vocab %u",
                    (unsigned long long)a->row_stride, a->vocab);
    if (a->flags & ~(uint32_t)(MF_ARGS_MASKS_DEVICE | MF_ARGS_PARAMS_DEVICE | MF_VERIFY_DRAFTS_DEVICE))
        return fail(MF_ERROR_INVALID_VALUE, "unknown verify flags 0x%x", a->flags);
    if (a->draft_probs) {  // read when the kernel runs, like every device input
        if (!aligned(a->draft_probs, 4)) return fail(MF_ERROR_INVALID_VALUE, "draft_probs pointer is misaligned");
        mf_status st = check_device_range(a->draft_probs, (size_t)a->rows * a->k * a->vocab * 4, "draft_probs");
        if (st != MF_SUCCESS) return st;
    }
    if (cell_words > a->cell_capacity)
        return fail(MF_ERROR_INVALID_VALUE, "%u rows of k + 2 = %u words exceed the feed cells' capacity of %u words",
                    a->rows, a->k + 2, a->cell_capacity);
    if (!a->drafts || !aligned(a->drafts, 4))
        return fail(MF_ERROR_INVALID_VALUE, "drafts is a null or misaligned pointer");
    mf_status st = MF_SUCCESS;
    if (a->flags & MF_VERIFY_DRAFTS_DEVICE) {  // read when the kernel runs: an id >= vocab never matches
        st = check_device_range(a->drafts, (size_t)a->rows * a->k * 4, "device-resident drafts");
        if (st != MF_SUCCESS) return st;
    } else {
        for (uint32_t r = 0; r < a->rows; ++r) {
            const uint32_t *x = a->drafts + (size_t)r * a->k;
            for (uint32_t j = 0, d = mf_verify_drafts(x, a->k); j < d; ++j)
                if (x[j] >= a->vocab)
                    return fail(MF_ERROR_INVALID_VALUE, "draft %u of row %u is id %u, not below vocab %u", j, r, x[j],
                                a->vocab);
        }
    }
    if (!a->masks && (a->flags & MF_ARGS_MASKS_DEVICE))
        return fail(MF_ERROR_INVALID_VALUE, "device-resident masks is a null pointer");
    if (a->masks && (a->flags & MF_ARGS_MASKS_DEVICE)) {
        if (!aligned(a->masks, 4)) return fail(MF_ERROR_INVALID_VALUE, "device masks pointer is misaligned");
        st = check_device_range(a->masks, (size_t)logit_rows * 8, "device-resident masks");
        if (st != MF_SUCCESS) return st;
    } else if (a->masks) {
        for (uint32_t i = 0; i < 2 * logit_rows; ++i)
            if (a->masks[i] != MF_NO_TOKEN && a->masks[i] >= a->vocab)
                return fail(MF_ERROR_INVALID_VALUE, "mask id %u of logit row %u is not below vocab %u", a->masks[i],
                            i / 2, a->vocab);
    }
    if (a->bitmask) {
        if (!aligned(a->bitmask, 4)) return fail(MF_ERROR_INVALID_VALUE, "bitmask pointer is misaligned");
        st = check_device_range(a->bitmask, (size_t)logit_rows * mf_bitmask_words(a->vocab) * 4, "bitmask");
        if (st != MF_SUCCESS) return st;
    }
    if (a->params) {
        mf_argmax_args view{};  // check_sampling's view: one record per row
        view.rows = a->rows;
        view.params = a->params;
        view.flags = a->flags & MF_ARGS_PARAMS_DEVICE;
        st = check_sampling(&view);
        if (st != MF_SUCCESS) return st;
    } else if (a->flags & MF_ARGS_PARAMS_DEVICE) {
        return fail(MF_ERROR_INVALID_VALUE, "MF_ARGS_PARAMS_DEVICE without params");
    }
    if (a->advance) {  // device words read when the kernel runs
        if (!a->params) return fail(MF_ERROR_INVALID_VALUE, "advance needs params (it moves their positions)");
        if (!aligned(a->advance, 4)) return fail(MF_ERROR_INVALID_VALUE, "advance pointer is misaligned");
        st = check_device_range(a->advance, (size_t)a->rows * 4, "advance");
        if (st != MF_SUCCESS) return st;
    }
    if (a->logprobs_dst && !a->logprobs)
        return fail(MF_ERROR_INVALID_VALUE, "logprobs_dst needs logprobs (the device floats it copies)");
    if (a->logprobs) {
        if (!aligned(a->logprobs, 4)) return fail(MF_ERROR_INVALID_VALUE, "logprobs pointer is misaligned");
        st = check_device_range(a->logprobs, (size_t)logit_rows * 4, "logprobs");
        if (st == MF_SUCCESS && a->logprobs_dst)
            st = check_host_range(a->logprobs_dst, (size_t)logit_rows * 4, "logprobs destination");
        if (st != MF_SUCCESS) return st;
    }
    const size_t esize = dtype_size(a->dtype);
    if (!aligned(a->logits, esize) || !aligned(a->cells, 4))
        return fail(MF_ERROR_INVALID_VALUE, "logits or cells pointer is misaligned");
    const unsigned __int128 wide = ((unsigned __int128)(logit_rows - 1) * a->row_stride + a->vocab) * esize;
    if (wide > (unsigned __int128)(SIZE_MAX / 2))
        return fail(MF_ERROR_INVALID_VALUE, "logit rows x row_stride (%u x %llu) spans more memory than exists",
                    logit_rows, (unsigned long long)a->row_stride);
    st = check_device_range(a->logits, (size_t)wide, "logits");
    if (st == MF_SUCCESS) st = check_device_range(a->cells, (size_t)a->cell_capacity * 4, "feed cells");
    if (st == MF_SUCCESS && a->host_dst) st = check_host_range(a->host_dst, (size_t)cell_words * 4, "verify destination");
    const bool device_drafts = a->flags & MF_VERIFY_DRAFTS_DEVICE;
    if (st == MF_SUCCESS && a->grammar)
        st = read_grammar(a->grammar, a->rows, a->k, a->vocab, a->drafts, !device_drafts, a->bitmask, a->cells, gp);
    if (st == MF_SUCCESS) {  // what the call writes must not overlap anything else it touches
        const GrammarSpans g(*gp);
        const Span spans[] = {
            {a->cells, (size_t)cell_words * 4, "feed cells", true},
            {a->host_dst, a->host_dst ? (size_t)cell_words * 4 : 0, "verify destination", true},
            {a->logprobs, a->logprobs ? (size_t)logit_rows * 4 : 0, "logprobs", true},
            {a->logprobs_dst, a->logprobs_dst ? (size_t)logit_rows * 4 : 0, "logprobs destination", true},
            {a->logits, (size_t)wide, "logits", false},
            {a->drafts, (size_t)a->rows * a->k * 4, "drafts", false},
            {(a->flags & MF_ARGS_MASKS_DEVICE) ? a->masks : nullptr, (size_t)logit_rows * 8, "masks", false},
            {a->bitmask, a->bitmask ? (size_t)logit_rows * mf_bitmask_words(a->vocab) * 4 : 0, "bitmask", false},
            {(a->flags & MF_ARGS_PARAMS_DEVICE) ? a->params : nullptr, (size_t)a->rows * sizeof(mf_sampling_params),
             "device-resident sampling params", false},
            {a->draft_probs, a->draft_probs ? (size_t)a->rows * a->k * a->vocab * 4 : 0, "draft_probs", false},
            {a->advance, a->advance ? (size_t)a->rows * 4 : 0, "advance", false},
            g.s[0], g.s[1], g.s[2], g.s[3],
        };
        st = refuse_overlaps(spans);
    }
    *event = nullptr;
    if (st == MF_SUCCESS && a->event) st = resolve_event(a->event, event);
    return st;
}

// The spans of a combine of partial blocks: `spans` (its other inputs and outputs) must not overlap
// each other or the partials; its fault word and the word's host copy must overlap none of `spans`,
// and the fault word may lie in the partials only at the first header's reserved word (the binding
// puts it there: the combine checks the headers before it writes it; any other byte would be read
// as a header or a record while it is written).
template <size_t N>
mf_status refuse_combine_overlaps(const Span (&spans)[N], const Span &partials, const Span &fault,
                                  const Span &fault_dst) {
    Span all[N + 2];
    std::copy(spans, spans + N, all);
    all[N] = partials;
    mf_status st = refuse_overlaps(all, N + 1);
    const char *p = static_cast<const char *>(partials.ptr), *f = static_cast<const char *>(fault.ptr);
    if (st == MF_SUCCESS && f + 4 > p && f < p + partials.nbytes && f != p + MF_PARTIAL_OFF_FAULT)
        st = fail(MF_ERROR_INVALID_VALUE, "the fault word overlaps the partial blocks other than at the first "
                  "header's reserved word (offset %u)", MF_PARTIAL_OFF_FAULT);
    all[N] = fault;
    all[N + 1] = fault_dst;
    return st == MF_SUCCESS ? refuse_overlaps(all, N + 2) : st;
}

}  // namespace

extern "C" {

static mf_status check_penalty_ranges(const mf_penalty_args *a, bool update, size_t *logit_bytes);

// An update's ids: a word a row, or a verify's cells (k + 2 words a row).
static size_t penalty_id_bytes(const mf_penalty_args *a) { return (size_t)a->rows * (a->k ? a->k + 2 : 1) * 4; }

// A pick's penalties (mf_argmax_args.penalties): the apply over its logits and the update with
// its cells, each checked as the two functions check theirs.
static mf_status pick_penalties(const mf_argmax_args *args, const GrammarPick &gp, mf_penalty_args *apply,
                                mf_penalty_args *update) {
    if (args->flags & (MF_ARGS_PARTIAL | MF_ARGS_SELECT))
        return fail(MF_ERROR_INVALID_VALUE, "penalties with a partial call: each slice applies its own "
                    "(mf_penalties_apply), and the update takes the combined ids");
    mf_status st = read_descriptor(args->penalties, apply, "mf_penalty_args", kPenaltySizes);
    if (st != MF_SUCCESS) return st;
    if (apply->rows != args->rows)
        return fail(MF_ERROR_INVALID_VALUE, "the penalties name %u rows; the call picks %u", apply->rows, args->rows);
    if (apply->k != 0 || apply->drafts)
        return fail(MF_ERROR_INVALID_VALUE, "the penalties of a pick have no drafts (k %u): a verify's are "
                    "mf_penalties_apply and mf_penalties_update with k", apply->k);
    apply->logits = const_cast<void *>(args->logits);  // changed in place, as penalties_apply does
    apply->dtype = args->dtype;
    apply->vocab = args->vocab;
    apply->row_stride = args->row_stride;
    apply->start = 0;
    apply->ids = nullptr;
    *update = *apply;
    update->ids = args->cells;  // checked with the call's cells: its own check would add nothing
    size_t logit_bytes = 0;
    st = check_penalty_ranges(apply, false, &logit_bytes);
    if (st != MF_SUCCESS) return st;
    // One call now writes the logits and the tables too: none of its writes may land on what
    // another part of it reads or writes. These spans hold the apply's own (check_penalties').
    const bool dmasks = args->flags & MF_ARGS_MASKS_DEVICE, dparams = args->flags & MF_ARGS_PARAMS_DEVICE;
    const bool dslots = apply->flags & MF_PENALTY_SLOTS_DEVICE;
    const GrammarSpans g(gp);  // the grammar's state words and scratch against the tables too
    const Span spans[] = {
        {args->logits, logit_bytes, "logits", true},
        {args->cells, (size_t)args->rows * 4, "cells", true},
        {args->logprobs, (size_t)args->rows * 4, "logprobs", true},
        // Host destinations too: on cuda a managed pointer passes as host and as device memory.
        {args->host_dst, (size_t)args->rows * 4, "argmax destination", true},
        {args->logprobs_dst, (size_t)args->rows * 4, "logprobs destination", true},
        {apply->state, (size_t)apply->slot_count * sizeof(mf_penalty_slot), "penalty state", true},
        {apply->table, (size_t)apply->slot_count * apply->table_cap * sizeof(mf_penalty_entry), "penalty table", true},
        {apply->items, (size_t)apply->slot_count * apply->item_cap * sizeof(mf_penalty_item), "penalty items", false},
        {dslots ? apply->slots : nullptr, (size_t)args->rows * 4, "penalty slots", false},
        {dmasks ? args->masks : nullptr, (size_t)args->rows * 8, "device-resident masks", false},
        {args->bitmask, (size_t)args->rows * mf_bitmask_words(args->vocab) * 4, "bitmask", false},
        {dparams ? args->params : nullptr, (size_t)args->rows * sizeof(mf_sampling_params), "device-resident params",
         false},
        g.s[0], g.s[1], g.s[2], g.s[3],
    };
    return refuse_overlaps(spans);
}

// A verify's penalties (mf_verify_args.penalties): the apply with k over its logits, walking its
// drafts, and the update with k from its cells, each checked as the two functions check theirs.
static mf_status verify_penalties(const mf_verify_args *args, const GrammarPick &gp, mf_penalty_args *apply,
                                  mf_penalty_args *update) {
    mf_status st = read_descriptor(args->penalties, apply, "mf_penalty_args", kPenaltySizes);
    if (st != MF_SUCCESS) return st;
    if (apply->rows != args->rows)
        return fail(MF_ERROR_INVALID_VALUE, "the penalties name %u rows; the verify has %u", apply->rows, args->rows);
    if (apply->k != args->k)
        return fail(MF_ERROR_INVALID_VALUE, "the penalties walk k = %u drafts a row; the verify has k = %u", apply->k,
                    args->k);
    if (!(args->flags & MF_VERIFY_DRAFTS_DEVICE))
        return fail(MF_ERROR_INVALID_VALUE, "penalties with host drafts: the apply's walk reads device drafts "
                    "(MF_VERIFY_DRAFTS_DEVICE)");
    apply->logits = const_cast<void *>(args->logits);  // changed in place, as penalties_apply does
    apply->dtype = args->dtype;
    apply->vocab = args->vocab;
    apply->row_stride = args->row_stride;
    apply->start = 0;
    apply->drafts = args->drafts;
    apply->ids = nullptr;
    *update = *apply;
    update->drafts = nullptr;
    update->ids = args->cells;  // checked with the call's cells: its own check would add nothing
    size_t logit_bytes = 0;
    st = check_penalty_ranges(apply, false, &logit_bytes);
    if (st != MF_SUCCESS) return st;
    // One call writes the logits and the tables too: none of its writes may land on what another
    // part of it reads or writes (check_verify's spans, and the apply's own).
    const uint32_t logit_rows = args->rows * (args->k + 1), cell_words = args->rows * (args->k + 2);
    const bool dmasks = args->flags & MF_ARGS_MASKS_DEVICE, dparams = args->flags & MF_ARGS_PARAMS_DEVICE;
    const bool dslots = apply->flags & MF_PENALTY_SLOTS_DEVICE;
    const GrammarSpans g(gp);
    const Span spans[] = {
        {args->logits, logit_bytes, "logits", true},
        {args->cells, (size_t)cell_words * 4, "feed cells", true},
        {args->logprobs, args->logprobs ? (size_t)logit_rows * 4 : 0, "logprobs", true},
        {args->host_dst, args->host_dst ? (size_t)cell_words * 4 : 0, "verify destination", true},
        {args->logprobs_dst, args->logprobs_dst ? (size_t)logit_rows * 4 : 0, "logprobs destination", true},
        {apply->state, (size_t)apply->slot_count * sizeof(mf_penalty_slot), "penalty state", true},
        {apply->table, (size_t)apply->slot_count * apply->table_cap * sizeof(mf_penalty_entry), "penalty table", true},
        {apply->items, (size_t)apply->slot_count * apply->item_cap * sizeof(mf_penalty_item), "penalty items", false},
        {dslots ? apply->slots : nullptr, (size_t)args->rows * 4, "penalty slots", false},
        {args->drafts, (size_t)args->rows * args->k * 4, "drafts", false},
        {dmasks ? args->masks : nullptr, (size_t)logit_rows * 8, "device-resident masks", false},
        {args->bitmask, args->bitmask ? (size_t)logit_rows * mf_bitmask_words(args->vocab) * 4 : 0, "bitmask", false},
        {dparams ? args->params : nullptr, (size_t)args->rows * sizeof(mf_sampling_params), "device-resident params",
         false},
        {args->draft_probs, args->draft_probs ? (size_t)args->rows * args->k * args->vocab * 4 : 0, "draft_probs",
         false},
        {args->advance, args->advance ? (size_t)args->rows * 4 : 0, "advance", false},
        g.s[0], g.s[1], g.s[2], g.s[3],
    };
    return refuse_overlaps(spans);
}

mf_status mf_argmax_to_feed(const mf_argmax_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("argmax_to_feed");
        mf_argmax_args snapshot;
        mf_status status = read_descriptor(caller, &snapshot, "mf_argmax_args", kArgmaxSizes);
        if (status != MF_SUCCESS) return status;
        const mf_argmax_args *args = &snapshot;
        void *raw;
        Slot *event;
        GrammarPick gp;
        status = check_argmax(args, &gp, &event);
        mf_penalty_args pen_apply{}, pen_update{};
        const bool penalised = args->penalties != nullptr;
        if (status == MF_SUCCESS && penalised) status = pick_penalties(args, gp, &pen_apply, &pen_update);
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS && penalised && !(pen_apply.flags & MF_PENALTY_SLOTS_DEVICE))
            status = refuse_in_capture(raw, "argmax_to_feed with penalties of host-resident slots", true);
        if (status == MF_SUCCESS && args->masks && !(args->flags & MF_ARGS_MASKS_DEVICE))
            status = refuse_in_capture(raw, "argmax_to_feed with host-resident masks", true);
        if (status == MF_SUCCESS && args->params && !(args->flags & MF_ARGS_PARAMS_DEVICE))
            status = refuse_in_capture(raw, "sample_to_feed with host-resident params", true);
        if (status == MF_SUCCESS && args->host_dst)
            status = capture_host_check(raw, args->host_dst, "argmax_to_feed destination");
        if (status == MF_SUCCESS && args->logprobs_dst)
            status = capture_host_check(raw, args->logprobs_dst, "argmax_to_feed logprobs destination");
        if (status != MF_SUCCESS) return status;
        // A replay's copy owns its penalty and grammar descriptors: the caller's may be gone by then.
        if (kept_for_graph(raw, [copy = *args, pen = pen_apply, penalised, gram = gp.g, grammar = gp.on](
                                    mf_stream_t s) mutable {
                if (penalised) copy.penalties = &pen;
                if (grammar) copy.grammar = &gram;
                return mf_argmax_to_feed(&copy, s);
            }))
            return MF_SUCCESS;
        mf_argmax_args local;
        if (!args->masks || gp.on) {
            local = *args;
            if (!local.masks) local.masks = no_masks();
            if (gp.on) local.bitmask = gp.g.scratch;  // the mask's rows, the caller's bitmask ANDed in
            args = &local;
        }
        // The grammar's mask before the kernels and its advance after them, both ahead of the copies
        // and the event record: the event covers the state words too.
        Staged staged(raw, penalised || gp.on || args->host_dst || args->logprobs_dst || event);
        status = gp.on ? ops().grammar_mask(&gp.mask, raw) : MF_SUCCESS;
        if (status == MF_SUCCESS && penalised && ops().argmax_penalised) {
            status = ops().argmax_penalised(args, &pen_apply, raw);
        } else if (status == MF_SUCCESS) {
            status = penalised ? ops().penalties(&pen_apply, false, raw) : MF_SUCCESS;
            if (status == MF_SUCCESS) status = ops().argmax(args, raw);
            if (status == MF_SUCCESS && penalised) status = ops().penalties(&pen_update, true, raw);
        }
        if (status == MF_SUCCESS && gp.on) status = ops().grammar_advance(&gp.advance, raw);
        if (status == MF_SUCCESS && args->host_dst)
            status = ops().copy_async(args->host_dst, args->cells, (size_t)args->rows * 4, kD2H, raw);
        if (status == MF_SUCCESS && args->logprobs_dst)
            status = ops().copy_async(args->logprobs_dst, args->logprobs, (size_t)args->rows * 4, kD2H, raw);
        if (status == MF_SUCCESS && event) status = ops().event_record(event->raw, (mf_stream_t)(uintptr_t)raw);
        return staged.close(status);
    });
}

mf_status mf_combine_partials(const mf_combine_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("combine_partials");
        mf_combine_args snapshot;
        mf_status status = read_descriptor(caller, &snapshot, "mf_combine_args", kCombineSizes);
        if (status != MF_SUCCESS) return status;
        const mf_combine_args *a = &snapshot;
        if (a->world == 0 || a->world > MF_MAX_SLICES)
            return fail(MF_ERROR_INVALID_VALUE, "world must be in [1, %u], got %u", MF_MAX_SLICES, a->world);
        if (a->rows == 0 || a->rows > kMaxRows)
            return fail(MF_ERROR_INVALID_VALUE, "rows must be in [1, %u], got %u", kMaxRows, a->rows);
        const bool verify = a->flags & MF_COMBINE_VERIFY;
        if (verify) {  // rows are logit rows: R verified rows of k + 1 positions (feed.h)
            if (a->k == 0 || a->k > MF_MAX_DRAFTS)
                return fail(MF_ERROR_INVALID_VALUE, "k must be in [1, %u], got %u", MF_MAX_DRAFTS, a->k);
            if (a->rows % (a->k + 1))
                return fail(MF_ERROR_INVALID_VALUE, "a verify combine's %u logit rows are not a multiple of k + 1 = %u",
                            a->rows, a->k + 1);
            if (a->op == MF_PARTIAL_SAMPLE)
                return fail(MF_ERROR_INVALID_VALUE, "a verify combine takes argmax partials (greedy rows) or a "
                            "verify's RACE blocks (MF_PARTIAL_FILTERED)");
            if (!a->drafts || !aligned(a->drafts, 4))
                return fail(MF_ERROR_INVALID_VALUE, "a verify combine needs aligned device drafts");
            if ((a->op == MF_PARTIAL_FILTERED) != (a->select != nullptr) || !aligned(a->select, 8))
                return fail(MF_ERROR_INVALID_VALUE, "a sampled verify combine needs its aligned select state, and "
                            "only it takes one");
            if (a->op == MF_PARTIAL_FILTERED && (a->logprobs || a->logprobs_dst))
                return fail(MF_ERROR_INVALID_VALUE, "a sampled verify over a split vocabulary has no logprobs");
        } else if (a->drafts || a->k || a->select) {
            return fail(MF_ERROR_INVALID_VALUE, "drafts, k and select are MF_COMBINE_VERIFY's");
        }
        // Words of cells and host_dst: one a row, or a verified row's k + 2; the drafts' bytes.
        const size_t cell_words = verify ? (size_t)a->rows / (a->k + 1) * (a->k + 2) : a->rows;
        const size_t draft_bytes = verify ? (size_t)a->rows / (a->k + 1) * a->k * 4 : 0;
        if (cell_words > a->cell_capacity)
            return fail(MF_ERROR_INVALID_VALUE, "%zu cell words exceed the feed cells' capacity of %u", cell_words,
                        a->cell_capacity);
        if (a->vocab == 0 || a->vocab > kMaxVocab)
            return fail(MF_ERROR_INVALID_VALUE, "vocab must be in [1, 2**24], got %u", a->vocab);
        if (a->op != MF_PARTIAL_ARGMAX && a->op != MF_PARTIAL_SAMPLE && a->op != MF_PARTIAL_FILTERED)
            return fail(MF_ERROR_INVALID_VALUE, "unknown partial operation %u", a->op);
        if ((uint64_t)a->slice_stride < (uint64_t)a->rows + MF_PARTIAL_HEADER_RECORDS)
            return fail(MF_ERROR_INVALID_VALUE, "slice_stride %u records is less than rows + %u", a->slice_stride,
                        MF_PARTIAL_HEADER_RECORDS);
        if ((a->op != MF_PARTIAL_ARGMAX) != (a->params != nullptr))
            return fail(MF_ERROR_INVALID_VALUE, "params are required for a sampled combine, and only there");
        if (a->flags & ~(uint32_t)(MF_COMBINE_PARAMS_DEVICE | MF_COMBINE_VERIFY))
            return fail(MF_ERROR_INVALID_VALUE, "unknown combine flags 0x%x", a->flags);
        const bool device_params = a->flags & MF_COMBINE_PARAMS_DEVICE;
        if (verify && a->op == MF_PARTIAL_FILTERED && !device_params)
            return fail(MF_ERROR_INVALID_VALUE, "a sampled verify combine reads device params (MF_COMBINE_PARAMS_DEVICE): "
                        "the logit rows' own, position j's at position + j");
        if (device_params && a->op == MF_PARTIAL_ARGMAX)
            return fail(MF_ERROR_INVALID_VALUE, "MF_COMBINE_PARAMS_DEVICE needs a sampled combine");
        if (!a->partials || !aligned(a->partials, 8) || !a->cells || !aligned(a->cells, 4) || !a->fault ||
            !aligned(a->fault, 4) || (a->logprobs && !aligned(a->logprobs, 4)) || !aligned(a->refused, 4))
            return fail(MF_ERROR_INVALID_VALUE,
                        "partials, cells, fault, logprobs or refused is a null or misaligned pointer");
        if (a->logprobs_dst && !a->logprobs)
            return fail(MF_ERROR_INVALID_VALUE, "logprobs_dst needs logprobs (the device floats it copies)");
        if (a->params) {
            mf_argmax_args view{};
            view.rows = a->rows;
            view.params = a->params;
            view.flags = device_params ? MF_ARGS_PARAMS_DEVICE : 0u;  // device: its extent only
            status = check_sampling(&view);
            // FILTERED blocks were raced over the filters' global thresholds (MF_ARGS_SELECT).
            if (status == MF_SUCCESS && a->op == MF_PARTIAL_SAMPLE && !device_params)
                status = check_temperature_only(a->params, a->rows);
        }
        // world <= MF_MAX_SLICES and slice_stride < 2**32: the product fits 64 bits.
        if (status == MF_SUCCESS)
            status = check_device_range(a->partials, (size_t)a->world * a->slice_stride * 16, "partials");
        if (status == MF_SUCCESS) status = check_device_range(a->cells, (size_t)a->cell_capacity * 4, "feed cells");
        if (status == MF_SUCCESS) status = check_device_range(a->fault, 4, "fault word");
        if (status == MF_SUCCESS && a->logprobs) status = check_device_range(a->logprobs, (size_t)a->rows * 4, "logprobs");
        if (status == MF_SUCCESS && verify)
            status = check_device_range(a->drafts, draft_bytes, "drafts");
        if (status == MF_SUCCESS && a->select)
            status = check_device_range(a->select, (size_t)a->rows * sizeof(mf_select_row), "select state");
        if (status == MF_SUCCESS && a->refused) status = check_device_range(a->refused, 4, "refused word");
        if (status == MF_SUCCESS && a->host_dst)
            status = check_host_range(a->host_dst, cell_words * 4, "combine destination");
        if (status == MF_SUCCESS && a->logprobs_dst)
            status = check_host_range(a->logprobs_dst, (size_t)a->rows * 4, "logprobs destination");
        if (status == MF_SUCCESS && a->fault_dst) status = check_host_range(a->fault_dst, 4, "fault destination");
        if (status == MF_SUCCESS) {
            const size_t rows = a->rows;
            const Span spans[] = {
                {a->cells, cell_words * 4, "feed cells", true},
                {a->host_dst, cell_words * 4, "combine destination", true},
                {a->logprobs, rows * 4, "logprobs", true},
                {a->logprobs_dst, rows * 4, "logprobs destination", true},
                {device_params ? a->params : nullptr, rows * sizeof(mf_sampling_params),
                 "device-resident sampling params", false},
                {a->drafts, draft_bytes, "drafts", false},
                {a->refused, 4, "refused word", false},
                {a->select, a->select ? rows * sizeof(mf_select_row) : 0, "select state", false},
            };
            status = refuse_combine_overlaps(spans, {a->partials, (size_t)a->world * a->slice_stride * 16, "partials", false},
                                             {a->fault, 4, "fault word", true},
                                             {a->fault_dst, 4, "fault destination", true});
        }
        Slot *event = nullptr;
        if (status == MF_SUCCESS && a->event) status = resolve_event(a->event, &event);
        void *raw;
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        // In a capture (a sharded call in a graph): host params are read once, at the call, on cuda
        // (kernel arguments); the copies at each launch need page-locked destinations.
        if (status == MF_SUCCESS && a->params && !device_params)
            status = refuse_in_capture(raw, "a sampled combine_partials (host-resident params)", true);
        if (status == MF_SUCCESS && a->host_dst)
            status = capture_host_check(raw, a->host_dst, "combine_partials destination");
        if (status == MF_SUCCESS && a->logprobs_dst)
            status = capture_host_check(raw, a->logprobs_dst, "combine_partials logprobs destination");
        if (status == MF_SUCCESS && a->fault_dst)
            status = capture_host_check(raw, a->fault_dst, "combine_partials fault destination");
        if (status != MF_SUCCESS) return status;
        if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_combine_partials(&copy, s); }))
            return MF_SUCCESS;
        Staged staged(raw, a->host_dst || a->logprobs_dst || a->fault_dst || event);
        status = ops().combine(a, raw);
        if (status == MF_SUCCESS && a->host_dst)
            status = ops().copy_async(a->host_dst, a->cells, cell_words * 4, kD2H, raw);
        if (status == MF_SUCCESS && a->logprobs_dst)
            status = ops().copy_async(a->logprobs_dst, a->logprobs, (size_t)a->rows * 4, kD2H, raw);
        if (status == MF_SUCCESS && a->fault_dst) status = ops().copy_async(a->fault_dst, a->fault, 4, kD2H, raw);
        if (status == MF_SUCCESS && event) status = ops().event_record(event->raw, (mf_stream_t)(uintptr_t)raw);
        return staged.close(status);
    });
}

mf_status mf_resolve_feed(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                          uint32_t *out, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        return mf_resolve_feed_flags(sources, n, cells, prev_rows, out, 0u, stream);
    });
}

mf_status mf_resolve_feed_flags(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                                uint32_t prev_rows, uint32_t *out, unsigned flags, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("resolve_feed");
        if (n == 0 || n > kMaxRows) return fail(MF_ERROR_INVALID_VALUE, "rows must be in [1, %u], got %u", kMaxRows, n);
        if (flags & ~(unsigned)MF_SOURCES_DEVICE) return fail(MF_ERROR_INVALID_VALUE, "unknown resolve flags 0x%x", flags);
        if (!sources) return fail(MF_ERROR_INVALID_VALUE, "sources is a null pointer");
        const bool on_device = flags & MF_SOURCES_DEVICE;
        mf_status status = MF_SUCCESS;
        if (on_device) {  // read when the kernel runs, which bounds from_row by prev_rows itself
            if (!aligned(sources, 4)) return fail(MF_ERROR_INVALID_VALUE, "sources pointer is misaligned");
            status = check_device_range(sources, (size_t)n * 4, "device-resident sources");
        } else {
            for (uint32_t i = 0; i < n; ++i) {
                uint32_t s = sources[i];
                if (!(s & MF_FEED_HOST_BIT) && s >= prev_rows)
                    return fail(MF_ERROR_INVALID_VALUE,
                                "source %u reads feed cell %u, beyond the previous step's %u rows", i, s, prev_rows);
            }
        }
        if (!aligned(cells, 4) || !aligned(out, 4))
            return fail(MF_ERROR_INVALID_VALUE, "cells or out pointer is misaligned");
        if (status == MF_SUCCESS && prev_rows) status = check_device_range(cells, (size_t)prev_rows * 4, "feed cells");
        if (status == MF_SUCCESS) status = check_device_range(out, (size_t)n * 4, "resolve output");
        if (status == MF_SUCCESS) {
            const Span spans[] = {{out, (size_t)n * 4, "resolve output", true},
                                  {cells, (size_t)prev_rows * 4, "feed cells", false},
                                  {on_device ? sources : nullptr, (size_t)n * 4, "device-resident sources", false}};
            status = refuse_overlaps(spans);
        }
        void *raw;
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS && !on_device)
            status = refuse_in_capture(raw, "resolve_feed with host-resident sources", true);
        if (status != MF_SUCCESS) return status;
        if (kept_for_graph(raw, [=](mf_stream_t s) {
                return mf_resolve_feed_flags(sources, n, cells, prev_rows, out, flags, s);
            }))
            return MF_SUCCESS;
        return ops().resolve(sources, n, cells, prev_rows, out, on_device, raw);
    });
}

mf_status mf_reference_forward(const mf_reference_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("reference_forward");
        mf_reference_args snapshot;
        mf_status status = read_descriptor(caller, &snapshot, "mf_reference_args", kReferenceSizes);
        if (status != MF_SUCCESS) return status;
        const mf_reference_args *a = &snapshot;
        if (!dtype_known(a->dtype)) return fail(MF_ERROR_INVALID_VALUE, "unknown logits dtype %d", (int)a->dtype);
        if (a->rows == 0 || a->rows > kMaxRows || a->vocab == 0 || a->vocab > kMaxVocab || a->block_size == 0)
            return fail(MF_ERROR_INVALID_VALUE, "reference forward: bad rows, vocab or block size");
        if (a->start > kMaxVocab - a->vocab)
            return fail(MF_ERROR_INVALID_VALUE, "reference forward: columns [%u, %llu) pass the largest vocabulary",
                        a->start, (unsigned long long)a->start + a->vocab);
        status = check_device_range(a->input_ids, (size_t)a->rows * 4, "input ids");
        if (status == MF_SUCCESS) status = check_device_range(a->meta, (size_t)a->rows * 8, "row meta");
        if (status == MF_SUCCESS && a->table_words == 0)
            status = fail(MF_ERROR_INVALID_VALUE, "block tables must hold at least one id");
        if (status == MF_SUCCESS)
            status = check_device_range(a->tables, (size_t)a->table_words * 4, "block tables");
        if (status == MF_SUCCESS) status = check_device_range(a->kv, (size_t)a->kv_slots * 4, "kv cache");
        if (status == MF_SUCCESS && a->logits)  // no logits: a prefill, KV writes only
            status = check_device_range(a->logits, (size_t)a->rows * a->vocab * dtype_size(a->dtype), "logits");
        const size_t advance_bytes =
            a->advance && a->advance_group ? ((size_t)a->rows + a->advance_group - 1) / a->advance_group * 4 : 0;
        if (status == MF_SUCCESS && a->advance && a->advance_group == 0)
            status = fail(MF_ERROR_INVALID_VALUE, "reference forward: advance_group must be at least 1 with advance");
        if (status == MF_SUCCESS && a->advance)
            status = check_device_range(a->advance, advance_bytes, "position advance");
        if (status == MF_SUCCESS) {
            const Span spans[] = {
                {a->kv, (size_t)a->kv_slots * 4, "kv cache", true},
                {a->logits, (size_t)a->rows * a->vocab * dtype_size(a->dtype), "logits", true},
                {a->input_ids, (size_t)a->rows * 4, "input ids", false},
                {a->meta, (size_t)a->rows * 8, "row meta", false},
                {a->tables, (size_t)a->table_words * 4, "block tables", false},
                {a->advance, advance_bytes, "position advance", false},
            };
            status = refuse_overlaps(spans);
        }
        void *raw;
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status != MF_SUCCESS) return status;
        if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_reference_forward(&copy, s); }))
            return MF_SUCCESS;
        return ops().reference_forward(a, raw);
    });
}


mf_status mf_verify_to_feed(const mf_verify_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("verify_to_feed");
        mf_verify_args copied;
        mf_status status = read_descriptor(caller, &copied, "mf_verify_args", kVerifySizes);
        if (status != MF_SUCCESS) return status;
        const mf_verify_args *args = &copied;
        void *raw;
        Slot *event;
        GrammarPick gp;
        status = check_verify(args, &gp, &event);
        mf_penalty_args pen_apply{}, pen_update{};
        const bool penalised = args->penalties != nullptr;
        if (status == MF_SUCCESS && penalised) status = verify_penalties(args, gp, &pen_apply, &pen_update);
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS && penalised && !(pen_apply.flags & MF_PENALTY_SLOTS_DEVICE))
            status = refuse_in_capture(raw, "verify_to_feed with penalties of host-resident slots", true);
        if (status == MF_SUCCESS && !(args->flags & MF_VERIFY_DRAFTS_DEVICE))
            status = refuse_in_capture(raw, "verify_to_feed with host-resident drafts", true);
        if (status == MF_SUCCESS && args->masks && !(args->flags & MF_ARGS_MASKS_DEVICE))
            status = refuse_in_capture(raw, "verify_to_feed with host-resident masks", true);
        if (status == MF_SUCCESS && args->params && !(args->flags & MF_ARGS_PARAMS_DEVICE))
            status = refuse_in_capture(raw, "verify_to_feed with host-resident params", true);
        if (status == MF_SUCCESS && args->host_dst)
            status = capture_host_check(raw, args->host_dst, "verify_to_feed destination");
        if (status == MF_SUCCESS && args->logprobs_dst)
            status = capture_host_check(raw, args->logprobs_dst, "verify_to_feed logprobs destination");
        if (status != MF_SUCCESS) return status;
        // A replay's copy owns its penalty and grammar descriptors: the caller's may be gone by then.
        if (kept_for_graph(raw, [copy = *args, pen = pen_apply, penalised, gram = gp.g, grammar = gp.on](
                                    mf_stream_t s) mutable {
                if (penalised) copy.penalties = &pen;
                if (grammar) copy.grammar = &gram;
                return mf_verify_to_feed(&copy, s);
            }))
            return MF_SUCCESS;
        mf_verify_args local = *args;
        if (!local.masks) local.masks = no_masks();  // rows * (k + 1) <= MF_MAX_ROWS unmasked rows
        if (gp.on) local.bitmask = gp.g.scratch;     // the mask's rows, the caller's bitmask ANDed in
        const size_t cell_bytes = (size_t)args->rows * (args->k + 2) * 4, lp_bytes = (size_t)args->rows * (args->k + 1) * 4;
        // The grammar's pieces (host drafts uploaded for its walk, the mask) before the kernel and its
        // advance after it, all ahead of the copies and the event record, which then covers the states.
        Staged staged(raw, penalised || gp.on || args->host_dst || args->logprobs_dst || event);
        status = MF_SUCCESS;
        if (gp.upload_bytes)
            status = ops().copy_async(gp.g.scratch + gp.mask_bytes / 4, args->drafts, gp.upload_bytes, kH2D, raw);
        if (status == MF_SUCCESS && gp.on) status = ops().grammar_mask(&gp.mask, raw);
        if (status == MF_SUCCESS && penalised && ops().verify_penalised) {
            status = ops().verify_penalised(&local, &pen_apply, raw);
        } else if (status == MF_SUCCESS) {
            status = penalised ? ops().penalties(&pen_apply, false, raw) : MF_SUCCESS;
            if (status == MF_SUCCESS) status = ops().verify(&local, raw);
            if (status == MF_SUCCESS && penalised) status = ops().penalties(&pen_update, true, raw);
        }
        if (status == MF_SUCCESS && gp.on) status = ops().grammar_advance(&gp.advance, raw);
        if (status == MF_SUCCESS && args->host_dst)
            status = ops().copy_async(args->host_dst, args->cells, cell_bytes, kD2H, raw);
        if (status == MF_SUCCESS && args->logprobs_dst)
            status = ops().copy_async(args->logprobs_dst, args->logprobs, lp_bytes, kD2H, raw);
        if (status == MF_SUCCESS && event) status = ops().event_record(event->raw, (mf_stream_t)(uintptr_t)raw);
        return staged.close(status);
    });
}

mf_status mf_resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                              uint32_t *out_advance, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("resolve_verified");
        if (mf_status st = check_verify_shape(rows, k); st != MF_SUCCESS) return st;
        if (!out_ids && !out_advance) return fail(MF_ERROR_INVALID_VALUE, "resolve_verified needs out_ids or out_advance");
        if (!cells || !aligned(cells, 4) || !aligned(out_ids, 4) || !aligned(out_advance, 4))
            return fail(MF_ERROR_INVALID_VALUE, "cells, out_ids or out_advance is a null or misaligned pointer");
        mf_status status = check_device_range(cells, (size_t)rows * (k + 2) * 4, "verify cells");
        if (status == MF_SUCCESS && out_ids) status = check_device_range(out_ids, (size_t)rows * 4, "out_ids");
        if (status == MF_SUCCESS && out_advance) status = check_device_range(out_advance, (size_t)rows * 4, "out_advance");
        if (status == MF_SUCCESS) {  // the kernel reads a row's cells while other rows write theirs
            const Span spans[] = {{out_ids, (size_t)rows * 4, "out_ids", true},
                                  {out_advance, (size_t)rows * 4, "out_advance", true},
                                  {cells, (size_t)rows * (k + 2) * 4, "verify cells", false}};
            status = refuse_overlaps(spans);
        }
        void *raw;
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status != MF_SUCCESS) return status;
        if (kept_for_graph(raw, [=](mf_stream_t s) { return mf_resolve_verified(cells, rows, k, out_ids, out_advance, s); }))
            return MF_SUCCESS;
        return ops().resolve_verified(cells, rows, k, out_ids, out_advance, raw);
    });
}

mf_status mf_verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows, uint32_t k,
                                 mf_sampling_params *out, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("verify_logit_params");
        if (mf_status st = check_verify_shape(rows, k); st != MF_SUCCESS) return st;
        if (!params || !out || !aligned(params, alignof(mf_sampling_params)) || !aligned(out, alignof(mf_sampling_params)) ||
            !aligned(advance, 4))
            return fail(MF_ERROR_INVALID_VALUE, "verify_logit_params: params, advance or out is a null or misaligned pointer");
        const size_t in_bytes = (size_t)rows * sizeof(mf_sampling_params), out_bytes = in_bytes * (k + 1);
        mf_status status = check_device_range(params, in_bytes, "params");
        if (status == MF_SUCCESS && advance) status = check_device_range(advance, (size_t)rows * 4, "advance");
        if (status == MF_SUCCESS) status = check_device_range(out, out_bytes, "out");
        if (status == MF_SUCCESS) {  // the kernel reads every row while it writes others
            const Span spans[] = {{out, out_bytes, "out", true}, {params, in_bytes, "params", false},
                                  {advance, advance ? (size_t)rows * 4 : 0, "advance", false}};
            status = refuse_overlaps(spans);
        }
        void *raw;
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status != MF_SUCCESS) return status;
        if (kept_for_graph(raw, [=](mf_stream_t s) { return mf_verify_logit_params(params, advance, rows, k, out, s); }))
            return MF_SUCCESS;
        return ops().verify_logit_params(params, advance, rows, k, out, raw);
    });
}

// Both penalty ops' descriptor, checked once (docs/penalties.md): its fields and ranges, for the
// two functions and for a pick that carries its step's penalties (mf_argmax_args.penalties, which
// then checks the overlaps of the whole call); `logit_bytes` gets the apply's span of logits.
static mf_status check_penalty_ranges(const mf_penalty_args *a, bool update, size_t *logit_bytes) {
    const char *name = update ? "penalties_update" : "penalties_apply";
    mf_status st;
    if (a->rows > kMaxRows) return fail(MF_ERROR_INVALID_VALUE, "%s: rows must be at most %u, got %u", name, kMaxRows, a->rows);
    if (a->flags & ~(uint32_t)MF_PENALTY_SLOTS_DEVICE)
        return fail(MF_ERROR_INVALID_VALUE, "%s: unknown flags %#x", name, a->flags);
    // A verify's rows (k > 0): rows * (k + 1) logit rows, and drafts for the apply's walk alone.
    const uint32_t k = a->k;
    if (k > MF_MAX_DRAFTS) return fail(MF_ERROR_INVALID_VALUE, "%s: k must be at most %u, got %u", name, MF_MAX_DRAFTS, k);
    if (k && (uint64_t)a->rows * (k + 1) > kMaxRows)
        return fail(MF_ERROR_INVALID_VALUE, "%s: rows x (k + 1) = %llu logit rows; at most %u", name,
                    (unsigned long long)a->rows * (k + 1), kMaxRows);
    if (update || !k) {
        if (a->drafts)
            return fail(MF_ERROR_INVALID_VALUE, "%s: drafts must be NULL %s", name,
                        update ? "(the update reads the verify's cells)" : "with k 0");
    } else if (!a->drafts || !aligned(a->drafts, 4)) {
        return fail(MF_ERROR_INVALID_VALUE, "%s: drafts is a null or misaligned pointer (k %u)", name, k);
    }
    if (a->slot_count == 0 || a->slot_count > MF_MAX_PENALTY_SLOTS)
        return fail(MF_ERROR_INVALID_VALUE, "%s: slot_count must be in [1, %u], got %u", name, MF_MAX_PENALTY_SLOTS, a->slot_count);
    if (a->table_cap == 0 || a->table_cap > MF_MAX_PENALTY_TABLE)
        return fail(MF_ERROR_INVALID_VALUE, "%s: table_cap must be in [1, %u], got %u", name, MF_MAX_PENALTY_TABLE, a->table_cap);
    if (a->item_cap == 0 || a->item_cap > 4 * MF_PENALTY_ITEMS)
        return fail(MF_ERROR_INVALID_VALUE, "%s: item_cap must be in [1, %u], got %u", name, 4 * MF_PENALTY_ITEMS, a->item_cap);
    const bool dslots = a->flags & MF_PENALTY_SLOTS_DEVICE;
    if (!a->slots || !a->state || !a->table || !a->items || !aligned(a->slots, 4) || !aligned(a->state, 4) ||
        !aligned(a->table, 4) || !aligned(a->items, 4))
        return fail(MF_ERROR_INVALID_VALUE, "%s: slots, state, table or items is a null or misaligned pointer", name);
    const size_t state_bytes = (size_t)a->slot_count * sizeof(mf_penalty_slot);
    const size_t table_bytes = (size_t)a->slot_count * a->table_cap * sizeof(mf_penalty_entry);
    const size_t item_bytes = (size_t)a->slot_count * a->item_cap * sizeof(mf_penalty_item);
    st = check_device_range(a->state, state_bytes, "penalty state");
    if (st == MF_SUCCESS) st = check_device_range(a->table, table_bytes, "penalty table");
    if (st == MF_SUCCESS) st = check_device_range(a->items, item_bytes, "penalty items");
    if (st == MF_SUCCESS && dslots) st = check_device_range(a->slots, (size_t)a->rows * 4, "device-resident slots");
    if (st == MF_SUCCESS && !update && k) st = check_device_range(a->drafts, (size_t)a->rows * k * 4, "drafts");
    if (st != MF_SUCCESS) return st;
    if (!dslots) {  // host slots: every one in range, none twice (two rows would race on it)
        std::vector<bool> seen(a->slot_count, false);
        for (uint32_t r = 0; r < a->rows; ++r) {
            const uint32_t s = a->slots[r];
            if (s == MF_NO_TOKEN) continue;
            if (s >= a->slot_count)
                return fail(MF_ERROR_INVALID_VALUE, "%s: row %u names slot %u; there are %u", name, r, s, a->slot_count);
            if (seen[s]) return fail(MF_ERROR_INVALID_VALUE, "%s: slot %u is named by two rows", name, s);
            seen[s] = true;
        }
    }
    *logit_bytes = 0;
    if (update) {
        if (!a->ids || !aligned(a->ids, 4)) return fail(MF_ERROR_INVALID_VALUE, "%s: ids is a null or misaligned pointer", name);
        st = check_device_range(a->ids, penalty_id_bytes(a), k ? "ids (the verify's cells)" : "ids");
    } else {
        if (!dtype_known(a->dtype)) return fail(MF_ERROR_INVALID_VALUE, "%s: unknown logits dtype %d", name, (int)a->dtype);
        if (a->vocab > kMaxVocab || a->start > kMaxVocab - a->vocab)
            return fail(MF_ERROR_INVALID_VALUE, "%s: columns [%u, %llu) pass the largest vocabulary (%u)", name, a->start,
                        (unsigned long long)a->start + a->vocab, kMaxVocab);
        if (a->row_stride < a->vocab)
            return fail(MF_ERROR_INVALID_VALUE, "%s: row_stride %llu is less than vocab %u", name,
                        (unsigned long long)a->row_stride, a->vocab);
        const size_t esize = dtype_size(a->dtype);
        const uint64_t logit_rows = (uint64_t)a->rows * (k + 1);
        if (logit_rows && a->vocab) {
            if (!a->logits || !aligned(a->logits, esize))
                return fail(MF_ERROR_INVALID_VALUE, "%s: logits is a null or misaligned pointer", name);
            const unsigned __int128 wide = ((unsigned __int128)(logit_rows - 1) * a->row_stride + a->vocab) * esize;
            if (wide > (unsigned __int128)(SIZE_MAX / 2))
                return fail(MF_ERROR_INVALID_VALUE, "%s: rows x row_stride spans more memory than exists", name);
            *logit_bytes = (size_t)wide;
            st = check_device_range(a->logits, *logit_bytes, "logits");
        }
    }
    return st;
}

// A penalty function's descriptor: its ranges, then no write of it over another of its spans.
static mf_status check_penalties(const mf_penalty_args *a, bool update) {
    size_t logit_bytes = 0;
    mf_status st = check_penalty_ranges(a, update, &logit_bytes);
    if (st != MF_SUCCESS) return st;
    const bool dslots = a->flags & MF_PENALTY_SLOTS_DEVICE;
    const Span spans[] = {
        {a->logits, logit_bytes, "logits", !update},
        {a->state, (size_t)a->slot_count * sizeof(mf_penalty_slot), "penalty state", update},
        {a->table, (size_t)a->slot_count * a->table_cap * sizeof(mf_penalty_entry), "penalty table", update},
        {a->items, (size_t)a->slot_count * a->item_cap * sizeof(mf_penalty_item), "penalty items", false},
        {dslots ? a->slots : nullptr, (size_t)a->rows * 4, "slots", false},
        {update ? a->ids : nullptr, update ? penalty_id_bytes(a) : 0, "ids", false},
        {update ? nullptr : a->drafts, (size_t)a->rows * a->k * 4, "drafts", false},
    };
    return refuse_overlaps(spans);
}

static mf_status penalties(const mf_penalty_args *caller, bool update, mf_stream_t stream) {
    mf_penalty_args copied;
    mf_status st = read_descriptor(caller, &copied, "mf_penalty_args", kPenaltySizes);
    if (st != MF_SUCCESS) return st;
    const mf_penalty_args *a = &copied;
    const bool dslots = a->flags & MF_PENALTY_SLOTS_DEVICE;
    st = check_penalties(a, update);
    void *raw;
    if (st == MF_SUCCESS) st = resolve_stream(stream, &raw);
    if (st == MF_SUCCESS && !dslots) st = refuse_in_capture(raw, update ? "penalties_update with host-resident slots"
                                                                          : "penalties_apply with host-resident slots", true);
    if (st != MF_SUCCESS) return st;
    if (kept_for_graph(raw, [copy = *a, update](mf_stream_t s) {
            return update ? mf_penalties_update(&copy, s) : mf_penalties_apply(&copy, s);
        }))
        return MF_SUCCESS;
    if (a->rows == 0 || (!update && a->vocab == 0)) return MF_SUCCESS;  // nothing to touch
    return ops().penalties(a, update, raw);
}

mf_status mf_penalties_apply(const mf_penalty_args *args, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("penalties_apply");
        return penalties(args, false, stream);
    });
}

mf_status mf_penalties_update(const mf_penalty_args *args, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("penalties_update");
        return penalties(args, true, stream);
    });
}

// The top logprobs of each row (docs/kernels.md, "Top logprobs"): the descriptor checked once here.
mf_status mf_top_logprobs(const mf_top_logprobs_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("top_logprobs");
        mf_top_logprobs_args copied;
        mf_status st = read_descriptor(caller, &copied, "mf_top_logprobs_args", kTopSizes);
        if (st != MF_SUCCESS) return st;
        const mf_top_logprobs_args *a = &copied;
        const bool partial = a->flags & MF_TOP_PARTIAL;
        if (a->flags & ~(uint32_t)MF_TOP_PARTIAL)
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: unknown flags 0x%x", a->flags);
        if (a->rows > kMaxRows) return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: rows must be at most %u, got %u", kMaxRows, a->rows);
        if (a->n > MF_MAX_TOP_LOGPROBS || (a->n == 0 && !a->ids))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: n must be in [1, %u] (0 only with ids), got %u",
                        MF_MAX_TOP_LOGPROBS, a->n);
        if (!partial && !a->ids != !a->chosen) return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: ids and chosen go together");
        if (partial && (a->out || a->chosen))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: a slice's call (MF_TOP_PARTIAL) writes its block, not out or chosen");
        if (!partial && (a->partials || a->vocab_total || a->start || a->call))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: partials, vocab_total, start and call are MF_TOP_PARTIAL's");
        if (!dtype_known(a->dtype)) return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: unknown logits dtype %d", (int)a->dtype);
        if ((a->vocab == 0 && !partial) || a->vocab > kMaxVocab)
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: vocab must be in [%u, %u], got %u", partial ? 0u : 1u,
                        kMaxVocab, a->vocab);
        if (partial && (a->vocab_total == 0 || a->vocab_total > kMaxVocab || a->start > a->vocab_total ||
                        a->vocab > a->vocab_total - a->start))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: the slice [%u, %u + %u) is not inside a vocabulary of %u "
                        "(at most %u)", a->start, a->start, a->vocab, a->vocab_total, kMaxVocab);
        if (a->row_stride < a->vocab)
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: row_stride %llu is less than vocab %u",
                        (unsigned long long)a->row_stride, a->vocab);
        if (a->rows == 0) return MF_SUCCESS;
        const size_t esize = dtype_size(a->dtype);
        const bool reads = a->vocab != 0;  // an empty slice reads no logits
        if ((reads && (!a->logits || !aligned(a->logits, esize))) || (!partial && a->n && (!a->out || !aligned(a->out, 4))) ||
            (a->ids && !aligned(a->ids, 4)) || (a->chosen && !aligned(a->chosen, 4)) ||
            (partial && (!a->partials || !aligned(a->partials, 8))))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: logits, out, ids, chosen or partials is a null or misaligned pointer");
        const unsigned __int128 wide = reads ? ((unsigned __int128)(a->rows - 1) * a->row_stride + a->vocab) * esize : 0;
        if (wide > (unsigned __int128)(SIZE_MAX / 2))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs: rows x row_stride spans more memory than exists");
        const size_t logit_bytes = (size_t)wide, out_bytes = partial ? 0 : (size_t)a->rows * a->n * sizeof(mf_top_logprob);
        const size_t id_bytes = a->ids ? (size_t)a->rows * 4 : 0;
        const size_t block_bytes = partial ? (size_t)mf_top_block_records(a->rows, a->n) * MF_PARTIAL_RECORD_BYTES : 0;
        if (reads) st = check_device_range(a->logits, logit_bytes, "logits");
        if (st == MF_SUCCESS && out_bytes) st = check_device_range(a->out, out_bytes, "out");
        if (st == MF_SUCCESS && a->ids) st = check_device_range(a->ids, id_bytes, "ids");
        if (st == MF_SUCCESS && a->chosen) st = check_device_range(a->chosen, id_bytes, "chosen");
        if (st == MF_SUCCESS && partial) st = check_device_range(a->partials, block_bytes, "partials");
        if (st == MF_SUCCESS) {
            const Span spans[] = {{reads ? a->logits : nullptr, logit_bytes, "logits", false},
                                  {a->out, out_bytes, "out", true},
                                  {a->ids, id_bytes, "ids", false},
                                  {a->chosen, a->chosen ? id_bytes : 0, "chosen", true},
                                  {a->partials, block_bytes, "partials", true}};
            st = refuse_overlaps(spans);
        }
        void *raw;
        if (st == MF_SUCCESS) st = resolve_stream(stream, &raw);
        if (st != MF_SUCCESS) return st;
        if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_top_logprobs(&copy, s); })) return MF_SUCCESS;
        return ops().top_logprobs(a, raw);
    });
}

// The top logprobs of a split vocabulary from gathered blocks (feed.h): checked once here.
mf_status mf_top_logprobs_combine(const mf_top_combine_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("top_logprobs_combine");
        mf_top_combine_args copied;
        mf_status st = read_descriptor(caller, &copied, "mf_top_combine_args", kTopCombineSizes);
        if (st != MF_SUCCESS) return st;
        const mf_top_combine_args *a = &copied;
        if (a->world == 0 || a->world > MF_MAX_SLICES)
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs_combine: world must be in [1, %u], got %u", MF_MAX_SLICES,
                        a->world);
        if (a->rows == 0 || a->rows > kMaxRows)
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs_combine: rows must be in [1, %u], got %u", kMaxRows, a->rows);
        if (a->n > MF_MAX_TOP_LOGPROBS || (a->n == 0 && !a->chosen))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs_combine: n must be in [1, %u] (0 only with chosen), got %u",
                        MF_MAX_TOP_LOGPROBS, a->n);
        if (a->vocab == 0 || a->vocab > kMaxVocab)
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs_combine: vocab must be in [1, %u], got %u", kMaxVocab, a->vocab);
        if (a->slice_stride < mf_top_block_records(a->rows, a->n))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs_combine: slice_stride %u records is less than a block of "
                        "%u rows of %u ids (%llu)", a->slice_stride, a->rows, a->n,
                        (unsigned long long)mf_top_block_records(a->rows, a->n));
        if (!a->partials || !aligned(a->partials, 8) || (a->n && (!a->out || !aligned(a->out, 4))) ||
            (!a->n && a->out) || (a->chosen && !aligned(a->chosen, 4)) || !a->fault || !aligned(a->fault, 4))
            return fail(MF_ERROR_INVALID_VALUE, "top_logprobs_combine: partials, out, chosen or fault is a null or "
                        "misaligned pointer");
        // world <= MF_MAX_SLICES and slice_stride < 2**32: the product fits 64 bits.
        const size_t part_bytes = (size_t)a->world * a->slice_stride * MF_PARTIAL_RECORD_BYTES;
        const size_t out_bytes = (size_t)a->rows * a->n * sizeof(mf_top_logprob);
        const size_t chosen_bytes = a->chosen ? (size_t)a->rows * 4 : 0;
        st = check_device_range(a->partials, part_bytes, "partials");
        if (st == MF_SUCCESS && a->n) st = check_device_range(a->out, out_bytes, "out");
        if (st == MF_SUCCESS && a->chosen) st = check_device_range(a->chosen, chosen_bytes, "chosen");
        if (st == MF_SUCCESS) st = check_device_range(a->fault, 4, "fault word");
        if (st == MF_SUCCESS && a->fault_dst) st = check_host_range(a->fault_dst, 4, "fault destination");
        if (st == MF_SUCCESS) {
            const Span spans[] = {{a->out, out_bytes, "out", true}, {a->chosen, chosen_bytes, "chosen", true}};
            st = refuse_combine_overlaps(spans, {a->partials, part_bytes, "partials", false},
                                         {a->fault, 4, "fault word", true}, {a->fault_dst, 4, "fault destination", true});
        }
        Slot *event = nullptr;
        if (st == MF_SUCCESS && a->event) st = resolve_event(a->event, &event);
        void *raw;
        if (st == MF_SUCCESS) st = resolve_stream(stream, &raw);
        if (st == MF_SUCCESS && a->fault_dst) st = capture_host_check(raw, a->fault_dst, "top_logprobs_combine fault destination");
        if (st != MF_SUCCESS) return st;
        if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_top_logprobs_combine(&copy, s); }))
            return MF_SUCCESS;
        Staged staged(raw, a->fault_dst || event);
        st = ops().top_combine(a, raw);
        if (st == MF_SUCCESS && a->fault_dst) st = ops().copy_async(a->fault_dst, a->fault, 4, kD2H, raw);
        if (st == MF_SUCCESS && event) st = ops().event_record(event->raw, (mf_stream_t)(uintptr_t)raw);
        return staged.close(st);
    });
}

// The decisions between a split row's filter stages (feed.h, select_rule.h): checked once here.
mf_status mf_select_decide(const mf_select_decide_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("select_decide");
        mf_select_decide_args copied;
        mf_status st = read_descriptor(caller, &copied, "mf_select_decide_args", kDecideSizes);
        if (st != MF_SUCCESS) return st;
        const mf_select_decide_args *a = &copied;
        if (a->select_row_bytes != sizeof(mf_select_row))
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: select_row_bytes is %u, not this build's "
                        "sizeof(mf_select_row) = %zu: set the descriptor up with mf_select_decide_args_init()",
                        a->select_row_bytes, sizeof(mf_select_row));
        const bool top = a->step == MF_DECIDE_TOP;
        if (!top && a->step != MF_DECIDE_ROUND)
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: unknown step %u", a->step);
        if (a->world == 0 || a->world > MF_MAX_SLICES || a->rank >= a->world)
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: world must be in [1, %u] and rank below it, got %u and %u",
                        MF_MAX_SLICES, a->world, a->rank);
        if (a->rows == 0 || a->rows > kMaxRows)
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: rows must be in [1, %u], got %u", kMaxRows, a->rows);
        if (top && (a->vocab == 0 || a->vocab > kMaxVocab))
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: vocab must be in [1, %u], got %u", kMaxVocab, a->vocab);
        const auto known = [](uint32_t sel) { return sel == MF_SELECT_K || sel == MF_SELECT_P; };
        if (!top && (!known(a->select_k_p) || a->round >= MF_SELECT_ROUNDS))
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: a round needs its select (MF_SELECT_K or _P) and a "
                        "round below %u, got %u and %u", MF_SELECT_ROUNDS, a->select_k_p, a->round);
        if (a->next && !known(a->next))
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: next must be 0, MF_SELECT_K or MF_SELECT_P, got %u", a->next);
        const uint32_t cap = a->rounds & MF_ROUNDS_CAP_MASK;
        if (a->rounds && (!top || !(a->rounds & MF_ROUNDS_FIXED) || cap > MF_SELECT_CANDS_MAX ||
                          (a->rounds & ~(MF_ROUNDS_FIXED | MF_ROUNDS_TOP_P | MF_ROUNDS_CAP_MASK))))
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: rounds 0x%x: a TOP decision's MF_ROUNDS_FIXED, a cap up "
                        "to %u and MF_ROUNDS_TOP_P, or 0", a->rounds, MF_SELECT_CANDS_MAX);
        // A block: the header, then a record (TOP) or a histogram (ROUND) a row.
        const uint64_t need = MF_PARTIAL_HEADER_BYTES + (uint64_t)a->rows * (top ? MF_PARTIAL_RECORD_BYTES : MF_SELECT_BINS * 8u);
        if (a->block_bytes < need || a->block_bytes % MF_PARTIAL_RECORD_BYTES ||
            a->block_bytes / MF_PARTIAL_RECORD_BYTES > UINT32_MAX || a->block_bytes > SIZE_MAX / 2 / a->world)
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: block_bytes %llu is not a whole number of 16-byte records "
                        "of at least %llu", (unsigned long long)a->block_bytes, (unsigned long long)need);
        if (!a->gathered || !aligned(a->gathered, 16) || !a->params || !aligned(a->params, 8) || !a->select ||
            !aligned(a->select, 8) || !a->plan || !aligned(a->plan, 8) || !a->fault || !aligned(a->fault, 4))
            return fail(MF_ERROR_INVALID_VALUE, "select_decide: gathered, params, select, plan or fault is a null or "
                        "misaligned pointer");
        const size_t rows = a->rows, gathered = (size_t)a->world * a->block_bytes;
        st = check_device_range(a->gathered, gathered, "gathered blocks");
        if (st == MF_SUCCESS) st = check_device_range(a->params, rows * sizeof(mf_sampling_params), "params");
        if (st == MF_SUCCESS) st = check_device_range(a->select, rows * sizeof(mf_select_row), "select state");
        if (st == MF_SUCCESS) st = check_device_range(a->plan, rows * sizeof(mf_select_plan), "select plan");
        if (st == MF_SUCCESS) st = check_device_range(a->fault, 4, "fault word");
        if (st == MF_SUCCESS) {
            const Span spans[] = {{a->gathered, gathered, "gathered blocks", false},
                                  {a->params, rows * sizeof(mf_sampling_params), "params", false},
                                  {a->select, rows * sizeof(mf_select_row), "select state", true},
                                  {a->plan, rows * sizeof(mf_select_plan), "select plan", true},
                                  {a->fault, 4, "fault word", true}};
            st = refuse_overlaps(spans);
        }
        void *raw;
        if (st == MF_SUCCESS) st = resolve_stream(stream, &raw);
        if (st != MF_SUCCESS) return st;
        if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_select_decide(&copy, s); })) return MF_SUCCESS;
        return ops().select_decide(a, raw);
    });
}

// ---- the device grammar's two ops (feed.h, "grammar"; their checks are above, with a pick's) ----

mf_status mf_grammar_mask(const mf_grammar_mask_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("grammar_mask");
        mf_grammar_mask_args copied;
        mf_status st = read_descriptor(caller, &copied, "mf_grammar_mask_args", kGrammarMaskSizes);
        if (st != MF_SUCCESS) return st;
        const mf_grammar_mask_args *a = &copied;
        const char *name = "grammar_mask";
        st = check_grammar_shape(name, a->rows, a->k);
        if (st == MF_SUCCESS) st = check_automaton(name, a->states, a->num_states, a->edges, a->num_edges, a->vocab);
        if (st != MF_SUCCESS) return st;
        if (!a->k != !a->drafts)
            return fail(MF_ERROR_INVALID_VALUE, "grammar_mask: drafts are given exactly when k > 0 (k = %u)", a->k);
        if (!a->state_words || !aligned(a->state_words, 4) || !aligned(a->drafts, 4) || !aligned(a->bitmask_in, 4) ||
            !a->bitmask_out || !aligned(a->bitmask_out, 4))
            return fail(MF_ERROR_INVALID_VALUE, "grammar_mask: state_words, drafts, bitmask_in or bitmask_out is a null "
                        "or misaligned pointer");
        const size_t rows = a->rows, mask_bytes = rows * (a->k + 1) * mf_bitmask_words(a->vocab) * 4;
        const size_t draft_bytes = rows * a->k * 4;
        st = check_device_range(a->state_words, rows * 4, "grammar state words");
        if (st == MF_SUCCESS && a->drafts) st = check_device_range(a->drafts, draft_bytes, "drafts");
        if (st == MF_SUCCESS && a->bitmask_in) st = check_device_range(a->bitmask_in, mask_bytes, "bitmask_in");
        if (st == MF_SUCCESS) st = check_device_range(a->bitmask_out, mask_bytes, "bitmask_out");
        if (st == MF_SUCCESS) {  // each block reads the state words, drafts and automaton while others write
            const Span spans[] = {{a->bitmask_out, mask_bytes, "bitmask_out", true},
                                  {a->bitmask_in, a->bitmask_in ? mask_bytes : 0, "bitmask_in", false},
                                  {a->state_words, rows * 4, "grammar state words", false},
                                  {a->drafts, a->drafts ? draft_bytes : 0, "drafts", false},
                                  {a->states, (size_t)a->num_states * sizeof(mf_grammar_state), "grammar states", false},
                                  {a->num_edges ? a->edges : nullptr, (size_t)a->num_edges * sizeof(mf_grammar_edge),
                                   "grammar edges", false}};
            st = refuse_overlaps(spans);
        }
        void *raw;
        if (st == MF_SUCCESS) st = resolve_stream(stream, &raw);
        if (st != MF_SUCCESS) return st;
        if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_grammar_mask(&copy, s); })) return MF_SUCCESS;
        return ops().grammar_mask(a, raw);
    });
}

mf_status mf_grammar_advance(const mf_grammar_advance_args *caller, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("grammar_advance");
        mf_grammar_advance_args copied;
        mf_status st = read_descriptor(caller, &copied, "mf_grammar_advance_args", kGrammarAdvanceSizes);
        if (st != MF_SUCCESS) return st;
        const mf_grammar_advance_args *a = &copied;
        const char *name = "grammar_advance";
        st = check_grammar_shape(name, a->rows, a->k);
        if (st == MF_SUCCESS) st = check_automaton(name, a->states, a->num_states, a->edges, a->num_edges, a->vocab);
        if (st != MF_SUCCESS) return st;
        if (!a->cells || !aligned(a->cells, 4) || !a->state_words || !aligned(a->state_words, 4))
            return fail(MF_ERROR_INVALID_VALUE, "grammar_advance: cells or state_words is a null or misaligned pointer");
        const size_t rows = a->rows, cell_bytes = rows * (a->k ? a->k + 2 : 1) * 4;
        st = check_device_range(a->cells, cell_bytes, "cells");
        if (st == MF_SUCCESS) st = check_device_range(a->state_words, rows * 4, "grammar state words");
        if (st == MF_SUCCESS) {  // a row's thread writes its word while others read the automaton and cells
            const Span spans[] = {{a->state_words, rows * 4, "grammar state words", true},
                                  {a->cells, cell_bytes, "cells", false},
                                  {a->states, (size_t)a->num_states * sizeof(mf_grammar_state), "grammar states", false},
                                  {a->num_edges ? a->edges : nullptr, (size_t)a->num_edges * sizeof(mf_grammar_edge),
                                   "grammar edges", false}};
            st = refuse_overlaps(spans);
        }
        void *raw;
        if (st == MF_SUCCESS) st = resolve_stream(stream, &raw);
        if (st != MF_SUCCESS) return st;
        if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_grammar_advance(&copy, s); }))
            return MF_SUCCESS;
        return ops().grammar_advance(a, raw);
    });
}

}  // extern "C"

// ---- record layouts (feed.h's MF_SAMPLING_PARAMS_FIELDS) ----
namespace {
// Whether a numpy format ("<f4", "<u8", ...) describes the C type T: its kind and its size.
template <class T>
constexpr bool numpy_format_is(const char *f) {
    return f[0] == '<' && f[1] == (std::is_floating_point<T>::value ? 'f' : std::is_signed<T>::value ? 'i' : 'u') &&
           f[2] - '0' == (int)sizeof(T) && f[3] == '\0';
}
#define MF_FIELD_CHECK_(ctype, name, format, meaning) \
    static_assert(numpy_format_is<ctype>(format), "mf_sampling_params." #name ": the format is not its C type's");
MF_SAMPLING_PARAMS_FIELDS(MF_FIELD_CHECK_)
#undef MF_FIELD_CHECK_
#define MF_FIELD_ENTRY_(ctype, name, format, meaning) \
    {#name, format, (uint32_t)offsetof(mf_sampling_params, name), (uint32_t)sizeof(ctype)},
const mf_record_field kSamplingFields[] = {MF_SAMPLING_PARAMS_FIELDS(MF_FIELD_ENTRY_)};
#undef MF_FIELD_ENTRY_
// The kernels read a row's record at a stride of 32 bytes in every backend (and Python's
// SAMPLING_PARAMS_DTYPE is this size): a field that grows it is a new release of the ABI.
static_assert(sizeof(mf_sampling_params) == 32, "mf_sampling_params is 32 bytes");
constexpr uint32_t kLayoutSizes[] = {sizeof(mf_record_layout)};
}  // namespace

extern "C" mf_status mf_sampling_params_layout(mf_record_layout *layout) {
    return guard([&]() -> mf_status {
        mf_record_layout out;
        const mf_status st = read_descriptor(layout, &out, "mf_record_layout", kLayoutSizes);
        if (st != MF_SUCCESS) return st;
        out.record_size = (uint32_t)sizeof(mf_sampling_params);
        out.count = (uint32_t)(sizeof kSamplingFields / sizeof kSamplingFields[0]);
        out.field_size = (uint32_t)sizeof(mf_record_field);
        out.fields = kSamplingFields;
        std::memcpy(layout, &out, out.struct_size);
        return MF_SUCCESS;
    });
}
