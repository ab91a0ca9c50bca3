"""The one checker of ``DecodePipeline.submit``'s sampling parameters above the C layer.

``submit`` checks scalars (``sampling``); the routers check the ``SAMPLING_PARAMS_DTYPE``
records a caller hands them (``records``). Both apply the rules of ``sample_to_feed``
(docs/kernels.md, "Sampling") to the values as the records store them (float32, uint32, uint64),
so what passes here is what the kernel checks again, and a refusal happens before anything is
queued. Plain Python: numpy is imported only when records are checked.
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Any, Optional, Tuple

from . import _core

__all__ = ["integer", "real", "float32", "flag", "sampling", "records", "penalties", "logprobs"]

_F32 = struct.Struct("<f")
_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF

Sampling = Tuple[float, int, float, float, int]  # temperature, top_k, top_p, min_p, seed


def integer(value: Any, name: str) -> int:
    """``value`` as an int: an int or anything with ``__index__`` (numpy's integers), never a
    bool (``True`` is no count), a float or a str (TypeError)."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    return int(value.__index__())


def flag(value: Any, name: str) -> bool:
    """``value`` as a bool: ``True``, ``False`` or a numpy bool; an int (``1``), a str or None is
    a TypeError (``bool("no")`` is True)."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ in ("bool_", "bool") and type(value).__module__ == "numpy":
        return bool(value)
    raise TypeError(f"{name} must be a bool, not {type(value).__name__}")


def real(value: Any, name: str) -> float:
    """``value`` as a finite float: an int, a float or a numpy real scalar; a str, a bool or
    anything else is a TypeError (``float("0.5")`` would take a str)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def float32(value: Any, name: str) -> float:
    """``real(value)`` rounded to float32, as ``SAMPLING_PARAMS_DTYPE`` stores it, so a value
    that passes is the value the sampler checks (1e-50 is 0.0 in float32; 1e39 is refused)."""
    out = real(value, name)
    try:
        rounded: float = _F32.unpack(_F32.pack(out))[0]
    except OverflowError:
        raise ValueError(f"{name} {out} is outside float32") from None
    return rounded


def sampling(temperature: Any, top_k: Any, top_p: Any, min_p: Any, seed: Any) -> Sampling:
    """The sampling parameters of ``submit``, checked, as float32 values and unsigned ints.

    Raises
    ------
    TypeError
        A parameter that is not a number (a str, a bool, None, ...).
    ValueError
        A temperature that is negative or not finite, ``top_p`` outside (0, 1], ``min_p``
        outside [0, 1), ``top_k`` outside [0, 2**32), ``seed`` outside [0, 2**64).
    """
    t = float32(temperature, "temperature")
    if t < 0.0:
        raise ValueError(f"temperature must be at least 0, got {temperature}")
    p = float32(top_p, "top_p")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    m = float32(min_p, "min_p")
    if not 0.0 <= m < 1.0:
        raise ValueError(f"min_p must be in [0, 1), got {min_p}")
    k = integer(top_k, "top_k")
    if not 0 <= k <= _U32_MAX:
        raise ValueError(f"top_k must be in [0, 2**32) (0: every id), got {k}")
    s = integer(seed, "seed")
    if not 0 <= s <= _U64_MAX:
        raise ValueError(f"seed must be in [0, 2**64), got {s}")
    return (t, k, p, m, s)


# repetition, presence, frequency, logit_bias ((id, bias), ...) sorted by id, min_tokens
Penalties = Tuple[float, float, float, Tuple[Tuple[int, float], ...], int]
NO_PENALTIES: Penalties = (1.0, 0.0, 0.0, (), 0)
MAX_LOGIT_BIAS: int = _core.MAX_LOGIT_BIAS  # feed.h's MF_MAX_LOGIT_BIAS


def penalties(repetition_penalty: Any, presence_penalty: Any, frequency_penalty: Any,
              logit_bias: Any, min_tokens: Any, vocab: Optional[int],
              max_new_tokens: int) -> Penalties:
    """The penalty parameters of ``submit`` (vLLM's ``SamplingParams`` rules), as float32
    values: ``repetition_penalty`` finite and > 0, ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2], ``logit_bias`` a mapping of at most 300 ids in the
    vocabulary to finite biases, ``min_tokens`` in [0, max_new_tokens]. ``vocab`` None: the ids
    need only be non-negative (``SamplingParams``, made before any pipeline).

    Raises
    ------
    TypeError
        A str, a bool or None where a number goes; a ``logit_bias`` that is not a mapping.
    ValueError
        A value out of range.
    """
    rep = float32(repetition_penalty, "repetition_penalty")
    if not rep > 0.0:
        raise ValueError(f"repetition_penalty must be greater than 0, got {repetition_penalty}")
    pres = float32(presence_penalty, "presence_penalty")
    freq = float32(frequency_penalty, "frequency_penalty")
    for value, name in ((pres, "presence_penalty"), (freq, "frequency_penalty")):
        if not -2.0 <= value <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {value}")
    bias: Tuple[Tuple[int, float], ...] = ()
    if logit_bias is not None:
        items = getattr(logit_bias, "items", None)
        if not callable(items):
            raise TypeError(f"logit_bias must be a mapping of id to bias, not {type(logit_bias).__name__}")
        pairs = {}
        for key, value in items():
            token = integer(key, "logit_bias id")
            if token < 0:
                raise ValueError(f"logit_bias id {token} is negative")
            if vocab is not None and token >= vocab:
                raise ValueError(f"logit_bias id {token} is outside the vocabulary of {vocab} ids")
            if token in pairs:
                raise ValueError(f"logit_bias names id {token} twice")
            pairs[token] = float32(value, f"logit_bias[{token}]")
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS}")
        bias = tuple(sorted(pairs.items()))
    mt = integer(min_tokens, "min_tokens")
    if not 0 <= mt <= max_new_tokens:
        raise ValueError(f"min_tokens must be in [0, max_new_tokens = {max_new_tokens}], got {mt}")
    return rep, pres, freq, bias, mt


