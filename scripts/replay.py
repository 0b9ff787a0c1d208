"""Replay corpus cases live and compare each live verdict with the offline one (`make replay`).

For each case (tests/corpus/*): the replay lab (tests/lab/replay.py) puts its evidence on a
simulated host and a container of a Docker engine of its own; cudamedic collects it over SSH and
the Docker API exactly as `cudamedic collect HOST --container NAME --trigger TEXT` does, then
classifies the bundle. Offline is `classify` of the case directory. Both leave the case out of its
own similar incidents (leave-one-out, as the corpus figures do).

    .venv/bin/python scripts/replay.py                 # every case
    .venv/bin/python scripts/replay.py --sample        # the stratified sample `make test` runs
    .venv/bin/python scripts/replay.py --tsv docs/accuracy-live.tsv CASE ...

Prints one line per case that disagrees or is not replayable, then the figures: live = offline,
live top-1 and offline top-1 against the labels. Run as root (the lab starts dockerd and sshd).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runbooks.collect.collector import collect
from runbooks.collect.inventory import load_inventory
from runbooks.collect.target import resolve_target
from runbooks.core.runbook import Runbook
from runbooks.core.settings import load_settings
from runbooks.diagnose.classify import classify_path
from tests.lab import replay

SAMPLE_PER_CLASS = 3
CUDAMEDIC = str(Path(sys.executable).parent / "cudamedic")  # the command a user runs
# Cases whose live verdict differs from the offline one, and why (each checked by hand; the
# tests fail on a disagreement not listed here).
EXPLAINED = {
    "gpu-not-requested--model-angelo-slurm-job-without-gpu-allocation": "live is right: the "
    "thread only has the job's error, and the replayed container (its kind's default: no GPUs "
    "asked for) shows what the thread concluded, a container that wants GPUs and was given none",
    "healthy--deepo-tf-import-libnvinfer-tensorrt-warnings-only": "live is right: the running "
    "container's own `nvidia-smi -L` (the lab's hook shim) lists its GPUs, the positive evidence "
    "the thread's warnings alone do not give",
    # Offline the case is one pasted line, whose known message decides; live the bundle is more
    # than that line, so the learned model (the packaged one, trained on this thread) may
    # withhold the message's class when it is sure of another. Both offline verdicts are wrong.
    "gpu-not-requested--gpu-operator-vectoradd-no-nvidia-runtimeclass": "live is closer: "
    "`unknown` between driver-too-old (the message) and gpu-not-requested (the model, the "
    "thread's conclusion); offline the pasted line alone says driver-too-old",
    "invalid-device-ordinal--vitis-ai-tf2-docker-gpu-1-cuda-error-no-device": "live is closer: "
    "`unknown` between gpu-not-requested (the message) and invalid-device-ordinal (the model, "
    "the thread's conclusion); offline the pasted line alone says gpu-not-requested",
    "cpu-only-build--pii-image-cpu-wheel-despite-nvidia-runtime": "live is closer: `unknown` "
    "between gpu-not-requested (the message) and cpu-only-build (the model, the thread's "
    "conclusion: a CPU wheel in a container given its GPU); offline the pasted line alone says "
    "gpu-not-requested",
}


@dataclass
class Outcome:
    case: str
    label: str
    live: str | None
    offline: str
    seconds: float
    unreplayable: list[str]
    bundle: str = ""
    triage: str | None = None  # `cudamedic triage`'s verdict (with --triage)
    triage_bundle_verdict: str | None = None  # `classify` of the bundle triage collected

    @property
    def agrees(self) -> bool:
        return self.live == self.offline


def all_cases() -> list[Path]:
    return sorted(p for p in replay.CORPUS.iterdir() if (p / "case.yaml").exists())


def sample(cases: list[Path], per_class: int = SAMPLE_PER_CLASS) -> list[Path]:
    """A stratified sample: per labelled class, the `per_class` cases first by a hash of their
    name (stable, and not the alphabetical first ones)."""
    by_class: dict[str, list[Path]] = defaultdict(list)
    for case in cases:
        by_class[str(yaml.safe_load((case / "case.yaml").read_text())["incident"])].append(case)
    chosen: list[Path] = []
    for _, members in sorted(by_class.items()):
        members.sort(key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
        chosen.extend(members[:per_class])
    return sorted(chosen)


def replay_case(
    lab: replay.ReplayLab, case: Path, out: Path, triage_env: dict[str, str] | None = None
) -> Outcome:
    """Replay one case live and classify it both ways (and triage it, given an environment for
    the CLI)."""
    started = time.monotonic()
    plan = replay.plan_case(case)
    offline = classify_path(case, exclude={case.name}).incident
    if plan.unreplayable:
        return Outcome(case.name, plan.incident, None, offline, 0.0, plan.unreplayable)
    trigger = plan.trigger
    container = plan.containers[0].name if len(plan.containers) == 1 else None
    try:
        host = lab.load_case(plan)
    except replay.EngineRefused as exc:  # no container: what the user pastes is all there is
        host, trigger = lab.load_refused(plan, str(exc))
        container = None
    settings = load_settings(out_dir=out, state_dir=out / "state")
    target = resolve_target(host, load_inventory(settings.inventory))
    bundle = collect(
        target,
        settings,
        container=container,
        trigger=trigger,
        runbook=Runbook.model_validate(plan.runbook()),
    )
    live = classify_path(bundle, exclude={case.name}).incident
    outcome = Outcome(
        case.name, plan.incident, live, offline, time.monotonic() - started, [], str(bundle)
    )
    if triage_env is not None:
        outcome.triage, outcome.triage_bundle_verdict = _triage(
            host, container, trigger, plan, out, triage_env
        )
    return outcome


def _triage(
    host: str,
    container: str | None,
    trigger: str | None,
    plan: replay.ReplayPlan,
    out: Path,
    env: dict[str, str],
) -> tuple[str, str]:
    """`cudamedic triage HOST [--container X] [--trigger T] --json` (a dry run) on the replayed
    case: its verdict, and `classify`'s of the bundle it collected."""
    book = out / "runbook.yaml"
    book.write_text(yaml.safe_dump(plan.runbook()))
    argv = [CUDAMEDIC, "triage", host, "--json"]
    argv += ["--container", container] if container else []
    argv += ["--trigger", trigger] if trigger else []
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "CUDAMEDIC_RUNBOOK": str(book), "CUDAMEDIC_OUT_DIR": str(out)},
    )
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        result = {}
    if "bundle" not in result:
        raise RuntimeError(f"triage of {plan.case} ({proc.returncode}): {proc.stderr[-2000:]}")
    return str(result.get("incident")), classify_path(Path(result["bundle"])).incident


