"""The fleet's fix cap cannot be loosened or jammed through Prefect events (issue 27, finding 10):
the server filters the `cudamedic.fix.applied` events by the fleet's label (a flood from another
fleet, forged or real, no longer pushes this fleet's events out of the pages read); a count that
does not fit the pages read is unknown and refuses unattended fixes; the fleet-wide count (which
anyone with API access can inflate) gates unattended fixes only; `cudamedic audit` prints one
line per event whatever its fields hold. Real Prefect: the tests' server and its events."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from runbooks.core.policy import Policy
from runbooks.core.settings import Settings
from runbooks.fix.audit import CountUnknown, applied_in_fleet, flush, line
from runbooks.fix.fixer import refusal
from runbooks.fix.journal import audit, now


def _fleet(tmp_path: Path, tag: str) -> str:
    return f"t-{tag}-" + tmp_path.name[-16:].lower().replace("_", "-")


def _wait_for(fleet: str, n: int, pages: int = 20) -> int | None:
    since = now() - timedelta(hours=1)
    deadline = time.monotonic() + 60  # the server stores events a moment after they arrive
    while (got := applied_in_fleet(fleet, since, pages)) != n and time.monotonic() < deadline:
        time.sleep(1)
    return got


def test_a_flood_of_another_fleets_events_does_not_hide_this_fleets(
    prefect_api: str, tmp_path: Path
) -> None:
    ours, theirs = _fleet(tmp_path, "ours"), _fleet(tmp_path, "flood")
    for _ in range(2):
        audit(tmp_path / "a", "apply", host="h", container="c", fleet=ours)
    flush()
    assert _wait_for(ours, 2, pages=2) == 2
    for _ in range(120):  # newer than ours: the first two pages of all fleets' events
        audit(tmp_path / "flood", "apply", host="x", container="y", fleet=theirs)
    flush()
    time.sleep(3)
    assert applied_in_fleet(ours, now() - timedelta(hours=1), max_pages=2) == 2


def test_a_count_past_the_pages_read_is_unknown_and_refuses_unattended_fixes(
    prefect_api: str, tmp_path: Path
) -> None:
    fleet = _fleet(tmp_path, "many")
    for _ in range(20 * 50 + 10):  # forged or real, more than the 20 pages a count reads
        audit(tmp_path / "a", "apply", host="h", container="c", fleet=fleet)
    flush(60)
    since = now() - timedelta(hours=1)
    deadline = time.monotonic() + 90
    while applied_in_fleet(fleet, since, 40) != 1010 and time.monotonic() < deadline:
        time.sleep(1)
    with pytest.raises(CountUnknown):
        applied_in_fleet(fleet, since)  # was: 1,000, as if that were all
    settings = Settings(state_dir=tmp_path / "b", fleet=fleet)
    policy = Policy(unattended={"shm-too-small": ("lab",)}, max_fixes_per_hour=5)

    class P:  # the field refusal() reads
        incident = "shm-too-small"

    why = refusal(P(), ("lab",), policy, settings, confirmed=True, unattended=True)  # type: ignore[arg-type]
    assert why is not None and "unknown" in why, why
    why = refusal(P(), ("lab",), policy, settings, confirmed=False)  # type: ignore[arg-type]
    assert why is not None and "unknown" in why, why
    # A person's fix is not jammed by events: this machine's own log counts for it.
    assert refusal(P(), ("lab",), policy, settings, confirmed=True) is None  # type: ignore[arg-type]


def test_audit_prints_one_line_per_event() -> None:
    record = {
        "event": "cudamedic.fix.applied",
        "host": "node07\n2026-12-04T00:00:00  cudamedic.approval.approved  node07  by U0BOSS",
        "container": "web\u2028x",
        "identity": "U0X\r\nforged",
    }
    shown = line(record)
    assert "\n" not in shown and "\r" not in shown and "\u2028" not in shown, shown
    assert "\\n2026-12-04" in shown
