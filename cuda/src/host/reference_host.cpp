// The reference model's forward on the CPU: the same per-row steps as reference_forward.cu.
#include <cstring>

#include "kernels.hpp"
#include "metrale_feed/argmax_rule.h"
#include "queue.hpp"

namespace mf::host {
namespace {
// The KV slot of position `pos` through the table at `offset`, or kv_slots (outside the cache)
// when the table entry lies past the tables: corrupt row metadata reads nothing it does not own.
uint64_t slot_of(const mf_reference_args &a, uint32_t offset, uint32_t pos) {
    uint64_t entry = (uint64_t)offset + pos / a.block_size;
    if (entry >= a.table_words) return a.kv_slots;
    return (uint64_t)a.tables[entry] * a.block_size + pos % a.block_size;
}
}  // namespace

void run_reference_forward(const mf_reference_args &a) {
    parallel_rows(a.rows, [&](uint32_t begin, uint32_t end) {
        for (uint32_t r = begin; r < end; ++r) {
            uint32_t pos = a.meta[2 * r], offset = a.meta[2 * r + 1];
            if (a.advance) pos += a.advance[r / a.advance_group];  // wraps as uint32, as on the GPU
            if (!a.logits) {  // prefill: the write alone
                uint64_t slot = slot_of(a, offset, pos);
                if (slot < a.kv_slots) a.kv[slot] = a.input_ids[r];
                continue;
            }
            // As the CUDA kernel: a table pointing past the cache writes nothing and reads NO_TOKEN;
            // a position past the cache's size has no history in it at all.
            uint32_t h = MF_FNV_OFFSET;
            for (uint64_t t = 0; t <= pos && pos < a.kv_slots; ++t) {
                uint64_t slot = slot_of(a, offset, (uint32_t)t);
                bool inside = slot < a.kv_slots;
                if (inside && t == pos) a.kv[slot] = a.input_ids[r];
                h = mf_fnv_step(h, inside ? a.kv[slot] : MF_NO_TOKEN);
            }
            for (uint32_t v = 0; v < a.vocab; ++v) {
                float logit = mf_reference_logit(h, a.start + v);
                uint32_t bits;
                std::memcpy(&bits, &logit, 4);
                size_t at = (size_t)r * a.vocab + v;
                if (a.dtype == MF_DTYPE_F32)
                    ((uint32_t *)a.logits)[at] = bits;
                else
                    ((uint16_t *)a.logits)[at] =
                        a.dtype == MF_DTYPE_BF16 ? mf_f32_to_bf16(bits) : mf_f32_to_f16(bits);
            }
        }
    });
}

}  // namespace mf::host
