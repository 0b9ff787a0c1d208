"""A fix's record lives on the target: a second worker, with its own empty state dir and HOME,
finishes or rolls back a fix that another worker's process was killed in the middle of, and two
fixes of one container never both proceed (real lab engines, the real CLI, real processes).

Worker A is `cudamedic fix --apply --yes` with CUDAMEDIC_STOP_AT=<boundary>: it stops itself
(SIGSTOP) at that step boundary, and the test SIGKILLs its whole process group. Worker B is a
later `cudamedic fix` from another state dir; it knows nothing but the target.
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import pytest

from runbooks.core.names import FIX_LOCK_SUFFIX
from runbooks.fix.fixlock import PREFIX
from runbooks.fix.recreate import BOUNDARIES
from tests.lab.lab import IMAGE, LabState
from tests.test_fix import CLI, GPU_WORKLOAD, names_like, volume_text

RUN_BOUNDARIES = [b for b in BOUNDARIES if b not in ("rolling-back", "restore:done")]
ROLLBACK_BOUNDARIES = ["rolling-back", "restore:done"]
ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "APP_MODE": "train-42"}
LABELS = {"team": "ml", "job": "resnet"}


class Worker:
    """One worker machine's view: its own state dir and HOME; the lab's inventory."""

    def __init__(self, lab: LabState, root: Path, **env: str) -> None:
        self.state, self.home = root / "state", root / "home"
        self.home.mkdir(parents=True)
        self.env = {
            **os.environ,
            "CUDAMEDIC_CONFIG": lab.config,
            "CUDAMEDIC_STATE_DIR": str(self.state),
            "CUDAMEDIC_OUT_DIR": str(root / "out"),
            "CUDAMEDIC_FIX_SETTLE_S": "1.5",
            # the workers of one test are one fleet (the fix cap counts its fixes in Prefect)
            "CUDAMEDIC_FLEET": "t-" + hashlib.sha256(str(root.parent).encode()).hexdigest()[:12],
            "HOME": str(self.home),
            **env,
        }

    def start(self, *args: str, prefix: tuple[str, ...] = (), **env: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*prefix, *CLI, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**self.env, **env},
            start_new_session=True,  # its own process group: the test kills the whole tree
        )

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args], capture_output=True, text=True, env=self.env, timeout=180
        )


def _stopped(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] == "T"


def stop_then_kill(proc: subprocess.Popen[str], what: str) -> None:
    """Wait until the worker stopped itself at its boundary, then SIGKILL its process group."""
    deadline = time.monotonic() + 150
    while not _stopped(proc.pid):
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"{what}: the worker ended ({proc.returncode}) before the boundary: {err}")
        assert time.monotonic() < deadline, f"{what}: the worker never reached the boundary"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def workload(engine: docker.DockerClient, name: str, volume: str) -> dict[str, Any]:
    """The original: env, labels, a volume, a restart policy, and a file in its own layer."""
    c = engine.containers.run(
        IMAGE,
        ["sh", "-c", GPU_WORKLOAD],
        name=name,
        detach=True,
        network_mode="none",
        volumes={volume: {"bind": "/data"}},
        environment=ENV,
        labels=LABELS,
        restart_policy={"Name": "unless-stopped"},
    )
    layer = f"layer-{uuid.uuid4().hex}"
    assert c.exec_run(["sh", "-c", f"echo {layer} > /layer.txt"]).exit_code == 0
    time.sleep(1)
    return {"id": c.id, "layer": layer, "data": volume_text(engine, volume)}


def layer_text(engine: docker.DockerClient, name: str) -> str:
    stream, _ = engine.containers.get(name).get_archive("/layer.txt")
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        member = tar.extractfile("layer.txt")
        assert member is not None
        return member.read().decode().strip()


def assert_one_container_with_its_data(
    engine: docker.DockerClient, name: str, volume: str, original: dict[str, Any]
) -> str:
    """Exactly one container of the name, running, with the original's config and data; no lock,
    no stray backup (only the kept backup of a verified fix, named by its replacement). Returns
    'old' (rolled back) or 'new' (finished)."""
    found = names_like(engine, name)
    assert name in found and f"{name}{FIX_LOCK_SUFFIX}" not in found, found
    current = engine.containers.get(name)
    state = "old" if current.id == original["id"] else "new"
    backups = [n for n in found if "-cudamedic-backup-" in n]
    assert sorted(found) == sorted([name, *backups]), found
    if state == "old":
        assert backups == [], found
        assert layer_text(engine, name) == original["layer"]
    else:  # the verified fix's backup, kept for `cudamedic rollback`: the original itself
        assert backups == [current.labels[f"{PREFIX}backup"]], found
        assert engine.containers.get(backups[0]).id == original["id"]
        assert layer_text(engine, backups[0]) == original["layer"]
    deadline = time.monotonic() + 20
    while engine.containers.get(name).status != "running":
        assert time.monotonic() < deadline, engine.containers.get(name).status
        time.sleep(0.3)
    attrs = engine.containers.get(name).attrs
    env = set(attrs["Config"]["Env"])
    assert {f"{k}={v}" for k, v in ENV.items()} <= env
    labels = attrs["Config"]["Labels"]
    assert {k: labels.get(k) for k in LABELS} == LABELS
    assert all(k in LABELS or k.startswith(PREFIX) for k in labels), labels
    assert [(m["Name"], m["Destination"]) for m in attrs["Mounts"]] == [(volume, "/data")]
    assert attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
    assert volume_text(engine, volume) == original["data"]
    return state


def _volume(engine: docker.DockerClient, name: str) -> str:
    return str(engine.volumes.create(f"{name}-data").name)


def _clean(engine: docker.DockerClient, name: str, volume: str) -> None:
    for c in engine.containers.list(all=True):
        if c.name.startswith(name):
            c.remove(force=True)
    engine.volumes.get(volume).remove(force=True)


@pytest.mark.parametrize(
    ("boundary", "host", "engine_kind"),
    [(b, "gpu-healthy", "gpu") for b in RUN_BOUNDARIES]
    + [(b, "gpu-nohook", "plain") for b in ROLLBACK_BOUNDARIES],
)
def test_a_worker_killed_at_each_step_is_recovered_by_another_worker_from_the_target(
    boundary: str, host: str, engine_kind: str, lab: LabState, tmp_path: Path
) -> None:
    engine = docker.DockerClient(base_url=lab.engines[engine_kind].url, timeout=60)
    name = f"t-{uuid.uuid4().hex[:10]}"
    volume = _volume(engine, name)
    try:
        original = workload(engine, name, volume)
        a, b = Worker(lab, tmp_path / "a"), Worker(lab, tmp_path / "b")
        worker_a = a.start(
            "fix", host, "--container", name, "--apply", "--yes", CUDAMEDIC_STOP_AT=boundary
        )
        stop_then_kill(worker_a, boundary)
        # Worker B has never seen this fix: an empty state dir, another HOME.
        again = b.run("fix", host, "--container", name)
        assert again.returncode == 0, again.stderr
        assert "Traceback" not in again.stderr
        state = assert_one_container_with_its_data(engine, name, volume, original)
        if boundary == "verified":  # committed on the target before A died: nothing to recover
            assert state == "new" and "recovered:" not in again.stdout, again.stdout
        else:
            assert state == "old", (boundary, state)
            assert "recovered:" in again.stdout and "lock on the target" in again.stdout
        # Nothing is left for a third worker to do.
        third = Worker(lab, tmp_path / "c").run("fix", host, "--container", name)
        assert third.returncode == 0 and "recovered:" not in third.stdout, third.stdout
    finally:
        _clean(engine, name, volume)
        engine.close()


def test_two_workers_never_both_fix_one_container(
    lab: LabState, tmp_path: Path, gpu_engine: docker.DockerClient
) -> None:
    name = f"t-{uuid.uuid4().hex[:10]}"
    volume = _volume(gpu_engine, name)
    try:
        original = workload(gpu_engine, name, volume)
        a, b = Worker(lab, tmp_path / "a"), Worker(lab, tmp_path / "b")
        # A holds the lock, alive but paused mid-fix: B (another state dir) is refused.
        worker_a = a.start(
            "fix", "gpu-healthy", "--container", name, "--apply", "--yes",
            CUDAMEDIC_STOP_AT="start:done",
        )  # fmt: skip
        deadline = time.monotonic() + 150
        while not _stopped(worker_a.pid):
            assert worker_a.poll() is None and time.monotonic() < deadline, worker_a.communicate()
            time.sleep(0.1)
        refused = b.run("fix", "gpu-healthy", "--container", name, "--apply", "--yes")
        assert refused.returncode != 0, refused.stdout
        assert f"another fix of gpu-healthy/{name} is running" in refused.stderr, refused.stderr
        assert len([n for n in names_like(gpu_engine, name) if "-cudamedic-backup-" in n]) == 1
        os.killpg(worker_a.pid, signal.SIGCONT)
        out, err = worker_a.communicate(timeout=180)
        assert worker_a.returncode == 0 and "outcome: fixed" in out, (out, err)
        assert assert_one_container_with_its_data(gpu_engine, name, volume, original) == "new"
        # B rolls A's verified fix back by hand, from the replacement's labels alone.
        back = b.run("rollback", "gpu-healthy", "--container", name)
        assert back.returncode == 0 and "original container again" in back.stdout, back
        current = gpu_engine.containers.get(name)
        assert current.id == original["id"] and layer_text(gpu_engine, name) == original["layer"]
        assert len([n for n in names_like(gpu_engine, name) if "-cudamedic-replaced-" in n]) == 1
    finally:
        _clean(gpu_engine, name, volume)


def test_two_workers_started_together_apply_one_fix(
    lab: LabState, tmp_path: Path, gpu_engine: docker.DockerClient
) -> None:
    name = f"t-{uuid.uuid4().hex[:10]}"
    volume = _volume(gpu_engine, name)
    try:
        original = workload(gpu_engine, name, volume)
        workers = [Worker(lab, tmp_path / w) for w in ("a", "b")]
        procs = [
            w.start("fix", "gpu-healthy", "--container", name, "--apply", "--yes") for w in workers
        ]
        outs = [p.communicate(timeout=240) for p in procs]
        fixed = [out for out, _ in outs if "outcome: fixed" in out]
        assert len(fixed) == 1, outs
        assert all("Traceback" not in err for _, err in outs), outs
        assert assert_one_container_with_its_data(gpu_engine, name, volume, original) == "new"
    finally:
        _clean(gpu_engine, name, volume)


def test_a_dead_worker_on_another_machine_is_taken_over_when_its_lease_ends(
    lab: LabState, tmp_path: Path, gpu_engine: docker.DockerClient
) -> None:
    """Worker A runs under another host name (its own UTS namespace): B cannot see whether its
    process lives, so B waits for A's lease (20 s here) before it rolls A's fix back."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    volume = _volume(gpu_engine, name)
    try:
        original = workload(gpu_engine, name, volume)
        a = Worker(lab, tmp_path / "a", CUDAMEDIC_FIX_LEASE_S="20")
        b = Worker(lab, tmp_path / "b")
        other_host = ("unshare", "--uts", "sh", "-c", 'hostname worker-a && exec "$@"', "sh")
        worker_a = a.start(
            "fix", "gpu-healthy", "--container", name, "--apply", "--yes",
            prefix=other_host, CUDAMEDIC_STOP_AT="create:done",
        )  # fmt: skip
        stop_then_kill(worker_a, "create:done")
        early = b.run("fix", "gpu-healthy", "--container", name)
        assert early.returncode != 0, early.stdout
        assert "@worker-a" in early.stderr and "its lease runs until" in early.stderr, early.stderr
        time.sleep(21)
        late = b.run("fix", "gpu-healthy", "--container", name)
        assert late.returncode == 0 and "recovered:" in late.stdout, (late.stdout, late.stderr)
        assert assert_one_container_with_its_data(gpu_engine, name, volume, original) == "old"
    finally:
        _clean(gpu_engine, name, volume)


