"""Parse what ``nvidia-smi`` printed: the plain table, an ``-L`` listing, or ``-q -x`` XML.

Reads the bundle files ``nvidia-smi.txt`` (plain ``nvidia-smi``, ``nvidia-smi -L``, or the error
text nvidia-smi printed instead of a table) and ``nvidia-smi.xml`` (``nvidia-smi -q -x``).
Returns :class:`SmiFacts` / :class:`SmiXmlFacts`: driver and CUDA versions, one entry per GPU,
the processes, and for the text form a ``status`` naming the failure nvidia-smi reported.
Never raises: anything odd (an ``ERR!`` field, a row it could not read, truncated XML, a DOCTYPE
with entities, binary junk) becomes a :class:`~runbooks.core.model.Finding`.

Real example (8x H100 SXM, ``thamada/nvidia-smi`` ``nvsim/H100SXMx8_smi.py``)::

    | NVIDIA-SMI 565.57.01              Driver Version: 565.57.01      CUDA Version: 12.7     |
    ...
    |   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |
    | N/A   30C    P0            100W /  700W |       1MiB /  81559MiB |      0%      Default |
    |                                         |                        |             Disabled |

parses to ``status="ok"``, ``driver_version="565.57.01"``, ``cuda_version="12.7"`` (the highest
CUDA the driver supports) and ``gpus[0]`` with ``bus_id="0000:18:00.0"``, ``power_draw_w=100.0``,
``memory_total_mib=81559`` and ``mig_mode="Disabled"``.

Bus ids are normalised to the lower-case ``dddd:bb:dd.f`` form (NVML prints
``00000000:3B:00.0``) so they match the ``PCI:0000:3b:00`` ids of kernel Xid lines.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET  # size-capped; DOCTYPE internal subsets/ENTITY refused
from typing import Literal

from runbooks.collect.evidence.text import (
    MAX_SCAN_CHARS,
    binary_input,
    cite,
    looks_binary,
    split_lines,
    too_long,
)
from runbooks.core.model import Finding, Frozen, Line

SmiStatus = Literal[
    "ok", "driver-not-loaded", "library-mismatch", "no-devices", "not-found", "error", "empty"
]

MAX_XML_CHARS = 20_000_000  # an 8-GPU `-q -x` is ~200 kB; anything near this is not nvidia-smi
MAX_XML_ELEMENTS = 200_000  # ~3,000 per 8-GPU node: a 64-GPU node is far under this


# ---------------------------------------------------------------------------------- models


class SmiGpu(Frozen):
    """One GPU from the plain table (or an ``-L`` line). ``None`` means not shown or N/A."""

    index: int | None = None
    name: str = ""
    uuid: str | None = None
    bus_id: str | None = None
    persistence_mode: str | None = None
    display_active: str | None = None
    volatile_uncorrected_ecc: str | None = None
    fan_percent: int | None = None
    temperature_c: int | None = None
    perf_state: str | None = None
    power_draw_w: float | None = None
    power_cap_w: float | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    utilization_percent: int | None = None
    compute_mode: str | None = None
    mig_mode: str | None = None
    mig_uuids: tuple[str, ...] = ()
    err_fields: tuple[str, ...] = ()
    line: Line | None = None


class SmiProcess(Frozen):
    gpu: int | None
    gpu_instance: str | None = None
    compute_instance: str | None = None
    pid: int | None
    type: str | None
    name: str
    used_mib: int | None
    line: Line


class SmiFacts(Frozen):
    source: str
    status: SmiStatus
    status_line: Line | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    nvml_library_version: str | None = None
    gpus: tuple[SmiGpu, ...] = ()
    processes: tuple[SmiProcess, ...] = ()
    no_processes_line: Line | None = None  # "No running processes found"
    findings: tuple[Finding, ...] = ()


class EccCounts(Frozen):
    """ECC counters of one scope (volatile or aggregate). New drivers report SRAM/DRAM,
    pre-Ampere ones report single/double bit totals; whichever is absent stays ``None``."""

    sram_correctable: int | None = None
    sram_uncorrectable: int | None = None
    dram_correctable: int | None = None
    dram_uncorrectable: int | None = None
    single_bit_total: int | None = None
    double_bit_total: int | None = None
    sram_threshold_exceeded: bool | None = None


class RetiredPages(Frozen):
    sbe_count: int | None = None
    dbe_count: int | None = None
    pending_blacklist: bool | None = None
    pending_retirement: bool | None = None


class RemappedRows(Frozen):
    correctable: int | None = None
    uncorrectable: int | None = None
    pending: bool | None = None
    failure: bool | None = None


class XmlProcess(Frozen):
    pid: int | None
    type: str | None
    name: str
    used_mib: int | None
    gpu_instance_id: str | None = None
    compute_instance_id: str | None = None


class XmlGpu(Frozen):
    position: int  # order in the file (nvidia-smi XML carries no index)
    product_name: str | None = None
    bus_id: str | None = None
    uuid: str | None = None
    serial: str | None = None
    mig_mode: str | None = None
    mig_mode_pending: str | None = None
    mig_device_count: int = 0
    ecc_mode: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    utilization_gpu_percent: int | None = None
    utilization_memory_percent: int | None = None
    temperature_c: int | None = None
    slowdown_temp_c: int | None = None
    shutdown_temp_c: int | None = None
    memory_temp_c: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    performance_state: str | None = None
    clock_event_reasons_active: tuple[str, ...] = ()
    sm_clock_mhz: int | None = None  # clocks/sm_clock: the current SM clock
    sm_clock_max_mhz: int | None = None  # max_clocks/sm_clock
    # pci/pci_gpu_link_info: PCIe generation and lanes ("16x" -> 16), now and at most. Both may
    # drop while the GPU idles (generation does, to save power).
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    ecc_volatile: EccCounts | None = None
    ecc_aggregate: EccCounts | None = None
    retired_pages: RetiredPages | None = None
    remapped_rows: RemappedRows | None = None
    reset_required: str | None = None
    recovery_action: str | None = None
    processes: tuple[XmlProcess, ...] = ()


class SmiXmlFacts(Frozen):
    source: str
    timestamp: str | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    attached_gpus: int | None = None
    gpus: tuple[XmlGpu, ...] = ()
    truncated: bool = False
    findings: tuple[Finding, ...] = ()


# --------------------------------------------------------------------------------- helpers

_BUS_ID = re.compile(
    r"(?P<dom>[0-9A-Fa-f]{4,8}):(?P<bus>[0-9A-Fa-f]{2}):(?P<dev>[0-9A-Fa-f]{2})\.(?P<fn>[0-7])"
)


def normalize_bus_id(raw: str | None) -> str | None:
    """``00000000:3B:00.0`` -> ``0000:3b:00.0``; ``None`` if there is no bus id in ``raw``."""
    if not raw:
        return None
    m = _BUS_ID.search(raw)
    if m is None:
        return None
    return f"{int(m['dom'], 16):04x}:{m['bus'].lower()}:{m['dev'].lower()}.{m['fn']}"


_LEADING_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)")
_NOT_A_VALUE = {"", "n/a", "[n/a]", "not supported", "[not supported]", "none", "unknown error"}


def _number(raw: str | None) -> float | None:
    if raw is None or raw.strip().lower() in _NOT_A_VALUE:
        return None
    m = _LEADING_NUMBER.match(raw)
    value = float(m.group(1)) if m else None
    return value if value is not None and math.isfinite(value) else None  # 400 digits: inf


def _integer(raw: str | None) -> int | None:
    value = _number(raw)
    return int(value) if value is not None else None


def _is_err(raw: str | None) -> bool:
    return raw is not None and "ERR" in raw.upper()


def _value(raw: str | None) -> str | None:
    if raw is None:
        return None
    raw = raw.strip()
    return None if raw.lower() in _NOT_A_VALUE else raw


# ------------------------------------------------------------------------------ plain text

_DRIVER = re.compile(r"Driver Version:\s*(?P<v>[\w.-]+)")
_CUDA = re.compile(r"CUDA Version:\s*(?P<v>\d+(?:\.\d+)*|N/A)")
_NVML_LIB = re.compile(r"NVML library version:\s*(?P<v>[\w.-]+)", re.IGNORECASE)
# A lazy name before `\s+X$` rescans the spaces after each character it takes: the `\s++` that
# ends it may start only after a non-space (issue 27: linear on a line of spaces).
_GPU_HEAD = re.compile(
    r"^(?P<index>\d{1,9})\s++(?P<name>.*?)(?:(?<!\s)\s++(?P<pm>On|Off|N/A|ERR!))?$"
)
_LIST_GPU = re.compile(r"^GPU (?P<index>\d{1,9}): (?P<name>.+?) \(UUID: (?P<uuid>GPU-[\w-]+)\)$")
_LIST_MIG = re.compile(r"^MIG .*?Device\s+\d+: \(UUID: (?P<uuid>MIG-[\w/-]+)\)$")
_PROC_NEW = re.compile(
    r"^(?P<gpu>\d{1,9})\s++(?P<gi>N/A|\d++)\s++(?P<ci>N/A|\d++)\s++(?P<pid>\d{1,18})\s++"
    r"(?P<type>C\+G|M\+C|C|G|M)\s++(?P<name>.*?)(?<!\s)\s++(?P<mem>\d++MiB|N/A)$"
)
_PROC_OLD = re.compile(
    r"^(?P<gpu>\d{1,9})\s++(?P<pid>\d{1,18})\s++(?P<type>C\+G|M\+C|C|G|M)\s++(?P<name>.*?)"
    r"(?<!\s)\s++(?P<mem>\d++MiB|N/A)$"
)
_MEMORY = re.compile(r"^(?P<used>\S+)\s*/\s*(?P<total>\S+)$")

# Order is priority: the first kind found anywhere in the file decides `status`.
_STATUS_PATTERNS: tuple[tuple[SmiStatus, re.Pattern[str]], ...] = (
    ("driver-not-loaded", re.compile(r"couldn.t communicate with the NVIDIA driver", re.I)),
    ("library-mismatch", re.compile(r"Driver/library version mismatch", re.I)),
    ("no-devices", re.compile(r"No devices were found", re.I)),
    (
        "not-found",
        re.compile(
            r"nvidia-smi[\"':\s\\]{0,6}(?:command not found|not found|executable file not found"
            r"|No such file or directory)",
            re.I,
        ),
    ),
    (
        "error",
        re.compile(
            r"Failed to initialize NVML|NVIDIA-SMI has failed|Unable to determine the device"
            r"|Unknown Error|GPU access blocked",
            re.I,
        ),
    ),
)


def _cells(line: str) -> list[str] | None:
    s = line.strip()
    if len(s) < 2 or s[0] != "|" or s[-1] != "|":
        return None
    return [c.strip() for c in s[1:-1].split("|")]


class _GpuDraft:
    """Mutable accumulator for the 2-3 table rows that describe one GPU."""

    def __init__(self, index: int, name: str, line: Line) -> None:
        self.fields: dict[str, object] = {"index": index, "name": name, "line": line}
        self.errs: list[str] = []
        self.rows = 1
        self.current_line = line.line
        self.err_line: int | None = None

    def put(self, key: str, raw: str | None, parsed: object) -> None:
        if _is_err(raw):
            self.errs.append(key)
            self.err_line = self.err_line or self.current_line
            return
        self.fields[key] = parsed

    def build(self) -> SmiGpu:
        return SmiGpu.model_validate({**self.fields, "err_fields": tuple(self.errs)})


def _first_row(draft: _GpuDraft, head: re.Match[str], cells: list[str]) -> None:
    draft.put("name", head["name"].strip(), head["name"].strip())
    draft.put("persistence_mode", head["pm"], head["pm"])
    bus_cell = cells[1].split()
    draft.fields["bus_id"] = normalize_bus_id(cells[1])
    if len(bus_cell) > 1:
        draft.put("display_active", bus_cell[-1], bus_cell[-1])
    draft.put("volatile_uncorrected_ecc", cells[2], _value(cells[2]))


def _second_row(draft: _GpuDraft, cells: list[str]) -> None:
    tokens = cells[0].split()
    if len(tokens) >= 3:
        draft.put("fan_percent", tokens[0], _integer(tokens[0]))
        draft.put("temperature_c", tokens[1], _integer(tokens[1]))
        draft.put("perf_state", tokens[2], _value(tokens[2]))
        draw, _, cap = " ".join(tokens[3:]).partition("/")
        draft.put("power_draw_w", draw, _number(draw))
        draft.put("power_cap_w", cap, _number(cap))
    memory = _MEMORY.match(cells[1])
    if memory:
        draft.put("memory_used_mib", memory["used"], _integer(memory["used"]))
        draft.put("memory_total_mib", memory["total"], _integer(memory["total"]))
    elif cells[1]:
        draft.put("memory_used_mib", cells[1], None)
    util, _, mode = cells[2].partition(" ")
    draft.put("utilization_percent", util, _integer(util))
    draft.put("compute_mode", mode.strip() or None, _value(mode))


def _status_of(lines: list[str], source: str) -> tuple[SmiStatus, Line] | None:
    found: dict[SmiStatus, Line] = {}
    for number, line in enumerate(lines, 1):
        scan = line[:MAX_SCAN_CHARS]
        for status, pattern in _STATUS_PATTERNS:
            if status not in found and pattern.search(scan):
                found[status] = cite(source, number, line)
    for status, _ in _STATUS_PATTERNS:
        if status in found:
            return status, found[status]
    return None


def parse_nvidia_smi(text: str, source: str = "nvidia-smi.txt") -> SmiFacts:
    """Parse plain ``nvidia-smi`` (or ``-L``, or its error text) into :class:`SmiFacts`."""
    if not text.strip():
        return SmiFacts(source=source, status="empty")
    return _SmiTextReader(text, source).read()


class _SmiTextReader:
    """One pass over plain nvidia-smi output, line by line: the version header, ``-L`` lines,
    the GPU table (2-3 rows per GPU, built in a :class:`_GpuDraft`) and the process table;
    then the ``status`` from the error text found or from what was read."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.findings: list[Finding] = (
            [binary_input(source, "not nvidia-smi text")] if looks_binary(text) else []
        )
        self.lines = split_lines(text)
        self.gpus: list[SmiGpu] = []
        self.processes: list[SmiProcess] = []
        self.driver: str | None = None
        self.cuda: str | None = None
        self.nvml: str | None = None
        self.header: Line | None = None
        self.no_processes: Line | None = None
        self.section = "gpus"  # "gpus", "processes" or "mig": the table being read
        self.draft: _GpuDraft | None = None

    def read(self) -> SmiFacts:
        for number, line in enumerate(self.lines, 1):
            if len(line) > MAX_SCAN_CHARS:
                self.findings.append(too_long(self.source, number, len(line)))
            else:
                self._line(number, line)
        self._flush()
        status, status_line = self._status()
        return SmiFacts(
            source=self.source,
            status=status,
            status_line=status_line,
            driver_version=self.driver,
            cuda_version=self.cuda,
            nvml_library_version=self.nvml,
            gpus=tuple(self.gpus),
            processes=tuple(self.processes),
            no_processes_line=self.no_processes,
            findings=tuple(self.findings),
        )

    def _line(self, number: int, line: str) -> None:
        self._versions(number, line)
        if "Processes:" in line or "MIG devices:" in line:
            self._flush()
            self.section = "processes" if "Processes:" in line else "mig"
            return
        if self._listing(number, line):
            return
        cells = _cells(line)
        if cells is None:
            return
        if self.section == "processes":
            self._process_row(number, line, cells)
        elif self.section == "gpus" and len(cells) == 3:
            self._gpu_row(number, line, cells)

    def _versions(self, number: int, line: str) -> None:
        """The driver and CUDA versions (first header only) and the NVML library version."""
        if self.driver is None and (m := _DRIVER.search(line)):
            self.driver, self.header = m["v"], cite(self.source, number, line)
            cuda_match = _CUDA.search(line)
            self.cuda = cuda_match["v"] if cuda_match and cuda_match["v"] != "N/A" else None
        if self.nvml is None and (m := _NVML_LIB.search(line)):
            self.nvml = m["v"]

    def _listing(self, number: int, line: str) -> bool:
        """An ``nvidia-smi -L`` line: a GPU, or a MIG device of the GPU listed above it."""
        stripped = line.strip()
        if m := _LIST_GPU.match(stripped):
            self._flush()
            self.gpus.append(
                SmiGpu(
                    index=int(m["index"]),
                    name=m["name"],
                    uuid=m["uuid"],
                    line=cite(self.source, number, line),
                )
            )
            return True
        if (m := _LIST_MIG.match(stripped)) and self.gpus and self.gpus[-1].uuid:
            last = self.gpus[-1]
            self.gpus[-1] = last.model_copy(update={"mig_uuids": (*last.mig_uuids, m["uuid"])})
            return True
        return False

    def _process_row(self, number: int, line: str, cells: list[str]) -> None:
        if len(cells) != 1:
            return
        if "No running processes found" in cells[0]:
            self.no_processes = cite(self.source, number, line)
        proc = _process(cells[0], cite(self.source, number, line))
        if proc is not None:
            self.processes.append(proc)

    def _gpu_row(self, number: int, line: str, cells: list[str]) -> None:
        """A three-cell row of the GPU table: a GPU's first row starts a new draft; the next
        one or two rows (counters, then MIG mode) complete it."""
        head = _GPU_HEAD.match(cells[0])
        draft = self.draft
        if head and normalize_bus_id(cells[1]):
            self._flush()
            self.draft = _GpuDraft(
                int(head["index"]), head["name"].strip(), cite(self.source, number, line)
            )
            _first_row(self.draft, head, cells)
        elif head and cells[1]:
            self.findings.append(
                Finding(
                    code="smi-unparsed-row",
                    message="row starts like a GPU row but has no bus id",
                    source=self.source,
                    line=number,
                )
            )
        elif draft is not None and draft.rows == 1:
            draft.current_line = number
            _second_row(draft, cells)
            draft.rows = 2
        elif draft is not None and draft.rows == 2 and not cells[0] and not cells[1]:
            draft.current_line = number
            draft.put("mig_mode", cells[2], _value(cells[2]))
            draft.rows = 3

    def _flush(self) -> None:
        """Finish the GPU being drafted, with a finding for any ``ERR!`` field it showed."""
        draft, self.draft = self.draft, None
        if draft is None:
            return
        gpu = draft.build()
        self.gpus.append(gpu)
        if gpu.err_fields:
            self.findings.append(
                Finding(
                    code="smi-err-field",
                    message=f"GPU {gpu.index} ({gpu.bus_id}) shows ERR! in: "
                    + ", ".join(gpu.err_fields),
                    source=self.source,
                    line=draft.err_line,
                    severity="warning",
                )
            )

    def _status(self) -> tuple[SmiStatus, Line | None]:
        """The failure nvidia-smi reported; else ``ok`` if anything of a table was read."""
        reported = _status_of(self.lines, self.source)
        if reported is not None:
            return reported
        if self.gpus or self.header or self.processes:
            if not self.gpus and self.header:
                self.findings.append(
                    Finding(
                        code="smi-no-gpu-rows", message="header but no GPU rows", source=self.source
                    )
                )
            return "ok", self.header or (self.gpus[0].line if self.gpus else self.processes[0].line)
        self.findings.append(
            Finding(
                code="smi-unrecognized",
                message="neither an nvidia-smi table nor a known nvidia-smi error",
                source=self.source,
                severity="warning",
            )
        )
        return "error", None


