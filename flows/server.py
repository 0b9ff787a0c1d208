"""Where the flows report to: a Prefect server named by PREFECT_API_URL, or the embedded default —
a local `prefect server` on 127.0.0.1 with SQLite under STATE_DIR/prefect, started once by the
first command that needs it and reused by every later one (telemetry off).

Prefect's own "ephemeral" mode starts a temporary server inside each command; on 2 cores that
takes 8-21 s and often misses its 20 s start timeout on a fresh database. A long-lived local
server costs that start once. `cudamedic server start|stop|status` manage it by hand.

One server per state dir: it listens on the settings' port (CUDAMEDIC_PREFECT_PORT, default
4200) and is known by its PREFECT_HOME (STATE_DIR/prefect, where its database is), which the
server itself reports (`/api/admin/settings`). A port already served by another state dir's
server, or by any other Prefect server, is an error that names it: two state dirs never share
one database silently, and `stop` stops only the server this state dir started.

The embedded server asks every caller for its API auth string (issue 27: whoever reaches the API
can answer a paused fix, plant Slack messages, start responses): it is generated once, kept 0600
in PREFECT_HOME (`api-auth-string`), handed to the server as PREFECT_SERVER_API_AUTH_STRING and to
this process and its children as PREFECT_API_AUTH_STRING. A process whose environment already
names one (a fleet's units, the tests) gives the server that one.

This module must run before `prefect` is imported anywhere: Prefect reads its settings from the
environment at import time.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from runbooks.core.errors import CudamedicError
from runbooks.core.settings import Settings

START_TIMEOUT_S = 90.0


class ServerError(CudamedicError):
    pass


def prefect_home(settings: Settings) -> Path:
    return (settings.prefect_home or settings.state_path / "prefect").expanduser()


def local_url(settings: Settings) -> str:
    return f"http://127.0.0.1:{settings.prefect_port}/api"


AUTH_FILE = "api-auth-string"


def auth_string(settings: Settings) -> str:
    """The embedded server's auth string: read from PREFECT_HOME, or generated there (0600)."""
    home = prefect_home(settings)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = home / AUTH_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)  # an older copy made by hand: private again
        value = path.read_text(encoding="utf-8").strip()
        if not value:
            raise ServerError(f"{path} is empty: remove it to generate a new one") from None
        return value
    value = "cudamedic:" + secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(value + "\n")
    return value


def _auth_headers() -> dict[str, str]:
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()} if auth else {}


def healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout) as resp:  # noqa: S310 - our own URL
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def server_home(api_url: str, timeout: float = 5.0) -> Path | None:
    """The PREFECT_HOME of the Prefect server answering at `api_url` (where its database is:
    its identity); None when none answers or it does not say."""
    url = f"{api_url.rstrip('/')}/admin/settings"
    req = urllib.request.Request(url, headers=_auth_headers())  # noqa: S310 - our own URL
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - our own URL
            home = json.load(resp).get("home")
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return None
    return Path(home) if isinstance(home, str) and home else None


def foreign_server(settings: Settings) -> Path | None:
    """The home of another Prefect server on this state dir's port, if one answers there
    (one that does not say its home is reported as an unknown path)."""
    url = local_url(settings)
    if not healthy(url):
        return None
    home = server_home(url)
    if home is not None and home.resolve() == prefect_home(settings).resolve():
        return None
    return home or Path("(unknown)")


def _refuse_foreign(settings: Settings) -> None:
    other = foreign_server(settings)
    if other is not None:
        raise ServerError(
            f"127.0.0.1:{settings.prefect_port} is served by another Prefect server (database "
            f"under {other}), not this state dir's ({prefect_home(settings)}): give this state "
            "dir its own port (CUDAMEDIC_PREFECT_PORT) or use that server (PREFECT_API_URL)"
        )


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
    # A Prefect server whose database is unreachable (PostgreSQL restarting) answers 500: retry
    # it like a 503 (deploy/OPERATIONS.md, "Prefect on PostgreSQL with several workers").
    os.environ.setdefault("PREFECT_CLIENT_RETRY_EXTRA_CODES", "500")
    named = os.environ.get("PREFECT_API_URL")
    if named:
        return named
    for key, value in _base_env(settings).items():
        os.environ.setdefault(key, value)
    if not os.environ.get("PREFECT_API_AUTH_STRING"):
        os.environ["PREFECT_API_AUTH_STRING"] = auth_string(settings)
    url = local_url(settings)
    if start:
        ensure_local_server(settings)
    os.environ["PREFECT_API_URL"] = url
    return url


def ensure_local_server(settings: Settings, env: Mapping[str, str] | None = None) -> str:
    """Start this state dir's server unless it already answers; returns its API URL. Another
    Prefect server on the port is an error. `env` adds to the server's environment (e.g.
    PREFECT_API_DATABASE_CONNECTION_URL: a server on PostgreSQL)."""
    url = local_url(settings)
    if healthy(url):
        _refuse_foreign(settings)
        return url
    home = prefect_home(settings)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    with _lock(home / "server.lock"):
        if healthy(url):  # another cudamedic command started it while we waited
            _refuse_foreign(settings)
            return url
        first = not any(home.glob("*.db"))
        print(
            f"cudamedic: starting the embedded Prefect server on 127.0.0.1:{settings.prefect_port}"
            f" (database under {home}; "
            + ("the first start creates it and takes ~20 s" if first else "takes ~10 s")
            + ") ...",
            file=sys.stderr,
            flush=True,
        )
        began = time.monotonic()
        server_env = {**os.environ, **_base_env(settings), **(env or {})}
        server_env.pop("PREFECT_API_URL", None)
        server_env["PREFECT_SERVER_API_AUTH_STRING"] = (
            (env or {}).get("PREFECT_SERVER_API_AUTH_STRING")
            or os.environ.get("PREFECT_API_AUTH_STRING")
            or auth_string(settings)
        )
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
            env=server_env,
            start_new_session=True,  # outlives this command: the next one reuses it
        )
        (home / "server.pid").write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (home / "server.log").read_text(errors="replace")[-1500:]
                raise ServerError(f"the local Prefect server exited at start:\n{tail}")
            if healthy(url):
                print(
                    f"cudamedic: Prefect server up after {time.monotonic() - began:.0f} s: "
                    f"{url.removesuffix('/api')}",
                    file=sys.stderr,
                    flush=True,
                )
                return url
            time.sleep(0.25)
        raise ServerError(
            f"the local Prefect server did not answer within {START_TIMEOUT_S:g} s; "
            f"see {home / 'server.log'}"
        )


def _recorded_pid(settings: Settings) -> int | None:
    """The pid in STATE_DIR/prefect/server.pid, if that process is still the `prefect server`
    this state dir started on its port (never a reused pid)."""
    try:
        pid = int((prefect_home(settings) / "server.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    ours = b"prefect\0server\0start\0" in cmdline and (
        f"--port\0{settings.prefect_port}\0".encode() in cmdline
    )
    return pid if ours else None


def stop_local_server(settings: Settings) -> bool:
    """Stop the server this state dir started; True when one was running."""
    pidfile = prefect_home(settings) / "server.pid"
    pid = _recorded_pid(settings)
    if pid is None:
        pidfile.unlink(missing_ok=True)
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
