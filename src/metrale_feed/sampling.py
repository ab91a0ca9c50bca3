"""Sampling parameters: ``SAMPLING_PARAMS_DTYPE`` and a helper that fills an array of them.

Loaded lazily (``metrale_feed.SAMPLING_PARAMS_DTYPE``), so ``import metrale_feed`` does not import
numpy. The layout is the C ABI's ``mf_sampling_params`` (``feed.h``), read from the extension.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _core

__all__ = ["SAMPLING_PARAMS_DTYPE", "sampling_params", "step_records", "ROW_FIELDS"]

def _dtype_of_layout() -> np.dtype:
    fields, size = _core._SAMPLING_PARAMS_LAYOUT  # the C struct's own offsets and size
    return np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields],
                     "offsets": [f[2] for f in fields], "itemsize": size})


#: One row's ``mf_sampling_params`` record, as feed.h lays it out.
SAMPLING_PARAMS_DTYPE = _dtype_of_layout()

#: The record's per-request fields: every field but ``position`` (which the scheduler sets at
#: each launch) and the padding (``_``-named) is the ``SamplingParams`` attribute of the same name. Read from the layout, so
#: a field added to ``mf_sampling_params`` (and to ``SamplingParams``) reaches every step.
ROW_FIELDS = tuple(name for name in SAMPLING_PARAMS_DTYPE.names
                   if name != "position" and not name.startswith("_"))


def step_records(params: Any) -> np.ndarray:
    """The one batch builder of a step's records, for plain and speculative steps alike: a
    ``SAMPLING_PARAMS_DTYPE`` record per row from each row's ``SamplingParams`` (checked when it
    was made), ``position`` 0 (the scheduler sets it per launch).

    Parameters
    ----------
    params : sequence of SamplingParams
        One a row, in row order.

    Returns
    -------
    numpy.ndarray

    Examples
    --------
    >>> import metrale_feed as mf
    >>> rows = step_records([mf.SamplingParams(temperature=0.5, top_k=4), mf.SamplingParams()])
    >>> rows["temperature"].tolist(), rows["top_k"].tolist()
    ([0.5, 0.0], [4, 0])
    """
    out = np.zeros(len(params), SAMPLING_PARAMS_DTYPE)
    for name in ROW_FIELDS:
        out[name] = [getattr(p, name) for p in params]
    return out


def sampling_params(rows: int, *, temperature: Any = 1.0, top_k: Any = 0, top_p: Any = 1.0,
                    min_p: Any = 0.0, seed: Any = 0, position: Any = 0) -> np.ndarray:
    """A ``(rows,)`` array of ``SAMPLING_PARAMS_DTYPE`` records; each field a scalar or a sequence
    of ``rows`` values.

    Parameters
    ----------
    rows : int
        Records to make.
    temperature, top_k, top_p, min_p, seed, position
        The fields (``docs/kernels.md``); checked by ``sample_to_feed``, not here.

    Returns
    -------
    numpy.ndarray
        The records, C-contiguous.

    Examples
    --------
    >>> sampling_params(2, temperature=0.8, seed=7, position=[3, 4])["position"].tolist()
    [3, 4]
    """
    out = np.zeros(rows, SAMPLING_PARAMS_DTYPE)
    out["temperature"], out["top_k"], out["top_p"] = temperature, top_k, top_p
    out["min_p"], out["seed"], out["position"] = min_p, seed, position
    return out
