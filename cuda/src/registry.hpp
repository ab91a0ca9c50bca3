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
// `state` (no lock), and an unpin one atomic add.
//
// The hottest call, a query of an event that has completed, takes no pin at all: a query that
// finds the event complete leaves a done mark in its slot, and a later query that finds the mark
// current answers from it with plain loads (SlotTable::marked_done). The mark is current while
// no call has resolved the event since the query that left it: every call that can record it
// (a record, a kernel with an event, a graph replay of them) resolves it through acquire(), and
// each such call counts one `changes` once its work is queued (PinScope), so a record that
// returned before a query began always makes the mark stale. The mark holds the generation, so
// a destroyed handle never matches it, even with its slot reused.
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
    // Tables that count changes (events): calls that resolved the slot, counted after their
    // work (release), and generation << 32 | changes as a query read them before it saw the
    // event complete (0: none).
    std::atomic<uint32_t> changes{0};
    std::atomic<uint64_t> done_mark{0};
};

class SlotTable {
public:
    // reclaim destroys a slot's raw object once it is erased and unused.
    // counts_changes: every acquire() of a slot counts one `changes` when its PinScope ends.
    explicit SlotTable(mf_status (*reclaim)(void *raw, bool owned), bool counts_changes = false)
        : reclaim_(reclaim), counts_changes_(counts_changes) {}
    uint64_t insert(void *raw, uint32_t flags, bool owned);  // 0 when full
    // A live slot, pinned until the current PinScope ends; MF_ERROR_INVALID_HANDLE (message set,
    // `what` names the kind) when not live, or created before a fork().
    mf_status acquire(uint64_t handle, Slot **out, const char *what);
    // As acquire, but the caller unpins it itself (no PinScope: the hot event_query path).
    mf_status pin(uint64_t handle, Slot **out, const char *what);
    void unpin(Slot *slot);
    // True when `handle` is live and its slot's done mark is current (see Slot): the event is
    // complete. Loads only, no pin: the slot's memory is never freed, and nothing here reads
    // the object. False means "ask the backend" (pin), never "not done".
    bool marked_done(uint64_t handle) const;
    // After a query of a pinned `slot` that read `changes` (acquire) before the backend said
    // the event was complete.
    static void mark_done(Slot *slot, uint32_t changes) {
        uint64_t mark = (slot->state.load(std::memory_order_relaxed) >> 32 << 32) | changes;
        if (slot->done_mark.load(std::memory_order_relaxed) != mark)
            slot->done_mark.store(mark, std::memory_order_release);
    }
    void forget_marks();  // a fork()ed child: no parent's slot may answer without a pin
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
    const bool counts_changes_;
    friend class PinScope;
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

inline bool SlotTable::marked_done(uint64_t handle) const {
    uint32_t index = (uint32_t)handle - 1u;  // a handle's low word is index + 1, never 0
    if (index >= (kChunks << kChunkBits)) return false;
    const Slot *chunk = chunks_[index >> kChunkBits].load(std::memory_order_acquire);
    if (!chunk) return false;
    const Slot &slot = chunk[index & ((1u << kChunkBits) - 1u)];
    uint64_t state = slot.state.load(std::memory_order_acquire);
    uint64_t generation = handle >> 32;
    if ((state >> 32) != generation || !(state & Slot::kLive)) return false;
    uint64_t mark = slot.done_mark.load(std::memory_order_acquire);
    return mark == ((generation << 32) | slot.changes.load(std::memory_order_acquire));
}

// Allocations by address, for range checks on copies and exact frees (docs/lifetimes.md).
// Each allocation gets a generation, unique for the process: a ref (base, generation) names that
// allocation and no later one at the same address, so a check against a ref can never be passed
// by an address reuse.
struct AllocRef {
    uintptr_t base = 0;
    uint64_t generation = 0;
};
uint64_t alloc_insert(void *ptr, size_t nbytes, mf_mem_kind kind);  // its generation
// A free: the allocation leaves the live map at once (every later check refuses it). kRelease:
// the caller hands the memory to the backend's free, which calls alloc_released() once it has
// freed it (the host backend: when the streams have passed the work queued before the free).
// kKept: a graph names it; its last graph_unpin hands it to the backend.
enum class FreeOutcome { kUnknown, kWrongSize, kRelease, kKept };
FreeOutcome alloc_erase(void *ptr, mf_mem_kind kind, size_t *nbytes);
void alloc_released(void *ptr);  // the backend freed memory that alloc_erase gave it
mf_mem_kind alloc_lookup(const void *ptr, size_t *bytes_left, AllocRef *ref = nullptr);
// Graphs (api_graph.cpp): memory a capture names is pinned until the graph or the discarded
// capture goes, so a free meanwhile is deferred (kKept) and its address cannot be reused.
void alloc_graph_pin(const AllocRef &ref);    // a ref no longer live is left unpinned
void alloc_graph_unpin(const AllocRef &ref);  // the last pin of a freed allocation frees it
// The first of `n` refs that is no longer the live allocation it named, or nullptr.
const AllocRef *alloc_first_stale(const AllocRef *refs, size_t n);
// Counted until the backend has freed them: freed allocations kept for graphs or still queued.
uint64_t alloc_live_bytes(mf_mem_kind kind);
uint64_t alloc_live_count();

// What the checks of the current public call found (check_device_range, check_host_range): the
// allocations it names and the borrowed ranges it uses, for a graph capture to keep. Reset when
// an outermost PinScope opens (each public call).
struct Touched {
    AllocRef ref;          // base 0: a borrowed range (ptr, nbytes) of the calling binding
    const void *ptr;
    size_t nbytes;
};
void touch(const Touched &touched);
const Touched *touched(unsigned *count);  // this call's, in check order
void touched_reset();

// fork() hooks of the layer's other parts (the host backend's queues, the trace, the backend
// selection): registry.cpp registers one pthread_atfork set that calls them in order.
namespace host {
void before_fork();
void after_fork_parent();
void after_fork_child();
}  // namespace host
void backend_after_fork_child();  // api_runtime.cpp: a cuda backend cannot cross fork()

}  // namespace mf
