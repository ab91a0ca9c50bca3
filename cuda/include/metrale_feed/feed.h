/* metrale_feed: the C ABI of the device token feed.
 *
 * One header, two backends (the CUDA runtime and an asynchronous host double) behind one table.
 * Every function returns an mf_status; on failure the calling thread's last-error message (and,
 * for CUDA failures, the cudaError_t code) describe it. No function touches Python or the GIL.
 * One rule for every operation that queues work: none of the bytes it writes (outputs, host
 * destinations) may overlap another range it reads or writes, or the call is refused with
 * MF_ERROR_INVALID_VALUE, naming both, before anything is queued (a copy onto itself excepted). */
#ifndef METRALE_FEED_FEED_H
#define METRALE_FEED_FEED_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The package links this layer statically into its extension and hides it (extensions reach it
 * through the capsule of capi.h); a shared build of the layer may define MF_EXPORT to export. */
#ifndef MF_EXPORT
#define MF_EXPORT
#endif

#define MF_NO_TOKEN 0xFFFFFFFFu
/* The one source of the kernels' limits (exported to Python as MAX_ROWS and MAX_VOCAB). */
#define MF_MAX_ROWS 4096u
#define MF_MAX_VOCAB 16777216u /* 2**24: ids below it fit a float32 mantissa */
#define MF_MAX_SLICES 65536u  /* slices one combine takes */
#define MF_FEED_HOST_BIT 0x80000000u

typedef uint64_t mf_event_t;  /* a handle this layer hands out; never 0 */
typedef uint64_t mf_stream_t; /* 0 is the default stream; cuda: the cudaStream_t value */

typedef enum mf_status {
    MF_SUCCESS = 0,
    MF_ERROR_INVALID_VALUE = 1,  /* bad argument, caught before anything was queued */
    MF_ERROR_INVALID_HANDLE = 2, /* destroyed, freed or unknown handle or pointer */
    MF_ERROR_OUT_OF_MEMORY = 3,
    MF_ERROR_CUDA = 4,           /* the CUDA runtime failed: mf_last_cuda_error() has the code */
    MF_ERROR_INJECTED = 5,       /* a host-backend fault knob fired */
    MF_ERROR_UNAVAILABLE = 6,    /* backend not compiled in, or no usable device */
    MF_ERROR_DEVICE = 7,         /* queued work failed (asynchronous error) */
    MF_ERROR_CAPTURE = 8,        /* not allowed on a stream that is capturing a graph (graphs) */
    MF_ERROR_INTERNAL = 9        /* a defect of this layer (an unexpected C++ exception), caught */
} mf_status;

/* MF_BACKEND_SIMT: the host backend's runtime with the CUDA kernels run on the CPU (simt executor). */
typedef enum mf_backend { MF_BACKEND_HOST = 0, MF_BACKEND_CUDA = 1, MF_BACKEND_SIMT = 2 } mf_backend;
typedef enum mf_dtype { MF_DTYPE_F32 = 0, MF_DTYPE_F16 = 1, MF_DTYPE_BF16 = 2 } mf_dtype;
typedef enum mf_mem_kind { MF_MEM_UNKNOWN = 0, MF_MEM_PINNED = 1, MF_MEM_DEVICE = 2 } mf_mem_kind;

/* MF_EVENT_UNCOUNTED: the binding's own bookkeeping events, which fault knobs never hit. */
enum { MF_EVENT_TIMING = 1u, MF_EVENT_BLOCKING = 2u, MF_EVENT_UNCOUNTED = 4u };
enum { MF_STREAM_NON_BLOCKING = 1u };
enum { MF_HOST_PORTABLE = 1u, MF_HOST_MAPPED = 2u, MF_HOST_WRITE_COMBINED = 4u };

/* ---- errors (thread-local) ---- */
MF_EXPORT const char *mf_last_error(void);
MF_EXPORT int mf_last_cuda_error(void);
MF_EXPORT const char *mf_cuda_error_name(int code);
MF_EXPORT void mf_clear_error(void);

/* ---- backend and build ---- */
MF_EXPORT mf_status mf_select_backend(mf_backend which); /* cuda: fails when no usable device */
MF_EXPORT mf_backend mf_active_backend(void);
MF_EXPORT int mf_build_has_cuda(void);
MF_EXPORT int mf_build_cuda_version(void);   /* CUDART_VERSION, 0 without CUDA */
MF_EXPORT const char *mf_build_cuda_archs(void);
MF_EXPORT int mf_build_has_nvtx(void);
MF_EXPORT mf_status mf_device_count(int *count);
MF_EXPORT mf_status mf_device_name(int device, char *buf, size_t buflen);
MF_EXPORT mf_status mf_driver_version(int *version);
MF_EXPORT mf_status mf_current_device(int *device); /* cuda: cudaGetDevice; host: 0 */
MF_EXPORT void mf_live_counts(uint64_t *events, uint64_t *streams, uint64_t *pinned_bytes,
                              uint64_t *device_bytes);

/* Host-backend fault knobs: 0 is off; N makes the Nth call from now fail with MF_ERROR_INJECTED. */
typedef struct mf_host_faults {
    uint32_t lag_us;
    uint64_t fail_event_query_at;
    uint64_t fail_alloc_at;
    uint64_t fail_copy_at;
    uint64_t fail_synchronize_at;
    /* Counts every event creation, the binding's own too: it stands in for a full event table. */
    uint64_t fail_event_create_at;
} mf_host_faults;
MF_EXPORT void mf_host_configure(const mf_host_faults *faults); /* NULL: every knob off */
/* Threads one host-backend kernel may use (the stream's worker included); 0 = every core. A
 * simulated device of fewer cores leaves the others to the scheduler, as a real GPU does. */
MF_EXPORT void mf_host_set_kernel_threads(unsigned threads);
MF_EXPORT unsigned mf_host_kernel_threads(void);
/* The host argmax's code path: "avx2" or "portable" (both follow argmax_rule.h). Forcing the
 * portable one lets tests check both; returns the path now in force. */
MF_EXPORT const char *mf_host_argmax_isa(int force_portable);
MF_EXPORT void mf_host_faults_get(mf_host_faults *out);
/* Bench-only: the floor of a host kernel over `rows` float32 rows of `vocab` logits, on the calling
 * thread and the kernel threads (mf_host_set_kernel_threads): a loop of the rule's own per-id
 * arithmetic, eight lanes at a time, with no bookkeeping. HASH: every id's Philox words; RACE:
 * those and the race's score -log(-log U) + z; STATS: the max, then logprob_rule.h's sum of
 * exponentials; TOP_P: the max, then every id's mass and Philox words; TOP_P_LOG: and its score.
 * Returns a checksum of the work, or NaN where there is no such loop (no AVX2, another `what`). */
enum { MF_HOST_FLOOR_HASH = 1, MF_HOST_FLOOR_RACE = 2, MF_HOST_FLOOR_STATS = 3, MF_HOST_FLOOR_TOP_P = 4,
       MF_HOST_FLOOR_TOP_P_LOG = 5 };
MF_EXPORT double mf_host_floor(unsigned what, const float *logits, uint32_t rows, uint32_t vocab);

/* ---- the simt backend's executor (any build) ----
 * sm_count: what the launch planning sees (default 132, an H200's; small counts make few-row
 * calls split); order: blocks in order (0), reversed (1) or in a random order from `seed` (2);
 * threads: OS threads that run blocks at once (1: the stream's worker alone). */
typedef struct mf_simt_config {
    int sm_count;
    int order;
    uint64_t seed;
    int threads;
} mf_simt_config;
MF_EXPORT mf_status mf_simt_configure(const mf_simt_config *config);
MF_EXPORT void mf_simt_config_get(mf_simt_config *out);
/* launches, blocks, threads, fiber switches, barriers, shuffles: since the process started. */
MF_EXPORT void mf_simt_counters(uint64_t out[6]);
/* Launches per kernel since the process started, as "name=count\n" lines into `buf` (truncated
 * to `capacity`); returns the length the whole text needs. */
MF_EXPORT size_t mf_simt_kernel_launches(char *buf, size_t capacity);
/* Runs a test-only kernel that breaks a rule of CUDA (`which` names it; "" lists them into
 * `message`): 1 with the executor's message when it caught the break, 0 when it did not. */
MF_EXPORT int mf_simt_selftest(const char *which, char *message, size_t capacity);

