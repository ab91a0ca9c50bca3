"""The bench's report: each figure printed beside its baseline, ratio, target and verdict, and the
machine it ran on."""

from __future__ import annotations

import os
import platform
import re
import time
from typing import Any, Callable, Dict, List, Optional

import metrale_feed as mf

NO_TOKEN = mf.NO_TOKEN
LARGE = (256, 152064)

def section(title: str) -> None:
    print(f"\n== {title}")
    row("figure", "value", "baseline", "ratio", "target", mark="result")


_TARGET = re.compile(r"^(<=|>=|<|>)\s*(\d+(?:\.\d+)?)\s*(x|ns|us|ms|s)$")
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(x|ns|us|ms|s)\b")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
VERDICTS: List[Any] = []  # (row, verdict) of every printed row with a target, in order
_LAST_NAME = ""


def verdict(value: str, ratio: str, target: str) -> str:
    """Whether a printed figure meets its printed target: "met", "MISSED", "not measured", or ""
    for a row without a target. A target in ``x`` reads the ratio column; one in a time unit reads
    the value column (in any time unit); a word target ("no") must equal the value."""
    if not target:
        return ""
    rule = _TARGET.match(target.strip())
    if rule is None:
        return "met" if value.strip() == target.strip() else "MISSED"
    op, bound, unit = rule.group(1), float(rule.group(2)), rule.group(3)
    figure = _NUMBER.match(ratio if unit == "x" else value)
    if figure is None or (unit == "x") != (figure.group(2) == "x"):
        return "not measured"
    got = float(figure.group(1))
    if unit != "x":
        got, bound = got * _SECONDS[figure.group(2)], bound * _SECONDS[unit]
    ok = {"<=": got <= bound, ">=": got >= bound, "<": got < bound, ">": got > bound}[op]
    return "met" if ok else "MISSED"


def row(name: str, value: str, base: str = "", ratio: str = "", target: str = "",
         note: str = "", mark: Optional[str] = None) -> None:
    global _LAST_NAME
    if mark is None:
        # A row without a name is a second baseline of the row above.
        label = name.strip() or f"{_LAST_NAME} vs {' '.join(base.split()[:2])}"
        _LAST_NAME = name.strip() or _LAST_NAME
        mark = verdict(value, ratio, target)
        if mark:
            VERDICTS.append((label, mark))
    line = f"  {name:<30} {value:>11}  {base:<26} {ratio:>10}  {target:<10} {mark:<12} {note}"
    print(line.rstrip(), flush=True)


def cimport_reason(reason: str) -> str:
    """The cimport row's failure, with what to install when that is the cause."""
    if "no module named cython" in reason.lower():
        return "Cython is not installed: pip install 'metrale-feed[cython]'"
    if reason.startswith("compiler"):
        return f"{reason} (a C compiler is needed: install gcc or clang)"
    return reason


def timed(fn: Callable[[], Any]) -> float:
    """Milliseconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def machine() -> Dict[str, Any]:
    import numpy as np

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpu_count": os.cpu_count(), "cpus_usable": usable, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "backend": mf.backend(),
            "build": mf.build_info(), "metrale_feed": mf.__version__}

