"""The fleet health sweep flow: every host checked in parallel, each batch of hosts one Prefect task
(tens of task runs per sweep, not thousands: the SQLite server stays calm), state kept between
sweeps so only what is new, changed or resolved is reported, a fleet summary written to the
reports directory and attached as a Markdown artifact, and optionally an incident response
started for each host with news.

With `distribute=True` the batches run as runs of the ``sweep-batch`` deployment, so every
worker of the work pool takes a share. A batch's results travel through the Prefect API (a table
artifact of the batch run, `sweep-batch-hosts`), never a worker's disk: the workers share
nothing but the API.
"""

from __future__ import annotations

import concurrent.futures
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import FlowRun
from prefect.runtime import flow_run
from pydantic import BaseModel

from flows.fleet_state import sweep_state
from flows.incident import run_url, slug
from reports.render import SweepChange, SweepHostRow, SweepSummary, render_sweep, sweep_report_name
from reports.store import save_report
from runbooks.collect.inventory import Inventory, load_inventory
from runbooks.core import progress
from runbooks.core.runbook import Runbook, load_runbook
from runbooks.core.settings import Settings, load_settings
from runbooks.diagnose.health import HostChange, diff, snapshot, with_history
from runbooks.diagnose.sweep import (
    HostResult,
    batches,
    check_hosts,
    failed_result,
    select_hosts,
    summarize,
)

BATCH_DEPLOYMENT = "sweep-batch/sweep-batch"
INCIDENT_DEPLOYMENT = "incident-response/incident-response"


class NotChecked(BaseModel):
    """A finding of the last sweep that this one could not check (kept as it was), and why."""

    host: str
    code: str
    subject: str = ""
    level: str
    why: str


class SweepResult(BaseModel):
    hosts: int
    verdicts: dict[str, str]  # host -> healthy | warning | drain
    changes: list[HostChange]
    counts: dict[str, int]  # new / changed / resolved
    report: str
    duration_s: float
    responses: list[str] = []  # flow run ids of the incident responses started
    flow_run_url: str | None = None
    # the last sweep's findings this one could not check, kept as they were (health.with_history)
    not_checked: list[NotChecked] = []


def _inputs(inventory: str | None) -> tuple[Settings, Runbook, Inventory]:
    settings = load_settings(inventory=Path(inventory) if inventory else None)
    from runbooks.core.errors import InputError

    if settings.inventory is None:
        raise InputError("a sweep needs an inventory (--inventory or CUDAMEDIC_INVENTORY)")
    return (
        settings,
        load_runbook(settings.sweep_runbook, "sweep"),
        load_inventory(settings.inventory),
    )


@task(name="check-hosts", cache_policy=NO_CACHE, retries=0)
def check_batch_task(
    names: list[str],
    inventory: Inventory,
    settings: Settings,
    book: Runbook,
    out_dir: str,
    workers: int,
) -> list[HostResult]:
    return check_hosts(names, inventory, settings, book, Path(out_dir), workers)


BATCH_ARTIFACT = "sweep-batch-hosts"


@flow(name="sweep-batch", persist_result=False, log_prints=False)
def sweep_batch(
    names: list[str], out_dir: str, inventory: str | None = None
) -> list[dict[str, Any]]:
    """One batch of a distributed sweep, run by whichever worker takes it; its results are the
    run's `sweep-batch-hosts` artifact (one row per host), where the sweep reads them."""
    settings, book, inv = _inputs(inventory)
    rows = [
        r.model_dump(mode="json") for r in check_hosts(names, inv, settings, book, Path(out_dir))
    ]
    create_table_artifact(
        table=rows, key=BATCH_ARTIFACT, description="This batch's hosts, read by its sweep"
    )
    return rows


def batch_results(run_id: Any) -> list[HostResult]:
    """The results a finished `sweep-batch` run left in its artifact, from the Prefect API."""
    import json

    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]),
                key=ArtifactFilterKey(any_=[BATCH_ARTIFACT]),
            )
        )
    if len(found) != 1:
        raise LookupError(f"{len(found)} {BATCH_ARTIFACT} artifacts")
    data = found[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    if not isinstance(rows, list):
        raise TypeError(f"{BATCH_ARTIFACT} holds {type(rows).__name__}, not a list of hosts")
    return [HostResult.model_validate(r) for r in rows]


def _distributed(
    names: list[list[str]], out_dir: str, inventory: str | None, timeout: float
) -> list[HostResult]:
    from prefect.deployments import run_deployment

    def one(batch: list[str]) -> list[HostResult]:
        run: FlowRun = run_deployment(  # type: ignore[assignment]  # sync call in a sync flow
            BATCH_DEPLOYMENT,
            parameters={"names": batch, "out_dir": out_dir, "inventory": inventory},
            timeout=timeout,
            as_subflow=True,
        )
        state = run.state
        if state is None or not state.is_completed():
            why = f"batch run {run.id} ended {state.name if state else 'without a state'}"
            return [failed_result(n, why) for n in batch]
        try:
            return batch_results(run.id)
        except Exception as exc:  # an API error, a batch of another version
            why = f"batch run {run.id}: its result could not be read ({type(exc).__name__}: {exc})"
            return [failed_result(n, why[:500]) for n in batch]

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(names))) as pool:
        return [r for part in pool.map(one, names) for r in part]


