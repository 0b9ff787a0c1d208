"""The incident-response flow: collect -> classify -> plan -> approve -> apply -> verify -> report.

Each step is a Prefect task with the runbook's timeout; only collection retries (steps with side
effects never do, and none is cached). The apply step runs under the host's Prefect concurrency
limit (``cudamedic-host-<name>``, created up front, strict) so two flows never fix one host at
once, also from two workers; the fix itself re-checks that the container is still the one that
was planned. Approval pauses the flow run for a typed `Approval` (approve/reject, who, why) that
`cudamedic approve`, the Prefect UI or Slack supply; the flow judges each answer's identity by
one rule (approvers, four-eyes: flows/approvals.py), audits it, and waits on after a refused one.
Unattended approval comes from the runbook's policy, behind the fleet-wide circuit breaker.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, cast

from prefect import flow, get_client, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.sync import concurrency
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import deployment, flow_run
from pydantic import BaseModel, Field

from flows import approvals
from flows.automations import ensure_approval_timeout, ensure_crash_detection
from flows.fleet_state import ensure_limits
from flows.notify import Notifier
from flows.slack.delivery import thread_for
from reports import slack as slack_msg
from runbooks.collect.collector import collect, finding_message, missing_container
from runbooks.collect.inventory import load_inventory
from runbooks.collect.target import Target, resolve_target
from runbooks.core import progress
from runbooks.core.errors import CudamedicError, FixLocked, InputError
from runbooks.core.model import Diagnosis, SimilarIncident
from runbooks.core.runbook import Runbook, load_runbook
from runbooks.core.settings import Settings, load_settings
from runbooks.diagnose.classify import classify_path
from runbooks.diagnose.remedy import fault_container
from runbooks.diagnose.rma import BugReport
from runbooks.fix import breaker
from runbooks.fix.approvals import (
    CLAIMED,
    OS_USER,
    WaitingApproval,
    enforced,
    four_eyes,
    identity,
    started_by_cli,
    take_up_front,
)
from runbooks.fix.fixer import (
    Prepared,
    effective_policy,
    execute,
    plan_for,
    postmortem,
    recover_interrupted,
    refusal,
    save_postmortem,
)
from runbooks.fix.journal import audit, now, who
from runbooks.fix.recreate import Outcome

BREAKER_VARIABLE = "cudamedic_breaker"
DEFAULT_DETECTED_BY = "cudamedic triage"
DEPLOYMENT_RUN = "prefect deployment run"  # a run created through the API, by whoever holds it
BREAKER_LOCK = "cudamedic-breaker"


class Approval(RunInput):
    """What a person answers to a paused fix. `by` names who answers: a Slack user id (Slack),
    `os:<user>` (`cudamedic approve`), or an approver identity typed in the Prefect UI; the flow
    takes it only from an approver who did not ask for the response (runbooks/fix/approvals.py)."""

    decision: Literal["approve", "reject"]
    by: str = Field(min_length=1, max_length=200)
    reason: str = Field(default="", max_length=2000)
    # set by the Slack app and `cudamedic approve` (how `by` was established: runbooks/approvals
    # .py); typed in the UI it is empty, and the identity only claimed
    proof: str = Field(default="", max_length=200)


class Locked(BaseModel):
    """Another fix of the container holds its lock: the response stops there, writing nothing
    (no post-mortem, no history): the fix that holds it reports."""

    message: str


class Response(BaseModel):
    """The flow's result: what a caller (CLI, Slack, a sweep) shows."""

    host: str
    container: str | None = None
    incident: str
    confidence: float
    summary: str
    outcome: str  # fixed | rolled-back | planned | diagnosed | rejected | refused | ...
    detail: str = ""
    bundle: str
    report: str
    diff: list[str] = []
    approval: str | None = None
    flow_run_id: str | None = None
    flow_run_url: str | None = None
    similar: list[SimilarIncident] = []  # known incidents that resemble this one
    basis: str = "evidence"


# -- names and limits ----------------------------------------------------------------------------
def slug(host: str) -> str:
    """A host name as Prefect names and keys allow it (lower case, letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", host.lower()).strip("-")


HOST_LOCK_LEASE_S = 60.0  # the server's minimum


def host_lock(host: str) -> str:
    return "cudamedic-host-" + slug(host)


def response_name(target: str, container: str | None) -> str:
    """`triage-<host>-<container>`: what an incident-response run is called."""
    return f"triage-{slug(target)[:40]}-{container or 'host'}"


def response_run_name() -> str:
    """The flow's run name, from its parameters (the CLI adds a suffix to find its own run)."""
    params = flow_run.parameters
    return response_name(str(params.get("target") or ""), params.get("container"))


def tag_run(run_id: str | None, *tags: str) -> None:
    """Add tags to this flow run. A run's tags stay editable while it runs: the host is known
    once the target is resolved, the class after classify, the outcome at the end."""
    if not run_id:
        return
    from uuid import UUID

    try:
        with get_client(sync_client=True) as client:
            have = client.read_flow_run(UUID(run_id)).tags
            client.update_flow_run(UUID(run_id), tags=[*have, *(t for t in tags if t not in have)])
    except Exception as exc:  # a label for the UI: never worth failing a response over
        get_run_logger().warning("could not tag the flow run %s: %s", tags, exc)


