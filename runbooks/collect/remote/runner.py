"""Running host commands: the `CommandRunner` port, its result, and the local implementation.

Every run has a timeout and an output bound. Output beyond the bound is dropped from the head
(``keep="tail"``, for logs where the newest lines matter) or the tail (``keep="head"``), and the
result says so; memory stays bounded whatever the command prints.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections import deque
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

Keep = Literal["head", "tail"]


class CommandResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    command: str
    exit_code: int | None  # None when it was killed for its timeout
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False
    truncated: bool = False
    bytes_seen: int = 0
    duration_s: float = 0.0
    note: str | None = None  # why, when cudamedic decided it (not started, killed at its timeout)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class CommandRunner(Protocol):
    """Runs one shell command line on a host. Implementations: LocalRunner, SshRunner."""

    name: str

    def run(
        self, command: str, *, timeout: float, max_bytes: int, keep: Keep = "head"
    ) -> CommandResult: ...

    def close(self) -> None: ...


class BoundedBuffer:
    """Keeps at most `limit` bytes of a stream: its head or its tail."""

    def __init__(self, limit: int, keep: Keep) -> None:
        self.limit = limit
        self.keep = keep
        self.seen = 0
        self._chunks: deque[bytes] = deque()
        self._size = 0

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.seen += len(data)
        if self.keep == "head":
            room = self.limit - self._size
            if room > 0:
                piece = data[:room]
                self._chunks.append(piece)
                self._size += len(piece)
            return
        self._chunks.append(data)
        self._size += len(data)
        while self._size - len(self._chunks[0]) >= self.limit:
            self._size -= len(self._chunks.popleft())

    @property
    def truncated(self) -> bool:
        return self.seen > self.limit

    def getvalue(self) -> bytes:
        """What was kept: whole lines only when the stream was cut (see `_whole_lines`)."""
        data = b"".join(self._chunks)
        cut_at_line = False
        if self.keep == "tail" and len(data) > self.limit:
            cut_at_line = data[-self.limit - 1 : -self.limit] == b"\n"
            data = data[-self.limit :]
        if self.truncated and not cut_at_line:
            data = _whole_lines(data, self.keep)
        return data


def _whole_lines(data: bytes, keep: Keep) -> bytes:
    """A cut window without the line the cut went through.

    A secret cut in half at the window's edge cannot be recognised from the half that is left
    (a token's tail, a password without its name), so that partial line is dropped; in a window
    with no line break, the partial word is.
    """
    for sep in (b"\n", b" "):
        at = data.find(sep) if keep == "tail" else data.rfind(sep)
        if at >= 0:
            return data[at + 1 :] if keep == "tail" else data[: at + 1]
    return b""


class LocalRunner:
    """Runs commands on this machine with `sh -c`, in its own process group."""

    name = "local"

    def run(
        self, command: str, *, timeout: float, max_bytes: int, keep: Keep = "head"
    ) -> CommandResult:
        start = time.monotonic()
        out, err = BoundedBuffer(max_bytes, keep), BoundedBuffer(max(max_bytes // 4, 65536), "tail")
        try:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", command],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            return CommandResult(command=command, exit_code=127, stderr=str(exc).encode())
        assert proc.stdout is not None and proc.stderr is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        timed_out = False
        deadline = start + timeout
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                else:
                    key.data.write(chunk)
        sel.close()
        if timed_out:
            _kill_group(proc)
        try:
            code: int | None = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
            code = None
        proc.stdout.close()
        proc.stderr.close()
        return CommandResult(
            command=command,
            exit_code=None if timed_out else code,
            stdout=out.getvalue(),
            stderr=err.getvalue(),
            timed_out=timed_out,
            truncated=out.truncated,
            bytes_seen=out.seen,
            duration_s=round(time.monotonic() - start, 3),
        )

    def close(self) -> None:
        return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
