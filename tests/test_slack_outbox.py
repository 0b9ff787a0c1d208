"""The Slack outbox is the fleet's, in Prefect (issue 17): a message one worker could not send is
sent by another that shares nothing with it but the Prefect API (its own STATE_DIR); when Prefect
cannot be reached a message is kept on the worker's disk and moved into Prefect, in its place in
the order, once Prefect answers again; a Prefect that hangs costs one timeout, not one per
message. Slack's Web API is the local fake (tests/slackfake.py), Prefect the tests' real server."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from flows.slack.delivery import dead, deliver, waiting
from flows.slack.outbox import PrefectUnavailable, local_outbox, read_local
from runbooks.core.settings import Settings
from tests.slackfake import FakeSlack, fake_slack
from tests.test_slack import TOKEN

README = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")


@pytest.fixture
def slack() -> Iterator[FakeSlack]:
    with fake_slack() as fake:
        yield fake


def worker(fake: FakeSlack, tmp_path: Path, name: str) -> Settings:
    """One worker of the test's fleet: its own STATE_DIR, the fleet's name shared."""
    return Settings(
        slack_bot_token=SecretStr(TOKEN),
        slack_api_url=fake.base_url,
        slack_timeout=2,
        state_dir=tmp_path / name / "state",
        fleet="t-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12],
    )


def texts(fake: FakeSlack) -> list[str]:
    return [str(c["args"]["text"]) for c in fake.delivered("chat.postMessage")]


def test_a_message_kept_by_a_worker_that_died_is_sent_by_another(
    prefect_api: str, slack: FakeSlack, tmp_path: Path
) -> None:
    a, b = worker(slack, tmp_path, "a"), worker(slack, tmp_path, "b")
    slack.down = True
    deliver(a, "chat.postMessage", channel="C1", text="Post-mortem: shm-too-small on node07")
    # a post-mortem is larger than a Prefect Variable holds (5,000 characters)
    assert len(README) > 5000
    deliver(a, "files_upload_v2", channel="C1", content=README, filename="pm.md", title="PM")
    kept = waiting(b)
    assert [(w["method"], w["kept"]) for w in kept] == [
        ("chat.postMessage", "prefect"),
        ("files_upload_v2", "prefect"),
    ]
    assert kept[1]["args"]["content"] == README
    assert not list(a.state_path.glob("*.jsonl"))  # nothing of it on worker A's disk
    slack.down = False  # worker A is gone; worker B's next delivery sends A's first
    assert deliver(b, "chat.postMessage", channel="C1", text="next") is not None
    assert texts(slack) == ["Post-mortem: shm-too-small on node07", "next"]
    assert [u.decode() for u in slack.uploads.values()] == [README]
    assert waiting(a) == waiting(b) == [] and dead(b) == []


def test_prefect_away_keeps_messages_locally_then_moves_them_in_order(
    prefect_api: str, slack: FakeSlack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = worker(slack, tmp_path, "a"), worker(slack, tmp_path, "b")
    slack.down = True
    deliver(a, "chat.postMessage", channel="C1", text="m1")  # Prefect answers: kept there
    with socket.socket() as closed:  # a port nothing listens on: Prefect is down
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{closed.getsockname()[1]}/api")
        deliver(a, "chat.postMessage", channel="C1", text="m2")
        deliver(a, "chat.postMessage", channel="C1", text="m3")
        with pytest.raises(PrefectUnavailable):
            waiting(a)
    assert [x["args"]["text"] for x in read_local(local_outbox(a))] == ["m2", "m3"]
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)  # Prefect is back, Slack still down
    assert [(w["args"]["text"], w["kept"]) for w in waiting(a)] == [
        ("m1", "prefect"),
        ("m2", "local"),
        ("m3", "local"),
    ]
    deliver(b, "chat.postMessage", channel="C1", text="m4")  # in Prefect before m2 and m3 are
    deliver(a, "chat.postMessage", channel="C1", text="m5")  # moves m2, m3 in first
    assert not local_outbox(a).exists()
    assert [(w["args"]["text"], w["kept"]) for w in waiting(b)] == [
        (f"m{i}", "prefect") for i in range(1, 6)
    ]
    slack.down = False
    deliver(b, "chat.postMessage", channel="C1", text="m6")  # another worker sends them all
    assert texts(slack) == [f"m{i}" for i in range(1, 7)]  # in the order they were said
    assert waiting(a) == []


def test_a_hanging_prefect_costs_one_timeout_not_one_per_message(
    prefect_api: str, slack: FakeSlack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = worker(slack, tmp_path, "a")
    with socket.socket() as hung:  # accepts connections (the kernel's backlog), never answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{hung.getsockname()[1]}/api")
        start = time.monotonic()
        opened = deliver(a, "views.open", trigger_id="1.2.3", view={"type": "modal"})
        took_modal = time.monotonic() - start
        answers: list[Any] = []
        for i in range(5):
            answers.append(deliver(a, "chat.postMessage", channel="C1", text=f"h{i}"))
        took = time.monotonic() - start
    assert opened == {"ok": True} and took_modal < 1.0  # a modal never waits on Prefect
    assert all(answers) and texts(slack) == [f"h{i}" for i in range(5)]
    assert took < 2.0 + 3.0, took  # one 2 s timeout, then this process stops asking for a while


def _plant(settings: Settings, data: dict[str, Any]) -> None:
    """An artifact under the outbox's key, written by anyone who can write to the Prefect API."""
    from flows.slack.outbox import outbox_key
    from runbooks.core.prefect_api import call

    body = {"key": outbox_key(settings), "type": "cudamedic-outbox", "data": data}
    call("POST", "/artifacts/", body, timeout=5.0)


