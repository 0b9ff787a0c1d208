#!/usr/bin/env python3
"""Benchmark: fleet sweep fan-out against the tools people use today, on a simulated fleet.

Builds a fleet of N hosts, each a real sshd in its own network namespace (a veth pair from this
machine; nothing leaves the namespaces this script creates), answering GPU commands from
recorded real outputs (tests/fixtures) with realistic run times (`nvidia-smi` 0.3-1.0 s; a few
slow hosts 5 s), plus dead hosts (packets silently dropped) and refusing hosts (no sshd). Then, on
the same hosts and the same host commands (those of runbooks/sweep.yaml), in one run:
  - cudamedic sweep          the CLI and its Prefect flow, on a warm local Prefect server
  - cudamedic, no Prefect    runbooks.diagnose.sweep.check_hosts directly (the flow's work without
    Prefect)
  - ansible -f 50 -m command ansible-core, pipelining on
  - parallel-ssh             pssh.clients.ParallelSSHClient (libssh2), pool size 100
  - sequential paramiko      one host after the other: the floor
prints wall time, client CPU seconds, peak RSS and ratios, and draws a PNG (matplotlib, if
present). Tools not installed are installed into tests/benchmarks/.venv-bench on first use.
Run as root:
  .venv/bin/python tests/benchmarks/bench_sweep.py [--sizes 50 100 300] [--out bench-sweep.png]

Kept honest: the kernel here has no sch_netem, so there is no network delay between the
namespaces; host-side delay comes from the commands' run times only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
PY = str(REPO / ".venv" / "bin" / "python")
BENCH_VENV = REPO / "tests" / "benchmarks" / ".venv-bench"
ROOT = Path("/tmp/cudamedic-bench-fleet")
FIX = REPO / "tests" / "fixtures"
CONNECT_TIMEOUT = 10
SEQUENTIAL_MAX = 100
COMMANDS = [  # the host commands of runbooks/sweep.yaml
    "nvidia-smi",
    "nvidia-smi -q -x",
    "nvidia-smi topo -m",
    "dmesg -T",
    "cat /proc/uptime",
    "df -h",
    "lsmod | grep -i nvidia",
    "nvidia-ctk --version 2>/dev/null || nvidia-container-cli --version",
]
ONE_SHELL = "; ".join(f"{{ {c}; }}" for c in COMMANDS)

SCRIPT = """#!/bin/sh
case "$*" in
  "-L") exec cat {data}/nvidia-smi-L.txt ;;
  "-q -x") f={data}/nvidia-smi.xml ;;
  "topo -m") f={data}/nvidia-smi-topo.txt ;;
  *) f={data}/nvidia-smi.txt ;;
