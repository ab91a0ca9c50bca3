"""The package's one table of element types: every spelling the API takes, and the facts the
binding needs about each (its C code, size, DLPack code, numpy type string).

A dtype may be spelled as a string (``"float32"``, ``"f32"``, ``"bf16"``, ...), a numpy dtype or
scalar type, an ``ml_dtypes`` type, or a torch dtype. Torch and numpy are recognised by name, so
this module imports neither. A non-native byte order is refused: every kernel reads native words.
"""

from __future__ import annotations

import sys as _sys

# DLPack's type codes (DLDataTypeCode).
DL_INT = 0
DL_UINT = 1
DL_FLOAT = 2
DL_BFLOAT = 4


class DType:
    """Facts about one element type.

    Attributes
    ----------
    name : str
        The canonical name (``"float32"``, ...).
    code : int or None
        The C layer's ``mf_dtype`` for logits types; None for the others.
    itemsize : int
        Bytes per element.
    dl_code, dl_bits : int
        DLPack's ``DLDataType`` code and bits (lanes are always 1).
    typestr : str
        The ``__cuda_array_interface__``/numpy type string (native byte order).
    """

    __slots__ = ("name", "code", "itemsize", "dl_code", "dl_bits", "typestr")

    def __init__(self, name: str, code: int | None, itemsize: int, dl_code: int, typestr: str) -> None:
        self.name = name
        self.code = code
        self.itemsize = itemsize
        self.dl_code = dl_code
        self.dl_bits = itemsize * 8
        self.typestr = typestr

    def __repr__(self) -> str:
        return f"DType({self.name!r})"


_E = "<" if _sys.byteorder == "little" else ">"

# code: mf_dtype of feed.h (MF_DTYPE_F32 = 0, MF_DTYPE_F16 = 1, MF_DTYPE_BF16 = 2); _core checks
# these against the header at import. bfloat16 has no numpy type string; "V2" is what ml_dtypes uses.
TABLE: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 0, 4, DL_FLOAT, _E + "f4"),
        DType("float16", 1, 2, DL_FLOAT, _E + "f2"),
        DType("bfloat16", 2, 2, DL_BFLOAT, _E + "V2"),
        DType("uint8", None, 1, DL_UINT, "|u1"),
        DType("int8", None, 1, DL_INT, "|i1"),
        DType("uint16", None, 2, DL_UINT, _E + "u2"),
        DType("int16", None, 2, DL_INT, _E + "i2"),
        DType("uint32", None, 4, DL_UINT, _E + "u4"),
        DType("int32", None, 4, DL_INT, _E + "i4"),
        DType("uint64", None, 8, DL_UINT, _E + "u8"),
        DType("int64", None, 8, DL_INT, _E + "i8"),
        DType("float64", None, 8, DL_FLOAT, _E + "f8"),
    )
}

ALIASES: dict[str, str] = {
    "f32": "float32", "f4": "float32", "float": "float32",
    "f16": "float16", "f2": "float16", "half": "float16",
    "bf16": "bfloat16",
    "u1": "uint8", "u8": "uint8", "i1": "int8", "i8": "int8",
    "u2": "uint16", "u16": "uint16", "i2": "int16", "i16": "int16",
    "u4": "uint32", "u32": "uint32", "i4": "int32", "i32": "int32",
    "u64": "uint64", "i64": "int64",
    "f8": "float64", "f64": "float64", "double": "float64",
}

# DLPack (code, bits) to the type, for imports.
BY_DLPACK: dict[tuple[int, int], DType] = {(d.dl_code, d.dl_bits): d for d in TABLE.values()}

_NON_NATIVE = ">" if _E == "<" else "<"


def dtype(spelling: object) -> DType:
    """The table entry of ``spelling``.

    Parameters
    ----------
    spelling : str, numpy dtype or type, torch dtype, ml_dtypes type, or DType
        ``"float32"``, ``"f32"``, ``numpy.float16``, ``numpy.dtype("<f4")``, ``torch.bfloat16``, ...

    Returns
    -------
    DType

    Raises
    ------
    ValueError
        An unknown type, or a non-native byte order (``numpy.dtype(">f4")``).

    Examples
    --------
    >>> dtype("bf16").name
    'bfloat16'
    """
    if type(spelling) is DType:
        return spelling
    if isinstance(spelling, str):
        name = spelling
        if name[:1] in "<>=|" and len(name) > 1:  # a numpy type string: "<f4", "=f2"
            if name[0] == _NON_NATIVE:
                raise ValueError(f"dtype {spelling!r} has a non-native byte order")
            name = name[1:]
    else:
        order = getattr(spelling, "byteorder", None)  # numpy dtypes
        if order == _NON_NATIVE:
            raise ValueError(f"dtype {spelling!r} has a non-native byte order")
        name = getattr(spelling, "name", None)
        if not isinstance(name, str):
            name = spelling.__name__ if isinstance(spelling, type) else str(spelling)
    if name.startswith("torch."):
        name = name[6:]
    entry = TABLE.get(name) or TABLE.get(ALIASES.get(name, ""))
    if entry is None:
        raise ValueError(f"unknown dtype {spelling!r}: use float32, float16 or bfloat16 for logits "
                         f"(or their spellings f32, f16, bf16, numpy or torch dtypes)")
    return entry


def logits_dtype(spelling: object) -> DType:
    """``dtype(spelling)``, refused with ``ValueError`` unless it is a logits type (float32,
    float16 or bfloat16). A non-native byte order says so."""
    try:
        entry = dtype(spelling)
    except ValueError as error:
        if "byte order" in str(error):
            raise
        entry = None
    if entry is None or entry.code is None:
        raise ValueError(f"unknown logits dtype {spelling!r}: use float32, float16 or bfloat16 "
                         f"(or f32, f16, bf16, a numpy or a torch dtype)")
    return entry
