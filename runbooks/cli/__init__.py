"""The `cudamedic` command line. Heavy modules are imported inside each command, not at start.

Exit status (README, "Exit status"): 0 done, 1 unexpected internal error (and the documented
"found something" answers of `sweep --fail-on-drain`, `server status`, `breaker status`),
2 usage or input error (a container that does not exist on a host that answered included),
3 target cannot be reached, 4 refused / rejected / not answered, 5 rolled back, 6 rollback
failed or another failure of the response, 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from flows.http import HttpServer
    from flows.incident import Response
    from flows.sweep import SweepResult as SweepRun
    from runbooks.collect.inventory import Inventory
    from runbooks.collect.target import Target
    from runbooks.core.cli_json import (
        CollectTarget,
        FailedSource,
        FixResult,
        SweepResult,
        TriageResult,
    )
    from runbooks.core.model import FixPlan
    from runbooks.core.policy import Policy
    from runbooks.core.settings import Settings
    from runbooks.fix.fixer import Prepared

    Subparsers: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

EXIT_OK, EXIT_INTERNAL, EXIT_INPUT, EXIT_UNREACHABLE = 0, 1, 2, 3
EXIT_REFUSED, EXIT_ROLLED_BACK, EXIT_FAILED, EXIT_INTERRUPTED = 4, 5, 6, 130
# What a fix or a response ended as -> exit status (README, "Exit status").
OUTCOME_EXIT = {
    "fixed": EXIT_OK,
    "recovered": EXIT_OK,
    "planned": EXIT_OK,
    "diagnosed": EXIT_OK,
    "needs-a-person": EXIT_OK,
    "nothing-to-fix": EXIT_OK,
    "no-such-container": EXIT_INPUT,
    "rejected": EXIT_REFUSED,
    "refused": EXIT_REFUSED,
    "approval-timed-out": EXIT_REFUSED,
    "rolled-back": EXIT_ROLLED_BACK,
    "unreachable": EXIT_UNREACHABLE,
    "locked": EXIT_REFUSED,
}
JSON_COMMANDS = ("collect", "fix", "triage", "sweep", "audit", "classify", "pending")


def show(text: object, *, err: bool = False) -> None:
    """Print text that may carry what a target sent (log lines, names, messages): control
    characters (ESC, CR, BEL, ...) are shown escaped, never sent to the terminal raw.
    `err`: to standard error (warnings, reasons)."""
    from runbooks.core.names import terminal_safe

    print(terminal_safe(str(text)), file=sys.stderr if err else sys.stdout)


def _progress() -> Any:
    """Show the steps of a flow run in this process as they run, on standard error: a live line
    on a terminal, plain lines otherwise (runbooks/core/progress.py). Standard output is untouched,
    so --json keeps it one object."""
    from runbooks.core.progress import attach

    return attach(sys.stderr, live=sys.stderr.isatty())


def _emit(args: argparse.Namespace, result: Any) -> None:
    """The one JSON object of a --json command, on the real standard output."""
    args.json_emitted = True
    print(result.dumps(), file=args.json_out, flush=True)


def _failures(bundle: Path) -> tuple[str | None, list[FailedSource]]:
    """Why a bundle's target could not be reached (None: it was), and its failed sources."""
    from runbooks.collect.collector import failed_sources, finding_message
    from runbooks.core.cli_json import FailedSource

    reason = finding_message(bundle, "target-unreachable")
    return reason, [FailedSource(name=n, error=e) for n, e in failed_sources(bundle)]


