"""Render a container's effective `docker run` command from its inspect JSON (PURE).

Shows a person what the container is, before and after a fix, and the difference. Environment
values are redacted (secrets never reach a plan, a report or a log). Example output::

    docker run --name train --gpus all --shm-size 64m -v data:/data -e NCCL_DEBUG=INFO img cmd

Only options that differ from Docker's defaults are shown.
"""

from __future__ import annotations

import shlex
from typing import Any

from runbooks.collect.redact import MASK, name_is_secret, redact_argv, redact_text

_SIZE_UNITS = ((1 << 30, "g"), (1 << 20, "m"), (1 << 10, "k"))


def fmt_size(size: int) -> str:
    for unit, suffix in _SIZE_UNITS:
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def _d(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _l(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def gpus_arg(requests: list[Any]) -> list[str]:
    out = []
    for req in requests:
        if not isinstance(req, dict):
            continue
        caps = [c for group in _l(req.get("Capabilities")) for c in _l(group)]
        if "gpu" not in caps and req.get("Driver") != "nvidia":
            continue
        ids = _l(req.get("DeviceIDs"))
        if ids:
            out.append(f'"device={",".join(str(i) for i in ids)}"')
        elif req.get("Count") == -1:
            out.append("all")
        else:
            out.append(str(req.get("Count")))
    return out


def _env_item(item: str, image_env: set[str]) -> str | None:
    if item in image_env:
        return None  # comes from the image, not from `docker run -e`
    name, sep, _value = item.partition("=")
    if sep and name_is_secret(name):
        return f"{name}={MASK}"
    return redact_text(item)


def run_args(inspect: dict[str, Any], image_env: list[str] | None = None) -> list[str]:
    """The `docker run` arguments (without `docker run`) that would recreate this container."""
    config, host = _d(inspect.get("Config")), _d(inspect.get("HostConfig"))
    args: list[str] = [f"--name {str(inspect.get('Name', '')).lstrip('/')}"]
    args += _gpu_args(host)
    args += _isolation_args(host)
    args += _network_and_storage_args(host)
    args += _restart_and_limit_args(host)
    args += _process_args(config, image_env)
    log = _d(host.get("LogConfig"))
    if log.get("Type") and log.get("Type") != "json-file":
        args.append(f"--log-driver {log['Type']}")
    if config.get("Entrypoint"):
        entrypoint = redact_argv([str(e) for e in config["Entrypoint"]])
        args.append(f"--entrypoint {shlex.quote(' '.join(entrypoint))}")
    args.append(str(config.get("Image") or inspect.get("Image") or "?"))
    cmd = _l(config.get("Cmd"))
    if cmd:
        args.append(shlex.join(redact_argv([str(c) for c in cmd])))
    return args


def _gpu_args(host: dict[str, Any]) -> list[str]:
    """--gpus, --runtime and --device: how the container reaches the GPUs."""
    args = [f"--gpus {g}" for g in gpus_arg(_l(host.get("DeviceRequests")))]
    if host.get("Runtime") and host.get("Runtime") != "runc":
        args.append(f"--runtime {host['Runtime']}")
    for dev in _l(host.get("Devices")):
        if isinstance(dev, dict):
            args.append(f"--device {dev.get('PathOnHost')}:{dev.get('PathInContainer')}")
    return args


def _isolation_args(host: dict[str, Any]) -> list[str]:
    """--ipc, --shm-size, --ulimit, the capabilities and --privileged."""
    args = []
    ipc = str(host.get("IpcMode") or "")
    if ipc and ipc not in ("private", "shareable"):
        args.append(f"--ipc {ipc}")
    shm = host.get("ShmSize")
    if isinstance(shm, int) and shm and ipc != "host":
        args.append(f"--shm-size {fmt_size(shm)}")
    for u in _l(host.get("Ulimits")):
        if isinstance(u, dict):
            soft, hard = u.get("Soft"), u.get("Hard")
            value = f"{soft}" if soft == hard else f"{soft}:{hard}"
            args.append(f"--ulimit {u.get('Name')}={value}")
    args += [f"--cap-add {cap}" for cap in _l(host.get("CapAdd"))]
    args += [f"--cap-drop {cap}" for cap in _l(host.get("CapDrop"))]
    if host.get("Privileged"):
        args.append("--privileged")
    return args


def _network_and_storage_args(host: dict[str, Any]) -> list[str]:
    """--network, the binds (-v) and mounts (--mount), and the published ports (-p)."""
    args = []
    net = str(host.get("NetworkMode") or "")
    if net and net not in ("default", "bridge"):
        args.append(f"--network {net}")
    args += [f"-v {bind}" for bind in _l(host.get("Binds"))]
    for m in _l(host.get("Mounts")):
        if isinstance(m, dict):
            ro = ",readonly" if m.get("ReadOnly") else ""
            args.append(
                f"--mount type={m.get('Type')},source={m.get('Source')},"
                f"target={m.get('Target')}{ro}"
            )
    for port, bindings in sorted(_d(host.get("PortBindings")).items()):
        for b in _l(bindings):
            if isinstance(b, dict):
                hip = f"{b.get('HostIp')}:" if b.get("HostIp") else ""
                args.append(f"-p {hip}{b.get('HostPort')}:{port.replace('/tcp', '')}")
    return args


def _restart_and_limit_args(host: dict[str, Any]) -> list[str]:
    """--restart, --memory and --cpus."""
    args = []
    restart = _d(host.get("RestartPolicy"))
    if restart.get("Name") and restart.get("Name") != "no":
        count = f":{restart['MaximumRetryCount']}" if restart.get("MaximumRetryCount") else ""
        args.append(f"--restart {restart['Name']}{count}")
    if host.get("Memory"):
        args.append(f"--memory {fmt_size(int(host['Memory']))}")
    if host.get("NanoCpus"):
        args.append(f"--cpus {int(host['NanoCpus']) / 1e9:g}")
    return args


def _process_args(config: dict[str, Any], image_env: list[str] | None) -> list[str]:
    """--user, -w, the env the run set (-e, secrets masked), --label and --health-cmd."""
    args = []
    if config.get("User"):
        args.append(f"--user {config['User']}")
    if config.get("WorkingDir"):
        args.append(f"-w {config['WorkingDir']}")
    image_env_set = set(image_env or [])
    for item in _l(config.get("Env")):
        if isinstance(item, str) and (shown := _env_item(item, image_env_set)) is not None:
            args.append(f"-e {shlex.quote(shown)}")
    for key, value in sorted(_d(config.get("Labels")).items()):
        shown = MASK if name_is_secret(str(key)) else redact_text(str(value))
        args.append(f"--label {shlex.quote(f'{key}={shown}')}")
    if _d(config.get("Healthcheck")).get("Test"):
        test = redact_argv([str(t) for t in config["Healthcheck"]["Test"][1:]])
        args.append(f"--health-cmd {shlex.quote(' '.join(test))}")
    return args


def diff(before: list[str], after: list[str]) -> list[str]:
    """Lines for a person: '  ' unchanged, '- ' removed, '+ ' added, in `after` order."""
    removed = [a for a in before if a not in after]
    lines = [f"- {a}" for a in removed]
    lines += [("+ " if a not in before else "  ") + a for a in after]
    return lines
