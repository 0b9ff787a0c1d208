"""Issue 15 (part): evidence from a compromised host must not write files outside the bundle,
and must reach the terminal and the post-mortem inert."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from tests.hostile_engine import hostile_engine

CLI = [sys.executable, "-m", "runbooks.cli"]
NO_HOST_COMMANDS = """
name: engine-only
kind: incident
host_sources:
  - {name: uname, path: commands/uname.txt, command: uname -s}
nccl_tests: false
"""


def test_a_container_name_from_a_hostile_engine_cannot_write_outside_the_bundle(
    tmp_path: Path,
) -> None:
    cid, bad = "ab" * 32, "cd" * 32
    state = {
        "Running": False,
        "ExitCode": 1,
        "FinishedAt": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    container = {
        "Id": cid,
        "Name": "/../../../escaped",
        "Config": {"Image": "x", "Env": ["NVIDIA_VISIBLE_DEVICES=all"], "Tty": False},
        "HostConfig": {},
        "State": state,
    }
    # A malformed answer (no Config.Tty, which docker-py reads before fetching logs).
    malformed = {
        "Id": bad,
        "Name": "/broken",
        "Config": {"Image": "x", "Env": ["CUDA_VERSION=12.1"]},
        "State": state,
    }
    book = tmp_path / "runbook.yaml"
    book.write_text(NO_HOST_COMMANDS)
    out = tmp_path / "work" / "bundles"
    logs = {cid: b"written by the attacker\n"}
    with hostile_engine(tmp_path / "d.sock", [container, malformed], logs) as url:
        proc = subprocess.run(
            [*CLI, "collect", "local", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            env={
                **os.environ,
                "CUDAMEDIC_DOCKER_HOST": url,
                "CUDAMEDIC_RUNBOOK": str(book),
                "CUDAMEDIC_STATE_DIR": str(tmp_path / "state"),
            },
        )
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert all(
        p.startswith(("work/bundles/", "state/")) or p in ("runbook.yaml",) for p in written
    ), written
    assert not list(tmp_path.rglob("escaped*"))
    bundle = Path(proc.stdout.strip())
    assert (bundle / "containers" / f"{cid[:12]}.log").read_text() == "written by the attacker\n"
    meta = (bundle / "bundle.json").read_text()
    assert "container-name-refused" in meta and "Traceback" not in proc.stderr
    assert "broken:log" in meta and "malformed answer from the engine" in meta
