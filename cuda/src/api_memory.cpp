// Public entry points: page-locked and device memory, and the async copies.
#include <cstdint>
#include <new>

#include "api.hpp"

namespace mf {
namespace {
// Ranges vouched for by the binding for the calls this thread makes (mf_device_borrow).
struct Borrowed {
    const char *begin;
    size_t nbytes;
};
thread_local Borrowed t_borrowed[MF_MAX_BORROWED];
thread_local int t_borrowed_count = 0;

bool borrowed(const void *ptr, size_t nbytes) {
    const char *p = static_cast<const char *>(ptr);
    for (int i = 0; i < t_borrowed_count; ++i) {
        const Borrowed &b = t_borrowed[i];
        if (p >= b.begin && (size_t)(p - b.begin) <= b.nbytes && nbytes <= b.nbytes - (size_t)(p - b.begin))
            return true;
    }
    return false;
}
}  // namespace

mf_status check_device_range(const void *ptr, size_t nbytes, const char *what) {
    if (!ptr) return fail(MF_ERROR_INVALID_VALUE, "%s is a null pointer", what);
    size_t left = 0;
    AllocRef ref;
    mf_mem_kind kind = alloc_lookup(ptr, &left, &ref);
    if (kind == MF_MEM_DEVICE) {
        if (nbytes > left)
            return fail(MF_ERROR_INVALID_VALUE,
                        "%s: %zu bytes run past the end of its device allocation (%zu left)", what,
                        nbytes, left);
        touch(Touched{ref, ptr, nbytes});  // a capture keeps it (api_graph.cpp)
        return MF_SUCCESS;
    }
    if (kind == MF_MEM_PINNED)
        return fail(MF_ERROR_INVALID_VALUE, "%s is page-locked host memory, not device memory", what);
    if (nbytes == 0 && kind == MF_MEM_UNKNOWN) {
        // Zero bytes at one past the end of an allocation touch nothing (as memcpy's end pointer).
        size_t last = 0;
        if (alloc_lookup(static_cast<const char *>(ptr) - 1, &last) == MF_MEM_DEVICE && last == 1)
            return MF_SUCCESS;
    }
    if (active_kind() == MF_BACKEND_CUDA) return MF_SUCCESS;  // foreign device memory, as is
    if (borrowed(ptr, nbytes)) {  // a CPU tensor the binding holds (a graph's replay borrows it again)
        touch(Touched{AllocRef{}, ptr, nbytes});
        return MF_SUCCESS;
    }
    return fail(MF_ERROR_INVALID_HANDLE,
                "%s 0x%llx is not a live device allocation of this package (the host backend "
                "accepts only its own)",
                what, (unsigned long long)(uintptr_t)ptr);
}

mf_status refuse_overlaps(const Span *spans, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        const Span &a = spans[i];
        if (!a.ptr || !a.nbytes) continue;
        const uintptr_t a0 = (uintptr_t)a.ptr;
        for (size_t j = 0; j < i; ++j) {
            const Span &b = spans[j];
            if (!b.ptr || !b.nbytes || !(a.written || b.written)) continue;
            const uintptr_t b0 = (uintptr_t)b.ptr;
            // Spans passed their range checks, so neither end wraps.
            if (a0 < b0 + b.nbytes && b0 < a0 + a.nbytes)
                return fail(MF_ERROR_INVALID_VALUE,
                            "%s and %s overlap (%zu bytes at 0x%llx, %zu bytes at 0x%llx): the call "
                            "would %s; give each output its own memory",
                            b.what, a.what, b.nbytes, (unsigned long long)b0, a.nbytes, (unsigned long long)a0,
                            a.written && b.written ? "write both into the same bytes" : "overwrite an input it reads");
        }
    }
    return MF_SUCCESS;
}

