"""Real Prometheus and Alertmanager for the tests (Debian's `prometheus` and
`prometheus-alertmanager`, installed by scripts/bootstrap.sh): each on a free loopback port with
its own temporary data directory, Alertmanager's cluster gossip off (it would bind every
address), stopped by the caller's `background` fixture."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode("utf-8"))


def wait_ready(url: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            get(url, timeout=2)
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} never answered:\n{log.read_text()[-3000:]}")


def alertmanager(
    start: Callable[..., Any], tmp: Path, webhook: str, token: str, env: dict[str, str]
) -> str:
    """Alertmanager routing every alert to `webhook` with a bearer token, repeating often and
    sending the resolved notification; returns its base URL."""
    (tmp / "am-data").mkdir(parents=True, exist_ok=True)
    (tmp / "am-token").write_text(token)
    config = {
        "route": {
            "receiver": "cudamedic",
            "group_by": ["alertname", "host"],
            "group_wait": "1s",
            "group_interval": "2s",
            "repeat_interval": "3s",
        },
        "receivers": [
            {
                "name": "cudamedic",
                "webhook_configs": [
                    {
                        "url": webhook,
                        "send_resolved": True,
                        "http_config": {
                            "authorization": {
                                "type": "Bearer",
                                "credentials_file": str(tmp / "am-token"),
                            }
                        },
                    }
                ],
            }
        ],
    }
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp / "alertmanager.log"
    start(
        [
            "prometheus-alertmanager",
            f"--config.file={tmp / 'alertmanager.yml'}",
            f"--storage.path={tmp / 'am-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        env,
        log,
    )
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/-/ready", log)
    return base


def prometheus(
    start: Callable[..., Any],
    tmp: Path,
    target: str,
    alertmanager_url: str,
    rules: Path,
    env: dict[str, str],
) -> str:
    """Prometheus scraping `target` (host:port) every second and evaluating `rules` every
    second, sending alerts to Alertmanager; returns its base URL."""
    (tmp / "prom-data").mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "cudamedic", "static_configs": [{"targets": [target]}]}],
        "alerting": {
            "alertmanagers": [
                {"static_configs": [{"targets": [alertmanager_url.removeprefix("http://")]}]}
            ]
        },
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp / "prometheus.log"
    start(
        [
            "prometheus",
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'prom-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        env,
        log,
    )
    base = f"http://127.0.0.1:{port}"
    wait_ready(base + "/-/ready", log)
    return base


def query(base: str, expr: str) -> list[dict[str, Any]]:
    from urllib.parse import quote

    data = json.loads(get(f"{base}/api/v1/query?query={quote(expr)}"))
    return list(data["data"]["result"])
