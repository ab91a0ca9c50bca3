"""``ReferenceModel``: a test model, not an LLM, that runs the whole trait on either backend.

Its forward writes the row's input id into a paged KV cache at position ``seq_len`` and computes
the logits of docs/router.md ("The reference model") from the history read back through the
block table, so any bug in feeding, block tables or KV writes changes the tokens. ``host_next_token`` is the same function
computed on the host, and ``reference_tokens`` decodes one request alone with it (or with the
host sampler): the one reference-token oracle of the tests, the bench and ``metrale-feed demo``.
"""

from __future__ import annotations

from array import array
from operator import index
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .. import _core
from ..errors import FeedError
from ..kv import PagedKvMixin, SequenceState
from ..runtime import RuntimeFeedMixin
from ..trait import ModelDeviceFeed

__all__ = ["ReferenceModel", "host_logits", "host_next_token", "reference_tokens"]

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_STAGING_SLOTS = 4  # two steps in flight and a batch of prefills, with one to spare
_PREFILL_ROWS = _core.MAX_ROWS  # positions per prefill forward: the forward's row limit (no logits)


def _token(value: Any) -> int:
    """A token id: an int in uint32 (a float is refused, not truncated)."""
    token = index(value)
    if not 0 <= token <= 0xFFFFFFFF:
        raise ValueError(f"a token id must be a uint32, got {token}")
    return token


class _Staging:
    """Pinned inputs of one forward and their device copies. The pinned side is rewritten only
    after ``event`` says the previous H2D copies from it have run."""

    def __init__(self, rows: int, table_words: int) -> None:
        self.event = _core.Event()
        self.rows = rows
        self.table_words = table_words
        self.host = [_core.PinnedBuffer(n * 4) for n in (rows, 2 * rows, table_words)]
        self.dev = [_core.DeviceBuffer(n * 4) for n in (rows, 2 * rows, table_words)]
        self.words = [memoryview(buf).cast("I") for buf in self.host]

    def close(self) -> None:
        for view in self.words:
            view.release()
        for buf in self.host + self.dev:
            buf.close()
        self.event.close()


