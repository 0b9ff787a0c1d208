"""Collection against the real lab: sshd hosts replaying recorded GPU outputs, real dockerd."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runbooks.collect.bundle import BundleMeta
from runbooks.collect.collector import collect
from runbooks.collect.inventory import Host, load_inventory
from runbooks.collect.target import Target, resolve_target
from runbooks.core.errors import InputError
from runbooks.core.settings import Settings
from tests.lab.lab import FIXTURES, LabState
from tests.lab.scenarios import SCENARIOS

SECRET = "hf_ZZtopSecretTokenValue0123456789abcd"


def meta_of(bundle: Path) -> BundleMeta:
    return BundleMeta.model_validate_json((bundle / "bundle.json").read_text())


def source(meta: BundleMeta, name: str):  # type: ignore[no-untyped-def]
    return next(s for s in meta.sources if s.name == name)


def target(settings: Settings, name: str) -> Target:
    assert settings.inventory is not None
    return resolve_target(name, load_inventory(settings.inventory))


def test_collect_from_ssh_host_with_xid79(settings: Settings) -> None:
    bundle = collect(target(settings, "gpu-xid79"), settings, trigger="training died")
    meta = meta_of(bundle)
    assert meta.host == "gpu-xid79"
    assert source(meta, "nvidia-smi").status == "ok"
    scenario = SCENARIOS["gpu-xid79"]
    assert (bundle / "nvidia-smi.txt").read_text() == (
        FIXTURES / scenario.files["nvidia-smi.txt"]
    ).read_text()
    assert "fallen off the bus" in (bundle / "dmesg.txt").read_text()
    assert source(meta, "nvidia-smi-list").status == "ok"
    assert (bundle / "commands/nvidia-smi-L.txt").read_text().count("GPU ") == 8
    assert source(meta, "docker-info").status == "ok"
    info = json.loads((bundle / "docker-info.json").read_text())
    assert "nvidia" in info["Runtimes"] or info["ServerVersion"]
    assert source(meta, "nccl-tests").status == "skipped"
    assert "not found" in (source(meta, "nccl-tests").note or "")
    assert (bundle / "trigger.txt").read_text() == "training died"


def test_collect_runs_nccl_tests_when_present(settings: Settings) -> None:
    bundle = collect(target(settings, "gpu-healthy"), settings)
    meta = meta_of(bundle)
    nccl = source(meta, "nccl-tests")
    assert nccl.status == "ok", nccl
    assert "-g 8" in (nccl.command or "")
    assert "Avg bus bandwidth" in (bundle / "nccl-tests.txt").read_text()


def test_collect_container_over_ssh_with_redaction(
    settings: Settings, make_container, container_name: str
) -> None:
    make_container(
        container_name,
        f"echo starting; echo token is {SECRET}; echo 'RuntimeError: CUDA error: invalid device "
        "ordinal'; sleep 300",
        environment={
            "HF_TOKEN": SECRET,
            "NCCL_DEBUG": "INFO",
            "CUDA_VISIBLE_DEVICES": "3",
            "DB_URL": "postgres://svc:pa55word@db/x",
        },
        labels={"wandb.api_key": "0123456789abcdef0123456789abcdef01234567"},
        shm_size="64m",
    )
    time.sleep(1)
    bundle = collect(target(settings, "gpu-healthy"), settings, container=container_name)
    meta = meta_of(bundle)
    base = bundle / "containers" / container_name
    inspect = json.loads(Path(f"{base}.inspect.json").read_text())
    assert inspect["HostConfig"]["ShmSize"] == 64 * 1024 * 1024
    assert "NCCL_DEBUG=INFO" in inspect["Config"]["Env"]
    assert "invalid device ordinal" in Path(f"{base}.log").read_text()
    assert "64.0M" in Path(f"{base}.exec-shm.txt").read_text()
    assert (
        "locked memory" in Path(f"{base}.exec-ulimit.txt").read_text()
        or "-l" in Path(f"{base}.exec-ulimit.txt").read_text()
    )
    assert "CUDA_VISIBLE_DEVICES=3" in Path(f"{base}.exec-env.txt").read_text()
    assert "no python" in Path(f"{base}.exec-torch.txt").read_text()
    assert source(meta, f"{container_name}:exec-torch").status == "failed"
    # No secret anywhere in the bundle.
    for file in bundle.rglob("*"):
        if file.is_file():
            data = file.read_bytes()
            for secret in (
                SECRET.encode(),
                b"pa55word",
                b"0123456789abcdef0123456789abcdef01234567",
            ):
                assert secret not in data, f"secret leaked into {file}"


def test_collect_local_selects_gpu_containers(
    settings: Settings, make_container, container_name: str
) -> None:
    from docker.types import DeviceRequest

    make_container(
        container_name + "-gpu",
        "sleep 300",
        device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])],
    )
    make_container(container_name + "-cpu", "sleep 300")
    bundle = collect(Target(kind="local", name="local"), settings)
    meta = meta_of(bundle)
    assert container_name + "-gpu" in meta.containers
    assert container_name + "-cpu" not in meta.containers
    listing = (bundle / "containers" / f"{container_name}-gpu.exec-nvidia-smi-L.txt").read_text()
    assert listing.count("GPU ") == 8  # the toolkit shim handed all 8 recorded GPUs in
    assert source(meta, "uname").status == "ok"


def test_unreachable_host_is_a_finding(settings: Settings) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    host = Host(name="down", address="127.0.0.1", port=port)
    bundle = collect(Target(kind="ssh", name="down", host=host), settings)
    meta = meta_of(bundle)
    ssh = source(meta, "ssh")
    assert ssh.status == "error" and "refused" in (ssh.error or "").lower()
    assert any(f.code == "target-unreachable" for f in meta.findings)
    assert source(meta, "nvidia-smi").status == "error"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runbooks.cli",
            "collect",
            f"ssh://root@127.0.0.1:{port}",
            "--out",
            str(settings.out_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3 and "could not be reached" in proc.stderr
    assert Path(proc.stdout.strip()).is_dir()  # the bundle with the finding is still written


def test_hanging_command_times_out_and_others_complete(settings: Settings) -> None:
    start = time.monotonic()
    bundle = collect(target(settings, "gpu-hang"), settings)
    elapsed = time.monotonic() - start
    meta = meta_of(bundle)
    assert source(meta, "nvidia-smi").status == "timeout"
    assert source(meta, "nvidia-smi-xml").status == "timeout"
    assert source(meta, "df").status == "ok"
    assert source(meta, "docker-info").status == "ok"
    assert elapsed < 3 * settings.command_timeout + 10


def test_changed_host_key_is_rejected(settings: Settings, lab: LabState, tmp_path: Path) -> None:
    port = lab.hosts["gpu-healthy"].port
    other = lab.hosts["gpu-xid79"].port
    lines = Path(lab.known_hosts).read_text().splitlines()
    their_key = next(ln for ln in lines if ln.startswith(f"[127.0.0.1]:{other} ")).split(" ", 1)[1]
    forged = [ln for ln in lines if not ln.startswith(f"[127.0.0.1]:{port} ")]
    forged.append(f"[127.0.0.1]:{port} {their_key}")
    known = tmp_path / "known_hosts"
    known.write_text("\n".join(forged) + "\n")
    bad = settings.model_copy(update={"known_hosts": known})
    bundle = collect(target(bad, "gpu-healthy"), bad)
    ssh = source(meta_of(bundle), "ssh")
    assert ssh.status == "error" and "CHANGED" in (ssh.error or "")


def test_output_that_arrives_with_the_exit_status_is_kept(
    settings: Settings, lab: LabState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28 (a drain host once seen healthy in a two-worker sweep): the read loop checked
    for output, then for the exit status; output and exit status arriving between the two
    checks (a thread descheduled for a moment on a loaded machine) ended the loop with the
    output unread: `dmesg` exit 0 with nothing, a kernel log without its Xid, gpu-xid79
    healthy. Here the scheduler's worst case is made certain: paramiko's stderr check (the one
    between them) returns only once the command has exited."""
    import paramiko

    from runbooks.collect.remote.ssh import SshRunner

    checked = paramiko.Channel.recv_stderr_ready

    def late(chan: paramiko.Channel) -> bool:
        deadline = time.monotonic() + 10
        while not chan.exit_status_ready() and time.monotonic() < deadline:
            time.sleep(0.01)
        return bool(checked(chan))

    tgt = target(settings, "gpu-nodriver")
    assert tgt.host is not None
    runner = SshRunner(tgt.host, settings)
    try:
        monkeypatch.setattr(paramiko.Channel, "recv_stderr_ready", late)
        res = runner.run("sleep 0.3; nvidia-smi", timeout=10, max_bytes=1 << 20)
        monkeypatch.undo()
    finally:
        runner.close()
    assert res.exit_code == 9 and not res.timed_out, res
    assert b"couldn't communicate with the NVIDIA driver" in res.stdout, res


