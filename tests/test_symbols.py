"""The built ``_core`` extension is not stripped: profilers (perf, py-spy --native) need the C
layer's function names and, ideally, its debug info."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

import metrale_feed._core as core

# C ABI entry points and C++ internals of the C layer that a native profile should be able to name.
C_FUNCTIONS = ("mf_event_query", "mf_event_synchronize", "mf_argmax_to_feed", "mf_host_alloc")
CXX_PATTERN = re.compile(r"\bmf::host::\w+\(")


def _elf_or_skip():
    with open(core.__file__, "rb") as f:
        if f.read(4) != b"\x7fELF":
            pytest.skip("the extension is not an ELF file (symbol checks are for Linux)")


def function_symbols():
    """Names of the function symbols in the extension's symbol table, demangled where possible:
    from ``nm -C`` (types T/t/W/w), else ``readelf -Ws`` (FUNC entries, then c++filt if any)."""
    _elf_or_skip()
    nm = shutil.which("nm")
    if nm is not None:
        out = subprocess.run([nm, "-C", core.__file__], capture_output=True, text=True, check=True).stdout
        names = set()
        for line in out.splitlines():
            parts = line.split(None, 2)
            if len(parts) == 3 and parts[1] in "TtWw":
                names.add(parts[2])
        return names
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("neither nm nor readelf is installed")
    out = subprocess.run([readelf, "-Ws", core.__file__], capture_output=True, text=True, check=True).stdout
    names = [line.split()[7] for line in out.splitlines()
             if len(line.split()) >= 8 and line.split()[3] == "FUNC"]
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is not None:
        names = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True,
                               check=True).stdout.splitlines()
    return set(names)


def section_names():
    _elf_or_skip()
    readelf = shutil.which("readelf")
    if readelf is not None:
        out = subprocess.run([readelf, "-SW", core.__file__], capture_output=True, text=True, check=True).stdout
        return set(re.findall(r"\]\s+(\.\S+)", out))
    objdump = shutil.which("objdump")
    if objdump is not None:
        out = subprocess.run([objdump, "-h", core.__file__], capture_output=True, text=True, check=True).stdout
        return set(re.findall(r"^\s*\d+\s+(\.\S+)", out, re.M))
    pytest.skip("neither readelf nor objdump is installed")


def test_c_layer_function_symbols_kept():
    names = function_symbols()
    missing = [name for name in C_FUNCTIONS if name not in names]
    assert not missing, f"function symbols missing from {core.__file__}: {missing}"
    cxx = sorted(name for name in names if CXX_PATTERN.search(name))
    assert cxx, "no mf::host:: C++ function symbols: the extension looks stripped"


def test_not_stripped():
    sections = section_names()
    assert ".symtab" in sections, f"{core.__file__} has no .symtab: it was stripped"
    if ".debug_info" not in sections:
        # Allowed (a Release build), but worth seeing in the log.
        print(f"note: {core.__file__} has a .symtab but no .debug_info")
