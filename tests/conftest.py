"""Session fixtures: the lab (real dockerd + sshd), settings pointing at it, helpers."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

# pytest-xdist (`make test` runs test files on several workers): each worker has a lab of its own
# (its own Docker engines, sshd hosts and state, in CUDAMEDIC_LAB_DIR-<worker>), its own Prefect
# server and PostgreSQL (free ports, below); nothing on the machine is shared but the lab's user.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    _base = os.environ.get("CUDAMEDIC_LAB_DIR", "/tmp/cudamedic-lab")
    os.environ["CUDAMEDIC_LAB_DIR"] = f"{_base.rstrip('/')}-{WORKER}"

from runbooks.core.settings import Settings  # noqa: E402
from tests.fleet import Fleet, postgres, prefect_on  # noqa: E402
from tests.lab.lab import IMAGE, LabState, down, lab_dir, up  # noqa: E402


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
        # A lock lease that ends (its holder died) is revoked within 1 s, not 15 (the servers the
        # tests start: the lease itself is the product's, e.g. the host lock's 60 s)
        "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": "1",
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
        with postgres(_free_port()) as pg, prefect_on(pg, _free_port()) as url:
            yield Fleet(pg=pg, api_url=url)
    except RuntimeError as exc:  # PostgreSQL missing or failing: say why, no traceback
        pytest.fail(f"fleet harness: {exc}", pytrace=False)


LEFT_BY_TESTS: list[str] = []


@pytest.fixture(scope="session")
def lab() -> Iterator[LabState]:
    if os.geteuid() != 0:
        pytest.fail("the lab needs root (dockerd, sshd); run the tests as root, e.g. in CI")
    existing = LabState.load(lab_dir())
    reuse = existing is not None and existing.alive()
    state = up()
    yield state
    # A test's containers (named t-...) must not outlive the run: `make demo` shares the lab and
    # its sweeps would report them. Any left are removed and named in the summary.
    for engine in state.engines.values():
        client = docker.DockerClient(base_url=engine.url, timeout=60)
        try:
            for c in client.containers.list(all=True):
                if not c.name.startswith("t-"):
                    continue
                LEFT_BY_TESTS.append(f"{engine.name}/{c.name}")
                c.remove(force=True)
        except docker.errors.DockerException as e:
            LEFT_BY_TESTS.append(f"{engine.name}: could not list ({e})")
        finally:
            client.close()
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


def pytest_configure(config: pytest.Config) -> None:
    """Where xdist workers leave what the summary prints (the run's own directory)."""
    if not WORKER and "CUDAMEDIC_TEST_SUMMARY" not in os.environ:
        where = tempfile.mkdtemp(prefix="cudamedic-test-summary-")
        atexit.register(shutil.rmtree, where, True)
        os.environ["CUDAMEDIC_TEST_SUMMARY"] = where  # inherited by the workers it starts


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A worker writes its figures for the summary the controller prints."""
    where = os.environ.get("CUDAMEDIC_TEST_SUMMARY")
    if not WORKER or not where:
        return
    from dataclasses import asdict

    from tests.reliability.figures import FIGURES
    from tests.test_corpus import REPORT
    from tests.test_rounds import FIGURES as ROUNDS

    report = {k: {n: v for n, v in r.items() if n != "bases"} for k, r in REPORT.items()}
    Path(where, f"{WORKER}.json").write_text(
        json.dumps(
            {
                "left": LEFT_BY_TESTS,
                "figures": [asdict(f) for f in FIGURES],
                "rounds": {str(k): v for k, v in ROUNDS.items()},
                "report": report,
            }
        )
    )


def _from_workers() -> None:
    """The figures the xdist workers wrote, merged into this process's (the controller's)."""
    where = os.environ.get("CUDAMEDIC_TEST_SUMMARY")
    if WORKER or not where:
        return
    from tests.reliability.figures import FIGURES, Figure
    from tests.test_corpus import REPORT
    from tests.test_rounds import FIGURES as ROUNDS

    for path in sorted(Path(where).glob("*.json")):
        part = json.loads(path.read_text())
        LEFT_BY_TESTS.extend(part["left"])
        FIGURES.extend(Figure(**f) for f in part["figures"])
        ROUNDS.update({int(k): tuple(v) for k, v in part["rounds"].items()})
        REPORT.update(part["report"])


def pytest_terminal_summary(terminalreporter: object) -> None:
    """Print the reliability figures and the corpus accuracy table after the run."""
    from tests.reliability.figures import table
    from tests.test_corpus import REPORT
    from tests.test_rounds import FIGURES as ROUNDS

    _from_workers()
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    if LEFT_BY_TESTS:
        write(f"containers the tests left on the lab (removed): {', '.join(LEFT_BY_TESTS)}")
    for line in table():
        write(line)
    for round_, (right, total) in sorted(ROUNDS.items()):
        write(f"blind round {round_} (tests/rounds, not in the corpus): {right}/{total} right")
    if not REPORT:
        return
    for line in corpus_summary(REPORT):
        write(line)


def corpus_summary(report: dict[str, Any]) -> list[str]:
    """The held-out figures of tests/test_corpus.py: leave-one-out and leave-one-repository-out,
    before (rules + similar incidents + words) and after the learned model, per class, the
    reliability tables and the misses."""
    out = []

    def figure(name: str, r: dict[str, Any]) -> str:
        n = r["total"]
        return (
            f"{name}: {r['correct']}/{n} = {r['correct'] / n:.3f}; named {r['named']} "
            f"(coverage {r['named'] / n:.3f}), right when named {r['precision']:.3f}"
        )

    for key, name in (("loo", "leave-one-out"), ("loro", "leave-one-repository-out")):
        if key in report:
            out.append(figure(f"corpus {name}, before the model", report[f"{key}_before"]))
            out.append(figure(f"corpus {name}, with the model  ", report[key]))
            r = report[key]
            out.append(
                f"  the learned model alone, on the {r['model_cases']} cases with words of their "
                f"own: {r['model_correct']} right; named at its threshold {r['model_named']}, "
                f"right {r['model_precision']:.3f}"
            )
    main = report.get("loro") or report.get("loo")
    if main is None:
        return out
    title = "leave-one-repository-out" if "loro" in report else "leave-one-out"
    out.append(f"per class ({title}, with the model):")
    out.append(f"{'class':28} {'cases':>5} {'precision':>9} {'recall':>7}")
    out.extend(f"{c:28} {n:5d} {p:9.2f} {r:7.2f}" for c, n, p, r in main["recall"])
    for label, rows in (
        ("confidence of named answers", main["reliability"]),
        ("the learned model's probability of its first class", main["model_reliability"]),
    ):
        out.append(f"reliability ({title}), {label}: decile, answers, mean, right")
        out.extend(f"  {d}  {n:4d}  {m:.2f}  {ok:.2f}" for d, n, m, ok in rows)
    out.extend(f"  miss: {m}" for m in main["misses"])
    return out
