"""What every worker of a fleet shares, kept in the Prefect server all of them use (issue 17):
never on one worker's disk, so a sweep run by worker B knows what worker A's sweep saw.

- A **lock** is a Prefect global concurrency limit of one slot, created on first use. Its slot is a
  lease: a worker that dies holding it loses it after `LEASE_S`, so a crashed sweep never blocks
  the fleet for good (flock on a shared disk would, and is no lock across machines anyway).
- A **quick lock** (`quick_lock`) is the same kind of limit taken over the raw REST API (2 s, no
  retries) and never waited for: for the paths that must answer fast (Slack delivery).
- A **memory** of keys already handled (Slack's replays and retries, Alertmanager's repeats): one
  Prefect Variable per key, created only when absent, so the server decides who saw it first.
- A **document** (the sweep state) is the newest version of a keyed Prefect artifact: the server's
  database keeps it (SQLite for the embedded default, PostgreSQL for a fleet), the UI shows it under
  Artifacts, and the previous version is kept for a look back; older ones are deleted.
  Variables would not do: a Prefect Variable holds at most 5,000 characters.

Every call has a timeout (the Prefect client's); no call writes anything locally.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import get_client
from prefect.client.schemas.actions import ArtifactCreate, GlobalConcurrencyLimitCreate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.client.schemas.sorting import ArtifactSort
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from flows.alerts import Seen
from runbooks.core.prefect_api import call as _prefect
from runbooks.core.settings import Settings
from runbooks.diagnose.sweep import State, parse_state, read_state_file

log = logging.getLogger(__name__)

LEASE_S = 300.0  # a lock's holder that stops renewing (a dead worker) loses it after this
KEEP_VERSIONS = 2  # the newest document and the one before


def lock_name(name: str, settings: Settings) -> str:
    return f"cudamedic-{settings.fleet}-{name}"


def ensure_limits(names: list[str], limit: int = 1) -> None:
    """Create the global concurrency limits the flows lock on (strict locks need them to exist)."""
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_global_concurrency_limit_by_name(name)
                continue
            except ObjectNotFound:
                pass
            with contextlib.suppress(ObjectAlreadyExists):  # another worker made it first
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=limit)
                )


@contextlib.contextmanager
def fleet_lock(name: str, settings: Settings, timeout_s: float = 600.0) -> Iterator[None]:
    """Held by one process of the whole fleet at a time (TimeoutError after `timeout_s`)."""
    full = lock_name(name, settings)
    ensure_limits([full])
    with concurrency(
        full, occupy=1, timeout_seconds=timeout_s, lease_duration=LEASE_S, strict=True
    ):
        yield


QUICK_LEASE_S = 60.0  # the server's shortest lease: a dead holder frees a quick lock this fast


@contextlib.contextmanager
def quick_lock(name: str, settings: Settings) -> Iterator[Callable[[], None] | None]:
    """The fleet-wide lock `name` when it is free now, else None: never waits. Yields a function
    that renews the lease (call it at least every `QUICK_LEASE_S`/2 while holding it). Raw calls
    of 2 s without retries: OSError, ValueError or LookupError when Prefect cannot be asked."""
    lease = _lease(lock_name(name, settings))
    if lease is None:
        yield None
        return

    def renew() -> None:
        path = f"/v2/concurrency_limits/leases/{lease}/renew"
        _prefect("POST", path, {"lease_duration": QUICK_LEASE_S})

    try:
        yield renew
    finally:
        _release(lease)


def _lease(full: str) -> str | None:
    """A lease on the one slot of the limit `full` (created on first use), or None: taken."""
    body = {"names": [full], "slots": 1, "mode": "concurrency", "lease_duration": QUICK_LEASE_S}
    for _ in range(2):
        try:
            got = _prefect("POST", "/v2/concurrency_limits/increment-with-lease", body)
        except urllib.error.HTTPError as exc:
            if exc.code == 423:  # Locked: another process holds it
                return None
            raise
        if got["limits"]:
            return str(got["lease_id"])
        _release(str(got["lease_id"]))  # no such limit yet: the lease held nothing
        try:
            _prefect("POST", "/v2/concurrency_limits/", {"name": full, "limit": 1})
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: another process created it first
                raise
    raise LookupError(f"the concurrency limit {full} could not be created")


def _release(lease: str) -> None:
    try:
        _prefect("POST", "/v2/concurrency_limits/decrement-with-lease", {"lease_id": lease})
    except (OSError, ValueError, LookupError) as exc:  # the lease runs out by itself
        log.warning("releasing a fleet lock failed (%s): it expires by itself", type(exc).__name__)


DOCUMENT_TYPE = "cudamedic-state"
READ_BACK = 50  # versions walked back past newer ones that are not a readable document


def read_document(key: str, readable: Callable[[Any], bool]) -> tuple[Any | None, int]:
    """The newest version of the artifact `key` that is cudamedic's own type and `readable`
    (anyone who can write to the Prefect API can add a version under the key), and how many
    newer versions were passed over. (None, n > 0): versions exist, none readable."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC,
            limit=READ_BACK,
        )
    for passed, artifact in enumerate(found):
        data = artifact.data
        if isinstance(data, str):  # the server may hand JSON back as text
            try:
                data = json.loads(data)
            except (ValueError, RecursionError):
                continue
        if artifact.type == DOCUMENT_TYPE and readable(data):
            return data, passed
    return None, len(found)


