"""The alert path for real (issue 30): Alertmanager's webhook -> `cudamedic alerts` -> Prefect
event -> deploy/prefect.yaml's trigger -> a response on a worker of a process work pool, with
Prefect on the harness's PostgreSQL and two `cudamedic worker`s that share nothing but the API
and the lab's hosts (tests/fleet.py).

- An alert that names a container fixes that container and no other; with no container named, an
  unattended fix applies only where exactly one container's own evidence shows the fault.
- A fix that waits for a person is announced where approvers are (a Slack approvals channel,
  through the fake Slack Web API; a plain webhook, a local HTTP server), is listed by `cudamedic
  pending`, and holds no process: the worker that ran it stops on SIGTERM at once, and another
  worker finishes it once it is answered. A run created through the API names no requester, so
  two people approve it. One nobody answers ends `ApprovalTimedOut` on its own.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from uuid import UUID

import docker
import pytest

from tests.fleet import PREFECT, ROOT, Fleet, Pool, taken, use_api, work_pool, worker_env
from tests.lab.lab import LabState
from tests.slackfake import FakeSlack, fake_slack
from tests.test_deploy import flow_run_id
from tests.test_fix import GPU_WORKLOAD, IDLE, SHM_WORKLOAD
from tests.test_fleet import artifacts, responses_by, wait_final
from tests.test_flows import GPUS_ALL
from tests.test_slack import TOKEN

pytestmark = pytest.mark.fleet

CLI = str(Path(PREFECT[0]).parent / "cudamedic")
ALERT_TOKEN = secrets.token_hex(16)
APPROVAL_KEY = secrets.token_hex(16)
WEBHOOK_TOKEN = secrets.token_hex(8)
CHANNEL = "C0APPROVALS"
APPROVAL_S = 90  # the runbook's approval timeout in this module


class Webhook:
    """A team's plain webhook receiver: every POST, its headers and JSON body."""

    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, str], Any]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hook.posts.append((dict(self.headers), json.loads(body)))
                self.send_response(204)
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/cudamedic"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, run_id: str, timeout: float = 60) -> tuple[dict[str, str], Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for headers, body in list(self.posts):
                if body.get("run_id") == run_id:
                    return headers, body
            time.sleep(0.2)
        raise AssertionError(f"no webhook post for {run_id}: {self.posts}")


@dataclass
class Alerts:
    """What the module's tests share: the pool, the receiver's URL, Slack and the webhook."""

    pool: Pool
    url: str
    slack: FakeSlack
    hook: Webhook


