"""A fix's record and lock on the target itself, so any machine can finish or roll it back.

Before a fix (or a rollback by hand) changes anything, it creates the container
``NAME-cudamedic-fix-lock`` on the target's engine: never started, no image pulled (it is made from
the original's own image), labelled with what a recovery needs — the original's id and name, the
backup's name (which encodes the fix), the original's restart policy and whether it ran — and who
holds it. Docker refuses a second container of that name (409 Conflict), so the create is an
atomic test-and-set: two fixes of one container, from any machines, never both proceed. The
replacement is created with the same ``cudamedic.fix.*`` labels; the backup is the original itself.

The lock is removed when the fix commits (replacement verified) or has been rolled back, so a lock
left on the target means an interrupted fix. A lock whose holder is gone may be taken over: at
once when the holder ran on this machine and its process is dead, otherwise when its lease (how
long a fix can take) has run out by the engine's own clock. Pure helpers first, then engine I/O.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from runbooks.collect.evidence.docker_inspect import docker_time
from runbooks.collect.remote.docker import DockerEngine
from runbooks.core.errors import ContainerNotFound, EngineError, FixError, FixLocked
from runbooks.core.model import Frozen
from runbooks.core.names import FIX_LOCK_SUFFIX
from runbooks.core.settings import Settings
from runbooks.fix.journal import who

PREFIX = "cudamedic.fix."
Kind = Literal["fix", "manual-rollback"]


class FixRecord(Frozen):
    """What a recovery needs to put the original back: on the lock and on the replacement."""

    kind: Kind = "fix"
    name: str
    original_id: str
    backup: str  # the backup's name; names the fix (it holds the fix's time)
    restart_policy: dict[str, Any]
    was_running: bool
    replaced: str | None = None  # manual rollback: the name the replacement is kept under


class Holder(Frozen):
    who: str
    machine: str  # hostname and boot id: the same machine, the same boot
    pid: int
    pid_start: str  # the process's start time in clock ticks (/proc/PID/stat), against pid reuse
    lease_s: float


class Lock(Frozen):
    id: str  # the marker container's id
    image: str  # the image id it was made from (the original's)
    record: FixRecord
    holder: Holder
    created: datetime  # by the engine's clock


# -- pure ------------------------------------------------------------------------------------
def lock_name(name: str) -> str:
    return f"{name}{FIX_LOCK_SUFFIX}"


def record_labels(record: FixRecord) -> dict[str, str]:
    out = {
        f"{PREFIX}kind": record.kind,
        f"{PREFIX}name": record.name,
        f"{PREFIX}original-id": record.original_id,
        f"{PREFIX}backup": record.backup,
        f"{PREFIX}restart-policy": json.dumps(record.restart_policy, sort_keys=True),
        f"{PREFIX}was-running": "true" if record.was_running else "false",
    }
    if record.replaced:
        out[f"{PREFIX}replaced"] = record.replaced
    return out


def holder_labels(holder: Holder) -> dict[str, str]:
    return {
        f"{PREFIX}holder": holder.who,
        f"{PREFIX}holder-machine": holder.machine,
        f"{PREFIX}holder-pid": str(holder.pid),
        f"{PREFIX}holder-pid-start": holder.pid_start,
        f"{PREFIX}lease-s": f"{holder.lease_s:g}",
    }


def record_from_labels(labels: dict[str, Any] | None) -> FixRecord | None:
    """The fix a container's labels name (a replacement's or a lock's); None without them."""
    lab = labels or {}
    if f"{PREFIX}backup" not in lab:
        return None
    try:
        policy = json.loads(str(lab.get(f"{PREFIX}restart-policy") or "{}"))
        return FixRecord(
            kind="manual-rollback" if lab.get(f"{PREFIX}kind") == "manual-rollback" else "fix",
            name=str(lab[f"{PREFIX}name"]),
            original_id=str(lab[f"{PREFIX}original-id"]),
            backup=str(lab[f"{PREFIX}backup"]),
            restart_policy=policy if isinstance(policy, dict) else {},
            was_running=lab.get(f"{PREFIX}was-running") == "true",
            replaced=str(lab[f"{PREFIX}replaced"]) if lab.get(f"{PREFIX}replaced") else None,
        )
    except (KeyError, ValueError, RecursionError):
        return None


def foreign(record: FixRecord, name: str) -> str | None:
    """Why a record read from the target is not a record of a fix of container `name` (labels
    are whatever anyone put there: a crafted `web-cudamedic-fix-lock` naming `db` made the
    recovery of `web` remove `db`), or None when it is."""
    stamp = r"-\d{8}T\d{6}Z"
    if record.name != name:
        return f"it names container {record.name[:80]!r}, not {name!r}"
    if not re.fullmatch(re.escape(name) + "-cudamedic-backup" + stamp, record.backup):
        return f"its backup {record.backup[:120]!r} is not a backup name of {name!r}"
    if record.replaced is not None and not re.fullmatch(
        re.escape(name) + "-cudamedic-replaced" + stamp, record.replaced
    ):
        return f"its replacement name {record.replaced[:120]!r} is not one of {name!r}"
    if not re.fullmatch(r"[0-9a-f]{12,64}", record.original_id):
        return "its original container id is not a container id"
    return None


