"""Issue 16 (one engine): the incident diagnosis (`cudamedic classify`) and the sweep's host
verdict judge the same facts with the same rules, thresholds and class ids — on every corpus
bundle and on every lab host collected with the sweep runbook."""

from __future__ import annotations

from pathlib import Path

import pytest

from runbooks.collect.bundle import open_bundle
from runbooks.collect.collector import collect
from runbooks.collect.inventory import load_inventory
from runbooks.collect.target import resolve_target
from runbooks.core.model import Diagnosis
from runbooks.core.runbook import Thresholds, load_runbook
from runbooks.core.settings import Settings
from runbooks.core.taxonomy import Incident
from runbooks.diagnose.classify import classify_path, diagnose
from runbooks.diagnose.facts import Facts, gather
from runbooks.diagnose.health import check_host
from runbooks.diagnose.rules import STRONG
from runbooks.diagnose.sweep import HostResult, assess
from tests.lab.lab import LabState

CORPUS = Path(__file__).parent / "corpus"
TAXONOMY = {i.value for i in Incident}


def disagreements(d: Diagnosis, r: HostResult) -> list[str]:
    """Where a diagnosis and a sweep result of the same bundle say different things."""
    out = []
    reported = {f.code: f.message for f in d.findings}
    for f in r.health.findings:
        if f.incident not in TAXONOMY:
            out.append(f"sweep finding {f.key} names no taxonomy class ({f.incident})")
        if f.code == "diagnosis":
            continue
        if f.key not in reported:
            out.append(f"sweep finding {f.key} is not among the diagnosis's findings")
        elif not reported[f.key].startswith(f"{f.incident}:"):
            out.append(f"{f.key}: class {f.incident} in the sweep, {reported[f.key]!r} in classify")
    classes = {f.incident for f in r.health.findings}
    decided = d.basis == "evidence" and d.confidence >= STRONG
    if decided and d.incident not in (Incident.HEALTHY, Incident.UNKNOWN):
        if d.incident not in classes:
            out.append(f"diagnosis {d.incident} is not a class of any sweep finding {classes}")
        if r.incident != d.incident:
            out.append(f"sweep diagnosed {r.incident}, classify {d.incident}")
    if d.incident == Incident.HEALTHY and r.health.verdict == "drain":
        out.append("classify says healthy, the sweep drains the host")
    if r.health.verdict == "drain" and d.incident == Incident.HEALTHY:
        out.append("the sweep drains a host whose diagnosis is healthy")
    return out


def _facts(bundle: Path) -> Facts:
    with open_bundle(bundle) as b:
        return gather(b)


def test_classify_and_sweep_agree_on_every_corpus_bundle() -> None:
    cases = sorted(p for p in CORPUS.iterdir() if (p / "case.yaml").is_file())
    assert len(cases) >= 400
    found = {}
    for case in cases:
        facts = _facts(case)
        problems = disagreements(diagnose(facts), assess(case.name, facts, Thresholds()))
        if problems:
            found[case.name] = problems
    assert found == {}


def test_a_threshold_from_the_runbook_moves_both_verdicts() -> None:
    """The sweep runbook's shm floor is the classifier's too: one threshold, one place."""
    case = CORPUS / "shm-too-small--vllm-tp2-docker-ray-dev-shm-64mb"
    facts = _facts(case)
    default = assess(case.name, facts, Thresholds())
    assert default.incident == Incident.SHM_TOO_SMALL
    assert "container-shm-small" in {f.code for f in default.health.findings}
    lowered = Thresholds(shm_min_mib=32)  # 64 MiB is enough for this runbook
    r = assess(case.name, facts, lowered)
    d = diagnose(facts.model_copy(update={"thresholds": lowered}))
    assert "container-shm-small" not in {f.code for f in r.health.findings}
    assert not any(f.code.startswith("container-shm-small") for f in d.findings)
    # The log still says what it says, but the inspect's 64 MiB is no longer evidence of it.
    before = diagnose(facts)
    assert any(e.source.endswith(".inspect.json") for e in before.evidence)
    assert not any(e.source.endswith(".inspect.json") for e in d.evidence)
    assert d.confidence < before.confidence
    assert disagreements(d, r) == []


def test_every_sweep_code_names_a_class() -> None:
    from runbooks.diagnose.health import incident_of

    assert incident_of("xid-79") == Incident.GPU_HARDWARE_FAULT
    assert incident_of("xid-13") == Incident.CUDA_ILLEGAL_ACCESS
    assert incident_of("ecc-remapped-rows-failure") == Incident.GPU_HARDWARE_FAULT
    assert incident_of("container-shm-small") == Incident.SHM_TOO_SMALL
    assert incident_of("container-memlock-low") == Incident.MEMLOCK_LIMIT
    assert incident_of("host-unreachable") == Incident.UNKNOWN


def test_unrecognised_nvidia_smi_output_does_not_drain_a_host() -> None:
    """A pasted fragment of nvidia-smi (one process row) is not a failing GPU."""
    case = CORPUS / "healthy--vllm-awq-3b-16gb-kv-cache-preallocation"
    h = check_host(case.name, _facts(case), Thresholds())
    assert h.verdict != "drain"
    assert [f.code for f in h.findings] == ["nvidia-smi-unrecognized"]


@pytest.fixture
def sweep_settings(settings: Settings) -> Settings:
    return settings


def test_classify_and_sweep_agree_on_every_lab_host(
    lab: LabState, sweep_settings: Settings, tmp_path: Path
) -> None:
    assert sweep_settings.inventory is not None
    inventory = load_inventory(sweep_settings.inventory)
    book = load_runbook(kind="sweep")
    checked = {}
    for name in sorted(inventory.hosts):
        bundle = collect(
            resolve_target(name, inventory), sweep_settings, runbook=book, out_dir=tmp_path
        )
        facts = _facts(bundle)
        with open_bundle(bundle) as b:  # as the sweep reads it: a hung nvidia-smi is a timeout
            status = {s.name: s.status for s in b.meta.sources} if b.meta else {}
        r = assess(name, facts, book.thresholds, source_status=status)
        # with the similar known incidents, as `cudamedic classify BUNDLE` runs it
        d = classify_path(bundle, state_dir=tmp_path / "state")
        problems = disagreements(d, r)
        classes = {f.incident for f in r.health.findings}
        if r.health.verdict == "drain" and d.incident not in classes:
            # issue 26: gpu-hang drained, classify proposed shm-too-small from similar incidents
            problems.append(f"the sweep drains for {classes}, classify says {d.incident}")
        checked[name] = (r.health.verdict, d.incident, problems)
    assert len(checked) >= 6
    assert {n: c[2] for n, c in checked.items() if c[2]} == {}
    # The lab plants problems: the sweep finds some, and reports every host.
    assert {v for v, _, _ in checked.values()} & {"warning", "drain"}
