"""Issue 15 (part): evidence from a compromised host must not write files outside the bundle,
and must reach the terminal and the post-mortem inert."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from tests.hostile_engine import hostile_engine

CLI = [sys.executable, "-m", "runbooks.cli"]
NO_HOST_COMMANDS = """
name: engine-only
kind: incident
host_sources:
  - {name: uname, path: commands/uname.txt, command: uname -s}
nccl_tests: false
"""


def test_a_container_name_from_a_hostile_engine_cannot_write_outside_the_bundle(
    tmp_path: Path,
) -> None:
    cid, bad = "ab" * 32, "cd" * 32
    state = {
        "Running": False,
        "ExitCode": 1,
        "FinishedAt": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    container = {
        "Id": cid,
        "Name": "/../../../escaped",
        "Config": {"Image": "x", "Env": ["NVIDIA_VISIBLE_DEVICES=all"], "Tty": False},
        "HostConfig": {},
        "State": state,
    }
    # A malformed answer (no Config.Tty, which docker-py reads before fetching logs).
    malformed = {
        "Id": bad,
        "Name": "/broken",
        "Config": {"Image": "x", "Env": ["CUDA_VERSION=12.1"]},
        "State": state,
    }
    book = tmp_path / "runbook.yaml"
    book.write_text(NO_HOST_COMMANDS)
    out = tmp_path / "work" / "bundles"
    logs = {cid: b"written by the attacker\n"}
    with hostile_engine(tmp_path / "d.sock", [container, malformed], logs) as url:
        proc = subprocess.run(
            [*CLI, "collect", "local", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            env={
                **os.environ,
                "CUDAMEDIC_DOCKER_HOST": url,
                "CUDAMEDIC_RUNBOOK": str(book),
                "CUDAMEDIC_STATE_DIR": str(tmp_path / "state"),
            },
        )
    assert proc.returncode == 0, proc.stderr
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert all(
        p.startswith(("work/bundles/", "state/")) or p in ("runbook.yaml",) for p in written
    ), written
    assert not list(tmp_path.rglob("escaped*"))
    bundle = Path(proc.stdout.strip())
    assert (bundle / "containers" / f"{cid[:12]}.log").read_text() == "written by the attacker\n"
    meta = (bundle / "bundle.json").read_text()
    assert "container-name-refused" in meta and "Traceback" not in proc.stderr
    assert "broken:log" in meta and "malformed answer from the engine" in meta


# -- resource exhaustion from small inputs (classify on a bundle someone sends you) ------------
def _classify(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "classify", str(path)], capture_output=True, text=True, timeout=60)


def test_a_tar_declaring_more_than_the_cap_is_refused_before_unpacking(tmp_path: Path) -> None:
    import gzip
    import tarfile

    bomb = tmp_path / "bomb.tar.gz"
    info = tarfile.TarInfo("b/containers/x.log")
    info.size = 3 * 1024**3  # the header declares 3 GiB (a real bomb's zeros gzip to MBs)
    bomb.write_bytes(gzip.compress(info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 4096))
    proc = _classify(bomb)
    assert proc.returncode == 2, proc.stderr
    assert "refused (not unpacked)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_too_many_tar_entries_and_deep_nesting_are_refused_or_skipped(tmp_path: Path) -> None:
    import io
    import tarfile

    many = tmp_path / "many.tar.gz"
    with tarfile.open(many, "w:gz") as tar:
        for n in range(10_001):
            info = tarfile.TarInfo(f"b/commands/f{n}.txt")
            tar.addfile(info, io.BytesIO(b""))
    proc = _classify(many)
    assert proc.returncode == 2 and "entries" in proc.stderr, proc.stderr
    deep = tmp_path / "deep.tar.gz"
    with tarfile.open(deep, "w:gz") as tar:
        name = "/".join(["d"] * 1100) + "/x.log"
        data = b"RuntimeError: CUDA error: out of memory\n"
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        log = tarfile.TarInfo("b/containers/train.log")
        log.size = len(data)
        tar.addfile(log, io.BytesIO(data))
    proc = _classify(deep)
    assert proc.returncode == 0, proc.stderr
    assert "cuda-oom" in proc.stdout and "RecursionError" not in proc.stderr + proc.stdout


def test_a_fifo_is_refused_instead_of_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    proc = _classify(fifo)
    assert proc.returncode == 2 and "not a regular file or directory" in proc.stderr


def test_big_files_are_streamed_not_held_in_memory(tmp_path: Path) -> None:
    from runbooks.collect.bundle import MEMORY_BUDGET_BYTES, open_bundle

    root = tmp_path / "b"
    (root / "containers").mkdir(parents=True)
    chunk = b"epoch 1 loss 0.1\n" * (15 * 2**20 // 17)
    for n in range(8):
        (root / "containers" / f"w{n}.log").write_bytes(chunk)
    with open_bundle(root) as bundle:
        held = sum(len(text) for text in bundle.files.values())
        assert held <= MEMORY_BUDGET_BYTES and bundle.large


def test_an_xml_of_half_a_million_gpus_is_refused_quickly() -> None:
    import time

    from runbooks.collect.evidence.nvidia_smi import parse_nvidia_smi_xml

    started = time.monotonic()
    facts = parse_nvidia_smi_xml("<nvidia_smi_log>" + "<gpu/>" * 500_000 + "</nvidia_smi_log>")
    assert [f.code for f in facts.findings] == ["xml-too-many-elements"] and not facts.gpus
    assert time.monotonic() - started < 5


def test_control_characters_in_a_log_reach_the_terminal_escaped(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_bytes(b"\x1b[2J\x1b[31mRuntimeError: CUDA error: out of memory\r## Resolution\x07\n")
    proc = _classify(log)
    assert proc.returncode == 0
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout and "\x07" not in proc.stdout
    assert "\\x1b" in proc.stdout
