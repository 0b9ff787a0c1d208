"""Slack messages (PURE): Block Kit for a response's thread — progress, the approval request with
its buttons, the post-mortem summary —, the sweep summary, `why` answers and the list of
responses. Long text is split at Slack's limits (3000 characters per section, 50 blocks per
message) into more sections and messages, never cut."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from reports.render import PostMortem, SweepSummary
from runbooks.core.model import Diagnosis, SimilarIncident

SECTION_MAX = 3000
BLOCKS_MAX = 50
APPROVE, REJECT = "cudamedic_approve", "cudamedic_reject"
FENCE = "```"


def split_text(text: str, limit: int = SECTION_MAX) -> list[str]:
    """`text` in pieces of at most `limit` characters, at line ends where a line fits (PURE)."""
    pieces: list[str] = []
    current = ""
    for line in text.splitlines() or [""]:
        while len(line) > limit:  # a line longer than a piece: split inside it
            if current:
                pieces.append(current)
                current = ""
            pieces.append(line[:limit])
            line = line[limit:]
        joined = f"{current}\n{line}" if current else line
        if len(joined) > limit:
            pieces.append(current)
            current = line
        else:
            current = joined
    if current or not pieces:
        pieces.append(current)
    return pieces


def messages(blocks: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Blocks in groups of at most 50 (Slack's limit per message), in order."""
    return [blocks[i : i + BLOCKS_MAX] for i in range(0, len(blocks), BLOCKS_MAX)] or [[]]


def plain_section(text: str) -> dict[str, Any]:
    """One section of already safe text (at most 3000 characters: see `split_text`)."""
    return {"type": "section", "text": {"type": "mrkdwn", "text": text[:SECTION_MAX]}}


def _escape(text: str) -> str:
    """Slack mrkdwn control characters (so a log line never pings @channel or forms a link)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


# -- the post-mortem in Slack's own markup (mrkdwn) ------------------------------------------------
_MD_ESCAPED = re.compile(r"\\([\\`*_\[\]<>#!|~])")  # reports.render's escapes, undone
_CODE_SPAN = re.compile(r"(?<![`\\])(`+)(?!`)(.+?)(?<!`)\1(?!`)")  # not at an escaped `
_MD_LINK = re.compile(r"\[((?:\\.|[^\]\\])*)\]\((https?://[^()\s]+)\)")
_RULE = re.compile(r"^\|(?:\s*-+\s*\|)+$")


def mrkdwn(markdown: str) -> str:
    """A post-mortem rendered for GitHub and the Prefect UI (reports/render.py), in Slack's own
    markup: headings and `**bold**` as `*bold*`, list items as bullets, two-column table rows as
    `*name*: value`, links as `<url|name>`, fences as plain ```; reports.render's backslash
    escapes undone (Slack shows them raw) and Slack's own `&`, `<`, `>` escaped instead, so text
    from a target still forms no link or mention."""
    out: list[str] = []
    fence: str | None = None
    for line in markdown.splitlines():
        if fence is not None:
            if line.strip() == fence:
                fence = None
                out.append("```")
            else:
                out.append(_escape(line))
            continue
        if (m := re.match(r"^(`{3,})\w*\s*$", line)) is not None:
            fence = m.group(1)
            out.append("```")
        elif _RULE.match(line):
            continue
        elif (m := re.match(r"^#{1,6} (.*)$", line)) is not None:
            out.append(f"*{_inline(m.group(1))}*")
        elif (m := re.match(r"^\| (.*) \|$", line)) is not None:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(1))]
            name, rest = cells[0], [c for c in cells[1:] if c]
            out.append(f"*{_inline(name)}*: " + " — ".join(_inline(c) for c in rest))
        elif (m := re.match(r"^- (?:\[ \] )?(.*)$", line)) is not None:
            out.append(f"• {_inline(m.group(1))}")
        else:
            out.append(_inline(line))
    return "\n".join(out) + "\n"


def _inline(text: str) -> str:
    """One line of Markdown prose in mrkdwn: code spans kept (single backticks), links as
    Slack links, escapes undone, `&<>` escaped."""
    parts = []
    last = 0
    for m in _CODE_SPAN.finditer(text):
        parts.append(_prose(text[last : m.start()]))
        parts.append("`" + _escape(m.group(2).strip().replace("`", "'")) + "`")
        last = m.end()
    parts.append(_prose(text[last:]))
    return "".join(parts)


def _prose(text: str) -> str:
    out, last = [], 0
    for m in _MD_LINK.finditer(text):
        out.append(_plain(text[last : m.start()]))
        name = _MD_ESCAPED.sub(r"\1", m.group(1)).replace("|", "/")
        out.append(f"<{m.group(2)}|{_escape(name)}>")
        last = m.end()
    out.append(_plain(text[last:]))
    return "".join(out)


def _plain(text: str) -> str:
    return _escape(_MD_ESCAPED.sub(r"\1", text.replace("**", "*")))


