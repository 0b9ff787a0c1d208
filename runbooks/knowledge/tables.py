"""Knowledge tables as data: Xid catalogue, CUDA <-> driver versions, NCCL floors, ECC rules.

Reads the YAML files that ship next to this module (``xid.yaml``, ``cuda_driver.yaml``,
``nccl_floors.yaml``, ``ecc.yaml``) through ``importlib.resources``, once and lazily, into frozen
pydantic models. Every row carries the ``source`` it was checked against and a ``note`` where a
figure could not be verified. Pure: no I/O besides reading that package data.

    >>> xid_info(79).immediate_action
    'RESTART_BM'
    >>> max_cuda_for_driver("535.104.05")
    '12.2'
    >>> driver_satisfies("470.82.01", "cu121")
    False
    >>> nccl_floor("NVIDIA H100 80GB HBM3", 8, "nvlink").min_busbw_gbps
    460.0
    >>> nccl_floor("NVIDIA H100 80GB HBM3", 2, "nvlink") is None
    True
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, StringConstraints, model_validator

from runbooks.core.model import Frozen

SourceUrl = Annotated[str, StringConstraints(pattern=r"^https://\S+$")]
# NVIDIA's resolution tokens, verbatim: RESTART_APP, RESET_GPU, RESTART_BM, CHECK_APP/CUDA, ...
Action = Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Z0-9_/]*$")]
DriverVersion = Annotated[str, StringConstraints(pattern=r"^\d+\.\d+(\.\d+)?$")]
CudaRelease = Annotated[str, StringConstraints(pattern=r"^\d+\.\d+\.\d+$")]
CudaMinor = Annotated[str, StringConstraints(pattern=r"^\d+\.\d+$")]

XidSeverity = Literal["info", "warning", "critical"]
Interconnect = Literal["nvswitch", "nvlink-mesh", "nvlink-bridge", "pcie"]
Platform = Literal["linux", "windows"]


# --- models ------------------------------------------------------------------------------------


class XidInfo(Frozen):
    """One Xid code: NVIDIA's catalog row plus our classification (see xid.yaml header)."""

    code: int = Field(ge=1)
    mnemonic: str
    meaning: str
    severity: XidSeverity
    fault: bool
    app_error: bool
    noisy: bool = False
    immediate_action: Action
    investigatory_action: Action
    source: SourceUrl
    note: str | None = None

    @model_validator(mode="after")
    def _fault_or_app(self) -> XidInfo:
        if self.fault and self.app_error:
            raise ValueError(f"Xid {self.code}: fault and app_error are exclusive")
        return self


class ToolkitDriver(Frozen):
    """One row of NVIDIA's "CUDA Toolkit and Corresponding Driver Versions" table."""

    cuda: CudaRelease
    label: str
    ga: bool = False
    linux: DriverVersion
    windows: DriverVersion | None
    source: SourceUrl
    note: str | None = None


class MinorCompat(Frozen):
    """Minimum driver for CUDA minor-version compatibility across one major family."""

    major: int
    linux: DriverVersion
    windows: DriverVersion | None
    source: SourceUrl
    note: str | None = None


class DriverBranch(Frozen):
    """Linux driver branch -> the "CUDA Version" nvidia-smi prints for it."""

    branch: int
    cuda: CudaMinor
    source: SourceUrl
    note: str | None = None


class DriverRequirement(Frozen):
    """Minimum drivers for a CUDA toolkit/runtime version, both ways NVIDIA states them.

    ``linux``/``windows`` is the toolkit driver (every feature of that release);
    ``minor_compat_*`` the floor for its major family under minor-version compatibility
    (None before CUDA 11, and for Windows where NVIDIA gives none).
    """

    cuda: str
    release: CudaRelease
    label: str
    linux: DriverVersion
    windows: DriverVersion | None
    minor_compat_linux: DriverVersion | None
    minor_compat_windows: DriverVersion | None
    source: SourceUrl
    note: str | None = None


class GpuModel(Frozen):
    key: str
    name: str
    patterns: tuple[str, ...] = Field(min_length=1)


class BandwidthFloor(Frozen):
    """Minimum all_reduce busbw (GB/s) for one node shape: model x GPU count x interconnect."""

    model: str
    gpu_count: int = Field(ge=2)
    interconnects: tuple[Interconnect, ...] = Field(min_length=1)
    min_busbw_gbps: float = Field(gt=0)
    reference_gbps: float | None = None
    reference_high_gbps: float | None = None
    message_size: str | None = None
    basis: Literal["aznhc", "community"]
    source: SourceUrl
    note: str | None = None

    def passes(self, busbw_gbps: float) -> bool:
        """True when a measured busbw reaches the floor (aznhc passes at >=)."""
        return busbw_gbps >= self.min_busbw_gbps


