"""Safe fixes on the real lab engines: plan, apply, verify, roll back, recover after a crash."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import docker
import pytest

from runbooks.collect.inventory import load_inventory
from runbooks.collect.remote.docker import DockerEngine
from runbooks.collect.target import Target, resolve_target
from runbooks.core.model import ContainerChange, Fix
from runbooks.core.policy import Policy
from runbooks.core.settings import Settings
from runbooks.fix.fixer import execute, prepare, refusal
from runbooks.fix.fixlock import PREFIX
from runbooks.fix.journal import Journal, audit, container_lock
from runbooks.fix.plan import plan_fix
from runbooks.fix.recreate import apply_plan
from tests.lab.lab import IMAGE, LabState

CLI = [sys.executable, "-m", "runbooks.cli"]
DATA_CMD = "[ -f /data/keep.txt ] || echo precious-$(date +%s) > /data/keep.txt; "
IDLE = "{ trap 'exit 0' TERM; sleep 3600 & wait; }"  # sh as PID 1 ignores SIGTERM untrapped
SHM_WORKLOAD = DATA_CMD + "dd if=/dev/zero of=/dev/shm/batch-0 bs=1M count=256 && " + IDLE
GPU_WORKLOAD = DATA_CMD + "nvidia-smi -L; " + IDLE


@pytest.fixture
def fix_settings(settings: Settings, tmp_path: Path) -> Settings:
    return settings.model_copy(
        update={"state_dir": tmp_path / "state", "fix_settle_s": 1.5, "fix_health_timeout": 20.0}
    )


def target(settings: Settings, name: str) -> Target:
    assert settings.inventory is not None
    return resolve_target(name, load_inventory(settings.inventory))


def volume_text(client: docker.DockerClient, volume: str) -> str:
    out = client.containers.run(
        IMAGE,
        ["cat", "/data/keep.txt"],
        remove=True,
        network_mode="none",
        volumes={volume: {"bind": "/data"}},
    )
    return out.decode().strip()


def wait_exit(container: Any) -> None:
    container.wait(timeout=30)


@pytest.fixture
def volume(gpu_engine: docker.DockerClient, container_name: str) -> Any:
    vol = gpu_engine.volumes.create(f"{container_name}-data")
    yield vol.name
    for c in gpu_engine.containers.list(all=True):  # backups and replacements use it too
        if c.name.startswith(container_name):
            c.remove(force=True)
    vol.remove(force=True)


def names_like(client: docker.DockerClient, name: str) -> list[str]:
    return sorted(c.name for c in client.containers.list(all=True) if c.name.startswith(name))


# -- the three lab scenarios of the issue -----------------------------------------------------
def test_shm_fix_end_to_end_keeps_volume_data(
    fix_settings: Settings, make_container, container_name: str, gpu_engine, volume
) -> None:
    from docker.types import DeviceRequest

    c = make_container(
        container_name,
        SHM_WORKLOAD,
        volumes={volume: {"bind": "/data"}},
        device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])],
    )
    wait_exit(c)
    data = volume_text(gpu_engine, volume)
    prepared = prepare(target(fix_settings, "gpu-healthy"), container_name, fix_settings)
    assert prepared.diagnosis.incident == "shm-too-small"
    plan = prepared.plan
    assert plan is not None and "+ --shm-size 8g" in plan.diff
    outcome = execute(target(fix_settings, "gpu-healthy"), prepared, fix_settings)
    assert outcome.status == "fixed", outcome
    new = gpu_engine.containers.get(container_name)
    assert new.status == "running" and new.id != c.id
    assert new.attrs["HostConfig"]["ShmSize"] >= 1 << 30
    assert volume_text(gpu_engine, volume) == data
    assert [n for n in names_like(gpu_engine, container_name) if "backup" in n]
    # Again: nothing left to fix.
    again = prepare(target(fix_settings, "gpu-healthy"), container_name, fix_settings)
    assert again.diagnosis.incident == "healthy" and again.plan is None


def test_gpu_fix_makes_the_gpus_visible(
    fix_settings: Settings, make_container, container_name: str, gpu_engine, volume
) -> None:
    make_container(
        container_name,
        GPU_WORKLOAD,
        volumes={volume: {"bind": "/data"}},
        environment={"NVIDIA_VISIBLE_DEVICES": "all"},
    )
    time.sleep(1)
    prepared = prepare(target(fix_settings, "gpu-healthy"), container_name, fix_settings)
    assert prepared.diagnosis.incident == "gpu-not-requested", prepared.diagnosis
    assert prepared.plan is not None and "+ --gpus all" in prepared.plan.diff
    outcome = execute(target(fix_settings, "gpu-healthy"), prepared, fix_settings)
    assert outcome.status == "fixed", outcome
    gpus = next(ch for ch in outcome.checks if ch.name == "gpus-visible")
    assert gpus.ok and "8 GPU" in gpus.detail
    out = gpu_engine.containers.get(container_name).exec_run(["nvidia-smi", "-L"]).output.decode()
    assert out.count("GPU ") == 8


def test_gpu_fix_without_toolkit_rolls_back_to_the_exact_original(
    fix_settings: Settings, make_container, container_name: str, plain_engine
) -> None:
    vol = plain_engine.volumes.create(f"{container_name}-data")
    try:
        c = make_container(
            container_name,
            GPU_WORKLOAD,
            engine=plain_engine,
            volumes={vol.name: {"bind": "/data"}},
            environment={"NVIDIA_VISIBLE_DEVICES": "all"},
            restart_policy={"Name": "unless-stopped"},
        )
        time.sleep(1)
        before = plain_engine.api.inspect_container(c.id)
        data = volume_text(plain_engine, vol.name)
        prepared = prepare(target(fix_settings, "gpu-nohook"), container_name, fix_settings)
        assert prepared.diagnosis.incident == "gpu-not-requested"
        outcome = execute(target(fix_settings, "gpu-nohook"), prepared, fix_settings)
        assert outcome.status == "rolled-back", outcome
        assert 'could not select device driver "" with capabilities: [[gpu]]' in outcome.message
        after = plain_engine.api.inspect_container(container_name)
        assert after["Id"] == before["Id"]
        assert after["State"]["Running"] and after["Config"] == before["Config"]
        assert after["HostConfig"] == before["HostConfig"]
        assert after["Mounts"] == before["Mounts"]
        assert names_like(plain_engine, container_name) == [container_name]
        assert volume_text(plain_engine, vol.name) == data
    finally:
        plain_engine.containers.get(container_name).remove(force=True)
        vol.remove(force=True)


# -- faithful recreation ---------------------------------------------------------------------
SKIP_FIELDS = {
    "Id",
    "Created",
    "State",
    "ResolvConfPath",
    "HostnamePath",
    "HostsPath",
    "LogPath",
    "RestartCount",
    "NetworkSettings",
    "GraphDriver",
    "ProcessLabel",
    "AppArmorProfile",
    "ExecIDs",
    "SizeRw",
    "SizeRootFs",
    "MountLabel",
    "Path",
    "Args",
    "Platform",
    "Driver",
}


def test_recreate_keeps_everything_but_the_change(
    fix_settings: Settings, make_container, container_name: str, gpu_engine, volume, lab: LabState
) -> None:
    from docker.types import Healthcheck, LogConfig, Mount, Ulimit

    c = gpu_engine.containers.run(
        IMAGE,
        ["sleep 3600"],
        name=container_name,
        detach=True,
        network_mode="none",
        volumes={volume: {"bind": "/data"}},
        mounts=[Mount(target="/cache", source=None, type="volume")],  # an anonymous volume
        environment={"A": "1", "B": "two words"},
        labels={"team": "ml", "owner": "ops"},
        user="nobody",
        working_dir="/tmp",
        hostname="trainer",
        entrypoint=["/bin/sh", "-c"],
        restart_policy={"Name": "on-failure", "MaximumRetryCount": 2},
        mem_limit="512m",
        nano_cpus=500_000_000,
        devices=["/dev/null:/dev/xnull:rwm"],
        cap_add=["SYS_PTRACE"],
        ulimits=[Ulimit(name="nofile", soft=4096, hard=8192)],
        shm_size="64m",
        healthcheck=Healthcheck(test=["CMD", "true"], interval=1_000_000_000, retries=3),
        log_config=LogConfig(type="json-file", config={"max-size": "10m", "max-file": "2"}),
        stop_signal="SIGINT",
        tmpfs={"/scratch": "size=16m"},
    )
    time.sleep(1)
    # Write into the anonymous volume: a plain recreate would give it a new, empty one.
    assert c.exec_run(["sh", "-c", "echo anon > /cache/a.txt"], user="root").exit_code == 0
    before = gpu_engine.api.inspect_container(c.id)
    engine = DockerEngine.local(lab.engines["gpu"].url, 30)
    try:
        fix = Fix(
            safe=True,
            container=container_name,
            change=ContainerChange(shm_size=1 << 30),
            docker_run=("+ --shm-size=1g",),
        )
        plan = plan_fix(
            host="local",
            inspect=before,
            fix=fix,
            incident="shm-too-small",
            summary="test",
            current_image_id=engine.image_id(IMAGE),
            now=__import__("datetime").datetime.now(__import__("datetime").UTC),
            settle_s=1.5,
            retention_h=24,
        )
        journal = Journal(fix_settings.state_path, "local", container_name)
        outcome = apply_plan(engine, plan, fix_settings, journal, before)
    finally:
        engine.close()
    assert outcome.status == "fixed", outcome
    after = gpu_engine.api.inspect_container(container_name)
    assert after["Id"] != before["Id"]
    differences = []
    for key in sorted(set(before) | set(after)):
        if key in SKIP_FIELDS:
            continue
        if key in ("Config", "HostConfig"):
            for sub in sorted(set(before[key]) | set(after[key])):
                if (key, sub) == ("HostConfig", "ShmSize"):
                    continue  # the change
                if (key, sub) == ("Config", "Labels"):  # plus the fix's record (fixlock.py)
                    own = {k: v for k, v in after[key][sub].items() if not k.startswith(PREFIX)}
                    if own != before[key][sub] or not after[key][sub].get(f"{PREFIX}backup"):
                        differences.append(f"{key}.{sub}: {before[key][sub]!r} -> {own!r}")
                    continue
                if (key, sub) == ("HostConfig", "Mounts"):
                    # Anonymous volumes are pinned by name, so the same volume is mounted.
                    names = {m["Destination"]: m["Name"] for m in before["Mounts"]}
                    want = [
                        {**m, "Source": m.get("Source") or names[m["Target"]]}
                        for m in before[key][sub]
                    ]
                    if want != after[key][sub]:
                        differences.append(f"{key}.{sub}: {want!r} -> {after[key][sub]!r}")
                    continue
                if before[key].get(sub) != after[key].get(sub):
                    differences.append(
                        f"{key}.{sub}: {before[key].get(sub)!r} -> {after[key].get(sub)!r}"
                    )
        elif key == "Mounts":  # same mounts, in any order
            if by_destination(before[key]) != by_destination(after[key]):
                differences.append(f"Mounts: {before[key]!r} -> {after[key]!r}")
        elif before.get(key) != after.get(key):
            differences.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    assert differences == []
    assert after["HostConfig"]["ShmSize"] == 1 << 30
    assert after["Image"] == before["Image"]
    new = gpu_engine.containers.get(container_name)
    assert new.exec_run(["cat", "/cache/a.txt"]).output.decode().strip() == "anon"


def by_destination(mounts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(mounts, key=lambda mount: str(mount["Destination"]))


# -- procedure and policy -------------------------------------------------------------------
def cli_env(lab: LabState, settings: Settings, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "CUDAMEDIC_CONFIG": lab.config,
        "CUDAMEDIC_STATE_DIR": str(settings.state_path),
        # what a fleet shares lives in the tests' one Prefect server: one fleet per test
        "CUDAMEDIC_FLEET": settings.fleet,
        "CUDAMEDIC_OUT_DIR": str(settings.out_dir),
        "CUDAMEDIC_FIX_SETTLE_S": "1.5",
        **extra,
    }


def run_cli(
    lab: LabState, settings: Settings, *args: str, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env=cli_env(lab, settings, **env),
    )


def test_apply_without_yes_is_refused_and_changes_nothing(
    fix_settings: Settings, make_container, container_name: str, lab: LabState, gpu_engine
) -> None:
    c = make_container(container_name, SHM_WORKLOAD.replace(DATA_CMD, ""))
    wait_exit(c)
    proc = subprocess.run(
        [*CLI, "fix", "gpu-healthy", "--container", container_name, "--apply"],
        capture_output=True,
        text=True,
        env=cli_env(lab, fix_settings),
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 4, proc.stderr
    assert "refused" in proc.stderr and "--yes" in proc.stderr
    assert gpu_engine.containers.get(container_name).id == c.id


def test_dry_run_prints_the_plan_and_changes_nothing(
    fix_settings: Settings, make_container, container_name: str, lab: LabState, gpu_engine
) -> None:
    c = make_container(container_name, SHM_WORKLOAD.replace(DATA_CMD, ""))
    wait_exit(c)
    proc = subprocess.run(
        [*CLI, "fix", "gpu-healthy", "--container", container_name],
        capture_output=True,
        text=True,
        env=cli_env(lab, fix_settings),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "diagnosis: shm-too-small" in proc.stdout and "+ --shm-size" in proc.stdout
    assert "dry run: nothing was changed" in proc.stdout
    assert names_like(gpu_engine, container_name) == [container_name]


def test_a_second_fix_of_the_same_container_waits_for_the_lock(
    fix_settings: Settings, make_container, container_name: str, lab: LabState
) -> None:
    c = make_container(container_name, SHM_WORKLOAD.replace(DATA_CMD, ""))
    wait_exit(c)
    with container_lock(fix_settings.state_path, "gpu-healthy", container_name):
        proc = subprocess.run(
            [*CLI, "fix", "gpu-healthy", "--container", container_name, "--apply", "--yes"],
            capture_output=True,
            text=True,
            env=cli_env(lab, fix_settings),
            timeout=120,
        )
    assert proc.returncode == 4, proc.stderr  # refused (README: exit status)
    assert "another fix of gpu-healthy/" in proc.stderr and "Traceback" not in proc.stderr


def test_policy_unattended_and_blast_radius(fix_settings: Settings, tmp_path: Path) -> None:
    policy = Policy(unattended={"shm-too-small": ("lab",)}, max_fixes_per_hour=2)
    assert policy.allows_unattended("shm-too-small", ("lab", "h100"))
    assert not policy.allows_unattended("shm-too-small", ("prod",))
    assert not policy.allows_unattended("gpu-not-requested", ("lab",))
    with pytest.raises(ValueError):
        Policy(unattended={"gpu-hardware-fault": ("*",)})

    class P:  # the two fields refusal() reads
        incident = "shm-too-small"

    assert refusal(P(), ("lab",), policy, fix_settings, confirmed=False) is None  # type: ignore[arg-type]
    assert "needs --yes" in str(refusal(P(), ("prod",), policy, fix_settings, confirmed=False))  # type: ignore[arg-type]
    for _ in range(2):
        audit(fix_settings.state_path, "apply", host="h", container="c", fleet="another")
    # another fleet's fixes (this machine ran a demo, say) do not count against this one
    assert refusal(P(), ("lab",), policy, fix_settings, confirmed=True) is None  # type: ignore[arg-type]
    for _ in range(2):
        audit(fix_settings.state_path, "apply", host="h", container="c", fleet=fix_settings.fleet)
    assert "blast-radius" in str(refusal(P(), ("lab",), policy, fix_settings, confirmed=True))  # type: ignore[arg-type]


def test_the_fix_cap_counts_the_whole_fleet_from_prefect(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 17: two fixes audited by worker A (its own STATE_DIR) count against worker B's cap:
    B reads the fleet's `cudamedic.fix.applied` events from the Prefect server. Another fleet's
    fixes do not count; with Prefect unreachable B falls back to its own log, without waiting."""
    from runbooks.fix.audit import flush
    from runbooks.fix.journal import applied_within

    a, b = tmp_path / "worker-a", tmp_path / "worker-b"
    fleet = "t-cap-" + tmp_path.name[-20:].lower().replace("_", "-")
    for _ in range(2):
        audit(a, "apply", host="h", container="c", fleet=fleet)
    audit(a, "apply", host="h", container="c", fleet=fleet + "-other")
    flush()
    hour = timedelta(hours=1)
    deadline = time.monotonic() + 30  # the server stores events a moment after they arrive
    while applied_within(b, hour, fleet) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert applied_within(b, hour, fleet) == 2
    assert applied_within(b, hour) == 0  # no fleet: this machine's log only
    assert applied_within(a, hour, fleet) == 2  # A's log: this fleet's two, not the other's
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # nothing listens there
    started = time.monotonic()
    assert applied_within(b, hour, fleet) == 0
    assert applied_within(a, hour, fleet) == 2  # never fewer than the local log says
    assert time.monotonic() - started < 5


