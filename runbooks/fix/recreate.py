"""Apply a FixPlan to a container: keep the old one, create the new one, verify, roll back.
(SHELL: Docker engine calls, journal, clock.)

Order of a fix: lock (a record on the target, runbooks/fix/fixlock.py) -> begin (inspect snapshot)
-> stop -> rename (restart policy 'no', name -> backup) -> create (labelled with the record) ->
start -> verify -> commit (the lock is released) -> done; each step journalled locally before it
is done (a cache for the timeline). Any failure rolls back: the new container is removed, the
original gets its name and restart policy back and is started if it was running, the lock is
released. Volumes are never removed and the original is never removed before its replacement is
verified. `recover` rolls back a fix that was interrupted (process killed, machine lost, engine
restarted), from what the target records, on any machine, idempotently.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Literal

from runbooks.collect.remote.docker import DockerEngine
from runbooks.collect.remote.runner import CommandResult
from runbooks.core.errors import CudamedicError, FixError, RollbackFailed, VerifyFailed
from runbooks.core.model import ContainerChange, FixPlan, Frozen
from runbooks.core.names import BACKUP_RE
from runbooks.core.settings import Settings
from runbooks.diagnose.logscan import scan_text, signatures
from runbooks.fix import fixlock
from runbooks.fix.fixlock import FixRecord, Lock, foreign, record_from_labels
from runbooks.fix.journal import Journal

Status = Literal["fixed", "rolled-back", "rollback-failed", "recovered", "nothing-to-do"]

# Step boundaries, in order. CUDAMEDIC_CRASH_AT=<boundary> makes the process SIGKILL itself there,
# CUDAMEDIC_STOP_AT=<boundary> SIGSTOP itself (the fault-injection tests use them; they are never
# set in normal runs).
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
    if os.environ.get("CUDAMEDIC_STOP_AT") == name:  # a test then kills the whole process tree
        os.kill(os.getpid(), signal.SIGSTOP)


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
    fix_backup: str | None = None,
) -> None:
    """Put the original container back as it was. Safe to run any number of times.

    The replacement is removed (a fix's own container, seconds old), or — for a rollback by hand,
    when it may have run for hours — stopped and kept under `keep_replacement_as`. With
    `fix_backup`, a container under `name` is touched only when its labels name that fix."""
    holder = engine.find(name)
    if holder is not None and holder.get("Id") != original_id:
        replacement = str(holder["Id"])
        if fix_backup is not None:
            made_by = record_from_labels((holder.get("Config") or {}).get("Labels"))
            if made_by is None or made_by.backup != fix_backup:
                raise RollbackFailed(
                    f"{engine.where}: {name} is now container {replacement[:12]}, not the "
                    f"replacement made by the fix that kept {fix_backup}; left as it is — look at "
                    "it, then `cudamedic rollback`"
                )
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
    """Finish or roll back an interrupted fix of this container; None when there is none.

    The target decides (runbooks/fix/fixlock.py): a fix lock left there is an interrupted fix or
    rollback, taken over once its holder is gone and undone; without one, a fix this machine's
    journal still calls unfinished was finished or undone by whoever held the lock."""
    lock = fixlock.read(engine, journal.container)
    if lock is None:
        return _settle_journal(engine, journal)
    lock = fixlock.take_over(engine, lock, fixlock.recovery_lease_s(engine))
    rec = lock.record
    manual = rec.kind == "manual-rollback"
    current = journal.current()
    if not current or current[0].get("backup") != rec.backup:  # another machine's fix
        journal.write("begin", note="found on the target", **_begin_fields(rec))
    journal.write("manual-rollback" if manual else "rolling-back", reason=_INTERRUPTED)
    restore(
        engine,
        original_id=rec.original_id,
        name=rec.name,
        restart_policy=rec.restart_policy,
        was_running=rec.was_running,
        keep_replacement_as=rec.replaced,
        fix_backup=rec.backup,
    )
    fixlock.release(engine, lock)
    journal.write("manual-rollback-done" if manual else "rolled-back", reason=_INTERRUPTED)
    what = "rollback" if manual else "fix"
    return Outcome(
        status="recovered",
        message=(
            f"an interrupted {what} of {rec.name} (its lock on the target was held by "
            f"{lock.holder.who}) was "
            + ("completed" if manual else "rolled back: the original container is restored")
        ),
    )


_INTERRUPTED = "interrupted; completed from its record on the target"


def _begin_fields(rec: FixRecord) -> dict[str, Any]:
    return {
        "name": rec.name,
        "original_id": rec.original_id,
        "backup": rec.backup,
        "was_running": rec.was_running,
        "restart_policy": rec.restart_policy,
    }


def _settle_journal(engine: DockerEngine, journal: Journal) -> Outcome | None:
    """No lock on the target: a fix the local journal calls unfinished has ended there (or, for
    a journal from before target locks, is finished or rolled back from the journal)."""
    records = journal.unfinished()
    if records is None:
        return None
    begin, steps = records[0], [r.get("step") for r in records]
    holder = engine.find(str(begin.get("name")))
    labels = (holder or {}).get("Config", {}).get("Labels") if holder else None
    made_by = record_from_labels(labels)
    if "verified" in steps or (made_by is not None and made_by.backup == begin.get("backup")):
        journal.write("done", note="completed by recovery")
        return Outcome(
            status="recovered",
            message=(
                f"an interrupted fix of {journal.container} had already been verified; marked done"
            ),
            backup=begin.get("backup"),
        )
    manual = [r for r in records if r.get("step") == "manual-rollback"]
    if manual:  # a journal from before target locks
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
            message=f"an interrupted rollback of {journal.container} was completed",
        )
    created = {str(r.get("id")) for r in records if r.get("step") == "created"}
    if holder is not None and holder.get("Id") not in (begin.get("original_id"), *created):
        journal.write("rolled-back", note="the target shows this fix ended; nothing changed")
        return Outcome(
            status="recovered",
            message=f"an interrupted fix of {journal.container} had already ended on the target",
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
    back to the original. The fix's lock and record go on the target first (FixError, nothing
    changed, when another fix holds it); each step is journalled before it is done."""
    lock = _lock(engine, plan, settings)
    journal.write(
        "begin",
        incident=plan.incident,
        change=plan.change.model_dump(mode="json"),
        inspect=inspect_snapshot,
        **_begin_fields(lock.record),
    )
    _boundary("begin")
    try:
        return _recreate(engine, plan, settings, journal, lock, sleep)
    except CudamedicError as exc:
        return _roll_back(engine, plan, journal, exc, lock)


def _lock(engine: DockerEngine, plan: FixPlan, settings: Settings) -> Lock:
    """Take the container's lock on the target, then make sure it is still the planned one."""
    record = FixRecord(
        name=plan.container,
        original_id=plan.container_id,
        backup=plan.backup_name,
        restart_policy=plan.restart_policy,
        was_running=plan.was_running,
    )
    image = str(engine.inspect(plan.container_id).get("Image"))
    lock = fixlock.acquire(engine, record, image, fixlock.fix_lease_s(settings))
    current = engine.find(plan.container)
    if current is None or current.get("Id") != plan.container_id:
        fixlock.release(engine, lock)
        raise FixError(
            f"{plan.container} changed since it was planned (another fix or a redeploy); "
            "nothing was changed — plan again"
        )
    return lock


def _recreate(
    engine: DockerEngine,
    plan: FixPlan,
    settings: Settings,
    journal: Journal,
    lock: Lock,
    sleep: Callable[[float], None],
) -> Outcome:
    """Set the original aside, create and start the replacement, verify it, commit (release the
    lock on the target). Raises CudamedicError (VerifyFailed, carrying the checks, when a check
    fails)."""
    _set_aside(engine, plan, settings, journal)
    new_id, started = _create_and_start(engine, plan, journal, lock.record)
    checks = verify(engine, plan, new_id, started, settings, sleep)
    failed = [c for c in checks if not c.ok]
    if failed:
        raise VerifyFailed("; ".join(f"{c.name}: {c.detail}" for c in failed), checks)
    fixlock.release(engine, lock)  # the commit: from now on the target says the fix is done
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


def _create_and_start(
    engine: DockerEngine, plan: FixPlan, journal: Journal, record: FixRecord
) -> tuple[str, int]:
    """Create the replacement (labelled with the fix's record, joined to its extra networks) and
    start it: its id, and the epoch second just before the start (log lines from then on are
    its own)."""
    journal.write("create")
    _boundary("create")
    spec = plan.spec
    own = spec.config.get("Labels")
    labels = {**(own if isinstance(own, dict) else {}), **fixlock.record_labels(record)}
    config = {**spec.config, "Labels": labels}
    new_id = engine.create(spec.name, config, spec.host_config, spec.networking)
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
    engine: DockerEngine, plan: FixPlan, journal: Journal, exc: CudamedicError, lock: Lock
) -> Outcome:
    """Put the original back after ``exc`` and release the lock: ``rolled-back``, or
    ``rollback-failed`` (the lock stays on the target, free to take, for `recover`)."""
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
            fix_backup=plan.backup_name,
        )
    except CudamedicError as again:
        with contextlib.suppress(CudamedicError):
            fixlock.replace(engine, lock, lease_s=0)  # any run, anywhere, may finish it now
        return Outcome(
            status="rollback-failed",
            checks=seen,
            message=(
                f"the fix failed ({reason}) and the rollback failed too ({again}); its lock "
                f"{fixlock.lock_name(plan.container)} on the target records it — the next "
                "`cudamedic fix` or `cudamedic rollback` finishes it"
            ),
        )
    _boundary("restore:done")
    fixlock.release(engine, lock)
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
        res = _exec_said(engine, new_id, ["sh", "-c", "ulimit -l"], settings, 4096)
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
        res = _exec_said(engine, new_id, ["df", "-k", "/dev/shm"], settings, 65536)
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
        res = _exec_said(engine, new_id, ["nvidia-smi", "-L"], settings, 65536)
        gpus = [
            ln for ln in res.stdout.decode("utf-8", "replace").splitlines() if ln.startswith("GPU ")
        ]
        ok = bool(gpus)
        detail += f"; nvidia-smi -L inside lists {len(gpus)} GPU(s)"
    return Check(name="gpus-visible", ok=ok, detail=detail)


