"""Access: bad requests to every door of cudamedic, counted. Forged, unsigned, stale, replayed
and tampered Slack requests; approval clicks by people who may not approve; Alertmanager
webhooks without the right token; SSH hosts with an unknown or changed host key; and the
default listen address of every HTTP endpoint. Figure: bad requests accepted (goal 0) — and
the good control requests sent alongside must all be accepted, so the count can fail.
"""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.alerts import Seen, make_server
from flows.slack.app import SlackApp
from runbooks.collect.inventory import load_inventory
from runbooks.collect.remote.ssh import SshRunner
from runbooks.core.errors import HostKeyRejected
from runbooks.core.settings import Settings
from tests.lab.lab import LabState
from tests.reliability.figures import record, size, zero
from tests.slackfake import FakeSlack, fake_slack
from tests.test_slack import SECRET, command, post, signed, slack_settings

SUITE = "access"


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    with fake_slack() as fake:
        fake.usergroups["S0APPROVE"] = ["U0BOSS", "U0ASKER"]
        yield fake


@pytest.fixture
def app(settings: Settings, slack: FakeSlack, tmp_path: Path) -> Iterator[str]:
    assert settings.inventory is not None
    s = slack_settings(settings, slack, state_dir=tmp_path / "state")
    with SlackApp(s, load_inventory(settings.inventory)).server("127.0.0.1", 0) as server:
        yield server.url


def _send(url: str, body: bytes, headers: dict[str, str]) -> int:
    """The HTTP status; 0 when the server closed the connection on us (a refusal too: e.g. 413
    for a body over the limit, sent before the client finished writing it)."""
    try:
        return post(url, body, headers)[0]
    except (OSError, urllib.error.URLError):
        return 0


def _bad_slack_request(rng: random.Random, body: bytes) -> tuple[str, bytes, dict[str, str]]:
    now = int(time.time())
    kind = rng.choice(
        [
            "unsigned",
            "no-signature",
            "no-timestamp",
            "random-signature",
            "wrong-secret",
            "stale",
            "future",
            "tampered",
            "bad-timestamp",
            "v1-scheme",
            "huge-body",
        ]
    )
    headers: dict[str, str] = {}
    if kind == "unsigned":
        pass
    elif kind == "no-signature":
        headers = {"X-Slack-Request-Timestamp": str(now)}
    elif kind == "no-timestamp":
        headers = {"X-Slack-Signature": signed(body)["X-Slack-Signature"]}
    elif kind == "random-signature":
        headers = {
            "X-Slack-Request-Timestamp": str(now),
            "X-Slack-Signature": "v0=" + "".join(rng.choice("0123456789abcdef") for _ in range(64)),
        }
    elif kind == "wrong-secret":
        headers = signed(body, secret=SECRET[:-1] + ("0" if SECRET[-1] != "0" else "1"))
    elif kind == "stale":
        headers = signed(body, ts=str(now - rng.randint(301, 86_400)))
    elif kind == "future":
        headers = signed(body, ts=str(now + rng.randint(301, 86_400)))
    elif kind == "tampered":
        headers = signed(body)
        body = body.replace(b"triage", b"triagf", 1) + b"&x=1"
    elif kind == "bad-timestamp":
        headers = signed(body)
        headers["X-Slack-Request-Timestamp"] = rng.choice(["", "abc", "1e10", "-1", " " * 3])
    elif kind == "v1-scheme":
        headers = signed(body)
        headers["X-Slack-Signature"] = headers["X-Slack-Signature"].replace("v0=", "v1=")
    else:
        body = body + b"&pad=" + b"A" * (1 << 20)
        headers = signed(body)
    return kind, body, headers


