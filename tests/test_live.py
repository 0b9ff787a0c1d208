"""The live path, where users meet the diagnosis: a running container on the lab, collected, then
classified, must get the verdict its evidence gets offline.

- The reader table (runbooks/diagnose/facts.py READERS): a file is read by what produced it, never
  by
  whether cudamedic collected it (a collected container log was once read as nvidia-smi output,
  so live triage never saw what the workload printed).
- Ten real error texts (each a line of a corpus case, whose case.yaml names its public thread),
  each printed by a busybox container on the lab: `collect` + `classify`, and `triage`, give the
  verdict of the same text pasted into `classify -`.
- The shm fix from the workload's own log: `fix local --apply --yes`, and a second worker (other
  state dir and HOME) finishing a fix killed after the rename.
- The replay lab (tests/lab/replay.py): a stratified sample of the corpus (at least 3 cases per
  class, at least 60 in all) replayed live, each live verdict equal to the offline one.
  `make replay` runs every case (docs/accuracy.md, "live").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
import yaml

from runbooks.core.runbook import load_runbook
from runbooks.core.settings import Settings
from runbooks.diagnose.classify import classify_path
from runbooks.diagnose.facts import READERS, reader_of
from tests.lab import replay
from tests.lab.lab import IMAGE, LabState
from tests.test_fix import CLI, cli_env, fix_settings  # noqa: F401 - fixtures

CORPUS = Path(__file__).parent / "corpus"
SCRIPTS = Path(__file__).parents[1] / "scripts"

# (corpus case, file, a text in the line): the line printed is that file's first line holding it.
TEN = [
    ("shm-too-small--dataloader-unable-to-write-buried-in-training-log", "containers/train.log",
     "killed by signal: Bus error"),
    ("cuda-oom--k8s-time-slicing-t4-second-pod-oom", "containers/qa.log", "CUDA out of memory"),
    ("cuda-illegal-access--pytorch15-conv3d-small-numel-fixed-in-newer", "containers/train.log",
     "an illegal memory access was encountered"),
    ("invalid-device-ordinal--stanford-alpaca-torchrun-nproc-4-one-gpu", "trigger.txt",
     "invalid device ordinal"),
    ("volume-permission-denied--sd-docker-output-owned-by-root", "containers/sd.log",
     "PermissionError: [Errno 13]"),
    ("nccl-timeout--pytorch-deepspeed-sft-broadcast-1800s", "containers/train.log",
     "Watchdog caught collective operation timeout"),
    ("cpu-only-build--petronetto-slim-image-without-cuda", "trigger.txt",
     "Torch not compiled with CUDA enabled"),
    ("arch-unsupported--bevfusion-3090-cuda101-no-kernel-image", "trigger.txt",
     "no kernel image is available"),
    ("nccl-error--nccl-tests-docker-socket-creation-failed-no-ip-interface",
     "containers/nccl-tests.log", "unhandled system error"),
    ("disk-full--dolly-torch-save-checkpoint-errno-28-p3-16xlarge", "containers/train.log",
     "[Errno 28] No space left on device"),
]  # fmt: skip


def real_line(case: str, rel: str, needle: str) -> str:
    lines = (CORPUS / case / rel).read_text(encoding="utf-8").splitlines()
    return next(ln for ln in lines if needle in ln)


# -- the reader table ---------------------------------------------------------------------------
def test_a_collected_workload_log_is_read_as_the_workloads_log(tmp_path: Path) -> None:
    """A container log listed among bundle.json's sources (as every collection lists it) is
    scanned for the workload's signatures: the bus error decides, from the log line."""
    bundle = tmp_path / "b"
    (bundle / "containers").mkdir(parents=True)
    line = real_line(*TEN[0])
    (bundle / "containers" / "w.log").write_text(f"epoch 1 step 40\n{line}\n")
    (bundle / "bundle.json").write_text(
        json.dumps(
            {
                "schema_version": 1,
                "host": "node07",
                "target": "node07",
                "containers": ["w"],
                "collected_at": "2026-12-04T10:00:00Z",
                "sources": [
                    {"name": "w:log", "path": "containers/w.log", "status": "ok"},
                    {"name": "uname", "path": "commands/uname.txt", "status": "ok"},
                ],
            }
        )
    )
    diagnosis = classify_path(bundle)
    assert diagnosis.incident == "shm-too-small", diagnosis.summary
    assert any(ln.source == "containers/w.log" and ln.line == 2 for ln in diagnosis.evidence)


