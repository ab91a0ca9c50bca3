#include "registry.hpp"

#include <cstdlib>
#include <map>
#include <mutex>

namespace mf {
namespace {
std::mutex g_slot_mutex;

struct Allocation {
    size_t nbytes;
    mf_mem_kind kind;
};
std::mutex g_alloc_mutex;
std::map<uintptr_t, Allocation> g_allocs;
uint64_t g_alloc_bytes[3] = {0, 0, 0};
}  // namespace

Slot *SlotTable::slot_at(uint32_t index) const {
    Slot *chunk = chunks_[index >> kChunkBits].load(std::memory_order_acquire);
    return chunk ? &chunk[index & ((1u << kChunkBits) - 1u)] : nullptr;
}

uint64_t SlotTable::insert(void *raw, uint32_t flags, bool owned) {
    std::lock_guard<std::mutex> lock(g_slot_mutex);
    uint32_t index;
    if (free_len_ > 0) {
        index = free_[--free_len_];
    } else {
        if (next_ >= (kChunks << kChunkBits)) return 0;
        index = next_++;
        if (!chunks_[index >> kChunkBits].load(std::memory_order_relaxed))
            chunks_[index >> kChunkBits].store(new Slot[1u << kChunkBits], std::memory_order_release);
    }
    Slot *slot = slot_at(index);
    slot->raw = raw;
    slot->flags = flags;
    slot->owned = owned;
    uint32_t generation = slot->generation.load(std::memory_order_relaxed) + 1u;
    if (generation == 0) generation = 1;  // a handle is never 0
    slot->generation.store(generation, std::memory_order_relaxed);
    slot->live.store(true, std::memory_order_release);
    live_.fetch_add(1, std::memory_order_relaxed);
    return ((uint64_t)generation << 32) | (uint64_t)(index + 1u);
}

Slot *SlotTable::find(uint64_t handle) const {
    uint32_t low = (uint32_t)handle;
    if (low == 0 || low > (kChunks << kChunkBits)) return nullptr;
    Slot *slot = slot_at(low - 1u);
    if (!slot || !slot->live.load(std::memory_order_acquire)) return nullptr;
    if (slot->generation.load(std::memory_order_relaxed) != (uint32_t)(handle >> 32)) return nullptr;
    return slot;
}

bool SlotTable::erase(uint64_t handle, Slot *out) {
    std::lock_guard<std::mutex> lock(g_slot_mutex);
    Slot *slot = find(handle);
    if (!slot) return false;
    out->raw = slot->raw;
    out->flags = slot->flags;
    out->owned = slot->owned;
    slot->live.store(false, std::memory_order_release);
    live_.fetch_sub(1, std::memory_order_relaxed);
    if (free_len_ == free_cap_) {
        uint32_t cap = free_cap_ ? free_cap_ * 2 : 64;
        uint32_t *grown = (uint32_t *)std::realloc(free_, cap * sizeof *grown);
        if (!grown) return true;  // the slot is simply not reused
        free_ = grown;
        free_cap_ = cap;
    }
    free_[free_len_++] = (uint32_t)handle - 1u;
    return true;
}

SlotTable &event_table() {
    static SlotTable table;
    return table;
}

SlotTable &stream_table() {
    static SlotTable table;
    return table;
}

void alloc_insert(void *ptr, size_t nbytes, mf_mem_kind kind) {
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    g_allocs[(uintptr_t)ptr] = Allocation{nbytes, kind};
    g_alloc_bytes[kind] += nbytes;
}

bool alloc_erase(void *ptr, mf_mem_kind kind, size_t *nbytes) {
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    auto it = g_allocs.find((uintptr_t)ptr);
    if (it == g_allocs.end() || it->second.kind != kind) return false;
    if (nbytes) {
        if (*nbytes != it->second.nbytes) {
            *nbytes = it->second.nbytes;
            return false;
        }
    }
    g_alloc_bytes[kind] -= it->second.nbytes;
    g_allocs.erase(it);
    return true;
}

mf_mem_kind alloc_lookup(const void *ptr, size_t *bytes_left) {
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    uintptr_t p = (uintptr_t)ptr;
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return MF_MEM_UNKNOWN;
    --it;
    // A zero-byte allocation still owns its own address.
    if (p >= it->first && (p < it->first + it->second.nbytes || p == it->first)) {
        if (bytes_left) *bytes_left = it->first + it->second.nbytes - p;
        return it->second.kind;
    }
    return MF_MEM_UNKNOWN;
}

uint64_t alloc_live_bytes(mf_mem_kind kind) {
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    return g_alloc_bytes[kind];
}

uint64_t alloc_live_count() {
    std::lock_guard<std::mutex> lock(g_alloc_mutex);
    return g_allocs.size();
}

}  // namespace mf
