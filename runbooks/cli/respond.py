"""`cudamedic triage` and `cudamedic approve`: an incident response and its approval."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runbooks.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    JSON_HELP,
    OUTCOME_EXIT,
    TARGET_HELP,
    _confirm,
    _emit,
    _failures,
    _inventory,
    _prefect,
    _progress,
    _say_failures,
    _settings,
    show,
)

if TYPE_CHECKING:
    from flows.incident import Response
    from runbooks.cli.common import Subparsers
    from runbooks.core.cli_json import (
        FailedSource,
        TriageResult,
    )
    from runbooks.core.settings import Settings


def cmd_triage(args: argparse.Namespace) -> int:
    from runbooks.fix.approvals import cli_claim

    settings = _settings(args)
    _check_triage_input(args, settings)
    api = _prefect(args, settings)
    from flows.triage import triage
    from runbooks.core import progress

    interactive = sys.stdin.isatty() and not args.no_input and not args.json
    with _progress():
        progress.begin("start", f"on {api.removesuffix('/api')}")
        response = triage(
            args.target,
            container=args.container,
            trigger=args.trigger,
            apply=args.apply,
            approved_by=cli_claim(settings) if args.yes else None,  # judged by the flow's rule
            ask=_confirm if interactive else None,
            say=show,
            actor=cli_claim(settings),
        )
    if response.outcome == "no-such-container":
        from runbooks.core.errors import NoSuchContainer

        raise NoSuchContainer(response.detail)
    if response.outcome == "locked":  # nothing was written: the fix that holds it reports
        from runbooks.core.errors import FixLocked

        raise FixLocked(response.detail)
    _say_failures(response.host, Path(response.bundle))
    reason, failed = _failures(Path(response.bundle))
    _show_response(response)
    code = EXIT_UNREACHABLE if reason else OUTCOME_EXIT.get(response.outcome, EXIT_FAILED)
    if args.json:
        _emit(args, _triage_result(response, code, reason, failed))
    return code


def _check_triage_input(args: argparse.Namespace, settings: Settings) -> None:
    """Refuse bad input here, before a flow run starts."""
    from runbooks.collect.target import resolve_target
    from runbooks.core.runbook import load_runbook

    if args.container:
        from runbooks.core.names import container_name

        container_name(args.container)
    resolve_target(args.target, _inventory(settings))
    load_runbook(settings.runbook, "incident")


def _show_response(response: Response) -> None:
    """What a response found and did, one line each (the fix's diff and similar incidents
    indented below their heading)."""
    show(f"incident:  {response.incident} (confidence {response.confidence:.2f})")
    where = response.host + (f" / {response.container}" if response.container else "")
    show(f"where:     {where}")
    show(f"summary:   {response.summary}")
    if response.diff:
        show("fix (docker run; - removed, + added):")
        show("\n".join(f"  {ln}" for ln in response.diff if ln[:1] in "+-"))
    show(f"outcome:   {response.outcome}{': ' + response.detail if response.detail else ''}")
    if response.approval:
        show(f"approval:  {response.approval}")
    if response.similar:
        from runbooks.diagnose.classify import similar_line

        show("similar:")
        show("\n".join(f"  - {similar_line(s)}" for s in response.similar))
    show(f"report:    {response.report}")
    if response.flow_run_url:
        show(f"flow run:  {response.flow_run_url}")


def _triage_result(
    response: Response, code: int, reason: str | None, failed: list[FailedSource]
) -> TriageResult:
    """The --json object of `triage` (docs/cli-json.md)."""
    from runbooks.core.cli_json import TriageResult

    return TriageResult(
        exit_code=code,
        host=response.host,
        container=response.container,
        incident=response.incident,
        confidence=response.confidence,
        summary=response.summary,
        outcome=response.outcome,
        detail=response.detail,
        diff=response.diff,
        approval=response.approval,
        bundle=response.bundle,
        report=response.report,
        flow_run_url=response.flow_run_url,
        reachable=reason is None,
        reason=reason,
        failed_sources=failed,
    )


def cmd_approve(args: argparse.Namespace) -> int:
    """Answer as this process's OS user (`os:USER`); the flow judges it and says so in its
    audit event, which this command waits for."""
    from datetime import timedelta

    from runbooks.core.errors import InputError
    from runbooks.fix.approvals import cli_claim
    from runbooks.fix.journal import now

    if args.by is not None:
        raise InputError(
            "--by is gone: an answer is given as your OS user (os:USER), which the setting "
            "approver_os_users maps to an approver (deploy/OPERATIONS.md, 'Who may approve')"
        )
    from uuid import UUID

    try:
        UUID(args.run_id)  # before a Prefect server is asked (or started)
    except ValueError:
        raise InputError(
            f"{args.run_id!r} is not a flow run id: give the id `cudamedic triage` printed "
            "(`cudamedic approve 0b9f...`)"
        ) from None
    settings = _settings(args)
    _prefect(args, settings)
    from flows.triage import RESUME_WAIT_S, acted_since, answer, queued, verdict
    from runbooks.fix.approvals import answer_proof

    decision, by = ("reject" if args.reject else "approve"), cli_claim(settings)
    key = settings.approval_key
    # signed with the fleet's approval key where this host holds it: the flow then knows the OS
    # user was established on a trusted host, not merely claimed (runbooks/fix/approvals.py)
    proof = answer_proof(key.get_secret_value(), "os", args.run_id, decision, by) if key else ""
    asked = now()
    sent = asked - timedelta(seconds=5)  # the worker's clock may be a little behind ours
    print(answer(args.run_id, decision, by, args.reason or "", proof))
    # a suspended run (a worker's) is scheduled again: a worker takes it and collects first
    suspended = queued(args.run_id)
    judged = verdict(args.run_id, by, sent, RESUME_WAIT_S if suspended else settings.approve_wait_s)
    if judged is None and acted_since(args.run_id, asked):
        print(
            "the flow took the answer; its verdict is not in the audit trail yet: `cudamedic audit`"
        )
        return EXIT_OK
    if judged is None and queued(args.run_id):
        print(
            f"the answer is kept with flow run {args.run_id}, which waits for a worker of its "
            f"pool to take it (none did within {RESUME_WAIT_S:g} s): it is judged when one does "
            "(`cudamedic pending`, `cudamedic audit`)"
        )
        return EXIT_OK
    if judged is None:
        print(
            f"cudamedic: flow run {args.run_id} did not take the answer within "
            f"{settings.approve_wait_s:g} s: the process that ran it is gone (interrupted or "
            "killed), so it can no longer act. Respond again with `cudamedic triage`.",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if judged.get("refusal"):
        print(f"cudamedic: refused by the flow: {judged['refusal']}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"taken: {decision} by {judged.get('identity')}")
    return 0


def triage_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "triage", help="respond to an incident: collect, diagnose, plan, approve, fix, report"
    )
    p.add_argument("target", help=TARGET_HELP)
    p.add_argument("--container", help="the broken container (default: every GPU container)")
    p.add_argument("--trigger", help="the text that triggered this (e.g. a pasted error)")
    p.add_argument("--apply", action="store_true", help="fix after approval (default: dry run)")
    p.add_argument("--yes", action="store_true", help="approve up front (with --apply)")
    p.add_argument(
        "--no-input", action="store_true", help="never prompt; wait for `cudamedic approve`"
    )
    p.add_argument("--inventory", type=Path)
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_triage)


def approve_parser(sub: Subparsers) -> None:
    p = sub.add_parser("approve", help="answer a fix that waits for approval")
    p.add_argument("run_id", help="the flow run id `cudamedic triage` printed")
    p.add_argument("--reject", action="store_true", help="reject instead of approve")
    p.add_argument("--by", help=argparse.SUPPRESS)  # gone: refused with a clear error
    p.add_argument("--reason", help="why")
    p.set_defaults(func=cmd_approve)
