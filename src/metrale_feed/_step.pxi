# PickStep: one launch of a pick into the feed, described once and handed down (the Python
# mirror of mf_argmax_args / mf_verify_args). The scheduler's router builds one a launch (the
# speculative step one a verify), the model's feed method completes it with its own feed
# (PickStep.on), and pick_to_feed fills the C descriptor from it; the keyword ops (argmax_to_feed,
# sample_to_feed, verify_to_feed) are thin builders of one. An extension type, so that making one
# and reading its fields cost what passing keywords did: the fields are C slots, set without a
# dictionary.

#: The launches a PickStep describes.
PICK_OPS = ("argmax", "sample", "verify")

#: Its fields, in order: what a launch picks from, where it writes, verify's own, and the model's.
PICK_FIELDS = ("op", "logits", "masks", "params", "cells", "dst", "event", "stream", "rows",
               "vocab", "dtype", "row_stride", "bitmask", "logprobs", "logprobs_dst", "penalties",
               "grammar", "shard", "drafts", "k", "draft_probs", "advance", "top_logprobs",
               "top_logprobs_dst", "top_n", "raw_logits")


@cython.final
cdef class PickStep:
    """One launch of a pick into the feed: what it picks from and where it writes.

    Made once a launch, by the scheduler (the router's ``launch``; the speculative step's verify,
    which it hands to ``metrale_feed.pick_to_feed`` itself) or by the keyword functions
    (``argmax_to_feed``, ``sample_to_feed``, ``verify_to_feed``, which build one from their
    arguments), and handed down whole: to the model's ``pick_to_feed``, which completes it with
    its own feed (``on``), to ``metrale_feed.pick_to_feed``, which fills the C descriptor from it,
    and over a split vocabulary to the shard (``VocabShard.run_step``). Adding an option to a
    launch adds a field here, not a parameter to every function on the way down.

    Values are the caller's, unchecked: each layer checks what it reads, once (the C ABI checks
    everything it is handed). Read-only once made.

    Parameters
    ----------
    op : {"argmax", "sample", "verify"}
    logits, masks, params, cells, dst, event, stream, rows, vocab, dtype, row_stride, bitmask,
    logprobs, logprobs_dst, penalties, grammar, shard
        As ``argmax_to_feed`` and ``sample_to_feed`` take them (``params`` None for an argmax).
    drafts, k, draft_probs, advance
        ``verify_to_feed``'s own (None for the other two).
    top_logprobs, top_logprobs_dst, top_n, raw_logits
        The model feed method's own (the trait's keywords of the same names): the top ids it
        queues before the pick, and the logits before the penalties its logprobs are read from.
        ``pick_to_feed`` refuses a step that still holds them (``on`` clears them).

    Examples
    --------
    >>> from metrale_feed import PickStep
    >>> step = PickStep("argmax", cells=None, dst=None, event=None, rows=4)
    >>> step.op, step.rows, step.bitmask, step.stream
    ('argmax', 4, None, 0)
    >>> step.rows = 5
    Traceback (most recent call last):
        ...
    AttributeError: PickStep is read-only
    """

    cdef readonly str op
    cdef readonly object logits, masks, params, cells, dst, event, stream, rows, vocab, dtype
    cdef readonly object row_stride, bitmask, logprobs, logprobs_dst, penalties, grammar, shard
    cdef readonly object drafts, k, draft_probs, advance
    cdef readonly object top_logprobs, top_logprobs_dst, top_n, raw_logits

    def __init__(self, str op, *, logits=None, masks=None, params=None, cells=None, dst=None,
                 event=None, stream=0, rows=None, vocab=None, dtype=None, row_stride=None,
                 bitmask=None, logprobs=None, logprobs_dst=None, penalties=None, grammar=None,
                 shard=None, drafts=None, k=None, draft_probs=None, advance=None,
                 top_logprobs=None, top_logprobs_dst=None, top_n=0, raw_logits=None):
        if op not in PICK_OPS:
            raise ValueError(f"PickStep.op must be one of {PICK_OPS}, not {op!r}")
        self.op = op
        self.logits, self.masks, self.params, self.cells = logits, masks, params, cells
        self.dst, self.event, self.stream, self.rows = dst, event, stream, rows
        self.vocab, self.dtype, self.row_stride, self.bitmask = vocab, dtype, row_stride, bitmask
        self.logprobs, self.logprobs_dst, self.penalties = logprobs, logprobs_dst, penalties
        self.grammar, self.shard = grammar, shard
        self.drafts, self.k, self.draft_probs, self.advance = drafts, k, draft_probs, advance
        self.top_logprobs, self.top_logprobs_dst = top_logprobs, top_logprobs_dst
        self.top_n, self.raw_logits = top_n, raw_logits

    def __setattr__(self, name, value):
        raise AttributeError("PickStep is read-only")

    cdef PickStep copy(self):
        cdef PickStep s = PickStep.__new__(PickStep)
        s.op, s.logits, s.masks, s.params, s.cells = self.op, self.logits, self.masks, self.params, self.cells
        s.dst, s.event, s.stream, s.rows, s.vocab = self.dst, self.event, self.stream, self.rows, self.vocab
        s.dtype, s.row_stride, s.bitmask, s.logprobs = self.dtype, self.row_stride, self.bitmask, self.logprobs
        s.logprobs_dst, s.penalties, s.grammar, s.shard = self.logprobs_dst, self.penalties, self.grammar, self.shard
        s.drafts, s.k, s.draft_probs, s.advance = self.drafts, self.k, self.draft_probs, self.advance
        s.top_logprobs, s.top_logprobs_dst = self.top_logprobs, self.top_logprobs_dst
        s.top_n, s.raw_logits = self.top_n, self.raw_logits
        return s

    def on(self, cells, vocab, dtype, row_stride=None, shard=None):
        """This step on a model's feed: its cells, vocabulary (a shard's width with a shard),
        logits dtype, row stride and shard where the step leaves them None, and the model's own
        fields (``top_logprobs``, ``top_logprobs_dst``, ``top_n``, ``raw_logits``) cleared: what
        a feed method hands ``pick_to_feed`` once it has queued them."""
        cdef PickStep s = self.copy()
        if s.cells is None:
            s.cells = cells
        if s.vocab is None:
            s.vocab = vocab
        if s.dtype is None:
            s.dtype = dtype
        if s.row_stride is None:
            s.row_stride = row_stride
        if s.shard is None:
            s.shard = shard
        s.top_logprobs = s.top_logprobs_dst = s.raw_logits = None
        s.top_n = 0
        return s

    def replace(self, **changes):
        """A copy with ``changes`` (field names as keywords), like ``dataclasses.replace``."""
        fields = self.asdict()
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"PickStep has no field {sorted(unknown)[0]!r}")
        fields.update(changes)
        op = fields.pop("op")
        return PickStep(op, **fields)

    def asdict(self):
        """The fields as a dict, in ``PICK_FIELDS`` order."""
        return {name: getattr(self, name) for name in PICK_FIELDS}

    def __repr__(self):
        given = ", ".join(f"{n}={type(getattr(self, n)).__name__}" for n in PICK_FIELDS[1:]
                          if getattr(self, n) is not None and n not in ("stream", "top_n"))
        return f"PickStep({self.op!r}, {given})"

    def __reduce__(self):
        raise TypeError("a PickStep holds one launch's live buffers: it cannot be pickled")


