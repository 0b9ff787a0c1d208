"""Judgments of facts that the incident rules (rules.py) and the host health checks (health.py)
both make (PURE): is this /dev/shm small, this memlock limit low, this kernel event recent, this
GPU's ECC record a fault, this Container Toolkit too old, this image's CUDA beyond this driver.
One function each, and every threshold comes from `Thresholds` (runbook.py; a runbook may change
it; `Facts.thresholds` carries the one in force): a diagnosis and a sweep verdict can never
disagree about the same fact.

Time: an event's age is measured from one reference — the collection time for dated lines, the
host's uptime (``/proc/uptime``) for raw ``dmesg`` stamps, and the newest kernel event only when
the uptime was not collected. An incident asks "did this happen within `xid_incident_window_h`
before the workload failed?"; a sweep asks "within `xid_window_h` before now?".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

from runbooks import knowledge
from runbooks.collect.evidence.nvidia_smi import XmlGpu
from runbooks.collect.evidence.probes import ToolkitVersion, version_tuple
from runbooks.collect.evidence.topology import Topology
from runbooks.core.model import Frozen, Line
from runbooks.core.runbook import Thresholds
from runbooks.diagnose.facts import ContainerFacts, Facts

MIB = 1024 * 1024
DOCKER_DEFAULT_SHM = 64 * MIB  # what a container gets without --shm-size (a fact, not a limit)
_LATE = timedelta(minutes=10)  # a line stamped a little after the reference still belongs to it


def inspect_line(c: ContainerFacts, key: str, text: str | None = None) -> Line:
    """Cite the inspect JSON line that holds `key` (or the file itself when not found)."""
    found = c.inspect_lines.get(key)
    if found is not None:
        return found
    return Line(source=f"containers/{c.name}.inspect.json", line=0, text=text or key)


# -- /dev/shm ------------------------------------------------------------------------------------
def shm_size(c: ContainerFacts) -> int:
    """Bytes of the container's /dev/shm: measured inside it (df) when a probe ran, else its
    inspect, else Docker's default."""
    if c.shm is not None and c.shm.size is not None:
        return c.shm.size
    return (c.inspect.shm_size if c.inspect else None) or DOCKER_DEFAULT_SHM


def shm_line(c: ContainerFacts) -> Line:
    if c.shm is not None:
        return c.shm.line
    return inspect_line(c, "ShmSize", f'"ShmSize": {shm_size(c)}')


def shm_small(c: ContainerFacts, t: Thresholds) -> bool:
    """Is the container's /dev/shm under `shm_min_mib`? (`--ipc=host` shares the host's, which
    is not measured unless a probe ran inside.)"""
    measured = c.shm is not None and c.shm.size is not None
    if not measured and (c.inspect is None or c.inspect.ipc_mode == "host"):
        return False
    return shm_size(c) < t.shm_min_mib * MIB


# -- locked memory -------------------------------------------------------------------------------
def memlock_low(kb: int | None, t: Thresholds) -> bool:
    """Is a locked-memory limit (KiB; -1 = unlimited) too low to register RDMA/pinned buffers?"""
    return kb is not None and 0 <= kb < t.memlock_min_kb


def uses_rdma(env: Mapping[str, str], devices: Iterable[str] = ()) -> bool:
    """Does the workload register memory with a NIC (InfiniBand/RoCE/EFA devices or NCCL/libfabric
    settings that turn it on)?"""
    if any("/dev/infiniband" in d for d in devices):
        return True
    if env.get("NCCL_IB_DISABLE", "").strip() not in ("", "1") or env.get("NCCL_IB_HCA"):
        return True
    return any(k.startswith(("NCCL_IB_", "FI_")) and k != "NCCL_IB_DISABLE" for k in env)


