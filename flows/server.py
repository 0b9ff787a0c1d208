"""Where the flows report to: a Prefect server named by PREFECT_API_URL, or the embedded default —
a local `prefect server` on 127.0.0.1 with SQLite under STATE_DIR/prefect, started once by the
first command that needs it and reused by every later one (telemetry off).

Prefect's own "ephemeral" mode starts a temporary server inside each command; on 2 cores that
takes 8-21 s and often misses its 20 s start timeout on a fresh database. A long-lived local
server costs that start once. `cudamedic server start|stop|status` manage it by hand.

This module must run before `prefect` is imported anywhere: Prefect reads its settings from the
environment at import time.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from runbooks.errors import CudamedicError
from runbooks.settings import Settings

START_TIMEOUT_S = 90.0


class ServerError(CudamedicError):
    pass


def prefect_home(settings: Settings) -> Path:
    return (settings.prefect_home or settings.state_path / "prefect").expanduser()


def local_url(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.prefect_port}/api"


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as resp:  # noqa: S310 - our own URL
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _base_env(settings: Settings) -> dict[str, str]:
    home = prefect_home(settings)
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY": "false",
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(settings.prefect_port),
        "PREFECT_LOCAL_STORAGE_PATH": str(home / "storage"),
        # SQLite answers "database is locked" under bursts: give writers time to wait.
        "PREFECT_SERVER_DATABASE_TIMEOUT": "30",
        "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": "30",
    }


def configure(settings: Settings, *, start: bool = True) -> str:
    """Point this process at the Prefect API (starting the embedded server when none is named)
    and return the API URL. Call before importing prefect."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY", "false")
    os.environ.setdefault("PREFECT_UI_ENABLED", "true")
    named = os.environ.get("PREFECT_API_URL")
    if named:
        return named
    for key, value in _base_env(settings).items():
        os.environ.setdefault(key, value)
    url = local_url(settings)
    if start:
        ensure_local_server(settings)
    os.environ["PREFECT_API_URL"] = url
    return url


def ensure_local_server(settings: Settings) -> str:
    """Start the embedded server unless it already answers; returns its API URL."""
    url = local_url(settings)
    if healthy(url):
        return url
    home = prefect_home(settings)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _lock(home / "server.lock"):
        if healthy(url):  # another cudamedic command started it while we waited
            return url
        env = {**os.environ, **_base_env(settings)}
        env.pop("PREFECT_API_URL", None)
        log = open(home / "server.log", "ab")  # noqa: SIM115 - handed to the daemon
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefect",
                "server",
                "start",
                "--host",
                "127.0.0.1",
                "--port",
                str(settings.prefect_port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # outlives this command: the next one reuses it
        )
        (home / "server.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (home / "server.log").read_text(errors="replace")[-1500:]
                raise ServerError(f"the local Prefect server exited at start:\n{tail}")
            if healthy(url):
                return url
            time.sleep(0.25)
        raise ServerError(
            f"the local Prefect server did not answer within {START_TIMEOUT_S:g} s; "
            f"see {home / 'server.log'}"
        )


def stop_local_server(settings: Settings) -> bool:
    """Stop the embedded server this machine started; True when one was running."""
    pidfile = prefect_home(settings) / "server.pid"
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pidfile.unlink(missing_ok=True)
        return False
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
    return True


@contextlib.contextmanager
def _lock(path: Path):  # type: ignore[no-untyped-def]
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
