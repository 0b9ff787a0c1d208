"""`cudamedic serve`, `alerts`, `slack` and `server`: the long-running services."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from runbooks.cli.common import (
    _prefect,
    _required_inventory,
    _settings,
    show,
)

if TYPE_CHECKING:
    from flows.http import HttpServer
    from runbooks.cli.common import Subparsers


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


def serve_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "serve", help="serve the deployments: incident response, and the sweep on its schedule"
    )
    p.add_argument("--inventory", type=Path)
    p.set_defaults(func=cmd_serve)


def alerts_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "alerts", help="receive Alertmanager webhooks; each new firing alert starts a response"
    )
    p.add_argument("--inventory", type=Path)
    p.add_argument("--listen", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 9095; 0 picks a free one)")
    p.set_defaults(func=cmd_alerts)


def slack_parser(sub: Subparsers) -> None:
    p = sub.add_parser(
        "slack",
        help="the Slack app (Socket Mode with an app token, else HTTP): /cudamedic, approvals",
    )
    p.add_argument("--inventory", type=Path)
    p.add_argument("--listen", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 3000; 0 picks a free one)")
    p.set_defaults(func=cmd_slack)


def server_parser(sub: Subparsers) -> None:
    p = sub.add_parser("server", help="the embedded local Prefect server")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.set_defaults(func=cmd_server)
