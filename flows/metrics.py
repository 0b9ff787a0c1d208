"""Prometheus metrics of the fleet (SHELL): what the sweeps saw, kept where the fleet's state is,
served at ``/metrics`` by a long-running `cudamedic metrics`, or written as a node_exporter
textfile.

The fleet sweep stores each host's verdict and findings, and when it ran and for how long, in the
Prefect artifact ``cudamedic-<fleet>-sweep-metrics`` (the newest version; flows/fleet_state.py),
so the metrics process may run anywhere: on a scrape it reads that document and counts the
incident-response flow runs of the last days by their final state (``Fixed``, ``Diagnosed``,
``ApprovalTimedOut``...), both through the Prefect API with its timeouts, at most once every
`CACHE_S` seconds. When Prefect cannot be asked, the last answer is served again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from flows.fleet_state import read_document, write_document
from runbooks.core.settings import Settings
from runbooks.diagnose.metrics import (
    RESPONSE_WINDOW_D,
    SweepMetrics,
    families,
    host_metrics,
    merged,
)
from runbooks.diagnose.sweep import HostResult

log = logging.getLogger(__name__)
CACHE_S = 10.0
RESPONSE_FLOW = "incident-response"


def metrics_key(settings: Settings) -> str:
    return f"cudamedic-{settings.fleet}-sweep-metrics"


def _readable(data: object) -> bool:
    """Is a stored version a sweep's metrics document? (a version cut, edited by hand or planted
    by anyone with API access is passed over)"""
    try:
        SweepMetrics.model_validate(data)
    except ValueError:
        return False
    return True


def record_sweep(
    settings: Settings, results: Iterable[HostResult], ended: datetime, duration_s: float
) -> None:
    """Keep this sweep's verdicts beside the last sweep of the hosts it did not check."""
    now = SweepMetrics(
        at=ended,
        duration_s=round(duration_s, 3),
        hosts={
            r.health.host: host_metrics(
                r.health.verdict, ((f.code, f.subject, f.level) for f in r.health.findings)
            )
            for r in results
        },
    )
    key = metrics_key(settings)
    stored, _ = read_document(key, _readable)
    before = SweepMetrics.model_validate(stored) if stored is not None else None
    write_document(
        key,
        merged(before, now).model_dump(mode="json"),
        f"Fleet {settings.fleet}: the last sweep's verdicts, for /metrics",
    )


def responses_by_outcome(days: int = RESPONSE_WINDOW_D) -> dict[str, int]:
    """Incident-response flow runs started in the last `days`, counted by state name."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterStartTime,
    )

    since = datetime.now(UTC) - timedelta(days=days)
    counts: Counter[str] = Counter()
    with get_client(sync_client=True) as client:
        for page in range(25):  # 5,000 responses a week at most are counted
            runs = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[RESPONSE_FLOW])),
                flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)),
                limit=200,
                offset=200 * page,
            )
            counts.update(_outcome(r.state.name if r.state else None) for r in runs)
            if len(runs) < 200:
                break
    return dict(counts)


def _outcome(state: str | None) -> str:
    """`ApprovalTimedOut` -> `approval-timed-out` (the outcome words of the post-mortems)."""
    if not state:
        return "unknown"
    out = "".join(f"-{c.lower()}" if c.isupper() else c for c in state).lstrip("-")
    return out[:60]


class FleetCollector(Collector):
    """Reads the fleet's state on a scrape (cached `CACHE_S`); serves the last answer when
    Prefect cannot be asked."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.at = 0.0
        self.sweep: SweepMetrics | None = None
        self.responses: dict[str, int] = {}

    def refresh(self) -> None:
        with self.lock:
            if time.monotonic() - self.at < CACHE_S and self.at:
                return
            try:
                stored, _ = read_document(metrics_key(self.settings), _readable)
                self.sweep = SweepMetrics.model_validate(stored) if stored is not None else None
                self.responses = responses_by_outcome()
            except Exception as exc:  # Prefect away or a bad document: keep the last answer
                log.warning("fleet state not read for /metrics: %s: %s", type(exc).__name__, exc)
            self.at = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        self.refresh()
        yield from families(self.sweep, self.responses)


def registry_for(settings: Settings) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(settings))
    return registry


def write_textfile(registry: CollectorRegistry, path: Path) -> None:
    """The metrics as a node_exporter textfile (written atomically: node_exporter never reads
    half a file)."""
    from prometheus_client import write_to_textfile

    path.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(path), registry)


def serve(
    settings: Settings,
    listen: str,
    port: int | None,
    *,
    textfile: Path | None = None,
    every: float = 60.0,
    once: bool = False,
    say: Any = print,
) -> None:
    """Serve /metrics on listen:port (None: no HTTP; 0: a free port) and/or rewrite `textfile`
    every `every` seconds (`once`: write it once and return), until interrupted."""
    from prometheus_client import start_http_server

    registry = registry_for(settings)
    if port is not None and not once:
        server, _ = start_http_server(port, addr=listen, registry=registry)
        bound = server.server_address[1]
        say(f"metrics: GET http://{listen}:{bound}/metrics")
    while True:
        if textfile is not None:
            try:
                write_textfile(registry, textfile)
            except OSError as exc:
                log.warning("textfile %s not written: %s", textfile, exc)
            if once:
                say(f"metrics: wrote {textfile}")
                return
        time.sleep(every)
