"""What `--json` prints: one object per command on stdout (the schema of docs/cli-json.md;
`classify --json` is built by runbooks/diagnose/classify.py `to_json`, with the same three fields).

Every object carries `schema` (this module's SCHEMA, raised on any incompatible change),
`command` and `exit_code` (the process's exit status). A command that stops on an error prints
an ErrorResult instead. Pure: models only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA = 1


class _Result(BaseModel):
    model_config = ConfigDict(populate_by_name=True, frozen=True)

    schema_: int = Field(default=SCHEMA, alias="schema")
    exit_code: int

    def dumps(self) -> str:
        return self.model_dump_json(by_alias=True, indent=2)


class FailedSource(BaseModel):
    name: str
    error: str


class ErrorResult(_Result):
    command: str
    error: str


class CollectTarget(BaseModel):
    target: str
    bundle: str
    reachable: bool
    reason: str | None = None  # why the target could not be reached
    missing_container: str | None = None  # the error when --container named none there
    failed_sources: list[FailedSource] = []


class CollectResult(_Result):
    command: Literal["collect"] = "collect"
    targets: list[CollectTarget]


class Plan(BaseModel):
    diff: list[str]  # the effective `docker run`, lines marked "- " removed, "+ " added
    steps: list[str]


class Check(BaseModel):
    name: str
    ok: bool
    detail: str


class FixResult(_Result):
    command: Literal["fix"] = "fix"
    host: str
    container: str
    bundle: str
    incident: str
    confidence: float
    summary: str
    plan: Plan | None = None  # None: no safe automatic fix
    # nothing-to-fix | needs-a-person | planned | refused | fixed | recovered | rolled-back | ...
    outcome: str
    detail: str = ""
    checks: list[Check] = []
    report: str | None = None
    failed_sources: list[FailedSource] = []


class TriageResult(_Result):
    command: Literal["triage"] = "triage"
    host: str
    container: str | None = None
    incident: str
    confidence: float
    summary: str
    outcome: str  # diagnosed | planned | fixed | rolled-back | rejected | refused | ...
    detail: str = ""
    diff: list[str] = []
    approval: str | None = None
    bundle: str
    report: str
    flow_run_url: str | None = None
    reachable: bool = True
    reason: str | None = None
    failed_sources: list[FailedSource] = []


class SweepChange(BaseModel):
    change: str  # new | changed | resolved
    host: str
    code: str
    subject: str | None = None
    level: str | None = None
    message: str


class SweepNotChecked(BaseModel):
    host: str
    code: str
    subject: str | None = None
    level: str
    why: str  # e.g. "nccl-tests did not run", "the host was not reached"


class SweepResult(_Result):
    command: Literal["sweep"] = "sweep"
    hosts: int
    duration_s: float
    counts: dict[str, int]  # drain, warning, healthy
    verdicts: dict[str, str]  # host -> healthy | warning | drain
    still: dict[str, list[str]]  # drain, warning -> the hosts that still are
    changes: list[SweepChange]
    # the last sweep's findings this one could not check, kept as they were
    not_checked: list[SweepNotChecked] = []
    responses: list[str] = []  # flow run ids of incident responses started
    report: str
    flow_run_url: str | None = None


class AuditEvent(BaseModel):
    event: str  # cudamedic.fix.started, .fix.applied, .fix.failed, .approval.refused, ...
    occurred: str  # ISO 8601, UTC
    record: dict[str, Any]  # the audit record: at, who, action, host, ... (redacted)


class AuditResult(_Result):
    command: Literal["audit"] = "audit"
    since: str
    events: list[AuditEvent]  # oldest first


class PendingResult(_Result):
    """`cudamedic pending --json`: each fix that waits for a person (runbooks/fix/approvals.py
    WaitingApproval, plus `state`: Paused or Suspended)."""

    command: Literal["pending"] = "pending"
    approvals: list[dict[str, Any]]
