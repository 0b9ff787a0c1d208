"""What the Prefect API lets a caller do (issue 27, finding 4). The embedded server asks for an
auth string kept 0600 under its PREFECT_HOME (the tests' servers ask for one too: conftest);
`approved_by` approves only a run the CLI started in its own process; a run created through the
API (an alert event's target, a deployment run) may only target an inventory host.

Real components: the tests' Prefect server, a server started by flows/server.py on a port of its
own, the lab's engine and a `python -c` process that calls the flow the way a worker does
(a deployment run's parameters handed to the flow function, no CLI around it)."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from runbooks.core.settings import Settings
from tests.test_fix import fix_settings, volume  # noqa: F401 - fixtures
from tests.test_flows import env, shm_container  # noqa: F401 - fixtures

ROOT = Path(__file__).parents[1]


def _post(url: str, auth: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    req = urllib.request.Request(url, data=b"{}", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_embedded_server_asks_for_its_generated_auth_string(tmp_path: Path) -> None:
    from flows.server import AUTH_FILE, auth_string, ensure_local_server, stop_local_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(state_dir=tmp_path / "state", prefect_port=port)
    saved = os.environ.pop("PREFECT_API_AUTH_STRING")  # a CLI on a fresh machine names none
    try:
        url = ensure_local_server(settings)
        secret = auth_string(settings)
        path = tmp_path / "state" / "prefect" / AUTH_FILE
        assert path.stat().st_mode & 0o777 == 0o600 and secret in path.read_text()
        assert len(secret) > 40 and auth_string(settings) == secret  # generated once
        assert _post(url + "/flow_runs/filter", None) == 401
        assert _post(url + "/flow_runs/filter", "cudamedic:guess") == 401
        assert _post(url + "/flow_runs/filter", secret) == 200
    finally:
        os.environ["PREFECT_API_AUTH_STRING"] = saved
        stop_local_server(settings)


def test_the_tests_server_is_closed_without_the_auth_string(prefect_api: str) -> None:
    """The harness keeps working with auth on: its processes inherit PREFECT_API_AUTH_STRING."""
    assert _post(prefect_api + "/artifacts/filter", None) == 401
    assert _post(prefect_api + "/artifacts/filter", os.environ["PREFECT_API_AUTH_STRING"]) == 200


def test_the_shipped_setups_require_an_auth_string() -> None:
    compose = yaml.safe_load((ROOT / "deploy/docker-compose.yml").read_text())
    server = compose["services"]["prefect-server"]["environment"]
    assert server["PREFECT_SERVER_API_AUTH_STRING"].startswith("${PREFECT_AUTH_STRING:?")
    for name in ("worker", "alerts"):
        service = compose["services"][name]["environment"]
        assert service["PREFECT_API_AUTH_STRING"].startswith("${PREFECT_AUTH_STRING:?"), name
    units = ROOT / "deploy/systemd"
    server_unit = (units / "cudamedic-prefect-server.service").read_text()
    # `$$`: systemd hands `$NAME` to the shell unexpanded, so the string is never on a command line
    assert 'test -n "$$PREFECT_SERVER_API_AUTH_STRING"' in server_unit
    for unit in ("cudamedic-worker@.service", "cudamedic-serve.service",
                 "cudamedic-alerts.service", "cudamedic-slack.service"):  # fmt: skip
        assert 'test -n "$$PREFECT_API_AUTH_STRING"' in (units / unit).read_text(), unit
    ops = (ROOT / "deploy/OPERATIONS.md").read_text()
    assert "Who can reach the Prefect API" in ops


def _flow_as_a_worker_runs_it(
    environ: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys, json\n"
        "from flows.server import configure\n"
        "from runbooks.core.settings import load_settings\n"
        "configure(load_settings())\n"
        "from flows.incident import incident_response\n"
        "kw = json.loads(sys.argv[1])\n"
        "r = incident_response(**kw, return_state=True)\n"
        "print('STATE', r.type.value, r.message)\n"
        "res = r.result(raise_on_failure=False)\n"
        "print('OUTCOME', getattr(res, 'outcome', res))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, env=environ, timeout=300, cwd=ROOT,
    )  # fmt: skip


def test_approved_by_in_the_parameters_approves_nothing(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    gpu_engine: Any,
    volume: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A run whose parameters say `approved_by` (what anyone with API write access can create)
    waits for a person like any other: here nobody answers in the runbook's 3 s, so nothing
    changes. Before, the fix was applied at once, approved "up front" by whoever was named."""
    shm_container(make_container, container_name, volume)
    book = yaml.safe_load((ROOT / "runbooks/incident.yaml").read_text())
    book["timeouts"]["approval"] = 3
    (tmp_path / "incident.yaml").write_text(yaml.safe_dump(book))
    environ = {**env, "CUDAMEDIC_RUNBOOK": str(tmp_path / "incident.yaml")}
    kw = {"target": "gpu-healthy", "container": container_name, "approved_by": "U0BOSS"}
    out = _flow_as_a_worker_runs_it(environ, json.dumps(kw))
    assert "OUTCOME" in out.stdout, out.stdout + out.stderr
    assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] == 64 << 20
    assert "fixed" not in out.stdout.split("OUTCOME", 1)[1], out.stdout


@pytest.mark.parametrize("target", ["local", "ssh://root@127.0.0.1:22"])
def test_a_deployment_run_may_only_target_an_inventory_host(
    env: dict[str, str],  # noqa: F811
    target: str,
) -> None:
    """An alert event's `target` (or any run not started by the CLI in its own process) that is
    not an inventory host is refused before anything is collected."""
    out = _flow_as_a_worker_runs_it(env, json.dumps({"target": target}))
    assert "STATE FAILED" in out.stdout, out.stdout + out.stderr
    assert "is not an inventory host" in out.stdout
