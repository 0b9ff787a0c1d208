"""Alerts start incident responses: an Alertmanager (or DCGM-exporter rule) webhook receiver that
turns each new firing alert for an inventory host into a Prefect event
``cudamedic.alert.firing``; the incident-response deployment's trigger (an automation with a
RunDeployment action, in open-source Prefect) starts a response for that host.

`cudamedic alerts` runs the receiver: loopback by default, a bearer token required
(``CUDAMEDIC_ALERT_TOKEN``), bodies capped, each alert (Alertmanager's fingerprint + start time)
announced once however often Alertmanager repeats it; alerts for hosts outside the inventory
are answered but never acted on. One response per host per `HOST_WINDOW_S`: a later alert for a
host (in the same request or not) is announced as ``cudamedic.alert.joined`` (on the host's
resource, beside the response it joins) and starts nothing. Every label and annotation used is
redacted before it is cut, and cut at a word boundary: an alert's text reaches a Prefect event
and a flow run's parameters.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flows.http import HttpServer, Limits, json_app, read_body, reply
from runbooks.collect.inventory import Inventory
from runbooks.collect.redact import redact_text
from runbooks.core.errors import InputError

log = logging.getLogger(__name__)

EVENT = "cudamedic.alert.firing"
JOINED = "cudamedic.alert.joined"
HOST_WINDOW_S = 900  # one response per host in this window; later alerts join it
SUMMARY_MAX = 1000
_CONTAINER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
RESOURCE_PREFIX = "cudamedic.host."
MAX_BODY = 1 << 20
# Labels that name the host, most specific first (DCGM exporter: Hostname; node exporter:
# instance as host:port).
HOST_LABELS = ("cudamedic_host", "Hostname", "hostname", "host", "node", "nodename", "instance")
SEEN_TTL_S = 7 * 24 * 3600


class Alert(BaseModel):
    host: str | None  # the inventory host, None when no label names one
    status: str
    alertname: str
    summary: str
    container: str | None = None
    key: str  # fingerprint + start: the same alert repeated is the same key


def parse_alertmanager(body: Any, inventory: Inventory) -> list[Alert]:
    """Alertmanager webhook JSON (version 4) -> alerts, each mapped to an inventory host (PURE).
    Raises InputError on a body that is not an Alertmanager payload."""
    if not isinstance(body, dict) or not isinstance(body.get("alerts"), list):
        raise InputError("not an Alertmanager webhook body (no 'alerts' list)")
    common = _mapping(body.get("commonLabels"))
    out = []
    for raw in body["alerts"][:500]:
        if not isinstance(raw, dict):
            continue
        labels = {**common, **_mapping(raw.get("labels"))}
        notes = _mapping(raw.get("annotations"))
        alertname = _clean(labels.get("alertname") or "alert", 200)
        summary = _clean(notes.get("summary") or notes.get("description") or alertname, SUMMARY_MAX)
        fingerprint = str(raw.get("fingerprint") or json.dumps(labels, sort_keys=True))
        named = str(labels.get("container") or labels.get("container_name") or "")
        out.append(
            Alert(
                host=_host(labels, inventory),
                status=str(raw.get("status") or body.get("status") or "firing"),
                alertname=alertname,
                summary=summary,
                container=named if _CONTAINER.fullmatch(named) else None,
                key=f"{fingerprint}@{raw.get('startsAt', '')}",
            )
        )
    return out


def _clean(value: Any, limit: int) -> str:
    """Redacted, then cut at a word boundary (a cut before redaction left half a token)."""
    text = redact_text(str(value)[: 64 * limit])  # bounded work; the cut below drops the rest
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut) + "…"


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _host(labels: dict[str, Any], inventory: Inventory) -> str | None:
    by_address: dict[str, list[str]] = {}
    for name, h in inventory.hosts.items():
        by_address.setdefault(h.address, []).append(name)
    for label in HOST_LABELS:
        value = str(labels.get(label) or "").strip()
        if not value:
            continue
        if value in inventory.hosts:
            return value
        bare = re.sub(r":\d+$", "", value)  # instance = host:port
        if bare in inventory.hosts:
            return bare
        if len(by_address.get(bare, [])) == 1:
            return by_address[bare][0]
    return None


# -- keys already seen (announced alerts; Slack's replays and retries) --------------------------
class FirstTime(Protocol):
    """Says whether a key is new: `Seen` (this process), or `flows.fleet_state.Memory` (every
    replica, through Prefect)."""

    def first_time(self, key: str) -> bool: ...


class Seen:
    """Keys seen in the last `ttl` seconds; kept in a small JSON file when `path` is given (so
    they survive a restart), else in memory."""

    def __init__(self, path: Path | None = None, ttl: float = SEEN_TTL_S) -> None:
        self.path = path
        self.ttl = ttl
        self.lock = threading.Lock()
        self.keys: dict[str, float] = {}
        if path is not None:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                self.keys = {str(k): float(v) for k, v in data.items()}
            except (OSError, ValueError, AttributeError, TypeError, OverflowError, RecursionError):
                self.keys = {}  # unreadable: start afresh (at worst an alert is announced twice)

    def first_time(self, key: str) -> bool:
        now = time.time()
        with self.lock:
            self.keys = {k: t for k, t in self.keys.items() if now - t < self.ttl}
            if key in self.keys:
                return False
            self.keys[key] = now
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.keys), encoding="utf-8")
                tmp.replace(self.path)
            return True


def announce(alert: Alert, event: str = EVENT, key: str = "") -> None:
    """Emit the Prefect event the incident-response deployment's trigger waits for (`JOINED`:
    an alert for a host whose response already runs, for the host's event feed). `key`: the
    fleet's approval_key, which signs the start (`origin`: runbooks/fix/approvals.py)."""
    from prefect.events import emit_event

    from runbooks.fix.approvals import start_proof

    assert alert.host is not None
    container = alert.container or ""  # "" in the template: a response for the whole host
    detected_by = f"alert {alert.alertname}"
    emit_event(
        event=event,
        resource={
            "prefect.resource.id": RESOURCE_PREFIX + alert.host,
            "cudamedic.host": alert.host,
        },
        payload={
            "alertname": alert.alertname,
            "summary": alert.summary,
            "container": container,
            "origin": start_proof(key, detected_by, alert.host, container) if key else "",
        },
    )


