"""Issue 26, "say only what happened", through the real CLI on the lab and the tests' Prefect
server: a check that did not run is "not checked" (never "resolved"); a failed fix never reads
as a success (state type, audit, tags); the fix cap says what it counts; `classify` and the sweep
agree on the hung-`nvidia-smi` host."""

from __future__ import annotations

import json
from pathlib import Path

from runbooks.health import snapshot, with_history
from runbooks.runbook import Thresholds
from runbooks.sweep import failed_result
from tests.test_fix import fix_settings  # noqa: F401 - fixture
from tests.test_flows import cudamedic, env, sweep_runbook  # noqa: F401 - fixture


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
    from runbooks.health import HealthFinding, HostHealth

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
