"""Shared pydantic models that cross module boundaries.

Parsers (runbooks/collect/evidence/*) return their own frozen fact models; what they share is
defined
here: a cited evidence line (`Line`) and a `Finding` for anything odd they met. Line numbers
are 1-based and refer to the bundle file named in `source` (a path relative to the bundle root,
e.g. ``"dmesg.txt"`` or ``"containers/train.log"``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Severity = Literal["info", "warning", "error"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Line(Frozen):
    """One line of evidence, cited by bundle file and 1-based line number."""

    source: str
    line: int
    text: str


class Finding(Frozen):
    """Something a parser or collector noticed that is not a parse result.

    `code` is a stable kebab-case id (e.g. ``"xml-truncated"``, ``"smi-err-field"``).
    Parsers never raise on garbage; they return what they could read plus findings.
    """

    code: str
    message: str
    source: str = ""
    line: int | None = None
    severity: Severity = "info"


class Match(Frozen):
    """One rule's verdict: this incident class, this sure, because of these lines."""

    incident: str
    confidence: float
    evidence: tuple[Line, ...] = ()
    reason: str = ""
    rule: str = ""


class GpuRequestSpec(Frozen):
    """A GPU device request as the Engine API takes it (`--gpus`)."""

    count: int = -1  # -1: all
    device_ids: tuple[str, ...] = ()
    capabilities: tuple[str, ...] = ("gpu",)


class UlimitSpec(Frozen):
    name: str
    soft: int
    hard: int


class ContainerChange(Frozen):
    """What a safe fix changes in how a container is started; None = unchanged."""

    shm_size: int | None = None  # bytes
    ipc_mode: str | None = None
    device_requests: tuple[GpuRequestSpec, ...] | None = None
    ulimits: tuple[UlimitSpec, ...] | None = None
    cap_add: tuple[str, ...] | None = None


class Fix(Frozen):
    """The recommended fix: a safe container change (with its `docker run` delta) or steps."""

    safe: bool
    container: str | None = None
    change: ContainerChange | None = None
    docker_run: tuple[str, ...] = ()  # e.g. ("+ --shm-size=8g",)
    steps: tuple[str, ...] = ()
    note: str = ""


class SimilarIncident(Frozen):
    """A known incident that resembles this one: a public thread or one of the team's reports."""

    id: str
    incident: str
    kind: Literal["public", "team"] = "public"
    source: str  # thread URL, or the team report's path
    conclusion: str
    score: float  # BM25 score: higher is closer; comparable within one query only
    when: str | None = None
    host: str | None = None
    fix: str | None = None
    same_cause: bool | None = None  # its cause is the diagnosis' class (None: not compared)


# How the diagnosis was reached: rules over the evidence, a guess from thin evidence (a pasted
# line), the similar incidents alone (no rule fired), the words used alone (no rule fired, no
# close incident), the learned model (runbooks/diagnose/learned.py: it named the class, or it
# withheld a
# class the rules named because it is sure of another, or it ranked the candidates of an
# `unknown`), or nothing relevant was seen at all.
Basis = Literal[
    "evidence", "thin-evidence", "similar-incidents", "keywords", "model", "no-evidence"
]


class Candidate(Frozen):
    """A cause that fits an undecided diagnosis, with the learned model's calibrated probability
    of it (None where the model has no view, e.g. no model is packaged)."""

    incident: str
    probability: float | None = None
    why: str = ""  # what puts it forward: "rules: <rule>", "learned model"


class Diagnosis(Frozen):
    incident: str
    confidence: float
    summary: str
    evidence: tuple[Line, ...] = ()
    secondary: tuple[str, ...] = ()
    fix: Fix | None = None
    host: str | None = None
    container: str | None = None
    findings: tuple[Finding, ...] = ()
    matches: tuple[Match, ...] = ()
    basis: Basis = "evidence"
    next_checks: tuple[str, ...] = ()
    similar: tuple[SimilarIncident, ...] = ()
    # `unknown` because no class is clearly ahead: the two leading causes, and the one check that
    # tells them apart (classes.yaml `apart`, else the leading cause's first check).
    candidates: tuple[Candidate, ...] = ()
    tells_apart: str = ""
    # The learned model's leading classes and calibrated probabilities, whatever decided.
    model_view: tuple[tuple[str, float], ...] = ()

    @property
    def guess(self) -> bool:
        """True when the class is a likely guess rather than a finding."""
        return self.incident != "unknown" and self.basis in (
            "thin-evidence",
            "similar-incidents",
            "keywords",
            "model",
        )


class CreateSpec(Frozen):
    """Engine API bodies that recreate a container: Config, HostConfig, networks."""

    name: str
    config: dict[str, object]
    host_config: dict[str, object]
    networking: dict[str, object] | None = None  # the first network, given at create
    extra_networks: dict[str, dict[str, object]] = {}  # connected after create
    image_note: str = ""


class FixPlan(Frozen):
    """Everything a fix will do, written for a person and executable by recreate.py."""

    host: str
    container: str
    container_id: str
    incident: str
    summary: str
    change: ContainerChange
    docker_run_before: tuple[str, ...]
    docker_run_after: tuple[str, ...]
    diff: tuple[str, ...]
    steps: tuple[str, ...]
    spec: CreateSpec
    backup_name: str
    was_running: bool
    restart_policy: dict[str, object]
    checks: tuple[str, ...] = ()  # what verification will look at