def test_a_connection_that_drops_is_a_failed_command_not_a_crash(
    settings: Settings, lab: LabState
) -> None:
    """Seen in bench_sweep.py on a saturated machine: the SSH connection of a host went away in
    the middle of its collection, and every later command raised ("source ... crashed" with a
    traceback). A command on a dropped connection is a failed command with the reason."""
    from runbooks.collect.remote.ssh import SshRunner

    tgt = target(settings, "gpu-healthy")
    assert tgt.host is not None
    runner = SshRunner(tgt.host, settings)
    try:
        assert runner.run("echo hi", timeout=10, max_bytes=1024).stdout == b"hi\n"
        runner.transport.close()  # the peer gone: what a dropped connection leaves behind
        res = runner.run("echo hi", timeout=10, max_bytes=1024)
        assert res.exit_code == 255 and not res.ok
        assert b"SSH connection is closed" in res.stderr, res.stderr
    finally:
        runner.close()


def test_unknown_host_key_rejected_unless_opted_in(
    settings: Settings, lab: LabState, tmp_path: Path
) -> None:
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    strict = settings.model_copy(update={"known_hosts": empty})
    host = target(settings, "gpu-healthy").host
    assert host is not None
    bundle = collect(Target(kind="ssh", name="h", host=host), strict)
    assert "unknown host key" in (source(meta_of(bundle), "ssh").error or "")
    opted = host.model_copy(update={"accept_unknown_host_key": True})
    bundle = collect(Target(kind="ssh", name="h", host=opted), strict)
    meta = meta_of(bundle)
    assert source(meta, "nvidia-smi").status == "ok"
    assert any(f.code == "host-key-accepted" for f in meta.findings)


