"""Parsers for small outputs: the in-container probes, ``docker info`` and host ``df -h``.

- ``containers/NAME.exec-torch.txt``: the JSON line printed by sources.TORCH_PROBE, e.g.
  ``{"python": "3.10.12", "torch": "2.1.0+cu121", "cuda": "12.1", "is_available": false,
  "device_count": 0, "devices": []}``; or "cudamedic: no python in this container".
- ``containers/NAME.exec-ulimit.txt``: ``ulimit -a`` (bash, dash or busybox wording), e.g.
  ``max locked memory       (kbytes, -l) 64``.
- ``containers/NAME.exec-shm.txt`` and ``commands/df.txt``: ``df -h`` tables, e.g.
  ``shm   64M   0   64M   0% /dev/shm``.
- ``docker-info.json``: runtimes, default runtime, server version.
All pure, never raising: odd input gives empty facts plus a finding.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from runbooks.model import Finding, Frozen, Line


class TorchProbe(Frozen):
    present: bool = False  # python ran and printed the probe's JSON
    python: str | None = None
    torch: str | None = None
    cuda: str | None = None
    is_available: bool | None = None
    device_count: int | None = None
    devices: tuple[dict[str, str], ...] = ()
    arch_list: tuple[str, ...] = ()
    error: str | None = None
    line: Line | None = None
    findings: tuple[Finding, ...] = ()

    @property
    def cpu_only(self) -> bool:
        return self.torch is not None and (self.cuda is None or self.torch.endswith("+cpu"))


def parse_torch_probe(text: str, source: str = "containers/exec-torch.txt") -> TorchProbe:
    for number, raw in enumerate(text.splitlines(), 1):
        raw = raw.strip()
        if not raw.startswith("{"):
            continue
        try:
            data: Any = json.loads(raw)
        except (ValueError, RecursionError):
            continue
        if not isinstance(data, dict):
            continue
        devices = tuple(
            {str(k): str(v) for k, v in d.items()}
            for d in _list(data.get("devices"))
            if isinstance(d, dict)
        )
        count = data.get("device_count")
        return TorchProbe(
            present=True,
            python=_str(data.get("python")),
            torch=_str(data.get("torch")),
            cuda=_str(data.get("cuda")),
            is_available=data.get("is_available")
            if isinstance(data.get("is_available"), bool)
            else None,
            device_count=count if isinstance(count, int) else None,
            devices=devices,
            arch_list=tuple(str(a) for a in _list(data.get("arch_list"))),
            error=_str(data.get("error")),
            line=Line(source=source, line=number, text=raw[:500]),
        )
    code = "probe-no-python" if "no python" in text else "probe-unreadable"
    return TorchProbe(findings=(Finding(code=code, source=source, message=text.strip()[:200]),))


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


_ULIMIT_L = re.compile(
    r"(?i)(max locked memory|locked memory|memlock).*?(-l\)?)?\s+(unlimited|\d{1,30})\s*$"
)
_ULIMIT_S = re.compile(r"(?i)(stack size|stack).*?\s+(unlimited|\d{1,30})\s*$")


class Ulimits(Frozen):
    memlock_kb: int | None = None  # -1 = unlimited
    stack_kb: int | None = None
    memlock_line: Line | None = None
    findings: tuple[Finding, ...] = ()


def parse_ulimit(text: str, source: str = "containers/exec-ulimit.txt") -> Ulimits:
    memlock = stack = None
    memlock_line = None
    for number, raw in enumerate(text.splitlines(), 1):
        m = _ULIMIT_L.search(raw)
        if m and memlock is None:
            memlock = -1 if m.group(3).lower() == "unlimited" else int(m.group(3))
            memlock_line = Line(source=source, line=number, text=raw.strip())
            continue
        s = _ULIMIT_S.search(raw)
        if s and stack is None:
            stack = -1 if s.group(2).lower() == "unlimited" else int(s.group(2))
    findings: tuple[Finding, ...] = ()
    if memlock is None and stack is None and text.strip():
        findings = (
            Finding(
                code="ulimit-unreadable",
                source=source,
                message="no locked-memory or stack limit in this output: " + text.strip()[:100],
            ),
        )
    return Ulimits(memlock_kb=memlock, stack_kb=stack, memlock_line=memlock_line, findings=findings)


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([KMGTP]?)(?:i?B)?$", re.I)
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}


def parse_size(value: str) -> int | None:
    """'64M' / '64.0M' / '1.5G' / '65536' (df -k blocks are not handled here) -> bytes."""
    m = _SIZE.match(value.strip())
    if not m:
        return None
    size = float(m.group(1)) * _UNITS[m.group(2).upper()]
    return int(size) if math.isfinite(size) else None  # 400 digits: not a size


class Filesystem(Frozen):
    source: str
    size: int | None
    used: int | None
    use_percent: int | None
    mount: str
    line: Line


def parse_df(text: str, source: str = "commands/df.txt") -> tuple[Filesystem, ...]:
    out: list[Filesystem] = []
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("Filesystem") or not raw.strip():
            continue
        parts = (pending + " " + raw).split() if pending else raw.split()
        if len(parts) == 1:  # long device names wrap onto the next line
            pending = parts[0]
            continue
        pending = ""
        if len(parts) < 6 or not parts[4].endswith("%"):
            continue
        try:
            pct = int(parts[4].rstrip("%"))
        except ValueError:
            pct = None
        out.append(
            Filesystem(
                source=parts[0],
                size=parse_size(parts[1]),
                used=parse_size(parts[2]),
                use_percent=pct,
                mount=" ".join(parts[5:]),
                line=Line(source=source, line=number, text=raw.strip()),
            )
        )
    return tuple(out)


class DockerInfo(Frozen):
    runtimes: tuple[str, ...] = ()
    default_runtime: str = ""
    server_version: str = ""
    docker_root: str = ""
    findings: tuple[Finding, ...] = ()

    @property
    def has_nvidia_runtime(self) -> bool:
        return "nvidia" in self.runtimes or self.default_runtime == "nvidia"


def parse_docker_info(text: str, source: str = "docker-info.json") -> DockerInfo:
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return DockerInfo(
            findings=(
                Finding(
                    code="docker-info-invalid", source=source, severity="warning", message=str(exc)
                ),
            )
        )
    if not isinstance(data, dict):
        return DockerInfo(
            findings=(
                Finding(
                    code="docker-info-invalid",
                    source=source,
                    severity="warning",
                    message="not an object",
                ),
            )
        )
    runtimes = data.get("Runtimes")
    return DockerInfo(
        runtimes=tuple(sorted(runtimes)) if isinstance(runtimes, dict) else (),
        default_runtime=str(data.get("DefaultRuntime") or ""),
        server_version=str(data.get("ServerVersion") or ""),
        docker_root=str(data.get("DockerRootDir") or ""),
    )


_TB_START = "Traceback (most recent call last):"
_EXC_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)|AssertionError|"
    r"KeyError|StopIteration)(:.*)?$"
)


_ERROR_LINE = re.compile(r"^(?:\[[^\]]*\]\s*:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception)):\s")


def python_exceptions(text: str, source: str) -> tuple[Line, ...]:
    """Error lines of a log: the final exception line of each Python traceback (e.g.
    'KeyError: 3'), and stand-alone 'SomethingError: message' lines."""
    out: list[Line] = []
    in_tb = False
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.endswith(_TB_START):
            in_tb = True
            continue
        body = line.split("] ", 1)[-1] if line.startswith("[") else line
        if (in_tb and _EXC_LINE.match(body)) or _ERROR_LINE.match(line):
            out.append(Line(source=source, line=number, text=line[:500]))
            in_tb = False
    return tuple(out)