def _process(cell: str, line: Line) -> SmiProcess | None:
    m = _PROC_NEW.match(cell)
    gi = ci = None
    if m:
        gi, ci = _value(m["gi"]), _value(m["ci"])
    else:
        m = _PROC_OLD.match(cell)
    if m is None:
        return None
    return SmiProcess(
        gpu=int(m["gpu"]),
        gpu_instance=gi,
        compute_instance=ci,
        pid=int(m["pid"]),
        type=m["type"],
        name=m["name"],
        used_mib=_integer(m["mem"]),
        line=line,
    )


# ------------------------------------------------------------------------------------- XML


_DOCTYPE = re.compile(r"<!DOCTYPE[^>\[<]*+>", re.IGNORECASE)  # stops at the next `<`: linear


def _prepare_xml(text: str, source: str) -> tuple[str | None, Finding | None]:
    """Return text safe to hand to expat, or a finding saying why it was refused.

    nvidia-smi itself writes ``<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">``; that
    plain external reference is blanked (expat never fetches it). An internal subset or any
    ``<!ENTITY`` is refused outright: entity expansion is the classic XML bomb.
    """
    upper = text.upper()
    head = upper[:8192]
    start = head.find("<!DOCTYPE")
    declaration = head[start : head.find(">", start) if ">" in head[start:] else None]
    if "<!ENTITY" in upper or (start >= 0 and "[" in declaration):
        return None, Finding(
            code="xml-doctype-rejected",
            message="DOCTYPE with an internal subset or ENTITY declarations; not parsed",
            source=source,
            severity="error",
        )
    if upper.count("<!DOCTYPE") > 1:
        return None, Finding(
            code="xml-doctype-rejected",
            message="more than one DOCTYPE; not parsed",
            source=source,
            severity="error",
        )
    # Keep newlines so parser line numbers still match the file.
    return _DOCTYPE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, count=1), None


