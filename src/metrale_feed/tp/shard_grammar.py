"""A pick with ``grammar=`` over a split vocabulary: every rank masks the whole vocabulary from the
same state words, runs the split pick with that bitmask and advances every row by the same
global ids. A mixin of ``VocabShard``."""

from __future__ import annotations

from .. import _core
from ..step import PickStep
from . import ops
from .call_args import _host_drafts, _stream_key


class GrammarPicks:
    """``VocabShard``'s grammar half (``run_step`` hands it a ``PickStep`` with ``grammar``)."""

    def _with_grammar(self, step: PickStep) -> int:
        """A pick with ``grammar=(automaton, states[, scratch])`` over the split vocabulary:
        every rank holds the automaton and the same state words, so each builds the whole
        vocabulary's bitmask of its rows (the bitmask the partial calls take, ANDed with the
        caller's), runs the pick with it, and advances every row by the same global ids, which
        the combine wrote on every rank."""
        grammar = step.grammar
        if not isinstance(grammar, tuple) or len(grammar) not in (2, 3):
            raise TypeError("grammar must be a tuple (automaton, states) or (automaton, states, "
                            f"scratch), not {type(grammar).__name__}")
        from ..grammar.automaton import TokenAutomaton

        automaton, states = grammar[0], grammar[1]
        if not isinstance(automaton, TokenAutomaton):
            raise TypeError(f"grammar's automaton must be a metrale_feed.TokenAutomaton, not "
                            f"{type(automaton).__name__}")
        if automaton.vocab != self.vocab:
            raise ValueError(f"the automaton is for a vocabulary of {automaton.vocab} ids; the "
                             f"shard's is {self.vocab}")
        if not automaton.on_device:
            raise ValueError("the automaton is not on the device: call automaton.to_device(stream) "
                             "first")
        table, edges = automaton.device_arrays
        stream, drafts, k = step.stream, None, 0
        if step.op == "verify":
            k = step.k
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= _core.MAX_DRAFTS:
                raise ValueError(f"k must be in [1, {_core.MAX_DRAFTS}], not {k!r}")
            drafts = step.drafts
            host = _host_drafts(drafts)
            rows = step.rows
            if rows is None:
                if host is not None:
                    rows = len(host) // k
                elif hasattr(step.logits, "shape"):
                    rows = int(step.logits.shape[0]) // (k + 1)
                else:
                    raise ValueError("a sharded verify on raw memory with device drafts needs rows=")
            if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows * (k + 1) <= self.max_rows:
                raise ValueError(f"rows * (k + 1) must be in [1, max_rows={self.max_rows}], not "
                                 f"{rows!r} * {k + 1}")
            if host is not None:
                if len(host) != rows * k:
                    raise ValueError(f"drafts hold {len(host)} ids, not rows * k = {rows * k}")
                if _core.stream_capturing(stream):
                    raise ValueError("grammar= with host drafts in a capture: pass device drafts")
        else:
            rows = self._rows_of(step.logits, step.masks, step.params, step.rows)
        words = (self.vocab + 31) // 32
        mask_bytes = rows * (k + 1) * words * 4
        scratch = grammar[2] if len(grammar) == 3 else None
        if scratch is None:
            scratch = (_core.DeviceBuffer(mask_bytes) if _core.stream_capturing(stream)
                       else automaton._scratch(_stream_key(stream), mask_bytes))
        elif type(scratch) is not _core.DeviceBuffer or scratch.nbytes < mask_bytes:
            raise ValueError(f"grammar's scratch must be a DeviceBuffer of at least {mask_bytes} bytes")
        upload = None
        if step.op == "verify" and host is not None:
            upload = _core.DeviceBuffer(rows * k * 4)
        try:
            if upload is not None:
                _core.copy_h2d_async(upload, host, stream)
                drafts = upload
            ops.grammar_mask(table, edges, states, scratch, stream, num_states=automaton.num_states,
                             num_edges=len(automaton.edges), vocab=self.vocab, rows=rows, k=k,
                             drafts=drafts if k else None, bitmask_in=step.bitmask)
            n = self.run_step(step.replace(grammar=None, bitmask=scratch,
                                           drafts=step.drafts if upload is None else upload))
            ops.grammar_advance(table, edges, step.cells, states, stream,
                                num_states=automaton.num_states, num_edges=len(automaton.edges),
                                vocab=self.vocab, rows=rows, k=k)
        finally:
            if upload is not None:
                upload.close()  # freed once the stream has passed the work that reads it
        return n
