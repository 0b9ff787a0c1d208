"""The replay lab: any corpus case (tests/corpus/*) replayed live, the way a user meets it.

A case is a bundle of real evidence from a public thread. Replaying it means putting that evidence
back where cudamedic collects it from, and collecting it for real:
- a simulated host (a real sshd, like the lab's hosts) whose commands answer with the case's host
  files: `nvidia-smi` (table, `-q -x`, `-L`, `topo -m`), `dmesg`, `df`, `uname`, `lsmod`, the
  toolkit's `--version`, `all_reduce_perf`, and any other command output the case holds
  (`commands/NAME.txt`, answered by a command `case-NAME`: a team's own runbook command);
- a Docker engine of its own (so no other test's container is ever collected with it) running one
  container per case container: it prints the case's log on its standard output and exits, or
  stays up, as the case says, with the HostConfig the case implies (`plan_case`, below);
- the case's trigger text as the response's trigger.
The collection runs with the packaged incident runbook, less the host commands the case holds no
recording of (a real host would answer them; the replay never invents an answer) but for
`uname -a` (the machine's own: no judgment reads it) and, on the host without the toolkit, the
toolkit's `--version` (which really fails there), plus the case's own commands.

HostConfig of a replayed container, in order:
1. the case's `containers/NAME.inspect.json`, where it has one: its image reference (the lab's
   image tagged with it), GPUs through `DeviceRequests` or the `nvidia` runtime, `ShmSize`,
   `IpcMode`, `Ulimits`, `CapAdd`, `Binds` (an empty directory stands for each host path), its
   environment, and `State`: running, or its exit code (without a `State`, running when the
   case holds probes recorded inside it);
2. otherwise the default for the case's kind (its labelled class): a plain `docker run --gpus all`
   (Docker's defaults: a private IPC namespace, a 64 MB `/dev/shm`, the engine's limits), changed
   only where the kind says otherwise:
   `gpu-not-requested`: no GPUs asked for (the image's `NVIDIA_VISIBLE_DEVICES=all` stays, as in
   NVIDIA's CUDA images); `container-toolkit-missing`: the engine without the toolkit's hook, no
   GPUs asked for; `healthy`: the container keeps running;
   every other kind exits with code 1 after printing its log (a container the case holds probe
   recordings of keeps running: they were recorded in it).
Probes inside a running container: where the case holds recordings of probes run in it
(`containers/NAME.exec-torch.txt`, `.exec-nvidia-smi-L.txt`, `.exec-shm.txt`, and a person's
`.exec-nvidia-smi.txt`, which the runbook then asks for as a probe of its own), the runbook runs
those probes only, answered by shims first on the container's PATH (`python3`, `nvidia-smi`,
`df`): the others' answers are unknown. A container without recordings gets the packaged probes,
run for real in the busybox image (`nvidia-smi -L` through the lab's hook shim where it has GPUs).

An inspect whose `State.OOMKilled` is true is replayed for real: the container gets a 16 MB memory
limit and, after its log, a process that eats memory, so the kernel kills it and the engine says
so. A container the engine refuses to create (the case's `Runtime: nvidia` on the engine without
the toolkit: "Unknown runtime specified nvidia") is the incident itself: the replay is then what
a user has, the case's trigger and the container's log as the pasted text, and no container.
What cannot be replayed makes a case not replayable (`ReplayPlan.unreplayable`, with the
reason): a `docker-info.json` (the engine answers for itself).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.lab import lab as lab_mod
from tests.lab.lab import IMAGE, LAB_USER, EngineInfo

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "corpus"
INCIDENT_RUNBOOK = REPO / "runbooks" / "incident.yaml"
# The image's own environment, as NVIDIA's CUDA images set it: what makes a container one that
# "should have GPUs" for the collector, whether or not GPUs were asked for.
IMAGE_ENV = {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}
SHIM_DIR = "/replay/bin"
_VOLUME_NAME = re.compile(
    r"^[a-zA-Z0-9][a-zA-Z0-9_.-]*$"
)  # Docker's named volumes  # first on the replayed container's PATH
MAX_NAME = 40  # HostSource.name: ^[A-Za-z0-9][A-Za-z0-9_.-]{0,40}$

# Case file -> (data file of the simulated host, the packaged incident runbook's source name).
_HOST_FILES = {
    "nvidia-smi.txt": ("nvidia-smi.txt", "nvidia-smi"),
    "nvidia-smi.xml": ("nvidia-smi.xml", "nvidia-smi-xml"),
    "commands/nvidia-smi-L.txt": ("nvidia-smi-L.txt", "nvidia-smi-list"),
    "commands/nvidia-smi-topo.txt": ("nvidia-smi-topo.txt", "nvidia-topo"),
    "dmesg.txt": ("dmesg.txt", "kernel-log"),
    "commands/df.txt": ("df.txt", "df"),
    "commands/uname.txt": ("uname.txt", "uname"),
    "commands/lsmod-nvidia.txt": ("lsmod.txt", "lsmod-nvidia"),
    "commands/container-toolkit.txt": ("nvidia-ctk.txt", "container-toolkit"),
}
# Host data file -> the command that answers with it on the simulated host (its script).
_HOST_SCRIPTS = {
    "df.txt": "df",
    "uname.txt": "uname",
    "lsmod.txt": "lsmod",
    "nvidia-ctk.txt": "nvidia-ctk",
}
_NOT_REPLAYABLE = {
    "docker-info.json": "docker-info.json is what the engine says of itself: the replay's engine "
    "answers for itself",
}


@dataclass
class ContainerPlan:
    name: str
    log: bytes
    engine: str = "gpu"  # "gpu" (the toolkit's hook shim) or "plain" (no toolkit)
    gpus: bool = True
    exit_code: int | None = 1  # None: keeps running
    shm_size: int | None = None  # bytes; None: the engine's default (64 MB)
    ipc_mode: str | None = None
    ulimits: list[dict[str, Any]] = field(default_factory=list)
    cap_add: list[str] = field(default_factory=list)
    runtime: str | None = None
    image: str | None = None  # the case's image reference: the lab image is tagged with it
    oom_killed: bool = False  # the kernel kills it for its memory limit, for real
    binds: list[str] = field(default_factory=list)  # the case's HostConfig.Binds
    env: dict[str, str] = field(default_factory=lambda: dict(IMAGE_ENV))
    shims: dict[str, bytes] = field(default_factory=dict)  # recorded probe answers, by file
    config_from: str = "default"  # "inspect" or "default:<kind>"


@dataclass
class ReplayPlan:
    case: str
    incident: str
    host_files: dict[str, bytes] = field(default_factory=dict)  # host data file -> content
    extra_commands: dict[str, bytes] = field(default_factory=dict)  # case-NAME -> output
    sources: list[str] = field(default_factory=list)  # packaged source names kept
    nccl_tests: bool = False
    containers: list[ContainerPlan] = field(default_factory=list)
    trigger: str | None = None
    unreplayable: list[str] = field(default_factory=list)

    @property
    def engine(self) -> str:
        engines = {c.engine for c in self.containers}
        return "plain" if "plain" in engines else "gpu"

    def runbook(self) -> dict[str, Any]:
        """The packaged incident runbook, less the host commands the case has no recording of,
        plus a command for each of the case's own command outputs."""
        book = yaml.safe_load(INCIDENT_RUNBOOK.read_text())
        # `uname -a` always (a runbook needs one host command; this one answers for real when
        # the case has no recording of it, and no judgment reads it).
        keep = {*self.sources, "uname"}
        if self.engine == "plain":  # the toolkit's absence is real there: asked for real
            keep.add("container-toolkit")
        book["host_sources"] = [s for s in book["host_sources"] if s["name"] in keep]
        for command in sorted(self.extra_commands):
            name = command.removeprefix("case-")
            book["host_sources"].append(
                {"name": name, "path": f"commands/{name}.txt", "command": command}
            )
        book["nccl_tests"] = self.nccl_tests
        recorded = sorted({probe for c in self.containers for probe in c.shims})
        if recorded:  # only the probes the case holds answers for (see the module's docstring)
            book["container_probes"] = [
                {"name": "nvidia-smi", "argv": ["nvidia-smi"]} if p == "nvidia-smi" else p
                for p in recorded
            ]
        return book


