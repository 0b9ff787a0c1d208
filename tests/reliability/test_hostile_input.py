"""Hostile input (issue 8): every parser and loader fuzzed, adversarial names everywhere a string
can reach a shell, a Docker API call or a template, and templates that never evaluate input.

Pure: no Docker, no SSH server, no Prefect server. The CLI runs against an inventory whose hosts
point at 127.0.0.1 port 1 (nothing listens there), with fake ``ssh``/``docker``/``nvidia-smi``
executables first on PATH that would leave a marker if anything ever ran them.

Sizes (tests/reliability/figures.py): each property runs ``size(SMALL, 10_000)`` examples; the
default small size is what CI runs, ``CUDAMEDIC_RELIABILITY=full`` the issue's 10,000. Figures
per parser/loader: examples run and exceptions escaped (goal 0); for names: adversarial names
tried, names that ran something (goal 0) and tracebacks (goal 0); for templates: template
injections evaluated (goal 0).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar
from xml.sax.saxutils import escape as xml_escape

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from runbooks.collect.bundle import open_bundle
from runbooks.collect.evidence.dmesg import KernelLogFacts, parse_kernel_log
from runbooks.collect.evidence.docker_inspect import InspectFacts, parse_inspect
from runbooks.collect.evidence.nccl_tests import NcclTestFacts, parse_nccl_tests
from runbooks.collect.evidence.nvidia_smi import (
    SmiFacts,
    SmiXmlFacts,
    parse_nvidia_smi,
    parse_nvidia_smi_xml,
)
from runbooks.collect.evidence.probes import (
    DockerInfo,
    TorchProbe,
    Ulimits,
    parse_df,
    parse_docker_info,
    parse_torch_probe,
    parse_ulimit,
    python_exceptions,
)
from runbooks.collect.evidence.text import MAX_SCAN_CHARS, looks_binary, split_lines
from runbooks.collect.inventory import Host, Inventory, load_inventory
from runbooks.collect.target import resolve_target
from runbooks.core import names
from runbooks.core.errors import InputError, TargetError
from runbooks.core.runbook import Runbook, Thresholds, parse_runbook
from runbooks.core.taxonomy import Incident
from runbooks.diagnose.classify import diagnose, render_text, to_json
from runbooks.diagnose.facts import gather, parse_uptime
from runbooks.diagnose.health import check_host, diff, snapshot
from runbooks.diagnose.logscan import ScanResult, scan_text
from tests.reliability.figures import FULL, record, size, zero

# Strategies holding 100 kB inputs (deep JSON) make Hypothesis warn about their repr; harmless.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

SUITE = "hostile input"
SMALL = 200  # examples per property at the small size: the whole file in about half a minute
EXAMPLES = size(SMALL, 10_000)
# Generated inputs are large on purpose (whole fixtures, mangled); the examples are the point.
SLOW_OK = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.large_base_example,
    HealthCheck.filter_too_much,
]
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
CORPUS = ROOT / "tests" / "corpus"
T = TypeVar("T")


class Fuzz:
    """One property's figures: examples run (counted in the body) and whether an exception other
    than the allowed ones escaped the code under test."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.examples = 0
        self.escaped = 0

    def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        allowed: tuple[type[BaseException], ...] = (),
        **kwargs: Any,
    ) -> T:
        try:
            return fn(*args, **kwargs)
        except allowed:
            raise
        except Exception:
            self.escaped = 1
            raise

    def run(self, inner: Callable[[], None]) -> None:
        try:
            inner()
        except BaseException:
            self._record()
            raise
        self._record()

    def _record(self) -> None:
        record(
            SUITE,
            f"{self.name}: examples",
            self.examples,
            f">= {EXAMPLES}",
            self.examples >= EXAMPLES,
        )
        zero(SUITE, f"{self.name}: exceptions escaped", self.escaped)


# ================================================================================ strategies


def read(path: Path) -> str:
    # bytes + decode, not read_text(): keep CR/LF exactly as stored
    return path.read_bytes().decode("utf-8", errors="replace")


def fixture_texts(directory: str, pattern: str) -> list[str]:
    return [read(p) for p in sorted((FIXTURES / directory).glob(pattern))]


def real_lines(directory: str, pattern: str) -> list[str]:
    return [line for text in fixture_texts(directory, pattern) for line in text.splitlines()]


def mixed(directory: str, pattern: str) -> st.SearchStrategy[str]:
    """Real lines shuffled, cut and mixed with random text: nearer misses than st.text()."""
    real = real_lines(directory, pattern)
    cut = st.tuples(st.sampled_from(real), st.integers(0, 200)).map(lambda t: t[0][: t[1]])
    line = st.one_of(st.sampled_from(real), cut, st.text(max_size=80))
    return st.lists(line, max_size=40).map("\n".join)


def corpus_files(suffix: str) -> list[str]:
    return [read(p) for p in sorted(CORPUS.rglob(f"*{suffix}"))]


SMI_TEXTS = fixture_texts("nvidia-smi", "*.txt")
XML_TEXTS = fixture_texts("nvidia-smi-xml", "*.xml")
DMESG_TEXTS = fixture_texts("dmesg", "*.txt")
NCCL_TEXTS = fixture_texts("nccl-tests", "*.txt")
HOST_TEXTS = fixture_texts("host-commands", "*.txt")
INSPECT_TEXTS = corpus_files(".inspect.json")
LOG_TEXTS = corpus_files(".log") + corpus_files("trigger.txt")
SPLICE = SMI_TEXTS + XML_TEXTS + DMESG_TEXTS + NCCL_TEXTS + HOST_TEXTS + LOG_TEXTS[:40]

HUGE_NUMBERS = [
    "9" * 400,
    "9" * 5000,
    "-" + "9" * 40,
    "18446744073709551616",
    "-9223372036854775809",
    "1e999",
    "-1e999",
    "NaN",
    "inf",
    "0x" + "f" * 40,
    "٣٤٥",  # Arabic-Indic digits: int() takes them, regexes' \d matches them
    "𝟗𝟗",  # mathematical bold digits
    "1_000",
    "00000000000000000000001",
    "-0",
    "1.5e308",
]
ODD_PIECES = [
    "\x00",
    "\r\n",
    "\r",
    "\ufeff",
    "\u2028",
    "\u202e",
    "\x1b[31m",
    "\ufffd",
    "\x85",
    "\x0c",
    "\t",
    "｜",  # fullwidth bar: looks like a table border
    "ＥＲＲ!",
    "𝐍𝐕𝐑𝐌: Xid",
    "\U0001f600",
    " " * 300,
    "#012",
    "<![CDATA[",
    "&#0;",
    "%s%n%x",
    "{{ 7*7 }}",
]
ANY_TEXT = st.one_of(
    st.text(max_size=1000),
    st.text(alphabet=st.characters(max_codepoint=0x2FF), max_size=600),
    st.binary(max_size=600).map(lambda b: b.decode("latin-1")),
    st.binary(max_size=600).map(lambda b: b.decode("utf-8", errors="replace")),
)
MUTATIONS = (
    "cut",
    "drop",
    "splice",
    "flip",
    "crlf",
    "cr",
    "nul",
    "number",
    "odd",
    "repeat",
    "long",
)


_OPS = st.sampled_from(MUTATIONS)
_SHORT_OPS = st.sampled_from([m for m in MUTATIONS if m != "long"])
_SPLICE = st.sampled_from(SPLICE)
_CHAR = st.characters(blacklist_categories=("Cs",))
_HUGE = st.sampled_from(HUGE_NUMBERS)
_ODD = st.sampled_from(ODD_PIECES)
# Positions are drawn as one integer taken modulo the length: strategies built per example
# (st.integers(0, len(text))) cost Hypothesis more than the parsers cost to run.
_AT = st.integers(0, 1 << 20)
_TIMES = st.integers(1, 4)


def _mutate(draw: st.DrawFn, text: str, long_lines: bool) -> str:
    """`text` after 1-4 of: cuts, dropped spans, splices of other real outputs, character flips,
    CRLF/CR line ends, NULs, huge/odd numbers, odd unicode, repeats and one very long line (not
    for the YAML loaders: PyYAML takes ~50 ms per 100 kB, and the text parsers own that case)."""
    for _ in range(draw(_TIMES)):
        op = draw(_OPS if long_lines else _SHORT_OPS)
        i = draw(_AT) % (len(text) + 1)
        if op == "cut":
            text = text[:i]
        elif op == "drop":
            text = text[:i] + text[i + draw(_AT) % 400 :]
        elif op == "splice":
            other = draw(_SPLICE)
            k = draw(_AT) % (len(other) + 1)
            text = text[:i] + other[k : k + draw(_AT) % 1500] + text[i:]
        elif op == "flip":
            text = text[:i] + draw(_CHAR) + text[i + 1 :]
        elif op == "crlf":
            text = text.replace("\n", "\r\n")
        elif op == "cr":
            text = text.replace("\n", "\r")
        elif op == "nul":
            text = text[:i] + "\x00" * (1 + draw(_AT) % 3) + text[i:]
        elif op == "number":
            number = draw(_HUGE)
            count = 1 + draw(_AT) % 8
            text = re.sub(r"\d+", lambda _m, n=number: n, text, count=count)
        elif op == "odd":
            text = text[:i] + draw(_ODD) + text[i:]
        elif op == "repeat":
            text = text + text[i : i + 5000]
        else:  # one line longer than the parsers' scan limit
            text = text[:i] + "A" * (MAX_SCAN_CHARS + 1) + "\n" + text[i:]
    return text


@st.composite
def mutated(draw: st.DrawFn, text: str, long_lines: bool = True) -> str:
    """`text`, mangled (see _mutate)."""
    return _mutate(draw, text, long_lines)


@st.composite
def _mangled(draw: st.DrawFn, base: st.SearchStrategy[str], long_lines: bool) -> str:
    return _mutate(draw, draw(base), long_lines)


def mangled(
    seeds: list[str], lines: st.SearchStrategy[str] | None = None, long_lines: bool = True
) -> Any:
    """Real outputs (or mixes of their lines), mangled."""
    base = st.sampled_from(seeds) if lines is None else st.one_of(st.sampled_from(seeds), lines)
    return _mangled(base, long_lines)


def text_inputs(seeds: list[str], directory: str = "", pattern: str = "") -> Any:
    lines = mixed(directory, pattern) if directory else None
    parts: list[Any] = [ANY_TEXT, mangled(seeds, lines)]
    if lines is not None:
        parts.append(lines)
    return st.one_of(*parts)


