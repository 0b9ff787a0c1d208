"""`cudamedic triage` and `cudamedic approve`: run the incident-response flow from a terminal and
answer its approval.

The flow runs in this process (on the configured Prefect server); while it waits for approval,
this command shows the plan and asks (on a terminal) or says how to answer from elsewhere
(`cudamedic approve RUN_ID`, the Prefect UI, Slack) and keeps waiting.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any
from uuid import UUID

from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.exceptions import ObjectNotFound

from flows.automations import ensure_crash_detection
from flows.incident import Approval, Response, incident_response, response_name
from runbooks.collect.redact import redact_text
from runbooks.core.errors import InputError
from runbooks.core.settings import load_settings
from runbooks.fix.approvals import cli_run


def triage(
    target: str,
    *,
    container: str | None,
    trigger: str | None,
    apply: bool,
    approved_by: str | None,
    ask: Callable[[str], bool] | None,
    say: Callable[[str], None],
    actor: str,
) -> Response:
    """Run the flow; when it pauses for approval, show the plan and `ask` (None: wait for an
    answer from elsewhere)."""
    # The flow's own name plus a unique suffix: how this command finds its paused run.
    name = f"{response_name(target, container)}-{uuid.uuid4().hex[:6]}"
    box: dict[str, Any] = {}

    cli_run(name, approved_by)  # `local`, ssh:// and approved_by: for this run only
    # Before the run's first heartbeat: an automation created or changed after it would not have
    # seen it, and a worker killed before the next one would never be marked Crashed.
    ensure_crash_detection(load_settings().crash_after_s)

    def run() -> None:
        try:
            state = incident_response.with_options(flow_run_name=name)(
                target=target,
                container=container,
                trigger_text=redact_text(trigger) if trigger else None,  # a flow parameter
                apply=apply,
                approved_by=approved_by,
                return_state=True,
            )
            # A failed response (rolled back, not reached, ...) ends FAILED with its Response as
            # the state's data; a flow that raised has its exception there instead.
            result = state.result(raise_on_failure=False)
            if isinstance(result, BaseException):
                raise result
            box["result"] = result
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc
        finally:
            done.set()

    # An Event, not Thread.is_alive(): a join() cut by Ctrl-C leaves is_alive() False on a
    # thread that still runs (CPython's _wait_for_tstate_lock).
    done = threading.Event()
    worker = threading.Thread(target=run, name="incident-response", daemon=True)
    worker.start()
    try:
        _wait(done, name, apply, ask, say, actor)
    except KeyboardInterrupt:
        _interrupted(done, name, target, container, say)
    if "error" in box:
        raise box["error"]
    result: Response = box["result"]
    return result


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a triage: what became of it, and what to run next (the CLI says it)."""


def _interrupted(
    done: threading.Event,
    name: str,
    target: str,
    container: str | None,
    say: Callable[[str], None],
) -> None:
    """Ctrl-C: a fix that runs is let finish or roll back (a recreate is never cut in half; a
    second Ctrl-C leaves it to `cudamedic rollback`); before it, the run is cancelled in Prefect
    (it would wait Paused or Running for the crash automation) and nothing was changed."""
    from runbooks.core import progress

    where = f"{target}" + (f" --container {container}" if container else "")
    subject = f"{target}/{container}" if container else target
    if progress.running() == "apply" and not done.is_set():
        say(
            f"cudamedic: interrupted during the fix of {subject}: letting it finish or roll back "
            "first, a fix is never left half-done (Ctrl-C again to leave it now)"
        )
        try:
            while not done.wait(0.5):
                pass
            return  # the response ended as it would have: its outcome is shown
        except KeyboardInterrupt:
            run_id = cancel(name, "interrupted (Ctrl-C, twice) during the fix")
            raise Interrupted(
                f"the fix of {subject} was left mid-way; flow run {run_id or name} cancelled. "
                f"`cudamedic rollback {where}` restores the original container now; "
                f"`cudamedic triage {where}` finishes or rolls it back first, then responds "
                "again"
            ) from None
    run_id = cancel(name, "interrupted (Ctrl-C) before any change")
    raise Interrupted(
        f"nothing was changed on {subject}: it is as it was before the triage; flow run "
        f"{run_id or name} cancelled. To respond again: `cudamedic triage {where} --apply`"
    ) from None


def cancel(name: str, why: str) -> str | None:
    """Cancel this command's flow run in Prefect (found by its unique name), so it no longer
    waits for an answer nobody can act on; its id (None: it was not found or already final)."""
    import httpx
    from prefect.states import Cancelled

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])), limit=1
            )
            if not runs or (runs[0].state is not None and runs[0].state.is_final()):
                return str(runs[0].id) if runs else None
            client.set_flow_run_state(runs[0].id, Cancelled(message=why), force=True)
            return str(runs[0].id)
    except (httpx.HTTPError, OSError):
        return None