def test_a_lock_from_a_hostile_or_broken_target_is_read_without_raising() -> None:
    """Labels are whatever the engine says: garbage gives no lock (a person looks) or a lease
    within a day, never a traceback."""
    from datetime import UTC, datetime

    from runbooks.fix.fixlock import (
        FixRecord,
        Holder,
        holder_labels,
        parse_lock,
        record_labels,
        why_live,
    )

    rec = FixRecord(name="train", original_id="a" * 64, backup="train-cudamedic-backup-x",
                    restart_policy={"Name": "always"}, was_running=True)  # fmt: skip
    here = Holder(who="w@m", machine="m/1", pid=7, pid_start="9", lease_s=30)
    labels = {**record_labels(rec), **holder_labels(here)}
    good = {"Id": "b" * 64, "Image": "sha256:c", "Created": "2026-01-01T00:00:00.123456789Z"}
    lock = parse_lock({**good, "Config": {"Labels": labels}})
    assert lock is not None and lock.record == rec and lock.holder == here
    early, late = datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC), datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
    other = here.model_copy(update={"machine": "n/2"})
    assert why_live(lock, early, other, None) is not None  # another machine: the lease decides
    assert why_live(lock, late, other, None) is None
    assert why_live(lock, early, here, False) is None  # this machine, its process is gone
    assert why_live(lock, early, here, True) is not None
    for key, value in [
        (f"{PREFIX}lease-s", "inf"),
        (f"{PREFIX}lease-s", "nan"),
        (f"{PREFIX}lease-s", "1e400"),
        (f"{PREFIX}lease-s", "-5"),
        (f"{PREFIX}holder-pid", "x"),
        (f"{PREFIX}restart-policy", "[[[["),
        (f"{PREFIX}original-id", None),
    ]:
        broken = parse_lock({**good, "Config": {"Labels": {**labels, key: value}}})
        if broken is not None:
            assert 0 <= broken.holder.lease_s <= 86400
            why_live(broken, late, other, None)
    assert parse_lock({**good, "Created": "garbage", "Config": {"Labels": labels}}) is None
    assert parse_lock({**good, "Config": {"Labels": {"x": "y"}}}) is None
