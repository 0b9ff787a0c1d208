"""The fix procedure end to end (SHELL): recover, collect, diagnose, plan, decide, apply.

Used by `cudamedic fix` and `cudamedic rollback`, and by the flows. Decisions (what to change,
whether policy allows it) stay in the pure modules; this module only sequences I/O.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runbooks.collect.collector import collect, engine_session, missing_container
from runbooks.collect.evidence.docker_inspect import docker_time
from runbooks.collect.redact import redact_json, redact_text
from runbooks.collect.remote.docker import DockerEngine
from runbooks.collect.target import Target
from runbooks.core.errors import CudamedicError, FixError, FixLocked, NoSuchContainer
from runbooks.core.model import Diagnosis, FixPlan, Frozen
from runbooks.core.names import container_name
from runbooks.core.policy import Policy
from runbooks.core.runbook import Runbook
from runbooks.core.settings import Settings
from runbooks.diagnose.classify import classify_path
from runbooks.fix import fixlock
from runbooks.fix.journal import Journal, applied_within, audit, container_lock, now, who
from runbooks.fix.plan import plan_fix
from runbooks.fix.recreate import Outcome, apply_plan, cleanup_backups, manual_rollback, recover

if TYPE_CHECKING:
    from reports.render import CheckResult, PostMortem, TimelineEvent

log = logging.getLogger(__name__)


class Prepared(Frozen):
    bundle: str
    diagnosis: Diagnosis
    plan: FixPlan | None = None
    recovered: Outcome | None = None
    inspect: dict[str, Any] = {}


@contextlib.contextmanager
def _locked(
    target: Target, container: str, settings: Settings
) -> Iterator[tuple[DockerEngine, Journal, Outcome | None]]:
    """The container's fix lock and an engine, after finishing any interrupted fix (audited)."""
    journal = Journal(settings.state_path, target.name, container)
    with (
        container_lock(settings.state_path, target.name, container),
        engine_session(target, settings) as engine,
    ):
        recovered = recover(engine, journal)
        if recovered is not None:
            audit(
                settings.state_path,
                "recover",
                host=target.name,
                container=container,
                outcome=recovered.status,
                message=recovered.message,
            )
        yield engine, journal, recovered


def prepare(
    target: Target,
    container: str,
    settings: Settings,
    trigger: str | None = None,
    runbook: Runbook | None = None,
) -> Prepared:
    """Finish any interrupted fix, then collect, classify and plan (changes nothing else)."""
    container = container_name(container)
    recovered = recover_interrupted(target, container, settings)
    bundle = collect(target, settings, container=container, trigger=trigger, runbook=runbook)
    if (why := missing_container(bundle)) is not None:
        raise NoSuchContainer(why)
    diagnosis = classify_path(bundle, state_dir=settings.state_path)
    return plan_for(target, container, str(bundle), diagnosis, settings, recovered)


def recover_interrupted(target: Target, container: str, settings: Settings) -> Outcome | None:
    """Finish or roll back a fix of this container that a crash interrupted (None: there was
    none)."""
    with _locked(target, container_name(container), settings) as (_engine, _journal, recovered):
        return recovered


def plan_for(
    target: Target,
    container: str,
    bundle: str,
    diagnosis: Diagnosis,
    settings: Settings,
    recovered: Outcome | None = None,
) -> Prepared:
    """The fix plan for `container` from its diagnosis (None when there is no safe fix)."""
    container = container_name(container)
    with engine_session(target, settings) as engine:
        if (held := fixlock.read(engine, container)) is not None:
            raise FixLocked(
                f"another fix of {target.name}/{container} holds its lock on the target (held "
                f"by {held.holder.who}); nothing was done: wait for it, then respond again if "
                "the container still fails"
            )
        inspect = engine.inspect(container)
        image_id = engine.image_id(str((inspect.get("Config") or {}).get("Image") or ""))
        image_env = _image_env(engine, str(inspect.get("Image") or ""))
    seen = _evidence_id(bundle, container)
    live = str(inspect.get("Id", ""))
    if seen and live and seen != live:
        raise FixError(
            f"{container} changed since its evidence was collected (now container {live[:12]}, "
            f"the evidence shows {seen[:12]}): another fix or a redeploy recreated it; "
            "nothing was changed — respond again if it still fails"
        )
    plan = None
    fix = diagnosis.fix
    if fix is not None and fix.container and fix.container != container.split(".", 1)[0]:
        raise FixError(
            f"the fix was diagnosed for {fix.container}, not {container}: nothing was planned "
            f"for {container} (its own evidence does not show the fault)"
        )
    if fix is not None and fix.safe and fix.change is not None:
        plan = plan_fix(
            host=target.name,
            inspect=inspect,
            fix=fix,
            incident=diagnosis.incident,
            summary=diagnosis.summary,
            current_image_id=image_id,
            now=now(),
            settle_s=settings.fix_settle_s,
            retention_h=settings.fix_backup_retention_h,
            image_env=image_env,
        )
    return Prepared(
        bundle=bundle, diagnosis=diagnosis, plan=plan, recovered=recovered, inspect=inspect
    )


