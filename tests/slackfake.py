"""A local stand-in for Slack's Web API (the lowest layer: HTTP), reached through slack-sdk's
`base_url`. It speaks the methods cudamedic calls, records every call, and can be told to answer
a method with HTTP 429 (Retry-After) or 5xx a number of times first, hang past the client's
timeout (status 0) before answering 503, or refuse it for good (`refuse`: `ok: false` with an
error such as `channel_not_found`, as Slack does). `apps.connections.open` answers `socket_url`
(Socket Mode: tests/slacksocket.py); `conversations.members` pages like Slack (`limit`, at most
`page_max` a page, `response_metadata.next_cursor`)."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeSlack:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.uploads: dict[str, bytes] = {}
        self.failures: dict[str, list[tuple[int, dict[str, str]]]] = {}
        self.usergroups: dict[str, list[str]] = {}
        self.channel_members: dict[str, list[str]] = {}
        self.refusals: dict[str, list[str]] = {}  # method -> errors answered, in turn
        self.refused_channels: dict[str, str] = {}  # chat.* to a channel: this error, always
        self.socket_url = ""
        self.page_max = 100
        self.lock = threading.Lock()
        self.hang_s = 3.0
        self.down = False  # every method answers 503 (an outage)
        self._ts = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/api/"

    # -- test helpers --------------------------------------------------------------------------
    def fail(self, method: str, status: int, times: int, retry_after: int = 1) -> None:
        """Answer `method` with `status` the next `times` calls; status 0: hang for
        `self.hang_s`, then 503 (the client has given up by then)."""
        headers = {"Retry-After": str(retry_after)} if status == 429 else {}
        self.failures.setdefault(method, []).extend([(status, headers)] * times)

    def refuse(self, method: str, error: str, times: int = 1) -> None:
        """Answer `method` with HTTP 200 `{"ok": false, "error": error}` the next `times` calls."""
        self.refusals.setdefault(method, []).extend([error] * times)

    def delivered(self, method: str) -> list[dict[str, Any]]:
        """The calls of `method` that were answered ok (what reached the channel)."""
        return [c for c in self.of(method) if (c.get("response") or {}).get("ok")]

    def of(self, method: str) -> list[dict[str, Any]]:
        with self.lock:
            return [c for c in self.calls if c["method"] == method]

    def wait_for(self, pred: Any, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for c in self.calls:
                    if pred(c):
                        return c
            time.sleep(0.2)
        raise AssertionError(f"no matching Slack call; calls: {[c['method'] for c in self.calls]}")

    # -- the server ----------------------------------------------------------------------------
    def _next_ts(self) -> str:
        with self.lock:
            self._ts += 1
            return f"1764700000.{self._ts:06d}"

    def _answer(self, method: str, args: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            queued = self.refusals.get(method)
            refusal = queued.pop(0) if queued else None
        if refusal is not None:
            return {"ok": False, "error": refusal}
        if method.startswith("chat.") and str(args.get("channel")) in self.refused_channels:
            return {"ok": False, "error": self.refused_channels[str(args.get("channel"))]}
        if method in ("chat.postMessage", "chat.update"):
            ts = args.get("ts") or self._next_ts()
            return {"ok": True, "channel": args.get("channel"), "ts": ts}
        if method == "chat.postEphemeral":
            return {"ok": True, "message_ts": self._next_ts()}
        if method == "files.getUploadURLExternal":
            fid = f"F{self._next_ts().replace('.', '')}"
            port = self.server.server_address[1]
            url = f"http://127.0.0.1:{port}/upload/{fid}"
            return {"ok": True, "upload_url": url, "file_id": fid}
        if method == "files.completeUploadExternal":
            files = args.get("files")
            files = json.loads(files) if isinstance(files, str) else files or []
            return {"ok": True, "files": [{"id": f["id"], "title": f.get("title")} for f in files]}
        if method == "files.info":
            return {"ok": True, "file": {"id": args.get("file")}}
        if method == "usergroups.users.list":
            return {"ok": True, "users": self.usergroups.get(str(args.get("usergroup")), [])}
        if method == "conversations.members":
            members = self.channel_members.get(str(args.get("channel")), [])
            start = int(args.get("cursor") or 0)
            end = start + min(int(args.get("limit") or 100), self.page_max)
            cursor = str(end) if end < len(members) else ""
            return {
                "ok": True,
                "members": members[start:end],
                "response_metadata": {"next_cursor": cursor},
            }
        if method == "apps.connections.open":
            return {"ok": True, "url": self.socket_url} if self.socket_url else {"ok": False}
        if method == "auth.test":
            return {"ok": True, "team_id": "T0LAB", "user_id": "U0BOT", "bot_id": "B0BOT"}
        if method == "views.open":
            return {"ok": True}
        return {"ok": False, "error": "unknown_method"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.startswith("/upload/") and not fake.down:
                    fake.uploads[self.path.rsplit("/", 1)[1]] = raw
                    self._send(200, b"OK", "text/plain")
                    return
                method = self.path.removeprefix("/api/")
                ctype = self.headers.get("Content-Type", "")
                if "json" in ctype:
                    args = json.loads(raw or b"{}")
                else:
                    args = {k: v[0] for k, v in urllib.parse.parse_qs(raw.decode()).items()}
                with fake.lock:
                    fake.calls.append(
                        {"method": method, "args": args, "auth": self.headers.get("Authorization")}
                    )
                    queued = fake.failures.get(method)
                    failure = queued.pop(0) if queued else None
                    if fake.down:
                        failure = (503, {})
                if failure is not None:
                    status, headers = failure
                    if status == 0:
                        time.sleep(fake.hang_s)
                        status = 503
                    try:
                        self._send(
                            status, b'{"ok": false, "error": "ratelimited"}', headers=headers
                        )
                    except OSError:  # the client gave up waiting
                        pass
                    return
                answer = fake._answer(method, args)
                with fake.lock:
                    next(c for c in reversed(fake.calls) if c["args"] is args)["response"] = answer
                self._send(200, json.dumps(answer).encode())

            def _send(
                self,
                status: int,
                body: bytes,
                ctype: str = "application/json",
                headers: dict[str, str] | None = None,
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        return Handler


@contextmanager
def fake_slack() -> Iterator[FakeSlack]:
    fake = FakeSlack()
    thread = threading.Thread(target=fake.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()