esac
sleep "${{BENCH_SMI_S:-0.4}}"
cat "$f"
"""


@dataclass
class Host:
    name: str
    index: int
    kind: str  # normal | slow | dead | refusing
    address: str
    smi_s: float
    pid: int | None = None


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


# -- the fleet ----------------------------------------------------------------------------------
def build_fleet(n: int, seed: int = 7) -> list[Host]:
    from tests.lab.lab import LAB_USER, _ensure_user

    teardown()
    ROOT.mkdir(parents=True)
    ROOT.chmod(0o755)
    _ensure_user(ROOT)
    data, bindir = ROOT / "data", ROOT / "bin"
    data.mkdir()
    bindir.mkdir()
    for dest, src in {
        "nvidia-smi.txt": "nvidia-smi/h100-sxm-8gpu.txt",
        "nvidia-smi-L.txt": "nvidia-smi/list-h100-8gpu.txt",
        # an 8-GPU node's whole `-q -x` (227 kB: parsing it is most of a host's client CPU)
        "nvidia-smi.xml": "nvidia-smi-xml/v100s-pcie-8gpu-busy-v11.xml",
        "nvidia-smi-topo.txt": "nvidia-smi-topo/h100-8gpu-nv18.txt",
        "dmesg.txt": "dmesg/driver-load-benign.txt",
        "lsmod.txt": "host-commands/lsmod-nvidia-peermem.txt",
        "nvidia-ctk.txt": "host-commands/nvidia-ctk-version.txt",
    }.items():
        shutil.copyfile(FIX / src, data / dest)
    scripts = {
        "nvidia-smi": SCRIPT.format(data=data),
        "dmesg": f"#!/bin/sh\ncat {data}/dmesg.txt\n",
        "lsmod": f"#!/bin/sh\ncat {data}/lsmod.txt\n",
        "nvidia-ctk": f"#!/bin/sh\ncat {data}/nvidia-ctk.txt\n",
    }
    for name, text in scripts.items():
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    key = ROOT / "id_ed25519"
    run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    shutil.chown(key, LAB_USER)
    authorized = ROOT / "authorized_keys"
    shutil.copyfile(f"{key}.pub", authorized)
    rng = random.Random(seed)
    hosts, known, inventory = [], [], {}
    Path("/run/sshd").mkdir(exist_ok=True)
    for i in range(n):
        kind = "normal"
        if i % 50 == 7:
            kind = "dead"
        elif i % 50 == 13:
            kind = "refusing"
        elif i % 25 == 3:
            kind = "slow"
        a, b = 10 + i // 16384, (i // 64) % 256
        host_ip = f"10.{200 + a}.{b}.{(i % 64) * 4 + 2}"
        root_ip = host_ip.rsplit(".", 1)[0] + f".{(i % 64) * 4 + 1}"
        h = Host(f"h{i:03d}", i, kind, host_ip, 5.0 if kind == "slow" else rng.uniform(0.3, 1.0))
        ns, outer, inner = f"cmb{i}", f"cmbh{i}", f"cmbn{i}"
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        run("ip", "link", "set", inner, "netns", ns)
        run("ip", "addr", "add", f"{root_ip}/30", "dev", outer)
        run("ip", "link", "set", outer, "up")
        run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{host_ip}/30", "dev", inner)
        run("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        if kind == "dead":  # frames to a MAC nobody has: every packet silently dropped
            run(
                "ip",
                "neigh",
                "replace",
                host_ip,
                "lladdr",
                "02:00:00:00:de:ad",
                "dev",
                outer,
                "nud",
                "permanent",
            )
        if kind in ("normal", "slow"):
            home = ROOT / "hosts" / h.name
            home.mkdir(parents=True)
            hk = home / "host_key"
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hk))
            cfg = home / "sshd_config"
            cfg.write_text(
                f"ListenAddress {host_ip}:22\nHostKey {hk}\nAuthorizedKeysFile {authorized}\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                f"StrictModes no\nPidFile {home / 'sshd.pid'}\nMaxSessions 64\n"
                "MaxStartups 200:30:400\n"
                f"SetEnv PATH={bindir}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin "
                f"BENCH_SMI_S={h.smi_s:.2f} DOCKER_HOST=unix://{home}/no-docker.sock\n"
            )
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)],
                stdout=subprocess.DEVNULL,
                stderr=open(home / "sshd.log", "wb"),  # noqa: SIM115
                start_new_session=True,
            )
            h.pid = proc.pid
            pub = (home / "host_key.pub").read_text().split()
            known.append(f"{host_ip} {pub[0]} {pub[1]}")
        hosts.append(h)
        inventory[h.name] = {
            "address": host_ip,
            "port": 22,
            "user": LAB_USER,
            "key_file": str(key),
            "gpus": 8,
        }
    import yaml

    (ROOT / "known_hosts").write_text("\n".join(known) + "\n")
    (ROOT / "inventory.yaml").write_text(yaml.safe_dump({"hosts": inventory}))
    (ROOT / "ansible.ini").write_text(
        "[fleet]\n"
        + "".join(
            f"{h.name} ansible_host={h.address} ansible_user={LAB_USER} "
            f"ansible_ssh_private_key_file={key}\n"
            for h in hosts
        )
    )
    (ROOT / "cudamedic.yaml").write_text(
        yaml.safe_dump(
            {
                "inventory": str(ROOT / "inventory.yaml"),
                "known_hosts": str(ROOT / "known_hosts"),
                "ssh_connect_timeout": CONNECT_TIMEOUT,
                "command_timeout": 30,
            }
        )
    )
    _wait_for_sshd([h for h in hosts if h.kind in ("normal", "slow")])
    return hosts


def _wait_for_sshd(hosts: list[Host]) -> None:
    import socket

    deadline = time.monotonic() + 60
    for h in hosts:
        while True:
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((h.address, 22)) == 0:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"sshd of {h.name} did not start")
            time.sleep(0.05)


def teardown() -> None:
    out = run("ip", "netns", "list", check=False).stdout.split("\n")
    for line in out:
        ns = line.split(" ")[0]
        if ns.startswith("cmb"):
            run("ip", "netns", "pids", ns, check=False)
            for pid in run("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            run("ip", "netns", "del", ns, check=False)
    for line in run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("cmbh"):
            run("ip", "link", "del", name, check=False)
    shutil.rmtree(ROOT, ignore_errors=True)


# -- contenders ---------------------------------------------------------------------------------
def machine_cpu() -> float:
    """CPU seconds this machine has spent busy (every process: the tools and the hosts' sshd)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def measure(argv: list[str], env: dict[str, str], timeout: float = 1800) -> dict[str, float]:
    out_f, err_f = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - pipes fill up
    t0, busy0 = time.monotonic(), machine_cpu()
    proc = subprocess.Popen(argv, env=env, stdout=out_f, stderr=err_f)
    deadline = t0 + timeout
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    wall, busy = time.monotonic() - t0, machine_cpu() - busy0
    out_f.seek(0)
    err_f.seek(0)
    out = out_f.read().decode(errors="replace")
    err = err_f.read().decode(errors="replace")[-4000:]
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "rss": usage.ru_maxrss / 1024,
        "machine_cpu": busy,
        "rc": os.waitstatus_to_exitcode(status),
        "out": out,
        "err": err,
    }  # type: ignore[dict-item]