mf_status check_host_range(const void *ptr, size_t nbytes, const char *what) {
    if (!ptr) return fail(MF_ERROR_INVALID_VALUE, "%s is a null pointer", what);
    size_t left = 0;
    AllocRef ref;
    mf_mem_kind kind = alloc_lookup(ptr, &left, &ref);
    if (kind == MF_MEM_DEVICE)
        return fail(MF_ERROR_INVALID_VALUE, "%s is device memory, not host memory", what);
    if (kind == MF_MEM_PINNED) {
        if (nbytes > left)
            return fail(MF_ERROR_INVALID_VALUE,
                        "%s: %zu bytes run past the end of its pinned allocation (%zu left)", what,
                        nbytes, left);
        touch(Touched{ref, ptr, nbytes});
    }
    return MF_SUCCESS;
}

}  // namespace mf

using namespace mf;

namespace {
mf_status copy(void *dst, const void *src, size_t nbytes, CopyKind kind, mf_stream_t stream) {
    mf_status status;
    void *raw;
    switch (kind) {
    case kD2H:
        status = check_host_range(dst, nbytes, "copy destination");
        if (status == MF_SUCCESS) status = check_device_range(src, nbytes, "copy source");
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS) status = capture_host_check(raw, dst, "copy_d2h_async destination");
        break;
    case kH2D:
        status = check_device_range(dst, nbytes, "copy destination");
        if (status == MF_SUCCESS) status = check_host_range(src, nbytes, "copy source");
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status == MF_SUCCESS) status = capture_host_check(raw, src, "copy_h2d_async source");
        break;
    default:
        status = check_device_range(dst, nbytes, "copy destination");
        if (status == MF_SUCCESS) status = check_device_range(src, nbytes, "copy source");
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
    }
    // As for cudaMemcpyAsync, a copy's ranges may not overlap; a copy onto itself (a no-op) may.
    // Every kind: memory the host backend borrows (a CPU tensor) or cuda's managed memory passes
    // as host and as device memory.
    if (status == MF_SUCCESS && dst != src) {
        const Span spans[] = {{dst, nbytes, "copy destination", true}, {src, nbytes, "copy source", false}};
        status = refuse_overlaps(spans);
    }
    if (status != MF_SUCCESS || nbytes == 0) return status;
    if (kept_for_graph(raw, [=](mf_stream_t s) { return copy(dst, src, nbytes, kind, s); }))
        return MF_SUCCESS;
    return ops().copy_async(dst, src, nbytes, kind, raw);
}

// The ledger's record of a new allocation. When the ledger cannot grow, the allocation is given
// back, so a failed alloc leaves nothing behind.
mf_status record_allocation(void *ptr, size_t nbytes, mf_mem_kind kind) {
    try {
        alloc_insert(ptr, nbytes, kind);
        return MF_SUCCESS;
    } catch (const std::bad_alloc &) {
        (kind == MF_MEM_PINNED ? ops().host_free : ops().device_free)(ptr);
        return fail(MF_ERROR_OUT_OF_MEMORY, "out of memory for the allocation ledger (nothing was allocated)");
    }
}
}  // namespace