# Outcomes that are not routine name the run's final state, so a state filter in the Prefect UI
# finds them; the rest (diagnosed, planned, needs-a-person, recovered) stay "Completed". A fix
# that failed, a container that does not exist and a host that was not reached are failures:
# their state's type is FAILED (red in the UI, `prefect flow-run ls --state-type FAILED`), never
# a green success; a person's or the policy's "no" (rejected, refused, not answered) changed
# nothing as asked, and stays COMPLETED.
OUTCOME_STATES: dict[str, tuple[str, bool]] = {  # outcome -> (state name, failed)
    "fixed": ("Fixed", False),
    "rolled-back": ("RolledBack", True),
    "rollback-failed": ("RollbackFailed", True),
    "rejected": ("Rejected", False),
    "refused": ("Refused", False),
    "approval-timed-out": ("ApprovalTimedOut", False),
    "not-applied": ("NotApplied", True),
    "no-such-container": ("NoSuchContainer", True),
    "locked": ("Locked", False),
    "unreachable": ("Unreachable", True),
}


def finish(response: Response) -> Response:
    """Tag the run with its outcome and end it in the state that names it. Prefect makes a
    returned State the run's final state and hands its data, the Response, to the caller (a
    failed one too: `result(raise_on_failure=False)`, flows/triage.py)."""
    tag_run(response.flow_run_id, f"outcome:{response.outcome}")
    named = OUTCOME_STATES.get(response.outcome)
    if named is None:
        return response
    from prefect.states import Completed, Failed

    name, failed = named
    message = f"{response.outcome}: {response.detail}" if response.detail else response.outcome
    end = Failed if failed else Completed
    state: Any = end(name=name, message=message[:500], data=response)
    return cast(Response, state)


def run_url(run_id: str | None) -> str | None:
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui}/runs/flow-run/{run_id}" if ui and run_id else None


# -- tasks ---------------------------------------------------------------------------------------
@task(name="recover-interrupted-fix", cache_policy=NO_CACHE, timeout_seconds=900)
def recover_task(
    target: Target, container: str, settings: Settings
) -> Outcome | Locked | str | None:
    """Finish an interrupted fix of the container; `Locked` when another fix holds its lock
    this moment (nothing was interrupted); a message when it cannot be done now."""
    try:
        return recover_interrupted(target, container, settings)
    except FixLocked as exc:
        return Locked(message=str(exc))
    except CudamedicError as exc:
        return str(exc)


@task(name="collect-evidence", cache_policy=NO_CACHE)
def collect_task(
    target: Target, container: str | None, trigger: str | None, settings: Settings, book: Runbook
) -> str:
    return str(collect(target, settings, container=container, trigger=trigger, runbook=book))


@task(name="classify", cache_policy=NO_CACHE)
def classify_task(bundle: str, settings: Settings) -> Diagnosis:
    return classify_path(bundle, state_dir=settings.state_path)


@task(name="plan-fix", cache_policy=NO_CACHE, timeout_seconds=120)
def plan_task(
    target: Target, container: str, bundle: str, diagnosis: Diagnosis, settings: Settings
) -> Prepared | Locked | str:
    """The plan, or why there is none (an expected answer, not a task failure)."""
    try:
        return plan_for(target, container, bundle, diagnosis, settings)
    except FixLocked as exc:
        return Locked(message=str(exc))
    except CudamedicError as exc:
        return str(exc)


@task(name="apply-fix", cache_policy=NO_CACHE, retries=0)
def apply_task(
    target: Target,
    prepared: Prepared,
    settings: Settings,
    approved_by: str,
    unattended: bool,
) -> Outcome | Locked | str:
    # The lease is renewed while the fix runs; if the process dies mid-fix (a worker killed),
    # the lock frees itself after HOST_LOCK_LEASE_S, so a retry does not wait five minutes. A
    # failed renewal (the Prefect server restarting) must never cut a recreate in half: the fix
    # goes on (Prefect's default for strict locks would cancel it).
    with concurrency(
        host_lock(target.name),
        occupy=1,
        strict=True,
        timeout_seconds=600,
        lease_duration=HOST_LOCK_LEASE_S,
        raise_on_lease_renewal_failure=False,
    ):
        try:
            return execute(
                target, prepared, settings, approved_by=approved_by, unattended=unattended
            )
        except FixLocked as exc:
            return Locked(message=str(exc))
        except CudamedicError as exc:  # refused before any change: an answer, not a failure
            return str(exc)


@task(name="write-report", cache_policy=NO_CACHE, timeout_seconds=120)
def report_task(pm: Any, settings: Settings) -> str:
    from reports.render import render_markdown

    markdown = render_markdown(pm)  # once, for the file and the artifact
    path = save_postmortem(pm, settings, markdown)
    key = "postmortem-" + slug(pm.host)
    create_markdown_artifact(
        markdown=markdown,
        key=key[:100],
        description=f"Post-mortem: {pm.incident} on {pm.host} ({pm.outcome})",
    )
    return str(path)


# -- the circuit breaker (shared by every worker through a Prefect Variable) --------------------
def read_breaker() -> breaker.BreakerState:
    from prefect.variables import Variable

    raw = Variable.get(BREAKER_VARIABLE, default=None)
    if not raw:
        return breaker.BreakerState()
    try:
        data = json.loads(raw) if isinstance(raw, str) else raw
        return breaker.BreakerState.model_validate(data)
    except ValueError:
        return breaker.BreakerState(tripped_at=now(), reason="breaker state unreadable")


def _write_breaker(state: breaker.BreakerState) -> None:
    from prefect.variables import Variable

    Variable.set(BREAKER_VARIABLE, state.model_dump_json(), overwrite=True)


def admit_unattended(book: Runbook) -> tuple[bool, str]:
    ensure_limits([BREAKER_LOCK])
    with concurrency(BREAKER_LOCK, occupy=1, strict=True, timeout_seconds=60):
        allowed, state, why = breaker.admit(read_breaker(), book.circuit_breaker, now())
        _write_breaker(state)
    return allowed, why


