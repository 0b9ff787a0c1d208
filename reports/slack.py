"""Slack messages (PURE): Block Kit for a response's thread — progress, the approval request with
its buttons, the post-mortem summary — and the sweep summary. Text is cut to Slack's limits
(3000 characters per section; the full report goes as a file)."""

from __future__ import annotations

import json
from typing import Any

from reports.render import PostMortem, SweepSummary
from runbooks.model import SimilarIncident

SECTION_MAX = 3000
APPROVE, REJECT = "cudamedic_approve", "cudamedic_reject"


def _cut(text: str, limit: int = SECTION_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 20] + "\n… (truncated)"


def _escape(text: str) -> str:
    """Slack mrkdwn control characters (so a log line never pings @channel or forms a link)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": _cut(text)}}


def _code(lines: list[str] | tuple[str, ...]) -> str:
    body = _escape("\n".join(lines)).replace("```", "'''")
    return "```" + _cut(body, SECTION_MAX - 10) + "```"


def root_text(target: str, container: str | None, requester: str, state: str) -> str:
    where = f"{target}/{container}" if container else target
    return f"cudamedic triage {_escape(where)} (asked by <@{requester}>): {state}"


def progress(event: str, detail: str = "") -> str:
    return f"*{_escape(event)}*" + (f": {_escape(detail[:500])}" if detail else "")


def approval_blocks(
    *,
    run_id: str,
    requester: str,
    host: str,
    container: str,
    incident: str,
    confidence: float,
    summary: str,
    diff: tuple[str, ...],
    evidence: list[str],
) -> list[dict[str, Any]]:
    value = json.dumps({"run": run_id, "requester": requester})
    changed = [ln for ln in diff if ln[:1] in "+-"] or list(diff)
    return [
        _section(
            f":warning: *Fix waiting for approval* — `{_escape(incident)}` "
            f"(confidence {confidence:.2f}) on *{_escape(host)}* / `{_escape(container)}`\n"
            f"{_escape(summary)}"
        ),
        _section("*Evidence*\n" + _code(evidence[:6])),
        _section("*`docker run` change* (- removed, + added)\n" + _code(changed)),
        {
            "type": "actions",
            "block_id": "cudamedic_approval",
            "elements": [
                {
                    "type": "button",
                    "action_id": APPROVE,
                    "style": "primary",
                    "text": {"type": "plain_text", "text": "Approve"},
                    "value": value,
                },
                {
                    "type": "button",
                    "action_id": REJECT,
                    "style": "danger",
                    "text": {"type": "plain_text", "text": "Reject"},
                    "value": value,
                },
            ],
        },
    ]


def answered_blocks(original_summary: str, decision: str, user: str) -> list[dict[str, Any]]:
    verb = "Approved" if decision == "approve" else "Rejected"
    return [_section(original_summary), _section(f"*{verb}* by <@{user}>")]


def summary_blocks(pm: PostMortem) -> list[dict[str, Any]]:
    emoji = {
        "fixed": ":white_check_mark:",
        "rolled-back": ":leftwards_arrow_with_hook:",
        "rollback-failed": ":rotating_light:",
    }.get(pm.outcome, ":information_source:")
    where = f"{pm.host} / {pm.container}" if pm.container else pm.host
    seconds = (pm.ended_at - pm.started_at).total_seconds()
    fields = [
        ("Incident", f"`{pm.incident}` ({pm.confidence:.2f})"),
        ("Where", where),
        ("Outcome", pm.outcome),
        ("Time to resolution", f"{seconds:.0f} s"),
    ]
    return (
        [
            _section(f"{emoji} *Post-mortem: {_escape(pm.incident)} on {_escape(where)}*"),
            {
                "type": "section",
                "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{_escape(v)}"} for k, v in fields],
            },
            _section(_escape(pm.summary)),
        ]
        + ([_section(_escape(pm.outcome_detail))] if pm.outcome_detail else [])
        + (
            [_section("*Similar known incidents*\n" + similar_text(pm.similar))]
            if pm.similar
            else []
        )
    )


def similar_text(similar: tuple[SimilarIncident, ...] | list[SimilarIncident]) -> str:
    """Each similar incident on a line: its class, where it is from, what it concluded."""
    lines = []
    for s in similar:
        if s.kind == "team":
            fixed = f", fixed by `{_escape(s.fix)}`" if s.fix else ""
            lines.append(
                f"• `{s.incident}` — this happened on {_escape(s.host or '?')} on "
                f"{_escape(s.when or '?')}{fixed}"
            )
        else:
            lines.append(f"• `{s.incident}` — {_escape(s.source)}: {_escape(s.conclusion[:200])}")
    return "\n".join(lines)


def sweep_blocks(s: SweepSummary) -> list[dict[str, Any]]:
    lines = [
        f"{c.change} {c.host}: `{c.code}`"
        + (f" ({c.subject})" if c.subject else "")
        + (f" [{c.level}]" if c.level else "")
        for c in s.changes
    ]
    head = (
        f"*Fleet health sweep*: {len(s.hosts)} hosts — {s.count('drain')} drain, "
        f"{s.count('warning')} warning, {s.count('healthy')} healthy"
    )
    return [_section(head), _section(_escape("\n".join(lines)) or "nothing changed")]