# -- JSON --------------------------------------------------------------------------------------
def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in _keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in _keys(v)}
    return set()


def _loads(text: str) -> Any:
    return json.loads(text)


INSPECT_SEEDS = [_loads(t) for t in INSPECT_TEXTS]
ALERT_SEEDS = [_loads(read(FIXTURES / "alerts" / "alertmanager-webhook.json"))]
TORCH_SEEDS: list[Any] = [
    {
        "python": "3.10.12",
        "torch": "2.1.0+cu121",
        "cuda": "12.1",
        "is_available": True,
        "device_count": 1,
        "devices": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}],
        "arch_list": ["sm_80", "sm_90"],
    },
    {"python": "3.11.4", "torch": None, "error": "ModuleNotFoundError: No module named 'torch'"},
    {"python": "3.10.12", "torch": "2.3.0+cpu", "cuda": None, "is_available": False},
]
DOCKER_INFO_SEEDS: list[Any] = [
    {
        "ServerVersion": "24.0.7",
        "DefaultRuntime": "runc",
        "Runtimes": {"runc": {"path": "runc"}, "nvidia": {"path": "nvidia-container-runtime"}},
        "DockerRootDir": "/var/lib/docker",
    }
]
META_SEEDS: list[Any] = [
    {
        "schema_version": 1,
        "host": "node07",
        "target": "node07",
        "containers": ["train"],
        "collected_at": "2026-12-02T10:00:00+00:00",
        "duration_s": 3.5,
        "trigger": "RuntimeError: CUDA error: invalid device ordinal",
        "collector": {"version": "0.1.0"},
        "sources": [
            {"name": "ssh", "status": "error", "error": "connection refused"},
            {"name": "nvidia-smi", "path": "nvidia-smi.txt", "status": "timeout"},
            {"name": "container-toolkit", "status": "failed", "error": "nvidia-ctk: not found"},
        ],
        "findings": [{"code": "host-key-accepted", "message": "x", "severity": "warning"}],
    }
]
SLACK_SEEDS: list[Any] = [
    {
        "type": "block_actions",
        "user": {"id": "U1", "username": "ann"},
        "channel": {"id": "C1"},
        "actions": [{"action_id": "cudamedic_approve", "value": '{"run": "r1"}'}],
        "message": {"ts": "1.2", "blocks": [{"text": {"text": "Fix"}}]},
    },
    {
        "type": "message_action",
        "callback_id": "cudamedic_triage",
        "trigger_id": "t1",
        "user": {"id": "U1"},
        "channel": {"id": "C1"},
        "message": {"text": "RuntimeError: CUDA error"},
    },
    {
        "type": "view_submission",
        "user": {"id": "U1"},
        "view": {
            "id": "V1",
            "callback_id": "cudamedic_triage_modal",
            "private_metadata": '{"text": "boom", "channel": "C1"}',
            "state": {"values": {"host": {"v": {"value": "node07"}}, "container": {"v": {}}}},
        },
    },
]
JSON_KEYS = sorted(
    set().union(*(_keys(s) for s in INSPECT_SEEDS + ALERT_SEEDS + SLACK_SEEDS + META_SEEDS))
)
HOSTILE_STRINGS = [
    "a;touch /tmp/cudamedic-pwned",
    "$(id)",
    "`id`",
    "<!channel>",
    "{{ 7*7 }}",
    "../../etc/passwd",
    "--help",
    "\x00",
    "ｔｒａｉｎ",
    "a" * 2000,
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**64, -(2**63) - 1, 10**400]),
    st.floats(),
    st.text(max_size=40),
    st.sampled_from(HOSTILE_STRINGS + HUGE_NUMBERS),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(JSON_KEYS), st.text(max_size=12)), inner, max_size=4
        ),
    ),
    max_leaves=12,
)
NASTY_JSON = [
    "[" * 100_000,
    '{"a":' * 100_000,
    "1e999",
    "NaN",
    "9" * 5000,
    "[]",
    "{}",
    "null",
    '""',
    "[{}]",
    "[[]]",
    '{"": ""}',
    "\ufeff{}",
    '"\\ud800"',
    '{"a": 1, "a": [2]}',
]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


_ACTIONS = st.sampled_from(["replace", "delete", "wrap"])


@st.composite
def json_mutated(draw: st.DrawFn, seeds: list[Any]) -> Any:
    """A real document with 1-3 subtrees replaced by random JSON, deleted or wrapped in a list."""
    value = json.loads(json.dumps(seeds[draw(_AT) % len(seeds)]))
    for _ in range(1 + draw(_AT) % 3):
        paths = list(_paths(value))
        path = paths[draw(_AT) % len(paths)]
        new = draw(JSON)
        if not path:
            value = new
            continue
        parent = value
        for part in path[:-1]:
            parent = parent[part]
        action = draw(_ACTIONS)
        if action == "replace":
            parent[path[-1]] = new
        elif action == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = [parent[path[-1]]]
    return value


def json_texts(seeds: list[Any], text_seeds: list[str] | None = None) -> Any:
    """JSON documents as text: random, mutated real ones, mangled real text and nasty corners."""
    dumps = json.dumps
    parts: list[Any] = [
        JSON.map(dumps),
        json_mutated(seeds).map(dumps),
        st.lists(json_mutated(seeds), max_size=2).map(dumps),
        st.sampled_from(NASTY_JSON),
        ANY_TEXT,
    ]
    if text_seeds:
        parts.append(mangled(text_seeds))
    return st.one_of(*parts)


# -- XML ----------------------------------------------------------------------------------------
XML_TAGS = sorted({m for t in XML_TEXTS for m in re.findall(r"<([a-z_0-9]+)[ >]", t)})
XML_VALUES = st.one_of(
    st.sampled_from(
        [
            "N/A",
            "Yes",
            "No",
            "Active",
            "Enabled",
            "0",
            "1",
            "85 C",
            "300.00 W",
            "81559 MiB",
            "00000000:3B:00.0",
            "ERR!",
            "[Unknown Error]",
            "[N/A]",
            "Requested functionality has been deprecated",
        ]
    ),
    st.sampled_from(HUGE_NUMBERS),
    st.text(max_size=20),
)
XML_ELEMENT = st.recursive(
    st.tuples(st.sampled_from(XML_TAGS), XML_VALUES).map(
        lambda t: f"<{t[0]}>{xml_escape(t[1])}</{t[0]}>"
    ),
    lambda kids: st.tuples(st.sampled_from(XML_TAGS), st.lists(kids, max_size=5)).map(
        lambda t: f"<{t[0]}>{''.join(t[1])}</{t[0]}>"
    ),
    max_leaves=40,
)
XML_DOCS = st.one_of(
    XML_ELEMENT.map(
        lambda body: f'<?xml version="1.0" ?>\n<nvidia_smi_log>{body}</nvidia_smi_log>'
    ),
    XML_ELEMENT,
)


def finding_codes(facts: Any) -> set[str]:
    return {f.code for f in facts.findings}


def assert_text_oddities_reported(facts: Any, text: str) -> None:
    """The text parsers' promise: binary junk and over-long lines are reported as findings."""
    if not text.strip():
        return
    codes = finding_codes(facts)
    if looks_binary(text):
        assert "binary-input" in codes
    if any(len(line) > MAX_SCAN_CHARS for line in split_lines(text)):
        assert "line-too-long" in codes


# ======================================================================== parsers (evidence)


