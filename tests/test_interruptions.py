"""Issue 26, "interruptions, concurrency, hung tools", through the real CLI on the lab and the
tests' Prefect server: a hung `nvidia-smi` is never joined by another and what we started is
killed at its timeout; Ctrl-C during a triage cancels its flow run and says what to do next;
`approve` of a run that can no longer act says so; a second triage of a container whose fix
holds the lock stops at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.lab.lab import LabState
from tests.test_fix import CLI, SHM_WORKLOAD, fix_settings, volume  # noqa: F401 - fixtures
from tests.test_flows import (  # noqa: F401 - fixture
    GPUS_ALL,
    cudamedic,
    env,
    flow_run_of,
    run_id_of,
)


def smi_processes(lab: LabState, host: str) -> list[int]:
    """The pids of the simulated host's `nvidia-smi` (its script) that still run."""
    script = f"{lab.hosts[host].data.rsplit('/', 1)[0]}/bin/nvidia-smi"
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if script.encode() in argv[:2]:
            found.append(int(proc.name))
    return found


def stop_hung(lab: LabState, host: str) -> None:
    """Kill what still hangs in the simulated host's `nvidia-smi` (its process groups)."""
    for pid in smi_processes(lab, host):
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while smi_processes(lab, host) and time.monotonic() < deadline:
        time.sleep(0.2)


