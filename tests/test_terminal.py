# ruff: noqa: F811 - the fixtures imported from tests.test_fix / tests.test_flows
"""The operator's view (issue 19): what the real CLI says in the terminal — why a target was not
reached and which sources failed, exit codes as the README documents them, the approval prompt,
sweeps that say what is still wrong, quiet -v, --version, --json, and reports that match what
happened."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import docker
import pytest
from docker.types import DeviceRequest

from runbooks.core.settings import Settings
from tests.lab.lab import LabState
from tests.test_fix import (  # noqa: F401 - fixtures
    CLI,
    GPU_WORKLOAD,
    SHM_WORKLOAD,
    fix_settings,
    run_cli,
    volume,
)
from tests.test_flows import cudamedic, env, field, shm_container  # noqa: F401 - fixtures

UNREACHABLE = "ssh://root@127.0.0.1:1"  # loopback, a port nothing listens on
GPUS_ALL = [DeviceRequest(count=-1, capabilities=[["gpu"]])]


def section(report: str, title: str) -> str:
    m = re.search(rf"^## {title}\n(.*?)(?=^## |\Z)", report, re.M | re.S)
    assert m, f"no section {title} in\n{report}"
    return m.group(1).strip()


# -- 1. the reason, where the user is looking --------------------------------------------------
def test_collect_of_an_unreachable_target_says_why(lab: LabState, fix_settings: Settings) -> None:
    proc = run_cli(lab, fix_settings, "collect", UNREACHABLE)
    assert proc.returncode == 3, proc.stderr
    assert "Connection refused" in proc.stderr, proc.stderr
    assert re.search(r"^  ssh: .*Connection refused$", proc.stderr, re.M), proc.stderr
    # The sources that could not run because of it: named, on one line.
    assert re.search(r"^  not run \(host unreachable\): .*nvidia-smi", proc.stderr, re.M)
    assert "Traceback" not in proc.stderr


def test_collect_names_each_failed_source(lab: LabState, fix_settings: Settings) -> None:
    proc = run_cli(lab, fix_settings, "collect", "gpu-mismatch")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^  nvidia-smi: exit code 18$", proc.stderr, re.M), proc.stderr
    assert re.search(r"^  nvidia-smi-xml: exit code 18$", proc.stderr, re.M), proc.stderr
    assert proc.stdout.strip().count("\n") == 0, "stdout: the bundle path only"


def test_fix_of_an_unreachable_target_says_why(lab: LabState, fix_settings: Settings) -> None:
    proc = run_cli(lab, fix_settings, "fix", UNREACHABLE, "--container", "train")
    assert proc.returncode == 3, proc.stderr
    assert "Connection refused" in proc.stderr and "Traceback" not in proc.stderr


def test_triage_of_an_unreachable_target_says_why_and_exits_3(env: dict[str, str]) -> None:
    done = cudamedic(env, "triage", UNREACHABLE)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Connection refused" in done.stderr, done.stderr
    assert re.search(r"^  ssh: .*Connection refused$", done.stderr, re.M), done.stderr
    from runbooks.core.cli_json import TriageResult

    as_json = cudamedic(env, "triage", UNREACHABLE, "--json")
    result = TriageResult.model_validate_json(as_json.stdout)
    assert as_json.returncode == 3 and result.exit_code == 3
    assert result.reachable is False and "Connection refused" in (result.reason or "")


# -- 3. the approval prompt, 8. a rejected response's report -------------------------------------
def test_approval_prompt_is_plain_text_with_the_command_once(
    env: dict[str, str],
    make_container,
    container_name: str,
    gpu_engine,
    volume: str,
) -> None:
    shm_container(make_container, container_name, volume)
    proc = subprocess.Popen(
        [*CLI, "triage", "gpu-healthy", "--container", container_name, "--apply", "--no-input"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        run_id = None
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"waiting for approval: `cudamedic approve ([0-9a-f-]{36})`", line):
                run_id = m.group(1)
                break
        prompt = "".join(lines)
        assert run_id, prompt
        assert "+ --shm-size 8g" in prompt
        assert "```" not in prompt and not re.search(r"^#", prompt, re.M), prompt
        assert prompt.count(f"cudamedic approve {run_id}") == 1, prompt
        no = cudamedic(env, "approve", run_id, "--reject", "--reason", "mid-epoch")
        assert no.returncode == 0, no.stderr
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 4, rest + err
    report = Path(field(rest, "report")).read_text()
    resolution = section(report, "Resolution")
    assert "nothing was changed" in resolution.lower(), resolution
    assert "was recreated" not in report
    impact = section(report, "Impact")
    assert "not applied" in impact and "nothing was changed" in impact, impact


# -- 8. a healthy response's report ------------------------------------------------------------
def test_healthy_report_does_not_contradict_itself(
    env: dict[str, str],
    make_container,
    container_name: str,
) -> None:
    make_container(container_name, GPU_WORKLOAD, device_requests=GPUS_ALL)
    done = cudamedic(env, "triage", "gpu-healthy", "--container", container_name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert field(done.stdout, "incident").startswith("healthy"), done.stdout
    report = Path(field(done.stdout, "report")).read_text()
    assert "needs a person" not in report, report
    assert section(report, "Resolution"), report
    assert "nothing was changed" in section(report, "Resolution").lower()


# -- 8. a rolled-back fix's report ---------------------------------------------------------------
def test_rolled_back_fix_report_says_so_and_names_the_cause_it_pointed_at(
    lab: LabState,
    fix_settings: Settings,
    make_container,
    container_name: str,
    plain_engine: docker.DockerClient,
) -> None:
    make_container(
        container_name,
        GPU_WORKLOAD,
        engine=plain_engine,
        environment={"NVIDIA_VISIBLE_DEVICES": "all"},
    )
    proc = run_cli(
        lab, fix_settings, "fix", "gpu-nohook", "--container", container_name, "--apply", "--yes"
    )
    assert proc.returncode == 5, proc.stdout + proc.stderr
    m = re.search(r"The failure points at ([a-z-]+)", proc.stdout)
    assert m, proc.stdout
    cause = m.group(1)
    report = Path(proc.stdout.strip().splitlines()[-1].removeprefix("report: ")).read_text()
    resolution = section(report, "Resolution")
    assert "was recreated with one change" not in resolution, resolution
    assert "rolled back" in resolution, resolution
    assert f"`{cause}`" in section(report, "Root cause").splitlines()[0], report


# -- 4, 5, 6. sweeps: what is still wrong, quiet -v, --json --------------------------------------
def test_sweep_says_what_is_still_wrong_quietly_and_as_json(env: dict[str, str]) -> None:
    first = cudamedic(env, "-v", "sweep", "--host", "gpu-nodriver")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "HTTP Request" not in first.stderr, first.stderr
    # The lab's engines are shared: a container started elsewhere is news; sweep until quiet.
    for _ in range(4):
        second = cudamedic(env, "sweep", "--host", "gpu-nodriver")
        if "nothing new" in second.stdout:
            break
    report = field(second.stdout, "report")
    assert "nothing new, changed or resolved since the last sweep" in second.stdout
    assert f"still: 1 drain, 0 warning — see {report}" in second.stdout, second.stdout
    from runbooks.core.cli_json import SweepResult

    third = cudamedic(env, "-vv", "sweep", "--host", "gpu-nodriver", "--json")
    assert third.returncode == 0, third.stderr
    assert "HTTP Request" in third.stderr  # -vv shows the HTTP client's requests
    result = SweepResult.model_validate_json(third.stdout)
    assert json.loads(third.stdout)["schema"] == 1
    assert result.counts == {"drain": 1, "warning": 0, "healthy": 0}
    assert result.verdicts == {"gpu-nodriver": "drain"}
    assert result.still == {"drain": ["gpu-nodriver"], "warning": []}


# -- 6. --version, --json -------------------------------------------------------------------------
def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    proc = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == f"cudamedic {version('cudamedic')}"


def test_collect_json_is_one_object_on_stdout(lab: LabState, fix_settings: Settings) -> None:
    from runbooks.core.cli_json import CollectResult

    proc = run_cli(lab, fix_settings, "collect", UNREACHABLE, "--json")
    assert proc.returncode == 3
    result = CollectResult.model_validate_json(proc.stdout)
    assert result.exit_code == 3 and len(result.targets) == 1
    t = result.targets[0]
    assert t.reachable is False and "Connection refused" in (t.reason or "")
    assert Path(t.bundle, "bundle.json").is_file()
    assert any(s.name == "ssh" for s in t.failed_sources)
    assert "Connection refused" in proc.stderr  # the human text went to stderr


def test_fix_json_dry_run_and_errors(
    lab: LabState,
    fix_settings: Settings,
    make_container,
    container_name: str,
) -> None:
    from runbooks.core.cli_json import ErrorResult, FixResult

    c = make_container(container_name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    proc = run_cli(lab, fix_settings, "fix", "gpu-healthy", "--container", container_name, "--json")
    assert proc.returncode == 0, proc.stderr
    result = FixResult.model_validate_json(proc.stdout)
    assert result.incident == "shm-too-small" and result.outcome == "planned"
    assert result.plan is not None and "+ --shm-size 8g" in result.plan.diff
    assert "diagnosis: shm-too-small" in proc.stderr
    bad = run_cli(lab, fix_settings, "fix", "nohost", "--container", "x", "--json")
    assert bad.returncode == 2
    err = ErrorResult.model_validate_json(bad.stdout)
    assert err.command == "fix" and err.exit_code == 2 and "nohost" in err.error
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("command", ["collect", "fix", "triage", "sweep"])
def test_json_flag_is_documented(command: str) -> None:
    doc = (Path(__file__).parents[1] / "docs" / "cli-json.md").read_text()
    assert f"### `{command} --json`" in doc


# -- 7. shell completion -------------------------------------------------------------------------
def test_bash_completion_is_generated_from_the_parser(tmp_path: Path) -> None:
    proc = subprocess.run([*CLI, "completion", "bash"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "cudamedic.bash"
    script.write_text(proc.stdout)

    def complete(*words: str) -> list[str]:
        line = " ".join(["cudamedic", *words])
        probe = (
            f"source {script}; COMP_WORDS=({line}); COMP_CWORD={len(words)}; "
            '_cudamedic; printf "%s\\n" "${COMPREPLY[@]}"'
        )
        out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
        return out.stdout.split()

    assert "sweep" in complete("sw") and "--version" in complete("--v")
    assert complete("fix", "--j") == ["--json"]
    assert complete("-v", "sweep", "--fail") == ["--fail-on-drain"]
    assert set(complete("server", "")) == {"start", "stop", "status", "-h", "--help"}