def parse_lock(inspect: dict[str, Any]) -> Lock | None:
    labels = (inspect.get("Config") or {}).get("Labels") or {}
    record = record_from_labels(labels)
    created = docker_time(inspect.get("Created"))
    if record is None or created is None:
        return None
    try:
        holder = Holder(
            who=str(labels.get(f"{PREFIX}holder") or "?"),
            machine=str(labels.get(f"{PREFIX}holder-machine") or "?"),
            pid=int(labels.get(f"{PREFIX}holder-pid") or 0),
            pid_start=str(labels.get(f"{PREFIX}holder-pid-start") or ""),
            lease_s=_lease(labels.get(f"{PREFIX}lease-s")),
        )
    except ValueError:
        return None
    return Lock(
        id=str(inspect.get("Id")),
        image=str(inspect.get("Image")),
        record=record,
        holder=holder,
        created=created,
    )


def _lease(value: object) -> float:
    """A lease label as seconds, within [0, 1 day] (garbage from a hostile engine included)."""
    try:
        seconds = float(str(value or 0))
    except ValueError:
        return 0.0
    return min(max(seconds, 0.0), 86400.0) if math.isfinite(seconds) else 0.0


def lease_ends(lock: Lock) -> datetime:
    return lock.created + timedelta(seconds=lock.holder.lease_s)


def why_live(lock: Lock, engine_now: datetime, me: Holder, holder_alive: bool | None) -> str | None:
    """Why the lock still protects a running fix, or None when it may be taken over.
    `holder_alive`: whether its process runs, when it ran on this machine (else None)."""
    if lock.holder.machine == me.machine and holder_alive is not None:
        return None if not holder_alive else f"its process {lock.holder.pid} runs here"
    if engine_now >= lease_ends(lock):
        return None
    return f"its lease runs until {lease_ends(lock):%Y-%m-%d %H:%M:%S} UTC (engine clock)"


def fix_lease_s(settings: Settings) -> float:
    """How long a fix may take, at most: stop, settle, health checks, execs, engine calls."""
    if settings.fix_lease_s is not None:
        return settings.fix_lease_s
    return (
        settings.fix_stop_timeout
        + settings.fix_settle_s
        + settings.fix_health_timeout
        + 3 * settings.exec_timeout
        + 12 * settings.docker_timeout
    )


def recovery_lease_s(engine: DockerEngine) -> float:
    """How long a rollback may take: a handful of engine calls and one stop."""
    return 8 * engine.timeout + 15


# -- this process ----------------------------------------------------------------------------
def _pid_start(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22: starttime


def _machine() -> str:
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def me(lease_s: float) -> Holder:
    pid = os.getpid()
    return Holder(
        who=who(), machine=_machine(), pid=pid, pid_start=_pid_start(pid) or "", lease_s=lease_s
    )


def _alive_here(holder: Holder) -> bool | None:
    if holder.machine != _machine():
        return None
    return _pid_start(holder.pid) == holder.pid_start


# -- the engine ------------------------------------------------------------------------------
def read(engine: DockerEngine, name: str) -> Lock | None:
    """The lock on container `name`, or None. A container of that name that is not a readable
    lock is refused (a person should look at it)."""
    found = engine.find(lock_name(name))
    if found is None:
        return None
    lock = parse_lock(found)
    if lock is None:
        raise FixError(
            f"{engine.where}: {lock_name(name)} exists but is not a lock cudamedic can read; "
            "check it and remove it by hand before fixing that container"
        )
    if (why := foreign(lock.record, name)) is not None:
        raise FixError(
            f"{engine.where}: {lock_name(name)} is not a lock of a fix of {name}: {why}; "
            "nothing was changed — check it and remove it by hand"
        )
    return lock


def acquire(engine: DockerEngine, record: FixRecord, image: str, lease_s: float) -> Lock:
    """Create the lock (409 Conflict: another fix holds it; nothing was changed)."""
    name = lock_name(record.name)
    body = {
        "Image": image,
        "Entrypoint": ["cudamedic-fix-lock"],  # never started
        "Cmd": [],
        "Labels": {**record_labels(record), **holder_labels(me(lease_s))},
    }
    host = {"NetworkMode": "none", "RestartPolicy": {"Name": "no", "MaximumRetryCount": 0}}
    try:
        engine.create(name, body, host, None)
    except EngineError as exc:
        if "Conflict" in str(exc) or "already in use" in str(exc):
            raise FixLocked(
                f"another fix of {engine.where}/{record.name} is running (lock {name} on the "
                "target); try again later"
            ) from None
        raise
    lock = read(engine, record.name)
    if lock is None:
        raise FixError(f"{engine.where}: the lock {name} vanished as it was made; try again")
    return lock


def take_over(engine: DockerEngine, lock: Lock, lease_s: float) -> Lock:
    """Make a dead holder's lock ours (FixError while its holder may still be working)."""
    live = why_live(lock, engine_now(engine), me(lease_s), _alive_here(lock.holder))
    if live is not None:
        raise FixLocked(
            f"another fix of {engine.where}/{lock.record.name} is running (lock "
            f"{lock_name(lock.record.name)} held by {lock.holder.who}: {live}); try again later"
        )
    return replace(engine, lock, lease_s)


def replace(engine: DockerEngine, lock: Lock, lease_s: float) -> Lock:
    """Swap `lock` for one of ours with the same record (remove by id, then create: whoever
    loses either step gets FixError)."""
    try:
        engine.remove(lock.id)
    except ContainerNotFound:
        raise FixError(
            f"another run took over the interrupted fix of {engine.where}/{lock.record.name}"
        ) from None
    return acquire(engine, lock.record, lock.image, lease_s)


def release(engine: DockerEngine, lock: Lock) -> None:
    try:
        engine.remove(lock.id)
    except ContainerNotFound:
        pass


def engine_now(engine: DockerEngine) -> datetime:
    now = docker_time(engine.info().get("SystemTime"))
    if now is None:
        raise FixError(f"{engine.where}: the engine did not say its time (docker info)")
    return now
