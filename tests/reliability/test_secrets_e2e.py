"""Planted secrets end to end: >= 300 secrets of >= 30 kinds in a real container's environment,
labels, command line and logs (and in the pasted trigger text), then a full response on the lab
— collection, diagnosis, the approval request in Slack, the fix, the report — and a search of
everything cudamedic wrote or sent: the bundle, the report, the fix journal and audit log, the
CLI's output, the Prefect flow run (parameters, logs, artifacts) and every Slack payload.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from uuid import UUID

import docker
import pytest
from docker.types import DeviceRequest

from flows.slack.delivery import dead, waiting
from runbooks.core.settings import Settings
from tests.lab.lab import IMAGE, LabState
from tests.reliability.figures import record, size, zero
from tests.reliability.secrets import Planted, corpus, find_leaks
from tests.slackfake import FakeSlack, fake_slack
from tests.test_fix import CLI, cli_env, fix_settings  # noqa: F401 - fixture
from tests.test_slack import TOKEN

SUITE = "secrets"
# A real PyTorch DataLoader failure (tests/corpus: shm-too-small) so the response plans a fix.
BUS_ERROR = (
    "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient "
    "shared memory (shm)."
)


def _files(root: Path) -> str:
    parts = []
    for p in sorted(root.rglob("*")):
        if p.is_file():
            parts.append(f"\n=== {p}\n" + p.read_bytes().decode("utf-8", "replace"))
    return "".join(parts)


def _prefect_run(run_id: str) -> dict[str, str]:
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    rid = UUID(run_id)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(rid)
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[rid]))
        )
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[rid])))
        tasks = client.read_task_runs()
    return {
        "Prefect flow-run parameters": json.dumps(run.parameters),
        "Prefect artifacts": "\n".join(str(a.data) for a in arts),
        "Prefect logs": "\n".join(f"{lg.message}" for lg in logs),
        "Prefect task runs": "\n".join(
            json.dumps(t.model_dump(mode="json")) for t in tasks if t.flow_run_id == rid
        ),
    }


@pytest.fixture
def planted() -> list[Planted]:
    return corpus(seed=8, per_kind=size(7, 10))


@pytest.fixture
def seeded(planted: list[Planted], gpu_engine: docker.DockerClient, container_name: str) -> Any:
    argv = [a for p in planted for a in p.argv]
    logs = [p.log for p in planted]
    # The DataLoader error only while /dev/shm is Docker's 64 MB (so the fix is verified).
    # It logs its first len(logs) arguments (the log lines), one per line; the rest is its
    # command line (the argv carriers), as `docker inspect` and `ps` show it.
    script = (
        f'i=0; for a in "$@"; do i=$((i+1)); [ $i -le {len(logs)} ] && printf \'%s\\n\' "$a"; '
        "done; dd if=/dev/zero of=/dev/shm/b bs=1M count=256 2>/dev/null "
        f"|| echo '{BUS_ERROR}'; rm -f /dev/shm/b; trap 'exit 0' TERM; sleep 3600 & wait"
    )
    c = gpu_engine.containers.run(
        IMAGE,
        ["sh", "-c", script, "train.py", *logs, *argv],
        name=container_name,
        detach=True,
        network_mode="none",
        environment=[p.env for p in planted],
        labels={p.label_key: p.label_value for p in planted},
        device_requests=[DeviceRequest(count=-1, capabilities=[["gpu"]])],
    )
    yield c
    for x in gpu_engine.containers.list(all=True):
        if x.name.startswith(container_name):
            x.remove(force=True)


def test_planted_secrets_reach_no_output(
    prefect_api: str,
    lab: LabState,
    fix_settings: Settings,  # noqa: F811
    planted: list[Planted],
    seeded: Any,
    container_name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows.incident import incident_response

    kinds = {p.kind for p in planted}
    # What the engine holds really carries them (the test would prove nothing otherwise).
    raw = json.dumps(seeded.client.api.inspect_container(seeded.id)) + seeded.logs().decode()
    assert len(find_leaks(raw, planted)) >= len(planted)
    trigger = " ".join([BUS_ERROR, *(p.log for p in planted[:: max(1, len(planted) // 40)])])

    sinks: dict[str, str] = {}
    # 1. The Slack path: the response run as the Slack app starts it, with the approval request
    #    posted to the thread (nobody answers; the runbook gives up after 3 s).
    book = (Path(__file__).parents[2] / "runbooks" / "incident.yaml").read_text()
    book = book.replace("approval: 3600", "approval: 3")
    (tmp_path / "incident.yaml").write_text(book)
    with fake_slack() as slack:
        for key, value in {
            "CUDAMEDIC_CONFIG": lab.config,
            "CUDAMEDIC_STATE_DIR": str(fix_settings.state_path),
            "CUDAMEDIC_OUT_DIR": str(fix_settings.out_dir),
            "CUDAMEDIC_FLEET": fix_settings.fleet,
            "CUDAMEDIC_RUNBOOK": str(tmp_path / "incident.yaml"),
            "CUDAMEDIC_SLACK_BOT_TOKEN": TOKEN,
            "CUDAMEDIC_SLACK_API_URL": slack.base_url,
        }.items():
            monkeypatch.setenv(key, value)
        state = incident_response(
            target="gpu-healthy",
            container=container_name,
            trigger_text=_redacted_like_the_entry_points(trigger),
            slack={"channel": "C0INCIDENT", "ts": "1764700000.000001", "requester": "U0ASKER"},
            return_state=True,
        )
        assert state.is_completed(), state
        sinks["Slack payloads"] = _slack_text(slack)
        assert "approval" in sinks["Slack payloads"].lower()
        slack_run = str(state.state_details.flow_run_id)
    # 2. The CLI path: `cudamedic triage --apply --yes` fixes it (journal, audit, report).
    env = cli_env(lab, fix_settings, PREFECT_API_URL=prefect_api)
    done = subprocess.run(
        [
            *CLI,
            "triage",
            "gpu-healthy",
            "--container",
            container_name,
            "--apply",
            "--yes",
            "--trigger",
            trigger,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "outcome:    fixed" in done.stdout or "fixed" in done.stdout, done.stdout
    sinks["CLI output"] = done.stdout + done.stderr
    cli_run = next(ln.rsplit("/", 1)[1] for ln in done.stdout.split() if "/runs/flow-run/" in ln)
    for run_id, where in ((slack_run, "Slack run"), (cli_run, "CLI run")):
        for name, text in _prefect_run(run_id).items():
            sinks[f"{name} ({where})"] = text
    sinks["bundles"] = _files(fix_settings.out_dir)
    sinks["reports"] = _files(fix_settings.reports_path)
    sinks["journal, audit log, local caches"] = _files(fix_settings.state_path)
    kept = {"waiting": waiting(fix_settings), "dead": dead(fix_settings)}
    sinks["Slack outbox and dead letters (Prefect)"] = json.dumps(kept)
    assert "shm-too-small" in sinks["reports"]

    total = 0
    found: list[str] = []
    for name, text in sinks.items():
        leaks = find_leaks(text, planted)
        total += len(leaks)
        found += [f"{name}: {kind} {prefix}… in {_where(text, prefix)}" for kind, prefix in leaks]
        zero(SUITE, f"leaks into {name}", len(leaks))
    record(SUITE, "planted secrets (end to end)", len(planted), ">= 300", len(planted) >= 300)
    record(SUITE, "kinds (end to end)", len(kinds), ">= 30", len(kinds) >= 30)
    record(SUITE, "output scanned (MB)", round(sum(map(len, sinks.values())) / 1e6, 2))
    zero(SUITE, "secrets that reached any output", total)
    assert total == 0, "\n".join(found[:50])


def _where(text: str, prefix: str) -> str:
    """The file (=== header) and the text around a leak, for the failure message."""
    at = text.find(prefix)
    if at < 0:
        return "?"
    header = text.rfind("\n=== ", 0, at)
    name = text[header + 5 : text.find("\n", header + 1)] if header >= 0 else ""
    return f"{name}: …{text[max(0, at - 80) : at + 20]!r}"


def _redacted_like_the_entry_points(text: str) -> str:
    """The CLI, the Slack app and the alert receiver redact pasted text before it becomes a
    flow parameter; this test calls the flow directly, so it does the same."""
    from runbooks.collect.redact import redact_text

    return redact_text(text)


def _slack_text(slack: FakeSlack) -> str:
    calls = json.dumps([c["args"] for c in slack.calls])
    uploads = "\n".join(u.decode("utf-8", "replace") for u in slack.uploads.values())
    return calls + "\n" + uploads
