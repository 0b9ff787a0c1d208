"""Apply a FixPlan to a container: keep the old one, create the new one, verify, roll back.
(SHELL: Docker engine calls, journal, clock.)

Order of a fix, each step journalled before it is done (runbooks/journal.py):
begin (inspect snapshot) -> stop -> rename (restart policy 'no', name -> backup) -> create ->
start -> verify -> done. Any failure rolls back: the new container is removed, the original gets
its name and restart policy back and is started if it was running. Volumes are never removed and
the original is never removed before its replacement is verified. `recover` finishes or rolls
back a fix that was interrupted (process killed, engine restarted), idempotently.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Literal

from runbooks.errors import CudamedicError, RollbackFailed, VerifyFailed
from runbooks.journal import Journal
from runbooks.logscan import scan_text, signatures
from runbooks.model import ContainerChange, FixPlan, Frozen
from runbooks.names import BACKUP_RE
from runbooks.remote.docker import DockerEngine
from runbooks.settings import Settings

Status = Literal["fixed", "rolled-back", "rollback-failed", "recovered", "nothing-to-do"]

# Step boundaries, in order. CUDAMEDIC_CRASH_AT=<boundary> makes the process SIGKILL itself there
# (the fault-injection tests use it; it is never set in normal runs).
BOUNDARIES = (
    "begin",
    "stop",
    "stop:done",
    "rename",
    "rename:done",
    "create",
    "create:done",
    "start",
    "start:done",
    "verified",
    "rolling-back",
    "restore:done",
)


def _boundary(name: str) -> None:
    if os.environ.get("CUDAMEDIC_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


class Check(Frozen):
    name: str
    ok: bool
    detail: str = ""


class Outcome(Frozen):
    status: Status
    message: str
    checks: tuple[Check, ...] = ()
    new_id: str | None = None
    backup: str | None = None


# -- restoring the original (idempotent) --------------------------------------------------------
def restore(
    engine: DockerEngine,
    *,
    original_id: str,
    name: str,
    restart_policy: dict[str, Any],
    was_running: bool,
    keep_replacement_as: str | None = None,
) -> None:
    """Put the original container back as it was. Safe to run any number of times.

    The replacement is removed (a fix's own container, seconds old), or — for a rollback by hand,
    when it may have run for hours — stopped and kept under `keep_replacement_as`."""
    holder = engine.find(name)
    if holder is not None and holder.get("Id") != original_id:
        replacement = str(holder["Id"])
        if keep_replacement_as is None:
            engine.remove(replacement)  # never its volumes
        else:
            if (holder.get("State") or {}).get("Running"):
                engine.stop(replacement, 10)
            engine.set_restart_policy(replacement, {"Name": "no", "MaximumRetryCount": 0})
            engine.rename(replacement, keep_replacement_as)
    original = engine.find(original_id)
    if original is None:
        raise RollbackFailed(
            f"{engine.where}: the original container {original_id[:12]} of {name} is gone; "
            "restore it by hand from the journal snapshot"
        )
    if str(original.get("Name", "")).lstrip("/") != name:
        engine.rename(original_id, name)
    engine.set_restart_policy(original_id, restart_policy)
    state = original.get("State") or {}
    if was_running and not state.get("Running"):
        engine.start(original_id)


def recover(engine: DockerEngine, journal: Journal) -> Outcome | None:
    """Finish or roll back an interrupted fix of this container; None when there is none."""
    records = journal.unfinished()
    if records is None:
        return None
    begin = records[0]
    steps = [r.get("step") for r in records]
    manual = [r for r in records if r.get("step") == "manual-rollback"]
    if manual:
        m = manual[-1]
        restore(
            engine,
            original_id=m["original_id"],
            name=m["name"],
            restart_policy=m["restart_policy"],
            was_running=m["was_running"],
            keep_replacement_as=m["replaced"],
        )
        journal.write("manual-rollback-done", note="completed by recovery")
        return Outcome(
            status="recovered",
            message=(f"an interrupted rollback of {journal.container} was completed"),
        )
    if "verified" in steps:
        journal.write("done", note="completed by recovery")
        return Outcome(
            status="recovered",
            message=(
                f"an interrupted fix of {journal.container} had already been verified; marked done"
            ),
            backup=begin.get("backup"),
        )
    journal.write("rolling-back", reason=f"interrupted after step '{steps[-1]}'")
    restore(
        engine,
        original_id=begin["original_id"],
        name=begin["name"],
        restart_policy=begin["restart_policy"],
        was_running=begin["was_running"],
    )
    journal.write("rolled-back", reason=f"interrupted after step '{steps[-1]}'")
    return Outcome(
        status="recovered",
        message=(
            f"an interrupted fix of {journal.container} (stopped after '{steps[-1]}') was rolled "
            "back: the original container is restored"
        ),
    )


# -- applying --------------------------------------------------------------------------------
def apply_plan(
    engine: DockerEngine,
    plan: FixPlan,
    settings: Settings,
    journal: Journal,
    inspect_snapshot: dict[str, Any],
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Recreate ``plan.container`` with the planned change and verify it; any failure rolls
    back to the original. Each step is journalled before it is done (see the module doc)."""
    journal.write(
        "begin",
        name=plan.container,
        original_id=plan.container_id,
        backup=plan.backup_name,
        was_running=plan.was_running,
        restart_policy=plan.restart_policy,
        incident=plan.incident,
        change=plan.change.model_dump(mode="json"),
        inspect=inspect_snapshot,
    )
    _boundary("begin")
    try:
        return _recreate(engine, plan, settings, journal, sleep)
    except CudamedicError as exc:
        return _roll_back(engine, plan, journal, exc)


def _recreate(
    engine: DockerEngine,
    plan: FixPlan,
    settings: Settings,
    journal: Journal,
    sleep: Callable[[float], None],
) -> Outcome:
    """Set the original aside, create and start the replacement, verify it. Raises
    CudamedicError (VerifyFailed, carrying the checks, when a check fails)."""
    _set_aside(engine, plan, settings, journal)
    new_id, started = _create_and_start(engine, plan, journal)
    checks = verify(engine, plan, new_id, started, settings, sleep)
    failed = [c for c in checks if not c.ok]
    if failed:
        raise VerifyFailed("; ".join(f"{c.name}: {c.detail}" for c in failed), checks)
    journal.write("verified", checks=[c.model_dump() for c in checks])
    _boundary("verified")
    journal.write("done", id=new_id)
    return Outcome(
        status="fixed",
        checks=tuple(checks),
        new_id=new_id,
        backup=plan.backup_name,
        message=f"{plan.container} recreated with {' '.join(_delta(plan))}; "
        f"verified; backup kept as {plan.backup_name}",
    )


def _set_aside(engine: DockerEngine, plan: FixPlan, settings: Settings, journal: Journal) -> None:
    """Stop the original if it runs, set its restart policy to 'no', rename it to the backup."""
    if plan.was_running:
        journal.write("stop")
        _boundary("stop")
        engine.stop(plan.container_id, settings.fix_stop_timeout)
        _boundary("stop:done")
    journal.write("rename", to=plan.backup_name)
    _boundary("rename")
    engine.set_restart_policy(plan.container_id, {"Name": "no", "MaximumRetryCount": 0})
    engine.rename(plan.container_id, plan.backup_name)
    _boundary("rename:done")


def _create_and_start(engine: DockerEngine, plan: FixPlan, journal: Journal) -> tuple[str, int]:
    """Create the replacement (joined to its extra networks) and start it: its id, and the
    epoch second just before the start (log lines from then on are its own)."""
    journal.write("create")
    _boundary("create")
    spec = plan.spec
    new_id = engine.create(spec.name, spec.config, spec.host_config, spec.networking)
    for net, endpoint in spec.extra_networks.items():
        engine.connect(net, new_id, endpoint)
    journal.write("created", id=new_id)
    _boundary("create:done")
    journal.write("start", id=new_id)
    _boundary("start")
    started = int(time.time()) - 1
    engine.start(new_id)
    _boundary("start:done")
    return new_id, started


def _roll_back(
    engine: DockerEngine, plan: FixPlan, journal: Journal, exc: CudamedicError
) -> Outcome:
    """Put the original back after ``exc``: ``rolled-back``, or ``rollback-failed`` (the
    journal then holds where it stopped, for `recover`)."""
    seen: tuple[Check, ...] = (
        tuple(exc.args[1]) if isinstance(exc, VerifyFailed) and len(exc.args) > 1 else ()
    )
    reason = str(exc.args[0]) if exc.args else str(exc)
    journal.write("rolling-back", reason=reason)
    _boundary("rolling-back")
    try:
        restore(
            engine,
            original_id=plan.container_id,
            name=plan.container,
            restart_policy=plan.restart_policy,
            was_running=plan.was_running,
        )
    except CudamedicError as again:
        return Outcome(
            status="rollback-failed",
            checks=seen,
            message=(
                f"the fix failed ({reason}) and the rollback failed too ({again}); the journal "
                f"{journal.path} records where it stopped — the next `cudamedic fix` or "
                "`cudamedic rollback` finishes it"
            ),
        )
    _boundary("restore:done")
    journal.write("rolled-back", reason=reason)
    return Outcome(
        status="rolled-back",
        checks=seen,
        message=(
            f"the fix failed ({reason}); rolled back: {plan.container} is the original "
            "container again, as it was"
        ),
    )


def _delta(plan: FixPlan) -> list[str]:
    return [line[2:] for line in plan.diff if line.startswith("+ ")]


# -- verification -----------------------------------------------------------------------------
def verify(
    engine: DockerEngine,
    plan: FixPlan,
    new_id: str,
    started: int,
    settings: Settings,
    sleep: Callable[[float], None] = time.sleep,
) -> list[Check]:
    sleep(settings.fix_settle_s)
    info = engine.inspect(new_id)
    state = info.get("State") or {}
    checks = [
        Check(
            name="running",
            ok=bool(state.get("Running")) and not state.get("Restarting"),
            detail=f"status {state.get('Status')}, exit code {state.get('ExitCode')}",
        )
    ]
    if (info.get("Config") or {}).get("Healthcheck", {}).get("Test") not in (None, ["NONE"]):
        checks.append(_health(engine, new_id, settings, sleep))
    running = checks[0].ok
    host = info.get("HostConfig") or {}
    checks += _change_checks(engine, plan.change, new_id, host, running, settings)
    checks.append(_no_recurrence(engine, plan, new_id, started))
    return checks


def _change_checks(
    engine: DockerEngine,
    change: ContainerChange,
    new_id: str,
    host: dict[str, Any],
    running: bool,
    settings: Settings,
) -> list[Check]:
    """Whether the new container has what the fix changed: in its HostConfig, and where it is
    `running`, as seen from inside it."""
    checks = []
    if change.shm_size is not None:
        checks.append(_shm_check(engine, change.shm_size, new_id, host, running, settings))
    if change.ipc_mode is not None:
        checks.append(
            Check(
                name="ipc-mode",
                ok=host.get("IpcMode") == change.ipc_mode,
                detail=f"HostConfig.IpcMode {host.get('IpcMode')}",
            )
        )
    if change.ulimits is not None and running:
        res = engine.exec(new_id, ["sh", "-c", "ulimit -l"], settings.exec_timeout, 4096)
        out = res.stdout.decode("utf-8", "replace").strip()
        want = next(u for u in change.ulimits if u.name == "memlock")
        ok = out == "unlimited" if want.soft == -1 else out == str(want.soft // 1024)
        checks.append(Check(name="ulimit-memlock", ok=ok, detail=f"ulimit -l: {out!r}"))
    if change.cap_add is not None:
        caps = host.get("CapAdd") or []
        checks.append(
            Check(
                name="cap-add",
                ok=all(c in caps for c in change.cap_add),
                detail=f"HostConfig.CapAdd {caps}",
            )
        )
    if change.device_requests is not None:
        checks.append(_gpus_check(engine, new_id, host, running, settings))
    return checks


def _shm_check(
    engine: DockerEngine,
    shm_size: int,
    new_id: str,
    host: dict[str, Any],
    running: bool,
    settings: Settings,
) -> Check:
    """HostConfig.ShmSize is the fix's, and `df -k /dev/shm` inside says so (almost: 99%)."""
    ok = host.get("ShmSize") == shm_size
    detail = f"HostConfig.ShmSize {host.get('ShmSize')}"
    if ok and running:
        res = engine.exec(new_id, ["df", "-k", "/dev/shm"], settings.exec_timeout, 65536)
        kb = _df_kb(res.stdout.decode("utf-8", "replace"))
        ok = kb is not None and kb * 1024 >= shm_size * 0.99
        detail += f"; df -k /dev/shm: {kb} KiB"
    return Check(name="shm-size", ok=ok, detail=detail)


def _gpus_check(
    engine: DockerEngine, new_id: str, host: dict[str, Any], running: bool, settings: Settings
) -> Check:
    """The new container requests GPUs, and `nvidia-smi -L` inside lists some."""
    ok = bool(host.get("DeviceRequests"))
    detail = f"{len(host.get('DeviceRequests') or [])} device request(s)"
    if ok and running:
        res = engine.exec(new_id, ["nvidia-smi", "-L"], settings.exec_timeout, 65536)
        gpus = [
            ln for ln in res.stdout.decode("utf-8", "replace").splitlines() if ln.startswith("GPU ")
        ]
        ok = bool(gpus)
        detail += f"; nvidia-smi -L inside lists {len(gpus)} GPU(s)"
    return Check(name="gpus-visible", ok=ok, detail=detail)


def _df_kb(text: str) -> int | None:
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            return int(parts[1])
    return None


def _health(
    engine: DockerEngine, cid: str, settings: Settings, sleep: Callable[[float], None]
) -> Check:
    deadline = time.monotonic() + settings.fix_health_timeout
    status = "starting"
    while time.monotonic() < deadline:
        health = (engine.inspect(cid).get("State") or {}).get("Health") or {}
        status = str(health.get("Status") or "none")
        if status in ("healthy", "unhealthy", "none"):
            break
        sleep(1.0)
    return Check(name="healthcheck", ok=status == "healthy", detail=f"health {status}")


def _no_recurrence(engine: DockerEngine, plan: FixPlan, cid: str, started: int) -> Check:
    log = engine.logs_since(cid, started, 4 * 1024 * 1024).decode("utf-8", "replace")
    wanted = {s.id for s in signatures() if s.incident == plan.incident and s.role != "context"}
    found = [sid for sid in scan_text(log, "new.log").hits if sid in wanted]
    return Check(
        name="error-gone",  # ("signature" would read as a credential name to redaction)
        ok=not found,
        detail=f"recurred: {', '.join(found)}" if found else "not seen in the new log",
    )


# -- backups ----------------------------------------------------------------------------------


def expired_backups(names: list[str], retention: timedelta, now: datetime) -> list[str]:
    out = []
    for name in names:
        m = BACKUP_RE.search(name)
        if not m:
            continue
        made = datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=now.tzinfo)
        if now - made > retention:
            out.append(name)
    return out


def cleanup_backups(
    engine: DockerEngine, journal: Journal, settings: Settings, now: datetime
) -> list[str]:
    """Remove backups past retention — only those whose fix finished verified ('done')."""
    verified = {
        f[0].get("backup") for f in journal.fixes() if any(r.get("step") == "done" for r in f)
    }
    names = [
        n.lstrip("/")
        for c in engine.list_named(f"{journal.container}-cudamedic-backup-")
        for n in c.get("Names") or []
    ]
    removed = []
    for name in expired_backups(names, timedelta(hours=settings.fix_backup_retention_h), now):
        if name in verified:
            engine.remove(name)
            removed.append(name)
    return removed


def manual_rollback(engine: DockerEngine, journal: Journal, now: datetime) -> Outcome:
    """Put back the original of the latest verified fix (its backup must still exist)."""
    done = [
        f
        for f in journal.fixes()
        if any(r.get("step") == "done" for r in f)
        and not any(r.get("step") == "manual-rollback-done" for r in f)
    ]
    if not done:
        return Outcome(
            status="nothing-to-do",
            message=(f"no completed fix of {journal.container} in the journal to roll back"),
        )
    begin = done[-1][0]
    backup = str(begin["backup"])
    if engine.find(begin["original_id"]) is None:
        return Outcome(
            status="nothing-to-do",
            message=(f"the backup {backup} is gone (past retention?); nothing to restore"),
        )
    replaced = f"{begin['name']}-cudamedic-replaced-{now.strftime('%Y%m%dT%H%M%SZ')}"
    journal.write(
        "manual-rollback",
        backup=backup,
        replaced=replaced,
        original_id=begin["original_id"],
        name=begin["name"],
        restart_policy=begin["restart_policy"],
        was_running=begin["was_running"],
    )
    restore(
        engine,
        original_id=begin["original_id"],
        name=begin["name"],
        restart_policy=begin["restart_policy"],
        was_running=begin["was_running"],
        keep_replacement_as=replaced,
    )
    journal.write("manual-rollback-done")
    return Outcome(
        status="rolled-back",
        backup=backup,
        message=(
            f"{begin['name']} is the original container again"
            f"{' (started)' if begin['was_running'] else ''}; the replacement is kept, stopped, "
            f"as {replaced}"
        ),
    )