def _default_container(name: str, log: bytes, kind: str) -> ContainerPlan:
    plan = ContainerPlan(name=name, log=log, config_from=f"default:{kind}")
    if kind == "gpu-not-requested":
        plan.gpus = False
    elif kind == "container-toolkit-missing":
        plan.engine, plan.gpus = "plain", False
    elif kind == "healthy":
        plan.exit_code = None
    return plan


def _from_inspect(
    name: str, log: bytes, raw: Any, plan: ReplayPlan, probes: dict[str, bytes]
) -> ContainerPlan:
    data = raw[0] if isinstance(raw, list) and raw else raw
    data = data if isinstance(data, dict) else {}
    host = data.get("HostConfig") or {}
    state = data.get("State") or {}
    config = data.get("Config") or {}
    env = dict(
        item.split("=", 1)
        for item in config.get("Env") or []
        if isinstance(item, str) and "=" in item and not item.startswith("PATH=")
    )
    runtime = host.get("Runtime")
    # Without a State, the container ran when the case's probes were recorded in it.
    probed = "Running" not in state and any(p.startswith("exec-") for p in probes)
    container = ContainerPlan(
        name=name,
        log=log,
        gpus=bool(host.get("DeviceRequests")),
        exit_code=None if state.get("Running") or probed else int(state.get("ExitCode") or 1),
        shm_size=host.get("ShmSize") or None,
        ipc_mode=host.get("IpcMode") or None,
        ulimits=[u for u in host.get("Ulimits") or [] if isinstance(u, dict)],
        cap_add=[c for c in host.get("CapAdd") or [] if isinstance(c, str)],
        runtime=runtime if runtime == "nvidia" else None,
        image=str(config.get("Image") or data.get("Image") or "") or None,
        binds=[b for b in host.get("Binds") or [] if isinstance(b, str)],
        env=env,
        config_from="inspect",
    )
    container.oom_killed = bool(state.get("OOMKilled"))
    if plan.incident == "container-toolkit-missing":
        container.engine = "plain"
    return container


