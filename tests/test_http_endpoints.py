"""The HTTP endpoints (`cudamedic alerts`, `cudamedic slack`) against hostile clients (issue 15,
"HTTP endpoints"): idle connections past the limit, slow headers, slow bodies and oversized
bodies never make them unreachable, and a slow request handler never blocks the others.

Real sockets on loopback; the fd-limit case runs the alert receiver in a child process under a
64-descriptor limit, as in the original finding. No lab needed."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from flows.alerts import Seen, make_server
from flows.http import Limits
from flows.slack.app import SlackApp
from runbooks.collect.inventory import Host, Inventory
from runbooks.core.settings import Settings
from tests.slackfake import FakeSlack, fake_slack
from tests.test_slack import SECRET, command, post, signed

ROOT = Path(__file__).parents[1]
TOKEN = "s3cret-t0ken"
INVENTORY = Inventory(hosts={"node07": Host(name="node07", address="10.0.0.7")})
FAST = Limits(max_connections=16, header_timeout=1.5, body_timeout=1.5)


@contextmanager
def alerts(limits: Limits = FAST) -> Iterator[str]:
    with make_server("127.0.0.1", 0, TOKEN, INVENTORY, Seen(), limits) as server:
        yield server.url


@contextmanager
def slack_app(tmp_path: Path, fake: FakeSlack, limits: Limits = FAST) -> Iterator[str]:
    settings = Settings(
        slack_bot_token=SecretStr("xoxb-test"),
        slack_signing_secret=SecretStr(SECRET),
        slack_api_url=fake.base_url,
        slack_timeout=3,
        state_dir=tmp_path,
    )
    with SlackApp(settings, INVENTORY).server("127.0.0.1", 0, limits) as server:
        yield server.url


def raw(url: str) -> socket.socket:
    """A plain TCP connection to the server of `url`."""
    host, port = urllib.parse.urlsplit(url).netloc.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed `sock` (whatever it answered first), None if it kept it
    open for `seconds`."""
    t0 = time.monotonic()
    while (left := seconds - (time.monotonic() - t0)) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            break
        try:
            if not sock.recv(65536):
                return time.monotonic() - t0
        except OSError:  # reset
            return time.monotonic() - t0
    return None


def status(sock: socket.socket, seconds: float) -> int:
    """The status the server answered on `sock` within `seconds` (0 if it closed or said
    nothing)."""
    sock.settimeout(seconds)
    try:
        line = sock.recv(65536).split(b"\r\n", 1)[0]
    except (TimeoutError, OSError):
        return 0
    return int(line.split()[1]) if line.startswith(b"HTTP/") else 0


def get(url: str, timeout: float = 10) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


# -- the tests ------------------------------------------------------------------------------
RECEIVER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
from flows.alerts import Seen, make_server
from flows.http import Limits
from runbooks.collect.inventory import Inventory
limits = Limits(max_connections=32, header_timeout=3)
server = make_server("127.0.0.1", 0, "t", Inventory(hosts={}), Seen(), limits)
server.bind()
print(server.url, flush=True)
server.serve_forever()
"""


def test_idle_connections_past_the_limit_leave_health_reachable_under_64_fds() -> None:
    """80 connections that send nothing, to a receiver limited to 64 file descriptors: /health
    still answers at once, and the server closes every idle connection by the header timeout."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    idle: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), proc.stderr.read() if proc.stderr else ""
        assert get(url + "/health") == 200
        idle = [raw(url) for _ in range(80)]
        time.sleep(0.5)  # let the server accept what it can
        t0 = time.monotonic()
        assert get(url + "/health", timeout=5) == 200
        took = time.monotonic() - t0
        print(f"/health with 80 idle connections under 64 fds: {took:.3f} s")
        assert took < 2.0
        closed = [closed_within(s, 3 + 3) for s in idle]
        assert all(c is not None for c in closed), closed
        assert proc.poll() is None  # alive, and still answering
        assert get(url + "/health", timeout=5) == 200
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_slow_body_is_cut_off_and_other_requests_are_served(tmp_path: Path) -> None:
    """`Content-Length: 1000000`, 10 bytes sent, then nothing: answered 408 (or closed) by the
    body timeout, while a signed request sent meanwhile is answered at once."""
    with fake_slack() as fake, slack_app(tmp_path, fake) as url, closing(raw(url)) as slow:
        slow.sendall(
            b"POST /slack/commands HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
            + b"text=triag"
        )
        t0 = time.monotonic()
        body = command("triage nosuchhost")
        code, answer = post(url + "/slack/commands", body, signed(body))
        assert code == 200 and "not a host of the inventory" in answer["text"]
        assert time.monotonic() - t0 < 1.0
        answered = status(slow, 6)
        held = time.monotonic() - t0
        print(f"slow body held for {held:.2f} s, answered {answered}")
        assert answered in (0, 408), answered
        assert held < FAST.body_timeout + 1.5
        assert closed_within(slow, 2) is not None


