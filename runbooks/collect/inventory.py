"""Inventory: the hosts cudamedic may talk to, from our YAML or an Ansible YAML/INI inventory.

Our format (deploy/inventory.example.yaml documents every field)::

    defaults: {user: root, key_file: ~/.ssh/id_ed25519}
    hosts:
      node07: {address: 10.0.0.7, port: 22, gpus: 8, tags: [h100], jump: bastion}
      bastion: {address: bastion.example.com}

Ansible inventories (INI, YAML, a directory; group_vars/ and host_vars/; ranges) are read as
Ansible reads them: by ``ansible-inventory -i PATH --list`` when it is installed, else by our own
reader (runbooks/collect/ansible_inventory.py; the two agree, tests/test_ansible_inventory.py).
From each
host's variables: ``ansible_host``, ``ansible_port``, ``ansible_user``,
``ansible_ssh_private_key_file`` and ``-J``/``ProxyJump`` (a chain ``a,b`` too) in
``ansible_ssh_common_args``/``ansible_ssh_extra_args``; its groups become tags. When
``ansible-inventory`` fails or times out that is an InputError (no silent fallback: Ansible says
the inventory is broken). Every error is an InputError naming the file and the entry.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from runbooks.collect import ansible_inventory as ansible
from runbooks.core import names
from runbooks.core.errors import InputError

log = logging.getLogger(__name__)
MAX_JUMP_HOPS = 8


class Host(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    address: str
    port: int = 22
    user: str | None = None
    key_file: Path | None = None
    # another inventory host's name, or [user@]host[:port], or a chain of those "a,b" (through a,
    # then b: each hop of a chain is an SSH destination, as for ssh -J)
    jump: str | None = None
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
        ``[user@]host[:port]``, or a chain ``hop,hop``: every part validated like a host's own."""
        if v is None:
            return v
        hops = v.split(",")
        if len(hops) > MAX_JUMP_HOPS:
            raise ValueError(f"more than {MAX_JUMP_HOPS} jump hosts in {v[:80]!r}")
        for hop in hops:
            if names.is_inventory_name(hop):
                continue
            user, _, rest = hop.rpartition("@")
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
    read_by: Literal["cudamedic", "ansible-inventory"] = "cudamedic"

    def get(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            known = ", ".join(sorted(self.hosts)) or "none"
            raise InputError(f"host {name!r} is not in the inventory (known: {known})") from None

    def with_tag(self, tag: str) -> list[Host]:
        return [h for h in self.hosts.values() if tag in h.tags]


Reader = Literal["auto", "ansible-inventory", "cudamedic"]


def load_inventory(path: Path, *, reader: Reader = "auto", timeout: float = 60) -> Inventory:
    """Our YAML inventory, or an Ansible inventory (file or directory). ``reader`` decides who
    reads an Ansible inventory: ``auto`` ansible-inventory when installed, else our reader."""
    first = None
    if not path.is_dir():
        text = ansible.read_text(path)
        data = ansible.sniff_yaml(text, path)
        if isinstance(data, dict) and "hosts" in data and "all" not in data:
            return _from_native(data, path)
        ansible.check_yaml_file(data, path)
        first = (text, data)
    executable = ansible_inventory_executable() if reader != "cudamedic" else None
    if reader == "ansible-inventory" and executable is None:
        raise InputError(f"inventory {path}: ansible-inventory is not installed")
    if executable is None:
        return _from_ansible(ansible.read_ansible(path, first), path, "cudamedic")
    log.info("reading inventory %s with %s", path, executable)
    output = ansible.run_ansible_inventory(executable, path, timeout)
    return _from_ansible(ansible.parse_ansible_json(output, path), path, "ansible-inventory")


def ansible_inventory_executable() -> str | None:
    """ansible-inventory on PATH (Ansible installed, or its virtualenv activated), or None."""
    return shutil.which("ansible-inventory")


def _build(
    raw: dict[str, dict[str, Any]],
    path: Path,
    read_by: Literal["cudamedic", "ansible-inventory"] = "cudamedic",
) -> Inventory:
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
        # A chain's hops are SSH destinations (as for ssh -J a,b), resolved by ~/.ssh/config.
        external = host.jump is not None and any(ch in host.jump for ch in "@:.,")
        if host.jump and not external and host.jump not in hosts:
            raise InputError(
                f"inventory {path}: host {host.name!r}: jump host {host.jump!r} "
                "is not in the inventory"
            )
    return Inventory(hosts=hosts, read_by=read_by)


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


# Host field <- Ansible variables; where several are set, the last one listed wins (as in
# Ansible's ssh connection plugin).
_ANSIBLE_FIELDS = {
    "address": ("ansible_host", "ansible_ssh_host"),
    "port": ("ansible_port", "ansible_ssh_port"),
    "user": ("ansible_user", "ansible_ssh_user"),
    "key_file": ("ansible_private_key_file", "ansible_ssh_private_key_file"),
    "gpus": ("cudamedic_gpus",),
}
_JUMP = re.compile(r"(?:-J\s*|ProxyJump[=\s]\s*)([^\s'\"]+)", re.IGNORECASE)


def jump_from_ssh_args(*args: Any) -> str | None:
    """The ProxyJump (``-J a,b`` or ``-o ProxyJump=a,b``) in ssh arguments, or None."""
    for value in args:
        match = _JUMP.search(value) if isinstance(value, str) else None
        if match:
            return None if match.group(1).lower() == "none" else match.group(1)
    return None


def _ansible_host(name: str, hostvars: dict[str, Any], groups: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"address": name, "tags": groups}
    for field, keys in _ANSIBLE_FIELDS.items():
        for key in keys:
            if key in hostvars:
                out[field] = hostvars[key]
    jump = jump_from_ssh_args(
        hostvars.get("ansible_ssh_common_args"), hostvars.get("ansible_ssh_extra_args")
    )
    if jump:
        out["jump"] = jump
    return out


def _from_ansible(
    hosts: ansible.AnsibleHosts, path: Path, read_by: Literal["cudamedic", "ansible-inventory"]
) -> Inventory:
    raw = {name: _ansible_host(name, h.vars, h.groups) for name, h in hosts.items()}
    return _build(raw, path, read_by)