class ReferenceModel(PagedKvMixin, RuntimeFeedMixin, ModelDeviceFeed):
    """A test model, not an LLM, that implements the whole ``ModelDeviceFeed`` trait on either backend.

    It has a paged KV cache (``block_size`` ids a block, ``num_blocks`` blocks, a block table per
    sequence). Its forward writes each row's input id into the cache at ``seq.seq_len``, reads the
    row's whole history back from the cache through the block table and computes every logit from
    a hash of it (docs/router.md, "The reference model"). So ``host_next_token`` predicts every
    token exactly, and a bug in feeding, block tables or KV writes changes the tokens.

    Parameters
    ----------
    vocab : int
        Logits per row, 1 to 2**24.
    block_size : int, optional
        Ids per KV block, at least 1. Default 16.
    num_blocks : int, optional
        Blocks in the pool; ``num_blocks * block_size`` must be below 2**32. Default 4096.
    max_rows : int, optional
        The most rows a step may have, 1 to ``metrale_feed.MAX_ROWS`` (4096). Default 256.
    logits_dtype : {"float32", "float16", "bfloat16"}, optional
        The logits' dtype (16-bit values are rounded to nearest even). Default "float32".
    stream : Stream, int or stream-like, optional
        The stream its work runs on. Default 0.
    graphs : bool, optional
        Run each fed step (``resolve_feed`` from device-resident sources, the forward, the argmax
        with device-resident masks, the readback and its event) as one captured graph, replayed
        each step with the same tokens as the default path (docs/graphs.md, "The reference
        model's graphs"). Default False.
    max_graphs : int, optional
        With ``graphs``, how many graphs ``fed_step_settled`` keeps (least recently used evicted
        first, once their last launch has completed). Default 16.
    shard : VocabShard, optional
        A vocabulary split across ranks (docs/tensor-parallel.md): as a column-parallel LM head,
        the forward computes only the slice's ``shard.width`` columns of each row
        (``logits`` holds ``max_rows`` rows of that width), and the feed goes through the
        sharded call, so every rank gets the same tokens as the unsharded model. A rank whose
        slice is empty writes the KV cache only.

    Raises
    ------
    ValueError
        An argument out of range.
    FeedError
        Device or pinned memory could not be allocated.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> from metrale_feed.testing.reference import ReferenceModel, host_next_token
    >>> model = ReferenceModel(500, max_rows=1)
    >>> seq = mf.SequenceState(0)
    >>> model.prefill(seq, [3, 1, 4])          # the prompt [3, 1, 4, 1] less its last id
    >>> with mf.SyncDeviceIo(model, 1) as io:
    ...     ids = io.await_result(io.launch_decode([1], [seq], None))
    >>> ids == [host_next_token([3, 1, 4, 1], 500)]
    True
    >>> model.close()
    """
    def __init__(self, vocab: int, *, block_size: int = 16, num_blocks: int = 4096,
                 max_rows: int = 256, logits_dtype: str = "float32", stream: Any = 0,
                 graphs: bool = False, max_graphs: int = 16, shard: Any = None) -> None:
        if graphs and max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        if graphs and shard is not None:  # a sharded call runs a host function: not capturable yet
            raise ValueError("graphs=True and shard= cannot be combined yet")
        if num_blocks * block_size > 0xFFFFFFFF:  # KV slots are addressed with uint32
            raise ValueError(f"num_blocks x block_size must be below 2**32, got {num_blocks * block_size}")
        self.init_paged_kv(block_size=block_size, num_blocks=num_blocks)  # before any allocation
        self.init_device_feed(vocab=vocab, logits_dtype=logits_dtype, max_rows=max_rows, shard=shard)
        # The logits' columns: the ids [start, start + width), the whole row without a shard.
        self._start, self._width = (0, vocab) if shard is None else (shard.start, shard.width)
        self.stream = stream
        self.settled_steps = 0
        self.host_syncs = 0  # times the host waited for the device (a full staging ring)
        self.kv = _core.DeviceBuffer(num_blocks * block_size * 4)
        self.logits = _core.DeviceBuffer(max(1, max_rows * self._width * _ITEMSIZE[self.feed_logits_dtype]))
        self._staging: List[Optional[_Staging]] = [None] * _STAGING_SLOTS
        self._next_staging = 0
        self._closed = False
        self._fed_graphs = None
        self._verify_logits: Optional[Any] = None  # decode_batch_verify's rows * (k + 1) rows
        if graphs:
            from .fed_graphs import FedGraphs

            self._fed_graphs = FedGraphs(self, max_graphs)

    # ---- KV bookkeeping: PagedKvMixin's (the scheduler reserves; the forward checks) ----

    def fed_step_settled(self) -> None:
        """A fed step has completed: with ``graphs=True``, graphs beyond ``max_graphs`` whose last
        launch has completed are evicted here."""
        self.settled_steps += 1
        if self._fed_graphs is not None:
            self._fed_graphs.evict()

    @property
    def graph_stats(self) -> Dict[str, int]:
        """With ``graphs=True``: ``captures``, ``launches`` and ``live`` graphs; else empty."""
        fg = self._fed_graphs
        if fg is None:
            return {}
        return {"captures": fg.captures, "launches": fg.launches, "live": len(fg.graphs)}

    def _flush_graph_step(self) -> None:
        if self._fed_graphs is not None:
            self._fed_graphs.flush()

    def flush_forward(self, stream: Any) -> None:
        """With ``graphs=True``, queue the forward ``decode_batch_fed`` held back (the step then
        runs as the eager path does): the router calls this before it changes or copies the
        step's logits (``metrale_feed.contract.DefersForward``). Else nothing to do."""
        self._flush_graph_step()

    # ---- the forward ----

    def _stage(self, seqs: Sequence[SequenceState], positions: Sequence[int]) -> _Staging:
        rows = len(seqs)
        table_words = max(1, sum(len(seq.block_table) for seq in {id(s): s for s in seqs}.values()))
        at = self._next_staging
        self._next_staging = (at + 1) % _STAGING_SLOTS
        slot = self._staging[at]
        if slot is not None:
            if not slot.event.query():  # only when more than _STAGING_SLOTS forwards are queued
                self.host_syncs += 1
                slot.event.synchronize()
            if slot.rows < rows or slot.table_words < table_words:
                slot.close()
                slot = None
        if slot is None:
            self._staging[at] = None  # a failed allocation leaves no closed slot behind
            slot = _Staging(max(rows, 64), max(table_words, 1024))
            self._staging[at] = slot
        meta = slot.words[1]
        tables: List[int] = []
        offsets: Dict[int, int] = {}  # a sequence staged for several rows (prefill) has one table
        for r, seq in enumerate(seqs):
            offset = offsets.get(id(seq))
            if offset is None:
                offset = offsets[id(seq)] = len(tables)
                tables.extend(seq.block_table)
            meta[2 * r] = positions[r]
            meta[2 * r + 1] = offset
        slot.words[2][: len(tables)] = array("I", tables)
        return slot

    def _forward(self, slot: _Staging, rows: int, stream: Any, logits: bool = True) -> int:
        """Copy the staged meta and tables, mark the slot reusable after them, run the forward
        (``logits=False``: the KV writes alone, a prefill)."""
        _core.copy_h2d_async(slot.dev[1], slot.host[1], stream)
        _core.copy_h2d_async(slot.dev[2], slot.host[2], stream)
        slot.event.record(stream)
        logits = logits and self._width > 0  # an empty slice has no column to compute
        _core.reference_forward(slot.dev[0], slot.dev[1], slot.dev[2], self.kv,
                                self.pool.num_blocks * self.block_size, self.block_size, rows,
                                max(self._width, 1), self.feed_logits_dtype,
                                self.logits if logits else None, stream,
                                start=self._start if logits else 0)
        return self.logits.ptr

    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                     stream: Any = None) -> int:
        """The synchronous-input decode step: writes ``tokens`` at each row's ``seq_len``, pushes
        them and advances ``seq_len``; returns the logits' device pointer."""
        stream = self.stream if stream is None else stream
        self._check_rows(len(tokens), seqs)
        self._flush_graph_step()
        ids = array("I", [_token(t) for t in tokens])  # checked before any block is taken
        self.cover_decode_blocks(seqs)  # called without a router: the blocks it lacks
        positions = [seq.seq_len for seq in seqs]
        slot = self._stage(seqs, positions)
        slot.words[0][: len(ids)] = ids
        _core.copy_h2d_async(slot.dev[0], slot.host[0], stream)
        logits = self._forward(slot, len(seqs), stream)
        for token, seq in zip(ids, seqs):
            seq.tokens.append(token)
            seq.seq_len += 1
        return logits

    def decode_batch_fed(self, sources: Sequence[int], seqs: Sequence[SequenceState],
                         stream: Any = None) -> int:
        stream = self.stream if stream is None else stream
        self._check_rows(len(sources), seqs)
        if self._fed_graphs is not None:
            # Kept until argmax_batch_to_feed names the readback slot: the step is one graph.
            self._fed_graphs.flush()
            self._fed_graphs.keep(sources, seqs, stream)
            return self.logits.ptr
        return self._decode_fed_eager(sources, seqs, stream)

    def _decode_fed_eager(self, sources: Sequence[int], seqs: Sequence[SequenceState],
                          stream: Any) -> int:
        self.check_decode_blocks(seqs)  # reserved by the scheduler: a refused step takes none
        slot = self._stage(seqs, [seq.seq_len for seq in seqs])
        cells = self.feed_cells
        if cells is None:
            raise FeedError("the reference model is closed")
        # The sources are read at launch; the ids land on the device in stream order.
        _core.resolve_feed(sources, cells, slot.dev[0], stream, prev_rows=self.feed_prev_rows)
        return self._forward(slot, len(seqs), stream)

    def decode_batch_verify(self, input_ids: Any, seqs: Sequence[SequenceState], k: int,
                            stream: Any = None, advance: Any = None) -> int:
        """A speculative step's forward over ``k + 1`` positions a row (docs/speculative.md).

        Row ``r`` reads its ids from the device array ``input_ids`` at ``r * (k + 1) + j`` (its
        input at ``j = 0``, then its ``k`` drafts) and writes them into the KV cache at positions
        ``seq.seq_len + j``; logit row ``r * (k + 1) + j`` is the logits after position
        ``seq.seq_len + j``. The caller reserves the blocks of all ``k + 1`` positions first and
        advances ``seq_len`` by the accepted count once it is read: ``seq_len`` and ``tokens``
        are left as they are.

        Parameters
        ----------
        input_ids : DeviceBuffer, int, or device array
            ``len(seqs) * (k + 1)`` uint32 ids, read when the forward runs.
        seqs : sequence of SequenceState
        k : int
            Drafts a row, at least 1; ``len(seqs) * (k + 1)`` at most ``MAX_ROWS``.
        stream : Stream, int or stream-like, optional
            Default: the model's stream.
        advance : DeviceBuffer, int, or device array, optional
            ``len(seqs)`` uint32, each at most ``k + 1`` (the last verify's ``n``, from
            ``resolve_verified``), read when the forward runs: row ``r``'s positions start at
            ``seq.seq_len + advance[r]``, so a step is launched before the host knows how far
            the last one advanced. The block tables must then cover ``seq.seq_len + 2k + 1``.

        Returns
        -------
        int
            The device pointer of the ``len(seqs) * (k + 1)`` logit rows.

        Raises
        ------
        ValueError
            A bad ``k``, too many positions, or a block table that does not cover them.
        FeedError
            The model is closed.
        """
        stream = self.stream if stream is None else stream
        k = index(k)
        if self._closed:
            raise FeedError("the reference model is closed")
        rows = len(seqs)
        if k < 1 or not 1 <= rows * (k + 1) <= _core.MAX_ROWS:
            raise ValueError(f"a verify step takes 1 to {_core.MAX_ROWS} positions and k >= 1, "
                             f"got {rows} rows and k={k}")
        self.check_verify_blocks(seqs, k, advance is not None)
        self._flush_graph_step()
        need = max(1, rows * (k + 1) * self._width * _ITEMSIZE[self.feed_logits_dtype])
        if self._verify_logits is None or self._verify_logits.nbytes < need:
            if self._verify_logits is not None:
                self._verify_logits.close()  # freed once the queued work has passed it
                self._verify_logits = None
            self._verify_logits = _core.DeviceBuffer(need)
        row_seqs = [seq for seq in seqs for _ in range(k + 1)]
        positions = [seq.seq_len + j for seq in seqs for j in range(k + 1)]
        slot = self._stage(row_seqs, positions)
        n = rows * (k + 1)
        _core.copy_h2d_async(slot.dev[1], slot.host[1], stream)
        _core.copy_h2d_async(slot.dev[2], slot.host[2], stream)
        slot.event.record(stream)
        # Two forwards: a row reads the KV its sequence's other rows write in the same launch
        # (on a GPU, other blocks), so the first writes every position (no logits) and the
        # second, in stream order behind it, writes the same ids again and reads whole histories.
        kv_slots = self.pool.num_blocks * self.block_size
        logits = self._verify_logits if self._width > 0 else None
        for out in (None, logits):
            _core.reference_forward(input_ids, slot.dev[1], slot.dev[2], self.kv, kv_slots,
                                    self.block_size, n, max(self._width, 1),
                                    self.feed_logits_dtype, out, stream,
                                    start=self._start if out is not None else 0,
                                    advance=advance, advance_group=k + 1)
        return self._verify_logits.ptr

    def prefill(self, seq: SequenceState, ids: Sequence[int], stream: Any = None) -> None:
        """Write ``ids`` into the KV cache at positions ``seq.seq_len..``; no logits are computed.

        Blocks are allocated as needed; ``ids`` are appended to ``seq.tokens`` and ``seq.seq_len``
        advances. A prompt ``P`` is prefilled as ``P[:-1]``: the first decode step takes ``P[-1]``.

        Parameters
        ----------
        seq : SequenceState
        ids : sequence of int
            Token ids (uint32).
        stream : Stream, int or stream-like, optional
            Default: the model's stream.

        Raises
        ------
        KvPoolExhausted
            The pool ran out of blocks (nothing is allocated: all or none).
        ValueError
            An id outside uint32, or a sequence longer than the cache.
        """
        self.prefill_many([seq], [ids], stream)

    def prefill_many(self, seqs: Sequence[SequenceState], id_lists: Sequence[Sequence[int]],
                     stream: Any = None) -> None:
        """``prefill`` of several sequences in as few forwards as the row limit allows (one per
        ``MAX_ROWS`` positions), so admitting a batch of requests queues one forward, not one each.
        Blocks are allocated for all of them or none."""
        stream = self.stream if stream is None else stream
        if self._closed:
            raise FeedError("the reference model is closed")
        self._flush_graph_step()
        if len(seqs) != len(id_lists):
            raise ValueError(f"{len(id_lists)} id lists for {len(seqs)} sequences")
        lists = [[_token(i) for i in ids] for ids in id_lists]  # checked before any block
        self.take_prefill_blocks(seqs, lists)
        # One row per position, each reading its sequence's table: the forward writes each id
        # at its position; logits=None skips the logits.
        row_seqs: List[SequenceState] = []
        positions: List[int] = []
        words: List[int] = []
        for seq, ids in zip(seqs, lists):
            row_seqs.extend([seq] * len(ids))
            positions.extend(range(seq.seq_len, seq.seq_len + len(ids)))
            words.extend(ids)
        for start in range(0, len(words), _PREFILL_ROWS):
            end = min(start + _PREFILL_ROWS, len(words))
            slot = self._stage(row_seqs[start:end], positions[start:end])
            slot.words[0][: end - start] = array("I", words[start:end])
            _core.copy_h2d_async(slot.dev[0], slot.host[0], stream)
            self._forward(slot, end - start, stream, logits=False)
        for seq, ids in zip(seqs, lists):
            seq.tokens.extend(ids)
            seq.seq_len += len(ids)

    def feed_info(self) -> Any:
        # pick_to_feed (the mixin's feed methods come to it) hands every field on to the mixin's,
        # penalties=, grammar= and bitmask= included.
        return super().feed_info()._replace(penalties=True, grammar=True, bitmask=True)

    def pick_to_feed(self, step: Any) -> None:
        if step.params is not None or any(
                getattr(step, k) is not None
                for k in ("logprobs", "top_logprobs", "penalties", "grammar", "bitmask")):
            # The graphs capture no sampling, logprobs, penalties, grammar nor bitmask: the
            # default path.
            self._flush_graph_step()
        elif self._fed_graphs is not None and self._fed_graphs.launch(step.masks, step.dst,
                                                                      step.event, step.stream):
            return
        super().pick_to_feed(step)

    def _check_rows(self, n: int, seqs: Sequence[SequenceState]) -> None:
        if self._closed:
            raise FeedError("the reference model is closed")
        if n != len(seqs):
            raise ValueError(f"{n} inputs for {len(seqs)} sequences")
        if not 1 <= n <= self.feed_max_rows:
            raise ValueError(f"a step takes 1 to {self.feed_max_rows} rows, got {n}")

    def close(self) -> None:
        """Free the model's device and pinned memory (after queued work)."""
        if self._closed:
            return
        self._closed = True
        if self._fed_graphs is not None:
            self._fed_graphs.close()
        for slot in self._staging:
            if slot is not None:
                slot.close()
        self._staging = [None] * _STAGING_SLOTS
        self.kv.close()
        self.logits.close()
        if self._verify_logits is not None:
            self._verify_logits.close()
            self._verify_logits = None
        self.close_device_feed()

    def __enter__(self) -> "ReferenceModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the same function on the host (numpy), the oracle ----

