"""metrale_feed: the device token feed of an asynchronous LLM scheduler.

The runtime binding (events, streams, pinned and device memory, async copies, the two feed
kernels) lives in the ``_core`` extension; the trait, router and reference model are Python.
Importing this package imports no numpy. The design, the encodings, the argmax rule, the router
protocol and the error model are described in the project's ``docs/`` (start at docs/README.md);
``metrale-feed --help`` lists the command's tools.
"""

from __future__ import annotations

import os as _os

TYPE_CHECKING = False  # mypy reads any TYPE_CHECKING as True; importing typing costs milliseconds
if TYPE_CHECKING:
    from typing import Any as _Any

from . import _core
# `X as X`: the PEP 484 spelling of a re-export, so `mypy --strict` users see these names.
from ._core import (
    MAX_ROWS as MAX_ROWS,
    MAX_VOCAB as MAX_VOCAB,
    NO_TOKEN as NO_TOKEN,
    BufferView as BufferView,
    DeviceBuffer as DeviceBuffer,
    Event as Event,
    PickStep as PickStep,
    PinnedBuffer as PinnedBuffer,
    Stream as Stream,
    _C_API as _C_API,
    alloc_host_pinned as alloc_host_pinned,
    argmax_to_feed as argmax_to_feed,
    backend as backend,
    build_info as build_info,
    configure_host as configure_host,
    configure_simt as configure_simt,
    copy_d2d_async as copy_d2d_async,
    copy_d2h_async as copy_d2h_async,
    copy_h2d_async as copy_h2d_async,
    destroy_event as destroy_event,
    devices as devices,
    event_create as event_create,
    event_query as event_query,
    event_record as event_record,
    event_synchronize as event_synchronize,
    free_host_pinned as free_host_pinned,
    Graph as Graph,
    graph_capture as graph_capture,
    host_faults as host_faults,
    host_argmax_path as host_argmax_path,
    host_kernel_threads as host_kernel_threads,
    launch_host_func as launch_host_func,
    live_objects as live_objects,
    nvtx_range as nvtx_range,
    pick_to_feed as pick_to_feed,
    read_pinned_u32 as read_pinned_u32,
    resolve_feed as resolve_feed,
    sample_to_feed as sample_to_feed,
    simt_config as simt_config,
    stream_capturing as stream_capturing,
    stream_synchronize as stream_synchronize,
    write_pinned_u32 as write_pinned_u32,
)
from ._core import MAX_DRAFTS as MAX_DRAFTS
from ._core import resolve_verified as resolve_verified
from ._core import verify_to_feed as verify_to_feed
from .dtypes import dtype as dtype
from .errors import BackendUnavailable as BackendUnavailable
from .errors import CaptureError as CaptureError
from .errors import CudaError as CudaError
from .errors import DeviceError as DeviceError
from .errors import FeedError as FeedError
from .errors import FeedMemoryError as FeedMemoryError
from .errors import HostFunctionError as HostFunctionError
from .errors import InjectedFault as InjectedFault
from .errors import InternalError as InternalError
from .errors import InvalidHandleError as InvalidHandleError
from .errors import KvPoolExhausted as KvPoolExhausted
from .errors import NoDeviceTokenFeed as NoDeviceTokenFeed
from .feed import FeedSource as FeedSource
from .feed import RowMask as RowMask

__version__ = "0.1.0"


# Why METRALE_FEED_BACKEND was refused, when the ``metrale-feed`` command imported the package: the
# command explains it in words (``metrale-feed info``) instead of ending in a traceback.
_env_refused: "_Any" = None