def plan_case(case: Path) -> ReplayPlan:
    """What to put on the replay host and engine for one corpus case (PURE: reads its files)."""
    meta = yaml.safe_load((case / "case.yaml").read_text())
    plan = ReplayPlan(case=case.name, incident=str(meta["incident"]))
    files = sorted(p.relative_to(case).as_posix() for p in case.rglob("*") if p.is_file())
    names: dict[str, dict[str, bytes]] = {}
    for rel in files:
        data = (case / rel).read_bytes()
        if rel == "case.yaml":
            continue
        if rel == "trigger.txt":
            plan.trigger = data.decode("utf-8", "replace")
        elif rel in _HOST_FILES:
            dest, source = _HOST_FILES[rel]
            plan.host_files[dest] = data
            plan.sources.append(source)
        elif rel == "nccl-tests.txt":
            plan.host_files["nccl-tests.txt"] = data
            plan.nccl_tests = True
        elif rel in _NOT_REPLAYABLE:
            plan.unreplayable.append(_NOT_REPLAYABLE[rel])
        elif rel.startswith("commands/") and rel.count("/") == 1 and rel.endswith(".txt"):
            name = rel.removeprefix("commands/").removesuffix(".txt")[:MAX_NAME]
            plan.extra_commands[f"case-{name}"] = data
        elif rel.startswith("containers/") and rel.count("/") == 1:
            stem = rel.removeprefix("containers/")
            cname, _, rest = stem.partition(".")
            names.setdefault(cname, {})[rest] = data
        else:
            plan.unreplayable.append(f"{rel}: not a file of the bundle layout the replay knows")
    for cname, parts in sorted(names.items()):
        log = parts.pop("log", b"")
        inspect = parts.pop("inspect.json", None)
        if inspect is not None:
            container = _from_inspect(cname, log, json.loads(inspect), plan, parts)
        else:
            container = _default_container(cname, log, plan.incident)
            if parts:  # probes were recorded in it: it ran
                container.exit_code = None
        for rest, data in parts.items():
            probe = rest.removeprefix("exec-").removesuffix(".txt")
            if probe in ("torch", "nvidia-smi", "nvidia-smi-L", "shm"):
                container.shims[probe] = data
            else:
                plan.unreplayable.append(f"containers/{cname}.{rest}: no replay for this probe")
        plan.containers.append(container)
    return plan