def _txt(element: ET.Element | None, path: str) -> str | None:
    if element is None:
        return None
    found = element.find(path)
    if found is None or found.text is None:
        return None
    return found.text.strip() or None


def _yes_no(raw: str | None) -> bool | None:
    if raw is None:
        return None
    lowered = raw.strip().lower()
    return True if lowered == "yes" else False if lowered == "no" else None


def _ecc_scope(scope: ET.Element | None) -> EccCounts | None:
    if scope is None:
        return None
    parity = _integer(_txt(scope, "sram_uncorrectable_parity"))
    secded = _integer(_txt(scope, "sram_uncorrectable_secded"))
    sram_unc = _integer(_txt(scope, "sram_uncorrectable"))
    if sram_unc is None and (parity is not None or secded is not None):
        sram_unc = (parity or 0) + (secded or 0)
    counts = EccCounts(
        sram_correctable=_integer(_txt(scope, "sram_correctable")),
        sram_uncorrectable=sram_unc,
        dram_correctable=_integer(_txt(scope, "dram_correctable")),
        dram_uncorrectable=_integer(_txt(scope, "dram_uncorrectable")),
        single_bit_total=_integer(_txt(scope, "single_bit/total")),
        double_bit_total=_integer(_txt(scope, "double_bit/total")),
        sram_threshold_exceeded=_yes_no(_txt(scope, "sram_threshold_exceeded")),
    )
    return None if counts == EccCounts() else counts


