"""`cudamedic metrics` and `cudamedic history`: the commands that meet what a GPU team already
runs (Prometheus, a knowledge base of post-mortems). Registered in runbooks/cli/__init__.py
SUBCOMMANDS."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def metrics_parser(sub: Any) -> None:
    p = sub.add_parser(
        "metrics",
        help="serve the fleet's sweep verdicts, findings and responses at /metrics (Prometheus)",
    )
    p.add_argument("--listen", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9464, help="port (default 9464; 0: a free one)")
    p.add_argument("--no-http", action="store_true", help="serve nothing; only the --textfile")
    p.add_argument(
        "--textfile",
        type=Path,
        help="also write the metrics to this node_exporter textfile (e.g. "
        "/var/lib/node_exporter/textfile_collector/cudamedic.prom)",
    )
    p.add_argument("--every", type=float, default=60.0, help="textfile rewrite interval, seconds")
    p.add_argument("--once", action="store_true", help="write the textfile once and exit")
    p.set_defaults(func=cmd_metrics)


def cmd_metrics(args: argparse.Namespace) -> int:
    from runbooks.cli.common import _prefect, _settings
    from runbooks.core.errors import InputError

    if (args.no_http or args.once) and args.textfile is None:
        raise InputError("--no-http and --once need --textfile")
    settings = _settings(args)
    _prefect(args, settings)
    from flows.metrics import serve

    try:
        serve(
            settings,
            args.listen,
            None if args.no_http else args.port,
            textfile=args.textfile,
            every=max(args.every, 1.0),
            once=args.once,
            say=lambda text: print(text, flush=True),
        )
    except KeyboardInterrupt:
        return 0
    return 0


def history_parser(sub: Any) -> None:
    p = sub.add_parser(
        "history", help="the team's post-mortems (the fleet's history): list and search them"
    )
    p.add_argument("--host", help="only this host")
    p.add_argument("--class", dest="incident", help="only this incident class")
    p.add_argument("--since", help="only from this date on (YYYY-MM-DD) or the last N days (Nd)")
    p.add_argument("--confirmed", action="store_true", help="only confirmed causes")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=cmd_history)


def since_date(text: str | None) -> str | None:
    """`2026-11-02` or `7d` -> the first date to list (ISO), None for all."""
    from datetime import UTC, date, datetime, timedelta

    from runbooks.core.errors import InputError

    if not text:
        return None
    if text.endswith("d") and text[:-1].isdigit() and len(text) <= 6:
        return (datetime.now(UTC).date() - timedelta(days=int(text[:-1]))).isoformat()
    try:
        return date.fromisoformat(text).isoformat()
    except ValueError:
        raise InputError(
            f"--since {text!r}: a date (YYYY-MM-DD) or a number of days (7d)"
        ) from None


def cmd_history(args: argparse.Namespace) -> int:
    import json

    from runbooks.cli.common import _prefect, _settings
    from runbooks.core.names import display
    from runbooks.diagnose.history import reports

    first = since_date(args.since)
    settings = _settings(args)
    _prefect(args, settings)
    rows = [
        r
        for r in reports(settings.state_path, settings.fleet)
        if (not args.host or r.get("host") == args.host)
        and (not args.incident or r.get("incident") == args.incident)
        and (not first or str(r.get("when") or "") >= first)
        and (not args.confirmed or r.get("confirmed_by"))
    ]
    for r in rows:
        if args.json:
            keep = ("id", "when", "host", "container", "incident", "conclusion", "fix")
            out = {k: r.get(k) for k in keep}
            out.update(report=r.get("report"), confirmed_by=r.get("confirmed_by"))
            print(json.dumps(out, sort_keys=True))
            continue
        who = f"confirmed by {r['confirmed_by']}" if r.get("confirmed_by") else "not confirmed"
        where = display(f"{r.get('host')}" + (f"/{r['container']}" if r.get("container") else ""))
        print(f"{r.get('when')}  {where}  {r.get('incident')}  ({who})")
        print(f"    {display(str(r.get('conclusion') or ''), 200)}")
        print(f"    {display(str(r.get('report') or ''), 300)}")
    if not rows and not args.json:
        print("no post-mortem matches")
    return 0


def pending_parser(sub: Any) -> None:
    p = sub.add_parser(
        "pending", help="the fleet's fixes that wait for a person (from the Prefect server)"
    )
    p.add_argument("--all-fleets", action="store_true", help="every fleet on the server")
    p.add_argument("--json", action="store_true", help="print one JSON object (docs/cli-json.md)")
    p.set_defaults(func=cmd_pending)


def cmd_pending(args: argparse.Namespace) -> int:
    from runbooks.cli.common import _emit, _prefect, _settings, show
    from runbooks.core.cli_json import PendingResult

    settings = _settings(args)
    _prefect(args, settings)
    from flows.pending import pending

    found = pending(None if args.all_fleets else settings.fleet)
    if args.json:
        _emit(args, PendingResult(exit_code=0, approvals=[p.model_dump() for p in found]))
        return 0
    if not found:
        print("no fix waits for approval")
        return 0
    print(f"{len(found)} waiting for approval:")
    for p in found:
        where = p.host + (f"/{p.container}" if p.container else "")
        show(
            f"  {p.run_id}  {where}  {p.incident} ({p.confidence:.2f})  {p.state} since "
            f"{p.asked_at}" + (f", expires {p.expires_at}" if p.expires_at else "")
        )
        show(f"      asked by {p.requester} ({p.detected_by})")
        for line in p.diff[:10]:
            show(f"      {line}")
        if p.offer:
            show(f"      {p.offer}")
        show(f"      {p.approve}   (reject: --reject)")
    return 0


def worker_parser(sub: Any) -> None:
    p = sub.add_parser(
        "worker",
        help="a Prefect worker of the work pool (deploy/prefect.yaml), after checking its setup",
    )
    p.add_argument("--pool", help="the work pool (default: CUDAMEDIC_WORK_POOL)")
    p.add_argument("--name", help="the worker's name (default: Prefect's)")
    p.add_argument("--limit", type=int, default=8, help="flow runs at a time (default 8)")
    p.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    """Check what a worker needs, say what would go unseen, then become `prefect worker start`
    (exec: the same process, so systemd's SIGTERM reaches Prefect's handler: the worker stops
    taking runs and exits once its running flow runs end; a run waiting for approval holds no
    process: flows/incident.py)."""
    import os
    import sys

    from runbooks.cli.common import _prefect, _settings, show
    from runbooks.core.errors import InputError

    settings = _settings(args)
    pool = args.pool or settings.work_pool
    if not pool:
        raise InputError("name the work pool: --pool or CUDAMEDIC_WORK_POOL")
    if args.limit < 1:
        raise InputError("--limit must be at least 1")
    if not os.environ.get("CUDAMEDIC_HOME"):
        raise InputError(
            "CUDAMEDIC_HOME is not set: deploy/prefect.yaml's runs start there (the checkout or "
            "install with its .venv)"
        )
    _prefect(args, settings)
    from flows.announce import warnings

    for line in warnings(settings):
        show(f"cudamedic: warning: {line}", err=True)
    argv = [str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool]
    argv += ["--limit", str(args.limit), *(["--name", args.name] if args.name else [])]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)  # noqa: S606 - Prefect's own command, next to this Python
    return 0  # not reached