def write_document(key: str, data: Any, description: str) -> None:
    """A new version of the artifact `key`; versions past `KEEP_VERSIONS` are deleted."""
    with get_client(sync_client=True) as client:
        client.create_artifact(
            ArtifactCreate(key=key, type=DOCUMENT_TYPE, description=description, data=data)
        )
        versions = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
            sort=ArtifactSort.CREATED_DESC,
            offset=KEEP_VERSIONS,
            limit=50,
        )
        for old in versions:
            with contextlib.suppress(ObjectNotFound):
                client.delete_artifact(old.id)


def sweep_state_key(settings: Settings) -> str:
    return f"cudamedic-{settings.fleet}-sweep-state"


@contextlib.contextmanager
def sweep_state(settings: Settings) -> Iterator[tuple[State, Callable[[State], None]]]:
    """The fleet's previous sweep state under the fleet-wide lock (two sweeps never interleave),
    and a function that stores the new one. Hosts not swept this time keep their state. The first
    time, a `STATE_DIR/sweep-state.json` left by an older cudamedic is taken over.

    Newer versions under the key that are not a readable state (not cudamedic's type, not a
    state: written by anyone with API access, or cut) are passed over with a warning; when no
    version can be read, nothing is saved (a new state would forget every host this sweep did
    not check)."""
    key = sweep_state_key(settings)
    with fleet_lock("sweep-state", settings):
        stored, passed = read_document(key, _is_state)
        if passed:
            log.warning(
                "the sweep state %s: %d newer version(s) are not a state cudamedic can read; %s",
                key,
                passed,
                "read the newest one that is" if stored is not None else "none can be read",
            )
        before = parse_state(stored) if stored is not None else _legacy(settings)
        lost = stored is None and passed > 0

        def save(seen: State) -> None:
            if lost:
                log.warning("the sweep state %s was not saved: its last state is unreadable", key)
                return
            data = {"updated_at": datetime.now(UTC).isoformat(), "hosts": {**before, **seen}}
            write_document(key, data, f"Fleet {settings.fleet}: what the last sweep saw per host")

        yield before, save


def _is_state(data: Any) -> bool:
    return isinstance(data, dict) and isinstance(data.get("hosts"), dict)


def _legacy(settings: Settings) -> State:
    path: Path = settings.state_path / "sweep-state.json"
    return read_state_file(path) if path.exists() else {}


