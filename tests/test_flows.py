"""The Prefect flows on a real Prefect server and the lab: `cudamedic triage` (dry run, approval,
rejection, two triggers at once, unattended policy and the circuit breaker) and `cudamedic sweep`.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import docker
import pytest
import yaml
from docker.types import DeviceRequest

from runbooks.core.settings import Settings
from tests.lab.lab import LabState, _free_port
from tests.test_fix import (  # noqa: F401 - fixtures
    CLI,
    SHM_WORKLOAD,
    cli_env,
    fix_settings,
    volume,
    volume_text,
)

GPUS_ALL = [DeviceRequest(count=-1, capabilities=[["gpu"]])]


@pytest.fixture
def env(prefect_api: str, lab: LabState, fix_settings: Settings) -> dict[str, str]:  # noqa: F811
    # Root run by alice through sudo: answers from this CLI are `os:alice`
    # (runbooks/fix/approvals.py).
    return cli_env(lab, fix_settings, PREFECT_API_URL=prefect_api, SUDO_USER="alice")


def cudamedic(
    env: dict[str, str], *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def field(out: str, name: str) -> str:
    m = re.search(rf"^{name}:\s+(.*)$", out, re.M)
    assert m, f"no {name}: line in\n{out}"  # callers pass stdout + stderr on failure
    return m.group(1).strip()


def shm_container(make_container: Any, name: str, vol: str) -> Any:
    c = make_container(
        name, SHM_WORKLOAD, volumes={vol: {"bind": "/data"}}, device_requests=GPUS_ALL
    )
    c.wait(timeout=30)  # dd fails on Docker's 64 MB /dev/shm and the container exits
    return c


def artifacts_of(run_id: str) -> dict[str, str]:
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)]))
        )
    return {a.key or "": str(a.data) for a in arts}


def flow_run_of(run_id: str) -> Any:
    from uuid import UUID

    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(run_id))


def logs_of(run_id: str, expect: str, timeout: float = 15) -> list[Any]:
    """The flow run's logs as the Prefect API has them (the UI's Logs tab), once `expect` is in."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))
            )
        if any(expect in log.message for log in logs) or time.monotonic() > deadline:
            return list(logs)
        time.sleep(0.5)


def run_id_of(out: str) -> str:
    m = re.search(r"/runs/flow-run/([0-9a-f-]{36})", out)
    assert m, out
    return m.group(1)


