"""`cudamedic sweep`: the fleet health sweep."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from runbooks.cli.common import (
    EXIT_INTERNAL,
    EXIT_OK,
    JSON_HELP,
    _emit,
    _prefect,
    _progress,
    _required_inventory,
    _settings,
    show,
)

if TYPE_CHECKING:
    from flows.sweep import SweepResult as SweepRun
    from runbooks.cli.common import Subparsers
    from runbooks.core.cli_json import SweepResult
    from runbooks.core.settings import Settings


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


def sweep_parser(sub: Subparsers) -> None:
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
