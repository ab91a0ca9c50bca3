"""Running one call on a named backend, for the tests that compare two backends' bits."""

from __future__ import annotations

import gc

import metrale_feed as mf


def on(name, fn, **settings):
    """``fn()`` with backend ``name`` active (simt under ``settings``, the keywords of
    ``configure_simt``), then the simt defaults and the previous backend back.

    Garbage is collected around the switch, so that no object of one backend is freed while the
    other is active.
    """
    previous = mf.backend()
    gc.collect()
    mf.set_backend(name)
    mf.configure_simt(**settings)
    try:
        return fn()
    finally:
        mf.configure_simt()
        mf.stream_synchronize(0)
        gc.collect()
        mf.set_backend(previous)
