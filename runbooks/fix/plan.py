"""Plan the safe fix a diagnosis proposed (PURE): the create request that reproduces the
container exactly but for the change, its `docker run` delta, the steps and the checks. What to
fix is decided by the diagnosis (runbooks/diagnose/remedy.py `propose_fix`).
"""

from __future__ import annotations

import copy
import re
from datetime import datetime
from typing import Any

from runbooks.collect.redact import redact_text
from runbooks.core.errors import FixError
from runbooks.core.model import (
    ContainerChange,
    CreateSpec,
    Fix,
    FixPlan,
)
from runbooks.fix.dockerrun import diff, fmt_size, run_args

# -- planning a recreate ----------------------------------------------------------------------
# Config keys the Engine API accepts at create time, copied as inspect shows them.
_CONFIG_KEYS = (
    "Hostname",
    "Domainname",
    "User",
    "AttachStdin",
    "AttachStdout",
    "AttachStderr",
    "ExposedPorts",
    "Tty",
    "OpenStdin",
    "StdinOnce",
    "Env",
    "Cmd",
    "Healthcheck",
    "ArgsEscaped",
    "Image",
    "Volumes",
    "WorkingDir",
    "Entrypoint",
    "NetworkDisabled",
    "MacAddress",
    "OnBuild",
    "Labels",
    "StopSignal",
    "StopTimeout",
    "Shell",
)
_ANON_VOLUME = re.compile(r"^[0-9a-f]{64}$")


def apply_change(host_config: dict[str, Any], change: ContainerChange) -> dict[str, Any]:
    """HostConfig with the change applied; everything else untouched."""
    out = copy.deepcopy(host_config)
    if change.shm_size is not None:
        out["ShmSize"] = change.shm_size
    if change.ipc_mode is not None:
        out["IpcMode"] = change.ipc_mode
    if change.device_requests is not None:
        out["DeviceRequests"] = [
            {
                "Driver": "",
                "Count": r.count if not r.device_ids else 0,
                "DeviceIDs": list(r.device_ids) or None,
                "Capabilities": [list(r.capabilities)],
                "Options": {},
            }
            for r in change.device_requests
        ]
    if change.ulimits is not None:
        by_name = {u["Name"]: u for u in out.get("Ulimits") or [] if isinstance(u, dict)}
        for u in change.ulimits:
            by_name[u.name] = {"Name": u.name, "Soft": u.soft, "Hard": u.hard}
        out["Ulimits"] = list(by_name.values())
    if change.cap_add is not None:
        caps = list(out.get("CapAdd") or [])
        out["CapAdd"] = caps + [c for c in change.cap_add if c not in caps]
    return out


def create_spec(
    inspect: dict[str, Any], change: ContainerChange, current_image_id: str | None
) -> CreateSpec:
    """The create request that reproduces the container exactly, except for `change`."""
    config = {
        k: copy.deepcopy(v) for k, v in (inspect.get("Config") or {}).items() if k in _CONFIG_KEYS
    }
    image_note = ""
    if current_image_id != inspect.get("Image"):
        # The tag now points elsewhere (or is gone): recreate from the image the container ran.
        config["Image"] = inspect.get("Image")
        image_note = (
            f"tag {inspect.get('Config', {}).get('Image')} no longer points to the "
            f"container's image; using the image ID {str(inspect.get('Image'))[:19]}"
        )
    host = apply_change(inspect.get("HostConfig") or {}, change)
    _pin_anonymous_volumes(inspect, host)
    networking, extra = _networks(inspect, str(host.get("NetworkMode") or "default"))
    return CreateSpec(
        name=str(inspect.get("Name", "")).lstrip("/"),
        config=config,
        host_config=host,
        networking=networking,
        extra_networks=extra,
        image_note=image_note,
    )


def _pin_anonymous_volumes(inspect: dict[str, Any], host: dict[str, Any]) -> None:
    """Anonymous volumes would be created anew (empty) by a plain recreate: point `host`'s
    mounts and binds at the old ones (changes `host`)."""
    by_dest = {m.get("Destination"): m for m in inspect.get("Mounts") or [] if isinstance(m, dict)}
    pinned = []
    for m in host.get("Mounts") or []:
        if isinstance(m, dict) and m.get("Type") == "volume" and not m.get("Source"):
            old = by_dest.get(m.get("Target"))
            m = {**m, "Source": old["Name"]} if old and old.get("Name") else m
        pinned.append(m)
    if host.get("Mounts"):
        host["Mounts"] = pinned
    binds = list(host.get("Binds") or [])
    taken = {b.split(":")[1] for b in binds if b.count(":") >= 1}
    taken |= {m.get("Target") for m in host.get("Mounts") or [] if isinstance(m, dict)}
    for m in inspect.get("Mounts") or []:
        if (
            m.get("Type") == "volume"
            and _ANON_VOLUME.match(str(m.get("Name", "")))
            and m.get("Destination") not in taken
        ):
            binds.append(f"{m['Name']}:{m['Destination']}" + ("" if m.get("RW", True) else ":ro"))
    if binds:
        host["Binds"] = binds


