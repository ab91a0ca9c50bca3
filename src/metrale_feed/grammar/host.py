"""``HostGrammar``: a request's structured-output constraint kept on the host, an xgrammar
``GrammarMatcher``, for grammars no finite automaton holds (recursive JSON, EBNF).

A ``TokenAutomaton`` lives on the device and advances there; a matcher cannot, so the pipeline
fills the row's bitmask on the host from the matcher's state after the tokens before it, which
costs one host sync a step at depth 2 (docs/pipeline.md, "Structured outputs"). xgrammar is
imported only when a ``HostGrammar`` is made.
"""

from __future__ import annotations

from typing import Any, List, Optional

from .. import _checks

__all__ = ["HostGrammar"]


class HostGrammar:
    """One request's grammar as an xgrammar matcher, for ``DecodePipeline.submit(grammar=)``.

    Parameters
    ----------
    grammar : xgrammar.GrammarMatcher or xgrammar.CompiledGrammar
        A compiled grammar (a matcher is made from it) or a matcher. The wrapper resets it: the
        request starts from the grammar's start, and from then on the pipeline is the matcher's
        one user (it accepts, rolls back and resets it as tokens are committed or thrown away).
    vocab : int, optional
        The vocabulary of the pipeline it runs on: the logits a row holds. A compiled grammar
        says its own (its tokenizer info's ``vocab_size``; when given too, it must agree); a
        matcher does not, so it is needed then, and checked against the matcher's bitmask width.

    Attributes
    ----------
    vocab : int
    matcher : xgrammar.GrammarMatcher
        The wrapped matcher; read it (``is_terminated()``, ``is_completed()``) once the request
        has finished, never while it runs.

    Raises
    ------
    TypeError
        ``grammar`` is neither (or xgrammar is not installed: ``pip install xgrammar``), or a
        ``vocab`` that is not an int.
    ValueError
        No ``vocab`` with a matcher, a ``vocab`` outside ``[1, MAX_VOCAB]``, or one the grammar
        disagrees with.

    Notes
    -----
    One ``HostGrammar`` per request: submitting one whose request has not finished is refused
    (``ValueError``), since two requests cannot share one matcher's state. Once its request has
    finished it may be submitted again (it starts over).

    Examples
    --------
    >>> import xgrammar as xgr                                           # doctest: +SKIP
    >>> info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=len(pieces),
    ...                          stop_token_ids=[eos])                   # doctest: +SKIP
    >>> compiled = xgr.GrammarCompiler(info).compile_builtin_json_grammar()   # doctest: +SKIP
    >>> req = pipe.submit(prompt, max_new_tokens=64,
    ...                   grammar=mf.HostGrammar(compiled))              # doctest: +SKIP
    """

    __slots__ = ("vocab", "_matcher", "_accepted", "_request", "_rollback")

    def __init__(self, grammar: Any, *, vocab: Optional[int] = None) -> None:
        if vocab is not None:
            vocab = _checks.integer(vocab, "vocab")
        try:
            import xgrammar as xgr
        except ImportError:
            raise TypeError(f"HostGrammar wraps an xgrammar GrammarMatcher or CompiledGrammar "
                            f"(pip install xgrammar), not {type(grammar).__name__}") from None
        if isinstance(grammar, xgr.CompiledGrammar):
            own = int(grammar.tokenizer_info.vocab_size)
            if vocab is not None and vocab != own:
                raise ValueError(f"the compiled grammar is for a vocabulary of {own} ids, not "
                                 f"{vocab}")
            vocab = own
            matcher = xgr.GrammarMatcher(grammar)
        elif isinstance(grammar, xgr.GrammarMatcher):
            if vocab is None:
                raise ValueError("HostGrammar(matcher) needs vocab=: a matcher does not say its "
                                 "vocabulary (or pass the CompiledGrammar)")
            matcher = grammar
        else:
            raise TypeError(f"HostGrammar wraps an xgrammar GrammarMatcher or CompiledGrammar, "
                            f"not {type(grammar).__name__}")
        from .. import _core

        if not 1 <= vocab <= _core.MAX_VOCAB:
            raise ValueError(f"vocab must be in [1, {_core.MAX_VOCAB}], got {vocab}")
        import numpy as np

        try:  # the matcher checks the width of the bitmask it fills: ceil(vocab / 32) words
            matcher.fill_next_token_bitmask(np.zeros((1, _words(vocab)), np.int32))
        except RuntimeError:
            raise ValueError(f"the matcher's vocabulary does not fit vocab={vocab} (its bitmask "
                             f"is not {_words(vocab)} words a row)") from None
        matcher.reset()
        self.vocab = vocab
        self._matcher = matcher
        self._accepted: List[int] = []  # the generated ids the matcher has accepted since reset
        self._request: Any = None  # the request it constrains, while it is live
        limit = int(getattr(matcher, "max_rollback_tokens", -1))
        self._rollback = limit  # how far back a rollback may go (-1: any)

    @property
    def matcher(self) -> Any:
        return self._matcher

    def __repr__(self) -> str:
        return f"HostGrammar(vocab={self.vocab}, accepted={len(self._accepted)})"

    # ---- the pipeline's side (sched/host_grammar.py) ----

    def _claim(self, request: Any) -> None:
        """``request`` is the one it constrains now (submit checked that no live one is): the
        matcher starts over."""
        self._matcher.reset()
        self._accepted.clear()
        self._request = request

    def _sync(self, tokens: List[int], ahead: Optional[int] = None) -> bool:
        """Bring the matcher to exactly ``tokens`` (the request's committed ids) followed by
        ``ahead`` (the id of the step in flight, when given): the ids it accepted past their
        common prefix are rolled back (or it is reset and the prefix accepted again), the rest
        accepted. False when the matcher refuses one (it then stands after the ones before it).

        Every id it accepted but the last is a committed id of the request (the one of a step
        in flight is accepted only while it is the last), and committed ids never change, so
        comparing the last one tells whether what it accepted is a prefix of the target: a step
        costs no pass over the request's ids (``ahead`` is passed apart so that none is copied)."""
        acc = self._accepted
        n, m = len(acc), len(tokens)
        if n > m + (ahead is not None) or (n and acc[-1] != (tokens[n - 1] if n <= m else ahead)):
            # Rare (a thrown-away id replaced, a request joining again): the prefix found by a pass.
            target = tokens if ahead is None else tokens + [ahead]
            keep = 0
            for a, b in zip(acc, target):
                if a != b:
                    break
                keep += 1
            back = n - keep
            if keep and (self._rollback < 0 or back <= self._rollback):
                self._matcher.rollback(back)
                del acc[keep:]
            else:
                self._matcher.reset()
                acc.clear()
        accept, vocab = self._matcher.accept_token, self.vocab
        for token in tokens[len(acc):] if len(acc) < m else ():
            # NO_TOKEN (a row left no candidate) is refused here, before xgrammar warns of it.
            if not 0 <= token < vocab or not accept(token):
                return False
            acc.append(token)
        if ahead is not None and len(acc) == m:
            if not 0 <= ahead < vocab or not accept(ahead):
                return False
            acc.append(ahead)
        return True

    def _fill(self, bitmask: Any, row: int) -> None:
        """Row ``row`` of ``bitmask`` (int32, ``ceil(vocab / 32)`` words a row): the ids the
        matcher allows next; none once it has terminated."""
        if self._matcher.is_terminated():
            bitmask[row] = 0
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def _terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def _words(vocab: int) -> int:
    """int32 words of one bitmask row (docs/encodings.md): one bit an id."""
    return (vocab + 31) // 32
