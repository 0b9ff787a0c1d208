"""`systemctl` for tests/test_install.py, where there is no systemd: starts and stops the units of
deploy/systemd as systemd would run them — their EnvironmentFile= and Environment= (later ones
win), WorkingDirectory=, each ExecStartPre= (a failure stops the start) and ExecStart= in a
session of its own, `%i` for the instance, `$VAR`/`${VAR}` from the unit's environment and `$$`
for a dollar — and stops them as `KillMode=mixed` does (SIGTERM to the main process, SIGKILL to
the rest after TimeoutStopSec=). Not emulated: User=/Group= (the test runs as root), the
sandboxing options, Restart=.

    python -m tests.units daemon-reload | enable --now UNIT... | start UNIT... | stop UNIT...

Units are read from $SYSTEMD_DIR; pid files and logs go to $SYSTEMD_DIR/.run/.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STOP_CAP_S = 120.0  # a test never waits longer than this for a unit to stop


def run_dir() -> Path:
    path = Path(os.environ["SYSTEMD_DIR"]) / ".run"
    path.mkdir(parents=True, exist_ok=True)
    return path


def unit_file(name: str) -> tuple[Path, str]:
    """The unit's file (`cudamedic-worker@w1` -> cudamedic-worker@.service) and its instance."""
    name = name.removesuffix(".service")
    base, _, instance = name.partition("@")
    file = Path(os.environ["SYSTEMD_DIR"]) / (
        f"{base}@.service" if "@" in name else f"{base}.service"
    )
    if not file.exists():
        raise SystemExit(f"Unit {name}.service not found.")
    return file, instance


def directives(text: str) -> list[tuple[str, str]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.append((key.strip(), value.strip()))
    return out


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";")) and "=" in line:
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip().strip('"')
    return env


def expand(word: str, env: dict[str, str]) -> str:
    word = word.replace("$$", "\0")
    word = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m.group(1) or m.group(2), ""), word)
    return word.replace("\0", "$")


def start(name: str) -> None:
    file, instance = unit_file(name)
    env = {"PATH": BASE_PATH, "LANG": "C.UTF-8"}
    home = run_dir() / f"home-{name}"
    home.mkdir(exist_ok=True)
    env["HOME"] = str(home)  # the service user's home (User= is not emulated)
    cwd, pre, main = "/", [], ""
    for key, value in directives(file.read_text().replace("%i", instance)):
        if key == "EnvironmentFile":
            env.update(read_env_file(Path(value.lstrip("-"))))
        elif key == "Environment":
            k, _, v = value.partition("=")
            env[k] = v
        elif key == "WorkingDirectory":
            cwd = value
        elif key == "ExecStartPre":
            pre.append(value)
        elif key == "ExecStart":
            main = value
    for command in pre:
        done = subprocess.run([expand(w, env) for w in shlex.split(command)], env=env, cwd=cwd)
        if done.returncode != 0:
            raise SystemExit(f"{name}: ExecStartPre failed ({done.returncode}): {command}")
    log = (run_dir() / f"{name}.log").open("ab")
    proc = subprocess.Popen(
        [expand(w, env) for w in shlex.split(main)],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    (run_dir() / f"{name}.pid").write_text(str(proc.pid))


def stop(name: str) -> None:
    pid_file = run_dir() / f"{name}.pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    file, _ = unit_file(name)
    limit = min(float(dict(directives(file.read_text())).get("TimeoutStopSec", "90")), STOP_CAP_S)
    try:
        os.kill(pid, signal.SIGTERM)  # KillMode=mixed: the main process only
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)  # then everything left in its group
    except ProcessLookupError:
        pass
    pid_file.unlink()


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # our child when started by this process
        if waited:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: systemctl daemon-reload | enable --now UNIT... | start | stop")
    verb, rest = argv[0], [a for a in argv[1:] if not a.startswith("-")]
    if verb == "daemon-reload":
        return 0
    if verb in ("enable", "start"):
        for name in rest if verb == "start" or "--now" in argv else []:
            start(name)
        return 0
    if verb == "stop":
        for name in rest:
            stop(name)
        return 0
    raise SystemExit(f"not emulated: systemctl {' '.join(argv)}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
