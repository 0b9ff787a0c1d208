"""One fleet sweep's work without Prefect (SHELL): check hosts in parallel, keep state between
sweeps, and say what is new, changed or resolved.

`check_hosts` checks a batch of hosts with bounded concurrency; each host is collected with the
sweep runbook, judged by runbooks/health.py and, when it is not healthy, diagnosed like an
incident. A host that fails or hangs costs its own timeouts and never fails the batch. The flow
(flows/sweep.py) runs batches as Prefect tasks, or as `sweep-batch` runs spread over workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from runbooks.bundle import open_bundle
from runbooks.classify import diagnose
from runbooks.collect import collect
from runbooks.errors import CudamedicError
from runbooks.facts import gather
from runbooks.health import HealthFinding, HostChange, HostHealth, check_host, parse_uptime
from runbooks.inventory import Inventory
from runbooks.model import Frozen
from runbooks.runbook import Runbook
from runbooks.settings import Settings
from runbooks.target import resolve_target


class HostResult(Frozen):
    health: HostHealth
    incident: str | None = None  # the incident diagnosis of a host that is not healthy
    incident_summary: str | None = None
    container: str | None = None
    duration_s: float = 0.0


def check_one(
    name: str, inventory: Inventory, settings: Settings, book: Runbook, out_dir: Path
) -> HostResult:
    import time

    start = time.monotonic()
    try:
        target = resolve_target(name, inventory)
        expected = target.host.gpus if target.host else None
        bundle = collect(target, settings, runbook=book, out_dir=out_dir)
        with open_bundle(bundle) as b:
            facts = gather(b)
            status = {s.name: s.status for s in b.meta.sources} if b.meta else {}
            uptime = parse_uptime(b.files.get("commands/uptime.txt"))
        health = check_host(
            name,
            facts,
            book.thresholds,
            expected_gpus=expected,
            source_status=status,
            uptime_s=uptime,
            bundle=str(bundle),
        )
        result = HostResult(health=health)
        if health.verdict != "healthy" and health.error is None:
            d = diagnose(facts, host=name)
            if d.incident not in ("healthy", "unknown"):
                result = result.model_copy(
                    update={
                        "incident": d.incident,
                        "incident_summary": d.summary,
                        "container": d.container if d.container != "log" else None,
                    }
                )
        elif health.verdict == "healthy":
            shutil.rmtree(bundle, ignore_errors=True)  # keep evidence only where there is news
            result = result.model_copy(
                update={"health": health.model_copy(update={"bundle": None})}
            )
    except CudamedicError as exc:
        result = failed_result(name, str(exc))
    except Exception as exc:  # one host's surprise must never fail the sweep
        result = failed_result(name, f"internal error: {type(exc).__name__}: {exc}")
    return result.model_copy(update={"duration_s": round(time.monotonic() - start, 3)})


def failed_result(name: str, error: str) -> HostResult:
    f = HealthFinding(code="check-failed", level="warning", message=error[:500])
    return HostResult(health=HostHealth(host=name, verdict="warning", findings=(f,), error=error))


def check_hosts(
    names: list[str],
    inventory: Inventory,
    settings: Settings,
    book: Runbook,
    out_dir: Path,
    workers: int | None = None,
) -> list[HostResult]:
    """Check hosts at once (at most `workers`, default `book.concurrency`); results in the
    order given."""
    if not names:
        return []
    workers = max(1, min(workers or book.concurrency, len(names)))
    deadline = book.timeouts.collect
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(
            pool.map(
                lambda n: within(
                    deadline, n, lambda: check_one(n, inventory, settings, book, out_dir)
                ),
                names,
            )
        )


def within(seconds: float, name: str, check: Callable[[], HostResult]) -> HostResult:
    """The host's result, or a finding when it has none within `seconds` (the sweep runbook's
    per-host timeout). However a host misbehaves, the sweep never waits longer for it: the late
    check is abandoned to its own (shorter, per-call) timeouts in a daemon thread."""
    box: list[HostResult] = []
    worker = threading.Thread(target=lambda: box.append(check()), name=f"check {name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if box:
        return box[0]
    result = failed_result(
        name, f"no answer within the sweep's per-host timeout ({seconds:g}s); check abandoned"
    )
    return result.model_copy(update={"duration_s": seconds})


def batches(names: list[str], size: int) -> list[list[str]]:
    return [names[i : i + size] for i in range(0, len(names), size)]


def select_hosts(
    inventory: Inventory, hosts: list[str] | None = None, tags: list[str] | None = None
) -> list[str]:
    if hosts:
        for h in hosts:
            inventory.get(h)  # InputError naming the unknown host
        return sorted(dict.fromkeys(hosts))
    chosen = [
        name for name, h in inventory.hosts.items() if not tags or any(t in h.tags for t in tags)
    ]
    return sorted(chosen)


# -- state between sweeps -------------------------------------------------------------------------
State = dict[str, dict[str, dict[str, str]]]


def state_path(settings: Settings) -> Path:
    return settings.state_path / "sweep-state.json"


@contextlib.contextmanager
def locked_state(settings: Settings) -> Iterator[tuple[State, Callable[[State], None]]]:
    """The previous sweep's state under an exclusive lock (two sweeps never interleave), and a
    function that saves the new one atomically. Hosts not swept this time keep their state."""
    path = state_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        before = _read_state(path)

        def save(seen: State) -> None:
            data = {"updated_at": datetime.now(UTC).isoformat(), "hosts": {**before, **seen}}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, path)

        yield before, save
    finally:
        os.close(fd)


def _read_state(path: Path) -> State:
    """The stored state; what is not host -> finding key -> {field: text} (a file cut by a crash
    or edited by hand) is left out: at worst a finding is reported as new again."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    hosts = data.get("hosts") if isinstance(data, dict) else None
    if not isinstance(hosts, dict):
        return {}
    return {
        str(host): {
            str(key): {str(k): v for k, v in entry.items() if isinstance(v, str)}
            for key, entry in findings.items()
            if isinstance(entry, dict)
        }
        for host, findings in hosts.items()
        if isinstance(findings, dict)
    }


def summarize(changes: list[HostChange]) -> dict[str, int]:
    out = {"new": 0, "changed": 0, "resolved": 0}
    for c in changes:
        out[c.change] += 1
    return out
