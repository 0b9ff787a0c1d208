"""The request memory (flows/fleet_state.Memory: Prefect Variables, one per key) forgets every
expired key, not only those on the first page of 200 (issue 27, finding 9); an expired key not
pruned yet is new again. Real Prefect: the tests' server."""

from __future__ import annotations

import time
import uuid

from flows.fleet_state import Memory
from runbooks.core.prefect_api import call


def _put(name: str, until: float) -> None:
    body = {"name": name, "value": {"until": round(until)}, "tags": [Memory.TAG]}
    call("POST", "/variables/", body, timeout=5.0)


def _exists(name: str) -> bool:
    found = call("POST", "/variables/filter", {"variables": {"name": {"any_": [name]}}}, 5.0)
    return bool(found)


def test_every_expired_key_is_forgotten_also_behind_live_ones(prefect_api: str) -> None:
    run = uuid.uuid4().hex[:8]
    live = [f"{Memory.TAG}-{run}-a{i:03d}" for i in range(230)]  # sort before the expired ones
    expired = [f"{Memory.TAG}-{run}-z{i:03d}" for i in range(40)]
    for name in live:
        _put(name, time.time() + 3600)
    for name in expired:
        _put(name, time.time() - 10)
    assert Memory.prune() >= len(expired)
    assert not any(_exists(n) for n in expired)
    assert all(_exists(n) for n in live[:5] + live[-5:])


def test_an_expired_key_not_pruned_yet_is_new_again(prefect_api: str) -> None:
    memory = Memory(ttl=600)
    key = f"cmd:{uuid.uuid4().hex}"
    assert memory.first_time(key)
    assert not Memory(ttl=600).first_time(key)  # another replica: seen
    import hashlib

    name = f"{Memory.TAG}-{hashlib.sha256(key.encode()).hexdigest()[:40]}"
    call("PATCH", f"/variables/name/{name}", {"value": {"until": round(time.time() - 1)}}, 5.0)
    assert Memory(ttl=600).first_time(key)  # its time is past: new again
    assert not Memory(ttl=600).first_time(key)
