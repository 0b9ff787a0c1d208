"""Fleet health checks (PURE): one host's `Facts` -> a verdict with stable finding codes, and the
difference between two sweeps (what is new, changed or resolved).

Verdicts: ``healthy``; ``warning`` (degraded or at risk, keep serving); ``drain`` (take the host
out of scheduling: its GPUs are unusable or their results suspect). Codes are stable strings an
alerting rule can key on, e.g. ``xid-79`` on ``0000:3b:00`` or ``container-shm-small`` on
``train``. Each finding has a `key` (code + subject) that identifies it across sweeps and a
`detail` whose change is reported as "changed".

Xid events count only inside the runbook's window (by the host's uptime for raw ``dmesg``
stamps, by the collection time for dated ones) and only once per (code, GPU).

One engine: every judgment (shm, memlock, event recency, ECC) and threshold is shared with the
incident rules (runbooks/diagnose/judgments.py, `Thresholds`), and every finding names the taxonomy
class
it is evidence of (`incident`), the same id a diagnosis of the same facts uses;
`classify.diagnose` reports these findings too, so a sweep and a diagnosis of one bundle agree.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Literal, cast

from runbooks import knowledge
from runbooks.collect.evidence.nvidia_smi import XmlGpu
from runbooks.core.model import Frozen, Line
from runbooks.core.runbook import Thresholds
from runbooks.core.taxonomy import Incident
from runbooks.diagnose.facts import ContainerFacts, Facts
from runbooks.diagnose.judgments import (
    MIB,
    ImageDrift,
    cuda_beyond_driver,
    cuda_cache_growth_kib,
    ecc_tripped,
    image_drift,
    in_window,
    memlock_low,
    shm_size,
    shm_small,
    toolkit_too_old,
    uses_rdma,
)

Verdict = Literal["healthy", "warning", "drain"]
Level = Literal["warning", "drain"]
_RANK: dict[str, int] = {"healthy": 0, "warning": 1, "drain": 2}
MEASURE = "measure:"  # a stored measure, not a finding: "measure:cuda-cache@train" -> {value}


class HealthFinding(Frozen):
    code: str
    level: Level
    subject: str = ""  # a GPU bus id, a container, a mount; "" for the host
    message: str
    evidence: tuple[Line, ...] = ()
    incident: str = Incident.UNKNOWN  # the taxonomy class this is evidence of (see incident_of)
    # Why this finding was not checked this sweep (its source did not answer, or its check is off
    # in the runbook): it is the last sweep's, kept as it was. None: seen by this sweep.
    not_checked: str | None = None

    @property
    def key(self) -> str:
        return f"{self.code}@{self.subject}" if self.subject else self.code


class HostHealth(Frozen):
    host: str
    verdict: Verdict
    findings: tuple[HealthFinding, ...] = ()
    gpus_seen: int = 0
    gpus_expected: int | None = None
    driver: str | None = None
    toolkit: str | None = None
    bundle: str | None = None
    error: str | None = None  # the host could not be checked (unreachable, timed out)
    # what a later sweep compares against: "cuda-cache@CONTAINER" -> KiB
    measures: dict[str, int] = {}
    # finding codes (or prefixes, "" for all) this sweep could not judge -> why (`unchecked`)
    unchecked: dict[str, str] = {}


def verdict_of(findings: Iterable[HealthFinding]) -> Verdict:
    worst: Verdict = "healthy"
    for f in findings:
        if _RANK[f.level] > _RANK[worst]:
            worst = f.level
    return worst


def check_host(
    host: str,
    facts: Facts,
    thresholds: Thresholds,
    *,
    expected_gpus: int | None = None,
    source_status: Mapping[str, str] | None = None,
    uptime_s: float | None = None,
    bundle: str | None = None,
) -> HostHealth:
    """Every health check of one host. `source_status`: bundle source name -> ok/failed/timeout."""
    status = dict(source_status or {})
    facts = facts.model_copy(update={"thresholds": thresholds})
    if uptime_s is not None:
        facts = facts.model_copy(update={"uptime_s": uptime_s})
    driver = facts.smi.driver_version if facts.smi else None
    if facts.ssh_error is not None:
        f = HealthFinding(
            code="host-unreachable", level="warning", message=f"not checked: {facts.ssh_error}"
        )
        return HostHealth(
            host=host,
            verdict="warning",
            findings=(f,),
            gpus_expected=expected_gpus,
            bundle=bundle,
            error=facts.ssh_error,
            unchecked={"": "the host was not reached"},
        )
    found: list[HealthFinding] = []
    found += _driver(facts, status)
    found += _gpu_count(facts, expected_gpus, status)
    found += _xids(facts, thresholds)
    found += _ecc(facts)
    found += _thermal(facts, thresholds)
    found += _stragglers(facts, thresholds)
    found += _toolkit(facts)
    found += _containers(facts, thresholds)
    found += _disks(facts, thresholds)
    found += _nccl(facts)
    found += dcgm_findings(facts)
    unique = {f.key: f.model_copy(update={"incident": incident_of(f.code)}) for f in found}
    ordered = sorted(unique.values(), key=lambda f: (-_RANK[f.level], f.code, f.subject))
    return HostHealth(
        host=host,
        verdict=verdict_of(ordered),
        findings=tuple(ordered),
        gpus_seen=facts.host_gpu_count,
        gpus_expected=expected_gpus,
        driver=driver,
        toolkit=facts.toolkit.splitlines()[0][:120] if facts.toolkit else None,
        bundle=bundle,
        measures=_measures(facts),
        unchecked=unchecked(facts, status),
    )


# Finding codes (a code, or the prefix of a family) and the bundle source each is judged from.
# When that source gave no whole answer this sweep, the absence of the finding proves nothing.
_JUDGED_FROM: tuple[tuple[str, str], ...] = (
    ("nccl-bandwidth-low", "nccl-tests"),
    ("xid-", "kernel-log"),
    ("ecc-", "nvidia-smi-xml"),
    ("gpu-reset-required", "nvidia-smi-xml"),
    ("gpu-throttled", "nvidia-smi-xml"),
    ("gpu-hot", "nvidia-smi-xml"),
    ("gpu-straggler", "nvidia-smi-xml"),
    ("disk-full", "df"),
)


def unchecked(facts: Facts, status: Mapping[str, str]) -> dict[str, str]:
    """The finding codes this host's evidence could not judge -> why: each code's source
    (`_JUDGED_FROM`) did not run (off in the runbook, skipped), failed or timed out. A source the
    bundle does not list counts as answered when its output was read."""
    read = {
        "nccl-tests": facts.nccl is not None,
        "kernel-log": facts.kernel is not None,
        "nvidia-smi-xml": facts.smi_xml is not None,
        "df": bool(facts.df),
    }
    out = {}
    for code, source in _JUDGED_FROM:
        state = status.get(source)
        if state == "ok" or (state is None and read[source]):
            continue
        out[code] = f"{source} did not run" if state in (None, "skipped") else f"{source} {state}"
    return out


def _not_judged(code: str, unjudged: Mapping[str, str]) -> str | None:
    """Why `code` was not judged this sweep (None: it was)."""
    for prefix, why in unjudged.items():
        if code == prefix or code.startswith(prefix):
            return why
    return None


def _measures(facts: Facts) -> dict[str, int]:
    return {
        f"cuda-cache@{name}": c.cuda_cache.kib
        for name, c in sorted(facts.containers.items())
        if c.cuda_cache is not None and c.cuda_cache.kib is not None
    }


def with_history(
    h: HostHealth, before: Mapping[str, Mapping[str, str]], t: Thresholds
) -> HostHealth:
    """The judgments that need the previous sweep of this host (`before`, as `snapshot` stored
    it): a container's CUDA JIT cache that keeps growing; and the last sweep's findings that this
    one could not check (`unchecked`), kept as they were and marked `not_checked` — never
    reported resolved by a check that did not run."""
    extra = []
    seen = {f.key for f in h.findings}
    for key, entry in sorted(before.items()):
        if key.startswith(MEASURE) or key in seen:
            continue
        why = _not_judged(entry.get("code", ""), h.unchecked)
        level = entry.get("level")
        if why is None or level not in ("warning", "drain"):
            continue
        extra.append(
            HealthFinding(
                code=entry.get("code", key),
                level=cast(Level, level),
                subject=entry.get("subject", ""),
                message=entry.get("message", ""),
                incident=incident_of(entry.get("code", "")),
                not_checked=why,
            )
        )
    for key, kib in sorted(h.measures.items()):
        name = key.removeprefix("cuda-cache@")
        old = before.get(MEASURE + key, {}).get("value", "")
        grown = cuda_cache_growth_kib(int(old) if old.isdigit() else None, kib, t)
        if grown:
            extra.append(
                HealthFinding(
                    code="container-cuda-cache-growing",
                    level="warning",
                    subject=name,
                    message=f"{name}: the CUDA JIT cache grew {grown // 1024} MiB since the last "
                    f"sweep (now {kib // 1024} MiB): kernels are being compiled from PTX at run "
                    "time; an image with native code for this GPU (its sm_XX in the build's "
                    "arch list) starts without that cost",
                )
            )
    if not extra:
        return h
    findings = tuple(sorted((*h.findings, *extra), key=lambda f: (-_RANK[f.level], f.code)))
    return h.model_copy(update={"findings": findings, "verdict": verdict_of(findings)})


def _driver(facts: Facts, status: Mapping[str, str]) -> list[HealthFinding]:
    out = []
    if status.get("nvidia-smi") == "timeout":
        out.append(
            HealthFinding(
                code="nvidia-smi-hung",
                level="drain",
                message="nvidia-smi did not answer within its timeout (a hung GPU or driver)",
            )
        )
    smi = facts.smi
    if smi is None or smi.status == "ok":
        return out
    line = (smi.status_line,) if smi.status_line else ()
    codes: dict[str, tuple[str, Level]] = {
        "driver-not-loaded": ("driver-not-loaded", "drain"),
        "library-mismatch": ("driver-library-mismatch", "drain"),
        "no-devices": ("no-gpus-found", "drain"),
        "not-found": ("nvidia-smi-missing", "drain"),
        "error": ("nvidia-smi-error", "drain"),
    }
    if smi.status == "error" and smi.status_line is None:
        # Output that is neither a table nor a known error says nothing about the GPUs.
        codes["error"] = ("nvidia-smi-unrecognized", "warning")
    if smi.status in codes:
        code, level = codes[smi.status]
        text = smi.status_line.text if smi.status_line else smi.status
        out.append(HealthFinding(code=code, level=level, message=text[:300], evidence=line))
    return out


def _gpu_count(facts: Facts, expected: int | None, status: dict[str, str]) -> list[HealthFinding]:
    """Fewer GPUs than the inventory says, counted from an output that came back whole (a
    source that failed in the middle is no evidence of a missing GPU)."""
    seen = facts.gpus_listed(lambda source: status.get(source) in ("ok", None))
    if expected is None or seen == 0 or seen >= expected:
        return []  # seen == 0 is the driver finding's business
    return [
        HealthFinding(
            code="gpu-count-low",
            level="drain",
            message=f"{seen} GPUs visible, the inventory expects {expected}",
        )
    ]


def _xids(facts: Facts, t: Thresholds) -> list[HealthFinding]:
    if facts.kernel is None:
        return []
    events: dict[tuple[int, str], list[Line]] = {}
    for x in facts.kernel.xids:
        info = knowledge.xid_info(x.code)
        if info is not None and (info.noisy or info.severity == "info"):
            continue
        if not in_window(facts, x.timestamp, x.uptime_s, t.xid_window_h, incident=False):
            continue
        events.setdefault((x.code, x.pci or "?"), []).append(x.line)
    out = []
    for (code, pci), lines in sorted(events.items()):
        info = knowledge.xid_info(code)
        level: Level = (
            "drain" if info is None or info.fault or info.severity == "critical" else ("warning")
        )
        what = f"{info.mnemonic}: {info.immediate_action}" if info else "unknown Xid"
        out.append(
            HealthFinding(
                code=f"xid-{code}",
                level=level,
                subject=pci,
                message=f"Xid {code} on {pci} within {t.xid_window_h:g} h ({what}); "
                f"{len(lines)} line(s)",
                evidence=tuple(lines[:3]),
            )
        )
    return out


def _ecc(facts: Facts) -> list[HealthFinding]:
    if facts.smi_xml is None:
        return []
    out = []
    for gpu in facts.smi_xml.gpus:
        subject = gpu.bus_id or f"gpu{gpu.position}"
        out += [
            HealthFinding(
                code=f"ecc-{name.replace('_', '-')}",
                level="drain" if rule.severity == "fault" else "warning",
                subject=subject,
                message=f"{name.replace('_', ' ')}: {shown} ({rule.op} {rule.threshold})",
            )
            for name, rule, shown in ecc_tripped(gpu)
        ]
        if (gpu.reset_required or "").lower() == "yes":
            out.append(
                HealthFinding(
                    code="gpu-reset-required",
                    level="drain",
                    subject=subject,
                    message="nvidia-smi reports the GPU needs a reset",
                )
            )
    return out


def _thermal(facts: Facts, t: Thresholds) -> list[HealthFinding]:
    out = []
    if facts.smi_xml is not None:
        for gpu in facts.smi_xml.gpus:
            active = [r for r in gpu.clock_event_reasons_active if r in t.throttle_reasons]
            if active:
                out.append(
                    HealthFinding(
                        code="gpu-throttled",
                        level="warning",
                        subject=gpu.bus_id or f"gpu{gpu.position}",
                        message=f"clocks held down: {', '.join(sorted(active))}",
                    )
                )
    gpus = facts.smi.gpus if facts.smi is not None else ()
    for g in gpus:
        if g.temperature_c is not None and g.temperature_c > t.temperature_max_c:
            out.append(
                HealthFinding(
                    code="gpu-hot",
                    level="warning",
                    subject=g.bus_id or f"gpu{g.index}",
                    message=f"{g.temperature_c} C (threshold {t.temperature_max_c} C)",
                    evidence=(g.line,) if g.line else (),
                )
            )
    return out


def _stragglers(facts: Facts, t: Thresholds) -> list[HealthFinding]:
    """GPUs that stand out from the OTHER GPUs of the same node, one warning per kind and GPU:
    SM clock (busy GPUs), temperature (busy against busy, idle against idle), throttle reasons
    active on fewer than half of the GPUs, a PCIe link narrower than its peers', a PCIe
    generation under its busy peers' (idle GPUs drop it to save power: not judged). Each needs
    `straggler_min_gpus` GPUs to compare."""
    if facts.smi_xml is None:
        return []
    gpus = list(facts.smi_xml.gpus)
    busy = [g for g in gpus if (g.utilization_gpu_percent or 0) >= t.straggler_busy_pct]
    idle = [g for g in gpus if g not in busy]
    out = [
        _straggler(
            "gpu-straggler",
            g,
            f"SM clock {v} MHz under {t.straggler_ratio:g} x the "
            f"median {m:g} MHz of the node's {n} other busy GPUs",
        )
        for g, v, m, n in _against_peers(busy, lambda g: g.sm_clock_mhz or None, t)
        if v < t.straggler_ratio * m
    ]
    for group, state in ((busy, "busy"), (idle, "idle")):
        out += [
            _straggler(
                "gpu-straggler-temp",
                g,
                f"{v} C, more than {t.straggler_temp_delta_c} C "
                f"above the median {m:g} C of the node's {n} other {state} GPUs",
            )
            for g, v, m, n in _against_peers(group, lambda g: g.temperature_c, t)
            if v > m + t.straggler_temp_delta_c
        ]
    out += [
        _straggler(
            "gpu-straggler-pcie-width",
            g,
            f"PCIe link x{v} (the GPU can do "
            f"x{g.pcie_width_max or '?'}), narrower than the x{m:g} median of the "
            f"node's {n} other GPUs",
        )
        for g, v, m, n in _against_peers(gpus, lambda g: g.pcie_width, t)
        if v < m
    ]
    out += [
        _straggler(
            "gpu-straggler-pcie-gen",
            g,
            f"PCIe gen {v} while busy (the GPU can do gen "
            f"{g.pcie_gen_max or '?'}), under the gen {m:g} median of the node's {n} "
            "other busy GPUs",
        )
        for g, v, m, n in _against_peers(busy, lambda g: g.pcie_gen, t)
        if v < m
    ]
    return out + _throttled_minority(gpus, t)


def _against_peers(
    group: list[XmlGpu], value: Callable[[XmlGpu], int | None], t: Thresholds
) -> list[tuple[XmlGpu, int, float, int]]:
    """(GPU, its value, the median of the others' values, how many others) for each GPU of
    `group` with a value, when at least `straggler_min_gpus` GPUs have one."""
    known = [(g, v) for g in group if (v := value(g)) is not None]
    if len(known) < t.straggler_min_gpus:
        return []
    return [
        (g, v, statistics.median(w for h, w in known if h is not g), len(known) - 1)
        for g, v in known
    ]


def _throttled_minority(gpus: list[XmlGpu], t: Thresholds) -> list[HealthFinding]:
    """`throttle_reasons` active on fewer than half of the node's GPUs while the others run
    free of them (on all or half of them it is the node's cooling or power, not one GPU)."""
    active = {
        id(g): sorted(r for r in g.clock_event_reasons_active if r in t.throttle_reasons)
        for g in gpus
    }
    held = [g for g in gpus if active[id(g)]]
    if len(gpus) < t.straggler_min_gpus or not held or 2 * len(held) >= len(gpus):
        return []
    free = len(gpus) - len(held)
    return [
        _straggler(
            "gpu-straggler-throttle",
            g,
            f"{', '.join(active[id(g)])} active while "
            f"{free} of the node's {len(gpus) - 1} other GPUs run without any of "
            f"{', '.join(t.throttle_reasons)}",
        )
        for g in held
    ]


def _straggler(code: str, gpu: XmlGpu, message: str) -> HealthFinding:
    return HealthFinding(
        code=code, level="warning", subject=gpu.bus_id or f"gpu{gpu.position}", message=message
    )


def _toolkit(facts: Facts) -> list[HealthFinding]:
    old = toolkit_too_old(facts)
    if old is not None:
        return [
            HealthFinding(
                code="toolkit-old",
                level="warning",
                message=f"NVIDIA Container Toolkit {old.version} is older than "
                f"{facts.thresholds.toolkit_min_version}",
                evidence=(old.line,),
            )
        ]
    if not facts.toolkit_missing:
        return []
    return [
        HealthFinding(
            code="toolkit-missing",
            level="warning",
            message="neither nvidia-ctk nor nvidia-container-cli is installed: containers "
            "cannot be given GPUs",
        )
    ]


def _containers(facts: Facts, t: Thresholds) -> list[HealthFinding]:
    out = [
        HealthFinding(
            code="container-driver-too-old",
            level="warning",
            subject=m.container,
            message=f"{m.container}: {m.reason}",
            evidence=(m.line,),
        )
        for m in cuda_beyond_driver(facts)
    ]
    for name, c in sorted(facts.containers.items()):
        if (drift := image_drift(c)) is not None:
            out.append(_drift_finding(drift, c))
        ins = c.inspect
        if ins is None or not ins.wants_gpu:
            continue
        if not ins.has_gpu_access:
            out.append(
                HealthFinding(
                    code="container-no-gpu-request",
                    level="warning",
                    subject=name,
                    message=f"{name} ({ins.image}) wants GPUs but was started without --gpus",
                    evidence=tuple(ln for ln in [c.inspect_lines.get("DeviceRequests")] if ln),
                )
            )
        out += _torch_probe(c)
        out += _launch_limits(c, t)
    return out


def _drift_finding(d: ImageDrift, c: ContainerFacts) -> HealthFinding:
    now = f"now names {d.now[:19]}" if d.now else "names no image any more"
    return HealthFinding(
        code="container-image-drift",
        level="warning",
        subject=d.container,
        message=f"{d.container} runs {d.running[:19]} but its tag {d.ref} {now}: a restart "
        "keeps the old build, a recreate or a new node takes the other",
        evidence=tuple(ln for ln in [c.inspect_lines.get("Image")] if ln),
    )


def _torch_probe(c: ContainerFacts) -> list[HealthFinding]:
    """`torch.cuda.is_available()` inside a container that has (or needs no) GPU request."""
    probe, ins = c.torch, c.inspect
    if (
        ins is None
        or probe is None
        or not probe.present
        or probe.is_available is not False
        or not (ins.has_gpu_access or probe.cpu_only)  # else: container-no-gpu-request
    ):
        return []
    cpu_only = probe.cpu_only
    return [
        HealthFinding(
            code="container-torch-cpu-only" if cpu_only else "container-cuda-unavailable",
            level="warning",
            subject=c.name,
            message=f"{c.name}: torch.cuda.is_available() is False (torch {probe.torch}, "
            f"CUDA {probe.cuda}{'; a build without CUDA' if cpu_only else ''})",
            evidence=(probe.line,) if probe.line else (),
        )
    ]


def _launch_limits(c: ContainerFacts, t: Thresholds) -> list[HealthFinding]:
    """/dev/shm and (for RDMA users) memlock: the launch flags a recreate can fix."""
    out = []
    if shm_small(c, t):
        size = shm_size(c)
        out.append(
            HealthFinding(
                code="container-shm-small",
                level="warning",
                subject=c.name,
                message=f"{c.name}: /dev/shm is {size // MIB} MiB (< {t.shm_min_mib} MiB for "
                "multi-worker DataLoaders)",
                evidence=tuple(ln for ln in [c.inspect_lines.get("ShmSize")] if ln),
            )
        )
    ins = c.inspect
    if ins is not None and t.memlock_for_rdma and uses_rdma(ins.env, ins.devices):
        memlock = c.ulimits.memlock_kb if c.ulimits is not None else None
        if memlock_low(memlock, t):
            out.append(
                HealthFinding(
                    code="container-memlock-low",
                    level="warning",
                    subject=c.name,
                    message=f"{c.name} uses RDMA but its memlock limit is {memlock} KiB "
                    f"(< {t.memlock_min_kb} KiB; unlimited is usual)",
                )
            )
    return out


def _disks(facts: Facts, t: Thresholds) -> list[HealthFinding]:
    return [
        HealthFinding(
            code="disk-full",
            level="warning",
            subject=fs.mount,
            message=f"{fs.mount} is {fs.use_percent}% full (threshold {t.disk_used_max_pct}%)",
            evidence=(fs.line,),
        )
        for fs in facts.df
        if fs.use_percent is not None and fs.use_percent >= t.disk_used_max_pct
    ]


def _nccl(facts: Facts) -> list[HealthFinding]:
    if facts.nccl is None:
        return []
    from runbooks.diagnose.rules import nccl_below_floor

    short = nccl_below_floor(facts)
    if short is None:
        return []
    return [
        HealthFinding(
            code="nccl-bandwidth-low", level="warning", message=short.reason, evidence=(short.line,)
        )
    ]


def dcgm_findings(facts: Facts) -> list[HealthFinding]:
    """What NVIDIA DCGM itself reported, in its own words: a health incident (`dcgmi health -c`:
    Failure drains, Warning warns) and a failed diagnostic test (`dcgmi diag`: a hardware,
    integration or stress test, or the GPU's retired-page/InfoROM records, drains; a failed
    deployment test is the host's setup, a warning). A host without DCGM gives none."""
    dcgm = facts.dcgm
    if dcgm is None:
        return []
    out = []
    for i in dcgm.health.incidents if dcgm.health is not None else ():
        system = i.system.lower().removesuffix(" system").replace(" ", "-")
        out.append(
            HealthFinding(
                code=f"dcgm-health-{system}"[:60],
                level="drain" if i.status == "Failure" else "warning",
                subject=f"gpu{i.gpu}",
                message=f"DCGM health, {i.system} of GPU {i.gpu}: {i.status}"
                + (f": {i.message[:400]}" if i.message else ""),
                evidence=(i.line,),
            )
        )
    for t in dcgm.diag.failed if dcgm.diag is not None else ():
        gpus = ", ".join(t.failed_gpus) or "?"
        out.append(
            HealthFinding(
                code="dcgm-diag-fail" if t.hardware else "dcgm-diag-setup",
                level="drain" if t.hardware else "warning",
                subject=t.name,
                message=f"DCGM diagnostic {t.section} / {t.name}: Fail (GPU {gpus})"
                + (f": {t.message[:400]}" if t.message else ""),
                evidence=tuple(ln for ln in (t.line, t.message_line) if ln is not None),
            )
        )
    return out


# The taxonomy class each finding code is evidence of: one table, the ids a diagnosis uses.
_INCIDENT_OF: dict[str, Incident] = {
    "nvidia-smi-hung": Incident.GPU_HARDWARE_FAULT,
    "driver-not-loaded": Incident.DRIVER_NOT_LOADED,
    "nvidia-smi-missing": Incident.DRIVER_NOT_LOADED,
    "driver-library-mismatch": Incident.DRIVER_LIBRARY_MISMATCH,
    "no-gpus-found": Incident.GPU_HARDWARE_FAULT,
    "gpu-count-low": Incident.GPU_HARDWARE_FAULT,
    "gpu-reset-required": Incident.GPU_HARDWARE_FAULT,
    "gpu-throttled": Incident.GPU_HARDWARE_FAULT,
    "gpu-hot": Incident.GPU_HARDWARE_FAULT,
    "gpu-straggler": Incident.GPU_HARDWARE_FAULT,
    "gpu-straggler-temp": Incident.GPU_HARDWARE_FAULT,
    "gpu-straggler-throttle": Incident.GPU_HARDWARE_FAULT,
    "gpu-straggler-pcie-width": Incident.GPU_HARDWARE_FAULT,
    "gpu-straggler-pcie-gen": Incident.GPU_HARDWARE_FAULT,
    "toolkit-missing": Incident.CONTAINER_TOOLKIT_MISSING,
    "toolkit-old": Incident.CONTAINER_TOOLKIT_MISSING,
    "container-driver-too-old": Incident.DRIVER_TOO_OLD,
    "container-no-gpu-request": Incident.GPU_NOT_REQUESTED,
    "container-shm-small": Incident.SHM_TOO_SMALL,
    "container-torch-cpu-only": Incident.CPU_ONLY_BUILD,
    # GPUs given, torch built with CUDA, yet no device: a driver/runtime problem whose cause
    # the probe alone does not name (driver-too-old, when the versions show it, is reported too).
    "container-cuda-unavailable": Incident.UNKNOWN,
    "container-memlock-low": Incident.MEMLOCK_LIMIT,
    # Worth knowing, but no incident: the workload still runs (drift: two builds under one tag;
    # a growing JIT cache: slow starts).
    "container-image-drift": Incident.UNKNOWN,
    "container-cuda-cache-growing": Incident.UNKNOWN,
    "disk-full": Incident.DISK_FULL,
    "nccl-bandwidth-low": Incident.NCCL_SLOW_TRANSPORT,
    "dcgm-diag-fail": Incident.GPU_HARDWARE_FAULT,
    # a failed deployment test (persistence mode, a library, an environment variable): setup
    "dcgm-diag-setup": Incident.UNKNOWN,
}


def incident_of(code: str) -> Incident:
    """The taxonomy class a finding code is evidence of (unknown: host-unreachable,
    check-failed, nvidia-smi-error/-unrecognized say nothing about a class)."""
    if code.startswith(("ecc-", "dcgm-health-")):
        return Incident.GPU_HARDWARE_FAULT
    if code.startswith("xid-") and code[4:].isdigit():
        info = knowledge.xid_info(int(code[4:]))
        if info is not None and info.app_error:
            return Incident.CUDA_ILLEGAL_ACCESS
        return Incident.GPU_HARDWARE_FAULT
    return _INCIDENT_OF.get(code, Incident.UNKNOWN)


# -- sweep-to-sweep differences ----------------------------------------------------------------
Change = Literal["new", "changed", "resolved"]


class HostChange(Frozen):
    host: str
    change: Change
    code: str
    subject: str = ""
    level: Level | None = None  # None for resolved
    message: str


def snapshot(health: Iterable[HostHealth]) -> dict[str, dict[str, dict[str, str]]]:
    """What a sweep saw, as stored between sweeps: host -> finding key -> {level, message...}."""
    return {
        h.host: {
            **{
                f.key: {
                    "code": f.code,
                    "subject": f.subject,
                    "level": f.level,
                    "message": f.message,
                }
                for f in h.findings
            },
            **{MEASURE + key: {"value": str(value)} for key, value in h.measures.items()},
        }
        for h in health
    }


def _signature(entry: Mapping[str, str]) -> str:
    """What counts as a change: the level, and the message without volatile numbers."""
    return entry.get("level", "") + "|" + entry.get("code", "")


def diff(
    before: Mapping[str, Mapping[str, Mapping[str, str]]],
    after: Mapping[str, Mapping[str, Mapping[str, str]]],
) -> list[HostChange]:
    """New, changed (level went up or down) and resolved findings; unchanged ones are silent.

    Hosts absent from `after` (not swept this time) keep their old state: nothing is resolved."""
    out: list[HostChange] = []
    for host in sorted(after):
        old, new = _findings(before.get(host, {})), _findings(after[host])
        for key in sorted(new):
            entry = new[key]
            level = entry.get("level")
            lvl: Level | None = level if level in ("warning", "drain") else None  # type: ignore[assignment]
            if key not in old:
                change: Change | None = "new"
            elif _signature(old[key]) != _signature(entry) or _message_changed(old[key], entry):
                change = "changed"
            else:
                change = None
            if change is not None:
                out.append(
                    HostChange(
                        host=host,
                        change=change,
                        code=entry.get("code", key),
                        subject=entry.get("subject", ""),
                        level=lvl,
                        message=entry.get("message", ""),
                    )
                )
        for key in sorted(set(old) - set(new)):
            out.append(
                HostChange(
                    host=host,
                    change="resolved",
                    code=old[key].get("code", key),
                    subject=old[key].get("subject", ""),
                    message=old[key].get("message", ""),
                )
            )
    return out


def _findings(entries: Mapping[str, Mapping[str, str]]) -> dict[str, Mapping[str, str]]:
    return {k: v for k, v in entries.items() if not k.startswith(MEASURE)}


def _message_changed(old: Mapping[str, str], new: Mapping[str, str]) -> bool:
    """Xid findings change when more events arrive; other messages carry live numbers (a disk's
    percentage, a temperature) that must not re-alert while the level stays the same."""
    return new.get("code", "").startswith("xid-") and old.get("message") != new.get("message")
