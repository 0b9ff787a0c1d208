"""The Slack app that starts responses and takes approvals (`cudamedic slack`): a slack_bolt App,
in Socket Mode when an app-level token is configured, else on the HTTP server of flows/http.py.
Delivery (threads, outbox, dead letters) is flows/slack/delivery.py, which the flows use. Every
HTTP request is verified with the signing secret (5-minute window, constant-time comparison);
replays and Slack's retries never start a second response, also after a restart or on another
replica (the memory of seen requests is kept in Prefect: `Memory`).
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flows.approvals import APPROVERS_TTL_S, Approvers  # noqa: F401 - the app caches members
from flows.fleet_state import Memory
from flows.http import HttpServer, Limits, json_app, read_body, reply
from flows.incident import run_url
from flows.slack.delivery import (  # noqa: F401 - the app's side of delivery, and its old home
    SlackThread,
    dead,
    deliver,
    flush_outbox,
    waiting,
    web_client,
)
from flows.triage import answer
from reports import slack as msg
from runbooks.collect.inventory import Inventory
from runbooks.collect.redact import redact_text
from runbooks.core.errors import CudamedicError, InputError
from runbooks.core.names import container_name
from runbooks.core.settings import Settings
from runbooks.fix.approvals import answer_proof, start_proof

log = logging.getLogger(__name__)
INCIDENT_DEPLOYMENT = "incident-response/incident-response"
SWEEP_DEPLOYMENT = "fleet-health-check/fleet-sweep"
MAX_BODY = 1 << 20
PATHS = ("/slack/commands", "/slack/interactive", "/slack/events")


def keep_flushing(settings: Settings) -> threading.Event:
    """Resend the outbox every `slack_outbox_flush_s` from a daemon thread (the Slack app runs
    it), so a message kept during an outage goes out once Slack answers, even when nothing else
    is posted; and forget seen requests past their time. Set the returned event to stop."""
    stop = threading.Event()

    def loop() -> None:
        last_prune = 0.0
        while not stop.wait(settings.slack_outbox_flush_s):
            try:
                flush_outbox(settings)
                if time.monotonic() - last_prune > 600:
                    last_prune = time.monotonic()
                    Memory.prune()
            except Exception as exc:  # never let the flusher die
                log.warning("Slack outbox flush failed: %s", type(exc).__name__)

    threading.Thread(target=loop, name="slack-outbox", daemon=True).start()
    return stop


# -- the app ------------------------------------------------------------------------------------
USAGE = (
    "usage: /cudamedic triage HOST [CONTAINER] [-- pasted error text] | why PASTED ERROR TEXT"
    " | sweep [TAG] | status"
)
TRIAGE_USAGE = "usage: /cudamedic triage HOST [CONTAINER] [-- pasted error text]"
# `SlackApp.socket_mode` acknowledges every envelope with slack_bolt's Socket Mode helpers
# (`run_bolt_app`, `send_response`: no public form); checked against slack_bolt 1.30 and pinned
# by tests/test_slack_app.py::test_slack_bolt_internals_we_use_are_as_checked.
BOLT_CHECKED = (1, 30)


def parse_command(text: str, inventory: Inventory) -> tuple[str, str | None, str | None]:
    """`triage HOST [CONTAINER] [-- TRIGGER TEXT]` -> (host, container, trigger) (PURE)."""
    head, _, trigger = text.partition("--")
    words = head.split()
    if not words or words[0] != "triage" or len(words) not in (2, 3):
        raise InputError(TRIAGE_USAGE)
    host = words[1]
    if host not in inventory.hosts:
        raise InputError(f"{host!r} is not a host of the inventory")
    container = container_name(words[2]) if len(words) == 3 else None
    return host, container, trigger.strip()[:4000] or None


def diagnose_text(text: str, state_dir: Path) -> Any:
    """A pasted error classified as the text a person reported (`cudamedic classify -`): no
    host, no SSH, nothing started."""
    from runbooks.diagnose.classify import classify_path

    with tempfile.TemporaryDirectory(prefix="cudamedic-paste-") as tmp:
        (Path(tmp) / "trigger.txt").write_text(redact_text(text), encoding="utf-8")
        return classify_path(Path(tmp), state_dir=state_dir)


class SlackApp:
    """The Slack app: a slack_bolt App whose listeners start responses, answer `why`, start
    sweeps, list responses and take approvals. `server()` serves it over HTTP (flows/http.py),
    `socket_mode()` connects it to Slack over a WebSocket."""

    def __init__(self, settings: Settings, inventory: Inventory) -> None:
        if settings.slack_bot_token is None or (
            settings.slack_signing_secret is None and settings.slack_app_token is None
        ):
            raise InputError(
                "the Slack app needs CUDAMEDIC_SLACK_BOT_TOKEN and CUDAMEDIC_SLACK_APP_TOKEN "
                "(Socket Mode) or CUDAMEDIC_SLACK_SIGNING_SECRET (HTTP)"
            )
        from slack_sdk.signature import SignatureVerifier

        self.settings = settings
        self.inventory = inventory
        secret = settings.slack_signing_secret
        self.verifier = SignatureVerifier(secret.get_secret_value()) if secret else None
        self.signatures = Memory(ttl=600)
        self.requests = Memory(ttl=3600)
        self.approvers = Approvers(settings)
        self.bolt = self._bolt()

    def _bolt(self) -> Any:
        from slack_bolt import App
        from slack_bolt.authorization import AuthorizeResult

        assert self.settings.slack_bot_token is not None
        token = self.settings.slack_bot_token.get_secret_value()
        secret = self.settings.slack_signing_secret

        def authorize(**_: Any) -> AuthorizeResult:  # one workspace; no auth.test per request
            return AuthorizeResult(enterprise_id=None, team_id=None, bot_token=token)

        client = web_client(self.settings)
        client.token = None  # Bolt takes the bot token from `authorize`
        app = App(
            client=client,
            signing_secret=secret.get_secret_value() if secret else "",
            authorize=authorize,
            request_verification_enabled=secret is not None,
            process_before_response=False,
            logger=logging.getLogger("flows.slack.app.bolt"),
        )
        anything = re.compile(r".*")  # every one acknowledged; `interaction` picks ours
        app.command(anything)(self._on_command)
        app.action(anything)(self._on_interaction)
        app.shortcut(anything)(self._on_interaction)
        app.view(anything)(self._on_interaction)
        return app

    def _on_command(self, ack: Any, body: dict[str, Any]) -> None:
        ack(self.command({str(k): str(v) for k, v in body.items()}))

    def _on_interaction(self, ack: Any, body: dict[str, Any]) -> None:
        answer = self.interaction(body)
        ack(answer) if answer else ack()

    # verification (HTTP mode)
    def verified(self, body: bytes, headers: Any) -> str | None:
        """None when the request is Slack's and new; else why it is refused."""
        ts, sig = headers.get("X-Slack-Request-Timestamp"), headers.get("X-Slack-Signature")
        if not ts or not sig:
            return "unsigned request"
        if self.verifier is None:
            return "no signing secret configured"
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
        text = form.get("text", "")
        verb, _, rest = text.strip().partition(" ")
        if verb in ("why", "sweep", "status"):
            return self._other(verb, rest.strip(), form)
        try:
            host, container, trigger = parse_command(text, self.inventory)
        except InputError as exc:
            usage = USAGE if str(exc) == TRIAGE_USAGE and verb != "triage" else str(exc)
            return {"response_type": "ephemeral", "text": usage}
        if not self.requests.first_time("cmd:" + form.get("trigger_id", "") + text):
            return {"response_type": "ephemeral", "text": "already started"}
        self._start(host, container, trigger, user, channel, f"Slack /cudamedic by <@{user}>")
        where = f"{host}/{container}" if container else host
        return {"response_type": "ephemeral", "text": f"Starting a response for {where}…"}

    def _other(self, verb: str, rest: str, form: dict[str, str]) -> dict[str, Any]:
        """`why TEXT`, `sweep [TAG]`, `status`: answered in a worker thread."""
        user, channel = form.get("user_id", ""), form.get("channel_id", "")
        if verb == "why" and not rest:
            return {"response_type": "ephemeral", "text": "usage: /cudamedic why PASTED ERROR"}
        if verb == "sweep" and (len(rest.split()) > 1 or not re.fullmatch(r"[\w.-]*", rest)):
            return {"response_type": "ephemeral", "text": "usage: /cudamedic sweep [TAG]"}
        if not self.requests.first_time(f"{verb}:" + form.get("trigger_id", "") + rest):
            return {"response_type": "ephemeral", "text": "already started"}

        def tell(text: str, blocks: list[dict[str, Any]] | None = None) -> None:
            extra = {"blocks": blocks} if blocks else {}
            deliver(
                self.settings, "chat.postEphemeral", channel=channel, user=user, text=text, **extra
            )

        work = {
            "why": lambda: self._why(rest[:20000], tell),
            "sweep": lambda: self._sweep(rest or None, channel, user, tell),
            "status": lambda: self._status(tell),
        }[verb]
        threading.Thread(target=_guarded(work, tell), name=f"slack-{verb}", daemon=True).start()
        said = {"why": "Diagnosing the pasted text…", "sweep": "Starting a fleet sweep…"}
        return {"response_type": "ephemeral", "text": said.get(verb, "Looking…")}

    def _why(self, text: str, say: Any) -> None:
        d = diagnose_text(text, self.settings.state_path)
        for blocks in msg.why_messages(d):
            say(f"cudamedic why: {d.incident} ({d.confidence:.2f})", blocks)

    def _sweep(self, tag: str | None, channel: str, user: str, tell: Any) -> None:
        from prefect.deployments import run_deployment

        parameters = {
            "inventory": str(self.settings.inventory) if self.settings.inventory else None,
            "tags": [tag] if tag else None,
        }
        root = deliver(
            self.settings,
            "chat.postMessage",
            channel=channel,
            text=f"Fleet sweep{f' of hosts tagged {tag}' if tag else ''} asked by <@{user}>…",
        )
        run = run_deployment(SWEEP_DEPLOYMENT, parameters=parameters, timeout=3600)
        state = run.state.name if run.state else "unknown"  # type: ignore[union-attr]
        thread = {"thread_ts": root["ts"]} if root else {}
        markdown = _artifact(str(run.id), "fleet-sweep")  # type: ignore[union-attr]
        chunks = msg.split_text(markdown or f"The sweep ended {state}.")
        for chunk in chunks:
            deliver(
                self.settings,
                "chat.postMessage",
                channel=channel,
                text=chunk,
                blocks=[msg.plain_section(chunk)],
                **thread,
            )

    def _status(self, tell: Any) -> None:
        runs = _active_runs()
        tell(f"{len(runs)} response(s) running or waiting", msg.status_blocks(runs))

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
            if ref is not None and self.settings.slack_bot_token is not None:
                # the flow takes `requester` as established only with this signature: a run
                # created through the Prefect API could name anyone (runbooks/fix/approvals.py)
                bot = self.settings.slack_bot_token.get_secret_value()
                ref["sig"] = start_proof(bot, "slack", ref["channel"], ref["ts"], user, host)
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

    # buttons, shortcuts, modal
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
        if kind == "message_action" and payload.get("callback_id") == "cudamedic_why":
            self._why_shortcut(payload, user)
            return None
        if kind == "view_submission":
            return self._submitted(payload, user)
        return None

    def _why_shortcut(self, payload: dict[str, Any], user: str) -> None:
        """The message shortcut "Why did this fail?": the diagnosis of the message's text, in
        its thread (no host, nothing started)."""
        message = _obj(payload.get("message"))
        text = str(message.get("text", ""))[:20000]
        channel = str(_obj(payload.get("channel")).get("id", ""))
        ts = str(message.get("thread_ts") or message.get("ts") or "")
        if not text.strip() or not channel:
            return
        if not self.requests.first_time("why:" + str(payload.get("trigger_id", "")) + ts):
            return

        def say(summary: str, blocks: list[dict[str, Any]] | None = None) -> None:
            args: dict[str, Any] = {"channel": channel, "text": summary, "blocks": blocks}
            deliver(self.settings, "chat.postMessage", **args, **({"thread_ts": ts} if ts else {}))

        def tell(text: str, blocks: list[dict[str, Any]] | None = None) -> None:
            deliver(self.settings, "chat.postEphemeral", channel=channel, user=user, text=text)

        work = _guarded(lambda: self._why(text, say), tell)
        threading.Thread(target=work, name="slack-why", daemon=True).start()

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

        why_not = self.refusal(run_id, user)
        if why_not:
            tell(why_not)
            return
        bot = self.settings.slack_bot_token
        proof = answer_proof(bot.get_secret_value(), "slack", run_id, decision, user) if bot else ""
        try:  # the flow judges the Slack user id again (the authority); this was the early word
            answer(run_id, decision, user, "Slack button", proof=proof)
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
        """Why `user` may not answer this run (None: they may), each failure as what it is: the
        flow's rule (runbooks/fix/approvals.py) told at once; the flow checks it again."""
        from slack_sdk.errors import SlackApiError

        from runbooks.fix import approvals

        s = self.settings
        if not approvals.enforced(s):
            return "No approvers are configured (approvers, slack_approver_groups/channels)."
        if approvals.four_eyes(s):
            try:
                requester = _requester(run_id)
            except Exception as exc:  # a forged or stale run id, Prefect unreachable
                log.warning("approval click for %r refused: %s", run_id[:40], type(exc).__name__)
                return _prefect_trouble(exc)
            if user == requester:
                return "Four-eyes rule: you asked for this response, someone else must approve it."
        if approvals.listed(s, user):
            return None
        try:
            for group in s.slack_approver_groups:
                if user in self.approvers.members("group", group):
                    return None
            for chan in s.slack_approver_channels:
                if user in self.approvers.members("channel", chan):
                    return None
        except SlackApiError as exc:
            error = exc.response.get("error") if exc.response is not None else None
            return f"Nothing was changed: asked who approves, Slack answered {error or 'an error'}."
        except Exception as exc:
            why = type(exc).__name__
            return f"Nothing was changed: Slack could not be asked who approves ({why})."
        return "You are not allowed to approve fixes (not in an approver group or channel)."

    # the transports
    def handle(self, path: str, body: bytes, headers: Any) -> Response:
        """One POST (HTTP mode): verified, then Bolt's. Blocking (Slack, Prefect): the server runs
        it in a worker thread."""
        from slack_bolt.request import BoltRequest

        why = self.verified(body, headers)
        if why:
            log.warning("refused Slack request to %s: %s", path, why)
            return reply(401, {"error": why})
        if path not in PATHS:
            return reply(404, {"error": "not found"})
        text = body.decode("utf-8", errors="replace")
        if path == "/slack/interactive":
            raw = urllib.parse.parse_qs(text).get("payload", ["{}"])[0]
            try:
                payload = json.loads(raw)
            except (ValueError, RecursionError):
                payload = None
            if not isinstance(payload, dict):
                return reply(400, {"error": "bad payload"})
        answer = self.bolt.dispatch(BoltRequest(body=text, headers=dict(headers), mode="http"))
        if answer.status == 404:  # nothing of ours listens for it: acknowledged, nothing done
            return Response(b"", 200)
        ctype = (answer.headers.get("content-type") or ["application/json"])[0]
        return Response(answer.body or b"", answer.status, media_type=ctype)

    @staticmethod
    def warm() -> None:
        """Import now what the first response needs (Prefect's client: seconds of CPU), so it
        never delays an acknowledgement."""
        import prefect.deployments  # noqa: F401

    def server(self, host: str, port: int, limits: Limits | None = None) -> HttpServer:
        """POST /slack/commands and /slack/interactive (signed by Slack); GET /health."""
        if self.verifier is None:
            raise InputError("HTTP mode needs CUDAMEDIC_SLACK_SIGNING_SECRET")
        self.warm()
        limits = limits or Limits.of(self.settings)

        async def health(request: Request) -> Response:
            return reply(200, {"ok": True})

        async def post(request: Request) -> Response:
            body = await read_body(request, limits, MAX_BODY)
            path = request.url.path
            return await run_in_threadpool(self.handle, path, body, request.headers)

        routes = [Route("/health", health), Route("/{path:path}", post, methods=["POST"])]
        return HttpServer(json_app(routes, log), host, port, limits)

    def socket_mode(self) -> Any:
        """A connected Socket Mode handler (slack_bolt's built-in client): Slack sends every
        request over a WebSocket the app opens, so no public endpoint is needed. `close()` it."""
        from slack_bolt.adapter.socket_mode import SocketModeHandler
        from slack_bolt.adapter.socket_mode.internals import run_bolt_app, send_response
        from slack_bolt.response import BoltResponse
        from slack_sdk.errors import SlackApiError

        token = self.settings.slack_app_token
        if token is None:
            raise InputError("Socket Mode needs CUDAMEDIC_SLACK_APP_TOKEN (xapp-...)")
        self.warm()

        class Handler(SocketModeHandler):
            def handle(self, client: Any, req: Any) -> None:
                """Every envelope acknowledged, also one nothing listens for (Slack would
                send it again and tell the user the app did not answer)."""
                start = time.time()
                answer = run_bolt_app(self.app, req)
                if answer.status != 200:
                    answer = BoltResponse(status=200, body="")
                send_response(client, req, answer, start)

        handler = Handler(self.bolt, token.get_secret_value(), web_client=web_client(self.settings))
        try:
            handler.connect()  # type: ignore[no-untyped-call]
        except SlackApiError as exc:
            handler.close()  # type: ignore[no-untyped-call]
            error = exc.response.get("error") if exc.response is not None else exc
            raise InputError(f"Slack refused the Socket Mode connection: {error}") from None
        return handler