def _evidence_id(bundle: str, container: str) -> str | None:
    """The container id the evidence bundle saw (None when it has no readable inspect)."""
    try:
        data = json.loads((Path(bundle) / "containers" / f"{container}.inspect.json").read_text())
    except (OSError, ValueError):
        return None
    return str(data.get("Id") or "") or None if isinstance(data, dict) else None


def _image_env(engine: DockerEngine, image_id: str) -> list[str]:
    try:
        info = engine.inspect_image(image_id)
    except CudamedicError:  # only used to hide image-provided env from the displayed command
        return []
    env = (info.get("Config") or {}).get("Env") if isinstance(info, dict) else None
    return [e for e in env if isinstance(e, str)] if isinstance(env, list) else []


def refusal(
    plan: FixPlan,
    tags: tuple[str, ...],
    policy: Policy,
    settings: Settings,
    confirmed: bool,
    unattended: bool = False,
) -> str | None:
    """Why this fix may not run now, or None. `confirmed`: --yes or an interactive yes.
    `unattended`: no person approved it. The fleet-wide count in Prefect (events anyone with
    API access can emit) gates unattended fixes only, and one it cannot read whole refuses
    them; a person's fix is counted against this machine's audit log (this fleet's entries)."""
    if not confirmed and not policy.allows_unattended(plan.incident, tags):
        return (
            "--apply needs --yes (or an interactive confirmation), or a policy that allows "
            f"unattended {plan.incident} fixes on this host's tags {list(tags)}"
        )
    from runbooks.fix.audit import CountUnknown

    ask_prefect = unattended or not confirmed
    try:
        recent = applied_within(
            settings.state_path, timedelta(hours=1), settings.fleet, fleet_wide=ask_prefect
        )
    except CountUnknown as exc:
        return f"the fleet's fix count is unknown ({exc}): unattended fixes are refused"
    if recent >= policy.max_fixes_per_hour:
        return (
            f"blast-radius limit: {recent} fix attempt(s) started in fleet {settings.fleet} in "
            f"the last hour, the policy allows {policy.max_fixes_per_hour}. Every attempt counts, "
            "a rolled-back or interrupted one too (it stopped and restarted its workload as well); "
            "wait, or raise max_fixes_per_hour"
        )
    return None


def execute(
    target: Target,
    prepared: Prepared,
    settings: Settings,
    *,
    approved_by: str | None = None,
    unattended: bool = False,
) -> Outcome:
    plan = prepared.plan
    if plan is None:
        raise FixError("nothing to apply: the diagnosis has no safe automatic fix")
    journal = Journal(settings.state_path, target.name, plan.container)
    with (
        container_lock(settings.state_path, target.name, plan.container),
        engine_session(target, settings) as engine,
    ):
        current = engine.inspect(plan.container)
        if current.get("Id") != plan.container_id:
            raise FixError(
                f"{plan.container} changed since it was planned (new container "
                f"{str(current.get('Id'))[:12]}); plan again"
            )
        audit(
            settings.state_path,
            "apply",
            host=target.name,
            container=plan.container,
            incident=plan.incident,
            before=list(plan.docker_run_before),
            after=list(plan.docker_run_after),
            bundle=prepared.bundle,
            approved_by=approved_by,
            unattended=unattended,
            fleet=settings.fleet,  # the fleet-wide fix cap counts these events
        )
        # The journal keeps a redacted snapshot: enough to restore by hand, no secrets on disk.
        outcome = apply_plan(engine, plan, settings, journal, redact_json(current))
        audit(
            settings.state_path,
            "applied" if outcome.status == "fixed" else "fix-failed",
            host=target.name,
            container=plan.container,
            incident=plan.incident,
            outcome=outcome.status,
            message=outcome.message,
            checks=[c.model_dump() for c in outcome.checks],
            approved_by=approved_by,
            unattended=unattended,
            fleet=settings.fleet,
        )
        if outcome.status != "fixed":
            outcome = outcome.model_copy(
                update={"message": outcome.message + _hint(outcome.message)}
            )
        removed = cleanup_backups(engine, journal, settings, now())
        if removed:
            audit(settings.state_path, "cleanup", host=target.name, removed=removed)
    return outcome