def _retired(gpu: ET.Element) -> RetiredPages | None:
    pages = gpu.find("retired_pages")
    if pages is None:
        return None
    result = RetiredPages(
        sbe_count=_integer(_txt(pages, "multiple_single_bit_retirement/retired_count")),
        dbe_count=_integer(_txt(pages, "double_bit_retirement/retired_count")),
        pending_blacklist=_yes_no(_txt(pages, "pending_blacklist")),
        pending_retirement=_yes_no(_txt(pages, "pending_retirement")),
    )
    return None if result == RetiredPages() else result


def _remapped(gpu: ET.Element) -> RemappedRows | None:
    rows = gpu.find("remapped_rows")
    if rows is None:
        return None
    result = RemappedRows(
        correctable=_integer(_txt(rows, "remapped_row_corr")),
        uncorrectable=_integer(_txt(rows, "remapped_row_unc")),
        pending=_yes_no(_txt(rows, "remapped_row_pending")),
        failure=_yes_no(_txt(rows, "remapped_row_failure")),
    )
    return None if result == RemappedRows() else result


def _clock_events(gpu: ET.Element) -> tuple[str, ...]:
    active: list[str] = []
    for group in ("clocks_event_reasons", "clocks_throttle_reasons"):
        reasons = gpu.find(group)
        if reasons is None:
            continue
        for reason in reasons:
            if (reason.text or "").strip() == "Active":
                active.append(
                    reason.tag.removeprefix("clocks_event_reason_").removeprefix(
                        "clocks_throttle_reason_"
                    )
                )
    return tuple(active)


