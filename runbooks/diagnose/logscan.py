"""Scan text for the error signatures of runbooks/knowledge/signatures.yaml, streaming.

`scan_stream` reads a file in chunks of whole lines and runs every signature over each chunk at
once with Hyperscan (one multi-pattern automaton, so adding signatures does not add passes); where
Hyperscan is not installed it falls back to Python's `re`, one pass per signature. Memory is
bounded by the chunk size plus a few kept lines per signature, whatever the file size.

Returns a `ScanResult`: per signature, the number of matching lines and the first and last few
lines cited with their 1-based line numbers.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import sys
import threading
from collections.abc import Callable, Iterable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import IO, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from runbooks.core.model import Frozen, Line
from runbooks.core.taxonomy import Incident

Role = Literal["cause", "symptom", "context"]
# Where a signature applies: logs, the kernel log, nvidia-smi-like output, or anywhere. A file
# scanned as "command" (output a person added) gets the log and nvidia-smi signatures both.
Where = Literal["log", "kernel", "smi", "any", "command"]
CHUNK = 8 * 1024 * 1024
KEEP = 3  # lines kept per signature at each end
MAX_LINE_TEXT = 500


class Signature(Frozen):
    id: str
    incident: Incident
    pattern: str
    role: Role
    weight: float = Field(ge=0, le=1)
    where: Where = "log"
    # Messages are matched regardless of case (frameworks and versions spell them differently:
    # "Create cuBLAS handle failed", "create cublas handle failed"); `exact` for the few whose
    # capitals carry the meaning (a shell's "Killed" line).
    exact: bool = False
    example: str
    source: str | None = Field(default=None, pattern=r"^https://\S+$")  # where it was seen


class SignatureHits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int = 0
    first: list[Line] = []
    last: list[Line] = []

    def lines(self) -> list[Line]:
        seen = {ln.line for ln in self.first}
        return self.first + [ln for ln in self.last if ln.line not in seen]


class ScanResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    lines: int = 0
    bytes: int = 0
    hits: dict[str, SignatureHits] = {}

    def merge(self, other: ScanResult) -> None:
        self.lines += other.lines
        self.bytes += other.bytes
        for sid, h in other.hits.items():
            mine = self.hits.setdefault(sid, SignatureHits())
            mine.count += h.count
            mine.first = (mine.first + h.first)[:KEEP]
            mine.last = (mine.last + h.last)[-KEEP:]


@cache
def signatures() -> tuple[Signature, ...]:
    text = resources.files("runbooks.knowledge").joinpath("signatures.yaml").read_text("utf-8")
    raw = yaml.safe_load(text)["signatures"]
    return tuple(Signature.model_validate(item) for item in raw)


def signature(sid: str) -> Signature:
    return next(s for s in signatures() if s.id == sid)


def applies(sig: Signature, kind: Where) -> bool:
    if kind == "command":
        return sig.where in ("log", "smi", "any")
    return sig.where == "any" or sig.where == kind


def cache_dir() -> Path:
    """Where compiled signature databases are kept between runs: CUDAMEDIC_CACHE_DIR, else
    $XDG_CACHE_HOME/cudamedic, else ~/.cache/cudamedic."""
    if explicit := os.environ.get("CUDAMEDIC_CACHE_DIR"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cudamedic"


def _platform() -> bytes:
    """What a compiled database depends on besides the patterns: Hyperscan's version and the
    CPU it was compiled for (a database is tuned to the CPU's instruction set)."""
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((ln for ln in f if ln.startswith(b"flags")), b"")
    except OSError:
        pass
    return f"{platform.machine()}|{sys.version_info[:2]}|".encode() + flags


def _compiled(hyperscan: Any, patterns: list[bytes], flags: list[int]) -> Any:
    """The Hyperscan database of `patterns`, from the cache when an earlier run compiled it.

    Compiling the log signatures takes 1.4 s, most of a cold `cudamedic classify`; loading takes
    0.1 ms. A cache file is named by a hash of the patterns, flags, Hyperscan version and CPU, and
    holds its own SHA-256: a file that is truncated, edited or from another machine is compiled
    afresh and replaced; a cache directory that others can write is not read. A cache that cannot
    be read or written is no error, only slower.
    """
    version = str(getattr(hyperscan, "__version__", "?")).encode()
    key = hashlib.sha256(version + _platform())
    for pattern, flag in zip(patterns, flags, strict=True):
        key.update(b"%d\0%s\0" % (flag, pattern))
    path = cache_dir() / f"signatures-{key.hexdigest()[:32]}.hsdb"
    try:
        # Only a directory that nobody else can write: a database is code for the scanner.
        owner = path.parent.stat()
        if owner.st_uid != os.getuid() or owner.st_mode & 0o022:
            raise PermissionError(f"{path.parent} is writable by others")
        blob = path.read_bytes()
        digest, payload = blob[:32], blob[32:]
        if hashlib.sha256(payload).digest() == digest:
            return hyperscan.loadb(payload, hyperscan.HS_MODE_BLOCK)
    except (OSError, hyperscan.error):
        pass
    db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    db.compile(
        expressions=patterns, ids=list(range(len(patterns))), elements=len(patterns), flags=flags
    )
    try:
        payload = hyperscan.dumpb(db)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except (OSError, hyperscan.error):
        pass
    return db


class _Matcher:
    """Compiled signatures for one kind of source; `scan(chunk, on_match)` over bytes."""

    def __init__(self, sigs: tuple[Signature, ...]) -> None:
        self.sigs = sigs
        self._hs: Any = None
        self._local = threading.local()
        try:
            import hyperscan

            self._hs = _compiled(
                hyperscan,
                [s.pattern.encode() for s in sigs],
                [
                    hyperscan.HS_FLAG_MULTILINE | (0 if s.exact else hyperscan.HS_FLAG_CASELESS)
                    for s in sigs
                ],
            )
        except ImportError:
            self._res = [
                re.compile(s.pattern.encode(), re.MULTILINE | (0 if s.exact else re.IGNORECASE))
                for s in sigs
            ]

    def _scratch(self) -> Any:
        """Hyperscan scratch space is per thread: one shared scratch raises ScratchInUseError
        when two threads scan at once (a sweep checks hosts in parallel)."""
        import hyperscan

        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = hyperscan.Scratch(self._hs)
        return scratch

    def scan(self, chunk: bytes | memoryview, on_match: Callable[[int, int], None]) -> None:
        if self._hs is not None:

            def handler(idx: int, start: int, end: int, flags: int, ctx: object) -> None:
                on_match(idx, end)

            self._hs.scan(chunk, match_event_handler=handler, scratch=self._scratch())
            return
        found: list[tuple[int, int]] = []
        for idx, rx in enumerate(self._res):
            found.extend((m.end(), idx) for m in rx.finditer(chunk))
        for end, idx in sorted(found):
            on_match(idx, end)


@cache
def _matcher(kind: Where) -> _Matcher:
    return _Matcher(tuple(s for s in signatures() if applies(s, kind)))


def scan_stream(
    stream: IO[bytes], source: str, kind: Where = "log", chunk_size: int = CHUNK
) -> ScanResult:
    """Scan a binary stream; never raises on content (binary junk, huge lines, bad UTF-8).

    Each read is scanned in place (a memoryview, no copy) from its first to its last newline;
    only the partial line around a read boundary is joined and scanned on its own.
    """
    matcher = _matcher(kind)
    result = ScanResult(source=source)
    carry = b""
    line = 0  # complete lines before the current position
    while True:
        data = stream.read(chunk_size)
        if not data:
            if carry:
                _scan_piece(matcher, carry, 0, len(carry), line, result)
                line += 1
            break
        result.bytes += len(data)
        first = data.find(b"\n")
        if first < 0:
            carry += data
            if len(carry) > 4 * chunk_size:  # one huge line: scan it in pieces, bounded memory
                _scan_piece(matcher, carry, 0, len(carry), line, result)
                carry = b""
            continue
        head = carry + data[: first + 1]
        _scan_piece(matcher, head, 0, len(head), line, result)
        line += 1
        last = data.rfind(b"\n")
        if last > first:
            _scan_piece(matcher, data, first + 1, last + 1, line, result)
            line += data.count(b"\n", first + 1, last + 1)
        carry = data[last + 1 :]
    result.lines = line
    return result


def scan_text(text: str, source: str, kind: Where = "log") -> ScanResult:
    import io

    return scan_stream(io.BytesIO(text.encode("utf-8", errors="replace")), source, kind)


def _scan_piece(
    matcher: _Matcher, data: bytes, begin: int, end: int, base_line: int, result: ScanResult
) -> None:
    """Scan data[begin:end] (whole lines); line numbers start after `base_line` lines."""
    cursor_off = begin
    cursor_line = 0  # newlines in data[begin:cursor_off]
    last_line_of: dict[int, int] = {}

    def on_match(idx: int, match_end: int) -> None:
        nonlocal cursor_off, cursor_line
        pos = begin + max(match_end - 1, 0)
        if pos >= cursor_off:
            cursor_line += data.count(b"\n", cursor_off, pos)
        else:  # an out-of-order report (rare): count from the start
            cursor_line = data.count(b"\n", begin, pos)
        cursor_off = pos
        line_no = base_line + cursor_line + 1
        if last_line_of.get(idx) == line_no:
            return  # one count per line and signature
        last_line_of[idx] = line_no
        hits = result.hits.setdefault(matcher.sigs[idx].id, SignatureHits())
        hits.count += 1
        start = data.rfind(b"\n", begin, pos) + 1 or begin
        stop = data.find(b"\n", pos, end)
        raw = data[max(start, begin) : stop if stop >= 0 else end]
        text = raw[: MAX_LINE_TEXT * 4].decode("utf-8", errors="replace").rstrip("\r")
        if len(text) > MAX_LINE_TEXT:
            text = text[:MAX_LINE_TEXT] + "…"
        cited = Line(source=result.source, line=line_no, text=text)
        if len(hits.first) < KEEP:
            hits.first.append(cited)
        else:
            hits.last.append(cited)
            if len(hits.last) > KEEP:
                del hits.last[0]

    matcher.scan(memoryview(data)[begin:end], on_match)


def ere_patterns(kind: Where = "log") -> Iterable[str]:
    """The signature patterns as POSIX ERE (for `grep -E` in the benchmark)."""
    return (s.pattern for s in signatures() if applies(s, kind))
