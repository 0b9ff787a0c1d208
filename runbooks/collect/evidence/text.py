"""Text helpers shared by the evidence parsers: line splitting, binary detection, citing."""

from __future__ import annotations

import re

from runbooks.core.model import Finding, Line

MAX_LINE_CHARS = 2000  # text kept for a cited line
MAX_SCAN_CHARS = 100_000  # longer lines are cited, never parsed: keeps every regex cheap


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ufffd]")


def split_lines(text: str) -> list[str]:
    """Split on ``\\n`` only (not ``str.splitlines``), so line numbers match ``wc -l``/editors
    even when binary junk contains form feeds or other separators; drop a trailing ``\\r``."""
    parts = text.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def looks_binary(text: str) -> bool:
    sample = text[:65536]
    if not sample:
        return False
    return "\x00" in sample or len(_CONTROL.findall(sample)) > max(8, len(sample) // 100)


def cite(source: str, number: int, text: str) -> Line:
    return Line(source=source, line=number, text=text[:MAX_LINE_CHARS].rstrip())


def binary_input(source: str, what: str = "") -> Finding:
    """The finding for a file that holds control characters or NUL bytes."""
    suffix = f"; {what}" if what else ""
    return Finding(
        code="binary-input",
        source=source,
        severity="warning",
        message=f"file contains control characters or NUL bytes{suffix}",
    )


def too_long(source: str, number: int, length: int) -> Finding:
    """The finding for a line longer than MAX_SCAN_CHARS (cited, never parsed)."""
    return Finding(
        code="line-too-long",
        message=f"line of {length} characters skipped",
        source=source,
        line=number,
    )