def reset_breaker(by: str) -> breaker.BreakerState:
    ensure_limits([BREAKER_LOCK])
    with concurrency(BREAKER_LOCK, occupy=1, strict=True, timeout_seconds=60):
        state = breaker.reset(read_breaker(), by, now())
        _write_breaker(state)
    return state


# -- the flow ------------------------------------------------------------------------------------
@flow(
    name="incident-response",
    flow_run_name=response_run_name,
    log_prints=False,
    persist_result=False,
)
def incident_response(
    target: str,
    container: str | None = None,
    trigger_text: str | None = None,
    apply: bool = True,
    approved_by: str | None = None,
    detected_by: str = DEFAULT_DETECTED_BY,
    slack: dict[str, str] | None = None,
    origin: str | None = None,
) -> Response:
    """Respond to an incident on `target` (an inventory host, ssh://user@host[:port] or local),
    and only to `container` when one is named (an alert's `container` label): no other
    container of the host is touched.

    `apply`: False stops after the plan (dry run). `approved_by`: a person who approved up
    front (`cudamedic triage --yes`); otherwise the fix waits for an `Approval` unless the
    runbook's policy allows it unattended. `slack`: the thread to report progress to
    ({channel, ts, requester, sig}; set by the Slack app). `origin`: the alert receiver's or the
    sweep's signature of this start (runbooks/fix/approvals.py)."""
    container = _named(container)
    run = _Run.start(target, detected_by, approved_by, slack, (origin or "", container))
    recovered = _recover(run, container) if container else None
    if isinstance(recovered, Locked):
        return finish(run.stopped(container, "", "locked", recovered.message))
    bundle = _collect(run, container, trigger_text)
    if (missing := missing_container(Path(bundle))) is not None:
        # A mistyped container: an error to show the person, not an incident to report.
        run.mark("no such container", missing)
        return finish(run.stopped(container, bundle, "no-such-container", missing))
    diagnosis = _diagnose(run, bundle)
    diagnosis = _dcgm_diag(run, bundle, diagnosis)
    # the container whose own evidence shows the fault (a fix is never planned for another); a
    # host's response that cannot tell names none
    fix = diagnosis.fix
    subject = container or (fix.container if fix else None) or fault_container(diagnosis)
    prepared = Prepared(bundle=bundle, diagnosis=diagnosis, recovered=recovered)
    if (unreached := finding_message(Path(bundle), "target-unreachable")) is not None:
        result = _Result(
            "unreachable",
            f"{run.tgt.name} could not be reached ({unreached}): nothing was checked or changed",
        )
        run.mark("not reached", unreached)
        apply = False
    else:
        prepared, no_plan = _plan(run, subject, prepared)
        if isinstance(no_plan, Locked):
            return finish(run.stopped(subject, bundle, "locked", no_plan.message))
        result = _Result.before_apply(prepared, no_plan)
    if prepared.plan is not None and apply:
        result = _approve_and_apply(run, prepared, approved_by, named=container is not None)
        if result.status == "locked":
            return finish(run.stopped(subject, bundle, "locked", result.detail))
    extra = []
    if diagnosis.incident == GPU_HARDWARE_FAULT:
        item, approval = _rma(run, prepared, approved_by, apply)
        extra.append(item)
        result.approval = result.approval or approval
    pm = postmortem(
        prepared,
        run.settings,
        run.tgt.name,
        run.started,
        outcome=result.outcome,
        status=result.status,
        detail=result.detail,
        trigger=trigger_text,
        detected_by=run.detected_by,
        events=run.events,
        approval=result.approval,
        links=run.links,
        # a person ran `cudamedic triage` only when the flow runs in their process; a run on a
        # worker names no one (the worker's user did not ask for it)
        triggered_by=(approved_by or who()) if run.in_process else None,
        extra_actions=extra,
    )
    return finish(_report(run, prepared, subject, pm, result))


def _named(container: str | None) -> str | None:
    """The container a response is for: None for none ("" is how an alert without a
    `container` label arrives through the trigger's template); a name Docker would refuse is
    an input error."""
    from runbooks.core.names import container_name

    if container is None or not container.strip() or container.strip() == "None":
        return None
    return container_name(container.strip())


