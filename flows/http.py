"""The HTTP endpoints' server (`cudamedic alerts`, `cudamedic slack`): a Starlette app on
uvicorn, with limits that hostile or broken clients cannot get around (issue 15).

- Connections: at most `max_connections` open. Past the limit, the connection that has waited
  longest for a request (idle, or still sending its headers) is closed before the next one is
  accepted; while every connection is in the middle of a request, new ones wait in the kernel's
  queue. So idle sockets never use up the file descriptors, and `/health` stays reachable.
- Headers: a connection must send a complete request head within `header_timeout` of
  connecting (or of its previous response); else it is closed. uvicorn arms no timer before the
  first request, so a connection that says nothing or dribbles its headers would be held for
  ever: `_GuardedH11` adds that timer. Heads over `max_header_bytes` are answered 400.
- Bodies: read by `read_body` within `body_timeout` (uvicorn has no body timeout) and capped
  while streaming: 408 / 413, and the connection is closed.
- Handlers that block (Prefect, Slack) run in worker threads (`run_in_threadpool`), never on
  the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar

import anyio
import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from runbooks.core.settings import Settings

log = logging.getLogger(__name__)
# `_GuardedH11` and `_Server` extend uvicorn beyond its public API (no public form exists for a
# header timeout or an accept loop); checked against uvicorn 0.55 and pinned by
# tests/test_http_endpoints.py::test_uvicorn_internals_we_extend_are_as_checked.
UVICORN_CHECKED = (0, 55)


@dataclass(frozen=True)
class Limits:
    max_connections: int = 100
    header_timeout: float = 10.0  # connect (or last response) -> complete request head
    body_timeout: float = 10.0  # request head -> complete body
    max_header_bytes: int = 16 * 1024
    keep_alive: int = 5  # an idle keep-alive connection is closed after this (uvicorn's timer)

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(
            max_connections=settings.http_max_connections,
            header_timeout=settings.http_header_timeout,
            body_timeout=settings.http_body_timeout,
        )


# -- the app side: replies, bodies, logging ----------------------------------------------------
class Refused(Exception):
    """A request answered with `status` before its handler ran; the connection is closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def reply(status: int, body: Any, close: bool = False) -> Response:
    return JSONResponse(body, status, headers={"Connection": "close"} if close else None)


async def read_body(request: Request, limits: Limits, max_bytes: int) -> bytes:
    """The request body, at most `max_bytes`, received within `limits.body_timeout`."""
    too_large = Refused(413, f"body must be 0..{max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > max_bytes:  # h11 let only digits through
        raise too_large
    chunks, size = [], 0
    try:
        with anyio.fail_after(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise Refused(408, f"body not received within {limits.body_timeout:g} s") from None
    except ClientDisconnect:
        raise Refused(400, "the client went away") from None
    return b"".join(chunks)


def json_app(routes: Sequence[BaseRoute], logger: logging.Logger) -> ASGIApp:
    """A Starlette app of `routes` whose errors are JSON; each request is logged as method and
    path only (never a query string, a header or a body)."""

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        logger.warning("refused %s %s: %s", request.method, request.url.path, exc)
        return reply(exc.status, {"error": str(exc)}, close=True)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return reply(exc.status_code, {"error": exc.detail.lower()})

    app = Starlette(
        routes=list(routes),
        exception_handlers={Refused: refused, 404: http_error, 405: http_error},
    )

    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            logger.info("%s %s", scope["method"], scope["path"])
        await app(scope, receive, send)

    return logged


# -- the connection side: a header deadline per connection, a cap on connections ---------------
class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, closed when no complete request head arrives within
    `limits.header_timeout` of connecting or of the previous response."""

    limits: ClassVar[Limits]
    _deadline: asyncio.TimerHandle | None = None
    waiting_since = 0.0

    @property
    def waiting(self) -> bool:
        """Idle or sending a request head (not in the middle of a request)."""
        return self._deadline is not None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request head arrived (or an error)
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before: a pipelined request handled in there disarms it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self.waiting_since = time.monotonic()
        self._deadline = self.loop.call_later(self.limits.header_timeout, self.transport.close)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class _Listener:
    """What uvicorn's shutdown closes (it expects asyncio Servers): the accept loop."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    def close(self) -> None:
        self.task.cancel()

    async def wait_closed(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class _Server(uvicorn.Server):
    """uvicorn's server with its own accept loop (asyncio's accepts as many as the kernel
    queued, and on EMFILE logs and retries once per queued connection, every second): past
    `max_connections` it closes the connection that has waited longest for a request before it
    accepts the next one, and waits while every connection is in the middle of a request."""

    limits: Limits

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        assert sockets is not None and len(sockets) == 1
        await self.lifespan.startup()
        self.servers = [_Listener(asyncio.create_task(self._accept(sockets[0])))]  # type: ignore[list-item]
        self.started = True

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        complained = 0.0
        while True:
            if not self._room():
                await asyncio.sleep(0.05)
                continue
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # out of file descriptors (or the like): wait, never spin
                if time.monotonic() - complained > 60:
                    complained = time.monotonic()
                    log.warning("cannot accept connections: %s", exc)
                await asyncio.sleep(0.1)
                continue
            await loop.connect_accepted_socket(self._protocol, conn)

    def _room(self) -> bool:
        """True when one more connection fits, closing the longest-waiting one if needed."""
        connections = self.server_state.connections
        if len(connections) < self.limits.max_connections:
            return True
        waiting = [c for c in connections if isinstance(c, _GuardedH11) and c.waiting]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.waiting_since)
        oldest.transport.close()
        connections.discard(oldest)  # its connection_lost comes in the next loop turn
        return True

    def _protocol(self) -> asyncio.Protocol:
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )


class HttpServer:
    """`app` served on host:port with `limits`: `start()`/`stop()` (or `with`) in a background
    thread, or `serve_forever()` in this one (Ctrl-C / SIGTERM end it gracefully). `bind()`
    binds the socket (port 0: any free port) so the address is known before serving."""

    def __init__(self, app: ASGIApp, host: str, port: int, limits: Limits) -> None:
        self.host, self.port, self.limits = host, port, limits
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        protocol = type("GuardedH11", (_GuardedH11,), {"limits": limits})
        config = uvicorn.Config(
            app,
            http=protocol,
            loop="asyncio",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            # uvicorn answers 503 from this many connections or requests; the cap above keeps
            # connections at max_connections, so this bounds requests in progress
            limit_concurrency=limits.max_connections + 1,
            timeout_keep_alive=limits.keep_alive,
            h11_max_incomplete_event_size=limits.max_header_bytes,
            timeout_graceful_shutdown=5,
        )
        self._server = _Server(config)
        self._server.limits = limits

    def bind(self) -> tuple[str, int]:
        if self._sock is None:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            self._sock = socket.create_server((self.host, self.port), family=family)
            self.host, self.port = self._sock.getsockname()[:2]
        return self.host, self.port

    @property
    def url(self) -> str:
        host, port = self.bind()
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.bind()
        self._server.run(sockets=[self._sock] if self._sock else None)

    def start(self) -> HttpServer:
        self.bind()
        self._thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)

    def __enter__(self) -> HttpServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