def _xml_processes(gpu: ET.Element) -> tuple[XmlProcess, ...]:
    result: list[XmlProcess] = []
    for info in gpu.findall("processes/process_info"):
        result.append(
            XmlProcess(
                pid=_integer(_txt(info, "pid")),
                type=_value(_txt(info, "type")),
                name=_txt(info, "process_name") or "",
                used_mib=_integer(_txt(info, "used_memory")),
                gpu_instance_id=_value(_txt(info, "gpu_instance_id")),
                compute_instance_id=_value(_txt(info, "compute_instance_id")),
            )
        )
    return tuple(result)


def _first(*values: str | None) -> str | None:
    return next((v for v in values if _value(v) is not None), None)


_LINK = "pci/pci_gpu_link_info"


def _xml_gpu(position: int, gpu: ET.Element) -> XmlGpu:
    power = gpu.find("gpu_power_readings")
    if power is None:
        power = gpu.find("power_readings")
    ecc = gpu.find("ecc_errors")
    return XmlGpu(
        position=position,
        product_name=_txt(gpu, "product_name"),
        bus_id=normalize_bus_id(gpu.get("id") or _txt(gpu, "pci/pci_bus_id")),
        uuid=_value(_txt(gpu, "uuid")),
        serial=_value(_txt(gpu, "serial")),
        mig_mode=_value(_txt(gpu, "mig_mode/current_mig")),
        mig_mode_pending=_value(_txt(gpu, "mig_mode/pending_mig")),
        mig_device_count=len(gpu.findall("mig_devices/mig_device")),
        ecc_mode=_value(_txt(gpu, "ecc_mode/current_ecc")),
        memory_total_mib=_integer(_txt(gpu, "fb_memory_usage/total")),
        memory_used_mib=_integer(_txt(gpu, "fb_memory_usage/used")),
        utilization_gpu_percent=_integer(_txt(gpu, "utilization/gpu_util")),
        utilization_memory_percent=_integer(_txt(gpu, "utilization/memory_util")),
        temperature_c=_integer(_txt(gpu, "temperature/gpu_temp")),
        slowdown_temp_c=_integer(_txt(gpu, "temperature/gpu_temp_slow_threshold")),
        shutdown_temp_c=_integer(_txt(gpu, "temperature/gpu_temp_max_threshold")),
        memory_temp_c=_integer(_txt(gpu, "temperature/memory_temp")),
        power_draw_w=_number(
            _first(
                _txt(power, "power_draw"),
                _txt(power, "instant_power_draw"),
                _txt(power, "average_power_draw"),
            )
        ),
        power_limit_w=_number(
            _first(
                _txt(power, "current_power_limit"),
                _txt(power, "enforced_power_limit"),
                _txt(power, "power_limit"),
            )
        ),
        performance_state=_value(_txt(gpu, "performance_state")),
        clock_event_reasons_active=_clock_events(gpu),
        sm_clock_mhz=_integer(_txt(gpu, "clocks/sm_clock")),
        sm_clock_max_mhz=_integer(_txt(gpu, "max_clocks/sm_clock")),
        pcie_gen=_integer(_txt(gpu, f"{_LINK}/pcie_gen/current_link_gen")),
        pcie_gen_max=_integer(_txt(gpu, f"{_LINK}/pcie_gen/max_link_gen")),
        pcie_width=_integer(_txt(gpu, f"{_LINK}/link_widths/current_link_width")),
        pcie_width_max=_integer(_txt(gpu, f"{_LINK}/link_widths/max_link_width")),
        ecc_volatile=_ecc_scope(ecc.find("volatile") if ecc is not None else None),
        ecc_aggregate=_ecc_scope(ecc.find("aggregate") if ecc is not None else None),
        retired_pages=_retired(gpu),
        remapped_rows=_remapped(gpu),
        reset_required=_value(_txt(gpu, "gpu_reset_status/reset_required")),
        recovery_action=_value(_txt(gpu, "gpu_recovery_action")),
        processes=_xml_processes(gpu),
    )