# -- crash safety ---------------------------------------------------------------------------
def invariant(client: docker.DockerClient, name: str, volume: str, data: str) -> str:
    """The workload runs (old or new), its data is intact, nothing is duplicated."""
    found = names_like(client, name)
    assert name in found, found
    running = [n for n in found if client.containers.get(n).status == "running"]
    assert running == [name], f"running: {running}"
    extra = [n for n in found if n != name]
    assert all("-cudamedic-backup-" in n for n in extra) and len(extra) <= 1, found
    assert volume_text(client, volume) == data
    return "new" if extra else "old"


# The CLI's own recovery path, at two boundaries (one rolled back, one finished). Every boundary
# of every fix kind, engine restarts and randomised faults: tests/reliability/test_fault_fixes.py.
RUN_BOUNDARIES = ["create:done", "verified"]


@pytest.mark.parametrize("boundary", RUN_BOUNDARIES)
def test_fix_killed_at_every_step_is_finished_or_rolled_back(
    boundary: str,
    fix_settings: Settings,
    make_container,
    container_name: str,
    lab: LabState,
    gpu_engine,
    volume,
) -> None:
    make_container(
        container_name,
        GPU_WORKLOAD,
        volumes={volume: {"bind": "/data"}},
        environment={"NVIDIA_VISIBLE_DEVICES": "all"},
        restart_policy={"Name": "unless-stopped"},
    )
    time.sleep(1)
    data = volume_text(gpu_engine, volume)
    killed = run_cli(
        lab,
        fix_settings,
        "fix",
        "gpu-healthy",
        "--container",
        container_name,
        "--apply",
        "--yes",
        CUDAMEDIC_CRASH_AT=boundary,
    )
    assert killed.returncode == -9, (boundary, killed.stdout, killed.stderr)
    # The next run (a dry run here) finishes or rolls back the interrupted fix first.
    again = run_cli(lab, fix_settings, "fix", "gpu-healthy", "--container", container_name)
    assert again.returncode == 0, again.stderr
    assert "recovered:" in again.stdout or (boundary == "begin" and "recovered" in again.stdout)
    state = invariant(gpu_engine, container_name, volume, data)
    assert state == ("new" if boundary == "verified" else "old"), (boundary, state)
    journal = Journal(fix_settings.state_path, "gpu-healthy", container_name)
    assert journal.unfinished() is None


