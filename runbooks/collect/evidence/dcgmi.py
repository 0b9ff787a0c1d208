"""Parse NVIDIA DCGM's command line, ``dcgmi``: ``discovery -l``, ``health -c`` and ``diag -r N``.

Reads the bundle files ``commands/dcgmi-discovery.txt``, ``commands/dcgmi-health.txt`` and
``commands/dcgmi-diag.txt`` (collected only on hosts where ``dcgmi`` is installed). The layouts
are those of DCGM's own formatters (dcgmi/Health.cpp, dcgmi/Diag.cpp in NVIDIA/DCGM): boxed
two-column tables, the diag's section rows (``|-----  Deployment  ---...|``), its result cells
(``Pass``, ``Fail - GPU: 0``, ``GPU0: Pass``) and its Warning/Error/Info rows cut every 45
characters mid-word; the health report's tree (``-> 0``, ``-> Errors``, ``-> Memory system``)
with word-wrapped messages, or its ``-j`` JSON. Never raises: unreadable text is a finding.

Real example (NVIDIA/go-dcgm#52, ``dcgmi diag -r 2``)::

    +-----  Hardware  ----------+------------------------------------------------+
    | GPU Memory                | Pass - GPU: 1                                  |
    |                           | Fail - GPU: 0                                  |
    | Warning                   | GPU 0 Error using CUDA API cuCtxCreate Check   |
    |                           | DCGM and system logs for errors. Reset GPU. R  |

parses to one test ``GPU Memory`` (section ``Hardware``) whose result is ``Fail`` on GPU 0, with
DCGM's message "GPU 0 Error using CUDA API cuCtxCreate Check DCGM and system logs for errors.
Reset GPU. Restart DCGM. ..." joined back from its 45-character pieces.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from runbooks.collect.evidence.text import (
    MAX_SCAN_CHARS,
    binary_input,
    cite,
    looks_binary,
    split_lines,
)
from runbooks.core.model import Finding, Frozen, Line

MAX_ROWS = 5000  # a diag of many GPUs is a few hundred rows; more is not DCGM's output
HARDWARE_SECTIONS = frozenset({"Hardware", "Integration", "Stress"})
# Deployment tests that read the GPU's own memory-health records: a failure is the GPU's.
HARDWARE_DEPLOYMENT_TESTS = frozenset({"Page Retirement/Row Remap", "Inforom"})
_RESULT = re.compile(r"^(Pass|Fail|Skip|Warn)\b(?: - (.{1,200}))?$")
_GPU_RESULT = re.compile(r"^GPU\s?(\d{1,4}): (Pass|Fail|Skip|Warn)\b")
_FOUND = re.compile(r"^(\d{1,5}) GPUs? found")
_ENTITY = re.compile(r"^-> (\d{1,5})$")
_OLD_ENTITY = re.compile(r"^GPU ID: (\d{1,5})$")
_OLD_INCIDENT = re.compile(
    r"^([A-Za-z][A-Za-z ]{0,40}?(?: system)?|Driver): (Warning|Failure) - (.*)$"
)
Status = Literal["Healthy", "Warning", "Failure"]


class DcgmGpu(Frozen):
    id: int
    name: str | None = None
    bus_id: str | None = None
    uuid: str | None = None


class DcgmDiscovery(Frozen):
    found: int | None = None  # "8 GPUs found."
    gpus: tuple[DcgmGpu, ...] = ()
    findings: tuple[Finding, ...] = ()


class HealthIncident(Frozen):
    gpu: str  # the entity id as DCGM prints it ("0")
    system: str  # "Memory system", "PCIe system", "Driver"
    status: Status
    message: str  # DCGM's own text
    line: Line


class DcgmHealth(Frozen):
    state: Literal["ok", "not-enabled", "unavailable", "unrecognized"] = "unrecognized"
    overall: Status | None = None
    incidents: tuple[HealthIncident, ...] = ()
    line: Line | None = None  # the Overall Health row, or the error line
    findings: tuple[Finding, ...] = ()


class DiagTest(Frozen):
    section: str  # Deployment, Integration, Hardware, Stress ("" before any section row)
    name: str
    result: str  # Pass | Fail | Skip | Warn (the worst of its per-GPU results)
    failed_gpus: tuple[str, ...] = ()  # "0", or "All"
    message: str = ""  # DCGM's Warning/Error text for this test, joined back
    line: Line
    message_line: Line | None = None  # where that text starts

    @property
    def hardware(self) -> bool:
        """Does a failure of this test point at the GPU rather than its software setup?"""
        return self.section in HARDWARE_SECTIONS or self.name in HARDWARE_DEPLOYMENT_TESTS


class DcgmDiag(Frozen):
    ran: bool = False  # "Successfully ran diagnostic for group." or a result table
    version: str | None = None
    tests: tuple[DiagTest, ...] = ()
    error: Line | None = None  # "Error: ..." printed instead of a table
    findings: tuple[Finding, ...] = ()

    @property
    def failed(self) -> tuple[DiagTest, ...]:
        return tuple(t for t in self.tests if t.result == "Fail")


def _cells(raw: str) -> tuple[str, str] | None:
    """(name cell, value cell as printed) of a ``| name | value |`` row, else None."""
    if not raw.startswith("|") or len(raw) > MAX_SCAN_CHARS:
        return None
    name, sep, rest = raw[1:].partition("|")
    if not sep:
        return None
    return name, rest.rstrip().removesuffix("|")


def _rows(text: str, source: str) -> tuple[list[tuple[int, str]], list[Finding]]:
    findings: list[Finding] = []
    if looks_binary(text):
        return [], [binary_input(source)]
    lines = list(enumerate(split_lines(text), 1))
    if len(lines) > MAX_ROWS:
        findings.append(
            Finding(
                code="dcgmi-too-long",
                source=source,
                severity="warning",
                message=f"{len(lines)} lines; read the first {MAX_ROWS}",
            )
        )
    return lines[:MAX_ROWS], findings


# -- discovery -----------------------------------------------------------------------------------
def parse_dcgmi_discovery(text: str, source: str = "commands/dcgmi-discovery.txt") -> DcgmDiscovery:
    rows, findings = _rows(text, source)
    found: int | None = None
    gpus: list[dict[str, object]] = []
    in_gpus = False
    for _, raw in rows:
        line = raw.strip()
        if (m := _FOUND.match(line)) is not None:
            in_gpus = found is None  # the first table lists GPUs; NvSwitches etc. follow
            found = int(m.group(1)) if found is None else found
            continue
        cells = _cells(line)
        if not in_gpus or cells is None:
            continue
        key, value = cells[0].strip(), cells[1].strip()
        if key.isdigit():
            gpus.append({"id": int(key)})
        if not gpus:
            continue
        for label, field in (
            ("Name: ", "name"),
            ("PCI Bus ID: ", "bus_id"),
            ("Device UUID: ", "uuid"),
        ):
            if value.startswith(label):
                gpus[-1][field] = value.removeprefix(label)[:200] or None
    if found is None and not gpus and text.strip():
        findings.append(
            Finding(
                code="dcgmi-unrecognized",
                source=source,
                severity="info",
                message=f"not a `dcgmi discovery -l` listing: {text.strip().splitlines()[0][:200]}",
            )
        )
    return DcgmDiscovery(
        found=found,
        gpus=tuple(DcgmGpu.model_validate(g) for g in gpus),
        findings=tuple(findings),
    )


# -- health --------------------------------------------------------------------------------------
def _status(value: str) -> Status | None:
    word = value.strip().split(" ", 1)[0] if value.strip() else ""
    return word if word in ("Healthy", "Warning", "Failure") else None  # type: ignore[return-value]


def parse_dcgmi_health(text: str, source: str = "commands/dcgmi-health.txt") -> DcgmHealth:
    """``dcgmi health -c`` (the tree, or the older ``GPU ID: N`` rows), or its ``-j`` JSON."""
    stripped = text.strip()
    if stripped.startswith("{"):
        return _health_json(stripped, source)
    rows, findings = _rows(text, source)
    overall: Status | None = None
    overall_line: Line | None = None
    incidents: list[dict[str, object]] = []
    entity = ""
    for number, raw in rows:
        line = raw.strip()
        if line.startswith("Error:"):
            state = "not-enabled" if "not enabled" in line else "unavailable"
            return DcgmHealth(
                state=state, line=cite(source, number, line), findings=tuple(findings)
            )
        cells = _cells(line)
        if cells is None:
            continue
        name, value = cells[0].strip(), cells[1].strip()
        if name == "Overall Health" or (name.startswith("Group") and "Overall Health:" in value):
            overall = _status(value.rsplit(":", 1)[-1])
            overall_line = cite(source, number, line)
        elif (m := _ENTITY.match(name) or _OLD_ENTITY.match(name)) is not None:
            entity = m.group(1)
        elif name.startswith("-> ") and name != "-> Errors" and entity:
            status = _status(value)
            if status is not None and status != "Healthy":
                incidents.append(_incident(entity, name[3:], status, "", source, number, line))
        elif not name and value and entity:
            old = _OLD_INCIDENT.match(value)
            if old is not None:
                said_status: Status = "Failure" if old.group(2) == "Failure" else "Warning"
                incidents.append(
                    _incident(entity, old.group(1), said_status, old.group(3), source, number, line)
                )
            elif incidents and incidents[-1]["gpu"] == entity:
                said = str(incidents[-1]["message"])
                incidents[-1]["message"] = f"{said} {value}".strip()[:2000]
    if overall is None:
        if stripped:
            findings.append(
                Finding(
                    code="dcgmi-unrecognized",
                    source=source,
                    severity="info",
                    message=f"not a DCGM health report: {stripped.splitlines()[0][:200]}",
                )
            )
        return DcgmHealth(findings=tuple(findings))
    return DcgmHealth(
        state="ok",
        overall=overall,
        incidents=tuple(HealthIncident.model_validate(i) for i in incidents),
        line=overall_line,
        findings=tuple(findings),
    )


def _incident(
    gpu: str, system: str, status: Status, message: str, source: str, number: int, line: str
) -> dict[str, object]:
    return {
        "gpu": gpu,
        "system": system[:60],
        "status": status,
        "message": message[:2000],
        "line": cite(source, number, line),
    }


def _health_json(text: str, source: str) -> DcgmHealth:
    """The ``-j`` form: only the overall verdict is read (no recorded incident in JSON form has
    been seen to read its layout from)."""
    try:
        data = json.loads(text[:MAX_SCAN_CHARS])
        value = data["body"]["Overall Health"]["value"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return DcgmHealth(
            findings=(
                Finding(
                    code="dcgmi-unrecognized",
                    source=source,
                    severity="info",
                    message="JSON that is not a DCGM health report",
                ),
            )
        )
    status = _status(str(value))
    number = next((n for n, ln in enumerate(text.splitlines(), 1) if "Overall Health" in ln), 1)
    return DcgmHealth(
        state="ok" if status else "unrecognized",
        overall=status,
        line=cite(source, number, f"Overall Health: {value}"),
    )


# -- diag ----------------------------------------------------------------------------------------
def _section(line: str) -> str | None:
    """``|-----  Deployment  ----+---|`` or ``+-----  Hardware  ---+---+`` -> the section's name."""
    if not line.startswith(("|-----", "+-----")):
        return None
    name = line[1:].split("+", 1)[0].strip("-| ")
    return name if name and name[0].isalpha() and len(name) <= 40 else None


