"""Parse a kernel log for GPU trouble: Xid events, other NVRM lines, OOM kills.

Reads the bundle file ``dmesg.txt``: ``dmesg`` (raw ``[12345.678901]`` uptime stamps),
``dmesg -T`` (``[Fri Aug 30 11:43:09 2024]``), ``dmesg -x`` (``kern  :info  : ...``),
``journalctl -k`` / syslog (``Dec  2 11:38:47 host kernel: ...``, also ``-o short-iso``), or
bare ``kernel: NVRM: ...`` lines. Returns :class:`KernelLogFacts`: every ``NVRM: Xid`` as an
:class:`XidEvent` (code, PCI address, MIG GPU/compute instance, pid, process name), the other
NVRM lines flagged for ``API mismatch`` and ``RmInitAdapter``/``failed``, OOM-killer kills,
"fallen off the bus" lines, and whether ``dmesg`` itself was refused. Never raises; CRLF, very
long lines and binary junk are tolerated and reported as findings.

Real example (``dmesg -T`` on an 8x H100 host, akash-network/support#244)::

    [Mon Aug  5 03:54:13 2024] NVRM: Xid (PCI:0000:00:07): 31, pid=2512125, name=python3.10, ...

parses to ``XidEvent(code=31, pci="0000:00:07", pid=2512125, process_name="python3.10",
timestamp=datetime(2024, 8, 5, 3, 54, 13), ...)``. A MIG line such as
``NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: ...`` also sets
``gpu_instance=5``.
"""

from __future__ import annotations

import re
from datetime import datetime

from runbooks.collect.evidence.text import (
    MAX_SCAN_CHARS,
    binary_input,
    cite,
    looks_binary,
    split_lines,
    too_long,
)
from runbooks.core.model import Finding, Frozen, Line


class XidEvent(Frozen):
    code: int
    pci: str | None  # "0000:3b:00", normalised like nvidia-smi bus ids, without function
    gpu_instance: int | None = None
    compute_instance: int | None = None
    pid: int | None = None
    process_name: str | None = None
    message: str  # what follows the code, minus pid=/name=
    timestamp: datetime | None = None  # only when the line carries a full date
    time_text: str | None = None  # the stamp as written, e.g. "Dec  2 11:38:47" (no year)
    uptime_s: float | None = None
    line: Line


class NvrmLine(Frozen):
    line: Line
    api_mismatch: bool = False
    init_failed: bool = False  # RmInitAdapter / rm_init_adapter failed
    failed: bool = False  # any "failed"/"failure", including init_failed
    client_version: str | None = None  # API mismatch: the user-space side
    kernel_version: str | None = None  # API mismatch: the loaded module
    timestamp: datetime | None = None
    time_text: str | None = None
    uptime_s: float | None = None


class OomKill(Frozen):
    pid: int | None
    process_name: str | None
    constraint: str | None = None
    task_memcg: str | None = None
    timestamp: datetime | None = None
    time_text: str | None = None
    uptime_s: float | None = None
    line: Line


class KernelLogFacts(Frozen):
    source: str
    line_count: int = 0
    xids: tuple[XidEvent, ...] = ()
    nvrm: tuple[NvrmLine, ...] = ()
    oom_kills: tuple[OomKill, ...] = ()
    fell_off_bus: tuple[Line, ...] = ()
    not_permitted: bool = False
    findings: tuple[Finding, ...] = ()


_FACILITY = re.compile(r"^(?:kern|user|daemon|syslog|mail|auth)\s*:\s*\w+\s*:\s*")
_ISO = re.compile(
    r"^(?P<iso>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)"
    r"\s+\S+\s+kernel:\s?"
)
_SYSLOG = re.compile(r"^(?P<when>[A-Z][a-z]{2}\s+\d{1,2}\s+\d{2}:\d{2}:\d{2})\s+\S+\s+kernel:\s?")
_KERNEL = re.compile(r"^kernel:\s?")
_CTIME = re.compile(
    r"^\[(?P<when>[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]?\d \d{2}:\d{2}:\d{2} \d{4})\]\s?"
)
_UPTIME = re.compile(r"^\[\s*(?P<up>\d+\.\d+)\]\s?")

_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{1,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})"
    r"(?:\.[0-7])?(?P<attrs>[^)]{0,80})\):\s*(?P<code>\d{1,9})(?!\d)\s*,?\s*(?P<rest>.*)$"
)
_GPU_I = re.compile(r"GPU-I:\s*(\d{1,9})(?!\d)")
_GPU_CI = re.compile(r"GPU-CI:\s*(\d{1,9})(?!\d)")
_PID = re.compile(r"^pid=(?:'(?P<quoted>[^']*)'|(?P<bare>[^,\s]*)),?\s*")
_NAME = re.compile(r"^name=(?P<name>[^,]*),?\s*")
_INIT_FAILED = re.compile(r"RmInitAdapter failed|rm_init_adapter failed", re.IGNORECASE)
_FAILED = re.compile(r"fail", re.IGNORECASE)
_CLIENT = re.compile(
    r"the client(?: '(?P<client>[^']*)' \(pid \d+\))?\s+has the version (?P<v>\d+(?:\.\d+)*)"
)
_MODULE = re.compile(r"this kernel module has\s+the version (?P<v>\d+(?:\.\d+)*)")
_OOM_KILLED = re.compile(
    r"(?:Out of memory|Memory cgroup out of memory): Kill(?:ed)? process (?P<pid>\d{1,18}) "
    r"\((?P<name>[^)]*)\)"
)
_OOM_KILL = re.compile(r"oom-kill:(?P<fields>\S+)")
_NOT_PERMITTED = re.compile(
    r"dmesg: read kernel buffer failed: (?:Operation not permitted|Permission denied)"
)


