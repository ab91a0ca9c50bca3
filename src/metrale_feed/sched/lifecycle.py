"""What a pipeline's lifecycle shares with its parts: the lock that makes its loop one thread's
at a time (``_LoopLock``), and ``close_each``, which closes every part whatever another raised."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional

from ..errors import FeedError


class _LoopLock:
    """The loop's lock, knowing which thread holds it: a loop call (``step``, ``run``,
    ``admit``, ``close``) made by the thread already inside one (a drafter's ``propose`` or a
    model's method calling back into the pipeline) would wait for itself forever, so it raises
    instead. ``acquire(blocking=False)`` and ``release`` are the inbox's, as a Lock's."""

    __slots__ = ("_lock", "owner", "what")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: Optional[int] = None
        self.what = "step"

    def __call__(self, what: str) -> "_LoopLock":
        if self.owner == threading.get_ident():
            raise FeedError(f"{what}() was called from inside one of this pipeline's own calls "
                            f"(a drafter's propose or a model's method): it would wait for itself; "
                            f"call it once that returns (abort() and submit() may be called there)")
        return self

    def __enter__(self) -> None:
        self._lock.acquire()
        self.owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self.owner = None
        self._lock.release()

    def acquire(self, blocking: bool = True) -> bool:
        return self._lock.acquire(blocking)

    def release(self) -> None:
        self._lock.release()



def close_each(closers: Iterable[Callable[[], Any]]) -> None:
    """Call every closer, whatever the ones before raised, then raise the first error: one part
    that fails to close never leaves the others' events and memory behind."""
    first: Optional[BaseException] = None
    for closer in closers:
        try:
            closer()
        except BaseException as exc:
            if first is None:
                first = exc
    if first is not None:
        raise first
