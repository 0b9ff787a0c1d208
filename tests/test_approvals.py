"""One rule for approvals, judged by the flow whatever the path (CLI, the Prefect UI's resume
form), and the audit trail read back from the Prefect server's events by another process.

Real components: the lab's engine and the tests' Prefect server; the response runs in a
`cudamedic triage` process. People are told apart the way sudo tells them: root run by alice
has SUDO_USER=alice (runbooks/approvals.os_user)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any
from uuid import UUID

from runbooks.core.settings import Settings
from runbooks.fix.approvals import identity, refusal
from tests.test_fix import CLI, fix_settings, volume, volume_text  # noqa: F401 - fixtures
from tests.test_flows import cudamedic, env, field, shm_container  # noqa: F401 - fixtures

RULE = {
    "CUDAMEDIC_APPROVERS": '["U0CAROL"]',
    # alice's OS user is her Slack id; carol approves from a terminal as her Slack id too
    "CUDAMEDIC_APPROVER_OS_USERS": '{"alice": "U0ALICE", "carol": "U0CAROL"}',
    # this host is trusted: `cudamedic approve` signs its OS user with the fleet's key
    "CUDAMEDIC_APPROVAL_KEY": "test-approval-key-" + "0" * 24,
}


def test_the_rule_as_a_function() -> None:
    s = Settings(approvers=("U0CAROL",), approver_os_users={"alice": "U0ALICE"})
    never = lambda _: False  # noqa: E731 - no Slack groups configured: never asked
    signed = {"established": "slack-signed"}
    assert identity(s, "os:alice") == "U0ALICE" and identity(s, "os:eve") == "os:eve"
    assert refusal(s, "U0CAROL", "U0ALICE", never, **signed) is None
    assert refusal(s, "U0ALICE", "os:bob", never, established="trusted-host") is None
    assert "four-eyes" in str(refusal(s, "U0ALICE", "U0ALICE", never, **signed))
    assert "not an approver" in str(refusal(s, "os:eve", "U0ALICE", never, **signed))
    assert (
        refusal(s.model_copy(update={"four_eyes": False}), "U0ALICE", "U0ALICE", never, **signed)
        is None
    )
    assert refusal(Settings(), "anyone", "anyone", never, established="claimed") is None  # open
    # A claimed identity (the UI's form, an API call) never satisfies four-eyes (issue 30) ...
    assert "only claimed" in str(refusal(s, "U0CAROL", "U0ALICE", never, established="claimed"))
    # ... but may reject (nothing changes), and counts as before without four-eyes.
    no = refusal(s, "U0CAROL", "U0ALICE", never, established="claimed", decision="reject")
    assert no is None
    off = s.model_copy(update={"four_eyes": False})
    assert refusal(off, "U0CAROL", "U0ALICE", never, established="claimed") is None


def test_proofs_establish_identities_and_nothing_else_does() -> None:
    from runbooks.fix.approvals import (
        answer_established,
        answer_proof,
        start_established,
        start_proof,
    )

    s = Settings(slack_bot_token="xoxb-test-token", approval_key="k" * 32)
    run = "0b9f0000-0000-4000-8000-000000000000"
    slack = answer_proof("xoxb-test-token", "slack", run, "approve", "U0CAROL")
    assert answer_established(s, run, "approve", "U0CAROL", slack) == "slack-signed"
    assert answer_established(s, run, "reject", "U0CAROL", slack) == "claimed"  # another answer
    assert answer_established(s, run, "approve", "U0MALLORY", slack) == "claimed"
    assert answer_established(s, run[:-1] + "1", "approve", "U0CAROL", slack) == "claimed"
    os_proof = answer_proof("k" * 32, "os", run, "approve", "os:carol")
    assert answer_established(s, run, "approve", "os:carol", os_proof) == "trusted-host"
    # the bot token does not vouch for an OS user, nor the approval key for a Slack user
    assert answer_established(s, run, "approve", "os:carol", slack) == "claimed"
    wrong = answer_proof("k" * 32, "os", run, "approve", "U0CAROL")
    assert answer_established(s, run, "approve", "U0CAROL", wrong) == "claimed"
    assert answer_established(Settings(), run, "approve", "os:carol", os_proof) == "claimed"
    start = start_proof("k" * 32, "alert GpuXid", "gpu-healthy", "train")
    assert start_established(s, start, "alert GpuXid", "gpu-healthy", "train")
    assert not start_established(s, start, "alert GpuXid", "gpu-healthy", "other")
    assert not start_established(Settings(), start, "alert GpuXid", "gpu-healthy", "train")


def _triage(environ: dict[str, str], container: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*CLI, "triage", "gpu-healthy", "--container", container, "--apply", "--no-input"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if m := re.search(r"waiting for approval: `cudamedic approve ([0-9a-f-]{36})`", line):
            return proc, m.group(1)
        assert line, proc.stderr.read() if proc.stderr else ""
    raise AssertionError("the response never waited for approval")


def _ui_answer(run_id: str, by: str) -> None:
    """What the Prefect UI's resume form does: resume the run with the typed input."""
    from prefect.flow_runs import resume_flow_run

    from flows.triage import wait_until_paused

    assert wait_until_paused(run_id)
    resume_flow_run(UUID(run_id), run_input={"decision": "approve", "by": by, "reason": "UI"})