def figures(outcomes: list[Outcome]) -> list[str]:
    replayed = [o for o in outcomes if o.live is not None]
    same = sum(o.agrees for o in replayed)
    live_ok = sum(o.live == o.label for o in replayed)
    off_ok = sum(o.offline == o.label for o in replayed)
    n = max(len(replayed), 1)
    triaged = [o for o in replayed if o.triage is not None]
    same_triage = sum(o.triage == o.triage_bundle_verdict for o in triaged)
    extra = (
        [f"triage verdict = classify of its bundle: {same_triage}/{len(triaged)}"]
        if triaged
        else []
    )
    return [
        f"cases: {len(outcomes)}; replayed live: {len(replayed)}; "
        f"not replayable: {len(outcomes) - len(replayed)}",
        f"live verdict = offline verdict: {same}/{len(replayed)} = {same / n:.1%}",
        f"top-1 against the labels: live {live_ok}/{len(replayed)} = {live_ok / n:.1%}, "
        f"offline {off_ok}/{len(replayed)} = {off_ok / n:.1%}",
        *extra,
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="case directory names (default: every case)")
    parser.add_argument("--sample", action="store_true", help="the stratified sample only")
    parser.add_argument("--tsv", type=Path, help="write one row per case here")
    parser.add_argument(
        "--triage",
        action="store_true",
        help="also run `cudamedic triage` (a dry run, on an embedded Prefect server of its own)",
    )
    args = parser.parse_args(argv)
    cases = [replay.CORPUS / c for c in args.cases] if args.cases else all_cases()
    if args.sample:
        cases = sample(cases)
    lab = replay.up()
    os.environ["CUDAMEDIC_CONFIG"] = lab.config  # the replay lab's hosts, never a user's
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="cudamedic-replay-") as tmp:
        env = {
            **os.environ,
            "CUDAMEDIC_STATE_DIR": str(Path(tmp, "state")),
            "CUDAMEDIC_PREFECT_PORT": str(_free_port()),  # an embedded server of its own
        }
        try:
            for case in cases:
                outcome = replay_case(lab, case, Path(tmp), env if args.triage else None)
                outcomes.append(outcome)
                _say(outcome)
        finally:
            if args.triage:
                subprocess.run(
                    [CUDAMEDIC, "server", "stop"],
                    env=env,
                    capture_output=True,
                    timeout=120,
                )
    for line in figures(outcomes):
        print(line)
    if args.tsv:
        rows = ["case\tlabel\tlive\toffline\tagrees\ttriage\tseconds"]
        rows += [
            f"{o.case}\t{o.label}\t{o.live or 'not-replayable'}\t{o.offline}\t"
            f"{'yes' if o.agrees else 'no'}\t{o.triage or '-'}\t{o.seconds:.1f}"
            for o in outcomes
        ]
        args.tsv.parent.mkdir(parents=True, exist_ok=True)
        args.tsv.write_text("\n".join(rows) + "\n")
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(outcome: Outcome) -> None:
    """One line for a case that is not replayable or disagrees."""
    if outcome.live is None:
        print(f"not replayable  {outcome.case}: {'; '.join(outcome.unreplayable)}")
    elif not outcome.agrees:
        why = EXPLAINED.get(outcome.case, "NOT EXPLAINED")
        print(
            f"disagrees       {outcome.case}: label {outcome.label}, live {outcome.live}, "
            f"offline {outcome.offline} ({why})"
        )
    if outcome.triage is not None and outcome.triage != outcome.triage_bundle_verdict:
        print(
            f"triage differs  {outcome.case}: triage {outcome.triage}, classify of its bundle "
            f"{outcome.triage_bundle_verdict}"
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
