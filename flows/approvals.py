"""The approval rule's I/O side (the rule itself: runbooks/approvals.py): who asked for a
response, whether a Slack user is in an approver group or channel, and the verdict on one
answer, audited. The flow judges every answer it receives (CLI, Slack, the Prefect UI, an
up-front approval); the Slack app asks the same questions first, to answer a click at once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flows.slack_delivery import web_client
from runbooks import approvals
from runbooks.settings import Settings

APPROVERS_TTL_S = 60.0


class Approvers:
    """Who may approve: members of the approver user groups and channels, asked of Slack at
    most every `ttl` seconds (channel members page by page)."""

    def __init__(self, settings: Settings, ttl: float = APPROVERS_TTL_S) -> None:
        self.settings, self.ttl = settings, ttl
        self.lock = threading.Lock()
        self.cache: dict[str, tuple[float, frozenset[str]]] = {}

    def members(self, kind: str, ident: str) -> frozenset[str]:
        key = f"{kind}:{ident}"
        with self.lock:
            hit = self.cache.get(key)
        if hit and time.monotonic() - hit[0] < self.ttl:
            return hit[1]
        users = frozenset(self._ask(kind, ident))
        with self.lock:
            self.cache[key] = (time.monotonic(), users)
        return users

    def _ask(self, kind: str, ident: str) -> list[str]:
        client = web_client(self.settings)
        if client is None:
            raise RuntimeError("no Slack bot token (CUDAMEDIC_SLACK_BOT_TOKEN) here")
        if kind == "group":
            answer = client.api_call("usergroups.users.list", params={"usergroup": ident})
            return [str(u) for u in answer.get("users") or []]
        users: list[str] = []
        cursor = ""
        for _ in range(1000):  # 200 a page: 200,000 members at most
            params = {"channel": ident, "limit": 200, **({"cursor": cursor} if cursor else {})}
            answer = client.api_call("conversations.members", params=params)
            users += [str(u) for u in answer.get("members") or []]
            cursor = str(_obj(answer.get("response_metadata")).get("next_cursor") or "")
            if not cursor:
                break
        return users


def _obj(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def requester(slack: dict[str, str] | None, detected_by: str, in_process: bool) -> str:
    """Who asked for a response, as an identity: the Slack user who asked; the OS user of the
    process the flow runs in when started from a terminal (`cudamedic triage`); otherwise the
    automation that started it (a sweep, an alert), which is nobody who could approve."""
    if slack and slack.get("requester"):
        return str(slack["requester"])
    if in_process:
        return approvals.cli_claim()
    return f"automation:{detected_by}"


def judge(
    settings: Settings, by: str, requester_id: str, members: Approvers | None = None
) -> tuple[str, str | None]:
    """The identity an answer's `by` names, and why it may not answer (None: it may)."""
    who = approvals.identity(settings, by)
    asker = approvals.identity(settings, requester_id)
    members = members or Approvers(settings)

    def slack_member(user: str) -> bool:
        for group in settings.slack_approver_groups:
            if user in members.members("group", group):
                return True
        return any(user in members.members("channel", c) for c in settings.slack_approver_channels)

    try:
        return who, approvals.refusal(settings, who, asker, slack_member)
    except Exception as exc:  # Slack unreachable or refusing: nobody is let in on a failure
        why = f"{type(exc).__name__}: {exc}"[:200]
        return who, f"could not ask Slack whether {who} approves ({why})"
