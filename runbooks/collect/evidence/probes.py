"""Parsers for small outputs: the in-container probes, ``docker info`` and host ``df -h``.

- ``containers/NAME.exec-torch.txt``: the JSON line printed by sources.TORCH_PROBE, e.g.
  ``{"python": "3.10.12", "torch": "2.1.0+cu121", "cuda": "12.1", "is_available": false,
  "device_count": 0, "devices": []}``; or "cudamedic: no python in this container".
- ``containers/NAME.exec-ulimit.txt``: ``ulimit -a`` (bash, dash or busybox wording), e.g.
  ``max locked memory       (kbytes, -l) 64``.
- ``containers/NAME.exec-shm.txt`` and ``commands/df.txt``: ``df -h`` tables, e.g.
  ``shm   64M   0   64M   0% /dev/shm``.
- ``containers/NAME.exec-cuda-cache.txt``: ``du -sk`` of the CUDA JIT cache, e.g.
  ``5120	/root/.nv/ComputeCache``, or du's "No such file or directory" (no cache yet).
- ``docker-info.json``: runtimes, default runtime, server version.
All pure, never raising: odd input gives empty facts plus a finding.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from runbooks.core.model import Finding, Frozen, Line


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


# `ulimit -a`: "max locked memory       (kbytes, -l) 65536": the name, then the value last on
# the line. Found with str methods, not `name.*?\s+(value)\s*$`: that is quadratic on a
# repeated name and on runs of spaces (issue 27).
_ULIMIT_L = re.compile(r"(?i)max locked memory|locked memory|memlock")
_ULIMIT_S = re.compile(r"(?i)stack size|stack")


def _value_after(name: re.Pattern[str], raw: str) -> int | None:
    """The value (-1: unlimited) that ends a line holding `name`, after a space, or None."""
    m = name.search(raw)
    rest = raw[m.end() :].rstrip() if m else ""
    last = rest.split()[-1] if rest.split() else ""
    if not last or not rest[: len(rest) - len(last)][-1:].isspace():
        return None
    if last.lower() == "unlimited":
        return -1
    return int(last) if last.isdecimal() and len(last) <= 30 else None


class Ulimits(Frozen):
    memlock_kb: int | None = None  # -1 = unlimited
    stack_kb: int | None = None
    memlock_line: Line | None = None
    findings: tuple[Finding, ...] = ()


# /proc/PID/limits: "Max locked memory   65536   65536   bytes" (bytes, not KiB)
_PROC_LIMIT = re.compile(
    r"^Max (?P<what>locked memory|stack size)\s+(?P<soft>unlimited|\d{1,30})\s+\S+\s+bytes\s*$"
)


def parse_ulimit(text: str, source: str = "containers/exec-ulimit.txt") -> Ulimits:
    """`ulimit -a` (bash, dash, busybox; values in KiB) or /proc/PID/limits (bytes)."""
    memlock = stack = None
    memlock_line = None
    for number, raw in enumerate(text.splitlines(), 1):
        p = _PROC_LIMIT.match(raw.strip())
        if p is not None:
            value = -1 if p["soft"] == "unlimited" else int(p["soft"]) // 1024
            if p["what"] == "locked memory" and memlock is None:
                memlock, memlock_line = value, Line(source=source, line=number, text=raw.strip())
            elif stack is None:
                stack = value
            continue
        kb = _value_after(_ULIMIT_L, raw)
        if kb is not None and memlock is None:
            memlock = kb
            memlock_line = Line(source=source, line=number, text=raw.strip())
            continue
        kb = _value_after(_ULIMIT_S, raw)
        if kb is not None and stack is None:
            stack = kb
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
    block = 1  # `df -h` sizes carry their unit; plain `df` / `df -k` counts 1K-blocks
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.startswith("Filesystem"):
            block = 1024 if "1K-blocks" in raw or "1024-blocks" in raw else 1
            continue
        if not raw.strip():
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
                size=_blocks(parse_size(parts[1]), block),
                used=_blocks(parse_size(parts[2]), block),
                use_percent=pct,
                mount=" ".join(parts[5:]),
                line=Line(source=source, line=number, text=raw.strip()),
            )
        )
    return tuple(out)


def _blocks(size: int | None, block: int) -> int | None:
    return None if size is None else size * block


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


_ERROR_LINE = re.compile(r"^(?:\[[^\]]*+\]\s*+:?\s*+)?([A-Za-z_][\w.]*(?:Error|Exception)):\s")


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


class EnvReport(Frozen):
    """What a pasted environment report says: PyTorch's ``collect_env`` (also printed by
    ``torch.utils.collect_env`` in bug templates), ``pip list``/``pip show`` lines, a
    ``print(torch.__version__, torch.version.cuda)`` or an interactive ``is_available()``.

    Real example (https://github.com/pytorch/pytorch/issues/52239)::

        PyTorch version: 1.7.1+cpu
        CUDA used to build PyTorch: None
        Is CUDA available: False

    gives ``torch="1.7.1+cpu"``, ``built_cuda=None``, ``built_without_cuda=True``,
    ``cuda_available=False``.
    """

    torch: str | None = None
    built_cuda: str | None = None  # "12.1"; None when not said
    built_without_cuda: bool = False  # "+cpu", "CUDA used to build PyTorch: None"
    cuda_available: bool | None = None
    driver: str | None = None  # "Nvidia driver version: 535.104.05"
    nvcc: str | None = None  # "Cuda compilation tools, release 11.7": the toolkit in use
    lines: tuple[Line, ...] = ()

    @property
    def said_anything(self) -> bool:
        return bool(self.lines)


_ENV_TORCH = re.compile(
    r"(?:PyTorch version|torch version|torch\.__version__\)?|^torch)\s*+[:=]{0,2}\s*+['\"]?"
    r"(?P<v>\d+\.\d+(?:\.\d+)?(?:[a-z0-9.]*)?(?:\+(?P<local>[a-z0-9.]+))?)",
    re.IGNORECASE,
)
_ENV_PIP_TORCH = re.compile(r"\btorch[-=]{1,2}(?P<v>\d+\.\d+(?:\.\d+)?)\+(?P<local>cpu|cu\d+)\b")
_ENV_BUILT = re.compile(r"CUDA used to build PyTorch:\s*(?P<v>\S+)")
_ENV_AVAILABLE = re.compile(r"Is CUDA available:\s*(?P<v>True|False|Yes|No)\b")
_ENV_DRIVER = re.compile(r"Nvidia driver version:\s*(?P<v>\d+\.\d+(?:\.\d+)?)")
_BARE_CPU_VERSION = re.compile(r"^['\"(]?(?P<v>\d+\.\d+(?:\.\d+)?\+cpu)['\")]?$")
_IS_AVAILABLE_CALL = re.compile(
    r"is_available\(\)[)\"'\s]*+(?:(?:->|=|:|returns?|is)\s*+)?(?P<v>True|False)?[\s\"')]*+$"
)
ANSWER_WITHIN = 50  # lines between `print(...is_available())` and its True/False
_NVCC = re.compile(r"Cuda compilation tools, release (?P<v>\d+\.\d+)")


def parse_env_report(text: str, source: str) -> EnvReport:
    """Scan a text (log, trigger, probe output) for environment-report lines; bounded work."""
    scan = _EnvScan(source)
    for number, raw in enumerate(text.splitlines()[:20000], 1):
        line = raw.strip()[:400]
        if line:
            scan.read(number, line)
    return scan.report()


@dataclass
class _EnvScan:
    """What parse_env_report has found so far; `read` takes one more (non-empty) line."""

    source: str
    torch: str | None = None
    built: str | None = None
    without: bool = False
    available: bool | None = None
    driver: str | None = None
    nvcc: str | None = None
    cited: list[Line] = field(default_factory=list)
    pending_call: int | None = None  # an `is_available()` whose answer is on a later line

    def read(self, number: int, line: str) -> None:
        if self.pending_call is not None:
            self._answer(number, line, self.pending_call)
        if self._labelled(number, line) or self._torch_version(number, line):
            return
        self._is_available_call(number, line)

    def report(self) -> EnvReport:
        return EnvReport(
            torch=self.torch,
            built_cuda=self.built,
            built_without_cuda=self.without,
            cuda_available=self.available,
            driver=self.driver,
            nvcc=self.nvcc,
            lines=tuple(self.cited[:8]),
        )

    def _cite(self, number: int, line: str) -> None:
        self.cited.append(Line(source=self.source, line=number, text=line))

    def _answer(self, number: int, line: str, call: int) -> None:
        """The answer to the `is_available()` of line `call` is the next line that is only
        True/False (log lines may come first); none within ANSWER_WITHIN lines: no answer."""
        answer = line.lstrip(">.# ").strip()
        if answer in ("True", "False"):
            self.available = answer == "True"
            self._cite(number, line)
            self.pending_call = None
        elif number - call > ANSWER_WITHIN:
            self.pending_call = None

    def _labelled(self, number: int, line: str) -> bool:
        """A labelled line (`CUDA used to build PyTorch:`, `Is CUDA available:`, nvcc's
        release, `Nvidia driver version:`): read and cited."""
        if (m := _ENV_BUILT.search(line)) is not None:
            value = m["v"]
            if value in ("None", "N/A"):
                self.without = True
            elif value[:1].isdigit():
                self.built = value
        elif (m := _ENV_AVAILABLE.search(line)) is not None:
            self.available = m["v"] in ("True", "Yes")
        elif (m := _NVCC.search(line)) is not None:
            self.nvcc = m["v"]
        elif (m := _ENV_DRIVER.search(line)) is not None:
            self.driver = m["v"]
        else:
            return False
        self._cite(number, line)
        return True

    def _torch_version(self, number: int, line: str) -> bool:
        """The first torch version said (a bare `1.7.1+cpu`, pip's `torch==2.1.0+cu121`, or a
        `PyTorch version:` line); its local part says a CPU-only or a CUDA build."""
        if self.torch is None and (m := _BARE_CPU_VERSION.match(line)) is not None:
            self.torch, self.without = m["v"], True
            self._cite(number, line)
            return True
        m = _ENV_PIP_TORCH.search(line) or _ENV_TORCH.search(line)
        if m is None or self.torch is not None:
            return False
        self.torch = m["v"]
        if m["local"] == "cpu":
            self.without = True
        elif m["local"] and m["local"].startswith("cu") and m["local"][2:].isdigit():
            digits = m["local"][2:]
            self.built = self.built or f"{digits[:-1]}.{digits[-1]}"
        self._cite(number, line)
        return True

    def _is_available_call(self, number: int, line: str) -> None:
        """`torch.cuda.is_available()` (or TensorFlow's `is_gpu_available()`) with its answer on
        the same line, or waiting for it on a later one."""
        if "is_available()" not in line and "is_gpu_available()" not in line:
            return
        m = _IS_AVAILABLE_CALL.search(line.replace("is_gpu_available()", "is_available()"))
        if m is None:
            return
        if m["v"] is None:
            self.pending_call = number
        else:
            self.available = m["v"] == "True"
            self._cite(number, line)


# ``nvidia-ctk --version`` prints "NVIDIA Container Toolkit CLI version 1.12.0"; the older
# ``nvidia-container-cli --version`` prints "version: 1.0.7" (libnvidia-container), newer ones
# "cli-version: 1.14.3" and "lib-version: ...".
_TOOLKIT_VERSION = re.compile(
    r"(?im)^[ \t]*+(?:NVIDIA Container (?:Toolkit CLI|Runtime Hook) version|(?:cli-)?version:)"
    r"[ \t]*+v?(\d+\.\d+(?:\.\d+)?)"
)


class ToolkitVersion(Frozen):
    version: str  # "1.12.0"
    line: Line


def parse_toolkit_version(
    text: str, source: str = "commands/container-toolkit.txt"
) -> ToolkitVersion | None:
    """The NVIDIA Container Toolkit version a host's ``nvidia-ctk --version`` /
    ``nvidia-container-toolkit --version`` / ``nvidia-container-cli --version`` printed, with its
    line; None when it says none."""
    m = _TOOLKIT_VERSION.search(text)
    if m is None:
        return None
    number = text.count("\n", 0, m.start()) + 1
    raw = text.splitlines()[number - 1] if text.splitlines() else m.group(0)
    return ToolkitVersion(version=m.group(1), line=Line(source=source, line=number, text=raw[:300]))


def version_tuple(version: str) -> tuple[int, ...]:
    """ "1.13" -> (1, 13); "1.12.0" -> (1, 12, 0); text after the numbers is ignored."""
    m = re.match(r"v?(\d{1,9}(?:\.\d{1,9}){0,8})", version.strip())
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


class CudaCache(Frozen):
    """The size of a container's CUDA JIT cache (``~/.nv/ComputeCache``); 0 when there is none."""

    kib: int | None = None  # None: du's answer was not understood
    path: str = ""
    line: Line | None = None


_DU = re.compile(r"^(\d+)\s+(\S.*)$")


def parse_cuda_cache(text: str, source: str = "containers/exec-cuda-cache.txt") -> CudaCache:
    """``du -sk PATH``: its size; "No such file or directory" (GNU or busybox wording) is an empty
    cache. Anything else (permission denied, no du) leaves the size unknown."""
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if m := _DU.match(line):
            return CudaCache(
                kib=int(m.group(1)), path=m.group(2), line=Line(source=source, line=n, text=line)
            )
        if "No such file or directory" in line:
            return CudaCache(kib=0, line=Line(source=source, line=n, text=line))
    return CudaCache()