# -- the simulated host and its engines ----------------------------------------------------------
_CASE_CMD = """#!/bin/sh
cat {data}/case/{file}
"""
# The replayed container's command: print the case's log as recorded, then exit or stay up.
_WORKLOAD = """#!/bin/sh
cat /replay/log
if [ -f /replay/oom ]; then exec tail /dev/zero; fi
if [ -f /replay/exit-code ]; then exit "$(cat /replay/exit-code)"; fi
exec sleep 36000
"""
OOM_LIMIT = "16m"  # a replayed OOM kill: this memory limit, then a process that eats memory
_PY_SHIM = """#!/bin/sh
cat /replay/probe-torch.txt
"""
_SMI_SHIM = """#!/bin/sh
if [ "$1" = "-L" ]; then f=/replay/probe-nvidia-smi-L.txt; else f=/replay/probe-nvidia-smi.txt; fi
if [ -f "$f" ]; then cat "$f"; exit 0; fi
exec /usr/local/bin/nvidia-smi "$@"
"""
_DF_SHIM = """#!/bin/sh
if [ "$*" = "-h /dev/shm" ]; then cat /replay/probe-shm.txt; exit 0; fi
exec /bin/df "$@"
"""


class EngineRefused(RuntimeError):
    """The engine would not create or start the case's container: that refusal is the incident
    itself (e.g. "Unknown runtime specified nvidia"), and there is no container to collect."""


@dataclass
class ReplayLab:
    dir: str
    engines: dict[str, EngineInfo]
    hosts: dict[str, lab_mod.HostInfo]  # "replay-gpu", "replay-plain"
    user_key: str
    known_hosts: str
    inventory: str
    config: str

    def save(self) -> None:
        Path(self.dir, "replay.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, directory: Path) -> ReplayLab | None:
        try:
            raw = json.loads((directory / "replay.json").read_text())
        except (OSError, ValueError):
            return None
        raw["engines"] = {k: EngineInfo(**v) for k, v in raw["engines"].items()}
        raw["hosts"] = {k: lab_mod.HostInfo(**v) for k, v in raw["hosts"].items()}
        return cls(**raw)

    def alive(self) -> bool:
        pids = [e.pid for e in self.engines.values()] + [h.pid for h in self.hosts.values()]
        return bool(pids) and all(lab_mod._ours(p, self.dir) for p in pids)

    def host_for(self, plan: ReplayPlan) -> str:
        return f"replay-{plan.engine}"

    def engine_url(self, plan: ReplayPlan) -> str:
        return self.engines[f"r{plan.engine}"].url

    def load_case(self, plan: ReplayPlan) -> str:
        """Put one case on its host and engine (replacing the last one); returns the host name.
        Blocks until every container has printed its log (and exited, where it exits)."""
        host = self.hosts[self.host_for(plan)]
        for engine in self.engines.values():
            _clear_engine(engine)
        _write_host(Path(host.data), plan)
        work = Path(self.dir, "replay-work")
        if work.exists():
            shutil.rmtree(work)
        for container in plan.containers:
            _run_container(self.engines[f"r{container.engine}"], work / container.name, container)
        return host.name

    def load_refused(self, plan: ReplayPlan, refusal: str) -> tuple[str, str]:
        """A case whose container the engine refused to create: its host, and the text a user
        pastes then (the trigger and what the workload would have printed)."""
        host = self.hosts[self.host_for(plan)]
        for engine in self.engines.values():
            _clear_engine(engine)
        _write_host(Path(host.data), plan)
        logs = [c.log.decode("utf-8", "replace") for c in plan.containers]
        return host.name, "\n".join(t for t in [plan.trigger or "", *logs] if t.strip())


def _clear_engine(engine: EngineInfo) -> None:
    ids = _docker(engine, "ps", "-aq").split()
    if ids:
        _docker(engine, "rm", "-f", *ids)


def _docker(engine: EngineInfo, *args: str) -> str:
    proc = subprocess.run(
        ["docker", "-H", engine.url, *args], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])}: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def _write_host(data: Path, plan: ReplayPlan) -> None:
    """The simulated host's recorded answers and command scripts for this case only."""
    bindir = data.parent / "bin"
    for d in (data, bindir):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    (data / "case").mkdir()
    for dest, content in plan.host_files.items():
        (data / dest).write_bytes(content)
    scripts = {"nvidia-smi": lab_mod._NVIDIA_SMI, "dmesg": lab_mod._DMESG}
    if plan.nccl_tests:
        scripts["all_reduce_perf"] = lab_mod._ALL_REDUCE
        (data / "nccl-tests.seconds").write_text("0")
    for dest, command in _HOST_SCRIPTS.items():
        if dest in plan.host_files:
            scripts[command] = lab_mod._CAT.replace("{file}", dest)
    for command, content in plan.extra_commands.items():
        (data / "case" / f"{command}.txt").write_bytes(content)
        scripts[command] = _CASE_CMD.replace("{file}", f"{command}.txt")
    for name, text in scripts.items():
        path = bindir / name
        path.write_text(text.format(data=data, scenario=plan.case))
        path.chmod(0o755)


