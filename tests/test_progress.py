# ruff: noqa: F811 - the fixtures imported from tests.test_fix / tests.test_flows
"""Issue 19, the operator's view: `triage` and `sweep` show each step live as it runs — plain
lines on standard error when it is not a terminal (what these tests see), a live line on a
terminal, and nothing on standard output in --json mode."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runbooks.core.progress import STEPS
from tests.test_fix import CLI, fix_settings, volume  # noqa: F401 - fixtures
from tests.test_flows import cudamedic, env, field, shm_container  # noqa: F401 - fixtures
from tests.test_terminal import section


def progress_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("cudamedic: [")]


def steps_seen(stderr: str) -> list[str]:
    """The steps in the order their lines came (each step once)."""
    seen = [
        m.group(1) for ln in progress_lines(stderr) if (m := re.match(r"cudamedic: \[(\w+)\]", ln))
    ]
    return list(dict.fromkeys(seen))


def test_triage_dry_run_shows_each_step_on_stderr(
    env: dict[str, str], make_container, container_name: str, volume: str
) -> None:
    shm_container(make_container, container_name, volume)
    done = cudamedic(env, "triage", "gpu-healthy", "--container", container_name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert steps_seen(done.stderr) == ["start", "collect", "classify", "plan", "report"], (
        done.stderr
    )
    lines = "\n".join(progress_lines(done.stderr))
    # Each step says what it is doing as it starts, and what came of it when done.
    assert f"[collect] {STEPS['collect']} from gpu-healthy / {container_name}" in lines, lines
    assert re.search(r"\[collect\] done in \d+\.\d s: \d+ sources, \d+ failed", lines), lines
    assert re.search(r"\[classify\] done in \d+\.\d s: shm-too-small", lines), lines
    assert re.search(r"\[plan\] done in \d+\.\d s: .*\+ --shm-size 8g", lines), lines
    assert re.search(r"\[report\] done in \d+\.\d s: .*\.md", lines), lines
    assert "cudamedic: [" not in done.stdout  # progress never goes to standard output
    assert field(done.stdout, "incident").startswith("shm-too-small")


def test_triage_json_keeps_stdout_one_object_and_progress_on_stderr(
    env: dict[str, str], make_container, container_name: str, volume: str
) -> None:
    shm_container(make_container, container_name, volume)
    done = cudamedic(env, "triage", "gpu-healthy", "--container", container_name, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["incident"] == "shm-too-small"
    assert "collect" in steps_seen(done.stderr), done.stderr


def test_sweep_shows_hosts_done_out_of_total(env: dict[str, str]) -> None:
    done = cudamedic(env, "sweep", "--host", "gpu-nodriver", "--host", "gpu-healthy")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = "\n".join(progress_lines(done.stderr))
    assert f"[sweep] {STEPS['sweep']} (2 in all)" in lines, lines
    assert re.search(r"\[sweep\] 1/2 hosts done \(gpu-\w+: \w+\)", lines), lines
    assert re.search(r"\[sweep\] 2/2 hosts done \(gpu-\w+: \w+\)", lines), lines
    # The lab's engines are shared: another test's container may make gpu-healthy a warning.
    assert "gpu-nodriver: drain" in lines and re.search(r"gpu-healthy: (healthy|warning)", lines)
    assert steps_seen(done.stderr)[-1] == "report", done.stderr
    assert "cudamedic: [" not in done.stdout


def test_on_a_terminal_progress_is_a_live_line(
    env: dict[str, str], make_container, container_name: str, volume: str
) -> None:
    """stderr a terminal: one live (rewritten) status line, not a line per step; stdout keeps
    the result."""
    shm_container(make_container, container_name, volume)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, "triage", "gpu-healthy", "--container", container_name],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=follower,
        env={**env, "COLUMNS": "120", "TERM": "xterm"},
    )
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    out, _ = proc.communicate(timeout=60)
    os.close(leader)
    assert proc.returncode == 0, seen.decode(errors="replace")
    text = seen.decode(errors="replace")
    assert STEPS["collect"] in text, text
    assert "\r" in text or "\x1b[" in text, text  # rewritten in place
    assert "cudamedic: [collect]" not in text  # not the plain lines
    assert b"incident:" in out


@pytest.fixture
def drop_backups(gpu_engine: Any, container_name: str) -> Iterator[None]:
    """A verified fix keeps the original as a backup for a day: remove this test's."""
    yield
    for c in gpu_engine.containers.list(all=True, filters={"name": f"{container_name}-cudamedic-"}):
        c.remove(force=True)


def test_fixed_report_says_how_long_the_workload_was_down_and_who_started_it(
    env: dict[str, str], make_container, container_name: str, volume: str, drop_backups: None
) -> None:
    """The post-mortem of a real fix: the workload's downtime from its container's FinishedAt to
    the verified restart, who ran what and when, human times, no internal signature ids."""
    shm_container(make_container, container_name, volume)  # dd fails and the container exits
    done = cudamedic(
        env,
        "triage",
        "gpu-healthy",
        "--container",
        container_name,
        "--apply",
        "--yes",
        "--trigger",
        "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error.",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"apply", "verify"} <= set(steps_seen(done.stderr)), done.stderr
    assert re.search(r"\[verify\] done: \d/\d checks ok", done.stderr), done.stderr
    report = Path(field(done.stdout, "report")).read_text()
    impact = section(report, "Impact")
    assert re.search(
        r"It was down for \*\*[\d. a-z]+\*\*: it stopped at \d\d:\d\d:\d\d UTC and runs again, "
        r"verified, since \d\d:\d\d:\d\d UTC\.",
        impact,
    ), impact
    assert re.search(r"^\| Workload down \| [\d. a-z]+ \|$", report, re.M), report
    detection = section(report, "Detection")
    assert re.search(r"ran `cudamedic triage` at \d\d:\d\d:\d\d UTC on \d+ \w{3} \d{4}", detection)
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:", report.split("## Evidence appendix")[0])
    summary = section(report, "Summary")
    assert "matched" not in summary and "bus-error" not in summary, summary
    timeline = section(report, "Timeline \\(UTC\\)")
    assert "journal:" not in timeline and "replacement verified" in timeline, timeline
    assert not re.search(r"[0-9a-f]{64}", timeline), timeline  # container ids as docker ps shows
