"""Slack: delivery from the flows (progress in a thread, the approval request, the post-mortem),
and the Slack app that starts responses and takes approvals (`cudamedic slack`, HTTP mode).

Delivery never fails a flow: slack-sdk retries rate limits (429 + Retry-After), server errors and
dropped connections; what still fails is kept in ``STATE_DIR/slack-outbox.jsonl`` and sent by the
next delivery. Every inbound request is verified with the signing secret (5-minute window,
constant-time comparison); replays and Slack's retries never start a second response.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flows.alerts import Seen
from flows.http import HttpServer, Limits, json_app, read_body, reply
from reports import slack as msg
from runbooks.errors import CudamedicError, InputError
from runbooks.inventory import Inventory
from runbooks.names import container_name
from runbooks.redact import redact_text
from runbooks.settings import Settings

log = logging.getLogger(__name__)
INCIDENT_DEPLOYMENT = "incident-response/incident-response"
MAX_BODY = 1 << 20
_outbox_lock = threading.Lock()


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


def _send(client: Any, item: dict[str, Any]) -> dict[str, Any]:
    if item["method"] == "files_upload_v2":
        return dict(client.files_upload_v2(**item["args"]).data)
    return dict(client.api_call(item["method"], json=item["args"]).data)


def deliver(settings: Settings, method: str, **args: Any) -> dict[str, Any] | None:
    """Call one Slack method; on failure keep it in the outbox. Never raises."""
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
        log.warning("Slack %s failed (kept for later): %s", method, type(exc).__name__)
        _keep(settings, item)
        return None


def _keep(settings: Settings, item: dict[str, Any]) -> None:
    with _outbox_lock:
        path = _outbox(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({**item, "at": time.time()}) + "\n")


def flush_outbox(settings: Settings, client: Any = None) -> int:
    """Send what earlier deliveries could not; returns how many are still waiting."""
    path = _outbox(settings)
    if not path.exists():
        return 0
    client = client or web_client(settings)
    if client is None:
        return 0
    with _outbox_lock:
        items = _outbox_items(path.read_text(encoding="utf-8", errors="replace"))
        left = []
        for i, item in enumerate(items):
            try:
                _send(client, item)
            except Exception:
                left = items[i:]  # keep the order: stop at the first failure
                break
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


def keep_flushing(settings: Settings) -> threading.Event:
    """Resend the outbox every `slack_outbox_flush_s` from a daemon thread (the Slack app runs
    it), so a message kept during an outage goes out once Slack answers, even when nothing else
    is posted. Set the returned event to stop."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(settings.slack_outbox_flush_s):
            try:
                flush_outbox(settings)
            except Exception as exc:  # never let the flusher die
                log.warning("Slack outbox flush failed: %s", type(exc).__name__)

    threading.Thread(target=loop, name="slack-outbox", daemon=True).start()
    return stop