def _run_container(engine: EngineInfo, work: Path, c: ContainerPlan) -> None:
    work.mkdir(parents=True)
    (work / "bin").mkdir()
    (work / "log").write_bytes(c.log)
    (work / "run").write_text(_WORKLOAD)
    if c.exit_code is not None:
        (work / "exit-code").write_text(str(c.exit_code))
    if c.oom_killed:
        (work / "oom").write_text("")
    shims = {"torch": ("python3", _PY_SHIM), "shm": ("df", _DF_SHIM)}
    for probe, content in c.shims.items():
        (work / f"probe-{probe}.txt").write_bytes(content)
        command, script = shims.get(probe, ("nvidia-smi", _SMI_SHIM))
        (work / "bin" / command).write_text(script)
    for path in work.rglob("*"):
        path.chmod(
            0o755 if path.is_dir() or path.parent.name == "bin" or path.name == "run" else 0o644
        )
    work.chmod(0o755)
    args = ["create", "--name", c.name, "--network", "none", "-v", f"{work}:/replay:ro"]
    for bind in c.binds:
        source, _, rest = bind.partition(":")
        target = rest.split(":", 1)[0]
        if not target.startswith("/") or target.rstrip("/") in ("", "/replay"):
            continue
        if not _VOLUME_NAME.match(source):  # an empty directory stands for the host's path
            stand_in = work / "binds" / re.sub(r"[^A-Za-z0-9_./-]", "_", source).strip("/.")
            stand_in.mkdir(parents=True, exist_ok=True)
            source = str(stand_in)
        args += ["-v", f"{source}:{target}:ro"]
    env = {**c.env, "PATH": f"{SHIM_DIR}:/usr/local/bin:/usr/bin:/bin"}
    for key, value in sorted(env.items()):
        args += ["-e", f"{key}={value}"]
    if c.gpus:
        args += ["--gpus", "all"]
    if c.runtime:
        args += ["--runtime", c.runtime]
    if c.shm_size:
        args += ["--shm-size", str(c.shm_size)]
    if c.oom_killed:
        args += ["--memory", OOM_LIMIT, "--memory-swap", OOM_LIMIT]
    if c.ipc_mode:
        args += ["--ipc", c.ipc_mode]
    for limit in c.ulimits:
        args += ["--ulimit", f"{limit.get('Name')}={limit.get('Soft')}:{limit.get('Hard')}"]
    for cap in c.cap_add:
        args += ["--cap-add", cap]
    image = IMAGE
    if c.image:
        try:
            _docker(engine, "tag", IMAGE, c.image)
            image = c.image
        except RuntimeError:
            pass  # not a valid reference ("MY_DOCKER_IMAGE"): the lab's own name
    try:
        _docker(engine, *args, image, "/bin/sh", "/replay/run")
        _docker(engine, "start", c.name)
    except RuntimeError as exc:
        raise EngineRefused(str(exc)) from exc
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = json.loads(_docker(engine, "inspect", "--format", "{{json .State}}", c.name))
        if c.exit_code is not None and not state.get("Running"):
            return
        if c.exit_code is None and _logged(engine, c):
            return
        time.sleep(0.05)
    raise RuntimeError(f"replayed container {c.name} did not finish printing its log")


