"""One call to the Prefect REST API without the client's retries, for the places that must answer
fast or fall back (the request memory of the Slack app and the alert receiver, the fleet-wide fix
count): a 2 s timeout, no retries but of a busy server's 503 (twice, within 0.7 s), no ephemeral
server."""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

# Prefect answers 503 while its database is busy (SQLite locked under a burst of writes): the
# request is tried again after these waits, then the error is raised.
BUSY_WAITS_S = (0.2, 0.5)


def call(method: str, path: str, body: Any = None, timeout: float = 2.0) -> Any:
    """One call to the Prefect API of PREFECT_API_URL (set by the CLI for the embedded server
    too), without the client's retries. LookupError: no API is configured."""
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if not api.startswith(("http://", "https://")):
        raise LookupError("PREFECT_API_URL is not set")
    headers = {"Content-Type": "application/json"}
    if key := os.environ.get("PREFECT_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    elif auth := os.environ.get("PREFECT_API_AUTH_STRING"):
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    data = json.dumps(body).encode() if body is not None else None
    for wait in (*BUSY_WAITS_S, None):
        req = urllib.request.Request(api + path, data=data, method=method, headers=headers)  # noqa: S310
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
                raw = resp.read()
            break
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or wait is None:
                raise
            time.sleep(wait)  # busy: nothing was written (the transaction was rolled back)
    return json.loads(raw) if raw else None