@dataclass
class _Run:
    """One response in progress: where it runs, and its timeline (also told to Slack)."""

    settings: Settings
    book: Runbook
    tgt: Target
    run_id: str | None
    requester: str  # who asked for it, as an identity (four-eyes)
    requester_how: str  # how that was established (runbooks/fix/approvals.py)
    links: dict[str, str]
    thread: Notifier | None
    started: datetime
    events: list[tuple[datetime, str, str]]
    detected_by: str
    in_process: bool  # the flow runs in the process of the `cudamedic` command that started it
    suspendable: bool  # a deployment's run: waiting for a person releases the worker
    replaying: bool = False  # a suspended run scheduled again, before it reaches its wait

    @classmethod
    def start(
        cls,
        target: str,
        detected_by: str,
        approved_by: str | None,
        slack: dict[str, str] | None,
        origin: tuple[str, str | None],
    ) -> _Run:
        started = now()
        settings = load_settings()
        inventory = load_inventory(settings.inventory) if settings.inventory else None
        here = started_by_cli(flow_run.get_name())
        if not here and (inventory is None or target not in inventory.hosts):
            # a run created through the Prefect API (an event's target, a deployment run): only
            # an inventory host, never `local` or an ssh:// address anyone could name (issue 27)
            raise InputError(
                f"{target[:100]!r} is not an inventory host: a response started through the "
                "Prefect API (an alert event, a deployment run) may only target one"
            )
        in_process = deployment.get_id() is None
        if not in_process and detected_by == DEFAULT_DETECTED_BY:
            detected_by = DEPLOYMENT_RUN  # nobody ran `cudamedic triage`: a deployment run
        triggered = f"{detected_by} by {approved_by or who()}" if here else detected_by
        tgt = resolve_target(target, inventory)
        run_id = str(flow_run.get_id() or "") or None
        tag_run(run_id, f"host:{tgt.name}")
        ensure_limits([host_lock(tgt.name)])
        book = load_runbook(settings.runbook, "incident")
        ensure_crash_detection(settings.crash_after_s)  # work pools: no `serve` set it up
        if not in_process:
            ensure_approval_timeout(book.timeouts.approval)
        asker, how = approvals.requester(
            settings, slack, detected_by, in_process, (origin[0], target, origin[1])
        )
        return cls(
            settings=settings,
            book=book,
            tgt=tgt,
            run_id=run_id,
            requester=asker,
            requester_how=how,
            links={"Prefect flow run": u} if (u := run_url(run_id)) else {},
            thread=thread_for(settings, slack),
            started=started,
            events=[(started, "triggered", triggered + (f" (on {who()})" if not here else ""))],
            detected_by=detected_by,
            in_process=in_process,
            suspendable=not in_process,
            replaying=not in_process and _waited(run_id),
        )

    def resumed(self, waiting: Waiting) -> None:
        """A suspended run scheduled again: its timeline goes on from where it waited."""
        self.replaying = False
        self.started = waiting.started_at
        again = (now(), "resumed", f"on {who()}: evidence collected again, the plan unchanged")
        self.events = [*waiting.events, again, *self.events[1:]]
        get_run_logger().info("resumed on %s", who())

    def mark(self, event: str, detail: str = "", *, quiet: bool = False) -> None:
        self.events.append((now(), event, detail))
        get_run_logger().info("%s%s", event, f": {detail}" if detail else "")
        if self.thread is not None and not quiet and not self.replaying:
            self.thread.say(slack_msg.progress(event, detail))

    def stopped(self, container: str | None, bundle: str, outcome: str, why: str) -> Response:
        """The answer to a response that stopped before a report: its container does not
        exist (`no-such-container`), or another fix of it holds its lock (`locked`)."""
        if outcome == "locked":
            self.mark("another fix holds the lock", why)
        return Response(
            host=self.tgt.name,
            container=container,
            incident="unknown",
            confidence=0.0,
            summary=why,
            outcome=outcome,
            detail=why,
            bundle=bundle,
            report="",
            flow_run_id=self.run_id,
            flow_run_url=self.links.get("Prefect flow run"),
        )


@dataclass
class _Result:
    """Where a response stands before its report: status, detail, and what was done."""

    status: str
    detail: str = ""
    outcome: Outcome | None = None
    approval: str | None = None

    @classmethod
    def before_apply(cls, prepared: Prepared, no_plan: str | None) -> _Result:
        fix = prepared.diagnosis.fix
        if prepared.plan is not None:
            return cls("planned", "dry run: nothing was changed")
        if no_plan is not None:
            return cls("not-applied", no_plan)
        if fix is not None and fix.steps:
            return cls("needs-a-person", "no safe automatic fix; see the action items")
        return cls("diagnosed")


def _recover(run: _Run, container: str) -> Outcome | Locked | None:
    """Finish or roll back an interrupted fix of this container first (a progress step when
    there was one to finish); `Locked` when another fix holds the container's lock."""
    found = recover_task(run.tgt, container, run.settings)
    if isinstance(found, str):
        run.mark("recovery skipped", found)
        return None
    if isinstance(found, Outcome):
        progress.end("recover", found.message)  # shown once it happened: most runs have none
        run.mark("interrupted fix finished", found.message)
    return found


def _collect(run: _Run, container: str | None, trigger_text: str | None) -> str:
    progress.begin("collect", f"from {run.tgt.name}" + (f" / {container}" if container else ""))
    bundle = collect_task.with_options(
        timeout_seconds=run.book.timeouts.collect, retries=run.book.retries, retry_delay_seconds=5
    )(run.tgt, container, trigger_text, run.settings, run.book)
    progress.end("collect", _sources_line(Path(bundle)))
    run.mark("evidence collected", f"bundle {bundle}")
    return bundle


def _diagnose(run: _Run, bundle: str) -> Diagnosis:
    progress.begin("classify")
    diagnosis = classify_task.with_options(timeout_seconds=run.book.timeouts.classify)(
        bundle, run.settings
    )
    said = f"{diagnosis.incident} (confidence {diagnosis.confidence:.2f})"
    progress.end("classify", said)
    run.mark("diagnosed", said)
    tag_run(run.run_id, f"incident:{diagnosis.incident}")
    return diagnosis


@task(name="dcgm-diagnostic", cache_policy=NO_CACHE, retries=0)
def dcgm_diag_task(target: Target, settings: Settings, bundle: str) -> str:
    from runbooks.collect.dcgm import run_diag

    result = run_diag(target, settings, Path(bundle))
    return f"{result.command or 'dcgmi diag'}: {result.status}" + (
        f" ({result.error or result.note})" if result.error or result.note else ""
    )


def _dcgm_diag(run: _Run, bundle: str, diagnosis: Diagnosis) -> Diagnosis:
    """A suspected hardware fault on a host with DCGM: run `dcgmi diag -r 1` (seconds, read-only)
    into the bundle and diagnose again, so DCGM's own verdict is part of the evidence."""
    from runbooks.collect.dcgm import has_dcgm
    from runbooks.core.taxonomy import Incident

    if diagnosis.incident != Incident.GPU_HARDWARE_FAULT or not has_dcgm(Path(bundle)):
        return diagnosis
    progress.begin("dcgm", "dcgmi diag -r 1")
    said = dcgm_diag_task.with_options(timeout_seconds=180)(run.tgt, run.settings, bundle)
    progress.end("dcgm", said)
    run.mark("DCGM diagnostic", said)
    return _diagnose(run, bundle)


