"""Issue 26, "say only what happened", through the real CLI on the lab and the tests' Prefect
server: a check that did not run is "not checked" (never "resolved"); a failed fix never reads
as a success (state type, audit, tags); the fix cap says what it counts; `classify` and the sweep
agree on the hung-`nvidia-smi` host."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from runbooks.core.runbook import Thresholds
from runbooks.diagnose.health import snapshot, with_history
from runbooks.diagnose.sweep import failed_result
from tests.test_fix import fix_settings  # noqa: F401 - fixture
from tests.test_flows import (  # noqa: F401 - fixture
    cudamedic,
    env,
    field,
    flow_run_of,
    run_id_of,
    sweep_runbook,
)


def test_a_check_that_did_not_run_is_not_checked_never_resolved(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The README's own example: `cudamedic sweep --host gpu-slow-nccl` after a sweep that ran
    nccl-tests said the NCCL problem was resolved, though the default runbook never ran them."""
    with_nccl = {
        **env,
        "CUDAMEDIC_SWEEP_RUNBOOK": str(
            sweep_runbook(tmp_path, **{"nccl_tests: false": "nccl_tests: true"})
        ),
    }
    first = cudamedic(with_nccl, "sweep", "--host", "gpu-slow-nccl")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "new      gpu-slow-nccl: nccl-bandwidth-low [warning]" in first.stdout, first.stdout

    default = cudamedic(env, "sweep", "--host", "gpu-slow-nccl", "--json")
    assert default.returncode == 0, default.stdout + default.stderr
    result = json.loads(default.stdout)
    assert result["changes"] == [], result["changes"]  # not "resolved"
    assert result["verdicts"] == {"gpu-slow-nccl": "warning"}
    assert result["not_checked"] == [
        {
            "host": "gpu-slow-nccl",
            "code": "nccl-bandwidth-low",
            "subject": None,
            "level": "warning",
            "why": "nccl-tests did not run",
        }
    ]
    text = cudamedic(env, "sweep", "--host", "gpu-slow-nccl")
    assert "\n  resolved " not in text.stdout, text.stdout
    assert "not checked gpu-slow-nccl: nccl-bandwidth-low [warning] nccl-tests did not run" in (
        text.stdout
    )
    assert (
        "nccl-bandwidth-low (not checked: nccl-tests did not run)"
        in Path(text.stdout.split("report:")[1].split()[0]).read_text()
    )
    # nccl-tests again: the finding was there all along, nothing new
    again = cudamedic(with_nccl, "sweep", "--host", "gpu-slow-nccl")
    assert "nothing new, changed or resolved" in again.stdout, again.stdout


def test_an_unreachable_host_keeps_its_findings() -> None:
    """A host whose check failed said nothing about its GPUs: its findings stay."""
    from runbooks.diagnose.health import HealthFinding, HostHealth

    before = snapshot(
        [
            HostHealth(
                host="node07",
                verdict="drain",
                findings=(
                    HealthFinding(code="xid-79", level="drain", subject="0000:02:00", message="x"),
                ),
            )
        ]
    )["node07"]
    failed = failed_result("node07", "timed out after 10 s")
    kept = with_history(failed.health, before, Thresholds())
    assert kept.verdict == "drain"
    assert {(f.key, f.not_checked) for f in kept.findings} == {
        ("check-failed", None),
        ("xid-79@0000:02:00", "the host's check failed"),
    }


def _nogpu(make_container: Any, name: str, plain_engine: Any) -> None:
    """A container that wants GPUs on the engine without the toolkit's hook (gpu-nohook): its
    fix (`--gpus all`) fails at start and is rolled back."""
    make_container(
        name,
        "nvidia-smi -L; sleep 3600",
        engine=plain_engine,
        environment={"NVIDIA_VISIBLE_DEVICES": "all"},
    )
    time.sleep(1)


def _state(run_id: str) -> tuple[str, str]:
    run = flow_run_of(run_id)
    return str(run.state.type.value), str(run.state.name)


