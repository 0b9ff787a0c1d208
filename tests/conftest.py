"""Session fixtures: the lab (real dockerd + sshd), settings pointing at it, helpers."""

from __future__ import annotations

import atexit
import hashlib
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from runbooks.settings import Settings
from tests.fleet import Fleet, postgres, prefect_on
from tests.lab.lab import IMAGE, LabState, down, lab_dir, up


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The tests' own Prefect server: a real `prefect server` on loopback with a fresh SQLite database,
# started by the `prefect_api` fixture. Prefect reads its settings when it is first imported, so
# the environment is set here, before any test module imports it; a PREFECT_API_URL of the
# calling shell is replaced, so tests never talk to a production server.
PREFECT_TEST_PORT = _free_port()
PREFECT_TEST_HOME = Path(tempfile.mkdtemp(prefix="cudamedic-test-prefect-"))
atexit.register(shutil.rmtree, PREFECT_TEST_HOME, True)  # also when no test used the server
os.environ.update(
    {
        "PREFECT_API_URL": f"http://127.0.0.1:{PREFECT_TEST_PORT}/api",
        "PREFECT_HOME": str(PREFECT_TEST_HOME),
        "PREFECT_LOCAL_STORAGE_PATH": str(PREFECT_TEST_HOME / "storage"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Step logs reach the API at INFO (the UI), the terminal shows warnings only.
        "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    }
)
os.environ.pop("PREFECT_API_KEY", None)
# The tests' servers ask for an auth string like the embedded one (flows/server.py): every
# process of the tests (workers, CLI runs) inherits it.
os.environ["PREFECT_API_AUTH_STRING"] = "cudamedic-test:" + secrets.token_urlsafe(24)


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """Start the tests' Prefect server (with cudamedic's own starter) and stop it at the end."""
    from flows.server import ensure_local_server, stop_local_server

    server = Settings(prefect_port=PREFECT_TEST_PORT, prefect_home=PREFECT_TEST_HOME)
    url = ensure_local_server(server)
    yield url
    stop_local_server(server)
    shutil.rmtree(PREFECT_TEST_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    """The fleet harness (tests/fleet.py): a PostgreSQL cluster of its own and a Prefect server
    on it, both stopped at the end. The tests' processes keep the SQLite server's API: fleet
    tests talk to this one through `fleet.api_url` (workers' PREFECT_API_URL, `use_api`)."""
    try:
        with postgres(_free_port()) as pg, prefect_on(pg, _free_port()) as (url, log):
            yield Fleet(pg=pg, api_url=url, server_log=log)
    except RuntimeError as exc:  # PostgreSQL missing or failing: say why, no traceback
        pytest.fail(f"fleet harness: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def lab() -> Iterator[LabState]:
    if os.geteuid() != 0:
        pytest.fail("the lab needs root (dockerd, sshd); run the tests as root, e.g. in CI")
    existing = LabState.load(lab_dir())
    reuse = existing is not None and existing.alive()
    state = up()
    yield state
    if not reuse:
        down(state)


@pytest.fixture
def settings(lab: LabState, tmp_path: Path) -> Settings:
    return Settings(
        inventory=Path(lab.inventory),
        known_hosts=Path(lab.known_hosts),
        out_dir=tmp_path / "bundles",
        state_dir=tmp_path / "state",  # never the machine's ~/.local/state
        # what a fleet shares (sweep state, the fix cap's count) is in the tests' one Prefect
        # server: a fleet of its own for each test
        fleet="t-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12],
        ssh_connect_timeout=5,
        command_timeout=5,
        exec_timeout=10,
        docker_timeout=15,
        nccl_tests_budget=20,
        docker_host=lab.engines["gpu"].url,
    )


@pytest.fixture(scope="session")
def gpu_engine(lab: LabState) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=lab.engines["gpu"].url, timeout=60)
    yield client
    client.close()


@pytest.fixture(scope="session")
def plain_engine(lab: LabState) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=lab.engines["plain"].url, timeout=60)
    yield client
    client.close()


@pytest.fixture
def container_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def make_container(gpu_engine: docker.DockerClient) -> Iterator[object]:
    """Create (and clean up) containers on the lab's GPU engine from the lab image."""
    made: list[tuple[docker.DockerClient, str]] = []

    def make(
        name: str, command: str, engine: docker.DockerClient | None = None, **kwargs: object
    ) -> docker.models.containers.Container:
        client = engine or gpu_engine
        kwargs.setdefault("network_mode", "none")
        container = client.containers.run(
            IMAGE, ["sh", "-c", command], name=name, detach=True, **kwargs
        )
        made.append((client, name))
        return container

    yield make
    for client, name in made:
        remove_made(client, name)


def remove_made(client: docker.DockerClient, name: str) -> None:
    """Remove a test's container and what fixes of it left beside it (its backups
    `NAME-cudamedic-backup-*`, its lock `NAME-cudamedic-fix-lock`): the lab is shared with
    `make demo`, whose sweeps must see only the problems the lab plants."""
    for c in client.containers.list(all=True, filters={"name": name}):
        if c.name == name or c.name.startswith(f"{name}-cudamedic-"):
            try:
                c.remove(force=True)
            except docker.errors.NotFound:
                pass


def pytest_terminal_summary(terminalreporter: object) -> None:
    """Print the reliability figures and the corpus accuracy table after the run."""
    from tests.reliability.figures import table
    from tests.test_corpus import LORO, REPORT
    from tests.test_rounds import FIGURES as ROUNDS

    write = terminalreporter.write_line  # type: ignore[attr-defined]
    for line in table():
        write(line)
    for round_, (right, total) in sorted(ROUNDS.items()):
        write(f"blind round {round_} (tests/rounds, not in the corpus): {right}/{total} right")
    for name, result in (("leave-one-out", REPORT), ("leave-one-repository-out", LORO)):
        if not result:
            continue
        named = f"{result['right_named']}/{result['named']}"
        write(
            f"corpus accuracy, {name}: {result['correct']}/{result['total']} = "
            f"{result['accuracy']:.3f}; right when a class is named: {named}"
            + (f" ({result['groups']} repositories or sites)" if "groups" in result else "")
        )
        write(f"{'class':28} {'cases':>5} {'precision':>9} {'recall':>7}")
        for cls, n, precision, recall in result["rows"]:
            write(f"{cls:28} {n:5d} {precision:9.2f} {recall:7.2f}")
        for miss in result["misses"]:
            write(f"  miss: {miss}")