def _sweep_hang(env: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:  # noqa: F811
    """Sweep gpu-hang: (the --json result, its bundle's nvidia-smi source)."""
    out = cudamedic(env, "sweep", "--host", "gpu-hang", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    newest = sorted(Path(env["CUDAMEDIC_OUT_DIR"], "sweeps").glob("*/gpu-hang-*"))[-1]
    sources = json.loads((newest / "bundle.json").read_text())["sources"]
    return json.loads(out.stdout), next(s for s in sources if s["name"] == "nvidia-smi")


def test_a_hung_nvidia_smi_is_never_joined_and_ours_is_killed(
    env: dict[str, str],  # noqa: F811
    lab: LabState,
) -> None:
    """Each sweep of the hung-nvidia-smi host left three more hung processes on it (80 after an
    afternoon): now one is started, and killed when its timeout passes; while one started by
    anyone else still runs, none is started at all."""
    stop_hung(lab, "gpu-hang")  # earlier runs' (older code's) hung processes on the lab host
    before = set(smi_processes(lab, "gpu-hang"))
    result, smi = _sweep_hang(env)
    assert result["verdicts"] == {"gpu-hang": "drain"}
    assert smi["status"] == "timeout" and "killed it" in smi["error"], smi
    deadline = time.monotonic() + 10  # the host's `timeout` sends SIGKILL 2 s after SIGTERM
    while set(smi_processes(lab, "gpu-hang")) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert set(smi_processes(lab, "gpu-hang")) - before == set()

    script = f"{lab.hosts['gpu-hang'].data.rsplit('/', 1)[0]}/bin/nvidia-smi"
    hung = subprocess.Popen([script, "-q"], start_new_session=True)  # someone else's, hung
    try:
        # hung: running longer than a command's timeout (the lab's 10 s); a younger one is
        # someone's ordinary call and does not count
        time.sleep(12)
        started = time.monotonic()
        result, smi = _sweep_hang(env)
        assert result["verdicts"] == {"gpu-hang": "drain"}
        assert smi["status"] == "timeout", smi
        assert smi["error"].startswith(
            f"not started: an nvidia-smi started earlier still runs on the host: pid {hung.pid}"
        ), smi
        assert time.monotonic() - started < 25  # no 10 s timeout waited out per command
        assert set(smi_processes(lab, "gpu-hang")) - before == {hung.pid}
    finally:
        os.killpg(hung.pid, signal.SIGKILL)
        hung.wait(timeout=10)


def _wait_for(path: Path, text: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None, path.read_text()
        assert time.monotonic() < deadline, path.read_text()
        time.sleep(0.3)


def test_a_second_triage_of_a_container_being_fixed_stops_and_writes_nothing(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    tmp_path: Path,
) -> None:
    """Two triages of one container: the second ended with Docker's raw "No such container",
    exit 6, and a second post-mortem. Now it says another fix holds the lock (exit 4), from this
    machine or another one (its own state dir), and writes no report."""
    c = make_container(container_name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    slow = {**env, "CUDAMEDIC_FIX_SETTLE_S": "25"}  # the first fix holds its lock a while
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        first = subprocess.Popen(
            [*CLI, "triage", "gpu-healthy", "--container", container_name, "--apply", "--yes"],
            env=slow,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        _wait_for(log, "cudamedic: [apply]", first)
        time.sleep(2)
        reports = Path(env["CUDAMEDIC_OUT_DIR"], "reports")
        before = sorted(reports.glob("*.md"))
        for who, e in {
            "this machine": env,
            "another machine": {**env, "CUDAMEDIC_STATE_DIR": str(tmp_path / "other-state")},
        }.items():
            second = cudamedic(e, "triage", "gpu-healthy", "--container", container_name, "--yes")
            assert second.returncode == 4, (who, second.stdout + second.stderr)
            assert "refused: another fix of gpu-healthy" in second.stderr, second.stderr
            assert "No such container" not in second.stdout + second.stderr
            assert "report:" not in second.stdout, second.stdout
            assert sorted(reports.glob("*.md")) == before, who
        assert first.wait(timeout=120) == 0, log.read_text()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert "outcome:   fixed" in log.read_text()


def _start_triage(
    env: dict[str, str],  # noqa: F811
    container: str,
    log: Path,
    *extra: str,
) -> subprocess.Popen[str]:
    with open(log, "w") as out:
        return subprocess.Popen(
            [*CLI, "triage", "gpu-healthy", "--container", container, "--apply", *extra],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )


def _approval_run(log: Path, proc: subprocess.Popen[str]) -> str:
    _wait_for(log, "waiting for approval: `cudamedic approve ", proc)
    return log.read_text().split("`cudamedic approve ", 1)[1].split("`")[0]


def test_ctrl_c_cancels_the_run_and_says_what_to_do_next(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: Any,
    tmp_path: Path,
) -> None:
    """Ctrl-C while a fix waited for approval left the run Paused (until the crash automation,
    ~7.5 min) and said only "interrupted"; approving it then exited 0 and nothing happened."""
    c = make_container(container_name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    log = tmp_path / "triage.log"
    proc = _start_triage(env, container_name, log, "--no-input")
    run_id = _approval_run(log, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130, log.read_text()
    said = log.read_text()
    assert (
        f"cudamedic: interrupted: nothing was changed on gpu-healthy/{container_name}: it is as "
        f"it was before the triage; flow run {run_id} cancelled. To respond again: `cudamedic "
        f"triage gpu-healthy --container {container_name} --apply`"
    ) in said, said
    assert "Traceback" not in said
    assert flow_run_of(run_id).state.type.value == "CANCELLED"
    assert gpu_engine.containers.get(container_name).id == c.id  # untouched
    late = cudamedic(env, "approve", run_id)
    assert late.returncode == 2, late.stdout + late.stderr
    assert "it can no longer act on an answer" in late.stderr, late.stderr


def test_approving_a_run_whose_process_is_gone_says_so(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    tmp_path: Path,
) -> None:
    """A triage killed outright (no Ctrl-C handler runs) leaves its run Paused: the answer is
    sent, nobody takes it, and `approve` says so and exits 6 (it said "not said yet", exit 0)."""
    c = make_container(container_name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    log = tmp_path / "triage.log"
    proc = _start_triage(env, container_name, log, "--no-input")
    run_id = _approval_run(log, proc)
    proc.kill()
    proc.wait(timeout=30)
    # nothing can take it: how long `approve` waits for a verdict only delays the same answer
    late = cudamedic({**env, "CUDAMEDIC_APPROVE_WAIT_S": "5"}, "approve", run_id, timeout=120)
    assert late.returncode == 6, late.stdout + late.stderr
    assert "did not take the answer within 5 s" in late.stderr
    assert "can no longer act" in late.stderr


def test_approve_checks_the_run_id_before_starting_a_server(tmp_path: Path) -> None:
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "CUDAMEDIC_"))}
    bare["CUDAMEDIC_STATE_DIR"] = str(tmp_path / "state")
    started = time.monotonic()
    out = subprocess.run(
        [*CLI, "approve", "not-a-uuid"], env=bare, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "'not-a-uuid' is not a flow run id" in out.stderr
    assert "Prefect server" not in out.stderr
    assert not (tmp_path / "state" / "prefect").exists()  # no server was started
    assert time.monotonic() - started < 10


def test_ctrl_c_during_the_fix_lets_it_finish(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: Any,
    tmp_path: Path,
) -> None:
    """Ctrl-C during apply printed only "interrupted" and left the fix half-done, for the next
    run to roll back silently. Now the fix finishes (or rolls back) first and says so."""
    c = make_container(container_name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    log = tmp_path / "triage.log"
    proc = _start_triage({**env, "CUDAMEDIC_FIX_SETTLE_S": "10"}, container_name, log, "--yes")
    _wait_for(log, "cudamedic: [apply]", proc)
    time.sleep(1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log.read_text()
    said = log.read_text()
    assert (
        f"cudamedic: interrupted during the fix of gpu-healthy/{container_name}: letting it "
        "finish or roll back first"
    ) in said, said
    assert "outcome:   fixed" in said, said
    new = gpu_engine.containers.get(container_name)
    assert new.id != c.id and new.attrs["HostConfig"]["ShmSize"] == 8 * 1024**3
    assert not [x for x in gpu_engine.containers.list(all=True) if x.name.endswith("fix-lock")]


def test_the_next_triage_shows_the_recovery_of_an_interrupted_fix(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: Any,
) -> None:
    """The next run rolled an interrupted fix back silently: now it is a progress step."""
    c = make_container(container_name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    killed = subprocess.run(
        [*CLI, "fix", "gpu-healthy", "--container", container_name, "--apply", "--yes"],
        env={**env, "CUDAMEDIC_CRASH_AT": "rename:done"},  # killed with the original renamed
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stdout + killed.stderr
    again = cudamedic(env, "triage", "gpu-healthy", "--container", container_name)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        f"cudamedic: [recover] done: an interrupted fix of {container_name} (its lock on the "
        "target was held by"
    ) in again.stderr, again.stderr
    assert "rolled back: the original container is restored" in again.stderr
    assert gpu_engine.containers.get(container_name).id == c.id