def _logged(engine: EngineInfo, c: ContainerPlan) -> bool:
    """Has a running container printed its whole log yet?"""
    proc = subprocess.run(
        ["docker", "-H", engine.url, "logs", c.name], capture_output=True, timeout=60
    )
    return len(proc.stdout) + len(proc.stderr) >= len(c.log)


def up() -> ReplayLab:
    """Start (or reuse) the replay lab in the lab's directory: two engines of its own and two
    simulated hosts (the lab's main engines and hosts are not touched)."""
    root = lab_mod.lab_dir()
    existing = ReplayLab.load(root)
    if existing and existing.alive():
        return existing
    if existing:
        down(existing)
    root.mkdir(parents=True, exist_ok=True)
    lab_mod._ensure_user(root)
    root.chmod(0o755)
    rootfs = lab_mod._rootfs_tar()
    engines: dict[str, EngineInfo] = {}
    hosts: dict[str, lab_mod.HostInfo] = {}
    state = ReplayLab(str(root), engines, hosts, "", "", "", "")
    try:
        for name, gpu in (("rgpu", True), ("rplain", False)):
            runtimes = ("--add-runtime=nvidia=runc",) if gpu else ()
            engines[name] = lab_mod._start_engine(root, name, gpu, extra=runtimes)
            state.save()
            lab_mod._import_image(engines[name], rootfs)
        keys = root / "replay-keys"
        keys.mkdir(exist_ok=True)
        user_key = keys / "id_ed25519"
        if not user_key.exists():
            lab_mod._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(user_key))
        authorized = keys / "authorized_keys"
        shutil.copyfile(f"{user_key}.pub", authorized)
        known, inventory = [], {}
        for kind in ("gpu", "plain"):
            name = f"replay-{kind}"
            home = root / "hosts" / name
            if home.exists():
                shutil.rmtree(home)
            (home / "data").mkdir(parents=True)
            (home / "bin").mkdir()
            host_key = home / "ssh_host_ed25519_key"
            lab_mod._run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
            port = lab_mod._free_port()
            engine = engines[f"r{kind}"]
            pid = lab_mod._start_sshd(root, name, port, engine, home / "bin", host_key, authorized)
            hosts[name] = lab_mod.HostInfo(name, port, name, engine.name, pid, str(home / "data"))
            pub = Path(f"{host_key}.pub").read_text().split()
            known.append(f"[127.0.0.1]:{port} {pub[0]} {pub[1]}")
            inventory[name] = {
                "address": "127.0.0.1",
                "port": port,
                "user": LAB_USER,
                "key_file": str(user_key),
                "tags": ["replay"],
            }
            state.save()
        # The simulated hosts' commands read the case data as the lab user.
        for path in (root / "hosts", keys):
            for p in [path, *path.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o755)
        os.chmod(user_key, 0o600)
        state.user_key = str(user_key)
        state.known_hosts = str(root / "replay-known_hosts")
        Path(state.known_hosts).write_text("\n".join(known) + "\n")
        state.inventory = str(root / "replay-inventory.yaml")
        Path(state.inventory).write_text(yaml.safe_dump({"hosts": inventory}, sort_keys=True))
        state.config = str(root / "replay-cudamedic.yaml")
        Path(state.config).write_text(
            yaml.safe_dump(
                {
                    "inventory": state.inventory,
                    "known_hosts": state.known_hosts,
                    "ssh_connect_timeout": 5,
                    "command_timeout": 10,
                    "nccl_tests_budget": 10,
                    "nccl_tests_gpus": 8,
                }
            )
        )
        state.save()
    except BaseException:
        down(state)
        raise
    return state


def down(state: ReplayLab | None = None) -> None:
    state = state or ReplayLab.load(lab_mod.lab_dir())
    if state is None:
        return
    for host in state.hosts.values():
        lab_mod._terminate(host.pid)
    for engine in state.engines.values():
        try:
            _clear_engine(engine)
        except (RuntimeError, subprocess.SubprocessError):
            pass
        lab_mod._terminate(engine.pid, wait=20)
    Path(state.dir, "replay.json").unlink(missing_ok=True)
