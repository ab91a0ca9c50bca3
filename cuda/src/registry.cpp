#include "registry.hpp"

#include <pthread.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "api.hpp"

namespace mf {
namespace {
// Never destroyed: a host-backend worker may still look something up while the process exits,
// after static destructors have run (see docs/host-backend.md, "Exit").
std::mutex &slot_mutex() {
    static std::mutex *mutex = new std::mutex;
    return *mutex;
}

struct Allocation {
    size_t nbytes;
    mf_mem_kind kind;
    uint64_t generation;
    uint32_t graph_pins = 0;
    bool releasing = false;  // retired only: handed to the backend's free
};
struct Allocs {
    std::mutex mutex;
    std::map<uintptr_t, Allocation> by_address;  // live
    // Freed by their owner, not yet by the backend: kept for graphs, or queued for release.
    // Their memory is still allocated, so no live allocation shares their address.
    std::map<uintptr_t, Allocation> retired;
    uint64_t bytes[3] = {0, 0, 0};
    uint64_t next_generation = 0;
};
Allocs &allocs() {
    static Allocs *instance = new Allocs;
    return *instance;
}

// The checks of this thread's current public call (touch). Few: a kernel names under a dozen.
constexpr unsigned kMaxTouched = 32;
thread_local Touched t_touched[kMaxTouched];
thread_local unsigned t_touched_count = 0;

mf_status free_retired(void *ptr, mf_mem_kind kind) {
    return kind == MF_MEM_PINNED ? ops().host_free(ptr) : ops().device_free(ptr);
}

std::atomic<uint32_t> g_epoch{0};

// The pins of the current thread's public call: few at once (an argmax pins a stream and an event).
struct Pin {
    SlotTable *table;
    Slot *slot;
};
constexpr unsigned kMaxPins = 16;
thread_local Pin t_pins[kMaxPins];
thread_local unsigned t_pin_count = 0;

mf_status reclaim_event(void *raw, bool owned) { return owned ? ops().event_destroy(raw) : MF_SUCCESS; }
mf_status reclaim_stream(void *raw, bool owned) { return owned ? ops().stream_destroy(raw) : MF_SUCCESS; }

// One set of fork hooks for the whole layer. Before fork() every ledger lock is taken, so the
// child's copies are consistent and unlocked; the parent's threads do not exist in the child.
void prepare() {
    host::before_fork();
    slot_mutex().lock();
    allocs().mutex.lock();
}
void parent() {
    allocs().mutex.unlock();
    slot_mutex().unlock();
    host::after_fork_parent();
}
void child() {
    // Frees the parent had queued are never performed here (their streams' workers do not
    // exist): the memory stays with the child, out of its ledger.
    for (auto it = allocs().retired.begin(); it != allocs().retired.end();) {
        if (it->second.releasing) {
            allocs().bytes[it->second.kind] -= it->second.nbytes;
            it = allocs().retired.erase(it);
        } else {
            ++it;
        }
    }
    allocs().mutex.unlock();
    slot_mutex().unlock();
    g_epoch.fetch_add(1, std::memory_order_relaxed);
    // The parent's events are refused by pin(), so their marks must not answer either; the
    // child has one thread here, and no later query marks a parent's slot (it cannot pin one).
    event_table().forget_marks();
    host::after_fork_child();
    backend_after_fork_child();
}
const int g_atfork = pthread_atfork(prepare, parent, child);
}  // namespace

uint32_t fork_epoch() { return g_epoch.load(std::memory_order_relaxed); }

Slot *SlotTable::slot_at(uint32_t index) const {
    Slot *chunk = chunks_[index >> kChunkBits].load(std::memory_order_acquire);
    return chunk ? &chunk[index & ((1u << kChunkBits) - 1u)] : nullptr;
}

uint64_t SlotTable::insert(void *raw, uint32_t flags, bool owned) {
    std::lock_guard<std::mutex> lock(slot_mutex());
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
    slot->epoch = fork_epoch();
    slot->index = index;
    uint32_t generation = (uint32_t)(slot->state.load(std::memory_order_relaxed) >> 32) + 1u;
    if (generation == 0) generation = 1;  // a handle is never 0
    // Published last: a pin that sees this state sees the fields above.
    slot->state.store(((uint64_t)generation << 32) | Slot::kLive, std::memory_order_release);
    live_.fetch_add(1, std::memory_order_relaxed);
    return ((uint64_t)generation << 32) | (uint64_t)(index + 1u);
}

Slot *SlotTable::slot_of(uint64_t handle) const {
    uint32_t low = (uint32_t)handle;
    if (low == 0 || low > (kChunks << kChunkBits)) return nullptr;
    return slot_at(low - 1u);
}

void SlotTable::forget_marks() {
    for (uint32_t c = 0; c < kChunks; ++c) {
        Slot *chunk = chunks_[c].load(std::memory_order_relaxed);
        if (!chunk) continue;
        for (uint32_t i = 0; i < (1u << kChunkBits); ++i) chunk[i].done_mark.store(0, std::memory_order_relaxed);
    }
}

void SlotTable::push_free(uint32_t index) {
    if (free_len_ == free_cap_) {
        uint32_t cap = free_cap_ ? free_cap_ * 2 : 64;
        uint32_t *grown = (uint32_t *)std::realloc(free_, cap * sizeof *grown);
        if (!grown) return;  // the slot is simply not reused
        free_ = grown;
        free_cap_ = cap;
    }
    free_[free_len_++] = index;
}

mf_status SlotTable::acquire(uint64_t handle, Slot **out, const char *what) {
    if (t_pin_count >= kMaxPins)
        return fail(MF_ERROR_INVALID_VALUE, "internal: too many handles pinned by one call");
    mf_status status = pin(handle, out, what);
    if (status == MF_SUCCESS) t_pins[t_pin_count++] = Pin{this, *out};
    return status;
}

mf_status SlotTable::pin(uint64_t handle, Slot **out, const char *what) {
    Slot *slot = slot_of(handle);
    uint64_t state = slot ? slot->state.load(std::memory_order_acquire) : 0;
    for (;;) {
        if (!slot || (uint32_t)(state >> 32) != (uint32_t)(handle >> 32) || !(state & Slot::kLive) ||
            (state & Slot::kUsers) == Slot::kUsers)
            return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed %s 0x%llx", what,
                        (unsigned long long)handle);
        if (slot->state.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel,
                                              std::memory_order_acquire))
            break;
    }
    if (slot->epoch != fork_epoch()) {
        slot->state.fetch_sub(1, std::memory_order_acq_rel);  // never reclaimed: see erase
        return fail(MF_ERROR_INVALID_HANDLE,
                    "%s 0x%llx was created before fork(): the parent's %ss cannot be used in a "
                    "forked child (create new ones there)",
                    what, (unsigned long long)handle, what);
    }
    *out = slot;
    return MF_SUCCESS;
}

