"""The approval rule's I/O side (the rule itself: runbooks/fix/approvals.py): who asked for a
response, whether a Slack user is in an approver group or channel, and the verdict on one
answer, audited. The flow judges every answer it receives (CLI, Slack, the Prefect UI, an
up-front approval); the Slack app asks the same questions first, to answer a click at once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flows.slack.delivery import web_client
from runbooks.core.settings import Settings
from runbooks.fix import approvals

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


def requester(
    settings: Settings,
    slack: dict[str, str] | None,
    detected_by: str,
    in_process: bool,
    start: tuple[str, str, str | None],
) -> tuple[str, str]:
    """Who asked for a response, as an identity, and how that is established
    (runbooks/fix/approvals.py): the Slack user of a start the Slack app signed; the OS user of the
    process the flow runs in when started from a terminal (`cudamedic triage`); an alert or a
    sweep that signed its start (`start`: proof, target, container) — nobody who could approve;
    otherwise unknown: a run created through the Prefect API by whoever holds its credentials."""
    proof, target, container = start
    if slack and slack.get("requester"):
        user = str(slack["requester"])
        signed = approvals.slack_start_established(
            settings,
            str(slack.get("sig") or ""),
            str(slack.get("channel") or ""),
            str(slack.get("ts") or ""),
            user,
            target,
        )
        if signed:
            return user, approvals.SLACK_SIGNED
        return f"api:unsigned Slack request for {user}"[:200], approvals.CLAIMED
    if in_process:
        return approvals.cli_claim(settings), approvals.OS_USER
    if approvals.start_established(settings, proof, detected_by, target, container or ""):
        return f"automation:{detected_by}", approvals.AUTOMATION
    return f"api:{detected_by}"[:200], approvals.CLAIMED


def judge(
    settings: Settings,
    answer: Any,
    run_id: str,
    requester_id: str,
    members: Approvers | None = None,
    established: str | None = None,
) -> tuple[str, str, str | None]:
    """The identity an answer's `by` names, how it was established, and why it may not answer
    (None: it may). `answer`: an Approval (decision, by, proof). `established`: how, when this
    process established it itself (an up-front `--yes` of the CLI that runs the flow)."""
    who = approvals.identity(settings, answer.by)
    how = established or approvals.answer_established(
        settings, run_id, answer.decision, answer.by, getattr(answer, "proof", "")
    )
    asker = approvals.identity(settings, requester_id)
    members = members or Approvers(settings)

    def slack_member(user: str) -> bool:
        for group in settings.slack_approver_groups:
            if user in members.members("group", group):
                return True
        return any(user in members.members("channel", c) for c in settings.slack_approver_channels)

    try:
        why = approvals.refusal(
            settings, who, asker, slack_member, established=how, decision=answer.decision
        )
    except Exception as exc:  # Slack unreachable or refusing: nobody is let in on a failure
        why = f"could not ask Slack whether {who} approves ({f'{type(exc).__name__}: {exc}'[:200]})"
    return who, how, why
