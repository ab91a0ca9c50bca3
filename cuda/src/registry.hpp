// Ledgers of what this layer handed out, so a destroyed, freed or unknown handle or pointer is an
// error instead of a crash.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "metrale_feed/feed.h"

namespace mf {

// Generation-checked slots: handle = (generation << 32) | (index + 1). A lookup is two loads and
// no lock, so validating an event on the hot path is cheap; create and destroy take a mutex.
struct Slot {
    std::atomic<uint32_t> generation{0};
    std::atomic<bool> live{false};
    void *raw = nullptr;
    uint32_t flags = 0;
    bool owned = true;
};

class SlotTable {
public:
    uint64_t insert(void *raw, uint32_t flags, bool owned);  // 0 when full
    Slot *find(uint64_t handle) const;                       // nullptr when not live
    bool erase(uint64_t handle, Slot *out);                  // copies the slot out
    uint64_t live_count() const { return live_.load(std::memory_order_relaxed); }

private:
    static constexpr uint32_t kChunkBits = 12, kChunks = 256;
    Slot *slot_at(uint32_t index) const;
    std::atomic<Slot *> chunks_[kChunks] = {};
    std::atomic<uint64_t> live_{0};
    uint32_t next_ = 0;      // guarded by the table mutex (registry.cpp)
    uint32_t *free_ = nullptr;
    uint32_t free_len_ = 0, free_cap_ = 0;
};

SlotTable &event_table();
SlotTable &stream_table();

// Allocations by address, for range checks on copies and exact frees.
void alloc_insert(void *ptr, size_t nbytes, mf_mem_kind kind);
bool alloc_erase(void *ptr, mf_mem_kind kind, size_t *nbytes);  // false: not such an allocation
mf_mem_kind alloc_lookup(const void *ptr, size_t *bytes_left);
uint64_t alloc_live_bytes(mf_mem_kind kind);
uint64_t alloc_live_count();

}  // namespace mf
