"""Slack's Web API misbehaving: 429 with Retry-After, 5xx bursts and calls that hang past the
client's timeout, at random, and a whole outage during an incident response. Nothing is lost:
what fails waits in the outbox and is delivered, in order and once, when Slack answers again;
the post-mortem lands in the reports directory regardless.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from prefect import get_client

from flows.slack.app import deliver, flush_outbox, keep_flushing, waiting
from reports.slack import mrkdwn
from runbooks.core.settings import Settings
from tests.lab.lab import LabState
from tests.reliability.figures import record, size, zero
from tests.slackfake import FakeSlack, fake_slack
from tests.test_slack import TOKEN, slack_settings

SUITE = "faults: Slack"


@pytest.fixture
def slack() -> FakeSlack:
    with fake_slack() as fake:
        fake.hang_s = 1.5
        yield fake


def test_random_rate_limits_errors_and_timeouts_lose_nothing(
    prefect_api: str, settings: Settings, slack: FakeSlack
) -> None:
    s = slack_settings(settings, slack, slack_timeout=1)
    rng = random.Random(20261203)
    injected = {"429": 0, "5xx": 0, "timeout": 0}
    n = size(20, 400)
    start = time.monotonic()
    for i in range(n):
        roll = rng.random()
        if roll < 0.12:
            slack.fail("chat.postMessage", 429, 1, retry_after=1)
            injected["429"] += 1
        elif roll < 0.30:
            times = rng.randint(1, 4)  # more than 2 outlasts the client's retries
            slack.fail("chat.postMessage", rng.choice([500, 502, 503]), times)
            injected["5xx"] += times
        elif roll < 0.38:
            slack.fail("chat.postMessage", 0, 1)
            injected["timeout"] += 1
        deliver(s, "chat.postMessage", channel="C1", text=f"message {i:04d}")
    slack.failures.clear()  # Slack answers again
    left = flush_outbox(s)
    took = time.monotonic() - start
    texts = [c["args"]["text"] for c in slack.delivered("chat.postMessage")]
    want = [f"message {i:04d}" for i in range(n)]
    lost = len(set(want) - set(texts))
    duplicated = len(texts) - len(set(texts))
    first_seen = list(dict.fromkeys(texts))
    out_of_order = sum(1 for a, b in zip(first_seen, sorted(first_seen), strict=True) if a != b)
    record(SUITE, "messages sent while Slack was flaky", n)
    record(SUITE, "429s / 5xx / timeouts injected", " / ".join(map(str, injected.values())))
    zero(SUITE, "messages lost", lost)
    zero(SUITE, "messages delivered twice", duplicated)
    zero(SUITE, "messages out of order", out_of_order)
    zero(SUITE, "messages still waiting once Slack answered", left)
    assert waiting(s) == []
    record(SUITE, "seconds for all deliveries (retries, waits)", round(took, 1))
    assert (lost, duplicated, out_of_order, left) == (0, 0, 0, 0)
    assert all(c["auth"] == f"Bearer {TOKEN}" for c in slack.calls)


def test_an_outage_during_a_response_loses_nothing(
    prefect_api: str,
    lab: LabState,
    settings: Settings,
    slack: FakeSlack,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flows.incident import incident_response

    reports = tmp_path / "reports"
    for key, value in {
        "CUDAMEDIC_CONFIG": lab.config,
        "CUDAMEDIC_STATE_DIR": str(tmp_path / "state"),
        "CUDAMEDIC_OUT_DIR": str(tmp_path / "bundles"),
        "CUDAMEDIC_FLEET": "t-" + tmp_path.name[-30:].lower().replace("_", "-"),
        "CUDAMEDIC_REPORT_DIR": str(reports),
        "CUDAMEDIC_SLACK_BOT_TOKEN": TOKEN,
        "CUDAMEDIC_SLACK_API_URL": slack.base_url,
        "CUDAMEDIC_SLACK_TIMEOUT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    slack.down = True
    state = incident_response(
        target="gpu-nodriver",
        trigger_text="nvidia-smi fails",
        apply=False,
        slack={"channel": "C0INCIDENT", "ts": "1764700000.000001", "requester": "U0ASKER"},
        return_state=True,
    )
    assert state.is_completed(), state
    written = sorted(reports.glob("*.md"))
    assert len(written) == 1 and "driver-not-loaded" in written[0].read_text()
    # the Slack app of another worker: its own STATE_DIR, the same fleet (the same Prefect)
    s = Settings(
        state_dir=tmp_path / "app-state",
        fleet=os.environ["CUDAMEDIC_FLEET"],
        slack_bot_token=TOKEN,
        slack_api_url=slack.base_url,
    )
    kept = len(waiting(s))
    assert not list((tmp_path / "state").glob("slack-*.jsonl"))  # none on the flow worker
    assert kept >= 3  # progress, the summary, the report file
    slack.down = False  # Slack is back: the app's flusher sends everything, in order, once
    stop = keep_flushing(s.model_copy(update={"slack_outbox_flush_s": 0.2}))
    try:
        deadline = time.monotonic() + 30
        while waiting(s) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
    left = len(waiting(s))
    posted = [c["args"]["text"] for c in slack.delivered("chat.postMessage")]
    uploaded = [u.decode() for u in slack.uploads.values()]
    # the file goes in Slack's own markup (reports/slack.mrkdwn), from the report written
    report_delivered = any(mrkdwn(written[0].read_text()) == u for u in uploaded)
    record(SUITE, "Slack outage during a response: messages kept", kept)
    zero(SUITE, "Slack outage: messages still waiting after it ended", left)
    record(
        SUITE,
        "Slack outage: report written and then delivered",
        report_delivered,
        "True",
        report_delivered,
    )
    assert left == 0
    assert any(t.startswith("Post-mortem: driver-not-loaded on gpu-nodriver") for t in posted)
    assert report_delivered, uploaded
    assert len(posted) == len(set(posted))
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).state.is_completed()
