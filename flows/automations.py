"""Workers that die (issue 17): a Prefect automation that marks a cudamedic flow run Crashed when
its heartbeats stop, so a response whose worker machine vanished does not stay Running forever.

Every flow run sends `prefect.flow-run.heartbeat` every `PREFECT_FLOWS_HEARTBEAT_FREQUENCY` seconds
(Prefect's default 180, also while it waits for an approval). The automation (Prefect's documented
"zombie flow" pattern) is proactive: after a heartbeat, it expects another heartbeat or the run's
end within `crash_after_s`; when none comes, the run is set to Crashed. Only cudamedic's flows are
watched (a shared Prefect server may run other teams' flows).

The next response for that host and container recovers the interrupted fix from the target
(runbooks/fix/recreate.py `recover`: finish or roll back), whichever worker runs it.

Set up by `cudamedic serve` and by the first cudamedic flow run on a server (work pools deployed
with `prefect deploy`): `ensure_crash_detection` is idempotent and updates a changed window.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from prefect import get_client
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification

log = logging.getLogger(__name__)

NAME = "cudamedic: crash runs whose worker stopped sending heartbeats"
FLOWS = ("incident-response", "fleet-health-check", "sweep-batch")
# A suspended run (waiting for a person, its process ended: flows/incident.py) sends no
# heartbeats and is not crashed.
_ENDS = ("Completed", "Failed", "Cancelled", "Crashed", "Cancelling", "Suspended")


def crash_detection(crash_after_s: float) -> AutomationCore:
    """The automation (PURE)."""
    return AutomationCore(
        name=NAME,
        description="A cudamedic flow run whose heartbeats stop (its worker died) is set to "
        "Crashed; the next response for that container recovers its fix from the target.",
        enabled=True,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in _ENDS)},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification(
                {"prefect.resource.role": "flow", "prefect.resource.name": list(FLOWS)}
            ),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=crash_after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"No heartbeat for {crash_after_s:g} s: the worker running it stopped "
                "(cudamedic crash detection)",
            )
        ],
    )


def ensure_crash_detection(crash_after_s: float) -> None:
    """Create the automation, or update it when its window changed; never raises (a server
    without the events service still runs responses)."""
    _ensure(crash_detection(crash_after_s), "crash detection")


def _ensure(want: AutomationCore, what: str) -> None:
    """Create the automation `want` (by its name), or update it when its trigger (window,
    events) is not the one wanted; never raises, says `what` could not be set up."""
    try:
        with get_client(sync_client=True) as client:
            found = client.read_automations_by_name(want.name)
            if not found:
                client.create_automation(want)
                return
            _update(client, found[0], want)
    except Exception as exc:
        log.warning("could not set up %s: %s: %s", what, type(exc).__name__, exc)


def _update(client: Any, found: Any, want: AutomationCore) -> None:
    """Update an automation whose trigger (window, events) is not the one wanted."""
    have, new = found.trigger, want.trigger
    assert isinstance(new, EventTrigger)
    if (
        not isinstance(have, EventTrigger)
        or have.within != new.within
        or have.expect != new.expect
        or have.after != new.after
    ):
        client.update_automation(found.id, want)


# -- approvals nobody answers -------------------------------------------------------------------
APPROVAL_NAME = "cudamedic: resume responses whose approval timed out"
_AFTER_SUSPENDED = (
    "Resuming",
    "Scheduled",
    "Pending",
    "Running",
    "Completed",
    "Failed",
    "Cancelled",
    "Cancelling",
    "Crashed",
)


def approval_timeout(timeout_s: float) -> AutomationCore:
    """The automation (PURE): an incident response suspended for a person's answer that gets
    none within `timeout_s` (the runbook's `timeouts.approval`) is scheduled again without one;
    the run then reports "approval-timed-out" (its post-mortem says nothing was changed) on
    whichever worker takes it. Prefect's own pause timeout is later (flows/incident.py
    SUSPEND_MARGIN_S): it fails a run only if this automation did not act."""
    return AutomationCore(
        name=APPROVAL_NAME,
        description="An incident response that waited for approval longer than the runbook's "
        "approval timeout is scheduled again, to report that nobody answered.",
        enabled=True,
        trigger=EventTrigger(
            after={"prefect.flow-run.Suspended"},
            expect={f"prefect.flow-run.{s}" for s in _AFTER_SUSPENDED},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification(
                {"prefect.resource.role": "flow", "prefect.resource.name": "incident-response"}
            ),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=max(timeout_s, 10)),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED,
                name="Resuming",
                message=f"Nobody answered the approval within {timeout_s:g} s "
                "(cudamedic approval timeout): the response resumes to report it",
            )
        ],
    )


def ensure_approval_timeout(timeout_s: float) -> None:
    """Create the automation, or update it when its window changed; never raises. One window
    per Prefect server: a run woken before its own runbook's timeout waits again."""
    _ensure(approval_timeout(timeout_s), "the approval timeout")