def test_every_path_obeys_the_rule_and_the_trail_is_one(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: Any,
    volume: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    from flows.triage import verdict, wait_until_paused
    from runbooks.fix.journal import now

    shm_container(make_container, container_name, volume)
    data = volume_text(gpu_engine, volume)
    env = {**env, **RULE}
    as_user = lambda user: {**env, "SUDO_USER": user}  # noqa: E731
    proc, run_id = _triage(as_user("alice"), container_name)  # alice asks
    try:
        eve = cudamedic(as_user("eve"), "approve", run_id)
        assert eve.returncode == 4 and "os:eve is not an approver" in eve.stderr, eve
        assert wait_until_paused(run_id)
        own = cudamedic(as_user("alice"), "approve", run_id)
        assert own.returncode == 4 and "four-eyes rule: U0ALICE" in own.stderr, own
        sent = now()
        _ui_answer(run_id, "U0ALICE")  # alice again, by her Slack id in the UI form
        judged = verdict(run_id, "U0ALICE", sent, 60)
        assert judged and "only claimed" in str(judged["refusal"]), judged
        _ui_answer(run_id, "U0CAROL")  # anyone may type carol's id: only claimed (issue 30)
        judged = verdict(run_id, "U0CAROL", sent, 60)
        assert judged and "only claimed" in str(judged["refusal"]), judged
        assert judged["established"] == "claimed", judged
        # Nothing was changed by any of them.
        assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] == 64 << 20
        assert wait_until_paused(run_id)
        ok = cudamedic(as_user("carol"), "approve", run_id, "--reason", "shm is the cause")
        assert ok.returncode == 0 and "taken: approve by U0CAROL" in ok.stdout, ok
        rest, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest + err
    assert field(rest, "approval") == "approve by U0CAROL (shm is the cause)"
    assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] == 8 << 30
    assert volume_text(gpu_engine, volume) == data
    _trail_from_another_machine(env, tmp_path, run_id, container_name)


def _trail_from_another_machine(
    environ: dict[str, str], tmp: Path, run_id: str, container: str
) -> None:
    """`cudamedic audit --json --host` with its own state dir and home: it reads Prefect."""
    other = {
        **environ,
        "CUDAMEDIC_STATE_DIR": str(tmp / "other-state"),
        "HOME": str(tmp / "other-home"),
        "PREFECT_HOME": str(tmp / "other-prefect"),
    }
    deadline = time.monotonic() + 30
    while True:
        out = cudamedic(other, "audit", "--json", "--host", "gpu-healthy", "--since", "1h")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        mine = [e for e in doc["events"] if e["record"].get("flow_run") == run_id]
        names = [e["event"] for e in mine]
        if "cudamedic.response.finished" in names or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert doc["schema"] == 1 and doc["command"] == "audit" and doc["exit_code"] == 0
    said = [(e["event"], e["record"]["identity"]) for e in mine if "identity" in e["record"]]
    assert said == [
        ("cudamedic.approval.refused", "os:eve"),
        ("cudamedic.approval.refused", "U0ALICE"),
        ("cudamedic.approval.refused", "U0ALICE"),
        ("cudamedic.approval.refused", "U0CAROL"),
        ("cudamedic.approval.approved", "U0CAROL"),
    ], said
    # how each identity was established: signed by this trusted host's key, or only claimed
    how = [e["record"]["established"] for e in mine if "identity" in e["record"]]
    assert how == ["trusted-host", "trusted-host", "claimed", "claimed", "trusted-host"], how
    assert {e["record"]["requester_established"] for e in mine if "identity" in e["record"]} == {
        "os-user"
    }
    assert {e["record"]["requester"] for e in mine if "requester" in e["record"]} == {"U0ALICE"}
    assert "cudamedic.response.finished" in names
    applied = [e for e in doc["events"] if e["event"] == "cudamedic.fix.applied"]
    assert [
        e["record"]["approved_by"] for e in applied if e["record"]["container"] == container
    ] == ["U0CAROL"]
    assert not (tmp / "other-state" / "audit.jsonl").exists()  # nothing local was read


def test_a_rejection_is_taken_and_said(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: Any,
    volume: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`approve --reject` waited for the event `cudamedic.approval.rejectd` (issue 30: the name
    was made by adding "d" to the decision) and said the flow had not answered; an automation
    on `.rejected` never fired."""
    shm_container(make_container, container_name, volume)
    env = {**env, **RULE}
    proc, run_id = _triage({**env, "SUDO_USER": "alice"}, container_name)
    try:
        no = cudamedic({**env, "SUDO_USER": "carol"}, "approve", run_id, "--reject")
        assert no.returncode == 0 and "taken: reject by U0CAROL" in no.stdout, no
        rest, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 4 and field(rest, "outcome").startswith("rejected"), rest + err
    assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] == 64 << 20
    out = cudamedic(env, "audit", "--json", "--host", "gpu-healthy", "--since", "1h")
    events = [
        e["event"]
        for e in json.loads(out.stdout)["events"]
        if e["record"].get("flow_run") == run_id and "decision" in e["record"]
    ]
    assert events == ["cudamedic.approval.rejected"], events
