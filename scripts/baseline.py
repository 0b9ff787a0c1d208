#!/usr/bin/env python3
"""The naive baseline every accuracy round is compared with: 20 regular expressions, first match.

What an on-call engineer's grep list looks like: one pattern per well-known message, tried in
order over all the text of a case (every evidence file, concatenated); the first pattern that
matches anywhere names the class; nothing matches -> ``unknown``. It never says ``healthy``.
Frozen on 2026-12-03 before the first blind round was scored: do not tune it, or the comparison
in docs/accuracy.md means nothing.

Usage: scripts/baseline.py CASE_DIR...   (prints "case<TAB>class" per case)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PATTERNS: tuple[tuple[str, str], ...] = (
    (
        "gpu-hardware-fault",
        r"fallen off the bus|Xid.{0,40}\b(48|79|94|95|119|120)\b|uncorrectable ECC",
    ),
    ("driver-not-loaded", r"couldn't communicate with the NVIDIA driver"),
    ("driver-library-mismatch", r"Driver/library version mismatch"),
    ("driver-too-old", r"driver version is insufficient|NVIDIA driver on your system is too old"),
    (
        "container-toolkit-missing",
        r"could not select device driver|unknown or invalid runtime name: nvidia"
        r"|nvidia-container-cli",
    ),
    ("cpu-only-build", r"Torch not compiled with CUDA"),
    ("arch-unsupported", r"no kernel image is available"),
    ("invalid-device-ordinal", r"invalid device ordinal"),
    ("host-oom-killed", r"OOMKilled|Out of memory: Killed process|exit code 137"),
    ("cuda-oom", r"CUDA out of memory|OutOfMemoryError"),
    ("cuda-illegal-access", r"illegal memory access|device-side assert"),
    ("shm-too-small", r"Bus error|insufficient shared memory"),
    ("memlock-limit", r"ibv_reg_mr|memlock"),
    ("nccl-timeout", r"collective operation timeout|ProcessGroupNCCL.{0,80}[Tt]imeout"),
    ("nccl-slow-transport", r"NET/Socket|Could not enable P2P"),
    ("nccl-error", r"NCCL error|ncclInternalError|ncclSystemError|unhandled system error"),
    ("ssh-access-denied", r"Permission denied \(publickey"),
    ("volume-permission-denied", r"PermissionError: \[Errno 13\]"),
    ("disk-full", r"No space left on device"),
    (
        "gpu-not-requested",
        r"Found no NVIDIA driver|is_available\(\)\W{0,5}(returns )?False|nvidia-smi: not found",
    ),
)
_COMPILED = tuple((cls, re.compile(p)) for cls, p in PATTERNS)
assert len(PATTERNS) == 20


def case_text(case: Path) -> str:
    parts = []
    for f in sorted(case.rglob("*")):
        if f.is_file() and f.name != "case.yaml":
            parts.append(f.read_bytes().decode("utf-8", errors="replace"))
    return "\n".join(parts)


def baseline(text: str) -> str:
    for cls, pattern in _COMPILED:
        if pattern.search(text):
            return cls
    return "unknown"


def main(argv: list[str]) -> int:
    for arg in argv:
        print(f"{Path(arg).name}\t{baseline(case_text(Path(arg)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
