"""Check that `make demo` told its story: the outputs of its steps (OUT_DIR/demo-steps, written by
scripts/demo.sh) against what the README promises. Exit 0 when every outcome is the promised one,
else 1 with one line per difference (CI runs the demo: .ci/run).

- the shm fix was approved with `cudamedic approve`, verified, and its flow run ended `Fixed`;
- the fix that cannot work (no toolkit hook) was rolled back (exit 5), its run `RolledBack`;
- the first sweep named each planted problem once, nothing else: EXPECTED_FIRST_SWEEP;
- the second sweep named nothing.

Usage: .venv/bin/python scripts/check_demo.py OUT_DIR/demo-steps
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

# (host, finding code, subject) of each problem the lab plants, as the first sweep reports it:
# four hosts to drain, three to warn about, gpu-healthy healthy; the rolled-back train-nogpu is
# seen by both hosts of the engine without the toolkit (gpu-notoolkit and gpu-nohook share it).
EXPECTED_FIRST_SWEEP = {
    ("gpu-hang", "nvidia-smi-hung", ""),
    ("gpu-mismatch", "driver-library-mismatch", ""),
    ("gpu-nodriver", "driver-not-loaded", ""),
    ("gpu-xid79", "xid-79", "0000:02:00"),
    # its DCGM (a recorded `dcgmi health -c` of a real L4) warns of the power it sees
    ("gpu-xid79", "dcgm-health-power", "gpu0"),
    ("gpu-slow-nccl", "nccl-bandwidth-low", ""),
    ("gpu-notoolkit", "toolkit-missing", ""),
    ("gpu-nohook", "toolkit-old", ""),
    *(
        (host, code, "train-nogpu")
        for host in ("gpu-notoolkit", "gpu-nohook")
        for code in ("container-no-gpu-request", "container-shm-small")
    ),
}
EXPECTED_VERDICTS = "8 hosts in {s} s: 4 drain, 3 warning, 1 healthy"
# What the final state of a response's flow run must be: (state type, state name).
EXPECTED_STATES = {"fixed": ("COMPLETED", "Fixed"), "rolled-back": ("FAILED", "RolledBack")}

_CHANGE = re.compile(r"^  (new|changed|resolved|still)\s+(\S+): (\S+)(?: \(([^)]*)\))? ")
_RUN = re.compile(r"^flow run:\s+(\S+)/runs/flow-run/([0-9a-f-]{36})$", re.M)

StateOf = Callable[[str, str], tuple[str, str] | None]


def sweep_changes(text: str) -> list[tuple[str, str, str, str]]:
    """(change, host, code, subject) of each line a sweep printed about a finding."""
    return [
        (m.group(1), m.group(2), m.group(3), m.group(4) or "")
        for line in text.splitlines()
        if (m := _CHANGE.match(line))
    ]


def _response(text: str, name: str, outcome: str, code: int, state_of: StateOf) -> list[str]:
    """What is wrong with one triage's output (its `exit status: N` line added by the demo)."""
    problems = []
    said = re.search(r"^outcome:\s+(\S+?):?(?:\s|$)", text, re.M)
    if said is None or said.group(1) != outcome:
        got = said.group(1) if said else "no outcome line"
        problems.append(f"{name}: outcome {got}, expected {outcome}")
    status = re.search(r"^exit status: (\d+)$", text, re.M)
    if status is None or int(status.group(1)) != code:
        got = status.group(1) if status else "?"
        problems.append(f"{name}: exit status {got}, expected {code}")
    run = _RUN.search(text)
    if run is None:
        problems.append(f"{name}: no flow run printed")
    else:
        state = state_of(run.group(1), run.group(2))
        want = EXPECTED_STATES[outcome]
        if state != want:
            problems.append(f"{name}: flow run {run.group(2)} ended {state}, expected {want}")
    if "Traceback" in text:
        problems.append(f"{name}: a traceback")
    return problems


def check(steps: Path, state_of: StateOf) -> list[str]:
    """Every difference between the demo's step outputs in `steps` and its promised story."""

    def read(name: str) -> str:
        path = steps / name
        return path.read_text(errors="replace") if path.exists() else ""

    problems = _response(read("1-triage-train-shm.txt"), "train-shm", "fixed", 0, state_of)
    approve = read("2-approve.txt")
    if not re.search(r"^taken: approve by ", approve, re.M):
        problems.append(f"approve: the flow did not take the answer: {approve.strip()!r}")
    problems += _response(
        read("3-triage-train-nogpu.txt"), "train-nogpu", "rolled-back", 5, state_of
    )

    first, second = read("4-sweep-first.txt"), read("5-sweep-second.txt")
    counts = re.search(r"^8 hosts in ([\d.]+) s: .*$", first, re.M)
    if counts is None or counts.group(0) != EXPECTED_VERDICTS.format(s=counts.group(1)):
        problems.append(
            f"first sweep: {counts.group(0) if counts else 'no verdict line'}, expected "
            f"{EXPECTED_VERDICTS.format(s='N')}"
        )
    seen = Counter((host, code, subject) for change, host, code, subject in sweep_changes(first))
    changes = {change for change, *_ in sweep_changes(first)}
    if changes - {"new"}:
        problems.append(f"first sweep: {sorted(changes - {'new'})} findings, expected only new")
    for key in sorted(EXPECTED_FIRST_SWEEP - set(seen)):
        problems.append(f"first sweep: missing {key}")
    for key in sorted(set(seen) - EXPECTED_FIRST_SWEEP):
        problems.append(f"first sweep: not planted {key}")
    for key, n in sorted(seen.items()):
        if n > 1:
            problems.append(f"first sweep: {key} named {n} times")
    if sweep_changes(second) or "nothing new, changed or resolved" not in second:
        problems.append(f"second sweep: not quiet: {sweep_changes(second)}")
    return problems


def _auth_headers() -> dict[str, str]:
    """The demo's embedded server asks for its API auth string (PREFECT_API_AUTH_STRING, else
    the one it keeps in its PREFECT_HOME under the demo's state dir)."""
    import base64
    import os

    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if not auth:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from flows.server import AUTH_FILE, prefect_home
        from runbooks.core.settings import load_settings

        try:
            auth = (prefect_home(load_settings()) / AUTH_FILE).read_text(encoding="utf-8").strip()
        except OSError:
            return {}
    return {"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()}


def prefect_state(ui: str, run_id: str) -> tuple[str, str] | None:
    """(state type, state name) of a flow run, asked of the Prefect server the demo used."""
    url = f"{ui}/api/flow_runs/{run_id}"
    request = urllib.request.Request(url, headers=_auth_headers())  # noqa: S310 - the demo server
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - the demo's own server
            run = json.load(resp)
    except (OSError, ValueError):
        return None
    return str(run.get("state_type")), str(run.get("state_name"))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: check_demo.py OUT_DIR/demo-steps", file=sys.stderr)
        return 2
    problems = check(Path(argv[0]), prefect_state)
    if problems:
        print("demo: the story was not the promised one:", file=sys.stderr)
        for p in problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(
        "demo checked: train-shm Fixed, train-nogpu RolledBack, the first sweep named each "
        f"of the {len(EXPECTED_FIRST_SWEEP)} planted findings once, the second nothing"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
