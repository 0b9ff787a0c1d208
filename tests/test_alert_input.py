"""Alertmanager input is hostile (issue 27, finding 6): every label and annotation cudamedic uses
is redacted before it is cut (and cut at a word boundary), since it reaches a Prefect event and
a flow run's parameters; one request (or many) starts one response per host in a window, later
alerts join it. Real components: the alert receiver's `receive` and the tests' Prefect server
(the events it emits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flows.alerts import Seen, parse_alertmanager, receive
from runbooks.collect.inventory import Host, Inventory

TOKEN = "ghp_" + "Zq7Kx2Lm9Np4Rs8Tv3Wy6Ab1Cd5Ef0Gh2Jk4"  # the GitHub format (ghp_ + 36)
INVENTORY = Inventory(hosts={"node07": Host(name="node07", address="10.0.0.7")})


def _body(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "alerts": list(alerts)}


def _alert(n: int = 0, **labels: str) -> dict[str, Any]:
    return {
        "status": "firing",
        "labels": {"alertname": "GpuXid", "instance": "node07:9400", **labels},
        "annotations": {"summary": f"Xid 79 on GPU {n}"},
        "fingerprint": f"f{n:04d}",
        "startsAt": "2026-12-04T10:00:00Z",
    }


def test_alert_name_and_labels_are_redacted() -> None:
    raw = _alert(alertname=f"GpuXid token={TOKEN}", container=f"web {TOKEN}")
    [alert] = parse_alertmanager(_body(raw), INVENTORY)
    assert TOKEN not in alert.model_dump_json() and TOKEN[4:20] not in alert.model_dump_json()
    assert "[REDACTED]" in alert.alertname and alert.container is None  # not a container name


def test_a_summary_is_redacted_before_it_is_cut() -> None:
    """A token across the old 1,000-character cut: its first half survived."""
    for at in (980, 990, 996, 1000):
        raw = _alert()
        raw["annotations"]["summary"] = "x" * at + " " + TOKEN + " after"
        [alert] = parse_alertmanager(_body(raw), INVENTORY)
        assert TOKEN[:8] not in alert.summary and "ghp_" not in alert.summary, at
        assert len(alert.summary) <= 1000


def test_one_request_starts_one_response_per_host(prefect_api: str) -> None:
    """500 alerts for one host in one request started 500 responses; now one, the rest join it,
    and a later request for the host joins it too."""
    seen = Seen()
    code, answer = receive(
        json.dumps(_body(*(_alert(n) for n in range(500)))).encode(), INVENTORY, seen
    )
    assert code == 202 and len(answer["announced"]) == 1, answer["announced"]
    joined = [i for i in answer["ignored"] if i["why"] == "joined the host's response"]
    assert len(joined) == 499
    code, answer = receive(json.dumps(_body(_alert(9999))).encode(), INVENTORY, seen)
    assert answer["announced"] == [] and answer["ignored"][0]["why"].startswith("joined")


def test_the_receiver_refuses_the_example_token(tmp_path: Path) -> None:
    """deploy/systemd/cudamedic.env.example's `change-me-long-random` was accepted (issue 30):
    every receiver installed from it would take the same token."""
    import pytest

    from flows.alerts import make_server
    from runbooks.core.errors import InputError

    with pytest.raises(InputError, match="example"):
        make_server("127.0.0.1", 0, "change-me-long-random", INVENTORY, Seen())
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text("hosts:\n  node07: {address: 10.0.0.7}\n")
    env = {
        **os.environ,
        "CUDAMEDIC_INVENTORY": str(inventory),
        "CUDAMEDIC_ALERT_TOKEN": "change-me-long-random",
        "CUDAMEDIC_STATE_DIR": str(tmp_path / "state"),
    }
    done = subprocess.run(
        [sys.executable, "-m", "runbooks.cli", "alerts", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "example" in done.stderr and "Traceback" not in done.stderr
