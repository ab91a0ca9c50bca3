"""What ``sample_to_feed`` draws for one request's row alone under a bitmask: the oracle of the
grammar pipeline tests that sample (the host-grammar loop and the automaton loop alike)."""

from __future__ import annotations

import numpy as np

import metrale_feed as mf
from metrale_feed.testing.reference import host_logits


def sample_one(history, bits, vocab, **sampling):
    """One row of the reference logits at position ``len(history)``, sampled by
    ``sample_to_feed`` with ``bits`` (32-bit words, bit ``i`` of the row's ids set where ``i`` is
    allowed) as its bitmask.

    Parameters
    ----------
    history : list of int
        The prompt and the tokens so far.
    bits : numpy.ndarray
        The packed bitmask, ``ceil(vocab / 32)`` 32-bit words.
    vocab : int
        The row's width.
    **sampling
        Arguments of ``sampling_params``.

    Returns
    -------
    int
        The id drawn.
    """
    row = host_logits(history, vocab)
    params = mf.sampling_params(1, position=len(history), **sampling)
    out = np.zeros(1, np.uint32)
    with mf.DeviceBuffer(row.nbytes) as logits, mf.DeviceBuffer(4) as cells, \
            mf.DeviceBuffer(bits.nbytes) as bitmask, mf.Event() as done:
        mf.copy_h2d_async(logits, row.view(np.uint8))
        mf.copy_h2d_async(bitmask, bits)
        mf.sample_to_feed(logits, params, cells, out, done, bitmask=bitmask, vocab=vocab,
                          dtype="float32")
        done.synchronize()
    return int(out[0])