# -- time ----------------------------------------------------------------------------------------
def in_window(
    facts: Facts,
    when: datetime | None,
    stamp_uptime: float | None,
    window_h: float,
    *,
    incident: bool,
) -> bool:
    """Did a kernel event happen within `window_h` hours before the reference — the incident
    (the workload's failure) when `incident`, else the collection? Unknown timing: True (a
    kernel log keeps only this boot's events)."""
    window = timedelta(hours=window_h)
    ref = facts.incident_time if incident else facts.collected_at
    if when is not None and ref is not None:
        when = when if when.tzinfo else when.replace(tzinfo=ref.tzinfo)
        start = facts.started_at
        if incident and start is not None and when < start - timedelta(minutes=5):
            return False  # before the workload even started
        return ref - window <= when <= ref + _LATE
    if stamp_uptime is None:
        return True
    now = facts.uptime_s
    if now is not None:
        if incident and facts.collected_at is not None and ref is not None:
            now -= max(0.0, (facts.collected_at - ref).total_seconds())
        return now - stamp_uptime <= window.total_seconds()
    if facts.kernel is None:
        return True
    newest = max(
        [0.0]
        + [x.uptime_s or 0.0 for x in facts.kernel.xids]
        + [n.uptime_s or 0.0 for n in facts.kernel.nvrm]
    )
    return newest - stamp_uptime <= window.total_seconds()


# -- ECC -----------------------------------------------------------------------------------------
def ecc_counters(gpu: XmlGpu) -> dict[str, int]:
    """The XML's counters under the names ecc.yaml's rules use (nvidia-smi query names)."""
    values: dict[str, int] = {}
    rows = gpu.remapped_rows
    if rows is not None:
        if rows.pending is not None:
            values["remapped_rows.pending"] = int(rows.pending)
        if rows.failure is not None:
            values["remapped_rows.failure"] = int(rows.failure)
    for scope, ecc in (("volatile", gpu.ecc_volatile), ("aggregate", gpu.ecc_aggregate)):
        if ecc is None:
            continue
        for kind, corrected, uncorrected in (
            ("sram", ecc.sram_correctable, ecc.sram_uncorrectable),
            ("dram", ecc.dram_correctable, ecc.dram_uncorrectable),
        ):
            if corrected is not None:
                values[f"ecc.errors.corrected.{scope}.{kind}"] = corrected
            if uncorrected is not None:
                values[f"ecc.errors.uncorrected.{scope}.{kind}"] = uncorrected
        # Pre-Ampere drivers count single-bit (corrected) and double-bit (uncorrected) errors.
        if ecc.single_bit_total is not None:
            values[f"ecc.errors.corrected.{scope}.total"] = ecc.single_bit_total
        if ecc.double_bit_total is not None:
            values[f"ecc.errors.uncorrected.{scope}.total"] = ecc.double_bit_total
    pages = gpu.retired_pages
    if pages is not None:
        if pages.sbe_count is not None:
            values["retired_pages.sbe"] = pages.sbe_count
        if pages.dbe_count is not None:
            values["retired_pages.dbe"] = pages.dbe_count
        pending = pages_pending(gpu)
        if pending is not None:
            values["retired_pages.pending"] = int(pending)
    return values


def pages_pending(gpu: XmlGpu) -> bool | None:
    """Are retired pages waiting for a driver reload? DTD v10 (drivers 410-440) names the flag
    ``pending_retirement`` only; later ones add ``pending_blacklist`` ("Pending Page
    Blacklist"): either one saying Yes counts."""
    pages = gpu.retired_pages
    if pages is None or (pages.pending_blacklist is None and pages.pending_retirement is None):
        return None
    return bool(pages.pending_blacklist or pages.pending_retirement)


def ecc_tripped(gpu: XmlGpu) -> list[tuple[str, knowledge.EccRule, dict[str, int]]]:
    """Every ECC/row-remap/retired-page rule (knowledge/ecc.yaml) this GPU's record trips:
    (rule name, rule, the counters it read)."""
    values = ecc_counters(gpu)
    pending = bool(pages_pending(gpu))
    return [
        (name, r, {c: values[c] for c in r.counters if c in values})
        for name, r in knowledge.ecc_rules().rules()
        if r.trips(values, pending_blacklist=pending)
    ]


# -- NVIDIA Container Toolkit --------------------------------------------------------------------
def toolkit_too_old(facts: Facts) -> ToolkitVersion | None:
    """The host's NVIDIA Container Toolkit version when it is under `toolkit_min_version`."""
    found = facts.toolkit_version
    if found is None:
        return None
    if version_tuple(found.version) < version_tuple(facts.thresholds.toolkit_min_version):
        return found
    return None


