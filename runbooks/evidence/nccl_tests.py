"""Parse the output of an nccl-tests binary such as ``all_reduce_perf``.

Reads the bundle file ``nccl-tests.txt``. Returns :class:`NcclTestFacts`: the collective
(``all_reduce`` from ``# Collective test starting: all_reduce_perf`` or from the binary name on a
command line), the ``# nThread ... nGpus ...`` header, one :class:`NcclDevice` per
``#  Rank N ... device N [0x..] NVIDIA H100 80GB HBM3`` line, every size row of the table
(out-of-place and in-place time/algbw/busbw and ``#wrong``, or the ``error`` column of older
versions), ``# Avg bus bandwidth``, the largest busbw, the ``#wrong`` total, ``Out of bounds
values`` and the failure/``NCCL WARN`` lines. Tolerates ``mpirun --tag-output`` (``[1,0]<stdout>:``)
and ``srun --label`` (`` 0: ``) prefixes and interleaved ``NCCL INFO`` logging. Never raises.

Real example (single 8x H100 node, NVIDIA/nccl-tests#290)::

    #  Rank  7 Group  0 Pid 295203 on    node005 device  7 [0xc1] NVIDIA H100 80GB HBM3
    ...
      4294967296    1073741824     float     sum      -1    15870  270.63  473.60      0 ...
    # Out of bounds values : 0 OK
    # Avg bus bandwidth    : 439.369

parses to ``n_ranks=8``, ``gpu_models=("NVIDIA H100 80GB HBM3",)``, ``avg_busbw=439.369``,
``max_busbw=476.53`` (the in-place busbw of the last row), ``wrong_total=0`` and
``out_of_bounds_values=0``.
"""

from __future__ import annotations

import re

from runbooks.evidence.text import (
    MAX_SCAN_CHARS,
    binary_input,
    cite,
    looks_binary,
    split_lines,
    too_long,
)
from runbooks.model import Finding, Frozen, Line


class NcclDevice(Frozen):
    rank: int
    group: int | None = None
    pid: int | None = None
    host: str
    device: int
    bus_id: str  # as printed: "0x18" (PCI bus) or "0000:06:00"
    model: str
    line: Line


class NcclRow(Frozen):
    """One size of the sweep; ``oop_*`` is out-of-place, ``ip_*`` in-place. Times in us, bandwidths
    in GB/s. ``*_wrong`` is the ``#wrong`` count (``None`` for ``N/A``); older nccl-tests print a
    max ``error`` instead, kept in ``*_error``."""

    size_bytes: int
    count: int
    type: str
    redop: str | None = None
    root: int | None = None
    oop_time_us: float | None = None
    oop_algbw: float | None = None
    oop_busbw: float | None = None
    oop_wrong: int | None = None
    oop_error: float | None = None
    ip_time_us: float | None = None
    ip_algbw: float | None = None
    ip_busbw: float | None = None
    ip_wrong: int | None = None
    ip_error: float | None = None
    line: Line


class NcclTestFacts(Frozen):
    source: str
    collective: str | None = None
    header: Line | None = None
    n_threads: int | None = None
    n_gpus_per_process: int | None = None
    nccl_version: str | None = None
    n_ranks: int = 0
    devices: tuple[NcclDevice, ...] = ()
    gpu_models: tuple[str, ...] = ()
    rows: tuple[NcclRow, ...] = ()
    avg_busbw: float | None = None
    max_busbw: float | None = None
    wrong_total: int = 0
    out_of_bounds_values: int | None = None
    out_of_bounds_ok: bool | None = None
    failures: tuple[Line, ...] = ()
    findings: tuple[Finding, ...] = ()


