"""Recommend a fix for a diagnosis (PURE): a safe container change with its `docker run` delta,
or the steps a person should take.

Only the taxonomy's "safe" classes get a container change, and only when the facts say the change
would help (e.g. `--gpus` only on a host whose GPUs work). Everything else gets manual steps; for
hardware faults, NVIDIA's Xid action from the catalogue.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from runbooks import knowledge
from runbooks.collect.evidence.docker_inspect import InspectFacts
from runbooks.collect.redact import redact_text
from runbooks.core.errors import FixError
from runbooks.core.model import (
    ContainerChange,
    CreateSpec,
    Diagnosis,
    Fix,
    FixPlan,
    GpuRequestSpec,
    Line,
    Match,
    UlimitSpec,
)
from runbooks.core.taxonomy import SAFE_FIX, Incident
from runbooks.diagnose.facts import ContainerFacts, Facts
from runbooks.fix.dockerrun import diff, fmt_size, run_args

GiB = 1024**3
MEMLOCK = (
    UlimitSpec(name="memlock", soft=-1, hard=-1),
    UlimitSpec(name="stack", soft=67108864, hard=67108864),
)

MANUAL: dict[Incident, tuple[str, ...]] = {
    Incident.CONTAINER_TOOLKIT_MISSING: (
        "Install or upgrade the NVIDIA Container Toolkit (>= 1.13) on the host.",
        "Run `nvidia-ctk runtime configure --runtime=docker` and restart dockerd.",
        "Check with `docker run --rm --gpus all <image> nvidia-smi`.",
    ),
    Incident.DRIVER_NOT_LOADED: (
        "Drain the node: move or stop GPU workloads.",
        "Check `lsmod | grep nvidia` and `dmesg | grep NVRM`; after a kernel upgrade, reinstall "
        "the driver (DKMS) for the running kernel.",
        "Load the module (`modprobe nvidia`) or reboot, then check `nvidia-smi`.",
    ),
    Incident.DRIVER_LIBRARY_MISMATCH: (
        "Drain the node: the driver was upgraded without a reboot.",
        "Reboot (or unload and reload the nvidia kernel modules) so module and libraries match.",
    ),
    Incident.DRIVER_TOO_OLD: (
        "Upgrade the host driver to one that supports the image's CUDA version, or",
        "pin an image built for the CUDA version the driver supports (see `nvidia-smi` header).",
    ),
    Incident.ARCH_UNSUPPORTED: (
        "Use an image whose framework build includes kernels for this GPU's compute capability "
        "(e.g. a newer PyTorch CUDA build for sm_90/sm_100/sm_120).",
    ),
    Incident.CPU_ONLY_BUILD: (
        "Use a CUDA build of the framework (e.g. a `+cu121` PyTorch wheel or a CUDA base image).",
    ),
    Incident.CUDA_OOM: (
        "Reduce the batch size or sequence length; enable mixed precision (AMP).",
        "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation.",
        "Check `nvidia-smi` for other processes holding GPU memory.",
    ),
    Incident.HOST_OOM_KILLED: (
        "Raise the container's memory limit or the host's RAM headroom.",
        "Reduce DataLoader workers / prefetch, or the per-worker memory.",
    ),
    Incident.CUDA_ILLEGAL_ACCESS: (
        "Application bug: rerun with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel.",
        "Check index ranges (e.g. labels vs. number of classes, token ids vs. vocabulary size).",
    ),
    Incident.NCCL_TIMEOUT: (
        "Find the slow or dead rank: look for the first rank that errored or stopped logging.",
        "Check the kernel log of every node for Xid events at that time.",
    ),
    Incident.NCCL_ERROR: (
        "Rerun with NCCL_DEBUG=INFO (and NCCL_DEBUG_SUBSYS=INIT,NET) to see the failing call.",
        "Check NCCL_SOCKET_IFNAME / network interfaces and that all ranks use one NCCL version.",
    ),
    Incident.VOLUME_PERMISSION_DENIED: (
        "Run the container as the owner of the mounted path (`--user $(id -u):$(id -g)`), or",
        "fix the ownership of the host path (`chown`).",
    ),
    Incident.SSH_ACCESS_DENIED: (
        "Check the user, key and authorized_keys on the host; for cudamedic, the inventory's "
        "user and key_file.",
    ),
    Incident.DISK_FULL: (
        "Free space: prune unused images (`docker system prune`), move checkpoints elsewhere.",
    ),
    Incident.NCCL_SLOW_TRANSPORT: (
        "Host work: check ACS/IOMMU settings, `nvidia-smi topo -m`, NVLink status "
        "(`nvidia-smi nvlink -s`) and GPUDirect RDMA; remove NCCL_P2P_DISABLE if set.",
    ),
    Incident.INVALID_DEVICE_ORDINAL: (
        "Make the workload ask only for GPUs that exist: check CUDA_VISIBLE_DEVICES and "
        "`--nproc_per_node` against `nvidia-smi -L` inside the container.",
    ),
}


def own_evidence(lines: Iterable[Line]) -> tuple[str, ...]:
    """The containers whose own files (`containers/<name>.*`: log, inspect, probes) the lines
    cite, sorted. `containers/train-shm2.log:3` is train-shm2's own evidence; the trigger text,
    the kernel log or another container's file are not."""
    return tuple(
        sorted(
            {
                PurePosixPath(ln.source).name.split(".", 1)[0]  # as Bundle.container_names
                for ln in lines
                if ln.source.startswith("containers/")
            }
        )
    )


