"""`python -m tests.lab up|down|clean|status|env` — run the lab by hand (as root)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from tests.lab.lab import LabState, clean, down, lab_dir, up


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "status"
    if cmd == "up":
        state = up()
        print(
            f"lab up in {state.dir}: {len(state.hosts)} hosts, engines "
            f"{', '.join(e.name + '=' + e.url for e in state.engines.values())}"
        )
        print(f"export CUDAMEDIC_CONFIG={state.config}")
        return 0
    if cmd == "down":
        down()
        print("lab down")
        return 0
    if cmd == "clean":
        removed = clean()
        print(f"lab clean: {removed} container(s) left by earlier runs removed")
        return 0
    state = LabState.load(lab_dir())
    if cmd == "env":
        # Read by `eval "$(python -m tests.lab env)"`: a lab that is down must say so on stderr
        # (an empty eval would leave the shell silently pointed at nothing).
        if state is None or not state.alive():
            print(
                f"cudamedic lab: the lab in {lab_dir()} is down (CUDAMEDIC_LAB_DIR); start it "
                "with `make lab-up` (or `make demo`) from the project directory",
                file=sys.stderr,
            )
            return 1
        print(f"export CUDAMEDIC_CONFIG={state.config}")
        print(f"export DOCKER_HOST={state.engines['gpu'].url}")
        # The engine without the toolkit's hook (the demo's rolled-back fix runs on it).
        print(f"export CUDAMEDIC_LAB_PLAIN_DOCKER_HOST={state.engines['plain'].url}")
        return 0
    if state is None:
        print("lab is down")
        return 1
    print(json.dumps(asdict(state), indent=2))
    return 0 if state.alive() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
