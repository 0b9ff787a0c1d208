"""One fix applied by a separate process, so a test can SIGKILL it at a step boundary.

`python -m tests.reliability.recreate_driver ENGINE_URL CONTAINER KIND STATE_DIR` plans the safe
fix of KIND (shm, gpus, memlock, nccl: the container changes the taxonomy's safe fixes make) for
CONTAINER from its current `docker inspect`, and applies it with the product's recreate machinery
(journal, backup, verify, rollback). `CUDAMEDIC_CRASH_AT=<boundary>` in the environment makes it
kill itself there. It prints the outcome's status and message (`fixed: ...`), or `error: ...`
when the fix was refused before it changed anything.
"""

from __future__ import annotations

import resource
import sys
from datetime import UTC, datetime
from pathlib import Path

from runbooks.collect.remote.docker import DockerEngine
from runbooks.core.errors import CudamedicError
from runbooks.core.model import ContainerChange, Fix, GpuRequestSpec, UlimitSpec
from runbooks.core.settings import Settings
from runbooks.diagnose.remedy import MEMLOCK
from runbooks.fix.journal import Journal
from runbooks.fix.plan import plan_fix
from runbooks.fix.recreate import apply_plan

HOST = "lab"


def _memlock() -> tuple[UlimitSpec, ...]:
    """The product's memlock change, unless this machine cannot grant it: a container that may
    not raise RLIMIT_MEMLOCK past the engine's own hard limit fails to start ("error setting
    rlimit type 8: operation not permitted"), so the lab asks for that hard limit instead."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    if hard == resource.RLIM_INFINITY:
        return MEMLOCK
    return tuple(
        UlimitSpec(name="memlock", soft=hard, hard=hard) if u.name == "memlock" else u
        for u in MEMLOCK
    )


CHANGES = {
    "shm": (ContainerChange(shm_size=1 << 30), "+ --shm-size=1g", "shm-too-small"),
    "gpus": (
        ContainerChange(device_requests=(GpuRequestSpec(count=-1),)),
        "+ --gpus all",
        "gpu-not-requested",
    ),
    "memlock": (
        ContainerChange(ulimits=_memlock(), cap_add=("IPC_LOCK",)),
        "+ --ulimit memlock --cap-add IPC_LOCK",
        "memlock-limit",
    ),
    "nccl": (
        ContainerChange(ipc_mode="host", ulimits=_memlock(), cap_add=("IPC_LOCK",)),
        "+ --ipc=host --ulimit memlock --cap-add IPC_LOCK",
        "nccl-slow-transport",
    ),
}
KINDS = tuple(CHANGES)


def main(url: str, container: str, kind: str, state_dir: str) -> int:
    try:
        print(fix(url, container, kind, Path(state_dir)))
    except CudamedicError as exc:  # e.g. the engine is down: refused, as the CLI would say
        print(f"error: {exc}")
        return 2
    return 0


def fix(url: str, container: str, kind: str, state_dir: Path) -> str:
    """Plan and apply the fix: `status: message` of its outcome."""
    change, flag, incident = CHANGES[kind]
    settings = Settings(state_dir=state_dir, fix_settle_s=1.0, fix_health_timeout=20.0)
    engine = DockerEngine.local(url, 30)
    try:
        inspect = engine.inspect(container)
        plan = plan_fix(
            host=HOST,
            inspect=inspect,
            fix=Fix(safe=True, container=container, change=change, docker_run=(flag,)),
            incident=incident,
            summary=f"fault injection: {kind}",
            current_image_id=str(inspect.get("Image")),
            now=datetime.now(UTC),
            settle_s=settings.fix_settle_s,
            retention_h=24,
        )
        journal = Journal(state_dir, HOST, container)
        outcome = apply_plan(engine, plan, settings, journal, inspect)
        return f"{outcome.status}: {outcome.message}"
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
