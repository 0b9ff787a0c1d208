"""The Slack app on slack_bolt (issue 18): Socket Mode against a local server that speaks Slack's
protocol, the memory of seen requests across a restart and between two replicas (kept in the
real Prefect server), dead letters for what Slack refuses for good, `/cudamedic why` and
`status`, approver lists paged and cached, and long texts split instead of cut. Slack's Web API
is the local fake (tests/slackfake.py), its Socket Mode server tests/slacksocket.py."""

from __future__ import annotations

import hashlib
import json
import statistics
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from flows.slack.app import SlackApp, SlackThread, dead, deliver, flush_outbox, waiting
from reports.slack import SECTION_MAX, approval_blocks, split_text
from runbooks.collect.inventory import Host, Inventory
from runbooks.core.settings import Settings
from tests.slackfake import FakeSlack, fake_slack
from tests.slacksocket import SocketSlack, socket_slack
from tests.test_deploy import _drop_deployments
from tests.test_slack import APP_TOKEN, SECRET, TOKEN, command, post, signed

INVENTORY = Inventory(
    hosts={
        "node07": Host(name="node07", address="10.0.0.7"),
        "node08": Host(name="node08", address="10.0.0.8"),
    }
)
PASTED = (
    "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible "
    "that dataloader's workers are out of shared memory. Please try to raise your shared "
    "memory limit."
)


@pytest.fixture
def prefect(prefect_api: str) -> str:
    """The tests' Prefect server without cudamedic's deployments (another test may have served
    them): responses started here cannot run, each ends with "could not start"."""
    _drop_deployments()
    return prefect_api


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    with fake_slack() as fake:
        yield fake


def app_settings(fake: FakeSlack, tmp_path: Path, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "slack_bot_token": SecretStr(TOKEN),
        "slack_signing_secret": SecretStr(SECRET),
        "slack_api_url": fake.base_url,
        "slack_approver_groups": ("S0APPROVE",),
        "slack_timeout": 3,
        "state_dir": tmp_path / "state",
        # the outbox and the dead letters are the fleet's, in the tests' Prefect: one per test
        "fleet": "t-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12],
    }
    return Settings(**{**base, **over})


@contextmanager
def http_app(settings: Settings) -> Iterator[str]:
    with SlackApp(settings, INVENTORY).server("127.0.0.1", 0) as server:
        yield server.url


@contextmanager
def socket_app(fake: FakeSlack, settings: Settings) -> Iterator[SocketSlack]:
    with socket_slack(fake) as sock:
        s = settings.model_copy(update={"slack_app_token": SecretStr(APP_TOKEN)})
        handler = SlackApp(s, INVENTORY).socket_mode()
        try:
            sock.wait_connected(1)
            yield sock
        finally:
            handler.close()


def starts(fake: FakeSlack) -> list[dict[str, Any]]:
    """Responses started: each posts its root message first."""
    return [c for c in fake.of("chat.postMessage") if "collecting evidence" in str(c["args"])]


def settled(fake: FakeSlack, n: int) -> None:
    """Until `n` responses have tried to start (no deployment is served here: each ends with
    "could not start"), so each acknowledgement is timed on an app at rest, as in use."""
    deadline = time.monotonic() + 30
    while len(fake.of("chat.postEphemeral")) < n:
        assert time.monotonic() < deadline, fake.of("chat.postEphemeral")
        time.sleep(0.05)


# -- Socket Mode ---------------------------------------------------------------------------------
def test_socket_mode_acknowledges_every_envelope_and_survives_a_refresh(
    prefect: str, slack: FakeSlack, tmp_path: Path
) -> None:
    """(With the request memory in the tests' Prefect server, as in production.)"""
    with socket_app(slack, app_settings(slack, tmp_path)) as sock:
        opened = slack.of("apps.connections.open")
        assert len(opened) == 1 and opened[0]["auth"] == f"Bearer {APP_TOKEN}"

        def slash(text: str) -> tuple[float, dict[str, Any]]:
            form = urllib.parse.parse_qs(command(text).decode())
            took, answer = sock.ack(
                sock.envelope("slash_commands", {k: v[0] for k, v in form.items()})
            )
            return took, answer or {}

        _, answer = slash("triage nosuchhost")
        assert "not a host of the inventory" in answer["text"]
        assert answer["response_type"] == "ephemeral"
        _, answer = slash("")
        assert answer["text"].startswith("usage: /cudamedic triage HOST")
        click = {
            "type": "block_actions",
            "user": {"id": "U0NOBODY"},
            "channel": {"id": "C1"},
            "actions": [{"action_id": "elsewhere", "value": "{}"}],
        }
        assert sock.ack(sock.envelope("interactive", click))[1] is None  # acknowledged, no body
        shortcut = {
            "type": "message_action",
            "callback_id": "cudamedic_triage",
            "trigger_id": "t.1",
            "user": {"id": "U1"},
            "channel": {"id": "C1"},
            "message": {"text": "CUDA error", "ts": "1.2"},
        }
        sock.ack(sock.envelope("interactive", shortcut))
        assert slack.wait_for(lambda c: c["method"] == "views.open", timeout=10)

        sock.refresh()  # Slack's disconnect: a new URL, a new connection, nothing lost
        print(f"\nSocket Mode refresh: moved to a new connection in {sock.wait_connected(2):.2f} s")
        assert len(slack.of("apps.connections.open")) == 2
        acks = []
        for i in range(20):  # each a new response: remembered in Prefect, then started
            took, answer = slash(f"triage node07 train-{i}")
            assert answer["text"].startswith("Starting a response for node07/")
            acks.append(took)
            settled(slack, i + 1)
        print(
            f"\nSocket Mode acknowledgement: p50 {statistics.median(acks) * 1000:.1f} ms, "
            f"max {max(acks) * 1000:.1f} ms (n={len(acks)}): {[round(a * 1000) for a in acks]}"
        )
        assert acks[0] < 3.0 and max(acks[1:]) < 1.0  # the first: Prefect's first Variable


