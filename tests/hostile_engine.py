"""A Docker Engine API that a compromised host could run: it answers the calls `collect` makes
(version, info, list, inspect, logs) over a unix socket, with whatever names and text the test
gives it. The lowest layer of a target, played by an attacker; nothing of cudamedic is replaced.
"""

from __future__ import annotations

import json
import os
import socketserver
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    containers: list[dict[str, Any]]
    logs: dict[str, bytes]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def address_string(self) -> str:  # a unix socket has no peer address
        return "local"

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        parts = [unquote(p) for p in path.split("/") if p]
        if parts and parts[0].startswith("v1."):
            parts = parts[1:]
        if parts == ["version"]:
            return self._send(200, json.dumps({"ApiVersion": "1.41", "Version": "28.2"}).encode())
        if parts == ["info"]:
            return self._send(200, json.dumps({"Runtimes": {"runc": {}}}).encode())
        if parts == ["containers", "json"]:
            summaries = [{"Id": c["Id"], "Names": [c["Name"]]} for c in self.server.containers]
            return self._send(200, json.dumps(summaries).encode())
        if len(parts) == 3 and parts[0] == "containers":
            found = next(  # like Docker: by name, full id or an id prefix
                (
                    c
                    for c in self.server.containers
                    if parts[1] == c["Name"].lstrip("/") or c["Id"].startswith(parts[1])
                ),
                None,
            )
            if found is None:
                return self._send(404, b'{"message": "No such container"}')
            if parts[2] == "json":
                return self._send(200, json.dumps(found).encode())
            if parts[2] == "logs":
                text = self.server.logs.get(found["Id"], b"")
                frame = struct.pack(">BxxxL", 1, len(text)) + text
                return self._send(200, frame, "application/vnd.docker.raw-stream")
        return self._send(404, b'{"message": "not here"}')


@contextmanager
def hostile_engine(
    socket_path: Path, containers: list[dict[str, Any]], logs: dict[str, bytes]
) -> Iterator[str]:
    """Serve the fake engine on `socket_path`; yields its unix:// URL."""
    if socket_path.exists():
        os.unlink(socket_path)
    server = _Server(str(socket_path), _Handler)
    server.containers = containers
    server.logs = logs
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"unix://{socket_path}"
    finally:
        server.shutdown()
        server.server_close()
