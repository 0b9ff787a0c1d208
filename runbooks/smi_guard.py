"""`nvidia-smi` on a host, with care (SHELL): a hung one must not be joined by more.

On a host whose GPU or driver hangs, `nvidia-smi` blocks in the kernel (state D) and every new
one blocks behind it, making things worse; an SSH channel closed on our timeout does not stop
it. So, for one collection from one host, `SmiGuard` (a `CommandRunner` around the real one):

- first asks whether an `nvidia-smi` of that host is already running (`pgrep -x nvidia-smi`,
  the host's own binary: the first word of its command line is `nvidia-smi` or the path
  `command -v nvidia-smi` gives, or a script of that path); if one is, no `nvidia-smi` is
  started at all and each asks answers "not started", naming the one that runs;
- runs `nvidia-smi` commands one at a time, each under the host's `timeout` (SIGTERM to its
  process group when its time is up, SIGKILL 2 s later), so what we started is killed when
  its timeout passes; exit 124/137 of `timeout` is a timeout;
- after one timed out, starts no other in that collection.

Other commands pass through unchanged. Example: the lab's gpu-hang host answers the first
`nvidia-smi` with a hang; the sweep then reports `nvidia-smi-hung` and leaves nothing running.
"""

from __future__ import annotations

import re
import threading

from runbooks.remote.runner import CommandResult, CommandRunner, Keep

# The host's own nvidia-smi processes: pid, state (R, S, D, ...) and seconds running.
FIND_RUNNING = (
    "p=$(command -v nvidia-smi) || exit 0; for pid in $(pgrep -x nvidia-smi 2>/dev/null); do "
    'set -- $(tr "\\000" " " < /proc/$pid/cmdline 2>/dev/null); '
    'case "${1:-}" in nvidia-smi|"$p") ;; *) [ "${2:-}" = "$p" ] || continue ;; esac; '
    'echo "$pid $(cut -d" " -f3 /proc/$pid/stat 2>/dev/null) '
    '$(ps -o etimes= -p $pid 2>/dev/null | tr -d " ")"; done'
)
KILL_AFTER_S = 2  # SIGKILL this long after the SIGTERM of the host's `timeout`
_PLAIN = re.compile(r"^nvidia-smi(?: [A-Za-z0-9 ._=,:-]*)?$")  # no shell syntax to wrap


def is_smi(command: str) -> bool:
    return bool(_PLAIN.match(command.strip()))


def running(lines: str) -> str | None:
    """What a FIND_RUNNING answer says is running (None: nothing)."""
    procs = []
    for line in lines.splitlines():
        parts = line.split()
        if not parts or not parts[0].isdigit():
            continue
        state = parts[1] if len(parts) > 1 else "?"
        age = f", running {parts[2]} s" if len(parts) > 2 and parts[2].isdigit() else ""
        procs.append(f"pid {parts[0]} (state {state}{age})")
    if not procs:
        return None
    return f"an nvidia-smi started earlier still runs on the host: {', '.join(procs[:5])}"


class SmiGuard:
    """A `CommandRunner` that runs the host's `nvidia-smi` as the module says."""

    def __init__(self, runner: CommandRunner) -> None:
        self.runner = runner
        self.name = runner.name
        self._lock = threading.Lock()
        self._asked = False
        self._blocked: str | None = None  # why no nvidia-smi is started any more

    def run(
        self, command: str, *, timeout: float, max_bytes: int, keep: Keep = "head"
    ) -> CommandResult:
        if not is_smi(command):
            return self.runner.run(command, timeout=timeout, max_bytes=max_bytes, keep=keep)
        with self._lock:
            if not self._asked:
                self._asked = True
                found = self.runner.run(FIND_RUNNING, timeout=10, max_bytes=65536)
                if found.ok:
                    self._blocked = running(found.stdout.decode("utf-8", "replace"))
            if self._blocked is not None:
                return CommandResult(
                    command=command,
                    exit_code=None,
                    timed_out=True,
                    note=f"not started: {self._blocked}; cudamedic does not start another",
                )
            limit = max(1, int(timeout))
            wrapped = (
                "if command -v timeout >/dev/null 2>&1; then "
                f"exec timeout -k {KILL_AFTER_S} {limit} {command}; else exec {command}; fi"
            )
            res = self.runner.run(
                wrapped, timeout=limit + KILL_AFTER_S + 3, max_bytes=max_bytes, keep=keep
            )
            res = res.model_copy(update={"command": command})
            if res.timed_out or res.exit_code in (124, 137):
                res = res.model_copy(
                    update={
                        "timed_out": True,
                        "note": f"timed out after {limit} s; the host's `timeout` killed it",
                    }
                )
                self._blocked = f"`{command}` timed out in this collection"
            return res

    def close(self) -> None:
        self.runner.close()