def _events(
    env: dict[str, str],  # noqa: F811
    container: str,
    want: str,
    timeout: float = 30,
) -> list[str]:
    """The audit event names about a container, read back from Prefect, once `want` is among
    them."""
    deadline = time.monotonic() + timeout
    while True:
        out = cudamedic(env, "audit", "--json", "--since", "1h")
        assert out.returncode == 0, out.stderr
        names = [
            e["event"]
            for e in json.loads(out.stdout)["events"]
            if e["record"].get("container") == container
        ]
        if want in names or time.monotonic() > deadline:
            return names
        time.sleep(1)


def test_a_failed_fix_never_reads_as_a_success(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    plain_engine: Any,
) -> None:
    """Issue 26: a rolled-back fix, a container that does not exist and a host that was not
    reached ended COMPLETED (green in the UI); the audit said `fix.applied` for the fix that
    was then rolled back."""
    _nogpu(make_container, container_name, plain_engine)
    out = cudamedic(env, "triage", "gpu-nohook", "--container", container_name, "--apply", "--yes")
    assert out.returncode == 5, out.stdout + out.stderr
    run_id = run_id_of(out.stdout)
    assert _state(run_id) == ("FAILED", "RolledBack")
    assert "outcome:rolled-back" in flow_run_of(run_id).tags
    names = _events(env, container_name, "cudamedic.fix.failed")
    assert "cudamedic.fix.started" in names and "cudamedic.fix.failed" in names, names
    assert "cudamedic.fix.applied" not in names, names

    missing = cudamedic(env, "triage", "gpu-nohook", "--container", container_name + "-typo")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    runs = _runs_named(f"triage-gpu-nohook-{container_name}-typo")
    assert [_state(str(r.id)) for r in runs] == [("FAILED", "NoSuchContainer")]

    nobody = cudamedic(env, "triage", "ssh://cudamedic-lab@127.0.0.1:9")
    assert nobody.returncode == 3, nobody.stdout + nobody.stderr
    assert field(nobody.stdout, "outcome").startswith("unreachable: "), nobody.stdout
    assert _state(run_id_of(nobody.stdout)) == ("FAILED", "Unreachable")


def _runs_named(prefix: str) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=prefix))
        )
    return [r for r in runs if r.name.startswith(prefix)]


def test_the_fix_cap_says_what_it_counts(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    plain_engine: Any,
    tmp_path: Path,
) -> None:
    """Issue 26: a rolled-back attempt counts against the per-hour cap (it stopped and
    restarted the workload too), and the refusal said "1 fixes applied"."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_fixes_per_hour: 1\n")
    _nogpu(make_container, container_name, plain_engine)
    args = ("fix", "gpu-nohook", "--container", container_name, "--apply", "--yes")
    first = cudamedic(env, *args, "--policy", str(policy))
    assert first.returncode == 5, first.stdout + first.stderr
    second = cudamedic(env, *args, "--policy", str(policy))
    assert second.returncode == 4, second.stdout + second.stderr
    assert (
        f"blast-radius limit: 1 fix attempt(s) started in fleet {env['CUDAMEDIC_FLEET']} in the "
        "last hour, the policy allows 1. Every attempt counts, a rolled-back or interrupted one "
        "too"
    ) in second.stderr, second.stderr
    assert "fixes applied" not in second.stderr


def test_classify_and_the_sweep_agree_on_the_hung_nvidia_smi_host(
    env: dict[str, str],  # noqa: F811
) -> None:
    """Issue 26: the sweep drained gpu-hang (nvidia-smi hung: gpu-hardware-fault) while
    `cudamedic classify` of the same bundle proposed another class from similar incidents. The
    sweep's run is tagged with what it found, so the UI's filters find a sweep that drains."""
    out = cudamedic(env, "sweep", "--host", "gpu-hang", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["verdicts"] == {"gpu-hang": "drain"}
    assert {"verdict:drain", "drain:gpu-hang"} <= set(flow_run_of(run_id_of(out.stdout)).tags)
    bundles = list(Path(env["CUDAMEDIC_OUT_DIR"], "sweeps").glob("*/gpu-hang-*"))
    assert len(bundles) == 1, bundles
    classified = cudamedic(env, "classify", str(bundles[0]), "--json")
    assert classified.returncode == 0, classified.stderr
    d = json.loads(classified.stdout)
    assert (d["incident"], d["basis"]) == ("gpu-hardware-fault", "evidence"), d["summary"]
    assert "nvidia-smi did not answer within its timeout" in d["summary"]