extern "C" {

mf_status mf_host_alloc(size_t nbytes, unsigned flags, void **out) {
    return guard([&]() -> mf_status {
        MF_RANGE("host_alloc");
        if (nbytes == 0) return fail(MF_ERROR_INVALID_VALUE, "a pinned allocation needs at least 1 byte");
        if (flags & ~(unsigned)(MF_HOST_PORTABLE | MF_HOST_MAPPED | MF_HOST_WRITE_COMBINED))
            return fail(MF_ERROR_INVALID_VALUE, "unknown pinned-memory flags 0x%x", flags);
        if (!out) return need(out, "out");
        mf_status status = ops().host_alloc(nbytes, flags, out);
        return status != MF_SUCCESS ? status : record_allocation(*out, nbytes, MF_MEM_PINNED);
    });
}

mf_status mf_host_free(void *ptr, size_t nbytes) {
    return guard([&]() -> mf_status {
        MF_RANGE("host_free");
        size_t expected = nbytes;
        switch (alloc_erase(ptr, MF_MEM_PINNED, &expected)) {
        case FreeOutcome::kWrongSize:
            return fail(MF_ERROR_INVALID_VALUE, "pinned allocation 0x%llx has %zu bytes, not %zu",
                        (unsigned long long)(uintptr_t)ptr, expected, nbytes);
        case FreeOutcome::kUnknown:
            return fail(MF_ERROR_INVALID_HANDLE, "0x%llx is not a live pinned allocation (freed or foreign)",
                        (unsigned long long)(uintptr_t)ptr);
        case FreeOutcome::kKept:
            return MF_SUCCESS;  // a live graph names it: freed when the last such graph goes
        case FreeOutcome::kRelease:
            break;
        }
        return ops().host_free(ptr);
    });
}

mf_status mf_device_alloc(size_t nbytes, void **out) {
    return guard([&]() -> mf_status {
        MF_RANGE("device_alloc");
        if (nbytes == 0) return fail(MF_ERROR_INVALID_VALUE, "a device allocation needs at least 1 byte");
        if (!out) return need(out, "out");
        mf_status status = ops().device_alloc(nbytes, out);
        return status != MF_SUCCESS ? status : record_allocation(*out, nbytes, MF_MEM_DEVICE);
    });
}

mf_status mf_device_free(void *ptr) {
    return guard([&]() -> mf_status {
        MF_RANGE("device_free");
        switch (alloc_erase(ptr, MF_MEM_DEVICE, nullptr)) {
        case FreeOutcome::kUnknown:
        case FreeOutcome::kWrongSize:
            return fail(MF_ERROR_INVALID_HANDLE, "0x%llx is not a live device allocation (freed or foreign)",
                        (unsigned long long)(uintptr_t)ptr);
        case FreeOutcome::kKept:
            return MF_SUCCESS;  // as mf_host_free's
        case FreeOutcome::kRelease:
            break;
        }
        return ops().device_free(ptr);
    });
}

mf_mem_kind mf_mem_lookup(const void *ptr, size_t *bytes_left) {
    return guard_value(MF_MEM_UNKNOWN, [&] { return alloc_lookup(ptr, bytes_left); });
}

mf_status mf_memset_async(void *dev, int value, size_t nbytes, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("memset_async");
        mf_status status = check_device_range(dev, nbytes, "memset destination");
        void *raw;
        if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
        if (status != MF_SUCCESS || nbytes == 0) return status;
        if (kept_for_graph(raw, [=](mf_stream_t s) { return mf_memset_async(dev, value, nbytes, s); }))
            return MF_SUCCESS;
        return ops().memset_async(dev, value, nbytes, raw);
    });
}

mf_status mf_copy_d2h_async(void *host_dst, const void *dev_src, size_t nbytes, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("copy_d2h_async");
        return copy(host_dst, dev_src, nbytes, kD2H, stream);
    });
}

mf_status mf_copy_h2d_async(void *dev_dst, const void *host_src, size_t nbytes, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("copy_h2d_async");
        return copy(dev_dst, host_src, nbytes, kH2D, stream);
    });
}

mf_status mf_copy_d2d_async(void *dev_dst, const void *dev_src, size_t nbytes, mf_stream_t stream) {
    return guard([&]() -> mf_status {
        MF_RANGE("copy_d2d_async");
        return copy(dev_dst, dev_src, nbytes, kD2D, stream);
    });
}

}  // extern "C"

extern "C" {

mf_status mf_device_borrow(const void *ptr, size_t nbytes) {
    return guard([&]() -> mf_status {
        if (!ptr) return fail(MF_ERROR_INVALID_VALUE, "a borrowed range cannot start at a null pointer");
        if (t_borrowed_count == MF_MAX_BORROWED)
            return fail(MF_ERROR_INVALID_VALUE, "more than %d borrowed ranges at once", MF_MAX_BORROWED);
        if (nbytes > SIZE_MAX - (uintptr_t)ptr)
            return fail(MF_ERROR_INVALID_VALUE, "a borrowed range of %zu bytes wraps the address space", nbytes);
        t_borrowed[t_borrowed_count++] = Borrowed{static_cast<const char *>(ptr), nbytes};
        return MF_SUCCESS;
    });
}

void mf_device_borrow_clear(void) { t_borrowed_count = 0; }

}  // extern "C"