class EccRule(Frozen):
    """A threshold over nvidia-smi ECC / remapped-row / retired-page counters."""

    counters: tuple[str, ...] = Field(min_length=1)
    op: Literal[">", ">="]
    threshold: int = Field(ge=0)
    severity: Literal["warning", "fault"]
    sum_counters: bool = False
    requires_pending_blacklist: bool = False
    source: SourceUrl
    note: str | None = None

    def trips(self, values: Mapping[str, int], *, pending_blacklist: bool = False) -> bool:
        """Does the rule fire for these counter values? Counters not in ``values`` are skipped."""
        present = [values[c] for c in self.counters if c in values]
        if not present or (self.requires_pending_blacklist and not pending_blacklist):
            return False
        candidates = [sum(present)] if self.sum_counters else present
        if self.op == ">":
            return any(v > self.threshold for v in candidates)
        return any(v >= self.threshold for v in candidates)


class EccRules(Frozen):
    """ECC thresholds from ecc.yaml; ``rules()`` lists them by name."""

    remapped_rows_pending: EccRule
    remapped_rows_failure: EccRule
    sram_uncorrectable: EccRule
    sram_correctable: EccRule
    dram_counters: EccRule
    retired_pages_table_full: EccRule
    dcgm_max_retired_pages: EccRule
    dcgm_retired_pages_soft_limit: EccRule
    retired_pages_pending: EccRule
    double_bit_volatile: EccRule

    def rules(self) -> tuple[tuple[str, EccRule], ...]:
        return tuple((name, getattr(self, name)) for name in type(self).model_fields)


class _CudaTables(Frozen):
    toolkit: tuple[ToolkitDriver, ...]
    minor_compat: tuple[MinorCompat, ...]
    branches: tuple[DriverBranch, ...]


class _NcclTables(Frozen):
    investigate_below_fraction: float = Field(gt=0, lt=1)
    investigate_source: SourceUrl
    investigate_note: str
    models: tuple[GpuModel, ...]
    floors: tuple[BandwidthFloor, ...]

    @model_validator(mode="after")
    def _known_models(self) -> _NcclTables:
        keys = [m.key for m in self.models]
        if len(set(keys)) != len(keys):
            raise ValueError("nccl_floors.yaml: duplicate model key")
        unknown = {f.model for f in self.floors} - set(keys)
        if unknown:
            raise ValueError(f"nccl_floors.yaml: floors for unknown models {sorted(unknown)}")
        return self


class ClassInfo(Frozen):
    """One incident class in plain words (classes.yaml): what it means, what to check next."""

    explain: str
    next: tuple[str, ...] = ()
    words: tuple[str, ...] = ()  # what people write about it (a last-resort guess), lower case
    # The one check that tells this class from another it is often mistaken for, by class id.
    apart: dict[str, str] = {}


# --- loading -----------------------------------------------------------------------------------


def _load(name: str) -> dict[str, Any]:
    text = resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{name}: expected a mapping at the top level")
    # "x-..." keys only hold YAML anchors (shared source URLs).
    return {k: v for k, v in data.items() if not str(k).startswith("x-")}


@cache
def _xids() -> dict[int, XidInfo]:
    rows = [XidInfo.model_validate(r) for r in _load("xid.yaml")["xids"]]
    table = {r.code: r for r in rows}
    if len(table) != len(rows):
        raise ValueError("xid.yaml: duplicate Xid code")
    return table


@cache
def _cuda() -> _CudaTables:
    return _CudaTables.model_validate(_load("cuda_driver.yaml"))


@cache
def _nccl() -> _NcclTables:
    return _NcclTables.model_validate(_load("nccl_floors.yaml"))


@cache
def _model_patterns() -> tuple[tuple[str, tuple[re.Pattern[str], ...]], ...]:
    return tuple(
        (m.key, tuple(re.compile(p, re.IGNORECASE) for p in m.patterns)) for m in _nccl().models
    )


@cache
def _classes() -> dict[str, ClassInfo]:
    rows = _load("classes.yaml")["classes"]
    return {str(k): ClassInfo.model_validate(v) for k, v in rows.items()}


def class_info(incident: str) -> ClassInfo:
    """What an incident class means and what to check next (classes.yaml)."""
    return _classes().get(incident) or ClassInfo(explain=incident)


def class_table() -> dict[str, ClassInfo]:
    return dict(_classes())


# --- Xid ---------------------------------------------------------------------------------------


