"""The cudamedic test lab: real Docker engines and real OpenSSH servers on this machine.

`up()` starts (as root):
- two Docker engines (Debian's dockerd, ``--bridge=none --iptables=false``), each on its own
  socket and data root: ``gpu`` has the `nvidia-container-runtime-hook` test shim on its PATH so
  ``--gpus`` works; ``plain`` has none, so ``--gpus`` fails with the real toolkit-missing error;
- a small image imported into both (a busybox-static root filesystem; no registry);
- one sshd per simulated host on 127.0.0.1, with generated host and user keys, a known_hosts file,
  and the host's scenario commands (`nvidia-smi`, `dmesg`, `all_reduce_perf`, ...) first on its
  PATH, replaying recorded real outputs (tests/fixtures/, each with its source);
- an inventory and a cudamedic config file for these hosts.
State goes to ``$CUDAMEDIC_LAB_DIR/state.json`` (default /tmp/cudamedic-lab) so a lab started by
``python -m tests.lab up`` is reused by the tests and by ``make demo``. No traffic leaves loopback:
the engines have no bridge network and any image pull goes to a dead loopback proxy.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass, field
from io import BytesIO
from pathlib import Path

from tests.lab.scenarios import SCENARIOS, Scenario

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
IMAGE = "cudamedic-lab/busybox:1"
# Simulated hosts are logged into as an unprivileged user with a plain POSIX shell (no rc files),
# in the docker group for the lab engines' sockets — like an operator account on a GPU node.
LAB_USER = "cudamedic-lab"
SHIM_FIXTURES = {  # what the GPU engine's containers see through the toolkit shim
    "nvidia-smi-L.txt": "nvidia-smi/list-h100-8gpu.txt",
    "nvidia-smi.txt": "nvidia-smi/h100-sxm-8gpu.txt",
}


def lab_dir() -> Path:
    return Path(os.environ.get("CUDAMEDIC_LAB_DIR", "/tmp/cudamedic-lab"))


@dataclass
class EngineInfo:
    name: str
    socket: str
    pid: int
    gpu: bool

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"


@dataclass
class HostInfo:
    name: str
    port: int
    scenario: str
    engine: str
    pid: int
    data: str  # directory of the scenario's recorded outputs (tests may edit them)


@dataclass
class LabState:
    dir: str
    engines: dict[str, EngineInfo] = field(default_factory=dict)
    hosts: dict[str, HostInfo] = field(default_factory=dict)
    user_key: str = ""
    known_hosts: str = ""
    inventory: str = ""
    config: str = ""

    def save(self) -> None:
        Path(self.dir, "state.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: Path) -> LabState | None:
        path = directory / "state.json"
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        state = cls(
            dir=raw["dir"],
            user_key=raw["user_key"],
            known_hosts=raw["known_hosts"],
            inventory=raw["inventory"],
            config=raw["config"],
        )
        state.engines = {k: EngineInfo(**v) for k, v in raw["engines"].items()}
        state.hosts = {k: HostInfo(**v) for k, v in raw["hosts"].items()}
        return state

    def alive(self) -> bool:
        pids = [e.pid for e in self.engines.values()] + [h.pid for h in self.hosts.values()]
        return bool(pids) and all(_ours(p, self.dir) for p in pids)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    *argv: str, env: dict[str, str] | None = None, check: bool = True, input_: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        list(argv), check=check, env=env, input=input_, capture_output=True, timeout=120
    )


# -- Docker engines ----------------------------------------------------------------------------
def _start_engine(root: Path, name: str, gpu: bool, extra: tuple[str, ...] = ()) -> EngineInfo:
    base = root / "engines" / name
    (base / "bin").mkdir(parents=True, exist_ok=True)
    sock = base / "docker.sock"
    env = dict(os.environ)
    # Any accidental pull fails fast on a dead loopback port instead of leaving the machine.
    env.update(HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="")
    env.pop("DOCKER_HOST", None)
    if gpu:
        shim = base / "bin" / "nvidia-container-runtime-hook"
        text = (REPO / "tests/lab/gpu_hook_shim.py").read_text().split("\n", 1)[1]
        shim.write_text(f"#!{sys.executable}\n{text}")
        shim.chmod(0o755)
        for dest, fixture in SHIM_FIXTURES.items():
            shutil.copyfile(FIXTURES / fixture, base / "bin" / dest)
        env["PATH"] = f"{base / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    else:
        env["PATH"] = ":".join(
            p
            for p in env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":")
            if not (Path(p) / "nvidia-container-runtime-hook").exists()
        )
    # Short (containerd's socket paths are limited) and one per lab directory, so two labs
    # (CUDAMEDIC_LAB_DIR) can run side by side on one machine.
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:6]
    exec_root = Path(f"/run/cml-{tag}-{name}")
    log = open(base / "dockerd.log", "ab")  # noqa: SIM115 - handed to the daemon
    proc = subprocess.Popen(
        [
            "dockerd",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            f"--host=unix://{sock}",
            f"--data-root={base / 'data'}",
            f"--exec-root={exec_root}",
            f"--pidfile={base / 'dockerd.pid'}",
            "--storage-driver=overlay2",
            *extra,
        ],
        stdout=log,
        stderr=log,
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"dockerd {name} exited: {(base / 'dockerd.log').read_text()[-2000:]}"
            )
        if (
            sock.exists()
            and _run("docker", "-H", f"unix://{sock}", "version", check=False).returncode == 0
        ):
            return EngineInfo(name=name, socket=str(sock), pid=proc.pid, gpu=gpu)
        time.sleep(0.3)
    raise RuntimeError(f"dockerd {name} did not start; see {base / 'dockerd.log'}")


def _rootfs_tar() -> bytes:
    """A busybox-static root filesystem as a tar stream, built in memory."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    applets = _run(busybox, "--list").stdout.decode().split()
    buf = BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add_dir(path: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(path)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        def add_file(path: str, data: bytes, mode: int = 0o644) -> None:
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), mode
            tar.addfile(info, BytesIO(data))

        for d in (
            "bin",
            "etc",
            "tmp",
            "root",
            "proc",
            "sys",
            "dev",
            "data",
            "usr",
            "usr/local",
            "usr/local/bin",
            "workspace",
        ):
            add_dir(d, 0o1777 if d == "tmp" else 0o755)
        with open(busybox, "rb") as fh:
            add_file("bin/busybox", fh.read(), 0o755)
        for applet in applets:
            if applet != "busybox":
                info = tarfile.TarInfo(f"bin/{applet}")
                info.type, info.linkname = tarfile.SYMTYPE, "busybox"
                tar.addfile(info)
        add_file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/sh\n")
        add_file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
    return buf.getvalue()


