"""The fleet harness: Debian's PostgreSQL in a temporary cluster, a Prefect server on it, and
workers as separate processes that share nothing but the Prefect API and the lab's hosts.

The cluster runs as the `postgres` system user when the tests run as root (PostgreSQL refuses
root), listens on 127.0.0.1 on a free port (its socket in the cluster's own directory) with a
password, and trades durability for speed (`fsync=off`: a test database). The Prefect server is
started and stopped by cudamedic's own starter (flows/server.py) with the cluster's URL in
PREFECT_API_DATABASE_CONNECTION_URL, after `prefect server database upgrade` (as
deploy/OPERATIONS.md says to run it).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from runbooks.settings import Settings

PG_USER = "cudamedic"
PG_DATABASE = "prefect"
TIMEOUT_S = 90
RETRY_EXTRA_CODES = "500"  # PREFECT_CLIENT_RETRY_EXTRA_CODES of the workers


def pg_bin() -> Path:
    """The newest installed PostgreSQL's bin directory (Debian: /usr/lib/postgresql/N/bin)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if not found:
        raise RuntimeError(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): "
            "run scripts/bootstrap.sh, which installs Debian's postgresql"
        )
    return found[-1].parent


@dataclass
class Postgres:
    """One PostgreSQL cluster in `root` (data, socket, log), owned by `owner`."""

    root: Path
    port: int
    password: str
    owner: str | None  # run as this user (root cannot run PostgreSQL); None: as ourselves

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def url(self) -> str:
        """The connection URL Prefect's server takes (PREFECT_API_DATABASE_CONNECTION_URL)."""
        return f"postgresql+asyncpg://{PG_USER}:{self.password}@127.0.0.1:{self.port}/{PG_DATABASE}"

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [str(pg_bin() / tool), *args],
            user=self.owner,
            env={**os.environ, "PGPASSWORD": self.password, "LC_ALL": "C.UTF-8"},
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if done.returncode != 0:
            log = self.root / "postgres.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)}: {done.stdout}{done.stderr}{tail}")

    def init(self) -> None:
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if self.owner:
            account = pwd.getpwnam(self.owner)
            for path in (self.root, pwfile):
                os.chown(path, account.pw_uid, account.pw_gid)
        self.root.chmod(0o700)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            PG_USER,
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )
        pwfile.unlink()
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.root}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
            )

    def pg_ctl(self, action: str) -> None:
        """`pg_ctl start|stop|restart`, waiting until it is done (stop: fast, like a reboot's)."""
        self._run(
            "pg_ctl", action, "-D", str(self.data), "-l", str(self.root / "postgres.log"),
            "-w", "-t", str(TIMEOUT_S), "-m", "fast",
        )  # fmt: skip

    def create_database(self) -> None:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, PG_DATABASE)


def _owner() -> str | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres").pw_name  # Debian's package creates it
    except KeyError:
        raise RuntimeError(
            "the tests run as root and there is no `postgres` user to run PostgreSQL as: "
            "run scripts/bootstrap.sh, which installs Debian's postgresql"
        ) from None


@contextlib.contextmanager
def postgres(port: int) -> Iterator[Postgres]:
    """A fresh PostgreSQL cluster with the Prefect database, stopped and removed at the end."""
    root = Path(tempfile.mkdtemp(prefix="cudamedic-test-pg-"))
    pg = Postgres(root=root, port=port, password=secrets.token_hex(12), owner=_owner())
    try:
        pg.init()
        pg.pg_ctl("start")
        pg.create_database()
        yield pg
    finally:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            pg.pg_ctl("stop")
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def prefect_on(pg: Postgres, port: int) -> Iterator[str]:
    """A Prefect server on `pg` on 127.0.0.1:`port` with its own PREFECT_HOME; its API URL."""
    from flows.server import ensure_local_server, stop_local_server

    home = Path(tempfile.mkdtemp(prefix="cudamedic-test-pgprefect-"))
    server = Settings(prefect_port=port, prefect_home=home)
    database = {"PREFECT_API_DATABASE_CONNECTION_URL": pg.url}
    upgrade = subprocess.run(
        [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
        env={**os.environ, "PREFECT_HOME": str(home), **database},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if upgrade.returncode != 0:
        raise RuntimeError(f"prefect server database upgrade: {upgrade.stdout}{upgrade.stderr}")
    try:
        yield ensure_local_server(server, env=database)
    finally:
        stop_local_server(server)
        shutil.rmtree(home, ignore_errors=True)


@dataclass(frozen=True)
class Fleet:
    """The harness's PostgreSQL cluster and the API URL of the Prefect server on it."""

    pg: Postgres
    api_url: str


def worker_env(base: dict[str, str], api_url: str, home: Path) -> dict[str, str]:
    """The environment of one worker machine: its own HOME, PREFECT_HOME, result storage, state
    and output dirs under `home`; the shared Prefect API."""
    dirs = {k: home / k for k in ("home", "prefect", "state", "out")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    return {
        **base,
        "PREFECT_API_URL": api_url,
        "HOME": str(dirs["home"]),
        "PREFECT_HOME": str(dirs["prefect"]),
        "PREFECT_LOCAL_STORAGE_PATH": str(dirs["prefect"] / "storage"),
        "CUDAMEDIC_STATE_DIR": str(dirs["state"]),
        "CUDAMEDIC_OUT_DIR": str(dirs["out"]),
        # As deploy/systemd/cudamedic.env.example: retry what the server answers with 500 while
        # its database is unreachable (deploy/OPERATIONS.md, "Prefect on PostgreSQL").
        "PREFECT_CLIENT_RETRY_EXTRA_CODES": RETRY_EXTRA_CODES,
    }


@contextlib.contextmanager
def use_api(api_url: str) -> Iterator[None]:
    """Point this process's Prefect client at `api_url` for the block (the tests' own process
    keeps the SQLite test server otherwise)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        yield
