"""``ReferenceDrafter``: a drafter for ``ReferenceModel`` whose acceptance rate is a setting, so
tests of speculative decoding control acceptance from 0 to 1 (docs/speculative.md)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

from .. import _checks
from ..dtypes import logits_dtype
from ..feed import NO_TOKEN
from ..sched.speculative import HostDrafter
from .reference import host_next_token

__all__ = ["ReferenceDrafter"]

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int, salt: int) -> int:
    """splitmix64's finaliser of (seed, position, salt): the drafter's counter-based key."""
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + salt) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class ReferenceDrafter(HostDrafter):
    """For ``ReferenceModel``: each draft is the reference rule's greedy id after the row's
    history and its earlier drafts with probability ``acceptance``, else another id; the choice
    is keyed by the request's seed and the draft's position alone. So a greedy row accepts
    ``m < k`` drafts with probability ``a**m * (1 - a)`` and all ``k`` with ``a**k``; at 1 every
    draft is accepted, at 0 none.

    Parameters
    ----------
    vocab : int
        The model's vocabulary, at least 2 (another id must exist).
    k : int
        Drafts a row, 1 to ``MAX_DRAFTS``.
    acceptance : float
        In [0, 1].
    dtype : str, optional
        The model's ``logits_dtype`` (the rule's id depends on it). Default "float32".

    Raises
    ------
    ValueError
        An argument out of range, or not finite; a ``dtype`` that is no logits dtype.
    TypeError
        A ``vocab`` or ``k`` that is not an int, an ``acceptance`` that is not a real number.

    Examples
    --------
    >>> from metrale_feed.testing.drafter import ReferenceDrafter
    >>> from metrale_feed.testing.reference import host_next_token
    >>> drafter = ReferenceDrafter(500, 2, acceptance=1.0)
    >>> first = host_next_token([3, 1, 4], 500)
    >>> drafter.draft([3, 1, 4], 2, 0) == [first, host_next_token([3, 1, 4, first], 500)]
    True
    """

    def __init__(self, vocab: int, k: int, acceptance: float, dtype: str = "float32") -> None:
        vocab = _checks.integer(vocab, "vocab")
        if vocab < 2:
            raise ValueError(f"the reference drafter needs a vocabulary of 2 ids or more, got {vocab}")
        acceptance = _checks.real(acceptance, "acceptance")  # a bool or a str is no rate
        logits_dtype(dtype)  # refused here, not at the first step's rule
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        super().__init__(k)
        self.vocab, self.acceptance, self.dtype = vocab, acceptance, dtype
        self._threshold = int(acceptance * (1 << 53))  # 53-bit uniforms: 1.0 always agrees

    def agrees(self, seed: int, position: int) -> bool:
        """Whether the draft at ``position`` is the rule's id, for a request's ``seed``."""
        return (_mix(seed, position, 1) >> 11) < self._threshold

    def after(self, history: Sequence[int], drafts: Sequence[int], seed: int,
              mask: Tuple[int, int]) -> List[int]:
        """The history once the greedy verify of ``drafts`` after ``history`` is committed: the
        drafts the rule agrees with, then the rule's own id (the reference rule is known on the
        host). So at depth 2 the drafts are those of depth 1."""
        h = list(history)
        for draft in list(drafts) + [None]:
            rule = host_next_token(h, self.vocab, self.dtype, tuple(mask))
            h.append(rule)
            if draft != rule:
                break
        return h

    def draft(self, history: Sequence[int], k: int, seed: int = 0,
              mask: Tuple[int, int] = (NO_TOKEN, NO_TOKEN)) -> List[int]:
        """The ``k`` drafts after ``history`` (the input id last) for a request's ``seed``."""
        h = list(history)
        out: List[int] = []
        for _ in range(k):
            position = len(h)  # the drafted id's position
            rule = host_next_token(h, self.vocab, self.dtype, tuple(mask))
            if rule == NO_TOKEN or not self.agrees(seed, position):
                base = 0 if rule == NO_TOKEN else rule  # any id but the rule's
                rule = (base + 1 + _mix(seed, position, 2) % (self.vocab - 1)) % self.vocab
            out.append(rule)
            h.append(rule)
        return out
