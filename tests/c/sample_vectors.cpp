// The host sampler's AVX2 helpers against the scalar rule they stand for, bit for bit: the
// vector Philox against philox.h, exp_neg8 against sample_rule.h's mf_exp_neg, and log_pos8 and
// gumbel8 against its mf_log_pos and mf_gumbel. Built and run
// by tests/test_sampling.py (x86-64 with AVX2 only). The helpers are header-only.
#include <cstdio>
#include <initializer_list>

#include "host/vec_exp.hpp"
#include "host/vec_philox.hpp"
#include "metrale_feed/feed.h"
#include "metrale_feed/sample_rule.h"

__attribute__((target("avx2"))) static int run() {
    using namespace mf::host;
    long bad = 0, checked = 0;
    for (uint64_t seed : {0ull, 1ull, 0x123456789ABCDEFull, ~0ull})
        for (uint32_t pos : {0u, 7u, 0xFFFFFFFFu}) {
            const PhiloxKeys k = philox_keys(seed);
            for (uint32_t i = 0; i < 8192; i += 32) {
                __m256i out[4];
                philox32(k, pos, i, out);
                alignas(32) uint32_t w[32];
                for (int j = 0; j < 4; ++j) _mm256_store_si256((__m256i *)(w + 8 * j), out[j]);
                for (uint32_t j = 0; j < 32; ++j, ++checked) bad += w[j] != mf_philox_bits(seed, pos, i + j);
            }
        }
    for (int n = 0; n < 1000000; ++n, ++checked) {  // [-100, 2]: out of range, subnormal edge, > 0
        const float x = -100.0f + (float)n * 1.02e-4f;
        alignas(32) float r[8];
        _mm256_store_ps(r, exp_neg8(_mm256_set1_ps(x)));
        bad += mf_to_bits(r[0]) != mf_to_bits(mf_exp_neg(x));
    }
    // log_pos8 over normal floats: (0, 1) densely (the race's two logs), then every binade's
    // edges around sqrt(2) and 1, up to FLT_MAX.
    for (uint32_t b = 0x00800000u; b < 0x7F800000u; b += 0x3FFu, ++checked) {
        alignas(32) float r[8];
        _mm256_store_ps(r, log_pos8(_mm256_set1_ps(mf_from_bits(b))));
        bad += mf_to_bits(r[0]) != mf_to_bits(mf_log_pos(mf_from_bits(b)));
    }
    for (uint32_t e = 1; e < 255; ++e)
        for (uint32_t m : {0u, 1u, 0x3504F2u, 0x3504F3u, 0x3504F4u, 0x7FFFFFu}) {
            const float x = mf_from_bits(e << 23 | m);
            alignas(32) float r[8];
            _mm256_store_ps(r, log_pos8(_mm256_set1_ps(x)));
            bad += mf_to_bits(r[0]) != mf_to_bits(mf_log_pos(x));
            ++checked;
        }
    // gumbel8 of Philox words, the extremes of the uniform included.
    for (uint64_t seed : {3ull, 0xFEEDull})
        for (uint32_t i = 0; i < 65536; i += 32) {
            __m256i out[4];
            philox32(philox_keys(seed), 9u, i, out);
            for (int j = 0; j < 4; ++j) {
                alignas(32) float r[8];
                _mm256_store_ps(r, gumbel8(out[j]));
                for (uint32_t l = 0; l < 8; ++l, ++checked)
                    bad += mf_to_bits(r[l]) != mf_to_bits(mf_gumbel(seed, 9u, i + 8 * j + l));
            }
        }
    for (uint32_t w : {0u, 0xFFu, 0x100u, 0xFFFFFF00u, 0xFFFFFFFFu, 0x80000000u}) {
        alignas(32) float r[8];
        _mm256_store_ps(r, gumbel8(_mm256_set1_epi32((int)w)));
        const float u = mf_uniform(w);
        bad += mf_to_bits(r[0]) != mf_to_bits(-mf_log_pos(-mf_log_pos(u)));
        ++checked;
    }
    std::printf("checked %ld, mismatches %ld\n", checked, bad);
    return bad != 0;
}

int main() {
    if (!__builtin_cpu_supports("avx2")) {
        std::printf("no avx2\n");
        return 77;
    }
    return run();
}
