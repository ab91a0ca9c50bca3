# The C ABI of cuda/include/metrale_feed/feed.h, for Cython. No Python objects here.
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t

cdef extern from "metrale_feed/feed.h" nogil:
    const uint32_t MF_NO_TOKEN
    const uint32_t MF_MAX_ROWS
    const uint32_t MF_MAX_VOCAB
    const uint32_t MF_FEED_HOST_BIT
    ctypedef uint64_t mf_event_t
    ctypedef uint64_t mf_stream_t

    ctypedef enum mf_status:
        MF_SUCCESS
        MF_ERROR_INVALID_VALUE
        MF_ERROR_INVALID_HANDLE
        MF_ERROR_OUT_OF_MEMORY
        MF_ERROR_CUDA
        MF_ERROR_INJECTED
        MF_ERROR_UNAVAILABLE
        MF_ERROR_DEVICE
        MF_ERROR_CAPTURE
        MF_ERROR_INTERNAL

    ctypedef enum mf_backend:
        MF_BACKEND_HOST
        MF_BACKEND_CUDA
        MF_BACKEND_SIMT

    ctypedef enum mf_dtype:
        MF_DTYPE_F32
        MF_DTYPE_F16
        MF_DTYPE_BF16

    ctypedef enum mf_mem_kind:
        MF_MEM_UNKNOWN
        MF_MEM_PINNED
        MF_MEM_DEVICE

    enum:
        MF_EVENT_TIMING
        MF_EVENT_BLOCKING
        MF_EVENT_UNCOUNTED
        MF_STREAM_NON_BLOCKING
        MF_HOST_PORTABLE
        MF_HOST_MAPPED
        MF_HOST_WRITE_COMBINED

    const char *mf_last_error()
    int mf_last_cuda_error()
    const char *mf_cuda_error_name(int code)
    void mf_clear_error()

    mf_status mf_select_backend(mf_backend which)
    mf_backend mf_active_backend()
    int mf_build_has_cuda()
    int mf_build_cuda_version()
    const char *mf_build_cuda_archs()
    int mf_build_has_nvtx()
    mf_status mf_device_count(int *count)
    mf_status mf_device_name(int device, char *buf, size_t buflen)
    mf_status mf_driver_version(int *version)
    mf_status mf_current_device(int *device)
    void mf_live_counts(uint64_t *events, uint64_t *streams, uint64_t *pinned_bytes,
                        uint64_t *device_bytes)

    ctypedef struct mf_host_faults:
        uint32_t lag_us
        uint64_t fail_event_query_at
        uint64_t fail_alloc_at
        uint64_t fail_copy_at
        uint64_t fail_synchronize_at
        uint64_t fail_event_create_at
    void mf_host_configure(const mf_host_faults *faults)
    void mf_host_faults_get(mf_host_faults *out)

    ctypedef struct mf_simt_config:
        int sm_count
        int order
        uint64_t seed
        int threads
    mf_status mf_simt_configure(const mf_simt_config *config)
    void mf_simt_config_get(mf_simt_config *out)
    void mf_simt_counters(uint64_t *out)
    size_t mf_simt_kernel_launches(char *buf, size_t capacity)
    int mf_simt_selftest(const char *which, char *message, size_t capacity)
    void mf_host_set_kernel_threads(unsigned threads)
    unsigned mf_host_kernel_threads()
    const char *mf_host_argmax_isa(int force_portable)
    double mf_host_floor(unsigned what, const float *logits, uint32_t rows, uint32_t vocab) nogil

    mf_status mf_event_create(unsigned flags, mf_event_t *out)
    mf_status mf_event_wrap(uint64_t foreign, mf_event_t *out)
    mf_status mf_event_record(mf_event_t event, mf_stream_t stream)
    mf_status mf_event_query(mf_event_t event, int *done)
    mf_status mf_event_synchronize(mf_event_t event)
    mf_status mf_event_synchronize_for(mf_event_t event, uint32_t timeout_us, uint64_t *mark, int *done)
    mf_status mf_event_elapsed_ms(mf_event_t start, mf_event_t end, float *ms)
    mf_status mf_event_destroy(mf_event_t event)
    mf_status mf_event_raw(mf_event_t event, uint64_t *raw)

    mf_status mf_stream_create(unsigned flags, mf_stream_t *out)
    mf_status mf_stream_check(mf_stream_t stream)
    mf_status mf_stream_query(mf_stream_t stream, int *idle)
    mf_status mf_stream_synchronize(mf_stream_t stream)
    mf_status mf_stream_synchronize_for(mf_stream_t stream, uint32_t timeout_us, uint64_t *mark, int *done)
    mf_status mf_stream_wait_event(mf_stream_t stream, mf_event_t event)
    mf_status mf_stream_destroy(mf_stream_t stream)

    mf_status mf_host_alloc(size_t nbytes, unsigned flags, void **out)
    mf_status mf_host_free(void *ptr, size_t nbytes)
    mf_status mf_device_alloc(size_t nbytes, void **out)
    mf_status mf_device_free(void *ptr)
    mf_mem_kind mf_mem_lookup(const void *ptr, size_t *bytes_left)
    mf_status mf_memset_async(void *dev, int value, size_t nbytes, mf_stream_t stream)
    mf_status mf_copy_d2h_async(void *host_dst, const void *dev_src, size_t nbytes, mf_stream_t stream)
    mf_status mf_copy_h2d_async(void *dev_dst, const void *host_src, size_t nbytes, mf_stream_t stream)
    mf_status mf_copy_d2d_async(void *dev_dst, const void *dev_src, size_t nbytes, mf_stream_t stream)

    # The layout is feed.h's (MF_SAMPLING_PARAMS_FIELDS); Python reads it from
    # mf_sampling_params_layout(). The fields are named here only for Cython code that cimports
    # this file and fills a record by name: the package reads none, and a field feed.h adds is in
    # the struct whether or not it is named here (tests/test_params_layout.py checks these names
    # are the table's, in order).
    ctypedef struct mf_sampling_params:
        float temperature
        float top_p
        float min_p
        uint32_t top_k
        uint64_t seed
        uint32_t position
    ctypedef struct mf_record_field:
        const char *name
        const char *format
        uint32_t offset
        uint32_t size
    ctypedef struct mf_record_layout:
        uint32_t struct_size
        uint32_t record_size
        uint32_t count
        uint32_t field_size
        const mf_record_field *fields
    void mf_record_layout_init(mf_record_layout *layout)
    mf_status mf_sampling_params_layout(mf_record_layout *layout)
    ctypedef struct mf_select_row:
        uint64_t floor
        uint64_t cut_need
        uint32_t top_bits
        uint32_t cut_key
        uint32_t prefix
        uint32_t shift
        uint32_t flags
        uint32_t list_len
        uint32_t draft_bits
    ctypedef struct mf_select_plan:
        uint64_t target
        uint64_t above
        uint32_t prefix
        uint32_t flags
    enum:
        MF_SELECT_K
        MF_SELECT_P
        MF_DECIDE_TOP
        MF_DECIDE_ROUND
    ctypedef struct mf_select_decide_args:
        uint32_t struct_size
        uint32_t step
        const void *gathered
        uint64_t block_bytes
        uint32_t world
        uint32_t rank
        uint32_t rows
        uint32_t vocab
        uint64_t call
        const mf_sampling_params *params
        mf_select_row *select
        mf_select_plan *plan
        uint32_t *fault
        uint32_t select_k_p
        uint32_t round
        uint32_t next
        uint32_t rounds
    void mf_select_decide_args_init(mf_select_decide_args *args)
    mf_status mf_select_decide(const mf_select_decide_args *args, mf_stream_t stream)
    # The penalty descriptor (declared here: mf_argmax_args points to one).
    ctypedef struct mf_penalty_slot:
        float repetition
        float presence
        float frequency
        uint32_t min_tokens
        uint32_t generated
        uint32_t entries
        uint32_t biases
        uint32_t stops
    ctypedef struct mf_penalty_entry:
        uint32_t id
        uint32_t count
    ctypedef struct mf_penalty_item:
        uint32_t id
        float value
    ctypedef struct mf_penalty_args:
        uint32_t struct_size
        void *logits
        mf_dtype dtype
        uint32_t rows
        uint32_t vocab
        uint64_t row_stride
        uint32_t start
        uint32_t flags
        const uint32_t *slots
        mf_penalty_slot *state
        uint32_t slot_count
        uint32_t table_cap
        mf_penalty_entry *table
        const mf_penalty_item *items
        uint32_t item_cap
        const uint32_t *ids
        const uint32_t *drafts
        uint32_t k
    # Descriptors start with struct_size: set one up with its mf_*_args_init() (feed.h).
    ctypedef struct mf_argmax_args:
        uint32_t struct_size
        const void *logits
        mf_dtype dtype
        uint32_t rows
        uint32_t vocab
        uint64_t row_stride
        const uint32_t *masks
        uint32_t *cells
        uint32_t cell_capacity
        void *host_dst
        mf_event_t event
        const uint32_t *bitmask
        const mf_sampling_params *params
        uint32_t flags
        float *logprobs
        void *logprobs_dst
        void *partials
        uint32_t vocab_total
        uint32_t start
        uint64_t call
        mf_select_row *select
        uint32_t select_stage
        uint32_t select_list_cap
        uint32_t *select_list
        uint32_t select_cands_cap
        uint32_t select_cands_world
        uint64_t select_cands_stride
        const void *select_cands
        const mf_penalty_args *penalties
        const uint32_t *select_drafts
        uint32_t select_k
        const mf_grammar_pick *grammar
    enum:
        MF_ARGS_MASKS_DEVICE
        MF_ARGS_PARAMS_DEVICE
        MF_ARGS_PARTIAL
        MF_ARGS_PARTIAL_LOGPROBS
        MF_ARGS_SELECT
        MF_SELECT_TOP
        MF_SELECT_HIST
        MF_SELECT_RACE
        MF_SELECT_CANDS
        MF_SELECT_ROW_TOP
        MF_SELECT_ROW_HIST
        MF_SELECT_ROW_MASS
        MF_SELECT_ROW_CUT
        MF_SELECT_ROW_CUT_MASS
        MF_SELECT_ROW_CANDS
        MF_SOURCES_DEVICE
    const uint32_t MF_SELECT_BINS
    const uint32_t MF_SELECT_DIGIT_BITS
    const uint32_t MF_SELECT_CANDS_MAX
    const uint32_t MF_ROUNDS_FIXED
    const uint32_t MF_ROUNDS_TOP_P
    void mf_argmax_args_init(mf_argmax_args *args)
    mf_status mf_argmax_to_feed(const mf_argmax_args *args, mf_stream_t stream)
    const uint32_t MF_MAX_SLICES
    ctypedef struct mf_combine_args:
        uint32_t struct_size
        const void *partials
        uint32_t world
        uint32_t slice_stride
        uint32_t rows
        uint32_t vocab
        uint32_t op
        uint32_t flags
        uint64_t call
        const mf_sampling_params *params
        uint32_t *cells
        uint32_t cell_capacity
        void *host_dst
        float *logprobs
        void *logprobs_dst
        uint32_t *fault
        void *fault_dst
        mf_event_t event
        const uint32_t *drafts
        uint32_t k
        const uint32_t *refused
        const mf_select_row *select
    enum:
        MF_COMBINE_PARAMS_DEVICE
        MF_COMBINE_VERIFY
    void mf_combine_args_init(mf_combine_args *args)
    mf_status mf_combine_partials(const mf_combine_args *args, mf_stream_t stream)
    mf_status mf_resolve_feed(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                              uint32_t prev_rows, uint32_t *out, mf_stream_t stream)
    mf_status mf_resolve_feed_flags(const uint32_t *sources, uint32_t n, const uint32_t *cells,
                                    uint32_t prev_rows, uint32_t *out, unsigned flags,
                                    mf_stream_t stream)

    const uint32_t MF_MAX_DRAFTS
    enum:
        MF_VERIFY_DRAFTS_DEVICE
    ctypedef struct mf_verify_args:
        uint32_t struct_size
        const void *logits
        mf_dtype dtype
        uint32_t rows
        uint32_t k
        uint32_t vocab
        uint64_t row_stride
        const uint32_t *drafts
        const uint32_t *masks
        const uint32_t *bitmask
        const mf_sampling_params *params
        const float *draft_probs
        uint32_t flags
        uint32_t *cells
        uint32_t cell_capacity
        void *host_dst
        float *logprobs
        void *logprobs_dst
        mf_event_t event
        const uint32_t *advance
        const mf_grammar_pick *grammar
        const mf_penalty_args *penalties
    void mf_verify_args_init(mf_verify_args *args)
    mf_status mf_verify_to_feed(const mf_verify_args *args, mf_stream_t stream)
    mf_status mf_resolve_verified(const uint32_t *cells, uint32_t rows, uint32_t k, uint32_t *out_ids,
                                  uint32_t *out_advance, mf_stream_t stream)
    mf_status mf_verify_logit_params(const mf_sampling_params *params, const uint32_t *advance, uint32_t rows,
                                     uint32_t k, mf_sampling_params *out, mf_stream_t stream)

    const uint32_t MF_GRAMMAR_DEAD
    enum: MF_GRAMMAR_FINAL
    ctypedef struct mf_grammar_state:
        uint32_t first
        uint32_t count
        uint32_t fallback
        uint32_t flags
    ctypedef struct mf_grammar_edge:
        uint32_t token
        uint32_t next
    ctypedef struct mf_grammar_mask_args:
        uint32_t struct_size
        const mf_grammar_state *states
        uint32_t num_states
        uint32_t num_edges
        const mf_grammar_edge *edges
        uint32_t vocab
        uint32_t rows
        uint32_t k
        const uint32_t *state_words
        const uint32_t *drafts
        const uint32_t *bitmask_in
        uint32_t *bitmask_out
    void mf_grammar_mask_args_init(mf_grammar_mask_args *args)
    mf_status mf_grammar_mask(const mf_grammar_mask_args *args, mf_stream_t stream)
    ctypedef struct mf_grammar_advance_args:
        uint32_t struct_size
        const mf_grammar_state *states
        uint32_t num_states
        uint32_t num_edges
        const mf_grammar_edge *edges
        uint32_t vocab
        uint32_t rows
        uint32_t k
        const uint32_t *cells
        uint32_t *state_words
    void mf_grammar_advance_args_init(mf_grammar_advance_args *args)
    mf_status mf_grammar_advance(const mf_grammar_advance_args *args, mf_stream_t stream)
    ctypedef struct mf_grammar_pick:
        uint32_t struct_size
        uint32_t num_states
        const mf_grammar_state *states
        const mf_grammar_edge *edges
        uint32_t num_edges
        uint32_t vocab
        uint32_t *state_words
        uint32_t *scratch
    void mf_grammar_pick_init(mf_grammar_pick *args)

    const uint32_t MF_MAX_LOGIT_BIAS
    const uint32_t MF_MAX_PENALTY_STOPS
    const uint32_t MF_PENALTY_ITEMS
    const uint32_t MF_MAX_PENALTY_TABLE
    const uint32_t MF_MAX_PENALTY_SLOTS
    const uint32_t MF_PENALTY_PROMPT
    enum: MF_PENALTY_SLOTS_DEVICE
    void mf_penalty_args_init(mf_penalty_args *args)
    mf_status mf_penalties_apply(const mf_penalty_args *args, mf_stream_t stream)
    mf_status mf_penalties_update(const mf_penalty_args *args, mf_stream_t stream)

    const uint32_t MF_MAX_TOP_LOGPROBS
    ctypedef struct mf_top_logprob:
        uint32_t id
        float logprob
    ctypedef struct mf_top_logprobs_args:
        uint32_t struct_size
        const void *logits
        mf_dtype dtype
        uint32_t rows
        uint32_t vocab
        uint64_t row_stride
        uint32_t n
        mf_top_logprob *out
        const uint32_t *ids
        float *chosen
        uint32_t flags
        uint32_t vocab_total
        uint32_t start
        uint64_t call
        void *partials
    void mf_top_logprobs_args_init(mf_top_logprobs_args *args)
    mf_status mf_top_logprobs(const mf_top_logprobs_args *args, mf_stream_t stream)
    enum:
        MF_TOP_PARTIAL
    ctypedef struct mf_top_combine_args:
        uint32_t struct_size
        uint32_t world
        const void *partials
        uint32_t slice_stride
        uint32_t rows
        uint32_t vocab
        uint32_t n
        uint64_t call
        mf_top_logprob *out
        float *chosen
        uint32_t *fault
        void *fault_dst
        mf_event_t event
    void mf_top_combine_args_init(mf_top_combine_args *args)
    mf_status mf_top_logprobs_combine(const mf_top_combine_args *args, mf_stream_t stream)

    ctypedef struct mf_reference_args:
        uint32_t struct_size
        const uint32_t *input_ids
        const uint32_t *meta
        const uint32_t *tables
        uint32_t table_words
        uint32_t *kv
        uint32_t kv_slots
        uint32_t block_size
        uint32_t rows
        uint32_t vocab
        mf_dtype dtype
        void *logits
        uint32_t start
        const uint32_t *advance
        uint32_t advance_group
    void mf_reference_args_init(mf_reference_args *args)
    mf_status mf_reference_forward(const mf_reference_args *args, mf_stream_t stream)

    ctypedef void (*mf_host_fn)(void *data) noexcept
    mf_status mf_launch_host_func(mf_stream_t stream, mf_host_fn fn, void *data)
    const int MF_MAX_BORROWED
    mf_status mf_device_borrow(const void *ptr, size_t nbytes)
    void mf_device_borrow_clear()
    ctypedef uint64_t mf_graph_t
    mf_status mf_graph_begin(mf_stream_t stream)
    mf_status mf_graph_end(mf_stream_t stream, mf_graph_t *out)
    mf_status mf_graph_launch(mf_graph_t graph, mf_stream_t stream)
    mf_status mf_graph_destroy(mf_graph_t graph)
    mf_status mf_stream_capturing(mf_stream_t stream, int *capturing)
    uint64_t mf_live_graphs()

    ctypedef struct mf_trace_record:
        const char *name
        uint64_t stream
        int64_t queued_ns
        int64_t start_ns
        int64_t end_ns
    void mf_trace_enable(size_t capacity)
    size_t mf_trace_read(mf_trace_record *out, size_t max, uint64_t *dropped)
    int64_t mf_trace_now_ns()

    void mf_nvtx_push(const char *name)
    void mf_nvtx_pop()
    void mf_nvtx_enable(int on)