void SlotTable::unpin(Slot *slot) {
    uint64_t before = slot->state.fetch_sub(1, std::memory_order_acq_rel);
    if (!(before & Slot::kLive) && (before & Slot::kUsers) == 1) reclaim(slot);
}

void SlotTable::reclaim(Slot *slot) {
    if (slot->epoch != fork_epoch()) return;  // the parent's: left as it is (see erase)
    void *raw = slot->raw;
    bool owned = slot->owned;
    {
        std::lock_guard<std::mutex> lock(slot_mutex());
        push_free(slot->index);  // reusable from here: raw and owned were copied first
    }
    reclaim_(raw, owned);
}

mf_status SlotTable::erase(uint64_t handle, const char *what) {
    Slot *slot = slot_of(handle);
    uint64_t state = slot ? slot->state.load(std::memory_order_acquire) : 0;
    for (;;) {
        if (!slot || (uint32_t)(state >> 32) != (uint32_t)(handle >> 32) || !(state & Slot::kLive))
            return fail(MF_ERROR_INVALID_HANDLE, "unknown or destroyed %s 0x%llx", what,
                        (unsigned long long)handle);
        // Clearing kLive ends new pins; whoever sees the users drop to 0 afterwards reclaims.
        if (slot->state.compare_exchange_weak(state, state & ~Slot::kLive, std::memory_order_acq_rel,
                                              std::memory_order_acquire))
            break;
    }
    live_.fetch_sub(1, std::memory_order_relaxed);
    if (slot->epoch != fork_epoch()) {
        // The parent's object: its threads are gone, so it is left as it is (a leak, the only
        // safe choice), and the slot is not reused.
        return MF_SUCCESS;
    }
    if ((state & Slot::kUsers) != 0) return MF_SUCCESS;  // the last user reclaims it (unpin)
    void *raw = slot->raw;
    bool owned = slot->owned;
    {
        std::lock_guard<std::mutex> lock(slot_mutex());
        push_free(slot->index);
    }
    return reclaim_(raw, owned);
}

PinScope::PinScope() : mark_(t_pin_count) {
    if (mark_ == 0) t_touched_count = 0;  // an outermost public call starts its own list
}

