"""Classify a bundle: run the rules, pick the root cause, explain it (PURE over `Facts`).

`diagnose(facts)` returns a `Diagnosis`: the primary incident id, a confidence, a plain-language
summary, the evidence lines that decided it, secondary findings and the recommended fix.
`healthy` when the evidence shows working GPUs and no rule matched; `unknown` when evidence is
missing or shows errors no rule explains.
"""

from __future__ import annotations

from runbooks.facts import Facts
from runbooks.fixes import propose_fix
from runbooks.model import Diagnosis, Line, Match
from runbooks.rules import rank, run_rules
from runbooks.taxonomy import Incident

EXPLAIN: dict[str, str] = {
    "healthy": "No check failed: the GPUs answer and no error signature was found.",
    "gpu-not-requested": "The container was started without GPU access on a host whose GPUs "
    "work, so CUDA inside it finds no device.",
    "container-toolkit-missing": "The host cannot hand GPUs to containers: the NVIDIA "
    "Container Toolkit is missing, misconfigured or too old.",
    "invalid-device-ordinal": "The workload asks for a GPU index that is not visible inside "
    "the container.",
    "shm-too-small": "/dev/shm is too small for DataLoader workers or NCCL (Docker's default "
    "is 64 MB), so workers die with a bus error or shared-memory allocation fails.",
    "memlock-limit": "The locked-memory limit blocks RDMA or pinned memory, so NCCL/IB "
    "registration fails or falls back to slow paths.",
    "driver-not-loaded": "The host's NVIDIA kernel driver is not running.",
    "driver-library-mismatch": "The NVIDIA user-space libraries and the loaded kernel module "
    "are different versions (driver upgraded without a reboot).",
    "driver-too-old": "The host driver is older than the CUDA runtime in the image needs.",
    "arch-unsupported": "The framework build has no kernels for this GPU's compute capability.",
    "cpu-only-build": "The framework in the image was built without CUDA.",
    "cuda-oom": "GPU memory ran out.",
    "host-oom-killed": "The container or a process in it was killed for lack of host RAM.",
    "cuda-illegal-access": "The application crashed the GPU context (illegal memory access or "
    "a device-side assert): an application bug.",
    "gpu-hardware-fault": "A GPU, its memory or its links are failing.",
    "nccl-timeout": "A collective operation hung until the NCCL watchdog fired.",
    "nccl-slow-transport": "NCCL runs over a slow path (no P2P/NVLink/IB), far under the "
    "expected bandwidth.",
    "nccl-error": "NCCL failed for a reason other than a timeout.",
    "volume-permission-denied": "The container user cannot write to a mounted path.",
    "ssh-access-denied": "Logging in to the host or container was refused.",
    "disk-full": "A filesystem (not /dev/shm) is full.",
    "unknown": "Evidence was collected but matches no known incident class.",
}


def diagnose(facts: Facts, host: str | None = None) -> Diagnosis:
    matches = sorted(run_rules(facts), key=rank, reverse=True)
    container = next((c.name for c in facts.containers.values() if c.inspect), None) or next(
        iter(facts.containers), None
    )
    if matches:
        primary = matches[0]
        secondary = tuple(dict.fromkeys(m.incident for m in matches[1:]))
        return Diagnosis(
            incident=primary.incident,
            confidence=primary.confidence,
            summary=_summary(primary),
            evidence=primary.evidence,
            secondary=secondary,
            fix=propose_fix(primary, facts),
            host=host,
            container=container,
            findings=tuple(facts.findings),
            matches=tuple(matches),
        )
    healthy_lines = _health_evidence(facts)
    if healthy_lines and not facts.exceptions:
        strong = [ln for ln in healthy_lines if not ln.text.startswith("container log has no")]
        return Diagnosis(
            incident=Incident.HEALTHY,
            confidence=0.85 if len(strong) > 1 else 0.7 if strong else 0.5,
            summary=EXPLAIN["healthy"],
            evidence=tuple(healthy_lines),
            host=host,
            container=container,
            findings=tuple(facts.findings),
        )
    evidence = tuple(facts.exceptions[-3:])
    summary = EXPLAIN["unknown"]
    if evidence:
        summary += f" The last error was: {evidence[-1].text}"
    elif facts.ssh_error:
        summary += f" The host could not be reached: {facts.ssh_error}"
    return Diagnosis(
        incident=Incident.UNKNOWN,
        confidence=0.3,
        summary=summary,
        evidence=evidence,
        host=host,
        container=container,
        findings=tuple(facts.findings),
    )


