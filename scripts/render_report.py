#!/usr/bin/env python3
"""Render a cudamedic report (Markdown) to HTML as GitHub and the Prefect UI show it — CommonMark
with GFM tables (markdown-it-py) and a GitHub-like stylesheet — and, when chromium is installed,
take a headless screenshot of it.

    .venv/bin/python scripts/render_report.py REPORT.md [--html OUT.html] [--png OUT.png]
        [--width 1100] [--height 1800]

Without --html the HTML goes beside the report (REPORT.html). --png needs `chromium`,
`chromium-headless-shell` or `google-chrome` on PATH (Debian: `apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import html
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from markdown_it import MarkdownIt

STYLE = """
body { font-family: -apple-system, BlinkMacSystemFont, "Segoe UI", "Noto Sans", Helvetica, Arial,
       sans-serif; font-size: 16px; line-height: 1.5; color: #1f2328; background: #fff;
       max-width: 980px; margin: 24px auto; padding: 0 32px; }
h1, h2 { border-bottom: 1px solid #d1d9e0; padding-bottom: .3em; margin-top: 24px; }
h1 { font-size: 2em; } h2 { font-size: 1.5em; }
code, pre { font-family: ui-monospace, SFMono-Regular, "SF Mono", Menlo, Consolas,
            "Liberation Mono", monospace; font-size: 85%; }
code { background: #eff1f3; border-radius: 6px; padding: .2em .4em; }
pre { background: #f6f8fa; border-radius: 6px; padding: 16px; overflow: auto; }
pre code { background: none; padding: 0; font-size: 100%; }
table { border-collapse: collapse; margin: 16px 0; display: block; overflow: auto; }
th, td { border: 1px solid #d1d9e0; padding: 6px 13px; }
tr:nth-child(2n) { background: #f6f8fa; }
ul { padding-left: 2em; }
a { color: #0969da; }
"""


def to_html(markdown: str) -> str:
    """The report's body as HTML (CommonMark + GFM tables and strikethrough; raw HTML off, as
    on GitHub for untrusted text it is escaped anyway)."""
    return (
        MarkdownIt("commonmark", {"html": False})
        .enable(["table", "strikethrough"])
        .render(markdown)
    )


def page(markdown: str, title: str) -> str:
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n"
        f"<body>\n{to_html(markdown)}</body></html>\n"
    )


def browser() -> str | None:
    for name in ("chromium", "chromium-headless-shell", "google-chrome", "chrome"):
        if found := shutil.which(name):
            return found
    return None


def screenshot(html_file: Path, png: Path, width: int, height: int) -> None:
    exe = browser()
    if exe is None:
        raise SystemExit("render_report: no chromium on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="render-report-") as profile:
        subprocess.run(
            [
                exe,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--screenshot={png}",
                f"--window-size={width},{height}",
                html_file.resolve().as_uri(),
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path)
    p.add_argument("--html", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--width", type=int, default=1100)
    p.add_argument("--height", type=int, default=1800)
    args = p.parse_args(argv)
    out = args.html or args.report.with_suffix(".html")
    out.write_text(
        page(args.report.read_text(encoding="utf-8"), args.report.stem), encoding="utf-8"
    )
    print(out)
    if args.png:
        screenshot(out, args.png, args.width, args.height)
        print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