/* ---- events ---- */
MF_EXPORT mf_status mf_event_create(unsigned flags, mf_event_t *out);
MF_EXPORT mf_status mf_event_wrap(uint64_t foreign, mf_event_t *out); /* not owned, never destroyed */
MF_EXPORT mf_status mf_event_record(mf_event_t event, mf_stream_t stream);
MF_EXPORT mf_status mf_event_query(mf_event_t event, int *done); /* never blocks */
MF_EXPORT mf_status mf_event_synchronize(mf_event_t event);
/* One slice of a synchronize, for callers that must stay responsive (signals): *done is 1 once
 * the event's work is complete, else 0 after about timeout_us. *mark must be 0 on a wait's first
 * slice and is kept between slices, so a wait always ends at the record current when it began. */
MF_EXPORT mf_status mf_event_synchronize_for(mf_event_t event, uint32_t timeout_us, uint64_t *mark,
                                             int *done);
MF_EXPORT mf_status mf_event_elapsed_ms(mf_event_t start, mf_event_t end, float *ms);
MF_EXPORT mf_status mf_event_destroy(mf_event_t event);
MF_EXPORT mf_status mf_event_raw(mf_event_t event, uint64_t *raw); /* the cudaEvent_t, cuda only */

/* ---- streams ---- */
MF_EXPORT mf_status mf_stream_create(unsigned flags, mf_stream_t *out);
MF_EXPORT mf_status mf_stream_check(mf_stream_t stream); /* host: known? cuda: accepted as is */
MF_EXPORT mf_status mf_stream_query(mf_stream_t stream, int *idle);
MF_EXPORT mf_status mf_stream_synchronize(mf_stream_t stream);
/* As mf_event_synchronize_for: the work queued when the wait began (host; cuda: the stream idle). */
MF_EXPORT mf_status mf_stream_synchronize_for(mf_stream_t stream, uint32_t timeout_us,
                                              uint64_t *mark, int *done);
MF_EXPORT mf_status mf_stream_wait_event(mf_stream_t stream, mf_event_t event);
MF_EXPORT mf_status mf_stream_destroy(mf_stream_t stream);

/* ---- memory ---- */
MF_EXPORT mf_status mf_host_alloc(size_t nbytes, unsigned flags, void **out); /* zeroed, page-locked */
MF_EXPORT mf_status mf_host_free(void *ptr, size_t nbytes);                  /* nbytes must match */
MF_EXPORT mf_status mf_device_alloc(size_t nbytes, void **out);
MF_EXPORT mf_status mf_device_free(void *ptr);
/* What this layer allocated at ptr: kind, and bytes from ptr to the allocation's end. */
MF_EXPORT mf_mem_kind mf_mem_lookup(const void *ptr, size_t *bytes_left);
MF_EXPORT mf_status mf_memset_async(void *dev, int value, size_t nbytes, mf_stream_t stream);
MF_EXPORT mf_status mf_copy_d2h_async(void *host_dst, const void *dev_src, size_t nbytes,
                                      mf_stream_t stream);
MF_EXPORT mf_status mf_copy_h2d_async(void *dev_dst, const void *host_src, size_t nbytes,
                                      mf_stream_t stream);
MF_EXPORT mf_status mf_copy_d2d_async(void *dev_dst, const void *dev_src, size_t nbytes,
                                      mf_stream_t stream);

/* ---- descriptors ----
 * The kernels take their arguments in descriptors (mf_argmax_args, mf_combine_args,
 * mf_reference_args) that grow as options are added. Each starts with struct_size, which its
 * mf_*_args_init() sets to the size the caller was compiled with, after zero-filling it (every
 * option off): always set a descriptor up with its init, then set the fields you use. The layer
 * reads a descriptor of a size it knows up to that size and takes every later field as zero, so a
 * binary built against an older header keeps working when fields are appended; a size it does not
 * know (a descriptor that skipped the init: stack garbage) is refused with MF_ERROR_INVALID_VALUE
 * before anything is read or queued, as is a NULL descriptor. As in Vulkan's sType or CUDA's
 * versioned structs, the size is the descriptor's version.
 *
 * ---- kernels ----
 * argmax_to_feed: cells[r] = the id chosen for row r, then an async copy of rows*4 bytes of cells
 * into host_dst, then a record of event (0: none). Capacity is the cells' length in ids.
 *
 * One descriptor carries every option; the kernels read them through one rule (argmax_rule.h,
 * sample_rule.h), so a new option is a field and a flag, not a new entry point:
 * - masks (rows*2 ids): host memory is read before the call returns; with MF_ARGS_MASKS_DEVICE it
 *   is device memory, read when the kernel runs (a mask id >= vocab then masks nothing); NULL
 *   (without the flag): no masks, a constant a graph capture accepts;
 * - bitmask (device, rows * ceil(vocab/32) words, NULL: none): bit v%32 of word v/32 set = allowed;
 * - params (one mf_sampling_params per row, NULL: argmax): a sampled id per row; host memory is
 *   read (and checked) before the call returns, device memory (MF_ARGS_PARAMS_DEVICE) when the
 *   kernel runs, where a value out of range means its neutral setting (temperature 0, top_p 1,
 *   min_p 0);
 * - logprobs (device, rows floats, NULL: none): each row's chosen id's log_softmax over the whole
 *   row (logprob_rule.h); logprobs_dst (host, rows*4 bytes, NULL: none) gets a copy after host_dst
 *   and before the event record;
 * - MF_ARGS_PARTIAL: the logits are the slice [start, start + vocab) of a row of vocab_total ids
 *   (masks hold global ids, the bitmask is the whole row's ceil(vocab_total/32) words, vocab may be
 *   0); instead of cells, a partial block (a header, then one record per row: logprob_rule.h) is
 *   written to `partials`, for mf_combine_partials. cells, host_dst and logprobs must be NULL, and
 *   params temperature-only: top_k, top_p and min_p need global thresholds. Host params are
 *   checked now; device params (MF_ARGS_PARAMS_DEVICE) are read when the kernel runs, and a
 *   sampled row with a filter there is the combine's fault (MF_FAULT_FILTERS), never a token;
 * - MF_ARGS_PARTIAL_LOGPROBS (with MF_ARGS_PARTIAL only): the records also carry the slice's max
 *   and sum of exponentials, for a combine that writes logprobs; without it they hold 0 and the
 *   partial call costs what the argmax over the slice costs. The header records the choice, so a
 *   combine whose logprobs setting differs from a slice's refuses it (MF_FAULT_LOGPROBS).
 * - MF_ARGS_SELECT (with MF_ARGS_PARTIAL and params, filters allowed; device params are read
 *   when the kernel runs, so the stage is capturable): one stage of the split filters
 *   (docs/kernels.md, "Filters need global thresholds"): `select` holds rows mf_select_row,
 *   `select_stage` says what the block gets (MF_SELECT_*).
 * - penalties (NULL: none; not with MF_ARGS_PARTIAL): a step's penalties in the same call, as
 *   mf_penalties_apply over these logits before the pick and mf_penalties_update with the chosen
 *   ids (the cells) after it, both queued by this call ahead of the copies and the event. Its
 *   logits, dtype, vocab, row_stride and start fields are ignored (the call's own layout, start
 *   0), as are ids (the cells); its rows must be the call's. The descriptor is read before the
 *   call returns and checked as those two functions check theirs; a refusal queues nothing.
 * - grammar (appended; NULL: none; not with MF_ARGS_PARTIAL): the rows' structured-output
 *   automaton in the same call (mf_grammar_pick, in "grammar" below): the call queues the mask
 *   of each row's state word into the grammar's scratch (ANDed with `bitmask`), the pick with that
 *   bitmask instead of `bitmask`, then the advance of the state words by the ids the pick wrote,
 *   all ahead of the copies and the event record, so the event covers the new states too. */
struct mf_penalty_args;
struct mf_grammar_pick;
enum {
    MF_ARGS_MASKS_DEVICE = 1u,
    MF_ARGS_PARAMS_DEVICE = 2u,
    MF_ARGS_PARTIAL = 4u,
    MF_ARGS_PARTIAL_LOGPROBS = 8u,
    MF_ARGS_SELECT = 16u
};

/* The stages of a split row's filters, each writing a partial block (a header, then per row):
 * TOP the slice's greatest finite candidate (a partial record whose m is 0 and whose s word holds
 * the row's params digest, mf_params_digest), HIST a histogram of one 8-bit digit of the logit
 * key (MF_SELECT_BINS uint64 weights), CANDS the slice's candidate list (below), RACE the race
 * winner over the survivors (a partial record, for mf_combine_partials with MF_PARTIAL_FILTERED). */