class _Stamp:
    __slots__ = ("time_text", "timestamp", "uptime_s")

    def __init__(self) -> None:
        self.timestamp: datetime | None = None
        self.time_text: str | None = None
        self.uptime_s: float | None = None

    def as_fields(self) -> dict[str, object]:
        return {"timestamp": self.timestamp, "time_text": self.time_text, "uptime_s": self.uptime_s}


def _parse_iso(raw: str) -> datetime | None:
    candidate = raw.replace(",", ".").replace(" ", "T", 1)
    candidate = re.sub(r"([+-]\d{2})(\d{2})$", r"\1:\2", candidate)
    try:
        return datetime.fromisoformat(candidate.replace("Z", "+00:00"))
    except ValueError:
        return None


def _strip_prefix(line: str) -> tuple[_Stamp, str]:
    """Peel facility, syslog/journal, ctime and uptime prefixes off one line."""
    stamp = _Stamp()
    body = line.strip()
    if m := _FACILITY.match(body):
        body = body[m.end() :]
    if m := _ISO.match(body):
        stamp.time_text, stamp.timestamp = m["iso"], _parse_iso(m["iso"])
        body = body[m.end() :]
    elif m := _SYSLOG.match(body):
        stamp.time_text = m["when"]
        body = body[m.end() :]
    elif m := _KERNEL.match(body):
        body = body[m.end() :]
    if m := _CTIME.match(body):
        stamp.time_text = m["when"]
        try:
            stamp.timestamp = datetime.strptime(" ".join(m["when"].split()), "%a %b %d %H:%M:%S %Y")
        except ValueError:
            stamp.timestamp = None
        body = body[m.end() :]
    if m := _UPTIME.match(body):
        stamp.uptime_s = float(m["up"])
        body = body[m.end() :]
    return stamp, body


def _xid(body: str, stamp: _Stamp, line: Line) -> XidEvent | None:
    m = _XID.search(body)
    if m is None:
        return None
    domain, bus, device = m["pci"].split(":")
    rest = m["rest"]
    pid: int | None = None
    name: str | None = None
    if pm := _PID.match(rest):
        raw = pm["quoted"] if pm["quoted"] is not None else pm["bare"]
        pid = int(raw) if raw.isdecimal() and len(raw) <= 18 else None
        rest = rest[pm.end() :]
        if nm := _NAME.match(rest):
            name = nm["name"].strip() or None
            name = None if name == "<unknown>" else name
            rest = rest[nm.end() :]
    gi, ci = _GPU_I.search(m["attrs"]), _GPU_CI.search(m["attrs"])
    return XidEvent(
        code=int(m["code"]),
        pci=f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}",
        gpu_instance=int(gi.group(1)) if gi else None,
        compute_instance=int(ci.group(1)) if ci else None,
        pid=pid,
        process_name=name,
        message=rest.strip(),
        line=line,
        timestamp=stamp.timestamp,
        time_text=stamp.time_text,
        uptime_s=stamp.uptime_s,
    )


