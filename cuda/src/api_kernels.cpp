// Public entry points: the two feed kernels and the reference forward. Every argument is checked
// here, before anything is queued, so a bad call launches nothing.
#include <cstdint>

#include "api.hpp"

using namespace mf;

namespace {
constexpr uint32_t kMaxRows = MF_MAX_ROWS;
constexpr uint32_t kMaxVocab = MF_MAX_VOCAB;

size_t dtype_size(mf_dtype dtype) { return dtype == MF_DTYPE_F32 ? 4 : 2; }
bool dtype_known(mf_dtype dtype) {
    return dtype == MF_DTYPE_F32 || dtype == MF_DTYPE_F16 || dtype == MF_DTYPE_BF16;
}
bool aligned(const void *ptr, size_t to) { return ((uintptr_t)ptr % to) == 0; }

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
    if (!a->masks) return fail(MF_ERROR_INVALID_VALUE, "masks is a null pointer");
    for (uint32_t i = 0; i < 2 * a->rows; ++i) {
        uint32_t id = a->masks[i];
        if (id != MF_NO_TOKEN && id >= a->vocab)
            return fail(MF_ERROR_INVALID_VALUE, "mask id %u of row %u is not below vocab %u", id, i / 2,
                        a->vocab);
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
    if (status != MF_SUCCESS) return status;
    status = ops().argmax(args, raw);
    if (status == MF_SUCCESS && args->host_dst)
        status = ops().copy_async(args->host_dst, args->cells, (size_t)args->rows * 4, kD2H, raw);
    if (status == MF_SUCCESS && event) status = ops().event_record(event->raw, (mf_stream_t)(uintptr_t)raw);
    return status;
}

mf_status mf_resolve_feed(const uint32_t *sources, uint32_t n, const uint32_t *cells, uint32_t prev_rows,
                          uint32_t *out, mf_stream_t stream) {
    MF_RANGE("resolve_feed");
    if (n == 0 || n > kMaxRows) return fail(MF_ERROR_INVALID_VALUE, "rows must be in [1, %u], got %u", kMaxRows, n);
    if (!sources) return fail(MF_ERROR_INVALID_VALUE, "sources is a null pointer");
    for (uint32_t i = 0; i < n; ++i) {
        uint32_t s = sources[i];
        if (!(s & MF_FEED_HOST_BIT) && s >= prev_rows)
            return fail(MF_ERROR_INVALID_VALUE,
                        "source %u reads feed cell %u, beyond the previous step's %u rows", i, s, prev_rows);
    }
    if (!aligned(cells, 4) || !aligned(out, 4))
        return fail(MF_ERROR_INVALID_VALUE, "cells or out pointer is misaligned");
    mf_status status = prev_rows ? check_device_range(cells, (size_t)prev_rows * 4, "feed cells") : MF_SUCCESS;
    if (status == MF_SUCCESS) status = check_device_range(out, (size_t)n * 4, "resolve output");
    void *raw;
    if (status == MF_SUCCESS) status = resolve_stream(stream, &raw);
    if (status != MF_SUCCESS) return status;
    return ops().resolve(sources, n, cells, out, raw);
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
    return ops().reference_forward(a, raw);
}

}  // extern "C"
