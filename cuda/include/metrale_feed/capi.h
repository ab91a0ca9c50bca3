/* metrale_feed's C API for C and C++ extensions (pybind11, nanobind, plain CPython).
 *
 *     #include <metrale_feed/capi.h>
 *     const mf_capi *feed = mf_import_capi();   // NULL, with a Python error set, on failure
 *     int done; feed->event_query(handle, &done);
 *
 * The table comes from the `metrale_feed._C_API` capsule, so an extension reaches the same backend,
 * handles and allocations as the Python package without linking the C layer. Functions are only
 * ever appended; check `version` (or `size`) before using a newer entry.
 *
 * Version 2 appended the full descriptor's entry: `mf_argmax_args` grew (bitmask, sampling,
 * logprobs, partial slices) after version 1, so an extension built against version 1 passes the
 * shorter `mf_argmax_args_v1`. Its slot keeps that meaning (renamed `argmax_to_feed_v1`, reading
 * exactly the old fields), and `argmax_to_feed` is now a new slot that reads the whole descriptor.
 *
 * Version 3 appended the ops of speculative decoding, penalties and top logprobs (verify_to_feed,
 * resolve_verified, penalties_apply, penalties_update, top_logprobs, top_logprobs_combine).
 *
 * Since version 2 every descriptor starts with `struct_size` (feed.h, "descriptors"): set one up
 * with its mf_*_args_init() (header-only, nothing to link), so later growth never reads past what
 * an extension built against an older header passes. A NULL descriptor is MF_ERROR_INVALID_VALUE
 * in every slot. */
#ifndef METRALE_FEED_CAPI_H
#define METRALE_FEED_CAPI_H

#include "metrale_feed/feed.h"

#define MF_CAPI_VERSION 3
#define MF_CAPI_CAPSULE "metrale_feed._C_API"

/* Version 1's descriptor (before struct_size): its fields are the first of mf_argmax_args's. */
typedef struct mf_argmax_args_v1 {
    const void *logits;
    mf_dtype dtype;
    uint32_t rows;
    uint32_t vocab;
    uint64_t row_stride;
    const uint32_t *masks;
    uint32_t *cells;
    uint32_t cell_capacity;
    void *host_dst;
    mf_event_t event;
} mf_argmax_args_v1;

typedef struct mf_capi {
    uint32_t version;
    uint32_t size; /* sizeof(mf_capi) of the package's build */
    const char *(*last_error)(void);
    int (*last_cuda_error)(void);
    mf_backend (*active_backend)(void);
    mf_status (*event_create)(unsigned flags, mf_event_t *out);
    mf_status (*event_record)(mf_event_t event, mf_stream_t stream);
    mf_status (*event_query)(mf_event_t event, int *done);
    mf_status (*event_synchronize)(mf_event_t event);
    mf_status (*event_destroy)(mf_event_t event);
    mf_status (*stream_create)(unsigned flags, mf_stream_t *out);
    mf_status (*stream_synchronize)(mf_stream_t stream);
    mf_status (*stream_destroy)(mf_stream_t stream);
    mf_status (*host_alloc)(size_t nbytes, unsigned flags, void **out);
    mf_status (*host_free)(void *ptr, size_t nbytes);
    mf_status (*device_alloc)(size_t nbytes, void **out);
    mf_status (*device_free)(void *ptr);
    mf_status (*copy_d2h_async)(void *host_dst, const void *dev_src, size_t nbytes, mf_stream_t stream);
    mf_status (*copy_h2d_async)(void *dev_dst, const void *host_src, size_t nbytes, mf_stream_t stream);
    /* Version 1's entry: reads an mf_argmax_args_v1 (masks and no other option). */
    mf_status (*argmax_to_feed_v1)(const mf_argmax_args_v1 *args, mf_stream_t stream);
    mf_status (*resolve_feed)(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, mf_stream_t stream);
    void (*nvtx_push)(const char *name);
    void (*nvtx_pop)(void);
    /* ---- version 2 ---- */
    mf_status (*argmax_to_feed)(const mf_argmax_args *args, mf_stream_t stream); /* the whole one */
    mf_status (*stream_wait_event)(mf_stream_t stream, mf_event_t event);
    mf_status (*copy_d2d_async)(void *dev_dst, const void *dev_src, size_t nbytes, mf_stream_t stream);
    mf_status (*memset_async)(void *dev, int value, size_t nbytes, mf_stream_t stream);
    mf_status (*launch_host_func)(mf_stream_t stream, mf_host_fn fn, void *data);
    mf_status (*combine_partials)(const mf_combine_args *args, mf_stream_t stream);
    mf_status (*graph_begin)(mf_stream_t stream);
    mf_status (*graph_end)(mf_stream_t stream, mf_graph_t *out);
    mf_status (*graph_launch)(mf_graph_t graph, mf_stream_t stream);
    mf_status (*graph_destroy)(mf_graph_t graph);
    /* ---- version 3 ---- */
    mf_status (*verify_to_feed)(const mf_verify_args *args, mf_stream_t stream);
    mf_status (*resolve_verified)(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                                  uint32_t *out_advance, mf_stream_t stream);
    mf_status (*penalties_apply)(const mf_penalty_args *args, mf_stream_t stream);
    mf_status (*penalties_update)(const mf_penalty_args *args, mf_stream_t stream);
    mf_status (*top_logprobs)(const mf_top_logprobs_args *args, mf_stream_t stream);
    mf_status (*top_logprobs_combine)(const mf_top_combine_args *args, mf_stream_t stream);
} mf_capi;

