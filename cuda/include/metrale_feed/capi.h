/* metrale_feed's C API for C and C++ extensions (pybind11, nanobind, plain CPython).
 *
 *     #include <metrale_feed/capi.h>
 *     const mf_capi *feed = mf_import_capi();   // NULL, with a Python error set, on failure
 *     int done; feed->event_query(handle, &done);
 *
 * The table comes from the `metrale_feed._C_API` capsule, so an extension reaches the same backend,
 * handles and allocations as the Python package without linking the C layer. Functions are only
 * ever appended; check `version` (or `size`) before using a newer entry. */
#ifndef METRALE_FEED_CAPI_H
#define METRALE_FEED_CAPI_H

#include "metrale_feed/feed.h"

#define MF_CAPI_VERSION 1
#define MF_CAPI_CAPSULE "metrale_feed._C_API"

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
    mf_status (*argmax_to_feed)(const mf_argmax_args *args, mf_stream_t stream);
    mf_status (*resolve_feed)(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, mf_stream_t stream);
    void (*nvtx_push)(const char *name);
    void (*nvtx_pop)(void);
} mf_capi;

#ifdef MF_CAPI_IMPLEMENTATION
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
    t->argmax_to_feed = mf_argmax_to_feed;
    t->resolve_feed = mf_resolve_feed;
    t->nvtx_push = mf_nvtx_push;
    t->nvtx_pop = mf_nvtx_pop;
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
