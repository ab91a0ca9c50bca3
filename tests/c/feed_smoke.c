/* A C-only smoke test of the C ABI (metrale_feed/feed.h) on the host backend, for valgrind and the
 * sanitizers: events, streams, pinned and device memory, copies, argmax_to_feed, resolve_feed, the
 * grammar ops and a pick's grammar, the fault knobs and the error paths (double frees, unknown handles, ranges), with
 * results checked against plain C loops written here. Exit status 0 when every check passed.
 *
 * Built and run by tools/sanitize.sh against the static library metrale_feed_c. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrale_feed/feed.h"
#include "metrale_feed/logprob_rule.h" /* MF_FAULT_*, and partial_layout.h's block sizes */

static int failures = 0;

#define CHECK(cond)                                                                           \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, \
                    #cond, mf_last_error());                                                  \
            ++failures;                                                                       \
        }                                                                                     \
    } while (0)

#define OK(call) CHECK((call) == MF_SUCCESS)
#define FAILS_WITH(call, status)                                                   \
    do {                                                                           \
        mf_clear_error();                                                          \
        CHECK((call) == (status));                                                 \
        CHECK(mf_last_error()[0] != '\0'); /* a failure always says why */         \
    } while (0)

/* The rule of docs/encodings.md for float32 rows, as a plain loop: NaN never wins, ties go to the
 * lowest id, masked ids are skipped, no candidate answers NO_TOKEN. */
static uint32_t plain_argmax(const float *row, uint32_t vocab, uint32_t m0, uint32_t m1) {
    uint32_t best = MF_NO_TOKEN;
    for (uint32_t v = 0; v < vocab; ++v) {
        if (v == m0 || v == m1) continue;
        if (best == MF_NO_TOKEN) {
            best = v;
            continue;
        }
        float a = row[v], b = row[best];
        if (isnan(a)) continue;
        if (isnan(b) || a > b) best = v;
    }
    return best;
}