def test_forged_slack_requests_and_clicks_are_refused(
    prefect_api: str, app: str, slack: FakeSlack
) -> None:
    rng = random.Random(8)
    n = size(80, 2000)
    accepted: dict[str, int] = {}
    tried: dict[str, int] = {}
    good_ok = 0
    for i in range(n):
        body = command(f"triage gpu-healthy train-{i}", trigger=f"t{i}")
        if i % 10 == 0:  # a control: Slack's own request, which must be accepted (once)
            headers = signed(body)
            status, _ = post(f"{app}/slack/commands", body, headers)
            good_ok += status == 200
            replay_status, _ = post(f"{app}/slack/commands", body, headers)  # the same request
            tried["replayed"] = tried.get("replayed", 0) + 1
            accepted["replayed"] = accepted.get("replayed", 0) + (replay_status == 200)
            continue
        kind, bad_body, headers = _bad_slack_request(rng, body)
        path = rng.choice(["/slack/commands", "/slack/interactive"])
        status = _send(f"{app}{path}", bad_body, headers)
        tried[kind] = tried.get(kind, 0) + 1
        accepted[kind] = accepted.get(kind, 0) + (status == 200)
    controls = len(range(0, n, 10))
    bad = sum(accepted.values())
    record(SUITE, "Slack: forged/unsigned/stale/replayed/tampered requests", sum(tried.values()))
    record(SUITE, "Slack: kinds of bad request", len(tried))
    zero(SUITE, "Slack: bad requests accepted", bad)
    record(
        SUITE,
        "Slack: good control requests accepted",
        f"{good_ok}/{controls}",
        "all",
        good_ok == controls,
    )
    assert bad == 0, {k: v for k, v in accepted.items() if v}
    assert good_ok == controls
    # The controls started a response each (a deployment run is attempted); the bad ones none.
    starts = [c for c in slack.of("chat.postMessage") if "collecting evidence" in str(c["args"])]
    zero(SUITE, "Slack: responses started by bad requests", max(0, len(starts) - controls))
    assert len(starts) <= controls


def test_approval_clicks_by_people_who_may_not_approve_are_refused(
    prefect_api: str, app: str, slack: FakeSlack
) -> None:
    from prefect import flow, get_client

    @flow(name="cudamedic-access-test")
    def waiting(slack: dict[str, str]) -> None:  # never run: only its flow run record is used
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(
            waiting, parameters={"slack": {"channel": "C1", "ts": "1.1", "requester": "U0ASKER"}}
        )
        before = client.read_flow_run(run.id).state
    n = size(12, 200)
    rng = random.Random(3)
    users = ["U0ASKER"] + [f"U0NOBODY{i}" for i in range(5)]
    for i in range(n):
        user = rng.choice(users)
        value = json.dumps(
            {"run": str(run.id) if i % 4 else "00000000-0000-4000-8000-000000000000"}
        )
        payload = {
            "type": "block_actions",
            "user": {"id": user, "username": user.lower()},
            "channel": {"id": "C1"},
            "message": {"ts": "1.1", "blocks": []},
            "actions": [{"action_id": "cudamedic_approve", "value": value, "action_ts": f"{i}.0"}],
        }
        body = urllib.parse.urlencode({"payload": json.dumps(payload)}).encode()
        status, _ = post(f"{app}/slack/interactive", body, signed(body))
        assert status == 200
    deadline = time.monotonic() + 30
    while len(slack.of("chat.postEphemeral")) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    answers = [c["args"]["text"] for c in slack.of("chat.postEphemeral")]
    refused = [a for a in answers if re.search(r"not allowed|Four-eyes|Nothing was changed", a)]
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(run.id).state
    changed = state is None or before is None or state.type != before.type
    approved = len(answers) - len(refused) + int(changed)
    record(SUITE, "approval clicks by the requester or non-approvers", n)
    zero(SUITE, "approvals accepted from people who may not approve", approved)
    assert len(answers) == n, answers
    assert approved == 0, answers
    assert not slack.of("chat.update")


