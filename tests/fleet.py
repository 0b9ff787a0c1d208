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
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from uuid import UUID

from runbooks.core.settings import Settings

ROOT = Path(__file__).parents[1]
PREFECT = [str(Path(sys.executable).parent / "prefect")]
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


@dataclass
class Pool:
    """The deployments of deploy/prefect.yaml on a process work pool with running workers."""

    name: str
    api_url: str
    operator: dict[str, str]  # the environment of `prefect` commands run by an operator
    logs: dict[str, Path] = field(default_factory=dict)  # worker name -> its log
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def prefect(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*PREFECT, *args],
            cwd=ROOT,
            env=self.operator,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def marks(self) -> dict[str, int]:
        """Where each worker's log ends now (for `took_since`)."""
        return {w: log.stat().st_size for w, log in self.logs.items()}

    def took_since(self, marks: dict[str, int]) -> dict[str, list[str]]:
        """Worker -> the flows of the runs its log says it took since `marks`."""
        took = {}
        with use_api(self.api_url):
            for w, log in self.logs.items():
                with log.open("rb") as f:
                    f.seek(marks[w])
                    took[w] = [flow_name(r) for r in taken(f.read().decode(errors="replace"))]
        return took

    def worker_logs(self) -> str:
        return "".join(f"--- {n}\n{p.read_text(errors='replace')}" for n, p in self.logs.items())


def worker_argv(pool: str, worker: str, limit: int, cudamedic: bool) -> list[str]:
    """A worker's command: `cudamedic worker` (deploy/systemd/cudamedic-worker@.service), or
    Prefect's own `prefect worker start`."""
    if cudamedic:
        cli = str(Path(PREFECT[0]).parent / "cudamedic")
        return [cli, "worker", "--pool", pool, "--name", worker, "--limit", str(limit)]
    return [*PREFECT, "worker", "start", "--pool", pool, "--name", worker, "--limit", str(limit)]


@contextlib.contextmanager
def work_pool(
    api_url: str,
    base: dict[str, str],
    root: Path,
    workers: tuple[str, ...],
    limit: int = 2,
    cudamedic: bool = False,
) -> Iterator[Pool]:
    """deploy/prefect.yaml on a new process work pool of the server at `api_url` (the cron sweep
    paused), and `workers` as separate processes, each with its own HOME, PREFECT_HOME, state and
    output dirs under `root` (worker_env); stopped at the end (SIGINT, then SIGKILL).
    `cudamedic`: the workers run as `cudamedic worker`."""
    name = f"cudamedic-fleet-{secrets.token_hex(3)}"
    base = {**base, "CUDAMEDIC_HOME": str(ROOT), "CUDAMEDIC_WORK_POOL": name}
    pool = Pool(name, api_url, worker_env(base, api_url, root / "operator"))
    for argv in (
        ["work-pool", "create", name, "--type", "process"],
        ["--no-prompt", "deploy", "--all", "--prefect-file", "deploy/prefect.yaml"],
    ):
        done = pool.prefect(*argv)
        if done.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(argv)}: {done.stdout}{done.stderr}")
    with use_api(api_url):
        pause_schedules("fleet-health-check/fleet-sweep")
    try:
        for worker in workers:
            pool.logs[worker] = root / f"{worker}.log"
            pool.procs[worker] = subprocess.Popen(
                worker_argv(name, worker, limit, cudamedic),
                cwd=ROOT,
                env=worker_env(base, api_url, root / worker),
                stdout=pool.logs[worker].open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        yield pool
    finally:
        stop_processes(list(pool.procs.values()))


def stop_processes(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the processes still running (workers, servers started with start_new_session):
    SIGINT to each process group, SIGKILL after 20 s."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pause_schedules(deployment: str) -> None:
    """The deployed cron sweep must not fire in the middle of a test ..."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        for sched in dep.schedules:
            client.update_deployment_schedule(dep.id, sched.id, active=False)
        # ... nor a run the scheduler created before the pause.
        ahead = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))
        )
        for run in ahead:
            if run.state is not None and run.state.is_scheduled():
                client.delete_flow_run(run.id)


def taken(log: str) -> list[str]:
    """The flow runs a worker's log says it submitted and did not leave to another worker: more
    submissions than aborted ones (a worker that lost the race for a run once may take it later,
    when the run is scheduled again)."""
    aborted = Counter(re.findall(r"Aborted submission of flow run '([0-9a-f-]{36})'", log))
    submitted = re.findall(r"submitting flow run '([0-9a-f-]{36})'", log)
    return [r for r, n in Counter(submitted).items() if n > aborted[r]]


def flow_name(run_id: str) -> str:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow(client.read_flow_run(UUID(run_id)).flow_id).name