def xid_info(code: int) -> XidInfo | None:
    """The catalogue row for an Xid code, or None when the code is not in xid.yaml."""
    return _xids().get(code)


def xid_table() -> tuple[XidInfo, ...]:
    """Every Xid row, ordered by code."""
    return tuple(sorted(_xids().values(), key=lambda x: x.code))


# --- CUDA <-> driver ---------------------------------------------------------------------------

_CU_TAG = re.compile(r"^cu(\d{2,3})$")
_DOTTED = re.compile(r"^(?:cuda)?\s*v?(\d+)\.(\d+)(?:\.(\d+))?$")
_DRIVER = re.compile(r"(?<!\d)(\d{1,9})\.(\d{1,9})(?:\.(\d{1,9}))?")


def _parse_cuda(cuda: str) -> tuple[int, int, int | None] | None:
    """Parse "12.1" -> (12, 1, None), "12.1.1" -> (12, 1, 1), "cu121" -> (12, 1, None)."""
    s = cuda.strip().lower()
    if m := _CU_TAG.match(s):
        digits = m.group(1)
        return int(digits[:-1]), int(digits[-1]), None
    if m := _DOTTED.match(s):
        patch = m.group(3)
        return int(m.group(1)), int(m.group(2)), None if patch is None else int(patch)
    return None


def _parse_driver(driver: str) -> tuple[int, int, int] | None:
    """Parse "535.104.05" -> (535, 104, 5), "570.26" -> (570, 26, 0); ignores text around it."""
    m = _DRIVER.search(driver)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _release(row: ToolkitDriver) -> tuple[int, int, int]:
    major, minor, patch = (int(p) for p in row.cuda.split("."))
    return major, minor, patch


def _minor_compat(major: int) -> MinorCompat | None:
    return next((m for m in _cuda().minor_compat if m.major == major), None)


def min_driver_for_cuda(cuda: str) -> DriverRequirement | None:
    """Minimum drivers for a CUDA version ("12.1", "12.1.1", "cu121", "11.8"), or None.

    A bare major.minor (or a ``cuNNN`` tag) resolves to that minor's GA row. With a patch level
    the newest table row at or below it is used, so "12.3.2" (not in NVIDIA's table) falls back to
    the 12.3 Update 1 row and a component version like "12.1.105" to 12.1 Update 1.
    """
    parsed = _parse_cuda(cuda)
    if parsed is None:
        return None
    major, minor, patch = parsed
    rows = [r for r in _cuda().toolkit if _release(r)[:2] == (major, minor)]
    if not rows:
        return None
    ga = next((r for r in rows if r.ga), min(rows, key=_release))
    row = ga
    if patch is not None:
        older = [r for r in rows if _release(r)[2] <= patch]
        row = max(older, key=_release) if older else ga
    compat = _minor_compat(major)
    return DriverRequirement(
        cuda=f"{major}.{minor}" if patch is None else f"{major}.{minor}.{patch}",
        release=row.cuda,
        label=row.label,
        linux=row.linux,
        windows=row.windows,
        minor_compat_linux=compat.linux if compat else None,
        minor_compat_windows=compat.windows if compat else None,
        source=row.source,
        note=row.note,
    )


def max_cuda_for_driver(driver: str) -> str | None:
    """The CUDA version nvidia-smi prints for a Linux driver ("535.104.05" -> "12.2").

    Looked up by driver branch; None for an unparsable version or a branch not in the table
    (no guessing from neighbouring branches).
    """
    parsed = _parse_driver(driver)
    if parsed is None:
        return None
    return next((b.cuda for b in _cuda().branches if b.branch == parsed[0]), None)


def driver_satisfies(
    driver: str, cuda: str, *, platform: Platform = "linux", strict: bool = False
) -> bool | None:
    """Can a host with this driver run an image built for this CUDA runtime? None if unknown.

    Rule applied (NVIDIA's CUDA Compatibility guide):

    1. True when the driver is at least the toolkit driver of that release (every feature).
    2. Otherwise, for CUDA 11 and later and unless ``strict``, True when the driver is at least
       the minor-version-compatibility floor of the CUDA major family (12.x: 525.60.13,
       11.x: 450.80.02, 13.x: 580.65.06 on Linux). NVIDIA: such applications "can run, with
       limited feature-set" - e.g. PTX JIT of newer PTX still needs the newer driver - which is
       what most PyTorch wheels and NGC images rely on (a 535 driver runs a cu124 wheel).
    3. Otherwise False; before CUDA 11 there is no minor-version compatibility.

    A newer major driver always runs older CUDA (backward compatibility), which rule 1 covers.
    None when either version cannot be parsed or nothing is known for that CUDA version or
    platform (e.g. CUDA 13.x on Windows, where NVIDIA lists no minimum).
    """
    have = _parse_driver(driver)
    want = _parse_cuda(cuda)
    if have is None or want is None:
        return None
    req = min_driver_for_cuda(cuda)
    need = None if req is None else (req.linux if platform == "linux" else req.windows)
    if need is not None and have >= _as_tuple(need):
        return True
    compat = _minor_compat(want[0]) if want[0] >= 11 else None
    floor = None if compat is None else (compat.linux if platform == "linux" else compat.windows)
    if not strict and floor is not None:
        return have >= _as_tuple(floor)
    if need is None:
        return None
    return False