# -- CUDA of an image vs the host's driver -------------------------------------------------------
class CudaMismatch(Frozen):
    container: str
    image: str
    wanted: str  # the CUDA the container needs (torch.version.cuda, else the image's CUDA)
    driver: str
    line: Line  # the host's driver line

    @property
    def reason(self) -> str:
        return (
            f"image {self.image} needs CUDA {self.wanted}; driver {self.driver} supports at most "
            f"CUDA {knowledge.max_cuda_for_driver(self.driver) or '?'}"
        )


def host_driver(facts: Facts) -> str | None:
    """The host's driver version (nvidia-smi table, else its XML)."""
    return (facts.smi.driver_version if facts.smi else None) or (
        facts.smi_xml.driver_version if facts.smi_xml else None
    )


def cuda_beyond_driver(facts: Facts) -> list[CudaMismatch]:
    """Containers whose CUDA (the torch probe's torch.version.cuda, else the image's
    CUDA_VERSION / NVIDIA_REQUIRE_CUDA) the host's driver cannot run (knowledge/cuda_driver.yaml;
    minor-version compatibility counts unless `cuda_minor_compat` is off)."""
    driver = host_driver(facts)
    if driver is None:
        return []
    strict = not facts.thresholds.cuda_minor_compat
    out = []
    for c in facts.containers.values():
        wanted = (c.torch.cuda if c.torch and c.torch.cuda else None) or (
            c.inspect.image_cuda if c.inspect else None
        )
        if not wanted or knowledge.driver_satisfies(driver, wanted, strict=strict) is not False:
            continue
        line = (
            facts.smi.status_line
            if facts.smi and facts.smi.status_line
            else Line(source="nvidia-smi.txt", line=0, text=f"Driver Version: {driver}")
        )
        image = c.inspect.image if c.inspect else c.name
        out.append(
            CudaMismatch(container=c.name, image=image, wanted=wanted, driver=driver, line=line)
        )
    return out


# -- the node's GPU interconnect -----------------------------------------------------------------
def node_interconnect(topology: Topology | None) -> str | None:
    """What `nvidia-smi topo -m` says joins the node's GPUs, in the words of
    knowledge/nccl_floors.yaml: "nvlink" (every GPU pair over NVLink: NVSwitch or a full mesh),
    "pcie" (no pair over NVLink: PIX/PXB/PHB/NODE/SYS), None when unknown or mixed (some pairs
    over NVLink, some not: a bridged pair or a partial mesh; the most lenient floor applies).
    """
    if topology is None or not topology.links:
        return None
    kinds = [k.startswith("NV") for k in topology.links.values()]
    if all(kinds):
        return "nvlink"
    if not any(kinds):
        return "pcie"
    return None


# -- image drift and the CUDA JIT cache -----------------------------------------------------------
class ImageDrift(Frozen):
    container: str
    ref: str  # the tag the container was started from
    running: str  # the image ID it runs
    now: str | None  # the image ID the tag names now (None: the tag is gone)


def image_drift(c: ContainerFacts) -> ImageDrift | None:
    """Does the container's image tag now name another image than the one it runs? A restart
    keeps the old image; a recreate (or a new node) takes the new one: the fleet runs two builds
    under one name."""
    if c.inspect is None or c.image_now is None or not c.inspect.image_id:
        return None
    if c.image_now.ref != c.inspect.image or c.image_now.id == c.inspect.image_id:
        return None
    return ImageDrift(
        container=c.name, ref=c.image_now.ref, running=c.inspect.image_id, now=c.image_now.id
    )


def cuda_cache_growth_kib(before_kib: int | None, now_kib: int | None, t: Thresholds) -> int:
    """How much a container's CUDA JIT cache grew since the last sweep, when that is at least
    `cuda_cache_growth_mib` (else 0). A cache that keeps growing means kernels are compiled
    from PTX at every start: the image has no native code for this GPU."""
    if before_kib is None or now_kib is None:
        return 0
    grown = now_kib - before_kib
    return grown if grown >= t.cuda_cache_growth_mib * 1024 else 0