def _say_failures(name: str, bundle: Path) -> None:
    """Say on stderr why `name` could not be reached and which sources failed, one line each
    (the sources never tried because the host was unreachable: on one line)."""
    from runbooks.collect.collector import NOT_RUN_UNREACHABLE

    reason, failed = _failures(bundle)
    if reason is not None:
        show(f"cudamedic: {name} could not be reached: {reason}", err=True)
    elif failed:
        show(f"cudamedic: {name}: {len(failed)} source(s) failed (bundle {bundle}):", err=True)
    for f in failed:
        if f.error != NOT_RUN_UNREACHABLE:
            show(f"  {f.name}: {f.error}", err=True)
    if not_run := [f.name for f in failed if f.error == NOT_RUN_UNREACHABLE]:
        show(f"  not run (host unreachable): {', '.join(not_run)}", err=True)


def _settings(args: argparse.Namespace, **extra: object) -> Settings:
    from runbooks.core.settings import load_settings

    return load_settings(inventory=getattr(args, "inventory", None), **extra)


def _inventory(settings: Settings) -> Inventory | None:
    from runbooks.collect.inventory import load_inventory

    return load_inventory(settings.inventory) if settings.inventory else None


def _required_inventory(settings: Settings, who: str) -> Inventory:
    from runbooks.core.errors import InputError

    inventory = _inventory(settings)
    if inventory is None:
        raise InputError(f"{who} needs an inventory (--inventory or CUDAMEDIC_INVENTORY)")
    return inventory


def cmd_collect(args: argparse.Namespace) -> int:
    from runbooks.core.cli_json import CollectResult

    settings = _settings(args)
    targets = _collect_targets(args, _inventory(settings))
    results = _collect_all(args, settings, targets)
    for r in results:
        if r.missing_container is not None:
            show(f"cudamedic: error: {r.missing_container}", err=True)
    code = _collect_exit(results)
    if args.json:
        _emit(args, CollectResult(exit_code=code, targets=results))
    return code


def _collect_targets(args: argparse.Namespace, inventory: Inventory | None) -> list[Target]:
    """The targets `collect` was asked for, each once (TARGETs, and with --all every inventory
    host); a combination that makes no sense is refused."""
    from runbooks.collect.target import resolve_target
    from runbooks.core.errors import InputError

    specs = list(args.target)
    if args.all:
        if inventory is None:
            raise InputError("--all needs an inventory (--inventory or CUDAMEDIC_INVENTORY)")
        specs += sorted(inventory.hosts)
    if not specs:
        raise InputError("name a TARGET, or --all for every inventory host")
    if args.container and len(specs) > 1:
        raise InputError("--container applies to one TARGET only")
    return [resolve_target(spec, inventory) for spec in dict.fromkeys(specs)]


def _collect_all(
    args: argparse.Namespace, settings: Settings, targets: list[Target]
) -> list[CollectTarget]:
    """Collect every target, printing each bundle's path and what failed in it, in order."""
    import concurrent.futures

    from runbooks.collect.bundle import write_tar
    from runbooks.collect.collector import collect, missing_container
    from runbooks.core.cli_json import CollectTarget

    def one(target: Target) -> str:
        path = collect(
            target, settings, container=args.container, out_dir=args.out, trigger=args.trigger
        )
        return str(write_tar(path) if args.tar else path)

    # Hosts are independent: collect them at once, each bounded by its own timeouts.
    results: list[CollectTarget] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        for target, path in zip(targets, pool.map(one, targets), strict=True):
            show(path)
            _say_failures(target.name, Path(path))
            reason, failed = _failures(Path(path))
            results.append(
                CollectTarget(
                    target=target.name,
                    bundle=path,
                    reachable=reason is None,
                    reason=reason,
                    missing_container=missing_container(Path(path)),
                    failed_sources=failed,
                )
            )
    return results


def _collect_exit(results: list[CollectTarget]) -> int:
    """A container that does not exist is a usage error; else any unreachable target counts."""
    if any(r.missing_container is not None for r in results):
        return EXIT_INPUT
    if any(not r.reachable for r in results):
        return EXIT_UNREACHABLE
    return EXIT_OK