def test_http_mode_acknowledgement_time(prefect: str, slack: FakeSlack, tmp_path: Path) -> None:
    with http_app(app_settings(slack, tmp_path)) as url:
        acks = []
        for i in range(20):  # each a new response: remembered in Prefect, then started
            body = command(f"triage node07 train-{i}")
            t0 = time.monotonic()
            code, answer = post(url + "/slack/commands", body, signed(body))
            acks.append(time.monotonic() - t0)
            assert code == 200 and answer["text"].startswith("Starting a response for node07/")
            settled(slack, i + 1)
    print(
        f"\nHTTP mode acknowledgement: p50 {statistics.median(acks) * 1000:.1f} ms, "
        f"max {max(acks) * 1000:.1f} ms (n={len(acks)}): {[round(a * 1000) for a in acks]}"
    )
    assert acks[0] < 3.0 and max(acks[1:]) < 1.0  # the first: Prefect's first Variable


# -- the memory of seen requests -----------------------------------------------------------------
def test_a_request_replayed_after_a_restart_or_to_another_replica_starts_nothing(
    prefect: str, slack: FakeSlack, tmp_path: Path
) -> None:
    s = app_settings(slack, tmp_path)
    body = command("triage node07", trigger="t.restart")
    headers = signed(body)
    with http_app(s) as url:
        code, answer = post(url + "/slack/commands", body, headers)
        assert code == 200 and answer["text"].startswith("Starting a response for node07")
        slack.wait_for(lambda c: "collecting evidence" in str(c["args"]), timeout=10)
    with http_app(s) as url:  # restarted: a new process memory, the same Prefect server
        assert post(url + "/slack/commands", body, headers) == (401, {"error": "replayed request"})
        retry = command("triage node07", trigger="t.restart")  # Slack's retry: a new signature
        time.sleep(1.1)  # (a new timestamp)
        code, answer = post(url + "/slack/commands", retry, signed(retry))
        assert code == 200 and answer["text"] == "already started", answer
    # two replicas at once: the same signed request to both starts one response
    with http_app(s) as one, http_app(s) as two:
        body = command("triage node08", trigger="t.replicas")
        headers = signed(body)
        answers: list[tuple[int, Any]] = []
        threads = [
            threading.Thread(
                target=lambda u=u: answers.append(post(u + "/slack/commands", body, headers))
            )
            for u in (one, two)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(code for code, _ in answers) == [200, 401], answers
    time.sleep(1)
    assert len(starts(slack)) == 2  # node07 once, node08 once


def test_a_socket_mode_retry_after_a_restart_starts_nothing(
    prefect: str, slack: FakeSlack, tmp_path: Path
) -> None:
    s = app_settings(slack, tmp_path)
    form = {k: v[0] for k, v in urllib.parse.parse_qs(command("triage node07").decode()).items()}
    with socket_app(slack, s) as sock:
        answer = sock.ack(sock.envelope("slash_commands", form))[1] or {}
        assert answer["text"].startswith("Starting a response for node07")
    with socket_app(slack, s) as sock:  # Slack retries the envelope it saw no answer to
        answer = sock.ack(sock.envelope("slash_commands", form, retry=1))[1] or {}
        assert answer["text"] == "already started"
    time.sleep(1)
    assert len(starts(slack)) == 1


# -- delivery that never jams --------------------------------------------------------------------
@pytest.mark.parametrize(
    "error", ["channel_not_found", "not_in_channel", "is_archived", "msg_too_long", "invalid_auth"]
)
def test_a_message_refused_for_good_goes_to_the_dead_letters_and_blocks_nothing(
    prefect_api: str, slack: FakeSlack, tmp_path: Path, error: str
) -> None:
    s = app_settings(slack, tmp_path)
    slack.refused_channels["C0GONE"] = error
    assert deliver(s, "chat.postMessage", channel="C0GONE", text="refused") is None
    assert deliver(s, "chat.postMessage", channel="C1", text="next") is not None  # not held back
    assert waiting(s) == []
    letters = dead(s)
    assert [(d["args"]["text"], d["reason"], d["kept"]) for d in letters] == [
        ("refused", error, "prefect")
    ]

    # kept during an outage, then refused for good: the messages behind it still go out
    slack.down = True
    for channel, text in (("C0GONE", "a"), ("C1", "b"), ("C1", "c")):
        assert deliver(s, "chat.postMessage", channel=channel, text=text) is None
    assert [w["args"]["text"] for w in waiting(s)] == ["a", "b", "c"]
    slack.down = False
    assert flush_outbox(s) == 0
    assert [c["args"]["text"] for c in slack.delivered("chat.postMessage")] == ["next", "b", "c"]
    assert [d["args"]["text"] for d in dead(s)] == ["a", "refused"]  # newest first
    assert waiting(s) == []
    assert not list(s.state_path.glob("*.jsonl"))  # Prefect answered: nothing kept locally


def test_only_passing_failures_wait(prefect_api: str, slack: FakeSlack, tmp_path: Path) -> None:
    s = app_settings(slack, tmp_path)
    slack.fail("chat.postMessage", 503, times=10)
    assert deliver(s, "chat.postMessage", channel="C1", text="kept") is None
    assert [(w["args"]["text"], w["kept"]) for w in waiting(s)] == [("kept", "prefect")]
    assert dead(s) == []
    slack.failures.clear()
    slack.refuse("chat.postMessage", "ratelimited")  # Slack's own "later", said with HTTP 200
    assert flush_outbox(s) == 1
    assert flush_outbox(s) == 0 and dead(s) == [] and waiting(s) == []
    assert [c["args"]["text"] for c in slack.delivered("chat.postMessage")] == ["kept"]


# -- why, status ---------------------------------------------------------------------------------
def test_why_answers_with_the_diagnosis_and_starts_nothing(
    slack: FakeSlack, tmp_path: Path
) -> None:
    with http_app(app_settings(slack, tmp_path)) as url:
        body = command("why " + PASTED)
        code, answer = post(url + "/slack/commands", body, signed(body))
        assert code == 200 and answer["response_type"] == "ephemeral"
        told = slack.wait_for(lambda c: c["method"] == "chat.postEphemeral", timeout=30)
        text = json.dumps(told["args"]["blocks"])
        assert told["args"]["user"] == "U0ASKER" and "shm-too-small" in text
        for part in ("confidence 0.", "Check next", "Fix (advice", "shm-size", "Similar known"):
            assert part in text, part
        # the message shortcut on any message: the answer goes to that message's thread
        shortcut = {
            "type": "message_action",
            "callback_id": "cudamedic_why",
            "trigger_id": "t.why",
            "user": {"id": "U0ASKER"},
            "channel": {"id": "C0INCIDENT"},
            "message": {"text": PASTED, "ts": "1764700000.000777"},
        }
        form = urllib.parse.urlencode({"payload": json.dumps(shortcut)}).encode()
        assert post(url + "/slack/interactive", form, signed(form))[0] == 200
        said = slack.wait_for(
            lambda c: (
                c["method"] == "chat.postMessage"
                and c["args"].get("thread_ts") == "1764700000.000777"
            ),
            timeout=30,
        )
        assert "shm-too-small" in json.dumps(said["args"]["blocks"])
        body = command("why")
        assert (
            "usage: /cudamedic why" in post(url + "/slack/commands", body, signed(body))[1]["text"]
        )
    assert starts(slack) == [] and not slack.of("views.open")


def test_status_lists_running_and_waiting_responses(
    prefect_api: str, slack: FakeSlack, tmp_path: Path
) -> None:
    from prefect import flow, get_client
    from prefect.states import Completed, Paused, Running

    @flow(name="incident-response")
    def stand_in(target: str, container: str | None = None) -> None:  # never run
        pass

    with get_client(sync_client=True) as client:
        runs = {}
        for target, state in (("node07", Paused()), ("node08", Running()), ("gone", Completed())):
            run = client.create_flow_run(
                stand_in, parameters={"target": target, "container": "train"}
            )
            client.set_flow_run_state(run.id, state, force=True)
            runs[target] = run
    with socket_app(slack, app_settings(slack, tmp_path)) as sock:
        form = {k: v[0] for k, v in urllib.parse.parse_qs(command("status").decode()).items()}
        sock.ack(sock.envelope("slash_commands", form))
        told = slack.wait_for(lambda c: c["method"] == "chat.postEphemeral", timeout=30)
    text = json.dumps(told["args"]["blocks"])
    assert runs["node07"].name in text and "node07/train" in text and "Paused" in text
    assert runs["node08"].name in text and "Running" in text
    assert runs["gone"].name not in text
    assert str(runs["node07"].id) in text  # the link to the Prefect run


# -- approvers -----------------------------------------------------------------------------------
def test_approvers_are_paged_cached_and_slack_errors_told_as_they_are(
    slack: FakeSlack, tmp_path: Path
) -> None:
    slack.channel_members["C0BIG"] = [f"U{i:05d}" for i in range(250)]
    s = app_settings(slack, tmp_path, slack_approver_groups=(), slack_approver_channels=("C0BIG",))
    s = s.model_copy(update={"slack_four_eyes": False})
    app = SlackApp(s, INVENTORY)
    assert app.refusal("00000000-0000-4000-8000-000000000000", "U00240") is None  # page 3
    assert "not allowed" in str(app.refusal("00000000-0000-4000-8000-000000000000", "U99999"))
    assert len(slack.of("conversations.members")) == 3  # 250 members, 100 a page; then cached

    s = s.model_copy(update={"slack_approver_groups": ("S0APPROVE",)})
    slack.refuse("usergroups.users.list", "missing_scope")
    why = str(SlackApp(s, INVENTORY).refusal("00000000-0000-4000-8000-000000000000", "U1"))
    assert "missing_scope" in why and "cannot be found" not in why


# -- long texts ----------------------------------------------------------------------------------
def test_long_texts_are_split_across_sections_and_messages_not_cut(
    slack: FakeSlack, tmp_path: Path
) -> None:
    lines = [f"line {i:05d} " + "x" * 90 for i in range(400)]  # about 40,000 characters
    pieces = split_text("\n".join(lines))
    assert all(len(p) <= SECTION_MAX for p in pieces) and "\n".join(pieces) == "\n".join(lines)
    assert split_text("y" * 7000) == ["y" * 3000, "y" * 3000, "y" * 1000]
    blocks = approval_blocks(
        run_id="r",
        requester="U1",
        host="h",
        container="c",
        incident="shm-too-small",
        confidence=0.9,
        summary="s",
        diff=tuple(f"+ --flag-{i}" for i in range(15000)),
        evidence=["e" * 10000],
    )
    text = "".join(b["text"]["text"] for b in blocks if b["type"] == "section")
    assert text.count("e") >= 10000 and "--flag-14999" in text and "truncated" not in text
    assert len(blocks) > 50  # more than one message holds
    s = app_settings(slack, tmp_path)
    SlackThread(s, {"channel": "C1", "ts": "1.1"}).say("Fix waiting", blocks)
    posted = slack.of("chat.postMessage")
    assert len(posted) == -(-len(blocks) // 50)
    assert all(len(c["args"]["blocks"]) <= 50 for c in posted)


def test_both_manifests_name_what_the_app_handles() -> None:
    import yaml

    deploy = Path(__file__).parents[1] / "deploy"
    http = yaml.safe_load((deploy / "slack-app-manifest.yaml").read_text())
    sock = yaml.safe_load((deploy / "slack-app-manifest-socket.yaml").read_text())
    for manifest in (http, sock):
        ids = {s["callback_id"] for s in manifest["features"]["shortcuts"]}
        assert ids == {"cudamedic_triage", "cudamedic_why"}
        assert manifest["features"]["slash_commands"][0]["command"] == "/cudamedic"
    assert sock["settings"]["socket_mode_enabled"] is True and "https://" not in json.dumps(sock)
    assert http["settings"]["socket_mode_enabled"] is False
    assert http["settings"]["interactivity"]["request_url"].endswith("/slack/interactive")


def test_slack_bolt_internals_we_use_are_as_checked() -> None:
    """SlackApp.socket_mode overrides SocketModeHandler.handle with slack_bolt's own helpers;
    pin them so an upgrade that changes them fails here."""
    import inspect

    from slack_bolt.adapter.socket_mode import SocketModeHandler
    from slack_bolt.adapter.socket_mode.internals import run_bolt_app, send_response
    from slack_bolt.version import __version__

    from flows.slack.app import BOLT_CHECKED

    assert tuple(int(p) for p in __version__.split(".")[:2]) == BOLT_CHECKED
    assert list(inspect.signature(run_bolt_app).parameters) == ["app", "req"]
    assert list(inspect.signature(send_response).parameters) == [
        "client",
        "req",
        "bolt_resp",
        "start_time",
    ]
    assert list(inspect.signature(SocketModeHandler.handle).parameters) == ["self", "client", "req"]
