"""One fleet sweep's work without Prefect (SHELL): check hosts in parallel, keep state between
sweeps, and say what is new, changed or resolved.

`check_hosts` checks a batch of hosts with bounded concurrency; each host is collected with the
sweep runbook and assessed by one engine (`assess`): the health checks of
runbooks/diagnose/health.py and
the incident diagnosis of the same facts, with the same class ids and thresholds. A host that
fails or hangs costs its own timeouts and never fails the batch. The flow (flows/sweep.py) runs
batches as Prefect tasks, or as `sweep-batch` runs spread over workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import json
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from runbooks.collect.bundle import open_bundle
from runbooks.collect.collector import collect
from runbooks.collect.inventory import Inventory
from runbooks.collect.target import resolve_target
from runbooks.core import progress
from runbooks.core.errors import CudamedicError
from runbooks.core.model import Frozen
from runbooks.core.runbook import Runbook, Thresholds
from runbooks.core.settings import Settings
from runbooks.core.taxonomy import Incident
from runbooks.diagnose.classify import diagnose
from runbooks.diagnose.facts import Facts, gather
from runbooks.diagnose.health import (
    HealthFinding,
    HostChange,
    HostHealth,
    Level,
    check_host,
    verdict_of,
)
from runbooks.diagnose.remedy import fault_container
from runbooks.diagnose.rules import STRONG


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
        result = assess(name, facts, book.thresholds, expected_gpus=expected, source_status=status)
        result = result.model_copy(
            update={"health": result.health.model_copy(update={"bundle": str(bundle)})}
        )
        health = result.health
        if health.verdict == "healthy":
            shutil.rmtree(bundle, ignore_errors=True)  # keep evidence only where there is news
            result = result.model_copy(
                update={"health": health.model_copy(update={"bundle": None})}
            )
    except CudamedicError as exc:
        result = failed_result(name, str(exc))
    except Exception as exc:  # one host's surprise must never fail the sweep
        result = failed_result(name, f"internal error: {type(exc).__name__}: {exc}")
    return result.model_copy(update={"duration_s": round(time.monotonic() - start, 3)})


# Classes whose diagnosis takes the host out of scheduling (its GPUs or driver are unusable).
_DRAIN_CLASSES = frozenset(
    {Incident.GPU_HARDWARE_FAULT, Incident.DRIVER_NOT_LOADED, Incident.DRIVER_LIBRARY_MISMATCH}
)


def assess(
    name: str,
    facts: Facts,
    thresholds: Thresholds,
    *,
    expected_gpus: int | None = None,
    source_status: Mapping[str, str] | None = None,
) -> HostResult:
    """One engine for a host (PURE): its health checks and the incident diagnosis of the same
    facts, with the same class ids. A diagnosed fault that no health check names (e.g. a CUDA
    error in a container's log) becomes a `diagnosis` finding, so the verdict never says healthy
    beside a diagnosed fault."""
    facts = facts.model_copy(update={"thresholds": thresholds})
    health = check_host(
        name, facts, thresholds, expected_gpus=expected_gpus, source_status=source_status
    )
    if health.error is not None:
        return HostResult(health=health)
    d = diagnose(facts, host=name, source_status=source_status)
    if d.incident in (Incident.HEALTHY, Incident.UNKNOWN):
        return HostResult(health=health)
    findings = list(health.findings)
    named = {f.incident for f in findings}
    if d.incident not in named and d.basis == "evidence" and d.confidence >= STRONG:
        level: Level = "drain" if d.incident in _DRAIN_CLASSES else "warning"
        container = d.container if d.container != "log" else None
        findings.append(
            HealthFinding(
                code="diagnosis",
                level=level,
                subject=container or "",
                message=f"{d.incident}: {d.summary[:300]}",
                evidence=d.evidence[:3],
                incident=d.incident,
            )
        )
        health = health.model_copy(
            update={"findings": tuple(findings), "verdict": verdict_of(findings)}
        )
    return HostResult(
        health=health,
        incident=d.incident,
        incident_summary=d.summary,
        # the response it starts names a container only where that one's own evidence shows
        # the fault (another container of the host must never be touched)
        container=fault_container(d),
    )


def failed_result(name: str, error: str) -> HostResult:
    f = HealthFinding(code="check-failed", level="warning", message=error[:500])
    health = HostHealth(
        host=name,
        verdict="warning",
        findings=(f,),
        error=error,
        unchecked={"": "the host's check failed"},  # its last findings stay as they were
    )
    return HostResult(health=health)


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

    def one(name: str) -> HostResult:
        result = within(deadline, name, lambda: check_one(name, inventory, settings, book, out_dir))
        progress.host_checked(name, result.health.verdict)
        return result

    with _fewer_collections(), concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(one, names))


_gc_lock = threading.Lock()
_gc_users = [0]  # check_hosts calls running now
_gc_before: list[int] = []  # the thresholds to restore


@contextlib.contextmanager
def _fewer_collections() -> Iterator[None]:
    """Python's young-generation collection every 50,000 allocations instead of 700 while hosts
    are checked: parsing every host's output allocates by the hundred thousand, and the default
    collected ~2,000 times per 200 hosts, a fifth of the sweep's CPU (bench_sweep.py). Nothing
    is kept longer than the next collection; the first caller in sets it, the last one out
    restores it (batches run in threads)."""
    with _gc_lock:
        _gc_users[0] += 1
        if _gc_users[0] == 1:
            _gc_before[:] = gc.get_threshold()
            gc.set_threshold(50_000, *_gc_before[1:])
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users[0] -= 1
            if _gc_users[0] == 0:
                gc.set_threshold(*_gc_before)


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


def read_state_file(path: Path) -> State:
    """A sweep state file (``sweep-state.json`` of cudamedic before the state moved to Prefect);
    what cannot be read is an empty state."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return parse_state(data)


def parse_state(data: object) -> State:
    """A stored state; what is not host -> finding key -> {field: text} (a document cut by a crash
    or edited by hand) is left out: at worst a finding is reported as new again."""
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
