"""`cudamedic pending`: the fleet's fixes that wait for a person, read from the Prefect server
(any machine, any state dir): every incident-response run that is Paused (a `cudamedic triage`
waiting in its process) or Suspended (a worker's run, its process ended), with what it waits
for, kept with the run by the flow (flows/incident.py `Waiting`).

Example (text): `4b1e…  gpu-healthy/train-shm2  shm-too-small (0.93)  Suspended since
12:03:07 UTC, expires 13:03:07 UTC, asked by automation:alert ContainerDown`.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from pydantic import ValidationError

from runbooks.fix.approvals import WaitingApproval

WAITING_KEY = "cudamedic-waiting-"  # flows/incident.py
LIMIT = 200


class Pending(WaitingApproval):
    state: str  # Paused or Suspended


def pending(fleet: str | None) -> list[Pending]:
    """The waiting approvals, oldest first; `fleet` None: every fleet on the server."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["incident-response"])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))
            ),
            sort=FlowRunSort.START_TIME_ASC,
            limit=LIMIT,
        )
        out = []
        for run in runs:
            state = run.state.name if run.state else "Paused"
            found = _request(client, run.id) or _from_parameters(run)
            if fleet is None or found.fleet in (fleet, ""):
                out.append(Pending(**found.model_dump(), state=state))
    return out


def _request(client: Any, run_id: UUID) -> WaitingApproval | None:
    """What the flow kept with the run (hostile input: validated; None when unreadable)."""
    import json

    try:
        inputs = client.filter_flow_run_input(
            flow_run_id=run_id, key_prefix=WAITING_KEY, limit=5, exclude_keys=set()
        )
    except Exception:  # an older server or a transient error: the run is still listed
        return None
    for item in inputs:
        try:
            data = json.loads(item.value)
            return WaitingApproval.model_validate(data.get("request"))
        except (ValueError, ValidationError, AttributeError, RecursionError):
            continue
    return None


def _from_parameters(run: Any) -> WaitingApproval:
    """A run paused by an older cudamedic (nothing kept with it): what its parameters say."""
    params = run.parameters or {}
    rid = str(run.id)
    return WaitingApproval(
        run_id=rid,
        fleet="",
        host=str(params.get("target") or "?")[:200],
        container=str(params["container"])[:200] if params.get("container") else None,
        incident=next((t.split(":", 1)[1] for t in run.tags if t.startswith("incident:")), "?"),
        confidence=0.0,
        summary="",
        requester="?",
        detected_by=str(params.get("detected_by") or "?")[:200],
        asked_at=run.state.timestamp.isoformat(timespec="seconds") if run.state else "",
        expires_at="",
        approve=f"cudamedic approve {rid}",
        reject=f"cudamedic approve {rid} --reject",
    )
