"""Shared pydantic models that cross module boundaries.

Parsers (runbooks/evidence/*) return their own frozen fact models; what they share is defined
here: a cited evidence line (`Line`) and a `Finding` for anything odd they met. Line numbers
are 1-based and refer to the bundle file named in `source` (a path relative to the bundle root,
e.g. ``"dmesg.txt"`` or ``"containers/train.log"``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Severity = Literal["info", "warning", "error"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Line(Frozen):
    """One line of evidence, cited by bundle file and 1-based line number."""

    source: str
    line: int
    text: str


class Finding(Frozen):
    """Something a parser or collector noticed that is not a parse result.

    `code` is a stable kebab-case id (e.g. ``"xml-truncated"``, ``"smi-err-field"``).
    Parsers never raise on garbage; they return what they could read plus findings.
    """

    code: str
    message: str
    source: str = ""
    line: int | None = None
    severity: Severity = "info"