cdef extern from "metrale_feed/partial_layout.h" nogil:
    const uint32_t MF_PARTIAL_TAG
    const uint32_t MF_PARTIAL_RECORD_BYTES
    const uint32_t MF_PARTIAL_HEADER_RECORDS
    const uint32_t MF_PARTIAL_HEADER_BYTES
    const uint32_t MF_PARTIAL_OFF_TAG
    const uint32_t MF_PARTIAL_OFF_ROWS
    const uint32_t MF_PARTIAL_OFF_CALL
    const uint32_t MF_PARTIAL_OFF_VOCAB
    const uint32_t MF_PARTIAL_OFF_START
    const uint32_t MF_PARTIAL_OFF_STOP
    const uint32_t MF_PARTIAL_OFF_FAULT
    const uint32_t MF_RECORD_OFF_ID
    const uint32_t MF_RECORD_OFF_LOGIT_BITS
    const uint32_t MF_RECORD_OFF_MAX
    const uint32_t MF_RECORD_OFF_SUM
    const uint32_t MF_PARTIAL_CAND_BYTES
    uint64_t mf_top_block_records(uint32_t rows, uint32_t n)


cdef extern from "metrale_feed/sample_rule.h" nogil:
    ctypedef struct mf_sample_plan:
        int greedy
        int use_top_p
        int use_min_p
        uint32_t top_k
    mf_sample_plan mf_plan_sampling(const mf_sampling_params *p)


cdef extern from "metrale_feed/logprob_rule.h" nogil:
    enum:
        MF_PARTIAL_ARGMAX
        MF_PARTIAL_SAMPLE
        MF_PARTIAL_FILTERED
        MF_PARTIAL_TOP
        MF_PARTIAL_HIST
        MF_PARTIAL_CANDS
        MF_PARTIAL_TOP_LOGPROBS
