"""Slack delivery from the flows (PURE of the app): progress in a response's thread, the
approval request, the post-mortem, sweep news. It never fails a flow and never jams: slack-sdk
retries rate limits (429 + Retry-After), server errors and dropped connections; what still fails
for a passing reason waits in the fleet's outbox in Prefect (flows/slack/outbox.py: any worker
sends it, also when the one that kept it is gone) and is sent, in order, by the next delivery
of any worker, or by the Slack app's flusher; what Slack refuses for good (``channel_not_found``,
``not_in_channel``, ``invalid_auth``, ...) goes to the fleet's dead letters with the reason, and
the messages behind it go on. `waiting` and `dead` list them.

The flows know only `Notifier` (flows/notify.py); `thread_for` gives them a Slack thread. The Slack
app (flows/slack/app.py) starts responses and imports the flows; nothing here imports the app.
"""

from __future__ import annotations

import http.client
import logging
import time
import urllib.error
from collections.abc import Callable
from typing import Any

from flows.fleet_state import QUICK_LEASE_S, quick_lock
from flows.slack import outbox
from reports import slack as msg
from runbooks.core.settings import Settings

log = logging.getLogger(__name__)
# calls worth nothing later (a modal's trigger_id lives 3 s): never kept, never wait on Prefect
NOW_OR_NEVER = frozenset({"views.open"})
# Slack's answers that mean "try again later"; every other error is final for that message
TRANSIENT_ERRORS = frozenset(
    {"ratelimited", "internal_error", "fatal_error", "service_unavailable", "request_timeout"}
)


# -- delivery ------------------------------------------------------------------------------------
def web_client(settings: Settings) -> Any:
    """A WebClient with retry handlers, or None when no bot token is configured."""
    if settings.slack_bot_token is None:
        return None
    from slack_sdk import WebClient
    from slack_sdk.http_retry.builtin_handlers import (
        ConnectionErrorRetryHandler,
        RateLimitErrorRetryHandler,
        ServerErrorRetryHandler,
    )

    return WebClient(
        token=settings.slack_bot_token.get_secret_value(),
        base_url=settings.slack_api_url or WebClient.BASE_URL,
        timeout=settings.slack_timeout,
        retry_handlers=[
            ConnectionErrorRetryHandler(max_retry_count=2),
            RateLimitErrorRetryHandler(max_retry_count=3),
            ServerErrorRetryHandler(max_retry_count=2),
        ],
    )


class NeverSent(ValueError):
    """A message cudamedic does not send (flows/slack/outbox.py `ALLOWED`)."""


def _send(client: Any, item: dict[str, Any]) -> dict[str, Any]:
    if why := outbox.refusal(item):  # the one door to Slack: only what cudamedic sends
        raise NeverSent(why)
    if item["method"] == "files_upload_v2":
        return dict(client.files_upload_v2(**item["args"]).data)
    return dict(client.api_call(item["method"], json=item["args"]).data)


def refused_for_good(exc: Exception) -> str | None:
    """Why Slack will never take this message (its error code), or None when waiting may help
    (429, 5xx, timeouts, connection errors)."""
    from slack_sdk.errors import SlackApiError, SlackRequestError

    if isinstance(exc, NeverSent):
        return str(exc)
    if isinstance(exc, SlackApiError):
        status = int(getattr(exc.response, "status_code", 200) or 200)
        error = str(exc.response.get("error") or "") if exc.response is not None else ""
        if status == 429 or status >= 500 or error in TRANSIENT_ERRORS:
            return None
        return error or f"HTTP {status}"
    if isinstance(exc, SlackRequestError):  # an upload the file server did not take, or bad args
        return None if str(exc).startswith("Failed to upload") else str(exc)[:200]
    if isinstance(exc, OSError | TimeoutError | urllib.error.URLError | http.client.HTTPException):
        return None
    return type(exc).__name__  # a message that cannot be sent (waiting would not help)


def deliver(settings: Settings, method: str, **args: Any) -> dict[str, Any] | None:
    """Call one Slack method; on a passing failure keep it in the outbox, on a final one in the
    dead letters. Never raises."""
    client = web_client(settings)
    if client is None:
        return None
    item = {"method": method, "args": args}
    if method in NOW_OR_NEVER:
        return _send_now(client, item)
    if flush_outbox(settings, client):  # older messages still wait: keep the order
        _keep(settings, item)
        return None
    try:
        return _send(client, item)
    except Exception as exc:  # a Slack outage must never fail a response
        why = refused_for_good(exc)
        if why is None:
            log.warning("Slack %s failed (kept for later): %s", method, type(exc).__name__)
            _keep(settings, item)
        else:
            outbox.bury(settings, item, why)
        return None


def _send_now(client: Any, item: dict[str, Any]) -> dict[str, Any] | None:
    """A call that is worth nothing later (a modal's trigger lives 3 s): sent at once, past the
    outbox and without asking Prefect (it answers a click before the acknowledgement)."""
    try:
        return _send(client, item)
    except Exception as exc:
        log.warning("Slack %s failed (not kept): %s", item["method"], type(exc).__name__)
        return None