def test_alert_webhooks_without_the_token_are_refused(settings: Settings) -> None:
    assert settings.inventory is not None
    token = "s3cret-t0ken-for-the-receiver"
    server = make_server("127.0.0.1", 0, token, load_inventory(settings.inventory), Seen())
    url = server.start().url + "/alertmanager"
    rng = random.Random(5)
    body = json.dumps({"version": "4", "status": "firing", "alerts": []}).encode()
    n = size(40, 1000)
    accepted = 0
    try:
        for _ in range(n):
            bad = rng.choice(
                [
                    None,
                    "",
                    "Bearer",
                    f"Bearer {token[:-1]}",
                    f"bearer {token}x",
                    f"Basic {token}",
                    f"Bearer {token.upper()}",
                    f"Bearer  {token}",
                    token,
                    "Bearer " + "A" * 4096,
                ]
            )
            headers = {"Content-Type": "application/json"}
            if bad is not None:
                headers["Authorization"] = bad
            status, _ = post(url, body, headers)
            accepted += status < 300
        good, _ = post(url, body, {"Authorization": f"Bearer {token}"})
    finally:
        server.stop()
    record(SUITE, "alert receiver: requests without the right token", n)
    zero(SUITE, "alert receiver: bad requests accepted", accepted)
    assert accepted == 0 and good < 300


def test_unknown_and_changed_ssh_host_keys_are_rejected(
    lab: LabState, settings: Settings, tmp_path: Path
) -> None:
    assert settings.inventory is not None
    inventory = load_inventory(settings.inventory)
    lines = Path(lab.known_hosts).read_text().splitlines()
    empty = tmp_path / "empty"
    empty.write_text("")
    hosts = sorted(lab.hosts)
    n = size(4, 40)
    accepted = 0
    for i in range(n):
        name = hosts[i % len(hosts)]
        port = lab.hosts[name].port
        if i % 2:
            known = empty  # unknown host key
        else:  # changed: another lab host's key under this host's address
            other = next(ln for ln in lines if not ln.startswith(f"[127.0.0.1]:{port} "))
            forged = [ln for ln in lines if not ln.startswith(f"[127.0.0.1]:{port} ")]
            known = tmp_path / f"forged-{i}"
            known.write_text("\n".join([*forged, f"[127.0.0.1]:{port} {other.split(' ', 1)[1]}"]))
        try:
            SshRunner(
                inventory.get(name), settings.model_copy(update={"known_hosts": known})
            ).close()
            accepted += 1
        except HostKeyRejected:
            pass
    record(SUITE, "SSH: connections to hosts with an unknown or changed key", n)
    zero(SUITE, "SSH: bad host keys accepted", accepted)
    assert accepted == 0


def _listening(port: int) -> list[str]:
    out = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True, check=True).stdout
    return [ln.split()[3] for ln in out.splitlines() if ln.split()[3].endswith(f":{port}")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_http_endpoints_listen_on_loopback_by_default(
    lab: LabState, prefect_api: str, tmp_path: Path
) -> None:
    """`cudamedic slack`, `cudamedic alerts` and the embedded Prefect server, as a user starts
    them with no listen address: each binds 127.0.0.1 only."""
    from tests.conftest import PREFECT_TEST_PORT

    env = {
        "PATH": "/usr/bin:/bin",
        "CUDAMEDIC_CONFIG": lab.config,
        "PREFECT_API_URL": prefect_api,
        "CUDAMEDIC_SLACK_SIGNING_SECRET": SECRET,
        "CUDAMEDIC_SLACK_BOT_TOKEN": "xoxb-not-real",
        "CUDAMEDIC_ALERT_TOKEN": "not-a-real-token",
        "HOME": str(tmp_path),
    }
    wide: list[str] = []
    checked = {"Prefect server (embedded)": _listening(PREFECT_TEST_PORT)}
    for name, argv in {
        "Slack app": ["slack", "--port", str(_free_port())],
        "alert receiver": ["alerts", "--port", str(_free_port())],
    }.items():
        port = int(argv[-1])
        proc = subprocess.Popen(
            [sys.executable, "-m", "runbooks.cli", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not _listening(port) and time.monotonic() < deadline:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.2)
            checked[name] = _listening(port)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    for name, addresses in checked.items():
        assert addresses, name
        wide += [f"{name}: {a}" for a in addresses if not a.startswith("127.0.0.1:")]
    record(SUITE, "HTTP endpoints checked (Prefect, Slack app, alert receiver)", len(checked))
    zero(SUITE, "HTTP endpoints listening beyond loopback by default", len(wide))
    assert not wide, wide
