"""Waiting approvals reach people, whoever started the response: each fix that waits for a
person is announced where the approvers are, and `cudamedic pending` lists the fleet's.

Where an approval is announced (`channels`):

- Slack: the response's own thread when Slack started it, and `slack_approvals_channel` for every
  response (alerts, sweeps, deployment runs included), with the Approve/Reject buttons the Slack
  app answers (flows/slack/app.py). Sent through flows/slack/delivery.py: a Slack outage keeps the
  message in the fleet's outbox, and a channel Slack refuses goes to the dead letters.
- A plain webhook for teams without Slack (`approval_webhook`, optional bearer token
  `approval_webhook_token`): one JSON POST (`WaitingApproval` plus `"event":
  "cudamedic.approval.waiting"`), retried twice, 5 s each; a failure is logged and said in the
  response's timeline, never fatal.
- Always: the Prefect event `cudamedic.approval.waiting` (an automation can forward it anywhere)
  and the response's record in Prefect, which `cudamedic pending` reads.

`warnings(settings)` is what a worker says at start when nobody would hear of a waiting approval.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

from runbooks.core.settings import Settings
from runbooks.fix.approvals import WaitingApproval

log = logging.getLogger(__name__)

EVENT = "cudamedic.approval.waiting"
__all__ = ["WaitingApproval", "announce", "channels", "warnings"]
WEBHOOK_TIMEOUT_S = 5.0
WEBHOOK_TRIES = 3


def channels(settings: Settings) -> list[str]:
    """Where a waiting approval is announced beyond Prefect (empty: nowhere a person looks)."""
    out = []
    if settings.slack_approvals_channel and settings.slack_bot_token is not None:
        out.append(f"Slack channel {settings.slack_approvals_channel}")
    if settings.approval_webhook:
        out.append(f"webhook {settings.approval_webhook.split('?', 1)[0]}")
    return out


def warnings(settings: Settings) -> list[str]:
    """What a worker (or `cudamedic serve`) says at start about approvals nobody would see."""
    said = []
    if settings.slack_approvals_channel and settings.slack_bot_token is None:
        said.append(
            "slack_approvals_channel is set but there is no Slack bot token "
            "(CUDAMEDIC_SLACK_BOT_TOKEN) here: approvals cannot be posted to it"
        )
    if not channels(settings):
        said.append(
            "no approval channel is configured (slack_approvals_channel, approval_webhook): a "
            "fix started by an alert, a sweep or a deployment run that waits for a person is "
            "seen only in the Prefect UI and `cudamedic pending`, and is not applied when "
            "nobody answers in time (deploy/OPERATIONS.md, 'Approvals')"
        )
    return said


def announce(settings: Settings, waiting: WaitingApproval) -> list[str]:
    """Announce a waiting approval everywhere configured; what failed, in words (never raises)."""
    failed = []
    if settings.slack_approvals_channel and settings.slack_bot_token is not None:
        failed.append(_slack(settings, waiting))
    if settings.approval_webhook:
        failed.append(_webhook(settings, waiting))
    return [why for why in failed if why is not None]


def _slack(settings: Settings, waiting: WaitingApproval) -> str | None:
    from flows.slack.delivery import deliver
    from reports import slack as msg

    blocks = msg.approval_blocks(
        run_id=waiting.run_id,
        requester=waiting.requester,
        host=waiting.host,
        container=waiting.container or "(host)",
        incident=waiting.incident,
        confidence=waiting.confidence,
        summary=waiting.summary + (f"\n{waiting.offer}" if waiting.offer else ""),
        diff=tuple(waiting.diff),
        evidence=waiting.evidence,
    )
    text = f"Fix waiting for approval: {waiting.incident} on {waiting.host}"
    try:
        for part in msg.messages(blocks):
            args: dict[str, Any] = {"channel": settings.slack_approvals_channel, "text": text}
            if part:
                args["blocks"] = part
            deliver(settings, "chat.postMessage", **args)  # kept in the outbox on an outage
    except Exception as exc:  # delivery never raises; a bug in building it must not either
        return f"Slack: {type(exc).__name__}"
    return None


def _webhook(settings: Settings, waiting: WaitingApproval) -> str | None:
    url = settings.approval_webhook or ""
    body = json.dumps({"event": EVENT, **waiting.model_dump(mode="json")}).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "cudamedic"}
    if settings.approval_webhook_token is not None:
        headers["Authorization"] = f"Bearer {settings.approval_webhook_token.get_secret_value()}"
    why = ""
    for attempt in range(WEBHOOK_TRIES):
        if attempt:
            time.sleep(attempt)  # 1 s, then 2 s
        request = urllib.request.Request(url, data=body, method="POST", headers=headers)  # noqa: S310 - http(s) only (settings)
        try:
            with urllib.request.urlopen(request, timeout=WEBHOOK_TIMEOUT_S) as resp:  # noqa: S310
                if 200 <= resp.status < 300:
                    return None
                why = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            why = f"HTTP {exc.code}"
            if 400 <= exc.code < 500 and exc.code not in (408, 429):
                break  # the receiver refuses it: asking again would not help
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = type(getattr(exc, "reason", exc)).__name__
    where = url.split("?", 1)[0]
    log.warning("approval webhook %s failed: %s", where, why)
    return f"webhook {where}: {why}"
