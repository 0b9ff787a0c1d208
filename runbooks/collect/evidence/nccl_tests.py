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

from runbooks.collect.evidence.text import (
    MAX_SCAN_CHARS,
    binary_input,
    cite,
    looks_binary,
    split_lines,
    too_long,
)
from runbooks.core.model import Finding, Frozen, Line


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
    return _NcclReader(text, source).read()


class _NcclReader:
    """One pass over nccl-tests output, line by line with any launcher prefix removed: what
    names the test, the ``nThread`` header, the rank/device lines, the column header, the size
    rows and the summary lines; then the totals and findings over all rows."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.findings: list[Finding] = [binary_input(source)] if looks_binary(text) else []
        self.lines = split_lines(text)
        self.collective: str | None = None  # from "# Collective test starting: ..."
        self.binary_hint: str | None = None  # from a binary name such as all_reduce_perf
        self.header: Line | None = None
        self.threads: int | None = None
        self.gpus_per_proc: int | None = None
        self.version: str | None = None
        self.devices: dict[tuple[str, int], NcclDevice] = {}  # first line per (host, rank)
        self.rows: list[NcclRow] = []
        self.avg: float | None = None
        self.oob: int | None = None
        self.oob_ok: bool | None = None
        self.failures: list[Line] = []
        self.has_root: bool | None = None  # None: no column header seen
        self.error_column = False  # the column header has "error", not "#wrong"

    def read(self) -> NcclTestFacts:
        for number, raw in enumerate(self.lines, 1):
            if len(raw) > MAX_SCAN_CHARS:
                self.findings.append(too_long(self.source, number, len(raw)))
                continue
            body = _PREFIX.sub("", raw, count=1).strip()
            if body:
                self._line(number, body, cite(self.source, number, raw))
        return self._facts()

    def _line(self, number: int, body: str, cited: Line) -> None:
        self._names_and_failures(body, cited)
        if self._summary(body):
            return
        if self.header is None and (m := _HEADER.match(body)):
            self.header, self.threads, self.gpus_per_proc = cited, int(m["threads"]), int(m["gpus"])
        elif m := _DEVICE.match(body):
            device = _device(m, cited)
            self.devices.setdefault((device.host, device.rank), device)
        elif body.startswith("#"):
            self._column_header(body.split())
        else:
            self._size_row(number, body.split(), cited)

    def _names_and_failures(self, body: str, cited: Line) -> None:
        """The collective, binary name and NCCL version (first seen) and any failure line."""
        if self.collective is None and (m := _STARTING.search(body)):
            self.collective = m["bin"]
        if self.binary_hint is None and "NCCL INFO" not in body and (m := _BINARY.search(body)):
            self.binary_hint = m["bin"]
        if self.version is None and (m := _VERSION.search(body)):
            self.version = m["v"]
        if _FAILURE.search(body):
            self.failures.append(cited)

    def _summary(self, body: str) -> bool:
        """``# Avg bus bandwidth`` or ``# Out of bounds values``; True if it was one."""
        if m := _AVG.search(body):
            self.avg = float(m["v"])
            return True
        if m := _OOB.search(body):
            self.oob = int(m["n"])
            self.oob_ok = m["verdict"] == "OK" if m["verdict"] else self.oob == 0
            return True
        return False

    def _column_header(self, words: list[str]) -> None:
        """A ``#`` line naming the columns tells whether rows have a root and an error column."""
        if "size" in words and "count" in words and "type" in words:
            self.has_root = "root" in words
            self.error_column = "error" in words and "#wrong" not in words

    def _size_row(self, number: int, tokens: list[str], cited: Line) -> None:
        if not _INT.match(tokens[0]) or len(tokens) < 4:
            return
        row = _row(tokens, self.has_root, self.error_column, cited)
        if row is not None:
            self.rows.append(row)
        elif len(tokens) >= 8:
            self.findings.append(
                Finding(
                    code="nccl-unparsed-row",
                    message="line starts like a size row but could not be read",
                    source=self.source,
                    line=number,
                )
            )

    def _facts(self) -> NcclTestFacts:
        rows = self.rows
        busbws = [b for r in rows for b in (r.oop_busbw, r.ip_busbw) if b is not None]
        wrong_total = sum(w for r in rows for w in (r.oop_wrong, r.ip_wrong) if w is not None)
        self._result_findings(wrong_total)
        ordered = sorted(self.devices.values(), key=lambda d: d.rank)
        return NcclTestFacts(
            source=self.source,
            collective=self.collective or self.binary_hint,
            header=self.header,
            n_threads=self.threads,
            n_gpus_per_process=self.gpus_per_proc,
            nccl_version=self.version,
            n_ranks=len({d.rank for d in ordered}),
            devices=tuple(ordered),
            gpu_models=_models(ordered),
            rows=tuple(rows),
            avg_busbw=self.avg,
            max_busbw=max(busbws) if busbws else None,
            wrong_total=wrong_total,
            out_of_bounds_values=self.oob,
            out_of_bounds_ok=self.oob_ok,
            failures=tuple(self.failures),
            findings=tuple(self.findings),
        )

    def _result_findings(self, wrong_total: int) -> None:
        """No rows at all, wrong values in the ``#wrong`` columns, out-of-bounds values."""
        if not self.rows:
            self.findings.append(
                Finding(code="nccl-no-rows", message="no result rows found", source=self.source)
            )
        if wrong_total:
            self.findings.append(
                Finding(
                    code="nccl-wrong-results",
                    message=f"{wrong_total} wrong values reported in the #wrong columns",
                    source=self.source,
                    severity="error",
                )
            )
        if self.oob_ok is False:
            self.findings.append(
                Finding(
                    code="nccl-out-of-bounds",
                    message=f"Out of bounds values: {self.oob} FAILED",
                    source=self.source,
                    severity="error",
                )
            )


def _device(m: re.Match[str], line: Line) -> NcclDevice:
    return NcclDevice(
        rank=int(m["rank"]),
        group=int(m["group"]) if m["group"] else None,
        pid=int(m["pid"]),
        host=m["host"],
        device=int(m["device"]),
        bus_id=m["bus"].strip(),
        model=m["model"],
        line=line,
    )


def _models(devices: list[NcclDevice]) -> tuple[str, ...]:
    """The GPU models in rank order, each once."""
    models: list[str] = []
    for device in devices:
        if device.model not in models:
            models.append(device.model)
    return tuple(models)
