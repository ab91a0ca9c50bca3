// Public entry points: the two feed kernels and the reference forward. Every argument is checked
// here, before anything is queued, so a bad call launches nothing.
#include <cstdint>

#include "api.hpp"
#include "metrale_feed/argmax_rule.h"

using namespace mf;

namespace {
constexpr uint32_t kMaxRows = MF_MAX_ROWS;
constexpr uint32_t kMaxVocab = MF_MAX_VOCAB;

size_t dtype_size(mf_dtype dtype) { return dtype == MF_DTYPE_F32 ? 4 : 2; }
bool dtype_known(mf_dtype dtype) {
    return dtype == MF_DTYPE_F32 || dtype == MF_DTYPE_F16 || dtype == MF_DTYPE_BF16;
}
bool aligned(const void *ptr, size_t to) { return ((uintptr_t)ptr % to) == 0; }

// Host masks of MF_MAX_ROWS unmasked rows: what masks NULL means. A constant, so a graph that
// captured it replays the same (no) masks.
const uint32_t *no_masks() {
    static const uint32_t *const words = [] {
        static uint32_t table[2 * MF_MAX_ROWS];
        for (uint32_t &w : table) w = MF_NO_TOKEN;
        return table;
    }();
    return words;
}

// Host-resident params are checked row by row here; device-resident ones only for their extent
// (the kernels read an out-of-range value as its neutral setting).
mf_status check_sampling(const mf_argmax_args *a) {
    if (!aligned(a->params, 8)) return fail(MF_ERROR_INVALID_VALUE, "sampling params pointer is misaligned");
    if (a->flags & MF_ARGS_PARAMS_DEVICE)
        return check_device_range(a->params, (size_t)a->rows * sizeof(mf_sampling_params),
                                  "device-resident sampling params");
    for (uint32_t r = 0; r < a->rows; ++r) {
        const mf_sampling_params &p = a->params[r];
        if (!(p.temperature >= 0.0f && p.temperature <= 3.4e38f))  // NaN fails both
            return fail(MF_ERROR_INVALID_VALUE, "row %u: temperature must be finite and >= 0, got %g", r,
                        (double)p.temperature);
        if (!(p.top_p > 0.0f && p.top_p <= 1.0f))
            return fail(MF_ERROR_INVALID_VALUE, "row %u: top_p must be in (0, 1], got %g", r, (double)p.top_p);
        if (!(p.min_p >= 0.0f && p.min_p < 1.0f))
            return fail(MF_ERROR_INVALID_VALUE, "row %u: min_p must be in [0, 1), got %g", r, (double)p.min_p);
    }
    return MF_SUCCESS;
}

mf_status check_argmax(const mf_argmax_args *a, Slot **event) {
    if (!dtype_known(a->dtype)) return fail(MF_ERROR_INVALID_VALUE, "unknown logits dtype %d", (int)a->dtype);
    if (a->rows == 0 || a->rows > kMaxRows)
        return fail(MF_ERROR_INVALID_VALUE, "rows must be in [1, %u], got %u", kMaxRows, a->rows);
    if (a->rows > a->cell_capacity)
        return fail(MF_ERROR_INVALID_VALUE, "%u rows exceed the feed cells' capacity of %u", a->rows,
                    a->cell_capacity);
    if (a->vocab == 0 || a->vocab > kMaxVocab)
        return fail(MF_ERROR_INVALID_VALUE, "vocab must be in [1, 2**24], got %u", a->vocab);
    if (a->row_stride < a->vocab)
        return fail(MF_ERROR_INVALID_VALUE, "row_stride %llu is less than vocab %u",
                    (unsigned long long)a->row_stride, a->vocab);
    if (a->flags & ~(uint32_t)(MF_ARGS_MASKS_DEVICE | MF_ARGS_PARAMS_DEVICE))
        return fail(MF_ERROR_INVALID_VALUE, "unknown argmax flags 0x%x", a->flags);
    if (!a->masks && (a->flags & MF_ARGS_MASKS_DEVICE))
        return fail(MF_ERROR_INVALID_VALUE, "device-resident masks is a null pointer");
    if (!a->masks) {
        // No masks: mf_argmax_to_feed passes the constant unmasked rows.
    } else if (a->flags & MF_ARGS_MASKS_DEVICE) {
        // Read when the kernel runs: only its extent can be checked now.
        if (!aligned(a->masks, 4)) return fail(MF_ERROR_INVALID_VALUE, "device masks pointer is misaligned");
        mf_status st = check_device_range(a->masks, (size_t)a->rows * 8, "device-resident masks");
        if (st != MF_SUCCESS) return st;
    } else {
        for (uint32_t i = 0; i < 2 * a->rows; ++i) {
            uint32_t id = a->masks[i];
            if (id != MF_NO_TOKEN && id >= a->vocab)
                return fail(MF_ERROR_INVALID_VALUE, "mask id %u of row %u is not below vocab %u", id,
                            i / 2, a->vocab);
        }
    }
    if (a->bitmask) {
        if (!aligned(a->bitmask, 4)) return fail(MF_ERROR_INVALID_VALUE, "bitmask pointer is misaligned");
        mf_status st = check_device_range(a->bitmask, (size_t)a->rows * mf_bitmask_words(a->vocab) * 4,
                                          "bitmask");
        if (st != MF_SUCCESS) return st;
    }
    if (a->params) {
        mf_status st = check_sampling(a);
        if (st != MF_SUCCESS) return st;
    } else if (a->flags & MF_ARGS_PARAMS_DEVICE) {
        return fail(MF_ERROR_INVALID_VALUE, "MF_ARGS_PARAMS_DEVICE without params");
    }
    size_t esize = dtype_size(a->dtype);
    if (!aligned(a->logits, esize) || !aligned(a->cells, 4))
        return fail(MF_ERROR_INVALID_VALUE, "logits or cells pointer is misaligned");
    // In 128 bits: a huge row_stride must not wrap into a small span that passes the range check.
    unsigned __int128 wide = ((unsigned __int128)(a->rows - 1) * a->row_stride + a->vocab) * esize;
    if (wide > (unsigned __int128)(SIZE_MAX / 2))
        return fail(MF_ERROR_INVALID_VALUE, "rows x row_stride (%u x %llu) spans more memory than exists",
                    a->rows, (unsigned long long)a->row_stride);
    size_t span = (size_t)wide;
    mf_status status = check_device_range(a->logits, span, "logits");
    if (status == MF_SUCCESS)
        status = check_device_range(a->cells, (size_t)a->cell_capacity * 4, "feed cells");
    if (status == MF_SUCCESS && a->host_dst)
        status = check_host_range(a->host_dst, (size_t)a->rows * 4, "argmax destination");
    *event = nullptr;
    if (status == MF_SUCCESS && a->event) status = resolve_event(a->event, event);
    return status;
}
}  // namespace