def host_logits(history: Sequence[int], vocab: int, dtype: str = "float32") -> Any:
    """The logits row the reference forward computes after ``history`` (the input id included).

    Parameters
    ----------
    history : sequence of int
        Every id in the row's KV cache, in order, the step's input id last.
    vocab : int
    dtype : {"float32", "float16", "bfloat16"}, optional

    Returns
    -------
    numpy.ndarray
        ``vocab`` values of ``dtype`` (bfloat16 as ``ml_dtypes.bfloat16``, which must be installed).

    Examples
    --------
    >>> from metrale_feed.testing.reference import host_logits
    >>> row = host_logits([1, 2, 3], 8)
    >>> row.shape, bool((row >= 0).all() and (row < 1).all())
    ((8,), True)
    """
    import numpy as np

    h = 0x811C9DC5
    for t in history:
        h = ((h ^ int(t)) * 0x01000193) & 0xFFFFFFFF
    with np.errstate(over="ignore"):
        x = (np.uint32(h) + np.arange(vocab, dtype=np.uint32) * np.uint32(0x9E3779B9)).astype(np.uint32)
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x *= np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
    logits = (x >> np.uint32(8)).astype(np.float32) / np.float32(1 << 24)
    if dtype == "float32":
        return logits
    if dtype == "float16":
        return logits.astype(np.float16)  # numpy rounds to nearest even
    if dtype == "bfloat16":
        import ml_dtypes

        return logits.astype(ml_dtypes.bfloat16)
    raise ValueError(f"unknown logits dtype {dtype!r}")


