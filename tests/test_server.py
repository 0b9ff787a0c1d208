"""The embedded Prefect server through the real CLI: `cudamedic server start|status|stop`.

One server per state dir, on the port from the settings (CUDAMEDIC_PREFECT_PORT, default 4200);
a port held by another state dir's server (or any other Prefect server) is named, never shared
and never stopped."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _free_port
from tests.test_fix import CLI


def server_env(state: Path, port: int) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "CUDAMEDIC_"))
    }  # no PREFECT_API_URL: the embedded server, as on an operator's machine
    return {**env, "CUDAMEDIC_STATE_DIR": str(state), "CUDAMEDIC_PREFECT_PORT": str(port)}


def server(env: dict[str, str], action: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "server", action], env=env, capture_output=True, text=True, timeout=150, check=False
    )


@pytest.fixture
def two_state_dirs(tmp_path: Path) -> Iterator[tuple[dict[str, str], dict[str, str]]]:
    port = _free_port()
    a = server_env(tmp_path / "a", port)
    b = server_env(tmp_path / "b", port)
    yield a, b
    for env in (a, b):  # only the servers this test started
        server(env, "stop")


def test_one_server_per_state_dir_and_stop_stops_what_status_shows(
    two_state_dirs: tuple[dict[str, str], dict[str, str]], tmp_path: Path
) -> None:
    a, b = two_state_dirs
    port = a["CUDAMEDIC_PREFECT_PORT"]
    down = server(a, "status")
    assert down.returncode == 1 and ": down" in down.stdout, down.stdout + down.stderr

    up = server(a, "start")
    assert up.returncode == 0, up.stdout + up.stderr
    assert f"http://127.0.0.1:{port}/api" in up.stdout and str(tmp_path / "a") in up.stdout
    status = server(a, "status")
    assert status.returncode == 0 and ": up" in status.stdout, status.stdout + status.stderr
    assert str(tmp_path / "a" / "prefect") in status.stdout

    # Another state dir on the same port: not silently shared, not stopped by it. (It cannot
    # say where that server's database is: the server answers that only with its own auth
    # string, which is a's, issue 27.)
    other = server(b, "start")
    assert other.returncode == 1, other.stdout + other.stderr
    assert "served by another Prefect server" in other.stderr, other.stderr
    assert "CUDAMEDIC_PREFECT_PORT" in other.stderr and "Traceback" not in other.stderr
    seen = server(b, "status")
    assert seen.returncode == 1 and "another" in seen.stdout, seen.stdout + seen.stderr
    kept = server(b, "stop")
    assert kept.returncode == 1, kept.stdout + kept.stderr
    assert "nothing was stopped" in kept.stdout
    assert server(a, "status").returncode == 0

    stopped = server(a, "stop")
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    after = server(a, "status")
    assert after.returncode == 1 and ": down" in after.stdout
    again = server(a, "stop")
    assert again.returncode == 0 and "no local server was running" in again.stdout


def test_status_asks_the_server_prefect_api_url_names(prefect_api: str, tmp_path: Path) -> None:
    """Every command uses the server PREFECT_API_URL names; `server status` asked the embedded
    one anyway (issue 30) and said "down" beside a running fleet server."""
    env = server_env(tmp_path / "a", _free_port())
    up = server({**env, "PREFECT_API_URL": prefect_api}, "status")
    assert up.returncode == 0 and f"{prefect_api}: up (PREFECT_API_URL" in up.stdout, up
    gone = f"http://127.0.0.1:{_free_port()}/api"
    down = server({**env, "PREFECT_API_URL": gone}, "status")
    assert down.returncode == 1 and f"{gone}: down" in down.stdout, down
    start = server({**env, "PREFECT_API_URL": prefect_api}, "start")
    assert start.returncode == 2 and "PREFECT_API_URL names" in start.stderr, start
    assert not (tmp_path / "a" / "prefect").exists()  # nothing embedded was started
