// The host sampler's AVX2 helpers against the scalar rule they stand for, bit for bit: the
// vector Philox against philox.h, and exp_neg8 against sample_rule.h's mf_exp_neg. Built and run
// by tests/test_sampling.py (x86-64 with AVX2 only). The helpers live in an anonymous namespace,
// so this file includes their translation unit.
#include "host/sample_host.cpp"

#include <cstdio>

namespace mf::host {
uint32_t argmax_row(const void *, mf_dtype, uint32_t, const mf_row_rule *) { return 0; }  // unused
}  // namespace mf::host

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
