"""Fix journal, per-container lock and audit log: files on the machine running cudamedic.

- The journal (``STATE/journal/HOST/CONTAINER.jsonl``) gets one JSON line per step, written and
  fsync'd *before* the step is done: the post-mortem's timeline. It is a cache: what a recovery
  needs is on the target (runbooks/fix/fixlock.py), so another machine can finish the fix.
- The lock (``STATE/locks/HOST--CONTAINER.lock``, ``flock``) keeps two fixes of one container
  from running at once on this machine cheaply; the lock on the target holds across machines.
- The audit log (``STATE/audit.jsonl``) records who did what, when, before and after; each
  record is also a Prefect event (runbooks/fix/audit.py), the fleet's trail that `cudamedic audit`
  reads. The local file is this machine's cache (the per-hour fix cap counts it).
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from runbooks.core.errors import FixLocked

TERMINAL = frozenset({"done", "rolled-back", "manual-rollback-done"})


def _safe(part: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in part)


def now() -> datetime:
    return datetime.now(UTC)


def _append(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
            continue  # a line cut by a crash mid-write
        if isinstance(record, dict):
            out.append(record)
    return out


class Journal:
    def __init__(self, state_dir: Path, host: str, container: str) -> None:
        self.path = state_dir / "journal" / _safe(host) / f"{_safe(container)}.jsonl"
        self.host, self.container = host, container

    def write(self, step: str, **data: Any) -> None:
        _append(self.path, {"at": now().isoformat(), "step": step, **data})

    def records(self) -> list[dict[str, Any]]:
        return _read(self.path)

    def current(self) -> list[dict[str, Any]]:
        """Records of the latest fix (from its 'begin')."""
        records = self.records()
        starts = [i for i, r in enumerate(records) if r.get("step") == "begin"]
        return records[starts[-1] :] if starts else []

    def unfinished(self) -> list[dict[str, Any]] | None:
        cur = self.current()
        if cur and cur[-1].get("step") not in TERMINAL:
            return cur
        return None

    def fixes(self) -> list[list[dict[str, Any]]]:
        """Every fix in the journal, oldest first."""
        out: list[list[dict[str, Any]]] = []
        for r in self.records():
            if r.get("step") == "begin":
                out.append([r])
            elif out:
                out[-1].append(r)
        return out


@contextlib.contextmanager
def container_lock(state_dir: Path, host: str, container: str) -> Iterator[None]:
    path = state_dir / "locks" / f"{_safe(host)}--{_safe(container)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FixLocked(
                f"another fix of {host}/{container} is running (lock {path}); try again later"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing releases the flock


def who() -> str:
    user = os.environ.get("CUDAMEDIC_ACTOR") or os.environ.get("SUDO_USER") or getpass.getuser()
    return f"{user}@{socket.gethostname()}"


def audit(state_dir: Path, action: str, **data: Any) -> None:
    """Record an action: in the local audit log, and as a Prefect event. Redacted first: a
    secret in a `docker run` line or a message never reaches the trail."""
    from runbooks.collect.redact import redact_argv, redact_json
    from runbooks.fix import audit as trail

    plain = {"at": now().isoformat(), "who": who(), "action": action, **data}
    record = redact_json(json.loads(json.dumps(plain, default=str)))
    for key in ("before", "after"):  # `docker run` argument lists
        if isinstance(record.get(key), list):
            record[key] = redact_argv([str(a) for a in record[key]])
    _append(state_dir / "audit.jsonl", record)
    trail.emit(record)


def audit_records(state_dir: Path) -> list[dict[str, Any]]:
    return _read(state_dir / "audit.jsonl")


def applied_within(
    state_dir: Path, window: timedelta, fleet: str | None = None, *, fleet_wide: bool = True
) -> int:
    """How many fixes were applied within the window: `fleet`'s only when it is given (another
    fleet this machine served does not count); with `fleet_wide`, from the Prefect server's audit
    events too when it answers, never fewer than this machine's own audit log counts for that
    fleet (the cap must not loosen when Prefect cannot be asked)."""
    cutoff = now() - window
    local = 0
    for r in audit_records(state_dir):
        if r.get("action") != "apply":
            continue
        if fleet is not None and r.get("fleet", "default") != fleet:
            continue  # another fleet's fix (this machine may have served several)
        try:
            at = datetime.fromisoformat(str(r.get("at")))
        except ValueError:
            continue
        if at >= cutoff:
            local += 1
    if fleet is None or not fleet_wide:
        return local
    from runbooks.fix.audit import applied_in_fleet

    in_prefect = applied_in_fleet(fleet, cutoff)
    return max(local, in_prefect or 0)
