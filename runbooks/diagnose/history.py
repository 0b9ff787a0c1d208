"""The team's own incident history: every post-mortem, and which causes were confirmed.

The history is the fleet's (issue 29): each record is a version of the Prefect artifact
``cudamedic-<fleet>-history`` (the server's database, SQLite or the fleet's PostgreSQL), so a
second worker with its own state directory cites the first one's confirmed post-mortems.
``STATE_DIR/history.jsonl`` is this worker's cache: every record is also appended there, read
alone while Prefect cannot be asked, and a record Prefect did not take waits in
``STATE_DIR/history-pending.jsonl`` until the next write or read moves it in. Each record has a
``uid``, so the cache and Prefect merge without duplicates. Raw REST calls with short timeouts
(runbooks/core/prefect_api.py); no PREFECT_API_URL (offline `classify`): the local file only.

``STATE_DIR/history.jsonl`` is append-only. A post-mortem adds a ``report`` record (its class,
host, container, date, the fix, the salient evidence, the report's path); a verified fix confirms
it at once; ``cudamedic confirm REPORT [--incident CLASS]`` adds a ``confirm`` record for a
person's confirmation (or correction) of the cause. Confirmed reports become searchable
incidents (runbooks/diagnose/similar.py), cited beside the public threads: "this happened on node07
on
2026-11-02, fixed by --shm-size 8g (report)".

Records hold only redacted text (the post-mortem's evidence is redacted at collection). A
malformed line is skipped, never fatal.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runbooks.core.errors import InputError
from runbooks.diagnose.similar import KnownIncident, SimilarIndex, public_incidents, public_index

HISTORY = "history.jsonl"
PENDING = "history-pending.jsonl"
PAGE = 200
QUIET_S = 30.0  # after Prefect timed out, the local cache alone for this long
_quiet_until = 0.0
MAX_RECORDS = 100_000
MAX_TEXT = 8000


def _path(state_dir: Path) -> Path:
    return state_dir / HISTORY


def fleet_of(fleet: str | None = None) -> str:
    """The fleet whose history this is: given, else CUDAMEDIC_FLEET, else "default"."""
    return fleet or os.environ.get("CUDAMEDIC_FLEET") or "default"


def history_key(fleet: str | None = None) -> str:
    return f"cudamedic-{fleet_of(fleet)}-history"


def _write_line(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def _append(state_dir: Path, record: dict[str, Any], fleet: str | None = None) -> None:
    """Keep a record: in the local cache, and in Prefect (else pending, moved in later)."""
    record = {"uid": uuid.uuid4().hex, **record}
    _write_line(_path(state_dir), record)
    _flush_pending(state_dir, fleet)
    if not _remote_add(record, fleet):
        _write_line(state_dir / PENDING, record)


def _call(method: str, path: str, body: Any = None, timeout: float = 5.0) -> Any:
    """A raw Prefect call; OSError/ValueError/LookupError when Prefect cannot answer (a timeout
    keeps it from being asked again for QUIET_S)."""
    global _quiet_until
    from runbooks.core.prefect_api import call

    if time.monotonic() < _quiet_until:
        raise LookupError("Prefect did not answer a moment ago")
    try:
        return call(method, path, body, timeout=timeout)
    except TimeoutError:
        _quiet_until = time.monotonic() + QUIET_S
        raise


def _remote_add(record: dict[str, Any], fleet: str | None) -> bool:
    kind = "post-mortem" if record.get("type") == "report" else "confirmation"
    body = {
        "key": history_key(fleet),
        "type": "cudamedic-history",
        "description": f"Incident history: {kind} {str(record.get('id'))[:120]}",
        "data": record,
    }
    try:
        _call("POST", "/artifacts/", body)
    except (OSError, ValueError, LookupError):
        return False
    return True


def _remote_records(fleet: str | None) -> list[dict[str, Any]] | None:
    """Every record kept in Prefect, oldest first; None when Prefect cannot be asked."""
    out: list[dict[str, Any]] = []  # newest first, until reversed
    for page in range(MAX_RECORDS // PAGE):
        body = {
            "artifacts": {"key": {"any_": [history_key(fleet)]}},
            "sort": "CREATED_DESC",  # (no ascending sort): reversed below
            "limit": PAGE,
            "offset": page * PAGE,
        }
        try:
            found = _call("POST", "/artifacts/filter", body)
        except (OSError, ValueError, LookupError):
            return None
        arts = found if isinstance(found, list) else []
        for art in arts:
            data = art.get("data") if isinstance(art, dict) else None
            if isinstance(data, str):  # the server may hand JSON back as text
                try:
                    data = json.loads(data)
                except (ValueError, RecursionError):
                    continue
            if isinstance(data, dict):
                out.append(data)
        if len(arts) < PAGE:
            break
    return out[::-1]


def _flush_pending(state_dir: Path, fleet: str | None) -> None:
    """Move records Prefect did not take before into it (those it still refuses stay)."""
    pending = state_dir / PENDING
    if not pending.exists():
        return
    left = [r for r in _read_lines(pending) if not _remote_add(r, fleet)]
    tmp = pending.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in left), encoding="utf-8")
    os.replace(tmp, pending)
    if not left:
        pending.unlink(missing_ok=True)


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
    fleet: str | None = None,
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
        fleet,
    )


def confirm(
    state_dir: Path, report: str, by: str, incident: str | None = None, fleet: str | None = None
) -> str:
    """A person confirms (or corrects, with `incident`) the cause of a report in the history.
    Returns the class now recorded. Raises InputError for a report the history does not hold."""
    records = _records(state_dir, fleet)
    key = Path(report).stem
    known = [r for r in records if r.get("type") == "report" and r.get("id") == key]
    if not known:
        raise InputError(f"no post-mortem named {key!r} in {_path(state_dir)}")
    if incident is not None:
        from runbooks.core.taxonomy import Incident

        try:
            Incident(incident)
        except ValueError:
            raise InputError(f"{incident!r} is not an incident class") from None
    _append(
        state_dir,
        {"type": "confirm", "id": key, "by": by, "incident": incident, "at": _now()},
        fleet,
    )
    return incident or str(known[-1].get("incident"))


def reports(state_dir: Path, fleet: str | None = None) -> list[dict[str, Any]]:
    """Every post-mortem of the fleet's history with its confirmation folded in (`confirmed_by`,
    a corrected `incident`), in the order kept."""
    out: dict[str, dict[str, Any]] = {}
    for r in _records(state_dir, fleet):
        key = str(r.get("id") or "")
        if not key:
            continue
        if r.get("type") == "report":
            out[key] = dict(r)
        elif r.get("type") == "confirm" and key in out:
            out[key]["confirmed_by"] = r.get("by") or "a person"
            if r.get("incident"):
                out[key]["incident"] = r["incident"]
    return list(out.values())


def confirmed(state_dir: Path, fleet: str | None = None) -> tuple[KnownIncident, ...]:
    """The confirmed incidents of this team, newest record per report winning."""
    reports: dict[str, dict[str, Any]] = {}
    for r in _records(state_dir, fleet):
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


def _records(state_dir: Path, fleet: str | None = None) -> list[dict[str, Any]]:
    """The fleet's records (Prefect) merged with this worker's cache (records Prefect has not
    got yet, and those of a cudamedic before the history moved there); the cache alone while
    Prefect cannot be asked."""
    local = _read_lines(_path(state_dir))
    _flush_pending(state_dir, fleet)
    remote = _remote_records(fleet)
    if remote is None:
        return local
    have = {r.get("uid") for r in remote if r.get("uid")}
    return remote + [r for r in local if not r.get("uid") or r.get("uid") not in have]


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
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


def team_incidents(state_dir: Path | None) -> tuple[KnownIncident, ...]:
    """Confirmed incidents of this team (the history file); unreadable lines are skipped."""
    if state_dir is None:
        return ()
    return confirmed(state_dir)


def index_for(state_dir: Path | None) -> SimilarIndex:
    """The public corpus plus this team's confirmed incidents."""
    team = team_incidents(state_dir)
    if not team:
        return public_index()
    return SimilarIndex((*public_incidents(), *team))