def _remove_leftovers(engine: EngineInfo) -> int:
    """Remove every container on a lab engine; return how many there were. A lab that died
    without `down` (a reboot, a killed CI job) leaves its containers in the engine's data root,
    and a test's container found there would be swept as a finding of every host."""
    ids = _run("docker", "-H", engine.url, "ps", "-aq", check=False).stdout.decode().split()
    if ids:
        _run("docker", "-H", engine.url, "rm", "-f", *ids, check=False)
    return len(ids)


def _import_image(engine: EngineInfo, rootfs: bytes) -> None:
    _run(
        "docker",
        "-H",
        engine.url,
        "import",
        "-c",
        'CMD ["/bin/sh"]',
        "-c",
        "ENV PATH=/usr/local/bin:/usr/bin:/bin",
        "-",
        IMAGE,
        input_=rootfs,
    )


# -- simulated GPU hosts -----------------------------------------------------------------------
_NVIDIA_SMI = """#!/bin/sh
# cudamedic lab: replays recorded nvidia-smi output for scenario {scenario}
D={data}
# A hung nvidia-smi stays an nvidia-smi process (not exec'd away), as on a real host.
[ -f "$D/nvidia-smi.hang" ] && {{ sleep 3600; exit 1; }}
rc="$(cat "$D/nvidia-smi.rc" 2>/dev/null || echo 0)"
case "$*" in
  "-L") f="$D/nvidia-smi-L.txt" ;;
  "-q -x") f="$D/nvidia-smi.xml" ;;
  "topo -m") f="$D/nvidia-smi-topo.txt" ;;
  *) f="$D/nvidia-smi.txt" ;;
esac
# A failing driver prints the same error whatever is asked; a missing recording prints nothing.
[ "$rc" != 0 ] && f="$D/nvidia-smi.txt"
[ -f "$f" ] && cat "$f"
exit "$rc"
"""
_DMESG = """#!/bin/sh
D={data}
if [ -f "$D/dmesg.denied" ]; then cat "$D/dmesg.denied" >&2; exit 1; fi
cat "$D/dmesg.txt"
"""
_JOURNALCTL = """#!/bin/sh
D={data}
[ -f "$D/journal.txt" ] && cat "$D/journal.txt"
"""
_ALL_REDUCE = """#!/bin/sh
D={data}
sleep "$(cat "$D/nccl-tests.seconds" 2>/dev/null || echo 1)"
cat "$D/nccl-tests.txt"
"""
_DCGMI = """#!/bin/sh
# cudamedic lab: replays recorded dcgmi output for scenario {scenario}
D={data}
case "$*" in
  "discovery -l") f="$D/dcgmi-discovery.txt" ;;
  "health -c") f="$D/dcgmi-health.txt" ;;
  "diag -r "*) f="$D/dcgmi-diag.txt" ;;
  *) exit 2 ;;
esac
[ -f "$f" ] && cat "$f"
exit 0
"""
# A stand-in for NVIDIA's nvidia-bug-report.sh with the real tool's output layout: it writes
# `nvidia-bug-report.log.gz` (gzip) into the current directory, starting with the tool's
# prologue, then the sections it appends, each after a line of 44 underscores. Layout, file name
# and prologue lines from NVIDIA's script (MIT-licensed, driver 5xx): https://github.com/
# bottlerocket-os/bottlerocket-admin-container/blob/a226b193d441e3aa7ffdd3bca305b5621b1d2d7f/
# nvidia-bug-report.sh ("Start of NVIDIA bug report log file", BASE_LOG_FILENAME, GZIP_CMD).
# The one section kept here is the host's kernel log (its replayed dmesg), where the Xids are.
_BUG_REPORT = """#!/bin/sh
D={data}
LOG_FILENAME=nvidia-bug-report.log.gz
touch $LOG_FILENAME 2> /dev/null || exit 1
(
    echo "____________________________________________"
    echo ""
    echo "Start of NVIDIA bug report log file.  Please include this file, along"
    echo "with a detailed description of your problem, when reporting a graphics"
    echo "driver bug via the NVIDIA Linux forum (see forums.developer.nvidia.com)"
    echo "or by sending email to 'linux-bugs@nvidia.com'."
    echo ""
    echo "nvidia-bug-report.sh Version: cudamedic-lab stand-in"
    echo ""
    echo "Date: `date`"
    echo "uname: `uname -a`"
    echo "command line flags: $*"
    echo ""
    echo "____________________________________________"
    echo ""
    cat "$D/dmesg.txt"
    echo ""
) | gzip -c > $LOG_FILENAME
"""
_CAT = """#!/bin/sh
cat {data}/{file}
"""