enum { MF_SELECT_TOP = 1u, MF_SELECT_HIST = 2u, MF_SELECT_RACE = 3u, MF_SELECT_CANDS = 4u };
/* HIST: one digit of MF_SELECT_DIGIT_BITS bits a round, so a 32-bit key in 32 / 8 = 4 rounds. */
#define MF_SELECT_DIGIT_BITS 8u
#define MF_SELECT_BINS 256u
/* CANDS: each row with MF_SELECT_ROW_CANDS lists its slice's greatest min(top_k, count)
 * candidates (mf_partial_cand, global ids, in the rule's order, the rest MF_NO_TOKEN), in
 * select_cands_cap entries a row after the header. A top_k up to MF_SELECT_CANDS_MAX takes this
 * path: every rank then holds every slice's list, so the row's global top_k survivors, and
 * applies top_p and min_p over them itself (the RACE stage, sample_rule.h's mf_cands_threshold). */
#define MF_SELECT_CANDS_MAX 1024u
/* Per-row flags of mf_select_row. */
enum {
    MF_SELECT_ROW_TOP = 1u,      /* top_bits holds the whole row's greatest finite candidate */
    MF_SELECT_ROW_HIST = 2u,     /* HIST: histogram this row (else its bins are 0) */
    MF_SELECT_ROW_MASS = 4u,     /* HIST: weights are masses (top_p), else counts (top_k) */
    MF_SELECT_ROW_CUT = 8u,      /* first raise `floor` by the cut at cut_key (then cleared) */
    MF_SELECT_ROW_CUT_MASS = 16u, /* the cut's weights are masses */
    MF_SELECT_ROW_CANDS = 32u     /* CANDS: list this row; RACE: its floor from the gathered lists */
};
/* One row's state between the stages of a split row's filters: written by the caller between
 * stages, except `floor`, which a cut writes. The weight of a candidate is 1 or its mass; a cut
 * keeps the candidates with key > cut_key, and those at cut_key in id order while the weight
 * taken before each is below cut_need (0: none of them). */
typedef struct mf_select_row {
    uint64_t floor;    /* this slice's packed threshold: candidates below it are out (0: none out) */
    uint64_t cut_need; /* the weight still needed from this slice's candidates at cut_key */
    uint32_t top_bits; /* the whole row's greatest finite candidate logit (float32 bits): zmax */
    uint32_t cut_key;
    uint32_t prefix;   /* HIST: the key bits above the digit, already selected */
    uint32_t shift;    /* HIST: the digit's lowest bit, 24, 16, 8, 0 */
    uint32_t flags;    /* MF_SELECT_ROW_* */
    uint32_t list_len; /* host backend: the row's list (see select_list); MF_SELECT_NO_LIST: none */
    uint32_t draft_bits; /* a verify's draft at this position: its logit bits from the TOP records
                          * (mf_decide_top_row), MF_VERIFY_NO_BITS when no slice holds it as a
                          * finite candidate (or the call verifies nothing) */
    uint32_t pad_;
} mf_select_row;
#define MF_VERIFY_NO_BITS 0x7FC00000u /* a quiet NaN: never a finite candidate's bits */
#define MF_SELECT_NO_LIST 0xFFFFFFFFu


/* One row's sampling parameters (32 bytes), written once: this table of its fields, in order, as
 * X(C type, name, numpy format, meaning), makes the struct below and the table that
 * mf_sampling_params_layout() returns (Python's SAMPLING_PARAMS_DTYPE is built from that). A new
 * per-row field is one line here: it takes the place of pad_ or grows the record. A name ending
 * in '_' is padding, never read. The formats are little-endian, as every backend is. */
#define MF_SAMPLING_PARAMS_FIELDS(X)                                                                \
    X(float, temperature, "<f4", "0: the argmax rule exactly; else finite and > 0")                \
    X(float, top_p, "<f4", "(0, 1]; 1: off")                                                       \
    X(float, min_p, "<f4", "[0, 1); 0: off")                                                       \
    X(uint32_t, top_k, "<u4", "0: off")                                                            \
    X(uint64_t, seed, "<u8", "the Philox key")                                                     \
    X(uint32_t, position, "<u4", "the Philox counter's position word (the token's index in its "   \
                                 "sequence)")                                                      \
    X(uint32_t, pad_, "<u4", "padding to 8 bytes")
#define MF_FIELD_MEMBER_(ctype, name, format, meaning) ctype name;
typedef struct mf_sampling_params {
    MF_SAMPLING_PARAMS_FIELDS(MF_FIELD_MEMBER_)
} mf_sampling_params;
#undef MF_FIELD_MEMBER_

/* One field of a record as numpy's structured dtypes describe it. */
typedef struct mf_record_field {
    const char *name;   /* the C name (static storage) */
    const char *format; /* numpy's format string: "<f4", "<u4", "<u8" */
    uint32_t offset;    /* offsetof in the record */
    uint32_t size;      /* bytes */
} mf_record_field;
/* A record's layout, filled by mf_sampling_params_layout(): a descriptor that grows as the others
 * do (struct_size first; set it up with mf_record_layout_init). fields points at the layer's own
 * static table of count entries, in offset order, each field_size bytes apart. */
typedef struct mf_record_layout {
    uint32_t struct_size;  /* sizeof(mf_record_layout) where the caller was built: _init */
    uint32_t record_size;  /* sizeof the record */
    uint32_t count;        /* entries at fields */
    uint32_t field_size;   /* sizeof(mf_record_field) in this layer: the table's stride */
    const mf_record_field *fields;
} mf_record_layout;
static inline void mf_record_layout_init(mf_record_layout *layout) {
    memset(layout, 0, sizeof *layout);
    layout->struct_size = (uint32_t)sizeof *layout;
}
/* mf_sampling_params's layout, from MF_SAMPLING_PARAMS_FIELDS. A NULL layout, or one whose
 * struct_size this build does not know, is MF_ERROR_INVALID_VALUE. */
MF_EXPORT mf_status mf_sampling_params_layout(mf_record_layout *layout);

/* The decisions between a split row's filter stages (mf_select_decide; select_rule.h): one row's
 * own state across the exchanges, written by the decisions alone. A row takes part in at most two
 * radix selects, top_k's then top_p's (MF_SELECT_K, MF_SELECT_P), each 32 / 8 = 4 rounds. */
enum { MF_SELECT_K = 1u, MF_SELECT_P = 2u };
enum {
    MF_PLAN_K = 1u,  /* the row's top_k takes a radix select (top_k > MF_SELECT_CANDS_MAX) */
    MF_PLAN_P = 2u,  /* the row's top_p takes a radix select (no candidate list serves it) */
    MF_PLAN_ON = 4u  /* the row takes part in the current select (its weight is not all kept) */
};
typedef struct mf_select_plan {
    uint64_t target; /* the current select's weight to reach (top_k, or top_p's share of the mass) */
    uint64_t above;  /* the weight of the greater digits selected so far */
    uint32_t prefix; /* the key bits selected so far */
    uint32_t flags;  /* MF_PLAN_* */
} mf_select_plan;
/* MF_DECIDE_TOP after the exchange of the TOP stage's blocks: checks their headers (a mismatch is
 * the fault, every row's flags 0), then each row's zmax and which selects it takes, and starts the
 * first select (`next`). MF_DECIDE_ROUND after round `round` of select `select`'s histograms: picks
 * every taking row's digit as mf_select_digit does over the summed histograms; after the last
 * round, its cut at the key found (the weight at that key of the slices before `rank`), then
 * starts select `next` (0: none). A decision after a fault changes nothing. */
enum { MF_DECIDE_TOP = 1u, MF_DECIDE_ROUND = 2u };
/* Fixed rounds (a shard's FilterRounds): MF_ROUNDS_FIXED | the candidate lists' cap (0 to
 * MF_SELECT_CANDS_MAX) | MF_ROUNDS_TOP_P when top_p's radix select runs. The TOP decision then
 * checks each sampled row against them: a row with a top_k above the cap, or with top_p alone and
 * no such select, is the fault MF_FAULT_ROUNDS | row << 8 (on the host backend the first such
 * row, on cuda any), which the combine takes (mf_combine_args.refused). */