def _piece(printed: str) -> str:
    """One 45-character piece of a cut message: the cell without its one leading space and its
    padding (a piece that fills the cell keeps its own trailing space)."""
    body = printed[1:] if printed.startswith(" ") else printed
    return body[: max(len(body) - 2, 0)] if len(body) >= 3 else body.rstrip()


def parse_dcgmi_diag(text: str, source: str = "commands/dcgmi-diag.txt") -> DcgmDiag:
    rows, findings = _rows(text, source)
    ran = False
    version: str | None = None
    error: Line | None = None
    section = ""
    tests: list[dict[str, object]] = []
    message_of: dict[str, object] | None = None  # the test a Warning/Error row belongs to
    pieces: list[str] = []

    def close_message() -> None:
        nonlocal message_of, pieces
        if message_of is not None and pieces:
            joined = "".join(pieces).strip()
            said = str(message_of["message"])
            message_of["message"] = (f"{said} | {joined}" if said else joined)[:2000]
        message_of, pieces = None, []

    for number, raw in rows:
        line = raw.rstrip()
        if line.startswith("Successfully ran diagnostic"):
            ran = True
            continue
        if line.startswith("Error:") and error is None:
            error = cite(source, number, line)
            continue
        if (name := _section(line)) is not None:
            close_message()
            section = name
            continue
        cells = _cells(line)
        if cells is None:
            continue
        key, printed = cells[0].strip(), cells[1]
        value = printed.strip()
        if key in ("Diagnostic", "Result") or (not value and not key):
            continue
        if section == "Metadata":
            if key == "DCGM Version":
                version = value[:40]
            continue
        if key in ("Warning", "Error", "Info"):
            close_message()
            if key != "Info" and tests:
                message_of, pieces = tests[-1], [_piece(printed)]
                message_of.setdefault("message_line", cite(source, number, line))
            continue
        if not key:
            if message_of is not None:
                pieces.append(_piece(printed))
            elif tests:
                _add_result(tests[-1], value)
            continue
        close_message()
        ran = True
        tests.append(
            {
                "section": section,
                "name": key[:80],
                "result": "",
                "failed_gpus": [],
                "message": "",
                "line": cite(source, number, line),
            }
        )
        _add_result(tests[-1], value)
    close_message()
    kept = [t for t in tests if t["result"]]
    if not kept and error is None and text.strip():
        findings.append(
            Finding(
                code="dcgmi-unrecognized",
                source=source,
                severity="info",
                message=f"no diagnostic results: {text.strip().splitlines()[0][:200]}",
            )
        )
    return DcgmDiag(
        ran=ran,
        version=version,
        tests=tuple(DiagTest.model_validate(t) for t in kept),
        error=error,
        findings=tuple(findings),
    )


_ORDER = {"": 0, "Pass": 1, "Skip": 1, "Warn": 2, "Fail": 3}


def _add_result(test: dict[str, object], value: str) -> None:
    """Fold one result cell (``Pass``, ``Fail - GPU: 0``, ``Fail - All``, ``GPU0: Fail``) into
    the test: its result is the worst one seen, and the GPUs that failed are kept."""
    m = _RESULT.match(value)
    g = _GPU_RESULT.match(value)
    if m is None and g is None:
        return
    result = m.group(1) if m else g.group(2)  # type: ignore[union-attr]
    current = str(test["result"])
    if _ORDER[result] > _ORDER[current] or not current:
        test["result"] = result
    if result == "Fail":
        failed = test["failed_gpus"]
        assert isinstance(failed, list)
        if g is not None:
            failed.append(g.group(1))
        elif m is not None and m.group(2):
            who = m.group(2).removeprefix("GPU: ").removeprefix("GPU:").strip()
            failed.extend(w.strip() for w in who.split(",") if w.strip())
