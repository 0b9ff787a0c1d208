"""Parse ``docker inspect`` JSON of one container into the facts the classifier and fixes need.

Reads the object the Engine API returns for ``GET /containers/{id}/json`` (or a list holding one,
as the ``docker inspect`` CLI prints). Returns `InspectFacts`; never raises. Example input
(abridged, real shape)::

    {"Name": "/train", "Config": {"Image": "pytorch/pytorch:2.1.0-cuda12.1-cudnn8-runtime",
     "Env": ["CUDA_VISIBLE_DEVICES=0,1"]}, "HostConfig": {"ShmSize": 67108864,
     "DeviceRequests": null, "Runtime": "runc"}, "State": {"ExitCode": 135, "OOMKilled": false}}
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Any

from runbooks.core.model import Finding, Frozen

_BEYOND_MICROSECONDS = re.compile(r"(\.\d{6})\d+")
_CUDA_TAG = re.compile(r"(?i)cuda[-_]?(\d+)\.(\d+)|cu(\d{2,3})\b")
_GPU_IMAGE = re.compile(
    r"(?i)(?<![a-z])(cuda|torch|nvidia|vllm|triton)(?![a-z])|pytorch|nvcr\.io|tensorflow.{0,100}?gpu|-gpu\b"
)


def docker_time(value: object) -> datetime | None:
    """A Docker timestamp (RFC 3339 with nanoseconds: ``2024-05-01T10:00:00.123456789Z``, or an
    offset such as ``+02:00`` in `docker info`'s SystemTime) as an aware datetime, UTC when it
    names no zone; None for Docker's zero time (``0001-01-01T00:00:00Z``: never) or garbage.
    The one parser of Docker's times."""
    if not isinstance(value, str) or value.strip().startswith("0001-"):
        return None
    text = _BEYOND_MICROSECONDS.sub(r"\1", value.strip()).replace("Z", "+00:00")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


class GpuRequest(Frozen):
    driver: str = ""
    count: int = 0  # -1 means all
    device_ids: tuple[str, ...] = ()
    capabilities: tuple[tuple[str, ...], ...] = ()


class Ulimit(Frozen):
    name: str
    soft: int
    hard: int


class InspectFacts(Frozen):
    name: str = ""
    id: str = ""
    image: str = ""
    image_id: str = ""
    image_cuda: str | None = None  # CUDA version the image name/env says, e.g. "12.1"
    env: dict[str, str] = {}
    labels: dict[str, str] = {}
    gpu_requests: tuple[GpuRequest, ...] = ()
    runtime: str = ""
    devices: tuple[str, ...] = ()
    shm_size: int | None = None  # bytes; None when unset (engine default 64 MiB)
    ipc_mode: str = ""
    ulimits: tuple[Ulimit, ...] = ()
    cap_add: tuple[str, ...] = ()
    privileged: bool = False
    binds: tuple[str, ...] = ()
    mounts: tuple[dict[str, str], ...] = ()
    user: str = ""
    status: str = ""
    running: bool = False
    exit_code: int | None = None
    oom_killed: bool = False
    restart_count: int = 0
    error: str = ""
    started_at: str = ""
    finished_at: str = ""
    findings: tuple[Finding, ...] = ()

    @property
    def has_gpu_access(self) -> bool:
        if self.privileged and any("nvidia" in d for d in self.devices):
            return True
        if self.runtime == "nvidia":
            return self.env.get("NVIDIA_VISIBLE_DEVICES", "all") not in ("", "void", "none")
        return any(
            r.driver == "nvidia" or any("gpu" in caps for caps in r.capabilities)
            for r in self.gpu_requests
        ) or any("/dev/nvidia" in d for d in self.devices)

    @property
    def wants_gpu(self) -> bool:
        """Has GPUs, or by its env/image clearly should have them."""
        if self.has_gpu_access:
            return True
        if any(k.startswith(("NVIDIA_", "CUDA_")) for k in self.env):
            return True
        # Host driver binaries or libraries bind-mounted in by hand: the old pre-toolkit way.
        if any("nvidia" in b.lower() for b in self.binds):
            return True
        return bool(_GPU_IMAGE.search(self.image))

    def ulimit(self, name: str) -> Ulimit | None:
        return next((u for u in self.ulimits if u.name == name), None)


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    """A JSON array, or nothing (Docker writes null for an empty one; anything else is odd)."""
    return value if isinstance(value, list) else []


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: 1e999 reads as infinity
        return None


def parse_inspect(text: str, source: str = "containers/inspect.json") -> InspectFacts:
    findings: list[Finding] = []
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return _unreadable(source, "inspect-invalid-json", f"not JSON: {exc}")
    if isinstance(data, list):
        if not data:
            return _unreadable(source, "inspect-empty", "empty list")
        if len(data) > 1:
            findings.append(
                Finding(
                    code="inspect-many",
                    source=source,
                    message=f"{len(data)} objects; used the first",
                )
            )
        data = data[0]
    if not isinstance(data, dict) or not data.keys() & _CONTAINER_KEYS:
        return _unreadable(source, "inspect-empty", "not a container object")
    odd = [k for k in ("Config", "HostConfig", "State") if not isinstance(data.get(k), dict | None)]
    if odd:
        findings.append(
            Finding(
                code="inspect-odd-section",
                source=source,
                severity="warning",
                message=f"{', '.join(odd)} not an object; read as empty",
            )
        )
    return _facts(data, source, findings)


def _unreadable(source: str, code: str, message: str) -> InspectFacts:
    """No facts, and the warning that says why the inspect JSON could not be read."""
    return InspectFacts(
        findings=(Finding(code=code, source=source, severity="warning", message=message),)
    )


_CONTAINER_KEYS = {"Id", "Name", "Image", "Config", "HostConfig", "State"}


def facts_from_dict(data: dict[str, Any], source: str = "containers/inspect.json") -> InspectFacts:
    return _facts(data, source, [])


def _facts(data: dict[str, Any], source: str, findings: list[Finding]) -> InspectFacts:
    config = _as_dict(data.get("Config"))
    host = _as_dict(data.get("HostConfig"))
    state = _as_dict(data.get("State"))
    env = _env(config)
    image = str(config.get("Image") or data.get("Image") or "")
    return InspectFacts(
        name=str(data.get("Name") or "").lstrip("/"),
        id=str(data.get("Id") or ""),
        image=image,
        image_id=str(data.get("Image") or ""),
        image_cuda=_image_cuda(image, env),
        env=env,
        labels={str(k): str(v) for k, v in _as_dict(config.get("Labels")).items()},
        gpu_requests=_gpu_requests(host),
        runtime=str(host.get("Runtime") or ""),
        devices=tuple(
            str(d.get("PathOnHost", "")) for d in _list(host.get("Devices")) if isinstance(d, dict)
        ),
        shm_size=_int(host.get("ShmSize")) or None,
        ipc_mode=str(host.get("IpcMode") or ""),
        ulimits=_ulimits(host),
        cap_add=tuple(str(c) for c in _list(host.get("CapAdd"))),
        privileged=bool(host.get("Privileged")),
        binds=tuple(str(b) for b in _list(host.get("Binds"))),
        mounts=_mounts(data),
        user=str(config.get("User") or ""),
        status=str(state.get("Status") or ""),
        running=bool(state.get("Running")),
        exit_code=_int(state.get("ExitCode")),
        oom_killed=bool(state.get("OOMKilled")),
        restart_count=_int(data.get("RestartCount")) or 0,
        error=str(state.get("Error") or ""),
        started_at=str(state.get("StartedAt") or ""),
        finished_at=str(state.get("FinishedAt") or ""),
        findings=tuple(findings),
    )


def _env(config: dict[str, Any]) -> dict[str, str]:
    """Config.Env (["KEY=value", ...]) as a dict; a later KEY wins."""
    env: dict[str, str] = {}
    for item in _list(config.get("Env")):
        if isinstance(item, str):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def _gpu_requests(host: dict[str, Any]) -> tuple[GpuRequest, ...]:
    """HostConfig.DeviceRequests (what `--gpus` asks for); entries that are not objects skipped."""
    requests: list[GpuRequest] = []
    for req in _list(host.get("DeviceRequests")):
        if not isinstance(req, dict):
            continue
        caps = tuple(
            tuple(str(c) for c in group)
            for group in _list(req.get("Capabilities"))
            if isinstance(group, list)
        )
        requests.append(
            GpuRequest(
                driver=str(req.get("Driver") or ""),
                count=_int(req.get("Count")) or 0,
                device_ids=tuple(str(d) for d in _list(req.get("DeviceIDs"))),
                capabilities=caps,
            )
        )
    return tuple(requests)


def _ulimits(host: dict[str, Any]) -> tuple[Ulimit, ...]:
    """HostConfig.Ulimits that have a name; an unreadable limit reads as 0."""
    return tuple(
        Ulimit(name=str(u["Name"]), soft=_int(u.get("Soft")) or 0, hard=_int(u.get("Hard")) or 0)
        for u in _list(host.get("Ulimits"))
        if isinstance(u, dict) and u.get("Name")
    )


def _mounts(data: dict[str, Any]) -> tuple[dict[str, str], ...]:
    """The container's mounts, each with the keys the fixes read (values as strings)."""
    return tuple(
        {k: str(v) for k, v in m.items() if k in ("Type", "Source", "Destination", "Name", "RW")}
        for m in _list(data.get("Mounts"))
        if isinstance(m, dict)
    )


def _image_cuda(image: str, env: dict[str, str]) -> str | None:
    if env.get("CUDA_VERSION"):
        parts = env["CUDA_VERSION"].split(".")
        if len(parts) >= 2 and parts[0].isdigit():
            return f"{parts[0]}.{parts[1]}"
    match = _CUDA_TAG.search(image)
    if not match:
        return None
    if match.group(1):
        return f"{match.group(1)}.{match.group(2)}"
    digits = match.group(3)
    return f"{digits[:-1]}.{digits[-1]}"


class ImageNow(Frozen):
    """What a container's image reference (``Config.Image``, e.g. ``train:latest``) names now,
    from ``containers/NAME.image.json``: the Engine API's image inspect of that reference at
    collection time, trimmed to ``{"Ref", "Id", "Created", "RepoTags", "Error"}``."""

    ref: str = ""
    id: str | None = None  # None: the reference no longer names any image
    created: str = ""
    error: str = ""


def parse_image_now(text: str) -> ImageNow | None:
    """Never raises: anything but a JSON object with a string ``Ref`` is None."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("Ref"), str):
        return None
    ident = data.get("Id")
    return ImageNow(
        ref=data["Ref"][:300],
        id=ident if isinstance(ident, str) and ident else None,
        created=str(data.get("Created") or "")[:40],
        error=str(data.get("Error") or "")[:300],
    )
