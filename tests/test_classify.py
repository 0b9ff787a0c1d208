"""Classifier conformance, CLI behaviour and hostile input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runbooks.core.taxonomy import Incident
from runbooks.diagnose.classify import classify_path
from runbooks.diagnose.logscan import ere_patterns, scan_stream, scan_text, signatures
from runbooks.diagnose.rules import PRIORITY, RULES

CORPUS = Path(__file__).parent / "corpus"
SPEC = Path(__file__).parents[1] / "docs" / "spec"  # the project's own copy of the shared spec
SPEC_FILES = ("taxonomy.md", "evidence-bundle.md", "gpu-facts.md")
TAXONOMY = SPEC / "taxonomy.md"
SHARED_SPEC = next(
    (p / "shared/spec" for p in Path(__file__).resolve().parents if (p / "shared/spec").is_dir()),
    None,
)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runbooks.cli", *args], capture_output=True, text=True, timeout=120
    )


# -- conformance -------------------------------------------------------------------------------
def test_taxonomy_ids_match_the_spec() -> None:
    import re

    spec = set(re.findall(r"^\| `([a-z-]+)` \|", TAXONOMY.read_text(), re.M))
    assert spec == {i.value for i in Incident}


@pytest.mark.parametrize("name", SPEC_FILES)
def test_the_spec_copy_matches_the_shared_spec(name: str) -> None:
    """docs/spec is what a clone of this project alone has; where the team's shared/spec is
    beside it, the copy must be the same text."""
    copy = (SPEC / name).read_text()
    assert copy.startswith("# ") and len(copy.splitlines()) > 10, name
    if SHARED_SPEC is not None:
        assert copy == (SHARED_SPEC / name).read_text(), (
            f"docs/spec/{name} differs from {SHARED_SPEC}"
        )


def test_every_class_has_a_rule_and_a_priority() -> None:
    expected = set(Incident) - {Incident.HEALTHY, Incident.UNKNOWN}
    assert set(RULES) == expected
    assert set(PRIORITY) == expected


@pytest.mark.parametrize("sig", signatures(), ids=[s.id for s in signatures()])
def test_signature_matches_its_real_example(sig) -> None:  # type: ignore[no-untyped-def]
    kind = sig.where if sig.where != "any" else "log"
    assert sig.id in scan_text(sig.example, "x", kind).hits


def test_signatures_are_valid_posix_ere(tmp_path: Path) -> None:
    """The same patterns must work with `grep -E` (the benchmark compares against it)."""
    for sig in signatures():
        sample = tmp_path / "sample.txt"
        sample.write_text(sig.example + "\n")
        case = [] if sig.exact else ["-i"]
        proc = subprocess.run(
            ["grep", "-E", *case, "-c", "-e", sig.pattern, str(sample)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "1", (sig.id, proc.stderr)
    assert len(list(ere_patterns())) > 30


def test_scanner_counts_lines_across_chunk_boundaries() -> None:
    import io

    text = (
        "".join(f"noise line {i}\n" for i in range(5000))
        + "RuntimeError: CUDA error: invalid device ordinal\n"
    )
    result = scan_stream(io.BytesIO(text.encode()), "containers/x.log", chunk_size=4096)
    hit = result.hits["invalid-device-ordinal"].first[0]
    assert hit.line == 5001 and hit.text.startswith("RuntimeError")
    assert result.lines == 5001


def test_the_compiled_signatures_are_cached_and_a_bad_cache_is_compiled_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hyperscan database of the signatures is kept between runs (compiling it is most of a
    cold classify); a cache file that is corrupt is replaced, one that cannot be written is no
    error, and every path finds the same lines."""
    hyperscan = pytest.importorskip("hyperscan")
    from runbooks.diagnose import logscan

    sigs = [s for s in signatures() if logscan.applies(s, "log")]
    patterns = [s.pattern.encode() for s in sigs]
    flags = [
        hyperscan.HS_FLAG_MULTILINE | (0 if s.exact else hyperscan.HS_FLAG_CASELESS) for s in sigs
    ]
    text = b"noise\nRuntimeError: DataLoader worker (pid 1) is killed by signal: Bus error.\n"

    def found(db: object) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        db.scan(  # type: ignore[attr-defined]
            text,
            match_event_handler=lambda i, _s, end, _f, _c: out.append((i, end)),
            scratch=hyperscan.Scratch(db),
        )
        return sorted(out)

    monkeypatch.setenv("CUDAMEDIC_CACHE_DIR", str(tmp_path / "cache"))
    compiled = found(logscan._compiled(hyperscan, patterns, flags))
    assert compiled and any(sigs[i].incident == "shm-too-small" for i, _ in compiled)
    (cached,) = (tmp_path / "cache").iterdir()
    assert oct(cached.stat().st_mode & 0o777) == "0o600"
    assert found(logscan._compiled(hyperscan, patterns, flags)) == compiled  # loaded
    blob = bytearray(cached.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    cached.write_bytes(bytes(blob))
    assert found(logscan._compiled(hyperscan, patterns, flags)) == compiled
    assert cached.read_bytes() != bytes(blob)  # rewritten whole
    (tmp_path / "cache").chmod(0o777)  # others could have planted it: compiled, not read
    mtime = cached.stat().st_mtime_ns
    assert found(logscan._compiled(hyperscan, patterns, flags)) == compiled
    assert cached.stat().st_mtime_ns != mtime
    (tmp_path / "cache").chmod(0o700)
    monkeypatch.setenv("CUDAMEDIC_CACHE_DIR", str(cached))  # a file: no directory there
    assert found(logscan._compiled(hyperscan, patterns, flags)) == compiled
    other = logscan._compiled(hyperscan, patterns[:-1], flags[:-1])  # other signatures, own file
    monkeypatch.setenv("CUDAMEDIC_CACHE_DIR", str(tmp_path / "cache"))
    logscan._compiled(hyperscan, patterns[:-1], flags[:-1])
    assert len(list((tmp_path / "cache").iterdir())) == 2 and other is not None


# -- root cause over symptom -------------------------------------------------------------------
def write_bundle(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def corpus_file(case: str, rel: str) -> str:
    return (CORPUS / case / rel).read_text()


def test_xid79_beats_nccl_timeout(tmp_path: Path) -> None:
    d = classify_path(CORPUS / "gpu-hardware-fault--xid79-fell-off-bus-during-nccl-timeout")
    assert d.incident == "gpu-hardware-fault"
    assert "nccl-timeout" in d.secondary
    assert any(ln.source == "dmesg.txt" and "79" in ln.text for ln in d.evidence)
    assert d.fix is not None and not d.fix.safe
    assert any("restart the machine" in s for s in d.fix.steps)


def test_xid63_alone_is_not_a_fault() -> None:
    d = classify_path(CORPUS / "healthy--xid63-row-remap-recorded-training-continues")
    assert d.incident == "healthy"


def test_shm_fix_is_exact_docker_run_change() -> None:
    d = classify_path(CORPUS / "shm-too-small--video-diffusion-nccl-shm-segment")
    assert d.incident == "shm-too-small"
    assert d.fix is not None and d.fix.safe
    assert d.fix.docker_run == ("+ --shm-size=8g",)
    assert any(ln.source.endswith(".inspect.json") and "67108864" in ln.text for ln in d.evidence)


def test_predicted_driver_too_old_before_any_crash(tmp_path: Path) -> None:
    smi = (Path(__file__).parent / "fixtures/nvidia-smi/a100-sxm4-40gb-8gpu-r450.txt").read_text()
    inspect = {
        "Name": "/train",
        "Config": {
            "Image": "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime",
            "Env": ["CUDA_VERSION=12.1.0"],
        },
        "HostConfig": {
            "DeviceRequests": [{"Driver": "", "Count": -1, "Capabilities": [["gpu"]]}],
            "ShmSize": 8589934592,
        },
        "State": {"Running": True},
    }
    bundle = write_bundle(
        tmp_path,
        {
            "nvidia-smi.txt": smi,
            "containers/train.inspect.json": json.dumps(inspect),
            "containers/train.log": "epoch 1 step 1 loss 2.3\n",
        },
    )
    d = classify_path(bundle)
    assert d.incident == "driver-too-old", d
    assert "12.1" in d.summary


# -- CLI ---------------------------------------------------------------------------------------
def test_cli_classify_json_keys_and_exit_code() -> None:
    proc = cli(
        "classify", str(CORPUS / "shm-too-small--video-diffusion-nccl-shm-segment"), "--json"
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert {"incident", "confidence", "summary", "evidence", "secondary", "fix"} <= set(data)
    assert data["incident"] == "shm-too-small"
    assert all({"source", "line", "text"} <= set(e) for e in data["evidence"])


def test_cli_classify_tar_and_single_log(tmp_path: Path) -> None:
    case = CORPUS / "gpu-hardware-fault--xid79-fell-off-bus-during-nccl-timeout"
    tar = tmp_path / "b.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        t.add(case, arcname="bundle")
    assert (
        json.loads(cli("classify", str(tar), "--json").stdout)["incident"] == "gpu-hardware-fault"
    )
    log = tmp_path / "train.log"
    log.write_text("step 1\nRuntimeError: CUDA error: invalid device ordinal\n")
    out = cli("classify", str(log))
    assert out.returncode == 0 and "invalid-device-ordinal" in out.stdout
    assert "containers/log.log:2" in out.stdout


def test_cli_classify_healthy_and_unknown_exit_zero(tmp_path: Path) -> None:
    log = tmp_path / "ok.log"
    log.write_text("epoch 1 loss 2.0\nepoch 2 loss 1.5\n")
    assert cli("classify", str(log)).returncode == 0
    bad = tmp_path / "bad.log"
    bad.write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'label'\n"
    )
    proc = cli("classify", str(bad), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["incident"] == "unknown"


def test_cli_unreadable_path_is_a_clear_error(tmp_path: Path) -> None:
    proc = cli("classify", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "no such file" in proc.stderr and "Traceback" not in proc.stderr
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(b"\x1f\x8b\x08garbage")
    proc = cli("classify", str(broken))
    assert proc.returncode == 2 and "not a readable" in proc.stderr


# -- hostile input -----------------------------------------------------------------------------
HOSTILE = {
    "binary": bytes(range(256)) * 64,
    "non-utf8": b"ok\n\xff\xfe\xfd RuntimeError: CUDA error: invalid device ordinal\n",
    "long-line": b"x" * (10 * 1024 * 1024),
    "nul": b"\x00" * 4096 + b"\nBus error\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_bundle_files_never_crash(tmp_path: Path, name: str) -> None:
    data = HOSTILE[name]
    for rel in (
        "containers/c.log",
        "dmesg.txt",
        "nvidia-smi.txt",
        "nvidia-smi.xml",
        "containers/c.inspect.json",
        "docker-info.json",
        "nccl-tests.txt",
        "commands/df.txt",
        "containers/c.exec-torch.txt",
        "bundle.json",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    proc = cli("classify", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["incident"]


@pytest.mark.parametrize(
    "inspect",
    [
        "[]",
        "{}",
        "[1, 2]",
        "null",
        '{"HostConfig": []}',
        '{"Config": {"Env": [1, null]}}',
        "[{" * 10000,
    ],
)
def test_odd_inspect_json_is_a_finding(tmp_path: Path, inspect: str) -> None:
    write_bundle(
        tmp_path, {"containers/c.inspect.json": inspect, "containers/c.log": "Bus error\n"}
    )
    d = classify_path(tmp_path)
    assert d.incident in {i.value for i in Incident}


def test_truncated_xml_is_a_finding(tmp_path: Path) -> None:
    xml = (Path(__file__).parent / "fixtures/nvidia-smi-xml").glob("*.xml")
    text = next(iter(sorted(xml))).read_text()
    write_bundle(tmp_path, {"nvidia-smi.xml": text[: len(text) // 3]})
    d = classify_path(tmp_path)
    assert d.incident in {i.value for i in Incident}


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=2000))
def test_scanner_never_raises(text: str) -> None:
    result = scan_text(text, "containers/x.log")
    assert result.lines >= 0


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            [
                "containers/c.log",
                "dmesg.txt",
                "nvidia-smi.txt",
                "containers/c.inspect.json",
                "nccl-tests.txt",
                "docker-info.json",
                "trigger.txt",
            ]
        ),
        st.text(max_size=500),
        max_size=5,
    )
)
def test_classify_never_raises_on_any_bundle(files: dict[str, str]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        write_bundle(Path(tmp), files)
        d = classify_path(Path(tmp))
        assert d.incident in {i.value for i in Incident}


def test_bundle_symlinks_are_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("Bus error\n")
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "trigger.txt").symlink_to(secret)
    assert classify_path(root).incident != "shm-too-small"
    shutil.rmtree(root)


FIXTURES = Path(__file__).parent / "fixtures"


def test_smi_err_fields_with_exit_zero_are_a_hardware_fault(tmp_path: Path) -> None:
    smi = (FIXTURES / "nvidia-smi/err-a100-gsp-fragment.txt").read_text()
    write_bundle(tmp_path, {"nvidia-smi.txt": smi})
    d = classify_path(tmp_path)
    assert d.incident == "gpu-hardware-fault"
    assert any("ERR!" in ln.text for ln in d.evidence)


def test_mig_format_xid_lines_are_read(tmp_path: Path) -> None:
    dmesg = (FIXTURES / "dmesg/xid94-95-mig-nvidia-doc.txt").read_text()
    write_bundle(tmp_path, {"dmesg.txt": dmesg})
    d = classify_path(tmp_path)
    assert d.incident == "gpu-hardware-fault"
    assert any("GPU-I:05" in ln.text for ln in d.evidence)


def test_old_xid_before_the_workload_started_is_context(tmp_path: Path) -> None:
    # Real `dmesg -T` lines from 2024 (Xid 94 among them); the workload ran in 2025.
    dmesg = (FIXTURES / "dmesg/xid43-31-94-ctime.txt").read_text()
    inspect = {
        "Name": "/train",
        "Config": {"Image": "pytorch/pytorch:2.3.0-cuda12.1-cudnn8-runtime"},
        "HostConfig": {
            "DeviceRequests": [{"Count": -1, "Capabilities": [["gpu"]]}],
            "ShmSize": 67108864,
        },
        "State": {
            "Running": False,
            "ExitCode": 1,
            "StartedAt": "2025-06-01T10:00:00.000000000Z",
            "FinishedAt": "2025-06-01T11:00:00.000000000Z",
        },
    }
    log = "RuntimeError: DataLoader worker (pid 7) is killed by signal: Bus error.\n"
    write_bundle(
        tmp_path,
        {
            "dmesg.txt": dmesg,
            "containers/train.inspect.json": json.dumps(inspect),
            "containers/train.log": log,
        },
    )
    d = classify_path(tmp_path)
    assert d.incident == "shm-too-small", d
    assert "gpu-hardware-fault" not in d.secondary and "cuda-illegal-access" not in d.secondary


def test_log_scanning_from_many_threads_at_once() -> None:
    """A sweep scans hosts' logs in parallel threads: the compiled matcher is shared, its
    scratch space must not be (hyperscan raised ScratchInUseError, seen in a CI sweep)."""
    import threading

    from runbooks.diagnose.logscan import scan_text

    line = (
        "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient "
        "shared memory (shm).\n"
    )
    text = "step=1 loss=2.0\n" * 20000 + line
    errors: list[str] = []

    def scan() -> None:
        try:
            for _ in range(20):
                assert scan_text(text, "train.log").hits
        except Exception as exc:  # collected: an exception in a thread would be lost
            errors.append(repr(exc))

    threads = [threading.Thread(target=scan) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