def _oom_fields(raw: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in raw.split(","):
        key, sep, value = part.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def parse_kernel_log(text: str, source: str = "dmesg.txt") -> KernelLogFacts:
    """Parse ``dmesg``/``dmesg -T``/``journalctl -k`` text into :class:`KernelLogFacts`."""
    if not text.strip():
        return KernelLogFacts(
            source=source,
            findings=(Finding(code="kernel-log-empty", message="empty kernel log", source=source),),
        )
    return _KernelLogReader(text, source).read()


def _stamped(lines: list[str]) -> list[tuple[_Stamp, str] | None]:
    """Each line's time stamp and body (None for a line too long to scan); an indented
    continuation line takes the stamp of the message above."""
    out: list[tuple[_Stamp, str] | None] = []
    previous = _Stamp()
    for line in lines:
        if len(line) > MAX_SCAN_CHARS:
            out.append(None)
            continue
        stamp, body = _strip_prefix(line)
        if line[:1].isspace() and stamp.time_text is None and stamp.uptime_s is None:
            stamp = previous
        previous = stamp
        out.append((stamp, body))
    return out


class _KernelLogReader:
    """One pass over a kernel log, line by line, collecting Xids, NVRM lines and OOM kills."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.findings: list[Finding] = [binary_input(source)] if looks_binary(text) else []
        self.lines = split_lines(text)
        self.stripped = _stamped(self.lines)
        self.xids: list[XidEvent] = []
        self.nvrm: list[NvrmLine] = []
        self.ooms: list[OomKill] = []
        self.pending_oom: dict[str, dict[str, str]] = {}  # "oom-kill:" lines by pid
        self.fell_off: list[Line] = []
        self.not_permitted = False
        self.consumed: set[int] = set()  # continuation lines joined into an earlier one

    def read(self) -> KernelLogFacts:
        for index, line in enumerate(self.lines):
            parsed = self.stripped[index]
            if parsed is None:
                self.findings.append(too_long(self.source, index + 1, len(line)))
            elif index not in self.consumed:
                self._line(index, *parsed)
        self._unpaired_ooms()
        return KernelLogFacts(
            source=self.source,
            line_count=len(self.lines),
            xids=tuple(self.xids),
            nvrm=tuple(self.nvrm),
            oom_kills=tuple(sorted(self.ooms, key=lambda kill: kill.line.line)),
            fell_off_bus=tuple(self.fell_off),
            not_permitted=self.not_permitted,
            findings=tuple(self.findings),
        )

    def _line(self, index: int, stamp: _Stamp, body: str) -> None:
        number = index + 1
        cited = cite(self.source, number, self.lines[index])
        if "fallen off the bus" in body.lower():
            self.fell_off.append(cited)
        if _NOT_PERMITTED.search(body):
            self.not_permitted = True
            self.findings.append(
                Finding(
                    code="dmesg-not-permitted",
                    message="dmesg was refused (kernel.dmesg_restrict / no CAP_SYSLOG); "
                    "the kernel log is missing, not clean",
                    source=self.source,
                    line=number,
                    severity="error",
                )
            )
        elif oom := _OOM_KILL.search(body):
            fields = _oom_fields(oom["fields"])
            if "pid" in fields:
                self.pending_oom[fields["pid"]] = fields | {"__line": str(index)}
        elif oom := _OOM_KILLED.search(body):
            fields = self.pending_oom.pop(oom["pid"], {})
            self.ooms.append(_oom_kill(int(oom["pid"]), oom["name"], fields, cited, stamp))
        elif "NVRM:" in body:
            self._nvrm(index, stamp, body, cited)

    def _nvrm(self, index: int, stamp: _Stamp, body: str, cited: Line) -> None:
        if "Xid" in body:
            event = _xid(body, stamp, cited)
            if event is not None:
                self.xids.append(event)
                return
            self.findings.append(
                Finding(
                    code="xid-unparsed",
                    message="NVRM line mentions Xid but is not in the Xid format",
                    source=self.source,
                    line=index + 1,
                )
            )
        entry: dict[str, object] = {"line": cited, **stamp.as_fields()}
        if "API mismatch" in body:
            entry |= self._api_mismatch(index, body)
        init_failed = bool(_INIT_FAILED.search(body))
        entry |= {"init_failed": init_failed, "failed": init_failed or bool(_FAILED.search(body))}
        self.nvrm.append(NvrmLine.model_validate(entry))

    def _api_mismatch(self, index: int, body: str) -> dict[str, object]:
        """The client and kernel module versions of an API-mismatch message, which the kernel
        may split over up to five NVRM lines (joined here and skipped later)."""
        joined = body
        for follow in range(index + 1, min(index + 5, len(self.lines))):
            nxt = self.stripped[follow]
            if nxt is None or "NVRM:" not in nxt[1] or "API mismatch" in nxt[1]:
                break
            if "Xid" in nxt[1]:
                break
            joined += " " + nxt[1]
            self.consumed.add(follow)
        joined = re.sub(r"(?<!\s)\s*+(?:#012)?NVRM:\s*+", " ", joined.replace("#012", " "))
        client, module = _CLIENT.search(joined), _MODULE.search(joined)
        return {
            "api_mismatch": True,
            "client_version": client["v"] if client else None,
            "kernel_version": module["v"] if module else None,
        }

    def _unpaired_ooms(self) -> None:
        """An "oom-kill:" line seen without its "Killed process" line is a kill too."""
        for fields in self.pending_oom.values():
            index = int(fields["__line"])
            stamp, _ = self.stripped[index] or (_Stamp(), "")
            pid = fields.get("pid", "")
            number = int(pid) if pid.isdecimal() and len(pid) <= 18 else None
            cited = cite(self.source, index + 1, self.lines[index])
            self.ooms.append(_oom_kill(number, fields.get("task"), fields, cited, stamp))


def _oom_kill(
    pid: int | None, name: str | None, fields: dict[str, str], line: Line, stamp: _Stamp
) -> OomKill:
    return OomKill(
        pid=pid,
        process_name=name,
        constraint=fields.get("constraint"),
        task_memcg=fields.get("task_memcg"),
        line=line,
        timestamp=stamp.timestamp,
        time_text=stamp.time_text,
        uptime_s=stamp.uptime_s,
    )
