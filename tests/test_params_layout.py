"""The one statement of a row's sampling record: feed.h's ``MF_SAMPLING_PARAMS_FIELDS`` makes the
C struct and the table ``mf_sampling_params_layout`` returns, and ``SAMPLING_PARAMS_DTYPE`` is
built from that table. Checked against the layout written out by hand here, against the table's
own invariants, and against what the C rule reads from records numpy writes."""

from __future__ import annotations

import numpy as np

import metrale_feed as mf
from metrale_feed import _core

# The record as the C ABI has shipped it: 32 bytes, every byte in a named field.
EXPECTED = np.dtype({"names": ["temperature", "top_p", "min_p", "top_k", "seed", "position", "_pad"],
                     "formats": ["<f4", "<f4", "<f4", "<u4", "<u8", "<u4", "<u4"],
                     "offsets": [0, 4, 8, 12, 16, 24, 28], "itemsize": 32})


def test_the_dtype_from_the_c_table_is_the_shipped_layout():
    got = mf.SAMPLING_PARAMS_DTYPE
    assert got == EXPECTED
    assert got.itemsize == 32 and got.names == EXPECTED.names
    assert {name: (got.fields[name][0].str, got.fields[name][1]) for name in got.names} == \
        {name: (EXPECTED.fields[name][0].str, EXPECTED.fields[name][1]) for name in EXPECTED.names}
    assert got.isalignedstruct is False and got.descr == EXPECTED.descr


def test_the_c_table_is_well_formed():
    """What a table that drifted from its struct would break: names unique, offsets strictly
    increasing and aligned, every field inside the record and the fields tiling it (padding is a
    named field, so numpy writes every byte the kernels read)."""
    fields, size = _core._SAMPLING_PARAMS_LAYOUT
    assert size == 32 and len(fields) >= 1
    names = [name for name, _, _ in fields]
    assert len(set(names)) == len(names)
    assert all(name.isidentifier() for name in names)
    offsets = [offset for _, _, offset in fields]
    assert offsets == sorted(set(offsets)) and offsets[0] == 0
    end = 0
    for name, fmt, offset in fields:
        width = np.dtype(fmt).itemsize
        assert fmt[0] == "<" and fmt[1] in "fui" and int(fmt[2:]) == width, (name, fmt)
        assert offset == end, f"{name} at {offset}: a gap or an overlap after byte {end}"
        assert offset % width == 0, f"{name} at {offset} is not aligned to its {width} bytes"
        end = offset + width
    assert end == size


def test_row_fields_are_the_per_request_fields():
    from metrale_feed.sampling import ROW_FIELDS

    assert ROW_FIELDS == ("temperature", "top_p", "min_p", "top_k", "seed")


def test_numpy_records_are_what_the_c_rule_reads():
    """Records written through the dtype, read by the C rule (``mf_plan_sampling``) through the
    struct: a field at another offset in one of them would turn another field's filter on or off."""
    recs = np.zeros(6, mf.SAMPLING_PARAMS_DTYPE)
    recs["top_p"], recs["seed"], recs["position"] = 1.0, 2**64 - 1, 0xFFFFFFFF
    recs["temperature"][1:] = 0.5
    recs["top_k"][2] = 7
    recs["top_p"][3] = 0.5
    recs["min_p"][4] = 0.25
    recs["_pad"][5] = 0xFFFFFFFF  # padding is never read
    plan = np.frombuffer(_core._sampling_plan(recs), np.uint8)
    s, k, p, m = _core._PLAN_SAMPLED, _core._PLAN_TOP_K, _core._PLAN_TOP_P, _core._PLAN_MIN_P
    assert plan.tolist() == [0, s, s | k, s | p, s | m, s]


def test_the_pxd_names_the_table_fields_in_order():
    """The shipped ``_cfeed.pxd`` names the record's fields for Cython code that cimports it: a
    prefix of the C table's, by name and order, so a cimporting caller never sets a field the
    struct does not have (the C compiler would refuse it) nor misreads which comes first."""
    import re
    from pathlib import Path

    pxd = (Path(mf.__file__).parent / "_cfeed.pxd").read_text()
    block = re.search(r"ctypedef struct mf_sampling_params:\n((?:        .*\n)+)", pxd)
    assert block is not None, "_cfeed.pxd no longer declares mf_sampling_params"
    declared = [line.split()[-1] for line in block.group(1).splitlines() if line.strip()]
    table = [name for name, _, _ in _core._SAMPLING_PARAMS_LAYOUT[0]]
    assert declared and declared == [n for n in table if not n.startswith("_")][:len(declared)]
