"""Prometheus and Alertmanager, the whole loop, for real (issue 29, part 3).

A sweep drains a lab host; `cudamedic metrics` (long-running) serves its verdict at /metrics;
Debian's real Prometheus scrapes it and fires deploy/prometheus/cudamedic-rules.yml's
CudamedicHostDrained; Debian's real Alertmanager sends it, repeated every few seconds, to
`cudamedic alerts`; the incident-response deployment (`cudamedic serve`) starts exactly one
response for that host. The host is then made healthy, the next sweep says so, the alert
resolves, Alertmanager sends the resolved notification, and still only one response exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from runbooks.diagnose.metrics import HostMetrics, SweepMetrics, families
from tests import prom
from tests.fleet import ROOT
from tests.lab.lab import FIXTURES, LabState
from tests.test_deploy import BIN, _drop_deployments, background, env  # noqa: F401 - fixtures
from tests.test_fix import cli_env, fix_settings  # noqa: F401 - fixtures

RULES = ROOT / "deploy" / "prometheus" / "cudamedic-rules.yml"


def exposition(sweep: SweepMetrics | None, responses: dict[str, int]) -> str:
    class One:
        def collect(self):  # type: ignore[no-untyped-def]
            yield from families(sweep, responses)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_families_name_each_host_verdict_and_finding() -> None:
    sweep = SweepMetrics(
        at=datetime(2026, 12, 4, 10, 0, tzinfo=UTC),
        duration_s=12.5,
        hosts={
            "gpu-xid79": HostMetrics(
                verdict="drain",
                findings=(
                    ("xid-79", "0000:02:00", "drain"),
                    ("dcgm-health-power", "gpu0", "warning"),
                ),
            ),
            'odd"host\n': HostMetrics(verdict="healthy"),
        },
    )
    text = exposition(sweep, {"fixed": 3, "approval-timed-out": 1})
    assert 'cudamedic_host_verdict{host="gpu-xid79",verdict="drain"} 1.0' in text
    assert 'cudamedic_host_verdict{host="gpu-xid79",verdict="healthy"} 0.0' in text
    assert 'cudamedic_finding{code="xid-79",host="gpu-xid79",severity="drain"} 1.0' in text
    assert 'cudamedic_finding{code="dcgm-health-power",host="gpu-xid79",severity="warning"}' in text
    assert "cudamedic_last_sweep_timestamp_seconds 1.7963784e+09" in text  # 2026-12-04T10:00Z
    assert "cudamedic_last_sweep_duration_seconds 12.5" in text
    assert 'cudamedic_responses{outcome="fixed"} 3.0' in text
    assert 'host="odd\\"host\\n"' in text  # a name from outside is escaped, never breaks a line
    assert "cudamedic_host_verdict" in exposition(None, {})  # no sweep yet: families, no samples


def _cudamedic(environ: dict[str, str], *args: str, timeout: float = 180) -> str:
    proc = subprocess.run(
        [str(BIN / "cudamedic"), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc.stdout


def _field(out: str, name: str) -> str:
    m = re.search(rf"^{name}:\s+(.*)$", out, re.M)
    assert m, out
    return m.group(1).strip()


def _wait(log: Path, pattern: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m := re.search(pattern, log.read_text()):
            return m.group(1)
        time.sleep(0.3)
    raise AssertionError(f"{pattern!r} never in {log}:\n{log.read_text()[-3000:]}")


def _responses_for(host: str, detected_by: str, since: datetime) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["incident-response"]))
        )
    return [
        r
        for r in runs
        if r.parameters.get("target") == host
        and r.parameters.get("detected_by") == detected_by
        and r.created is not None
        and r.created >= since
    ]


def _notifications(am: str) -> float:
    text = prom.get(am + "/metrics")
    return sum(
        float(v)
        for v in re.findall(
            r'^alertmanager_notifications_total\{integration="webhook"[^}]*\} (\S+)$', text, re.M
        )
    )


@pytest.mark.lab
def test_prometheus_fires_on_a_drained_host_and_alertmanager_starts_one_response(
    env: dict[str, str],  # noqa: F811
    background: Any,  # noqa: F811
    tmp_path: Path,
    lab: LabState,
) -> None:
    since = datetime.now(UTC)
    token = "pr0m-t0ken-s3cret"
    env = {**env, "CUDAMEDIC_SWEEP_SCHEDULE": "0 0 1 1 *", "CUDAMEDIC_ALERT_TOKEN": token}
    host = "gpu-nodriver"
    data = Path(lab.hosts[host].data)
    kept = {name: (data / name).read_bytes() for name in ("nvidia-smi.txt", "nvidia-smi.rc")}
    _drop_deployments()
    logs = {n: tmp_path / f"{n}.log" for n in ("serve", "alerts", "metrics")}
    background([str(BIN / "cudamedic"), "serve"], env, logs["serve"])
    background([str(BIN / "cudamedic"), "alerts", "--port", "0"], env, logs["alerts"])
    background([str(BIN / "cudamedic"), "metrics", "--port", "0"], env, logs["metrics"])
    alerts_url = _wait(logs["alerts"], r"POST (http://\S+)")
    metrics_url = _wait(logs["metrics"], r"GET (http://\S+)")
    _wait(logs["serve"], r"(being served)", timeout=120)
    try:
        out = _cudamedic(env, "sweep", "--host", host)
        assert re.search(r"\bdrain\b", out), out
        scraped = prom.get(metrics_url)
        assert f'cudamedic_host_verdict{{host="{host}",verdict="drain"}} 1.0' in scraped, scraped
        assert f'cudamedic_finding{{code="driver-not-loaded",host="{host}"' in scraped
        assert "cudamedic_last_sweep_duration_seconds" in scraped

        am = prom.alertmanager(background, tmp_path, alerts_url, token, env)
        target = metrics_url.removeprefix("http://").removesuffix("/metrics")
        pm = prom.prometheus(background, tmp_path, target, am, RULES, env)
        deadline = time.monotonic() + 60
        while not prom.query(pm, f'ALERTS{{alertname="CudamedicHostDrained",host="{host}"}}'):
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
        detected_by = "alert CudamedicHostDrained"
        deadline = time.monotonic() + 180
        while not [r for r in _responses_for(host, detected_by, since) if r.state.is_final()]:
            assert time.monotonic() < deadline, logs["serve"].read_text()[-4000:]
            time.sleep(1)
        # Alertmanager keeps repeating the firing alert (repeat_interval 3 s): no new response.
        while _notifications(am) < 4:
            assert time.monotonic() < deadline, prom.get(am + "/metrics")[-2000:]
            time.sleep(1)

        # The host is mended: the next sweep says healthy, the alert resolves.
        shutil.copyfile(FIXTURES / "nvidia-smi/h100-sxm-8gpu.txt", data / "nvidia-smi.txt")
        (data / "nvidia-smi.rc").write_text("0")
        out = _cudamedic(env, "sweep", "--host", host)
        assert re.search(rf"\| {host} \| healthy", Path(_field(out, "report")).read_text()), out
        sent = _notifications(am)
        deadline = time.monotonic() + 90
        mended = f'cudamedic_host_verdict{{host="{host}",verdict="drain"}} 0.0'
        while mended not in prom.get(metrics_url):  # the metrics process reads it again (10 s)
            assert time.monotonic() < deadline
            time.sleep(0.5)
        while prom.query(pm, f'ALERTS{{alertname="CudamedicHostDrained",host="{host}"}}'):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        while prom.get(am + "/api/v2/alerts?active=true").strip() != "[]":
            assert time.monotonic() < deadline, prom.get(am + "/api/v2/alerts")
            time.sleep(0.5)
        while _notifications(am) <= sent:  # the resolved notification reached the receiver
            assert time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(5)  # anything the resolved notification could have started has started
        runs = _responses_for(host, detected_by, since)
        assert len(runs) == 1, [(r.name, r.state_name) for r in runs]
        assert token not in "".join(p.read_text() for p in logs.values())
    finally:
        for name, content in kept.items():
            (data / name).write_bytes(content)


@pytest.mark.lab
def test_textfile_for_node_exporter(
    env: dict[str, str],  # noqa: F811
    tmp_path: Path,
) -> None:
    _cudamedic(env, "sweep", "--host", "gpu-mismatch")
    path = tmp_path / "textfile" / "cudamedic.prom"
    out = _cudamedic(env, "metrics", "--textfile", str(path), "--once")
    assert "wrote" in out
    text = path.read_text()
    assert 'cudamedic_host_verdict{host="gpu-mismatch",verdict="drain"} 1.0' in text, text
    assert not list(path.parent.glob("*.tmp*"))  # written atomically


def test_rules_files_are_valid_for_prometheus() -> None:
    proc = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "SUCCESS: 3 rules found" in proc.stdout, proc.stdout


def test_grafana_dashboard_queries_only_metrics_cudamedic_serves() -> None:
    """deploy/grafana/cudamedic-dashboard.json: every panel's query is valid PromQL for
    Prometheus' own parser (promtool) and names only families `cudamedic metrics` serves."""
    import json

    served = {f.name for f in families(SweepMetrics(at=datetime.now(UTC)), {"fixed": 1})}
    dash = json.loads((ROOT / "deploy" / "grafana" / "cudamedic-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 8
    for expr in exprs:
        names = set(re.findall(r"\bcudamedic_[a-z_]+", expr))
        assert names and names <= served, (expr, served)
        proc = subprocess.run(
            ["promtool", "check", "rules", "/dev/stdin"],
            input=f"groups: [{{name: g, rules: [{{record: r, expr: '{expr}'}}]}}]",
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 0, (expr, proc.stdout + proc.stderr)
