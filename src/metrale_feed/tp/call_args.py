"""The readings and checks of a sharded call's arguments, before anything is queued: host
drafts, stream keys, device params, host destinations, device addresses and what follows them."""

from __future__ import annotations

from typing import Any

from .. import _core
from . import ops


def _host_drafts(drafts: Any) -> Any:
    """Host drafts as uint32 (the mask walks them on the device, so they are uploaded), or None
    for device memory."""
    import numpy as np

    if type(drafts) is _core.DeviceBuffer or isinstance(drafts, int) or hasattr(
            drafts, "__cuda_array_interface__"):
        return None
    try:
        with memoryview(drafts):
            pass
    except TypeError:
        return np.asarray(list(drafts), np.uint32)
    if hasattr(drafts, "__dlpack__") and not hasattr(drafts, "dtype"):
        return None
    return np.ascontiguousarray(drafts, np.uint32).ravel()


def _close_slot(slot: tuple[Any, tuple[Any, ...]]) -> None:
    done, held = slot
    done.close()
    for buf in held:
        buf.close()


def _stream_key(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, _core.Stream):
        return int(stream.handle)
    if isinstance(stream, int):
        return int(stream)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    return int(getattr(stream, "cuda_stream", getattr(stream, "ptr", 0)))


def _device_params(params: Any) -> bool:
    """Whether params are device memory (read when the kernels run), by the rule sample_to_feed
    uses: a DeviceBuffer, an int pointer, or a tensor that is not a host buffer."""
    if type(params) is _core.DeviceBuffer or hasattr(params, "__cuda_array_interface__"):
        return True
    if isinstance(params, int) and not isinstance(params, bool):
        return True
    if hasattr(params, "__dlpack__"):
        try:
            memoryview(params).release()
        except TypeError:
            return True
    return False


def _check_host_params(params: Any) -> bool:
    """Host records (the filters' rounds read them on the worker); whether a filter is on."""
    import numpy as np

    if not isinstance(params, np.ndarray) or params.dtype.names is None:
        raise ValueError("a sharded sample_to_feed takes SAMPLING_PARAMS_DTYPE records: host ones "
                         "(any filters), or device memory holding them (temperature-only)")
    plan = np.frombuffer(ops.sampling_plan(np.ascontiguousarray(params)), np.uint8)
    return bool(np.any(plan & (ops.PLAN_TOP_K | ops.PLAN_TOP_P | ops.PLAN_MIN_P)))


def _precheck_host(buf: Any, rows: int, what: str, fmt: str) -> None:
    """The size (and type) of a host destination, before anything is queued."""
    if buf is None or isinstance(buf, int):
        return
    try:
        view = memoryview(buf)
    except TypeError as exc:
        raise TypeError(f"{what} must be a writable buffer") from exc
    if view.nbytes < rows * 4:
        raise ValueError(f"{what} holds {view.nbytes} bytes; {rows} rows need {rows * 4}")
    if fmt == "f" and view.format not in ("f", "<f", "=f", "B"):
        raise TypeError(f"{what} must be float32, not format {view.format!r}")


def _device_at(buf: Any, what: str) -> tuple[int, int | None]:
    """(address, bytes or None when unknown) of a top_logprobs destination: an int pointer's are
    what is left of its allocation (0 for a pointer the layer does not know, None for foreign
    memory on the cuda backend)."""
    if type(buf) is _core.DeviceBuffer:
        return int(buf.ptr), int(buf.nbytes)
    if isinstance(buf, int) and not isinstance(buf, bool):
        return int(buf), ops.device_bytes_left(buf)
    raise TypeError(f"{what} must be a DeviceBuffer or an int, not {type(buf).__name__}")