class SlackThread:
    """The thread of one response: progress, approval, post-mortem."""

    def __init__(self, settings: Settings, ref: dict[str, str]) -> None:
        self.settings = settings
        self.channel = ref["channel"]
        self.ts = ref["ts"]
        self.requester = ref.get("requester", "")

    def say(self, text: str, blocks: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        args: dict[str, Any] = {"channel": self.channel, "thread_ts": self.ts, "text": text}
        if blocks:
            args["blocks"] = blocks
        return deliver(self.settings, "chat.postMessage", **args)

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


# -- the app (HTTP mode) --------------------------------------------------------------------------
def parse_command(text: str, inventory: Inventory) -> tuple[str, str | None, str | None]:
    """`triage HOST [CONTAINER] [-- TRIGGER TEXT]` -> (host, container, trigger) (PURE)."""
    head, _, trigger = text.partition("--")
    words = head.split()
    if not words or words[0] != "triage" or len(words) not in (2, 3):
        raise InputError("usage: /cudamedic triage HOST [CONTAINER] [-- pasted error text]")
    host = words[1]
    if host not in inventory.hosts:
        raise InputError(f"{host!r} is not a host of the inventory")
    container = container_name(words[2]) if len(words) == 3 else None
    return host, container, trigger.strip()[:4000] or None


class SlackApp:
    def __init__(self, settings: Settings, inventory: Inventory) -> None:
        if settings.slack_signing_secret is None or settings.slack_bot_token is None:
            raise InputError(
                "the Slack app needs CUDAMEDIC_SLACK_SIGNING_SECRET and CUDAMEDIC_SLACK_BOT_TOKEN"
            )
        from slack_sdk.signature import SignatureVerifier

        self.settings = settings
        self.inventory = inventory
        self.verifier = SignatureVerifier(settings.slack_signing_secret.get_secret_value())
        self.signatures = Seen(ttl=600)
        self.requests = Seen(ttl=3600)

    # verification
    def verified(self, body: bytes, headers: Any) -> str | None:
        """None when the request is Slack's and new; else why it is refused."""
        ts, sig = headers.get("X-Slack-Request-Timestamp"), headers.get("X-Slack-Signature")
        if not ts or not sig:
            return "unsigned request"
        try:
            valid = self.verifier.is_valid(body, ts, sig)
        except (ValueError, UnicodeDecodeError):  # a timestamp that is no number, a non-UTF-8 body
            valid = False
        if not valid:
            return "bad signature or stale timestamp"
        if not self.signatures.first_time(f"{ts}:{sig}"):
            return "replayed request"
        return None

    # slash command
    def command(self, form: dict[str, str]) -> dict[str, Any]:
        user, channel = form.get("user_id", ""), form.get("channel_id", "")
        try:
            host, container, trigger = parse_command(form.get("text", ""), self.inventory)
        except InputError as exc:
            return {"response_type": "ephemeral", "text": str(exc)}
        if not self.requests.first_time("cmd:" + form.get("trigger_id", "") + form.get("text", "")):
            return {"response_type": "ephemeral", "text": "already started"}
        self._start(host, container, trigger, user, channel, f"Slack /cudamedic by <@{user}>")
        where = f"{host}/{container}" if container else host
        return {"response_type": "ephemeral", "text": f"Starting a response for {where}…"}

    def _start(
        self,
        host: str,
        container: str | None,
        trigger: str | None,
        user: str,
        channel: str,
        detected_by: str,
    ) -> None:
        def run() -> None:
            root = deliver(
                self.settings,
                "chat.postMessage",
                channel=channel,
                text=msg.root_text(host, container, user, "collecting evidence…"),
            )
            ref = (
                {"channel": str(root["channel"]), "ts": str(root["ts"]), "requester": user}
                if root
                else None
            )
            try:
                _run_deployment(
                    {
                        "target": host,
                        "container": container,
                        "trigger_text": redact_text(trigger) if trigger else None,
                        "detected_by": detected_by,
                        "slack": ref,
                    }
                )
            except Exception as exc:
                log.warning("could not start the response: %s: %s", type(exc).__name__, exc)
                deliver(
                    self.settings,
                    "chat.postEphemeral",
                    channel=channel,
                    user=user,
                    text="cudamedic could not start the response: "
                    f"{type(exc).__name__}: {str(exc)[:300]}",
                )

        threading.Thread(target=run, name="slack-start", daemon=True).start()

    # buttons, shortcut, modal
    def interaction(self, payload: dict[str, Any]) -> dict[str, Any] | None:
        if not isinstance(payload, dict):
            return None
        kind = payload.get("type")
        user = str(_obj(payload.get("user")).get("id", ""))
        if kind == "block_actions":
            self._button(payload, user)
            return None
        if kind == "message_action" and payload.get("callback_id") == "cudamedic_triage":
            text = str(_obj(payload.get("message")).get("text", ""))[:2900]
            channel = str(_obj(payload.get("channel")).get("id", ""))
            deliver(
                self.settings,
                "views.open",
                trigger_id=payload.get("trigger_id"),
                view=_triage_modal(text, channel),
            )
            return None
        if kind == "view_submission":
            return self._submitted(payload, user)
        return None

    def _submitted(self, payload: dict[str, Any], user: str) -> dict[str, Any] | None:
        view = _obj(payload.get("view"))
        if view.get("callback_id") != "cudamedic_triage_modal":
            return None
        values = _obj(_obj(view.get("state")).get("values"))

        def field(block: str) -> str:
            return str(_obj(_obj(values.get(block)).get("v")).get("value") or "").strip()

        try:
            meta = _obj(json.loads(str(view.get("private_metadata") or "{}")))
        except (ValueError, RecursionError):
            meta = {}
        spec = f"triage {field('host')} {field('container')}".strip()
        try:
            host, container, _ = parse_command(spec, self.inventory)
        except InputError as exc:
            return {"response_action": "errors", "errors": {"host": str(exc)[:150]}}
        if not self.requests.first_time("view:" + str(view.get("id", ""))):
            return None
        self._start(
            host,
            container,
            str(meta["text"]) if meta.get("text") else None,
            user,
            str(meta.get("channel", "")),
            f"Slack shortcut by <@{user}>",
        )
        return None

    def _button(self, payload: dict[str, Any], user: str) -> None:
        actions = payload.get("actions")
        if not isinstance(actions, list) or not actions:
            return
        action = _obj(actions[0])
        decision = {msg.APPROVE: "approve", msg.REJECT: "reject"}.get(str(action.get("action_id")))
        channel = str(_obj(payload.get("channel")).get("id", ""))
        if decision is None:
            return
        try:
            run_id = str(json.loads(action.get("value") or "{}")["run"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return
        if not self.requests.first_time(f"click:{run_id}:{user}:{action.get('action_ts', '')}"):
            return
        threading.Thread(
            target=self._decide,
            args=(run_id, decision, user, payload, channel),
            name="slack-approval",
            daemon=True,
        ).start()

    def _decide(
        self, run_id: str, decision: str, user: str, payload: dict[str, Any], channel: str
    ) -> None:
        def tell(text: str) -> None:
            deliver(self.settings, "chat.postEphemeral", channel=channel, user=user, text=text)

        try:
            why_not = self.refusal(run_id, user)
        except Exception as exc:  # a forged or stale run id, Prefect unreachable
            log.warning("approval click for %r refused: %s", run_id[:40], type(exc).__name__)
            why_not = "Nothing was changed: that flow run cannot be found."
        if why_not:
            tell(why_not)
            return
        from flows.triage import answer

        name = str(_obj(payload.get("user")).get("username") or user)
        try:
            answer(run_id, decision, f"{name} (Slack {user})", "Slack button")
        except (InputError, CudamedicError) as exc:
            tell(f"Nothing was changed: {exc}")
            return
        message = _obj(payload.get("message"))
        blocks = message.get("blocks")
        first = _obj(blocks[0]) if isinstance(blocks, list) and blocks else {}
        summary = str(_obj(first.get("text")).get("text", "Fix"))
        deliver(
            self.settings,
            "chat.update",
            channel=channel,
            ts=message.get("ts"),
            text=f"{decision} by <@{user}>",
            blocks=msg.answered_blocks(summary, decision, user),
        )

    def refusal(self, run_id: str, user: str) -> str | None:
        """Why `user` may not answer this run (None: they may)."""
        s = self.settings
        if not s.slack_approver_groups and not s.slack_approver_channels:
            return "No Slack approvers are configured (slack_approver_groups/channels)."
        if s.slack_four_eyes and user == _requester(run_id):
            return "Four-eyes rule: you asked for this response, someone else must approve it."
        client = web_client(s)
        for group in s.slack_approver_groups:
            users = client.api_call("usergroups.users.list", params={"usergroup": group})
            if user in (users.get("users") or []):
                return None
        for chan in s.slack_approver_channels:
            members = client.api_call("conversations.members", params={"channel": chan})
            if user in (members.get("members") or []):
                return None
        return "You are not allowed to approve fixes (not in an approver group or channel)."

    # the HTTP side
    def handle(self, path: str, body: bytes, headers: Any) -> tuple[int, dict[str, Any] | None]:
        """One POST -> (HTTP status, answer). Blocking (Slack, Prefect): the server runs it in a
        worker thread."""
        why = self.verified(body, headers)
        if why:
            log.warning("refused Slack request to %s: %s", path, why)
            return 401, {"error": why}
        text = body.decode("utf-8", errors="replace")
        form = {k: v[0] for k, v in urllib.parse.parse_qs(text).items()}
        if path == "/slack/commands":
            return 200, self.command(form)
        if path != "/slack/interactive":
            return 404, {"error": "not found"}
        try:
            payload = json.loads(form.get("payload", "{}"))
        except (ValueError, RecursionError):
            payload = None
        if not isinstance(payload, dict):
            return 400, {"error": "bad payload"}
        return 200, self.interaction(payload)

    def server(self, host: str, port: int, limits: Limits | None = None) -> HttpServer:
        """POST /slack/commands and /slack/interactive (signed by Slack); GET /health."""
        limits = limits or Limits.of(self.settings)

        async def health(request: Request) -> Response:
            return reply(200, {"ok": True})

        async def post(request: Request) -> Response:
            body = await read_body(request, limits, MAX_BODY)
            path = request.url.path
            return reply(*await run_in_threadpool(self.handle, path, body, request.headers))

        routes = [Route("/health", health), Route("/{path:path}", post, methods=["POST"])]
        return HttpServer(json_app(routes, log), host, port, limits)


def _obj(value: Any) -> dict[str, Any]:
    """A JSON object of a Slack payload, or an empty one when it is anything else."""
    return value if isinstance(value, dict) else {}


def _requester(run_id: str) -> str:
    from uuid import UUID

    from prefect import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
    ref = run.parameters.get("slack") or {}
    return str(ref.get("requester", "")) if isinstance(ref, dict) else ""


def _run_deployment(parameters: dict[str, Any]) -> str:
    from prefect.deployments import run_deployment

    run = run_deployment(INCIDENT_DEPLOYMENT, parameters=parameters, timeout=0)
    return str(run.id)  # type: ignore[union-attr]


def _triage_modal(text: str, channel: str) -> dict[str, Any]:
    def field(block: str, label: str, optional: bool) -> dict[str, Any]:
        return {
            "type": "input",
            "block_id": block,
            "optional": optional,
            "label": {"type": "plain_text", "text": label},
            "element": {"type": "plain_text_input", "action_id": "v"},
        }

    return {
        "type": "modal",
        "callback_id": "cudamedic_triage_modal",
        "title": {"type": "plain_text", "text": "cudamedic triage"},
        "submit": {"type": "plain_text", "text": "Start"},
        "private_metadata": json.dumps({"text": text[:2000], "channel": channel}),
        "blocks": [
            field("host", "Host (inventory name)", False),
            field("container", "Container (optional)", True),
        ],
    }
