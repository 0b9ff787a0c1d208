"""`make demo` under test: scripts/check_demo.py (which the demo runs on its own outputs, and CI
runs the demo: .ci/run) accepts the story the README promises and refuses any other; the lab
tells the demo where its engines are, whatever CUDAMEDIC_LAB_DIR is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.check_demo import EXPECTED_FIRST_SWEEP, check, sweep_changes
from tests.lab.lab import LabState

ROOT = Path(__file__).resolve().parents[1]
# The step outputs of a real `make demo` on the lab (tests/fixtures/demo/README).
RECORDED = Path(__file__).parent / "fixtures" / "demo"


def recorded_states(run: str, run_id: str) -> tuple[str, str] | None:
    for line in (RECORDED / "states.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["id"] == run_id:
            return rec["state_type"], rec["state_name"]
    return None


@pytest.fixture
def steps(tmp_path: Path) -> Path:
    copy = tmp_path / "steps"
    shutil.copytree(RECORDED / "steps", copy)
    return copy


def test_the_recorded_demo_tells_the_promised_story(steps: Path) -> None:
    assert check(steps, recorded_states) == []
    first = sweep_changes((steps / "4-sweep-first.txt").read_text())
    assert {(h, c, s) for _, h, c, s in first} == EXPECTED_FIRST_SWEEP


def test_a_demo_whose_approval_failed_is_refused(steps: Path) -> None:
    """Issue 26: `cudamedic approve --by on-call` exited 2 and the triage was left waiting; the
    old demo went on and CI never saw it."""
    (steps / "2-approve.txt").write_text(
        "cudamedic: error: --by is gone: an answer is given as your OS user (os:USER), which "
        "the setting approver_os_users maps to an approver (deploy/OPERATIONS.md, 'Who may "
        "approve')\n"
    )
    triage = steps / "1-triage-train-shm.txt"
    text = triage.read_text()
    triage.write_text(text[: text.index("incident:")] + "exit status: 130\n")
    problems = check(steps, recorded_states)
    assert any(p.startswith("approve: the flow did not take the answer") for p in problems)
    assert "train-shm: outcome no outcome line, expected fixed" in problems
    assert "train-shm: exit status 130, expected 0" in problems


def test_a_sweep_that_repeats_a_problem_or_is_not_quiet_is_refused(steps: Path) -> None:
    first = (steps / "4-sweep-first.txt").read_text()
    line = next(ln for ln in first.splitlines() if "gpu-xid79: xid-79" in ln)
    (steps / "4-sweep-first.txt").write_text(first.replace(line, line + "\n" + line))
    # the second demo's "first" sweep compared with the first demo's: it said nothing new
    (steps / "5-sweep-second.txt").write_text(first)
    problems = check(steps, recorded_states)
    assert "first sweep: ('gpu-xid79', 'xid-79', '0000:02:00') named 2 times" in problems
    assert any(p.startswith("second sweep: not quiet") for p in problems)


def test_a_response_in_the_wrong_state_is_refused(steps: Path) -> None:
    def completed(run: str, run_id: str) -> tuple[str, str]:
        return "COMPLETED", "Completed"

    problems = check(steps, completed)
    fixed = "expected ('COMPLETED', 'Fixed')"
    assert any("train-shm: flow run" in p and fixed in p for p in problems)
    assert any("train-nogpu: flow run" in p for p in problems)


def test_the_lab_says_where_its_engines_are_and_when_it_is_down(
    lab: LabState, tmp_path: Path
) -> None:
    """The demo takes the plain engine from the lab (it hard-coded /tmp/cudamedic-lab/...)."""
    env = {**os.environ, "CUDAMEDIC_LAB_DIR": lab.dir}
    out = subprocess.run(
        [sys.executable, "-m", "tests.lab", "env"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"export CUDAMEDIC_LAB_PLAIN_DOCKER_HOST={lab.engines['plain'].url}" in out.stdout
    assert f"export DOCKER_HOST={lab.engines['gpu'].url}" in out.stdout
    down = subprocess.run(
        [sys.executable, "-m", "tests.lab", "env"],
        cwd=ROOT,
        env={**env, "CUDAMEDIC_LAB_DIR": str(tmp_path / "no-lab")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 1 and down.stdout == ""
    assert "is down" in down.stderr and "make lab-up" in down.stderr
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "/tmp/cudamedic-lab" not in demo and "--by" not in demo
