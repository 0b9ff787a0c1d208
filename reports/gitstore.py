"""Post-mortems into a git repository of Markdown the team already searches (SHELL: git).

Optional (`reports_git`: a path or remote of a git repository, bare or not). Each post-mortem is
copied to ``postmortems/<report name>.md`` of a working clone (``STATE_DIR/reports-git``), the
index page ``README.md`` is regenerated from ``postmortems/index.json`` (one row per post-mortem:
date, host, container, class, outcome, summary), and both are committed with a message that says
what happened ("post-mortem: node07/train shm-too-small (fixed)") and pushed when the clone has a
remote. A push that fails (the remote down, a race with another worker) leaves the commit in the
clone; the next post-mortem rebases on the remote and pushes both. The report file itself is
written first, in `report_dir`, so a failing git never loses it. Every git call has a timeout and
never prompts.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from reports.render import PostMortem

log = logging.getLogger(__name__)
GIT_TIMEOUT_S = 60.0
DIR = "postmortems"
INDEX_JSON = f"{DIR}/index.json"
INDEX_MD = "README.md"
AUTHOR = ("cudamedic", "cudamedic@localhost")


class GitFailed(Exception):
    pass


def _git(clone: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_NAME": AUTHOR[0],
        "GIT_AUTHOR_EMAIL": AUTHOR[1],
        "GIT_COMMITTER_NAME": AUTHOR[0],
        "GIT_COMMITTER_EMAIL": AUTHOR[1],
    }
    try:
        proc = subprocess.run(
            ["git", "-C", str(clone), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GitFailed(f"git {args[0]}: {exc}") from None
    if check and proc.returncode != 0:
        raise GitFailed(f"git {args[0]}: {(proc.stderr or proc.stdout).strip()[-300:]}")
    return proc


def clone_of(source: str, state_dir: Path) -> Path:
    """The working clone of `source` (cloned on first use)."""
    clone = state_dir / "reports-git"
    if (clone / ".git").is_dir():
        return clone
    clone.parent.mkdir(parents=True, exist_ok=True)
    if clone.exists():
        shutil.rmtree(clone)
    try:
        proc = subprocess.run(
            ["git", "clone", "--quiet", "--", source, str(clone)],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GitFailed(f"git clone: {exc}") from None
    if proc.returncode != 0:
        raise GitFailed(f"git clone {source}: {proc.stderr.strip()[-300:]}")
    return clone


def index_page(rows: list[dict[str, Any]]) -> str:
    """The README of the repository: every post-mortem, newest first (PURE)."""

    def cell(value: object) -> str:
        return str(value or "").replace("|", "\\|").replace("\n", " ")[:160]

    out = [
        "# Post-mortems",
        "",
        "Written by cudamedic after each incident response (newest first). "
        "Search them here, or with `cudamedic history`.",
        "",
        "| Date | Host | Container | Class | Outcome | Summary |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: str(r.get("file")), reverse=True):
        link = f"[{cell(r.get('when'))}]({DIR}/{r.get('file')})"
        out.append(
            f"| {link} | {cell(r.get('host'))} | {cell(r.get('container'))} | "
            f"{cell(r.get('incident'))} | {cell(r.get('outcome'))} | {cell(r.get('summary'))} |"
        )
    return "\n".join(out) + "\n"


def publish(source: str, state_dir: Path, report: Path, pm: PostMortem) -> str:
    """Commit `report` (and the regenerated index) to the repository `source`, push when there
    is a remote; returns what happened. Raises GitFailed when it could not even commit."""
    clone = clone_of(source, state_dir)
    has_remote = bool(_git(clone, "remote").stdout.strip())
    if has_remote:  # take the others' post-mortems first (an empty remote has no branch yet)
        _git(clone, "pull", "--quiet", "--rebase", check=False)
    (clone / DIR).mkdir(exist_ok=True)
    shutil.copyfile(report, clone / DIR / report.name)
    try:
        rows = json.loads((clone / INDEX_JSON).read_text(encoding="utf-8"))
        rows = rows if isinstance(rows, list) else []
    except (OSError, ValueError, RecursionError):
        rows = []
    rows = [r for r in rows if isinstance(r, dict) and r.get("file") != report.name]
    rows.append(
        {
            "file": report.name,
            "when": pm.started_at.strftime("%Y-%m-%d %H:%M"),
            "host": pm.host,
            "container": pm.container,
            "incident": pm.incident,
            "outcome": pm.outcome,
            "summary": pm.summary[:300],
        }
    )
    (clone / INDEX_JSON).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    (clone / INDEX_MD).write_text(index_page(rows), encoding="utf-8")
    _git(clone, "add", "--", f"{DIR}/{report.name}", INDEX_JSON, INDEX_MD)
    who = f"{pm.host}/{pm.container}" if pm.container else pm.host
    message = f"post-mortem: {who} {pm.incident} ({pm.outcome})\n\n{pm.summary[:500]}\n"
    _git(clone, "commit", "--quiet", "-m", message)
    if not has_remote:
        return f"committed {report.name}"
    pushed = _git(clone, "push", "--quiet", "-u", "origin", "HEAD", check=False)
    if pushed.returncode != 0:
        _git(clone, "pull", "--quiet", "--rebase", check=False)
        pushed = _git(clone, "push", "--quiet", "-u", "origin", "HEAD", check=False)
    if pushed.returncode != 0:
        why = (pushed.stderr or pushed.stdout).strip()[-200:]
        log.warning("post-mortem %s committed, not pushed (next time): %s", report.name, why)
        return f"committed {report.name}; push failed: {why}"
    return f"committed and pushed {report.name}"