def cmd_classify(args: argparse.Namespace) -> int:
    import json

    from runbooks.diagnose.classify import classify_path, render_explain, render_text, to_json

    settings = _settings(args)
    if str(args.path) == "-":
        diagnosis = _classify_stdin(settings.state_path)
    else:
        from runbooks.collect.bundle import is_bundle_dir
        from runbooks.collect.collector import missing_container
        from runbooks.core.errors import InputError, NoSuchContainer

        path = Path(args.path)
        if path.is_dir() and not is_bundle_dir(path):
            raise InputError(
                f"{path} is not an evidence bundle: it has none of a bundle's files "
                "(bundle.json, nvidia-smi.txt, dmesg.txt, trigger.txt, containers/, commands/). "
                "Give a bundle directory (`cudamedic collect` prints one), a bundle .tar.gz, a "
                "log file, or - for pasted text"
            )
        if path.is_dir() and (why := missing_container(path)):
            raise NoSuchContainer(f"{why} (nothing to diagnose in {args.path})")
        diagnosis = classify_path(args.path, state_dir=settings.state_path)
    if args.json:
        args.json_emitted = True
        print(json.dumps(to_json(diagnosis), indent=2), file=args.json_out, flush=True)
    else:
        show(render_text(diagnosis))
        if args.explain:
            show(render_explain(diagnosis))
    return 0


STDIN_MAX_BYTES = 16 * 1024 * 1024


def _classify_stdin(state_dir: Path) -> Any:
    """A pasted error on standard input, classified as the text a person reported."""
    import tempfile

    from runbooks.collect.redact import redact_text
    from runbooks.core.errors import InputError
    from runbooks.diagnose.classify import classify_path

    if sys.stdin.isatty():  # a person at a terminal: say what the silence waits for
        print(
            "cudamedic: paste the error text, then press Ctrl-D on a new line (Ctrl-C cancels)",
            file=sys.stderr,
            flush=True,
        )
    data = sys.stdin.buffer.read(STDIN_MAX_BYTES + 1)
    if len(data) > STDIN_MAX_BYTES:
        raise InputError(f"standard input is over {STDIN_MAX_BYTES // 2**20} MiB: pass a file")
    with tempfile.TemporaryDirectory(prefix="cudamedic-paste-") as tmp:
        text = redact_text(data.decode("utf-8", errors="replace"))
        (Path(tmp) / "trigger.txt").write_text(text, encoding="utf-8")
        return classify_path(Path(tmp), state_dir=state_dir)


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