@pytest.mark.parametrize("boundary", ["rolling-back"])
def test_rollback_killed_midway_is_finished_by_the_next_run(
    boundary: str,
    fix_settings: Settings,
    make_container,
    container_name: str,
    lab: LabState,
    plain_engine,
) -> None:
    vol = plain_engine.volumes.create(f"{container_name}-data")
    try:
        make_container(
            container_name,
            GPU_WORKLOAD,
            engine=plain_engine,
            volumes={vol.name: {"bind": "/data"}},
            environment={"NVIDIA_VISIBLE_DEVICES": "all"},
        )
        time.sleep(1)
        data = volume_text(plain_engine, vol.name)
        killed = run_cli(
            lab,
            fix_settings,
            "fix",
            "gpu-nohook",
            "--container",
            container_name,
            "--apply",
            "--yes",
            CUDAMEDIC_CRASH_AT=boundary,
        )
        assert killed.returncode == -9, killed.stderr
        again = run_cli(lab, fix_settings, "rollback", "gpu-nohook", "--container", container_name)
        assert again.returncode == 0, again.stderr
        assert invariant(plain_engine, container_name, vol.name, data) == "old"
    finally:
        plain_engine.containers.get(container_name).remove(force=True)
        vol.remove(force=True)


def test_manual_rollback_restores_the_backup(
    fix_settings: Settings, make_container, container_name: str, lab: LabState, gpu_engine, volume
) -> None:
    original = make_container(
        container_name,
        GPU_WORKLOAD,
        volumes={volume: {"bind": "/data"}},
        environment={"NVIDIA_VISIBLE_DEVICES": "all"},
    )
    time.sleep(1)
    prepared = prepare(target(fix_settings, "gpu-healthy"), container_name, fix_settings)
    assert execute(target(fix_settings, "gpu-healthy"), prepared, fix_settings).status == "fixed"
    proc = subprocess.run(
        [*CLI, "rollback", "gpu-healthy", "--container", container_name],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(lab, fix_settings),
    )
    assert proc.returncode == 0, proc.stderr
    assert "original container again" in proc.stdout
    current = gpu_engine.containers.get(container_name)
    assert current.id == original.id and current.status == "running"
    replaced = [n for n in names_like(gpu_engine, container_name) if "-replaced-" in n]
    assert len(replaced) == 1  # kept, stopped: nothing is lost