_STAMP = re.compile(r"^\[\s*(\d+\.\d+)\]")


def _make_recent(path: Path, age_s: float) -> None:
    """Shift a recorded dmesg's `[uptime]` stamps so its last line was logged `age_s` seconds
    ago by this machine's clock (the lab hosts share its /proc/uptime); only the numbers move,
    never the text. A machine up for less time than the recording keeps it as recorded (its
    lines then read as just logged)."""
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    stamps = [float(m.group(1)) for ln in lines if (m := _STAMP.match(ln))]
    if not stamps:
        return
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    shift = (uptime - age_s) - max(stamps)
    if shift <= 0:
        return

    def moved(line: str) -> str:
        m = _STAMP.match(line)
        return f"[{float(m.group(1)) + shift:12.6f}]{line[m.end() :]}" if m else line

    path.write_text("".join(moved(ln) for ln in lines))


def _refresh_scenarios(state: LabState) -> None:
    """A lab started by older code gets the recordings and command scripts added since: missing
    data files are copied and changed scripts replaced (atomically: a running test may be reading
    them). Existing data files are left alone: tests edit them."""
    for host in state.hosts.values():
        scenario = SCENARIOS.get(host.scenario)
        if scenario is None:
            continue
        data = Path(host.data)
        for dest, fixture in scenario.files.items():
            if not (data / dest).exists():
                shutil.copyfile(FIXTURES / fixture, data / dest)
        for name, text in _scripts(scenario).items():
            path, want = data.parent / "bin" / name, text.format(data=data, scenario=scenario.name)
            if not path.exists() or path.read_text() != want:
                tmp = path.with_suffix(".new")
                tmp.write_text(want)
                tmp.chmod(0o755)
                os.replace(tmp, path)