def test_every_file_cudamedic_writes_has_its_reader() -> None:
    """The packaged runbooks' host commands are host inventories (never read for the workload's
    signatures), each named in the table rather than caught by its catch-all rows; container logs
    are the workload's; probes are ours; and the same path reads the same with or without a
    bundle.json."""
    catch_all = {"commands/*", "*", "containers/*"}
    named = {pattern for pattern, _ in READERS} - catch_all
    for kind in ("incident", "sweep"):
        for src in load_runbook(None, kind).host_sources:  # type: ignore[arg-type]
            reader = reader_of(src.path)
            assert reader.scan in ("smi", "kernel", None), (src.path, reader)
            assert reader.origin in ("host", "kernel")
            assert src.path in named or src.path == "nvidia-smi.xml", src.path
        for probe in load_runbook(None, kind).container_probes:  # type: ignore[arg-type]
            assert reader_of(f"containers/train.exec-{probe.name}.txt").origin == "probe"
    assert reader_of("containers/train.log") == ("log", "container")
    assert reader_of("trigger.txt") == ("log", "trigger")
    assert reader_of("commands/kubectl-logs.txt").scan == "command"  # a person's, or a runbook's


# -- ten real texts, live ----------------------------------------------------------------------
def _incident(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(json.loads(proc.stdout)["incident"])


@pytest.fixture
def live_env(prefect_api: str, lab: LabState, fix_settings: Settings) -> dict[str, str]:  # noqa: F811
    # `local` is this machine with the lab's GPU engine as its Docker engine.
    return cli_env(
        lab, fix_settings, PREFECT_API_URL=prefect_api, DOCKER_HOST=lab.engines["gpu"].url
    )


@pytest.mark.parametrize(("case", "rel", "needle"), TEN, ids=[t[0].split("--")[0] for t in TEN])
def test_a_container_printing_a_real_error_gets_the_verdict_of_the_text_pasted(
    case: str,
    rel: str,
    needle: str,
    live_env: dict[str, str],
    make_container,
    container_name: str,
) -> None:
    line = real_line(case, rel, needle)
    text = line + "\n"
    c = make_container(container_name, 'printf "%s" "$TEXT"; exit 1', environment={"TEXT": text})
    c.wait(timeout=30)

    def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args], input=stdin, capture_output=True, text=True, env=live_env, timeout=180
        )

    pasted = _incident(cli("classify", "-", "--json", stdin=text))
    collected = cli("collect", "local", "--container", container_name, "--json")
    assert collected.returncode == 0, collected.stderr
    bundle = json.loads(collected.stdout)["targets"][0]["bundle"]
    assert Path(bundle, "containers", f"{container_name}.log").read_text() == text
    assert _incident(cli("classify", bundle, "--json")) == pasted, (line, pasted)
    triaged = cli("triage", "local", "--container", container_name, "--json")
    assert _incident(triaged) == pasted, (line, triaged.stderr[-1500:])


# -- the shm fix from the workload's own log ---------------------------------------------------
# A DataLoader's behaviour: with Docker's 64 MB /dev/shm its workers die with the real error
# (the hopsworks thread's line); with enough shared memory it trains on.
SHM_TEXT = real_line(*TEN[0])
DATALOADER = (
    "kb=$(df -k /dev/shm | awk 'NR==2 {print $2}'); "
    'if [ "$kb" -lt 1048576 ]; then printf "%s\\n" "$TEXT"; exit 1; fi; '
    "echo training; exec sleep 3600"
)


def _dataloader(engine: docker.DockerClient, name: str) -> None:
    c = engine.containers.run(
        IMAGE,
        ["sh", "-c", DATALOADER],
        name=name,
        detach=True,
        network_mode="none",
        shm_size="64m",
        environment={"TEXT": SHM_TEXT, "NVIDIA_VISIBLE_DEVICES": "all"},
        device_requests=[docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])],
    )
    c.wait(timeout=30)


def _worker_env(base: dict[str, str], root: Path) -> dict[str, str]:
    (root / "home").mkdir(parents=True)
    return {
        **base,
        "CUDAMEDIC_STATE_DIR": str(root / "state"),
        "CUDAMEDIC_OUT_DIR": str(root / "out"),
        "HOME": str(root / "home"),
    }


def test_the_shm_fix_goes_through_from_the_workloads_log(
    live_env: dict[str, str], gpu_engine: docker.DockerClient, tmp_path: Path
) -> None:
    name = f"t-{uuid.uuid4().hex[:10]}"
    _dataloader(gpu_engine, name)
    try:
        a = _worker_env(live_env, tmp_path / "a")
        run = subprocess.run(
            [*CLI, "fix", "local", "--container", name, "--apply", "--yes", "--json"],
            capture_output=True, text=True, env=a, timeout=300,
        )  # fmt: skip
        out = json.loads(run.stdout)
        assert (out["incident"], out["outcome"]) == ("shm-too-small", "fixed"), run.stderr
        assert any("--shm-size" in d for d in out["plan"]["diff"])
        after = gpu_engine.containers.get(name)
        assert after.attrs["HostConfig"]["ShmSize"] >= 1 << 30 and after.status == "running"
    finally:
        _remove_like(gpu_engine, name)


