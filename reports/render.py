"""Post-mortem reports: a pydantic model of one incident, rendered to Markdown with Jinja2 (PURE).

The template (reports/templates/postmortem.md.j2) follows a blameless post-mortem: summary,
impact, root cause, trigger, detection, resolution, timeline, action items, evidence appendix.
StrictUndefined: a missing field is an error, never an empty placeholder. Input text is data —
Jinja2 never evaluates it — and evidence goes inside code fences longer than any backtick run it
holds, so a pasted log cannot break the report's structure.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import cache

import jinja2

from runbooks.core.model import Candidate, Frozen, Line, SimilarIncident


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
    candidates: tuple[Candidate, ...] = ()  # an `unknown` between two causes
    tells_apart: str = ""  # the one check that tells the candidates apart
    failure_cause: str | None = None  # the class a failed fix's own error points at
    triggered_by: str | None = None  # the person (user@host) who started the response, if any
    down_since: datetime | None = None  # the container's FinishedAt: when the workload stopped
    running_at_collection: bool | None = None  # None: unknown (no container, no inspect)
    restored_at: datetime | None = None  # the replacement verified running (a fixed outcome)
    # The fix itself stopped a running container: when, and when it ran again (the replacement
    # verified, or the original restarted by the rollback; None: not running again)
    fix_stopped_at: datetime | None = None
    fix_back_at: datetime | None = None

    @property
    def changed(self) -> bool:
        """Did the response leave a changed container (a verified or recovered fix)?"""
        return self.outcome in ("fixed", "recovered")

    @property
    def duration_s(self) -> float:
        return (self.ended_at - self.started_at).total_seconds()

    @property
    def fix_downtime_s(self) -> float | None:
        """How long the fix itself kept a running workload down (None: it stopped none)."""
        if self.fix_stopped_at is None:
            return None
        until = self.fix_back_at or self.ended_at
        return max(0.0, (until - self.fix_stopped_at).total_seconds())

    @property
    def downtime_s(self) -> float | None:
        """How long the workload was down: its container's stop to the verified restart (or,
        still down, to the end of the response). None when not known."""
        if self.down_since is None:
            return None
        until = self.restored_at if self.changed and self.restored_at else self.ended_at
        return max(0.0, (until - self.down_since).total_seconds())


# -- for people: times, durations, detection ------------------------------------------------------
def clock(at: datetime) -> str:
    """`15:06:51 UTC`."""
    return f"{at.astimezone(UTC):%H:%M:%S} UTC"


def day(at: datetime) -> str:
    """`2 Dec 2026`."""
    at = at.astimezone(UTC)
    return f"{at.day} {at:%b %Y}"


def stamp(at: datetime) -> str:
    """`2 Dec 2026, 15:06:51 UTC`."""
    return f"{day(at)}, {clock(at)}"


def duration(seconds: float) -> str:
    """`9.5 s`, `2 min 14 s`, `3 h 5 min`, `2 d 4 h`."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min" + (f" {s % 60} s" if s % 60 else "")
    if s < 86400:
        return f"{s // 3600} h" + (f" {s % 3600 // 60} min" if s % 3600 // 60 else "")
    return f"{s // 86400} d" + (f" {s % 86400 // 3600} h" if s % 86400 // 3600 else "")


def detection(pm: PostMortem) -> str:
    """Who or what noticed it, in words (Markdown): an alert, a sweep, Slack, a person at the
    CLI."""
    how = pm.detected_by.strip()
    if how.startswith("alert "):
        what = f"The Alertmanager alert {code(how.removeprefix('alert ').strip())} fired"
    elif how == "cudamedic fleet sweep":
        what = "A fleet health sweep found it"
    elif how.startswith("Slack"):
        what = f"Someone asked in Slack ({inert(how.removeprefix('Slack').strip())})"
    elif how == "prefect deployment run":
        # created through the Prefect API (`prefect deployment run`, the UI): whoever holds its
        # credentials, not the worker's user that ran it
        what = "A run of the incident-response deployment was started through the Prefect API"
    elif pm.triggered_by:
        what = f"{inert(pm.triggered_by)} ran {code(how)}"
    else:
        what = f"{code(how)} ran"
    return f"{what} at {clock(pm.started_at)} on {day(pm.started_at)}"


# `matched bus-error, dataloader-bus-error`: the signature ids a rule names in its reason. They
# are the classifier's own ids, not words for a report.
_SIGNATURE_IDS = re.compile(
    r"(?:[;,]\s*)?\bmatched [a-z0-9]+(?:-[a-z0-9]+)+(?:, [a-z0-9]+(?:-[a-z0-9]+)*)*"
)


def for_people(text: str) -> str:
    """A diagnosis summary without the classifier's internal signature ids."""
    out = _SIGNATURE_IDS.sub("", text)
    return re.sub(r"(?<!\s)\s++([.;,])", r"\1", re.sub(r"Why:\s*\.", "", out)).strip()


def prose(text: str) -> str:
    """Our own sentences that mark commands with backticks (action items): the `...` parts as
    code spans, the rest inert."""
    parts = re.split(r"`([^`\n]+)`", one_line(text.replace("\r", " ")))
    return "".join(
        code(p) if i % 2 else _MD_SPECIAL.sub(r"\\\1", p.translate(_CONTROL))
        for i, p in enumerate(parts)
    )


_SAFE_URL = re.compile(r"https?://[A-Za-z0-9._~:/?#@!$&'*+,;=%-]+")


def link(name: str, url: str) -> str:
    """A Markdown link when the URL is a plain http(s) one; otherwise inert text."""
    if _SAFE_URL.fullmatch(url) and "(" not in url and ")" not in url:
        return f"[{inert(name)}]({url})"
    return f"{inert(name)}: {inert(url)}"


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
    env.filters["clock"] = clock
    env.filters["day"] = day
    env.filters["stamp"] = stamp
    env.filters["duration"] = duration
    env.filters["for_people"] = for_people
    env.filters["prose"] = prose
    env.globals["detection"] = detection
    env.globals["link"] = link
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
