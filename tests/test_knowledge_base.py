"""The team's knowledge base, shared by the fleet (issue 29, part 4).

- The incident history lives where the fleet's state is (a real Prefect server): worker B, with
  its own state directory, cites worker A's confirmed post-mortem; `cudamedic confirm` (A) writes
  there and `cudamedic history` (B) lists it. While Prefect is away a record waits in A's cache
  and moves in when Prefect is back.
- `reports_git`: each post-mortem committed to a real git repository (a local bare one as the
  remote) with an index page; a push that fails keeps the report and the commit, and the next
  post-mortem pushes both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from runbooks.core.settings import Settings
from runbooks.diagnose import history
from runbooks.diagnose.classify import classify_path
from runbooks.diagnose.similar import public_incidents
from tests.test_reports import sample

CORPUS = Path(__file__).parent / "corpus"
SHM_CASE = "shm-too-small--dataloader-unable-to-write-buried-in-training-log"
CLI = [sys.executable, "-m", "runbooks.cli"]


@pytest.fixture
def fleet_env(prefect_api: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    fleet = f"kb-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    monkeypatch.setenv("CUDAMEDIC_FLEET", fleet)
    return {**os.environ, "PREFECT_API_URL": prefect_api, "CUDAMEDIC_FLEET": fleet}


def _record(state: Path, name: str = "20261102T101500Z-node07-train-shm-too-small.md") -> Path:
    text = next(c.text for c in public_incidents() if c.id == SHM_CASE)
    report = state.parent / "reports" / name
    history.record_report(
        state,
        report=report,
        incident="shm-too-small",
        host="node07",
        container="train",
        conclusion="/dev/shm was 64 MiB",
        text=text,
        fix="--shm-size 8g",
        confirmed_by=None,
        when=datetime(2026, 11, 2, 10, 15, tzinfo=UTC),
    )
    return report


def _cli(env: dict[str, str], state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        env={**env, "CUDAMEDIC_STATE_DIR": str(state), "HOME": str(state.parent)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _team(state: Path) -> list[object]:
    d = classify_path(CORPUS / SHM_CASE, state_dir=state, exclude={SHM_CASE})
    return [s for s in d.similar if s.kind == "team"]


def test_a_second_worker_cites_the_first_ones_confirmed_post_mortem(
    fleet_env: dict[str, str], tmp_path: Path
) -> None:
    a, b = tmp_path / "a" / "state", tmp_path / "b" / "state"
    report = _record(a)
    assert not _team(b)  # kept, not yet confirmed
    confirmed = _cli(fleet_env, a, "confirm", str(report), "--by", "alice")
    assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
    team = _team(b)
    assert team and team[0].host == "node07" and team[0].when == "2026-11-02", team  # type: ignore[attr-defined]
    assert not (b / "history.jsonl").exists()  # B read it from Prefect, not from a disk of A's
    listed = _cli(fleet_env, b, "history", "--host", "node07", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = [json.loads(ln) for ln in listed.stdout.splitlines()]
    assert (row["incident"], row["confirmed_by"], row["fix"]) == (
        "shm-too-small",
        "alice",
        "--shm-size 8g",
    )
    assert _cli(fleet_env, b, "history", "--class", "cuda-oom").stdout.strip() == (
        "no post-mortem matches"
    )
    assert "node07/train" in _cli(fleet_env, b, "history", "--since", "2026-11-01").stdout
    assert "no post-mortem" in _cli(fleet_env, b, "history", "--since", "2026-12-01").stdout
    bad = _cli(fleet_env, b, "history", "--since", "last tuesday")
    assert bad.returncode != 0 and "--since" in bad.stderr


def test_a_record_kept_while_prefect_is_away_moves_in_later(
    fleet_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a" / "state", tmp_path / "b" / "state"
    with socket_closed_port() as dead:
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{dead}/api")
        report = _record(a)
        history.confirm(a, report.name, "bob")  # the cache alone answers
        assert len(history.confirmed(a)) == 1
    assert (a / "history-pending.jsonl").read_text().count("\n") == 2
    monkeypatch.setenv("PREFECT_API_URL", fleet_env["PREFECT_API_URL"])
    assert not _team(b)  # nothing in Prefect yet
    assert len(history.confirmed(a)) == 1  # A reads: its waiting records move in
    assert not (a / "history-pending.jsonl").exists()
    assert _team(b)
    assert len(history.reports(b)) == 1  # no duplicate of the record moved in


class socket_closed_port:
    """A loopback port nothing listens on (a refused connection, as a stopped Prefect gives)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


# -- reports_git ---------------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def test_post_mortems_go_to_a_git_repository_with_an_index(tmp_path: Path) -> None:
    from runbooks.fix.fixer import save_postmortem

    remote = tmp_path / "kb.git"
    _git("init", "--quiet", "--bare", str(remote))
    settings = Settings(
        state_dir=tmp_path / "state",
        out_dir=tmp_path / "out",
        reports_git=str(remote),
        fleet=f"kb-{uuid.uuid4().hex[:8]}",  # its history is its own, on the session's Prefect
    )
    first = save_postmortem(sample(), settings)
    log = _git("--git-dir", str(remote), "log", "--format=%s", "--all")
    assert log.strip().splitlines() == ["post-mortem: node07/train shm-too-small (fixed)"], log
    tree = _git("--git-dir", str(remote), "ls-tree", "-r", "--name-only", "HEAD")
    assert f"postmortems/{first.name}" in tree and "README.md" in tree
    readme = _git("--git-dir", str(remote), "show", "HEAD:README.md")
    assert (
        f"(postmortems/{first.name})" in readme and "| node07 | train | shm-too-small |" in readme
    )
    shown = _git("--git-dir", str(remote), "show", f"HEAD:postmortems/{first.name}")
    assert shown == first.read_text()

    # The remote goes away: the report is written and committed, the push waits.
    moved = tmp_path / "kb-away.git"
    remote.rename(moved)
    later = sample(started_at=datetime(2026, 11, 3, 9, 0, tzinfo=UTC), host="node08")
    second = save_postmortem(later, settings)
    assert second.exists()
    clone = settings.state_path / "reports-git"
    assert "node08" in _git("-C", str(clone), "log", "-1", "--format=%s")
    # Back: the next post-mortem pushes both, and the index lists all three.
    moved.rename(remote)
    third = save_postmortem(
        sample(started_at=datetime(2026, 11, 4, 9, 0, tzinfo=UTC), host="node09"), settings
    )
    subjects = _git("--git-dir", str(remote), "log", "--format=%s", "--all").splitlines()
    assert len(subjects) == 3 and {s.split()[1].split("/")[0] for s in subjects} == {
        "node07",
        "node08",
        "node09",
    }
    readme = _git("--git-dir", str(remote), "show", "HEAD:README.md")
    assert all(f"(postmortems/{p.name})" in readme for p in (first, second, third))
    # Newest first (the first sample is of 2 December, the others of 3 and 4 November).
    assert readme.index(first.name) < readme.index(third.name) < readme.index(second.name)


def test_a_repository_that_cannot_be_cloned_never_loses_the_report(tmp_path: Path) -> None:
    from runbooks.fix.fixer import save_postmortem

    settings = Settings(
        state_dir=tmp_path / "state",
        out_dir=tmp_path / "out",
        reports_git=str(tmp_path / "no-such-repository.git"),
        fleet=f"kb-{uuid.uuid4().hex[:8]}",
    )
    path = save_postmortem(sample(), settings)
    assert path.exists() and "shm-too-small" in path.read_text()
