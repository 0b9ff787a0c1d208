"""A local stand-in for Slack's Socket Mode server, on 127.0.0.1 only: the app asks the fake Web
API (tests/slackfake.py) for `apps.connections.open`, gets this server's `ws://` URL, connects,
is greeted with `hello`, and then receives envelopes (slash commands, interactive payloads) that
it must acknowledge by `envelope_id`; `refresh()` sends Slack's `disconnect` (refresh_requested)
so the app opens a new connection, as Slack does every few hours."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.server import Server, ServerConnection, serve

from tests.slackfake import FakeSlack


class SocketSlack:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connections: list[ServerConnection] = []  # every connection, in order
        self.closed = 0  # how many of them the app has closed
        self.acks: dict[str, tuple[float, dict[str, Any] | None]] = {}  # envelope -> (at, payload)
        self.sent: dict[str, float] = {}  # envelope -> when it was sent
        self.server: Server = serve(self._session, "127.0.0.1", 0)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/link/?ticket=lab"

    # -- the protocol ------------------------------------------------------------------------
    def _session(self, ws: ServerConnection) -> None:
        with self.lock:
            self.connections.append(ws)
        hello = {
            "type": "hello",
            "num_connections": 1,
            "debug_info": {"host": "lab", "approximate_connection_time": 18060},
            "connection_info": {"app_id": "A0CUDAMEDIC"},
        }
        ws.send(json.dumps(hello))
        try:
            for raw in ws:
                ack = json.loads(raw)
                envelope = str(ack.get("envelope_id", ""))
                with self.lock:
                    if envelope in self.sent and envelope not in self.acks:
                        self.acks[envelope] = (time.monotonic(), ack.get("payload"))
        except ConnectionClosed:
            pass
        with self.lock:
            self.closed += 1

    @property
    def current(self) -> ServerConnection:
        with self.lock:
            return self.connections[-1]

    def wait_connected(self, n: int = 1, timeout: float = 20) -> float:
        """Until the app has opened its `n`-th connection and closed the ones before (it has
        moved over); returns the seconds it took."""
        started = deadline = time.monotonic()
        deadline += timeout
        while len(self.connections) < n or self.closed < n - 1:
            assert time.monotonic() < deadline, f"{len(self.connections)} connection(s), not {n}"
            time.sleep(0.01)
        return time.monotonic() - started

    def envelope(self, kind: str, payload: dict[str, Any], retry: int = 0) -> str:
        """Send one envelope (`slash_commands`, `interactive`) on the newest connection."""
        envelope_id = str(uuid.uuid4())
        message = {
            "envelope_id": envelope_id,
            "type": kind,
            "payload": payload,
            "accepts_response_payload": kind in ("slash_commands", "interactive"),
            "retry_attempt": retry,
            "retry_reason": "timeout" if retry else "",
        }
        with self.lock:
            self.sent[envelope_id] = time.monotonic()
        self.current.send(json.dumps(message))
        return envelope_id

    def ack(self, envelope_id: str, timeout: float = 10) -> tuple[float, dict[str, Any] | None]:
        """(seconds from sending to the acknowledgement, its payload)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if envelope_id in self.acks:
                    at, payload = self.acks[envelope_id]
                    return at - self.sent[envelope_id], payload
            assert time.monotonic() < deadline, f"envelope {envelope_id} was not acknowledged"
            time.sleep(0.005)

    def refresh(self) -> None:
        """Slack's `disconnect` (refresh_requested): the app must open a new connection."""
        self.current.send(
            json.dumps(
                {
                    "type": "disconnect",
                    "reason": "refresh_requested",
                    "debug_info": {"host": "lab"},
                }
            )
        )


@contextmanager
def socket_slack(fake: FakeSlack) -> Iterator[SocketSlack]:
    """A Socket Mode server that `fake`'s apps.connections.open points at."""
    server = SocketSlack()
    thread = threading.Thread(target=server.server.serve_forever, daemon=True)
    thread.start()
    fake.socket_url = server.url
    try:
        yield server
    finally:
        server.server.shutdown()
