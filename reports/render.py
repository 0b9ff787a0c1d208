"""Post-mortem reports: a pydantic model of one incident, rendered to Markdown with Jinja2 (PURE).

The template (reports/templates/postmortem.md.j2) follows a blameless post-mortem: summary,
impact, root cause, trigger, detection, resolution, timeline, action items, evidence appendix.
StrictUndefined: a missing field is an error, never an empty placeholder. Input text is data —
Jinja2 never evaluates it — and evidence goes inside code fences longer than any backtick run it
holds, so a pasted log cannot break the report's structure.
"""

from __future__ import annotations

import re
from datetime import datetime
from functools import cache

import jinja2

from runbooks.model import Frozen, Line, SimilarIncident


class TimelineEvent(Frozen):
    at: datetime
    event: str
    detail: str = ""


class CheckResult(Frozen):
    name: str
    ok: bool
    detail: str = ""


class PostMortem(Frozen):
    host: str
    container: str | None = None
    incident: str
    confidence: float
    summary: str
    trigger: str | None = None
    detected_by: str = "cudamedic fix"
    started_at: datetime
    ended_at: datetime
    outcome: str  # fixed | rolled-back | rollback-failed | not-fixed | ...
    outcome_detail: str = ""
    approval: str | None = None  # who approved (or rejected) the fix, and why
    evidence: tuple[Line, ...] = ()
    secondary: tuple[str, ...] = ()
    docker_run_diff: tuple[str, ...] = ()
    checks: tuple[CheckResult, ...] = ()
    timeline: tuple[TimelineEvent, ...] = ()
    action_items: tuple[str, ...] = ()
    links: dict[str, str] = {}
    bundle: str | None = None
    similar: tuple[SimilarIncident, ...] = ()  # known incidents that resemble this one
    basis: str = "evidence"  # how the class was reached (model.Basis)
    failure_cause: str | None = None  # the class a failed fix's own error points at

    @property
    def changed(self) -> bool:
        """Did the response leave a changed container (a verified or recovered fix)?"""
        return self.outcome in ("fixed", "recovered")

    @property
    def duration_s(self) -> float:
        return (self.ended_at - self.started_at).total_seconds()


def fence(text: str) -> str:
    """A code fence longer than any run of backticks inside `text`."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def one_line(text: str) -> str:
    return " ".join(text.split())


# What can make Markdown/HTML out of text: emphasis, code, links and images ([ ] !), raw HTML
# (< >), headings (#), table cells (|), strikethrough (~) and the escape itself.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>#!|~])")
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0, 9), *range(11, 32), 127)}


def inert(text: str) -> str:
    """Text from a target (logs, names, messages) made inert in Markdown: one line, control
    characters shown escaped, every Markdown/HTML special character backslash-escaped, so no
    image, link, raw HTML, heading or table cell can be formed by it."""
    flat = one_line(text.replace("\r", " "))
    return _MD_SPECIAL.sub(r"\\\1", flat.translate(_CONTROL))


def shown(text: str) -> str:
    """Text for a code fence: lines kept, other control characters (ESC, CR, BEL) escaped."""
    return text.replace("\r\n", "\n").translate(_CONTROL)


def code(text: str) -> str:
    """Text as an inline code span (inert in Markdown): one line, control characters escaped,
    delimited by more backticks than any run inside."""
    flat = one_line(text.replace("\r", " ")).translate(_CONTROL)
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", flat)), default=0) + 1)
    pad = " " if flat.startswith("`") or flat.endswith("`") or not flat.strip() else ""
    return f"{ticks}{pad}{flat}{pad}{ticks}"


@cache
def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("reports", "templates"),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # noqa: S701 - Markdown, not HTML; HTML/Slack renderers escape
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["fence"] = fence
    env.filters["one_line"] = one_line
    env.filters["inert"] = inert
    env.filters["code"] = code
    env.filters["shown"] = shown
    return env


def render_markdown(pm: PostMortem) -> str:
    return _env().get_template("postmortem.md.j2").render(pm=pm)


def report_name(pm: PostMortem) -> str:
    stamp = pm.started_at.strftime("%Y%m%dT%H%M%SZ")
    who = f"{pm.host}-{pm.container}" if pm.container else pm.host
    return f"{stamp}-{who}-{pm.incident}.md"


# -- the fleet sweep summary ----------------------------------------------------------------------
class SweepHostRow(Frozen):
    host: str
    verdict: str  # healthy | warning | drain
    codes: tuple[str, ...] = ()
    incident: str | None = None
    incident_summary: str | None = None
    bundle: str | None = None
    error: str | None = None
    duration_s: float = 0.0


class SweepChange(Frozen):
    host: str
    change: str  # new | changed | resolved
    code: str
    subject: str = ""
    level: str | None = None
    message: str


class SweepSummary(Frozen):
    started_at: datetime
    ended_at: datetime
    hosts: tuple[SweepHostRow, ...]
    changes: tuple[SweepChange, ...] = ()
    links: dict[str, str] = {}

    @property
    def duration_s(self) -> float:
        return (self.ended_at - self.started_at).total_seconds()

    def count(self, verdict: str) -> int:
        return sum(1 for h in self.hosts if h.verdict == verdict)


def cell(text: str) -> str:
    """Text safe inside one Markdown table cell."""
    return one_line(text).replace("|", "\\|")


def render_sweep(summary: SweepSummary) -> str:
    env = _env()
    env.filters["cell"] = cell
    return env.get_template("sweep.md.j2").render(s=summary)


def sweep_report_name(summary: SweepSummary) -> str:
    return f"{summary.started_at.strftime('%Y%m%dT%H%M%SZ')}-fleet-sweep.md"
