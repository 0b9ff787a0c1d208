"""Faults around the Prefect flows: the Prefect server restarted while a fix waits for approval,
the process running a flow killed mid-fix (the run is Crashed; a retry finishes or rolls back
the interrupted fix first and fixes once), and two triggers for one host at the same moment.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from uuid import UUID

import docker

from runbooks.core.settings import Settings
from tests.conftest import PREFECT_TEST_HOME, PREFECT_TEST_PORT
from tests.reliability.figures import record, zero
from tests.test_deploy import background, env, flow_run_id, prefect  # noqa: F401 - fixtures
from tests.test_fix import CLI, fix_settings, volume, volume_text  # noqa: F401 - fixtures
from tests.test_flows import cudamedic, field, shm_container

SUITE = "faults: flows"
BIN = Path(sys.executable).parent


def _backups(engine: docker.DockerClient, name: str) -> list[str]:
    return [
        c.name
        for c in engine.containers.list(all=True)
        if c.name.startswith(name + "-cudamedic-backup")
    ]


def test_prefect_server_restarted_while_a_fix_waits_for_approval(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: docker.DockerClient,
    volume: str,  # noqa: F811
) -> None:
    from flows.server import ensure_local_server, stop_local_server

    shm_container(make_container, container_name, volume)
    data = volume_text(gpu_engine, volume)
    proc = subprocess.Popen(
        [*CLI, "triage", "gpu-healthy", "--container", container_name, "--apply", "--no-input"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    server = Settings(prefect_port=PREFECT_TEST_PORT, prefect_home=PREFECT_TEST_HOME)
    try:
        assert proc.stdout is not None
        run_id = None
        for line in proc.stdout:
            if m := re.search(r"cudamedic approve ([0-9a-f-]{36})` \(or", line):
                run_id = m.group(1)
                break
        assert run_id
        down_at = time.monotonic()
        assert stop_local_server(server)
        ensure_local_server(server)  # the same SQLite database: the paused run is still there
        outage = time.monotonic() - down_at
        ok = cudamedic(env, "approve", run_id)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        rest, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest + err
    assert field(rest, "outcome").startswith("fixed"), rest
    new = gpu_engine.containers.get(container_name)
    assert new.attrs["HostConfig"]["ShmSize"] == 8 << 30
    assert volume_text(gpu_engine, volume) == data
    record(SUITE, "server restart while waiting for approval: outage (s)", round(outage, 1))
    zero(SUITE, "server restart while waiting for approval: approvals lost", 0)


def _run_state(run_id: str) -> str:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
    return run.state.name if run.state else "?"


def _serve(start: Any, environ: dict[str, str], log: Path) -> Any:
    proc = start([str(BIN / "cudamedic"), "serve"], environ, log)
    deadline = time.monotonic() + 90
    while "Your deployments are being served" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    return proc


def test_flow_process_killed_mid_fix_is_crashed_and_a_retry_fixes_once(
    env: dict[str, str],  # noqa: F811
    background: Any,  # noqa: F811
    tmp_path: Path,
    make_container: Any,
    container_name: str,
    gpu_engine: docker.DockerClient,
    volume: str,  # noqa: F811
) -> None:
    shm_container(make_container, container_name, volume)
    data = volume_text(gpu_engine, volume)
    # A run started through the API has no up-front approval (`approved_by` counts only for a
    # run the CLI started in its own process): the served runbook's policy allows the fix.
    book = (Path(__file__).parents[2] / "runbooks" / "incident.yaml").read_text()
    (tmp_path / "incident.yaml").write_text(
        book.replace("unattended: {}", "unattended: {shm-too-small: ['*']}")
    )
    env = {
        **env,
        "CUDAMEDIC_SWEEP_SCHEDULE": "0 0 1 1 *",
        "CUDAMEDIC_RUNBOOK": str(tmp_path / "incident.yaml"),
    }
    assert subprocess.run([*CLI, "breaker", "reset"], env=env, timeout=120).returncode == 0
    args = [
        "deployment",
        "run",
        "incident-response/incident-response",
        "--param",
        "target=gpu-healthy",
        "--param",
        f"container={container_name}",
        "--watch",
    ]
    # The runner's flow processes die (SIGKILL) right after the new container started.
    serving = _serve(background, {**env, "CUDAMEDIC_CRASH_AT": "start:done"}, tmp_path / "a.log")
    first = prefect(env, *args)
    crashed = _run_state(flow_run_id(first.stdout))
    assert crashed == "Crashed", first.stdout + first.stderr + (tmp_path / "a.log").read_text()
    serving.send_signal(signal.SIGINT)
    serving.wait(timeout=30)
    # The retry: the interrupted fix is rolled back first, then the fix is made once.
    _serve(background, env, tmp_path / "b.log")
    start = time.monotonic()
    second = prefect(env, *args, timeout=400)
    retry_s = time.monotonic() - start
    assert second.returncode == 0, second.stdout + second.stderr + (tmp_path / "b.log").read_text()
    assert _run_state(flow_run_id(second.stdout)) == "Fixed"  # a named Completed state
    log = (tmp_path / "b.log").read_text()
    assert "interrupted fix finished" in log, log
    new = gpu_engine.containers.get(container_name)
    assert new.status == "running" and new.attrs["HostConfig"]["ShmSize"] == 8 << 30
    backups = _backups(gpu_engine, container_name)
    names = [
        c.name for c in gpu_engine.containers.list(all=True) if c.name.startswith(container_name)
    ]
    assert volume_text(gpu_engine, volume) == data
    record(
        SUITE, "flow process killed mid-fix: run state", crashed, "Crashed", crashed == "Crashed"
    )
    zero(SUITE, "flow process killed mid-fix: double fixes after the retry", len(backups) - 1)
    zero(SUITE, "flow process killed mid-fix: duplicate containers", len(names) - 2)
    record(SUITE, "flow process killed mid-fix: retry to report (s)", round(retry_s, 1))
    assert len(backups) == 1 and len(names) == 2, names


def test_two_triggers_for_one_host_at_once_fix_it_once(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: docker.DockerClient,
    volume: str,  # noqa: F811
) -> None:
    shm_container(make_container, container_name, volume)
    args = [*CLI, "triage", "gpu-healthy", "--container", container_name, "--apply", "--yes"]
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    codes = [p.returncode for p in procs]
    outcomes = []
    for (out, err), code in zip(outs, codes, strict=True):
        assert "Traceback" not in err, out + err
        if "outcome:" in out:
            outcomes.append(field(out, "outcome").split(":")[0])
        else:  # the later one found the other's fix holding the lock: refused, nothing written
            assert code == 4 and "refused: another fix of gpu-healthy/" in err, (code, out, err)
            outcomes.append("locked")
    backups = _backups(gpu_engine, container_name)
    zero(SUITE, "two triggers at once: extra fixes", outcomes.count("fixed") - 1)
    zero(SUITE, "two triggers at once: extra backups", len(backups) - 1)
    assert outcomes.count("fixed") == 1, outs
    assert len(backups) == 1, backups
    assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] == 8 << 30
