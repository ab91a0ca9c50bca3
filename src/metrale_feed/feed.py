"""The fixed encodings (docs/encodings.md): FeedSource words and RowMask pairs."""

from __future__ import annotations

__all__ = ["NO_TOKEN", "FeedSource", "RowMask"]

NO_TOKEN = 0xFFFFFFFF
_HOST_BIT = 0x80000000

from _operator import index as _index  # operator.index, without importing operator


class FeedSource(int):
    """Where a row of the next step takes its input id: one uint32 (docs/encodings.md, "FeedSource").

    Bit 31 set: a host-supplied id in the low 31 bits (``FeedSource.host(id)``). Bit 31 clear:
    ``from_row``, the row of the previous step whose feed cell holds the id
    (``FeedSource.feed(from_row)``). It is an int, so a list of them goes straight to the kernels.

    Examples
    --------
    >>> from metrale_feed import FeedSource
    >>> FeedSource.feed(3), FeedSource.host(42)
    (FeedSource.feed(3), FeedSource.host(42))
    >>> hex(FeedSource.host(42)), FeedSource.host(42).is_host, FeedSource.host(42).value
    ('0x8000002a', True, 42)
    """

    __slots__ = ()

    @classmethod
    def host(cls, token_id: int) -> "FeedSource":
        """A host-supplied input id.

        Parameters
        ----------
        token_id : int
            0 to 2**31 - 1.

        Returns
        -------
        FeedSource

        Raises
        ------
        ValueError
            ``token_id`` out of range.
        TypeError
            ``token_id`` is not an int (a float is refused, never truncated).
        """
        token_id = _index(token_id)  # an int: a float is refused, never truncated
        if not 0 <= token_id < _HOST_BIT:
            raise ValueError(f"a host id must be in [0, 2**31), got {token_id}")
        return cls(_HOST_BIT | token_id)

    @classmethod
    def feed(cls, from_row: int) -> "FeedSource":
        """The id in the previous step's feed cell ``from_row``.

        Parameters
        ----------
        from_row : int
            0 to 2**31 - 1; the kernels also check it against the previous step's rows.

        Returns
        -------
        FeedSource

        Raises
        ------
        ValueError
            ``from_row`` out of range.
        TypeError
            ``from_row`` is not an int.
        """
        from_row = _index(from_row)
        if not 0 <= from_row < _HOST_BIT:
            raise ValueError(f"from_row must be in [0, 2**31), got {from_row}")
        return cls(from_row)

    @property
    def is_host(self) -> bool:
        """Whether bit 31 is set (a host-supplied id).
        """
        return bool(self & _HOST_BIT)

    @property
    def value(self) -> int:
        """The host id, or the from_row."""
        return int(self) & (_HOST_BIT - 1)

    def __repr__(self) -> str:
        kind = "host" if self.is_host else "feed"
        return f"FeedSource.{kind}({self.value})"


class RowMask(tuple):  # type: ignore[type-arg]
    """Two ids a row's argmax may not answer, ``NO_TOKEN`` where unused.

    A plain pair (a tuple), so a list of them is what the kernels take (docs/encodings.md,
    "RowMask"); no typing import, to keep ``import`` fast.

    Parameters
    ----------
    a, b : int, optional
        uint32 ids; default ``NO_TOKEN``.

    Raises
    ------
    ValueError
        An id outside uint32.

    Examples
    --------
    >>> from metrale_feed import RowMask
    >>> RowMask(7), tuple(RowMask(7, 9))
    (RowMask(7, NO_TOKEN), (7, 9))
    """

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