NOPREFECT = """
import json, sys, time
from pathlib import Path
from runbooks.collect.inventory import load_inventory
from runbooks.core.runbook import load_runbook
from runbooks.core.settings import load_settings
from runbooks.diagnose.sweep import check_hosts
s = load_settings(); book = load_runbook(s.sweep_runbook, "sweep")
inv = load_inventory(s.inventory)
names = sys.argv[1:] or sorted(inv.hosts)
res = check_hosts(names, inv, s, book, Path(s.out_dir) / "noprefect")
print(json.dumps({r.health.host: [f.code for f in r.health.findings] for r in res}))
"""

PARAMIKO = """
import sys, paramiko, yaml
inv = yaml.safe_load(open(sys.argv[1]))["hosts"]
ok = 0
for name in sorted(inv):
    h = inv[name]
    c = paramiko.SSHClient(); c.load_host_keys(sys.argv[2])
    c.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        c.connect(h["address"], port=22, username=h["user"], key_filename=h["key_file"],
                  timeout=TIMEOUT, banner_timeout=TIMEOUT, auth_timeout=TIMEOUT, allow_agent=False,
                  look_for_keys=False)
        _, out, _ = c.exec_command(sys.argv[3], timeout=30); out.read(); ok += 1
    except Exception:
        pass
    finally:
        c.close()
print(ok)
""".replace("TIMEOUT", str(CONNECT_TIMEOUT))

PSSH = """
import sys, yaml
from pssh.clients import ParallelSSHClient
inv = yaml.safe_load(open(sys.argv[1]))["hosts"]
names = sorted(inv); first = inv[names[0]]
client = ParallelSSHClient([inv[n]["address"] for n in names], user=first["user"],
                           pkey=first["key_file"], pool_size=100, timeout=TIMEOUT, num_retries=1)
out = client.run_command(sys.argv[2], stop_on_errors=False)
client.join(out, timeout=60)
ok = 0
for o in out:
    if o.exception is None:
        list(o.stdout); ok += 1
print(ok)
""".replace("TIMEOUT", str(CONNECT_TIMEOUT))


# -- cudamedic on a work pool: Prefect on PostgreSQL, workers as separate processes ----------
def _proc_cpu(pid: int) -> float:
    """CPU seconds of `pid` and of its children it has reaped (a worker's finished flow runs)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _tree_rss(pid: int) -> float:
    """MiB resident in `pid` and every process under it, now."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _stop(proc: subprocess.Popen[bytes]) -> tuple[float, float]:
    """Stop a worker (SIGINT to its group, SIGKILL after 20 s): its total CPU seconds with every
    flow run it started, and the peak RSS (MiB) of its largest process."""
    import signal

    os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + 20
    while True:
        pid, _, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            _, _, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.1)
    proc.returncode = 0
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def _online(api: str, pool: str, count: int, timeout: float = 120) -> None:
    from prefect import get_client

    from tests.fleet import use_api

    deadline = time.monotonic() + timeout
    with use_api(api), get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            workers = client.read_workers_for_work_pool(pool)
            if sum(1 for w in workers if str(w.status).endswith("ONLINE")) >= count:
                return
            time.sleep(0.5)
    raise SystemExit(f"{count} workers of {pool} not online in {timeout} s")


