"""Golden-file and robustness tests for the host evidence parsers.

Every ``tests/fixtures/<source>/<case>.txt|.xml`` is real output (see ``<case>.source``) and is
compared with the reviewed golden ``<case>.json``. To regenerate goldens after a deliberate
parser change, run::

    CUDAMEDIC_REGEN_GOLDEN=1 .venv/bin/pytest tests/test_parsers_host.py

then review the diff of the ``.json`` files before committing them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runbooks.collect.evidence.dmesg import parse_kernel_log
from runbooks.collect.evidence.nccl_tests import parse_nccl_tests
from runbooks.collect.evidence.nvidia_smi import (
    SmiFacts,
    SmiXmlFacts,
    normalize_bus_id,
    parse_nvidia_smi,
    parse_nvidia_smi_xml,
)

FIXTURES = Path(__file__).parent / "fixtures"

Parser = Callable[[str], Any]
PARSERS: dict[str, tuple[str, Parser]] = {
    "nvidia-smi": ("*.txt", parse_nvidia_smi),
    "nvidia-smi-xml": ("*.xml", parse_nvidia_smi_xml),
    "dmesg": ("*.txt", parse_kernel_log),
    "nccl-tests": ("*.txt", parse_nccl_tests),
}
ALL_PARSERS = [pytest.param(parser, id=name) for name, (_, parser) in PARSERS.items()]


def read_fixture(path: Path) -> str:
    # bytes + decode, not read_text(): keep CR/LF exactly as stored
    return path.read_bytes().decode("utf-8")


def fixture(directory: str, name: str) -> str:
    return read_fixture(FIXTURES / directory / name)


def regen_golden(golden: Path, facts: Any) -> None:
    """Rewrite a golden file, only when CUDAMEDIC_REGEN_GOLDEN=1 is set."""
    if os.environ.get("CUDAMEDIC_REGEN_GOLDEN") != "1":
        return
    text = json.dumps(facts.model_dump(mode="json"), indent=2, ensure_ascii=False)
    golden.write_text(text + "\n", encoding="utf-8")


def _fixture_cases() -> list[Any]:
    cases = []
    for directory, (pattern, parser) in PARSERS.items():
        for path in sorted((FIXTURES / directory).glob(pattern)):
            cases.append(pytest.param(path, parser, id=f"{directory}/{path.name}"))
    return cases


def _finding_codes(facts: Any) -> set[str]:
    return {finding.code for finding in facts.findings}


# ------------------------------------------------------------------------------ goldens


@pytest.mark.parametrize(("path", "parser"), _fixture_cases())
def test_fixture_matches_golden(path: Path, parser: Parser) -> None:
    facts = parser(read_fixture(path))
    golden = path.with_suffix(".json")
    regen_golden(golden, facts)
    assert golden.exists(), f"no {golden.name}: run with CUDAMEDIC_REGEN_GOLDEN=1 and review it"
    assert facts.model_dump(mode="json") == json.loads(golden.read_text(encoding="utf-8"))


@pytest.mark.parametrize("directory", [*PARSERS, "host-commands"], ids=[*PARSERS, "host-commands"])
def test_every_fixture_names_its_source(directory: str) -> None:
    outputs = [p for p in (FIXTURES / directory).iterdir() if p.suffix not in {".source", ".json"}]
    assert outputs, f"no fixtures in {directory}"
    for path in outputs:
        source = path.with_suffix(".source")
        assert source.exists(), f"{path.name} has no .source"
        first = source.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("https://"), f"{source.name}: first line must be the URL"


# --------------------------------------------------------------- what the goldens say


def test_h100_table_reads_versions_gpus_and_bus_ids() -> None:
    facts = parse_nvidia_smi(fixture("nvidia-smi", "h100-sxm-8gpu.txt"))
    assert (facts.status, facts.driver_version, facts.cuda_version) == ("ok", "565.57.01", "12.7")
    assert [g.bus_id for g in facts.gpus][:2] == ["0000:18:00.0", "0000:2a:00.0"]
    assert {g.memory_total_mib for g in facts.gpus} == {81559}
    assert facts.status_line is not None and facts.status_line.line == 2


def test_err_fields_become_findings() -> None:
    facts = parse_nvidia_smi(fixture("nvidia-smi", "err-a100-gsp-fragment.txt"))
    broken = facts.gpus[1]
    assert broken.index == 5 and broken.bus_id == "0000:91:00.0"
    assert {"temperature_c", "power_draw_w", "fan_percent"} <= set(broken.err_fields)
    assert "smi-err-field" in _finding_codes(facts)


@pytest.mark.parametrize(
    ("name", "status"),
    [
        ("driver-not-loaded.txt", "driver-not-loaded"),
        ("driver-not-loaded-wrapped.txt", "driver-not-loaded"),
        ("library-mismatch.txt", "library-mismatch"),
        ("library-mismatch-nvml-version.txt", "library-mismatch"),
        ("no-devices.txt", "no-devices"),
        ("not-found.txt", "not-found"),
        ("not-found-docker-exec.txt", "not-found"),
    ],
)
def test_error_texts_set_status(name: str, status: str) -> None:
    facts = parse_nvidia_smi(fixture("nvidia-smi", name))
    assert facts.status == status
    assert facts.status_line is not None and facts.status_line.line == 1


def test_processes_are_listed() -> None:
    facts = parse_nvidia_smi(fixture("nvidia-smi", "rtx2080ti-8gpu-processes.txt"))
    first = facts.processes[0]
    assert (first.gpu, first.pid, first.name, first.used_mib) == (
        0,
        34882,
        "python",
        6751,
    )


def test_xml_reads_ecc_mig_and_retired_pages() -> None:
    a100 = parse_nvidia_smi_xml(fixture("nvidia-smi-xml", "a100-sxm4-mig-v12.xml")).gpus[0]
    assert (a100.mig_mode, a100.mig_device_count, a100.remapped_rows) == ("Enabled", 4, None)
    assert a100.ecc_aggregate is not None and a100.ecc_aggregate.dram_uncorrectable == 0
    t4 = parse_nvidia_smi_xml(fixture("nvidia-smi-xml", "tesla-t4-v11.xml")).gpus[0]
    assert t4.retired_pages is not None and t4.retired_pages.pending_blacklist is False
    assert (t4.bus_id, t4.slowdown_temp_c, len(t4.processes)) == ("0000:00:1e.0", 93, 2)


def test_truncated_xml_keeps_leading_fields() -> None:
    facts = parse_nvidia_smi_xml(fixture("nvidia-smi-xml", "a100-sxm4-mig-v12-truncated.xml"))
    assert facts.truncated and "xml-truncated" in _finding_codes(facts)
    assert facts.gpus[0].uuid == "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    assert facts.gpus[0].memory_total_mib == 81920


def test_mig_xid_line() -> None:
    facts = parse_kernel_log(fixture("dmesg", "xid94-95-mig-nvidia-doc.txt"))
    first = facts.xids[0]
    assert (first.code, first.pci, first.gpu_instance, first.pid) == (94, "0000:01:00", 5, 7194)
    assert [x.code for x in facts.xids] == [94, 94, 95]


def test_ctime_and_syslog_stamps() -> None:
    ctime = parse_kernel_log(fixture("dmesg", "xid43-31-94-ctime.txt")).xids[2]
    assert ctime.timestamp is not None and ctime.timestamp.isoformat() == "2024-08-05T03:54:13"
    assert ctime.process_name == "python3.10"
    syslog = parse_kernel_log(fixture("dmesg", "xid48-64-rminitadapter-syslog.txt"))
    assert syslog.xids[0].time_text == "Dec  2 11:38:47" and syslog.xids[0].timestamp is None
    assert syslog.xids[0].uptime_s == pytest.approx(219.470994)
    assert sum(n.init_failed for n in syslog.nvrm) == 7


@pytest.mark.parametrize(
    ("name", "client", "module"),
    [
        ("api-mismatch-raw.txt", "515.48.07", "510.73.05"),
        ("api-mismatch-journal.txt", "367.44", "367.35"),
        ("api-mismatch-syslog-012.txt", "535.54.03", "530.30.02"),
        ("api-mismatch-client-pid-journal.txt", "570.133.07", "575.51.02"),
    ],
)
def test_api_mismatch_versions(name: str, client: str, module: str) -> None:
    mismatch = [n for n in parse_kernel_log(fixture("dmesg", name)).nvrm if n.api_mismatch]
    assert [(n.client_version, n.kernel_version) for n in mismatch] == [(client, module)]


def test_fell_off_bus_and_oom_and_not_permitted() -> None:
    assert parse_kernel_log(fixture("dmesg", "xid79-fallen-off-bus-aer.txt")).fell_off_bus
    assert parse_kernel_log(fixture("dmesg", "fallen-off-bus-no-xid.txt")).fell_off_bus
    oom = parse_kernel_log(fixture("dmesg", "oom-kill-raw.txt")).oom_kills
    assert [(k.pid, k.process_name, k.constraint) for k in oom] == [
        (25315, "python3", "CONSTRAINT_NONE")
    ]
    refused = parse_kernel_log(fixture("dmesg", "not-permitted.txt"))
    assert refused.not_permitted and "dmesg-not-permitted" in _finding_codes(refused)


def test_nccl_h100_single_node() -> None:
    facts = parse_nccl_tests(fixture("nccl-tests", "h100-8gpu-single-node.txt"))
    assert (facts.n_ranks, facts.gpu_models) == (8, ("NVIDIA H100 80GB HBM3",))
    assert (facts.avg_busbw, facts.max_busbw, facts.wrong_total) == (439.369, 476.53, 0)
    assert facts.out_of_bounds_ok is True


def test_nccl_wrong_and_failed() -> None:
    facts = parse_nccl_tests(fixture("nccl-tests", "gh200-2rank-wrong-failed.txt"))
    assert (facts.wrong_total, facts.out_of_bounds_values, facts.out_of_bounds_ok) == (
        128,
        4,
        False,
    )
    assert {"nccl-wrong-results", "nccl-out-of-bounds"} <= _finding_codes(facts)
    assert facts.collective == "all_reduce" and len(facts.failures) == 3


def test_nccl_srun_labels_and_slow_p2p() -> None:
    labelled = parse_nccl_tests(fixture("nccl-tests", "h100-16rank-srun-label.txt"))
    assert (labelled.n_ranks, len(labelled.rows), labelled.avg_busbw) == (16, 11, 142.735)
    slow = parse_nccl_tests(fixture("nccl-tests", "a100-4gpu-p2p-disabled.txt"))
    assert slow.max_busbw == 5.2


def test_bus_id_normalisation() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("00008ED0:00:00.0") == "8ed0:00:00.0"
    assert normalize_bus_id("no bus here") is None


# --------------------------------------------------------------------------- garbage

JUNK = bytes(range(256)).decode("latin-1")
HUGE_LINE = "A" * 10_000_000


@pytest.mark.parametrize("parser", ALL_PARSERS)
@pytest.mark.parametrize("text", ["", "   \n\t\n"], ids=["empty", "blank"])
def test_empty_input(parser: Parser, text: str) -> None:
    facts = parser(text)
    if isinstance(facts, SmiFacts):
        assert facts.status == "empty" and not facts.gpus
    else:
        assert facts.findings


@pytest.mark.parametrize("parser", ALL_PARSERS)
def test_binary_junk(parser: Parser) -> None:
    facts = parser(JUNK)
    assert facts.findings
    if not isinstance(facts, SmiXmlFacts):
        assert "binary-input" in _finding_codes(facts)


@pytest.mark.parametrize("parser", ALL_PARSERS)
def test_ten_megabyte_line(parser: Parser) -> None:
    started = time.monotonic()
    facts = parser(HUGE_LINE)
    assert facts.findings
    assert time.monotonic() - started < 10
    if not isinstance(facts, SmiXmlFacts):
        assert "line-too-long" in _finding_codes(facts)


def test_ten_megabyte_line_among_real_lines() -> None:
    text = fixture("dmesg", "xid13-109-ctime.txt") + HUGE_LINE + "\n"
    facts = parse_kernel_log(text)
    assert len(facts.xids) == 4 and "line-too-long" in _finding_codes(facts)


def test_every_cut_of_real_xml_parses() -> None:
    text = fixture("nvidia-smi-xml", "tesla-t4-v11.xml")
    for cut in range(1, len(text), 271):
        facts = parse_nvidia_smi_xml(text[:cut])
        assert _finding_codes(facts) & {"xml-truncated", "xml-malformed", "xml-empty"}


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE nvidia_smi_log [
 <!ENTITY lol "lol">
 <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
]>
<nvidia_smi_log><driver_version>&lol2;</driver_version></nvidia_smi_log>
"""
XXE = """<?xml version="1.0"?>
<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]>
<nvidia_smi_log><driver_version>&e;</driver_version></nvidia_smi_log>
"""


