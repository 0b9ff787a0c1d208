"""Turn a bundle into `Facts`: every parser's output plus the signature scans (PURE but for
streaming large log files out of the bundle).

Which parser reads which bundle file is decided here, once. Example: ``containers/train.log`` is
scanned for signatures and Python exceptions; ``containers/train.inspect.json`` becomes
`InspectFacts`; ``nvidia-smi.txt`` becomes `SmiFacts`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import datetime
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from runbooks.collect.bundle import LOG_FILE, Bundle
from runbooks.collect.evidence.dcgmi import (
    DcgmDiag,
    DcgmDiscovery,
    DcgmHealth,
    parse_dcgmi_diag,
    parse_dcgmi_discovery,
    parse_dcgmi_health,
)
from runbooks.collect.evidence.dmesg import KernelLogFacts, parse_kernel_log
from runbooks.collect.evidence.docker_inspect import (
    ImageNow,
    InspectFacts,
    docker_time,
    parse_image_now,
    parse_inspect,
)
from runbooks.collect.evidence.nccl_tests import NcclTestFacts, parse_nccl_tests
from runbooks.collect.evidence.nvidia_smi import (
    SmiFacts,
    SmiXmlFacts,
    parse_nvidia_smi,
    parse_nvidia_smi_xml,
)
from runbooks.collect.evidence.probes import (
    CudaCache,
    DockerInfo,
    EnvReport,
    Filesystem,
    ToolkitVersion,
    TorchProbe,
    Ulimits,
    parse_cuda_cache,
    parse_df,
    parse_docker_info,
    parse_env_report,
    parse_toolkit_version,
    parse_torch_probe,
    parse_ulimit,
    python_exceptions,
)
from runbooks.collect.evidence.topology import Topology, is_topology, parse_topology
from runbooks.core.model import Finding, Line
from runbooks.core.runbook import Thresholds
from runbooks.diagnose.logscan import ScanResult, Where, scan_stream
from runbooks.diagnose.similar import ERRORISH, MAX_SALIENT_LINES, salient_lines

# Where a line came from: the host's commands, its kernel log, the workload's own log, the text a
# person pasted, or a probe cudamedic itself ran inside a container (our probe failing is not a
# symptom of the workload: `nvidia-smi: not found` from our probe says nothing about a container
# that never wanted GPUs).
Origin = Literal["host", "kernel", "container", "trigger", "probe"]


class ContainerFacts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    inspect: InspectFacts | None = None
    torch: TorchProbe | None = None
    ulimits: Ulimits | None = None
    shm: Filesystem | None = None
    gpu_list: tuple[str, ...] | None = None  # `nvidia-smi -L` lines inside the container
    smi: SmiFacts | None = None  # plain `nvidia-smi` run inside the container
    env_probe: dict[str, str] = {}
    has_log: bool = False
    log_tail: tuple[Line, ...] = ()  # the last lines of the container log
    inspect_lines: dict[str, Line] = {}  # "ShmSize" -> the inspect JSON line that holds it
    image_now: ImageNow | None = None  # what the container's image tag names at collection time
    cuda_cache: CudaCache | None = None  # `du -sk ~/.nv/ComputeCache` inside the container


class DcgmFacts(BaseModel):
    """What NVIDIA DCGM's `dcgmi` said, on a host that has it
    (runbooks/collect/evidence/dcgmi.py)."""

    model_config = ConfigDict(extra="forbid")

    discovery: DcgmDiscovery | None = None
    health: DcgmHealth | None = None
    diag: DcgmDiag | None = None


class Facts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    collected_at: datetime | None = None
    uptime_s: float | None = None  # the host's /proc/uptime when collected
    thresholds: Thresholds = Thresholds()  # what the judgments compare against (the runbook's)
    smi: SmiFacts | None = None
    smi_xml: SmiXmlFacts | None = None
    kernel: KernelLogFacts | None = None
    nccl: NcclTestFacts | None = None
    docker_info: DockerInfo | None = None
    df: tuple[Filesystem, ...] = ()
    toolkit: str | None = None  # commands/container-toolkit.txt, as written
    toolkit_missing: bool = False
    toolkit_version: ToolkitVersion | None = None  # parsed from `toolkit`
    lsmod: str | None = None
    host_ulimits: Ulimits | None = None  # commands/*.txt holding `ulimit -a` or /proc/PID/limits
    topology: Topology | None = None  # commands/*.txt holding `nvidia-smi topo -m`
    dcgm: DcgmFacts | None = None  # commands/dcgmi-*.txt, where the host has DCGM
    containers: dict[str, ContainerFacts] = {}
    scans: list[ScanResult] = []
    exceptions: list[Line] = []
    env_reports: list[EnvReport] = []  # collect_env / version printouts in any text
    salient: list[str] = []  # the lines that carry meaning, for similar-incident search
    # The salient lines again, split by whose words they are: the workload's and a person's
    # text, and the host's kernel log (on a shared host it holds every container's events):
    # what the learned model reads (classify.model_input).
    own_text: list[str] = []
    kernel_text: list[str] = []
    errorish: list[Line] = []  # the last error-looking lines of each log (no signature needed)
    text_bytes: int = 0  # how much text the bundle held (0: nothing to read at all)
    ssh_error: str | None = None
    findings: list[Finding] = []

    @property
    def host_gpu_count(self) -> int:
        """GPUs the host's nvidia-smi (table, else XML) lists."""
        return self.gpus_listed()

    def gpus_listed(self, whole: Callable[[str], bool] | None = None) -> int:
        """GPUs the host's nvidia-smi lists: the table, else the XML. With `whole` (a bundle
        source name -> whether its output came back whole), only a whole output is counted: a
        connection dropped in the middle of the table lists the GPUs before the cut."""
        if self.smi is not None and self.smi.gpus and (whole is None or whole("nvidia-smi")):
            return len(self.smi.gpus)
        if self.smi_xml is not None and (
            whole is None or (whole("nvidia-smi-xml") and not self.smi_xml.truncated)
        ):
            return len(self.smi_xml.gpus)
        return 0

    @property
    def incident_time(self) -> datetime | None:
        """When the incident happened: the latest container exit, else the collection time."""
        ends = []
        for c in self.containers.values():
            if c.inspect and c.inspect.finished_at and not c.inspect.running:
                parsed = docker_time(c.inspect.finished_at)
                if parsed is not None:
                    ends.append(parsed)
        return max(ends) if ends else self.collected_at

    @property
    def started_at(self) -> datetime | None:
        starts = [
            t
            for c in self.containers.values()
            if c.inspect and c.inspect.started_at
            for t in [docker_time(c.inspect.started_at)]
            if t is not None
        ]
        return min(starts) if starts else None


