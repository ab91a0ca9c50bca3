// Sampling one row on the CPU, under sample_rule.h. The filters are thresholds on the packed word
// (logit key, ~id) found by a radix select over the candidates, narrowed digit by digit; the
// race then draws Philox noise only for survivors within MF_GUMBEL_BOUND of the best score so far
// (the others cannot win), which is what keeps sampling near the cost of the argmax.
#include <vector>

#include "kernels.hpp"
#include "metrale_feed/sample_rule.h"

namespace mf::host {
namespace {

struct Cand {
    uint64_t packed;  // mf_pack(logit key, id)
    uint64_t weight;  // what the select counts: 1 (top_k) or the mass (top_p)
};

// The smallest packed threshold t such that the candidates with packed >= t weigh >= target
// (1 <= target <= their total weight). Consumes `c`.
uint64_t radix_select(std::vector<Cand> &c, uint64_t target) {
    uint64_t above = 0, prefix = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        uint64_t bins[256] = {0};
        for (const Cand &x : c) bins[(x.packed >> shift) & 0xFFu] += x.weight;
        const uint32_t digit = mf_select_digit(bins, &above, target);
        prefix |= (uint64_t)digit << shift;
        size_t kept = 0;
        for (const Cand &x : c)
            if (((x.packed >> shift) & 0xFFu) == digit) c[kept++] = x;
        c.resize(kept);
    }
    return prefix;
}

}  // namespace

uint32_t sample_row(const void *row, mf_dtype dtype, uint32_t vocab, const mf_row_rule *rule,
                    const mf_sampling_params &params) {
    const mf_sample_plan p = mf_plan_sampling(&params);
    const int dt = (int)dtype;
    // Pass 1: the greatest finite candidate (its packed word) and how many there are.
    uint64_t top = 0;
    uint32_t count = 0;
    const mf_spans spans = mf_candidate_spans(vocab, rule->m0, rule->m1);
    thread_local std::vector<uint32_t> ids;  // the finite candidates, ascending
    ids.clear();
    for (uint32_t s = 0; s < spans.count; ++s)
        for (uint32_t i = spans.lo[s]; i < spans.hi[s]; ++i) {
            const uint32_t bits = mf_logit_bits(row, dt, i);
            if (!mf_finite_bits(bits) || !mf_bit_allowed(rule->bits, i)) continue;
            top = mf_pack_max(top, mf_pack(mf_key_f32(bits), i));
            ids.push_back(i);
        }
    count = (uint32_t)ids.size();
    if (count == 0) return MF_NO_TOKEN;
    const uint32_t top_id = mf_unpack_id(top);
    const float zmax = mf_fdiv(mf_from_bits(mf_logit_bits(row, dt, top_id)), p.temperature);
    if (!mf_finite_bits(mf_to_bits(zmax))) return top_id;  // temperature too small to matter

    auto z_of = [&](uint32_t i) { return mf_fdiv(mf_from_bits(mf_logit_bits(row, dt, i)), p.temperature); };
    auto packed_of = [&](uint32_t i) { return mf_pack(mf_key_f32(mf_logit_bits(row, dt, i)), i); };

    uint64_t threshold = 0;  // survivors: packed >= threshold
    thread_local std::vector<Cand> cand;
    if (p.top_k && count > p.top_k) {
        cand.clear();
        for (uint32_t i : ids) cand.push_back(Cand{packed_of(i), 1});
        threshold = radix_select(cand, p.top_k);
    }
    if (p.use_top_p) {
        cand.clear();
        uint64_t total = 0;
        for (uint32_t i : ids) {
            const uint64_t packed = packed_of(i);
            if (packed < threshold) continue;
            const uint64_t mass = mf_mass(mf_exp_neg(mf_fsub(z_of(i), zmax)));
            total += mass;
            cand.push_back(Cand{packed, mass});
        }
        threshold = radix_select(cand, mf_top_p_target(total, p.top_p));
    }
    // The race, the greatest logit first: its score bounds which others can still win.
    const float g_top = mf_gumbel(p.seed, p.position, top_id);
    uint64_t best = mf_pack(mf_key_f32(mf_to_bits(mf_fadd(zmax, g_top))), top_id);
    float best_score = mf_fadd(zmax, g_top);
    for (uint32_t i : ids) {
        if (i == top_id) continue;
        const float z = z_of(i);
        // score = z + g <= z + MF_GUMBEL_BOUND (rounding is monotone): below the best, it cannot win.
        if (mf_fadd(z, MF_GUMBEL_BOUND) < best_score) continue;
        if (threshold && packed_of(i) < threshold) continue;
        if (p.use_min_p && !(mf_exp_neg(mf_fsub(z, zmax)) >= p.min_p)) continue;
        const float score = mf_fadd(z, mf_gumbel(p.seed, p.position, i));
        const uint64_t packed = mf_pack(mf_key_f32(mf_to_bits(score)), i);
        if (packed > best) {
            best = packed;
            best_score = score;
        }
    }
    return mf_unpack_id(best);
}

}  // namespace mf::host
