"""Figures of the reliability suites: sizes, and a record of every figure with its goal.

`CUDAMEDIC_RELIABILITY=full` (set by `make reliability`) runs every suite at the issue's full
size; the default `small` is what CI runs. Each suite calls `record(...)` for each figure; the
figures are printed after the run (tests/conftest.py) and written as JSON lines to
`CUDAMEDIC_FIGURES` when that is set.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

SIZE = os.environ.get("CUDAMEDIC_RELIABILITY", "small")
FULL = SIZE == "full"


def size(small: int, full: int) -> int:
    """The number of runs/examples for the current size."""
    return full if FULL else small


@dataclass(frozen=True)
class Figure:
    suite: str
    name: str
    value: float | int | str
    goal: str = ""
    met: bool | None = None


FIGURES: list[Figure] = []


def record(
    suite: str, name: str, value: float | int | str, goal: str = "", met: bool | None = None
) -> None:
    """Keep one figure. `goal` is what it should be (e.g. "0"); `met` whether it is."""
    figure = Figure(suite, name, value, goal, met)
    FIGURES.append(figure)
    out = os.environ.get("CUDAMEDIC_FIGURES")
    if out:
        with Path(out).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({**asdict(figure), "size": SIZE}) + "\n")


def zero(suite: str, name: str, value: int) -> None:
    """Record a figure whose goal is 0."""
    record(suite, name, value, "0", value == 0)


def table() -> list[str]:
    """The figures as aligned lines, grouped by suite in the order they were recorded."""
    if not FIGURES:
        return []
    lines = [f"reliability figures (size: {SIZE})"]
    width = max(len(f.name) for f in FIGURES)
    suite = None
    for f in FIGURES:
        if f.suite != suite:
            suite = f.suite
            lines.append(f"[{suite}]")
        value = f"{f.value:.2f}" if isinstance(f.value, float) else str(f.value)
        mark = "" if f.met is None else ("  ok" if f.met else "  NOT MET")
        goal = f"  (goal {f.goal})" if f.goal else ""
        lines.append(f"  {f.name:{width}}  {value:>10}{goal}{mark}")
    return lines