def _summary(match: Match) -> str:
    text = EXPLAIN.get(match.incident, match.incident)
    if match.reason and not match.reason.startswith("matched "):
        text += f" Why: {match.reason}."
    elif match.evidence:
        text += f" Decided by: {match.evidence[0].text.strip()[:200]}"
    return text


def _health_evidence(facts: Facts) -> list[Line]:
    lines: list[Line] = []
    if facts.smi is not None and facts.smi.status == "ok" and facts.smi.gpus:
        first = facts.smi.gpus[0].line
        lines.append(
            first
            or Line(
                source="nvidia-smi.txt",
                line=0,
                text=f"{len(facts.smi.gpus)} GPUs, driver {facts.smi.driver_version}",
            )
        )
    if facts.nccl is not None and facts.nccl.avg_busbw is not None:
        lines.append(
            Line(
                source="nccl-tests.txt",
                line=0,
                text=f"# Avg bus bandwidth    : {facts.nccl.avg_busbw}",
            )
        )
    for c in facts.containers.values():
        if c.torch is not None and c.torch.is_available and c.torch.line:
            lines.append(c.torch.line)
        if c.has_log and not lines:
            lines.append(
                Line(
                    source=f"containers/{c.name}.log",
                    line=0,
                    text="container log has no error signature",
                )
            )
    return lines


def classify_path(path: object) -> Diagnosis:
    """Open a bundle (directory, .tar.gz or single log file) and diagnose it."""
    from pathlib import Path

    from runbooks.bundle import open_bundle
    from runbooks.facts import gather

    with open_bundle(Path(str(path))) as bundle:
        facts = gather(bundle)
        host = bundle.meta.host if bundle.meta else None
    return diagnose(facts, host=host)


def render_text(d: Diagnosis) -> str:
    """The diagnosis as a person reads it in a terminal."""
    out = [f"incident:   {d.incident}  (confidence {d.confidence:.2f})"]
    if d.host or d.container:
        out.append(
            f"where:      host {d.host or '?'}"
            + (f", container {d.container}" if d.container else "")
        )
    out.append(f"summary:    {d.summary}")
    if d.evidence:
        out.append("evidence:")
        for ln in d.evidence:
            where = f"{ln.source}:{ln.line}" if ln.line else ln.source
            out.append(f"  {where}: {ln.text.strip()[:300]}")
    if d.secondary:
        out.append(f"secondary:  {', '.join(d.secondary)}")
    warnings = [f for f in d.findings if f.severity != "info"]
    if warnings:
        out.append("findings:")
        out.extend(f"  [{f.severity}] {f.code}: {f.message}" for f in warnings[:10])
    if d.fix is not None:
        if d.fix.safe:
            out.append(f"fix (safe, automatic): recreate {d.fix.container} with")
            out.extend(f"  {delta}" for delta in d.fix.docker_run)
        else:
            out.append("fix (manual):")
        out.extend(f"  - {step}" for step in d.fix.steps)
        if d.fix.note:
            out.append(f"  note: {d.fix.note}")
    return "\n".join(out)


def to_json(d: Diagnosis) -> dict[str, object]:
    return {
        "incident": d.incident,
        "confidence": d.confidence,
        "summary": d.summary,
        "evidence": [ln.model_dump() for ln in d.evidence],
        "secondary": list(d.secondary),
        "fix": d.fix.model_dump(mode="json") if d.fix is not None else None,
        "host": d.host,
        "container": d.container,
        "findings": [f.model_dump() for f in d.findings],
    }