@pytest.mark.parametrize("text", [BILLION_LAUGHS, XXE], ids=["entity-expansion", "xxe"])
def test_xml_doctype_with_entities_is_refused(text: str) -> None:
    facts = parse_nvidia_smi_xml(text)
    assert "xml-doctype-rejected" in _finding_codes(facts)
    assert facts.driver_version is None and not facts.gpus


def test_undefined_entity_is_malformed_not_fatal() -> None:
    facts = parse_nvidia_smi_xml("<nvidia_smi_log><driver_version>&x;</driver_version>")
    assert "xml-malformed" in _finding_codes(facts)


def test_xml_with_wrong_root() -> None:
    facts = parse_nvidia_smi_xml("<html><body>502 Bad Gateway</body></html>")
    assert "xml-unexpected-root" in _finding_codes(facts) and not facts.gpus


@pytest.mark.parametrize(
    ("directory", "name", "parser"),
    [
        ("nvidia-smi", "h100-sxm-8gpu.txt", parse_nvidia_smi),
        ("dmesg", "xid48-64-rminitadapter-syslog.txt", parse_kernel_log),
        ("dmesg", "api-mismatch-raw.txt", parse_kernel_log),
        ("nccl-tests", "h100-8gpu-single-node.txt", parse_nccl_tests),
    ],
)
def test_crlf_gives_the_same_facts(directory: str, name: str, parser: Parser) -> None:
    text = fixture(directory, name)
    assert parser(text.replace("\n", "\r\n")) == parser(text)


