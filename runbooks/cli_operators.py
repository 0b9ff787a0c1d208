"""`cudamedic metrics` and `cudamedic history`: the commands that meet what a GPU team already
runs (Prometheus, a knowledge base of post-mortems). Registered in runbooks/cli.py SUBCOMMANDS."""

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
    from runbooks.cli import _prefect, _settings
    from runbooks.errors import InputError

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