def _prefect(args: argparse.Namespace, settings: Settings) -> str:
    """Point this process at the Prefect API (PREFECT_API_URL, else the embedded local server,
    started on first use). Must run before prefect is imported."""
    import os

    from flows.server import configure

    if not getattr(args, "verbose", False):
        # Step logs reach the Prefect API at INFO (the UI's Logs tab); the terminal shows
        # Prefect's warnings only (logging.yml's console handler, set by Prefect's own override).
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    return configure(settings)


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
    from flows.triage import RESUME_WAIT_S, VERDICT_WAIT_S, acted_since, answer, queued, verdict
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
    judged = verdict(args.run_id, by, sent, RESUME_WAIT_S if suspended else VERDICT_WAIT_S)
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
            f"{VERDICT_WAIT_S:g} s: the process that ran it is gone (interrupted or killed), "
            "so it can no longer act. Respond again with `cudamedic triage`.",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if judged.get("refusal"):
        print(f"cudamedic: refused by the flow: {judged['refusal']}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"taken: {decision} by {judged.get('identity')}")
    return 0


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


def cmd_sweep(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _check_sweep_input(args, settings)
    api = _prefect(args, settings)
    from flows.sweep import fleet_health_check
    from runbooks.core import progress

    with _progress():
        progress.begin("start", f"on {api.removesuffix('/api')}")
        result = fleet_health_check(
            inventory=str(args.inventory) if args.inventory else None,
            hosts=args.host or None,
            tags=args.tag or None,
            start_incidents=args.start_incidents,
            distribute=args.distribute,
        )
    verdicts = result.verdicts
    still = {v: sorted(h for h, x in verdicts.items() if x == v) for v in ("drain", "warning")}
    counts = {v: len(hosts) for v, hosts in still.items()}
    counts["healthy"] = result.hosts - counts["drain"] - counts["warning"]
    _show_sweep(result, counts)
    code = EXIT_INTERNAL if counts["drain"] and args.fail_on_drain else EXIT_OK
    if args.json:
        _emit(args, _sweep_result(result, code, counts, still))
    return code


def _check_sweep_input(args: argparse.Namespace, settings: Settings) -> None:
    """Refuse bad input here, before a flow run starts."""
    from runbooks.core.errors import InputError
    from runbooks.core.runbook import load_runbook
    from runbooks.diagnose.sweep import select_hosts

    inventory = _required_inventory(settings, "a sweep")
    load_runbook(settings.sweep_runbook, "sweep")
    if not select_hosts(inventory, args.host or None, args.tag or None):
        raise InputError("no inventory host matches --host/--tag")


def _show_sweep(result: SweepRun, counts: dict[str, int]) -> None:
    """The sweep's verdict counts, what is new, changed or resolved, and where to read more."""
    show(
        f"{result.hosts} hosts in {result.duration_s:.1f} s: {counts['drain']} drain, "
        f"{counts['warning']} warning, {counts['healthy']} healthy"
    )
    if not result.changes:
        show("nothing new, changed or resolved since the last sweep")
        if counts["drain"] or counts["warning"]:
            show(
                f"still: {counts['drain']} drain, {counts['warning']} warning — see {result.report}"
            )
    for c in result.changes:
        subject = f" ({c.subject})" if c.subject else ""
        level = f" [{c.level}]" if c.level else ""
        show(f"  {c.change:8} {c.host}: {c.code}{subject}{level} {c.message[:160]}")
    for n in result.not_checked:
        subject = f" ({n.subject})" if n.subject else ""
        show(
            f"  {'not checked':11} {n.host}: {n.code}{subject} [{n.level}] {n.why}; "
            "kept as the last sweep saw it"
        )
    for run_id in result.responses:
        show(f"  incident response started: flow run {run_id}")
    show(f"report:    {result.report}")
    if result.flow_run_url:
        show(f"flow run:  {result.flow_run_url}")


def _sweep_result(
    result: SweepRun, code: int, counts: dict[str, int], still: dict[str, list[str]]
) -> SweepResult:
    """The --json object of `sweep` (docs/cli-json.md)."""
    from runbooks.core.cli_json import SweepChange, SweepNotChecked, SweepResult

    return SweepResult(
        exit_code=code,
        hosts=result.hosts,
        duration_s=result.duration_s,
        counts=counts,
        verdicts=result.verdicts,
        still=still,
        changes=[
            SweepChange(
                change=c.change,
                host=c.host,
                code=c.code,
                subject=c.subject or None,
                level=c.level,
                message=c.message,
            )
            for c in result.changes
        ],
        not_checked=[
            SweepNotChecked(
                host=n.host, code=n.code, subject=n.subject or None, level=n.level, why=n.why
            )
            for n in result.not_checked
        ],
        responses=result.responses,
        report=result.report,
        flow_run_url=result.flow_run_url,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _prefect(args, settings)
    from flows.announce import warnings
    from flows.serve import serve

    for line in warnings(settings):
        show(f"cudamedic: warning: {line}", err=True)

    serve(settings)
    return 0


def cmd_alerts(args: argparse.Namespace) -> int:

    settings = _settings(args)
    inventory = _required_inventory(settings, "the alert receiver")
    token = settings.alert_token.get_secret_value() if settings.alert_token else ""
    from flows.alerts import check_token

    check_token(token)  # before a Prefect server is asked (or started)
    _prefect(args, settings)
    from flows.alerts import SEEN_TTL_S, make_server
    from flows.fleet_state import Memory
    from flows.http import Limits

    listen = args.listen or settings.alert_listen
    port = args.port if args.port is not None else settings.alert_port
    seen = Memory(ttl=SEEN_TTL_S)  # in Prefect: every replica of the receiver shares it
    key = settings.approval_key.get_secret_value() if settings.approval_key else ""
    server = make_server(listen, port, token, inventory, seen, Limits.of(settings), key)
    return _serve_http(server, "alert receiver: POST {base}/alertmanager")


def cmd_slack(args: argparse.Namespace) -> int:
    import threading

    settings = _settings(args)
    inventory = _required_inventory(settings, "the Slack app")
    _prefect(args, settings)
    from flows.slack.app import SlackApp, keep_flushing

    app = SlackApp(settings, inventory)
    keep_flushing(settings)
    if settings.slack_app_token is not None:
        handler = app.socket_mode()
        print("Slack app: Socket Mode, connected to Slack", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            handler.close()
        return 0
    listen = args.listen or settings.slack_listen
    port = args.port if args.port is not None else settings.slack_port
    server = app.server(listen, port)
    return _serve_http(server, "Slack app: {base}/slack/commands and {base}/slack/interactive")


def _serve_http(server: HttpServer, banner: str) -> int:
    """Announce where an HTTP endpoint of cudamedic listens, and serve until interrupted."""
    server.bind()
    print(banner.format(base=server.url), flush=True)
    server.serve_forever()
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    """This state dir's embedded server: one per state dir, on the settings' port. A server of
    another state dir on that port is reported, never used or stopped (flows/server.py)."""
    import os

    from flows.server import (
        AUTH_FILE,
        auth_string,
        ensure_local_server,
        foreign_server,
        healthy,
        local_url,
        prefect_home,
        stop_local_server,
    )
    from runbooks.core.errors import InputError

    settings = _settings(args)
    named = os.environ.get("PREFECT_API_URL")
    if named and args.action == "status":  # the server every other command would use
        up = healthy(named)
        print(f"{named}: {'up' if up else 'down'} (PREFECT_API_URL; not an embedded server)")
        return 0 if up else 1
    if named:
        raise InputError(
            f"PREFECT_API_URL names {named}: `server {args.action}` manages only this state "
            "dir's embedded server, which no command uses while PREFECT_API_URL is set"
        )
    url, home = local_url(settings), prefect_home(settings)
    if (home / AUTH_FILE).exists() and not os.environ.get("PREFECT_API_AUTH_STRING"):
        # ask this state dir's server as its clients do: it answers who it is only with it
        os.environ["PREFECT_API_AUTH_STRING"] = auth_string(settings)
    other = foreign_server(settings)
    if args.action == "start":
        ensure_local_server(settings)
        print(f"Prefect server: {url} (database under {home})")
        return 0
    if args.action == "stop":
        if stop_local_server(settings):
            print(f"stopped the Prefect server of {home}")
            return 0
        if other is not None or healthy(url):
            print(
                f"{url} is not a server this state dir started (database under "
                f"{other or home}, no server.pid for it); nothing was stopped"
            )
            return 1
        print("no local server was running")
        return 0
    if other is not None:
        print(f"{url}: up, but another Prefect server (database under {other}), not {home}'s")
        return 1
    up = healthy(url)
    print(f"{url}: {'up (database under ' + str(home) + ')' if up else 'down'}")
    return 0 if up else 1


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


def cmd_completion(args: argparse.Namespace) -> int:
    print(bash_completion(build_parser()))
    return EXIT_OK


def bash_completion(parser: argparse.ArgumentParser) -> str:
    """A bash completion script generated from the parser: subcommands, their flags, and the
    choices of their positional arguments (other words complete as file names)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cases = []
    for name, p in sub.choices.items():
        shown = [a for a in p._actions if a.help != argparse.SUPPRESS]  # never a gone flag
        words = [o for a in shown for o in a.option_strings]
        words += [str(c) for a in shown if not a.option_strings for c in a.choices or ()]
        cases.append(f'        {name}) words="{" ".join(words)}" ;;')
    top = [o for a in parser._actions for o in a.option_strings] + list(sub.choices)
    return "\n".join(
        [
            '# cudamedic bash completion: eval "$(cudamedic completion bash)"',
            "_cudamedic() {",
            '    local cur=${COMP_WORDS[COMP_CWORD]} cmd="" words="" i',
            "    for ((i = 1; i < COMP_CWORD; i++)); do",
            "        case ${COMP_WORDS[i]} in -*) ;; *) cmd=${COMP_WORDS[i]}; break ;; esac",
            "    done",
            '    case "$cmd" in',
            f'        "") words="{" ".join(top)}" ;;',
            *cases,
            "    esac",
            '    COMPREPLY=($(compgen -W "$words" -- "$cur"))',
            '    [ ${#COMPREPLY[@]} -eq 0 ] && [ -n "$cmd" ] &&',
            '        COMPREPLY=($(compgen -f -- "$cur"))',
            "    return 0",
            "}",
            "complete -F _cudamedic cudamedic",
        ]
    )


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    answer = input(f"{question} [y/N] ").strip().lower()
    return answer in ("y", "yes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cudamedic",
        description="Incident response for GPU hosts running PyTorch-CUDA containers.",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log progress to stderr (-vv: also every HTTP request and debug detail)",
    )
    parser.add_argument("--version", action="version", version=f"cudamedic {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(sub)
    return parser


# -- the subcommands' parsers: one function each, listed in SUBCOMMANDS -----------------------
TARGET_HELP = "'local', an inventory host name, or ssh://user@host[:port]"
JSON_HELP = "print one JSON object (docs/cli-json.md)"


def _collect_parser(sub: Subparsers) -> None:
    p = sub.add_parser("collect", help="gather an evidence bundle from a host")
    p.add_argument("target", nargs="*", help=f"{TARGET_HELP} (several: collected at once)")
    p.add_argument("--all", action="store_true", help="every host of the inventory")
    p.add_argument("--container", help="the container to examine (default: every GPU container)")
    p.add_argument("--out", type=Path, help="directory for bundles (default: ./bundles)")
    p.add_argument("--inventory", type=Path, help="inventory file (YAML or Ansible YAML/INI)")
    p.add_argument("--trigger", help="the text that triggered this (e.g. a pasted error)")
    p.add_argument("--tar", action="store_true", help="also pack the bundle as .tar.gz")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_collect)


def _fix_parser(sub: Subparsers) -> None:
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


def _confirm_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "confirm",
        help="confirm (or correct) the cause of a post-mortem, so it is cited as a known incident",
    )
    p.add_argument("report", help="the post-mortem (path or file name) the response wrote")
    p.add_argument("--incident", help="the cause, when it was not the diagnosed class")
    p.add_argument("--by", help="who confirms (default: this user@host)")
    p.set_defaults(func=cmd_confirm)


def _rollback_parser(sub: Subparsers) -> None:
    p = sub.add_parser("rollback", help="restore the container a fix replaced (its backup)")
    p.add_argument("target")
    p.add_argument("--container", required=True)
    p.add_argument("--inventory", type=Path)
    p.set_defaults(func=cmd_rollback)


def _triage_parser(sub: Subparsers) -> None:
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


def _approve_parser(sub: Subparsers) -> None:
    p = sub.add_parser("approve", help="answer a fix that waits for approval")
    p.add_argument("run_id", help="the flow run id `cudamedic triage` printed")
    p.add_argument("--reject", action="store_true", help="reject instead of approve")
    p.add_argument("--by", help=argparse.SUPPRESS)  # gone: refused with a clear error
    p.add_argument("--reason", help="why")
    p.set_defaults(func=cmd_approve)


def _audit_parser(sub: Subparsers) -> None:
    p = sub.add_parser("audit", help="the audit trail: fixes, approvals, refusals (Prefect events)")
    p.add_argument("--host", help="only this host's events")
    p.add_argument("--since", default="7d", help="ISO time or age like 30m, 12h, 7d (default 7d)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_audit)


def _sweep_parser(sub: Subparsers) -> None:
    p = sub.add_parser("sweep", help="check the health of every inventory host once")
    p.add_argument("--inventory", type=Path)
    p.add_argument("--host", action="append", help="only this host (repeatable)")
    p.add_argument("--tag", action="append", help="only hosts with this tag (repeatable)")
    p.add_argument(
        "--start-incidents",
        action="store_true",
        help="start an incident response (deployment) for each host with news",
    )
    p.add_argument(
        "--distribute", action="store_true", help="run batches on every worker of the pool"
    )
    p.add_argument(
        "--fail-on-drain", action="store_true", help="exit 1 when a host should be drained"
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=cmd_sweep)


def _serve_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "serve", help="serve the deployments: incident response, and the sweep on its schedule"
    )
    p.add_argument("--inventory", type=Path)
    p.set_defaults(func=cmd_serve)


def _alerts_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "alerts", help="receive Alertmanager webhooks; each new firing alert starts a response"
    )
    p.add_argument("--inventory", type=Path)
    p.add_argument("--listen", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 9095; 0 picks a free one)")
    p.set_defaults(func=cmd_alerts)


def _slack_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "slack",
        help="the Slack app (Socket Mode with an app token, else HTTP): /cudamedic, approvals",
    )
    p.add_argument("--inventory", type=Path)
    p.add_argument("--listen", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 3000; 0 picks a free one)")
    p.set_defaults(func=cmd_slack)


def _server_parser(sub: Subparsers) -> None:
    p = sub.add_parser("server", help="the embedded local Prefect server")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.set_defaults(func=cmd_server)


def _breaker_parser(sub: Subparsers) -> None:
    p = sub.add_parser("breaker", help="the fleet-wide circuit breaker for unattended fixes")
    p.add_argument("action", choices=["status", "reset"])
    p.set_defaults(func=cmd_breaker)


def _completion_parser(sub: Subparsers) -> None:
    p = sub.add_parser("completion", help="print a shell completion script")
    p.add_argument("shell", choices=["bash"])
    p.set_defaults(func=cmd_completion)


def _classify_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "classify",
        help="diagnose a bundle (directory, .tar.gz or a log file; - reads a pasted error)",
    )
    p.add_argument("path", type=Path, help="bundle directory, .tar.gz, log file, or - (stdin)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--explain",
        action="store_true",
        help="also list every class that matched, its evidence and why the winner won",
    )
    p.set_defaults(func=cmd_classify)


def _operators() -> tuple[Callable[[Subparsers], None], ...]:
    """`metrics`, `history`, `pending` and `worker` (runbooks/cli/operators.py)."""
    from runbooks.cli import operators as cli_operators

    return (
        cli_operators.metrics_parser,
        cli_operators.history_parser,
        cli_operators.pending_parser,
        cli_operators.worker_parser,
    )


# Every subcommand, in the order `cudamedic --help` lists them. A new one: a `_NAME_parser`
# function above (its arguments, `set_defaults(func=cmd_NAME)`) and its place here.
SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (
    _collect_parser,
    _fix_parser,
    _confirm_parser,
    _rollback_parser,
    _triage_parser,
    _approve_parser,
    _audit_parser,
    _sweep_parser,
    _serve_parser,
    _alerts_parser,
    _slack_parser,
    _server_parser,
    _breaker_parser,
    _completion_parser,
    _classify_parser,
    *_operators(),
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cudamedic")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _logging(verbose: int) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    terminal = logging.StreamHandler()
    terminal.setLevel(level)  # Prefect's INFO step logs propagate here: they are for its API
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[terminal]
    )
    # One line per HTTP request (the Prefect client's) floods -v; -vv shows them.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose > 1 else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    import contextlib

    parser = build_parser()
    args = _parse(parser, argv)
    _logging(args.verbose)
    json_mode = args.command in JSON_COMMANDS and bool(getattr(args, "json", False))
    # --json: the one object goes to the real stdout; everything else a command says to stderr.
    args.json_out, args.json_emitted = sys.stdout, False
    try:
        with contextlib.redirect_stdout(sys.stderr) if json_mode else contextlib.nullcontext():
            code, error = _run(args)
        if json_mode and not args.json_emitted:
            from runbooks.core.cli_json import ErrorResult

            _emit(args, ErrorResult(command=args.command, exit_code=code, error=error or "failed"))
    except BrokenPipeError:
        return _reader_gone()
    return code


def _reader_gone() -> int:
    """Standard output's reader went away (`cudamedic classify - | head`): what it wanted was
    written; stop quietly, as cat or grep do, and keep Python from complaining at exit."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_OK


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse; an option the subcommand does not have is that subcommand's error (its own usage,
    not the top level's), with the closest option it does have."""
    import difflib

    args, extra = parser.parse_known_args(argv)
    if not extra:
        return args
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command: argparse.ArgumentParser = sub.choices[args.command]
    options = [o for a in command._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
    hints = []
    for word in extra:
        if word.startswith("-"):
            close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"{word}: did you mean {close[0]}?")
    message = f"unrecognized arguments: {' '.join(extra)}"
    command.error(message + (" (" + "; ".join(hints) + ")" if hints else ""))


def _run(args: argparse.Namespace) -> tuple[int, str | None]:
    """Run the command: its exit status, and the error it stopped on (None: none)."""
    from runbooks.core.errors import (
        CudamedicError,
        FixError,
        InputError,
        RollbackFailed,
        TargetError,
    )
    from runbooks.core.names import terminal_safe as safe

    def fail(code: int, prefix: str, message: str) -> tuple[int, str]:
        print(f"cudamedic: {prefix}: {safe(message)}", file=sys.stderr)
        return code, message

    try:
        return int(args.func(args)), None
    except InputError as exc:
        return fail(EXIT_INPUT, "error", str(exc))
    except TargetError as exc:
        return fail(EXIT_UNREACHABLE, "target error", str(exc))
    except RollbackFailed as exc:
        return fail(EXIT_FAILED, "error", str(exc))
    except FixError as exc:  # another fix holds the lock, the container changed, ...: refused
        return fail(EXIT_REFUSED, "refused", str(exc))
    except CudamedicError as exc:
        return fail(EXIT_INTERNAL, "error", str(exc))
    except BrokenPipeError:  # the reader of standard output went away: main() stops quietly
        raise
    except KeyboardInterrupt as exc:  # flows/triage.py says what became of a response
        said = safe(str(exc))
        print(f"cudamedic: interrupted{': ' + said if said else ''}", file=sys.stderr)
        return EXIT_INTERRUPTED, "interrupted" + (f": {said}" if said else "")
    except Exception as exc:  # a bug or an unexpected failure: one line, the details with -v
        if args.verbose:
            raise
        return fail(
            EXIT_INTERNAL,
            "internal error",
            f"{type(exc).__name__}: {exc} (run with -v for details)",
        )
    finally:
        _flush_events()


def _flush_events() -> None:
    """Send the audit events this process emitted before it exits (Prefect sends them in the
    background; a short-lived command could end first)."""
    if "prefect.events.worker" in sys.modules:
        from runbooks.fix.audit import flush

        try:
            flush()
        except Exception as exc:  # never worth a traceback at exit
            logging.getLogger(__name__).warning("audit events not flushed: %s", exc)


if __name__ == "__main__":
    sys.exit(main())