def test_nvidia_smi_parser_never_raises_and_reports_oddities() -> None:
    fuzz = Fuzz("nvidia-smi parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(text_inputs(SMI_TEXTS, "nvidia-smi", "*.txt"))
    @example("| NVIDIA-SMI 550.54 Driver Version: 550.54 CUDA Version: 12.4 |")
    @example("\x00" * 20)
    def inner(text: str) -> None:
        fuzz.examples += 1
        facts = fuzz.call(parse_nvidia_smi, text)
        assert isinstance(facts, SmiFacts)
        assert_text_oddities_reported(facts, text)
        if not text.strip():
            assert facts.status == "empty"
        elif not (facts.gpus or facts.processes):
            # Nothing readable: either nvidia-smi's own error (cited) or a finding says so.
            named = facts.status not in ("ok", "empty") and facts.status_line is not None
            assert facts.findings or named

    fuzz.run(inner)


def test_nvidia_smi_xml_parser_never_raises_and_reports_oddities() -> None:
    fuzz = Fuzz("nvidia-smi XML parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(st.one_of(text_inputs(XML_TEXTS, "nvidia-smi-xml", "*.xml"), XML_DOCS))
    @example("<nvidia_smi_log/>")
    @example("<nvidia_smi_log></nvidia_smi_log>")
    @example('<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]><nvidia_smi_log>&e;')
    def inner(text: str) -> None:
        fuzz.examples += 1
        facts = fuzz.call(parse_nvidia_smi_xml, text)
        assert isinstance(facts, SmiXmlFacts)
        if "<!ENTITY" in text.upper():
            assert not facts.gpus and "xml-doctype-rejected" in finding_codes(facts)
        nothing = (
            not facts.gpus
            and facts.driver_version is None
            and facts.cuda_version is None
            and facts.attached_gpus is None
        )
        if nothing:
            assert facts.findings

    fuzz.run(inner)


def test_kernel_log_parser_never_raises_and_cites_real_lines() -> None:
    fuzz = Fuzz("kernel log parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(text_inputs(DMESG_TEXTS, "dmesg", "*.txt"))
    def inner(text: str) -> None:
        fuzz.examples += 1
        facts = fuzz.call(parse_kernel_log, text)
        assert isinstance(facts, KernelLogFacts)
        assert_text_oddities_reported(facts, text)
        if not text.strip():
            assert "kernel-log-empty" in finding_codes(facts)
            return
        lines = split_lines(text)
        assert facts.line_count == len(lines)
        cited = [x.line for x in facts.xids] + [k.line for k in facts.oom_kills]
        cited += [n.line for n in facts.nvrm] + list(facts.fell_off_bus)
        for line in cited:
            assert 1 <= line.line <= len(lines)
            assert line.text == lines[line.line - 1][:2000].rstrip()

    fuzz.run(inner)


def test_nccl_tests_parser_never_raises_and_reports_oddities() -> None:
    fuzz = Fuzz("nccl-tests parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(text_inputs(NCCL_TEXTS, "nccl-tests", "*.txt"))
    def inner(text: str) -> None:
        fuzz.examples += 1
        facts = fuzz.call(parse_nccl_tests, text)
        assert isinstance(facts, NcclTestFacts)
        assert_text_oddities_reported(facts, text)
        codes = finding_codes(facts)
        if not text.strip():
            assert "nccl-empty" in codes
        elif not facts.rows:
            assert "nccl-no-rows" in codes
        assert facts.wrong_total >= 0

    fuzz.run(inner)


CONTAINER_KEYS = {"Id", "Name", "Image", "Config", "HostConfig", "State"}


def _json_or_none(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def test_docker_inspect_parser_never_raises_and_reports_oddities() -> None:
    fuzz = Fuzz("docker inspect parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(json_texts(INSPECT_SEEDS, INSPECT_TEXTS))
    @example('{"Config": {"Env": 5}, "HostConfig": {"Ulimits": 1, "ShmSize": 1e999}}')
    def inner(text: str) -> None:
        fuzz.examples += 1
        facts = fuzz.call(parse_inspect, text)
        assert isinstance(facts, InspectFacts)
        # what the rules and fixes ask of it must not raise either
        fuzz.call(lambda: (facts.has_gpu_access, facts.wants_gpu, facts.ulimit("memlock")))
        ok, data = _json_or_none(text)
        if ok and isinstance(data, list):
            data = data[0] if data else None
        if not ok or not isinstance(data, dict) or not (data.keys() & CONTAINER_KEYS):
            assert facts.findings  # not JSON, or not a container: said so
        elif any(
            data.get(k) is not None and not isinstance(data.get(k), dict)
            for k in ("Config", "HostConfig", "State")
        ):
            assert facts.findings  # a section of the wrong type: said so

    fuzz.run(inner)


def test_torch_probe_parser_never_raises_and_reports_oddities() -> None:
    fuzz = Fuzz("torch probe parser")
    probe_lines = st.one_of(
        json_mutated(TORCH_SEEDS).map(json.dumps),
        st.sampled_from([t for t in NASTY_JSON if t.startswith("{")]),
    )
    texts = st.one_of(
        ANY_TEXT,
        st.tuples(ANY_TEXT, probe_lines, ANY_TEXT).map(lambda t: "\n".join(t)),
        st.sampled_from(["cudamedic: no python in this container", ""]),
    )

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(texts)
    def inner(text: str) -> None:
        fuzz.examples += 1
        probe = fuzz.call(parse_torch_probe, text)
        assert isinstance(probe, TorchProbe)
        fuzz.call(lambda: probe.cpu_only)
        if probe.present:
            assert probe.line is not None
        else:
            assert probe.findings  # no probe output: said so

    fuzz.run(inner)


ULIMIT_SEEDS = [
    "core file size          (blocks, -c) 0\ndata seg size           (kbytes, -d) unlimited\n"
    "max locked memory       (kbytes, -l) 64\nmax memory size         (kbytes, -m) unlimited\n"
    "open files                      (-n) 1048576\nstack size              (kbytes, -s) 8192\n",
    "time(seconds)        unlimited\nfile(blocks)         unlimited\ndata(kbytes)         "
    "unlimited\nstack(kbytes)        8192\nlockedmem(kbytes)    8192\n",
    "-t: cpu time (seconds)              unlimited\n-s: stack size (kbytes)             8192\n"
    "-l: locked memory (kbytes)          unlimited\n",
    *corpus_files("ulimit-a.txt"),
]
DF_SEEDS = [
    *[t for t in HOST_TEXTS if t.startswith("Filesystem")],
    *corpus_files("df.txt"),
    "Filesystem      Size  Used Avail Use% Mounted on\n"
    "shm              64M     0   64M   0% /dev/shm\n",
    "Filesystem                                   Size  Used Avail Use% Mounted on\n"
    "/dev/mapper/very-long-volume-group-name-root\n"
    "                              50G   45G  5.0G  91% /\n",
]


def test_ulimit_parser_never_raises_and_reports_oddities() -> None:
    fuzz = Fuzz("ulimit parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(st.one_of(ANY_TEXT, mangled(ULIMIT_SEEDS)))
    @example("max locked memory (kbytes, -l) " + "9" * 5000)
    def inner(text: str) -> None:
        fuzz.examples += 1
        limits = fuzz.call(parse_ulimit, text)
        assert isinstance(limits, Ulimits)
        for value in (limits.memlock_kb, limits.stack_kb):
            assert value is None or value >= -1
        if text.strip() and limits.memlock_kb is None and limits.stack_kb is None:
            assert limits.findings  # nothing readable: said so

    fuzz.run(inner)


def test_df_parser_never_raises() -> None:
    fuzz = Fuzz("df parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(st.one_of(ANY_TEXT, mangled(DF_SEEDS)))
    @example("shm " + "9" * 400 + "M 0 64M 0% /dev/shm")
    def inner(text: str) -> None:
        fuzz.examples += 1
        filesystems = fuzz.call(parse_df, text)
        assert isinstance(filesystems, tuple)
        lines = text.splitlines()
        for fs in filesystems:
            assert fs.size is None or fs.size >= 0
            assert 1 <= fs.line.line <= len(lines)

    fuzz.run(inner)


def test_docker_info_parser_never_raises_and_reports_oddities() -> None:
    fuzz = Fuzz("docker info parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(json_texts(DOCKER_INFO_SEEDS))
    def inner(text: str) -> None:
        fuzz.examples += 1
        info = fuzz.call(parse_docker_info, text)
        assert isinstance(info, DockerInfo)
        fuzz.call(lambda: info.has_nvidia_runtime)
        ok, data = _json_or_none(text)
        if not ok or not isinstance(data, dict):
            assert info.findings

    fuzz.run(inner)


def test_python_exception_finder_never_raises_and_cites_real_lines() -> None:
    fuzz = Fuzz("python exception finder")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(text_inputs(LOG_TEXTS))
    def inner(text: str) -> None:
        fuzz.examples += 1
        found = fuzz.call(python_exceptions, text, "containers/x.log")
        lines = text.splitlines()
        for line in found:
            assert 1 <= line.line <= len(lines)
            assert line.text == lines[line.line - 1].strip()[:500]

    fuzz.run(inner)


def test_signature_scan_never_raises_and_cites_real_lines() -> None:
    fuzz = Fuzz("signature scanner")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(
        st.one_of(text_inputs(LOG_TEXTS), text_inputs(DMESG_TEXTS, "dmesg", "*.txt")),
        st.sampled_from(["log", "kernel", "smi", "any"]),
    )
    def inner(text: str, kind: Any) -> None:
        fuzz.examples += 1
        result = fuzz.call(scan_text, text, "containers/x.log", kind)
        assert isinstance(result, ScanResult)
        data = text.encode("utf-8", errors="replace")
        expected = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        assert result.lines == expected
        lines = data.split(b"\n")
        for hits in result.hits.values():
            assert hits.count >= len(hits.lines()) > 0
            for line in hits.lines():
                assert 1 <= line.line <= expected
                real = lines[line.line - 1].decode("utf-8", errors="replace").rstrip("\r")
                if len(real) <= 500:
                    assert line.text == real

    fuzz.run(inner)


# ===================================================================== bundles, then classify

BUNDLE_FILES = [
    "nvidia-smi.txt",
    "nvidia-smi.xml",
    "dmesg.txt",
    "nccl-tests.txt",
    "docker-info.json",
    "trigger.txt",
    "commands/df.txt",
    "commands/uptime.txt",
    "commands/container-toolkit.txt",
    "commands/lsmod-nvidia.txt",
    "commands/ulimit-a.txt",
    "commands/nvidia-smi-L.txt",
]
CONTAINER_SUFFIXES = [
    ".inspect.json",
    ".log",
    ".exec-torch.txt",
    ".exec-ulimit.txt",
    ".exec-shm.txt",
    ".exec-env.txt",
    ".exec-nvidia-smi-L.txt",
]


def _corpus_cases() -> list[dict[str, str]]:
    cases = []
    for case in sorted(p for p in CORPUS.iterdir() if p.is_dir()):
        files = {
            p.relative_to(case).as_posix(): read(p)
            for p in sorted(case.rglob("*"))
            if p.is_file() and p.name != "case.yaml"
        }
        cases.append(files)
    return cases


CASES = _corpus_cases()
FILE_NAME = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
    min_size=1,
    max_size=16,
).filter(lambda s: s not in (".", ".."))


def _content(rel: str) -> Any:
    """What a file of this name is filled with: garbage, or mangled real output of its kind."""
    for suffix in (".inspect.json", ".exec-torch.txt", ".exec-ulimit.txt", ".exec-shm.txt"):
        if rel.endswith(suffix):
            return _CONTENT[suffix]
    return _CONTENT.get(rel, _CONTENT["log"])


def _content_strategies() -> dict[str, Any]:
    def text(seeds: list[str]) -> Any:
        return st.one_of(ANY_TEXT, mangled(seeds))

    return {
        "bundle.json": json_texts(META_SEEDS),
        ".inspect.json": json_texts(INSPECT_SEEDS, INSPECT_TEXTS[:4]),
        "docker-info.json": json_texts(DOCKER_INFO_SEEDS),
        ".exec-torch.txt": st.one_of(ANY_TEXT, json_mutated(TORCH_SEEDS).map(json.dumps)),
        "nvidia-smi.txt": text(SMI_TEXTS),
        "nvidia-smi.xml": text(XML_TEXTS),
        "dmesg.txt": text(DMESG_TEXTS),
        "nccl-tests.txt": text(NCCL_TEXTS),
        "commands/df.txt": text(DF_SEEDS),
        ".exec-shm.txt": text(DF_SEEDS),
        "commands/ulimit-a.txt": text(ULIMIT_SEEDS),
        ".exec-ulimit.txt": text(ULIMIT_SEEDS),
        "log": text(LOG_TEXTS[:40]),
    }


_CONTENT = _content_strategies()


_REL = st.one_of(
    st.sampled_from(["bundle.json", *BUNDLE_FILES]),
    st.tuples(
        st.one_of(st.sampled_from(["train", "log"]), FILE_NAME),
        st.sampled_from(CONTAINER_SUFFIXES),
    ).map(lambda t: f"containers/{t[0]}{t[1]}"),
    FILE_NAME,
    FILE_NAME.map(lambda n: f"commands/{n}"),
)


@st.composite
def bundle_files(draw: st.DrawFn) -> dict[str, str]:
    """A bundle directory's files: a real corpus case (or none), some files mangled, some
    generated (every kind the readers look for, plus odd names), some dropped."""
    files = dict(CASES[draw(_AT) % len(CASES)]) if draw(st.booleans()) else {}
    for _ in range(draw(_AT) % 4 if files else 0):  # mangle or empty a few real files
        rel = sorted(files)[draw(_AT) % len(files)]
        files[rel] = _mutate(draw, files[rel], True) if draw(st.booleans()) else ""
    for _ in range(draw(_AT) % 6):
        rel = draw(_REL)
        files[rel] = draw(_content(rel))
    for _ in range(draw(_AT) % 3):  # and drop one or two
        if files:
            files.pop(sorted(files)[draw(_AT) % len(files)])
    return files


def _write_tree(root: Path, files: dict[str, str]) -> dict[str, str]:
    """Write `files` under a fresh `root`; returns those written (a generated file named like a
    directory of another one, e.g. 'commands', cannot be both)."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    written = {}
    for rel, text in files.items():
        dest = root / rel
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        except OSError:
            continue
        written[rel] = text
    return written


def _write_tar(path: Path, files: dict[str, str], hostile: list[str]) -> None:
    """A bundle .tar.gz of `files`, plus members that try to escape and a symlink."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in [
            *((f"bundle/{r}", t) for r, t in files.items()),
            *((h, "x") for h in hostile),
        ]:
            data = text.encode("utf-8", errors="surrogateescape")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("bundle/containers/evil.log")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)


INCIDENTS = {i.value for i in Incident}
HOSTILE_MEMBERS = ["../escape.txt", "/tmp/cudamedic-abs-escape.txt", "bundle/../../escape2.txt"]


def _classify_and_check(path: Path, fuzz: Fuzz, meta_written: str | None) -> None:
    with open_bundle(path) as bundle:
        facts = fuzz.call(gather, bundle)
        uptime = fuzz.call(parse_uptime, bundle.files.get("commands/uptime.txt"))
        status = {s.name: s.status for s in bundle.meta.sources} if bundle.meta else {}
        host = bundle.meta.host if bundle.meta else None
    diagnosis = fuzz.call(diagnose, facts, host=host)
    assert diagnosis.incident in INCIDENTS
    assert 0.0 <= diagnosis.confidence <= 1.0
    assert isinstance(fuzz.call(render_text, diagnosis), str)
    json.dumps(fuzz.call(to_json, diagnosis))
    health = fuzz.call(
        check_host, "node07", facts, Thresholds(), source_status=status, uptime_s=uptime
    )
    assert health.verdict in ("healthy", "warning", "drain")
    codes = {f.code for f in facts.findings}
    if meta_written is not None and bundle.meta is None:
        assert "bundle-json-invalid" in codes  # an unreadable bundle.json is said so


def test_bundle_reader_and_classifier_never_raise_on_garbage_bundles() -> None:
    fuzz = Fuzz("bundle reader + classify")
    work = Path(tempfile.mkdtemp(prefix="cudamedic-fuzz-bundle-"))

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(bundle_files(), st.integers(0, 9))
    def inner(files: dict[str, str], form: int) -> None:
        fuzz.examples += 1
        root = work / "b"
        written = _write_tree(root / "src", files)
        meta = written.get("bundle.json")
        if form == 0:  # one in ten as a .tar.gz, with members that try to escape
            tar = root / "bundle.tar.gz"
            _write_tar(tar, written, HOSTILE_MEMBERS)
            try:
                _classify_and_check(tar, fuzz, meta)
            except InputError as exc:
                pytest.fail(f"a well-formed .tar.gz bundle was refused: {exc}")
            assert not (work / "escape.txt").exists() and not (root / "escape.txt").exists()
            assert not Path("/tmp/cudamedic-abs-escape.txt").exists()
            return
        if form == 1 and written:  # one in ten as a single log file (read as the container log)
            log = root / "pasted.log"
            log.write_bytes(next(iter(written.values())).encode("utf-8", "surrogateescape"))
            _classify_and_check(log, fuzz, None)
            return
        _classify_and_check(root / "src", fuzz, meta)

    try:
        fuzz.run(inner)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize(
    "data",
    [b"", b"not a tar", b"\x1f\x8b\x08\x00" + b"\x00" * 40, b"\x1f\x8b" + os.urandom(200)],
    ids=["empty", "text", "gzip-header-only", "gzip-random"],
)
def test_unreadable_tar_bundle_is_a_clear_input_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "x.tar.gz"
    path.write_bytes(data)
    with pytest.raises(InputError, match=r"not a readable \.tar\.gz bundle"), open_bundle(path):
        pass


# ======================================================================== loaders (config)


def _yaml_dump(value: Any) -> str:
    return yaml.safe_dump(value, allow_unicode=True)


HOST_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "address": st.one_of(st.sampled_from(["10.0.0.7", "node.example.com", "::1"]), SCALARS),
        "port": st.one_of(st.integers(-5, 70_000), SCALARS),
        "user": st.one_of(st.sampled_from(["root", "ubuntu"]), SCALARS),
        "key_file": st.one_of(st.sampled_from(["~/.ssh/id", "~nosuchuser/.ssh/id"]), SCALARS),
        "jump": st.one_of(st.sampled_from(["bastion", "u@b.example.com:2222", "b:x"]), SCALARS),
        "tags": st.one_of(st.lists(st.text(max_size=8), max_size=3), SCALARS),
        "gpus": st.one_of(st.integers(-1, 16), SCALARS),
        "docker_host": st.one_of(st.just("unix:///var/run/docker.sock"), SCALARS),
        "accept_unknown_host_key": SCALARS,
        "ansible_host": SCALARS,
        "ansible_port": SCALARS,
        "ansible_ssh_common_args": st.one_of(st.just("-J u@bastion:22"), SCALARS),
    },
)
HOST_NAMES = st.one_of(st.sampled_from(["node07", "bastion", "gpu-1"]), st.text(max_size=12))
NATIVE = st.fixed_dictionaries(
    {
        "hosts": st.one_of(
            st.dictionaries(HOST_NAMES, st.one_of(HOST_FIELDS, JSON), max_size=4), JSON
        )
    },
    optional={"defaults": st.one_of(HOST_FIELDS, JSON)},
)
ANSIBLE = st.recursive(
    st.fixed_dictionaries(
        {},
        optional={
            "hosts": st.one_of(
                st.dictionaries(HOST_NAMES, st.one_of(HOST_FIELDS, JSON), max_size=3), JSON
            ),
            "vars": st.one_of(HOST_FIELDS, JSON),
        },
    ),
    lambda inner: st.fixed_dictionaries(
        {"children": st.one_of(st.dictionaries(HOST_NAMES, inner, max_size=3), JSON)},
        optional={"hosts": JSON, "vars": JSON},
    ),
    max_leaves=6,
).map(lambda group: {"all": group})
INI_TOKEN = st.one_of(
    st.sampled_from(
        [
            "ansible_host=10.0.0.7",
            "ansible_port=2222",
            "ansible_user=root",
            "ansible_port=99999",
            "ansible_host=$(touch /tmp/cudamedic-pwned)",
            "'unterminated",
            "a=b=c",
            "novalue",
            "ansible_ssh_common_args='-J u@bastion'",
            "\\",
        ]
    ),
    st.text(max_size=12),
)
INI_LINE = st.one_of(
    st.sampled_from(["[gpu]", "[gpu:vars]", "[gpu:children]", "[broken", "# c", "; c", ""]),
    st.tuples(HOST_NAMES, st.lists(INI_TOKEN, max_size=3)).map(lambda t: " ".join([t[0], *t[1]])),
    st.text(max_size=40),
)
INI = st.lists(INI_LINE, max_size=12).map("\n".join)
INVENTORY_SEEDS = [read(ROOT / "deploy" / "inventory.example.yaml")]
INVENTORY_TEXTS = st.one_of(
    ANY_TEXT,
    NATIVE.map(_yaml_dump),
    ANSIBLE.map(_yaml_dump),
    INI,
    mangled(INVENTORY_SEEDS, long_lines=False),
    st.sampled_from(
        [
            "all: &a {children: {g: *a}}",  # a group that contains itself
            "hosts: &h {a: {address: 10.0.0.1}, b: *h}",
            "a: &a [*a]\n",
            "hosts: {x: {port: .inf}}",
            "hosts: {x: {port: .nan}}",
            "hosts: {x: {key_file: '~nosuchuser_xyz/k'}}",
            "hosts: {x: {jump: 'u@h:notaport'}}",
            "hosts: {x: {address: 'fe80::1%$(touch /tmp/cudamedic-pwned)'}}",
            "all: {vars: [1], hosts: {a: {}}}",
            "all: {hosts: [a, b]}",
            "all: {hosts: {a: x}}",
            "all: {children: [a]}",
            "hosts: {1: {}, 2.5: {}, null: {}}",
            "hosts: {x: !!binary aGVsbG8=}",
        ]
    ),
)


def _check_host_is_safe(host: Host, inventory: Inventory) -> None:
    """Everything of a loaded host that can reach SSH, a shell or Docker passed validation."""
    assert names.inventory_name(host.name) == host.name
    assert names.host_address(host.address)
    assert 1 <= host.port <= 65535
    if host.user is not None:
        assert names.user_name(host.user) == host.user
    if host.jump is not None and host.jump not in inventory.hosts:
        for hop in host.jump.split(","):  # a ProxyJump chain: every hop [user@]host[:port]
            user, _, rest = hop.rpartition("@")
            address, _, port = rest.partition(":")
            if user:
                names.user_name(user)
            names.host_address(address)
            if port:
                names.port(port)


def test_inventory_loader_gives_an_inventory_or_a_clear_input_error() -> None:
    fuzz = Fuzz("inventory loader")
    work = Path(tempfile.mkdtemp(prefix="cudamedic-fuzz-inventory-"))

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(INVENTORY_TEXTS, st.sampled_from(["inventory.yaml", "hosts.ini", "hosts", "inv.cfg"]))
    @example("[" * 600, "inventory.yaml")  # deeper than PyYAML's recursion (and slow: explicit)
    @example("- " * 5000, "hosts")
    def inner(text: str, name: str) -> None:
        fuzz.examples += 1
        path = work / name
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        try:
            inventory = fuzz.call(load_inventory, path, allowed=(InputError,))
        except InputError as exc:
            assert str(path) in str(exc)  # the message names the file
            return
        for host in inventory.hosts.values():
            _check_host_is_safe(host, inventory)

    try:
        fuzz.run(inner)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _packaged(kind: str) -> Any:
    return yaml.safe_load(read(ROOT / "runbooks" / f"{kind}.yaml"))


RUNBOOK_SEEDS = [_packaged("incident"), _packaged("sweep")]


def test_runbook_loader_gives_a_runbook_or_a_clear_input_error() -> None:
    fuzz = Fuzz("runbook loader")
    texts = st.one_of(
        ANY_TEXT,
        JSON.map(_yaml_dump),
        json_mutated(RUNBOOK_SEEDS).map(_yaml_dump),
        mangled(
            [read(ROOT / "runbooks" / f"{k}.yaml") for k in ("incident", "sweep")],
            long_lines=False,
        ),
        st.sampled_from(
            ["a: &a [*a]", "{? [a]: 1}", "!!python/object:os.system x", "x: 9" + "9" * 5000]
        ),
    )

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(texts)
    @example("[" * 600)  # deeper than PyYAML's recursion (and slow: explicit)
    @example("- " * 5000)
    def inner(text: str) -> None:
        fuzz.examples += 1
        try:
            book = fuzz.call(parse_runbook, text, "fuzz.yaml", allowed=(InputError,))
        except InputError as exc:
            assert "fuzz.yaml" in str(exc)
            return
        assert isinstance(book, Runbook)
        for src in book.host_sources:  # where output lands stays inside the bundle
            assert ".." not in src.path.split("/") and not src.path.startswith("/")
        for probe in book.container_probes:  # exec argv, never a shell line of ours
            assert _shell_inert(probe.name) and all(isinstance(arg, str) for arg in probe.argv)

    fuzz.run(inner)


@pytest.mark.parametrize(
    "source",
    [
        "{name: x, path: ../../etc/cron.d/x, command: id}",
        "{name: x, path: /etc/passwd, command: id}",
        "{name: x, path: commands/../../x, command: id}",
        "{name: 'x;touch /tmp/p', path: x.txt, command: id}",
        "{name: x, path: 'x.txt\\n', command: id}",
    ],
)
def test_runbook_names_and_paths_are_refused_not_cleaned(source: str) -> None:
    text = f"name: r\nkind: incident\nhost_sources:\n  - {source}\n"
    with pytest.raises(InputError, match="host_sources"):
        parse_runbook(text, "hostile.yaml")
    probe = "name: r\nkind: incident\nhost_sources: [{name: a, path: a.txt, command: id}]\n"
    with pytest.raises(InputError, match="container_probes"):
        parse_runbook(probe + "container_probes: [{name: ../x, argv: [id]}]\n", "hostile.yaml")


SETTINGS_SEEDS = [yaml.safe_load(read(ROOT / "deploy" / "cudamedic.example.yaml"))]


def test_settings_file_loader_gives_settings_or_a_clear_input_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from runbooks.core.settings import Settings, load_settings

    fuzz = Fuzz("settings file loader")
    path = tmp_path / "cudamedic.yaml"
    for key in [k for k in os.environ if k.startswith("CUDAMEDIC_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("CUDAMEDIC_CONFIG", str(path))
    texts = st.one_of(
        ANY_TEXT,
        JSON.map(_yaml_dump),
        json_mutated(SETTINGS_SEEDS).map(_yaml_dump),
        mangled([read(ROOT / "deploy" / "cudamedic.example.yaml")], long_lines=False),
        st.sampled_from(["a: &a [*a]", "ssh_connect_timeout: .nan", "\x00", "x: " + "9" * 5000]),
    )

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(texts)
    @example("[" * 600)  # deeper than PyYAML's recursion (and slow: explicit)
    @example("- " * 5000)
    def inner(text: str) -> None:
        fuzz.examples += 1
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        try:
            loaded = fuzz.call(load_settings, allowed=(InputError,))
        except InputError as exc:
            assert str(exc).strip()
            return
        assert isinstance(loaded, Settings)

    fuzz.run(inner)


def test_fix_policy_loader_gives_a_policy_or_a_clear_input_error(tmp_path: Path) -> None:
    from runbooks.core.policy import Policy, load_policy

    fuzz = Fuzz("fix policy loader")
    path = tmp_path / "policy.yaml"
    seeds = [yaml.safe_load(read(ROOT / "deploy" / "policy.example.yaml"))]
    texts = st.one_of(
        ANY_TEXT,
        JSON.map(_yaml_dump),
        json_mutated(seeds).map(_yaml_dump),
        mangled([read(ROOT / "deploy" / "policy.example.yaml")], long_lines=False),
        st.sampled_from(["unattended: &a {x: *a}", "max_fixes_per_hour: .inf", "x: " + "9" * 5000]),
    )

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(texts)
    @example("[" * 600)  # deeper than PyYAML's recursion (and slow: explicit)
    @example("- " * 5000)
    def inner(text: str) -> None:
        fuzz.examples += 1
        path.write_bytes(text.encode("utf-8", errors="surrogateescape"))
        try:
            policy = fuzz.call(load_policy, path, allowed=(InputError,))
        except InputError as exc:
            assert str(path) in str(exc)
            return
        assert isinstance(policy, Policy)
        assert isinstance(policy.allows_unattended("shm-too-small", ("a",)), bool)

    fuzz.run(inner)


def test_uptime_parser_gives_seconds_or_none() -> None:
    fuzz = Fuzz("uptime parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(st.one_of(st.none(), ANY_TEXT, mangled(["12345.67 54321.00\n"])))
    @example("nan 1")
    @example("-5 1")
    @example("1e999 1")
    def inner(text: str | None) -> None:
        fuzz.examples += 1
        value = fuzz.call(parse_uptime, text)
        assert value is None or (math.isfinite(value) and value >= 0)

    fuzz.run(inner)


# ============================================================ alerts, Slack, stored state


def _inventory() -> Inventory:
    return Inventory(
        hosts={
            "node07": Host(name="node07", address="10.0.0.7"),
            "node08": Host(name="node08", address="10.0.0.8"),
        }
    )


def test_alertmanager_payloads_give_alerts_or_a_clear_input_error() -> None:
    from flows.alerts import parse_alertmanager

    fuzz = Fuzz("Alertmanager payload parser")
    inventory = _inventory()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(st.one_of(JSON, json_mutated(ALERT_SEEDS)))
    def inner(body: Any) -> None:
        fuzz.examples += 1
        try:
            alerts = fuzz.call(parse_alertmanager, body, inventory, allowed=(InputError,))
        except InputError:
            return
        for alert in alerts:
            assert alert.host in (None, "node07", "node08")
            assert len(alert.alertname) <= 200 and len(alert.summary) <= 1000

    fuzz.run(inner)


def test_alert_receiver_answers_hostile_bodies_with_4xx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a loopback socket: deep nesting, non-JSON, non-UTF-8 and odd shapes get a clear
    4xx (or 202 with nothing announced), never a dropped connection."""
    import flows.alerts as alerts

    announced: list[Any] = []
    monkeypatch.setattr(alerts, "announce", announced.append)
    server = alerts.make_server("127.0.0.1", 0, "s3cret", _inventory(), alerts.Seen())
    url = server.start().url + "/alertmanager"
    bodies = [
        b"[" * 500_000,
        b'{"alerts": ' + b"[" * 100_000,
        b"\xff\xfe\x00garbage",
        b"null",
        b'{"alerts": "x"}',
        b'{"alerts": [1, "a", null, {"labels": "x", "annotations": []}]}',
        json.dumps({"alerts": [{"labels": {"host": "$(touch /tmp/x)"}}]}).encode(),
    ]
    try:
        for body in bodies:
            req = urllib.request.Request(
                url, data=body, headers={"Authorization": "Bearer s3cret"}, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    status = resp.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status in (202, 400), (body[:40], status)
    finally:
        server.stop()
    assert announced == []


SLACK_TOKENS = st.one_of(
    st.sampled_from(["triage", "node07", "node08", "train", "--", "-", "—", "triage\u200b"]),
    st.sampled_from(HOSTILE_STRINGS),
    st.text(max_size=12),
)


def test_slack_command_text_is_parsed_or_refused() -> None:
    from flows.slack.app import parse_command

    fuzz = Fuzz("Slack command parser")
    inventory = _inventory()
    texts = st.one_of(
        st.text(max_size=200),
        st.lists(SLACK_TOKENS, max_size=6).map(" ".join),
        st.lists(SLACK_TOKENS, max_size=3).map(lambda t: "triage node07 " + " ".join(t)),
    )

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(texts)
    def inner(text: str) -> None:
        fuzz.examples += 1
        try:
            host, container, trigger = fuzz.call(
                parse_command, text, inventory, allowed=(InputError,)
            )
        except InputError as exc:
            assert "\n" not in str(exc)  # one clear line back to the user
            return
        assert host in inventory.hosts
        assert container is None or names.container_name(container) == container
        assert trigger is None or len(trigger) <= 4000

    fuzz.run(inner)


def _slack_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Any, list[Any]]:
    """A SlackApp whose outside world (Slack API, Prefect, threads) is replaced by a log."""
    import flows.slack.app as slack
    from runbooks.core.settings import Settings

    calls: list[Any] = []
    monkeypatch.setattr(slack, "deliver", lambda *a, **k: calls.append(("deliver", a, k)))
    monkeypatch.setattr(slack.SlackApp, "_start", lambda self, *a: calls.append(("start", a)))
    monkeypatch.setattr(slack.SlackApp, "_decide", lambda self, *a: calls.append(("decide", a)))

    class NoThread:
        def __init__(self, target: Any = None, args: Any = (), **_: Any) -> None:
            self.target, self.args = target, args

        def start(self) -> None:
            self.target(*self.args)

    # flows.slack.app's own name for the module only: the test's servers still get real threads
    monkeypatch.setattr(slack, "threading", SimpleNamespace(Thread=NoThread, Lock=threading.Lock))
    app_settings = Settings(
        slack_bot_token="xoxb-test",  # type: ignore[arg-type]
        slack_signing_secret="sig",  # type: ignore[arg-type]
        state_dir=tmp_path,
    )
    return slack.SlackApp(app_settings, _inventory()), calls


def test_slack_interactions_never_raise(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    app, calls = _slack_app(monkeypatch, tmp_path)
    fuzz = Fuzz("Slack interaction parser")

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(st.one_of(JSON, json_mutated(SLACK_SEEDS)))
    def inner(payload: Any) -> None:
        fuzz.examples += 1
        calls.clear()
        answer = fuzz.call(app.interaction, payload)
        assert answer is None or isinstance(answer, dict)
        for call in calls:
            if call[0] == "start":
                host, container = call[1][0], call[1][1]
                assert host in app.inventory.hosts
                assert container is None or names.container_name(container) == container

    fuzz.run(inner)


def test_slack_endpoint_answers_hostile_signed_bodies(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import hashlib
    import hmac
    import time

    app, calls = _slack_app(monkeypatch, tmp_path)
    server = app.server("127.0.0.1", 0)
    base = server.start().url

    def post(path: str, body: bytes, ts: str | None = None, sig: str | None = None) -> int:
        ts = ts or str(int(time.time()))
        mac = hmac.new(b"sig", f"v0:{ts}:".encode() + body, hashlib.sha256).hexdigest()
        headers = {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig or "v0=" + mac}
        req = urllib.request.Request(base + path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    payloads = ["[" * 200_000, "[1]", '"x"', "null", '{"type": "block_actions", "user": "x"}']
    try:
        for i, raw in enumerate(payloads):  # signed, so they reach the payload parser
            body = b"payload=" + urllib.parse.quote(raw).encode() + f"&n={i}".encode()
            assert post("/slack/interactive", body) in (200, 400), raw[:20]
        text = urllib.parse.quote("triage node07 a;touch /tmp/x")
        assert post("/slack/commands", f"text={text}&user_id=U1".encode()) == 200
        # unsigned junk is refused before anything reads it, never a dropped connection
        assert post("/slack/commands", b"text=\xff\xfe%00&user_id=U1") in (200, 401)
        assert post("/slack/commands", b"text=x", ts="not-a-number", sig="v0=0") == 401
        assert post("/slack/commands", b"text=x", ts="9" * 5000, sig="v0=0") == 401
    finally:
        server.stop()
    assert not [c for c in calls if c[0] in ("start", "decide")]


STATE_TEXTS = st.one_of(
    ANY_TEXT,
    JSON.map(json.dumps),
    st.fixed_dictionaries({"hosts": JSON}).map(json.dumps),
    st.fixed_dictionaries(
        {
            "hosts": st.dictionaries(
                st.text(max_size=8),
                st.one_of(JSON, st.dictionaries(st.text(max_size=8), JSON, max_size=3)),
                max_size=3,
            )
        }
    ).map(json.dumps),
    st.lists(JSON.map(json.dumps), max_size=4).map("\n".join),
    st.sampled_from(NASTY_JSON),
)


def test_stored_state_readers_survive_corrupt_files(tmp_path: Path) -> None:
    """Files cudamedic keeps between runs (sweep state, seen alerts, the Slack outbox, fix
    journals) may be cut by a crash or edited by hand: reading them never raises."""
    from flows.alerts import Seen
    from flows.slack.app import flush_outbox
    from runbooks.core.settings import Settings
    from runbooks.diagnose.health import HealthFinding, HostHealth
    from runbooks.diagnose.sweep import read_state_file
    from runbooks.fix.journal import Journal

    fuzz = Fuzz("stored state readers")
    state_settings = Settings(  # the local cache of the outbox; the fleet, this test's own
        state_dir=tmp_path,
        slack_bot_token="xoxb-x",  # type: ignore[arg-type]
        fleet="t-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12],
    )
    sent: list[Any] = []

    class Client:
        def api_call(self, method: str, json: Any = None) -> Any:
            sent.append(method)
            return type("R", (), {"data": {"ok": True}})()

        def files_upload_v2(self, **_: Any) -> Any:
            return type("R", (), {"data": {"ok": True}})()

    after = snapshot(
        [
            HostHealth(
                host="node07",
                verdict="drain",
                findings=(HealthFinding(code="xid-79", level="drain", message="m", subject="x"),),
            )
        ]
    )
    journal = Journal(tmp_path, "node07", "train")
    journal.path.parent.mkdir(parents=True, exist_ok=True)

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(STATE_TEXTS)
    def inner(text: str) -> None:
        fuzz.examples += 1
        data = text.encode("utf-8", errors="surrogateescape")
        state = tmp_path / "sweep-state.json"
        state.write_bytes(data)
        before = fuzz.call(read_state_file, state)
        for change in fuzz.call(diff, before, after):
            assert change.change in ("new", "changed", "resolved")
        seen_file = tmp_path / "alerts.json"
        seen_file.write_bytes(data)
        assert fuzz.call(Seen, seen_file).first_time("k") in (True, False)
        outbox = tmp_path / "slack-outbox.jsonl"
        outbox.write_bytes(data)
        assert fuzz.call(flush_outbox, state_settings, Client()) >= 0
        journal.path.write_bytes(data)
        assert isinstance(fuzz.call(journal.records), list)

    fuzz.run(inner)


# ====================================================================== adversarial names


def adversarial(canary: Path) -> list[str]:
    """Names an attacker (or a careless paste) would try; `canary` must never appear."""
    c = str(canary)
    return [
        f"a;touch {c}",
        f"a; touch {c}",
        f"$(touch {c})",
        f"`touch {c}`",
        f"a|touch {c}",
        f"a&&touch {c}",
        f"a||touch {c}",
        f"a&touch {c}",
        f"a\ntouch {c}",
        f"a\rtouch {c}",
        f"a\x00;touch {c}",
        "a\x00b",
        f">{c}",
        f"a>{c}",
        f"<{c}",
        f"a'$(touch {c})'",
        f'a"$(touch {c})"',
        f"a${{IFS}}touch${{IFS}}{c}",
        "../etc/passwd",
        "../../../../tmp/x",
        "a/../../b",
        "/etc/shadow",
        ".",
        "..",
        "-rf",
        "--help",
        f"-oProxyCommand=touch {c}",
        "--privileged",
        "-v/:/host",
        "a" * 256,
        "a" * 10_000,
        "ｔｒａｉｎ",  # fullwidth
        "trаin",  # Cyrillic a
        "train\u200b",  # zero-width space
        "train\u202e",  # right-to-left override
        "train\u0301",  # combining accent
        "{{7*7}}",
        "{% for x in range(3) %}x{% endfor %}",
        "${jndi:ldap://x}",
        "%s%s%s%n",
        "%(x)s",
        "'",
        '"',
        "a'b",
        'a"b',
        "a b",
        "a\tb",
        "\\",
        "*",
        "?",
        "[a-z]",
        "~root",
        "$HOME",
        "a,b",
        "a=b",
        "a:b@c",
        "\x1b[31m",
        "<!channel>",
        "<@U123>",
        "*bold*",
        "",
        " ",
        "😀",
    ]


HOSTILE_ALPHABET = st.sampled_from([*";|&$`'\"\\<>(){}[]*?~!#%^=,:@/ \t\n\r\x00-.", "\u202e"])
HOSTILE_NAMES = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.one_of(HOSTILE_ALPHABET, st.sampled_from("ab0_")), max_size=30),
    st.sampled_from(adversarial(Path("/tmp/cudamedic-canary"))),
    st.tuples(st.from_regex(r"[a-z0-9]{1,8}", fullmatch=True), HOSTILE_ALPHABET).map(
        lambda t: t[0] + t[1]
    ),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,30}", fullmatch=True),
)


def _shell_inert(value: str) -> bool:
    """A value a POSIX shell takes as one literal word, and no program as an option."""
    return shlex.quote(value) == value and not value.startswith("-") and "\n" not in value


def _ip(value: str) -> str | None:
    """The canonical form of an IP literal (IPv6 maybe bracketed), else None."""
    import ipaddress

    raw = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        return None


def test_accepted_names_are_always_shell_inert() -> None:
    """Whatever the validators (and everything built on them) accept is one literal shell word:
    no quoting needed, no option, no metacharacter. Everything else is an InputError."""
    from flows.slack.app import parse_command

    fuzz = Fuzz("name validators")
    inventory = _inventory()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(HOSTILE_NAMES, st.integers(1, 65535))
    def inner(value: str, port: int) -> None:
        fuzz.examples += 1
        # validators refuse, they never clean: what they accept is what was given
        for validate, same in (
            (names.container_name, value.removeprefix("/")),
            (names.inventory_name, value),
            (names.user_name, value),
            (names.host_address, value),
        ):
            try:
                accepted = fuzz.call(validate, value, allowed=(InputError,))
            except InputError:
                continue
            assert accepted == same or (validate is names.host_address and _ip(value) == accepted)
        checks: list[tuple[Callable[[], Any], Callable[[Any], list[str]]]] = [
            (lambda: names.container_name(value), lambda v: [v]),
            (lambda: names.inventory_name(value), lambda v: [v]),
            (lambda: names.host_address(value), lambda v: [v]),
            (lambda: names.user_name(value), lambda v: [v]),
            (lambda: resolve_target(value, inventory), lambda t: [t.name]),
            (
                lambda: resolve_target(f"ssh://{value}@node.example.com:{port}", None),
                lambda t: [t.name, t.host.user or "", t.host.address],
            ),
            (
                lambda: resolve_target(f"ssh://root@{value}:{port}", None),
                lambda t: [t.name, t.host.address],
            ),
            (
                lambda: parse_command(f"triage node07 {value}", inventory),
                lambda r: [r[0], r[1] or ""],
            ),
        ]
        for check, words in checks:
            try:
                accepted = fuzz.call(check, allowed=(InputError,))
            except InputError as exc:
                assert "\n" not in str(exc)  # one clear line
                continue
            for word in words(accepted):
                assert word == "" or _shell_inert(word), (value, word)

    fuzz.run(inner)


class Ran:
    """Sentinels for everything that could run a command or reach a host or an engine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from runbooks.collect.remote.docker import DockerEngine
        from runbooks.collect.remote.runner import LocalRunner
        from runbooks.collect.remote.ssh import SshRunner

        self.calls: list[str] = []

        def ssh(runner: Any, host: Any, *_: Any, **__: Any) -> None:
            self.calls.append(f"ssh {getattr(host, 'address', host)}")
            raise TargetError("sentinel: no SSH in this test")

        def engine(*_: Any, **__: Any) -> Any:
            self.calls.append("docker")
            raise TargetError("sentinel: no Docker in this test")

        def local(*args: Any, **_: Any) -> Any:
            self.calls.append(f"local {args[1:]!r}")
            raise TargetError("sentinel: nothing runs locally in this test")

        def popen(*args: Any, **_: Any) -> Any:
            self.calls.append(f"popen {args!r}")
            raise OSError("sentinel: no subprocess in this test")

        monkeypatch.setattr(SshRunner, "__init__", ssh)
        monkeypatch.setattr(DockerEngine, "local", classmethod(engine))
        monkeypatch.setattr(DockerEngine, "over_ssh", classmethod(engine))
        monkeypatch.setattr(LocalRunner, "run", local)
        monkeypatch.setattr(subprocess, "Popen", popen)


def _write_inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(
        "hosts:\n"
        "  node07: {address: 127.0.0.1, port: 1, user: root}\n"
        "  node08: {address: 127.0.0.1, port: 1, user: root, jump: node07}\n",
        encoding="utf-8",
    )
    return inv


def _cli_env(tmp_path: Path, inventory: Path) -> dict[str, str]:
    return {
        "CUDAMEDIC_INVENTORY": str(inventory),
        "CUDAMEDIC_OUT_DIR": str(tmp_path / "bundles"),
        "CUDAMEDIC_STATE_DIR": str(tmp_path / "state"),
        "CUDAMEDIC_SSH_CONNECT_TIMEOUT": "2",
        "CUDAMEDIC_KNOWN_HOSTS": str(tmp_path / "known_hosts"),
        "CUDAMEDIC_SSH_CONFIG": str(tmp_path / "ssh_config"),
        "CUDAMEDIC_NCCL_TESTS_ENABLED": "false",
    }


def _cli_commands(name: str, inventory: Path) -> list[list[str]]:
    """Every place a name reaches through the CLI (without starting a Prefect server)."""
    inv = ["--inventory", str(inventory)]
    return [
        ["collect", "node07", f"--container={name}", *inv],
        ["collect", *inv, "--", name],
        ["collect", f"ssh://{name}@127.0.0.1:1", *inv],
        ["fix", "node07", f"--container={name}", *inv],
        ["fix", *inv, "--container=train", "--", name],
        ["rollback", "node07", f"--container={name}", *inv],
    ]


def _hostile_inventories(name: str) -> list[str]:
    q = json.dumps(name)  # a YAML double-quoted scalar holds any string
    texts = [
        f"hosts:\n  {q}: {{address: 127.0.0.1, port: 1}}\n",
        f"hosts:\n  node07: {{address: {q}, port: 1}}\n",
        f"hosts:\n  node07: {{address: 127.0.0.1, port: 1, user: {q}}}\n",
        f"hosts:\n  node07: {{address: 127.0.0.1, port: {q}}}\n",
    ]
    # `a,b` is a ProxyJump chain (a, then b) when each hop is a plain address: a valid jump.
    if not all(_plain_hop(hop) for hop in name.split(",")):
        texts.append(f"hosts:\n  node07: {{address: 127.0.0.1, port: 1, jump: {q}}}\n")
    return texts


def _plain_hop(hop: str) -> bool:
    try:
        names.host_address(hop)
    except InputError:
        return False
    return True


def test_adversarial_names_are_refused_everywhere_in_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each name through the validators, target resolution, the inventory loader, the Slack
    parser and the CLI's main(): an InputError / exit 2 with one clear line, and nothing ran."""
    from flows.slack.app import parse_command
    from runbooks.cli import main

    canary = tmp_path / "pwned"
    inventory_path = _write_inventory(tmp_path)
    for key, value in _cli_env(tmp_path, inventory_path).items():
        monkeypatch.setenv(key, value)
    ran = Ran(monkeypatch)
    inventory = load_inventory(inventory_path)
    tried = ran_something = tracebacks = 0
    problems: list[str] = []
    hostile = [n for n in adversarial(canary) if n]  # "" is "not given" (ssh://@h: default user)

    for name in hostile:
        checks: list[tuple[str, Callable[[str], Any]]] = [
            ("container name", names.container_name),
            ("inventory name", names.inventory_name),
            ("host address", names.host_address),
            ("user name", names.user_name),
            ("target", lambda n: resolve_target(n, inventory)),
            ("ssh user", lambda n: resolve_target(f"ssh://{n}@127.0.0.1:1", inventory)),
            ("ssh host", lambda n: resolve_target(f"ssh://root@{n}:1", inventory)),
            ("slack host", lambda n: parse_command(f"triage {n}", inventory)),
            ("slack container", lambda n: parse_command(f"triage node07 {n}", inventory)),
        ]
        for what, check in checks:
            tried += 1
            try:
                accepted = check(name)
            except InputError as exc:
                if "\n" in str(exc):
                    problems.append(f"{what}: multi-line error for {name!r}: {exc}")
                continue
            # Only the Slack parser may accept, when the name became no container at all (it
            # was blank, or followed '--': the pasted trigger text, which is data).
            if not (what == "slack container" and accepted[1] is None):
                problems.append(f"{what}: accepted {name!r} as {accepted!r}")
        for text in _hostile_inventories(name):
            tried += 1
            bad = tmp_path / "bad-inventory.yaml"
            bad.write_text(text, encoding="utf-8")
            with pytest.raises(InputError):
                load_inventory(bad)
        for argv in _cli_commands(name, inventory_path):
            tried += 1
            calls_before = len(ran.calls)
            code = main(argv)
            out, err = capsys.readouterr()
            if "Traceback" in out + err:
                tracebacks += 1
            if len(ran.calls) > calls_before or canary.exists():
                ran_something += 1
                problems.append(f"{argv}: ran {ran.calls[calls_before:]}")
            if code != 2 or err.count("\n") != 1 or not err.startswith("cudamedic: error:"):
                problems.append(f"{argv!r}: exit {code}, stderr {err!r}")

    record(SUITE, "adversarial names tried (in process)", tried)
    zero(SUITE, "adversarial names that ran something (in process)", ran_something)
    zero(SUITE, "tracebacks (in process)", tracebacks)
    assert not canary.exists()
    assert not problems, "\n".join(problems[:20])


def _fake_bin(tmp_path: Path, marker: Path) -> Path:
    """ssh, docker, nvidia-smi, ...: if anything ever runs them, `marker` records it."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    for tool in ("ssh", "docker", "nvidia-smi", "dmesg", "journalctl", "all_reduce_perf", "id"):
        exe = bin_dir / tool
        exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> {shlex.quote(str(marker))}\n')
        exe.chmod(0o755)
    return bin_dir


def _run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runbooks.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_adversarial_names_through_the_cli_end_to_end(tmp_path: Path) -> None:
    """The real `cudamedic` process: exit 2, one line on stderr, no traceback, nothing ran."""
    canary = tmp_path / "pwned"
    marker = tmp_path / "ran.log"
    inventory = _write_inventory(tmp_path)
    env = {
        "PATH": f"{_fake_bin(tmp_path, marker)}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "LANG": "C.UTF-8",
        **_cli_env(tmp_path, inventory),
    }
    hostile = [n for n in adversarial(canary) if n and "\x00" not in n]  # argv cannot hold NUL
    # Each name once, through the commands in turn (main() in-process takes every name through
    # every command); at the small size a spread of the shell-ish ones and a few others.
    if not FULL:
        shellish = [n for n in hostile if any(s in n for s in (";", "$(", "`", "\n", "|"))]
        hostile = [*shellish[:6], "--help", "../etc/passwd"]
    commands = [(name, _cli_commands(name, inventory)[i % 6]) for i, name in enumerate(hostile)]
    tried = ran_something = tracebacks = 0
    problems: list[str] = []
    for name, argv in commands:
        tried += 1
        proc = _run_cli(argv, env)
        if "Traceback" in proc.stdout + proc.stderr:
            tracebacks += 1
        if canary.exists() or marker.exists():
            ran_something += 1
        lines = proc.stderr.splitlines()
        if proc.returncode != 2 or len(lines) != 1 or not lines[0].startswith("cudamedic: error"):
            problems.append(f"{name!r} {argv[0]}: exit {proc.returncode}: {proc.stderr[-300:]!r}")
    record(SUITE, "adversarial names tried (cli)", tried)
    zero(SUITE, "adversarial names that ran something (cli)", ran_something)
    zero(SUITE, "tracebacks (cli)", tracebacks)
    assert not canary.exists() and not marker.exists()
    assert not problems, "\n".join(problems[:10])


def test_hostile_trigger_text_is_data_not_a_command(tmp_path: Path) -> None:
    """A pasted trigger reaches the bundle as text; the unreachable host costs exit 3."""
    canary = tmp_path / "pwned"
    marker = tmp_path / "ran.log"
    inventory = _write_inventory(tmp_path)
    env = {
        "PATH": f"{_fake_bin(tmp_path, marker)}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "LANG": "C.UTF-8",
        **_cli_env(tmp_path, inventory),
    }
    trigger = f"$(touch {canary}) `touch {canary}` ; touch {canary} {{{{7*7}}}} <!channel>"
    proc = _run_cli(["collect", "node07", f"--trigger={trigger}"], env)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    bundle = Path(proc.stdout.strip().splitlines()[-1])
    assert (bundle / "trigger.txt").read_text(encoding="utf-8") == trigger
    classify = _run_cli(["classify", str(bundle)], env)
    assert classify.returncode == 0 and "Traceback" not in classify.stdout + classify.stderr
    assert not canary.exists() and not marker.exists()


def test_classify_cli_on_hostile_paths_and_bundles(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    garbage = tmp_path / "b"
    _write_tree(
        garbage,
        {
            "bundle.json": "[" * 100_000,
            "nvidia-smi.txt": "\x00\xff" * 100,
            "containers/$(touch x).inspect.json": '{"Config": {"Env": 5}}',
            "containers/a;b.log": "RuntimeError: CUDA error: out of memory\n",
        },
    )
    tar = tmp_path / "junk.tar.gz"
    tar.write_bytes(b"\x1f\x8b" + b"\x00" * 64)
    runs = {
        "garbage bundle": (_run_cli(["classify", str(garbage)], env), 0),
        "junk tar": (_run_cli(["classify", str(tar)], env), 2),
        "missing": (_run_cli(["classify", str(tmp_path / "$(touch x)")], env), 2),
    }
    for what, (proc, code) in runs.items():
        assert proc.returncode == code, (what, proc.stderr)
        assert "Traceback" not in proc.stdout + proc.stderr, what
        if code == 2:
            assert len(proc.stderr.splitlines()) == 1, (what, proc.stderr)
    assert not (tmp_path / "x").exists() and not Path("x").exists()


def test_parameters_that_reach_a_shell_are_quoted(tmp_path: Path) -> None:
    """The only configurable strings put into a shell line of ours (the remote Docker host and
    the nccl-tests path) go through a real /bin/sh, with fake tools on PATH, as one literal
    word: the fake `docker` prints back exactly the value, nothing else runs."""
    from runbooks.collect.collector import _run_nccl_tests, _Writer
    from runbooks.collect.remote.docker import _DialAdapter
    from runbooks.collect.remote.runner import CommandResult
    from runbooks.core.settings import Settings

    canary = tmp_path / "pwned"
    marker = tmp_path / "ran.log"
    bin_dir = _fake_bin(tmp_path, marker)
    (bin_dir / "docker").write_text('#!/bin/sh\nprintf "%s" "$DOCKER_HOST"\n')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}

    class Shell:
        """The collector's CommandRunner, as a real /bin/sh with the fake tools on PATH."""

        name = "test"

        def run(self, command: str, *, timeout: float, max_bytes: int, keep: Any = "head") -> Any:
            proc = subprocess.run(
                ["/bin/sh", "-c", command], env=env, capture_output=True, timeout=30, check=False
            )
            return CommandResult(
                command=command, exit_code=proc.returncode, stdout=proc.stdout, stderr=proc.stderr
            )

        def close(self) -> None:
            pass

    tried = ran_something = 0
    shell = Shell()
    for value in adversarial(canary):
        if "\x00" in value:
            continue  # no C string holds a NUL: a remote shell would see the line cut short
        tried += 2
        command = _DialAdapter(object(), 5, value)._command  # type: ignore[arg-type]
        out = shell.run(command, timeout=30, max_bytes=1 << 20)
        assert out.stdout.decode() == value, (value, out.stderr)
        writer = _Writer(tmp_path / "w")
        config = Settings(nccl_tests_path=value, nccl_tests_gpus=1, nccl_tests_budget=5)
        _run_nccl_tests(shell, config, writer)
        assert [s.status for s in writer.sources] in (["skipped"], ["failed"], ["error"]), value
        if canary.exists() or marker.exists():
            ran_something += 1
    record(SUITE, "shell parameters tried", tried)
    zero(SUITE, "shell parameters that ran something", ran_something)
    assert not canary.exists()


# ================================================================================ templates

INJECTIONS = [
    "{{ 'EVAL' ~ 'UATED' }}",
    "{{ 7*7 }}",
    "{{7*'7'}}",
    "{% for x in range(3) %}LOOPED{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{# comment #}",
    "{% raw %}",
    "<!channel>",
    "<!here>",
    "<@U123>",
    "<#C123>",
    "<http://evil.example|click>",
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    "*bold*",
    "_it_",
    "~strike~",
    "[link](http://evil.example)",
    "`code`",
    "```",
    "|",
    "# Heading",
    "\n---\n",
    "&amp;",
]
HOSTILE_FIELD = st.one_of(
    st.lists(st.sampled_from(INJECTIONS), min_size=1, max_size=4).map(" ".join),
    st.text(max_size=60),
)


def _postmortem(fields: dict[str, str]) -> Any:
    from reports.render import CheckResult, PostMortem, TimelineEvent
    from runbooks.core.model import Line

    t0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
    f = fields
    return PostMortem(
        host=f["host"],
        container=f["container"],
        incident=f["incident"],
        confidence=0.9,
        summary=f["summary"],
        trigger=f["trigger"],
        detected_by=f["detected_by"],
        started_at=t0,
        ended_at=t0 + timedelta(seconds=9),
        outcome=f["outcome"],
        outcome_detail=f["outcome_detail"],
        approval=f["approval"],
        evidence=(Line(source=f["source"], line=3, text=f["evidence"]),),
        secondary=(f["secondary"],),
        docker_run_diff=(f"+ --shm-size {f['diff']}",),
        checks=(CheckResult(name=f["check"], ok=False, detail=f["detail"]),),
        timeline=(TimelineEvent(at=t0, event=f["event"], detail=f["detail"]),),
        action_items=(f["action"],),
        links={f["link_name"]: f["link"]},
        bundle=f["bundle"],
    )


PM_FIELDS = [
    "host",
    "container",
    "incident",
    "summary",
    "trigger",
    "detected_by",
    "outcome",
    "outcome_detail",
    "approval",
    "source",
    "evidence",
    "secondary",
    "diff",
    "check",
    "detail",
    "event",
    "action",
    "link_name",
    "link",
    "bundle",
]


def _spread(values: list[str]) -> dict[str, str]:
    """Six hostile values dealt over every field (drawing twenty costs more than it finds)."""
    return {k: values[i % len(values)] for i, k in enumerate(PM_FIELDS)}


def _evaluated(output: str, fields: dict[str, str]) -> bool:
    """Did a template evaluate input? Markers only evaluation makes: 'EVAL' ~ 'UATED' joined,
    a loop body repeated."""
    given_text = " ".join(fields.values())
    return any(
        marker in output and marker not in given_text
        for marker in ("EVALUATED", "LOOPEDLOOPED", "7777777")
    )


def test_templates_never_evaluate_input_and_slack_escapes_it() -> None:
    from reports.render import (
        SweepChange,
        SweepHostRow,
        SweepSummary,
        render_markdown,
        render_sweep,
        shown,
    )
    from reports.slack import approval_blocks, progress, summary_blocks, sweep_blocks

    fuzz = Fuzz("templates (post-mortem, sweep, Slack)")
    evaluated = 0

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=SLOW_OK, database=None)
    @given(st.lists(HOSTILE_FIELD, min_size=6, max_size=6).map(_spread))
    def inner(fields: dict[str, str]) -> None:
        nonlocal evaluated
        fuzz.examples += 1
        pm = _postmortem(fields)
        markdown = fuzz.call(render_markdown, pm)
        summary = SweepSummary(
            started_at=pm.started_at,
            ended_at=pm.ended_at,
            hosts=(
                SweepHostRow(
                    host=fields["host"],
                    verdict="drain",
                    codes=(fields["check"],),
                    incident=fields["incident"],
                    incident_summary=fields["summary"],
                    bundle=fields["bundle"],
                    error=fields["detail"],
                ),
            ),
            changes=(
                SweepChange(
                    host=fields["host"],
                    change="new",
                    code=fields["check"],
                    subject=fields["source"],
                    level="drain",
                    message=fields["detail"],
                ),
            ),
            links={fields["link_name"]: fields["link"]},
        )
        sweep = fuzz.call(render_sweep, summary)
        blocks = [
            *fuzz.call(summary_blocks, pm),
            *fuzz.call(sweep_blocks, summary),
            *fuzz.call(
                approval_blocks,
                run_id="r1",
                requester="U1",
                host=fields["host"],
                container=fields["container"],
                incident=fields["incident"],
                confidence=0.9,
                summary=fields["summary"],
                diff=(f"+ {fields['diff']}",),
                evidence=[fields["evidence"]],
            ),
        ]
        slack_text = json.dumps(blocks, ensure_ascii=False) + progress(
            fields["event"], fields["detail"]
        )
        if any(_evaluated(out, fields) for out in (markdown, sweep, slack_text)):
            evaluated += 1
        # Jinja syntax in input comes out as written
        if "{{ 7*7 }}" in fields["summary"]:
            assert "{{ 7*7 }}" in markdown
        # Slack: no input can ping a channel, mention someone, or form a link
        assert "<" not in slack_text and ">" not in slack_text
        # the pasted trigger sits in a fence longer than any backtick run it holds, its control
        # characters shown escaped
        trigger = fields["trigger"]
        if trigger:
            longest = max((len(run) for run in re.findall(r"`+", trigger)), default=0)
            fence = "`" * max(3, longest + 1)
            assert f"{fence}text\n{shown(trigger)}\n{fence}\n" in markdown

    try:
        fuzz.run(inner)
    finally:
        zero(SUITE, "template injections evaluated", evaluated)
    assert evaluated == 0


def test_known_injections_render_literally() -> None:
    from reports.render import render_markdown
    from reports.slack import summary_blocks

    evil = (
        "{{ 7*7 }} {% for x in range(3) %}x{% endfor %} <!channel> <@U123> "
        "<script>alert(1)</script> *bold* [link](http://evil.example) `tick`"
    )
    pm = _postmortem({k: evil for k in PM_FIELDS})
    markdown = render_markdown(pm)
    assert "49" not in markdown and "xxx" not in markdown
    assert "{{ 7*7 }}" in markdown and "{% for x in range(3) %}x{% endfor %}" in markdown
    slack = json.dumps(summary_blocks(pm))
    assert "49" not in slack
    assert "&lt;!channel&gt;" in slack and "&lt;@U123&gt;" in slack
    assert "&lt;script&gt;" in slack and "<" not in slack


def test_templates_come_only_from_the_package_and_none_renders_html() -> None:
    """No product code builds a template from a string (input would be code); every Jinja
    Environment loads templates from the package, and autoescape is off only where no template
    is HTML/XML."""
    import jinja2

    from reports.render import _env

    offenders: list[str] = []
    environments = 0
    for path in sorted(
        p for pkg in ("runbooks", "flows", "reports") for p in (ROOT / pkg).rglob("*.py")
    ):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if name in ("from_string", "Template", "render_template_string", "compile_expression"):
                offenders.append(f"{where}: {name}()")
            if name in ("Environment", "SandboxedEnvironment"):
                environments += 1
                loader = next((k.value for k in node.keywords if k.arg == "loader"), None)
                loader_name = (
                    getattr(loader.func, "attr", getattr(loader.func, "id", ""))
                    if isinstance(loader, ast.Call)
                    else ""
                )
                if loader_name not in ("PackageLoader", "FileSystemLoader"):
                    offenders.append(f"{where}: Environment without a package loader")
    assert environments >= 1
    assert not offenders, offenders
    env = _env()
    assert isinstance(env.loader, jinja2.PackageLoader | jinja2.FileSystemLoader)
    templates = env.list_templates()
    assert templates and all(t.endswith(".md.j2") for t in templates)
    html = [t for t in templates if t.endswith((".html", ".htm", ".xml", ".html.j2"))]
    autoescape = env.autoescape
    for name in html:
        assert autoescape is True or (callable(autoescape) and autoescape(name))


def test_alert_trigger_templates_do_not_evaluate_alert_text() -> None:
    """Prefect renders the alert trigger's parameters (sandboxed Jinja) with the alert as data:
    an alert named '{{ 7*7 }}' starts a response whose trigger text says '{{ 7*7 }}'."""
    from prefect.server.utilities.user_templates import render_user_template_sync

    from flows.alerts import trigger_parameters

    payload = {
        "alertname": "{{ 7*7 }}",
        "summary": "{% for x in range(3) %}x{% endfor %} {{ cycler.__init__.__globals__ }}",
        "container": "$(id)",
    }
    context = {"event": {"resource": {"cudamedic.host": "node07"}, "payload": payload}}
    rendered = {k: render_user_template_sync(v, context) for k, v in trigger_parameters().items()}
    assert rendered["target"] == "node07"
    assert rendered["trigger_text"] == f"{payload['alertname']}: {payload['summary']}"
    assert "49" not in json.dumps(rendered) and "xxx" not in json.dumps(rendered)
    zero(SUITE, "alert trigger templates evaluated", 0)