def _keep(settings: Settings, item: dict[str, Any]) -> None:
    outbox.keep(settings, {**item, "at": time.time()})


def flush_outbox(settings: Settings, client: Any = None) -> int:
    """Send what earlier deliveries could not, oldest first; returns how many still wait (at
    least 1 while another process of the fleet is sending them). A message Slack refuses for
    good goes to the dead letters and never holds back those behind it. When Prefect cannot be
    asked, what this machine kept is sent from its local cache."""
    client = client or web_client(settings)
    if client is None:
        return 0
    try:
        return _flush_fleet(settings, client)
    except outbox.PrefectUnavailable:
        return _flush_local(settings, client)


def _flush_fleet(settings: Settings, client: Any) -> int:
    if not outbox.local_outbox(settings).exists() and not outbox.any_stored(settings):
        return 0  # the common case: one small call
    try:
        with quick_lock("slack-outbox", settings) as renew:
            if renew is None:
                return 1  # another process sends them now; a new message waits behind them
            outbox.move_local(settings)
            return _send_stored(settings, client, renew)
    except (OSError, ValueError, LookupError) as exc:  # the lock's calls
        raise outbox.PrefectUnavailable(type(exc).__name__) from None


def _send_stored(settings: Settings, client: Any, renew: Callable[[], None]) -> int:
    """The fleet's waiting messages in order (and those kept while sending), each removed once
    sent; stops at the first passing failure."""
    renewed, done = time.monotonic(), set()
    while items := [x for x in outbox.stored(settings) if x[0] not in done]:
        for n, (art_id, item) in enumerate(items):
            if time.monotonic() - renewed > QUICK_LEASE_S / 3:
                renew()
                renewed = time.monotonic()
            if _failed_for_now(settings, client, item):
                return len(items) - n
            outbox.remove(art_id)
            done.add(art_id)
    return 0


def _flush_local(settings: Settings, client: Any) -> int:
    """What this machine kept while Prefect was away, sent from the local cache."""
    path = outbox.local_outbox(settings)
    if not path.exists():
        return 0
    with outbox.locked(settings):
        items = outbox.read_local(path)
        left: list[dict[str, Any]] = []
        for n, item in enumerate(items):
            if _failed_for_now(settings, client, item):
                left = items[n:]  # keep the order: stop at the first passing failure
                break
        outbox.write_local(path, left)
        return len(left)


def _failed_for_now(settings: Settings, client: Any, item: dict[str, Any]) -> bool:
    """Send one kept message: True when it must wait on; a final refusal goes to the dead
    letters (False: the next one may go), and so does a message not signed by cudamedic."""
    if why := outbox.untrusted(settings, item):
        log.warning("a kept Slack message was not sent (%s): moved to the dead letters", why)
        outbox.bury(settings, item, why)
        return False
    try:
        _send(client, item)
    except Exception as exc:
        why = refused_for_good(exc)
        if why is None:
            return True
        outbox.bury(settings, item, why)
    return False


def waiting(settings: Settings) -> list[dict[str, Any]]:
    """The messages waiting for Slack, oldest first (flows/slack/outbox.py)."""
    return outbox.waiting(settings)


def dead(settings: Settings) -> list[dict[str, Any]]:
    """The messages Slack refused for good, newest first, with the reason."""
    return outbox.dead(settings)


class SlackThread:
    """The thread of one response: progress, approval, post-mortem."""

    def __init__(self, settings: Settings, ref: dict[str, str]) -> None:
        self.settings = settings
        self.channel = ref["channel"]
        self.ts = ref["ts"]
        self.requester = ref.get("requester", "")

    def say(self, text: str, blocks: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """Post in the thread (more blocks than a message holds: several messages)."""
        first = None
        for part in msg.messages(blocks or []):
            args: dict[str, Any] = {"channel": self.channel, "thread_ts": self.ts, "text": text}
            if part:
                args["blocks"] = part
            answer = deliver(self.settings, "chat.postMessage", **args)
            first = first or answer
        return first

    def headline(self, text: str) -> None:
        deliver(self.settings, "chat.update", channel=self.channel, ts=self.ts, text=text)

    def report(self, pm: Any, markdown: str, name: str) -> None:
        self.say(f"Post-mortem: {pm.incident} on {pm.host} ({pm.outcome})", msg.summary_blocks(pm))
        deliver(
            self.settings,
            "files_upload_v2",
            channel=self.channel,
            thread_ts=self.ts,
            content=msg.mrkdwn(markdown),  # Slack shows a file as it is: its own markup
            filename=name,
            title=f"Post-mortem {pm.incident} {pm.host}",
        )


def thread_for(settings: Settings, ref: dict[str, str] | None) -> SlackThread | None:
    """The Slack thread a response reports to ({channel, ts, requester}), or None."""
    return SlackThread(settings, ref) if ref else None
