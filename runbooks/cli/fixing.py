"""`cudamedic fix`, `rollback`, `confirm`, `audit` and `breaker`: a fix, undoing it,
confirming its cause, the audit trail and the fleet's circuit breaker."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runbooks.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    JSON_HELP,
    OUTCOME_EXIT,
    TARGET_HELP,
    _confirm,
    _emit,
    _failures,
    _inventory,
    _prefect,
    _say_failures,
    _settings,
    show,
)

if TYPE_CHECKING:
    from runbooks.cli.common import Subparsers
    from runbooks.collect.target import Target
    from runbooks.core.cli_json import FixResult
    from runbooks.core.model import FixPlan
    from runbooks.core.policy import Policy
    from runbooks.core.settings import Settings
    from runbooks.fix.fixer import Prepared


def cmd_fix(args: argparse.Namespace) -> int:
    from runbooks.collect.target import resolve_target
    from runbooks.core.cli_json import Check
    from runbooks.core.policy import load_policy
    from runbooks.fix.fixer import execute, prepare, render_outcome, render_plan, write_postmortem
    from runbooks.fix.journal import now

    started = now()
    settings = _settings(args, policy=args.policy)
    target = resolve_target(args.target, _inventory(settings))
    policy = load_policy(settings.policy)
    prepared = prepare(target, args.container, settings, trigger=args.trigger)
    _say_failures(target.name, Path(prepared.bundle))
    show(render_plan(prepared))
    d, plan = prepared.diagnosis, prepared.plan

    def done(code: int, outcome: str, detail: str = "", **more: Any) -> int:
        if args.json:
            _emit(args, _fix_result(args, target.name, prepared, code, outcome, detail, **more))
        return code

    if plan is None:
        steps = d.fix is not None and bool(d.fix.steps)
        return done(EXIT_OK, "needs-a-person" if steps else "nothing-to-fix")
    if not args.apply:
        detail = "dry run: nothing was changed. Add --apply (and --yes) to make this change."
        show(detail)
        return done(EXIT_OK, "planned", detail)
    why = _fix_refusal(args, target, plan, policy, settings)
    if why is not None:
        show(f"cudamedic: refused: {why}", err=True)
        return done(EXIT_REFUSED, "refused", why)
    outcome = execute(target, prepared, settings)
    show(render_outcome(outcome))
    report = write_postmortem(prepared, outcome, settings, target.name, started, args.trigger)
    show(f"report: {report}")
    return done(
        OUTCOME_EXIT.get(outcome.status, EXIT_FAILED),
        outcome.status,
        outcome.message,
        checks=[Check(name=c.name, ok=c.ok, detail=c.detail) for c in outcome.checks],
        report=str(report),
    )


def _fix_refusal(
    args: argparse.Namespace, target: Target, plan: FixPlan, policy: Policy, settings: Settings
) -> str | None:
    """Why the planned fix may not be made now (None: it may). Asks for a confirmation on a
    terminal unless --yes (never with --json)."""
    from runbooks.fix.fixer import refusal

    confirmed = args.yes or (
        not args.json and _confirm(f"Apply this change to {target.name}/{args.container}?")
    )
    tags = target.host.tags if target.host else ()
    return refusal(plan, tags, policy, settings, confirmed)


def _fix_result(
    args: argparse.Namespace,
    host: str,
    prepared: Prepared,
    code: int,
    outcome: str,
    detail: str,
    **more: Any,
) -> FixResult:
    """The --json object of `fix` (docs/cli-json.md)."""
    from runbooks.core.cli_json import FixResult, Plan

    d, plan = prepared.diagnosis, prepared.plan
    return FixResult(
        exit_code=code,
        host=host,
        container=args.container,
        bundle=prepared.bundle,
        incident=d.incident,
        confidence=d.confidence,
        summary=d.summary,
        plan=Plan(diff=list(plan.diff), steps=list(plan.steps)) if plan else None,
        outcome=outcome,
        detail=detail,
        failed_sources=_failures(Path(prepared.bundle))[1],
        **more,
    )


def cmd_confirm(args: argparse.Namespace) -> int:
    from runbooks.diagnose.history import confirm
    from runbooks.fix.journal import who

    settings = _settings(args)
    # the history is the fleet's, in Prefect (runbooks/diagnose/history.py)
    _prefect(args, settings)
    incident = confirm(
        settings.state_path, args.report, args.by or who(), args.incident, fleet=settings.fleet
    )
    print(
        f"confirmed: {Path(args.report).name} is {incident}; it is now cited as a known "
        "incident of this team"
    )
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from runbooks.collect.target import resolve_target
    from runbooks.fix.fixer import render_outcome, rollback

    settings = _settings(args)
    target = resolve_target(args.target, _inventory(settings))
    outcome = rollback(target, args.container, settings)
    show(render_outcome(outcome))
    return 0 if outcome.status in ("rolled-back", "recovered", "nothing-to-do") else 6


def cmd_audit(args: argparse.Namespace) -> int:
    """The fleet's audit trail, read back from the Prefect server's events."""
    from runbooks.core.cli_json import AuditEvent, AuditResult
    from runbooks.fix.audit import line, parse_since, read
    from runbooks.fix.journal import now

    since = parse_since(args.since, now())
    settings = _settings(args)
    _prefect(args, settings)
    records = read(host=args.host, since=since)
    if args.json:
        events = [
            AuditEvent(event=r.pop("event"), occurred=r.pop("occurred"), record=r) for r in records
        ]
        _emit(args, AuditResult(exit_code=EXIT_OK, since=since.isoformat(), events=events))
        return EXIT_OK
    for record in records:
        print(line(record))
    if not records:
        print(f"no audit events since {since.isoformat(timespec='seconds')}", file=sys.stderr)
    return EXIT_OK


def cmd_breaker(args: argparse.Namespace) -> int:
    from runbooks.fix.journal import audit, who

    settings = _settings(args)
    _prefect(args, settings)
    from flows.incident import read_breaker, reset_breaker

    if args.action == "reset":
        state = reset_breaker(who())
        audit(settings.state_path, "breaker-reset", by=who())
        print(f"circuit breaker reset by {state.reset_by}: unattended fixes may run again")
        return 0
    state = read_breaker()
    if state.tripped:
        print(f"OPEN since {state.tripped_at}: {state.reason}")
        print("unattended fixes are held; `cudamedic breaker reset` re-arms it")
        return 1
    print(f"closed: {len(state.fixes)} unattended fix(es) in the current window")
    return 0


def fix_parser(sub: Subparsers) -> None:
    p = sub.add_parser("fix", help="plan (and with --apply, make) the safe fix for a container")
    p.add_argument("target", help=TARGET_HELP)
    p.add_argument("--container", required=True)
    p.add_argument("--apply", action="store_true", help="make the change (default: dry run)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--policy", type=Path, help="fix policy (unattended classes, blast radius)")
    p.add_argument("--inventory", type=Path)
    p.add_argument("--trigger", help="the text that triggered this")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_fix)


def confirm_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "confirm",
        help="confirm (or correct) the cause of a post-mortem, so it is cited as a known incident",
    )
    p.add_argument("report", help="the post-mortem (path or file name) the response wrote")
    p.add_argument("--incident", help="the cause, when it was not the diagnosed class")
    p.add_argument("--by", help="who confirms (default: this user@host)")
    p.set_defaults(func=cmd_confirm)


def rollback_parser(sub: Subparsers) -> None:
    p = sub.add_parser("rollback", help="restore the container a fix replaced (its backup)")
    p.add_argument("target")
    p.add_argument("--container", required=True)
    p.add_argument("--inventory", type=Path)
    p.set_defaults(func=cmd_rollback)


def audit_parser(sub: Subparsers) -> None:
    p = sub.add_parser("audit", help="the audit trail: fixes, approvals, refusals (Prefect events)")
    p.add_argument("--host", help="only this host's events")
    p.add_argument("--since", default="7d", help="ISO time or age like 30m, 12h, 7d (default 7d)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_audit)


def breaker_parser(sub: Subparsers) -> None:
    p = sub.add_parser("breaker", help="the fleet-wide circuit breaker for unattended fixes")
    p.add_argument("action", choices=["status", "reset"])
    p.set_defaults(func=cmd_breaker)