cdef PickStep pick_step(str op, object logits, object masks, object params, object cells,
                        object dst, object event, object stream, object rows, object vocab,
                        object dtype, object row_stride, object bitmask, object logprobs,
                        object logprobs_dst, object penalties, object grammar, object shard):
    """The keyword ops' step, made without parsing keywords again."""
    cdef PickStep s = PickStep.__new__(PickStep)
    s.op, s.logits, s.masks, s.params, s.cells = op, logits, masks, params, cells
    s.dst, s.event, s.stream, s.rows, s.vocab = dst, event, stream, rows, vocab
    s.dtype, s.row_stride, s.bitmask, s.logprobs = dtype, row_stride, bitmask, logprobs
    s.logprobs_dst, s.penalties, s.grammar, s.shard = logprobs_dst, penalties, grammar, shard
    s.top_n = 0
    return s


def _router_step(str op, logits, masks, params, dst, event, stream, logprobs, logprobs_dst,
                 top_logprobs, top_logprobs_dst, top_n, raw_logits, penalties, grammar, bitmask):
    """The router's step a launch, from positional arguments (``PickStep(...)``'s keywords cost
    a dictionary a call: this is the per-step path)."""
    cdef PickStep s = pick_step(op, logits, masks, params, None, dst, event, stream, None, None,
                                None, None, bitmask, logprobs, logprobs_dst, penalties, grammar,
                                None)
    s.top_logprobs, s.top_logprobs_dst, s.top_n, s.raw_logits = (top_logprobs, top_logprobs_dst,
                                                                 top_n, raw_logits)
    return s
