"""Recommend a fix for a diagnosis (PURE): a safe container change with its `docker run` delta,
or the steps a person should take.

Only the taxonomy's "safe" classes get a container change, and only when the facts say the change
would help (e.g. `--gpus` only on a host whose GPUs work). Everything else gets manual steps; for
hardware faults, NVIDIA's Xid action from the catalogue.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import PurePosixPath

from runbooks import knowledge
from runbooks.collect.evidence.docker_inspect import InspectFacts
from runbooks.core.model import (
    ContainerChange,
    Diagnosis,
    Fix,
    GpuRequestSpec,
    Line,
    Match,
    UlimitSpec,
)
from runbooks.core.taxonomy import SAFE_FIX, Incident
from runbooks.diagnose.facts import ContainerFacts, Facts

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