def parse_uptime(text: str | None) -> float | None:
    """``/proc/uptime`` ("12345.67 54321.00") -> seconds since boot."""
    if not text:
        return None
    try:
        seconds = float(text.split()[0])
    except (ValueError, IndexError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None  # 'nan', '-5': not one


SALIENT_TAIL_BYTES = 1 << 20  # similar-incident search reads at most the newest 1 MiB of a log


class Reader(NamedTuple):
    """How a bundle file is read: which signatures scan it (None: it holds facts, parsed by its
    own parser, never scanned), and where its lines come from."""

    scan: Where | None
    origin: Origin


# What produced a file decides how it is read, and a file's path in the bundle layout
# (docs/spec/evidence-bundle.md) names what produced it: the same file is read the same way
# whether cudamedic's collector wrote it or a person put it in a bundle by hand. First match wins;
# `*` stands for any run of characters.
#
# cudamedic's own host commands (the built-in runbooks' host sources: a test keeps this list and
# runbooks/*.yaml in step) are inventories of the host, read only for nvidia-smi-like messages;
# any other command output (a runbook's own source, a person's kubectl or journalctl) is read for
# every signature ("command"). Probe outputs that list settings (limits, env, sizes) are facts.
READERS: tuple[tuple[str, Reader], ...] = (
    ("bundle.json", Reader(None, "host")),
    ("trigger.txt", Reader("log", "trigger")),
    ("nvidia-smi.txt", Reader("smi", "host")),
    ("dmesg.txt", Reader("kernel", "kernel")),
    ("nccl-tests.txt", Reader("command", "host")),
    ("containers/*.json", Reader(None, "container")),  # inspect, what the image tag names now
    ("containers/*.exec-ulimit.txt", Reader(None, "probe")),
    ("containers/*.exec-env.txt", Reader(None, "probe")),
    ("containers/*.exec-shm.txt", Reader(None, "probe")),
    ("containers/*.exec-cuda-cache.txt", Reader(None, "probe")),
    ("containers/*.exec-nvidia-smi.txt", Reader("command", "probe")),
    ("containers/*.exec-nvidia-smi-L.txt", Reader("command", "probe")),
    ("containers/*.exec-*", Reader("log", "probe")),  # the torch probe, a runbook's own probes
    ("containers/*", Reader("log", "container")),  # the workload's own log
    ("*.json", Reader(None, "host")),
    ("*.xml", Reader(None, "host")),  # nvidia-smi -q -x: parsed as XML facts
    ("commands/nvidia-smi-L.txt", Reader("smi", "host")),
    ("commands/nvidia-smi-topo.txt", Reader("smi", "host")),
    ("commands/uptime.txt", Reader("smi", "host")),
    ("commands/df.txt", Reader("smi", "host")),
    ("commands/uname.txt", Reader("smi", "host")),
    ("commands/lsmod-nvidia.txt", Reader("smi", "host")),
    ("commands/container-toolkit.txt", Reader("smi", "host")),
    # NVIDIA DCGM (`dcgmi`, where installed): inventories read by their own parser, never scanned
    # (a diag's "Fail" rows and DCGM's advice text are facts, not a workload's log).
    ("commands/dcgmi-discovery.txt", Reader(None, "host")),
    ("commands/dcgmi-health.txt", Reader(None, "host")),
    ("commands/dcgmi-diag.txt", Reader(None, "host")),
    ("*ulimit-a.txt", Reader(None, "host")),  # a person's `ulimit -a`: facts (host_ulimits)
    ("*ulimit.txt", Reader(None, "host")),
    ("commands/*", Reader("command", "host")),
    ("*", Reader("log", "host")),
)


def _matches(pattern: str, rel: str) -> bool:
    """Glob match with `*` only, in one left-to-right pass (no backtracking: a hostile file name
    costs linear time)."""
    head, *middle, tail = pattern.split("*") if "*" in pattern else (pattern, pattern)
    if "*" not in pattern:
        return rel == pattern
    if len(rel) < len(head) + len(tail) or not rel.startswith(head) or not rel.endswith(tail):
        return False
    at, end = len(head), len(rel) - len(tail)
    for part in middle:
        found = rel.find(part, at, end)
        if found < 0:
            return False
        at = found + len(part)
    return True


def reader_of(rel: str) -> Reader:
    """How the bundle file `rel` is read (READERS)."""
    return next(reader for pattern, reader in READERS if _matches(pattern, rel))


def origin_of(source: str) -> Origin:
    return reader_of(source).origin


def gather(bundle: Bundle) -> Facts:
    """Every fact the judgments use, read from a bundle (never raising on what it holds)."""
    facts = Facts(findings=list(bundle.findings))
    _read_meta(facts, bundle)
    _read_host_files(facts, bundle)
    for name in bundle.container_names():
        facts.containers[name] = _container(bundle, name)
    _read_texts(facts, bundle)
    if LOG_FILE in bundle.names() and "log" not in facts.containers:
        facts.containers["log"] = ContainerFacts(name="log", has_log=True)
    return facts


def _read_meta(facts: Facts, bundle: Bundle) -> None:
    """bundle.json: when, the collector's findings, an SSH failure, a toolkit not found."""
    meta = bundle.meta
    if meta is None:
        return
    facts.collected_at = meta.collected_at
    facts.findings.extend(meta.findings)
    for src in meta.sources:
        if src.name == "ssh" and src.status == "error":
            facts.ssh_error = src.error
        if (
            src.name == "container-toolkit"
            and src.status == "failed"
            and src.error
            and "not found" in src.error
        ):
            facts.toolkit_missing = True
    if facts.toolkit_missing:
        facts.findings.append(
            Finding(
                code="container-toolkit-not-found",
                source="commands/container-toolkit.txt",
                severity="warning",
                message="neither nvidia-ctk nor nvidia-container-cli is on the "
                "host: containers cannot be given GPUs",
            )
        )


def _read_host_files(facts: Facts, bundle: Bundle) -> None:
    """The host's structured outputs: nvidia-smi, the kernel log, nccl-tests, docker info, df,
    uptime, the toolkit's version, lsmod, and any `ulimit -a` or `nvidia-smi topo -m`."""
    files = bundle.files
    if (text := bundle.text("nvidia-smi.txt")) is not None:
        facts.smi = parse_nvidia_smi(text)
    if (text := bundle.text("nvidia-smi.xml")) is not None and text.strip():
        facts.smi_xml = parse_nvidia_smi_xml(text)
    if (text := bundle.text("dmesg.txt")) is not None:
        facts.kernel = parse_kernel_log(text)
    if (text := bundle.text("nccl-tests.txt")) is not None:
        facts.nccl = parse_nccl_tests(text)
    if (text := files.get("docker-info.json")) is not None:
        facts.docker_info = parse_docker_info(text)
    if (text := files.get("commands/df.txt")) is not None:
        facts.df = parse_df(text)
    facts.uptime_s = parse_uptime(files.get("commands/uptime.txt"))
    if (text := files.get("commands/container-toolkit.txt")) is not None:
        facts.toolkit = text.strip() or None
        facts.toolkit_version = parse_toolkit_version(text, "commands/container-toolkit.txt")
    if (text := files.get("commands/lsmod-nvidia.txt")) is not None:
        facts.lsmod = text
    facts.dcgm = _read_dcgm(files)
    for rel, text in sorted(files.items()):
        # A person's `ulimit -a`, or a daemon's /proc/PID/limits, under any command name.
        if rel.startswith("commands/") and "locked memory" in text.lower():
            limits = parse_ulimit(text, rel)
            if limits.memlock_kb is not None:
                facts.host_ulimits = limits
        if rel.startswith("commands/") and is_topology(text):
            facts.topology = parse_topology(text, rel)


DCGM_FILES = {
    "discovery": "commands/dcgmi-discovery.txt",
    "health": "commands/dcgmi-health.txt",
    "diag": "commands/dcgmi-diag.txt",
}


def _read_dcgm(files: dict[str, str]) -> DcgmFacts | None:
    """`dcgmi discovery -l`, `health -c`, `diag -r N` as collected (None: no DCGM output)."""
    if not any(rel in files for rel in DCGM_FILES.values()):
        return None
    out = DcgmFacts()
    if (text := files.get(DCGM_FILES["discovery"])) is not None:
        out.discovery = parse_dcgmi_discovery(text, DCGM_FILES["discovery"])
    if (text := files.get(DCGM_FILES["health"])) is not None:
        out.health = parse_dcgmi_health(text, DCGM_FILES["health"])
    if (text := files.get(DCGM_FILES["diag"])) is not None:
        out.diag = parse_dcgmi_diag(text, DCGM_FILES["diag"])
    return out


def _read_texts(facts: Facts, bundle: Bundle) -> None:
    """Every log-like file: signature scans, exceptions, version printouts, salient and
    error-looking lines, each container's log tail."""
    for rel in bundle.names():
        kind = reader_of(rel).scan
        if kind is None:
            continue
        with bundle.open(rel) as stream:
            scan = scan_stream(stream, rel, kind)
        facts.scans.append(scan)
        facts.text_bytes += scan.bytes
        if kind not in ("log", "kernel", "command"):
            continue
        text = bundle.text(rel)  # once per file (a large log: its newest 16 MiB)
        if text:
            _read_text(facts, bundle, rel, kind, text, scan)


def _read_text(
    facts: Facts, bundle: Bundle, rel: str, kind: Where, text: str, scan: ScanResult
) -> None:
    if kind != "kernel":
        if kind == "log":
            facts.exceptions.extend(python_exceptions(text, rel))
        report = parse_env_report(text, rel)
        if report.said_anything:
            facts.env_reports.append(report)
    recent = _newest(text) if rel in bundle.large else text
    # What cudamedic's own probes printed is not the incident's text (see Origin).
    if len(facts.salient) < 4 * MAX_SALIENT_LINES and origin_of(rel) != "probe":
        lines = salient_lines(recent)
        facts.salient.extend(lines)
        (facts.kernel_text if kind == "kernel" else facts.own_text).extend(lines)
    if kind == "kernel":
        return
    cited = _cited(recent, rel, scan.lines)
    facts.errorish.extend([ln for ln in cited if ERRORISH.search(ln.text)][-2:])
    if rel.endswith(".log") and rel.startswith("containers/"):
        name = rel.removeprefix("containers/").removesuffix(".log")
        if name in facts.containers:
            facts.containers[name].log_tail = tuple(cited[-5:])


def _newest(text: str) -> str:
    """The newest SALIENT_TAIL_BYTES of a large log's text, from a line boundary."""
    if len(text) <= SALIENT_TAIL_BYTES:
        return text
    tail = text[-SALIENT_TAIL_BYTES:]
    return tail[tail.find("\n") + 1 :]


def _cited(text: str, source: str, total: int) -> list[Line]:
    """The non-empty lines of a log's text as cited lines (a large log's text is only its
    tail: numbering continues from the log's real line count)."""
    lines = text.splitlines()
    first = max(total, len(lines)) - len(lines) + 1
    return [
        Line(source=source, line=first + i, text=ln.strip()[:300])
        for i, ln in enumerate(lines)
        if ln.strip()
    ]


_INSPECT_KEYS = (
    "ShmSize",
    "IpcMode",
    "DeviceRequests",
    "Runtime",
    "OOMKilled",
    "Ulimits",
    "CapAdd",
    "ExitCode",
    "Image",
)


def _key_lines(text: str, source: str) -> dict[str, Line]:
    out: dict[str, Line] = {}
    for number, raw in enumerate(text.splitlines()[:5000], 1):
        for key in _INSPECT_KEYS:
            if key not in out and f'"{key}":' in raw:
                out[key] = Line(source=source, line=number, text=raw.strip()[:300])
    return out


def _container(bundle: Bundle, name: str) -> ContainerFacts:
    base = f"containers/{name}"
    facts = ContainerFacts(name=name, has_log=bundle.has(f"{base}.log"))
    if (text := bundle.files.get(f"{base}.inspect.json")) is not None:
        facts.inspect = parse_inspect(text, f"{base}.inspect.json")
        facts.inspect_lines = _key_lines(text, f"{base}.inspect.json")
    if (text := bundle.files.get(f"{base}.exec-torch.txt")) is not None:
        facts.torch = parse_torch_probe(text, f"{base}.exec-torch.txt")
    if (text := bundle.files.get(f"{base}.exec-ulimit.txt")) is not None:
        facts.ulimits = parse_ulimit(text, f"{base}.exec-ulimit.txt")
    if (text := bundle.files.get(f"{base}.exec-shm.txt")) is not None:
        shm = [fs for fs in parse_df(text, f"{base}.exec-shm.txt") if fs.mount == "/dev/shm"]
        facts.shm = shm[0] if shm else None
    if (text := bundle.files.get(f"{base}.exec-nvidia-smi.txt")) is not None:
        facts.smi = parse_nvidia_smi(text, f"{base}.exec-nvidia-smi.txt")
    if (text := bundle.files.get(f"{base}.exec-nvidia-smi-L.txt")) is not None:
        facts.gpu_list = tuple(ln for ln in text.splitlines() if ln.startswith("GPU "))
    if (text := bundle.files.get(f"{base}.image.json")) is not None:
        facts.image_now = parse_image_now(text)
    if (text := bundle.files.get(f"{base}.exec-cuda-cache.txt")) is not None:
        facts.cuda_cache = parse_cuda_cache(text, f"{base}.exec-cuda-cache.txt")
    if (text := bundle.files.get(f"{base}.exec-env.txt")) is not None:
        facts.env_probe = dict(
            ln.split("=", 1) for ln in text.splitlines() if "=" in ln and not ln.startswith("#")
        )
    return facts
