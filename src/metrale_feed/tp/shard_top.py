"""``VocabShard.top_logprobs``: every rank's top ``n`` logprobs of the whole raw distribution from
one exchange of ``16 + 8 n`` bytes a row, merged by a kernel. A mixin of ``VocabShard``."""

from __future__ import annotations

from typing import Any

from .. import _core
from . import ops
from .call_args import _device_at


class TopLogprobs:
    """``VocabShard``'s top-logprobs half."""

    def top_logprobs(self, logits: Any, out: Any, stream: Any = 0, *, n: int, rows: Any = None,
                     dtype: Any = None, row_stride: Any = None, event: Any = None,
                     ids: Any = None, chosen: Any = None) -> int:
        """Each row's ``n`` most likely ids of the whole raw distribution and their logprobs, from
        this rank's slice, in stream order: ``_core.top_logprobs`` on the whole rows, split.

        Every rank gets the same records in the same order: the argmax's order over global ids
        (the greater logit first, ties by the smaller id, a NaN below ``-inf``), each logprob
        ``log_softmax`` of the whole row at that id with the row's ``(M, S)`` combined as the
        sharded chosen-token logprob's (docs/tensor-parallel.md, "Top logprobs"), so the chosen
        id's entry equals ``argmax_to_feed(..., logprobs=, shard=)``'s bit for bit. With ``ids``
        (global ids, a step's feed cells), ``chosen[r]`` is also the logprob of ``ids[r]``: the
        raw logprob of a token chosen from logits changed since (penalties). Each rank sends one
        block of ``ops.top_block_bytes(max_rows, n)`` bytes (16 a row for its ``(m, s)`` and
        the asked-for id, 8 for each of its own top ``n``) in one all-gather; the merge is a
        kernel on the stream (``mf_top_logprobs_combine``): no host synchronisation, on every
        backend, and capturable in a graph. Every rank makes the same calls with the same ``n``
        and ``ids``-or-not, in the same order as its other sharded calls. A world of one is the
        unsharded call.

        Parameters
        ----------
        logits : DeviceBuffer, int, or a 2-D float tensor, or None
            This rank's ``stop - start`` columns of each row, ``row_stride`` elements apart; None
            (with ``dtype``) or a ``(rows, 0)`` tensor for an empty slice.
        out : DeviceBuffer, int, or None
            ``rows * n`` records of a uint32 global id and a float32 logprob, row ``r``'s ``j``-th
            at record ``r * n + j`` (``_core.top_logprobs``'s layout); ``(NO_TOKEN, NaN)`` ends a
            row of fewer than ``n`` ids. None only with ``n`` 0.
        stream : Stream, int or stream-like, optional
            The stream of this shard's other calls.
        n : int
            1 to 20; 0 with ``ids``: the chosen logprobs alone.
        rows : int, optional
            1 to ``max_rows``; default the tensor's rows.
        dtype : {"float32", "float16", "bfloat16"}, optional
            Required unless ``logits`` is a tensor.
        row_stride : int, optional
            Elements between rows (default the slice's width).
        event : Event, optional
            Recorded after ``out`` and ``chosen`` are written.
        ids : DeviceBuffer or int, optional
            ``rows`` global uint32 ids, read when the kernel runs; with ``chosen``.
        chosen : DeviceBuffer or int, optional
            ``rows`` float32 logprobs of ``ids`` (NaN for ``NO_TOKEN`` or an id past the
            vocabulary); with ``ids``.

        Returns
        -------
        int
            The rows.

        Raises
        ------
        ValueError, TypeError
            Bad ``n``, ``rows``, sizes or dtype; nothing is queued.
        FeedError
            After a fault, or a closed shard; before anything is queued. Ranks whose calls
            disagree (rows, ``n``, ``ids``-or-not, the call order) get ``(NO_TOKEN, NaN)`` records
            and a ``FeedError`` from the event on every rank.

        Examples
        --------
        >>> shard = mf.VocabShard(None, 1000, max_rows=16)                # doctest: +SKIP
        >>> shard.top_logprobs(part, out, n=5, rows=4, dtype="float32")   # doctest: +SKIP
        4
        """
        with self._lock:
            self._refuse_after_fault()
            if isinstance(n, bool) or not isinstance(n, int) or not (0 if ids is not None else 1) <= n <= 20:
                raise ValueError(f"n must be an int in [1, 20] (0 with ids), not {n!r}")
            if (ids is None) != (chosen is None):
                raise ValueError("ids and chosen go together")
            width = self.width
            shape = getattr(logits, "shape", None)
            if shape is not None and rows is None:
                rows = int(shape[0])
            count = self._rows_of(None, None, None, rows)
            if shape is not None and int(shape[0]) < count:
                raise ValueError(f"logits has {int(shape[0])} rows; rows={count}")
            # A tensor tells its own sizes (checked against these); raw memory (or None for an
            # empty slice) takes them from the arguments.
            sizes = dict(vocab=width, dtype=dtype, row_stride=row_stride)
            if shape is None:
                if dtype is None:
                    raise TypeError("dtype is required unless logits is a tensor")
                sizes["rows"] = count
            # The combine's outputs are checked before the slice's call is queued: a refusal
            # there would leave this rank's collective behind its peers'.
            if n and out is None:
                raise TypeError("out is required unless n is 0")
            spans = []
            for buf, what, need in ((out if n else None, "out", count * n * 8), (chosen, "chosen", count * 4)):
                if buf is None:
                    continue
                at, have = _device_at(buf, what)
                if have is not None and have < need:
                    raise ValueError(f"{what}: {count} rows need {need} bytes; it has {have}")
                if at % 4:
                    raise ValueError(f"{what} is not 4-byte aligned")
                spans.append((at, at + need, what))
            if len(spans) == 2 and spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]:
                raise ValueError("out and chosen overlap")
            src: Any = logits if shape is None or int(shape[0]) == count else logits[:count]
            if self.world == 1 and not self._force_exchange:  # the unsharded call, as the others
                _core.top_logprobs(src, out, stream, n=n, ids=ids, chosen=chosen, **sizes)
                if event is not None:
                    _core.event_record(event, stream)
                return count
            handle, capturing = self._stream_check(stream)
            call = self._calls + 1
            nbytes = ops.top_block_bytes(self.max_rows, n)

            def partial(block: Any) -> None:
                ops.top_partial(src, block, stream, n=n, start=self.start, vocab_total=self.vocab,
                                   call=call, ids=ids, **sizes)

            def combine(gathered: Any, fault: Any) -> None:
                ops.top_combine(gathered, self.world, out if n else None, stream, rows=count, n=n,
                                   vocab=self.vocab, call=call, slice_stride=nbytes // _core.PARTIAL_RECORD_BYTES,
                                   fault_dst=fault, chosen=chosen)

            self._exchanged(call, call, partial, combine, stream, handle, capturing, event,
                            nbytes=nbytes, outcome="every record got (NO_TOKEN, NaN)")
            return count
