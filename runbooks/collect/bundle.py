"""The evidence bundle: ``bundle.json`` metadata and reading a bundle from disk.

Layout: docs/spec/evidence-bundle.md. A bundle is a directory, a ``.tar.gz`` of one, or — for
``classify`` — a single log file treated as the container log. Readers never fail on a missing
or unparsable file; they record a finding.
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import IO, Literal

from pydantic import Field, ValidationError

from runbooks.core.errors import InputError
from runbooks.core.model import Finding, Frozen
from runbooks.core.names import display

SCHEMA_VERSION = 1
SourceStatus = Literal["ok", "failed", "timeout", "error", "skipped"]


class SourceResult(Frozen):
    """What happened to one evidence source during collection."""

    name: str
    path: str | None = None  # bundle-relative file written, if any
    status: SourceStatus
    command: str | None = None
    exit_code: int | None = None
    duration_s: float = 0.0
    error: str | None = None
    note: str | None = None
    truncated: bool = False
    bytes_seen: int = 0


class BundleMeta(Frozen):
    schema_version: int = SCHEMA_VERSION
    host: str
    target: str
    containers: tuple[str, ...] = ()
    collected_at: datetime
    duration_s: float = 0.0
    trigger: str | None = None
    collector: dict[str, str] = Field(default_factory=dict)
    sources: tuple[SourceResult, ...] = ()
    findings: tuple[Finding, ...] = ()


SMALL_FILE_BYTES = 16 * 1024 * 1024  # larger files are streamed, never read whole
MEMORY_BUDGET_BYTES = 64 * 1024 * 1024  # small files read into memory, in all
MAX_TAR_MEMBERS = 10_000
MAX_EXTRACT_BYTES = 1024**3 + 64 * 1024**2  # collected logs are bounded (tails, caps) far below
LOG_FILE = "containers/log.log"
# The bundle layout (docs/spec/evidence-bundle.md): anything else in a bundle directory (a
# README, a case.yaml with its label, stray files) is not evidence and is never read.
_TOP_FILES = frozenset(
    {
        "bundle.json",
        "trigger.txt",
        "nvidia-smi.txt",
        "nvidia-smi.xml",
        "dmesg.txt",
        "docker-info.json",
        "nccl-tests.txt",
    }
)


def in_layout(rel: str) -> bool:
    """Is this bundle-relative path one of the bundle's evidence files?"""
    parts = PurePosixPath(rel).parts
    if len(parts) == 1:
        return rel in _TOP_FILES
    return len(parts) == 2 and parts[0] in ("commands", "containers")


class Bundle(Frozen):
    """An evidence bundle: metadata, small files as text, large files by path (streamed)."""

    meta: BundleMeta | None = None
    files: dict[str, str] = Field(default_factory=dict)
    large: dict[str, Path] = Field(default_factory=dict)
    findings: tuple[Finding, ...] = ()
    origin: str = ""

    def names(self) -> list[str]:
        return sorted({*self.files, *self.large})

    def has(self, rel: str) -> bool:
        """Whether the bundle holds `rel` (constant time: `names()` sorts them all)."""
        return rel in self.files or rel in self.large

    def open(self, rel: str) -> IO[bytes]:
        if rel in self.large:
            return self.large[rel].open("rb")
        return io.BytesIO(self.files.get(rel, "").encode("utf-8", errors="replace"))

    def text(self, rel: str, limit: int = SMALL_FILE_BYTES) -> str | None:
        """A file's text; for a large file, its last `limit` bytes (newest lines)."""
        if rel in self.files:
            return self.files[rel]
        if rel in self.large:
            return _tail(self.large[rel], limit)
        return None

    def container_names(self) -> list[str]:
        return sorted(
            {
                PurePosixPath(p).name.split(".", 1)[0]
                for p in self.names()
                if p.startswith("containers/")
            }
        )


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _tail(path: Path, limit: int) -> str:
    size = path.stat().st_size
    with path.open("rb") as fh:
        if size > limit:
            fh.seek(size - limit)
            fh.readline()  # resync on a line boundary
        return _decode(fh.read(limit))


@contextlib.contextmanager
def open_bundle(path: Path) -> Iterator[Bundle]:
    """Open a bundle directory, a bundle .tar.gz (extracted to a temporary directory), or a
    single log file (treated as the container log). Raises InputError if unreadable."""
    if not path.exists():
        raise InputError(f"{path}: no such file or directory")
    if not (path.is_dir() or path.is_file()):
        # A FIFO, socket or device would block or never end: only files and directories.
        raise InputError(f"{path}: not a regular file or directory")
    if path.is_dir():
        yield _read_dir(path, str(path))
        return
    if path.name.endswith((".tar.gz", ".tgz")):
        with tempfile.TemporaryDirectory(prefix="cudamedic-bundle-") as tmp:
            findings = _extract_tar(path, Path(tmp))
            root = Path(tmp)
            entries = [p for p in root.iterdir()]
            if len(entries) == 1 and entries[0].is_dir():
                root = entries[0]
            bundle = _read_dir(root, str(path))
            yield bundle.model_copy(update={"findings": bundle.findings + tuple(findings)})
        return
    try:
        size = path.stat().st_size
        if size > SMALL_FILE_BYTES:
            yield Bundle(large={LOG_FILE: path}, origin=str(path))
        else:
            yield Bundle(files={LOG_FILE: _decode(path.read_bytes())}, origin=str(path))
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc}") from exc


