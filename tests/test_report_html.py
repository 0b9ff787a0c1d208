"""Issue 19: the post-mortem renders well where people read it (GitHub, the Prefect UI's
Markdown artifacts): each golden report through a real CommonMark renderer with GFM tables
(markdown-it-py), its HTML checked for structure — headings, tables with the right column
counts, evidence as code, no raw HTML from a target, no stray fences."""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from reports.render import render_markdown
from runbooks.core.model import Line
from tests.test_reports import PAYLOADS, sample

GOLDEN = Path(__file__).parent / "fixtures" / "reports"
SECTIONS = ["Summary", "Impact", "Root cause", "Trigger", "Detection", "Resolution"]
ALLOWED_TAGS = {
    *("h1", "h2", "p", "ul", "li", "table", "thead", "tbody", "tr", "th", "td", "code", "pre"),
    *("strong", "em", "a", "br", "s"),
}


def to_html(markdown: str) -> str:
    """As GitHub and the Prefect UI render it: CommonMark plus GFM tables and strikethrough."""
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)


class Structure(HTMLParser):
    """The parts of the HTML the checks look at."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.headings: list[tuple[str, str]] = []
        self.tables: list[list[int]] = []  # per table: the cell count of each row
        self.code: list[str] = []  # inline code spans' text
        self.hrefs: list[str] = []
        self._stack: list[str] = []
        self._text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self._stack.append(tag)
        if tag in ("h1", "h2", "code"):
            self._text = ""
        if tag == "table":
            self.tables.append([])
        if tag == "tr":
            self.tables[-1].append(0)
        if tag in ("td", "th"):
            self.tables[-1][-1] += 1
        if tag == "a":
            self.hrefs.append(dict(attrs).get("href") or "")

    def handle_endtag(self, tag: str) -> None:
        if self._stack and self._stack[-1] == tag:
            self._stack.pop()
        if tag in ("h1", "h2"):
            self.headings.append((tag, self._text.strip()))
        if tag == "code" and "pre" not in self._stack:
            self.code.append(self._text)

    def handle_data(self, data: str) -> None:
        self._text += data


def parsed(html: str) -> Structure:
    s = Structure()
    s.feed(html)
    s.close()
    return s


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("postmortem-*.md")), ids=lambda p: p.stem)
def test_golden_post_mortem_renders_as_intended(golden: Path) -> None:
    markdown = golden.read_text()
    html = to_html(markdown)
    s = parsed(html)
    assert [t for t, _ in s.headings].count("h1") == 1
    assert s.headings[0][1].startswith("Post-mortem: ")
    h2 = [text for tag, text in s.headings if tag == "h2"]
    assert h2[: len(SECTIONS)] == SECTIONS, h2
    assert {"Timeline (UTC)", "Action items", "Evidence appendix"} <= set(h2), h2
    assert [ln for ln in markdown.splitlines() if ln.startswith("## ")] == [f"## {t}" for t in h2]
    # Tables: the facts table has two columns, the checks table three, every row complete.
    assert s.tables, html
    assert all(len(set(rows)) == 1 for rows in s.tables), s.tables
    assert s.tables[0][0] == 2
    if "| Check | Result | Detail |" in markdown:
        assert [rows[0] for rows in s.tables] == [2, 3], s.tables
    # Evidence is code: each decisive line in a code span, no fence left as text.
    for text in ('"ShmSize": 67108864,', "dd: error writing '/dev/shm/batch-0'"):
        assert any(text in c for c in s.code), s.code
    assert "```" not in html and "~~~" not in html
    assert set(s.tags) <= ALLOWED_TAGS, set(s.tags) - ALLOWED_TAGS
    assert all(h.startswith("http://127.0.0.1:4200/") for h in s.hrefs), s.hrefs


def test_hostile_evidence_renders_as_text() -> None:
    """What a target sent (log lines, messages) is text in the HTML: no tag, image, link or
    heading comes from it."""
    evil = " ".join(PAYLOADS)
    pm = sample(
        summary=f"shm is small. {evil}",
        outcome_detail=evil,
        evidence=tuple(
            Line(source="containers/x.log", line=n, text=p) for n, p in enumerate(PAYLOADS, 1)
        ),
        action_items=(evil,),
        trigger=evil,
        links={},
    )
    html = to_html(render_markdown(pm))
    s = parsed(html)
    assert set(s.tags) <= ALLOWED_TAGS, set(s.tags) - ALLOWED_TAGS
    assert s.hrefs == [], s.hrefs
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    h2 = [text for tag, text in s.headings if tag == "h2"]
    assert h2.count("Resolution") == 1, h2
    assert all(len(set(rows)) == 1 for rows in s.tables), s.tables