_PREFIX = re.compile(r"^\s*(?:\[\d+,\d+\]<std(?:out|err)>:|\d+:(?=\s|$))")
_STARTING = re.compile(r"Collective test starting:\s*(?P<bin>\w+?)_perf\b")
_BINARY = re.compile(r"\b(?P<bin>[a-z][a-z_]*?)_perf(?:_mpi)?\b")
_HEADER = re.compile(r"^#?\s*nThread\s+(?P<threads>\d{1,9})\s+nGpus\s+(?P<gpus>\d{1,9})(?!\d)")
_DEVICE = re.compile(
    r"^#\s+Rank\s+(?P<rank>\d{1,9})\s+(?:Group\s+(?P<group>\d{1,9})\s+)?Pid\s+(?P<pid>\d{1,18})\s+"
    r"on\s+(?P<host>\S+)\s+device\s+(?P<device>\d{1,9})\s+\[(?P<bus>[^\]]*)\]\s+(?P<model>.+?)\s*$"
)
_VERSION = re.compile(r"NCCL version (?P<v>[\w.+-]+)")
_AVG = re.compile(r"Avg bus bandwidth\s*:\s*(?P<v>[-+]?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?)")
_OOB = re.compile(r"Out of bounds values\s*:\s*(?P<n>\d{1,18})(?!\d)\s*(?P<verdict>OK|FAILED)?")
_FAILURE = re.compile(
    r"NCCL WARN|Test (?:CUDA |NCCL )?failure|FAILED|NCCL (?:error|failure)|unhandled \w+ error"
)
_INT = re.compile(r"^-?\d{1,30}$")  # longer is no count: int() would refuse it
_FLOAT = re.compile(r"^-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?$")


def _float(token: str | None) -> float | None:
    return float(token) if token is not None and _FLOAT.match(token) else None


def _wrong_or_error(cell: str | None, error_column: bool) -> tuple[int | None, float | None]:
    if cell is None or cell == "N/A":
        return None, None
    if not error_column and _INT.match(cell):
        wrong = int(cell)
        return (wrong, None) if wrong >= 0 else (None, None)  # a negative count is no count
    return None, _float(cell)


def _row(
    tokens: list[str], has_root: bool | None, error_column: bool, line: Line
) -> NcclRow | None:
    if len(tokens) < 5 or not (_INT.match(tokens[0]) and _INT.match(tokens[1])):
        return None
    if _FLOAT.match(tokens[2]):
        return None
    size, count, dtype, rest = int(tokens[0]), int(tokens[1]), tokens[2], tokens[3:]
    redop: str | None = None
    if rest and not _FLOAT.match(rest[0]) and rest[0] != "N/A":
        redop, rest = rest[0], rest[1:]
    root: int | None = None
    if has_root is None:  # no column header seen: root is the int before a time with a dot
        has_root = bool(rest) and (
            rest[0] == "-1" or (len(rest) >= 9 and bool(_INT.match(rest[0])))
        )
    if has_root and rest and _INT.match(rest[0]):
        root, rest = int(rest[0]), rest[1:]
    if not rest or not all(_FLOAT.match(t) or t == "N/A" for t in rest):
        return None
    padded: list[str | None] = [*rest[:8], *([None] * (8 - min(len(rest), 8)))]
    oop_wrong, oop_error = _wrong_or_error(padded[3], error_column)
    ip_wrong, ip_error = _wrong_or_error(padded[7], error_column)
    return NcclRow(
        size_bytes=size,
        count=count,
        type=dtype,
        redop=redop,
        root=root,
        oop_time_us=_float(padded[0]),
        oop_algbw=_float(padded[1]),
        oop_busbw=_float(padded[2]),
        oop_wrong=oop_wrong,
        oop_error=oop_error,
        ip_time_us=_float(padded[4]),
        ip_algbw=_float(padded[5]),
        ip_busbw=_float(padded[6]),
        ip_wrong=ip_wrong,
        ip_error=ip_error,
        line=line,
    )


