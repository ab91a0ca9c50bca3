// Speculative verification on the CPU (verify_rule.h): each row's positions in order, each under
// the machinery of one argmax or sample row (argmax_row, sample_row, sample_target), until the
// first position that emits an id of its own.

#include "kernels.hpp"
#include "metrale_feed/logprob_rule.h"
#include "metrale_feed/verify_rule.h"
#include "queue.hpp"

namespace mf::host {
namespace {

struct Position {
    const void *row;
    mf_dtype dtype;
    uint32_t vocab;
    const mf_row_rule *rule;
};

bool candidate(const Position &at, uint32_t i, uint32_t *bits) {
    return i < at.vocab && mf_candidate(at.row, (int)at.dtype, at.rule, i, bits);
}

// The race over the survivors other than x. sample_row's winner over all of them is also the
// winner without x unless it is x; only then is the race run again here, skipping x (scalar: the
// scores are sample_rule.h's, so the GPU's race over the same ids gives the same id).
uint32_t residual_draw(const Position &at, const mf_sampling_params &params, const SampleTarget &t, uint32_t x,
                       bool vector) {
    const uint32_t w = sample_row(at.row, at.dtype, at.vocab, at.rule, params, vector);
    if (w != x) return w;
    const mf_sample_plan p = mf_plan_sampling(&params);
    uint64_t best = 0;
    float best_score = mf_neg_inf();
    for (uint32_t i = 0; i < at.vocab; ++i) {
        uint32_t bits;
        if (i == x || !candidate(at, i, &bits) || !mf_survives(bits, i, t.threshold, &p, t.zmax)) continue;
        const float z = mf_scaled(bits, p.inv_t);
        if (best && mf_fadd(z, MF_GUMBEL_BOUND) < best_score) continue;  // cannot win (sample_rule.h)
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, i));
        const uint64_t packed = mf_pack(mf_key_f32(mf_to_bits(score)), i);
        if (packed > best) {
            best = packed;
            best_score = score;
        }
    }
    return mf_unpack_id(best);  // NO_TOKEN when x was the only survivor (then x was accepted)
}

// The draw from max(0, p - q), renormalised, after a rejection under a general draft
// distribution q (verify_rule.h): the race over the survivors' positive residual weights. None
// positive (q covers p everywhere, which a rejection all but rules out): sample_to_feed's draw.
uint32_t residual_draw_q(const Position &at, const mf_sampling_params &params, const SampleTarget &t,
                         uint64_t total, const float *q, bool vector) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    uint64_t best = 0;
    for (uint32_t i = 0; i < at.vocab; ++i) {
        uint32_t bits;
        if (!candidate(at, i, &bits) || !mf_survives(bits, i, t.threshold, &p, t.zmax)) continue;
        const float w = mf_verify_residual(mf_verify_p(mf_survivor_mass(bits, p.inv_t, t.zmax), total), mf_verify_q(q[i]));
        if (w == 0.0f) continue;
        const float score = mf_verify_residual_score(w, p.seed, p.position, i);
        best = mf_pack_max(best, mf_pack(mf_key_f32(mf_to_bits(score)), i));
    }
    return best ? mf_unpack_id(best) : sample_row(at.row, at.dtype, at.vocab, at.rule, params, vector);
}

// One sampled position with draft x (x == NO_TOKEN: the bonus position, no draft) and the
// drafter's distribution q there (NULL: one-hot at x). Returns whether x is accepted; else *emit
// is the position's own id.
bool sampled_position(const Position &at, const mf_sampling_params &params, uint32_t x, const float *q,
                      bool vector, uint32_t *emit) {
    if (x == MF_NO_TOKEN) {
        *emit = sample_row(at.row, at.dtype, at.vocab, at.rule, params, vector);
        return false;
    }
    const SampleTarget t = sample_target(at.row, at.dtype, at.vocab, at.rule, params, vector);
    if (!t.top) {
        *emit = MF_NO_TOKEN;
        return false;
    }
    const mf_sample_plan p = mf_plan_sampling(&params);
    const bool exact = !mf_finite_bits(mf_to_bits(t.zmax));  // p is one-hot at the top, whatever q is
    uint64_t mass_x = 0, total = 0;
    if (!exact) {
        uint32_t bits;
        if (candidate(at, x, &bits) && mf_survives(bits, x, t.threshold, &p, t.zmax))
            mass_x = mf_survivor_mass(bits, p.inv_t, t.zmax);
        // A one-hot draft that is no survivor is rejected whatever the total: skip the pass.
        if (mass_x || q) total = survivor_mass(at.row, at.dtype, at.vocab, at.rule, params, t, vector);
    }
    const uint32_t top_id = mf_unpack_id(t.top);
    if (exact || !q) {
        if (mf_verify_accepts(exact, top_id, x, p.seed, p.position, mass_x, total)) return true;
        *emit = exact ? top_id : residual_draw(at, params, t, x, vector);
        return false;
    }
    if (mf_verify_accepts_q(p.seed, p.position, mf_verify_p(mass_x, total), mf_verify_q(x < at.vocab ? q[x] : 0.0f)))
        return true;
    *emit = residual_draw_q(at, params, t, total, q, vector);
    return false;
}

}  // namespace