GPU_HARDWARE_FAULT = "gpu-hardware-fault"
RMA_OFFER = (
    "RMA evidence: run nvidia-bug-report.sh on the host (the driver's logs NVIDIA asks for with "
    "an RMA; a minute or more, read-only). Approve to run it."
)


@task(name="rma-evidence", cache_policy=NO_CACHE, retries=0)
def rma_task(target: Target, settings: Settings) -> BugReport:
    from runbooks.collect.dcgm import runner_for
    from runbooks.core.errors import CudamedicError
    from runbooks.diagnose.rma import run_bug_report

    try:
        runner = runner_for(target, settings)
    except CudamedicError as exc:
        return BugReport(status="error", error=str(exc))
    try:
        return run_bug_report(runner, settings.bug_report_command)
    finally:
        runner.close()


def _rma(
    run: _Run, prepared: Prepared, approved_by: str | None, apply: bool
) -> tuple[str, str | None]:
    """A hardware fault: offer to run nvidia-bug-report.sh behind the same approval as a fix
    (an approval given up front, or a person's answer to the paused run); the post-mortem's
    "open an RMA" item, and who answered."""
    from runbooks.collect.bundle import open_bundle
    from runbooks.diagnose.facts import gather
    from runbooks.diagnose.rma import rma_item

    with open_bundle(Path(prepared.bundle)) as b:
        facts = gather(b)
    report, said = None, None
    if apply:
        if approved_by and run.in_process:
            up_front = Approval(decision="approve", by=approved_by, reason="approved up front")
            decision = _judged(run, prepared, up_front, how=OS_USER)
        else:
            decision = _wait_for_approval(prepared, run, "rma", extra=RMA_OFFER)
        if decision is not None:
            said = f"{decision.decision} by {decision.by}"
        if decision is not None and decision.decision == "approve":
            progress.begin("apply", f"nvidia-bug-report.sh on {run.tgt.name}")
            report = rma_task.with_options(timeout_seconds=1000)(run.tgt, run.settings)
            progress.end("apply", report.status)
            run.mark("RMA evidence", f"nvidia-bug-report.sh: {report.status}")
        else:
            run.mark("RMA evidence not collected", said or "nobody answered")
    return rma_item(facts, report, offered=apply), said


def _plan(
    run: _Run, subject: str | None, prepared: Prepared
) -> tuple[Prepared, str | Locked | None]:
    """The safe fix's plan for `subject`, or why there is none (None: no safe fix to plan)."""
    fix = prepared.diagnosis.fix
    if not subject or subject == "log" or fix is None or not fix.safe:
        return prepared, None
    progress.begin("plan", f"for {subject}")
    planned = plan_task(run.tgt, subject, prepared.bundle, prepared.diagnosis, run.settings)
    if isinstance(planned, Locked):
        progress.end("plan", f"not planned: {planned.message}")
        return prepared, planned
    if isinstance(planned, str):
        run.mark("no plan", planned)
        progress.end("plan", f"no plan: {planned}")
        return prepared, planned
    diff = [ln for ln in planned.plan.diff if ln[:1] in "+-"] if planned.plan else []
    progress.end("plan", " / ".join(diff) or "nothing to change")
    run.mark("fix planned", " / ".join(diff))
    return planned, None


def _approve_and_apply(
    run: _Run, prepared: Prepared, approved_by: str | None, named: bool
) -> _Result:
    """Get the approval (up front, the runbook's policy, or a person), then apply the plan."""
    plan = prepared.plan
    assert plan is not None
    tags = run.tgt.host.tags if run.tgt.host else ()
    policy = effective_policy(run.settings, run.book)
    decision, unattended = _decision_without_waiting(run, prepared, approved_by, tags, named)
    if decision is None:
        decision = _wait_for_approval(prepared, run, "fix")
    if decision is None:
        waited = f"{run.book.timeouts.approval:g}"
        return _Result(
            "approval-timed-out", f"nobody answered within {waited} s; nothing was changed"
        )
    said = f"{decision.decision} by {decision.by}" + (
        f" ({decision.reason})" if decision.reason else ""
    )
    run.mark("approval", said)
    progress.end("approval", said)
    if decision.decision == "reject":
        return _Result("rejected", f"rejected by {decision.by}; nothing was changed", None, said)
    why_not = refusal(plan, tags, policy, run.settings, confirmed=True, unattended=unattended)
    if why_not is not None:
        run.mark("refused", why_not)
        return _Result("refused", why_not, None, said)
    progress.begin("apply", f"to {plan.container} on {run.tgt.name}")
    try:
        applied = apply_task.with_options(timeout_seconds=run.book.timeouts.apply)(
            run.tgt, prepared, run.settings, decision.by, unattended
        )
    except Exception as exc:  # the report is still written
        applied = f"{type(exc).__name__}: {exc}"
    if isinstance(applied, Locked):
        progress.end("apply", f"not applied: {applied.message}")
        return _Result("locked", applied.message, None, said)
    if isinstance(applied, str):
        run.mark("fix not applied", applied)
        progress.end("apply", f"not applied: {applied}")
        return _Result("not-applied", applied, None, said)
    done = "fix applied" if applied.status in ("fixed", "recovered") else "fix failed"
    run.mark(done, f"{applied.status}: {applied.message}")
    progress.end("apply", applied.status)
    progress.end("verify", _checks_line(applied))
    return _Result("planned", "", applied, said)