def sweep_run_name() -> str:
    """`sweep-<tags or hosts, or all>-<UTC time>`: what a sweep run is called."""
    params = flow_run.parameters
    scope = params.get("tags") or params.get("hosts") or ["all"]
    return f"sweep-{'-'.join(slug(str(s)) for s in scope)[:40]}-{datetime.now(UTC):%Y%m%d-%H%M%S}"


@flow(
    name="fleet-health-check",
    flow_run_name=sweep_run_name,
    log_prints=False,
    persist_result=False,
)
def fleet_health_check(
    inventory: str | None = None,
    hosts: list[str] | None = None,
    tags: list[str] | None = None,
    start_incidents: bool = False,
    distribute: bool = False,
) -> SweepResult:
    """Check every selected host; report what is new, changed or resolved since the last sweep."""
    started = datetime.now(UTC)
    settings, book, inv = _inputs(inventory)
    names = select_hosts(inv, hosts, tags)
    out_dir = str(settings.out_dir / "sweeps" / started.strftime("%Y%m%dT%H%M%SZ"))
    progress.sweep_started(len(names))
    if distribute:
        groups = batches(names, book.batch_run_size)
        # a batch run waits for its worker, then checks `concurrency` hosts at a time, each
        # within the per-host timeout at worst
        rounds = -(-max(len(g) for g in groups or [[]]) // book.concurrency)
        timeout = book.timeouts.collect * (rounds + 1) + 120
        results = _distributed(groups, out_dir, inventory, timeout=timeout)
    else:
        results = _in_this_run(names, inv, settings, book, out_dir)
    progress.end("sweep", ", ".join(f"{summarize_verdicts(results)[v]} {v}" for v in VERDICTS))
    results, changes = _compare_with_last_sweep(settings, book, results)
    run_id = str(flow_run.get_id() or "") or None
    _tag_verdicts(run_id, results)
    links = {"Prefect flow run": u} if (u := run_url(run_id)) else {}
    summary = _summary(started, results, changes, links)
    _record_metrics(settings, results, started, summary.ended_at)
    responses = _start_responses(results, changes, run_id, settings) if start_incidents else {}
    path = _publish(settings, summary, changes, responses)
    counts = summarize(changes)
    get_run_logger().info(
        "%d hosts: %d drain, %d warning; %d new, %d changed, %d resolved",
        len(results),
        summary.count("drain"),
        summary.count("warning"),
        counts["new"],
        counts["changed"],
        counts["resolved"],
    )
    return SweepResult(
        hosts=len(results),
        verdicts={r.health.host: r.health.verdict for r in results},
        changes=changes,
        counts=counts,
        report=str(path),
        duration_s=round((summary.ended_at - started).total_seconds(), 2),
        responses=list(responses.values()),
        flow_run_url=links.get("Prefect flow run"),
        not_checked=[
            NotChecked(
                host=r.health.host, code=f.code, subject=f.subject, level=f.level, why=f.not_checked
            )
            for r in results
            for f in r.health.findings
            if f.not_checked
        ],
    )


MAX_HOST_TAGS = 20  # a run's tags name at most this many hosts to drain


def _tag_verdicts(run_id: str | None, results: list[HostResult]) -> None:
    """Tag the sweep's run with its worst verdict (`verdict:drain`) and the hosts to drain
    (`drain:<host>`), so the Prefect UI's filters find a sweep that found something."""
    from flows.incident import tag_run

    drain = sorted(r.health.host for r in results if r.health.verdict == "drain")
    worst = (
        "drain"
        if drain
        else "warning"
        if any(r.health.verdict == "warning" for r in results)
        else "healthy"
    )
    tag_run(run_id, f"verdict:{worst}", *(f"drain:{h}" for h in drain[:MAX_HOST_TAGS]))


def _record_metrics(
    settings: Settings, results: list[HostResult], started: datetime, ended: datetime
) -> None:
    """The sweep's verdicts for /metrics (flows/metrics.py); a failure to keep them is logged,
    never the sweep's failure."""
    from flows.metrics import record_sweep

    try:
        record_sweep(settings, results, ended, (ended - started).total_seconds())
    except Exception as exc:
        get_run_logger().warning("sweep metrics not kept: %s: %s", type(exc).__name__, exc)


def _in_this_run(
    names: list[str], inv: Inventory, settings: Settings, book: Runbook, out_dir: str
) -> list[HostResult]:
    """Every batch as a task of this flow run, all at once, sharing the runbook's concurrency:
    on a 2-core client, more SSH sessions at a time only cost CPU
    (tests/benchmarks/bench_sweep.py)."""
    groups = batches(names, book.batch_size)
    share = max(1, -(-book.concurrency // max(1, len(groups))))
    futures = [
        check_batch_task.with_options(timeout_seconds=book.timeouts.collect * 2 + 60).submit(
            g, inv, settings, book, out_dir, share
        )
        for g in groups
    ]
    return [r for fut in futures for r in fut.result()]


def _compare_with_last_sweep(
    settings: Settings, book: Runbook, results: list[HostResult]
) -> tuple[list[HostResult], list[HostChange]]:
    """Judge what needs the last sweep (a growing CUDA cache), then store this sweep and say
    what is new, changed or resolved since the last one."""
    with sweep_state(settings) as (before, save):
        results = [
            r.model_copy(
                update={
                    "health": with_history(r.health, before.get(r.health.host, {}), book.thresholds)
                }
            )
            for r in results
        ]
        seen = snapshot(r.health for r in results)
        changes = diff(before, seen)
        save(seen)
    return results, changes


def _summary(
    started: datetime,
    results: list[HostResult],
    changes: list[HostChange],
    links: dict[str, str],
) -> SweepSummary:
    return SweepSummary(
        started_at=started,
        ended_at=datetime.now(UTC),
        hosts=tuple(
            SweepHostRow(
                host=r.health.host,
                verdict=r.health.verdict,
                codes=tuple(
                    f.key + (f" (not checked: {f.not_checked})" if f.not_checked else "")
                    for f in r.health.findings
                ),
                incident=r.incident,
                incident_summary=r.incident_summary,
                bundle=r.health.bundle,
                error=r.health.error,
                duration_s=r.duration_s,
            )
            for r in results
        ),
        changes=tuple(SweepChange(**c.model_dump()) for c in changes),
        links=links,
    )


def _publish(
    settings: Settings,
    summary: SweepSummary,
    changes: list[HostChange],
    responses: dict[str, str],
) -> Path:
    """The report file, the run's artifacts, and (news only: a quiet fleet stays quiet) Slack."""
    progress.begin("report")
    markdown = render_sweep(summary) + _responses_section(responses)
    path = save_report(settings.reports_path, sweep_report_name(summary), markdown)
    progress.end("report", str(path))
    create_markdown_artifact(markdown=markdown, key="fleet-sweep", description="Fleet health sweep")
    create_table_artifact(
        table=[
            {"host": h.host, "verdict": h.verdict, "findings": ", ".join(h.codes) or "-"}
            for h in summary.hosts
        ],
        key="fleet-sweep-hosts",
        description="Verdict per host",
    )
    if changes and settings.slack_channel:
        from flows.slack.delivery import deliver
        from reports.slack import sweep_blocks

        deliver(
            settings,
            "chat.postMessage",
            channel=settings.slack_channel,
            text=f"Fleet health sweep: {len(changes)} change(s)",
            blocks=sweep_blocks(summary),
        )
    return path


VERDICTS = ("drain", "warning", "healthy")


def summarize_verdicts(results: list[HostResult]) -> dict[str, int]:
    return {v: sum(1 for r in results if r.health.verdict == v) for v in VERDICTS}


def _start_responses(
    results: list[HostResult], changes: list[HostChange], sweep_run: str | None, settings: Settings
) -> dict[str, str]:
    """Start an incident response (a run of the deployment) for each host with news; host ->
    flow run id. Fire and forget: a response may wait hours for an approval; the sweep must
    not. Each carries the sweep's run id as a tag (`sweep:<id>`), and the sweep's signature of
    its start when the fleet has an approval_key (runbooks/fix/approvals.py)."""
    from prefect.deployments import run_deployment

    from runbooks.fix.approvals import start_proof

    key = settings.approval_key.get_secret_value() if settings.approval_key else ""
    detected_by = "cudamedic fleet sweep"

    news = {c.host for c in changes if c.change != "resolved"}
    started: dict[str, str] = {}
    for r in results:
        if r.health.host in news and r.incident and r.health.error is None:
            trigger = f"fleet sweep: {', '.join(f.key for f in r.health.findings)}"
            run: FlowRun = run_deployment(  # type: ignore[assignment]
                INCIDENT_DEPLOYMENT,
                parameters={
                    "target": r.health.host,
                    "container": r.container,
                    "trigger_text": trigger,
                    "detected_by": detected_by,
                    "origin": start_proof(key, detected_by, r.health.host, r.container or "")
                    if key
                    else None,
                },
                tags=[f"sweep:{sweep_run}"] if sweep_run else None,
                timeout=0,
                as_subflow=False,
            )
            started[r.health.host] = str(run.id)
    return started


def _responses_section(responses: dict[str, str]) -> str:
    """The responses this sweep started, each linked to its flow run in the Prefect UI."""
    if not responses:
        return ""
    rows = [
        f"- {host}: [flow run {rid}]({run_url(rid)})" if run_url(rid) else f"- {host}: {rid}"
        for host, rid in responses.items()
    ]
    return "\n## Incident responses started\n\n" + "\n".join(rows) + "\n"
