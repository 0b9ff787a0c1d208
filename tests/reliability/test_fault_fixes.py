"""Fault injection into safe fixes on the real lab engines: the fixer SIGKILLed at every step
boundary for every safe fix kind, the Docker engine restarted mid-fix, and randomised
fault-injected recreates. After each, the next run's recovery must leave: the container (never
lost), its volume files (never lost), no duplicate, and the workload running.

`CUDAMEDIC_RELIABILITY=full` runs every (kind, boundary) pair and 200 randomised recreates.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
from docker.types import Mount

from runbooks.collect.remote.docker import DockerEngine
from runbooks.fix.journal import Journal
from runbooks.fix.recreate import BOUNDARIES, recover
from tests.lab.lab import IMAGE, LabState, restart_engine
from tests.reliability.figures import FULL, record, size, zero
from tests.reliability.recreate_driver import HOST, KINDS

SUITE = "faults: fixes"
WORKLOAD = (
    "[ -f /data/keep.txt ] || echo precious-$(date +%s)-$$ > /data/keep.txt; "
    "[ -f /cache/a.txt ] || echo anon-$$ > /cache/a.txt; "
    "trap 'exit 0' TERM; sleep 3600 & wait"  # stops at once on `docker stop`
)
RUN_BOUNDARIES = [b for b in BOUNDARIES if b not in ("rolling-back", "restore:done")]
ROLLBACK_BOUNDARIES = ["rolling-back", "restore:done"]


@dataclass
class Scenario:
    kind: str
    engine: str = "gpu"  # "plain" has no GPU hook: a GPU fix fails to start and rolls back
    crash_at: str | None = None
    restart_engine_after: float | None = None  # seconds after the fixer started
    restart_policy: str = "unless-stopped"
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    anonymous_volume: bool = True

    def expected(self) -> str | None:
        """The final state a deterministic scenario must end in: the new or the old container."""
        if self.restart_engine_after is not None:
            return None  # either, as long as nothing is lost
        fails = self.engine == "plain" and self.kind == "gpus"
        if fails or (self.crash_at is not None and self.crash_at != "verified"):
            return "old"
        return "new"

    def fixer_should(self) -> str | None:
        """How the fixer process itself must end for the scenario to be the one described:
        `killed` (SIGKILL at `crash_at`), or the outcome status it prints; None: either (an
        engine restart may or may not hit a step)."""
        if self.crash_at is not None:
            return "killed"
        if self.restart_engine_after is not None:
            return None
        return "rolled-back" if self.expected() == "old" else "fixed"

    def describe(self) -> str:
        fault = (
            f"kill at {self.crash_at}"
            if self.crash_at
            else f"engine restart at +{self.restart_engine_after:.1f}s"
            if self.restart_engine_after is not None
            else "no fault"
        )
        return f"{self.kind} on {self.engine} engine, {fault}, restart={self.restart_policy}"


@dataclass
class Tally:
    runs: int = 0
    lost_containers: int = 0
    lost_files: int = 0
    duplicates: int = 0
    not_running: int = 0
    wrong_state: int = 0
    not_as_planned: int = 0  # the fixer was not killed where asked, or ended otherwise
    recovered: int = 0
    tracebacks: int = 0
    seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def report(self, what: str) -> None:
        record(SUITE, f"{what}: fault-injected recreates", self.runs)
        zero(SUITE, f"{what}: containers lost", self.lost_containers)
        zero(SUITE, f"{what}: volume files lost", self.lost_files)
        zero(SUITE, f"{what}: duplicate containers left", self.duplicates)
        zero(SUITE, f"{what}: workloads not running at the end", self.not_running)
        zero(SUITE, f"{what}: wrong final state (old/new)", self.wrong_state)
        zero(SUITE, f"{what}: faults not injected as planned", self.not_as_planned)
        zero(SUITE, f"{what}: fixer tracebacks", self.tracebacks)
        record(SUITE, f"{what}: interrupted fixes finished by recovery", self.recovered)
        if self.seconds:
            record(SUITE, f"{what}: median seconds per scenario", statistics.median(self.seconds))


def _read(container: Any, path: str) -> str | None:
    try:
        res = container.exec_run(["cat", path])
    except docker.errors.APIError:
        return None
    return res.output.decode(errors="replace").strip() if res.exit_code == 0 else None


def _volume_file(client: docker.DockerClient, volume: str) -> str | None:
    try:
        out = client.containers.run(
            IMAGE,
            ["cat", "/data/keep.txt"],
            remove=True,
            network_mode="none",
            volumes={volume: {"bind": "/data"}},
        )
    except docker.errors.ContainerError:
        return None
    return bytes(out).decode().strip()


def _wait_for(predicate: Any, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def run_scenario(lab: LabState, sc: Scenario, state_dir: Path, tally: Tally) -> None:
    name = f"rel-{uuid.uuid4().hex[:10]}"
    url = lab.engines[sc.engine].url
    client = docker.DockerClient(base_url=url, timeout=60)
    vol = client.volumes.create(f"{name}-data")
    started = time.monotonic()
    try:
        rp: dict[str, Any] = {"Name": sc.restart_policy}
        if sc.restart_policy == "on-failure":
            rp["MaximumRetryCount"] = 3
        original = client.containers.run(
            IMAGE,
            ["sh", "-c", WORKLOAD],
            name=name,
            detach=True,
            network_mode="none",
            volumes={vol.name: {"bind": "/data"}},
            mounts=[Mount(target="/cache", source=None, type="volume")]
            if sc.anonymous_volume
            else [],
            environment=sc.env,
            labels=sc.labels,
            restart_policy=rp,
        )
        assert _wait_for(lambda: _read(original, "/data/keep.txt") is not None), name
        data = _read(original, "/data/keep.txt")
        anon = _read(original, "/cache/a.txt") if sc.anonymous_volume else None
        env = {k: v for k, v in os.environ.items() if k != "CUDAMEDIC_CRASH_AT"}
        if sc.crash_at:
            env["CUDAMEDIC_CRASH_AT"] = sc.crash_at
        fixer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reliability.recreate_driver",
                url,
                name,
                sc.kind,
                str(state_dir),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        if sc.restart_engine_after is not None:
            time.sleep(sc.restart_engine_after)
            restart_engine(lab, sc.engine)
        out, err = fixer.communicate(timeout=180)
        if "Traceback" in err:
            tally.tracebacks += 1
            tally.problems.append(f"{sc.describe()}: fixer traceback: {err[-600:]}")
        planned = _as_planned(sc, fixer.returncode, out)
        if planned is not None:
            tally.not_as_planned += 1
            tally.problems.append(f"{sc.describe()}: {planned}")
        # The next run: recovery finishes or rolls back what was interrupted, once.
        engine = DockerEngine.local(url, 30)
        try:
            journal = Journal(state_dir, HOST, name)
            if recover(engine, journal) is not None:
                tally.recovered += 1
            if recover(engine, journal) is not None:
                tally.problems.append(f"{sc.describe()}: a second recovery still found work")
        finally:
            engine.close()
        _check(client, sc, name, vol.name, original.id, data, anon, tally)
    finally:
        tally.runs += 1
        tally.seconds.append(time.monotonic() - started)
        for c in client.containers.list(all=True, filters={"name": name}):
            c.remove(force=True)
        try:
            vol.remove(force=True)
        except docker.errors.APIError:
            pass
        client.close()


def _as_planned(sc: Scenario, returncode: int, out: str) -> str | None:
    """Why the fixer did not end as the scenario plans (None: it did). A fixer that ended on its
    own before the boundary it was to be killed at (a refused or rolled-back fix) leaves the old
    container, which is also what most kills must leave: without this check such a scenario
    would pass without having tested its kill, and a kill at `verified` would read as a wrong
    recovery ("ended old, expected new") instead of naming what the fixer said."""
    should = sc.fixer_should()
    said = out.strip()[-600:] or "nothing"
    if should == "killed":
        if returncode != -signal.SIGKILL:
            return f"the fixer was not killed at {sc.crash_at}: exit {returncode}, it said {said}"
    elif should is not None and (returncode != 0 or not said.startswith(f"{should}:")):
        return f"the fixer should have printed {should}: exit {returncode}, it said {said}"
    return None


def _check(
    client: docker.DockerClient,
    sc: Scenario,
    name: str,
    volume: str,
    original_id: str,
    data: str | None,
    anon: str | None,
    tally: Tally,
) -> None:
    what = sc.describe()
    found = [c for c in client.containers.list(all=True) if c.name.startswith(name)]
    current = next((c for c in found if c.name == name), None)
    if current is None:
        tally.lost_containers += 1
        tally.problems.append(f"{what}: no container named {name}: {[c.name for c in found]}")
        return
    state = "old" if current.id == original_id else "new"
    backups = [c for c in found if "-cudamedic-backup-" in c.name]
    others = [c for c in found if c is not current and c not in backups]
    extra = len(others) + max(0, len(backups) - (1 if state == "new" else 0))
    if extra:
        tally.duplicates += extra
        tally.problems.append(f"{what}: left {[c.name for c in found]} (state {state})")
    if not _wait_for(lambda: client.containers.get(name).status == "running", 15):
        tally.not_running += 1
        tally.problems.append(f"{what}: {name} is {client.containers.get(name).status}")
    if _volume_file(client, volume) != data:
        tally.lost_files += 1
        tally.problems.append(f"{what}: /data/keep.txt is not {data!r}")
    if anon is not None and _read(client.containers.get(name), "/cache/a.txt") != anon:
        tally.lost_files += 1
        tally.problems.append(f"{what}: the anonymous volume lost /cache/a.txt")
    expected = sc.expected()
    if expected is not None and expected != state:
        tally.wrong_state += 1
        tally.problems.append(f"{what}: ended {state}, expected {expected}")


def _assert_clean(tally: Tally) -> None:
    assert not tally.problems, "\n".join(tally.problems)


def test_fixer_killed_at_every_step_boundary_of_every_fix_kind(
    lab: LabState, tmp_path: Path
) -> None:
    """Small size: every boundary once, the kinds in rotation; full size: every pair."""
    scenarios = [
        Scenario(kind=kind, crash_at=boundary)
        for i, boundary in enumerate(RUN_BOUNDARIES)
        for j, kind in enumerate(KINDS)
        if FULL or j == i % len(KINDS)
    ]
    # The rollback's own boundaries: a GPU fix on the engine without the toolkit fails to start.
    scenarios += [
        Scenario(kind="gpus", engine="plain", crash_at=b, restart_policy="always")
        for b in ROLLBACK_BOUNDARIES
    ]
    tally = Tally()
    for sc in scenarios:
        run_scenario(lab, sc, tmp_path / "state", tally)
    tally.report("kill at every step")
    record(SUITE, "kill at every step: fix kinds covered", len(KINDS))
    _assert_clean(tally)


def test_engine_restarted_mid_fix(lab: LabState, tmp_path: Path) -> None:
    tally = Tally()
    delays = [0.5, 1.5, 2.5] if FULL else [1.5]
    for i, delay in enumerate(delays):
        sc = Scenario(
            kind=KINDS[i % len(KINDS)], restart_engine_after=delay, restart_policy="always"
        )
        run_scenario(lab, sc, tmp_path / "state", tally)
    tally.report("engine restart mid-fix")
    _assert_clean(tally)


def random_scenario(rng: random.Random) -> Scenario:
    kind = rng.choice(KINDS)
    roll = rng.random()
    sc = Scenario(
        kind=kind,
        restart_policy=rng.choice(["no", "always", "unless-stopped", "on-failure"]),
        env={
            f"VAR_{i}": rng.choice(["1", "two words", "a=b", "'q'", "ü"])
            for i in range(rng.randint(0, 4))
        },
        labels={f"team.{i}": rng.choice(["ml", "ops", ""]) for i in range(rng.randint(0, 3))},
        anonymous_volume=rng.random() < 0.5,
    )
    if kind == "gpus" and rng.random() < 0.25:
        sc.engine = "plain"  # the fix cannot start: verification fails and it rolls back
    if roll < 0.2:
        pass  # no fault
    elif roll < 0.85:
        boundaries = RUN_BOUNDARIES + (ROLLBACK_BOUNDARIES if sc.engine == "plain" else [])
        sc.crash_at = rng.choice(boundaries)
    else:
        sc.restart_engine_after = rng.uniform(0.3, 3.0)
        sc.restart_policy = rng.choice(["always", "unless-stopped"])
    return sc


def test_randomised_fault_injected_recreates(lab: LabState, tmp_path: Path) -> None:
    seed = int(os.environ.get("CUDAMEDIC_RELIABILITY_SEED", "20261203"))
    rng = random.Random(seed)
    tally = Tally()
    mix = {"killed": 0, "engine restarted": 0, "fix fails, rolled back": 0, "no fault": 0}
    for _ in range(size(6, 200)):
        sc = random_scenario(rng)
        if sc.crash_at:
            mix["killed"] += 1
        elif sc.restart_engine_after is not None:
            mix["engine restarted"] += 1
        elif sc.expected() == "old":
            mix["fix fails, rolled back"] += 1
        else:
            mix["no fault"] += 1
        run_scenario(lab, sc, tmp_path / "state", tally)
    record(SUITE, "randomised: seed", seed)
    record(SUITE, "randomised: faults", ", ".join(f"{k} {v}" for k, v in mix.items()))
    tally.report("randomised")
    _assert_clean(tally)
