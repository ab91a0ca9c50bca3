"""``PickStep``: one pick's launch, described once and handed down.

The Python mirror of the C layer's launch descriptors (``mf_argmax_args``, ``mf_verify_args``):
what a launch picks from (the logits and their layout, masks, bitmask, params, penalties) and where
it writes (cells, ``dst``, the event, logprobs). ``argmax_to_feed``, ``sample_to_feed`` and
``verify_to_feed`` take keywords, as they always have, and build one when a lower layer takes the
launch whole: the shard of a split vocabulary (``VocabShard``) runs a ``PickStep`` instead of a call
of fifteen positional arguments, so adding an option to a launch adds a field here, not a
parameter to every function on the way down.

Plain Python with no imports, so the extension can make one without loading a layer above it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PickStep", "OPS"]

#: The launches a ``PickStep`` describes.
OPS = ("argmax", "sample", "verify")

_FIELDS = ("op", "logits", "masks", "params", "cells", "dst", "event", "stream", "rows", "vocab",
           "dtype", "row_stride", "bitmask", "logprobs", "logprobs_dst", "penalties", "grammar",
           # verify_to_feed only
           "drafts", "k", "draft_probs", "advance")


class PickStep:
    """One launch of a pick into the feed, as its public function was called.

    Values are the caller's, unchecked: each layer checks what it reads, once (the C ABI checks
    everything it is handed). Read-only once made.

    Parameters
    ----------
    op : {"argmax", "sample", "verify"}
    logits, masks, params, cells, dst, event, stream, rows, vocab, dtype, row_stride, bitmask,
    logprobs, logprobs_dst, penalties
        As ``argmax_to_feed`` and ``sample_to_feed`` take them (``params`` None for an argmax).
    drafts, k, draft_probs, advance
        ``verify_to_feed``'s own (None for the other two).

    Examples
    --------
    >>> from metrale_feed.step import PickStep
    >>> step = PickStep("argmax", logits=None, cells=None, dst=None, event=None, rows=4)
    >>> step.op, step.rows, step.bitmask
    ('argmax', 4, None)
    >>> step.rows = 5
    Traceback (most recent call last):
        ...
    AttributeError: PickStep is read-only
    """

    __slots__ = _FIELDS

    op: str
    logits: Any
    masks: Any
    params: Any
    cells: Any
    dst: Any
    event: Any
    stream: Any
    rows: Any
    vocab: Any
    dtype: Any
    row_stride: Any
    bitmask: Any
    logprobs: Any
    logprobs_dst: Any
    penalties: Any
    grammar: Any
    drafts: Any
    k: Any
    draft_probs: Any
    advance: Any

    def __init__(self, op: str, **fields: Any) -> None:
        if op not in OPS:
            raise ValueError(f"PickStep.op must be one of {OPS}, not {op!r}")
        unknown = set(fields) - set(_FIELDS)
        if unknown:
            raise TypeError(f"PickStep has no field {sorted(unknown)[0]!r}")
        setter = object.__setattr__
        setter(self, "op", op)
        for name in _FIELDS[1:]:
            setter(self, name, fields.get(name, 0 if name == "stream" else None))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("PickStep is read-only")

    def __repr__(self) -> str:
        given = ", ".join(f"{n}={type(getattr(self, n)).__name__}" for n in _FIELDS[1:]
                          if getattr(self, n) is not None)
        return f"PickStep({self.op!r}, {given})"
