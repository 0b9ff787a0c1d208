"""The audit trail as Prefect events: every audit record (runbooks.fix.journal.audit) is also sent
as an event (`cudamedic.fix.started`, `cudamedic.fix.applied`, `cudamedic.fix.failed`,
`cudamedic.approval.refused`, ...) about the resource
`cudamedic.host.<name>`, with the container and the flow run as related resources and the
redacted record as its payload. Events reach the Prefect server both workers use, so the trail
is one for the fleet (the UI's event feed shows it; automations can act on it); `read()` is
`cudamedic audit`'s query. Events are sent by Prefect's events worker in the background:
`flush()` waits for them before a short-lived process exits.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

log = logging.getLogger(__name__)
FLEET_LABEL = "cudamedic.fleet"  # a label of the event's resource: the count filters on it


class CountUnknown(Exception):
    """More fix events than one count reads: the count is unknown (a flood, forged or real)."""


PREFIX = "cudamedic."
# Audit actions as event names; any other action `a` is `cudamedic.a`. A fix is `started` before
# it changes anything (what the per-hour cap counts: every attempt), then `applied` (verified) or
# `failed` (rolled back, or its rollback failed): a failed fix is never called applied.
NAMES = {
    "apply": "fix.started",
    "applied": "fix.applied",
    "fix-failed": "fix.failed",
    "recover": "fix.recovered",
    "rollback": "fix.rolled-back",
    "cleanup": "fix.backups-removed",
    "response": "response.finished",
    "breaker-reset": "breaker.reset",
}


def event_name(action: str) -> str:
    return PREFIX + NAMES.get(action, action)


def host_resource(host: str | None) -> str:
    return f"{PREFIX}host.{host}" if host else f"{PREFIX}fleet"


def emit(record: dict[str, Any]) -> None:
    """Send one (already redacted) audit record as a Prefect event. Never raises: the local
    record is written, and an audit event must never stop a fix."""
    try:
        from prefect.events import emit_event

        host = str(record["host"]) if record.get("host") else None
        resource = {"prefect.resource.id": host_resource(host)}
        if host:
            resource["prefect.resource.name"] = host
        if record.get("fleet"):
            resource[FLEET_LABEL] = str(record["fleet"])
        emit_event(
            event=event_name(str(record["action"])),
            resource=resource,
            related=_related(record, host),
            payload=record,
        )
    except Exception as exc:  # Prefect unconfigured or unreachable, an event too large
        log.warning(
            "audit event %s not sent: %s: %s", record.get("action"), type(exc).__name__, exc
        )


def _related(record: dict[str, Any], host: str | None) -> list[dict[str, str]]:
    related = []
    if record.get("container"):
        related.append(
            {
                "prefect.resource.id": f"{PREFIX}container.{host}.{record['container']}",
                "prefect.resource.role": "container",
                "prefect.resource.name": str(record["container"]),
            }
        )
    if record.get("flow_run"):
        related.append(
            {
                "prefect.resource.id": f"prefect.flow-run.{record['flow_run']}",
                "prefect.resource.role": "flow-run",
            }
        )
    return related


def flush(timeout: float = 10.0) -> None:
    """Wait (at most `timeout` s) until this process's events have been sent."""
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=timeout, at_exit=False)


def read(
    *,
    host: str | None = None,
    since: datetime,
    flow_run: str | None = None,
    names: list[str] | None = None,
    limit: int = 10000,
) -> list[dict[str, Any]]:
    """The audit events since `since`, oldest first: each record with `event` (its name) and
    `occurred`. `host` narrows to one host, `flow_run` to one response, `names` to some events."""
    from prefect import get_client
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventOrder,
        EventRelatedFilter,
        EventResourceFilter,
    )

    query = EventFilter(
        occurred=EventOccurredFilter(since=since),
        event=EventNameFilter(name=names) if names else EventNameFilter(prefix=[PREFIX]),
        resource=EventResourceFilter(id=[host_resource(host)]) if host else None,
        related=EventRelatedFilter(id=[f"prefect.flow-run.{flow_run}"]) if flow_run else None,
        order=EventOrder.ASC,
    )
    out: list[dict[str, Any]] = []
    with get_client(sync_client=True) as client:
        page: Any = client.read_events(filter=query, limit=50)  # the API's page limit
        while page is not None and len(out) < limit:
            out += [
                {**e.payload, "event": e.event, "occurred": e.occurred.isoformat()}
                for e in page.events
            ]
            page = page.get_next_page_sync(client)
    return out[:limit]


def applied_in_fleet(fleet: str, since: datetime, max_pages: int = 20) -> int | None:
    """How many fixes this fleet started since `since`: its `cudamedic.fix.started` events on
    the Prefect server (every attempt; the server filters on the fleet label, so another fleet's
    events, or a flood of them, never take this fleet's pages); None when it cannot be asked (no
    API, down, slow: 2 s per call, no retries). CountUnknown when there are more than
    `max_pages` pages: a count cut short would loosen the cap."""
    from runbooks.core.prefect_api import call

    body = {
        "filter": {
            "occurred": {"since": since.isoformat()},
            "event": {"name": [event_name("apply")]},
            "resource": {"labels": {FLEET_LABEL: [fleet]}},
        },
        "limit": 50,
    }
    count, pages = 0, 0
    try:
        page: Any = call("POST", "/events/filter", body)
        while isinstance(page, dict) and pages < max_pages:
            pages += 1
            events: list[Any] = page.get("events") or []
            for e in events if isinstance(events, list) else []:
                payload = e.get("payload") if isinstance(e, dict) else None
                if isinstance(payload, dict) and payload.get("fleet") == fleet:
                    count += 1
            nxt = page.get("next_page")
            if not isinstance(nxt, str) or "/events/filter/next" not in nxt:
                return count
            page = call("GET", "/events/filter/next" + nxt.split("/events/filter/next", 1)[1])
        if isinstance(page, dict):
            raise CountUnknown(f"more than {count} fix events in the window")
    except (OSError, ValueError, LookupError) as exc:
        log.warning("fleet-wide fix count unavailable: %s", type(exc).__name__)
        return None
    return count


def parse_since(text: str, now: datetime) -> datetime:
    """`--since`: an ISO time (UTC when it names no zone) or an age: 30m, 12h, 7d."""
    import re
    from datetime import UTC, timedelta

    from runbooks.core.errors import InputError

    if m := re.fullmatch(r"(\d{1,6})[ \t]*+([smhd])", text.strip()):
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[m.group(2)]
        return now - timedelta(**{unit: int(m.group(1))})
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InputError(
            f"--since {text!r}: give an ISO time or an age like 30m, 12h, 7d"
        ) from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def line(record: dict[str, Any]) -> str:
    """One audit event as a terminal line: when, what, where, who, and what it says."""
    from runbooks.core.names import terminal_safe

    where = "/".join(str(record[k]) for k in ("host", "container") if record.get(k))
    who = record.get("identity") or record.get("by") or record.get("approved_by") or ""
    said = [f"{k}={record[k]}" for k in ("decision", "outcome", "refusal") if record.get(k)]
    parts = [str(record.get("occurred", record.get("at", ""))), str(record.get("event", ""))]
    parts += [where or "-", f"by {who}" if who else f"({record.get('who', '')})", *said]
    # one event, one line: a newline in a field (anyone can emit events) is shown, not printed
    text = "  ".join(parts).replace("\n", "\\n").replace("\u2028", "\\u2028")
    return terminal_safe(text.replace("\u2029", "\\u2029"))