def failure_cause(message: str) -> str | None:
    """The incident class a failed fix's own error points at (e.g. the toolkit-missing error
    when --gpus fails), else None."""
    from runbooks.diagnose.logscan import scan_text, signature

    hits = scan_text(message, "outcome").hits
    causes = [signature(sid) for sid in hits if signature(sid).role == "cause"]
    return str(max(causes, key=lambda sig: sig.weight).incident) if causes else None


def _hint(message: str) -> str:
    """What the failure itself points at, and what a person should do about it."""
    from runbooks.core.taxonomy import Incident
    from runbooks.diagnose.remedy import MANUAL

    cause = failure_cause(message)
    if cause is None:
        return ""
    steps = MANUAL.get(Incident(cause), ())
    return f". The failure points at {cause}" + (f": {steps[0]}" if steps else "")


def rollback(target: Target, container: str, settings: Settings) -> Outcome:
    container = container_name(container)
    with _locked(target, container, settings) as (engine, journal, recovered):
        if recovered is not None:
            return recovered
        outcome = manual_rollback(engine, journal, now())
    audit(
        settings.state_path,
        "rollback",
        host=target.name,
        container=container,
        outcome=outcome.status,
        message=outcome.message,
    )
    return outcome


def render_plan(prepared: Prepared) -> str:
    d, plan = prepared.diagnosis, prepared.plan
    lines = []
    if prepared.recovered is not None:
        lines.append(f"recovered: {prepared.recovered.message}")
    lines.append(f"diagnosis: {d.incident} (confidence {d.confidence:.2f})")
    lines.append(f"  {d.summary}")
    for ln in d.evidence[:4]:
        lines.append(f"  {ln.source}:{ln.line}: {ln.text.strip()[:200]}")
    lines.append(f"  bundle: {prepared.bundle}")
    if plan is None:
        if d.fix is not None and d.fix.steps:
            lines.append("no safe automatic fix; what a person should do:")
            lines.extend(f"  - {s}" for s in d.fix.steps)
        else:
            lines.append("nothing to fix.")
        return "\n".join(lines)
    lines.append(f"plan for {plan.host}/{plan.container}:")
    lines.append("  docker run (effective command; - removed, + added):")
    lines.extend(f"    {line}" for line in plan.diff)
    lines.append("  steps:")
    lines.extend(f"    {i}. {s}" for i, s in enumerate(plan.steps, 1))
    return "\n".join(lines)


def render_outcome(outcome: Outcome) -> str:
    lines = [f"outcome: {outcome.status}: {outcome.message}"]
    lines.extend(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}" for c in outcome.checks)
    return "\n".join(lines)


def plan_json(prepared: Prepared) -> str:
    data = {
        "bundle": prepared.bundle,
        "incident": prepared.diagnosis.incident,
        "plan": prepared.plan.model_dump(mode="json", exclude={"spec"}) if prepared.plan else None,
    }
    return json.dumps(data, indent=2)


def effective_policy(settings: Settings, runbook: Runbook) -> Policy:
    """The fix policy file when one is configured, else the runbook's `fixes:` section."""
    from runbooks.core.policy import load_policy

    return load_policy(settings.policy) if settings.policy else runbook.fixes