def test_a_slow_handler_does_not_block_the_others(tmp_path: Path) -> None:
    """A message shortcut waits on Slack's views.open (here: hanging past the client timeout);
    a slash command sent meanwhile is answered at once."""
    import json
    import threading

    with fake_slack() as fake, slack_app(tmp_path, fake) as url:
        fake.hang_s = 5
        fake.fail("views.open", 0, 1)
        payload = {
            "type": "message_action",
            "callback_id": "cudamedic_triage",
            "trigger_id": "t1",
            "user": {"id": "U1"},
            "channel": {"id": "C1"},
            "message": {"text": "CUDA error"},
        }
        slow = urllib.parse.urlencode({"payload": json.dumps(payload)}).encode()
        took: dict[str, float] = {}

        def shortcut() -> None:
            t = time.monotonic()
            post(url + "/slack/interactive", slow, signed(slow))
            took["shortcut"] = time.monotonic() - t

        thread = threading.Thread(target=shortcut)
        thread.start()
        fake.wait_for(lambda c: c["method"] == "views.open", timeout=5)
        t0 = time.monotonic()
        body = command("triage nosuchhost")
        assert post(url + "/slack/commands", body, signed(body))[0] == 200
        took["command"] = time.monotonic() - t0
        thread.join(30)
        assert took["command"] < 1.0 and took["shortcut"] > 2.5, took


def test_slow_headers_and_silent_connections_are_cut_off() -> None:
    """A request line, then headers one byte a second; and a connection that says nothing:
    both closed by the header timeout."""
    with alerts() as url, closing(raw(url)) as dribble, closing(raw(url)) as silent:
        dribble.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()  # both connections opened just before
        closed_at = None
        for byte in b"Host: x\r\nX-Slow: " + b"a" * 30:
            if closed_within(dribble, 1.0) is not None:
                closed_at = time.monotonic() - t0
                break
            try:
                dribble.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic() - t0
                break
        print(f"slow headers cut off after {closed_at} s")
        assert closed_at is not None and closed_at < FAST.header_timeout + 1.5
        assert closed_within(silent, FAST.header_timeout + 1.5) is not None
        quiet = time.monotonic() - t0
        print(f"silent connection closed by {quiet:.2f} s")
        assert quiet < FAST.header_timeout + 1.5
        assert get(url + "/health") == 200


def test_oversized_bodies_are_refused_without_reading_them(tmp_path: Path) -> None:
    auth = f"Authorization: Bearer {TOKEN}\r\n".encode()
    with alerts() as url:
        with closing(raw(url)) as s:  # declared too large: refused before any body byte
            s.sendall(b"POST /alertmanager HTTP/1.1\r\nHost: x\r\n" + auth)
            s.sendall(b"Content-Length: 2000000\r\n\r\n")
            assert status(s, 2) == 413
        with closing(raw(url)) as s:  # chunked, no length: refused once past the cap
            s.sendall(b"POST /alertmanager HTTP/1.1\r\nHost: x\r\n" + auth)
            s.sendall(b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 65536
            for _ in range(17):  # just past 1 MiB, then stop: nothing left unread, no reset
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            assert status(s, 2) == 413
    with fake_slack() as fake, slack_app(tmp_path, fake) as url, closing(raw(url)) as s:
        s.sendall(b"POST /slack/commands HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n")
        assert status(s, 2) == 413


def test_the_endpoints_keep_their_answers(tmp_path: Path) -> None:
    """/health, 404, 401 without the token or signature, 400 for bad JSON, 202 for alerts."""
    import json

    def alert_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
        return post(url, body, {"Content-Type": "application/json", **headers})

    with alerts() as url:
        assert get(url + "/health") == 200
        assert get(url + "/nope") == 404
        good = json.dumps({"version": "4", "alerts": [{"labels": {"host": "elsewhere"}}]})
        assert alert_post(url + "/alertmanager", good.encode(), {})[0] == 401
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert alert_post(url + "/alertmanager", b"{not json", bearer)[0] == 400
        code, answer = alert_post(url + "/alertmanager", good.encode(), bearer)
        assert code == 202 and answer["ignored"][0]["why"] == "no inventory host", answer
        assert alert_post(url + "/elsewhere", good.encode(), bearer)[0] == 404
    with fake_slack() as fake, slack_app(tmp_path, fake) as url:
        body = command("triage nosuchhost")
        assert post(url + "/slack/commands", body, {})[0] == 401
        assert post(url + "/slack/elsewhere", body, signed(body))[0] == 404
        body = command("triage nosuchhost")
        assert post(url + "/slack/commands", body, signed(body))[0] == 200


def test_uvicorn_internals_we_extend_are_as_checked() -> None:
    """flows/http.py subclasses uvicorn's h11 protocol and server; pin what it relies on so an
    upgrade that changes them fails here."""
    import inspect

    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from flows.http import UVICORN_CHECKED

    assert tuple(int(p) for p in uvicorn.__version__.split(".")[:2]) == UVICORN_CHECKED
    for method in ("connection_made", "handle_events", "on_response_complete", "connection_lost"):
        assert callable(getattr(H11Protocol, method)), method
    assert {"config", "server_state", "app_state"} <= set(
        inspect.signature(H11Protocol.__init__).parameters
    )
    assert "sockets" in inspect.signature(uvicorn.Server.startup).parameters
    server = uvicorn.Server(uvicorn.Config(app=lambda *a: None))
    assert hasattr(server, "server_state") and hasattr(server.server_state, "connections")