#define MF_ROUNDS_FIXED 0x80000000u
#define MF_ROUNDS_TOP_P 0x40000000u
#define MF_ROUNDS_CAP_MASK 0x7FFu
typedef struct mf_select_decide_args {
    uint32_t struct_size;       /* sizeof(mf_select_decide_args) where the caller was built: _init */
    uint32_t step;              /* MF_DECIDE_* */
    const void *gathered;       /* device: world blocks, block_bytes apart, slices in id order */
    uint64_t block_bytes;
    uint32_t world, rank;       /* the slices, and this caller's */
    uint32_t rows;
    uint32_t vocab;             /* TOP: the whole vocabulary (the headers' check) */
    uint64_t call;              /* TOP: the call word the headers carry */
    const mf_sampling_params *params; /* device, rows records, read when the kernel runs */
    mf_select_row *select;      /* device, rows: the stages' state (written) */
    mf_select_plan *plan;       /* device, rows: read and written */
    uint32_t *fault;            /* device word: MF_FAULT_* | slice << 8 (TOP writes it) */
    uint32_t select_k_p;        /* ROUND: the select of this round, MF_SELECT_K or MF_SELECT_P */
    uint32_t round;             /* ROUND: 0 .. 3 */
    uint32_t next;              /* the select that starts after this decision, 0: none */
    uint32_t rounds;            /* TOP: fixed rounds (MF_ROUNDS_*, below), 0: they follow the params */
    /* appended with mf_select_row.draft_bits: sizeof(mf_select_row) where the caller was built
     * (_init sets it), so state laid out by an older header is refused, never read past its rows */
    uint32_t select_row_bytes;
    uint32_t reserved_;
} mf_select_decide_args;
static inline void mf_select_decide_args_init(mf_select_decide_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
    args->select_row_bytes = (uint32_t)sizeof(mf_select_row);
}
MF_EXPORT mf_status mf_select_decide(const mf_select_decide_args *args, mf_stream_t stream);