def _exec_said(
    engine: DockerEngine, cid: str, argv: list[str], settings: Settings, max_bytes: int
) -> CommandResult:
    """`docker exec` of a check that always prints something (`nvidia-smi -L` with GPUs, `df`,
    `ulimit`). One that exits 0 having printed nothing lost its output on the way — Docker can
    (docker/docker-py#2042, moby/moby#27289; 1 in 3,000 `nvidia-smi -L` here under load, issue
    28) — and would fail a good fix's verification: it is asked again, twice at most."""
    res = engine.exec(cid, argv, settings.exec_timeout, max_bytes)
    for _ in range(2):
        if res.timed_out or res.exit_code != 0 or res.stdout.strip():
            break
        res = engine.exec(cid, argv, settings.exec_timeout, max_bytes)
    return res


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
    """Remove backups past retention — only those of finished fixes: not the backup named by a
    fix lock on the target (an interrupted or failed fix), nor one the local journal still
    calls unfinished."""
    busy = set()
    try:
        lock = fixlock.read(engine, journal.container)
    except FixError:
        return []  # an unreadable lock: leave everything for a person
    if lock is not None:
        busy.add(lock.record.backup)
    if (unfinished := journal.unfinished()) is not None:
        busy.add(str(unfinished[0].get("backup")))
    names = [
        n.lstrip("/")
        for c in engine.list_named(f"{journal.container}-cudamedic-backup-")
        for n in c.get("Names") or []
    ]
    removed = []
    for name in expired_backups(names, timedelta(hours=settings.fix_backup_retention_h), now):
        if name not in busy:
            engine.remove(name)
            removed.append(name)
    return removed