static void test_events_and_streams(void) {
    mf_event_t e = 0, t0 = 0, t1 = 0;
    mf_stream_t s = 0;
    int done = 0, idle = 0;
    float ms = -1.0f;

    OK(mf_event_create(0, &e));
    CHECK(e != 0);
    OK(mf_event_query(e, &done));
    CHECK(done == 1); /* never recorded: complete, as in CUDA */
    OK(mf_stream_create(MF_STREAM_NON_BLOCKING, &s));
    OK(mf_stream_check(s));
    OK(mf_event_record(e, s));
    OK(mf_event_synchronize(e));
    OK(mf_event_query(e, &done));
    CHECK(done == 1);
    OK(mf_stream_query(s, &idle));
    OK(mf_stream_synchronize(s));
    OK(mf_stream_query(s, &idle));
    CHECK(idle == 1);
    OK(mf_stream_wait_event(s, e));

    OK(mf_event_create(MF_EVENT_TIMING, &t0));
    OK(mf_event_create(MF_EVENT_TIMING, &t1));
    OK(mf_event_record(t0, s));
    OK(mf_event_record(t1, s));
    OK(mf_event_synchronize(t1));
    OK(mf_event_elapsed_ms(t0, t1, &ms));
    CHECK(ms >= 0.0f);
    FAILS_WITH(mf_event_elapsed_ms(e, t1, &ms), MF_ERROR_INVALID_VALUE); /* e has no timing */

    /* Error paths: unknown flags, destroyed and unknown handles, the default stream. */
    mf_event_t bad = 0;
    FAILS_WITH(mf_event_create(0x80u, &bad), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_stream_create(0x80u, &s), MF_ERROR_INVALID_VALUE);
    OK(mf_event_destroy(t0));
    OK(mf_event_destroy(t1));
    OK(mf_event_destroy(e));
    FAILS_WITH(mf_event_destroy(e), MF_ERROR_INVALID_HANDLE); /* double destroy */
    FAILS_WITH(mf_event_query(e, &done), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_event_record(e, 0), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_event_synchronize(0xDEAD00000001ull), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_event_query(0, &done), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_event_wrap(0x1234, &bad), MF_ERROR_INVALID_VALUE); /* cuda only */
    OK(mf_stream_destroy(s));
    FAILS_WITH(mf_stream_destroy(s), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_stream_synchronize(s), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_stream_destroy(0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_stream_check(0xBEEF0ull), MF_ERROR_INVALID_HANDLE);
}

static void test_memory_and_copies(void) {
    void *pinned = NULL, *dev = NULL, *dev2 = NULL;
    size_t left = 0;
    unsigned char host[64], back[64];

    OK(mf_host_alloc(256, 0, &pinned));
    for (int i = 0; i < 256; ++i) CHECK(((unsigned char *)pinned)[i] == 0); /* zeroed */
    CHECK(mf_mem_lookup((char *)pinned + 10, &left) == MF_MEM_PINNED && left == 246);
    FAILS_WITH(mf_host_free(pinned, 255), MF_ERROR_INVALID_VALUE); /* wrong size: still live */
    FAILS_WITH(mf_host_free((char *)pinned + 16, 240), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_host_alloc(0, 0, &dev), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_host_alloc(16, 0x100u, &dev), MF_ERROR_INVALID_VALUE);

    OK(mf_device_alloc(64, &dev));
    OK(mf_device_alloc(64, &dev2));
    CHECK(mf_mem_lookup(dev, &left) == MF_MEM_DEVICE && left == 64);
    CHECK(mf_mem_lookup(host, NULL) == MF_MEM_UNKNOWN);
    for (int i = 0; i < 64; ++i) host[i] = (unsigned char)(i * 7 + 1);
    OK(mf_copy_h2d_async(dev, host, 64, 0));
    OK(mf_copy_d2d_async(dev2, (char *)dev + 16, 48, 0));
    OK(mf_memset_async((char *)dev2 + 48, 0xAB, 16, 0));
    OK(mf_copy_d2h_async(pinned, dev2, 64, 0));
    OK(mf_stream_synchronize(0));
    for (int i = 0; i < 48; ++i) CHECK(((unsigned char *)pinned)[i] == host[i + 16]);
    for (int i = 48; i < 64; ++i) CHECK(((unsigned char *)pinned)[i] == 0xAB);

    /* Ranges, kinds and foreign memory, refused before anything is queued. */
    memset(back, 0x5A, sizeof back);
    FAILS_WITH(mf_copy_d2h_async(back, dev, 65, 0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_copy_d2h_async(back, (char *)dev + 60, 8, 0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_copy_d2h_async(back, host, 8, 0), MF_ERROR_INVALID_HANDLE); /* foreign */
    FAILS_WITH(mf_copy_d2h_async(back, pinned, 8, 0), MF_ERROR_INVALID_VALUE); /* pinned */
    FAILS_WITH(mf_copy_d2h_async(dev2, dev, 8, 0), MF_ERROR_INVALID_VALUE);    /* device dst */
    FAILS_WITH(mf_copy_h2d_async(dev, pinned, 257, 0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_copy_d2d_async(dev, dev2, 65, 0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_copy_d2h_async(back, dev, 8, 0xBEEF0ull), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_copy_d2h_async(NULL, dev, 8, 0), MF_ERROR_INVALID_VALUE);
    OK(mf_stream_synchronize(0));
    for (size_t i = 0; i < sizeof back; ++i) CHECK(back[i] == 0x5A); /* nothing launched */

    /* An injected copy fault: the call fails, and the knob is spent. */
    mf_host_faults faults = {0, 0, 0, 1, 0, 0};
    mf_host_configure(&faults);
    FAILS_WITH(mf_copy_d2h_async(back, dev, 8, 0), MF_ERROR_INJECTED);
    OK(mf_copy_d2h_async(back, dev, 8, 0));
    OK(mf_stream_synchronize(0));
    CHECK(memcmp(back, host, 8) == 0);
    memset(&faults, 0, sizeof faults);
    mf_host_configure(&faults);

    OK(mf_device_free(dev));
    OK(mf_device_free(dev2));
    FAILS_WITH(mf_device_free(dev), MF_ERROR_INVALID_HANDLE); /* double free */
    FAILS_WITH(mf_device_free(host), MF_ERROR_INVALID_HANDLE);
    FAILS_WITH(mf_copy_d2h_async(back, dev, 8, 0), MF_ERROR_INVALID_HANDLE); /* freed */
    OK(mf_host_free(pinned, 256));
    FAILS_WITH(mf_host_free(pinned, 256), MF_ERROR_INVALID_HANDLE); /* double free */
}

enum { ROWS = 5, VOCAB = 11, STRIDE = 13 };

static void test_argmax_and_resolve(void) {
    float logits[ROWS * STRIDE];
    uint32_t masks[ROWS * 2] = {MF_NO_TOKEN, MF_NO_TOKEN, 3, MF_NO_TOKEN, 0, 10,
                                MF_NO_TOKEN, MF_NO_TOKEN, 4, 4};
    uint32_t want[ROWS], cells_back[ROWS];
    void *dlogits = NULL, *cells = NULL, *dst = NULL, *out = NULL;
    mf_event_t event = 0;
    mf_stream_t stream = 0;

    srand(7);
    for (int i = 0; i < ROWS * STRIDE; ++i) logits[i] = (float)(rand() % 9) - 4.0f; /* ties */
    for (int r = 0; r < ROWS; ++r) {
        logits[r * STRIDE + VOCAB] = INFINITY; /* padding past vocab must never win */
        logits[r * STRIDE + VOCAB + 1] = INFINITY;
    }
    logits[0 * STRIDE + 2] = NAN;
    for (int v = 0; v < VOCAB; ++v) logits[3 * STRIDE + v] = NAN; /* all NaN: lowest id */
    logits[4 * STRIDE + 6] = -0.0f;
    for (int r = 0; r < ROWS; ++r)
        want[r] = plain_argmax(logits + r * STRIDE, VOCAB, masks[2 * r], masks[2 * r + 1]);

    OK(mf_stream_create(0, &stream));
    OK(mf_event_create(0, &event));
    OK(mf_device_alloc(sizeof logits, &dlogits));
    OK(mf_device_alloc(8 * 4, &cells));
    OK(mf_host_alloc(ROWS * 4, 0, &dst));
    OK(mf_copy_h2d_async(dlogits, logits, sizeof logits, stream));

    mf_argmax_args a;
    mf_argmax_args_init(&a);
    a.logits = dlogits;
    a.dtype = MF_DTYPE_F32;
    a.rows = ROWS;
    a.vocab = VOCAB;
    a.row_stride = STRIDE;
    a.masks = masks;
    a.cells = (uint32_t *)cells;
    a.cell_capacity = 8;
    a.host_dst = dst;
    a.event = event;
    OK(mf_argmax_to_feed(&a, stream));
    masks[0] = 0; /* the caller may reuse masks at once */
    OK(mf_event_synchronize(event));
    for (int r = 0; r < ROWS; ++r) CHECK(((uint32_t *)dst)[r] == want[r]);
    masks[0] = MF_NO_TOKEN;

    /* Refused before launch: nothing is written into the cells or dst. */
    OK(mf_memset_async(cells, 0xEE, 8 * 4, stream));
    memset(dst, 0xEE, ROWS * 4);
    OK(mf_stream_synchronize(stream));
    mf_argmax_args b = a;
    uint32_t bad_masks[ROWS * 2];
    memcpy(bad_masks, masks, sizeof bad_masks);
    bad_masks[5] = VOCAB; /* a mask id not below vocab */
    b.masks = bad_masks;
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    b = a;
    b.rows = 9; /* more than the cells hold */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    b = a;
    b.row_stride = VOCAB - 1;
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    b = a;
    b.dtype = (mf_dtype)7;
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    b = a;
    b.logits = (const char *)dlogits + 2; /* misaligned */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    b = a;
    b.flags = MF_ARGS_PARTIAL_LOGPROBS; /* a partial call's flag on an unsplit call */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    b = a;
    b.event = 0xDEAD00000001ull;
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_HANDLE);
    b = a;
    b.logits = logits; /* host memory the package did not allocate */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_HANDLE);
    OK(mf_stream_synchronize(stream));
    for (int r = 0; r < ROWS; ++r) CHECK(((uint32_t *)dst)[r] == 0xEEEEEEEEu);

    /* Cells for resolve: argmax again, without a copy to the host. */
    a.host_dst = NULL;
    a.event = 0;
    OK(mf_argmax_to_feed(&a, stream));
    uint32_t sources[4] = {4, MF_FEED_HOST_BIT | 123u, 0, MF_FEED_HOST_BIT | 0x7FFFFFFFu};
    uint32_t resolved[4];
    OK(mf_device_alloc(sizeof resolved, &out));
    OK(mf_resolve_feed(sources, 4, (const uint32_t *)cells, ROWS, (uint32_t *)out, stream));
    OK(mf_copy_d2h_async(resolved, out, sizeof resolved, stream));
    OK(mf_copy_d2h_async(cells_back, cells, sizeof cells_back, stream));
    OK(mf_stream_synchronize(stream));
    for (int r = 0; r < ROWS; ++r) CHECK(cells_back[r] == want[r]);
    CHECK(resolved[0] == want[4] && resolved[1] == 123u && resolved[2] == want[0] &&
          resolved[3] == 0x7FFFFFFFu);
    sources[2] = ROWS; /* a from_row beyond the previous step */
    FAILS_WITH(mf_resolve_feed(sources, 4, (const uint32_t *)cells, ROWS, (uint32_t *)out, stream),
               MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_resolve_feed(sources, 0, (const uint32_t *)cells, ROWS, (uint32_t *)out, stream),
               MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_resolve_feed(NULL, 4, (const uint32_t *)cells, ROWS, (uint32_t *)out, stream),
               MF_ERROR_INVALID_VALUE);

    OK(mf_device_free(out));
    OK(mf_host_free(dst, ROWS * 4));
    OK(mf_device_free(cells));
    OK(mf_device_free(dlogits));
    OK(mf_event_destroy(event));
    OK(mf_stream_destroy(stream));
}

/* Graphs: a capture keeps, a launch replays reading device-resident inputs at run time, refusals
 * return MF_ERROR_CAPTURE, and graph handles are generation-checked like events. */
static void test_graphs(void) {
    mf_stream_t stream;
    mf_graph_t graph = 0, empty = 0;
    void *dev, *pinned;
    int on = 1;
    uint32_t host_masks[2] = {MF_NO_TOKEN, MF_NO_TOKEN};
    OK(mf_stream_create(MF_STREAM_NON_BLOCKING, &stream));
    OK(mf_device_alloc(32, &dev)); /* 16 bytes of logits, then the cells */
    OK(mf_host_alloc(16, 0, &pinned));
    FAILS_WITH(mf_graph_begin(0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_graph_end(stream, &graph), MF_ERROR_CAPTURE); /* not capturing */
    OK(mf_graph_begin(stream));
    OK(mf_stream_capturing(stream, &on));
    CHECK(on == 1);
    FAILS_WITH(mf_graph_begin(stream), MF_ERROR_CAPTURE);
    FAILS_WITH(mf_stream_synchronize(stream), MF_ERROR_CAPTURE);
    FAILS_WITH(mf_stream_destroy(stream), MF_ERROR_CAPTURE);
    OK(mf_copy_h2d_async(dev, pinned, 16, stream)); /* pinned: read at each launch */
    OK(mf_copy_d2h_async((char *)pinned + 8, (char *)dev + 4, 4, stream)); /* word 1 to word 2 */
    mf_argmax_args a;
    mf_argmax_args_init(&a);
    a.logits = dev;
    a.dtype = MF_DTYPE_F32;
    a.rows = 1;
    a.vocab = 4;
    a.row_stride = 4;
    a.masks = host_masks;
    a.cells = (uint32_t *)((char *)dev + 16); /* not over the logits it reads */
    a.cell_capacity = 4;
    FAILS_WITH(mf_argmax_to_feed(&a, stream), MF_ERROR_CAPTURE); /* host masks */
    OK(mf_graph_end(stream, &graph));
    CHECK(graph != 0 && mf_live_graphs() == 1);
    OK(mf_stream_capturing(stream, &on));
    CHECK(on == 0);
    for (uint32_t step = 1; step <= 3; ++step) {
        ((uint32_t *)pinned)[1] = step; /* a new value, read by the replay */
        ((uint32_t *)pinned)[2] = 0;
        OK(mf_graph_launch(graph, stream));
        OK(mf_stream_synchronize(stream));
        CHECK(((uint32_t *)pinned)[2] == step);
    }
    OK(mf_graph_begin(stream));
    OK(mf_graph_end(stream, &empty)); /* an empty graph does nothing */
    OK(mf_graph_launch(empty, stream));
    OK(mf_graph_destroy(empty));
    FAILS_WITH(mf_graph_launch(empty, stream), MF_ERROR_INVALID_HANDLE); /* generation-checked */
    FAILS_WITH(mf_graph_destroy(empty), MF_ERROR_INVALID_HANDLE);
    OK(mf_graph_begin(stream));
    OK(mf_graph_end(stream, NULL)); /* discarded */
    OK(mf_graph_destroy(graph));
    CHECK(mf_live_graphs() == 0);
    OK(mf_stream_synchronize(stream));
    OK(mf_host_free(pinned, 16));
    OK(mf_device_free(dev));
    OK(mf_stream_destroy(stream));
}

/* A top logprobs combine's fault word: the first header's reserved word, or memory of its own; any
 * other byte of the blocks it reads is refused before anything is queued. */
static void test_top_combine_fault_word(void) {
    enum { ROWS = 2, N = 3 };
    const uint64_t records = mf_top_block_records(ROWS, N);
    void *parts = NULL, *out = NULL, *fault = NULL;
    OK(mf_device_alloc(records * 16, &parts));
    OK(mf_device_alloc(ROWS * N * 8, &out));
    OK(mf_device_alloc(4, &fault));
    mf_top_combine_args a;
    mf_top_combine_args_init(&a);
    a.partials = parts;
    a.world = 1;
    a.slice_stride = (uint32_t)records;
    a.rows = ROWS;
    a.vocab = 10;
    a.n = N;
    a.out = (mf_top_logprob *)out;
    a.fault = (uint32_t *)((char *)parts + 32); /* row 0's record */
    FAILS_WITH(mf_top_logprobs_combine(&a, 0), MF_ERROR_INVALID_VALUE);
    a.fault = (uint32_t *)parts; /* the tag */
    FAILS_WITH(mf_top_logprobs_combine(&a, 0), MF_ERROR_INVALID_VALUE);
    a.fault = (uint32_t *)((char *)parts + MF_PARTIAL_OFF_FAULT); /* the reserved word: taken */
    OK(mf_top_logprobs_combine(&a, 0));
    a.fault = (uint32_t *)fault; /* a word of its own: taken */
    OK(mf_top_logprobs_combine(&a, 0));
    OK(mf_stream_synchronize(0));
    uint32_t word = 0;
    OK(mf_copy_d2h_async(&word, fault, 4, 0));
    OK(mf_stream_synchronize(0));
    CHECK((word & 0xFFu) == MF_FAULT_TAG); /* zeroed blocks: not a partial block */
    OK(mf_device_free(parts));
    OK(mf_device_free(out));
    OK(mf_device_free(fault));
}

/* The device grammar: a descriptor that skipped its init is refused before anything is read, a
 * NULL one too; then a mask through one draft and an advance, checked against the automaton
 * written out here: state 0 allows 3 (to 1) and 5 (to 2), state 1 every id but 7 (staying), state
 * 2 nothing. */
static void test_grammar(void) {
    enum { VOCAB = 40, ROWS = 3, K = 1 };
    const mf_grammar_state states[3] = {{0, 2, MF_GRAMMAR_DEAD, 0}, {2, 1, 1, 0}, {3, 0, MF_GRAMMAR_DEAD, MF_GRAMMAR_FINAL}};
    const mf_grammar_edge edges[3] = {{3, 1}, {5, 2}, {7, MF_GRAMMAR_DEAD}};
    const uint32_t words[ROWS] = {0, 1, MF_NO_TOKEN}, drafts[ROWS * K] = {3, 7, 9}, cells[ROWS] = {5, 8, 1};
    void *st = NULL, *ed = NULL, *wd = NULL, *dr = NULL, *out = NULL, *cl = NULL;
    OK(mf_device_alloc(sizeof states, &st));
    OK(mf_device_alloc(sizeof edges, &ed));
    OK(mf_device_alloc(sizeof words, &wd));
    OK(mf_device_alloc(sizeof drafts, &dr));
    OK(mf_device_alloc(ROWS * (K + 1) * 2 * 4, &out));
    OK(mf_device_alloc(sizeof cells, &cl));
    OK(mf_copy_h2d_async(st, states, sizeof states, 0));
    OK(mf_copy_h2d_async(ed, edges, sizeof edges, 0));
    OK(mf_copy_h2d_async(wd, words, sizeof words, 0));
    OK(mf_copy_h2d_async(dr, drafts, sizeof drafts, 0));
    OK(mf_copy_h2d_async(cl, cells, sizeof cells, 0));
    mf_grammar_mask_args m;
    memset(&m, 0xA5, sizeof m); /* no init: stack garbage */
    FAILS_WITH(mf_grammar_mask(&m, 0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_grammar_mask(NULL, 0), MF_ERROR_INVALID_VALUE);
    mf_grammar_mask_args_init(&m);
    m.states = (const mf_grammar_state *)st;
    m.num_states = 3;
    m.edges = (const mf_grammar_edge *)ed;
    m.num_edges = 3;
    m.vocab = VOCAB;
    m.rows = ROWS;
    m.k = K;
    m.state_words = (const uint32_t *)wd;
    m.drafts = (const uint32_t *)dr;
    m.bitmask_out = (uint32_t *)out;
    OK(mf_grammar_mask(&m, 0));
    uint32_t got[ROWS * (K + 1) * 2];
    OK(mf_copy_d2h_async(got, out, sizeof got, 0));
    OK(mf_stream_synchronize(0));
    /* row 0: state 0, then 3 takes it to 1; row 1: state 1, 7 is refused so it stays; row 2: free */
    const uint32_t want[ROWS * (K + 1) * 2] = {(1u << 3) | (1u << 5), 0u, 0xFFFFFF7Fu, 0xFFu, 0xFFFFFF7Fu,
                                               0xFFu, 0xFFFFFF7Fu, 0xFFu, 0xFFFFFFFFu, 0xFFu, 0xFFFFFFFFu, 0xFFu};
    CHECK(memcmp(got, want, sizeof got) == 0);
    mf_grammar_advance_args a;
    memset(&a, 0xA5, sizeof a);
    FAILS_WITH(mf_grammar_advance(&a, 0), MF_ERROR_INVALID_VALUE);
    FAILS_WITH(mf_grammar_advance(NULL, 0), MF_ERROR_INVALID_VALUE);
    mf_grammar_advance_args_init(&a);
    a.states = (const mf_grammar_state *)st;
    a.num_states = 3;
    a.edges = (const mf_grammar_edge *)ed;
    a.num_edges = 3;
    a.vocab = VOCAB;
    a.rows = ROWS;
    a.cells = (const uint32_t *)cl;
    a.state_words = (uint32_t *)wd;
    OK(mf_grammar_advance(&a, 0));
    uint32_t after[ROWS];
    OK(mf_copy_d2h_async(after, wd, sizeof after, 0));
    OK(mf_stream_synchronize(0));
    CHECK(after[0] == 2 && after[1] == 1 && after[2] == MF_NO_TOKEN);
    OK(mf_device_free(st));
    OK(mf_device_free(ed));
    OK(mf_device_free(wd));
    OK(mf_device_free(dr));
    OK(mf_device_free(out));
    OK(mf_device_free(cl));
}

/* A pick's grammar through the C ABI (mf_grammar_pick): the same automaton as test_grammar, every
 * row's logits ranking 7 over 5 over 3. Refusals queue nothing (the state words and the scratch
 * keep their bytes); argmax_to_feed and a verify with host drafts mask, pick and advance in one
 * call; a descriptor of the size before `grammar` is read as having none; a captured call replays
 * with the states it finds. */
static void test_grammar_pick(void) {
    enum { VOCAB = 40, ROWS = 3, K = 1, WORDS = 2, LOGIT_ROWS = ROWS * (K + 1) };
    const mf_grammar_state states[3] = {{0, 2, MF_GRAMMAR_DEAD, 0}, {2, 1, 1, 0}, {3, 0, MF_GRAMMAR_DEAD, MF_GRAMMAR_FINAL}};
    const mf_grammar_edge edges[3] = {{3, 1}, {5, 2}, {7, MF_GRAMMAR_DEAD}};
    const uint32_t start[ROWS] = {0, 1, MF_NO_TOKEN}, drafts[ROWS * K] = {5, 7, 7};
    const size_t scratch_bytes = LOGIT_ROWS * WORDS * 4 + ROWS * K * 4; /* the mask, then the drafts */
    float logits[LOGIT_ROWS * VOCAB];
    for (int i = 0; i < LOGIT_ROWS * VOCAB; ++i) logits[i] = 0.0f;
    for (int r = 0; r < LOGIT_ROWS; ++r) {
        logits[r * VOCAB + 7] = 3.0f;
        logits[r * VOCAB + 5] = 2.0f;
        logits[r * VOCAB + 3] = 1.0f;
    }
    void *st = NULL, *ed = NULL, *wd = NULL, *dl = NULL, *cl = NULL, *sc = NULL, *dst = NULL;
    mf_event_t event = 0;
    mf_stream_t stream = 0;
    OK(mf_stream_create(MF_STREAM_NON_BLOCKING, &stream));
    OK(mf_event_create(0, &event));
    OK(mf_device_alloc(sizeof states, &st));
    OK(mf_device_alloc(sizeof edges, &ed));
    OK(mf_device_alloc(sizeof start, &wd));
    OK(mf_device_alloc(sizeof logits, &dl));
    OK(mf_device_alloc(ROWS * (K + 2) * 4, &cl));
    OK(mf_device_alloc(scratch_bytes, &sc));
    OK(mf_host_alloc(ROWS * (K + 2) * 4, 0, &dst));
    OK(mf_copy_h2d_async(st, states, sizeof states, stream));
    OK(mf_copy_h2d_async(ed, edges, sizeof edges, stream));
    OK(mf_copy_h2d_async(wd, start, sizeof start, stream));
    OK(mf_copy_h2d_async(dl, logits, sizeof logits, stream));
    OK(mf_memset_async(sc, 0xEE, scratch_bytes, stream));

    mf_grammar_pick g;
    mf_grammar_pick_init(&g);
    g.states = (const mf_grammar_state *)st;
    g.num_states = 3;
    g.edges = (const mf_grammar_edge *)ed;
    g.num_edges = 3;
    g.vocab = VOCAB;
    g.state_words = (uint32_t *)wd;
    g.scratch = (uint32_t *)sc;
    mf_argmax_args a;
    mf_argmax_args_init(&a);
    a.logits = dl;
    a.dtype = MF_DTYPE_F32;
    a.rows = ROWS;
    a.vocab = VOCAB;
    a.row_stride = VOCAB;
    a.cells = (uint32_t *)cl;
    a.cell_capacity = ROWS;
    a.host_dst = dst;
    a.event = event;
    a.grammar = &g;

    /* Refused before anything is queued: the descriptor, the automaton, the overlaps, the event. */
    mf_grammar_pick bad;
    memset(&bad, 0xA5, sizeof bad); /* no init */
    mf_argmax_args b = a;
    b.grammar = &bad;
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    bad = g;
    bad.vocab = VOCAB + 1; /* an automaton for another vocabulary */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    bad = g;
    bad.num_states = 4; /* past the states array */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    bad = g;
    bad.state_words = (uint32_t *)cl; /* over the cells the pick writes */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    bad = g;
    bad.scratch = (uint32_t *)dl; /* over the logits the pick reads */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    bad = g;
    bad.scratch = (uint32_t *)st; /* over the automaton the mask reads */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    bad = g;
    bad.state_words = (uint32_t *)sc + 1; /* inside the scratch */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_VALUE);
    b = a;
    b.event = 0xDEAD00000001ull; /* the pick's own check, after the grammar's passed */
    FAILS_WITH(mf_argmax_to_feed(&b, stream), MF_ERROR_INVALID_HANDLE);
    OK(mf_stream_synchronize(stream));
    uint32_t words[ROWS], scratch[LOGIT_ROWS * WORDS + ROWS * K], cells[ROWS * (K + 2)];
    OK(mf_copy_d2h_async(words, wd, sizeof words, stream));
    OK(mf_copy_d2h_async(scratch, sc, sizeof scratch, stream));
    OK(mf_stream_synchronize(stream));
    CHECK(memcmp(words, start, sizeof words) == 0);
    for (size_t i = 0; i < sizeof scratch / 4; ++i) CHECK(scratch[i] == 0xEEEEEEEEu);

    /* Row 0 (state 0: 3 or 5) picks 5 and goes to 2; row 1 (state 1: all but 7) picks 5 and stays;
     * row 2 is free. The event covers the states. */
    OK(mf_argmax_to_feed(&a, stream));
    OK(mf_event_synchronize(event));
    CHECK(((uint32_t *)dst)[0] == 5 && ((uint32_t *)dst)[1] == 5 && ((uint32_t *)dst)[2] == 7);
    OK(mf_copy_d2h_async(words, wd, sizeof words, stream));
    OK(mf_stream_synchronize(stream));
    CHECK(words[0] == 2 && words[1] == 1 && words[2] == MF_NO_TOKEN);

    /* A caller built before `grammar` was appended: its size says so, and whatever its stack holds
     * there is not read. */
    b = a;
    b.struct_size = (uint32_t)offsetof(mf_argmax_args, grammar);
    b.grammar = (const mf_grammar_pick *)(uintptr_t)0x10;
    OK(mf_argmax_to_feed(&b, stream));
    OK(mf_event_synchronize(event));
    CHECK(((uint32_t *)dst)[0] == 7 && ((uint32_t *)dst)[1] == 7 && ((uint32_t *)dst)[2] == 7);
    OK(mf_copy_d2h_async(words, wd, sizeof words, stream));
    OK(mf_stream_synchronize(stream));
    CHECK(words[0] == 2 && words[1] == 1 && words[2] == MF_NO_TOKEN); /* no advance */

    /* A verify with host drafts, uploaded after the mask in the scratch for its walk. Row 0 keeps
     * 5 (state 0 to 2), then state 2 allows nothing; row 1's draft 7 is refused by state 1, which
     * emits 5; row 2 is free. */
    OK(mf_copy_h2d_async(wd, start, sizeof start, stream));
    mf_verify_args v;
    mf_verify_args_init(&v);
    v.logits = dl;
    v.dtype = MF_DTYPE_F32;
    v.rows = ROWS;
    v.k = K;
    v.vocab = VOCAB;
    v.row_stride = VOCAB;
    v.drafts = drafts;
    v.cells = (uint32_t *)cl;
    v.cell_capacity = ROWS * (K + 2);
    v.host_dst = dst;
    v.event = event;
    v.grammar = &g;
    mf_verify_args vb = v;
    bad = g;
    bad.scratch = (uint32_t *)sc + 1; /* 4 bytes short: the drafts after the mask do not fit */
    vb.grammar = &bad;
    FAILS_WITH(mf_verify_to_feed(&vb, stream), MF_ERROR_INVALID_VALUE);
    OK(mf_verify_to_feed(&v, stream));
    OK(mf_event_synchronize(event));
    const uint32_t want_cells[ROWS * (K + 2)] = {2, 5, MF_NO_TOKEN, 1, 5, MF_NO_TOKEN, 2, 7, 7};
    CHECK(memcmp(dst, want_cells, sizeof want_cells) == 0);
    OK(mf_copy_d2h_async(words, wd, sizeof words, stream));
    OK(mf_stream_synchronize(stream));
    CHECK(words[0] == 2 && words[1] == 1 && words[2] == MF_NO_TOKEN);

    /* Captured once, replayed twice: each launch reads the states the last one left (row 0 has no
     * candidate the second time: NO_TOKEN, its state kept). */
    mf_graph_t graph = 0;
    OK(mf_copy_h2d_async(wd, start, sizeof start, stream));
    OK(mf_stream_synchronize(stream));
    a.host_dst = NULL;
    a.event = 0;
    OK(mf_graph_begin(stream));
    mf_grammar_pick captured = g;
    a.grammar = &captured;
    OK(mf_argmax_to_feed(&a, stream));
    OK(mf_graph_end(stream, &graph));
    memset(&captured, 0, sizeof captured); /* the graph keeps its own copy */
    const uint32_t want_ids[2][ROWS] = {{5, 5, 7}, {MF_NO_TOKEN, 5, 7}};
    for (int launch = 0; launch < 2; ++launch) {
        OK(mf_graph_launch(graph, stream));
        OK(mf_copy_d2h_async(cells, cl, ROWS * 4, stream));
        OK(mf_copy_d2h_async(words, wd, sizeof words, stream));
        OK(mf_stream_synchronize(stream));
        CHECK(memcmp(cells, want_ids[launch], ROWS * 4) == 0);
        CHECK(words[0] == 2 && words[1] == 1 && words[2] == MF_NO_TOKEN);
    }
    OK(mf_graph_destroy(graph));

    OK(mf_stream_synchronize(stream));
    OK(mf_host_free(dst, ROWS * (K + 2) * 4));
    void *bufs[] = {st, ed, wd, dl, cl, sc};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) OK(mf_device_free(bufs[i]));
    OK(mf_event_destroy(event));
    OK(mf_stream_destroy(stream));
}

int main(void) {
    uint64_t events = 1, streams = 1, pinned = 1, device = 1;

    CHECK(mf_active_backend() == MF_BACKEND_HOST);
    if (!mf_build_has_cuda()) FAILS_WITH(mf_select_backend(MF_BACKEND_CUDA), MF_ERROR_UNAVAILABLE);
    FAILS_WITH(mf_select_backend((mf_backend)9), MF_ERROR_INVALID_VALUE);
    test_events_and_streams();
    test_memory_and_copies();
    test_argmax_and_resolve();
    test_graphs();
    test_top_combine_fault_word();
    test_grammar();
    test_grammar_pick();
    OK(mf_stream_synchronize(0));
    /* The same argmax, resolve and graphs with the CUDA kernels run by the simt executor, once
     * with the launch planning of 2 SMs, so few rows split and the last block combines. */
    OK(mf_select_backend(MF_BACKEND_SIMT));
    CHECK(mf_active_backend() == MF_BACKEND_SIMT);
    for (int sms = 132; sms >= 2; sms -= 130) {
        const mf_simt_config c = {sms, 2, 7u, 3};
        OK(mf_simt_configure(&c));
        test_argmax_and_resolve();
        test_graphs();
        test_grammar();
        test_grammar_pick();
    }
    uint64_t counters[6];
    mf_simt_counters(counters);
    CHECK(counters[0] > 0 && counters[5] > 0); /* the kernels ran, with their shuffles */
    OK(mf_stream_synchronize(0));
    OK(mf_select_backend(MF_BACKEND_HOST));
    mf_live_counts(&events, &streams, &pinned, &device);
    CHECK(events == 0 && streams == 0 && pinned == 0 && device == 0); /* nothing leaked */
    if (failures) {
        fprintf(stderr, "feed_smoke: %d check(s) failed\n", failures);
        return 1;
    }
    printf("feed_smoke: all checks passed\n");
    return 0;
}
