"""Runbooks: what a response or a sweep collects, which thresholds it applies, which fixes may run
without a person. Declarative YAML validated by pydantic; operators edit a runbook, not code.

The packaged runbooks are ``runbooks/incident.yaml`` (incident response) and
``runbooks/sweep.yaml`` (fleet health sweep); ``CUDAMEDIC_RUNBOOK`` / ``CUDAMEDIC_SWEEP_RUNBOOK``
(or ``runbook:`` / ``sweep_runbook:`` in the config file) point at an edited copy. Example, adding
a host command and lowering a threshold::

    host_sources:
      - {name: nvidia-topo, path: commands/nvidia-smi-topo.txt, command: nvidia-smi topo -m}
    thresholds:
      shm_min_mib: 2048

An unknown key, a probe name that does not exist or an unsafe fix class is refused with the file
and the key in the message.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runbooks.core.errors import InputError
from runbooks.core.policy import Policy
from runbooks.core.sources import BUILTIN_PROBES, ContainerProbe, HostSource

Kind = Literal["incident", "sweep"]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Thresholds(_Strict):
    """The thresholds of every judgment (runbooks/diagnose/judgments.py) — one place for the
    sweep's host
    verdicts and the incident rules alike, each with the fact it is compared against."""

    xid_window_h: float = Field(default=24.0, gt=0)  # sweep: Xid events older than this: history
    # incident: an Xid older than this before the workload failed is context, not its cause
    xid_incident_window_h: float = Field(default=6.0, gt=0)
    shm_min_mib: int = Field(default=1024, ge=0)  # /dev/shm of GPU containers (DataLoader workers)
    memlock_min_kb: int = Field(default=65536, ge=0)  # locked-memory limit RDMA/pinned buffers need
    disk_used_max_pct: int = Field(default=90, ge=1, le=100)  # any filesystem above: warning
    temperature_max_c: int = Field(default=85, gt=0)  # GPU core temperature: warning above
    throttle_reasons: tuple[str, ...] = (  # active clock-event reasons that are a warning
        "hw_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "sw_thermal_slowdown",
    )
    straggler_ratio: float = Field(default=0.8, gt=0, le=1)  # GPU clock under ratio x median
    # a container's CUDA JIT cache (~/.nv/ComputeCache) that grew this much since the last sweep
    cuda_cache_growth_mib: int = Field(default=64, ge=1)
    # A GPU against the OTHER GPUs of its node (stragglers): compared only with this many GPUs
    # in the comparison (a median of two says nothing about which one is odd) ...
    straggler_min_gpus: int = Field(default=3, ge=3)
    # ... hotter than the median of its peers in the same state (busy/idle) by more than this,
    straggler_temp_delta_c: int = Field(default=15, gt=0)
    # ... and GPUs busier than this count as busy (clock, temperature, PCIe generation peers).
    straggler_busy_pct: int = Field(default=50, ge=0, le=100)
    memlock_for_rdma: bool = True  # flag RDMA containers without an unlimited memlock
    # NVIDIA Container Toolkit (nvidia-ctk / nvidia-container-cli --version): warning below
    toolkit_min_version: str = Field(default="1.13", pattern=r"^\d+(\.\d+){0,2}$")
    # An image's CUDA runs on a driver at the minor-version-compatibility floor of its major
    # family (NVIDIA's CUDA Compatibility guide); false: only on the toolkit's own driver.
    cuda_minor_compat: bool = True


class Breaker(_Strict):
    """Fleet-wide circuit breaker for unattended fixes; a person resets it."""

    max_unattended_fixes: int = Field(default=3, ge=1)
    window_min: float = Field(default=30.0, gt=0)


class Timeouts(_Strict):
    """Per-step timeouts of the flows, in seconds (each remote call has its own, shorter one)."""

    collect: float = Field(default=300.0, gt=0)
    classify: float = Field(default=120.0, gt=0)
    apply: float = Field(default=900.0, gt=0)
    report: float = Field(default=60.0, gt=0)
    approval: float = Field(default=3600.0, gt=0)  # how long a fix waits for a person


class Runbook(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,60}$")
    kind: Kind
    description: str = ""
    host_sources: tuple[HostSource, ...] = Field(min_length=1)
    container_probes: tuple[ContainerProbe, ...] = ()
    container_logs: bool = True
    nccl_tests: bool = False  # also needs Settings.nccl_tests_enabled
    thresholds: Thresholds = Thresholds()
    fixes: Policy = Policy()
    circuit_breaker: Breaker = Breaker()
    timeouts: Timeouts = Timeouts()
    retries: int = Field(default=1, ge=0, le=5)  # for collection only; side effects never retry
    batch_size: int = Field(default=25, ge=1, le=500)  # sweep: hosts per Prefect task
    # distributed sweep: hosts per sweep-batch run (each run is a process on a worker)
    batch_run_size: int = Field(default=500, ge=1, le=5000)
    concurrency: int = Field(default=32, ge=1, le=512)  # sweep: hosts checked at once

    @field_validator("container_probes", mode="before")
    @classmethod
    def _probes(cls, value: object) -> object:
        """A probe is a built-in's name (``torch``) or ``{name, argv}``."""
        if not isinstance(value, list | tuple):
            return value
        out: list[object] = []
        for item in value:
            if isinstance(item, str):
                if item not in BUILTIN_PROBES:
                    raise ValueError(
                        f"unknown probe {item!r}; built-in probes: {', '.join(BUILTIN_PROBES)}"
                    )
                out.append(BUILTIN_PROBES[item])
            else:
                out.append(item)
        return out

    @model_validator(mode="after")
    def _unique(self) -> Runbook:
        for label, names in (
            ("host_sources", [s.name for s in self.host_sources]),
            ("host_sources paths", [s.path for s in self.host_sources]),
            ("container_probes", [p.name for p in self.container_probes]),
        ):
            dup = {n for n in names if names.count(n) > 1}
            if dup:
                raise ValueError(f"{label}: duplicate {', '.join(sorted(dup))}")
        return self


def load_runbook(path: Path | None = None, kind: Kind = "incident") -> Runbook:
    """The runbook at `path`, or the packaged one of that kind."""
    if path is None:
        return _packaged(kind)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read runbook {path}: {exc}") from exc
    book = parse_runbook(text, str(path))
    if book.kind != kind:
        raise InputError(f"runbook {path} is a {book.kind} runbook; a {kind} runbook is needed")
    return book


def parse_runbook(text: str, origin: str = "<runbook>") -> Runbook:
    """Validate runbook YAML text; every problem is one InputError naming the key."""
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an integer of 5000 digits
        raise InputError(f"runbook {origin} is not valid YAML: {exc}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise InputError(f"runbook {origin} is nested too deeply to be a runbook") from None
    if not isinstance(data, dict):
        raise InputError(f"runbook {origin} must be a YAML mapping, got {type(data).__name__}")
    try:
        return Runbook.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise InputError(f"invalid runbook {origin}: {problems}") from None
    except (TypeError, ValueError) as exc:  # odd YAML (e.g. unhashable keys) pydantic rejects
        raise InputError(f"invalid runbook {origin}: {exc}") from None
    except RecursionError:  # a collection that contains itself (YAML anchors)
        raise InputError(f"invalid runbook {origin}: a value refers to itself") from None


@functools.cache
def _packaged(kind: Kind) -> Runbook:
    text = resources.files("runbooks").joinpath(f"{kind}.yaml").read_text(encoding="utf-8")
    return parse_runbook(text, f"runbooks/{kind}.yaml")