def parse_nvidia_smi_xml(text: str, source: str = "nvidia-smi.xml") -> SmiXmlFacts:
    """Parse ``nvidia-smi -q -x`` into :class:`SmiXmlFacts`; a cut-off file keeps what it had."""
    refusal = _size_refusal(text, source)
    if refusal is not None:
        return SmiXmlFacts(source=source, findings=(refusal,))
    prepared, refusal = _prepare_xml(text, source)
    if prepared is None:
        return SmiXmlFacts(source=source, findings=(refusal,) if refusal else ())
    root, truncated, findings = _build_tree(prepared, source)
    if root is None:
        return SmiXmlFacts(source=source, truncated=truncated, findings=tuple(findings))
    gpu_elements = [root] if root.tag == "gpu" else root.findall(".//gpu")
    gpus = tuple(_xml_gpu(i, g) for i, g in enumerate(gpu_elements))
    attached = _integer(_txt(root, "attached_gpus"))
    findings += _log_findings(root.tag, len(gpus), attached, source)
    return SmiXmlFacts(
        source=source,
        timestamp=_txt(root, "timestamp"),
        driver_version=_value(_txt(root, "driver_version")),
        cuda_version=_value(_txt(root, "cuda_version")),
        attached_gpus=attached,
        gpus=gpus,
        truncated=truncated,
        findings=tuple(findings),
    )