def _expired(value: Any) -> bool:
    until = value.get("until", 0) if isinstance(value, dict) else 0
    return isinstance(until, int | float) and until < time.time()


class Memory:
    """Requests already handled (signatures, retried commands, button clicks), for every replica
    and across restarts: one Prefect Variable per key, created only when absent, so the Prefect
    server (shared by the replicas) decides who saw it first. Asked over Prefect's REST API with
    a short timeout and no retries, so an acknowledgement never waits on it for long; when
    Prefect cannot be asked, this process's memory alone decides for `QUIET_S` (nothing can be
    started without Prefect anyway)."""

    TAG = "cudamedic-seen"
    PAGE = 200  # the Prefect API's largest page
    PRUNE_MAX = 100_000  # keys looked at by one prune
    QUIET_S = 30.0
    PRUNE_S = 600.0  # forget keys past their time at most this often (any user of the memory)

    def __init__(self, ttl: float, timeout: float = 2.0) -> None:
        self.ttl, self.timeout = ttl, timeout
        self.local = Seen(ttl=ttl)
        self.quiet_until = 0.0
        self.pruned_at = time.monotonic()

    def first_time(self, key: str) -> bool:
        if not self.local.first_time(key):
            return False
        if time.monotonic() - self.pruned_at > self.PRUNE_S:
            self.pruned_at = time.monotonic()
            try:
                self.prune()
            except (OSError, ValueError, LookupError) as exc:
                log.warning("forgetting old request keys failed: %s", type(exc).__name__)
        if time.monotonic() < self.quiet_until:
            return True
        name = f"{self.TAG}-{hashlib.sha256(key.encode()).hexdigest()[:40]}"
        value = {"until": round(time.time() + self.ttl)}
        try:
            _prefect("POST", "/variables/", {"name": name, "value": value, "tags": [self.TAG]})
        except urllib.error.HTTPError as exc:
            if exc.code == 409:  # already there: seen before, here or by another replica
                return self._expired_taken(name, value)
            self._unavailable(f"HTTP {exc.code}")
        except (OSError, ValueError, LookupError) as exc:
            self._unavailable(type(exc).__name__)
        return True

    def _expired_taken(self, name: str, value: dict[str, int]) -> bool:
        """A key whose time is past (not pruned yet) is new again: replaced, once."""
        path = f"/variables/name/{urllib.parse.quote(name)}"
        try:
            old = _prefect("GET", path, timeout=self.timeout)
            if not _expired(old.get("value") if isinstance(old, dict) else None):
                return False
            _prefect("DELETE", path, timeout=self.timeout)
            _prefect("POST", "/variables/", {"name": name, "value": value, "tags": [self.TAG]})
        except (OSError, ValueError, LookupError):  # HTTPError 409: another replica took it
            return False
        return True

    def _unavailable(self, why: str) -> None:
        self.quiet_until = time.monotonic() + self.QUIET_S
        log.warning("Prefect did not answer for the request memory (%s): this process's only", why)

    @classmethod
    def prune(cls) -> int:
        """Forget keys past their time, on every page of the memory (all read first: deleting
        shifts the pages); returns how many."""
        expired: list[str] = []
        for offset in range(0, cls.PRUNE_MAX, cls.PAGE):
            body = {"variables": {"tags": {"all_": [cls.TAG]}}, "limit": cls.PAGE, "offset": offset}
            found = _prefect("POST", "/variables/filter", body, 5.0)
            page = [v for v in found if isinstance(v, dict)] if isinstance(found, list) else []
            expired += [str(v.get("name")) for v in page if _expired(v.get("value"))]
            if len(page) < cls.PAGE:
                break
        for name in expired:  # Prefect's 503 (busy) is tried again by `call`
            with contextlib.suppress(urllib.error.HTTPError):  # gone already: another replica
                _prefect("DELETE", f"/variables/name/{urllib.parse.quote(name)}")
        return len(expired)
