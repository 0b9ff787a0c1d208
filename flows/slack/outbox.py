"""Where Slack messages wait and where the refused ones are kept (issue 17): in the Prefect server
every worker of the fleet uses, so a message one worker could not send (a post-mortem during a
Slack outage) is sent by another when the first is gone.

- A **waiting message** is one version of the artifact `cudamedic-<fleet>-slack-outbox` (type
  `cudamedic-outbox`, data `{method, args, at}`); `at`, the time it was first kept, orders them.
  Artifacts, not Variables: a Variable holds at most 5,000 characters, a post-mortem more.
- A **dead letter** is one version of `cudamedic-<fleet>-slack-dead-letter` (the newest
  `KEEP_DEAD`), shown under Artifacts in the UI.

Whoever can write to the Prefect API can write an artifact under the outbox's key (issue 27), so
a kept message is data, never a call: only the methods and argument keys cudamedic sends
(`ALLOWED`; an upload is by `content`, never a file path) are sent, and only a message signed
when it was kept (`sig`: HMAC-SHA256 keyed by the bot token, which only the workers and the Slack
app hold; whoever has it can post to Slack anyway). An unsigned, forged or unknown message goes
to the dead letters with a warning, in Prefect and in the local cache alike.

Every call is a raw REST call of 2 s (5 s for a page of messages) without retries
(runbooks/core/prefect_api.py). When Prefect cannot be asked, a message is kept in
`STATE_DIR/slack-outbox.jsonl` (or `slack-dead-letter.jsonl`) instead: a cache, moved into Prefect
by the next flush that reaches it. A Prefect that does not answer in time is not asked again by
this process for `QUIET_S` (a flow posting many messages would wait on each).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeGuard

from runbooks.core.errors import CudamedicError
from runbooks.core.prefect_api import call as _prefect
from runbooks.core.settings import Settings

log = logging.getLogger(__name__)

KEEP_DEAD = 100  # dead letters kept in Prefect, newest first
QUIET_S = 30.0  # after Prefect did not answer in time, this process keeps messages locally
PAGE = 200  # the Prefect API's largest page
_quiet_until: dict[str, float] = {}  # PREFECT_API_URL -> time.monotonic() when it is asked again
_file_locks = {"outbox": threading.Lock(), "dead-letter": threading.Lock()}

Item = dict[str, Any]
# The Slack methods cudamedic sends and the argument keys each takes: nothing else is ever sent
# from the outbox (a `file` of files_upload_v2 would upload a file of the flushing machine).
ALLOWED: dict[str, frozenset[str]] = {
    "chat.postMessage": frozenset({"channel", "text", "blocks", "thread_ts"}),
    "chat.postEphemeral": frozenset({"channel", "user", "text", "blocks", "thread_ts"}),
    "chat.update": frozenset({"channel", "ts", "text", "blocks"}),
    "files_upload_v2": frozenset({"channel", "thread_ts", "content", "filename", "title"}),
    "views.open": frozenset({"trigger_id", "view"}),
}
_STRINGS = frozenset({"channel", "user", "text", "thread_ts", "ts", "content", "filename", "title"})


class PrefectUnavailable(CudamedicError):
    """Prefect could not be asked (down, slow, refused the call) or was not asked (`QUIET_S`)."""


def outbox_key(settings: Settings) -> str:
    return f"cudamedic-{settings.fleet}-slack-outbox"


def dead_key(settings: Settings) -> str:
    return f"cudamedic-{settings.fleet}-slack-dead-letter"


def _call(method: str, path: str, body: Any = None, timeout: float = 2.0) -> Any:
    api = os.environ.get("PREFECT_API_URL", "")
    if time.monotonic() < _quiet_until.get(api, 0.0):
        raise PrefectUnavailable("Prefect did not answer a moment ago")
    try:
        return _prefect(method, path, body, timeout)
    except urllib.error.HTTPError as exc:
        raise PrefectUnavailable(f"Prefect answered HTTP {exc.code}") from None
    except (OSError, ValueError, LookupError) as exc:
        if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            _quiet_until[api] = time.monotonic() + QUIET_S  # a refused connection costs nothing
        raise PrefectUnavailable(f"Prefect could not be asked ({type(exc).__name__})") from None


# -- what may be sent -----------------------------------------------------------------------------
def refusal(item: Item) -> str | None:
    """Why cudamedic never sends this message (an unknown method, argument key or type), or None."""
    keys = ALLOWED.get(str(item.get("method")))
    args = item.get("args")
    if keys is None or not isinstance(args, dict):
        return f"not a message cudamedic sends ({str(item.get('method'))[:40]!r})"
    if extra := sorted(str(k)[:40] for k in args if k not in keys):
        return f"argument(s) cudamedic never sends: {', '.join(extra[:5])}"
    if bad := sorted(k for k in args if k in _STRINGS and not isinstance(args[k], str)):
        return f"argument(s) of the wrong type: {', '.join(bad)}"
    return None


def _signature(settings: Settings, item: Item) -> str:
    token = settings.slack_bot_token.get_secret_value() if settings.slack_bot_token else ""
    key = hmac.new(token.encode(), b"cudamedic-slack-outbox", hashlib.sha256).digest()
    body = json.dumps(
        {
            "fleet": settings.fleet,
            "method": item.get("method"),
            "args": item.get("args"),
            "at": item.get("at"),
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def sign(settings: Settings, item: Item) -> Item:
    """The item with its signature (`sig`), as it is kept."""
    return {**item, "sig": _signature(settings, item)}


def untrusted(settings: Settings, item: Item) -> str | None:
    """Why a kept message must not be sent (unsigned, forged, or not one cudamedic sends), or
    None when it may go."""
    sig = item.get("sig")
    if settings.slack_bot_token is None or not isinstance(sig, str):
        return "unsigned (not kept by cudamedic)"
    if not hmac.compare_digest(sig, _signature(settings, item)):
        return "bad signature (not kept by cudamedic, or changed since)"
    return refusal(item)


# -- in Prefect ----------------------------------------------------------------------------------
def _create(key: str, kind: str, data: Item, description: str) -> None:
    body = {"key": key, "type": kind, "description": description, "data": data}
    _call("POST", "/artifacts/", body, timeout=5.0)


def _versions(
    key: str, limit: int = PAGE, offset: int = 0, timeout: float = 5.0
) -> list[dict[str, Any]]:
    """Versions of the artifact `key`, newest first."""
    body = {
        "artifacts": {"key": {"any_": [key]}},
        "sort": "CREATED_DESC",
        "limit": limit,
        "offset": offset,
    }
    found = _call("POST", "/artifacts/filter", body, timeout=timeout)
    return [a for a in found if isinstance(a, dict)] if isinstance(found, list) else []


def _data(artifact: dict[str, Any]) -> Item | None:
    data = artifact.get("data")
    if isinstance(data, str):  # the server may hand JSON back as text
        try:
            data = json.loads(data)
        except (ValueError, RecursionError):
            return None
    return data if _is_item(data) else None


def stored(settings: Settings) -> list[tuple[str, Item]]:
    """The messages waiting in Prefect, oldest first, with their artifact ids (all pages)."""
    seen: dict[str, tuple[float, str, Item]] = {}
    offset = 0
    while True:
        page = _versions(outbox_key(settings), offset=offset)
        for art in page:
            item = _data(art)
            if item is None:  # unreadable: it would hold back everything behind it
                log.warning("dropped an unreadable message of the Slack outbox")
                remove(str(art["id"]))
                continue
            seen[str(art["id"])] = (float(item.get("at") or 0), str(art.get("created")), item)
        if len(page) < PAGE:
            break
        offset += PAGE
    ordered = sorted(seen.items(), key=lambda kv: kv[1][:2])
    return [(art_id, item) for art_id, (_, _, item) in ordered]


def any_stored(settings: Settings) -> bool:
    """Whether a message waits in Prefect (one small call)."""
    return bool(_versions(outbox_key(settings), limit=1, timeout=2.0))


def remove(art_id: str) -> None:
    """A sent message out of the outbox (already gone: fine, another worker removed it)."""
    try:
        _prefect("DELETE", f"/artifacts/{art_id}")
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise PrefectUnavailable(f"Prefect answered HTTP {exc.code}") from None
    except (OSError, ValueError, LookupError) as exc:
        raise PrefectUnavailable(f"Prefect could not be asked ({type(exc).__name__})") from None


def _store(settings: Settings, item: Item) -> None:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(item["at"])))
    description = f"Waiting for Slack: {item['method']} (kept {when} UTC)"
    _create(outbox_key(settings), "cudamedic-outbox", item, description)


# -- the local cache -----------------------------------------------------------------------------
def local_outbox(settings: Settings) -> Path:
    return settings.state_path / "slack-outbox.jsonl"


def local_dead_letters(settings: Settings) -> Path:
    return settings.state_path / "slack-dead-letter.jsonl"


@contextlib.contextmanager
def locked(settings: Settings, name: str = "outbox") -> Iterator[None]:
    """A local file ("outbox", "dead-letter") to this thread alone: a lock within the process,
    flock between processes of this machine (the app, the workers)."""
    with _file_locks[name]:
        path = settings.state_path / f"slack-{name}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _append(path: Path, item: Item) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(item) + "\n")


def read_local(path: Path) -> list[Item]:
    """The messages of a local file; a line cut by a crash or edited by hand is dropped (it would
    otherwise fail every flush and hold back everything behind it)."""
    if not path.exists():
        return []
    items = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            item = json.loads(line) if line.strip() else None
        except (ValueError, RecursionError):
            item = None
        if _is_item(item):
            items.append(item)
        elif line.strip():
            log.warning("dropped an unreadable line of %s", path.name)
    return items


def write_local(path: Path, items: list[Item]) -> None:
    if items:
        path.write_text("".join(json.dumps(x) + "\n" for x in items), encoding="utf-8")
    else:
        path.unlink(missing_ok=True)


def _is_item(item: Any) -> TypeGuard[Item]:
    at = item.get("at", 0) if isinstance(item, dict) else None
    return (
        isinstance(item, dict)
        and isinstance(item.get("method"), str)
        and isinstance(item.get("args"), dict)
        and isinstance(at, int | float)
        and -1e12 < at < 1e12  # a time (also no NaN, no infinity, no int too large for a float)
    )


# -- keeping -------------------------------------------------------------------------------------
def keep(settings: Settings, item: Item) -> None:
    """A message to send later (signed): in Prefect, or in the local cache when Prefect cannot
    be asked."""
    item = sign(settings, item)
    try:
        _store(settings, item)
    except PrefectUnavailable as exc:
        log.warning("Slack %s kept on this machine only: %s", item["method"], exc)
        with locked(settings):
            _append(local_outbox(settings), item)


def move_local(settings: Settings) -> None:
    """What this machine kept while Prefect was away, into Prefect (a message's `at` keeps its
    place in the order). PrefectUnavailable when it goes away meanwhile: the rest stay here."""
    outbox, letters = local_outbox(settings), local_dead_letters(settings)
    if not outbox.exists() and not letters.exists():
        return
    with locked(settings):
        _move(outbox, lambda item: _store(settings, item))
    with locked(settings, "dead-letter"):
        _move(letters, lambda letter: _create_dead(settings, letter))


def _move(path: Path, put: Callable[[Item], None]) -> None:
    items = read_local(path)
    for n, item in enumerate(items):
        try:
            put(item)
        except PrefectUnavailable:
            write_local(path, items[n:])
            raise
    path.unlink(missing_ok=True)


def bury(settings: Settings, item: Item, why: str) -> None:
    """A message Slack refused for good, with the reason: in Prefect (the newest `KEEP_DEAD`),
    else in the local cache. Logs the method and the reason only, never the message."""
    log.warning(
        "Slack refused %r for good (%s): kept in the dead letters", item["method"][:40], why
    )
    letter = {**item, "reason": why, "dead_at": time.time()}
    try:
        _create_dead(settings, letter)
    except PrefectUnavailable:
        with locked(settings, "dead-letter"):
            _append(local_dead_letters(settings), letter)


def _create_dead(settings: Settings, letter: Item) -> None:
    key = dead_key(settings)
    description = f"Slack refused {letter['method']}: {letter.get('reason')}"
    _create(key, "cudamedic-dead-letter", letter, description)
    for old in _versions(key, offset=KEEP_DEAD):
        remove(str(old["id"]))


# -- reading (tests, operators) ------------------------------------------------------------------
def waiting(settings: Settings) -> list[Item]:
    """The messages waiting for Slack, oldest first: those in Prefect (`kept`: "prefect") and those
    this machine could not put there yet (`kept`: "local"). PrefectUnavailable: Prefect did not
    answer (the local ones alone would hide the others)."""
    items = [{**item, "kept": "prefect"} for _, item in stored(settings)]
    items += [{**item, "kept": "local"} for item in read_local(local_outbox(settings))]
    return sorted(items, key=lambda x: float(x.get("at") or 0))


def dead(settings: Settings) -> list[Item]:
    """The messages Slack refused for good, newest first (`kept` as in `waiting`)."""
    items = [
        {**data, "kept": "prefect"}
        for art in _versions(dead_key(settings), limit=KEEP_DEAD)
        if (data := _data(art)) is not None
    ]
    items += [{**x, "kept": "local"} for x in read_local(local_dead_letters(settings))]
    return sorted(items, key=lambda x: -float(x.get("dead_at") or 0))
