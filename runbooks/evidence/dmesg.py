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

from runbooks.evidence.text import (
    MAX_SCAN_CHARS,
    binary_input,
    cite,
    looks_binary,
    split_lines,
    too_long,
)
from runbooks.model import Finding, Frozen, Line


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
    findings: list[Finding] = []
    if looks_binary(text):
        findings.append(binary_input(source))
    lines = split_lines(text)
    stripped: list[tuple[_Stamp, str] | None] = []
    previous = _Stamp()
    for line in lines:
        if len(line) > MAX_SCAN_CHARS:
            stripped.append(None)
            continue
        stamp, body = _strip_prefix(line)
        if line[:1].isspace() and stamp.time_text is None and stamp.uptime_s is None:
            stamp = previous  # an indented continuation line belongs to the message above
        previous = stamp
        stripped.append((stamp, body))
    xids: list[XidEvent] = []
    nvrm: list[NvrmLine] = []
    ooms: list[OomKill] = []
    pending_oom: dict[str, dict[str, str]] = {}
    fell_off: list[Line] = []
    not_permitted = False
    consumed: set[int] = set()

    for index, line in enumerate(lines):
        number = index + 1
        parsed = stripped[index]
        if parsed is None:
            findings.append(too_long(source, number, len(line)))
            continue
        if index in consumed:
            continue
        stamp, body = parsed
        cited = cite(source, number, line)
        if "fallen off the bus" in body.lower():
            fell_off.append(cited)
        if _NOT_PERMITTED.search(body):
            not_permitted = True
            findings.append(
                Finding(
                    code="dmesg-not-permitted",
                    message="dmesg was refused (kernel.dmesg_restrict / no CAP_SYSLOG); "
                    "the kernel log is missing, not clean",
                    source=source,
                    line=number,
                    severity="error",
                )
            )
            continue
        if oom := _OOM_KILL.search(body):
            fields = _oom_fields(oom["fields"])
            if "pid" in fields:
                pending_oom[fields["pid"]] = fields | {"__line": str(index)}
            continue
        if oom := _OOM_KILLED.search(body):
            fields = pending_oom.pop(oom["pid"], {})
            ooms.append(
                OomKill(
                    pid=int(oom["pid"]),
                    process_name=oom["name"],
                    constraint=fields.get("constraint"),
                    task_memcg=fields.get("task_memcg"),
                    line=cited,
                    timestamp=stamp.timestamp,
                    time_text=stamp.time_text,
                    uptime_s=stamp.uptime_s,
                )
            )
            continue
        if "NVRM:" not in body:
            continue
        if "Xid" in body:
            event = _xid(body, stamp, cited)
            if event is not None:
                xids.append(event)
                continue
            findings.append(
                Finding(
                    code="xid-unparsed",
                    message="NVRM line mentions Xid but is not in the Xid format",
                    source=source,
                    line=number,
                )
            )
        entry: dict[str, object] = {"line": cited, **stamp.as_fields()}
        if "API mismatch" in body:
            joined = body
            for follow in range(index + 1, min(index + 5, len(lines))):
                nxt = stripped[follow]
                if nxt is None or "NVRM:" not in nxt[1] or "API mismatch" in nxt[1]:
                    break
                if "Xid" in nxt[1]:
                    break
                joined += " " + nxt[1]
                consumed.add(follow)
            joined = re.sub(r"\s*(?:#012)?NVRM:\s*", " ", joined.replace("#012", " "))
            client, module = _CLIENT.search(joined), _MODULE.search(joined)
            entry |= {
                "api_mismatch": True,
                "client_version": client["v"] if client else None,
                "kernel_version": module["v"] if module else None,
            }
        init_failed = bool(_INIT_FAILED.search(body))
        entry |= {"init_failed": init_failed, "failed": init_failed or bool(_FAILED.search(body))}
        nvrm.append(NvrmLine.model_validate(entry))

    for fields in pending_oom.values():  # "oom-kill:" seen without its "Killed process" line
        index = int(fields["__line"])
        stamp, _ = stripped[index] or (_Stamp(), "")
        pid = fields.get("pid", "")
        ooms.append(
            OomKill(
                pid=int(pid) if pid.isdecimal() and len(pid) <= 18 else None,
                process_name=fields.get("task"),
                constraint=fields.get("constraint"),
                task_memcg=fields.get("task_memcg"),
                line=cite(source, index + 1, lines[index]),
                timestamp=stamp.timestamp,
                time_text=stamp.time_text,
                uptime_s=stamp.uptime_s,
            )
        )
    ooms.sort(key=lambda kill: kill.line.line)

    return KernelLogFacts(
        source=source,
        line_count=len(lines),
        xids=tuple(xids),
        nvrm=tuple(nvrm),
        oom_kills=tuple(ooms),
        fell_off_bus=tuple(fell_off),
        not_permitted=not_permitted,
        findings=tuple(findings),
    )