def test_dmesg_not_permitted_falls_back_to_journalctl(settings: Settings) -> None:
    bundle = collect(target(settings, "gpu-mismatch"), settings)
    meta = meta_of(bundle)
    kernel = source(meta, "kernel-log")
    assert kernel.status == "ok"
    assert "journalctl -k" in (kernel.command or "")
    assert "not permitted" in (kernel.note or "")
    assert any(f.code == "kernel-log-fallback" for f in meta.findings)
    journal = FIXTURES / SCENARIOS["gpu-mismatch"].files["journal.txt"]
    assert (bundle / "dmesg.txt").read_text() == journal.read_text()


def test_non_utf8_container_log_is_collected(
    settings: Settings, make_container, container_name: str
) -> None:
    # Docker's json-file driver itself turns invalid UTF-8 into U+FFFD; we keep what it gives.
    make_container(container_name, r"printf 'ok \377\376 bytes\n'; printf 'Bus error\n'; sleep 300")
    time.sleep(1)
    bundle = collect(Target(kind="local", name="local"), settings, container=container_name)
    data = (bundle / "containers" / f"{container_name}.log").read_bytes()
    assert "\ufffd".encode() in data and b"Bus error" in data


def test_non_utf8_host_output_is_kept_byte_for_byte(settings: Settings, lab: LabState) -> None:
    dmesg = Path(lab.hosts["gpu-healthy"].data) / "dmesg.txt"
    original = dmesg.read_bytes()
    junk = b"[Thu Jan  1 00:00:01 2026] \xff\xfe\x00 not utf-8 \xc3\x28\n"
    dmesg.write_bytes(original + junk)
    try:
        bundle = collect(target(settings, "gpu-healthy"), settings)
    finally:
        dmesg.write_bytes(original)
    assert (bundle / "dmesg.txt").read_bytes() == original + junk
    assert any(
        f.code == "non-utf8-output" and f.source == "dmesg.txt" for f in meta_of(bundle).findings
    )


def test_shell_metacharacters_in_container_name_run_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(InputError, match="invalid container name"):
        collect(Target(kind="local", name="local"), settings, container=f"x; touch {marker}")
    assert not marker.exists()
    assert not (tmp_path / "bundles").exists() or not any((tmp_path / "bundles").iterdir())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runbooks.cli",
            "collect",
            "local",
            "--container",
            f"x; touch {marker}",
            "--out",
            str(tmp_path / "b2"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "invalid container name" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_cli_collect_prints_bundle_path(settings: Settings, lab: LabState, tmp_path: Path) -> None:
    env = {**os.environ, "CUDAMEDIC_CONFIG": lab.config}
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "cudamedic"),
            "collect",
            "gpu-mismatch",
            "--out",
            str(tmp_path),
            "--tar",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    path = Path(proc.stdout.strip())
    assert path.name.endswith(".tar.gz") and path.exists()


