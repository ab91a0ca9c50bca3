"""Per-request penalty state on the device (docs/penalties.md).

``PenaltyState`` owns, in device memory, one record per request *slot* (the three penalties,
``min_tokens`` and the counts), one table per slot of the distinct ids the request has seen (its
generated count and whether the prompt holds it) and one list per slot of its logit biases and
the stop ids ``min_tokens`` bans. A step applies them to its logits before the argmax or the
sampler reads them (``apply``) and counts the ids it wrote into the tables (``update``), both in
stream order, with no host synchronisation: the counts live where the ids are.

Slots, not rows: a request keeps its slot while its row moves (compaction), so each launch only
says which slot each row is. Every change of a slot (``set``, ``clear``) is an async copy queued
in stream order, behind the steps already queued: a step in flight for a request that finished
counts into the old contents, which the next ``set`` of that slot overwrites.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np

from . import _checks, _core
from .errors import FeedError

__all__ = ["PenaltyState", "SLOT_DTYPE", "ENTRY_DTYPE", "ITEM_DTYPE", "MAX_LOGIT_BIAS",
           "MAX_PENALTY_STOPS"]

#: One slot's record (feed.h's ``mf_penalty_slot``, 32 bytes).
SLOT_DTYPE = np.dtype([("repetition", "<f4"), ("presence", "<f4"), ("frequency", "<f4"),
                       ("min_tokens", "<u4"), ("generated", "<u4"), ("entries", "<u4"),
                       ("biases", "<u4"), ("stops", "<u4")])
#: One table entry (``mf_penalty_entry``): an id, its generated count | ``PENALTY_PROMPT``.
ENTRY_DTYPE = np.dtype([("id", "<u4"), ("count", "<u4")])
#: One item (``mf_penalty_item``): a biased id and its bias, or a stop id.
ITEM_DTYPE = np.dtype([("id", "<u4"), ("value", "<f4")])
MAX_LOGIT_BIAS: int = _core.MAX_LOGIT_BIAS
MAX_PENALTY_STOPS: int = _core.MAX_PENALTY_STOPS
_ITEMS: int = _core.PENALTY_ITEMS
_PROMPT: int = _core.PENALTY_PROMPT


class PenaltyState:
    """The device tables of ``slots`` requests' penalties.

    Parameters
    ----------
    slots : int
        Requests that may hold penalties at once (the pipeline's ``max_rows``).
    capacity : int, optional
        Distinct ids one slot's table holds: a request's distinct prompt ids plus its
        ``max_new_tokens`` must fit (``set`` refuses one that does not). Default 4096. Device
        memory: ``slots * (32 + 8 * capacity + 8 * 364)`` bytes (256 slots of 4096 ids: 8.7 MiB,
        against 149 MiB for a dense count per id at 152064 ids).
    stream : stream-like, optional
        Where the copies that set slots run (the stream of the steps that use them).

    Examples
    --------
    >>> import numpy as np, metrale_feed as mf
    >>> from metrale_feed.penalties import PenaltyState
    >>> logits = np.array([[1.0, -1.0, 2.0, 0.5]], np.float32)
    >>> with PenaltyState(2, capacity=16) as state, mf.DeviceBuffer(16) as dev, \\
    ...         mf.PinnedBuffer(16) as host:
    ...     state.set(1, prompt=[0, 1], repetition_penalty=2.0, logit_bias={3: 1.0})
    ...     mf.copy_h2d_async(dev, logits)
    ...     rows = state.apply(dev, [1], vocab=4, dtype="float32")
    ...     mf.copy_d2h_async(dev, host); mf.stream_synchronize()
    ...     np.frombuffer(host, np.float32).tolist()
    [0.5, -2.0, 2.0, 1.5]
    """

    def __init__(self, slots: int, *, capacity: int = 4096, stream: Any = 0) -> None:
        slots = _checks.integer(slots, "slots")
        capacity = _checks.integer(capacity, "capacity")
        if not 1 <= slots <= _core.MAX_ROWS * 16:
            raise ValueError(f"slots must be in [1, {_core.MAX_ROWS * 16}], got {slots}")
        if not 1 <= capacity <= _core.MAX_PENALTY_TABLE:
            raise ValueError(f"capacity must be in [1, {_core.MAX_PENALTY_TABLE}], got {capacity}")
        self.slots = slots
        self.capacity = capacity
        self.stream = stream
        self._closed = True
        self.state = _core.DeviceBuffer(slots * SLOT_DTYPE.itemsize)
        self.table = _core.DeviceBuffer(slots * capacity * ENTRY_DTYPE.itemsize)
        self.items = _core.DeviceBuffer(slots * _ITEMS * ITEM_DTYPE.itemsize)
        self._closed = False
        self.state.memset_async(0, stream)  # no entries, no items: a slot touches nothing
        self._free: List[int] = list(range(slots - 1, -1, -1))
        # Slots whose record may be live (a set's last copy was queued, no clear's since): a set
        # of one clears its record first (set_checked).
        self._live: set = set()

    # ---- slots ----

    def acquire(self) -> int:
        """A free slot (``clear`` it, or ``set`` it, before a row names it).

        Raises
        ------
        FeedError
            Every slot is taken.
        """
        if not self._free:
            raise FeedError(f"every one of the {self.slots} penalty slots is taken")
        return self._free.pop()

    def release(self, slot: int) -> None:
        """Give ``slot`` back (cleared, in stream order). A refused clear still gives it back:
        no row names a free slot, and ``set`` rewrites every field before one does."""
        try:
            self.clear(slot)
        finally:
            self._free.append(self._slot(slot))

    @property
    def free(self) -> int:
        """Slots not taken."""
        return len(self._free)

    def set(self, slot: int, *, prompt: Iterable[int] = (), generated: Sequence[int] = (),
            repetition_penalty: Any = 1.0, presence_penalty: Any = 0.0,
            frequency_penalty: Any = 0.0, logit_bias: Optional[Mapping[int, float]] = None,
            min_tokens: Any = 0, stop_ids: Iterable[int] = (),
            vocab: int = _core.MAX_VOCAB) -> None:
        """Give ``slot`` a request's penalties, built from its prompt and the tokens it has
        generated so far (a new request: none; a preempted one resuming: its committed tokens),
        by async copies in stream order.

        Parameters
        ----------
        slot : int
        prompt : iterable of int
            The prompt's ids (each distinct id counts once for ``repetition_penalty``).
        generated : sequence of int
            Ids already generated: their counts, and ``min_tokens``'s count.
        repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens
            As ``DecodePipeline.submit`` takes them (``_checks.penalties``'s rules).
        stop_ids : iterable of int
            The ids ``min_tokens`` bans (at most ``MAX_PENALTY_STOPS`` when ``min_tokens > 0``).
        vocab : int, optional
            The vocabulary the ids must be in.

        Raises
        ------
        ValueError, TypeError
            A bad parameter, or more distinct ids than the table holds; nothing is queued.
        FeedError
            A copy refused (nothing queued for it): the slot then holds its old penalties or
            none, never part of each (docs/penalties.md).
        """
        slot = self._slot(slot)
        generated = [_checks.integer(t, "generated id") for t in generated]
        checked = _checks.penalties(
            repetition_penalty, presence_penalty, frequency_penalty, logit_bias, min_tokens, vocab,
            max(_checks.integer(min_tokens, "min_tokens"), 0))
        ids = [_checks.integer(t, "prompt id") for t in prompt]
        for what, tokens in (("prompt", ids), ("generated", generated)):
            for token in tokens:
                if not 0 <= token < vocab:
                    raise ValueError(f"{what} id {token} is outside the vocabulary of {vocab} ids")
        stops = sorted({_checks.integer(t, "stop id") for t in stop_ids}) if checked[4] else []
        if len(stops) > MAX_PENALTY_STOPS:
            raise ValueError(f"min_tokens bans at most {MAX_PENALTY_STOPS} stop ids, got "
                             f"{len(stops)}")
        self.set_checked(slot, ids, generated, checked, stops)

    def set_checked(self, slot: int, prompt: Iterable[int], generated: Sequence[int],
                    penalties: "_checks.Penalties", stop_ids: Iterable[int]) -> None:
        """``set`` of values already checked, as ``DecodePipeline.submit`` checks them once
        (``_checks.penalties``, ids in the vocabulary, at most ``MAX_PENALTY_STOPS`` stop ids, a
        table that fits): nothing is checked again but the table's bound, which keeps the
        copies inside the slot's memory. ``penalties`` is ``_checks.penalties``'s tuple; the
        stop ids are used only when its ``min_tokens`` is above 0."""
        rep, pres, freq, bias, mt = penalties
        order: Dict[int, int] = dict.fromkeys(prompt, _PROMPT)
        for t, n in Counter(generated).items():
            order[t] = order.get(t, 0) | n
        if len(order) > self.capacity:
            raise ValueError(f"{len(order)} distinct ids do not fit a penalty table of {self.capacity}")
        stops = sorted(set(stop_ids)) if mt else []
        record = np.zeros(1, SLOT_DTYPE)
        record[0] = (rep, pres, freq, mt, len(generated), len(order), len(bias), len(stops))
        entries = np.empty(max(1, len(order)), ENTRY_DTYPE)
        entries["id"][: len(order)] = list(order)
        entries["count"][: len(order)] = list(order.values())
        items = np.zeros(max(1, len(bias) + len(stops)), ITEM_DTYPE)
        items["id"][: len(bias)] = [t for t, _ in bias]
        items["value"][: len(bias)] = [b for _, b in bias]
        items["id"][len(bias): len(bias) + len(stops)] = stops
        stream = self.stream
        record_at = self.state.ptr + slot * SLOT_DTYPE.itemsize
        # All or nothing: a slot's table and items are read through its record, so a live record
        # is cleared before they change, and the new record is the last copy. A copy refused
        # (nothing queued for it) then leaves the old request whole (the clear refused) or no
        # penalties, never the old record over new ids and biases.
        if slot in self._live:
            _core.copy_h2d_async(record_at, np.zeros(1, SLOT_DTYPE), stream)
            self._live.discard(slot)
        if order:
            _core.copy_h2d_async(self.table.ptr + slot * self.capacity * ENTRY_DTYPE.itemsize,
                                 entries[: len(order)], stream)
        if bias or stops:
            _core.copy_h2d_async(self.items.ptr + slot * _ITEMS * ITEM_DTYPE.itemsize,
                                 items[: len(bias) + len(stops)], stream)
        _core.copy_h2d_async(record_at, record, stream)
        self._live.add(slot)

    def clear(self, slot: int) -> None:
        """No penalties in ``slot`` from here on in stream order (a row naming it is untouched)."""
        slot = self._slot(slot)
        _core.copy_h2d_async(self.state.ptr + slot * SLOT_DTYPE.itemsize, np.zeros(1, SLOT_DTYPE),
                             self.stream)
        self._live.discard(slot)

    def read(self, slot: int) -> Dict[str, Any]:
        """``slot``'s record and table as the device holds them once the stream is idle
        (synchronises the stream: for tests and debugging, never in a step)."""
        slot = self._slot(slot)
        rec = np.zeros(1, SLOT_DTYPE)
        ent = np.zeros(self.capacity, ENTRY_DTYPE)
        _core.copy_d2h_async(self.state.ptr + slot * SLOT_DTYPE.itemsize, rec, self.stream)
        _core.copy_d2h_async(self.table.ptr + slot * self.capacity * ENTRY_DTYPE.itemsize, ent,
                             self.stream)
        _core.stream_synchronize(self.stream)
        out = {name: rec[name][0].item() for name in SLOT_DTYPE.names}
        n = min(out["entries"], self.capacity)
        out["table"] = {int(i): int(c) for i, c in zip(ent["id"][:n], ent["count"][:n])}
        return out

    def _slot(self, slot: Any) -> int:
        if self._closed:
            raise FeedError("the penalty state is closed")
        slot = _checks.integer(slot, "slot")
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside [0, {self.slots})")
        return slot

    # ---- the two ops of a step ----

    def apply(self, logits: Any, slots: Any, *, vocab: Optional[int] = None, dtype: Any = None,
              row_stride: Optional[int] = None, start: int = 0, stream: Any = None, k: int = 0,
              drafts: Any = None) -> int:
        """Apply the penalties of each row's slot (``NO_TOKEN``: none) to ``logits`` in place,
        in stream order (``penalties_apply``); with ``k`` and ``drafts``, to a verify's
        ``rows * (k + 1)`` logit rows, each position walking its row's drafts before it."""
        return _core.penalties_apply(logits, slots, self.state, self.table, self.items,
                                     self.stream if stream is None else stream,
                                     table_cap=self.capacity, item_cap=_ITEMS, vocab=vocab,
                                     dtype=dtype, row_stride=row_stride, start=start, k=k,
                                     drafts=drafts)

    def prepare(self, slots: Any, *, vocab: Optional[int] = None, dtype: Any = None,
                row_stride: Optional[int] = None, start: int = 0,
                k: int = 0) -> "_core.PenaltyLaunch":
        """``apply`` and ``update`` of ``slots`` (copied), coerced once for the steps of a
        batch that keeps its rows: ``prepare(...).apply(logits, stream)`` queues what
        ``apply(logits, slots, ...)`` does, at a fraction of the host cost (with ``k``, a
        verify's: ``apply(logits, stream, drafts)`` and ``update(cells, stream)``)."""
        return _core.PenaltyLaunch(slots, self.state, self.table, self.items,
                                   table_cap=self.capacity, item_cap=_ITEMS, vocab=vocab,
                                   dtype=dtype, row_stride=row_stride, start=start, k=k)

    def update(self, ids: Any, slots: Any, *, stream: Any = None, k: int = 0) -> int:
        """Count each row's id (device, read when it runs) into its slot (``penalties_update``);
        with ``k``, ``ids`` are a verify's cells and each row's emitted ids are counted."""
        return _core.penalties_update(ids, slots, self.state, self.table, self.items,
                                      self.stream if stream is None else stream,
                                      table_cap=self.capacity, item_cap=_ITEMS, k=k)

    # ---- lifetime ----

    def close(self) -> None:
        """Free the tables (after the work queued on them: frees are deferred by the runtime)."""
        if self._closed:
            return
        self._closed = True
        for buf in (self.state, self.table, self.items):
            buf.close()

    def __enter__(self) -> "PenaltyState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PenaltyState(slots={self.slots}, capacity={self.capacity}, free={self.free})"