def test_a_message_planted_in_the_outbox_is_never_sent_issue27(
    prefect_api: str, slack: FakeSlack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 27 (1): an item under the outbox's key uploaded a private key of the flushing
    machine (`file:`) and posted a fake approval. Only signed items of the methods and argument
    keys cudamedic sends go out; the rest go to the dead letters with a warning."""
    from flows.slack.outbox import sign

    a = worker(slack, tmp_path, "a")
    key_file = tmp_path / "id_ed25519"
    key_file.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    now = time.time() - 60
    _plant(
        a,
        {"method": "files_upload_v2", "args": {"file": str(key_file), "channel": "C6"}, "at": now},
    )
    approval = {"channel": "C1", "text": "fix APPROVED by <@UBOSS>"}
    _plant(a, {"method": "chat.postMessage", "args": approval, "at": now + 1})
    _plant(a, {"method": "chat.postMessage", "args": approval, "at": now + 2, "sig": "0" * 64})
    # signed with the workers' key, but a call cudamedic never makes: refused all the same
    signed = sign(a, {"method": "files_upload_v2", "args": {"file": str(key_file)}, "at": now + 3})
    _plant(a, signed)
    _plant(a, sign(a, {"method": "admin.users.remove", "args": {"user": "U1"}, "at": now + 4}))
    with caplog.at_level("WARNING"):
        assert deliver(a, "chat.postMessage", channel="C1", text="real") is not None
    assert texts(slack) == ["real"] and slack.uploads == {}
    assert [c["method"] for c in slack.calls] == ["chat.postMessage"]
    reasons = sorted(str(d["reason"]) for d in dead(a))
    assert len(reasons) == 5 and waiting(a) == []
    assert sum("unsigned" in r for r in reasons) == 2
    assert sum("bad signature" in r for r in reasons) == 1
    assert sum("never sends: file" in r for r in reasons) == 1
    assert sum("not a message cudamedic sends" in r for r in reasons) == 1
    assert "moved to the dead letters" in caplog.text


def test_a_message_planted_in_the_local_outbox_is_never_sent_issue27(
    prefect_api: str, slack: FakeSlack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local cache (STATE_DIR/slack-outbox.jsonl) gets the same checks, Prefect up or down."""
    import json

    a = worker(slack, tmp_path, "a")
    a.state_path.mkdir(parents=True)
    planted = {"method": "files_upload_v2", "args": {"file": "/etc/shadow", "channel": "C6"}}
    local_outbox(a).write_text(json.dumps({**planted, "at": time.time()}) + "\n")
    with socket.socket() as closed:  # Prefect is down: the local flush sends the local cache
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{closed.getsockname()[1]}/api")
        assert deliver(a, "chat.postMessage", channel="C1", text="one") is not None
    assert not local_outbox(a).exists() and slack.uploads == {}
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    local_outbox(a).write_text(json.dumps({**planted, "at": time.time()}) + "\n")
    assert deliver(a, "chat.postMessage", channel="C1", text="two") is not None  # moved, refused
    assert texts(slack) == ["one", "two"] and slack.uploads == {}
    assert [d["method"] for d in dead(a)] == ["files_upload_v2", "files_upload_v2"]