def postmortem(
    prepared: Prepared,
    settings: Settings,
    host: str,
    started: datetime,
    *,
    outcome: Outcome | None = None,
    status: str | None = None,
    detail: str = "",
    trigger: str | None = None,
    detected_by: str = "cudamedic fix",
    events: Sequence[tuple[datetime, str, str]] = (),
    approval: str | None = None,
    links: dict[str, str] | None = None,
    triggered_by: str | None = None,
    extra_actions: Sequence[str] = (),
) -> PostMortem:
    """The post-mortem of one response. `outcome`: the fix's, when one was applied; otherwise
    `status`/`detail` say where it stopped (planned, rejected, approval-timed-out, ...)."""
    from reports.render import PostMortem, TimelineEvent

    d, plan = prepared.diagnosis, prepared.plan
    container = plan.container if plan else d.container
    timeline = _timeline(prepared, started, events)
    if container and outcome is not None:
        timeline += _journal_timeline(settings, host, container)
    ended = now()
    down_since, running = _workload_state(prepared.bundle, container)
    restored = _restored_at(settings, host, container, outcome, ended)
    stopped_at, back_at = _fix_downtime(settings, host, container, outcome)
    final = outcome.status if outcome is not None else (status or "diagnosed")
    timeline.append(TimelineEvent(at=ended, event=f"outcome: {final}"))
    failed = outcome is not None and outcome.status != "fixed"
    cause = failure_cause(outcome.message) if outcome is not None and failed else None
    actions = [
        *_action_items(prepared, settings, host, container, outcome, final, cause),
        *extra_actions,
    ]
    return PostMortem(
        host=host,
        container=container,
        incident=d.incident,
        confidence=d.confidence,
        summary=redact_text(d.summary),
        trigger=redact_text(trigger) if trigger else None,
        detected_by=detected_by,
        started_at=started,
        ended_at=ended,
        outcome=final,
        outcome_detail=redact_text(outcome.message if outcome is not None else detail),
        approval=redact_text(approval) if approval else None,
        evidence=d.evidence,
        secondary=_strong_secondary(d),
        docker_run_diff=plan.diff if plan else (),
        checks=_check_results(outcome),
        timeline=tuple(sorted(timeline, key=lambda e: e.at)),
        action_items=tuple(redact_text(a) for a in actions),
        links=links or {},
        bundle=prepared.bundle,
        similar=d.similar,
        basis=d.basis,
        candidates=d.candidates,
        tells_apart=redact_text(d.tells_apart),
        failure_cause=cause,
        triggered_by=triggered_by or who(),
        down_since=None if running else down_since,
        running_at_collection=running,
        restored_at=restored,
        fix_stopped_at=stopped_at,
        fix_back_at=back_at,
    )


def _strong_secondary(d: Diagnosis) -> tuple[str, ...]:
    """The other classes a post-mortem's root cause names: only candidates as strong as a root
    cause (`rules.STRONG`), never the symptoms the primary explains (a bus error read as an OOM
    kill, /dev/shm's "No space left on device" read as a full disk)."""
    from runbooks.diagnose.rules import STRONG

    if not d.matches:
        return d.secondary
    strong = (m.incident for m in d.matches[1:] if m.confidence >= STRONG)
    return tuple(dict.fromkeys(i for i in strong if i != d.incident))


def _fix_downtime(
    settings: Settings, host: str, container: str | None, outcome: Outcome | None
) -> tuple[datetime | None, datetime | None]:
    """When the fix stopped a running container (its journal's `stop`), and when it ran again:
    the replacement verified, or the original restarted by a rollback (None: not running)."""
    if outcome is None or not container:
        return None, None
    at: dict[str, datetime] = {}
    for r in Journal(settings.state_path, host, container).current():
        with contextlib.suppress(ValueError):
            at.setdefault(str(r.get("step")), datetime.fromisoformat(str(r.get("at"))))
    if "stop" not in at:
        return None, None  # it was not running: the workload's own downtime says it all
    back = at.get("verified") if outcome.status in ("fixed", "recovered") else at.get("rolled-back")
    return at["stop"], back