def _networks(
    inspect: dict[str, Any], mode: str
) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The container's networks as the create request takes them: the first (its network mode's,
    if it is one) in the request, the others to connect after it. `mode`: HostConfig.NetworkMode."""
    networks = dict((inspect.get("NetworkSettings") or {}).get("Networks") or {})
    endpoints: dict[str, dict[str, Any]] = {}
    short_id = str(inspect.get("Id", ""))[:12]
    for net, ep in networks.items():
        if net in ("none", "host") or mode.startswith("container:"):
            continue
        aliases = [a for a in ep.get("Aliases") or [] if a != short_id]
        endpoints[net] = {
            k: v
            for k, v in {
                "Aliases": aliases or None,
                "IPAMConfig": ep.get("IPAMConfig"),
                "Links": ep.get("Links"),
                "DriverOpts": ep.get("DriverOpts"),
            }.items()
            if v
        }
    first = mode if mode in endpoints else next(iter(endpoints), None)
    networking = {"EndpointsConfig": {first: endpoints[first]}} if first else None
    extra = {k: v for k, v in endpoints.items() if k != first}
    return networking, extra


def backup_name(name: str, now: datetime) -> str:
    return f"{name}-cudamedic-backup-{now.strftime('%Y%m%dT%H%M%SZ')}"


def plan_fix(
    *,
    host: str,
    inspect: dict[str, Any],
    fix: Fix,
    incident: str,
    summary: str,
    current_image_id: str | None,
    now: datetime,
    settle_s: float,
    retention_h: float,
    image_env: list[str] | None = None,
) -> FixPlan:
    assert fix.safe and fix.change is not None
    name = str(inspect.get("Name", "")).lstrip("/")
    spec = create_spec(inspect, fix.change, current_image_id)
    before, after = _docker_runs(inspect, spec, image_env)
    if before == after:
        raise FixError(
            f"{name} already runs with {' '.join(fix.docker_run) or 'this fix'}; nothing to change"
        )
    state = inspect.get("State") or {}
    was_running = bool(state.get("Running"))
    backup = backup_name(name, now)
    restart = dict((inspect.get("HostConfig") or {}).get("RestartPolicy") or {"Name": "no"})
    checks = _checks(fix.change, settle_s)
    status = str(state.get("Status", "?"))
    steps = _steps(host, name, fix, backup, checks, was_running, status, settle_s, retention_h)
    if spec.image_note:
        steps.insert(4, f"Note: {spec.image_note}.")
    return FixPlan(
        host=host,
        container=name,
        container_id=str(inspect.get("Id", "")),
        incident=incident,
        summary=summary,
        change=fix.change,
        docker_run_before=tuple(before),
        docker_run_after=tuple(after),
        diff=tuple(diff(before, after)),
        steps=tuple(steps),
        spec=spec,
        backup_name=backup,
        was_running=was_running,
        restart_policy=restart,
        checks=tuple(checks),
    )


def _docker_runs(
    inspect: dict[str, Any], spec: CreateSpec, image_env: list[str] | None
) -> tuple[list[str], list[str]]:
    """The container's `docker run` before the fix and after it (as `spec` recreates it)."""
    after_inspect = {
        **inspect,
        "Config": {**(inspect.get("Config") or {}), **spec.config},
        "HostConfig": spec.host_config,
    }
    # What people see of the container's `docker run` (plan, approval, report, Slack) is
    # redacted; the container itself is recreated from `spec`, which keeps every value.
    before = [redact_text(a) for a in run_args(inspect, image_env)]
    after = [redact_text(a) for a in run_args(after_inspect, image_env)]
    return before, after


def _steps(
    host: str,
    name: str,
    fix: Fix,
    backup: str,
    checks: list[str],
    was_running: bool,
    status: str,
    settle_s: float,
    retention_h: float,
) -> list[str]:
    """The plan's steps as a person reads them. `status`: the container's (State.Status)."""
    return [
        f"Take the fix lock for {host}/{name} and write every step to the journal first.",
        f"Snapshot `docker inspect {name}` to the journal.",
        (
            f"Stop {name} (it is running)."
            if was_running
            else f"{name} is not running ({status}); nothing to stop."
        ),
        f"Set its restart policy to 'no' and rename it to {backup} (the backup).",
        f"Create {name} again with the same image, command, env, mounts, volumes, networks, "
        f"restart policy and limits, changing only: {' '.join(fix.docker_run)}.",
        f"Start it and verify for {settle_s:g}s: " + "; ".join(checks) + ".",
        f"If any step fails: remove the new {name}, rename {backup} back, restore its restart "
        f"policy{', and start it' if was_running else ''}. Volumes are never removed.",
        f"On success keep {backup} for {retention_h:g} h; `cudamedic rollback` restores it.",
    ]


def _checks(change: ContainerChange, settle_s: float) -> list[str]:
    out = ["the container is running", "its healthcheck (if any) is healthy"]
    if change.shm_size is not None:
        out.append(f"/dev/shm is at least {fmt_size(change.shm_size)}")
    if change.ipc_mode == "host":
        out.append("IPC mode is host")
    if change.ulimits is not None:
        out.append("`ulimit -l` is unlimited")
    if change.device_requests is not None:
        out.append("`nvidia-smi -L` inside lists the GPUs")
    out.append("the original error does not recur in the new log")
    return out
