"""A fix's lock is bound to the container it was looked up for (issue 27, finding 12): a crafted
`web-cudamedic-fix-lock` whose record names `db` made the recovery of `web` remove `db` and
rename another container to `db`. Now the recovery refuses that lock and changes nothing; a
record whose backup is not a backup name of its container is refused the same way. Real Docker
(the lab's engine) and the real CLI."""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import docker

from runbooks.core.settings import Settings
from runbooks.fix.fixlock import FixRecord, Holder, holder_labels, lock_name, record_labels
from tests.lab.lab import IMAGE, LabState
from tests.test_fix import fix_settings, run_cli  # noqa: F401 - fixture


def _crafted_lock(engine: docker.DockerClient, web: str, record: FixRecord) -> Any:
    holder = Holder(who="mallory@x", machine="x/1", pid=1, pid_start="1", lease_s=1)
    labels = {**record_labels(record), **holder_labels(holder)}
    return engine.containers.create(IMAGE, ["true"], name=lock_name(web), labels=labels)


def test_a_lock_naming_another_container_is_refused_and_changes_nothing(
    fix_settings: Settings,  # noqa: F811
    lab: LabState,
    make_container: Any,
    gpu_engine: docker.DockerClient,
) -> None:
    tag = uuid.uuid4().hex[:8]
    web, db, other = f"web-{tag}", f"db-{tag}", f"other-{tag}"
    sleep = "trap 'exit 0' TERM; sleep 3600 & wait"
    make_container(web, sleep)
    db_id = make_container(db, sleep).id
    other_id = make_container(other, sleep).id
    crafts = [
        FixRecord(name=db, original_id=other_id, backup=other, restart_policy={},
                  was_running=True),  # names db; "backs up" another container
        FixRecord(name=web, original_id=other_id, backup=other, restart_policy={},
                  was_running=True),  # names web, but its backup is not a backup of web
    ]  # fmt: skip
    for record in crafts:
        lock = _crafted_lock(gpu_engine, web, record)
        try:
            out = run_cli(lab, fix_settings, "fix", "gpu-healthy", "--container", web)
        finally:
            with contextlib.suppress(docker.errors.NotFound):  # (the old code removed it)
                lock.remove(force=True)
        assert out.returncode != 0, out.stdout
        assert "is not a lock of a fix of" in out.stderr and "Traceback" not in out.stderr
        assert gpu_engine.containers.get(db).id == db_id
        assert gpu_engine.containers.get(other).id == other_id
        assert gpu_engine.containers.get(other).name == other
        assert gpu_engine.containers.get(web).status == "running"
