"""NVIDIA DCGM (issue 29, part 1): `dcgmi discovery -l`, `health -c` and `diag -r N` read from
recorded real outputs (tests/fixtures/dcgmi/, each with its .source), judged by the one engine
(runbooks/diagnose/health.py findings, runbooks/diagnose/rules.py proof), collected live from the
lab's
simulated host that has DCGM (gpu-xid79), skipped quietly on hosts that do not, and run by a
triage (`dcgmi diag -r 1`) when it suspects the hardware.

Goldens: CUDAMEDIC_REGEN_GOLDEN=1 rewrites tests/fixtures/dcgmi/<case>.json (review the diff).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from runbooks.collect.bundle import BundleMeta, open_bundle
from runbooks.collect.collector import collect
from runbooks.collect.evidence.dcgmi import (
    parse_dcgmi_diag,
    parse_dcgmi_discovery,
    parse_dcgmi_health,
)
from runbooks.core.errors import InputError
from runbooks.core.runbook import Thresholds
from runbooks.core.settings import Settings
from runbooks.diagnose.classify import classify_path
from runbooks.diagnose.facts import gather, reader_of
from runbooks.diagnose.health import check_host
from tests.lab.lab import LabState
from tests.test_fix import CLI, cli_env, fix_settings, target  # noqa: F401 - fixtures

DCGM = Path(__file__).parent / "fixtures" / "dcgmi"
FIX = Path(__file__).parent / "fixtures"


def parser_of(name: str):  # type: ignore[no-untyped-def]
    if name.startswith("discovery"):
        return parse_dcgmi_discovery
    return parse_dcgmi_health if name.startswith("health") else parse_dcgmi_diag


@pytest.mark.parametrize("path", sorted(DCGM.glob("*.txt")), ids=lambda p: p.name)
def test_fixture_matches_golden(path: Path) -> None:
    facts = parser_of(path.name)(path.read_bytes().decode("utf-8"))
    golden = path.with_suffix(".json")
    text = json.dumps(facts.model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"
    if os.environ.get("CUDAMEDIC_REGEN_GOLDEN") == "1":
        golden.write_text(text, encoding="utf-8")
    assert golden.exists(), f"no golden {golden.name}"
    assert json.loads(golden.read_text()) == json.loads(text)
    source = path.with_suffix(".source").read_text()
    assert source.strip(), path.name


def test_diag_message_is_joined_back_from_its_45_character_pieces() -> None:
    diag = parse_dcgmi_diag((DCGM / "diag-r2-gpu-memory-fail-fragment.txt").read_text())
    (test,) = diag.failed
    assert (test.section, test.name, test.failed_gpus, test.hardware) == (
        "Hardware",
        "GPU Memory",
        ("0",),
        True,
    )
    assert "Reset GPU. Restart DCGM. Rerun diagnostics. Unable to create CUDA context" in (
        test.message
    )


def test_dcgm_4x_layout_reads_per_gpu_results() -> None:
    diag = parse_dcgmi_diag((DCGM / "diag-dcgm423-software-memory-pass-fragment.txt").read_text())
    assert diag.version == "4.2.3" and [(t.name, t.result) for t in diag.tests] == [
        ("software", "Pass")
    ]
    failed = parse_dcgmi_diag(
        "|-----  Deployment  --------+------------------------------------------------|\n"
        "| software                  | Pass                                           |\n"
        "|                           | GPU1: Fail                                     |\n"
    )
    assert failed.failed[0].failed_gpus == ("1",) and not failed.failed[0].hardware


@pytest.mark.parametrize(
    "text", ["", "\x00\x01binary" * 50, "|" * 200_000, "+-----  " * 30_000, "| -> 0 |" * 20_000]
)
def test_garbage_never_raises(text: str) -> None:
    for parser in (parse_dcgmi_discovery, parse_dcgmi_health, parse_dcgmi_diag):
        parser(text)


def test_dcgmi_files_are_host_inventories_read_by_their_own_parser() -> None:
    for rel in (
        "commands/dcgmi-discovery.txt",
        "commands/dcgmi-health.txt",
        "commands/dcgmi-diag.txt",
    ):
        assert reader_of(rel) == (None, "host"), rel


# -- one engine ---------------------------------------------------------------------------------
def facts_of(tmp_path: Path, files: dict[str, str]):  # type: ignore[no-untyped-def]
    for rel, fixture in files.items():
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((FIX / fixture).read_bytes())
    with open_bundle(tmp_path) as b:
        return gather(b)


H100 = {
    "nvidia-smi.txt": "nvidia-smi/h100-sxm-8gpu.txt",
    "dmesg.txt": "dmesg/driver-load-benign.txt",
}


def test_a_failed_hardware_diag_drains_and_is_the_hardware_fault_in_dcgms_words(
    tmp_path: Path,
) -> None:
    files = {**H100, "commands/dcgmi-diag.txt": "dcgmi/diag-r2-gpu-memory-fail-fragment.txt"}
    facts = facts_of(tmp_path / "b", files)
    health = check_host("h", facts, Thresholds())
    (f,) = [f for f in health.findings if f.code == "dcgm-diag-fail"]
    assert (health.verdict, f.level, f.incident, f.subject) == (
        "drain",
        "drain",
        "gpu-hardware-fault",
        "GPU Memory",
    )
    assert "Unable to create CUDA context" in f.message
    d = classify_path(tmp_path / "b")
    assert d.incident == "gpu-hardware-fault", d.summary
    assert any(ln.source == "commands/dcgmi-diag.txt" for ln in d.evidence)
    (hw,) = [m for m in d.matches if m.incident == "gpu-hardware-fault"]
    assert "DCGM diagnostic GPU Memory failed on GPU 0: GPU 0 Error using CUDA API" in hw.reason


def test_a_health_warning_warns_and_a_passing_diag_changes_nothing(tmp_path: Path) -> None:
    plain = check_host("h", facts_of(tmp_path / "a", H100), Thresholds())
    files = {
        **H100,
        "commands/dcgmi-health.txt": "dcgmi/health-l4-power-warning.txt",
        "commands/dcgmi-discovery.txt": "dcgmi/discovery-h100-4gpu-null-names-fragment.txt",
    }
    warned = check_host("h", facts_of(tmp_path / "b", files), Thresholds())
    (f,) = [f for f in warned.findings if f.code.startswith("dcgm-")]
    assert (f.code, f.level, f.subject) == ("dcgm-health-power", "warning", "gpu0")
    assert "Detected clocks event due to power violation in GPU 0" in f.message
    assert warned.verdict == "warning" and plain.verdict == "healthy"
    # A warning is no proof of a fault: the diagnosis of the same evidence is unchanged.
    assert classify_path(tmp_path / "b").incident == classify_path(tmp_path / "a").incident
    passing = {**H100, "commands/dcgmi-diag.txt": "dcgmi/diag-r3-deployment-dcgm304-fragment.txt"}
    assert check_host("h", facts_of(tmp_path / "c", passing), Thresholds()).findings == (
        plain.findings
    )


# -- live, on the lab ----------------------------------------------------------------------------
def _meta(bundle: Path) -> BundleMeta:
    return BundleMeta.model_validate_json((bundle / "bundle.json").read_text())


@pytest.mark.lab
def test_sweep_collects_dcgm_where_installed_and_skips_quietly_elsewhere(
    settings: Settings,
) -> None:
    from runbooks.core.runbook import load_runbook
    from runbooks.diagnose.sweep import assess

    book = load_runbook(None, "sweep")
    with_dcgm = collect(target(settings, "gpu-xid79"), settings, runbook=book)
    sources = {s.name: s for s in _meta(with_dcgm).sources}
    assert sources["dcgmi-discovery"].status == "ok" and sources["dcgmi-health"].status == "ok"
    assert "Power system" in (with_dcgm / "commands/dcgmi-health.txt").read_text()
    with open_bundle(with_dcgm) as b:
        health = assess("gpu-xid79", gather(b), book.thresholds).health
    assert "dcgm-health-power@gpu0" in [f.key for f in health.findings]
    without = collect(target(settings, "gpu-healthy"), settings, runbook=book)
    meta = _meta(without)
    skipped = {s.name: s for s in meta.sources if s.name.startswith("dcgmi")}
    assert {s.status for s in skipped.values()} == {"skipped"}, skipped
    assert all("dcgmi not found" in (s.note or "") for s in skipped.values())
    assert not (without / "commands/dcgmi-health.txt").exists()
    assert not [f for f in meta.findings if "dcgm" in f.code]
    with open_bundle(without) as b:
        verdict = assess("gpu-healthy", gather(b), book.thresholds).health
    assert verdict.verdict == "healthy", verdict.findings


@pytest.mark.lab
def test_diag_level_1_runs_into_the_bundle_and_level_3_needs_a_person(
    settings: Settings, tmp_path: Path
) -> None:
    from runbooks.collect.dcgm import run_diag

    bundle = collect(target(settings, "gpu-xid79"), settings)
    with pytest.raises(InputError, match="approval"):
        run_diag(target(settings, "gpu-xid79"), settings, bundle, 3)
    assert not (bundle / "commands/dcgmi-diag.txt").exists()
    result = run_diag(target(settings, "gpu-xid79"), settings, bundle, 1)
    assert (result.status, result.command) == ("ok", "dcgmi diag -r 1")
    assert "Fail - GPU: 0" in (bundle / "commands/dcgmi-diag.txt").read_text()
    assert any(s.name == "dcgmi-diag-r1" for s in _meta(bundle).sources)
    none_here = collect(target(settings, "gpu-healthy"), settings)
    skipped = run_diag(target(settings, "gpu-healthy"), settings, none_here, 1)
    assert skipped.status == "skipped" and not (none_here / "commands/dcgmi-diag.txt").exists()


@pytest.mark.lab
def test_triage_of_a_hardware_fault_runs_dcgm_diag_level_1_and_cites_it(
    prefect_api: str,
    lab: LabState,
    fix_settings: Settings,  # noqa: F811
) -> None:
    env = cli_env(lab, fix_settings, PREFECT_API_URL=prefect_api)
    proc = subprocess.run(
        [*CLI, "triage", "gpu-xid79", "--json", "--no-input"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode in (0, 3, 4), proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["incident"] == "gpu-hardware-fault"
    bundle = Path(out["bundle"])
    sources = {s.name: s for s in _meta(bundle).sources}
    assert sources["dcgmi-diag-r1"].command == "dcgmi diag -r 1"
    assert "dcgmi-diag-r3" not in sources  # never without a person
    d = classify_path(bundle)
    assert any(ln.source == "commands/dcgmi-diag.txt" for ln in d.evidence), d.evidence
    report = Path(out["report"]).read_text()
    assert "DCGM" in report


def test_the_dcgm_exporter_rules_file_is_valid_for_prometheus() -> None:
    """deploy/prometheus/dcgm-exporter-rules.yml through Prometheus' own checker (Debian's
    `prometheus` package, installed by scripts/bootstrap.sh)."""
    rules = Path(__file__).parents[1] / "deploy" / "prometheus" / "dcgm-exporter-rules.yml"
    proc = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 7 rules found" in proc.stdout
    assert rules.read_text().count("Hostname") >= 7  # every alert names the host as DCGM does


def test_every_dcgmi_parser_takes_any_text_built_from_its_own_pieces() -> None:
    """Hypothesis: lines made of the layouts' own pieces (borders, arrows, results, cut cells) in
    any order and length never raise, and every cited line is a line of the input."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pieces = st.sampled_from(
        [
            "| ",
            " |",
            "|",
            "+-----  Hardware  ---+---+",
            "|-----  Deployment  --+--|",
            "-> ",
            "-> 0",
            "-> Errors",
            "Fail - GPU: 0",
            "Pass",
            "GPU1: Fail",
            "Warning",
            "Failure",
            "Overall Health",
            "Memory system",
            "GPU ID: 3",
            "PCIe system: Warning - x",
            "Error:",
            "8 GPUs found.",
            "Name: ",
            "PCI Bus ID: ",
            " " * 45,
            "\n",
            "{",
            "\x00",
            "é",
        ]
    )

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=200))
    def check(parts: list[str]) -> None:
        text = "".join(parts)
        lines = text.split("\n")
        for parser in (parse_dcgmi_discovery, parse_dcgmi_health, parse_dcgmi_diag):
            facts = parser(text)
            dumped = json.dumps(facts.model_dump(mode="json"))
            for number in re.findall(r'"line": (\d+)', dumped):
                assert 1 <= int(number) <= len(lines), (number, text[:300])

    check()