def test_triage_dry_run_diagnoses_plans_and_reports(
    env: dict[str, str],
    make_container,
    container_name: str,
    gpu_engine,
    volume: str,  # noqa: F811
) -> None:
    c = shm_container(make_container, container_name, volume)
    done = cudamedic(
        env,
        "triage",
        "gpu-healthy",
        "--container",
        container_name,
        "--trigger",
        "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error.",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert field(out, "incident").startswith("shm-too-small (confidence 0.9")
    assert "+ --shm-size 8g" in out
    assert field(out, "outcome").startswith("planned: dry run")
    report = Path(field(out, "report"))
    text = report.read_text()
    assert "## Root cause" in text and "shm-too-small" in text and "Bus error" in text
    assert gpu_engine.containers.get(container_name).id == c.id, "a dry run changes nothing"
    run_id = run_id_of(out)
    arts = artifacts_of(run_id)
    assert "postmortem-gpu-healthy" in arts and "## Timeline" in arts["postmortem-gpu-healthy"]
    assert "Traceback" not in done.stderr
    # The operator's view in the Prefect UI: a name that says what, tags for host and class,
    # and each step's INFO log (the terminal stays quiet).
    run = flow_run_of(run_id)
    assert run.name.startswith(f"triage-gpu-healthy-{container_name}"), run.name
    assert {"host:gpu-healthy", "incident:shm-too-small", "outcome:planned"} <= set(run.tags)
    logs = logs_of(run_id, "fix planned")
    info = [log.message for log in logs if log.level == 20]
    for step in ("evidence collected", "diagnosed: shm-too-small", "fix planned"):
        assert any(m.startswith(step) for m in info), (step, info)
    tasks = {log.task_run_id for log in logs if log.level == 20 and log.task_run_id}
    assert len(tasks) >= 4, info  # collect, classify, plan, report: each says how it ended
    assert "evidence collected" not in done.stderr and "INFO" not in done.stderr, done.stderr


def test_triage_waits_for_approval_then_fixes_verifies_and_reports(
    env: dict[str, str],
    make_container,
    container_name: str,
    gpu_engine,
    volume: str,  # noqa: F811
) -> None:
    shm_container(make_container, container_name, volume)
    data = volume_text(gpu_engine, volume)
    proc = subprocess.Popen(
        [
            *CLI,
            "triage",
            "gpu-healthy",
            "--container",
            container_name,
            "--apply",
            "--no-input",
            "--trigger",
            "train job died: Bus error",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        run_id = None
        deadline = time.monotonic() + 120
        while run_id is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"waiting for approval: `cudamedic approve ([0-9a-f-]{36})`", line):
                run_id = m.group(1)
        assert run_id, "".join(lines)
        plan = "".join(lines)
        assert "+ --shm-size 8g" in plan and "the original error does not recur" in plan
        # Nothing happens while it waits.
        assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] == 64 << 20
        ok = cudamedic(env, "approve", run_id, "--reason", "shm is the cause")
        assert ok.returncode == 0, ok.stderr
        assert "approve sent" in ok.stdout and "taken: approve by os:alice" in ok.stdout
        rest, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out + err
    assert field(out, "outcome").startswith("fixed")
    assert field(out, "approval") == "approve by os:alice (shm is the cause)"
    new = gpu_engine.containers.get(container_name)
    assert new.status == "running" and new.attrs["HostConfig"]["ShmSize"] == 8 << 30
    assert volume_text(gpu_engine, volume) == data
    report = Path(field(out, "report")).read_text()
    assert "Approval: approve by os:alice" in report
    assert re.search(r"^- \d\d:\d\d:\d\d — waiting for approval: cudamedic approve", report, re.M)
    assert "/runs/flow-run/" + run_id in report
    assert "verified" in report.lower()
    # A second answer changes nothing and says so.
    again = cudamedic(env, "approve", run_id, "--reject")
    assert again.returncode == 2 and "is not waiting for approval" in again.stderr
    assert "Traceback" not in err


def test_rejected_fix_changes_nothing(
    env: dict[str, str],
    make_container,
    container_name: str,
    gpu_engine,
    volume: str,  # noqa: F811
) -> None:
    c = shm_container(make_container, container_name, volume)
    proc = subprocess.Popen(
        [*CLI, "triage", "gpu-healthy", "--container", container_name, "--apply", "--no-input"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        run_id = None
        for line in proc.stdout:
            if m := re.search(r"cudamedic approve ([0-9a-f-]{36})` \(or", line):
                run_id = m.group(1)
                break
        assert run_id
        no = cudamedic(env, "approve", run_id, "--reject", "--reason", "mid-epoch")
        assert no.returncode == 0, no.stderr
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 4
    assert field(rest, "outcome") == "rejected: rejected by os:alice; nothing was changed"
    state = flow_run_of(run_id).state  # a filter on the state in the UI finds it
    assert (state.type.value, state.name) == ("COMPLETED", "Rejected"), state
    assert "rejected by os:alice" in (state.message or "")
    assert gpu_engine.containers.get(container_name).id == c.id
    assert "Approval: reject by os:alice (mid-epoch)" in Path(field(rest, "report")).read_text()


def test_a_response_whose_worker_dies_is_marked_crashed_and_the_next_one_fixes(
    env: dict[str, str],
    make_container,
    container_name: str,
    gpu_engine,
    volume: str,  # noqa: F811
) -> None:
    """Issue 17, workers that die: the response's whole process tree is killed (SIGKILL) while it
    waits for approval; the crash-detection automation (flows/automations.py, set up by the
    response itself) sees its heartbeats stop and sets the run Crashed. A new response for the
    container then runs to the end."""
    import os
    import signal

    shm_container(make_container, container_name, volume)
    env = {**env, "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30", "CUDAMEDIC_CRASH_AFTER_S": "45"}
    argv = [*CLI, "triage", "gpu-healthy", "--container", container_name, "--apply", "--no-input"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        run_id = None
        for line in proc.stdout:
            if m := re.search(r"cudamedic approve ([0-9a-f-]{36})` \(or", line):
                run_id = m.group(1)
                break
        assert run_id
        assert flow_run_of(run_id).state.type.value == "PAUSED"
        time.sleep(5)  # its first heartbeat is out
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 180
    while (state := flow_run_of(run_id).state).type.value != "CRASHED":
        assert time.monotonic() < deadline, f"still {state.type.value} after 180 s"
        time.sleep(3)
    assert "No heartbeat for 45 s" in (state.message or ""), state
    again = cudamedic(
        env, "triage", "gpu-healthy", "--container", container_name, "--apply", "--yes"
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] > 64 << 20


def test_bad_approvals_are_clear_errors(env: dict[str, str]) -> None:
    bad = cudamedic(env, "approve", "not-a-run-id")
    assert bad.returncode == 2 and "is not a flow run id" in bad.stderr
    unknown = cudamedic(env, "approve", "00000000-0000-0000-0000-000000000000")
    assert unknown.returncode == 2 and "no flow run" in unknown.stderr
    claimed = cudamedic(env, "approve", "00000000-0000-0000-0000-000000000000", "--by", "carol")
    assert claimed.returncode == 2 and "--by is gone" in claimed.stderr


def test_unattended_policy_and_the_circuit_breaker(
    env: dict[str, str],
    make_container,
    container_name: str,
    tmp_path: Path,
    volume: str,  # noqa: F811
) -> None:
    book = (Path(__file__).parents[1] / "runbooks" / "incident.yaml").read_text()
    book = book.replace("unattended: {}", "unattended: {shm-too-small: ['*']}")
    book = book.replace("max_unattended_fixes: 3", "max_unattended_fixes: 1")
    book = book.replace("approval: 3600", "approval: 6")
    (tmp_path / "incident.yaml").write_text(book)
    env = {**env, "CUDAMEDIC_RUNBOOK": str(tmp_path / "incident.yaml")}
    assert cudamedic(env, "breaker", "reset").returncode == 0
    try:
        names = [f"{container_name}-{i}" for i in (1, 2)]
        for n in names:
            shm_container(make_container, n, volume)
        first = cudamedic(
            env, "triage", "gpu-healthy", "--container", names[0], "--apply", "--no-input"
        )
        assert field(first.stdout, "outcome").startswith("fixed"), first.stdout + first.stderr
        assert field(first.stdout, "approval") == "approve by policy (runbook policy)"
        # The breaker allows one unattended fix per window: the second waits for a person,
        # nobody answers within the runbook's 6 s, nothing changes.
        second = cudamedic(
            env, "triage", "gpu-healthy", "--container", names[1], "--apply", "--no-input"
        )
        assert second.returncode == 4, second.stdout + second.stderr
        assert field(second.stdout, "outcome").startswith("approval-timed-out")
        assert flow_run_of(run_id_of(second.stdout)).state.name == "ApprovalTimedOut"
        assert flow_run_of(run_id_of(first.stdout)).state.name == "Fixed"
        report = Path(field(second.stdout, "report")).read_text()
        assert "unattended fix held" in report and "circuit breaker tripped" in report
        status = cudamedic(env, "breaker", "status")
        assert status.returncode == 1 and status.stdout.startswith("OPEN")
    finally:
        reset = cudamedic(env, "breaker", "reset")
    assert reset.returncode == 0 and "reset by" in reset.stdout
    assert cudamedic(env, "breaker", "status").returncode == 0


# -- the fleet sweep ---------------------------------------------------------------------------
EXPECTED = {  # lab host -> (verdict, finding codes) with nccl-tests on
    "gpu-healthy": ("healthy", set()),
    # gpu-xid79 runs NVIDIA DCGM: its recorded health report warns of a power clock event
    "gpu-xid79": ("drain", {"xid-79@0000:02:00", "dcgm-health-power@gpu0"}),
    "gpu-nodriver": ("drain", {"driver-not-loaded"}),
    "gpu-mismatch": ("drain", {"driver-library-mismatch"}),
    "gpu-slow-nccl": ("warning", {"nccl-bandwidth-low"}),
    "gpu-notoolkit": ("warning", {"toolkit-missing"}),
    "gpu-nohook": ("warning", {"toolkit-old"}),  # nvidia-ctk 1.12.0, under the 1.13 floor
    "gpu-hang": ("drain", {"nvidia-smi-hung"}),
}


def sweep_runbook(tmp_path: Path, **edits: str) -> Path:
    book = (Path(__file__).parents[1] / "runbooks" / "sweep.yaml").read_text()
    for old, new in edits.items():
        assert old in book
        book = book.replace(old, new)
    path = tmp_path / "sweep.yaml"
    path.write_text(book)
    return path


def test_sweep_reports_each_planted_problem_once(
    env: dict[str, str],
    tmp_path: Path,
    gpu_engine: docker.DockerClient,
    plain_engine: docker.DockerClient,
) -> None:
    # `make demo` leaves its train-* containers on the lab engines; they are not planted here.
    for engine in (gpu_engine, plain_engine):
        for c in engine.containers.list(all=True, filters={"name": "train-"}):
            c.remove(force=True)
    env = {
        **env,
        "CUDAMEDIC_SWEEP_RUNBOOK": str(
            sweep_runbook(tmp_path, **{"nccl_tests: false": "nccl_tests: true"})
        ),
    }
    first = cudamedic(env, "sweep")
    assert first.returncode == 0, first.stdout + first.stderr
    report = Path(field(first.stdout, "report"))
    text = report.read_text()
    for host, (verdict, found) in EXPECTED.items():
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| {host} |"))
        assert re.search(rf"\| (\*\*)?{verdict}(\*\*)? \|", row), row
        for code in found:
            assert code in row, row
    assert set(changes(first.stdout, "new")) == {
        (h, c) for h, (_, cs) in EXPECTED.items() for c in cs
    }, first.stdout
    assert len(changes(first.stdout, "new")) == sum(len(cs) for _, cs in EXPECTED.values())
    assert "8 hosts" in first.stdout and "4 drain, 3 warning, 1 healthy" in first.stdout
    assert re.fullmatch(r"sweep-all-\d{8}-\d{6}", flow_run_of(run_id_of(first.stdout)).name)
    # A drained host carries the incident flow's diagnosis.
    assert re.search(r"gpu-xid79 \|.*gpu-hardware-fault", text), text
    second = cudamedic(env, "sweep")
    assert second.returncode == 0, second.stderr
    assert "nothing new, changed or resolved since the last sweep" in second.stdout
    assert changes(second.stdout, "new") == []
    drain = cudamedic(env, "sweep", "--host", "gpu-nodriver", "--fail-on-drain")
    assert drain.returncode == 1


def changes(out: str, kind: str) -> list[tuple[str, str]]:
    """(host, finding key) of each `kind` line of `cudamedic sweep`."""
    return [
        (host, code + (f"@{subject}" if subject else ""))
        for host, code, subject in re.findall(
            rf"^  {kind}\s+(\S+): (\S+)(?: \(([^)]+)\))?", out, re.M
        )
    ]


def test_sweep_sees_container_flags_and_their_resolution(
    env: dict[str, str], make_container, container_name: str, gpu_engine: docker.DockerClient
) -> None:
    make_container(container_name, "sleep 3600", device_requests=GPUS_ALL)
    first = cudamedic(env, "sweep", "--host", "gpu-healthy")
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(
        rf"new\s+gpu-healthy: container-shm-small \({container_name}\) \[warning\]", first.stdout
    ), first.stdout
    make_container(container_name + "-x", "sleep 1")  # no GPU: not the sweep's business
    assert "nothing new" in cudamedic(env, "sweep", "--host", "gpu-healthy").stdout
    gpu_engine.containers.get(container_name).remove(force=True)
    third = cudamedic(env, "sweep", "--host", "gpu-healthy")
    assert re.search(
        rf"resolved\s+gpu-healthy: container-shm-small \({container_name}\)", third.stdout
    ), third.stdout


def test_sweep_state_lives_in_prefect_not_on_the_workers_disk(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 17: a sweep run with another STATE_DIR and HOME (another worker) knows what the first
    one saw, from the Prefect server alone; another fleet on the same server does not; an old
    STATE_DIR/sweep-state.json is taken over once; nothing is written to the state dir."""
    first = cudamedic(env, "sweep", "--host", "gpu-nodriver")
    assert first.returncode == 0, first.stdout + first.stderr
    assert ("gpu-nodriver", "driver-not-loaded") in changes(first.stdout, "new"), first.stdout
    other = {
        **env,
        "CUDAMEDIC_STATE_DIR": str(tmp_path / "worker-b" / "state"),
        "HOME": str(tmp_path / "worker-b"),
    }
    second = cudamedic(other, "sweep", "--host", "gpu-nodriver")
    assert second.returncode == 0, second.stdout + second.stderr
    # (other tests' containers on the lab engine may come and go: judge the host's own finding)
    assert ("gpu-nodriver", "driver-not-loaded") not in changes(second.stdout, "new"), second.stdout
    assert "1 hosts" in second.stdout and "1 drain" in second.stdout
    assert not (tmp_path / "worker-b" / "state" / "sweep-state.json").exists()
    # Another fleet: its own state. An older cudamedic's state file is its starting point.
    legacy = tmp_path / "legacy-state"
    legacy.mkdir()
    (legacy / "sweep-state.json").write_text(
        json.dumps(
            {
                "hosts": {
                    "gpu-nodriver": {
                        "driver-not-loaded": {
                            "code": "driver-not-loaded",
                            "level": "drain",
                            "message": "m",
                        }
                    }
                }
            }
        )
    )
    third = cudamedic(
        {
            **env,
            "CUDAMEDIC_FLEET": env["CUDAMEDIC_FLEET"] + "-b",
            "CUDAMEDIC_STATE_DIR": str(legacy),
        },
        "sweep",
        "--host",
        "gpu-nodriver",
    )
    assert third.returncode == 0, third.stdout + third.stderr
    assert ("gpu-nodriver", "driver-not-loaded") not in changes(third.stdout, "new"), third.stdout
    fourth = cudamedic(
        {**env, "CUDAMEDIC_FLEET": env["CUDAMEDIC_FLEET"] + "-c"}, "sweep", "--host", "gpu-nodriver"
    )
    assert ("gpu-nodriver", "driver-not-loaded") in changes(fourth.stdout, "new"), fourth.stdout


def test_sweep_sees_image_drift_and_a_cuda_cache_that_keeps_growing(
    env: dict[str, str], container_name: str, gpu_engine: docker.DockerClient
) -> None:
    """Issue 16's checklist, on the real engine: a container whose tag was moved to another image
    (`docker commit` onto the same tag) is drift; its `~/.nv/ComputeCache` (busybox `du -sk` in
    the container) growing 80 MiB between two sweeps is a finding, which resolves once it stops."""
    from tests.lab.lab import IMAGE

    ref = f"{container_name}-img:v1"
    gpu_engine.images.get(IMAGE).tag(ref)
    c = gpu_engine.containers.run(
        ref,
        ["sh", "-c", "mkdir -p /root/.nv/ComputeCache && sleep 3600"],
        name=container_name,
        detach=True,
        network_mode="none",
        shm_size="1g",
        device_requests=GPUS_ALL,
    )
    cache = "/root/.nv/ComputeCache"

    def grow(name: str, mib: int) -> None:
        res = c.exec_run(["dd", "if=/dev/zero", f"of={cache}/{name}", "bs=1048576", f"count={mib}"])
        assert res.exit_code == 0, res.output

    try:
        grow("a", 8)
        first = cudamedic(env, "sweep", "--host", "gpu-healthy")
        assert first.returncode == 0, first.stdout + first.stderr
        mine = [k for h, k in changes(first.stdout, "new") if container_name in k]
        assert mine == [], first.stdout  # one measure is no growth; the tag still names it
        c.commit(repository=ref.split(":")[0], tag="v1")  # the tag moves to a new image
        grow("b", 80)
        second = cudamedic(env, "sweep", "--host", "gpu-healthy")
        assert second.returncode == 0, second.stdout + second.stderr
        assert ("gpu-healthy", f"container-image-drift@{container_name}") in changes(
            second.stdout, "new"
        ), second.stdout
        assert ("gpu-healthy", f"container-cuda-cache-growing@{container_name}") in changes(
            second.stdout, "new"
        ), second.stdout
        assert re.search(rf"{container_name}: the CUDA JIT cache grew 8\d MiB", second.stdout)
        assert re.search(rf"{container_name} runs sha256:\w+ but its tag {ref}", second.stdout)
        third = cudamedic(env, "sweep", "--host", "gpu-healthy")
        assert ("gpu-healthy", f"container-cuda-cache-growing@{container_name}") in changes(
            third.stdout, "resolved"
        ), third.stdout
        assert not [k for h, k in changes(third.stdout, "new") if container_name in k]
    finally:
        c.remove(force=True)
        gpu_engine.images.remove(ref, force=True)


def test_sweep_survives_an_unreachable_host_and_garbage_inventory(
    env: dict[str, str], tmp_path: Path, lab: LabState
) -> None:
    inv = yaml.safe_load(Path(lab.inventory).read_text())
    inv["hosts"]["ghost"] = {
        **inv["hosts"]["gpu-healthy"],
        "port": _free_port(),
    }  # closed again: refused
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(inv))
    done = cudamedic(
        env, "sweep", "--inventory", str(path), "--host", "ghost", "--host", "gpu-healthy"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"new\s+ghost: host-unreachable \[warning\]", done.stdout), done.stdout
    (tmp_path / "bad.yaml").write_text("hosts: [1, 2")
    bad = cudamedic(env, "sweep", "--inventory", str(tmp_path / "bad.yaml"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr


def test_triage_fixes_the_busybox_bus_error_on_a_host_without_gpus(
    env: dict[str, str],
    make_container,
    container_name: str,
    lab: LabState,
    plain_engine,
    tmp_path: Path,
) -> None:
    from tests.test_fix import BUS_ERROR, busybox_on_cpu_host

    c, extra = busybox_on_cpu_host(make_container, container_name, plain_engine, tmp_path)
    env = {**env, "CUDAMEDIC_DOCKER_HOST": lab.engines["plain"].url, **extra}
    done = cudamedic(
        env, "triage", "local", "--container", container_name, "--apply", "--yes", "--no-input"
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert field(out, "incident").startswith("shm-too-small"), out
    assert field(out, "outcome").startswith("fixed"), out
    new = plain_engine.containers.get(container_name)
    assert new.id != c.id and new.attrs["HostConfig"]["ShmSize"] >= 1 << 30
    assert BUS_ERROR not in new.logs().decode()
    report = Path(field(out, "report")).read_text()
    assert "wants GPUs" not in report and "whose GPUs work" not in report


def test_triage_of_a_mistyped_container_is_an_error(
    env: dict[str, str], make_container, container_name: str
) -> None:
    make_container(container_name, "sleep 60")
    done = cudamedic(env, "triage", "gpu-healthy", "--container", container_name + "-nope")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"no container named '{container_name}-nope'" in done.stderr
    assert container_name in done.stderr and "Traceback" not in done.stderr
    assert "incident:" not in done.stdout