@pytest.fixture(scope="module")
def alertpath(
    fleet: Fleet, lab: LabState, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Alerts]:
    root = tmp_path_factory.mktemp("alertpath")
    book = (ROOT / "runbooks" / "incident.yaml").read_text()
    book = book.replace("approval: 3600}", f"approval: {APPROVAL_S}}}")
    (root / "incident.yaml").write_text(book)
    hook = Webhook()
    with fake_slack() as slack:
        base = {
            **os.environ,
            "CUDAMEDIC_CONFIG": lab.config,
            "CUDAMEDIC_FLEET": "alertpath-" + uuid.uuid4().hex[:6],
            "CUDAMEDIC_RUNBOOK": str(root / "incident.yaml"),
            "CUDAMEDIC_POLICY": str(ROOT / "deploy" / "policy.example.yaml"),  # shm: unattended
            "CUDAMEDIC_FIX_SETTLE_S": "1.5",
            "CUDAMEDIC_ALERT_TOKEN": ALERT_TOKEN,
            "CUDAMEDIC_APPROVAL_KEY": APPROVAL_KEY,
            "CUDAMEDIC_APPROVER_OS_USERS": '{"alice": "U0ALICE", "carol": "U0CAROL"}',
            "CUDAMEDIC_SLACK_BOT_TOKEN": TOKEN,
            "CUDAMEDIC_SLACK_API_URL": slack.base_url,
            "CUDAMEDIC_SLACK_APPROVALS_CHANNEL": CHANNEL,
            "CUDAMEDIC_APPROVAL_WEBHOOK": hook.url,
            "CUDAMEDIC_APPROVAL_WEBHOOK_TOKEN": WEBHOOK_TOKEN,
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "INFO",  # the workers' logs say what ran
        }
        with work_pool(fleet.api_url, base, root, ("w1", "w2"), cudamedic=True) as pool:
            log = root / "alerts.log"
            receiver = subprocess.Popen(
                [CLI, "alerts", "--port", "0"],
                env=worker_env(pool.operator, pool.api_url, root / "receiver"),
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            pool.procs["receiver"] = receiver  # stopped with the workers
            deadline = time.monotonic() + 120
            while not (m := re.search(r"POST (http://\S+)", log.read_text())):
                assert receiver.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
            yield Alerts(pool=pool, url=m.group(1), slack=slack, hook=hook)
        hook.server.shutdown()


def post_alert(url: str, alertname: str, labels: dict[str, str]) -> dict[str, Any]:
    """One firing alert, as Alertmanager posts it (webhook version 4)."""
    import urllib.request

    alert = {
        "status": "firing",
        "labels": {"alertname": alertname, **labels},
        "annotations": {"summary": f"{alertname} on {labels.get('Hostname')}"},
        "startsAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fingerprint": uuid.uuid4().hex[:16],
    }
    body = {"version": "4", "status": "firing", "receiver": "cudamedic", "alerts": [alert]}
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {ALERT_TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def cli(pool: Pool, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`cudamedic ARGS` as an operator on another machine (its own state dir and HOME)."""
    return subprocess.run(
        [CLI, *args],
        env={**worker_env(pool.operator, pool.api_url, Path(pool.logs["w1"]).parent / "op"), **env},
        capture_output=True,
        text=True,
        timeout=420,
        stdin=subprocess.DEVNULL,
    )


def state_name(pool: Pool, run_id: str) -> str:
    from prefect import get_client

    with use_api(pool.api_url), get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
    return run.state.name if run.state else "?"


def wait_state(pool: Pool, run_id: str, name: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while (now := state_name(pool, run_id)) != name:
        assert time.monotonic() < deadline, f"{run_id} is {now}, not {name}\n{pool.worker_logs()}"
        time.sleep(0.5)


def started(container: Any) -> tuple[str, str]:
    container.reload()
    return container.id, container.attrs["State"]["StartedAt"]


def idle_gpu(make_container: Any, name: str) -> Any:
    """A healthy GPU workload that runs (it sees its GPUs, then works)."""
    return make_container(name, "nvidia-smi -L; " + IDLE, device_requests=GPUS_ALL)


def dead_of_shm(make_container: Any, name: str) -> Any:
    """A DataLoader-like workload dead of Docker's 64 MB /dev/shm."""
    c = make_container(name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    return c


def test_an_alert_that_names_a_container_fixes_that_one_only(
    alertpath: Alerts, make_container: Any, gpu_engine: docker.DockerClient
) -> None:
    """Two containers on one host; the alert names the dead one. The response is for it alone
    (the trigger passes the `container` label) and the running one is never touched (its id and
    start time are the same). Before issue 30 the label was dropped, the response covered the
    host and the fix recreated the first container it listed: the running one."""
    pool, n = alertpath.pool, uuid.uuid4().hex[:6]
    running = idle_gpu(make_container, f"t{n}-a-idle")
    dead = dead_of_shm(make_container, f"t{n}-b-shm2")
    before = started(running)
    answer = post_alert(
        alertpath.url, "ContainerDown", {"Hostname": "gpu-healthy", "container": dead.name}
    )
    assert answer["announced"] == [
        {"alert": "ContainerDown", "host": "gpu-healthy", "container": dead.name}
    ], answer
    (run_id,) = responses_by(pool, "alert ContainerDown", timeout=120)
    run = wait_final(pool, str(run_id))
    assert started(gpu_engine.containers.get(running.name)) == before  # never touched
    fixed = gpu_engine.containers.get(dead.name)
    assert fixed.status == "running" and fixed.attrs["HostConfig"]["ShmSize"] == 8 << 30
    assert run.parameters["container"] == dead.name, run.parameters
    assert run.state.name == "Fixed", f"{run.state}\n{pool.worker_logs()}"
    report = artifacts(pool, str(run_id))["postmortem-gpu-healthy"]
    assert dead.name in report and running.name not in report


def test_with_no_container_named_only_one_containers_own_evidence_allows_a_fix(
    alertpath: Alerts, make_container: Any, gpu_engine: docker.DockerClient
) -> None:
    """An alert for the host alone: the dead container's own log shows the fault and the
    running one's evidence shows none, so the dead one is fixed unattended and the other left
    alone. Then two dead containers show it: nothing is fixed without a person, and the report
    says to respond for each by name."""
    pool, n = alertpath.pool, uuid.uuid4().hex[:6]
    running = idle_gpu(make_container, f"t{n}-a-idle")
    dead = dead_of_shm(make_container, f"t{n}-b-shm")
    before = started(running)
    post_alert(alertpath.url, "NodeTrainingStalled", {"Hostname": "gpu-healthy"})
    (run_id,) = responses_by(pool, "alert NodeTrainingStalled", timeout=120)
    run = wait_final(pool, str(run_id))
    assert started(gpu_engine.containers.get(running.name)) == before  # never touched
    assert gpu_engine.containers.get(dead.name).attrs["HostConfig"]["ShmSize"] == 8 << 30
    assert not run.parameters.get("container"), run.parameters  # the host, no container
    assert run.state.name == "Fixed", f"{run.state}\n{pool.worker_logs()}"

    # Two containers whose own logs show the fault: no guess between them.
    one, two = (
        dead_of_shm(make_container, f"t{n}-c-shm"),
        dead_of_shm(make_container, f"t{n}-d-shm"),
    )
    ids = {c.name: started(c) for c in (one, two, gpu_engine.containers.get(running.name))}
    out = cli(pool, "triage", "gpu-healthy", "--apply", "--no-input")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outcome:   needs-a-person" in out.stdout, out.stdout
    assert {c: started(gpu_engine.containers.get(c)) for c in ids} == ids  # nothing touched
    report = Path(re.search(r"^report:\s+(\S+)", out.stdout, re.M).group(1)).read_text()  # type: ignore[union-attr]
    assert f"the fault in 2 containers ({one.name}, {two.name}): respond for each" in report, report


def test_a_waiting_approval_reaches_people_and_outlives_its_worker(
    alertpath: Alerts, make_container: Any, gpu_engine: docker.DockerClient
) -> None:
    """Two responses started with `prefect deployment run` (nobody's Slack thread, no terminal)
    wait for a person: each is announced to the approvals channel and the webhook, listed by
    `cudamedic pending`, and Suspended: no process holds it. The worker that ran the first stops
    on SIGTERM within seconds. The first is approved by two people (who started it is unknown:
    anyone with the API could have), and the other worker finishes it. The second, unanswered,
    ends ApprovalTimedOut on its own."""
    pool, slack, hook = alertpath.pool, alertpath.slack, alertpath.hook
    n = uuid.uuid4().hex[:6]
    names = [f"t{n}-gpu{i}" for i in (1, 2)]
    for name in names:  # wants GPUs, got none: gpu-not-requested (not unattended in the policy)
        make_container(name, GPU_WORKLOAD, environment={"NVIDIA_VISIBLE_DEVICES": "all"})
    time.sleep(1)
    marks = pool.marks()
    runs = []
    for name in names:
        ran = pool.prefect(
            "deployment", "run", "incident-response/incident-response",
            "--param", "target=gpu-healthy", "--param", f"container={name}",
        )  # fmt: skip
        assert ran.returncode == 0, ran.stdout + ran.stderr
        runs.append(flow_run_id(ran.stdout))
    first, second = runs
    for run_id in runs:
        wait_state(pool, run_id, "Suspended")
    # Waiting holds no process: each run's process exits once it has suspended (a few seconds
    # after the state is set: it flushes its logs and events first).
    deadline = time.monotonic() + 60
    while _processes_of(runs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_of(runs), _processes_of(runs)

    # The worker that ran the first stops on SIGTERM (what `systemctl stop` sends) at once.
    took = {w: taken(pool.logs[w].read_bytes()[marks[w] :].decode(errors="replace")) for w in marks}
    (ran_it,) = [w for w, ids in took.items() if first in ids]
    other = next(w for w in ("w1", "w2") if w != ran_it)
    pool.procs[ran_it].send_signal(signal.SIGTERM)
    pool.procs[ran_it].wait(timeout=30)

    # Who started it is not established: carol's approval is one of two (taken first: it must
    # come within APPROVAL_S of the question, alice's within APPROVAL_S of carol's).
    as_carol = cli(pool, "approve", first, "--reason", "GPUs missing", SUDO_USER="carol")
    assert as_carol.returncode == 0 and "taken: approve by U0CAROL" in as_carol.stdout, (
        as_carol.stdout + as_carol.stderr + pool.worker_logs()
    )
    wait_state(pool, first, "Suspended")
    assert gpu_engine.containers.get(names[0]).attrs["HostConfig"]["DeviceRequests"] is None

    # Where approvers are: the webhook and the Slack approvals channel, with the plan.
    headers, body = hook.wait_for(first)
    assert headers["Authorization"] == f"Bearer {WEBHOOK_TOKEN}"
    assert body["event"] == "cudamedic.approval.waiting" and body["container"] == names[0]
    assert "+ --gpus all" in body["diff"] and body["approve"] == f"cudamedic approve {first}"
    posted = _slack_approval(slack, first)
    assert posted["args"]["channel"] == CHANNEL
    assert "+ --gpus all" in json.dumps(posted["args"]["blocks"])
    # ... and `cudamedic pending` on any machine.
    listed = cli(pool, "pending", "--json")
    assert listed.returncode == 0, listed.stderr
    waiting = {a["run_id"]: a for a in json.loads(listed.stdout)["approvals"]}
    assert set(runs) <= set(waiting), waiting
    assert waiting[first]["state"] == "Suspended" and waiting[first]["container"] == names[0]
    assert waiting[first]["requester"].startswith("api:"), waiting[first]

    as_alice = cli(pool, "approve", first, SUDO_USER="alice")
    assert as_alice.returncode == 0, as_alice.stdout + as_alice.stderr
    run = wait_final(pool, first)
    assert run.state.name == "Fixed", f"{run.state}\n{pool.worker_logs()}"
    assert first in taken(pool.logs[other].read_text(errors="replace"))  # the other worker
    out = gpu_engine.containers.get(names[0]).exec_run(["nvidia-smi", "-L"]).output.decode()
    assert out.count("GPU ") == 8
    report = artifacts(pool, first)["postmortem-gpu-healthy"]
    assert "approve by U0CAROL and U0ALICE" in report, report
    assert "started through the Prefect API" in report and "ran `cudamedic triage`" not in report

    # The trail: how each identity was established.
    trail = cli(pool, "audit", "--json", "--host", "gpu-healthy", "--since", "1h")
    events = [e for e in json.loads(trail.stdout)["events"] if e["record"].get("flow_run") == first]
    said = [
        (e["event"], e["record"].get("established")) for e in events if "decision" in e["record"]
    ]
    assert said == [
        ("cudamedic.approval.approved", "trusted-host"),
        ("cudamedic.approval.approved", "trusted-host"),
    ], said
    assert "cudamedic.approval.waiting" in [e["event"] for e in events]

    # Nobody answered the second: it ends on its own, reported, nothing changed.
    run = wait_final(pool, second, timeout=APPROVAL_S + 240)
    assert run.state.name == "ApprovalTimedOut", f"{run.state}\n{pool.worker_logs()}"
    assert gpu_engine.containers.get(names[1]).attrs["HostConfig"]["DeviceRequests"] is None
    assert "nobody answered" in artifacts(pool, second)["postmortem-gpu-healthy"]


def test_a_worker_warns_when_no_approval_reaches_anyone_and_stops_on_sigterm(
    alertpath: Alerts, tmp_path: Path
) -> None:
    pool = alertpath.pool
    env = worker_env(pool.operator, pool.api_url, tmp_path / "w3")
    for key in ("CUDAMEDIC_SLACK_APPROVALS_CHANNEL", "CUDAMEDIC_APPROVAL_WEBHOOK"):
        env.pop(key)
    log = tmp_path / "w3.log"
    proc = subprocess.Popen(
        [CLI, "worker", "--name", "w3", "--limit", "1"],  # the pool from CUDAMEDIC_WORK_POOL
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while "started!" not in log.read_text() and "Worker" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.3)
        text = log.read_text()
        assert "warning: no approval channel is configured" in text, text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _slack_approval(slack: FakeSlack, run_id: str) -> dict[str, Any]:
    return slack.wait_for(
        lambda c: (
            c["method"] == "chat.postMessage"
            and c["args"].get("channel") == CHANNEL
            and run_id in json.dumps(c["args"].get("blocks") or "")
        ),
        timeout=60,
    )


def _processes_of(run_ids: list[str]) -> list[int]:
    """The processes whose environment names one of these flow runs (PREFECT__FLOW_RUN_ID,
    set by the process worker for each run it starts)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if any(f"PREFECT__FLOW_RUN_ID={r}".encode() in environ for r in run_ids):
            found.append(int(proc.name))
    return found