def parse_nccl_tests(text: str, source: str = "nccl-tests.txt") -> NcclTestFacts:
    """Parse nccl-tests output into :class:`NcclTestFacts`."""
    if not text.strip():
        return NcclTestFacts(
            source=source,
            findings=(
                Finding(code="nccl-empty", message="empty nccl-tests output", source=source),
            ),
        )
    findings: list[Finding] = []
    if looks_binary(text):
        findings.append(binary_input(source))
    collective: str | None = None
    binary_hint: str | None = None
    header: Line | None = None
    threads = gpus_per_proc = None
    version: str | None = None
    devices: dict[tuple[str, int], NcclDevice] = {}
    rows: list[NcclRow] = []
    avg: float | None = None
    oob: int | None = None
    oob_ok: bool | None = None
    failures: list[Line] = []
    has_root: bool | None = None
    error_column = False

    for number, raw in enumerate(split_lines(text), 1):
        if len(raw) > MAX_SCAN_CHARS:
            findings.append(too_long(source, number, len(raw)))
            continue
        body = _PREFIX.sub("", raw, count=1).strip()
        if not body:
            continue
        cited = cite(source, number, raw)
        if collective is None and (m := _STARTING.search(body)):
            collective = m["bin"]
        if binary_hint is None and "NCCL INFO" not in body and (m := _BINARY.search(body)):
            binary_hint = m["bin"]
        if version is None and (m := _VERSION.search(body)):
            version = m["v"]
        if _FAILURE.search(body):
            failures.append(cited)
        if m := _AVG.search(body):
            avg = float(m["v"])
            continue
        if m := _OOB.search(body):
            oob = int(m["n"])
            oob_ok = m["verdict"] == "OK" if m["verdict"] else oob == 0
            continue
        if header is None and (m := _HEADER.match(body)):
            header, threads, gpus_per_proc = cited, int(m["threads"]), int(m["gpus"])
            continue
        if m := _DEVICE.match(body):
            device = NcclDevice(
                rank=int(m["rank"]),
                group=int(m["group"]) if m["group"] else None,
                pid=int(m["pid"]),
                host=m["host"],
                device=int(m["device"]),
                bus_id=m["bus"].strip(),
                model=m["model"],
                line=cited,
            )
            devices.setdefault((device.host, device.rank), device)
            continue
        if body.startswith("#"):
            words = body.split()
            if "size" in words and "count" in words and "type" in words:
                has_root = "root" in words
                error_column = "error" in words and "#wrong" not in words
            continue
        tokens = body.split()
        if not _INT.match(tokens[0]) or len(tokens) < 4:
            continue
        row = _row(tokens, has_root, error_column, cited)
        if row is not None:
            rows.append(row)
        elif len(tokens) >= 8:
            findings.append(
                Finding(
                    code="nccl-unparsed-row",
                    message="line starts like a size row but could not be read",
                    source=source,
                    line=number,
                )
            )

    busbws = [b for r in rows for b in (r.oop_busbw, r.ip_busbw) if b is not None]
    wrong_total = sum(w for r in rows for w in (r.oop_wrong, r.ip_wrong) if w is not None)
    if not rows:
        findings.append(Finding(code="nccl-no-rows", message="no result rows found", source=source))
    if wrong_total:
        findings.append(
            Finding(
                code="nccl-wrong-results",
                message=f"{wrong_total} wrong values reported in the #wrong columns",
                source=source,
                severity="error",
            )
        )
    if oob_ok is False:
        findings.append(
            Finding(
                code="nccl-out-of-bounds",
                message=f"Out of bounds values: {oob} FAILED",
                source=source,
                severity="error",
            )
        )
    ordered = sorted(devices.values(), key=lambda d: d.rank)
    models: list[str] = []
    for device in ordered:
        if device.model not in models:
            models.append(device.model)
    return NcclTestFacts(
        source=source,
        collective=collective or binary_hint,
        header=header,
        n_threads=threads,
        n_gpus_per_process=gpus_per_proc,
        nccl_version=version,
        n_ranks=len({d.rank for d in ordered}),
        devices=tuple(ordered),
        gpu_models=tuple(models),
        rows=tuple(rows),
        avg_busbw=avg,
        max_busbw=max(busbws) if busbws else None,
        wrong_total=wrong_total,
        out_of_bounds_values=oob,
        out_of_bounds_ok=oob_ok,
        failures=tuple(failures),
        findings=tuple(findings),
    )
