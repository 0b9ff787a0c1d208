"""The team's own incident history: every post-mortem, and which causes were confirmed.

``STATE_DIR/history.jsonl`` is append-only. A post-mortem adds a ``report`` record (its class,
host, container, date, the fix, the salient evidence, the report's path); a verified fix confirms
it at once; ``cudamedic confirm REPORT [--incident CLASS]`` adds a ``confirm`` record for a
person's confirmation (or correction) of the cause. Confirmed reports become searchable
incidents (runbooks/similar.py), cited beside the public threads: "this happened on node07 on
2026-11-02, fixed by --shm-size 8g (report)".

Records hold only redacted text (the post-mortem's evidence is redacted at collection). A
malformed line is skipped, never fatal.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runbooks.errors import InputError
from runbooks.similar import KnownIncident

HISTORY = "history.jsonl"
MAX_RECORDS = 100_000
MAX_TEXT = 8000


def _path(state_dir: Path) -> Path:
    return state_dir / HISTORY


def _append(state_dir: Path, record: dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True) + "\n"
    fd = os.open(_path(state_dir), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def record_report(
    state_dir: Path,
    *,
    report: Path,
    incident: str,
    host: str,
    container: str | None,
    conclusion: str,
    text: str,
    fix: str | None,
    confirmed_by: str | None,
    when: datetime | None = None,
) -> None:
    """Add a post-mortem to the history; `confirmed_by` is set when a verified fix confirmed
    the cause (e.g. "verified fix")."""
    stamp = (when or datetime.now(UTC)).astimezone(UTC)
    _append(
        state_dir,
        {
            "type": "report",
            "id": report.stem,
            "report": str(report),
            "incident": incident,
            "host": host,
            "container": container,
            "when": stamp.date().isoformat(),
            "conclusion": conclusion[:1000],
            "text": text[:MAX_TEXT],
            "fix": fix,
            "confirmed_by": confirmed_by,
        },
    )


def confirm(state_dir: Path, report: str, by: str, incident: str | None = None) -> str:
    """A person confirms (or corrects, with `incident`) the cause of a report in the history.
    Returns the class now recorded. Raises InputError for a report the history does not hold."""
    records = _records(state_dir)
    key = Path(report).stem
    known = [r for r in records if r.get("type") == "report" and r.get("id") == key]
    if not known:
        raise InputError(f"no post-mortem named {key!r} in {_path(state_dir)}")
    if incident is not None:
        from runbooks.taxonomy import Incident

        try:
            Incident(incident)
        except ValueError:
            raise InputError(f"{incident!r} is not an incident class") from None
    _append(
        state_dir,
        {"type": "confirm", "id": key, "by": by, "incident": incident, "at": _now()},
    )
    return incident or str(known[-1].get("incident"))


def confirmed(state_dir: Path) -> tuple[KnownIncident, ...]:
    """The confirmed incidents of this team, newest record per report winning."""
    reports: dict[str, dict[str, Any]] = {}
    for r in _records(state_dir):
        key = str(r.get("id") or "")
        if not key:
            continue
        if r.get("type") == "report":
            reports[key] = dict(r)
        elif r.get("type") == "confirm" and key in reports:
            reports[key]["confirmed_by"] = r.get("by") or "a person"
            if r.get("incident"):
                reports[key]["incident"] = r["incident"]
    out: list[KnownIncident] = []
    for key, r in reports.items():
        if not r.get("confirmed_by"):
            continue
        try:
            out.append(
                KnownIncident(
                    id=f"team:{key}",
                    incident=str(r["incident"]),
                    kind="team",
                    source=str(r.get("report") or key),
                    conclusion=str(r.get("conclusion") or ""),
                    text=str(r.get("text") or ""),
                    when=str(r.get("when") or "") or None,
                    host=str(r.get("host") or "") or None,
                    container=str(r.get("container") or "") or None,
                    fix=str(r.get("fix") or "") or None,
                )
            )
        except (KeyError, ValidationError):
            continue
    return tuple(out)


def _records(state_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        with _path(state_dir).open(encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh):
                if n >= MAX_RECORDS:
                    break
                try:
                    data = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(data, dict):
                    out.append(data)
    except OSError:
        return []
    return out


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