def _decision_without_waiting(
    run: _Run, prepared: Prepared, approved_by: str | None, tags: Any, named: bool
) -> tuple[Approval | None, bool]:
    """An approval given up front (judged like any answer) or the runbook's unattended policy
    (behind the breaker); (None, False) when a person must answer. With no container named, a
    fix runs unattended only when exactly that container's own evidence shows the fault."""
    from runbooks.diagnose.remedy import own_evidence

    plan = prepared.plan
    assert plan is not None
    policy = effective_policy(run.settings, run.book)
    if approved_by and take_up_front(flow_run.get_name(), approved_by):
        up_front = Approval(decision="approve", by=approved_by, reason="approved up front")
        return _judged(run, prepared, up_front, how=OS_USER), False
    if approved_by:  # a parameter of a run created through the Prefect API: nobody was asked
        run.mark("up-front approval ignored", "approved_by counts only for a CLI run in-process")
    if not policy.allows_unattended(plan.incident, tags):
        return None, False
    cited = own_evidence(prepared.diagnosis.evidence)
    if not named and cited != (plan.container,):
        why = (
            f"the evidence shows the fault in {len(cited)} containers ({', '.join(cited)})"
            if len(cited) > 1
            else f"the evidence is not {plan.container}'s own"
        )
        run.mark("unattended fix held", f"no container was named and {why}: a person decides")
        return None, False
    allowed, why = admit_unattended(run.book)
    if allowed:
        return Approval(decision="approve", by="policy", reason="runbook policy"), True
    run.mark("unattended fix held", why)
    return None, False


def _judged(
    run: _Run,
    prepared: Prepared,
    answer: Approval,
    how: str | None = None,
    earlier: tuple[str, ...] = (),
) -> Approval | None:
    """The answer when its identity may give it (the identity in `by`), else None; audited
    either way (`cudamedic.approval.approved|rejected|refused`, with how the identity was
    established). `how`: an identity this process established itself (an up-front `--yes`).
    `earlier`: who approved already when a second approver is needed."""
    who, established, why_not = approvals.judge(
        run.settings, answer, run.run_id or "", run.requester, established=how
    )
    if why_not is None and answer.decision == "approve" and who in earlier:
        why_not = f"{who} approved already: a second approver must be someone else"
    action = "approval.refused" if why_not else APPROVAL_EVENTS[answer.decision]
    audit(
        run.settings.state_path,
        action,
        host=run.tgt.name,
        container=prepared.plan.container if prepared.plan else None,
        flow_run=run.run_id,
        decision=answer.decision,
        by=answer.by,
        identity=who,
        established=established,
        requester=identity(run.settings, run.requester),
        requester_established=run.requester_how,
        reason=answer.reason,
        refusal=why_not,
    )
    if why_not is not None:
        run.mark("answer refused", f"{answer.decision} by {answer.by}: {why_not}")
        return None
    return answer.model_copy(update={"by": who})


# the audit action of an answer the flow took (`cudamedic.approval.rejected`, never `rejectd`)
APPROVAL_EVENTS = {"approve": "approval.approved", "reject": "approval.rejected"}


def _report(
    run: _Run, prepared: Prepared, subject: str | None, pm: Any, result: _Result
) -> Response:
    """Write the post-mortem (and post it to the Slack thread), audit, and answer."""
    diagnosis, plan = prepared.diagnosis, prepared.plan
    progress.begin("report")
    report = report_task.with_options(timeout_seconds=run.book.timeouts.report)(pm, run.settings)
    progress.end("report", report)
    if run.thread is not None:
        from reports.render import render_markdown

        thread = run.thread
        thread.headline(
            slack_msg.root_text(run.tgt.name, subject, thread.requester, f"*{pm.outcome}*")
        )
        thread.report(pm, render_markdown(pm), Path(report).name)
    audit(
        run.settings.state_path,
        "response",
        host=run.tgt.name,
        container=subject,
        incident=diagnosis.incident,
        outcome=pm.outcome,
        report=report,
        flow_run=run.run_id,
    )
    return Response(
        host=run.tgt.name,
        container=subject,
        incident=diagnosis.incident,
        confidence=diagnosis.confidence,
        summary=pm.summary,
        outcome=pm.outcome,
        detail=pm.outcome_detail,
        bundle=prepared.bundle,
        report=report,
        diff=list(plan.diff) if plan else [],
        approval=result.approval,
        flow_run_id=run.run_id,
        flow_run_url=run.links.get("Prefect flow run"),
        similar=list(diagnosis.similar),
        basis=diagnosis.basis,
    )


# -- waiting for a person --------------------------------------------------------------------
# A run of a deployment (a worker, `cudamedic serve`) is suspended while it waits: its process
# ends and its pool slot is free; the answer makes the run Scheduled again, any worker runs it
# from the start (collecting fresh evidence), and the answer is taken at the same wait. The wait
# itself is kept with the run in Prefect (`Waiting`), so the replay neither asks again nor judges
# an answer twice, and an answer counts only for the plan that was shown. A `cudamedic triage`
# run (no deployment) pauses in its own process as before.
WAITING_KEY = "cudamedic-waiting-"  # + purpose ("fix", "rma"): a flow run input of the run
SUSPEND_MARGIN_S = 600  # Prefect fails a suspended run this long after the approval timeout


class Waiting(BaseModel):
    """A response's wait for a person, kept with its run in Prefect (hostile input like all
    that is stored there: validated, bounded; the approvals so far are sealed)."""

    purpose: Literal["fix", "rma"]
    round: int = Field(default=1, ge=1, le=10_000)  # the pause key: `<purpose>-approval-<round>`
    digest: str = Field(max_length=64)  # of what the person was shown
    asked_at: float
    started_at: datetime
    events: list[tuple[datetime, str, str]] = Field(default=[], max_length=200)
    approvals: list[str] = Field(default=[], max_length=2)  # a second is needed: see _needs_two
    seal: str = ""  # HMAC of the approvals (approval_key or the bot token), "" when neither
    request: WaitingApproval


