"""deploy/OPERATIONS.md "Install: from nothing to a running fleet", followed as written: the
section's shell blocks are read from the file and run in one shell, in order, from nothing —
new directories, a new database on the harness's PostgreSQL (tests/fleet.py), the lab as the
fleet — with `systemctl` standing in for systemd (tests/units.py: the units of deploy/systemd
started as systemd starts them). The values a team brings (paths, the database URL, the ports,
the inventory, known_hosts and key) are the variables of step 0, exported before it.

Two lines are not run as written, and the test checks they are still there: the virtualenv and
`pip install` (tests reach no network): the new checkout gets the tests' own `.venv` instead.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import urllib.request
from pathlib import Path
from uuid import UUID

import pytest

from tests.conftest import _free_port
from tests.fleet import PG_USER, Fleet, use_api
from tests.lab.lab import LabState

pytestmark = pytest.mark.fleet

ROOT = Path(__file__).parents[1]
SECTION = "## Install: from nothing to a running fleet"
VENV_LINE = 'python3 -m venv "$CUDAMEDIC_HOME/.venv"'
PIP_LINE = '"$CUDAMEDIC_HOME/.venv/bin/pip" install -q "$CUDAMEDIC_HOME"'


def install_script() -> str:
    """The section's ```sh blocks, in order, as one script."""
    text = (ROOT / "deploy" / "OPERATIONS.md").read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    blocks = re.findall(r"```sh\n(.*?)```", text[start:end], re.S)
    assert len(blocks) >= 7, blocks
    return "\n".join(blocks)


def test_the_install_section_takes_a_team_from_nothing_to_a_running_fleet(
    fleet: Fleet, lab: LabState, tmp_path: Path
) -> None:
    script = install_script()
    for line in (VENV_LINE, PIP_LINE):
        assert line in script, f"the install section no longer says {line!r}"
    venv = Path(sys.executable).parent.parent
    script = script.replace(VENV_LINE, f'ln -s "{venv}" "$CUDAMEDIC_HOME/.venv"')
    script = script.replace(PIP_LINE, "true  # installed: the tests own .venv")

    # A new database for this Prefect server, on the harness's PostgreSQL.
    database = f"install_{secrets.token_hex(4)}"
    fleet.pg._run("createdb", "-h", "127.0.0.1", "-p", str(fleet.pg.port), "-U", PG_USER, database)
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "systemctl").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tests.units "$@"\n')
    (shim / "systemctl").chmod(0o755)
    prefect_port, alert_port = _free_port(), _free_port()
    pool = f"install-{secrets.token_hex(3)}"
    brought = {
        "CUDAMEDIC_HOME": str(tmp_path / "opt" / "cudamedic"),
        "CUDAMEDIC_USER": "root",  # tests run as root; User= is not emulated (tests/units.py)
        "ETC": str(tmp_path / "etc" / "cudamedic"),
        "VAR": str(tmp_path / "var" / "lib" / "cudamedic"),
        "SYSTEMD_DIR": str(tmp_path / "systemd"),
        "CUDAMEDIC_REPO": str(ROOT),
        "CUDAMEDIC_VERSION": _head(),
        "PREFECT_DB_URL": fleet.pg.url.rsplit("/", 1)[0] + f"/{database}",
        "PREFECT_PORT": str(prefect_port),
        "ALERT_PORT": str(alert_port),
        "PUBLIC_URL": f"http://127.0.0.1:{prefect_port}",
        "FLEET_INVENTORY": lab.inventory,
        "FLEET_KNOWN_HOSTS": lab.known_hosts,
        "FLEET_SSH_KEY": str(Path(lab.inventory).parent / "keys" / "id_ed25519"),
        "CUDAMEDIC_FLEET": pool,
        "CUDAMEDIC_WORK_POOL": pool,
        "CHECK_HOST": "gpu-nodriver",
    }
    (tmp_path / "systemd").mkdir()
    # An operator's root shell: none of the tests' Prefect or cudamedic settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "CUDAMEDIC_"))}
    env.update(brought, PATH=f"{shim}:{env['PATH']}", HOME=str(tmp_path / "root"))
    env["PYTHONPATH"] = str(ROOT)  # the systemctl stand-in: tests/units.py
    log = tmp_path / "install.log"
    try:
        with log.open("w") as out:
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script],
                env=env,
                cwd=tmp_path,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=600,
            )
        said = log.read_text()
        assert done.returncode == 0, said + _unit_logs(tmp_path)
        # Step 7's response ran on the worker (`--watch` exits non-zero unless it completed).
        run_id = re.findall(r"UUID: ([0-9a-f-]{36})", said)[-1]
        assert "no fix waits for approval" in said, said
        assert "Completed" in said, said
        api = f"http://127.0.0.1:{prefect_port}/api"
        auth = _env_file(Path(brought["ETC"]) / "cudamedic.env")["PREFECT_API_AUTH_STRING"]
        with use_api(api), _auth(auth):
            from prefect import get_client

            with get_client(sync_client=True) as client:
                run = client.read_flow_run(UUID(run_id))
            assert run.parameters["target"] == "gpu-nodriver"
        # No approval channel is configured by the install: the worker says so at start.
        assert "no approval channel is configured" in _unit_log(tmp_path, "cudamedic-worker@w1")
        # The alert receiver answers, with the token the install generated.
        with urllib.request.urlopen(f"http://127.0.0.1:{alert_port}/health", timeout=10) as r:
            assert json.loads(r.read()) == {"ok": True}
        token = _env_file(Path(brought["ETC"]) / "cudamedic.env")["CUDAMEDIC_ALERT_TOKEN"]
        assert len(token) == 64 and token != "change-me-long-random"
        # Secrets are not readable by others.
        for name in ("cudamedic.env", "prefect.env"):
            assert (Path(brought["ETC"]) / name).stat().st_mode & 0o007 == 0, name
        # The worker's state is its own (never a shared directory), under VAR.
        assert (Path(brought["VAR"]) / "bundles" / "reports").is_dir()
    finally:
        for unit in ("cudamedic-alerts", "cudamedic-worker@w1", "cudamedic-prefect-server"):
            subprocess.run(
                [str(shim / "systemctl"), "stop", unit], env=env, timeout=180, check=False
            )


def _head() -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _env_file(path: Path) -> dict[str, str]:
    from tests.units import read_env_file

    return read_env_file(path)


def _unit_log(tmp: Path, unit: str) -> str:
    log = tmp / "systemd" / ".run" / f"{unit}.log"
    return log.read_text(errors="replace") if log.exists() else ""


def _unit_logs(tmp: Path) -> str:
    return "".join(
        f"\n--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
        for p in sorted((tmp / "systemd" / ".run").glob("*.log"))
    )


class _auth:
    """PREFECT_API_AUTH_STRING of the installed server for this process's client."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __enter__(self) -> None:
        from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

        self.ctx = temporary_settings(updates={PREFECT_API_AUTH_STRING: self.value})
        self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.ctx.__exit__(*exc)
