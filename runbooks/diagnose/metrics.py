"""Sweep results and responses as Prometheus metrics (PURE: data in, metric families out).

What a sweep saw is kept per host (`SweepMetrics`, stored by flows/metrics.py where the fleet's
state is); these functions turn it, and the count of incident responses by outcome, into the
families `/metrics` serves and the node_exporter textfile holds:

    cudamedic_host_verdict{host="gpu-xid79",verdict="drain"} 1     (one per host and verdict)
    cudamedic_finding{host="gpu-xid79",code="xid-79",severity="drain"} 1
    cudamedic_last_sweep_timestamp_seconds 1.7649e+09
    cudamedic_last_sweep_duration_seconds 12.4
    cudamedic_hosts_swept 8
    cudamedic_responses{outcome="fixed"} 3                          (last `RESPONSE_WINDOW_D` days)

Each host has every verdict label, 1 for its verdict and 0 for the others, so an alert rule is
`cudamedic_host_verdict{verdict="drain"} == 1` and a resolved host sets it back to 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime

from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import Field

from runbooks.core.model import Frozen

VERDICTS = ("healthy", "warning", "drain")
RESPONSE_WINDOW_D = 7


class HostMetrics(Frozen):
    verdict: str
    findings: tuple[tuple[str, str, str], ...] = ()  # (code, subject, level)


class SweepMetrics(Frozen):
    """The last sweep of each host, and when the last sweep ran and how long it took."""

    at: datetime | None = None
    duration_s: float = 0.0
    hosts: dict[str, HostMetrics] = Field(default_factory=dict)


def merged(before: SweepMetrics | None, now: SweepMetrics) -> SweepMetrics:
    """A sweep of some hosts keeps the others as the last sweep of them saw them."""
    hosts = {**(before.hosts if before else {}), **now.hosts}
    return now.model_copy(update={"hosts": hosts})


def families(sweep: SweepMetrics | None, responses: Mapping[str, int]) -> list[Metric]:
    verdict = GaugeMetricFamily(
        "cudamedic_host_verdict",
        "The host's verdict in its last sweep (1 for that verdict, 0 for the others)",
        labels=["host", "verdict"],
    )
    finding = GaugeMetricFamily(
        "cudamedic_finding",
        "A finding of the host's last sweep (code, and severity warning or drain)",
        labels=["host", "code", "severity"],
    )
    for host, h in sorted((sweep.hosts if sweep else {}).items()):
        for v in VERDICTS:
            verdict.add_metric([host, v], 1.0 if h.verdict == v else 0.0)
        for code, level in sorted({(c, lvl) for c, _, lvl in h.findings}):
            finding.add_metric([host, code, level], 1.0)
    out: list[Metric] = [verdict, finding]
    if sweep is not None and sweep.at is not None:
        out.append(
            GaugeMetricFamily(
                "cudamedic_last_sweep_timestamp_seconds",
                "When the last sweep finished (Unix time)",
                value=sweep.at.timestamp(),
            )
        )
        out.append(
            GaugeMetricFamily(
                "cudamedic_last_sweep_duration_seconds",
                "How long the last sweep took",
                value=sweep.duration_s,
            )
        )
    out.append(
        GaugeMetricFamily(
            "cudamedic_hosts_swept",
            "Hosts with a last sweep",
            value=float(len(sweep.hosts) if sweep else 0),
        )
    )
    resp = GaugeMetricFamily(
        "cudamedic_responses",
        f"Incident responses of the last {RESPONSE_WINDOW_D} days by outcome",
        labels=["outcome"],
    )
    for outcome, count in sorted(responses.items()):
        resp.add_metric([outcome], float(count))
    out.append(resp)
    return out


def host_metrics(verdict: str, findings: Iterable[tuple[str, str, str]]) -> HostMetrics:
    return HostMetrics(verdict=verdict, findings=tuple(findings))
