"""Deployments on a real Prefect server: deploy/prefect.yaml on a process work pool with two
workers (a distributed sweep shared between them, an incident response run with
`prefect deployment run`), and `cudamedic serve`."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from runbooks.core.settings import Settings
from tests.fleet import PREFECT, ROOT, flow_name, pause_schedules, stop_processes, taken
from tests.lab.lab import LabState
from tests.test_fix import cli_env, fix_settings  # noqa: F401 - fixture
from tests.test_flows import artifacts_of, flow_run_of, run_id_of, sweep_runbook

BIN = Path(sys.executable).parent


@pytest.fixture
def env(prefect_api: str, lab: LabState, fix_settings: Settings, tmp_path: Path) -> dict[str, str]:  # noqa: F811
    return cli_env(
        lab,
        fix_settings,
        PREFECT_API_URL=prefect_api,
        CUDAMEDIC_HOME=str(ROOT),
        CUDAMEDIC_SWEEP_RUNBOOK=str(
            sweep_runbook(tmp_path, **{"batch_run_size: 500": "batch_run_size: 2"})
        ),
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_RUNNER_POLL_FREQUENCY="1",  # `cudamedic serve` takes a run within 1 s, not 10
        PREFECT_LOGGING_LEVEL="INFO",
        PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL="INFO",  # the workers' logs say what they took
    )


def prefect(
    env: dict[str, str], *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PREFECT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def background() -> Iterator[Any]:
    """Start long-running processes (workers, `cudamedic serve`); stop them all at the end."""
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        out = open(log, "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append((proc, log))
        return proc

    yield start
    stop_processes([proc for proc, _ in procs])


def flow_run_id(out: str) -> str:
    m = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert m, out
    return m.group(1)


def run_info(run_id: str) -> tuple[str, dict[str, str]]:
    """(final state name, artifacts key -> markdown) of a flow run."""
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    return (run.state.name if run.state else "?"), {a.key or "": str(a.data) for a in arts}


def test_prefect_yaml_on_a_work_pool_with_two_workers(
    env: dict[str, str], background: Any, tmp_path: Path
) -> None:
    pool = f"cudamedic-test-{uuid.uuid4().hex[:6]}"
    env = {**env, "CUDAMEDIC_WORK_POOL": pool}
    made = prefect(env, "work-pool", "create", pool, "--type", "process")
    assert made.returncode == 0, made.stdout + made.stderr
    deployed = prefect(
        env, "--no-prompt", "deploy", "--all", "--prefect-file", "deploy/prefect.yaml"
    )
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    pause_schedules("fleet-health-check/fleet-sweep")
    logs = {name: tmp_path / f"{name}.log" for name in ("w1", "w2")}
    for name, log in logs.items():
        background(
            [*PREFECT, "worker", "start", "--pool", pool, "--name", name, "--limit", "2"], env, log
        )

    # An incident response, started the way an operator (or an alert automation) starts one.
    ran = prefect(
        env,
        "deployment",
        "run",
        "incident-response/incident-response",
        "--param",
        "target=gpu-nodriver",
        "--param",
        "trigger_text=nvidia-smi fails",
        "--watch",
    )
    assert ran.returncode == 0, (
        ran.stdout + ran.stderr + "".join(p.read_text() for p in logs.values())
    )
    state, arts = run_info(flow_run_id(ran.stdout))
    assert state == "Completed"
    assert "driver-not-loaded" in arts["postmortem-gpu-nodriver"]

    # The fleet sweep (distribute: true in prefect.yaml): 8 lab hosts in batches of 2, each
    # batch a sweep-batch run that either worker may take; each worker runs 2 flows at most,
    # so the sweep itself and its batches are shared.
    swept = prefect(
        env, "deployment", "run", "fleet-health-check/fleet-sweep", "--watch", timeout=400
    )
    text = "".join(p.read_text() for p in logs.values())
    assert swept.returncode == 0, swept.stdout + swept.stderr + text
    state, arts = run_info(flow_run_id(swept.stdout))
    assert state == "Completed"
    table = arts["fleet-sweep"]
    for host in ("gpu-nodriver", "gpu-xid79", "gpu-mismatch", "gpu-hang"):
        assert re.search(rf"\| {host} \| \*\*drain\*\*", table), table
    submitted = {name: taken(log.read_text()) for name, log in logs.items()}
    assert all(submitted.values()), submitted  # both workers took runs
    names = sorted(flow_name(r) for runs in submitted.values() for r in runs)
    assert names == ["fleet-health-check", "incident-response"] + ["sweep-batch"] * 4, names


def test_cudamedic_serve_runs_an_incident_response(
    env: dict[str, str], background: Any, tmp_path: Path
) -> None:
    env = {**env, "CUDAMEDIC_SWEEP_SCHEDULE": "0 0 1 1 *"}
    # A deployment of the same name on a work pool is refused with a clear message ...
    pool = f"cudamedic-test-{uuid.uuid4().hex[:6]}"
    assert prefect(env, "work-pool", "create", pool, "--type", "process").returncode == 0
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    names = [
        "incident-response/incident-response",
        "fleet-health-check/fleet-sweep",
        "sweep-batch/sweep-batch",
    ]
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.delete_deployment(client.read_deployment_by_name(name).id)
            except ObjectNotFound:
                pass
        flow_id = client.create_flow_from_name("incident-response")
        dep_id = client.create_deployment(
            flow_id=flow_id, name="incident-response", work_pool_name=pool
        )
    refused = subprocess.run(
        [str(BIN / "cudamedic"), "serve"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"already runs on work pool '{pool}'" in refused.stderr
    assert "Traceback" not in refused.stderr
    # ... and once it is gone, `cudamedic serve` serves the three deployments.
    with get_client(sync_client=True) as client:
        client.delete_deployment(dep_id)
    serve = background([str(BIN / "cudamedic"), "serve"], env, tmp_path / "serve.log")
    log = tmp_path / "serve.log"
    deadline = time.monotonic() + 90
    while "Your deployments are being served" not in log.read_text():
        assert serve.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    ran = prefect(
        env,
        "deployment",
        "run",
        "incident-response/incident-response",
        "--param",
        "target=gpu-mismatch",
        "--watch",
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr + log.read_text()
    state, arts = run_info(flow_run_id(ran.stdout))
    assert state == "Completed"
    assert "driver-library-mismatch" in arts["postmortem-gpu-mismatch"]


def test_an_alert_starts_a_response_once(
    env: dict[str, str], background: Any, tmp_path: Path, lab: LabState
) -> None:
    """Alertmanager webhook -> `cudamedic alerts` -> Prefect event -> the deployment's trigger
    (served by `cudamedic serve`) -> an incident response for the alert's host."""
    import json
    import urllib.error
    import urllib.request

    env = {**env, "CUDAMEDIC_SWEEP_SCHEDULE": "0 0 1 1 *", "CUDAMEDIC_ALERT_TOKEN": "s3cret-t0ken"}
    _drop_deployments()
    serve_log, alerts_log = tmp_path / "serve.log", tmp_path / "alerts.log"
    background([str(BIN / "cudamedic"), "serve"], env, serve_log)
    background([str(BIN / "cudamedic"), "alerts", "--port", "0"], env, alerts_log)
    deadline = time.monotonic() + 90
    while not (
        "being served" in serve_log.read_text() and "alert receiver" in alerts_log.read_text()
    ):
        assert time.monotonic() < deadline, serve_log.read_text() + alerts_log.read_text()
        time.sleep(0.5)
    url = re.search(r"POST (http://\S+)", alerts_log.read_text()).group(1)  # type: ignore[union-attr]

    body = json.loads((FIXTURES / "alerts" / "alertmanager-webhook.json").read_text())
    body["alerts"][0]["labels"]["Hostname"] = "gpu-nodriver"

    def post(
        payload: bytes, token: str = "s3cret-t0ken", to: str = url
    ) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(
            to, data=payload, method="POST", headers={"Authorization": f"Bearer {token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    assert post(json.dumps(body).encode(), token="wrong")[0] == 401
    assert post(b"\x00garbage")[0] == 400
    code, answer = post(json.dumps(body).encode())
    assert code == 202 and answer["announced"] == [
        {"alert": "HardwareError_ServiceDown", "host": "gpu-nodriver", "container": None}
    ], answer
    again = post(json.dumps(body).encode())[1]  # Alertmanager repeats: announced once
    assert again["announced"] == [] and again["ignored"][0]["why"] == "already announced"
    # A second receiver (another machine: its own STATE_DIR and HOME) knows it too: the memory
    # of announced alerts is in Prefect.
    other = tmp_path / "receiver-b"
    b_log = tmp_path / "alerts-b.log"
    env_b = {**env, "CUDAMEDIC_STATE_DIR": str(other / "state"), "HOME": str(other)}
    background([str(BIN / "cudamedic"), "alerts", "--port", "0"], env_b, b_log)
    while "alert receiver" not in b_log.read_text():
        assert time.monotonic() < deadline + 60, b_log.read_text()
        time.sleep(0.5)
    url_b = re.search(r"POST (http://\S+)", b_log.read_text()).group(1)  # type: ignore[union-attr]
    on_b = post(json.dumps(body).encode(), to=url_b)[1]
    assert on_b["announced"] == [] and on_b["ignored"][0]["why"] == "already announced", on_b
    assert not (other / "state" / "alerts.json").exists()
    body["alerts"][0]["labels"]["Hostname"] = "not-in-inventory"
    body["alerts"][0]["startsAt"] = "2019-07-27T00:00:00Z"
    body["commonLabels"]["instance"] = "10.9.9.9:9100"
    body["alerts"][0]["labels"]["instance"] = "10.9.9.9:9100"
    assert post(json.dumps(body).encode())[1]["ignored"][0]["why"] == "no inventory host"

    run = _wait_for_run("incident-response", "alert HardwareError_ServiceDown", serve_log)
    state, arts = run_info(str(run))
    assert state == "Completed", serve_log.read_text()
    assert "driver-not-loaded" in arts["postmortem-gpu-nodriver"]
    assert "HardwareError_ServiceDown: Service apis.service" in arts["postmortem-gpu-nodriver"]
    assert "s3cret-t0ken" not in serve_log.read_text() + alerts_log.read_text()

    # A sweep that finds news starts a response for the host, run by the served deployment.
    swept = subprocess.run(
        [str(BIN / "cudamedic"), "sweep", "--host", "gpu-mismatch", "--start-incidents"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert swept.returncode == 0, swept.stdout + swept.stderr
    started = re.findall(r"incident response started: flow run ([0-9a-f-]{36})", swept.stdout)
    assert len(started) == 1, swept.stdout
    run = _wait_for_run("incident-response", "cudamedic fleet sweep", serve_log)
    assert str(run) == started[0]
    state, arts = run_info(started[0])
    assert state == "Completed" and "driver-library-mismatch" in arts["postmortem-gpu-mismatch"]
    # The sweep and the response it started point at each other in the Prefect UI.
    sweep_run = run_id_of(swept.stdout)
    response = flow_run_of(started[0])
    # The lab's GPU engine may hold containers this test did not create (`make demo`'s
    # train-shm): the response names the one its diagnosis chose, or none.
    chosen = response.parameters.get("container")
    assert response.parameters["target"] == "gpu-mismatch", response.parameters
    assert response.name == f"triage-gpu-mismatch-{chosen or 'host'}", response.name
    assert {f"sweep:{sweep_run}", "host:gpu-mismatch", "incident:driver-library-mismatch"} <= set(
        response.tags
    ), response.tags
    assert f"/runs/flow-run/{started[0]}" in artifacts_of(sweep_run)["fleet-sweep"]


FIXTURES = Path(__file__).parent / "fixtures"


def _drop_deployments() -> None:
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for name in (
            "incident-response/incident-response",
            "fleet-health-check/fleet-sweep",
            "sweep-batch/sweep-batch",
        ):
            try:
                client.delete_deployment(client.read_deployment_by_name(name).id)
            except ObjectNotFound:
                pass


def _wait_for_run(flow: str, detected_by: str, log: Path, timeout: float = 120) -> UUID:
    """The finished run of `flow` whose detected_by parameter is `detected_by`."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])))
        for r in runs:
            if r.parameters.get("detected_by") == detected_by and r.state and r.state.is_final():
                return r.id
        time.sleep(1)
    raise AssertionError(f"no finished {flow} run detected by {detected_by!r}:\n{log.read_text()}")


def test_every_label_the_receiver_reads_reaches_the_response() -> None:
    """deploy/prefect.yaml's trigger (work pools) passes what `cudamedic serve`'s does
    (flows/alerts.py trigger_parameters): the alert's container among them (issue 30: it was
    read and dropped, and the response covered the whole host)."""
    import yaml

    from flows.alerts import trigger_parameters

    deployments = yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["deployments"]
    (incident,) = [d for d in deployments if d["name"] == "incident-response"]
    (trigger,) = incident["triggers"]
    assert trigger["parameters"] == trigger_parameters()
    assert trigger["parameters"]["container"] == "{{ event.payload.container }}"


def test_the_worker_unit_drains_and_names_no_pool() -> None:
    """The worker unit runs `cudamedic worker` (the pool from CUDAMEDIC_WORK_POOL of the env
    file, never hard-coded), and a stop signals the worker alone, long enough for a fix."""
    unit = (ROOT / "deploy" / "systemd" / "cudamedic-worker@.service").read_text()
    start = re.search(r"^ExecStart=(.*)$", unit, re.M)
    assert start and " worker " in start.group(1) and "--pool" not in start.group(1), unit
    assert re.search(r"^KillMode=mixed$", unit, re.M), unit
    stop = re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)
    assert stop and int(stop.group(1)) > 900, unit  # the runbook's apply timeout
    env = (ROOT / "deploy" / "systemd" / "cudamedic.env.example").read_text()
    assert re.search(r"^CUDAMEDIC_WORK_POOL=", env, re.M), env


def test_systemd_units_limit_open_files() -> None:
    """Every unit caps its file descriptors (issue 15: idle connections past the fd limit made
    the alert receiver unreachable); the HTTP endpoints' cap leaves room above their connection
    limit (settings http_max_connections)."""
    from runbooks.core.settings import Settings

    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    assert len(units) >= 5
    for unit in units:
        limit = re.search(r"^LimitNOFILE=(\d+)$", unit.read_text(), re.M)
        assert limit, f"{unit.name} sets no LimitNOFILE"
        if unit.name in ("cudamedic-alerts.service", "cudamedic-slack.service"):
            least = 2 * Settings.model_fields["http_max_connections"].default
            assert int(limit.group(1)) >= least, unit.name