void run_verify(const VerifyJob &job) {
    const mf_verify_args &a = job.args;
    const size_t row_bytes = (size_t)a.row_stride * mf_dtype_size((int)a.dtype);
    const uint32_t words = mf_bitmask_words(a.vocab), k = a.k;
    const uint32_t *masks = job.mask_words();
    const uint32_t *drafts = job.draft_ids();
    const mf_sampling_params *params = job.row_params();
    const bool vector = vector_paths();
    // The step's penalties in the same pass (Ops::verify_penalised): each logit row's just before
    // the verify first reads it, and those of the positions a row never reads after its own, so
    // the logits end as mf_penalties_apply leaves them. The ids a row's penalties touch are
    // scattered over it, a cache miss each: the lines of the next logit row to apply are asked
    // for right after this one's apply, so they arrive while the verify streams this row.
    const mf_penalty_args *pen = job.penalties ? &job.penalties->args : nullptr;  // NULL: none
    const uint32_t *pen_slots = job.penalties ? job.penalties->slot_words() : nullptr;
    auto apply = [&](uint32_t r, uint32_t j, uint32_t end) {
        apply_verify_penalties_row(*pen, r, j, pen_slots[r]);
        const uint32_t next = j < k ? r : r + 1;  // the next logit row this thread applies
        if (next < end && pen_slots[next] < pen->slot_count)
            prefetch_penalties_row(*pen, next * (k + 1) + (j < k ? j + 1 : 0), pen_slots[next]);
    };
    // A greedy float32 row takes its penalties inside its argmax's one pass instead, a chunk at a
    // time on the lines the pass has just read (argmax_penalised_row): no miss of their own, nothing
    // to ask for ahead. The descriptor names the verify's own logits, as the call makes it.
    const bool chunked = pen && chunked_penalties(*pen) && pen->logits == a.logits && pen->vocab == a.vocab &&
                         pen->row_stride == a.row_stride && pen->start == 0u;
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        IeeeFpGuard ieee;  // the sampler's arithmetic needs subnormals on every pool thread
        uint32_t ids[MF_MAX_DRAFTS + 1];  // no allocation on the worker, but the chunks' sort
        PenaltyChunks chunks;             // the first chunked row's; reused by the others
        for (uint32_t r = begin; r < end; ++r) {
            const uint32_t *x = drafts + (size_t)r * k;
            const uint32_t d = mf_verify_drafts(x, k);
            const bool sampled = params && params[r].temperature > 0.0f && params[r].temperature <= 3.4e38f;
            const mf_sampling_params row_params = sampled ? mf_verify_row_params(&params[r], a.advance, r) : mf_sampling_params{};
            const bool penalised = pen && pen_slots[r] < pen->slot_count;  // NO_TOKEN: no penalties
            const bool in_pass = penalised && chunked && !sampled;  // the penalties in the argmax's pass
            if (in_pass) sort_penalty_chunks(*pen, pen_slots[r], chunks);
            uint32_t n = 0;
            for (uint32_t j = 0; j <= d; ++j) {
                if (penalised && !in_pass) apply(r, j, end);
                const size_t lr = (size_t)r * (k + 1) + j;
                const mf_row_rule rule{masks[2 * lr], masks[2 * lr + 1], a.bitmask ? a.bitmask + lr * words : nullptr};
                const Position at{(const char *)a.logits + lr * row_bytes, a.dtype, a.vocab, &rule};
                const uint32_t draft = j < d ? x[j] : MF_NO_TOKEN;
                uint32_t emit;
                bool accepted;
                if (sampled) {
                    const float *q = a.draft_probs && j < d ? a.draft_probs + ((size_t)r * k + j) * a.vocab : nullptr;
                    accepted = sampled_position(at, mf_verify_params_at(&row_params, j), draft, q, vector, &emit);
                } else {
                    emit = in_pass ? argmax_penalised_row(*pen, chunks, r, j, pen_slots[r], &rule)
                                   : argmax_row(at.row, a.dtype, a.vocab, &rule);
                    accepted = mf_verify_accepts(1, emit, draft, 0u, 0u, 0u, 0u);
                }
                ids[n++] = accepted ? draft : emit;
                if (!accepted) break;
            }
            for (uint32_t j = n; penalised && j <= k; ++j) apply(r, j, end);
            mf_verify_write_cells(a.cells + (size_t)r * (k + 2), k, ids, n);
            if (!a.logprobs) continue;
            for (uint32_t i = 0; i < k + 1; ++i) {
                float lp = mf_nan();
                if (i < n) {
                    const void *row = (const char *)a.logits + ((size_t)r * (k + 1) + i) * row_bytes;
                    const RowStats st = row_stats(row, a.dtype, a.vocab, vector);
                    const uint32_t bits = ids[i] == MF_NO_TOKEN ? 0u : mf_logit_bits(row, (int)a.dtype, ids[i]);
                    lp = mf_logprob_finish(ids[i], bits, st.m, st.s);
                }
                a.logprobs[(size_t)r * (k + 1) + i] = lp;
            }
        }
    });
    if (pen) {  // the update, with this verify's cells
        mf_penalty_args update = *pen;
        update.drafts = nullptr;
        update.ids = a.cells;
        count_penalties(update, pen_slots);
    }
}

void run_resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                          uint32_t *out_advance) {
    for (uint32_t r = 0; r < rows; ++r) {
        uint32_t id, n;
        mf_verify_resolve(cells + (size_t)r * (k + 2), k, &id, &n);
        if (out_ids) out_ids[r] = id;
        if (out_advance) out_advance[r] = n;
    }
}

void run_verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows, uint32_t k,
                             mf_sampling_params *out) {
    for (uint32_t i = 0; i < rows * (k + 1); ++i) out[i] = mf_verify_logit_row_params(params, advance, k, i);
}

}  // namespace mf::host
