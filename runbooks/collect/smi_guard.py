"""`nvidia-smi` on a host, with care (SHELL): a hung one must not be joined by more.

On a host whose GPU or driver hangs, `nvidia-smi` blocks in the kernel (state D) and every new
one blocks behind it, making things worse; an SSH channel closed on our timeout does not stop
it. So, for one collection from one host, `SmiGuard` (a `CommandRunner` around the real one):

- runs the first `nvidia-smi` command alone, in one remote call with a check: is an
  `nvidia-smi` of that host (`pgrep -x nvidia-smi`; its command line's first word is
  `nvidia-smi` or the path `command -v nvidia-smi` gives, or it is a script of that path)
  already running for longer than the command's timeout? Then it is hung: nothing is started,
  and every `nvidia-smi` of the collection answers "not started", naming it. (A young one is
  someone's ordinary call: a healthy `nvidia-smi` takes a second.)
- runs each `nvidia-smi` under the host's `timeout` (SIGTERM to its process group 2 s before our
  own timeout, SIGKILL 1 s later), so what we started is killed when its time is up; exit
  124/137 of `timeout` is a timeout;
- starts the others (at once) only after the first answered, and none after one timed out.

Other commands pass through unchanged. Example: the lab's gpu-hang host hangs the first
`nvidia-smi`; the collection reports it timed out, starts no other, and leaves nothing running.
"""

from __future__ import annotations

import re
import threading

from runbooks.collect.remote.runner import CommandResult, CommandRunner, Keep

MARK = "cudamedic-smi-running"
BLOCKED_EXIT = 99
# The host's own nvidia-smi processes older than OLDER seconds: "MARK pid state seconds" each.
_FIND_HUNG = (
    'p=$(command -v nvidia-smi 2>/dev/null); found=""; if [ -n "$p" ]; then '
    "for pid in $(pgrep -x nvidia-smi 2>/dev/null); do "
    'set -- $({ tr "\\000" " " < /proc/$pid/cmdline; } 2>/dev/null); '
    'case "${1:-}" in nvidia-smi|"$p") ;; *) [ "${2:-}" = "$p" ] || continue ;; esac; '
    "age=$(ps -o etimes= -p $pid 2>/dev/null | tr -d ' '); "
    '[ -n "$age" ] && [ "$age" -gt OLDER ] || continue; '
    'found="${found}MARK $pid $(cut -d" " -f3 /proc/$pid/stat 2>/dev/null) $age\\\\n"; '
    "done; fi; "
    'if [ -n "$found" ]; then printf "$found"; exit BLOCKED; fi; '
)
_PLAIN = re.compile(r"^nvidia-smi(?: [A-Za-z0-9 ._=,:-]*)?$")  # no shell syntax to wrap


def is_smi(command: str) -> bool:
    return bool(_PLAIN.match(command.strip()))


def running(lines: str) -> str | None:
    """What the check's answer says is running (None: nothing)."""
    procs = []
    for line in lines.splitlines():
        parts = line.split()
        if len(parts) < 2 or parts[0] != MARK or not parts[1].isdigit():
            continue
        state = parts[2] if len(parts) > 2 else "?"
        age = f", running {parts[3]} s" if len(parts) > 3 and parts[3].isdigit() else ""
        procs.append(f"pid {parts[1]} (state {state}{age})")
    if not procs:
        return None
    return f"an nvidia-smi started earlier still runs on the host: {', '.join(procs[:5])}"


def wrapped(command: str, timeout: float, check: bool) -> tuple[str, float]:
    """The remote command line (with the check first when `check`), and our own timeout."""
    limit = max(1, int(timeout) - 2)  # the host kills it before we give up on it
    run = (
        "if command -v timeout >/dev/null 2>&1; then "
        f"exec timeout -k 1 {limit} {command}; else exec {command}; fi"
    )
    if check:
        older = max(5, int(timeout))
        found = _FIND_HUNG.replace("OLDER", str(older)).replace("MARK", MARK)
        run = found.replace("BLOCKED", str(BLOCKED_EXIT)) + run
    return run, max(float(timeout), limit + 1.5)


class SmiGuard:
    """A `CommandRunner` that runs the host's `nvidia-smi` as the module says."""

    def __init__(self, runner: CommandRunner) -> None:
        self.runner = runner
        self.name = runner.name
        self._lock = threading.Lock()
        self._first: threading.Event | None = None  # set once the first nvidia-smi answered
        self._blocked: str | None = None  # why no nvidia-smi is started any more

    def run(
        self, command: str, *, timeout: float, max_bytes: int, keep: Keep = "head"
    ) -> CommandResult:
        if not is_smi(command):
            return self.runner.run(command, timeout=timeout, max_bytes=max_bytes, keep=keep)
        with self._lock:
            first = self._first is None
            if first:
                self._first = threading.Event()
            done = self._first
        assert done is not None
        if not first:
            done.wait(timeout)  # the first one says whether the host's nvidia-smi answers
        if self._blocked is not None:
            return self._not_started(command)
        try:
            return self._run(command, timeout, max_bytes, keep, first)
        finally:
            if first:
                done.set()  # after _blocked is decided: the others read it next

    def _run(
        self, command: str, timeout: float, max_bytes: int, keep: Keep, first: bool
    ) -> CommandResult:
        line, ours = wrapped(command, timeout, check=first)
        res = self.runner.run(line, timeout=ours, max_bytes=max_bytes, keep=keep)
        res = res.model_copy(update={"command": command})
        said = res.stdout.decode("utf-8", "replace")
        if first and res.exit_code == BLOCKED_EXIT and MARK in said:
            self._blocked = running(said) or "an nvidia-smi started earlier still runs"
            return self._not_started(command)
        if res.timed_out or res.exit_code in (124, 137):
            self._blocked = f"`{command}` timed out in this collection"
            limit = max(1, int(timeout) - 2)
            return res.model_copy(
                update={
                    "timed_out": True,
                    "note": f"timed out after {limit} s; the host's `timeout` killed it",
                }
            )
        return res

    def _not_started(self, command: str) -> CommandResult:
        return CommandResult(
            command=command,
            exit_code=None,
            timed_out=True,
            note=f"not started: {self._blocked}; cudamedic does not start another",
        )

    def close(self) -> None:
        self.runner.close()
