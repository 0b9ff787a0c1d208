"""Incident ids, verbatim from docs/spec/taxonomy.md (a public contract).

`Incident` is a StrEnum so ids stay kebab-case strings everywhere (JSON, reports, Slack).
`SAFE_FIX` mirrors the taxonomy's "safe automatic fix?" column.
"""

from __future__ import annotations

from enum import StrEnum


class Incident(StrEnum):
    HEALTHY = "healthy"
    GPU_NOT_REQUESTED = "gpu-not-requested"
    CONTAINER_TOOLKIT_MISSING = "container-toolkit-missing"
    INVALID_DEVICE_ORDINAL = "invalid-device-ordinal"
    SHM_TOO_SMALL = "shm-too-small"
    MEMLOCK_LIMIT = "memlock-limit"
    DRIVER_NOT_LOADED = "driver-not-loaded"
    DRIVER_LIBRARY_MISMATCH = "driver-library-mismatch"
    DRIVER_TOO_OLD = "driver-too-old"
    ARCH_UNSUPPORTED = "arch-unsupported"
    CPU_ONLY_BUILD = "cpu-only-build"
    CUDA_OOM = "cuda-oom"
    HOST_OOM_KILLED = "host-oom-killed"
    CUDA_ILLEGAL_ACCESS = "cuda-illegal-access"
    GPU_HARDWARE_FAULT = "gpu-hardware-fault"
    NCCL_TIMEOUT = "nccl-timeout"
    NCCL_SLOW_TRANSPORT = "nccl-slow-transport"
    NCCL_ERROR = "nccl-error"
    VOLUME_PERMISSION_DENIED = "volume-permission-denied"
    SSH_ACCESS_DENIED = "ssh-access-denied"
    DISK_FULL = "disk-full"
    UNKNOWN = "unknown"


SAFE_FIX: frozenset[Incident] = frozenset(
    {
        Incident.GPU_NOT_REQUESTED,
        Incident.INVALID_DEVICE_ORDINAL,
        Incident.SHM_TOO_SMALL,
        Incident.MEMLOCK_LIMIT,
        Incident.NCCL_SLOW_TRANSPORT,
    }
)
