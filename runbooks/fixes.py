"""Recommend a fix for a diagnosis (PURE): a safe container change with its `docker run` delta,
or the steps a person should take.

Only the taxonomy's "safe" classes get a container change, and only when the facts say the change
would help (e.g. `--gpus` only on a host whose GPUs work). Everything else gets manual steps; for
hardware faults, NVIDIA's Xid action from the catalogue.
"""

from __future__ import annotations

from runbooks import knowledge
from runbooks.facts import ContainerFacts, Facts
from runbooks.model import ContainerChange, Fix, GpuRequestSpec, Match, UlimitSpec
from runbooks.taxonomy import Incident

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


def _target(facts: Facts) -> ContainerFacts | None:
    with_inspect = [c for c in facts.containers.values() if c.inspect is not None]
    return with_inspect[0] if with_inspect else None


def _gpu_count(facts: Facts) -> int:
    if facts.smi is not None and facts.smi.gpus:
        return len(facts.smi.gpus)
    if facts.smi_xml is not None:
        return len(facts.smi_xml.gpus)
    return 0


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
    if match is None:
        return None
    incident = Incident(match.incident)
    c = _target(facts)
    gpus = _gpu_count(facts)
    manual = MANUAL.get(incident, ())
    if incident == Incident.GPU_HARDWARE_FAULT:
        return Fix(safe=False, steps=_hardware_steps(facts))
    if c is None or c.inspect is None:
        if incident in (Incident.GPU_NOT_REQUESTED, Incident.SHM_TOO_SMALL, Incident.MEMLOCK_LIMIT):
            return Fix(
                safe=False,
                steps=(*_flag_hint(incident), *manual),
                note="no container inspect in the evidence: cannot plan a recreate",
            )
        return Fix(safe=False, steps=manual) if manual else None
    info = c.inspect
    if incident == Incident.GPU_NOT_REQUESTED:
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
    if incident == Incident.SHM_TOO_SMALL:
        multi = gpus > 1 or any(
            r.count == -1 or r.count > 1 or len(r.device_ids) > 1 for r in info.gpu_requests
        )
        size = 8 * GiB if multi else 1 * GiB
        return Fix(
            safe=True,
            container=c.name,
            change=ContainerChange(shm_size=size),
            docker_run=(f"+ --shm-size={size // GiB}g",),
            note="--ipc=host is the alternative where the policy allows it",
        )
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
        visible = sum(max(r.count, 0) + len(r.device_ids) for r in info.gpu_requests)
        all_given = any(r.count == -1 for r in info.gpu_requests)
        if gpus > 1 and not all_given and (visible < gpus):
            devices = _intended_devices(c)
            return Fix(
                safe=True,
                container=c.name,
                change=ContainerChange(
                    device_requests=(
                        GpuRequestSpec(count=0 if devices else -1, device_ids=devices),
                    )
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
    if incident == Incident.NCCL_SLOW_TRANSPORT:
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
                container=c.name,
                change=change,
                docker_run=tuple(delta),
                steps=manual,
                note="container flags first; if still slow, the host work",
            )
        return Fix(safe=False, container=c.name, steps=manual)
    return Fix(safe=False, container=c.name, steps=manual) if manual else None


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
