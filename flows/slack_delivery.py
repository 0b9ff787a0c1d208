"""Slack delivery from the flows (PURE of the app): progress in a response's thread, the
approval request, the post-mortem, sweep news. It never fails a flow and never jams: slack-sdk
retries rate limits (429 + Retry-After), server errors and dropped connections; what still fails
for a passing reason waits in ``STATE_DIR/slack-outbox.jsonl`` and is sent, in order, by the next
delivery; what Slack refuses for good (``channel_not_found``, ``not_in_channel``,
``invalid_auth``, ...) goes to ``STATE_DIR/slack-dead-letter.jsonl`` with the reason, and the
messages behind it go on.

The flows know only `Notifier` (flows/notify.py); `thread_for` gives them a Slack thread. The Slack
app (flows/slack.py) starts responses and imports the flows; nothing here imports the app.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import logging
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from reports import slack as msg
from runbooks.settings import Settings

log = logging.getLogger(__name__)
_outbox_lock = threading.Lock()
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


def _outbox(settings: Settings) -> Path:
    return settings.state_path / "slack-outbox.jsonl"


def dead_letters(settings: Settings) -> Path:
    """Messages Slack refused for good, one JSON line each with the reason."""
    return settings.state_path / "slack-dead-letter.jsonl"


@contextlib.contextmanager
def _locked(settings: Settings) -> Iterator[None]:
    """The outbox to this thread alone: a lock within the process, flock between processes
    (the app, the workers, a second replica sharing STATE_DIR)."""
    with _outbox_lock:
        path = settings.state_path / "slack-outbox.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _send(client: Any, item: dict[str, Any]) -> dict[str, Any]:
    if item["method"] == "files_upload_v2":
        return dict(client.files_upload_v2(**item["args"]).data)
    return dict(client.api_call(item["method"], json=item["args"]).data)


def refused_for_good(exc: Exception) -> str | None:
    """Why Slack will never take this message (its error code), or None when waiting may help
    (429, 5xx, timeouts, connection errors)."""
    from slack_sdk.errors import SlackApiError, SlackRequestError

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
            _dead(settings, item, why)
        return None


def _keep(settings: Settings, item: dict[str, Any]) -> None:
    with _locked(settings), _outbox(settings).open("a", encoding="utf-8") as f:
        f.write(json.dumps({**item, "at": time.time()}) + "\n")


def _dead(settings: Settings, item: dict[str, Any], why: str) -> None:
    log.warning("Slack refused %s for good (%s): kept in the dead letters", item["method"], why)
    path = dead_letters(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({**item, "reason": why, "dead_at": time.time()}) + "\n")


def flush_outbox(settings: Settings, client: Any = None) -> int:
    """Send what earlier deliveries could not; returns how many are still waiting. A message
    Slack refuses for good goes to the dead letters and never holds back those behind it."""
    path = _outbox(settings)
    if not path.exists():
        return 0
    client = client or web_client(settings)
    if client is None:
        return 0
    with _locked(settings):
        if not path.exists():  # another process sent them meanwhile
            return 0
        items = _outbox_items(path.read_text(encoding="utf-8", errors="replace"))
        left = []
        for i, item in enumerate(items):
            try:
                _send(client, item)
            except Exception as exc:
                why = refused_for_good(exc)
                if why is None:
                    left = items[i:]  # keep the order: stop at the first passing failure
                    break
                _dead(settings, item, why)
        if left:
            path.write_text("".join(json.dumps(x) + "\n" for x in left), encoding="utf-8")
        else:
            path.unlink(missing_ok=True)
        return len(left)


def _outbox_items(text: str) -> list[dict[str, Any]]:
    """The outbox's messages; a line cut by a crash or edited by hand is dropped (it would
    otherwise fail every flush and hold back everything behind it)."""
    items = []
    for line in text.splitlines():
        try:
            item = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            item = None
        if (
            isinstance(item, dict)
            and isinstance(item.get("method"), str)
            and isinstance(item.get("args"), dict)
        ):
            items.append(item)
        elif line.strip():
            log.warning("dropped an unreadable line of the Slack outbox")
    return items


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
            content=markdown,
            filename=name,
            title=f"Post-mortem {pm.incident} {pm.host}",
        )


def thread_for(settings: Settings, ref: dict[str, str] | None) -> SlackThread | None:
    """The Slack thread a response reports to ({channel, ts, requester}), or None."""
    return SlackThread(settings, ref) if ref else None
