#!/usr/bin/env python3
"""Benchmark: time to diagnosis, the CLI's cold start, and the Slack acknowledgement.

On the lab (started if needed) with its own warm Prefect server (a real `prefect server` on a free
loopback port, temporary database):
  - `cudamedic triage gpu-healthy --container <broken> --trigger ...` (collect, classify, plan,
    report; a dry run, so every run sees the same broken container) N times: wall time of the
    command, and each step's time from its Prefect task run;
  - the CLI's cold start: `cudamedic --help` and `cudamedic classify <bundle>` (no Prefect);
  - a signed Slack slash command to the app's answer (Slack's limit is 3 s; goal 1 s).
Prints p50 / p95 / max against the goals. Run as root:
  .venv/bin/python tests/benchmarks/bench_triage.py [--runs 20]
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CLI = [str(REPO / ".venv" / "bin" / "cudamedic")]


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def row(name: str, values: list[float], goal: float | None) -> str:
    p50, p95 = statistics.median(values), pct(values, 95)
    verdict = "" if goal is None else ("met" if p95 <= goal else "NOT met")
    g = f"{goal:g}" if goal is not None else "–"
    return (
        f"| {name} | {len(values)} | {p50:.2f} | {p95:.2f} | {max(values):.2f} | {g} | {verdict} |"
    )


def step_times(run_id: str) -> dict[str, float]:
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)]))
        )
    out: dict[str, float] = {}
    for tr in runs:
        name = tr.name.rsplit("-", 1)[0]
        out[name] = out.get(name, 0.0) + float(tr.total_run_time.total_seconds())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()

    from tests.lab.lab import IMAGE, up

    lab = up()
    work = Path(tempfile.mkdtemp(prefix="cudamedic-bench-"))
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "CUDAMEDIC_CONFIG": lab.config,
        "CUDAMEDIC_STATE_DIR": str(work / "state"),
        "CUDAMEDIC_OUT_DIR": str(work / "out"),
        "CUDAMEDIC_PREFECT_PORT": str(port),
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    env.pop("PREFECT_API_URL", None)
    # The embedded default's cold start: the first command starts the local server.
    t0 = time.monotonic()
    subprocess.run([*CLI, "server", "start"], env=env, check=True, capture_output=True)
    server_start = time.monotonic() - t0
    env["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    os.environ.update(
        {"PREFECT_API_URL": env["PREFECT_API_URL"], "PREFECT_LOGGING_LEVEL": "WARNING"}
    )

    import docker

    engine = docker.DockerClient(base_url=lab.engines["gpu"].url)
    name = "bench-shm"
    try:
        engine.containers.get(name).remove(force=True)
    except docker.errors.NotFound:
        pass
    c = engine.containers.run(
        IMAGE,
        ["sh", "-c", "dd if=/dev/zero of=/dev/shm/b bs=1M count=256 && sleep 3600"],
        name=name,
        detach=True,
        network_mode="none",
        device_requests=[docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])],
    )
    c.wait(timeout=30)
    try:
        walls: list[float] = []
        steps: dict[str, list[float]] = {}
        for _ in range(args.runs):
            t0 = time.monotonic()
            done = subprocess.run(
                [
                    *CLI,
                    "triage",
                    "gpu-healthy",
                    "--container",
                    name,
                    "--trigger",
                    "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error.",
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            walls.append(time.monotonic() - t0)
            run_id = done.stdout.rsplit("/runs/flow-run/", 1)[1].strip()
            for k, v in step_times(run_id).items():
                steps.setdefault(k, []).append(v)
        help_s, classify_s = [], []
        reports = sorted((work / "out").glob("gpu-healthy-bench-shm-*"))
        for _ in range(5):
            t0 = time.monotonic()
            subprocess.run([*CLI, "--help"], env=env, check=True, capture_output=True)
            help_s.append(time.monotonic() - t0)
            t0 = time.monotonic()
            subprocess.run([*CLI, "classify", str(reports[0])], env=env, capture_output=True)
            classify_s.append(time.monotonic() - t0)
        acks = slack_acks(lab, env, runs=args.runs)
    finally:
        engine.containers.get(name).remove(force=True)
        subprocess.run([*CLI, "server", "stop"], env=env, capture_output=True)

    print(f"\nPrefect: embedded local server cold start {server_start:.1f} s (first command only)")
    print("\n| figure (seconds) | n | p50 | p95 | max | goal (p95) | |")
    print("|---|---|---|---|---|---|---|")
    print(row("triage: command, trigger to post-mortem written", walls, 15.0))
    for k in (
        "recover-interrupted-fix",
        "collect-evidence",
        "classify",
        "plan-fix",
        "write-report",
    ):
        if k in steps:
            print(row(f"  step {k}", steps[k], None))
    print(row("CLI cold start: cudamedic --help", help_s, None))
    print(row("CLI cold start: cudamedic classify BUNDLE", classify_s, None))
    print(row("Slack: signed slash command to acknowledgement", acks, 1.0))


def slack_acks(lab: Any, env: dict[str, str], runs: int) -> list[float]:
    from pydantic import SecretStr

    from flows.slack.app import SlackApp
    from runbooks.collect.inventory import load_inventory
    from runbooks.core.settings import load_settings
    from tests.slackfake import fake_slack

    secret = "bench-signing-secret"
    times: list[float] = []
    with fake_slack() as fake:
        settings = load_settings(
            inventory=Path(lab.inventory),
            slack_bot_token=SecretStr("xoxb-bench"),
            slack_signing_secret=SecretStr(secret),
            slack_api_url=fake.base_url,
            state_dir=Path(env["CUDAMEDIC_STATE_DIR"]),
        )
        app = SlackApp(settings, load_inventory(Path(lab.inventory)))
        server = app.server("127.0.0.1", 0).start()
        url = server.url + "/slack/commands"
        for i in range(runs):
            body = urllib.parse.urlencode(
                {
                    "command": "/cudamedic",
                    "text": "triage gpu-healthy bench-shm",
                    "user_id": "U1",
                    "channel_id": "C1",
                    "trigger_id": f"bench-{i}-{time.time_ns()}",
                }
            ).encode()
            ts = str(int(time.time()))
            sig = (
                "v0="
                + hmac.new(
                    secret.encode(), b"v0:" + ts.encode() + b":" + body, hashlib.sha256
                ).hexdigest()
            )
            req = urllib.request.Request(
                url,
                data=body,
                method="POST",
                headers={"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig},
            )
            t0 = time.monotonic()
            with urllib.request.urlopen(req, timeout=10) as resp:
                resp.read()
            times.append(time.monotonic() - t0)
            time.sleep(0.2)  # let the background start (it has no deployment here) finish
        server.stop()
    return times


if __name__ == "__main__":
    main()