def _scripts(scenario: Scenario) -> dict[str, str]:
    """The fake commands of a simulated host: name -> script template."""
    scripts = {
        "nvidia-smi": _NVIDIA_SMI,
        "dmesg": _DMESG,
        "journalctl": _JOURNALCTL,
    }
    if "nccl-tests.txt" in scenario.files:
        scripts["all_reduce_perf"] = _ALL_REDUCE
    for tool in ("nvidia-ctk", "nvidia-container-toolkit"):
        if f"{tool}.txt" in scenario.files:
            scripts[tool] = _CAT.replace("{file}", f"{tool}.txt")
    if "nvidia-bug-report" in scenario.literal:  # the driver's bug report tool
        scripts["nvidia-bug-report.sh"] = _BUG_REPORT
    if "dcgmi-discovery.txt" in scenario.files:  # NVIDIA DCGM on this host
        scripts["dcgmi"] = _DCGMI
    if "lsmod.txt" in scenario.files:
        scripts["lsmod"] = _CAT.replace("{file}", "lsmod.txt")
    return scripts


def _write_host_scenario(home: Path, scenario: Scenario) -> Path:
    data, bindir = home / "data", home / "bin"
    data.mkdir(parents=True, exist_ok=True)
    bindir.mkdir(parents=True, exist_ok=True)
    for dest, fixture in scenario.files.items():
        shutil.copyfile(FIXTURES / fixture, data / dest)
    for dest, text in scenario.literal.items():
        (data / dest).write_text(text)
    if "dmesg.recent" in scenario.literal and (data / "dmesg.txt").exists():
        _make_recent(data / "dmesg.txt", float(scenario.literal["dmesg.recent"]))
    for name, text in _scripts(scenario).items():
        path = bindir / name
        path.write_text(text.format(data=data, scenario=scenario.name))
        path.chmod(0o755)
    return data