def pool_sweep(api: str, env: dict[str, str], work: Path, workers: int) -> dict[str, object]:
    """The deployed distributed sweep (deploy/prefect.yaml) of every host on `workers` workers:
    wall time from the trigger to the run's end, the workers' CPU and RSS during it."""
    import threading

    from prefect import get_client
    from prefect.deployments import run_deployment

    from tests.fleet import use_api, work_pool

    names = tuple(f"w{i + 1}" for i in range(workers))
    base = {
        **env,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "CUDAMEDIC_FLEET": f"bench-{os.getpid()}-{time.time_ns()}",
    }
    root = Path(tempfile.mkdtemp(prefix="pool-", dir=work))
    with work_pool(api, base, root, names, limit=3) as pool:
        _online(api, pool.name, workers)
        time.sleep(2)  # the workers' start-up is over: what follows is the sweep's
        cpu0 = {w: _proc_cpu(p.pid) for w, p in pool.procs.items()}
        peak = {w: 0.0 for w in names}
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.5):
                for w, p in pool.procs.items():
                    peak[w] = max(peak[w], _tree_rss(p.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0, busy0 = time.monotonic(), machine_cpu()
        with use_api(api):
            run = run_deployment("fleet-health-check/fleet-sweep", timeout=0)
            with get_client(sync_client=True) as client:
                while True:
                    run = client.read_flow_run(run.id)
                    if run.state is not None and run.state.is_final():
                        break
                    if time.monotonic() - t0 > 1800:
                        break
                    time.sleep(0.2)
                wall, busy = time.monotonic() - t0, machine_cpu() - busy0
                rows = _sweep_rows(client, run.id)
        done.set()
        sampler.join()
        usage = {w: _stop(p) for w, p in pool.procs.items()}
        log_tail = pool.worker_logs()[-3000:]
    ran = (run.end_time - run.start_time).total_seconds() if run.end_time and run.start_time else 0
    return {
        "wall": wall,
        "run_s": ran,
        "cpu": sum(usage[w][0] - cpu0[w] for w in names),
        "rss": max(u[1] for u in usage.values()),
        "tree_rss": max(peak.values()),
        "machine_cpu": busy,
        "rc": 0 if run.state is not None and run.state.is_completed() else 1,
        "out": json.dumps(rows),
        "err": "" if run.state is not None and run.state.is_completed() else log_tail,
    }


def _sweep_rows(client: object, run_id: object) -> dict[str, list[str]]:
    """Host -> finding codes, from the sweep run's `fleet-sweep-hosts` table."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    arts = client.read_artifacts(  # type: ignore[attr-defined]
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
    )
    for a in arts:
        if a.key == "fleet-sweep-hosts":
            data = json.loads(a.data) if isinstance(a.data, str) else a.data
            return {
                r["host"]: [c.split("@")[0] for c in str(r["findings"]).split(", ") if c != "-"]
                for r in data
            }
    return {}


def ensure_tools() -> Path:
    py = BENCH_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
    have = subprocess.run([str(py), "-c", "import ansible, pssh, matplotlib"], capture_output=True)
    if have.returncode != 0:
        subprocess.run(
            [
                str(py),
                "-m",
                "pip",
                "install",
                "-q",
                "ansible-core",
                "parallel-ssh",
                "matplotlib",
                "pyyaml",
            ],
            check=True,
        )
    return py


TOOLS = ("sweep", "noprefect", "pool2", "pool1", "ansible", "pssh", "sequential")
NAMES = {
    "sweep": "cudamedic sweep",
    "noprefect": "cudamedic, no Prefect",
    "pool2": "cudamedic, 2 workers on PostgreSQL",
    "pool1": "cudamedic, 1 worker on PostgreSQL",
    "ansible": "ansible -f 50 -m command",
    "pssh": "parallel-ssh",
    "sequential": "sequential paramiko",
}


def contenders(
    hosts: list[Host],
    bench_py: Path,
    work: Path,
    api: str,
    pool_api: str | None,
    tools: list[str],
) -> dict[str, dict[str, object]]:
    env = {
        **os.environ,
        "CUDAMEDIC_CONFIG": str(ROOT / "cudamedic.yaml"),
        "CUDAMEDIC_STATE_DIR": str(work / "state"),
        "CUDAMEDIC_OUT_DIR": str(work / "out"),
        "PREFECT_API_URL": api,
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    inv, known = str(ROOT / "inventory.yaml"), str(ROOT / "known_hosts")
    results: dict[str, dict[str, object]] = {}
    for tool in tools:
        fresh = {**env, "CUDAMEDIC_FLEET": f"bench-{tool}-{time.time_ns()}"}  # all news
        if tool == "sweep":
            results[NAMES[tool]] = measure(
                [str(REPO / ".venv/bin/cudamedic"), "sweep", "--json"], fresh
            )
        elif tool == "noprefect":
            results[NAMES[tool]] = measure([PY, "-c", NOPREFECT], fresh)
        elif tool in ("pool1", "pool2") and pool_api:
            results[NAMES[tool]] = pool_sweep(pool_api, fresh, work, int(tool[-1]))
        elif tool == "ansible":
            results[NAMES[tool]] = measure(_ansible_argv(bench_py), _ansible_env(env, work, known))
        elif tool == "pssh":
            results[NAMES[tool]] = measure([str(bench_py), "-c", PSSH, inv, ONE_SHELL], env)
        elif tool == "sequential" and len(hosts) <= SEQUENTIAL_MAX:  # minutes beyond that
            results[NAMES[tool]] = measure([PY, "-c", PARAMIKO, inv, known, ONE_SHELL], env)
        print(f"  {tool} done", flush=True)
    # The slowest single host's own time (same tool, alone): a slow host, and a dead one.
    slow = next(h for h in hosts if h.kind == "slow")
    dead = next((h for h in hosts if h.kind == "dead"), None)
    alone = [float(measure([PY, "-c", NOPREFECT, slow.name], env)["wall"])]
    if dead:
        alone.append(float(measure([PY, "-c", NOPREFECT, dead.name], env)["wall"]))
    results["_slowest_host"] = {"wall": max(alone)}
    return results


def _ansible_env(env: dict[str, str], work: Path, known: str) -> dict[str, str]:
    return {
        **env,
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_SSH_ARGS": f"-o UserKnownHostsFile={known} -o ConnectTimeout={CONNECT_TIMEOUT}"
        " -o ControlMaster=no",
        "ANSIBLE_PYTHON_INTERPRETER": "/usr/bin/python3",
        "ANSIBLE_TIMEOUT": str(CONNECT_TIMEOUT),
        "ANSIBLE_LOCAL_TEMP": str(work / "ansible-tmp"),
        "ANSIBLE_REMOTE_TEMP": "/tmp/.ansible-bench",
    }


def _ansible_argv(bench_py: Path) -> list[str]:
    return [
        str(bench_py.parent / "ansible"), "all", "-i", str(ROOT / "ansible.ini"), "-f", "50",
        "-m", "command", "-a", f"sh -c '{ONE_SHELL}'",
    ]  # fmt: skip


@contextlib.contextmanager
def pool_server(work: Path) -> Iterator[str]:
    """PostgreSQL and a Prefect server on it (the test harness's, tests/fleet.py): its API URL."""
    from tests.fleet import postgres, prefect_on

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    with postgres(ports[0]) as pg, prefect_on(pg, ports[1]) as api:
        yield api


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 300])
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--out", default="bench-sweep.png")
    ap.add_argument("--keep", action="store_true", help="leave the last fleet running")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root (network namespaces, sshd)")
    bench_py = ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="cudamedic-bench-sweep-"))
    from runbooks.core.settings import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Settings(prefect_port=port, prefect_home=work / "prefect")
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    from flows.server import ensure_local_server, stop_local_server

    api = ensure_local_server(server)
    table: dict[int, dict[str, dict[str, object]]] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(stop_local_server, server)
        if not args.keep:
            stack.callback(teardown)
        pool_api = None
        if {"pool1", "pool2"} & set(args.tools):
            pool_api = stack.enter_context(pool_server(work))
        for n in args.sizes:
            t0 = time.monotonic()
            hosts = build_fleet(n)
            print(
                f"fleet of {n} hosts up in {time.monotonic() - t0:.1f} s "
                f"({sum(h.kind == 'dead' for h in hosts)} dead, "
                f"{sum(h.kind == 'refusing' for h in hosts)} refusing, "
                f"{sum(h.kind == 'slow' for h in hosts)} slow)",
                flush=True,
            )
            table[n] = contenders(hosts, bench_py, work, api, pool_api, args.tools)
            report(n, table[n])
    (work / "results.json").write_text(
        json.dumps(
            {
                n: {
                    k: {m: v for m, v in r.items() if m not in ("out", "err")}
                    for k, r in res.items()
                }
                for n, res in table.items()
            },
            indent=1,
        )
    )
    chart(table, Path(args.out), bench_py)
    print(f"raw figures: {work / 'results.json'}")


