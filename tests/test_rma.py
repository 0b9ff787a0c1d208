"""The RMA evidence NVIDIA asks for (issue 29, part 2): for a `gpu-hardware-fault` verdict the
response offers, behind the same approval as a fix, to run nvidia-bug-report.sh on the host, and
the post-mortem's "open an RMA" item keeps the file's path, size and sha256 with the GPU's serial
and the Xid lines. Live on the lab host gpu-xid79, whose nvidia-bug-report.sh is a stand-in with
the real tool's layout (tests/lab/lab.py cites NVIDIA's script)."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
from pathlib import Path

from runbooks.collect.bundle import open_bundle
from runbooks.core.settings import Settings
from runbooks.diagnose.facts import gather
from runbooks.diagnose.rma import BugReport, parse_answer, rma_item
from tests.lab.lab import LabState
from tests.test_fix import CLI, cli_env, fix_settings  # noqa: F401 - fixtures

FIX = Path(__file__).parent / "fixtures"


def facts_of(tmp_path: Path, files: dict[str, str]):  # type: ignore[no-untyped-def]
    for rel, fixture in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((FIX / fixture).read_bytes())
    with open_bundle(tmp_path) as b:
        return gather(b)


def test_the_rma_item_names_the_serial_the_xid_lines_and_the_kept_report(tmp_path: Path) -> None:
    facts = facts_of(
        tmp_path,
        {
            "nvidia-smi.xml": "nvidia-smi-xml/v100-sxm3-retired-pages-v10.xml",
            "dmesg.txt": "dmesg/xid48-64-rminitadapter-syslog.txt",
        },
    )
    serial = facts.smi_xml.gpus[0].serial
    assert serial
    report = BugReport(
        status="ok", path="/tmp/x/nvidia-bug-report.log.gz", size=12, sha256="a" * 64
    )
    item = rma_item(facts, report, offered=True)
    assert item.startswith("Open an RMA with NVIDIA:") and f"serial {serial}" in item
    assert "/tmp/x/nvidia-bug-report.log.gz on the host, 12 bytes, sha256 " + "a" * 64 in item
    assert "run nvidia-bug-report.sh on the host" in rma_item(facts, None, offered=False)
    assert "not approved" in rma_item(facts, None, offered=True)


def test_a_command_that_wrote_no_file_is_a_failure_not_a_report() -> None:
    assert parse_answer("").status == "failed"
    assert parse_answer("path=/tmp/a\nsize=12\nsha256=nothex").status == "failed"
    ok = parse_answer(f"path=/tmp/a.gz\nsize=12\nsha256={'0' * 64}\n")
    assert (ok.status, ok.size) == ("ok", 12)


def _triage(env: dict[str, str], *args: str) -> dict[str, object]:
    proc = subprocess.run(
        [*CLI, "triage", "gpu-xid79", "--json", "--no-input", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


def test_an_approved_hardware_fault_response_keeps_the_bug_report_for_the_rma(
    prefect_api: str,
    lab: LabState,
    fix_settings: Settings,  # noqa: F811
) -> None:
    env = cli_env(lab, fix_settings, PREFECT_API_URL=prefect_api)
    dry = _triage(env)  # no --apply: offered only in words, nothing runs on the host
    assert dry["incident"] == "gpu-hardware-fault"
    assert "run nvidia-bug-report.sh on the host as root" in Path(str(dry["report"])).read_text()

    out = _triage(env, "--apply", "--yes")
    assert out["incident"] == "gpu-hardware-fault", out
    report = Path(str(out["report"])).read_text()
    m = re.search(
        r"nvidia-bug-report: (\S+) on the host, (\d+) bytes, sha256 ([0-9a-f]{64})", report
    )
    assert m, report
    path = Path(m.group(1))  # the lab's hosts are this machine: the host's file is here
    assert path.name == "nvidia-bug-report.log.gz" and path.stat().st_size == int(m.group(2))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == m.group(3)
    log = gzip.decompress(path.read_bytes()).decode()
    assert "Start of NVIDIA bug report log file." in log and "Xid" in log
    item = next(ln for ln in report.splitlines() if "Open an RMA with NVIDIA" in ln)
    assert "Xid (PCI:0000:02:00): 79" in item  # the Xid line itself, from the kernel log
