"""Classifier rules, one function per incident class, registered with its root-cause priority.

A rule reads `Facts` and returns a `Match` (class, confidence, cited lines) or None. Signature
hits (runbooks/knowledge/signatures.yaml) give every class its log evidence; the rules add what
facts say (inspect flags, versions, Xid catalogue, ECC rules, bandwidth floors) and decide where
a line's origin changes its meaning (``couldn't communicate with the NVIDIA driver`` from the
host's nvidia-smi means the driver is down; from inside a container without GPUs it means the
container was started without them).

PRIORITY orders root causes over symptoms (taxonomy notes): a strong match of a higher-priority
class wins over any other strong match. Adding a class = one function + one priority entry.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from datetime import datetime

from runbooks import knowledge
from runbooks.collect.evidence.dmesg import KernelLogFacts, OomKill
from runbooks.collect.evidence.nvidia_smi import XmlGpu
from runbooks.core.model import Frozen, Line, Match
from runbooks.core.taxonomy import Incident
from runbooks.diagnose.facts import ContainerFacts, Facts, Origin, origin_of
from runbooks.diagnose.judgments import (
    cuda_beyond_driver,
    ecc_tripped,
    host_driver,
    in_window,
    inspect_line,
    memlock_low,
    node_interconnect,
    shm_line,
    shm_size,
    shm_small,
    uses_rdma,
)
from runbooks.diagnose.logscan import signature, signatures

Rule = Callable[[Facts], Match | None]
RULES: dict[Incident, Rule] = {}
PRIORITY: dict[Incident, int] = {
    Incident.GPU_HARDWARE_FAULT: 100,
    Incident.DRIVER_NOT_LOADED: 96,
    Incident.DRIVER_LIBRARY_MISMATCH: 95,
    Incident.DRIVER_TOO_OLD: 92,
    Incident.CONTAINER_TOOLKIT_MISSING: 90,
    Incident.HOST_OOM_KILLED: 80,
    Incident.CPU_ONLY_BUILD: 74,
    Incident.GPU_NOT_REQUESTED: 72,
    Incident.ARCH_UNSUPPORTED: 70,
    Incident.INVALID_DEVICE_ORDINAL: 66,
    Incident.SHM_TOO_SMALL: 62,
    Incident.MEMLOCK_LIMIT: 60,
    Incident.DISK_FULL: 58,
    Incident.VOLUME_PERMISSION_DENIED: 56,
    Incident.SSH_ACCESS_DENIED: 54,
    Incident.CUDA_ILLEGAL_ACCESS: 50,
    Incident.CUDA_OOM: 48,
    Incident.NCCL_SLOW_TRANSPORT: 40,
    Incident.NCCL_ERROR: 30,
    Incident.NCCL_TIMEOUT: 20,
}
STRONG = 0.75  # a match at least this sure is a candidate root cause
MIN_CONFIDENCE = 0.45  # below this a match is noise


def rule(incident: Incident) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        if incident in RULES:
            raise ValueError(f"two rules for {incident}")
        RULES[incident] = fn
        return fn

    return register


# -- helpers over signature hits ---------------------------------------------------------------
def hits(
    facts: Facts, sig_ids: Iterable[str], origins: Iterable[Origin] | None = None
) -> list[Line]:
    wanted = set(sig_ids)
    allowed = set(origins) if origins is not None else None
    out: list[Line] = []
    for scan in facts.scans:
        if allowed is not None and origin_of(scan.source) not in allowed:
            continue
        for sid, h in scan.hits.items():
            if sid in wanted:
                out.extend(h.lines())
    return sorted(out, key=lambda ln: (ln.source, ln.line))


def class_sigs(
    incident: Incident, roles: Iterable[str] = ("cause", "symptom", "context")
) -> list[str]:
    wanted = set(roles)
    return [s.id for s in signatures() if s.incident == incident and s.role in wanted]


def sig_match(
    facts: Facts,
    incident: Incident,
    origins: Iterable[Origin] | None = None,
    exclude: Iterable[str] = (),
    reason: str = "",
) -> Match | None:
    """A Match from every signature of the class; confidence = the best weight, +0.03 for each
    further distinct signature that also matched (corroboration), capped at 0.99."""
    skip = set(exclude)
    found: dict[str, list[Line]] = {}
    for sid in class_sigs(incident):
        if sid in skip:
            continue
        lines = hits(facts, [sid], origins)
        if lines:
            found[sid] = lines
    if not found:
        return None
    weights = sorted((signature(s).weight for s in found), reverse=True)
    confidence = min(0.99, weights[0] + 0.03 * (len(weights) - 1))
    evidence = _dedupe(line for lines in found.values() for line in lines)
    return Match(
        incident=incident,
        confidence=round(confidence, 2),
        evidence=tuple(evidence[:8]),
        reason=reason or f"matched {', '.join(sorted(found))}",
        rule="signatures",
    )


def _dedupe(lines: Iterable[Line]) -> list[Line]:
    seen: set[tuple[str, int]] = set()
    out = []
    for ln in sorted(lines, key=lambda x: (x.source, x.line)):
        if (ln.source, ln.line) not in seen:
            seen.add((ln.source, ln.line))
            out.append(ln)
    return out


def _boost(
    match: Match | None,
    incident: Incident,
    confidence: float,
    evidence: Iterable[Line],
    reason: str,
) -> Match:
    """Combine a signature match with fact evidence: the higher confidence, all lines."""
    lines = list(evidence)
    if match is None:
        return Match(
            incident=incident,
            confidence=round(min(confidence, 0.99), 2),
            evidence=tuple(_dedupe(lines)[:8]),
            reason=reason,
            rule="facts",
        )
    return Match(
        incident=incident,
        confidence=round(min(0.99, max(match.confidence, confidence) + 0.02), 2),
        evidence=tuple(_dedupe([*lines, *match.evidence])[:8]),
        reason=f"{reason}; {match.reason}" if reason else match.reason,
        rule="facts+signatures",
    )


def host_has_gpus(facts: Facts) -> bool:
    if facts.smi is not None and facts.smi.status == "ok" and facts.smi.gpus:
        return True
    return bool(facts.smi_xml and facts.smi_xml.gpus)


def recent(facts: Facts, when: object, uptime: float | None = None) -> bool:
    """Was a kernel event close enough before the incident to count (judgments.in_window)?"""
    stamp = when if isinstance(when, datetime) else None
    window = facts.thresholds.xid_incident_window_h
    return in_window(facts, stamp, uptime, window, incident=True)


# -- rules -------------------------------------------------------------------------------------
@rule(Incident.GPU_HARDWARE_FAULT)
def gpu_hardware_fault(facts: Facts) -> Match | None:
    """A failing GPU, proved by any of: recent fault Xids in the kernel log, one GPU failing to
    initialize while the others work, application Xids pinned to one GPU, fault Xids quoted
    in a log, uncorrectable ECC or ``ERR!`` in nvidia-smi, tripped ECC/retirement/remap
    counters in its XML. Without such proof the signature match alone stands (see
    :func:`_hardware_signature_only`)."""
    match = sig_match(facts, Incident.GPU_HARDWARE_FAULT)
    proof = _Proof()
    if facts.kernel is not None:
        _kernel_fault_xids(facts, facts.kernel, proof)
        _kernel_one_gpu_failing(facts, facts.kernel, proof)
    _quoted_fault_xids(facts, proof)
    _smi_faults(facts, proof)
    _dcgm_faults(facts, proof)
    if not proof.lines:
        return _hardware_signature_only(facts, match)
    return _boost(
        match, Incident.GPU_HARDWARE_FAULT, proof.best, proof.lines, "; ".join(proof.reasons)
    )


class _Proof:
    """What a rule found beyond its signatures: the lines, the best confidence, the reasons."""

    def __init__(self) -> None:
        self.lines: list[Line] = []
        self.best = 0.0
        self.reasons: list[str] = []

    def add(self, lines: Iterable[Line], confidence: float, reason: str) -> None:
        self.lines.extend(lines)
        self.best = max(self.best, confidence)
        self.reasons.append(reason)


def _kernel_fault_xids(facts: Facts, kernel: KernelLogFacts, proof: _Proof) -> None:
    """Recent kernel Xids whose code (or a previous Xid the line names) is a hardware fault."""
    for xid in kernel.xids:
        if not recent(facts, xid.timestamp, xid.uptime_s):
            continue
        # "Xid 45 ... caused by previous Xid 149": judge every code the line names.
        codes = dict.fromkeys([xid.code, *map(int, _PREVIOUS_XID.findall(xid.message))])
        for code in codes:
            info = knowledge.xid_info(code)
            if info is None or not info.fault:
                continue
            proof.add(
                [xid.line],
                0.95 if info.severity == "critical" else 0.8,
                f"Xid {code} ({info.mnemonic}): NVIDIA action {info.immediate_action}",
            )
            break


def _kernel_one_gpu_failing(facts: Facts, kernel: KernelLogFacts, proof: _Proof) -> None:
    """One GPU fails to initialize while the others work; application Xids that recur on one
    GPU across processes."""
    missing = hits(facts, ["gpu-reported-broken"], WORKLOAD)
    init_failed = [n.line for n in kernel.nvrm if "RmInitAdapter failed" in n.line.text]
    if missing and init_failed:
        proof.add(
            [*init_failed[:2], missing[0]],
            0.85,
            "one GPU fails to initialize (RmInitAdapter) while the others work",
        )
    pinned = _app_faults_pinned_to_one_gpu(facts)
    if pinned is not None:
        pci, pinned_lines = pinned
        proof.add(
            pinned_lines,
            0.8,
            f"application-type Xids recur on GPU {pci} only, across "
            f"{len({x.pid for x in kernel.xids if x.pci == pci})} different "
            "processes: the GPU, not the application, is the common factor",
        )


def _quoted_fault_xids(facts: Facts, proof: _Proof) -> None:
    """Fault Xids quoted in container, trigger or host text (no kernel log needed)."""
    for ln in hits(facts, ["xid-mention"], origins=("container", "trigger", "host")):
        for code in _XID_CODE.findall(ln.text):
            info = knowledge.xid_info(int(code))
            if info is not None and info.fault:
                proof.add(
                    [ln],
                    0.9 if info.severity == "critical" else 0.75,
                    f"Xid {code} ({info.mnemonic}) reported",
                )
                break


def _smi_faults(facts: Facts, proof: _Proof) -> None:
    """nvidia-smi: volatile uncorrectable ECC or ``ERR!`` fields in the table; tripped
    ECC/retirement/remap counters in the XML."""
    for gpu in facts.smi.gpus if facts.smi is not None else ():
        count = gpu.volatile_uncorrected_ecc or ""
        if count.isdigit() and int(count) > 0 and gpu.line is not None:
            proof.add(
                [gpu.line], 0.85, f"GPU {gpu.index} has {count} volatile uncorrectable ECC error(s)"
            )
        if gpu.err_fields and gpu.line is not None:
            proof.add(
                [gpu.line],
                0.85,
                f"nvidia-smi shows ERR! for GPU {gpu.index} ({', '.join(gpu.err_fields)})",
            )
    for xgpu in facts.smi_xml.gpus if facts.smi_xml is not None else ():
        tripped = _ecc_faults(xgpu)
        if tripped:
            text = f"GPU {xgpu.bus_id}: {', '.join(tripped)}"
            proof.add([Line(source="nvidia-smi.xml", line=0, text=text)], 0.9, text)


def _dcgm_faults(facts: Facts, proof: _Proof) -> None:
    """NVIDIA DCGM's own verdicts, cited in its words: a failed hardware, integration or stress
    diagnostic test (or the GPU's retired-page/InfoROM records), and a health incident of
    Failure. Warnings (a power or thermal clock event) and failed setup tests prove no fault."""
    dcgm = facts.dcgm
    if dcgm is None:
        return
    for t in dcgm.diag.failed if dcgm.diag is not None else ():
        if t.hardware:
            lines = [ln for ln in (t.line, t.message_line) if ln is not None]
            gpus = ", ".join(t.failed_gpus) or "?"
            said = f": {t.message[:240]}" if t.message else ""
            proof.add(lines, 0.9, f"DCGM diagnostic {t.name} failed on GPU {gpus}{said}")
    for i in dcgm.health.incidents if dcgm.health is not None else ():
        if i.status == "Failure":
            said = f": {i.message[:240]}" if i.message else ""
            proof.add([i.line], 0.85, f"DCGM health: {i.system} of GPU {i.gpu} Failure{said}")


def _hardware_signature_only(facts: Facts, match: Match | None) -> Match | None:
    """The signature match without further proof: 'busy or unavailable' alone on a GPU in an
    exclusive compute mode is a setting (confidence 0.4); kernel lines of old Xids are context,
    not the cause (dropped, and the match with them when nothing else is left)."""
    if match is None:
        return None
    if set(match.reason.removeprefix("matched ").split(", ")) == {
        "devices-busy-unavailable"
    } and exclusive_mode_gpus(facts):
        # Another process holds an exclusive-mode GPU: a setting, not a failing device.
        return match.model_copy(
            update={
                "confidence": 0.4,
                "reason": "'busy or unavailable' on a GPU in exclusive/prohibited compute "
                "mode: another process holds it (nvidia-smi -c 0 resets the mode)",
            }
        )
    if facts.kernel is None:
        return match
    old = {x.line.line for x in facts.kernel.xids if not recent(facts, x.timestamp, x.uptime_s)}
    kept = tuple(ln for ln in match.evidence if not (ln.source == "dmesg.txt" and ln.line in old))
    return match.model_copy(update={"evidence": kept}) if kept else None


def exclusive_mode_gpus(facts: Facts) -> list[Line]:
    """GPUs in an exclusive or prohibited compute mode (nvidia-smi), when CUDA says the devices
    are busy or unavailable: another process holds them, by configuration."""
    if not hits(facts, ["devices-busy-unavailable"]):
        return []
    return [
        g.line
        for g in (facts.smi.gpus if facts.smi else ())
        if g.line is not None and (g.compute_mode or "").startswith(("E.", "Prohibited"))
    ]


_XID_CODE = re.compile(r"Xid\s*+(?:\(PCI:[^)]{0,64}\))?[\s:,]*+(\d{1,3})\b")
_PREVIOUS_XID = re.compile(r"\bXid\s*(\d{1,3})\b")
PINNED_MIN_PROCESSES = 2  # app-type Xids from this many different processes on one GPU...


def _app_faults_pinned_to_one_gpu(facts: Facts) -> tuple[str, list[Line]] | None:
    """Xid 13/31/43-type faults (normally the application's) that keep hitting one physical
    GPU from different processes while the node's other GPUs stay clean: NVIDIA's Xid 13/31
    workflows say to suspect the GPU when the error follows the device, not the program."""
    if facts.kernel is None:
        return None
    by_gpu: dict[str, list[tuple[int | None, Line]]] = {}
    for xid in facts.kernel.xids:
        info = knowledge.xid_info(xid.code)
        if info is not None and info.app_error and xid.pci:
            by_gpu.setdefault(xid.pci, []).append((xid.pid, xid.line))
    if len(by_gpu) != 1:
        return None  # none, or on several GPUs (then the application is the likelier cause)
    pci, events = next(iter(by_gpu.items()))
    pids = {pid for pid, _ in events if pid is not None}
    # The node must have other GPUs that stayed clean, or it proves nothing about the device.
    others = facts.host_gpu_count > 1 or len({x.pci for x in facts.kernel.xids if x.pci}) > 1
    if len(pids) < PINNED_MIN_PROCESSES or not others:
        return None
    return pci, [ln for _, ln in events][:4]


def _ecc_faults(gpu: XmlGpu) -> list[str]:
    return [name.replace("_", " ") for name, r, _ in ecc_tripped(gpu) if r.severity == "fault"]


@rule(Incident.DRIVER_NOT_LOADED)
def driver_not_loaded(facts: Facts) -> Match | None:
    host = sig_match(facts, Incident.DRIVER_NOT_LOADED, origins=("host", "kernel", "trigger"))
    if facts.smi is not None and facts.smi.status == "driver-not-loaded":
        lines = [facts.smi.status_line] if facts.smi.status_line else []
        return _boost(
            host,
            Incident.DRIVER_NOT_LOADED,
            0.95,
            lines,
            "the host's nvidia-smi cannot talk to the driver",
        )
    inside = sig_match(facts, Incident.DRIVER_NOT_LOADED, origins=("container",))
    if inside is not None:
        # Seen only inside a container: the driver is down only if the container had GPUs.
        gpu_less = [
            c
            for c in facts.containers.values()
            if c.inspect is not None and not c.inspect.has_gpu_access
        ]
        if gpu_less or host_has_gpus(facts):
            inside = None
    if host is None and inside is None:
        return None
    if host is not None and host_has_gpus(facts):
        return host.model_copy(update={"confidence": min(host.confidence, 0.6)})
    return host or inside


@rule(Incident.DRIVER_LIBRARY_MISMATCH)
def driver_library_mismatch(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.DRIVER_LIBRARY_MISMATCH)
    if facts.smi is not None and facts.smi.status == "library-mismatch":
        lines = [facts.smi.status_line] if facts.smi.status_line else []
        return _boost(
            match,
            Incident.DRIVER_LIBRARY_MISMATCH,
            0.97,
            lines,
            "NVML reports a driver/library version mismatch",
        )
    if facts.kernel is not None:
        lines = [n.line for n in facts.kernel.nvrm if n.api_mismatch]
        if lines:
            return _boost(
                match,
                Incident.DRIVER_LIBRARY_MISMATCH,
                0.95,
                lines,
                "the kernel module and user-space driver differ (NVRM: API mismatch)",
            )
    return match


@rule(Incident.DRIVER_TOO_OLD)
def driver_too_old(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.DRIVER_TOO_OLD)
    driver = host_driver(facts)
    for report in facts.env_reports:
        have = report.driver or driver
        # Code compiled by a newer toolkit (PTX) needs the newer driver: no minor-version
        # compatibility for JIT, hence strict; a framework's CUDA runtime may rely on it.
        for wanted, what, strict in (
            (report.nvcc, "the CUDA toolkit in use is", True),
            (report.built_cuda, "torch is built for CUDA", False),
        ):
            if have and wanted and knowledge.driver_satisfies(have, wanted, strict=strict) is False:
                return _boost(
                    match,
                    Incident.DRIVER_TOO_OLD,
                    0.85,
                    list(report.lines),
                    f"{what} {wanted}; driver {have} supports at most "
                    f"CUDA {knowledge.max_cuda_for_driver(have) or '?'}",
                )
    beyond = cuda_beyond_driver(facts)
    if beyond:
        return _boost(match, Incident.DRIVER_TOO_OLD, 0.85, [beyond[0].line], beyond[0].reason)
    return match


@rule(Incident.CONTAINER_TOOLKIT_MISSING)
def container_toolkit_missing(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.CONTAINER_TOOLKIT_MISSING)
    toolkit_line = Line(
        source="commands/container-toolkit.txt",
        line=1,
        text=facts.toolkit or "nvidia-ctk / nvidia-container-cli: not found",
    )
    if match is not None:
        if facts.toolkit_missing:  # the host's own answer confirms what the workload said
            return _boost(
                match,
                Incident.CONTAINER_TOOLKIT_MISSING,
                0.8,
                [toolkit_line],
                "the host has no NVIDIA Container Toolkit either",
            )
        return match
    if facts.toolkit_missing and host_has_gpus(facts):
        gpu_wanting = [
            c
            for c in facts.containers.values()
            if c.inspect is not None and c.inspect.wants_gpu and not c.inspect.has_gpu_access
        ]
        if gpu_wanting:
            return Match(
                incident=Incident.CONTAINER_TOOLKIT_MISSING,
                confidence=0.8,
                evidence=(toolkit_line,),
                reason="no NVIDIA Container Toolkit on a GPU host whose GPU container has no GPUs",
                rule="facts",
            )
    return None


@rule(Incident.HOST_OOM_KILLED)
def host_oom_killed(facts: Facts) -> Match | None:
    ours = _our_container_ids(facts)
    kernel = facts.kernel.oom_kills if facts.kernel is not None else ()
    if kernel_kills_are_anothers(facts):
        # Every kill in the kernel log was another container's: its OOM lines are not evidence
        # for this one (read the class from everything but the kernel log).
        match = sig_match(
            facts, Incident.HOST_OOM_KILLED, ("host", "container", "trigger", "probe")
        )
    else:
        match = sig_match(facts, Incident.HOST_OOM_KILLED)
    for c in facts.containers.values():
        if c.inspect is not None and c.inspect.oom_killed:
            return _boost(
                match,
                Incident.HOST_OOM_KILLED,
                0.97,
                [inspect_line(c, "OOMKilled", '"OOMKilled": true')],
                f"Docker reports container {c.name} OOMKilled (exit {c.inspect.exit_code})",
            )
    if kernel:
        kills = [
            k
            for k in kernel
            if recent(facts, k.timestamp, k.uptime_s) and not _another_containers(k, ours)
        ]
        if kills:
            return _boost(
                match,
                Incident.HOST_OOM_KILLED,
                0.9,
                [k.line for k in kills],
                f"the kernel OOM killer killed {kills[-1].process_name or 'a process'}",
            )
    return match


_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")  # in a memcg path: /docker/<id>, docker-<id>.scope


def _our_container_ids(facts: Facts) -> set[str]:
    return {c.inspect.id for c in facts.containers.values() if c.inspect and c.inspect.id}


def kernel_kills_are_anothers(facts: Facts) -> bool:
    """Does the kernel log hold OOM kills, every one of another container than those collected?
    Then its text is another workload's story (the learned model leaves it out too)."""
    kills = facts.kernel.oom_kills if facts.kernel is not None else ()
    ours = _our_container_ids(facts)
    return bool(kills) and all(_another_containers(k, ours) for k in kills)


def _another_containers(kill: OomKill, ours: set[str]) -> bool:
    """Did the OOM killer kill a process of a container other than the ones collected? (On a
    shared host another job's OOM kill says nothing of this one's failure.)"""
    found = _CONTAINER_ID.search(kill.task_memcg or "") if ours else None
    return found is not None and found.group(0) not in ours


@rule(Incident.CPU_ONLY_BUILD)
def cpu_only_build(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.CPU_ONLY_BUILD)
    unavailable = _cuda_unavailable_lines(facts)
    given = given_gpus(facts)
    driver_trouble = hits(
        facts,
        [
            *class_sigs(Incident.DRIVER_NOT_LOADED),
            *class_sigs(Incident.DRIVER_LIBRARY_MISMATCH),
            *class_sigs(Incident.DRIVER_TOO_OLD),
            *class_sigs(Incident.CONTAINER_TOOLKIT_MISSING),
        ],
    )
    if unavailable and given and not driver_trouble:
        # The container has its GPUs, the driver says nothing wrong, yet the framework sees none:
        # the framework build in the image cannot use them.
        c = given[0]
        return _boost(
            match,
            Incident.CPU_ONLY_BUILD,
            0.7,
            [inspect_line(c, "DeviceRequests"), *unavailable[:2]],
            f"{c.name} was given GPUs, yet the framework reports none available and no driver "
            "or toolkit error was seen",
        )
    for report in facts.env_reports:
        if report.built_without_cuda:
            return _boost(
                match,
                Incident.CPU_ONLY_BUILD,
                0.9,
                list(report.lines),
                f"the environment report shows a PyTorch build without CUDA "
                f"({report.torch or 'CUDA used to build PyTorch: None'})",
            )
    for c in facts.containers.values():
        if c.torch is not None and c.torch.present and c.torch.cpu_only and c.torch.line:
            return _boost(
                match,
                Incident.CPU_ONLY_BUILD,
                0.95,
                [c.torch.line],
                f"torch {c.torch.torch} in {c.name} has no CUDA (torch.version.cuda "
                f"= {c.torch.cuda})",
            )
    return match


@rule(Incident.GPU_NOT_REQUESTED)
def gpu_not_requested(facts: Facts) -> Match | None:
    # What the workload itself said (its log, the pasted text) is a symptom; what cudamedic's
    # own probes printed inside the container (`nvidia-smi: not found`) only counts for a
    # container that wants GPUs: a busybox that never asked for one has no nvidia-smi either.
    symptoms = sig_match(facts, Incident.GPU_NOT_REQUESTED, origins=WORKLOAD)
    probed = sig_match(facts, Incident.GPU_NOT_REQUESTED, origins=("probe",))
    driver_sigs = class_sigs(Incident.DRIVER_NOT_LOADED)
    inside_driver = hits(facts, driver_sigs, origins=("container",))
    unavailable = _cuda_unavailable_lines(facts)
    for c in facts.containers.values():
        if c.inspect is None or c.inspect.has_gpu_access:
            continue
        wants = c.inspect.wants_gpu
        own = _own(symptoms, c) or _own_lines(inside_driver, c) or _own_lines(unavailable, c)
        if not (wants or own):
            continue
        lines = [
            inspect_line(
                c,
                "DeviceRequests",
                f'"DeviceRequests": null, "Runtime": "{c.inspect.runtime or "runc"}"',
            )
        ]
        confidence = 0.8
        if c.torch is not None and c.torch.is_available is False and c.torch.line:
            lines.append(c.torch.line)
            confidence = 0.92
        if inside_driver:
            lines.extend(inside_driver)
            confidence = 0.92
        if wants and probed is not None:
            lines.extend(probed.evidence)
            confidence = max(confidence, 0.85)
        if host_has_gpus(facts):
            confidence += 0.03
        if wants:
            why = f"container {c.name} wants GPUs ({_why_wants(c)})"
        else:
            why = f"the log of {c.name} shows CUDA finding no GPU"
        reason = f"{why} but was started without --gpus or the nvidia runtime"
        if host_has_gpus(facts):
            reason += f"; the host's nvidia-smi lists {facts.host_gpu_count} working GPU(s)"
        return _boost(symptoms, Incident.GPU_NOT_REQUESTED, confidence, lines, reason)
    if symptoms is None and unavailable and not given_gpus(facts):
        # Only `torch.cuda.is_available()` -> False: the commonest cause, but a guess.
        return Match(
            incident=Incident.GPU_NOT_REQUESTED,
            confidence=0.55,
            evidence=tuple(unavailable[:4]),
            reason="CUDA reports no usable GPU (torch.cuda.is_available() is False); the "
            "usual cause is a container started without GPUs",
            rule="facts",
        )
    if symptoms is None:
        return None
    if given_gpus(facts):
        return symptoms.model_copy(update={"confidence": min(symptoms.confidence, 0.5)})
    return symptoms


WORKLOAD: tuple[Origin, ...] = ("container", "trigger", "host", "kernel")


def given_gpus(facts: Facts) -> list[ContainerFacts]:
    """The containers that were started with GPU access."""
    return [
        c for c in facts.containers.values() if c.inspect is not None and c.inspect.has_gpu_access
    ]


def _own(match: Match | None, c: ContainerFacts) -> bool:
    return match is not None and _own_lines(list(match.evidence), c)


def _own_lines(lines: list[Line], c: ContainerFacts) -> bool:
    """Do any of these lines come from this container's own log (or the pasted trigger)?"""
    return any(ln.source in (f"containers/{c.name}.log", "trigger.txt") for ln in lines)


def _why_wants(c: ContainerFacts) -> str:
    assert c.inspect is not None
    env = sorted(k for k in c.inspect.env if k.startswith(("NVIDIA_", "CUDA_")))
    if env:
        return f"its environment sets {env[0]}"
    if any("nvidia" in b.lower() for b in c.inspect.binds):
        return "NVIDIA files are bind-mounted into it"
    return f"image {c.inspect.image}"


def _cuda_unavailable_lines(facts: Facts) -> list[Line]:
    """Environment reports (collect_env, an interactive `is_available()`) saying CUDA is not
    available, from a torch build that has CUDA (a +cpu build is cpu-only-build's)."""
    return [
        ln
        for r in facts.env_reports
        if r.cuda_available is False and not r.built_without_cuda
        for ln in r.lines
        if "vailable" in ln.text or ln.text.strip().lstrip(">.# ").strip() == "False"
    ]


@rule(Incident.ARCH_UNSUPPORTED)
def arch_unsupported(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.ARCH_UNSUPPORTED)
    for c in facts.containers.values():
        t = c.torch
        if t is None or not t.present or not t.arch_list or not t.devices:
            continue
        for dev in t.devices:
            cap = compute_capability(dev.get("capability", ""))
            if cap is None or build_runs_on(t.arch_list, cap):
                continue
            return _boost(
                match,
                Incident.ARCH_UNSUPPORTED,
                0.85,
                [t.line] if t.line else [],
                f"{dev.get('name')} is sm_{cap[0]}{cap[1]}; torch {t.torch} has kernels for "
                f"{' '.join(t.arch_list)}",
            )
    return match


def compute_capability(text: str) -> tuple[int, int] | None:
    """'9.0' / '12.0' / '90' / '120' / 'sm_86' -> (major, minor), compared as numbers."""
    digits = text.strip().lower().removeprefix("sm_").removeprefix("compute_").rstrip("a")
    if "." in digits:
        major, _, minor = digits.partition(".")
    else:
        major, minor = digits[:-1], digits[-1:]
    if not (major.isdigit() and minor.isdigit()):
        return None
    return int(major), int(minor)


def build_runs_on(arch_list: tuple[str, ...], cap: tuple[int, int]) -> bool:
    """Does a build with these targets run on a GPU of this compute capability? Exact SASS
    (`sm_XY`) runs, and so does SASS of an earlier minor of the same major (binary compatible
    within a major); PTX (`compute_XY`) of the same or an older architecture is JIT-compiled."""
    for arch in arch_list:
        got = compute_capability(arch)
        if got is None:
            continue
        if arch.startswith("sm_") and got[0] == cap[0] and got[1] <= cap[1]:
            return True
        if arch.startswith("compute_") and got <= cap:
            return True
    return False


@rule(Incident.INVALID_DEVICE_ORDINAL)
def invalid_device_ordinal(facts: Facts) -> Match | None:
    return sig_match(facts, Incident.INVALID_DEVICE_ORDINAL)


@rule(Incident.SHM_TOO_SMALL)
def shm_too_small(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.SHM_TOO_SMALL)
    small = [c for c in facts.containers.values() if shm_small(c, facts.thresholds)]
    nospace = hits(facts, ["no-space-left"], origins=("container", "trigger"))
    full = [c for c in small if c.shm is not None and (c.shm.use_percent or 0) >= 95]
    if full and match is None and not nospace:
        c = full[0]
        return _boost(
            None,
            Incident.SHM_TOO_SMALL,
            0.8,
            [shm_line(c)],
            f"/dev/shm of {c.name} is {shm_size(c) // 2**20} MiB and "
            f"{c.shm.use_percent if c.shm else '?'} % full",
        )
    segments = hits(facts, ["nccl-shm-segments"])
    nccl_failed = hits(facts, ["nccl-unhandled-system-error"], WORKLOAD)
    if segments and nccl_failed:
        # NCCL's failure to set up a segment while /dev/shm is littered with its segments.
        return _boost(
            match,
            Incident.SHM_TOO_SMALL,
            0.8,
            [nccl_failed[0], segments[0]],
            "NCCL fails with a system error while /dev/shm holds its stale nccl-* segments: "
            "/dev/shm is full",
        )
    if small and (match is not None or nospace) and not _disk_really_full(facts):
        # the container whose own log says it: another's default 64 MiB is not this fault
        said = {ln.source for ln in [*nospace, *(match.evidence if match else ())]}
        c = next(
            (c for c in small if any(s.startswith(f"containers/{c.name}.") for s in said)), small[0]
        )
        lines = [shm_line(c)]
        if match is None:
            lines.extend(nospace)
            # Docker's default /dev/shm is small in most containers, so a bare "No space left"
            # beside it says no more than "a disk or /dev/shm": shm only where the message
            # itself points at it (a checkpoint or a cache is written to a disk).
            named = any(_names_shm(ln) for ln in nospace)
            return _boost(
                None,
                Incident.SHM_TOO_SMALL,
                0.8 if named else 0.5,
                lines,
                f"'No space left on device' in a container whose /dev/shm is only "
                f"{shm_size(c) // 2**20} MiB"
                + ("" if named else " (a disk, or /dev/shm: `df -h /dev/shm` in it tells)"),
            )
        return _boost(
            match,
            Incident.SHM_TOO_SMALL,
            0.9,
            lines,
            f"/dev/shm of {c.name} is {shm_size(c) // 2**20} MiB",
        )
    return match


@rule(Incident.MEMLOCK_LIMIT)
def memlock_limit(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.MEMLOCK_LIMIT)
    limits = [(c.name, c.ulimits, c.env_probe) for c in facts.containers.values() if c.ulimits]
    if facts.host_ulimits is not None:
        limits.append(("the host", facts.host_ulimits, {}))
    for where, u, env in limits:
        if not memlock_low(u.memlock_kb, facts.thresholds):
            continue
        # A low limit matters when something registers memory (RDMA/IB/EFA, pinned buffers).
        if match is not None or uses_rdma(env):
            lines = [u.memlock_line] if u.memlock_line else []
            return _boost(
                match,
                Incident.MEMLOCK_LIMIT,
                0.8,
                lines,
                f"locked-memory limit in {where} is {u.memlock_kb} KiB",
            )
    return match


def _disk_really_full(facts: Facts) -> list[Line]:
    return [
        fs.line
        for fs in facts.df
        if (fs.use_percent or 0) >= 95
        and fs.mount != "/dev/shm"
        and not fs.mount.startswith(("/snap", "/boot/efi"))
        and not fs.source.startswith("/dev/loop")
    ]


def _names_shm(line: Line) -> bool:
    """Does a "No space left" line name shared memory (/dev/shm, shm, shared memory)?"""
    text = line.text.lower()
    return "shm" in text or "shared memory" in text


@rule(Incident.DISK_FULL)
def disk_full(facts: Facts) -> Match | None:
    shm_lines = {(ln.source, ln.line) for ln in hits(facts, class_sigs(Incident.SHM_TOO_SMALL))}
    lines = [ln for ln in hits(facts, ["no-space-left"]) if (ln.source, ln.line) not in shm_lines]
    other = sig_match(facts, Incident.DISK_FULL, exclude=["no-space-left"])
    if other is not None:  # an eviction for ephemeral storage, a quota: disk-full in itself
        return _boost(other, Incident.DISK_FULL, other.confidence, lines, "")
    full = _disk_really_full(facts)
    if full:
        return _boost(
            None, Incident.DISK_FULL, 0.9, [*full, *lines], "a filesystem is at least 95 % full"
        )
    if not lines:
        return None
    small = any(shm_small(c, facts.thresholds) for c in facts.containers.values())
    if small and any(_names_shm(ln) for ln in lines):
        return Match(
            incident=Incident.DISK_FULL,
            confidence=0.6,
            evidence=tuple(lines[:8]),
            reason="'No space left on device' (the container's /dev/shm is small too)",
            rule="signatures",
        )
    return Match(
        incident=Incident.DISK_FULL,
        confidence=signature("no-space-left").weight,
        evidence=tuple(lines[:8]),
        reason="'No space left on device'",
        rule="signatures",
    )


@rule(Incident.VOLUME_PERMISSION_DENIED)
def volume_permission_denied(facts: Facts) -> Match | None:
    return sig_match(facts, Incident.VOLUME_PERMISSION_DENIED)


@rule(Incident.SSH_ACCESS_DENIED)
def ssh_access_denied(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.SSH_ACCESS_DENIED)
    if facts.ssh_error and "authentication failed" in facts.ssh_error:
        return _boost(
            match,
            Incident.SSH_ACCESS_DENIED,
            0.9,
            [Line(source="bundle.json", line=0, text=facts.ssh_error)],
            "cudamedic itself could not log in to the host",
        )
    return match


@rule(Incident.CUDA_ILLEGAL_ACCESS)
def cuda_illegal_access(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.CUDA_ILLEGAL_ACCESS)
    if facts.kernel is not None:
        app = []
        for xid in facts.kernel.xids:
            info = knowledge.xid_info(xid.code)
            if info is not None and info.app_error and recent(facts, xid.timestamp, xid.uptime_s):
                app.append(xid.line)
        if app:
            # Timed and recent: likely this crash. Untimed: context unless the log agrees.
            timed = facts.incident_time is not None
            return _boost(
                match,
                Incident.CUDA_ILLEGAL_ACCESS,
                0.8 if timed else 0.6,
                app,
                "application-caused Xid (13/31/43) in the kernel log",
            )
    return match


@rule(Incident.CUDA_OOM)
def cuda_oom(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.CUDA_OOM)
    held = _memory_held_without_process(facts)
    if held:
        strong = match is not None and match.confidence >= STRONG
        return _boost(
            match,
            Incident.CUDA_OOM,
            0.9 if strong else 0.75 if match is not None else 0.6,
            held,
            "GPU memory is in use on the host while nvidia-smi lists no process: a leftover "
            "(zombie or orphaned) allocation holds it",
        )
    return match


FULL_MEMORY = 0.9  # a GPU this full has no room for a new context


def _memory_held_without_process(facts: Facts) -> list[Line]:
    """The host's nvidia-smi says "No running processes found" while a GPU's memory is full.
    (Inside a container an empty process list is normal PID-namespace behaviour: only the
    host's table counts.)"""
    smi = facts.smi
    if smi is None or smi.status != "ok" or smi.no_processes_line is None:
        return []
    full = [
        g.line
        for g in smi.gpus
        if g.line is not None
        and g.memory_used_mib is not None
        and g.memory_total_mib
        and g.memory_used_mib >= FULL_MEMORY * g.memory_total_mib
    ]
    return [*full, smi.no_processes_line] if full else []


class NcclShortfall(Frozen):
    measured: float
    floor: float
    basis: str
    count: int
    model: str
    line: Line

    @property
    def reason(self) -> str:
        return (
            f"all_reduce bus bandwidth {self.measured:g} GB/s is under {self.basis} "
            f"({self.floor:g} GB/s) for {self.count}x {self.model}"
        )


def nccl_below_floor(facts: Facts) -> NcclShortfall | None:
    """The nccl-tests run's bus bandwidth against the floor for this node, when it falls short."""
    nccl = facts.nccl
    measured = None if nccl is None else (nccl.max_busbw or nccl.avg_busbw)
    if nccl is None or measured is None:
        return None
    # The run's own device lines, else the host's nvidia-smi (same node).
    model = nccl.gpu_models[0] if nccl.gpu_models else _host_model(facts)
    count = nccl.n_ranks or len(nccl.devices) or facts.host_gpu_count
    floor, basis = _floor(model, count, node_interconnect(facts.topology))
    if floor is None or model is None or measured >= floor:
        return None
    return NcclShortfall(
        measured=measured,
        floor=floor,
        basis=basis,
        count=count,
        model=model,
        line=_nccl_line(nccl, measured),
    )


@rule(Incident.NCCL_SLOW_TRANSPORT)
def nccl_slow_transport(facts: Facts) -> Match | None:
    match = sig_match(facts, Incident.NCCL_SLOW_TRANSPORT)
    short = nccl_below_floor(facts)
    if short is not None:
        return _boost(match, Incident.NCCL_SLOW_TRANSPORT, 0.9, [short.line], short.reason)
    topo = facts.topology
    if topo is not None and not topo.nvlink and topo.through_host:
        # A collective that hangs between GPUs whose peer traffic crosses a host bridge: ACS or
        # the IOMMU blocks PCIe peer-to-peer (NCCL's troubleshooting guide; NCCL_P2P_DISABLE=1
        # makes it work, slowly).
        hang = hits(facts, ["collective-stall", *class_sigs(Incident.NCCL_TIMEOUT)], WORKLOAD)
        if hang:
            kinds = sorted(set(topo.links.values()))
            lines = [topo.line] if topo.line else []
            return _boost(
                match,
                Incident.NCCL_SLOW_TRANSPORT,
                0.8,
                [*lines, *hang[:3]],
                f"the collective hangs between GPUs linked over PCIe through the host "
                f"({'/'.join(kinds)}, no NVLink): peer-to-peer blocked by ACS/IOMMU",
            )
    plain, gdr = hits(facts, ["ib-without-gdrdma"]), hits(facts, ["ib-with-gdrdma"])
    if plain and gdr:
        # Some ranks use GPUDirect RDMA and others do not: the node without it (nvidia-peermem
        # not loaded, ACS on) stages every transfer through host memory.
        return _boost(
            match,
            Incident.NCCL_SLOW_TRANSPORT,
            0.8,
            [plain[0], gdr[0]],
            "NCCL uses GPUDirect RDMA on some paths only (NET/IB with and without GDRDMA)",
        )
    for c in facts.containers.values():
        env = {**(c.inspect.env if c.inspect else {}), **c.env_probe}
        if env.get("NCCL_P2P_DISABLE") == "1" and match is not None:
            return _boost(
                match, Incident.NCCL_SLOW_TRANSPORT, 0.8, [], f"NCCL_P2P_DISABLE=1 in {c.name}"
            )
    return match


def _host_model(facts: Facts) -> str | None:
    if facts.smi is not None and facts.smi.gpus:
        return facts.smi.gpus[0].name
    if facts.smi_xml is not None and facts.smi_xml.gpus:
        return facts.smi_xml.gpus[0].product_name
    return None


def _floor(
    model: str | None, count: int, interconnect: str | None = None
) -> tuple[float | None, str]:
    """The published floor for this exact node (model, GPU count, and the interconnect its
    `nvidia-smi topo -m` shows, when collected); else a conservative lower bound: the lowest
    PCIe-only floor of the same GPU generation with no more GPUs. An NVLink node of that
    generation that cannot reach even the PCIe node's floor is on a slow path."""
    if not model or count < 2:
        return None, ""
    exact = knowledge.nccl_floor(model, count, interconnect)
    if exact is not None:
        return exact.min_busbw_gbps, "the published floor"
    key = knowledge.gpu_model_key(model)
    if key is None:
        return None, ""
    family = key.split("-")[0]
    bounds = [
        f.min_busbw_gbps
        for f in knowledge.nccl_floors()
        if f.model.split("-")[0] == family and f.gpu_count <= count and "pcie" in f.interconnects
    ]
    return (min(bounds), "the PCIe-node floor of the same GPU generation") if bounds else (None, "")


def _nccl_line(nccl: object, measured: float) -> Line:
    rows = getattr(nccl, "rows", ())
    for row in rows:
        if measured in (row.oop_busbw, row.ip_busbw):
            return row.line  # type: ignore[no-any-return]
    return Line(source="nccl-tests.txt", line=0, text=f"busbw {measured:g} GB/s")


@rule(Incident.NCCL_ERROR)
def nccl_error(facts: Facts) -> Match | None:
    return sig_match(facts, Incident.NCCL_ERROR)


@rule(Incident.NCCL_TIMEOUT)
def nccl_timeout(facts: Facts) -> Match | None:
    return sig_match(facts, Incident.NCCL_TIMEOUT)


def run_rules(facts: Facts) -> list[Match]:
    out = []
    for incident, fn in RULES.items():
        match = fn(facts)
        if match is not None and match.confidence >= MIN_CONFIDENCE:
            out.append(match.model_copy(update={"rule": f"{incident}:{match.rule}"}))
    return out


def rank(match: Match) -> tuple[int, int, float]:
    strong = 1 if match.confidence >= STRONG else 0
    return (strong, PRIORITY.get(Incident(match.incident), 0), match.confidence)