def test_cli_fix_writes_a_redacted_post_mortem(
    fix_settings: Settings, make_container, container_name: str, lab: LabState
) -> None:
    from docker.types import DeviceRequest

    secret = "hf_ZZtopSecretTokenValue0123456789abcd"
    c = make_container(
        container_name,
        SHM_WORKLOAD.replace(DATA_CMD, ""),
        environment={"HF_TOKEN": secret},
        device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])],
    )
    wait_exit(c)
    proc = run_cli(
        lab,
        fix_settings,
        "fix",
        "gpu-healthy",
        "--container",
        container_name,
        "--apply",
        "--yes",
        "--trigger",
        f"it died; token {secret}",
    )
    assert proc.returncode == 0, proc.stderr
    report = Path(proc.stdout.strip().splitlines()[-1].removeprefix("report: "))
    text = report.read_text()
    assert "| Outcome | **fixed** |" in text and "+ --shm-size 8g" in text
    assert "replacement verified" in text  # the journal's verify step, in words
    assert secret not in text and secret not in proc.stdout


# -- issue 14: a container that neither has nor wants GPUs, on a host without GPUs --------------
# The DataLoader's own messages (signatures.yaml examples, real): printed by the workload only
# when its /dev/shm is too small for the batch it writes there.
BUS_ERROR = "RuntimeError: DataLoader worker (pid 4143) is killed by signal: Bus error."
SHM_HINT = (
    "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient "
    "shared memory (shm)."
)
DATALOADER_WORKLOAD = (
    "dd if=/dev/zero of=/dev/shm/batch-0 bs=1M count=100 2>/dev/null "
    f"|| {{ for i in 1 2 3; do echo '{BUS_ERROR}'; echo '{SHM_HINT}'; done; }}; " + IDLE
)
# A host without GPUs: this machine ("local": no nvidia-smi, no toolkit), with the lab's plain
# engine as its Docker. Only the GPU commands are collected (this machine's own dmesg and df are
# not part of the scenario).
CPU_HOST_RUNBOOK = """
name: cpu-host
kind: incident
host_sources:
  - {name: nvidia-smi, path: nvidia-smi.txt, command: nvidia-smi}
  - {name: nvidia-smi-list, path: commands/nvidia-smi-L.txt, command: nvidia-smi -L}
  - name: container-toolkit
    path: commands/container-toolkit.txt
    command: nvidia-ctk --version 2>/dev/null || nvidia-container-cli --version
container_probes: [torch, ulimit, shm, env, nvidia-smi-L]
nccl_tests: false
"""