def _wait(
    done: threading.Event,
    name: str,
    apply: bool,
    ask: Callable[[str], bool] | None,
    say: Callable[[str], None],
    actor: str,
) -> None:
    """While the flow runs: show its plan once it waits for approval, and ask (or say how to
    answer from elsewhere)."""
    pauses: list[str] = []  # the pause keys seen: a new one after an answer the flow refused
    while not done.wait(0.5):
        if not apply or done.is_set() or (paused := _paused_run(name)) is None:
            continue
        run_id, key = str(paused[0]), paused[1]
        if key in pauses:
            continue
        pauses.append(key)
        if len(pauses) == 1 and (plan := _approval_text(paused[0])):
            say(plan)
        if len(pauses) == 1 and ask is not None:
            yes = ask(f"Apply this fix? (flow run {run_id})")
            answer(run_id, "approve" if yes else "reject", actor, "answered at the terminal")
            continue
        said = "an answer was refused (`cudamedic audit` says why); " if len(pauses) > 1 else ""
        say(
            f"{said}waiting for approval: `cudamedic approve {run_id}` (or --reject), "
            "the Prefect UI or Slack"
        )


def _paused_run(name: str) -> tuple[UUID, str] | None:
    """The run's id and its pause's key while it waits for an answer; None also while the
    Prefect server cannot be asked (restarting: the flow itself rides that out)."""
    import httpx

    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])), limit=1
            )
    except (httpx.HTTPError, OSError):
        return None
    state = runs[0].state if runs else None
    if state is not None and state.is_paused():
        return runs[0].id, str(state.state_details.pause_key)
    return None


def _approval_text(run_id: UUID) -> str | None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
    for art in arts:
        if (art.key or "").startswith("approval-") and isinstance(art.data, str):
            return plain_plan(art.data)
    return None


def plain_plan(markdown: str) -> str:
    """The plan of an approval artifact as a terminal shows it: the text of its fenced block,
    without the Markdown heading, the fence or the approve line (said once, by the caller)."""
    import re

    fenced = re.search(r"^(`{3,})text\n(.*)\n\1$", markdown, re.M | re.S)
    return fenced.group(2) if fenced else markdown


def answer(run_id: str, decision: str, by: str, reason: str = "", proof: str = "") -> str:
    """Resume a paused (or suspended) incident response with a person's decision. A second
    answer, or one for a run that no longer waits, changes nothing and says so. `proof`: the
    signature that establishes `by` (runbooks/fix/approvals.py)."""
    from prefect.flow_runs import resume_flow_run

    try:
        uid = UUID(run_id)
    except ValueError:
        raise InputError(f"{run_id!r} is not a flow run id") from None
    approval = Approval(decision=decision, by=by, reason=reason, proof=proof)
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(uid)
        except ObjectNotFound:
            raise InputError(f"no flow run {run_id}") from None
    state = run.state
    if state is None or not state.is_paused():
        raise InputError(
            f"flow run {run_id} is not waiting for approval (it is "
            f"{state.name if state else 'without a state'}): it can no longer act on an "
            "answer; nothing was changed"
        )
    resume_flow_run(uid, run_input=approval.model_dump(mode="json"))
    return f"{decision} sent to flow run {run_id} by {by}"


RESUME_WAIT_S = 300.0  # a suspended one: a worker takes it and collects evidence first


def queued(run_id: str) -> bool:
    """Is the run scheduled again or starting (a suspended run that was answered), not yet
    running its flow?"""
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(UUID(run_id))
    state = run.state
    return state is not None and (state.is_scheduled() or state.is_pending())


def verdict(run_id: str, by: str, since: datetime, timeout: float) -> dict[str, Any] | None:
    """The flow's audit record of its judgement of `by`'s answer sent at `since` (the event
    `cudamedic.approval.approved|rejected|refused`); None when none came within `timeout`."""
    from runbooks.fix.audit import PREFIX, read

    names = [f"{PREFIX}approval.{v}" for v in ("approved", "rejected", "refused")]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in read(since=since, flow_run=run_id, names=names) if r.get("by") == by]
        if found:
            return found[0]
        time.sleep(1.0)
    return None


def acted_since(run_id: str, since: datetime) -> bool:
    """Has the flow run done anything since `since` (a log line: each step logs)? A run whose
    process is gone cannot; an answer's audit event may just be late."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterTimestamp

    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(
                flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]),
                timestamp=LogFilterTimestamp(after_=since),
            ),
            limit=1,
        )
    return bool(logs)


def wait_until_paused(run_id: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(UUID(run_id))
        if run.state is not None and run.state.is_paused():
            return True
        time.sleep(0.3)
    return False