def _seal(settings: Settings, run_id: str, digest: str, approved: list[str]) -> str:
    from runbooks.fix.approvals import start_proof

    key = settings.approval_key or settings.slack_bot_token
    if key is None:
        return ""
    return start_proof(key.get_secret_value(), "waiting", run_id, digest, *approved)


def _digest(run: _Run, prepared: Prepared, extra: str) -> str:
    """What an answer approves: the host, the container as it was planned (its id), the class
    and the change; a replay that plans anything else asks again."""
    import hashlib

    plan = prepared.plan
    what = [run.tgt.name, prepared.diagnosis.incident, extra]
    if plan is not None:
        what += [plan.container, plan.container_id, *plan.diff]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def _waited(run_id: str | None) -> bool:
    """Has this run waited for a person before (a replay: its thread heard the steps once)?"""
    from uuid import UUID

    if not run_id:
        return False
    try:
        with get_client(sync_client=True) as client:
            found = client.filter_flow_run_input(
                flow_run_id=UUID(run_id), key_prefix=WAITING_KEY, limit=1, exclude_keys=set()
            )
    except Exception:  # only the Slack thread's noise depends on it
        return False
    return bool(found)


def _read_waiting(run: _Run, purpose: str) -> Waiting | None:
    from uuid import UUID

    from prefect.input.actions import read_flow_run_input
    from pydantic import ValidationError

    if not run.run_id:
        return None
    raw = read_flow_run_input(WAITING_KEY + purpose, flow_run_id=UUID(run.run_id))
    if raw is None:
        return None
    try:
        waiting = Waiting.model_validate(raw)
    except ValidationError:
        run.mark("wait record unreadable", "asking again")
        return None
    if waiting.approvals and waiting.seal != _seal(
        run.settings, run.run_id, waiting.digest, waiting.approvals
    ):
        run.mark("wait record altered", "the approvals it lists do not count")
        waiting = waiting.model_copy(update={"approvals": [], "seal": ""})
    return waiting


def _save_waiting(run: _Run, waiting: Waiting) -> None:
    from uuid import UUID

    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
    from prefect.input.actions import create_flow_run_input, delete_flow_run_input

    if not run.run_id:
        return
    key, uid = WAITING_KEY + waiting.purpose, UUID(run.run_id)
    try:
        delete_flow_run_input(key, flow_run_id=uid)
    except (ObjectNotFound, PrefectHTTPStatusError):
        pass  # the first save
    create_flow_run_input(key, waiting.model_dump(mode="json"), flow_run_id=uid)


def _wait_for_approval(
    prepared: Prepared, run: _Run, purpose: Literal["fix", "rma"], extra: str = ""
) -> Approval | None:
    """Wait until a person answers; None when nobody allowed to did in time. `extra`: what
    else the answer allows (the RMA evidence of a hardware fault), shown with the plan."""
    digest = _digest(run, prepared, extra)
    waiting = _read_waiting(run, purpose)
    if waiting is not None and waiting.digest != digest:
        run.mark(
            "the plan changed while it waited",
            "an answer to the plan shown earlier does not count: asking again",
        )
        waiting = _ask(prepared, run, purpose, extra, digest, waiting.round + 1)
    elif waiting is not None:
        run.resumed(waiting)
    else:
        waiting = _ask(prepared, run, purpose, extra, digest, 1)
    deadline = waiting.asked_at + run.book.timeouts.approval
    while True:
        key = f"{purpose}-approval-{waiting.round}"
        # an answer that scheduled this run again counts, even when a worker took it late
        answer = _answer_for(run, key)
        if answer is None:
            if (left := int(deadline - time.time())) <= 0:
                break
            answer = _pause(run, left, key)
        # before judging: a later replay of this run never judges this answer again
        waiting = waiting.model_copy(update={"round": waiting.round + 1})
        _save_waiting(run, waiting)
        if answer is None:
            continue  # woken without an answer: the deadline decides
        judged = _judged(run, prepared, answer, earlier=tuple(waiting.approvals))
        if judged is None:
            progress.begin("approval", f"(flow run {run.run_id}) still waiting: answer refused")
            continue
        if judged.decision == "approve" and _needs_two(run) and not waiting.approvals:
            approved = [judged.by]
            seal = _seal(run.settings, run.run_id or "", digest, approved)
            waiting = waiting.model_copy(update={"approvals": approved, "seal": seal})
            _save_waiting(run, waiting)
            run.mark(
                "approval 1 of 2",
                f"by {judged.by}: who started this response is not established ({run.requester}"
                "), so a second approver must approve too",
            )
            continue
        if judged.decision == "approve" and waiting.approvals:
            judged = judged.model_copy(update={"by": " and ".join([*waiting.approvals, judged.by])})
        return judged
    run.mark("approval timed out")
    progress.end("approval", "nobody allowed to answer did in time")
    return None


def _needs_two(run: _Run) -> bool:
    """Four-eyes with a requester nobody established (a run created through the Prefect API
    without a signed start): one approver could have asked for it, so two must approve."""
    return enforced(run.settings) and four_eyes(run.settings) and run.requester_how == CLAIMED


