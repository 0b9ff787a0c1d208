"""Files cudamedic writes that hold evidence (bundles, reports): readable by their owner only,
whatever the umask (issue 27: they were 0644/0755; the journal and audit log already 0600).
Redaction is best effort; what it misses must not be world-readable."""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path, *, exist_ok: bool = True) -> Path:
    """Create `path` (and its missing parents) 0700; an existing one is left as it is."""
    path.mkdir(parents=True, exist_ok=exist_ok, mode=DIR_MODE)
    return path


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` (created or truncated), 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a file that existed keeps its mode otherwise
        with os.fdopen(fd, "wb", closefd=False) as f:
            f.write(data)
    finally:
        os.close(fd)


def create_private(path: Path) -> int:
    """A new file's descriptor, 0600 (FileExistsError when it exists)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