def _layout_files(root: Path) -> list[Path]:
    """The bundle layout's files under root, without walking deeper than it goes (a hostile
    bundle may nest thousands of directories), and at most MAX_TAR_MEMBERS of them, as in a
    .tar.gz: InputError past that."""
    out: list[Path] = []
    for top in _entries(root, 0):
        if top.is_dir() and not top.is_symlink() and top.name in ("commands", "containers"):
            out.extend(_entries(top, len(out)))
        else:
            out.append(top)
    return out


def _entries(folder: Path, before: int) -> list[Path]:
    found: list[Path] = []
    for entry in folder.iterdir():
        found.append(entry)
        if before + len(found) > MAX_TAR_MEMBERS:
            raise InputError(
                f"{folder}: more than {MAX_TAR_MEMBERS} entries; not an evidence bundle"
            )
    return sorted(found)


def is_bundle_dir(root: Path) -> bool:
    """Does this directory hold any file of the bundle layout (bundle.json, nvidia-smi.txt,
    dmesg.txt, trigger.txt, commands/*, containers/*, ...)?"""
    try:
        return any(
            f.is_file() and in_layout(f.relative_to(root).as_posix()) for f in _layout_files(root)
        )
    except OSError as exc:
        raise InputError(f"{root}: cannot read: {exc}") from exc


def _read_dir(root: Path, origin: str) -> Bundle:
    files: dict[str, str] = {}
    large: dict[str, Path] = {}
    findings: list[Finding] = []
    in_memory = 0
    try:
        for file in _layout_files(root):
            if not file.is_file() or file.is_symlink():
                continue
            rel = file.relative_to(root).as_posix()
            if not in_layout(rel):
                findings.append(
                    Finding(
                        code="not-evidence",
                        source=rel,
                        message="not a file of the bundle layout; not read",
                    )
                )
                continue
            size = file.stat().st_size
            if size > SMALL_FILE_BYTES or in_memory + size > MEMORY_BUDGET_BYTES:
                large[rel] = file  # streamed when scanned, never read whole
            else:
                in_memory += size
                files[rel] = _decode(file.read_bytes())
    except OSError as exc:
        raise InputError(f"{origin}: cannot read: {exc}") from exc
    meta = None
    if "bundle.json" in files:
        try:
            meta = BundleMeta.model_validate(json.loads(files["bundle.json"]))
        except (ValueError, ValidationError, RecursionError) as exc:
            findings.append(
                Finding(
                    code="bundle-json-invalid",
                    source="bundle.json",
                    severity="warning",
                    message=f"bundle.json unreadable: {str(exc).splitlines()[0]}",
                )
            )
    return Bundle(meta=meta, files=files, large=large, findings=tuple(findings), origin=origin)


def _extract_tar(path: Path, dest: Path) -> list[Finding]:
    """Extract the bundle files of a .tar.gz (one top directory allowed), within bounds: at
    most MAX_TAR_MEMBERS entries and MAX_EXTRACT_BYTES extracted; anything outside the bundle
    layout is skipped. A bomb is refused with a clear error, never unpacked."""
    findings: list[Finding] = []
    members = 0
    total = 0
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:  # streaming: never the whole member list in memory
                members += 1
                if members > MAX_TAR_MEMBERS:
                    raise InputError(
                        f"{path}: more than {MAX_TAR_MEMBERS} entries; not an evidence bundle"
                    )
                parts = PurePosixPath(member.name).parts
                if member.isdir():
                    continue
                rel = (
                    "/".join(parts[1:])
                    if len(parts) > 1 and not in_layout(member.name)
                    else member.name
                )
                if (
                    not member.isfile()
                    or member.name.startswith("/")
                    or ".." in parts
                    or not in_layout(rel)
                ):
                    if len(findings) < 100:
                        findings.append(
                            Finding(
                                code="tar-member-skipped",
                                source=display(member.name, 200),
                                message="not a file of the bundle layout",
                            )
                        )
                    continue
                total += member.size
                if total > MAX_EXTRACT_BYTES:
                    raise InputError(
                        f"{path}: expands to more than {MAX_EXTRACT_BYTES // 2**20} MiB; "
                        "refused (not unpacked)"
                    )
                tar.extract(member, dest, filter="data")
    except (tarfile.TarError, EOFError, OSError, RecursionError) as exc:
        raise InputError(f"{path}: not a readable .tar.gz bundle: {exc}") from exc
    return findings


def write_tar(bundle_dir: Path) -> Path:
    """Pack a bundle directory as <dir>.tar.gz beside it."""
    from runbooks.core.private import write_private

    target = bundle_dir.with_name(bundle_dir.name + ".tar.gz")
    write_private(target, b"")  # 0600 before a byte of evidence is in it
    with target.open("r+b") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        tar.add(bundle_dir, arcname=bundle_dir.name)
    return target


def dumps_json(data: object) -> str:
    return json.dumps(data, indent=2, sort_keys=True, default=str) + "\n"