def test_a_second_worker_finishes_a_shm_fix_killed_after_the_rename(
    live_env: dict[str, str], gpu_engine: docker.DockerClient, tmp_path: Path
) -> None:
    name = f"t-{uuid.uuid4().hex[:10]}"
    _dataloader(gpu_engine, name)
    try:
        a, b = _worker_env(live_env, tmp_path / "a"), _worker_env(live_env, tmp_path / "b")
        killed = subprocess.run(
            [*CLI, "fix", "local", "--container", name, "--apply", "--yes"],
            capture_output=True, text=True, timeout=300,
            env={**a, "CUDAMEDIC_CRASH_AT": "rename:done"},
        )  # fmt: skip
        assert killed.returncode == -9, killed.stderr
        # Worker B knows nothing of A's fix: it recovers from the record on the target, then
        # applies the fix the workload's log still calls for.
        done = subprocess.run(
            [*CLI, "fix", "local", "--container", name, "--apply", "--yes", "--json"],
            capture_output=True, text=True, env=b, timeout=300,
        )  # fmt: skip
        assert "recovered" in done.stderr + done.stdout, done.stderr
        out = json.loads(done.stdout)
        assert (out["incident"], out["outcome"]) == ("shm-too-small", "fixed"), done.stderr
        assert gpu_engine.containers.get(name).attrs["HostConfig"]["ShmSize"] >= 1 << 30
    finally:
        _remove_like(gpu_engine, name)


def _remove_like(engine: docker.DockerClient, name: str) -> None:
    for c in engine.containers.list(all=True):
        if c.name.startswith(name):
            c.remove(force=True)


# -- the replay lab: corpus cases live ---------------------------------------------------------
def _replay_module():  # scripts/ is not a package: load scripts/replay.py by path
    import importlib.util

    spec = importlib.util.spec_from_file_location("cudamedic_replay", SCRIPTS / "replay.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_replay_plan_of_a_case_is_its_evidence() -> None:
    """What a replay puts on the host and in the container is the case's own files, with the
    HostConfig its inspect gives (pure)."""
    plan = replay.plan_case(CORPUS / "shm-too-small--megatron-errno28-no-space-left")
    (c,) = plan.containers
    assert c.config_from == "inspect" and c.gpus and c.shm_size == 64 * 2**20
    assert plan.trigger == (CORPUS / plan.case / "trigger.txt").read_text()
    plan = replay.plan_case(CORPUS / "gpu-hardware-fault--llama-swap-5060ti-unseated-xid79")
    book = plan.runbook()
    paths = {s["path"] for s in book["host_sources"]}
    assert paths >= {"nvidia-smi.txt", "dmesg.txt"} and "commands/df.txt" not in paths
    assert plan.host_files["dmesg.txt"] == (CORPUS / plan.case / "dmesg.txt").read_bytes()


@pytest.fixture(scope="session")
def replay_lab(lab: LabState) -> Iterator[replay.ReplayLab]:
    """The replay lab beside the lab (reused when up; stopped at the end when started here)."""
    existing = replay.ReplayLab.load(Path(lab.dir))
    reuse = existing is not None and existing.alive()
    state = replay.up()
    yield state
    if not reuse:
        replay.down(state)


TRIAGE_EVERY = 11  # `cudamedic triage` too for every 11th case of the sample (6 of 66)


def test_a_stratified_sample_of_the_corpus_replayed_live_gets_its_offline_verdicts(
    replay_lab: replay.ReplayLab, prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = _replay_module()
    cases = tool.sample(tool.all_cases())
    labels = Counter(str(yaml.safe_load((c / "case.yaml").read_text())["incident"]) for c in cases)
    assert len(cases) >= 60 and min(labels.values()) >= 3 and len(labels) == 22, labels
    monkeypatch.setenv("CUDAMEDIC_CONFIG", replay_lab.config)
    env = {**os.environ, "CUDAMEDIC_STATE_DIR": str(tmp_path / "state")}
    outcomes = [
        tool.replay_case(replay_lab, case, tmp_path, env if i % TRIAGE_EVERY == 0 else None)
        for i, case in enumerate(cases)
    ]
    replayed = [o for o in outcomes if o.live is not None]
    assert len(replayed) >= 60, [(o.case, o.unreplayable) for o in outcomes if o.live is None]
    unexplained = [
        (o.case, o.live, o.offline)
        for o in replayed
        if not o.agrees and o.case not in tool.EXPLAINED
    ]
    assert unexplained == [], unexplained
    live_ok = sum(o.live == o.label for o in replayed)
    offline_ok = sum(o.offline == o.label for o in replayed)
    assert live_ok >= offline_ok - 0.01 * len(replayed), (live_ok, offline_ok)
    triaged = [o for o in replayed if o.triage is not None]
    assert len(triaged) == 6
    assert [(o.case, o.triage) for o in triaged] == [
        (o.case, o.triage_bundle_verdict) for o in triaged
    ]
