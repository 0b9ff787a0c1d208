"""Inventory: the hosts cudamedic may talk to, from our YAML or an Ansible YAML/INI inventory.

Our format (deploy/inventory.example.yaml documents every field)::

    defaults: {user: root, key_file: ~/.ssh/id_ed25519}
    hosts:
      node07: {address: 10.0.0.7, port: 22, gpus: 8, tags: [h100], jump: bastion}
      bastion: {address: bastion.example.com}

Ansible inventories are read too: ``ansible_host``, ``ansible_port``, ``ansible_user``,
``ansible_ssh_private_key_file`` and ``-J``/``ProxyJump`` in ``ansible_ssh_common_args``; group
names become tags. Every error is an InputError naming the file and the entry.
"""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runbooks import names
from runbooks.errors import InputError


class Host(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    address: str
    port: int = 22
    user: str | None = None
    key_file: Path | None = None
    jump: str | None = None  # another inventory host's name, or user@host[:port]
    tags: tuple[str, ...] = ()
    gpus: int | None = Field(default=None, ge=0)
    # Explicit opt-in to accept (and remember for this run) an unknown host key.
    accept_unknown_host_key: bool = False
    docker_host: str | None = None  # remote Docker socket, default unix:///var/run/docker.sock

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return names.inventory_name(v)

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return names.host_address(v)

    @field_validator("port", mode="before")
    @classmethod
    def _port(cls, v: Any) -> int:
        return names.port(v)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        return None if v is None else names.user_name(v)

    @field_validator("key_file", mode="before")
    @classmethod
    def _key(cls, v: Any) -> Any:
        try:
            return Path(v).expanduser() if isinstance(v, str) else v
        except RuntimeError as exc:  # ~nosuchuser/...
            raise ValueError(f"cannot expand {v!r}: {exc}") from None

    @field_validator("jump")
    @classmethod
    def _jump(cls, v: str | None) -> str | None:
        """Another inventory host's name (checked when the inventory is built), or
        ``[user@]host[:port]``: every part validated like a host's own."""
        if v is None or names.is_inventory_name(v):
            return v
        user, _, rest = v.rpartition("@")
        address, _, port = rest.partition(":")
        if user:
            names.user_name(user)
        names.host_address(address)
        if port:
            names.port(port)
        return v


class Inventory(BaseModel):
    model_config = ConfigDict(frozen=True)

    hosts: dict[str, Host] = {}

    def get(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            known = ", ".join(sorted(self.hosts)) or "none"
            raise InputError(f"host {name!r} is not in the inventory (known: {known})") from None

    def with_tag(self, tag: str) -> list[Host]:
        return [h for h in self.hosts.values() if tag in h.tags]


def load_inventory(path: Path) -> Inventory:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read inventory {path}: {exc}") from exc
    if path.suffix.lower() in {".ini", ".cfg", ""} and not text.lstrip().startswith(
        ("hosts:", "all:")
    ):
        try:
            return _from_ansible_ini(text, path)
        except configparser.Error:
            pass  # not INI: fall through to YAML
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: an integer of 5000 digits
        raise InputError(f"inventory {path} is not valid YAML: {exc}") from exc
    except RecursionError:  # PyYAML composes nested collections recursively
        raise InputError(f"inventory {path} is nested too deeply to be an inventory") from None
    if not isinstance(data, dict):
        raise InputError(f"inventory {path} must be a mapping with 'hosts:' (or an Ansible 'all:')")
    if "hosts" in data and "all" not in data:
        return _from_native(data, path)
    return _from_ansible_yaml(data, path)


def _build(raw: dict[str, dict[str, Any]], path: Path) -> Inventory:
    hosts: dict[str, Host] = {}
    for name, fields in raw.items():
        try:
            hosts[str(name)] = Host(name=str(name), **fields)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'host'}: {_msg(e)}" for e in exc.errors()
            )
            raise InputError(f"inventory {path}: host {str(name)!r}: {problems}") from None
        except InputError as exc:
            raise InputError(f"inventory {path}: host {str(name)!r}: {exc}") from None
        except TypeError as exc:
            raise InputError(f"inventory {path}: host {str(name)!r}: {exc}") from None
    for host in hosts.values():
        # A bare name must be an inventory host; user@host[:port] or a dotted name is external.
        external = host.jump is not None and any(ch in host.jump for ch in "@:.")
        if host.jump and not external and host.jump not in hosts:
            raise InputError(
                f"inventory {path}: host {host.name!r}: jump host {host.jump!r} "
                "is not in the inventory"
            )
    return Inventory(hosts=hosts)