def _guarded(work: Any, tell: Any) -> Any:
    """`work` for a thread: a failure is told to the user as what it is, never a traceback."""

    def run() -> None:
        try:
            work()
        except Exception as exc:
            log.warning("Slack request failed: %s: %s", type(exc).__name__, exc)
            tell(f"cudamedic could not do that: {type(exc).__name__}: {str(exc)[:300]}")

    return run


def _obj(value: Any) -> dict[str, Any]:
    """A JSON object of a Slack payload, or an empty one when it is anything else."""
    return value if isinstance(value, dict) else {}


def _prefect_trouble(exc: Exception) -> str:
    from prefect.exceptions import ObjectNotFound

    if isinstance(exc, ObjectNotFound | ValueError):
        return "Nothing was changed: that flow run cannot be found."
    return f"Nothing was changed: Prefect could not be asked about that run ({type(exc).__name__})."


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


def _artifact(run_id: str, key: str) -> str | None:
    """The markdown artifact `key` of a flow run, if it made one."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[key]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)]),
            ),
            limit=1,
        )
    return str(found[0].data) if found and found[0].data else None


def _active_runs() -> list[msg.RunLine]:
    """Runs of the incident-response flow running or waiting (Running, Paused, Scheduled,
    Pending), newest first."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    flow_name = INCIDENT_DEPLOYMENT.split("/")[0]  # from Slack, alerts, the CLI, a sweep
    states = [StateType.RUNNING, StateType.PAUSED, StateType.SCHEDULED, StateType.PENDING]
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=states))
            ),
            sort=FlowRunSort.START_TIME_DESC,
            limit=50,
        )
    return [
        msg.RunLine(
            name=r.name,
            state=str(r.state.name if r.state else "?"),
            target=str(r.parameters.get("target") or "?"),
            container=str(r.parameters.get("container") or ""),
            url=run_url(str(r.id)),
        )
        for r in runs
    ]


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