UNCHECKED = {"host-unreachable", "check-failed"}


def answered(name: str, out: str) -> int:
    """Hosts the tool got a full answer from (live hosts: all but the dead and refusing)."""
    import re

    try:
        if name == "cudamedic sweep":
            doc = json.loads(out)
            unchecked = {c["host"] for c in doc["changes"] if c["code"] in UNCHECKED}
            return int(doc["hosts"]) - len(unchecked)
        if name.startswith("cudamedic"):
            codes = json.loads(out.strip().splitlines()[-1])
            return sum(1 for found in codes.values() if not UNCHECKED & set(found))
    except (ValueError, IndexError, KeyError, TypeError):
        return 0
    if name.startswith("ansible"):
        return len(re.findall(r"^\S+ \| (?:CHANGED|SUCCESS) \|", out, re.M))
    try:
        return int(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0


def report(n: int, res: dict[str, dict[str, object]]) -> None:
    def f(name: str, key: str) -> float:
        return float(res[name][key]) if name in res else float("nan")  # type: ignore[arg-type]

    slowest = f("_slowest_host", "wall")

    def per_host(name: str) -> float:
        """CPU seconds per host answered (a tool that gives up on hosts does less work)."""
        if name not in res:
            return float("nan")
        return f(name, "cpu") / max(1, answered(name, str(res[name]["out"])))

    pssh_cpu = per_host("parallel-ssh")
    print(f"\n{n} hosts (slowest single host alone: {slowest:.1f} s)")
    print(
        "| tool | hosts answered | wall s | × slowest host | CPU s | CPU ms/answered host "
        "| × parallel-ssh CPU | peak RSS MiB (largest process / whole worker) "
        "| machine CPU s (all processes) | exit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        if name.startswith("_"):
            continue
        rss = f"{f(name, 'rss'):.0f}" + (f" / {f(name, 'tree_rss'):.0f}" if "tree_rss" in r else "")
        print(
            f"| {name} | {answered(name, str(r['out']))} | {f(name, 'wall'):.1f} | "
            f"{f(name, 'wall') / slowest:.2f} | {f(name, 'cpu'):.1f} | "
            f"{1000 * per_host(name):.0f} | "
            f"{per_host(name) / pssh_cpu:.2f} | {rss} | {f(name, 'machine_cpu'):.0f} | "
            f"{r['rc']} |"
        )
        if r["rc"]:
            print(str(r["err"])[-1500:])
    goal = 1.3 * slowest + 5
    for name in [k for k in res if k.startswith("cudamedic")]:
        wall, cpu = f(name, "wall"), per_host(name)
        rss = f(name, "tree_rss") if "tree_rss" in res[name] else f(name, "rss")
        print(
            f"goals, {name}: wall <= 1.3 x slowest + 5 s: {wall:.1f} <= {goal:.1f} "
            f"{'met' if wall <= goal else 'NOT met'}; CPU/host <= 2 x parallel-ssh's: "
            f"{cpu / pssh_cpu:.2f}x {'met' if cpu <= 2 * pssh_cpu else 'NOT met'}; "
            f"RSS per worker < 150 MiB: {rss:.0f} {'met' if rss < 150 else 'NOT met'}",
            flush=True,
        )


def chart(table: dict[int, dict[str, dict[str, object]]], out: Path, bench_py: Path) -> None:
    data: dict[str, list[tuple[int, float]]] = {}
    for n, res in sorted(table.items()):
        for name, r in res.items():
            if not name.startswith("_"):
                data.setdefault(name, []).append((n, float(r["wall"])))  # type: ignore[arg-type]
    code = (
        "import json, sys, matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot as plt\n"
        "d = json.loads(sys.argv[1]); fig, ax = plt.subplots(figsize=(7, 4.5))\n"
        "for k, pts in d.items():\n"
        "    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=k)\n"
        "ax.set_xlabel('hosts'); ax.set_ylabel('sweep wall time (s)'); ax.set_yscale('log')\n"
        "ax.grid(True, alpha=.3); ax.legend(); ax.set_title('Fleet sweep fan-out (2 cores)')\n"
        "fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)\n"
    )
    done = subprocess.run([str(bench_py), "-c", code, json.dumps(data), str(out)])
    if done.returncode == 0:
        print(f"chart: {out}")


if __name__ == "__main__":
    main()