extern "C" {

mf_status mf_argmax_to_feed(const mf_argmax_args *args, mf_stream_t stream) {
    MF_RANGE("argmax_to_feed");
    void *raw;
    Slot *event;
    mf_status status = check_argmax(args, &event);
    if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
    if (status == MF_SUCCESS && args->masks && !(args->flags & MF_ARGS_MASKS_DEVICE))
        status = refuse_in_capture(raw, "argmax_to_feed with host-resident masks", true);
    if (status == MF_SUCCESS && args->params && !(args->flags & MF_ARGS_PARAMS_DEVICE))
        status = refuse_in_capture(raw, "sample_to_feed with host-resident params", true);
    if (status == MF_SUCCESS && args->host_dst)
        status = capture_host_check(raw, args->host_dst, "argmax_to_feed destination");
    if (status != MF_SUCCESS) return status;
    if (kept_for_graph(raw, [copy = *args](mf_stream_t s) { return mf_argmax_to_feed(&copy, s); }))
        return MF_SUCCESS;
    mf_argmax_args local;
    if (!args->masks) {
        local = *args;
        local.masks = no_masks();
        args = &local;
    }
    status = ops().argmax(args, raw);
    if (status == MF_SUCCESS && args->host_dst)
        status = ops().copy_async(args->host_dst, args->cells, (size_t)args->rows * 4, kD2H, raw);
    if (status == MF_SUCCESS && event) status = ops().event_record(event->raw, (mf_stream_t)(uintptr_t)raw);
    return status;
}

mf_status mf_resolve_feed(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                          uint32_t *out, mf_stream_t stream) {
    return mf_resolve_feed_flags(sources, n, cells, prev_rows, out, 0u, stream);
}

mf_status mf_resolve_feed_flags(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                                uint32_t prev_rows, uint32_t *out, unsigned flags, mf_stream_t stream) {
    MF_RANGE("resolve_feed");
    if (n == 0 || n > kMaxRows) return fail(MF_ERROR_INVALID_VALUE, "rows must be in [1, %u], got %u", kMaxRows, n);
    if (flags & ~(unsigned)MF_SOURCES_DEVICE) return fail(MF_ERROR_INVALID_VALUE, "unknown resolve flags 0x%x", flags);
    if (!sources) return fail(MF_ERROR_INVALID_VALUE, "sources is a null pointer");
    const bool on_device = flags & MF_SOURCES_DEVICE;
    mf_status status = MF_SUCCESS;
    if (on_device) {  // read when the kernel runs, which bounds from_row by prev_rows itself
        if (!aligned(sources, 4)) return fail(MF_ERROR_INVALID_VALUE, "sources pointer is misaligned");
        status = check_device_range(sources, (size_t)n * 4, "device-resident sources");
    } else {
        for (uint32_t i = 0; i < n; ++i) {
            uint32_t s = sources[i];
            if (!(s & MF_FEED_HOST_BIT) && s >= prev_rows)
                return fail(MF_ERROR_INVALID_VALUE,
                            "source %u reads feed cell %u, beyond the previous step's %u rows", i, s, prev_rows);
        }
    }
    if (!aligned(cells, 4) || !aligned(out, 4))
        return fail(MF_ERROR_INVALID_VALUE, "cells or out pointer is misaligned");
    if (status == MF_SUCCESS && prev_rows) status = check_device_range(cells, (size_t)prev_rows * 4, "feed cells");
    if (status == MF_SUCCESS) status = check_device_range(out, (size_t)n * 4, "resolve output");
    void *raw;
    if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
    if (status == MF_SUCCESS && !on_device)
        status = refuse_in_capture(raw, "resolve_feed with host-resident sources", true);
    if (status != MF_SUCCESS) return status;
    if (kept_for_graph(raw, [=](mf_stream_t s) {
            return mf_resolve_feed_flags(sources, n, cells, prev_rows, out, flags, s);
        }))
        return MF_SUCCESS;
    return ops().resolve(sources, n, cells, prev_rows, out, on_device, raw);
}

mf_status mf_reference_forward(const mf_reference_args *a, mf_stream_t stream) {
    MF_RANGE("reference_forward");
    if (!dtype_known(a->dtype)) return fail(MF_ERROR_INVALID_VALUE, "unknown logits dtype %d", (int)a->dtype);
    if (a->rows == 0 || a->rows > kMaxRows || a->vocab == 0 || a->vocab > kMaxVocab || a->block_size == 0)
        return fail(MF_ERROR_INVALID_VALUE, "reference forward: bad rows, vocab or block size");
    mf_status status = check_device_range(a->input_ids, (size_t)a->rows * 4, "input ids");
    if (status == MF_SUCCESS) status = check_device_range(a->meta, (size_t)a->rows * 8, "row meta");
    if (status == MF_SUCCESS && a->table_words == 0)
        status = fail(MF_ERROR_INVALID_VALUE, "block tables must hold at least one id");
    if (status == MF_SUCCESS)
        status = check_device_range(a->tables, (size_t)a->table_words * 4, "block tables");
    if (status == MF_SUCCESS) status = check_device_range(a->kv, (size_t)a->kv_slots * 4, "kv cache");
    if (status == MF_SUCCESS && a->logits)  // no logits: a prefill, KV writes only
        status = check_device_range(a->logits, (size_t)a->rows * a->vocab * dtype_size(a->dtype), "logits");
    void *raw;
    if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
    if (status != MF_SUCCESS) return status;
    if (kept_for_graph(raw, [copy = *a](mf_stream_t s) { return mf_reference_forward(&copy, s); }))
        return MF_SUCCESS;
    return ops().reference_forward(a, raw);
}

}  // extern "C"