PinScope::~PinScope() {
    while (t_pin_count > mark_) {
        Pin pin = t_pins[--t_pin_count];
        // Counted while still pinned, after the call's work: a done mark left by a query that
        // began before this call is stale from here (Slot).
        if (pin.table->counts_changes_) pin.slot->changes.fetch_add(1, std::memory_order_release);
        pin.table->unpin(pin.slot);
    }
}

SlotTable &event_table() {
    static SlotTable *table = new SlotTable(reclaim_event, true);
    return *table;
}

SlotTable &stream_table() {
    static SlotTable *table = new SlotTable(reclaim_stream, false);
    return *table;
}

uint64_t alloc_insert(void *ptr, size_t nbytes, mf_mem_kind kind) {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    uint64_t generation = ++a.next_generation;
    a.by_address[(uintptr_t)ptr] = Allocation{nbytes, kind, generation};
    a.bytes[kind] += nbytes;
    return generation;
}

FreeOutcome alloc_erase(void *ptr, mf_mem_kind kind, size_t *nbytes) {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.by_address.find((uintptr_t)ptr);
    if (it == a.by_address.end() || it->second.kind != kind) return FreeOutcome::kUnknown;
    if (nbytes && *nbytes != it->second.nbytes) {
        *nbytes = it->second.nbytes;
        return FreeOutcome::kWrongSize;
    }
    Allocation retired = it->second;
    a.by_address.erase(it);
    retired.releasing = retired.graph_pins == 0;
    a.retired[(uintptr_t)ptr] = retired;
    return retired.releasing ? FreeOutcome::kRelease : FreeOutcome::kKept;
}

void alloc_released(void *ptr) {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.retired.find((uintptr_t)ptr);
    if (it == a.retired.end()) return;  // a fork()ed child dropped it (see child)
    a.bytes[it->second.kind] -= it->second.nbytes;
    a.retired.erase(it);
}

void alloc_graph_pin(const AllocRef &ref) {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    auto it = a.by_address.find(ref.base);
    if (it != a.by_address.end() && it->second.generation == ref.generation) ++it->second.graph_pins;
}

void alloc_graph_unpin(const AllocRef &ref) {
    Allocs &a = allocs();
    mf_mem_kind kind;
    {
        std::lock_guard<std::mutex> lock(a.mutex);
        auto it = a.by_address.find(ref.base);
        if (it != a.by_address.end() && it->second.generation == ref.generation) {
            if (it->second.graph_pins) --it->second.graph_pins;
            return;
        }
        it = a.retired.find(ref.base);
        if (it == a.retired.end() || it->second.generation != ref.generation || it->second.releasing ||
            it->second.graph_pins == 0)
            return;  // never pinned: it had been freed before the capture named it
        if (--it->second.graph_pins != 0) return;
        it->second.releasing = true;
        kind = it->second.kind;
    }
    // The backend's free outside the lock: it calls alloc_released (at once, or later).
    (void)free_retired((void *)ref.base, kind);
}

const AllocRef *alloc_first_stale(const AllocRef *refs, size_t n) {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    for (size_t i = 0; i < n; ++i) {
        auto it = a.by_address.find(refs[i].base);
        if (it == a.by_address.end() || it->second.generation != refs[i].generation) return &refs[i];
    }
    return nullptr;
}

mf_mem_kind alloc_lookup(const void *ptr, size_t *bytes_left, AllocRef *ref) {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    uintptr_t p = (uintptr_t)ptr;
    auto it = a.by_address.upper_bound(p);
    if (it == a.by_address.begin()) return MF_MEM_UNKNOWN;
    --it;
    // A zero-byte allocation still owns its own address.
    if (p >= it->first && (p < it->first + it->second.nbytes || p == it->first)) {
        if (bytes_left) *bytes_left = it->first + it->second.nbytes - p;
        if (ref) *ref = AllocRef{it->first, it->second.generation};
        return it->second.kind;
    }
    return MF_MEM_UNKNOWN;
}

void touch(const Touched &touched) {
    if (t_touched_count < kMaxTouched) t_touched[t_touched_count++] = touched;
}

const Touched *touched(unsigned *count) {
    *count = t_touched_count;
    return t_touched;
}

void touched_reset() { t_touched_count = 0; }

uint64_t alloc_live_bytes(mf_mem_kind kind) {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    return a.bytes[kind];
}

uint64_t alloc_live_count() {
    Allocs &a = allocs();
    std::lock_guard<std::mutex> lock(a.mutex);
    return a.by_address.size() + a.retired.size();
}

}  // namespace mf