#ifdef MF_CAPI_IMPLEMENTATION
#include <stddef.h>
#include <string.h>

#ifdef __cplusplus
#define MF_CAPI_ASSERT(c, m) static_assert(c, m)
#else
#define MF_CAPI_ASSERT(c, m) _Static_assert(c, m)
#endif
MF_CAPI_ASSERT(sizeof(mf_argmax_args_v1) == 72, "mf_argmax_args_v1 is a shipped layout: never change it");

/* Version 1's descriptor, read to its end and no further, field by field; every later field
 * zero (off). */
static mf_status mf_capi_argmax_v1(const mf_argmax_args_v1 *old, mf_stream_t stream) {
    mf_argmax_args a;
    if (!old) return mf_argmax_to_feed(NULL, stream); /* refused there, with the message */
    mf_argmax_args_init(&a);
    a.logits = old->logits;
    a.dtype = old->dtype;
    a.rows = old->rows;
    a.vocab = old->vocab;
    a.row_stride = old->row_stride;
    a.masks = old->masks;
    a.cells = old->cells;
    a.cell_capacity = old->cell_capacity;
    a.host_dst = old->host_dst;
    a.event = old->event;
    return mf_argmax_to_feed(&a, stream);
}

/* Used once, by the extension that owns the C layer. */
static inline void mf_capi_fill(mf_capi *t) {
    t->version = MF_CAPI_VERSION;
    t->size = (uint32_t)sizeof(mf_capi);
    t->last_error = mf_last_error;
    t->last_cuda_error = mf_last_cuda_error;
    t->active_backend = mf_active_backend;
    t->event_create = mf_event_create;
    t->event_record = mf_event_record;
    t->event_query = mf_event_query;
    t->event_synchronize = mf_event_synchronize;
    t->event_destroy = mf_event_destroy;
    t->stream_create = mf_stream_create;
    t->stream_synchronize = mf_stream_synchronize;
    t->stream_destroy = mf_stream_destroy;
    t->host_alloc = mf_host_alloc;
    t->host_free = mf_host_free;
    t->device_alloc = mf_device_alloc;
    t->device_free = mf_device_free;
    t->copy_d2h_async = mf_copy_d2h_async;
    t->copy_h2d_async = mf_copy_h2d_async;
    t->argmax_to_feed_v1 = mf_capi_argmax_v1;
    t->resolve_feed = mf_resolve_feed;
    t->nvtx_push = mf_nvtx_push;
    t->nvtx_pop = mf_nvtx_pop;
    t->argmax_to_feed = mf_argmax_to_feed;
    t->stream_wait_event = mf_stream_wait_event;
    t->copy_d2d_async = mf_copy_d2d_async;
    t->memset_async = mf_memset_async;
    t->launch_host_func = mf_launch_host_func;
    t->combine_partials = mf_combine_partials;
    t->graph_begin = mf_graph_begin;
    t->graph_end = mf_graph_end;
    t->graph_launch = mf_graph_launch;
    t->graph_destroy = mf_graph_destroy;
    t->verify_to_feed = mf_verify_to_feed;
    t->resolve_verified = mf_resolve_verified;
    t->penalties_apply = mf_penalties_apply;
    t->penalties_update = mf_penalties_update;
    t->top_logprobs = mf_top_logprobs;
    t->top_logprobs_combine = mf_top_logprobs_combine;
}
#elif defined(Py_PYTHON_H)
/* The table, or NULL with a Python exception set. Include Python.h first to get this helper. */
static inline const mf_capi *mf_import_capi(void) {
    const mf_capi *table = (const mf_capi *)PyCapsule_Import(MF_CAPI_CAPSULE, 0);
    if (table && table->version < MF_CAPI_VERSION) {
        PyErr_SetString(PyExc_ImportError, "metrale_feed's C API is older than this extension needs");
        return NULL;
    }
    return table;
}
#endif

#endif
