"""``_core._sampling_plan``: the C rule's (``mf_plan_sampling``'s) reading of each params record,
which the tensor-parallel layer plans its rounds from instead of restating it.

The reference below is written from docs/kernels.md ("Sampling"): a row samples when its
temperature is in (0, 3.4e38] (3.4e38 rounded to float32, a little below FLT_MAX: the rule's own
literal, which the tensor-parallel verify once restated as FLT_MAX); top_k is on when not 0, top_p when in (0, 1), min_p when in
(0, 1); a greedy row applies no filter. Any other value (NaN, inf, negative) is its neutral
setting, as device-resident params are read."""

from __future__ import annotations

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed import _core

T_MAX = np.float32(3.4e38)  # sample_rule.h: temperature <= 3.4e38f
F32_MAX = np.finfo(np.float32).max


def reference(p):
    t, k, tp, mp = p["temperature"], p["top_k"], p["top_p"], p["min_p"]
    with np.errstate(invalid="ignore"):
        sampled = (t > 0) & (t <= T_MAX)
        return (sampled * _core._PLAN_SAMPLED
                | (sampled & (k != 0)) * _core._PLAN_TOP_K
                | (sampled & (tp > 0) & (tp < 1)) * _core._PLAN_TOP_P
                | (sampled & (mp > 0) & (mp < 1)) * _core._PLAN_MIN_P).astype(np.uint8)


def test_the_plan_is_the_kernels_reading_of_awkward_records():
    awkward_t = [0.0, -0.0, -1.0, 1e-45, 0.5, 1.0, T_MAX, F32_MAX, np.inf, -np.inf, np.nan]
    awkward_p = [0.0, -0.5, 1e-45, 0.5, 1.0, 1.5, np.inf, np.nan]
    rng = np.random.default_rng(3)
    n = 4000
    p = np.zeros(n, mf.SAMPLING_PARAMS_DTYPE)
    p["temperature"] = rng.choice(np.array(awkward_t, np.float32), n)
    p["top_p"] = rng.choice(np.array(awkward_p, np.float32), n)
    p["min_p"] = rng.choice(np.array(awkward_p, np.float32), n)
    p["top_k"] = rng.choice(np.array([0, 1, 50, 2 ** 32 - 1], np.uint32), n)
    got = np.frombuffer(_core._sampling_plan(p), np.uint8)
    np.testing.assert_array_equal(got, reference(p))
    # Every bit occurs, set and clear, so a plan that dropped one could not pass.
    for bit in (_core._PLAN_SAMPLED, _core._PLAN_TOP_K, _core._PLAN_TOP_P, _core._PLAN_MIN_P):
        assert 0 < np.count_nonzero(got & bit) < n


def test_rows_takes_the_first_records_and_refuses_more_than_there_are():
    p = mf.sampling_params(3, temperature=[0.5, 0.0, 0.7], top_k=[0, 0, 4])
    assert list(_core._sampling_plan(p, 2)) == [_core._PLAN_SAMPLED, 0]
    assert list(_core._sampling_plan(p)) == [1, 0, _core._PLAN_SAMPLED | _core._PLAN_TOP_K]
    with pytest.raises(ValueError, match="fewer than 4"):
        _core._sampling_plan(p, 4)