def busybox_on_cpu_host(
    make_container: Any, name: str, plain_engine: docker.DockerClient, tmp_path: Path
) -> tuple[Any, dict[str, str]]:
    c = make_container(name, DATALOADER_WORKLOAD, engine=plain_engine, shm_size="64m")
    deadline = time.monotonic() + 20
    while BUS_ERROR not in c.logs().decode() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.attrs["HostConfig"].get("DeviceRequests") in (None, [])
    book = tmp_path / "cpu-host.yaml"
    book.write_text(CPU_HOST_RUNBOOK)
    return c, {"CUDAMEDIC_RUNBOOK": str(book)}


def test_busybox_bus_error_on_a_host_without_gpus_is_fixed_with_shm(
    fix_settings: Settings,
    make_container,
    container_name: str,
    lab: LabState,
    plain_engine,
    tmp_path: Path,
) -> None:
    """Our own `nvidia-smi -L` probe finding no nvidia-smi in a busybox is not a symptom: the
    workload's Bus error and its 64 MiB /dev/shm are, and `fix --apply --yes` fixes it."""
    c, extra = busybox_on_cpu_host(make_container, container_name, plain_engine, tmp_path)
    env = {"CUDAMEDIC_DOCKER_HOST": lab.engines["plain"].url, **extra}
    dry = run_cli(lab, fix_settings, "fix", "local", "--container", container_name, **env)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "diagnosis: shm-too-small" in dry.stdout, dry.stdout
    assert "wants GPUs" not in dry.stdout and "whose GPUs work" not in dry.stdout
    done = run_cli(
        lab, fix_settings, "fix", "local", "--container", container_name, "--apply", "--yes", **env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    new = plain_engine.containers.get(container_name)
    assert new.id != c.id and new.status == "running"
    assert new.attrs["HostConfig"]["ShmSize"] >= 1 << 30
    assert new.attrs["HostConfig"].get("DeviceRequests") in (None, []), "no GPUs were added"
    assert BUS_ERROR not in new.logs().decode()


def test_a_mistyped_container_is_an_error_naming_the_containers_there(
    fix_settings: Settings, make_container, container_name: str, lab: LabState, gpu_engine
) -> None:
    make_container(container_name, IDLE)
    typo = container_name + "-nope"
    for args in (
        ("collect", "gpu-healthy", "--container", typo),
        ("fix", "gpu-healthy", "--container", typo),
        ("fix", "gpu-healthy", "--container", typo, "--apply", "--yes"),
    ):
        proc = run_cli(lab, fix_settings, *args)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert f"no container named '{typo}'" in proc.stderr, proc.stderr
        assert container_name in proc.stderr  # the containers that do exist
        assert "cannot be reached" not in proc.stderr and "diagnosis:" not in proc.stdout
        assert "Traceback" not in proc.stderr
    # The bundle was still written, and classifying it is the same error.
    bundles = sorted(fix_settings.out_dir.glob(f"gpu-healthy-{typo}-*"))
    assert bundles
    proc = run_cli(lab, fix_settings, "classify", str(bundles[0]))
    assert proc.returncode == 2 and f"no container named '{typo}'" in proc.stderr
    assert names_like(gpu_engine, container_name) == [container_name]


def test_a_check_whose_exec_output_was_lost_is_asked_again(
    lab: LabState, gpu_engine: docker.DockerClient, container_name: str
) -> None:
    """Issue 28 (a kill at `verified` once ended on the old container): Docker can lose a
    `docker exec`'s output, exit 0 with nothing printed (docker/docker-py#2042, moby/moby#27289;
    1 in 3,000 `nvidia-smi -L` on the lab's engine under load), and the verification of a good
    `--gpus` fix then read "0 GPUs" and rolled it back. Here the container's `nvidia-smi` (the
    lab's toolkit shim) answers its first call with exit 0 and nothing, as a lost output reads."""
    from docker.types import DeviceRequest

    from runbooks.fix.recreate import _gpus_check

    smi = "/usr/local/bin/nvidia-smi"
    once = (
        f"mv {smi} /usr/local/bin/real-smi; "
        f"printf '#!/bin/sh\\n[ -f /tmp/once ] || {{ touch /tmp/once; exit 0; }}\\n"
        f'exec /usr/local/bin/real-smi "$@"\\n\' > {smi}; chmod +x {smi}; '
        "touch /tmp/ready; sleep 3600"
    )
    made = gpu_engine.containers.run(
        IMAGE,
        ["sh", "-c", once],
        name=container_name,
        detach=True,
        network_mode="none",
        device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])],
    )
    engine = DockerEngine.local(lab.engines["gpu"].url, 30)
    try:
        deadline = time.monotonic() + 30
        while made.exec_run(["test", "-f", "/tmp/ready"]).exit_code != 0:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        host = engine.inspect(made.id)["HostConfig"]
        check = _gpus_check(engine, made.id, host, True, Settings(exec_timeout=10))
    finally:
        engine.close()
        made.remove(force=True)
    assert check.ok and "lists 8 GPU(s)" in check.detail, check
