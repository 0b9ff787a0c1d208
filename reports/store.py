"""Writing reports to the reports directory (I/O): atomically, and never over another report."""

from __future__ import annotations

import os
from pathlib import Path

from runbooks.core.errors import CudamedicError
from runbooks.core.private import private_dir, write_private


def save_report(directory: Path, name: str, text: str) -> Path:
    """Write `text` as `directory/name`, or `name-2.md`, `-3`... when a report of that name
    exists (two responses started in the same second keep both). Returns the path written."""
    private_dir(directory)
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    write_private(tmp, text.encode("utf-8"))  # 0600: a report quotes evidence
    try:
        for n in range(1, 1000):
            candidate = path if n == 1 else path.with_name(f"{path.stem}-{n}{path.suffix}")
            try:
                os.link(tmp, candidate)  # atomic, and fails rather than replace
                return candidate
            except FileExistsError:
                continue
        raise CudamedicError(f"too many reports named like {path}")
    finally:
        tmp.unlink(missing_ok=True)
