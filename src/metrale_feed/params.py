"""``SamplingParams``: one request's decoding parameters, typed and checked once.

A request's parameters used to travel as keyword arguments, tuples and numpy records, checked at
each hop. ``SamplingParams`` is the one typed form: ``DecodePipeline.submit`` builds it from its
keywords (or takes one), the request keeps it (``Request.params``), and each step's batch is made
from it. Everything that does not depend on the pipeline is checked here, at construction, by
the rules of ``_checks`` (the C layer's own rules and limits, applied to the values as the kernels
read them: float32 and unsigned ints). What depends on the pipeline (the vocabulary, the request's
``max_new_tokens``, what its model and shard can run) is checked by ``submit``.

Loaded on first use (``metrale_feed.SamplingParams``), so ``import metrale_feed`` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional, Tuple

from . import _checks

__all__ = ["SamplingParams", "SAMPLING_FIELDS"]


def _frozen_bias(pairs: Tuple[Tuple[int, float], ...]) -> Optional[Mapping[int, float]]:
    return MappingProxyType(dict(pairs)) if pairs else None


@dataclass(frozen=True, eq=False)
class SamplingParams:
    """How one request decodes: its sampler, penalties and logprobs.

    The fields are ``DecodePipeline.submit``'s per-request keywords, with their names, meanings
    and defaults (see ``submit``). Every value is checked when the object is made, with the
    messages ``submit`` gives; float fields are kept as the float32 values the kernels read
    (``SamplingParams(top_p=0.1).top_p == 0.10000000149011612``), and ``logit_bias`` as a
    read-only mapping sorted by id (``None`` when empty).

    Parameters
    ----------
    temperature : float
        0 (the default): greedy, the argmax. Above 0: drawn from ``softmax(logit / t)``.
    top_k : int
        Keep the ``top_k`` most probable ids (0: all), below 2**32.
    top_p : float
        In (0, 1]; 1.0 keeps all.
    min_p : float
        In [0, 1); 0.0 keeps all.
    seed : int
        The draw's key, in [0, 2**64).
    repetition_penalty : float
        Finite, above 0; 1.0 is off.
    presence_penalty, frequency_penalty : float
        In [-2, 2]; 0.0 is off.
    logit_bias : mapping of int to float, optional
        At most ``MAX_LOGIT_BIAS`` ids (non-negative; ``submit`` checks them against the
        vocabulary) to finite biases.
    min_tokens : int
        At least 0 (``submit`` checks it against ``max_new_tokens``).
    logprobs : bool
        Keep each committed token's logprob.
    top_logprobs : int
        In [0, ``MAX_TOP_LOGPROBS``]; above 0 only with ``logprobs=True``.

    Raises
    ------
    TypeError
        A str, a bool or None where a number goes (a non-bool ``logprobs``), a ``logit_bias``
        that is not a mapping.
    ValueError
        A value out of its range.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> params = mf.SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    >>> params.sampled, params.penalised
    (True, False)
    >>> params.replace(temperature=0.0).sampled
    False
    >>> mf.SamplingParams(top_p=0.0)
    Traceback (most recent call last):
        ...
    ValueError: top_p must be in (0, 1], got 0.0
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[Mapping[int, float]] = None
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    # The checked penalty tuple (``_checks.Penalties``), made once at construction.
    _penalties: "_checks.Penalties" = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t, k, p, m, s = _checks.sampling(self.temperature, self.top_k, self.top_p, self.min_p,
                                         self.seed)
        mt = _checks.integer(self.min_tokens, "min_tokens")
        if mt < 0:
            raise ValueError(f"min_tokens must be at least 0, got {mt}")
        pen = _checks.penalties(self.repetition_penalty, self.presence_penalty,
                                self.frequency_penalty, self.logit_bias, mt, None, mt)
        wanted, n = _checks.logprobs(self.logprobs, self.top_logprobs)
        rep, pres, freq, bias, _ = pen
        values = (("temperature", t), ("top_k", k), ("top_p", p), ("min_p", m), ("seed", s),
                  ("repetition_penalty", rep), ("presence_penalty", pres),
                  ("frequency_penalty", freq), ("logit_bias", _frozen_bias(bias)),
                  ("min_tokens", mt), ("logprobs", wanted), ("top_logprobs", n),
                  ("_penalties", pen))
        for name, value in values:  # frozen: the dataclass's own way to set a checked value
            object.__setattr__(self, name, value)

    @property
    def sampled(self) -> bool:
        """Whether ids are drawn (``temperature > 0``) rather than the argmax."""
        return self.temperature > 0.0

    @property
    def penalised(self) -> bool:
        """Whether any penalty, ``logit_bias`` or ``min_tokens`` is on (the step applies them)."""
        return self._penalties != _checks.NO_PENALTIES

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with ``changes``, checked as a new object is.

        Examples
        --------
        >>> import metrale_feed as mf
        >>> mf.SamplingParams(seed=3).replace(seed=4).seed
        4
        """
        fields = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        fields.update(changes)
        return SamplingParams(**fields)

    def _key(self) -> Tuple[Any, ...]:
        return tuple(getattr(self, name) for name in SAMPLING_FIELDS[:8]) + (
            self._penalties[3], self.min_tokens, self.logprobs, self.top_logprobs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


#: The constructor's fields, in order: ``submit``'s per-request keywords.
SAMPLING_FIELDS: Tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
                            "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens",
                            "logprobs", "top_logprobs")
