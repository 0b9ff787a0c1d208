"""`cudamedic serve`: serve the deployments from this process — incident response (on demand:
the CLI, Slack, an alert webhook through a Prefect automation), the fleet sweep on the cron
schedule from the config, and the sweep's batch flow (for distributed sweeps).

For a work pool with several workers instead, see deploy/prefect.yaml and deploy/OPERATIONS.md.
"""

from __future__ import annotations

from typing import Any

from runbooks.core.settings import Settings

INCIDENT = "incident-response"
SWEEP = "fleet-sweep"
BATCH = "sweep-batch"


def deployments(settings: Settings) -> list[Any]:
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron

    from flows.alerts import EVENT, RESOURCE_PREFIX, trigger_parameters
    from flows.incident import incident_response
    from flows.sweep import fleet_health_check, sweep_batch

    inventory = str(settings.inventory) if settings.inventory else None
    on_alert = DeploymentEventTrigger(
        name="alert starts a response",
        expect={EVENT},
        match={"prefect.resource.id": RESOURCE_PREFIX + "*"},
        parameters=trigger_parameters(),
    )
    return [
        incident_response.to_deployment(
            name=INCIDENT,
            description="Collect, diagnose, plan, approve, fix and report one incident",
            tags=["cudamedic"],
            triggers=[on_alert],
        ),
        fleet_health_check.to_deployment(
            name=SWEEP,
            schedule=Cron(settings.sweep_schedule, timezone=settings.sweep_timezone),
            parameters={"inventory": inventory},
            description="Fleet health sweep: reports what is new, changed or resolved",
            tags=["cudamedic"],
        ),
        sweep_batch.to_deployment(
            name=BATCH, description="One batch of a distributed sweep", tags=["cudamedic"]
        ),
    ]


def serve(settings: Settings) -> None:
    from prefect import serve as prefect_serve

    from flows.automations import ensure_crash_detection

    deps = deployments(settings)
    _refuse_pool_deployments([d.full_name for d in deps])
    ensure_crash_detection(settings.crash_after_s)
    prefect_serve(*deps, limit=8, print_starting_message=True)


def _refuse_pool_deployments(names: list[str]) -> None:
    """A deployment of the same name that runs on a work pool (deploy/prefect.yaml) would be
    half-replaced by serving it here, and its runs would crash: say so instead."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from runbooks.core.errors import InputError

    with get_client(sync_client=True) as client:
        for name in names:
            try:
                dep = client.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            if dep.work_pool_name:
                raise InputError(
                    f"deployment {name} already runs on work pool {dep.work_pool_name!r} "
                    "(deploy/prefect.yaml): use that pool's workers, or delete it first "
                    f"(`prefect deployment delete {name}`) to serve it from here"
                )