def fault_container(d: Diagnosis) -> str | None:
    """The one container whose own evidence shows the diagnosed fault (None: no container's,
    or several): what a response started for the host may fix without a person."""
    cited = own_evidence(d.evidence)
    if d.fix is not None and d.fix.container:
        return d.fix.container if cited == (d.fix.container,) else None
    return cited[0] if len(cited) == 1 and cited[0] != "log" else None


def _target(facts: Facts, cited: tuple[str, ...]) -> ContainerFacts | None:
    """The container a fix is for: the one whose own evidence shows the fault; with no
    container's evidence cited, the bundle's only container. Never a guess between several (a
    fix recreates a container: the wrong one restarts a healthy workload)."""
    with_inspect = {n: c for n, c in facts.containers.items() if c.inspect is not None}
    if len(cited) == 1:
        return with_inspect.get(cited[0])
    if not cited and len(with_inspect) == 1:
        return next(iter(with_inspect.values()))
    return None


def _which_container(cited: tuple[str, ...], facts: Facts) -> str:
    """Why no single container can be fixed ("": the reason is elsewhere)."""
    if len(cited) > 1:
        return (
            f"the evidence shows the fault in {len(cited)} containers ({', '.join(cited)}): "
            "respond for each one by name (--container)"
        )
    if not cited and sum(c.inspect is not None for c in facts.containers.values()) > 1:
        return (
            "the evidence does not say which of the host's containers has the fault: "
            "respond for one by name (--container)"
        )
    return ""


def _intended_devices(c: ContainerFacts) -> tuple[str, ...]:
    """Devices the container was meant to have: label `cudamedic.gpus` or NVIDIA_VISIBLE_DEVICES."""
    assert c.inspect is not None
    spec = c.inspect.labels.get("cudamedic.gpus") or c.inspect.env.get("NVIDIA_VISIBLE_DEVICES", "")
    spec = spec.strip()
    if not spec or spec in ("all", "void", "none"):
        return ()
    return tuple(d.strip() for d in spec.split(",") if d.strip())


def _gpus_flag(devices: tuple[str, ...]) -> str:
    return f"+ --gpus '\"device={','.join(devices)}\"'" if devices else "+ --gpus all"


def propose_fix(match: Match | None, facts: Facts) -> Fix | None:
    """The fix for a match: a container change to recreate with (``safe``) where the evidence
    allows one, else the manual steps; ``None`` when there is nothing to propose."""
    if match is None:
        return None
    incident = Incident(match.incident)
    cited = own_evidence(match.evidence)
    c = _target(facts, cited)
    gpus = facts.host_gpu_count
    manual = MANUAL.get(incident, ())
    if incident == Incident.GPU_HARDWARE_FAULT:
        return Fix(safe=False, steps=_hardware_steps(facts))
    if c is None and incident in SAFE_FIX and (which := _which_container(cited, facts)):
        steps = (which[0].upper() + which[1:] + ".", *_flag_hint(incident), *manual)
        return Fix(safe=False, steps=steps)
    if c is None or c.inspect is None:
        return _fix_without_inspect(incident, manual)
    info = c.inspect
    if incident == Incident.GPU_NOT_REQUESTED:
        return _request_gpus(c, gpus)
    if incident == Incident.SHM_TOO_SMALL:
        return _larger_shm(c.name, info, gpus)
    if incident == Incident.MEMLOCK_LIMIT:
        return Fix(
            safe=True,
            container=c.name,
            change=ContainerChange(ulimits=MEMLOCK, cap_add=("IPC_LOCK",)),
            docker_run=(
                "+ --ulimit memlock=-1",
                "+ --ulimit stack=67108864",
                "+ --cap-add IPC_LOCK",
            ),
        )
    if incident == Incident.INVALID_DEVICE_ORDINAL:
        return _show_every_gpu(c, info, gpus, manual)
    if incident == Incident.NCCL_SLOW_TRANSPORT:
        return _nccl_transport(c.name, info, manual)
    return Fix(safe=False, container=c.name, steps=manual) if manual else None


def _fix_without_inspect(incident: Incident, manual: tuple[str, ...]) -> Fix | None:
    """No container inspect: no recreate can be planned, only steps."""
    if incident in (Incident.GPU_NOT_REQUESTED, Incident.SHM_TOO_SMALL, Incident.MEMLOCK_LIMIT):
        return Fix(
            safe=False,
            steps=(*_flag_hint(incident), *manual),
            note="no container inspect in the evidence: cannot plan a recreate",
        )
    return Fix(safe=False, steps=manual) if manual else None