def _widened_logits(history: Sequence[int], vocab: int, dtype: str) -> Any:
    """host_logits rounded to ``dtype`` and widened back to float32 (exact), with numpy alone."""
    import numpy as np

    logits = host_logits(history, vocab, "float32")
    if dtype == "float32":
        return logits
    if dtype == "float16":
        return logits.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits, as mf_f32_to_bf16
        bits = logits.view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                   >> np.uint32(16)) << np.uint32(16)
        return rounded.astype(np.uint32).view(np.float32)
    raise ValueError(f"unknown logits dtype {dtype!r}")


def host_next_token(history: Sequence[int], vocab: int, dtype: str = "float32",
                    mask: Sequence[int] = (0xFFFFFFFF, 0xFFFFFFFF)) -> int:
    """The reference model's greedy next token after ``history``, computed on the host.

    Parameters
    ----------
    history : sequence of int
        Every id in the row's KV cache, the step's input id last (for a first step: the prompt).
    vocab : int
    dtype : {"float32", "float16", "bfloat16"}, optional
        The model's ``logits_dtype``. Default "float32".
    mask : (int, int), optional
        Two ids that may not win; ``NO_TOKEN`` where unused.

    Returns
    -------
    int
        The id, or ``NO_TOKEN`` when every id is masked.

    Examples
    --------
    >>> from metrale_feed.testing.reference import host_next_token
    >>> token = host_next_token([3, 1, 4, 1], 500)
    >>> host_next_token([3, 1, 4, 1], 500, mask=(token, 0xFFFFFFFF)) != token
    True
    """
    import numpy as np

    logits = _widened_logits(history, vocab, dtype).copy()
    for banned in mask:
        if banned != 0xFFFFFFFF:
            logits[banned] = -1.0  # every logit is in [0, 1)
    if vocab <= 2 and all(v in mask for v in range(vocab)):
        return 0xFFFFFFFF  # no candidate left
    return int(np.argmax(logits))  # first maximum: ties to the lowest id


