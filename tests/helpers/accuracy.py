"""The logprobs accuracy contract, shared by the single-process and the multi-rank tests."""

import numpy as np


def assert_close(got, ref):
    """Within 2e-5 absolute or 2 float32 ulps of ref, whichever is larger; NaN and +-inf exactly."""
    got = np.asarray(got, np.float64)
    special = ~np.isfinite(ref)
    assert np.array_equal(np.isnan(got), np.isnan(ref)), (got, ref)
    assert np.array_equal(got[special & ~np.isnan(ref)], ref[special & ~np.isnan(ref)])
    fin = ~special
    tol = np.maximum(2e-5, 2 * np.spacing(np.abs(ref[fin]).astype(np.float32)).astype(np.float64))
    err = np.abs(got[fin] - ref[fin])
    assert (err <= tol).all(), (err.max(), got[fin][err > tol][:5], ref[fin][err > tol][:5])
