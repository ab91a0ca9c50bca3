"""The host argmax's vector and portable paths give the oracle's answer on the same inputs."""

import numpy as np
import pytest

import metrale_feed as mf
from metrale_feed.testing.oracle import reference_argmax

ml_dtypes = pytest.importorskip("ml_dtypes")
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def nasty_rows(rng, rows, vocab, dtype):
    """Few distinct values (ties), with NaN, +-inf and signed zeros sprinkled in."""
    pool = np.array([-np.inf, -1.5, -0.0, 0.0, 0.25, 1.0, np.inf, np.nan], np.float32)
    values = pool[rng.integers(0, len(pool), size=(rows, vocab))]
    return values.astype(DTYPES[dtype])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("vocab", [1, 2, 3, 15, 16, 17, 33, 1000])
def test_both_paths_match_the_oracle(path, no_leaks, dev, dtype, vocab):
    rng = np.random.default_rng(vocab * 7 + len(dtype))
    rows = 24
    logits = nasty_rows(rng, rows, vocab, dtype)
    masks = rng.integers(0, vocab, size=(rows, 2)).astype(np.uint32)
    masks[::3, 1] = mf.NO_TOKEN
    masks[::5] = mf.NO_TOKEN
    buf = dev.upload(logits)
    cells = mf.DeviceBuffer(rows * 4)
    dst = np.zeros(rows, np.uint32)
    with mf.Event() as done:
        mf.argmax_to_feed(buf, masks, cells, dst, done, rows=rows, vocab=vocab, dtype=dtype)
        done.synchronize()
    assert np.array_equal(dst, reference_argmax(logits, masks)), path
    buf.close()
    cells.close()