def _size_refusal(text: str, source: str) -> Finding | None:
    """Why ``text`` is not parsed at all: empty, or too large to be nvidia-smi XML."""
    if not text.strip():
        return Finding(code="xml-empty", message="empty file", source=source)
    if len(text) > MAX_XML_CHARS:
        return Finding(
            code="xml-too-large",
            message=f"{len(text)} characters; larger than any nvidia-smi XML",
            source=source,
            severity="error",
        )
    elements = text.count("<")
    if elements > MAX_XML_ELEMENTS:
        # An 8-GPU `-q -x` has ~3,000 elements; 500,000 empty <gpu/> cost gigabytes to build.
        return Finding(
            code="xml-too-many-elements",
            message=f"{elements} elements; more than any nvidia-smi XML (not parsed)",
            source=source,
            severity="error",
        )
    return None


def _build_tree(prepared: str, source: str) -> tuple[ET.Element | None, bool, list[Finding]]:
    """The element tree (as far as it is well-formed), whether the file was cut off, and a
    finding where the parser stopped early."""
    # The pull parser builds the tree in C and keeps what it built when it stops on an error,
    # so a truncated file still yields its complete leading GPUs (a Python builder took 2x).
    parser: ET.XMLPullParser[ET.Element] = ET.XMLPullParser(events=("start",))  # input vetted
    root: ET.Element | None = None
    try:
        parser.feed(prepared)
        root = _first_element(parser)
        parser.close()
    except ET.ParseError as exc:
        root = root if root is not None else _first_element(parser)
        row = exc.position[0] if exc.position else None
        last_line = prepared.count("\n") + 1
        message = str(exc)
        at_end = row is not None and row >= last_line - 1
        truncated = at_end and message.startswith(("no element found", "unclosed token"))
        finding = Finding(
            code="xml-truncated" if truncated else "xml-malformed",
            message=f"XML stops being well-formed: {message}; kept what came before",
            source=source,
            line=row,
            severity="warning",
        )
        return root, truncated, [finding]
    return root, False, []


def _first_element(parser: ET.XMLPullParser[ET.Element]) -> ET.Element | None:
    for event in parser.read_events():
        element: object = event[-1]  # ("start", element)
        return element if isinstance(element, ET.Element) else None
    return None


def _log_findings(
    root_tag: str, gpu_count: int, attached: int | None, source: str
) -> list[Finding]:
    """What is odd about a parsed log: another root element, no GPUs at all, or fewer or more
    ``<gpu>`` elements than ``attached_gpus`` says."""
    findings: list[Finding] = []
    if root_tag != "nvidia_smi_log":
        findings.append(
            Finding(
                code="xml-unexpected-root",
                message=f"root element is <{root_tag[:60]}>, not <nvidia_smi_log>",
                source=source,
                severity="warning",
            )
        )
    if not gpu_count and attached is None:
        findings.append(
            Finding(
                code="xml-no-gpus",
                message="no <gpu> elements and no attached_gpus: not an nvidia-smi -q -x log",
                source=source,
                severity="warning",
            )
        )
    if attached is not None and attached != gpu_count:
        findings.append(
            Finding(
                code="xml-gpu-count-mismatch",
                message=f"attached_gpus says {attached}, file describes {gpu_count}",
                source=source,
            )
        )
    return findings