typedef struct mf_argmax_args {
    uint32_t struct_size;  /* sizeof(mf_argmax_args) where the caller was built: mf_argmax_args_init */
    const void *logits;
    mf_dtype dtype;
    uint32_t rows;
    uint32_t vocab;
    uint64_t row_stride; /* elements, >= vocab */
    const uint32_t *masks; /* rows*2, host unless MF_ARGS_MASKS_DEVICE; NULL: none */
    uint32_t *cells;       /* device */
    uint32_t cell_capacity;
    void *host_dst;        /* host, >= rows*4 bytes, or NULL for no copy */
    mf_event_t event;      /* 0: none */
    const uint32_t *bitmask;           /* device, or NULL */
    const mf_sampling_params *params;  /* NULL: argmax; host unless MF_ARGS_PARAMS_DEVICE */
    uint32_t flags;                    /* MF_ARGS_* */
    float *logprobs;                   /* device, rows floats, or NULL */
    void *logprobs_dst;                /* host, rows*4 bytes, or NULL (needs logprobs) */
    void *partials;                    /* MF_ARGS_PARTIAL: device, 2 + rows 16-byte records */
    uint32_t vocab_total;              /* MF_ARGS_PARTIAL: the whole vocabulary */
    uint32_t start;                    /* MF_ARGS_PARTIAL: the slice's first global id */
    uint64_t call;                     /* MF_ARGS_PARTIAL: the caller's call counter (header) */
    mf_select_row *select;             /* MF_ARGS_SELECT: device, rows records */
    uint32_t select_stage;             /* MF_ARGS_SELECT: MF_SELECT_* */
    /* MF_ARGS_SELECT, optional (NULL): device scratch of rows * select_list_cap ids. A round whose
     * key prefix fixes the top 8 bits lists the ids still in range there (when they fit), so the
     * select's later rounds and its cut read the list instead of the whole slice. The host
     * backend's cache (with list_len): the kernels sweep the slice and leave both as they are. */
    uint32_t select_list_cap;
    uint32_t *select_list;
    /* MF_ARGS_SELECT: entries a row of a CANDS block (1 to MF_SELECT_CANDS_MAX; CANDS and a RACE
     * with select_cands). RACE, optional (NULL): the gathered CANDS blocks of select_cands_world
     * slices in id order, select_cands_stride bytes apart, read by rows with MF_SELECT_ROW_CANDS. */
    uint32_t select_cands_cap;
    uint32_t select_cands_world;
    uint64_t select_cands_stride;
    const void *select_cands;
    const struct mf_penalty_args *penalties; /* NULL: none; see above */
    /* MF_ARGS_SELECT, appended, optional (NULL): a sampled verify_to_feed over a split vocabulary
     * (docs/tensor-parallel.md, "Verify"). rows is R * (k + 1) logit rows, logit row r * (k + 1)
     * + j position j of row r, whose draft is mf_verify_draft_at (verify_rule.h): select_drafts
     * holds the R rows' k drafts (device, read when the kernel runs), select_k is k. TOP then
     * writes into its record's m word the draft's logit bits where this slice holds the draft and
     * it is a finite candidate (else MF_VERIFY_NO_BITS); RACE, for a sampled position with a
     * draft and a finite zmax, races without the draft and writes into the record's last 8 bytes
     * the slice's survivors' total mass (sample_rule.h's integer masses), MF_VERIFY_SURVIVES set
     * when the draft is this slice's and survives (verify_rule.h). No logprobs then. A descriptor
     * older than these fields was built with a smaller mf_select_row: MF_ARGS_SELECT refuses it. */
    const uint32_t *select_drafts;
    uint32_t select_k;
    uint32_t reserved_; /* 0: keeps the appended fields after it 8-byte aligned */
    const struct mf_grammar_pick *grammar; /* appended: NULL: none; see above */
} mf_argmax_args;
/* Zero-fills *args (every option off) and sets its struct_size: call it first. */
static inline void mf_argmax_args_init(mf_argmax_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
/* Also refuses outputs that overlap (cells, host_dst, logprobs, logprobs_dst, partials, select
 * state and list, a grammar's state words and scratch) or overlap a device-resident input
 * (logits, masks, bitmask, params, a grammar's automaton; penalties' tables likewise). */
MF_EXPORT mf_status mf_argmax_to_feed(const mf_argmax_args *args, mf_stream_t stream);

/* The partial blocks of one row split: what each slice's MF_ARGS_PARTIAL call wrote, gathered.
 * Block w starts at record w * slice_stride (records of 16 bytes; slice_stride >= rows + 2) and
 * holds a header (2 records) then rows records, slices in id order. The combine checks every
 * header against (op, rows, call, vocab, and whether logprobs is set: the slices must have been
 * called with MF_ARGS_PARTIAL_LOGPROBS exactly when it is) and the slices' coverage of [0, vocab),
 * then writes cells,
 * host_dst, logprobs and logprobs_dst exactly as the unsharded call would, then records event.
 * A mismatch writes NO_TOKEN and NaN to every row and the fault (MF_FAULT_* | slice << 8) to
 * `fault` (device word, required; 0 when the headers agree), copied to fault_dst (host) if set.
 * params: host records, read (and checked) before the call returns, or with
 * MF_COMBINE_PARAMS_DEVICE in `flags` device records, read when the combine runs (so a graph's
 * replay uses what they hold then; sampled ops). There a temperature out of range is 0, as in
 * mf_argmax_to_feed, and with MF_PARTIAL_SAMPLE a sampled row with a filter (top_k, top_p < 1 or
 * min_p > 0, the values the unsplit call would apply) gets NO_TOKEN and NaN and the fault
 * MF_FAULT_FILTERS | row << 8 (on the host backend the first such row, on cuda any), while the
 * other rows get their draws (MF_PARTIAL_FILTERED's slices applied the filters).
 * MF_COMBINE_VERIFY (appended: drafts, k) combines a greedy verify_to_feed over a split
 * vocabulary: the blocks are MF_PARTIAL_ARGMAX partials of rows = R * (k + 1) logit rows (each
 * rank's argmax over its slice of every position), drafts (device, R * k ids, read when the
 * combine runs) are the R rows' drafts, and cells, host_dst, logprobs and logprobs_dst take
 * verify_to_feed's layout (R * (k + 2) words, R * (k + 1) floats): each position's combined
 * argmax is the rule's id there, so a row keeps its drafts while they equal it (verify_rule.h).
 * A header fault leaves every row n = 1 with NO_TOKEN, as a row without candidates.
 * With MF_PARTIAL_FILTERED instead (appended: select), the rows may be sampled: the blocks are the
 * RACE blocks of a verify's select stages (mf_argmax_args.select_drafts), params are the logit
 * rows' own (position j's at position + j), and select is this rank's state of the logit rows
 * after those stages (device, read when the combine runs: zmax and the draft's bits). A sampled
 * position keeps its draft with probability mass / total and otherwise emits the race without it,
 * as the unsplit call does, bit for bit (verify_rule.h, mf_verify_sampled_combined_row). No
 * logprobs.
 * refused (appended; device word, read when the combine runs, or NULL): a fault found before the
 * last exchange, such as a split filter's first decision (mf_select_decide's `fault`). When the
 * headers agree and it is nonzero, the combine writes what a header fault writes, with this word
 * as the fault: so a call whose exchanges all ran (NCCL cannot skip one that is queued) never
 * draws a token from rounds the ranks did not agree on. */
enum { MF_COMBINE_PARAMS_DEVICE = 1u, MF_COMBINE_VERIFY = 2u };
typedef struct mf_combine_args {
    uint32_t struct_size;             /* sizeof(mf_combine_args) where the caller was built: _init */
    const void *partials;             /* device */
    uint32_t world;                   /* slices, >= 1 */
    uint32_t slice_stride;            /* records between blocks */
    uint32_t rows;
    uint32_t vocab;                   /* the whole vocabulary */
    uint32_t op;                      /* MF_PARTIAL_ARGMAX, _SAMPLE or _FILTERED (filters allowed) */
    uint32_t flags;                   /* MF_COMBINE_* (0: none) */
    uint64_t call;
    const mf_sampling_params *params; /* sampled ops: rows records, host unless MF_COMBINE_PARAMS_DEVICE */
    uint32_t *cells;                  /* device */
    uint32_t cell_capacity;
    void *host_dst;                   /* host, or NULL */
    float *logprobs;                  /* device, or NULL */
    void *logprobs_dst;               /* host, or NULL */
    uint32_t *fault;                  /* device, one word */
    void *fault_dst;                  /* host, one word, or NULL */
    mf_event_t event;                 /* 0: none */
    const uint32_t *drafts;           /* appended: MF_COMBINE_VERIFY's device drafts, else NULL */
    uint32_t k;                       /* appended: MF_COMBINE_VERIFY's drafts per row, else 0 */
    const uint32_t *refused;          /* appended: device word or NULL (below) */
    const mf_select_row *select;      /* appended: MF_COMBINE_VERIFY with MF_PARTIAL_FILTERED (below) */
} mf_combine_args;
static inline void mf_combine_args_init(mf_combine_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
/* Outputs (cells, host_dst, logprobs, logprobs_dst, fault, fault_dst) must not overlap each other,
 * the partials or device params. */
MF_EXPORT mf_status mf_combine_partials(const mf_combine_args *args, mf_stream_t stream);

/* resolve_feed: out[i] = sources[i] & 0x7FFFFFFF when bit 31 is set, else cells[sources[i]].
 * sources (host, n words) is read before the call returns; from_row must be < prev_rows. */
MF_EXPORT mf_status mf_resolve_feed(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                                    uint32_t prev_rows, uint32_t *out, mf_stream_t stream);
/* The same with flags: MF_SOURCES_DEVICE makes sources device memory, read when the kernel runs;
 * a from_row >= prev_rows there resolves to MF_NO_TOKEN (it cannot be refused before launch). */
enum { MF_SOURCES_DEVICE = 1u };
MF_EXPORT mf_status mf_resolve_feed_flags(const uint32_t *sources, uint32_t n,
                                          const uint32_t *cells, uint32_t prev_rows,
                                          uint32_t *out, unsigned flags, mf_stream_t stream);

/* verify_to_feed: speculative decoding's verification (docs/kernels.md, "Verify"; verify_rule.h).
 * Row r has k drafts (drafts[r*k ..], MF_NO_TOKEN ends them early) and k + 1 logit rows: position
 * j of row r is logit row r*(k+1) + j, its input then its first j drafts. The row accepts drafts
 * in order while the rule agrees and then emits one id of its own, so it emits n ids,
 * 1 <= n <= k + 1: greedy rows (no params, or temperature 0) accept a draft equal to the argmax
 * rule at its position and emit the rule's id at the first mismatch (or after the last draft);
 * sampled rows follow the speculative sampling rule over sample_to_feed's distribution at
 * position + j, against the drafter's distributions draft_probs (device float32, rows*k rows of
 * vocab, row r*k + j for draft j of row r; read when the kernel runs), or one-hot drafts when it
 * is NULL. cells[r*(k+2)] = n, then the n ids, then MF_NO_TOKEN; host_dst gets the same
 * rows*(k+2) words, logprobs (rows*(k+1) floats) one logprob per emitted id and NaN past n.
 * masks (rows*(k+1)*2 ids) and bitmask (rows*(k+1) rows of words) are per logit row; params one
 * record per row (position is position 0's). Host drafts are read and checked before the call
 * returns; with MF_VERIFY_DRAFTS_DEVICE they are device memory read when the kernel runs, where an
 * id >= vocab is never accepted. flags take MF_ARGS_MASKS_DEVICE and MF_ARGS_PARAMS_DEVICE too.
 * advance (device, rows words, NULL: none; needs params) adds advance[r] to row r's position, read
 * when the kernel runs: at depth 2 a step's first position follows the count the step before it
 * emitted (resolve_verified's out_advance), which the host does not know when it queues the step.
 * grammar (appended, NULL: none; mf_grammar_pick): each position j of row r may pick only what the
 * state its first j drafts reach from the row's state word allows (mf_grammar_mask with k into the
 * grammar's scratch, ANDed with `bitmask`, read by the verify instead of it), and the state words
 * advance by the emitted ids, before the copies and the event record. Host drafts are uploaded
 * into the scratch after the mask (an async copy, consumed before the call returns) for the mask
 * to walk; the verify itself reads them as without a grammar.
 * penalties (appended, NULL: none; mf_penalty_args with k, in "penalties" below): the step's
 * penalties in the same call, as mf_penalties_apply with k and the verify's drafts over these
 * logits before the verify and mf_penalties_update with k and these cells after it, both queued
 * by this call ahead of the grammar's advance, the copies and the event: the same logits, cells
 * and counts. Its k must be the call's and its rows the call's; its logits, dtype, vocab,
 * row_stride, start, drafts and ids are ignored (the call's own, start 0); the drafts must be
 * device memory (MF_VERIFY_DRAFTS_DEVICE), as the apply's are. The descriptor is read before the
 * call returns and checked as those two functions check theirs; a refusal queues nothing. */
#define MF_MAX_DRAFTS 64u
enum { MF_VERIFY_DRAFTS_DEVICE = 0x10000u }; /* apart from the MF_ARGS_* bits it shares flags with */
typedef struct mf_verify_args {
    uint32_t struct_size;    /* sizeof(mf_verify_args) where the caller was built: mf_verify_args_init */
    const void *logits;
    mf_dtype dtype;
    uint32_t rows;           /* rows of drafts; rows * (k + 1) <= MF_MAX_ROWS logit rows */
    uint32_t k;              /* drafts per row, 1..MF_MAX_DRAFTS */
    uint32_t vocab;
    uint64_t row_stride;     /* elements between logit rows, >= vocab */
    const uint32_t *drafts;  /* rows*k ids, host unless MF_VERIFY_DRAFTS_DEVICE */
    const uint32_t *masks;   /* rows*(k+1)*2, host unless MF_ARGS_MASKS_DEVICE; NULL: none */
    const uint32_t *bitmask; /* device, rows*(k+1)*ceil(vocab/32) words, or NULL */
    const mf_sampling_params *params; /* rows records, NULL: greedy; host unless MF_ARGS_PARAMS_DEVICE */
    const float *draft_probs;         /* device, rows*k*vocab, or NULL: one-hot drafts */
    uint32_t flags;
    uint32_t *cells;         /* device */
    uint32_t cell_capacity;  /* in words, >= rows*(k+2) */
    void *host_dst;          /* host, rows*(k+2)*4 bytes, or NULL */
    float *logprobs;         /* device, rows*(k+1) floats, or NULL */
    void *logprobs_dst;      /* host, rows*(k+1)*4 bytes, or NULL (needs logprobs) */
    mf_event_t event;        /* 0: none */
    const uint32_t *advance; /* appended: device, rows words added to the rows' positions; NULL: none */
    const struct mf_grammar_pick *grammar; /* appended: NULL: none; see above */
    const struct mf_penalty_args *penalties; /* appended: NULL: none; see above */
} mf_verify_args;
/* Zero-fills *args (every option off) and sets its struct_size: call it first. */
static inline void mf_verify_args_init(mf_verify_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
MF_EXPORT mf_status mf_verify_to_feed(const mf_verify_args *args, mf_stream_t stream);
/* The next step's inputs from verify cells: out_ids[r] = row r's last emitted id, out_advance[r]
 * = its n (either may be NULL), read from cells (rows*(k+2) words) when the kernel runs. */
MF_EXPORT mf_status mf_resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k,
                                        uint32_t *out_ids, uint32_t *out_advance, mf_stream_t stream);
/* The params of a verify's rows*(k+1) logit rows (mf_verify_logit_row_params): out[r*(k+1) + j] =
 * params[r] at position + advance[r] + j (advance NULL: + j), mod 2**32. params (rows records),
 * advance (rows words) and out are device memory, read and written when the kernel runs: a split
 * verify's sampled call reads one record a logit row, and at depth 2 the advance is on the device. */
MF_EXPORT mf_status mf_verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows,
                                           uint32_t k, mf_sampling_params *out, mf_stream_t stream);

/* ---- penalties (docs/penalties.md; penalty_rule.h) ----
 * vLLM v1's logit processors on the device, in place on the logits, in stream order before the
 * argmax, the sampler or the verifier reads them: per row, first logit_bias, then min_tokens
 * (the stop ids get -inf while fewer than min_tokens tokens were generated), then
 * repetition_penalty over the prompt's and the generated ids, and frequency_penalty (per
 * occurrence) and presence_penalty (once) over the generated ids. Per-request state lives in
 * device memory indexed by request *slot*, not row: a row names its slot (MF_NO_TOKEN: the row
 * has no penalties and is not touched), so compaction moves no state.
 * - state: one mf_penalty_slot per slot; `generated` and `entries` are advanced by
 *   mf_penalties_update, every other field is the caller's;
 * - table: table_cap mf_penalty_entry per slot (slot s at s * table_cap), one per distinct id the
 *   request has seen: its generated count and MF_PENALTY_PROMPT when the prompt holds it;
 * - items: item_cap mf_penalty_item per slot: `biases` logit biases, then `stops` stop ids.
 * The ids of a slot's table are distinct, and so are those of its biases and of its stops (the
 * caller's contract, as PenaltyState writes them: the kernels change the ids of a stage at once, so
 * an id twice in one list is applied once or twice as the lanes fall).
 * mf_penalties_apply changes the logits of this call's slice [start, start + vocab) only (a rank
 * of a split vocabulary applies its own columns; ids outside are skipped). Float32 arithmetic, one
 * IEEE operation at a time; float16/bfloat16 logits are rounded back to their dtype after each of
 * the three stages. mf_penalties_update counts ids[r] (device, the cells the step wrote, read when
 * the kernel runs; MF_NO_TOKEN counts nothing) into row r's slot. Host slots (rows words) are read
 * and checked before the call returns: ids < slot_count or MF_NO_TOKEN, no slot twice; with
 * MF_PENALTY_SLOTS_DEVICE they are device memory read when the kernel runs, where a slot out of
 * range touches nothing (and two rows must not name one slot). Counts in the state are clamped to
 * the capacities when read, so no state can make a kernel reach past its tables.
 * A verify (appended: drafts, k; k = 0 is the plain op above): rows is the verify's rows of drafts,
 * a slot word each. mf_penalties_apply then changes its rows * (k + 1) logit rows (verify_to_feed's
 * layout), logit row r * (k + 1) + j as if row r's first j drafts had been generated after the
 * slot's counted tokens: each draft added to its id's count (a draft equal to an earlier one counts
 * twice for frequency_penalty, once for presence and repetition; an id the table lacks joins it as a
 * generated one would, unless the table is full), and to `generated`, so the min_tokens ban lifts at
 * the position where the count reaches min_tokens. The walk stops at the row's first MF_NO_TOKEN
 * draft (mf_verify_drafts: the verify reads no position past it). drafts (device, rows * k ids) are
 * read when the kernel runs and the slot's state is left as it is. mf_penalties_update with k > 0
 * counts the ids a verify emitted: ids are its cells (rows * (k + 2) words: n, then the n ids; an
 * n outside [1, k + 1] counts nothing, as mf_resolve_verified reads it), each counted in order as
 * the plain update counts one; drafts must be NULL there. penalty_rule.h has the walk. */
#define MF_MAX_LOGIT_BIAS 300u       /* logit_bias entries a request may have */
#define MF_MAX_PENALTY_STOPS 64u     /* stop ids min_tokens can ban */
#define MF_PENALTY_ITEMS (MF_MAX_LOGIT_BIAS + MF_MAX_PENALTY_STOPS) /* the usual item_cap */
#define MF_MAX_PENALTY_TABLE 1048576u /* table_cap: distinct ids a slot may hold */
#define MF_MAX_PENALTY_SLOTS 65536u
#define MF_PENALTY_PROMPT 0x80000000u /* mf_penalty_entry.count: the id is in the prompt */
enum { MF_PENALTY_SLOTS_DEVICE = 1u };
typedef struct mf_penalty_slot {
    float repetition;    /* 1: off; > 0 */
    float presence;      /* 0: off */
    float frequency;     /* 0: off */
    uint32_t min_tokens; /* 0: off */
    uint32_t generated;  /* tokens counted so far (mf_penalties_update) */
    uint32_t entries;    /* table entries in use (mf_penalties_update appends) */
    uint32_t biases;     /* items [0, biases): logit biases */
    uint32_t stops;      /* items [biases, biases + stops): the ids min_tokens bans */
} mf_penalty_slot;
typedef struct mf_penalty_entry {
    uint32_t id;
    uint32_t count; /* generated occurrences, | MF_PENALTY_PROMPT */
} mf_penalty_entry;
typedef struct mf_penalty_item {
    uint32_t id;
    float value; /* the bias (stop items: unused) */
} mf_penalty_item;
typedef struct mf_penalty_args {
    uint32_t struct_size; /* sizeof(mf_penalty_args) where the caller was built: _init */
    void *logits;         /* apply: device, rows rows of row_stride elements, changed in place */
    mf_dtype dtype;
    uint32_t rows;
    uint32_t vocab;       /* apply: the columns of this call (a slice's width) */
    uint64_t row_stride;  /* apply: elements, >= vocab */
    uint32_t start;       /* apply: the global id of column 0 */
    uint32_t flags;       /* MF_PENALTY_* */
    const uint32_t *slots; /* rows words, host unless MF_PENALTY_SLOTS_DEVICE */
    mf_penalty_slot *state;        /* device, slot_count records */
    uint32_t slot_count;
    uint32_t table_cap;
    mf_penalty_entry *table;       /* device, slot_count * table_cap */
    const mf_penalty_item *items;  /* device, slot_count * item_cap */
    uint32_t item_cap;
    const uint32_t *ids;           /* update: device, rows ids (k > 0: rows * (k + 2) cell words) */
    /* appended: a verify's logit rows (above); an older descriptor's size reads as k = 0 */
    const uint32_t *drafts;        /* apply with k > 0: device, rows * k ids; else NULL */
    uint32_t k;                    /* drafts a row, 0 (a plain step) .. MF_MAX_DRAFTS */
    uint32_t reserved_;            /* 0: the next appended field changes the size */
} mf_penalty_args;
static inline void mf_penalty_args_init(mf_penalty_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
MF_EXPORT mf_status mf_penalties_apply(const mf_penalty_args *args, mf_stream_t stream);
MF_EXPORT mf_status mf_penalties_update(const mf_penalty_args *args, mf_stream_t stream);

/* ---- top logprobs (docs/kernels.md, "Top logprobs"; top_logprob_rule.h) ----
 * Per row, the n ids of greatest logit in the argmax order (greater value first, ties by the
 * smaller id; a NaN ranks below -inf) and their logprobs under the row's raw distribution, as the
 * chosen-token logprobs are computed (logprob_rule.h): out[r * n + j] for j = 0 .. n - 1 in that
 * order. A row of fewer than n ids fills the rest with (MF_NO_TOKEN, NaN). Read-only on the
 * logits; no masks, no bitmask, no temperature: the distribution of the model's output.
 * With ids (device, read when the kernel runs: a step's feed cells), chosen[r] is the logprob of
 * ids[r] under row r, as argmax_to_feed's logprobs are (NaN for MF_NO_TOKEN or an id outside the
 * row): the raw logprob of a token chosen from other logits (the penalised ones). n may be 0 then.
 * MF_TOP_PARTIAL (appended: flags, vocab_total, start, call, partials): the logits are the slice
 * [start, start + vocab) of rows of vocab_total ids (vocab may be 0, logits then unread), ids are
 * global, and instead of out and chosen (both NULL) the call writes the slice's partial block to
 * `partials` (partial_layout.h, "Top logprobs blocks": a header, per row a record of the slice's
 * (m, s) and of the id of ids[r] if the slice holds it, then per row the slice's n greatest
 * candidates), for mf_top_logprobs_combine. Every slice's call of one split takes the same n, rows,
 * call and ids-or-not: the header's operation carries n and whether ids were given. */
enum { MF_TOP_PARTIAL = 1u };
#define MF_MAX_TOP_LOGPROBS 20u /* the OpenAI API's top_logprobs limit */
typedef struct mf_top_logprob {
    uint32_t id;
    float logprob;
} mf_top_logprob;
typedef struct mf_top_logprobs_args {
    uint32_t struct_size; /* sizeof(mf_top_logprobs_args) where the caller was built: _init */
    const void *logits;   /* device, rows rows of row_stride elements */
    mf_dtype dtype;
    uint32_t rows;
    uint32_t vocab;
    uint64_t row_stride;  /* elements, >= vocab */
    uint32_t n;           /* 0 .. MF_MAX_TOP_LOGPROBS; 0 only with ids */
    mf_top_logprob *out;  /* device, rows * n records (NULL when n is 0) */
    const uint32_t *ids;  /* device, rows ids, or NULL */
    float *chosen;        /* device, rows floats: with ids, and only with them */
    uint32_t flags;       /* appended: MF_TOP_* (0: none) */
    uint32_t vocab_total; /* appended, MF_TOP_PARTIAL: the whole vocabulary */
    uint32_t start;       /* appended, MF_TOP_PARTIAL: the slice's first global id */
    uint64_t call;        /* appended, MF_TOP_PARTIAL: the caller's call word (header) */
    void *partials;       /* appended, MF_TOP_PARTIAL: device, mf_top_block_records(rows, n) records */
} mf_top_logprobs_args;
static inline void mf_top_logprobs_args_init(mf_top_logprobs_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
MF_EXPORT mf_status mf_top_logprobs(const mf_top_logprobs_args *args, mf_stream_t stream);

/* The top logprobs of a split vocabulary from its slices' MF_TOP_PARTIAL blocks, gathered: block w
 * starts at record w * slice_stride (records of 16 bytes), slices in id order. The combine checks
 * every header against (rows, n, ids-or-not, call, vocab) and the slices' coverage of [0, vocab),
 * as mf_combine_partials does, then writes out (rows * n records) and, when the slices had ids,
 * chosen (rows floats) as the unsplit mf_top_logprobs would: the n greatest of the slices' lists
 * by the argmax order of global ids, each logprob under the row's (M, S) combined from the slices'
 * (mf_combine_stats), so bit for bit the sharded chosen-token logprob's. A mismatch writes
 * (MF_NO_TOKEN, NaN) to every record, NaN to every chosen logprob, and the fault
 * (MF_FAULT_* | slice << 8) to `fault` (device word, required; 0 when the headers agree), copied to
 * fault_dst (host) if set; then event is recorded. Everything is read when the kernel runs, so the
 * call can be captured in a graph. */
typedef struct mf_top_combine_args {
    uint32_t struct_size;   /* sizeof(mf_top_combine_args) where the caller was built: _init */
    uint32_t world;         /* slices, >= 1 */
    const void *partials;   /* device */
    uint32_t slice_stride;  /* records between blocks, >= mf_top_block_records(rows, n) */
    uint32_t rows;
    uint32_t vocab;         /* the whole vocabulary */
    uint32_t n;             /* as each slice's call: 0 .. MF_MAX_TOP_LOGPROBS, 0 only with chosen */
    uint64_t call;
    mf_top_logprob *out;    /* device, rows * n records (NULL when n is 0) */
    float *chosen;          /* device, rows floats: exactly when the slices had ids */
    uint32_t *fault;        /* device, one word */
    void *fault_dst;        /* host, one word, or NULL */
    mf_event_t event;       /* 0: none */
} mf_top_combine_args;
static inline void mf_top_combine_args_init(mf_top_combine_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
/* Outputs (out, chosen, fault, fault_dst) must not overlap each other or the partials (the fault
 * word may be a header's reserved word, as mf_combine_partials allows). */
MF_EXPORT mf_status mf_top_logprobs_combine(const mf_top_combine_args *args, mf_stream_t stream);

/* ---- grammar (docs/kernels.md, "Grammar"; grammar_rule.h) ----
 * A deterministic automaton over token ids on the device, two arrays: num_states mf_grammar_state
 * records and num_edges mf_grammar_edge records. State s's edges are edges[first, first + count),
 * sorted by token (strictly increasing); every id that is not one of them goes to `fallback`. A
 * next state MF_GRAMMAR_DEAD (an edge's or the fallback) means the id is not allowed, so a state
 * allowing few ids lists them (fallback DEAD), and one allowing most of the vocabulary lists the
 * few it excludes (edges to DEAD) and those that leave it. MF_GRAMMAR_FINAL marks a state with no
 * outgoing transition (the output ends there); the kernels do not read it. Both arrays are device
 * memory read when the kernels run, so they are not checked when a call is queued; the kernels
 * keep every read in bounds instead: a state's edges are clamped to the edge array, a state word
 * or next state >= num_states allows nothing, ids >= vocab are never allowed. A row's state word
 * (uint32) is a state index, or MF_NO_TOKEN for an unconstrained row, which allows every id and
 * stays unconstrained. */
#define MF_GRAMMAR_DEAD 0xFFFFFFFFu
enum { MF_GRAMMAR_FINAL = 1u };
typedef struct mf_grammar_state {
    uint32_t first;    /* index of its first edge */
    uint32_t count;    /* its edges */
    uint32_t fallback; /* the next state of every id not among its edges; MF_GRAMMAR_DEAD: none */
    uint32_t flags;    /* MF_GRAMMAR_FINAL; other bits zero */
} mf_grammar_state;
typedef struct mf_grammar_edge {
    uint32_t token;
    uint32_t next; /* MF_GRAMMAR_DEAD: the token is not allowed */
} mf_grammar_edge;
/* mf_grammar_mask: rows rows with k drafts each (0: a plain step) give rows * (k + 1) bitmask rows
 * of ceil(vocab/32) words (argmax_to_feed's bitmask layout; bits >= vocab clear) in bitmask_out:
 * row r * (k + 1) + j holds the ids allowed by the state that row r's state word reaches through
 * its first j drafts. The walk stops at a draft its state does not allow (MF_NO_TOKEN and ids >=
 * vocab included): the later rows of that row take the state where it stopped (the verify rejects
 * that draft anyway). With bitmask_in (same shape) the output is ANDed with it. bitmask_out must
 * not overlap an input. */
typedef struct mf_grammar_mask_args {
    uint32_t struct_size;             /* sizeof(mf_grammar_mask_args) where the caller was built: _init */
    const mf_grammar_state *states;   /* device, num_states records */
    uint32_t num_states;              /* >= 1 */
    uint32_t num_edges;
    const mf_grammar_edge *edges;     /* device, num_edges records (NULL when there are none) */
    uint32_t vocab;                   /* 1 .. MF_MAX_VOCAB */
    uint32_t rows;                    /* rows * (k + 1) <= MF_MAX_ROWS */
    uint32_t k;                       /* drafts a row, 0 .. MF_MAX_DRAFTS */
    const uint32_t *state_words;      /* device, rows words */
    const uint32_t *drafts;           /* device, rows * k ids; NULL exactly when k is 0 */
    const uint32_t *bitmask_in;       /* device, rows * (k + 1) * ceil(vocab/32) words, or NULL */
    uint32_t *bitmask_out;            /* device, rows * (k + 1) * ceil(vocab/32) words */
} mf_grammar_mask_args;
static inline void mf_grammar_mask_args_init(mf_grammar_mask_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
MF_EXPORT mf_status mf_grammar_mask(const mf_grammar_mask_args *args, mf_stream_t stream);
/* mf_grammar_advance: each of rows state words becomes the state after the ids a pick wrote into
 * cells, in order: k = 0 (argmax_to_feed, sample_to_feed) cells[r] is row r's id; k > 0
 * (verify_to_feed) cells[r * (k + 2)] = n, then the n emitted ids (an n outside [1, k + 1]: no
 * ids, as resolve_verified reads it). Each id steps the state on its own: an id the state does not
 * allow (MF_NO_TOKEN, a row that had no candidate, included) leaves it unchanged, and so does a
 * state word MF_NO_TOKEN (unconstrained) or >= num_states. state_words must not overlap the other
 * arrays. */
typedef struct mf_grammar_advance_args {
    uint32_t struct_size;             /* sizeof(mf_grammar_advance_args) where the caller was built: _init */
    const mf_grammar_state *states;   /* device, num_states records */
    uint32_t num_states;              /* >= 1 */
    uint32_t num_edges;
    const mf_grammar_edge *edges;     /* device, num_edges records (NULL when there are none) */
    uint32_t vocab;                   /* 1 .. MF_MAX_VOCAB */
    uint32_t rows;                    /* 1 .. MF_MAX_ROWS (k > 0: rows * (k + 1) <= MF_MAX_ROWS) */
    uint32_t k;                       /* 0: one id a row; else the verify's drafts a row, <= MF_MAX_DRAFTS */
    const uint32_t *cells;            /* device, rows words (k = 0) or rows * (k + 2) words */
    uint32_t *state_words;            /* device, rows words, read and written */
} mf_grammar_advance_args;
static inline void mf_grammar_advance_args_init(mf_grammar_advance_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
MF_EXPORT mf_status mf_grammar_advance(const mf_grammar_advance_args *args, mf_stream_t stream);
/* A pick's grammar (mf_argmax_args.grammar, mf_verify_args.grammar; docs/kernels.md, "Grammar in
 * a pick"): the two ops above composed by mf_argmax_to_feed and mf_verify_to_feed around their
 * kernel, with the call's rows, k (0 for argmax_to_feed) and vocab. The pick checks it with
 * everything else before anything is queued: the automaton as the ops check theirs, its vocab
 * equal to the call's, the state words and the scratch in range and overlapping nothing else
 * the call reads or writes (the state words are written by the advance, the scratch by the
 * mask and the drafts' upload). The call then queues the mask, its kernel (with the scratch as
 * its bitmask), the advance, its copies and its event record, or none of them. Read before the
 * call returns (a graph capture keeps a copy). Not with MF_ARGS_PARTIAL: over a split vocabulary
 * each rank queues the two ops around its partial calls and the combine. */
typedef struct mf_grammar_pick {
    uint32_t struct_size;             /* sizeof(mf_grammar_pick) where the caller was built: _init */
    uint32_t num_states;              /* >= 1 */
    const mf_grammar_state *states;   /* device, num_states records */
    const mf_grammar_edge *edges;     /* device, num_edges records (NULL when there are none) */
    uint32_t num_edges;
    uint32_t vocab;                   /* the automaton's: must be the call's vocab */
    uint32_t *state_words;            /* device, rows words, read and written */
    /* device: the mask's rows * (k + 1) * ceil(vocab/32) words, then, for a verify with host
     * drafts, the rows * k drafts uploaded for the mask */
    uint32_t *scratch;
} mf_grammar_pick;
static inline void mf_grammar_pick_init(mf_grammar_pick *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}

/* The reference model's forward. Per row r (device arrays): meta[2r] = seq_len (the position
 * written), meta[2r+1] = offset of the row's block table in tables; input_ids[r] is written into
 * kv at that position, then logits row r (rows x vocab, dtype) is computed from the history:
 * column j holds the logit of id start + j, so a rank of a split vocabulary computes only its
 * slice, as a column-parallel LM head does (start 0: the whole row; start + vocab <= 2**24).
 * logits NULL: only the KV writes (a prefill, one row per position).
 * advance (device, ceil(rows / advance_group) words, NULL: none) adds advance[r / advance_group]
 * to row r's position, read when the kernel runs: a speculative step's rows * (k + 1) positions
 * take their advance from the last verify (resolve_verified), which the host does not know yet. */
typedef struct mf_reference_args {
    uint32_t struct_size; /* sizeof(mf_reference_args) where the caller was built: _init */
    const uint32_t *input_ids;
    const uint32_t *meta;
    const uint32_t *tables;
    uint32_t table_words; /* ids in tables: a row's table past them reads as out of the cache */
    uint32_t *kv;
    uint32_t kv_slots;   /* num_blocks * block_size */
    uint32_t block_size;
    uint32_t rows;
    uint32_t vocab;
    mf_dtype dtype;
    void *logits;
    uint32_t start; /* the id of column 0 */
    const uint32_t *advance; /* appended: device, per group of advance_group rows; NULL: none */
    uint32_t advance_group;  /* rows that share an advance word, at least 1 with advance */
} mf_reference_args;
static inline void mf_reference_args_init(mf_reference_args *args) {
    memset(args, 0, sizeof *args);
    args->struct_size = (uint32_t)sizeof *args;
}
MF_EXPORT mf_status mf_reference_forward(const mf_reference_args *args, mf_stream_t stream);

/* ---- host functions in stream order ----
 * fn(data) runs once the work queued before it on `stream` has run, and work queued after it waits
 * for it to return (cuda: cudaLaunchHostFunc, so fn must make no CUDA call; host: the stream's
 * worker thread). fn reports nothing back: a binding that needs errors keeps them itself.
 * On a capturing stream it becomes an operation of the graph (cuda: a host node), run at each
 * launch with the same data, which must then live as long as the graph and its queued launches. */
typedef void (*mf_host_fn)(void *data);
MF_EXPORT mf_status mf_launch_host_func(mf_stream_t stream, mf_host_fn fn, void *data);

/* ---- borrowed memory ----
 * Foreign memory a binding vouches for (a CPU tensor standing in for device memory on the host
 * backend) passes the device-range checks of the calls this thread makes until
 * mf_device_borrow_clear(). The caller keeps that memory alive until the work using it has run.
 * At most MF_MAX_BORROWED ranges at once. The cuda backend takes foreign pointers as they are. */
#define MF_MAX_BORROWED 8
MF_EXPORT mf_status mf_device_borrow(const void *ptr, size_t nbytes);
MF_EXPORT void mf_device_borrow_clear(void);
/* ---- graphs (docs/graphs.md) ----
 * mf_graph_begin starts capturing `stream` (not the default stream): operations then queued on it
 * are recorded, not run, until mf_graph_end makes them a graph. mf_graph_launch queues the whole
 * graph on any stream; each operation reads its device-resident inputs when it runs, and an event
 * record in the graph records that event at each launch. cuda: stream capture (thread-local mode),
 * instantiate, graph launch. host: the recorded calls are re-issued on the launch stream, each
 * checked again first, so a launch that fails queues nothing.
 * While a stream captures, an operation whose inputs live in host memory other than this layer's
 * pinned memory (host masks, params or sources, pageable copies), a stream wait, and a
 * synchronize, query or destroy of that stream fail with MF_ERROR_CAPTURE: a replay could not see
 * new host values. The memory a graph uses must outlive it. */
typedef uint64_t mf_graph_t; /* a handle this layer hands out; never 0 */
MF_EXPORT mf_status mf_graph_begin(mf_stream_t stream);
/* Ends the capture of `stream`; out NULL discards what was recorded. The capture ends even when
 * making the graph fails (cuda: a capture the runtime invalidated). */
MF_EXPORT mf_status mf_graph_end(mf_stream_t stream, mf_graph_t *out);
MF_EXPORT mf_status mf_graph_launch(mf_graph_t graph, mf_stream_t stream);
MF_EXPORT mf_status mf_graph_destroy(mf_graph_t graph); /* a launch already queued still runs */
MF_EXPORT mf_status mf_stream_capturing(mf_stream_t stream, int *capturing);
MF_EXPORT uint64_t mf_live_graphs(void);

/* ---- timelines (host backend) ----
 * While enabled, each op a host-backend worker runs is recorded: its name, its stream (0: the
 * default stream), and when it was queued, started and ended, in mf_trace_now_ns() time. */
typedef struct mf_trace_record {
    const char *name;
    uint64_t stream;
    int64_t queued_ns;
    int64_t start_ns;
    int64_t end_ns;
} mf_trace_record;
MF_EXPORT void mf_trace_enable(size_t capacity); /* 0 turns it off; either way clears */
MF_EXPORT size_t mf_trace_read(mf_trace_record *out, size_t max, uint64_t *dropped); /* drains */
MF_EXPORT int64_t mf_trace_now_ns(void);

/* ---- NVTX ---- */
MF_EXPORT void mf_nvtx_push(const char *name);
MF_EXPORT void mf_nvtx_pop(void);
MF_EXPORT void mf_nvtx_enable(int on);

#ifdef __cplusplus
}
#endif
#endif