def _start_sshd(
    root: Path,
    host: str,
    port: int,
    engine: EngineInfo,
    bindir: Path,
    host_key: Path,
    authorized: Path,
) -> int:
    home = root / "hosts" / host
    config = home / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\n"
        f"AuthorizedKeysFile {authorized}\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        f"StrictModes no\nPidFile {home / 'sshd.pid'}\nMaxSessions 64\nMaxStartups 64:30:128\n"
        f"SetEnv PATH={bindir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
        f"DOCKER_HOST={engine.url}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)
    log = open(home / "sshd.log", "ab")  # noqa: SIM115 - handed to the daemon
    proc = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd {host} exited: {(home / 'sshd.log').read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc.pid
        time.sleep(0.1)
    raise RuntimeError(f"sshd {host} did not start")


def _ensure_user(root: Path) -> None:
    home = root / "home"
    home.mkdir(parents=True, exist_ok=True)
    # Labs started at once (the test workers') add the one user once: useradd and usermod
    # refuse to run while another holds /etc/passwd's lock.
    with open("/run/cudamedic-lab-user.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _ensure_user_locked(home)


def _ensure_user_locked(home: Path) -> None:
    if _run("id", "-u", LAB_USER, check=False).returncode != 0:
        _run(
            "useradd",
            "--system",
            "--no-create-home",
            "--home-dir",
            str(home),
            "--shell",
            "/bin/sh",
            LAB_USER,
        )
    if _run("getent", "group", "docker", check=False).returncode != 0:
        _run("groupadd", "--system", "docker")
    # "*": no password, but not "locked" ("!"), which sshd refuses even for key logins.
    _run("usermod", "-aG", "docker", "-p", "*", LAB_USER)
    shutil.chown(home, LAB_USER)


def up(directory: Path | None = None) -> LabState:
    root = directory or lab_dir()
    existing = LabState.load(root)
    if existing and existing.alive():
        _refresh_scenarios(existing)
        return existing
    if existing:
        down(existing)
    root.mkdir(parents=True, exist_ok=True)
    state = LabState(dir=str(root))
    try:
        _ensure_user(root)
        root.chmod(0o755)
        rootfs = _rootfs_tar()
        for name, gpu in (("gpu", True), ("plain", False)):
            engine = _start_engine(root, name, gpu)
            state.engines[name] = engine
            state.save()
            _remove_leftovers(engine)
            _import_image(engine, rootfs)
        keys = root / "keys"
        keys.mkdir(exist_ok=True)
        user_key = keys / "id_ed25519"
        if not user_key.exists():
            _run(
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "cudamedic-lab",
                "-f",
                str(user_key),
            )
        authorized = keys / "authorized_keys"
        shutil.copyfile(f"{user_key}.pub", authorized)
        known: list[str] = []
        inventory: dict[str, dict[str, object]] = {}
        for scenario in SCENARIOS.values():
            home = root / "hosts" / scenario.name
            if home.exists():
                shutil.rmtree(home)
            data = _write_host_scenario(home, scenario)
            host_key = home / "ssh_host_ed25519_key"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
            port = _free_port()
            engine = state.engines[scenario.engine]
            pid = _start_sshd(root, scenario.name, port, engine, home / "bin", host_key, authorized)
            state.hosts[scenario.name] = HostInfo(
                name=scenario.name,
                port=port,
                scenario=scenario.name,
                engine=engine.name,
                pid=pid,
                data=str(data),
            )
            state.save()
            pub = Path(f"{host_key}.pub").read_text().split()
            known.append(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}")
            inventory[scenario.name] = {
                "address": "127.0.0.1",
                "port": port,
                "user": LAB_USER,
                "key_file": str(user_key),
                "gpus": scenario.gpus,
                "tags": list(scenario.tags),
            }
        known_hosts = root / "known_hosts"
        known_hosts.write_text("\n".join(known) + "\n")
        inv = root / "inventory.yaml"
        import yaml

        inv.write_text(yaml.safe_dump({"hosts": inventory}, sort_keys=True))
        config = root / "cudamedic.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "inventory": str(inv),
                    "known_hosts": str(known_hosts),
                    "ssh_connect_timeout": 5,
                    "command_timeout": 10,
                    "nccl_tests_budget": 30,
                }
            )
        )
        state.user_key, state.known_hosts = str(user_key), str(known_hosts)
        state.inventory, state.config = str(inv), str(config)
        state.save()
    except BaseException:
        down(state)
        raise
    return state


def clean(state: LabState | None = None) -> int:
    """Remove every container on the lab's engines (the demo starts with this: a test run killed
    half-way leaves its containers, and the demo's sweeps would report them)."""
    state = state or LabState.load(lab_dir())
    if state is None or not state.alive():
        return 0
    return sum(_remove_leftovers(engine) for engine in state.engines.values())


def restart_engine(state: LabState, name: str) -> None:
    """Stop a lab engine the way a host reboot or package upgrade would, and start it again."""
    engine = state.engines[name]
    _terminate(engine.pid, wait=30, marker=state.dir)
    state.engines[name] = _start_engine(Path(state.dir), name, engine.gpu)
    state.save()


def down(state: LabState | None = None) -> None:
    state = state or LabState.load(lab_dir())
    if state is None:
        return
    for host in state.hosts.values():
        _terminate(host.pid)
    for engine in state.engines.values():
        if _pid_alive(engine.pid):
            _remove_leftovers(engine)
        _terminate(engine.pid, wait=20)
    state_file = Path(state.dir, "state.json")
    if state_file.exists():
        state_file.unlink()


def _ours(pid: int, marker: str) -> bool:
    """Is `pid` still one of the lab's daemons? (pids are reused after a reboot or a crash)"""
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _terminate(pid: int, wait: float = 5, marker: str | None = None) -> None:
    if marker is not None and not _ours(pid, marker):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and _pid_alive(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    if _pid_alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