def manual_rollback(engine: DockerEngine, journal: Journal, now: datetime) -> Outcome:
    """Put back the original of the fix that made the current container (its labels name it and
    its backup; the backup must still exist). The replacement is kept, stopped."""
    name = journal.container
    holder = engine.find(name)
    rec = record_from_labels(((holder or {}).get("Config") or {}).get("Labels"))
    if holder is None or rec is None or foreign(rec, name) is not None:
        return Outcome(
            status="nothing-to-do",
            message=f"{name} was not made by a cudamedic fix (no fix labels); nothing to roll back",
        )
    if engine.find(rec.original_id) is None:
        return Outcome(
            status="nothing-to-do",
            message=f"the backup {rec.backup} is gone (past retention?); nothing to restore",
        )
    replaced = f"{name}-cudamedic-replaced-{now.strftime('%Y%m%dT%H%M%SZ')}"
    back = rec.model_copy(update={"kind": "manual-rollback", "replaced": replaced})
    lock = fixlock.acquire(engine, back, str(holder.get("Image")), fixlock.recovery_lease_s(engine))
    journal.write("begin", note="rollback by hand", **_begin_fields(rec))
    journal.write("manual-rollback", replaced=replaced, **_begin_fields(rec))
    restore(
        engine,
        original_id=rec.original_id,
        name=name,
        restart_policy=rec.restart_policy,
        was_running=rec.was_running,
        keep_replacement_as=replaced,
        fix_backup=rec.backup,
    )
    fixlock.release(engine, lock)
    journal.write("manual-rollback-done")
    return Outcome(
        status="rolled-back",
        backup=rec.backup,
        message=(
            f"{name} is the original container again"
            f"{' (started)' if rec.was_running else ''}; the replacement is kept, stopped, "
            f"as {replaced}"
        ),
    )