def _msg(error: Any) -> str:
    ctx = error.get("ctx") or {}
    inner = ctx.get("error")
    return str(inner) if inner is not None else str(error["msg"])


def _from_native(data: dict[str, Any], path: Path) -> Inventory:
    defaults = data.get("defaults") or {}
    hosts = data.get("hosts") or {}
    if not isinstance(defaults, dict) or not isinstance(hosts, dict):
        raise InputError(f"inventory {path}: 'defaults' and 'hosts' must be mappings")
    raw: dict[str, dict[str, Any]] = {}
    for name, fields in hosts.items():
        if fields is None:
            fields = {}
        if not isinstance(fields, dict):
            raise InputError(f"inventory {path}: host {name!r} must be a mapping")
        merged = {**defaults, **fields}
        merged.setdefault("address", str(name))
        raw[str(name)] = merged
    return _build(raw, path)


_ANSIBLE_KEYS = {
    "ansible_host": "address",
    "ansible_ssh_host": "address",
    "ansible_port": "port",
    "ansible_ssh_port": "port",
    "ansible_user": "user",
    "ansible_ssh_user": "user",
    "ansible_ssh_private_key_file": "key_file",
    "cudamedic_gpus": "gpus",
}
_JUMP = re.compile(r"(?:-J\s*|ProxyJump=)(\S+)")


def _ansible_host(name: str, hostvars: dict[str, Any], groups: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"address": name, "tags": tuple(g for g in groups if g != "all")}
    for key, value in hostvars.items():
        if key in _ANSIBLE_KEYS:
            out[_ANSIBLE_KEYS[key]] = value
        elif key == "ansible_ssh_common_args" and isinstance(value, str):
            match = _JUMP.search(value)
            if match:
                out["jump"] = match.group(1).strip("'\"")
    return out


def _from_ansible_yaml(data: dict[str, Any], path: Path) -> Inventory:
    raw: dict[str, dict[str, Any]] = {}

    visits = 0

    def mapping(value: Any, what: str) -> dict[Any, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise InputError(f"inventory {path}: {what} must be a mapping")
        return value

    def walk(
        group: str, node: Any, inherited: dict[str, Any], parents: list[str], path_ids: set[int]
    ) -> None:
        nonlocal visits
        if node is None:
            return
        mapping(node, f"group {group!r}")
        visits += 1
        if id(node) in path_ids:  # YAML anchors can make a group its own child
            raise InputError(f"inventory {path}: group {group!r} contains itself")
        if visits > 10_000:  # ... or repeat one group exponentially often
            raise InputError(f"inventory {path}: more than 10000 groups (repeated anchors?)")
        gvars = {**inherited, **mapping(node.get("vars"), f"group {group!r} vars")}
        chain = [*parents, group]
        for hname, hvars in mapping(node.get("hosts"), f"group {group!r} hosts").items():
            merged = {**gvars, **mapping(hvars, f"host {hname!r}")}
            entry = _ansible_host(str(hname), merged, chain)
            if str(hname) in raw:
                old = raw[str(hname)]
                entry["tags"] = tuple(dict.fromkeys([*old.get("tags", ()), *entry["tags"]]))
                entry = {**old, **entry}
            raw[str(hname)] = entry
        children = mapping(node.get("children"), f"group {group!r} children")
        for child, cnode in children.items():
            walk(str(child), cnode, gvars, chain, path_ids | {id(node)})

    for group, node in data.items():
        walk(str(group), node, {}, [], set())
    return _build(raw, path)


def _from_ansible_ini(text: str, path: Path) -> Inventory:
    raw: dict[str, dict[str, Any]] = {}
    group = "ungrouped"
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        if stripped.startswith("["):
            if not stripped.endswith("]"):
                raise configparser.ParsingError(f"{path}:{lineno}")
            group = stripped[1:-1]
            continue
        if ":" in group:  # [group:vars] / [group:children] — not host lines
            continue
        try:
            parts = shlex.split(stripped)
        except ValueError as exc:
            raise InputError(f"inventory {path}:{lineno}: {exc}") from None
        name, hostvars = parts[0], {}
        for token in parts[1:]:
            if "=" not in token:
                raise InputError(f"inventory {path}:{lineno}: expected key=value, got {token!r}")
            key, value = token.split("=", 1)
            hostvars[key] = value
        entry = _ansible_host(name, hostvars, [group])
        if name in raw:
            entry["tags"] = tuple(dict.fromkeys([*raw[name].get("tags", ()), *entry["tags"]]))
            entry = {**raw[name], **entry}
        raw[name] = entry
    if not raw:
        raise configparser.ParsingError(str(path))
    return _build(raw, path)
