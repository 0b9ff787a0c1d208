"""Slack: the app's request verification and input checks, robust delivery, and the whole path
end to end on the lab — a signed slash command starts the served incident-response deployment,
the approval appears in the thread, a signed button click approves, the container is fixed on
the real Docker engine, and the summary and report file are posted. Slack's Web API is the
local fake in tests/slackfake.py (reached through slack-sdk's base_url)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from flows.slack.app import SlackApp, deliver, flush_outbox, parse_command, waiting
from runbooks.collect.inventory import load_inventory
from runbooks.core.errors import InputError
from runbooks.core.settings import Settings
from tests.lab.lab import LabState
from tests.slackfake import FakeSlack, fake_slack
from tests.slacksocket import SocketSlack, socket_slack
from tests.test_deploy import BIN, _drop_deployments, background, env, run_info  # noqa: F401
from tests.test_fix import fix_settings, volume, volume_text  # noqa: F401
from tests.test_flows import shm_container

SECRET = "8f742231b10e8888abcd99yyyzzz85a5"  # Slack's documentation example signing secret
TOKEN = "xoxb-test-token-not-real"
APP_TOKEN = "xapp-1-A0CUDAMEDIC-test-token-not-real"


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    with fake_slack() as fake:
        yield fake


def slack_settings(settings: Settings, fake: FakeSlack, **over: Any) -> Settings:
    return settings.model_copy(
        update={
            "slack_bot_token": SecretStr(TOKEN),
            "slack_signing_secret": SecretStr(SECRET),
            "slack_api_url": fake.base_url,
            "slack_approver_groups": ("S0APPROVE",),
            **over,
        }
    )


def signed(body: bytes, ts: str | None = None, secret: str = SECRET) -> dict[str, str]:
    ts = ts or str(int(time.time()))
    base = b"v0:" + ts.encode() + b":" + body
    sig = "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()
    return {"X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig}


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw and raw != b"null" else {}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def command(text: str, user: str = "U0ASKER", trigger: str = "") -> bytes:
    return urllib.parse.urlencode(
        {
            "command": "/cudamedic",
            "text": text,
            "user_id": user,
            "user_name": "asker",
            "channel_id": "C0INCIDENT",
            "trigger_id": trigger or f"t{time.monotonic_ns()}",
        }
    ).encode()


@pytest.fixture
def app_url(settings: Settings, slack: FakeSlack) -> Iterator[str]:
    assert settings.inventory is not None
    app = SlackApp(slack_settings(settings, slack), load_inventory(settings.inventory))
    with app.server("127.0.0.1", 0) as server:
        yield server.url


def test_unsigned_bad_stale_and_replayed_requests_are_refused(
    app_url: str, slack: FakeSlack
) -> None:
    body = command("triage nosuchhost")
    url = app_url + "/slack/commands"
    assert post(url, body, {})[0] == 401
    assert post(url, body, signed(body, secret="wrong-secret"))[0] == 401
    stale = str(int(time.time()) - 6 * 60)
    assert post(url, body, signed(body, ts=stale))[0] == 401
    headers = signed(body)
    code, answer = post(url, body, headers)
    assert code == 200 and "is not a host of the inventory" in answer["text"]
    assert post(url, body, headers) == (401, {"error": "replayed request"})
    assert slack.of("chat.postMessage") == []  # nothing was started


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "usage: /cudamedic triage HOST"),
        ("reboot gpu-healthy", "usage"),
        ("triage gpu-healthy 'x; touch /tmp/pwned'", "usage"),
        ("triage gpu-healthy x;touch", "container"),
        ("triage evil.example.com", "not a host of the inventory"),
    ],
)
def test_bad_commands_get_a_clear_ephemeral_answer(
    app_url: str, slack: FakeSlack, text: str, needle: str
) -> None:
    body = command(text)
    code, answer = post(app_url + "/slack/commands", body, signed(body))
    assert code == 200 and answer["response_type"] == "ephemeral"
    assert needle in answer["text"]
    assert slack.of("chat.postMessage") == []


def test_parse_command(settings: Settings) -> None:
    assert settings.inventory is not None
    inv = load_inventory(settings.inventory)
    assert parse_command("triage gpu-healthy train -- Bus error", inv) == (
        "gpu-healthy",
        "train",
        "Bus error",
    )
    with pytest.raises(InputError):
        parse_command("triage gpu-healthy a b", inv)


def test_delivery_retries_rate_limits_and_keeps_what_fails(
    prefect_api: str, settings: Settings, slack: FakeSlack
) -> None:
    s = slack_settings(settings, slack)
    slack.fail("chat.postMessage", 429, times=1, retry_after=1)
    assert deliver(s, "chat.postMessage", channel="C1", text="one") is not None
    assert len(slack.of("chat.postMessage")) == 2  # the 429, then the retry

    slack.fail("chat.postMessage", 503, times=10)  # an outage outlasting the retries
    assert deliver(s, "chat.postMessage", channel="C1", text="two") is None
    assert [(w["args"]["text"], w["kept"]) for w in waiting(s)] == [("two", "prefect")]
    slack.failures.clear()  # Slack is back: the next delivery sends the kept one first
    deliver(s, "chat.postMessage", channel="C1", text="three")
    texts = [c["args"]["text"] for c in slack.of("chat.postMessage")]
    assert texts[-2:] == ["two", "three"]
    assert flush_outbox(s) == 0 and waiting(s) == []
    assert all(c["auth"] == f"Bearer {TOKEN}" for c in slack.calls)


class Transport:
    """How Slack reaches the app: signed HTTP POSTs, or envelopes over Socket Mode."""

    def __init__(self, url: str = "", sock: SocketSlack | None = None) -> None:
        self.url, self.sock = url, sock

    def command(self, body: bytes) -> tuple[float, dict[str, Any]]:
        """(seconds to the acknowledgement, its answer)."""
        if self.sock is None:
            started = time.monotonic()
            code, answer = post(self.url + "/slack/commands", body, signed(body))
            assert code == 200, answer
            return time.monotonic() - started, answer
        form = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode()).items()}
        took, answer = self.sock.ack(self.sock.envelope("slash_commands", form))
        return took, answer or {}

    def interactive(self, payload: dict[str, Any]) -> dict[str, Any]:
        if self.sock is None:
            form = urllib.parse.urlencode({"payload": json.dumps(payload)}).encode()
            code, answer = post(self.url + "/slack/interactive", form, signed(form))
            assert code == 200, answer
            return answer
        return self.sock.ack(self.sock.envelope("interactive", payload))[1] or {}


@pytest.mark.parametrize("mode", ["http", "socket"])
def test_slash_command_to_fixed_container_end_to_end(
    mode: str,
    env: dict[str, str],  # noqa: F811
    background: Any,  # noqa: F811
    slack: FakeSlack,
    make_container: Any,
    container_name: str,
    gpu_engine: Any,
    volume: str,  # noqa: F811
    tmp_path: Path,
    lab: LabState,
) -> None:
    """The same story in both modes: command -> response -> approval click -> fix verified on
    the real engine -> report in the thread. Socket Mode also reconnects mid-response (Slack's
    `disconnect` refresh) and goes on on the new connection."""
    shm_container(make_container, container_name, volume)
    data = volume_text(gpu_engine, volume)
    slack.usergroups["S0APPROVE"] = ["U0APPROVER"]
    env = {
        **env,
        "CUDAMEDIC_SWEEP_SCHEDULE": "0 0 1 1 *",
        "CUDAMEDIC_SLACK_BOT_TOKEN": TOKEN,
        "CUDAMEDIC_SLACK_SIGNING_SECRET": SECRET,
        "CUDAMEDIC_SLACK_API_URL": slack.base_url,
        "CUDAMEDIC_SLACK_APPROVER_GROUPS": '["S0APPROVE"]',
    }
    with contextlib.ExitStack() as stack:
        sock = None
        if mode == "socket":
            sock = stack.enter_context(socket_slack(slack))
            env["CUDAMEDIC_SLACK_APP_TOKEN"] = APP_TOKEN
            del env["CUDAMEDIC_SLACK_SIGNING_SECRET"]  # Socket Mode needs no signing secret
        _drop_deployments()
        serve_log, app_log = tmp_path / "serve.log", tmp_path / "slack.log"
        background([str(BIN / "cudamedic"), "serve"], env, serve_log)
        background([str(BIN / "cudamedic"), "slack", "--port", "0"], env, app_log)
        deadline = time.monotonic() + 90
        while not ("being served" in serve_log.read_text() and "Slack app" in app_log.read_text()):
            assert time.monotonic() < deadline, serve_log.read_text() + app_log.read_text()
            time.sleep(0.5)
        if sock is None:
            base = re.search(r"Slack app: (http://\S+)/slack/commands", app_log.read_text())
            assert base
            slack_side = Transport(url=base.group(1))
        else:
            sock.wait_connected(1)
            assert "Socket Mode" in app_log.read_text()
            slack_side = Transport(sock=sock)
        _approval_story(slack, slack_side, sock, gpu_engine, container_name, volume, data)
        _, answer = slack_side.command(command("sweep a100"))  # one lab host has the tag
        assert answer["text"].startswith("Starting a fleet sweep")
        report = slack.wait_for(
            lambda c: c["method"] == "chat.postMessage" and "gpu-slow-nccl" in str(c["args"]),
            timeout=120,
        )
        assert "thread_ts" in report["args"]  # in the thread of "Fleet sweep ... asked by"
        assert "gpu-healthy" not in json.dumps(report["args"])  # only the tagged host
        logs = serve_log.read_text() + app_log.read_text()
        assert TOKEN not in logs and SECRET not in logs and APP_TOKEN not in logs
        if sock is not None:  # the app token went only to apps.connections.open
            opened = slack.of("apps.connections.open")
            assert len(opened) >= 2 and all(c["auth"] == f"Bearer {APP_TOKEN}" for c in opened)


def _approval_story(
    slack: FakeSlack,
    slack_side: Transport,
    sock: SocketSlack | None,
    gpu_engine: Any,
    container_name: str,
    volume: str,  # noqa: F811
    data: str,
) -> None:
    body = command(f"triage gpu-healthy {container_name} -- DataLoader worker died: Bus error")
    took, answer = slack_side.command(body)
    print(f"\nSlack ({'Socket Mode' if sock else 'HTTP'}): command acknowledged in {took:.3f} s")
    assert took < 3.0  # Slack's acknowledgement limit
    assert answer["text"].startswith("Starting a response for gpu-healthy/")

    root = slack.wait_for(
        lambda c: c["method"] == "chat.postMessage" and "thread_ts" not in c["args"]
    )
    root_ts = root["response"]["ts"]
    assert "asked by <@U0ASKER>" in root["args"]["text"]
    if sock is not None:  # Slack refreshes the connection while the response runs
        sock.refresh()
        sock.wait_connected(2)
    slack.wait_for(  # progress in the thread
        lambda c: (
            c["method"] == "chat.postMessage"
            and c["args"].get("thread_ts") == root_ts
            and "diagnosed" in c["args"]["text"]
        )
    )
    approval = slack.wait_for(
        lambda c: (
            c["method"] == "chat.postMessage"
            and "cudamedic_approve" in json.dumps(c["args"].get("blocks") or "")
        ),
        timeout=120,
    )
    blocks = approval["args"]["blocks"]
    blocks = json.loads(blocks) if isinstance(blocks, str) else blocks
    assert "shm-too-small" in json.dumps(blocks) and "+ --shm-size 8g" in json.dumps(blocks)
    button = next(b for b in blocks if b["type"] == "actions")["elements"][0]
    run_id = json.loads(button["value"])["run"]
    assert approval["args"]["thread_ts"] == root_ts

    def click(user: str, action: str = "cudamedic_approve") -> None:
        payload = {
            "type": "block_actions",
            "user": {"id": user, "username": user.lower()},
            "channel": {"id": "C0INCIDENT"},
            "message": {"ts": "1764700000.000009", "blocks": blocks},
            "actions": [
                {"action_id": action, "value": button["value"], "action_ts": str(time.time())}
            ],
        }
        slack_side.interactive(payload)

    click("U0STRANGER")
    refusal = slack.wait_for(lambda c: c["method"] == "chat.postEphemeral")
    assert "not allowed to approve" in refusal["args"]["text"]
    click("U0ASKER")  # four eyes: the requester may not approve
    slack.wait_for(
        lambda c: c["method"] == "chat.postEphemeral" and "Four-eyes" in c["args"]["text"]
    )
    assert gpu_engine.containers.get(container_name).attrs["HostConfig"]["ShmSize"] == 64 << 20
    click("U0APPROVER")
    slack.wait_for(lambda c: c["method"] == "chat.update" and "approve by" in c["args"]["text"])
    done = slack.wait_for(lambda c: c["method"] == "files.completeUploadExternal", timeout=120)
    assert done["args"]["thread_ts"] == root_ts
    summary = slack.wait_for(
        lambda c: c["method"] == "chat.postMessage" and "Post-mortem" in c["args"]["text"]
    )
    assert "fixed" in json.dumps(summary["args"]["blocks"])
    report = b"".join(slack.uploads.values()).decode()
    # in Slack's own markup: no Markdown headings or backslash escapes shown raw (issue 26)
    assert "*Post-mortem: shm-too-small" in report and "Approval: approve by U0APPROVER" in report
    assert "\n#" not in report and "\\" not in report, report
    new = gpu_engine.containers.get(container_name)
    assert new.attrs["HostConfig"]["ShmSize"] == 8 << 30 and new.status == "running"
    assert volume_text(gpu_engine, volume) == data
    state, _ = run_info(run_id)
    assert state == "Fixed"  # a named Completed state
    click("U0APPROVER")  # a second click changes nothing
    slack.wait_for(
        lambda c: c["method"] == "chat.postEphemeral" and "Nothing was changed" in c["args"]["text"]
    )
    assert TOKEN not in report


def test_messages_are_inert_and_cut_to_slack_limits() -> None:
    from reports.slack import SECTION_MAX, approval_blocks

    blocks = approval_blocks(
        run_id="r",
        requester="U1",
        host="h",
        container="c",
        incident="shm-too-small",
        confidence=0.9,
        summary="<!channel> see <https://evil.example|here>",
        diff=("- --shm-size 64m", "+ --shm-size 8g"),
        evidence=["x" * 10000, "```"],
    )
    text = json.dumps(blocks)
    assert "<!channel>" not in text and "&lt;!channel&gt;" in text
    assert all(len(b["text"]["text"]) <= SECTION_MAX for b in blocks if b["type"] == "section")


def test_sweep_news_goes_to_the_channel_and_quiet_sweeps_stay_quiet(
    env: dict[str, str],  # noqa: F811
    slack: FakeSlack,
) -> None:
    import subprocess

    env = {
        **env,
        "CUDAMEDIC_SLACK_BOT_TOKEN": TOKEN,
        "CUDAMEDIC_SLACK_API_URL": slack.base_url,
        "CUDAMEDIC_SLACK_CHANNEL": "C0FLEET",
    }
    sweep = [str(BIN / "cudamedic"), "sweep", "--host", "gpu-nodriver"]
    first = subprocess.run(sweep, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    posted = slack.of("chat.postMessage")
    assert len(posted) == 1 and posted[0]["args"]["channel"] == "C0FLEET"
    assert "driver-not-loaded" in json.dumps(posted[0]["args"]["blocks"])
    second = subprocess.run(sweep, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "nothing new" in second.stdout
    assert len(slack.of("chat.postMessage")) == 1