def _restored_at(
    settings: Settings, host: str, container: str | None, outcome: Outcome | None, ended: datetime
) -> datetime | None:
    """When the workload ran again: the fix journal's verification, else the end of a response
    whose fix was applied and fixed or recovered (None: it was not restored)."""
    if outcome is None:
        return None
    restored = _verified_at(settings, host, container)
    if outcome.status in ("fixed", "recovered") and restored is None:
        return ended
    return restored


def _check_results(outcome: Outcome | None) -> tuple[CheckResult, ...]:
    """The verification checks of an applied fix, as the report shows them."""
    from reports.render import CheckResult

    if outcome is None:
        return ()
    return tuple(CheckResult(name=c.name, ok=c.ok, detail=c.detail) for c in outcome.checks)


def _timeline(
    prepared: Prepared, started: datetime, events: Sequence[tuple[datetime, str, str]]
) -> list[TimelineEvent]:
    """The response's own events (redacted); without any, those of a `cudamedic fix` run."""
    from reports.render import TimelineEvent

    if events:
        return [TimelineEvent(at=at, event=ev, detail=redact_text(det)) for at, ev, det in events]
    d = prepared.diagnosis
    return [
        TimelineEvent(at=started, event="fix started", detail=f"cudamedic fix by {who()}"),
        TimelineEvent(at=started, event="evidence collected", detail=f"bundle {prepared.bundle}"),
        TimelineEvent(
            at=started,
            event="diagnosed",
            detail=f"{d.incident} (confidence {d.confidence:.2f})",
        ),
    ]


def _journal_timeline(settings: Settings, host: str, container: str) -> list[TimelineEvent]:
    """The steps of the container's current fix journal, as a timeline says them."""
    from reports.render import TimelineEvent

    timeline = []
    for r in Journal(settings.state_path, host, container).current():
        try:
            at = datetime.fromisoformat(str(r.get("at")))
        except ValueError:
            continue
        event, what = journal_event(r)
        timeline.append(TimelineEvent(at=at, event=event, detail=what))
    return timeline


def _action_items(
    prepared: Prepared,
    settings: Settings,
    host: str,
    container: str | None,
    outcome: Outcome | None,
    final: str,
    cause: str | None = None,
) -> list[str]:
    """What people should do next: after a fix, watch it and fix the launch configuration at its
    source; after a fix that failed, the manual step for what its own error points at (`cause`:
    install the toolkit on that host) and the retry; otherwise the diagnosis's manual steps,
    after why the fix did not happen."""
    if outcome is not None and outcome.status == "fixed":
        return [
            f"Watch {container}'s next run; the backup {outcome.backup} is kept for "
            f"{settings.fix_backup_retention_h:g} h (`cudamedic rollback` restores it).",
            "Fix the launch configuration at its source (compose file, job template) so "
            "the next deployment does not bring the problem back.",
        ]
    fix = prepared.diagnosis.fix
    actions = list(fix.steps) if fix is not None else []
    if outcome is not None and cause is not None:
        from runbooks.core.taxonomy import Incident
        from runbooks.diagnose.remedy import MANUAL

        steps = [f"On {host}: {s}" for s in MANUAL.get(Incident(cause), ())]
        retry = (
            f"Then respond again: `cudamedic triage {host} --container {container} --apply`; "
            "the same fix should now hold."
            if container
            else "Then respond again with `cudamedic triage`."
        )
        return [*steps, retry] if steps else [f"Fix what the failure points at ({cause}).", retry]
    if outcome is not None:
        actions.insert(0, f"Read the outcome: {outcome.message}")
    elif prepared.plan is not None and final != "planned":
        actions.insert(0, f"The fix was not applied ({final}); `cudamedic triage` again to retry.")
    return actions


# A fix's journal steps (runbooks/fix/recreate.py) as a timeline says them.
_JOURNAL_WORDS = {
    "begin": "fix started",
    "stop": "original container stopped",
    "rename": "original kept as the backup",
    "create": "creating the replacement",
    "created": "replacement created",
    "start": "replacement started",
    "verified": "replacement verified",
    "done": "fix complete",
    "rolling-back": "rolling back",
    "rolled-back": "rolled back to the original container",
    "manual-rollback": "rollback by hand started",
    "manual-rollback-done": "rollback by hand complete",
}