def _ask(
    prepared: Prepared, run: _Run, purpose: Literal["fix", "rma"], extra: str, digest: str, n: int
) -> Waiting:
    """Ask for an answer: the approval artifact, the Slack thread, the approvers' channels
    (flows/announce.py) and the event `cudamedic.approval.waiting`; kept with the run."""
    from datetime import UTC, timedelta

    from flows import announce
    from runbooks.fix.fixer import render_plan

    tgt, run_id, d, plan = run.tgt, run.run_id or "", prepared.diagnosis, prepared.plan
    plan_text = render_plan(prepared) + (f"\n{extra}" if extra else "")
    approve = f"cudamedic approve {run_id}"
    text = (
        f"# Fix waiting for approval: {tgt.name}\n\n```text\n{plan_text}\n```\n\n"
        f"Approve: `{approve}`; reject: `{approve} --reject`\n"
    )
    create_markdown_artifact(
        markdown=text,
        key="approval-" + slug(tgt.name)[:80],
        description="A fix plan waiting for a person",
    )
    run.mark("waiting for approval", approve, quiet=True)
    progress.begin("approval", f"(flow run {run_id})" if run_id else "")
    evidence = [f"{ln.source}:{ln.line}: {ln.text}" for ln in d.evidence]
    if run.thread is not None and plan is not None and run_id:
        thread = run.thread
        thread.say(
            f"Fix waiting for approval: {d.incident} on {tgt.name}",
            slack_msg.approval_blocks(
                run_id=run_id,
                requester=thread.requester,
                host=tgt.name,
                container=plan.container,
                incident=d.incident,
                confidence=d.confidence,
                summary=d.summary,
                diff=plan.diff,
                evidence=evidence,
            ),
        )
        thread.headline(
            slack_msg.root_text(tgt.name, plan.container, thread.requester, "waiting for approval")
        )
    asked = datetime.now(UTC)
    request = announce.WaitingApproval(
        run_id=run_id,
        fleet=run.settings.fleet,
        host=tgt.name,
        container=plan.container if plan else None,
        incident=d.incident,
        confidence=d.confidence,
        summary=d.summary[:2000],
        diff=[ln for ln in plan.diff if ln[:1] in "+-"][:50] if plan else [],
        evidence=[ln[:300] for ln in evidence[:6]],
        offer=extra,
        requester=identity(run.settings, run.requester),
        detected_by=run.detected_by,
        asked_at=asked.isoformat(timespec="seconds"),
        expires_at=(asked + timedelta(seconds=run.book.timeouts.approval)).isoformat(
            timespec="seconds"
        ),
        approve=approve,
        reject=f"{approve} --reject",
        url=run.links.get("Prefect flow run"),
    )
    waiting = Waiting(
        purpose=purpose,
        round=n,
        digest=digest,
        asked_at=asked.timestamp(),
        started_at=run.started,
        events=run.events[-200:],
        request=request,
    )
    _save_waiting(run, waiting)
    failed = announce.announce(run.settings, request)
    for why in failed:
        run.mark("approval not announced", why)
    audit(
        run.settings.state_path,
        "approval.waiting",
        host=tgt.name,
        container=request.container,
        flow_run=run_id,
        incident=d.incident,
        requester=request.requester,
        requester_established=run.requester_how,
        announced=announce.channels(run.settings),
        failed=failed,
    )
    return waiting


def _answer_for(run: _Run, key: str) -> Approval | None:
    """The answer a suspended run got under the pause key `key` (None: none yet). What the
    Prefect API stores is hostile input: an answer that is not an Approval is none."""
    from uuid import UUID

    from prefect.input.actions import read_flow_run_input
    from pydantic import ValidationError

    if not run.suspendable or not run.run_id:
        return None
    raw = read_flow_run_input(f"suspended-{key}-response", flow_run_id=UUID(run.run_id))
    if raw is None:
        return None
    try:
        return Approval.model_validate(raw)
    except ValidationError:
        run.mark("answer unreadable", f"under {key}: not an approval")
        return None


def _pause(run: _Run, seconds: int, key: str) -> Approval | None:
    """Wait for an answer under the pause key `key`, at most `seconds`; None when there was
    none. A deployment's run is suspended (its process ends here; the answer, or the approval
    timeout's automation, schedules it again); a CLI run pauses in its process."""
    from pydantic import ValidationError

    if run.suspendable:
        from prefect.flow_runs import suspend_flow_run

        try:
            return suspend_flow_run(
                wait_for_input=Approval, timeout=seconds + SUSPEND_MARGIN_S, key=key
            )
        except ValidationError:  # scheduled again without an answer (the timeout's automation)
            return None
        except RuntimeError as exc:  # Prefect refused to suspend it: wait in this process
            get_run_logger().warning("waiting in this process: %s", exc)
    try:
        return pause_flow_run(wait_for_input=Approval, timeout=seconds, poll_interval=2, key=key)
    except FlowPauseTimeout:
        # Prefect leaves the run Paused (and would fail it at the end); nobody answered, so the
        # response goes on without the fix and reports that: the run is Running again.
        if run.run_id:
            from uuid import UUID

            from prefect.states import Running

            with get_client(sync_client=True) as client:
                client.set_flow_run_state(UUID(run.run_id), Running(), force=True)
        return None


def _sources_line(bundle: Path) -> str:
    """`14 sources, 2 failed` (or why the target was not reached), for the progress line."""
    from runbooks.collect.collector import failed_sources, finding_message

    if (why := finding_message(bundle, "target-unreachable")) is not None:
        return f"not reached: {why}"
    try:
        sources = json.loads((bundle / "bundle.json").read_text(encoding="utf-8"))["sources"]
    except (OSError, ValueError, KeyError):
        return str(bundle)
    return f"{len(sources)} sources, {len(failed_sources(bundle))} failed"


def _checks_line(outcome: Outcome) -> str:
    """`3/3 checks ok` or the failed ones, for the progress line."""
    failed = [c.name for c in outcome.checks if not c.ok]
    ok = len(outcome.checks) - len(failed)
    return f"{ok}/{len(outcome.checks)} checks ok" + (
        f"; failed: {', '.join(failed)}" if failed else ""
    )