def test_two_gigabyte_log_is_tailed_in_bounded_memory(
    settings: Settings, make_container, container_name: str, lab: LabState, tmp_path: Path
) -> None:
    """A container whose json-file log is 2 GiB: the collector asks the real engine for a
    bounded tail and keeps at most log_tail_bytes, in bounded memory.

    Pushing 2 GiB through the engine's log pipe takes minutes on 2 cores, so the test writes the
    container's json-file log (the engine's own on-disk format) directly, then reads it back
    through the engine as any collection would."""
    container = make_container(container_name, "echo started")
    container.wait(timeout=30)
    log_path = Path(
        container.attrs["LogPath"]
        if container.attrs.get("LogPath")
        else gpu_log_path(lab, container.id)
    )
    line = (
        json.dumps(
            {
                "log": "step 1 loss 2.3456 lr 0.0001 grad_norm 1.234 tokens/s 12345\n",
                "stream": "stdout",
                "time": "2026-12-02T10:00:00.000000000Z",
            }
        )
        + "\n"
    )
    block = line.encode() * 16384
    last = (
        json.dumps(
            {
                "log": "RuntimeError: DataLoader worker (pid 42) is killed by signal: Bus error.\n",
                "stream": "stderr",
                "time": "2026-12-02T10:00:01.000000000Z",
            }
        )
        + "\n"
    )
    with log_path.open("wb") as fh:
        written = 0
        while written < 2 << 30:
            fh.write(block)
            written += len(block)
        fh.write(last.encode())
    assert log_path.stat().st_size > 2 << 30
    env = {
        **os.environ,
        "CUDAMEDIC_CONFIG": lab.config,
        "CUDAMEDIC_LOG_TAIL_LINES": "200000",
        "CUDAMEDIC_LOG_TAIL_BYTES": str(4 << 20),
        "CUDAMEDIC_DOCKER_HOST": lab.engines["gpu"].url,
    }
    # Measure from a small parent: a child forked from the (large) pytest process would report
    # pytest's RSS as its own peak.
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            MEASURE,
            sys.executable,
            "-m",
            "runbooks.cli",
            "collect",
            "local",
            "--container",
            container_name,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out, peak = proc.stdout.strip().rsplit(b"\n", 1)
    bundle = Path(out.decode().strip())
    log = bundle / "containers" / f"{container_name}.log"
    assert log.stat().st_size <= 4 << 20
    assert log.read_bytes().rstrip().endswith(b"Bus error.")
    meta = meta_of(bundle)
    assert source(meta, f"{container_name}:log").truncated
    assert any(f.code == "log-truncated" for f in meta.findings)
    peak_mb = int(peak) / 1024
    assert peak_mb < 200, f"peak RSS {peak_mb:.0f} MB"
    log_path.write_bytes(b"")  # give the 2 GiB back


MEASURE = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)"
)


def gpu_log_path(lab: LabState, cid: str) -> Path:
    return Path(lab.engines["gpu"].socket).parent / "data" / "containers" / cid / f"{cid}-json.log"


def test_collect_through_a_jump_host(settings: Settings, lab: LabState, tmp_path: Path) -> None:
    """ProxyJump: reach gpu-xid79 through gpu-healthy's sshd (a direct-tcpip channel)."""
    inv = load_inventory(Path(lab.inventory))
    jump = inv.get("gpu-healthy")
    host = inv.get("gpu-xid79").model_copy(update={"jump": "gpu-healthy"})
    jump_log = Path(lab.hosts["gpu-healthy"].data).parent / "sshd.log"
    logins_before = jump_log.read_text().count("Accepted publickey")
    bundle = collect(Target(kind="ssh", name="via-jump", host=host, jump=jump), settings)
    meta = meta_of(bundle)
    assert source(meta, "nvidia-smi").status == "ok"
    assert "fallen off the bus" in (bundle / "dmesg.txt").read_text()  # gpu-xid79's own log
    # Exactly one login on the jump host: the hop (the commands ran on gpu-xid79).
    assert jump_log.read_text().count("Accepted publickey") == logins_before + 1


def test_docker_py_internals_we_subclass_are_as_checked() -> None:
    """runbooks/collect/remote/docker.py subclasses docker-py's SSH transport (no public form for a
    transport over our own paramiko session). Pin what it relies on, so an upgrade that changes
    them fails here, not in the field."""
    import inspect

    import docker
    from docker.transport.sshconn import SSHConnection, SSHConnectionPool, SSHHTTPAdapter

    from runbooks.collect.remote.docker import DOCKER_PY_CHECKED

    assert tuple(int(p) for p in docker.__version__.split(".")[:1]) == DOCKER_PY_CHECKED
    assert "ssh_transport" in inspect.signature(SSHConnection.__init__).parameters
    assert callable(SSHConnectionPool._new_conn)
    assert callable(SSHHTTPAdapter.get_connection) and callable(SSHHTTPAdapter.close)
    # The public calls we use instead of private ones exist with the arguments we pass.
    params = inspect.signature(docker.APIClient.create_container_from_config).parameters
    assert {"config", "name"} <= set(params)