def journal_event(record: dict[str, Any]) -> tuple[str, str]:
    """(event, detail) of one journal record, in words: container ids shortened as `docker ps`
    shows them."""
    step = str(record.get("step"))
    detail = str(record.get("reason") or record.get("to") or record.get("note") or "")
    if not detail and (cid := record.get("id")):
        detail = f"container {str(cid)[:12]}"
    return _JOURNAL_WORDS.get(step, f"fix step: {step}"), detail[:200]


def _workload_state(bundle: str, container: str | None) -> tuple[datetime | None, bool | None]:
    """When the container stopped (its FinishedAt) and whether it was running, as the evidence
    recorded them; (None, None) when not known."""
    if not container:
        return None, None
    try:
        data = json.loads(
            (Path(bundle) / "containers" / f"{container}.inspect.json").read_text(encoding="utf-8")
        )
        state = data["State"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    if not isinstance(state, dict):
        return None, None
    return docker_time(state.get("FinishedAt")), bool(state.get("Running"))


def _verified_at(settings: Settings, host: str, container: str | None) -> datetime | None:
    """When the replacement was verified (the journal's `verified` step), if it was."""
    if not container:
        return None
    for r in Journal(settings.state_path, host, container).current():
        if r.get("step") == "verified":
            with contextlib.suppress(ValueError):
                return datetime.fromisoformat(str(r.get("at")))
    return None


def save_postmortem(pm: PostMortem, settings: Settings, markdown: str | None = None) -> Path:
    """Write the post-mortem (rendered here unless `markdown` is given) into the reports
    directory; returns its path."""
    from reports.render import render_markdown, report_name
    from reports.store import save_report

    text = markdown if markdown is not None else render_markdown(pm)
    path = save_report(settings.reports_path, report_name(pm), text)
    remember(pm, path, settings)
    if settings.reports_git:
        _to_git(settings, path, pm)
    return path


def _to_git(settings: Settings, path: Path, pm: PostMortem) -> None:
    """Commit the post-mortem to the team's repository (`reports_git`); a git failure is
    logged, never the response's (the report is already written)."""
    from reports.gitstore import GitFailed, publish

    assert settings.reports_git is not None
    try:
        log.info("reports_git: %s", publish(settings.reports_git, settings.state_path, path, pm))
    except (GitFailed, OSError) as exc:
        log.warning("post-mortem %s not committed to reports_git: %s", path.name, exc)


def _history_text(pm: PostMortem) -> str:
    """What similar-incident search will match this report on: the bundle's salient evidence
    (as for any incident), else the post-mortem's decisive lines."""
    from runbooks.collect.bundle import open_bundle
    from runbooks.core.errors import CudamedicError
    from runbooks.diagnose.classify import evidence_text
    from runbooks.diagnose.facts import gather

    if pm.bundle and Path(pm.bundle).is_dir():
        try:
            with open_bundle(Path(pm.bundle)) as bundle:
                return evidence_text(gather(bundle))
        except CudamedicError:
            pass
    return "\n".join([*(ln.text for ln in pm.evidence), pm.trigger or ""])


def remember(pm: PostMortem, report: Path, settings: Settings) -> None:
    """Add the response to the team's history; a verified fix confirms its cause at once
    (`cudamedic confirm REPORT` confirms the others). Never fails the response."""
    from runbooks.diagnose.history import record_report

    fix = " ".join(ln[2:].strip() for ln in pm.docker_run_diff if ln.startswith("+ ")) or None
    try:
        record_report(
            settings.state_path,
            report=report,
            incident=pm.incident,
            host=pm.host,
            container=pm.container,
            conclusion=pm.summary,
            text=_history_text(pm),
            fix=fix,
            confirmed_by="verified fix" if pm.outcome == "fixed" else None,
            when=pm.started_at,
            fleet=settings.fleet,
        )
    except OSError as exc:
        log.warning("could not add %s to the incident history: %s", report, exc)


def write_postmortem(
    prepared: Prepared,
    outcome: Outcome,
    settings: Settings,
    host: str,
    started: datetime,
    trigger: str | None = None,
) -> Path:
    """Render the post-mortem of a `cudamedic fix` run to the reports directory."""
    pm = postmortem(prepared, settings, host, started, outcome=outcome, trigger=trigger)
    return save_postmortem(pm, settings)