MAX_TOP_LOGPROBS: int = _core.MAX_TOP_LOGPROBS  # the OpenAI API's limit; feed.h's MF_MAX_TOP_LOGPROBS


def logprobs(logprobs: Any, top_logprobs: Any) -> Tuple[bool, int]:
    """The logprobs options of ``submit``, as the OpenAI API has them: ``logprobs`` a bool,
    ``top_logprobs`` an int in [0, 20] that needs ``logprobs=True`` when above 0.

    Raises
    ------
    TypeError
        ``logprobs`` that is not a bool, ``top_logprobs`` that is not an int.
    ValueError
        ``top_logprobs`` outside [0, 20], or above 0 without ``logprobs``.
    """
    wanted = flag(logprobs, "logprobs")
    n = integer(top_logprobs, "top_logprobs")
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n}")
    if n and not wanted:
        raise ValueError(f"top_logprobs={n} needs logprobs=True")
    return wanted, n


def records(params: Any, rows: int) -> None:
    """``SAMPLING_PARAMS_DTYPE`` records refused before the forward, not after it: their dtype,
    their rows and the ranges ``sampling`` checks (the integer fields cannot leave theirs)."""
    from .sampling import SAMPLING_PARAMS_DTYPE  # numpy is loaded: params is an array

    if getattr(params, "dtype", None) != SAMPLING_PARAMS_DTYPE:
        raise TypeError("params must be an array of metrale_feed.SAMPLING_PARAMS_DTYPE records, "
                        f"not {getattr(params, 'dtype', type(params).__name__)}")
    if len(params) < rows:
        raise ValueError(f"params hold {len(params)} rows, fewer than the {rows} launched")
    import numpy as np

    head = params[:rows]
    t, p, m = head["temperature"], head["top_p"], head["min_p"]
    if not (np.isfinite(t) & (t >= 0)).all():
        raise ValueError("params: a temperature is negative or not finite")
    if not ((p > 0) & (p <= 1)).all():
        raise ValueError("params: a top_p is outside (0, 1]")
    if not ((m >= 0) & (m < 1)).all():
        raise ValueError("params: a min_p is outside [0, 1)")