def _sampled_next_token(history: List[int], mask: Sequence[int], sampling: Dict[str, Any],
                        vocab: int, dtype: str, buffers: Any) -> int:
    """One draw of the active backend's sampler over one row: the reference logits after
    ``history`` (widened to float32, which draws as the narrow dtype does), at position
    ``len(history)``."""
    import numpy as np

    from ..sampling import sampling_params

    logits, cells, done = buffers
    row = _widened_logits(history, vocab, dtype)
    _core.copy_h2d_async(logits, row.view(np.uint8))
    params = sampling_params(1, position=len(history), **sampling)
    dst = np.zeros(1, np.uint32)
    _core.sample_to_feed(logits, params, cells, dst, done, masks=[tuple(mask)], vocab=vocab,
                         dtype="float32")
    done.synchronize()
    return int(dst[0])


def reference_tokens(prompt: Sequence[int], max_new: int, vocab: int, dtype: str = "float32", *,
                     mask: Optional[Sequence[int]] = None, stops: Iterable[int] = (),
                     sampling: Optional[Dict[str, Any]] = None) -> List[int]:
    """The tokens of one request decoded alone on the reference model, computed on the host.

    The one reference-token oracle: ``metrale-feed demo``, the bench and the tests check a
    scheduler's tokens against it. Greedy: ``host_next_token`` step by step. Sampled (a
    ``sampling`` with ``temperature`` above 0): at each step the active backend's
    ``sample_to_feed`` over that one row, keyed on the position ``len(history)`` (run it on the
    host or simt backend, which give the same bits). A stop id is committed as the last token.

    Parameters
    ----------
    prompt : sequence of int
    max_new : int
        The most tokens to generate.
    vocab : int
    dtype : {"float32", "float16", "bfloat16"}, optional
        The model's ``logits_dtype``. Default "float32".
    mask : (int, int), optional
        Two ids the row may not answer (``NO_TOKEN`` where unused); default none.
    stops : iterable of int, optional
        Ids that end the request.
    sampling : dict, optional
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed`` (``sampling_params``'
        keywords); None, or a temperature of 0, is greedy decoding.

    Returns
    -------
    list of int

    Examples
    --------
    >>> from metrale_feed.testing.reference import host_next_token, reference_tokens
    >>> tokens = reference_tokens([3, 1, 4], 3, 500)
    >>> tokens[1] == host_next_token([3, 1, 4, tokens[0]], 500)
    True
    >>> reference_tokens([3, 1, 4], 3, 500, stops=[tokens[0]]) == tokens[:1]
    True
    """
    mask = (0xFFFFFFFF, 0xFFFFFFFF) if mask is None else (int(mask[0]), int(mask[1]))
    stops = frozenset(stops)
    history, out = [int(t) for t in prompt], []  # type: List[int], List[int]
    greedy = not sampling or sampling.get("temperature", 0.0) <= 0.0
    buffers: Any = None
    if not greedy:
        buffers = (_core.DeviceBuffer(vocab * 4), _core.DeviceBuffer(4), _core.Event())
    try:
        while len(out) < max_new:
            if greedy:
                token = host_next_token(history, vocab, dtype, mask)
            else:
                token = _sampled_next_token(history, mask, sampling or {}, vocab, dtype, buffers)
            out.append(token)
            history.append(token)
            if token in stops:
                break
    finally:
        for buf in buffers or ():
            buf.close()
    return out