def _request_gpus(c: ContainerFacts, gpus: int) -> Fix:
    """GPUs not requested: recreate with ``--gpus`` (the intended devices, else all), unless
    the host shows no working GPU."""
    if gpus == 0:
        return Fix(
            safe=False,
            container=c.name,
            steps=("Check the host's GPUs first (`nvidia-smi`): no working GPU seen.",),
            note="the host shows no working GPU, so adding --gpus would not help",
        )
    devices = _intended_devices(c)
    change = ContainerChange(
        device_requests=(GpuRequestSpec(count=0 if devices else -1, device_ids=devices),)
    )
    return Fix(safe=True, container=c.name, change=change, docker_run=(_gpus_flag(devices),))


def _larger_shm(name: str, info: InspectFacts, gpus: int) -> Fix:
    """/dev/shm too small: 8 GiB where several GPUs are in play, else 1 GiB."""
    multi = gpus > 1 or any(
        r.count == -1 or r.count > 1 or len(r.device_ids) > 1 for r in info.gpu_requests
    )
    size = 8 * GiB if multi else 1 * GiB
    return Fix(
        safe=True,
        container=name,
        change=ContainerChange(shm_size=size),
        docker_run=(f"+ --shm-size={size // GiB}g",),
        note="--ipc=host is the alternative where the policy allows it",
    )


def _show_every_gpu(
    c: ContainerFacts, info: InspectFacts, gpus: int, manual: tuple[str, ...]
) -> Fix:
    """An invalid device ordinal: give the container the host's GPUs when it sees fewer."""
    visible = sum(max(r.count, 0) + len(r.device_ids) for r in info.gpu_requests)
    all_given = any(r.count == -1 for r in info.gpu_requests)
    if gpus > 1 and not all_given and (visible < gpus):
        devices = _intended_devices(c)
        return Fix(
            safe=True,
            container=c.name,
            change=ContainerChange(
                device_requests=(GpuRequestSpec(count=0 if devices else -1, device_ids=devices),)
            ),
            docker_run=(_gpus_flag(devices),),
            note=f"the host has {gpus} GPUs; the container saw {visible}",
        )
    return Fix(
        safe=False,
        container=c.name,
        steps=manual,
        note="the container already sees every GPU the host has",
    )


def _nccl_transport(name: str, info: InspectFacts, manual: tuple[str, ...]) -> Fix:
    """A slow NCCL transport: the container flags it lacks (host IPC, unlimited memlock,
    IPC_LOCK) first, then the manual host work."""
    delta: list[str] = []
    change = ContainerChange()
    if info.ipc_mode != "host":
        delta.append("+ --ipc=host")
        change = change.model_copy(update={"ipc_mode": "host"})
    memlock = info.ulimit("memlock")
    if memlock is None or memlock.soft != -1:
        delta += ["+ --ulimit memlock=-1", "+ --ulimit stack=67108864"]
        change = change.model_copy(update={"ulimits": MEMLOCK})
    if "IPC_LOCK" not in info.cap_add:
        delta.append("+ --cap-add IPC_LOCK")
        change = change.model_copy(update={"cap_add": ("IPC_LOCK",)})
    if delta:
        return Fix(
            safe=True,
            container=name,
            change=change,
            docker_run=tuple(delta),
            steps=manual,
            note="container flags first; if still slow, the host work",
        )
    return Fix(safe=False, container=name, steps=manual)


def _flag_hint(incident: Incident) -> tuple[str, ...]:
    return {
        Incident.GPU_NOT_REQUESTED: ("Recreate the container with `--gpus all`.",),
        Incident.SHM_TOO_SMALL: ("Recreate the container with `--shm-size=8g` (or `--ipc=host`).",),
        Incident.MEMLOCK_LIMIT: (
            "Recreate the container with `--ulimit memlock=-1 --ulimit "
            "stack=67108864 --cap-add IPC_LOCK`.",
        ),
    }.get(incident, ())


_ACTIONS = {
    "RESTART_APP": "restart the application",
    "RESET_GPU": "reset the GPU (`nvidia-smi -r` after stopping its processes)",
    "RESTART_BM": "restart the machine (bare metal)",
    "IGNORE": "no immediate action",
    "CONTACT_SUPPORT": "contact NVIDIA support / open an RMA if it repeats",
}


def _hardware_steps(facts: Facts) -> tuple[str, ...]:
    steps = ["Drain the node: stop scheduling work on it."]
    seen: set[int] = set()
    if facts.kernel is not None:
        for xid in facts.kernel.xids:
            info = knowledge.xid_info(xid.code)
            if info is None or not info.fault or xid.code in seen:
                continue
            seen.add(xid.code)
            action = _ACTIONS.get(info.immediate_action, info.immediate_action)
            follow = _ACTIONS.get(info.investigatory_action, info.investigatory_action)
            steps.append(
                f"Xid {xid.code} ({info.mnemonic}): NVIDIA's immediate action: {action}; "
                f"then: {follow}."
            )
    steps.append("Run `dcgmi diag -r 3` before returning the node; open an RMA if it fails.")
    return tuple(steps)


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