def _select_from_env() -> None:
    global _env_refused
    wanted = _os.environ.get("METRALE_FEED_BACKEND", "auto").strip().lower() or "auto"
    try:
        if wanted not in ("auto", "cuda", "host", "simt"):
            raise ValueError(f"METRALE_FEED_BACKEND must be auto, cuda, host or simt, not {wanted!r}")
        if wanted == "host":
            return
        if wanted == "simt":  # asked for by name only: auto never selects it
            _core.select_backend("simt")
            return
        try:
            _core.select_backend("cuda")
        except FeedError:
            if wanted == "cuda":
                raise  # asked for by name: say why it is unusable
            # auto: no CUDA build, no driver or no device; the host backend stays active.
    except (ValueError, FeedError) as error:
        import sys

        if _os.path.basename(sys.argv[0] if sys.argv else "") != "metrale-feed":
            raise
        _env_refused = error  # the host backend stays active


_select_from_env()


def set_backend(name: str) -> None:
    """Switch the active backend while no event, stream or memory is live.

    Parameters
    ----------
    name : {"host", "cuda", "simt"}

    Raises
    ------
    ValueError
        An unknown name.
    CudaError
        The cuda backend is unusable; the message says why.
    FeedError
        This build has no CUDA backend, or objects of the current backend are still live.

    Examples
    --------
    >>> import metrale_feed as mf
    >>> mf.set_backend("host"); mf.backend()
    'host'
    """
    _core.select_backend(name)


def get_include() -> str:
    """The folder to add to the include path for ``cimport metrale_feed._core``.

    It holds the ``.pxd`` files and, below it, the C headers (``metrale_feed/feed.h``,
    ``metrale_feed/capi.h``).

    Returns
    -------
    str

    Examples
    --------
    >>> import os, metrale_feed as mf
    >>> os.path.isfile(os.path.join(mf.get_include(), "metrale_feed", "_core.pxd"))
    True
    """
    return _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))


def get_c_include() -> str:
    """The folder that holds ``metrale_feed/feed.h`` and ``metrale_feed/capi.h``.

    Returns
    -------
    str

    Examples
    --------
    >>> import os, metrale_feed as mf
    >>> os.path.isfile(os.path.join(mf.get_c_include(), "metrale_feed", "capi.h"))
    True
    """
    here = _os.path.dirname(_os.path.abspath(__file__))
    installed = _os.path.join(here, "include")
    if not _os.path.isdir(installed):  # an editable install of a checkout: the headers' own folder
        checkout = _os.path.join(_os.path.dirname(_os.path.dirname(here)), "cuda", "include")
        if _os.path.isdir(checkout):
            return checkout
    return installed


# The Python-level layers load on first use, so the hot import stays small: name -> (module, attr).
_LAZY = {
    "ModelDeviceFeed": ("trait", "ModelDeviceFeed"),
    "RuntimeFeedMixin": ("runtime", "RuntimeFeedMixin"),
    "SequenceState": ("kv", "SequenceState"),
    "BlockPool": ("kv", "BlockPool"),
    "AsyncDeviceIo": ("sched.router", "AsyncDeviceIo"),
    "SyncDeviceIo": ("sched.router", "SyncDeviceIo"),
    "DecodePipeline": ("sched.pipeline", "DecodePipeline"),
    "Request": ("sched.request", "Request"),
    "RequestStatus": ("sched.request", "RequestStatus"),
    "reference_argmax": ("testing.oracle", "reference_argmax"),
    "SamplingParams": ("params", "SamplingParams"),
    "SAMPLING_PARAMS_DTYPE": ("sampling", "SAMPLING_PARAMS_DTYPE"),
    "sampling_params": ("sampling", "sampling_params"),
    "VocabShard": ("tp.shard", "VocabShard"),
    "FilterRounds": ("tp.rounds", "FilterRounds"),
    "TokenAutomaton": ("grammar.automaton", "TokenAutomaton"),
    "HostGrammar": ("grammar.host", "HostGrammar"),
}


def __getattr__(name: str) -> "_Any":
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> "list[str]":
    # The lazy names are part of the package's namespace before their first use too.
    # ``annotations`` (the __future__ import) and TYPE_CHECKING are the module's machinery, not API.
    return sorted((set(globals()) | set(_LAZY)) - {"annotations", "TYPE_CHECKING"})
