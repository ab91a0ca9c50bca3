// Ledgers of what this layer handed out, so a destroyed, freed or unknown handle or pointer is an
// error instead of a crash.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "metrale_feed/feed.h"

namespace mf {

// Generation-checked slots: handle = (generation << 32) | (index + 1). A lookup pins the slot,
// so a destroy from another thread while a call is using the object only takes it out of the
// table; the last user reclaims it. That makes any interleaving of lookups and destroys safe: the
// object a call resolved stays valid until the call is over. A pin is one compare-and-swap on
// `state` (no lock), since it is on every hot call (event_query).
struct Slot {
    // generation << 32 | kLive | users: one word, so that a pin succeeds only while the slot is
    // live with the handle's generation, and exactly one party sees the last user leave.
    static constexpr uint64_t kLive = 1ull << 31, kUsers = kLive - 1;
    std::atomic<uint64_t> state{0};
    void *raw = nullptr;
    uint32_t flags = 0;
    bool owned = true;
    uint32_t epoch = 0;    // the fork epoch it was created in (see fork_epoch)
    uint32_t index = 0;    // its place in the table
};

class SlotTable {
public:
    // reclaim destroys a slot's raw object once it is erased and unused.
    explicit SlotTable(mf_status (*reclaim)(void *raw, bool owned)) : reclaim_(reclaim) {}
    uint64_t insert(void *raw, uint32_t flags, bool owned);  // 0 when full
    // A live slot, pinned until the current PinScope ends; MF_ERROR_INVALID_HANDLE (message set,
    // `what` names the kind) when not live, or created before a fork().
    mf_status acquire(uint64_t handle, Slot **out, const char *what);
    // As acquire, but the caller unpins it itself (no PinScope: the hot event_query path).
    mf_status pin(uint64_t handle, Slot **out, const char *what);
    void unpin(Slot *slot);
    // Takes the handle out of the table; its object is reclaimed now, or by its last user.
    mf_status erase(uint64_t handle, const char *what);
    uint64_t live_count() const { return live_.load(std::memory_order_relaxed); }

private:
    static constexpr uint32_t kChunkBits = 12, kChunks = 256;
    Slot *slot_at(uint32_t index) const;
    Slot *slot_of(uint64_t handle) const;  // the slot a handle names, live or not
    void push_free(uint32_t index);        // under the mutex
    void reclaim(Slot *slot);              // its last user has left a destroyed slot
    mf_status (*reclaim_)(void *raw, bool owned);
    std::atomic<Slot *> chunks_[kChunks] = {};
    std::atomic<uint64_t> live_{0};
    uint32_t next_ = 0;      // guarded by the table mutex (registry.cpp)
    uint32_t *free_ = nullptr;
    uint32_t free_len_ = 0, free_cap_ = 0;
};

SlotTable &event_table();
SlotTable &stream_table();

// Pins taken by acquire() during one public call, released when its scope ends (MF_RANGE opens
// one in every entry point; entry points without a range open one themselves).
class PinScope {
public:
    PinScope();
    ~PinScope();
    PinScope(const PinScope &) = delete;
    PinScope &operator=(const PinScope &) = delete;

private:
    unsigned mark_;
};

// Incremented in a fork()ed child: objects of an older epoch belong to the parent's threads.
uint32_t fork_epoch();

// Allocations by address, for range checks on copies and exact frees.
void alloc_insert(void *ptr, size_t nbytes, mf_mem_kind kind);
bool alloc_erase(void *ptr, mf_mem_kind kind, size_t *nbytes);  // false: not such an allocation
mf_mem_kind alloc_lookup(const void *ptr, size_t *bytes_left);
uint64_t alloc_live_bytes(mf_mem_kind kind);
uint64_t alloc_live_count();

// fork() hooks of the layer's other parts (the host backend's queues, the trace, the backend
// selection): registry.cpp registers one pthread_atfork set that calls them in order.
namespace host {
void before_fork();
void after_fork_parent();
void after_fork_child();
}  // namespace host
void backend_after_fork_child();  // api_runtime.cpp: a cuda backend cannot cross fork()

}  // namespace mf
