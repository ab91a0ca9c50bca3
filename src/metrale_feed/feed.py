"""The fixed encodings (docs/encodings.md): FeedSource words and RowMask pairs."""

from __future__ import annotations

__all__ = ["NO_TOKEN", "FeedSource", "RowMask"]

NO_TOKEN = 0xFFFFFFFF
_HOST_BIT = 0x80000000

from _operator import index as _index  # operator.index, without importing operator


class FeedSource(int):
    """One uint32: bit 31 set is a host-supplied id in the low 31 bits; clear, ``from_row``, the
    row of the previous step whose feed cell holds the id. It is an int, so a list of them goes
    straight to the kernels."""

    __slots__ = ()

    @classmethod
    def host(cls, token_id: int) -> "FeedSource":
        token_id = _index(token_id)  # an int: a float is refused, never truncated
        if not 0 <= token_id < _HOST_BIT:
            raise ValueError(f"a host id must be in [0, 2**31), got {token_id}")
        return cls(_HOST_BIT | token_id)

    @classmethod
    def feed(cls, from_row: int) -> "FeedSource":
        from_row = _index(from_row)
        if not 0 <= from_row < _HOST_BIT:
            raise ValueError(f"from_row must be in [0, 2**31), got {from_row}")
        return cls(from_row)

    @property
    def is_host(self) -> bool:
        return bool(self & _HOST_BIT)

    @property
    def value(self) -> int:
        """The host id, or the from_row."""
        return int(self) & (_HOST_BIT - 1)

    def __repr__(self) -> str:
        kind = "host" if self.is_host else "feed"
        return f"FeedSource.{kind}({self.value})"


class RowMask(tuple):  # type: ignore[type-arg]
    """Two ids a row's argmax may not answer; NO_TOKEN where unused. A plain pair (a tuple), so
    a list of them is what the kernels take; no typing import, to keep ``import`` fast."""

    __slots__ = ()

    def __new__(cls, a: int = NO_TOKEN, b: int = NO_TOKEN) -> "RowMask":
        for token in (a, b):
            if not 0 <= token <= NO_TOKEN:
                raise ValueError(f"a mask id must be a uint32, got {token}")
        return tuple.__new__(cls, (a, b))

    @property
    def a(self) -> int:
        return self[0]

    @property
    def b(self) -> int:
        return self[1]

    def __repr__(self) -> str:
        show = ["NO_TOKEN" if t == NO_TOKEN else str(t) for t in self]
        return f"RowMask({show[0]}, {show[1]})"