def _sections(text: str) -> list[dict[str, Any]]:
    return [plain_section(piece) for piece in split_text(text)]


def _code_sections(title: str, lines: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """`title` and the lines as code, in as many sections as they need."""
    body = _escape("\n".join(lines)).replace(FENCE, "'''")
    pieces = split_text(body, SECTION_MAX - len(title) - 2 * len(FENCE) - 1)
    return [
        plain_section((title + "\n" if i == 0 else "") + FENCE + piece + FENCE)
        for i, piece in enumerate(pieces)
    ]


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
        *_sections(
            f":warning: *Fix waiting for approval* — `{_escape(incident)}` "
            f"(confidence {confidence:.2f}) on *{_escape(host)}* / `{_escape(container)}`\n"
            f"{_escape(summary)}"
        ),
        *_code_sections("*Evidence*", evidence[:6]),
        *_code_sections("*`docker run` change* (- removed, + added)", changed),
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
    return [*_sections(original_summary), *_sections(f"*{verb}* by <@{user}>")]


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
            *_sections(f"{emoji} *Post-mortem: {_escape(pm.incident)} on {_escape(where)}*"),
            {
                "type": "section",
                "fields": [{"type": "mrkdwn", "text": f"*{k}*\n{_escape(v)}"} for k, v in fields],
            },
            *_sections(_escape(pm.summary)),
        ]
        + (_sections(_escape(pm.outcome_detail)) if pm.outcome_detail else [])
        + (
            _sections("*Similar known incidents*\n" + similar_text(pm.similar))
            if pm.similar
            else []
        )
    )


def similar_text(similar: tuple[SimilarIncident, ...] | list[SimilarIncident]) -> str:
    """Each similar incident on a line: its class, where it is from, what it concluded."""
    lines = []
    for s in similar:
        label = f"a different cause, `{s.incident}`" if s.same_cause is False else f"`{s.incident}`"
        if s.kind == "team":
            fixed = f", fixed by `{_escape(s.fix)}`" if s.fix else ""
            lines.append(
                f"• {label} — this happened on {_escape(s.host or '?')} on "
                f"{_escape(s.when or '?')}{fixed}"
            )
        else:
            lines.append(f"• {label} — {_escape(s.source)}: {_escape(s.conclusion[:200])}")
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
    return [*_sections(head), *_sections(_escape("\n".join(lines)) or "nothing changed")]


WHY_BASIS = {  # how a class was reached, as the `why` headline says it (model.Basis)
    "thin-evidence": ", a guess from pasted text",
    "similar-incidents": ", a proposal from similar incidents",
    "keywords": ", a guess from the words used",
    "model": ", named by the learned model",
}


def why_messages(d: Diagnosis) -> list[list[dict[str, Any]]]:
    """`/cudamedic why`: the diagnosis of a pasted error, its confidence, what to check next, the
    fix as advice and the similar known incidents, as one or more messages."""
    how = WHY_BASIS.get(d.basis, "") if not d.candidates else ", not decided"
    out = [f"*{_escape(d.incident)}* (confidence {d.confidence:.2f}{how}) — {_escape(d.summary)}"]
    if d.candidates:
        out.append("*Candidates*")
        out += [
            f"• {_escape(c.incident)} ({_escape(c.why)}"
            + (f", probability {c.probability:.2f})" if c.probability is not None else ")")
            for c in d.candidates
        ]
        out += ["*The check that tells them apart*", f"• {_escape(d.tells_apart)}"]
    if d.evidence:
        out.append("*Evidence*")
        out += [f"• {_escape(ln.text.strip()[:300])}" for ln in d.evidence[:6]]
    if d.next_checks and not d.candidates:  # with candidates: the check that tells them apart
        out.append("*Check next*")
        out += [f"• {_escape(c)}" for c in d.next_checks]
    if d.fix is not None:
        out.append("*Fix (advice: nothing was changed)*")
        if d.fix.docker_run:
            out.append(FENCE + _escape("\n".join(d.fix.docker_run)).replace(FENCE, "") + FENCE)
        out += [f"• {_escape(step)}" for step in d.fix.steps]
        if d.fix.note:
            out.append(_escape(d.fix.note))
    if d.similar:
        out += ["*Similar known incidents*", similar_text(d.similar)]
    return messages(_sections("\n".join(out)))


@dataclass(frozen=True)
class RunLine:
    """One response for `/cudamedic status`."""

    name: str
    state: str
    target: str
    container: str
    url: str | None


def status_blocks(runs: list[RunLine]) -> list[dict[str, Any]]:
    if not runs:
        return _sections("No responses are running or waiting.")
    lines = []
    for r in runs:
        where = _escape(f"{r.target}/{r.container}" if r.container else r.target)
        name = f"<{r.url}|{_escape(r.name)}>" if r.url else f"`{_escape(r.name)}`"
        lines.append(f"• {name} — {where}: *{_escape(r.state)}*")
    return _sections("*Responses running or waiting*\n" + "\n".join(lines))[:BLOCKS_MAX]