def _as_tuple(version: str) -> tuple[int, int, int]:
    parsed = _parse_driver(version)
    if parsed is None:  # table values are validated by DriverVersion
        raise ValueError(f"bad driver version in table: {version!r}")
    return parsed


def cuda_toolkit_table() -> tuple[ToolkitDriver, ...]:
    return _cuda().toolkit


def minor_compat_table() -> tuple[MinorCompat, ...]:
    return _cuda().minor_compat


def driver_branch_table() -> tuple[DriverBranch, ...]:
    return _cuda().branches


# --- NCCL bandwidth floors ---------------------------------------------------------------------

_ANY_NVLINK: frozenset[Interconnect] = frozenset({"nvswitch", "nvlink-mesh", "nvlink-bridge"})
_ALL: frozenset[Interconnect] = frozenset({"nvswitch", "nvlink-mesh", "nvlink-bridge", "pcie"})


def _interconnect_kinds(interconnect: str | None) -> frozenset[Interconnect]:
    """Which floor interconnects a caller's description can mean (empty = unknown word)."""
    if interconnect is None:
        return _ALL
    s = re.sub(r"[\s_]+", "-", interconnect.strip().lower())
    if s in {"nvswitch", "nvls", "nvl72", "nvlink-switch", "nvlink+nvswitch"}:
        return frozenset({"nvswitch"})
    if s in {"bridge", "nvlink-bridge", "nvlink-bridged", "nvbridge"}:
        return frozenset({"nvlink-bridge"})
    if s in {"nvlink-mesh", "hybrid-cube-mesh", "cube-mesh"}:
        return frozenset({"nvlink-mesh"})
    if re.fullmatch(r"nvlink\d*|nv\d*", s):  # "nvlink", "nvlink4", topo matrix "NV12"
        return _ANY_NVLINK
    if re.fullmatch(r"pcie?(-?gen)?\d*|sys|phb|node|pxb|pix", s):  # incl. nvidia-smi topo words
        return frozenset({"pcie"})
    return frozenset()


def gpu_model_key(name: str) -> str | None:
    """Canonical model key for an nvidia-smi GPU name ("NVIDIA A100-SXM4-80GB" -> "a100-sxm4")."""
    wanted = name.strip().lower()
    for key, patterns in _model_patterns():
        if wanted == key or any(p.search(name) for p in patterns):
            return key
    return None


def nccl_floor(gpu_model: str, gpu_count: int, interconnect: str | None) -> BandwidthFloor | None:
    """The all_reduce busbw floor for this node's own shape, or None when none is known.

    ``gpu_model`` is an nvidia-smi name ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB") or a
    model key; ``interconnect`` what the node is built with: "nvlink" (any NVLink), "nvswitch",
    "nvlink-bridge", "pcie" (or a topo word like "NV12"/"SYS"); None accepts any. Only a floor for
    exactly this model and GPU count is returned - never a bigger node's floor. If several
    match, the lowest (most lenient) wins.
    """
    key = gpu_model_key(gpu_model)
    kinds = _interconnect_kinds(interconnect)
    if key is None or not kinds:
        return None
    matches = [
        f
        for f in _nccl().floors
        if f.model == key and f.gpu_count == gpu_count and kinds.intersection(f.interconnects)
    ]
    return min(matches, key=lambda f: f.min_busbw_gbps, default=None)


def nccl_floors() -> tuple[BandwidthFloor, ...]:
    return _nccl().floors


def investigate_threshold(reference_gbps: float) -> float:
    """Busbw below which to investigate: 20 % under the reference (nccl_floors.yaml)."""
    return reference_gbps * (1.0 - _nccl().investigate_below_fraction)


# --- ECC ---------------------------------------------------------------------------------------


@cache
def ecc_rules() -> EccRules:
    """The ECC / row-remap / retired-page thresholds from ecc.yaml."""
    return EccRules.model_validate(_load("ecc.yaml")["rules"])