def trigger_parameters() -> dict[str, str]:
    """The incident-response parameters an alert event fills in (templated by Prefect): every
    label the receiver reads reaches the response (deploy/prefect.yaml's trigger says the same;
    a test compares them)."""
    return {
        "target": "{{ event.resource['cudamedic.host'] }}",
        "container": "{{ event.payload.container }}",
        "trigger_text": "{{ event.payload.alertname }}: {{ event.payload.summary }}",
        "detected_by": "alert {{ event.payload.alertname }}",
        "origin": "{{ event.payload.origin }}",
    }


def receive(
    body: bytes, inventory: Inventory, seen: FirstTime, key: str = ""
) -> tuple[int, dict[str, Any]]:
    """One authorized webhook body -> (HTTP status, answer); announces each new firing alert for
    an inventory host. One response per host and container (or the whole host) per window.
    Blocking (Prefect): the server runs it in a worker thread."""
    try:
        alerts = parse_alertmanager(json.loads(body), inventory)
    except RecursionError:
        return 400, {"error": "JSON nested too deeply"}
    except (ValueError, InputError) as exc:
        return 400, {"error": str(exc)[:300]}
    started, ignored = [], []
    for a in alerts:
        if a.status != "firing":
            ignored.append({"alert": a.alertname, "why": a.status})
        elif a.host is None:
            ignored.append({"alert": a.alertname, "why": "no inventory host"})
        elif not seen.first_time(a.key):
            ignored.append({"alert": a.alertname, "why": "already announced"})
        elif not seen.first_time(
            f"host:{a.host}/{a.container or ''}@{int(time.time() // HOST_WINDOW_S)}"
        ):
            announce(a, JOINED)  # one response per host (and container) in the window
            ignored.append({"alert": a.alertname, "why": "joined the host's response"})
        else:
            announce(a, key=key)
            started.append({"alert": a.alertname, "host": a.host, "container": a.container})
    return 202, {"announced": started, "ignored": ignored}


EXAMPLE_TOKENS = frozenset({"change-me-long-random"})  # deploy/systemd/cudamedic.env.example


def check_token(token: str) -> None:
    """Refuse no token, and the example file's (every copy of it would accept the same one)."""
    if not token:
        raise InputError("the alert receiver needs a token (CUDAMEDIC_ALERT_TOKEN)")
    if token in EXAMPLE_TOKENS:
        raise InputError(
            "CUDAMEDIC_ALERT_TOKEN is the example's (deploy/systemd/cudamedic.env.example): set "
            "a long random one of your own (`openssl rand -hex 32`)"
        )


def make_server(
    host: str,
    port: int,
    token: str,
    inventory: Inventory,
    seen: FirstTime,
    limits: Limits | None = None,
    key: str = "",
) -> HttpServer:
    """The receiver: POST /alertmanager with `Authorization: Bearer <token>`; GET /health.
    `key`: the fleet's approval_key, which signs each start."""
    check_token(token)
    limits = limits or Limits()
    expected = f"Bearer {token}".encode()

    async def health(request: Request) -> Response:
        return reply(200, {"ok": True})

    async def alertmanager(request: Request) -> Response:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), expected):
            return reply(401, {"error": "missing or wrong bearer token"})
        body = await read_body(request, limits, MAX_BODY)
        return reply(*await run_in_threadpool(receive, body, inventory, seen, key))

    routes = [Route("/health", health), Route("/alertmanager", alertmanager, methods=["POST"])]
    return HttpServer(json_app(routes, log), host, port, limits)