def test_junk_around_a_real_xid_line() -> None:
    line = "[74889.644138] NVRM: Xid (PCI:0000:02:00): 79, GPU has fallen off the bus."
    facts = parse_kernel_log("\x00\x1b[31m\x07" + line + "\x1b[0m\n\x00\x01\x02\n")
    assert [x.code for x in facts.xids] == [79]


def test_docker_time_reads_what_docker_prints_and_nothing_else() -> None:
    """The one parser of Docker's timestamps (inspect's StartedAt/FinishedAt/Created, `docker
    info`'s SystemTime): nanoseconds, `Z` or an offset; the zero time and garbage are None."""
    from datetime import UTC, datetime, timedelta, timezone

    from runbooks.collect.evidence.docker_inspect import docker_time

    # Docker Remote API v1.18 reference (docker/docker docs/reference/api/
    # docker_remote_api_v1.18.md), the example responses of GET /containers/(id)/json and GET /info
    exited = docker_time("2015-01-06T15:47:32.080254511Z")  # State.FinishedAt
    assert exited == datetime(2015, 1, 6, 15, 47, 32, 80254, tzinfo=UTC)
    local = docker_time("2015-03-10T11:11:23.730591467-07:00")  # SystemTime
    assert local == datetime(2015, 3, 10, 11, 11, 23, 730591, tzinfo=timezone(-timedelta(hours=7)))
    assert docker_time("2015-01-06T15:47:32Z") == datetime(2015, 1, 6, 15, 47, 32, tzinfo=UTC)
    for never in ("0001-01-01T00:00:00Z", "", "garbage", "2025-13-01T00:00:00Z", None, 17):
        assert docker_time(never) is None, never
