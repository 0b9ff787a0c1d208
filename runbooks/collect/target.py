"""TARGET as the user writes it: ``local``, an inventory host name, or ``ssh://user@host[:port]``.

Pure: resolves to a `Target` (kind + Host) or raises InputError with the reason.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from runbooks.collect.inventory import Host, Inventory
from runbooks.core import names
from runbooks.core.errors import InputError
from runbooks.core.model import Frozen


class Target(Frozen):
    kind: Literal["local", "ssh"]
    name: str
    host: Host | None = None
    jump: Host | None = None


def resolve_target(spec: str, inventory: Inventory | None) -> Target:
    if spec == "local":
        return Target(kind="local", name="local")
    if spec.startswith("ssh://"):
        if any(ch.isspace() or not ch.isprintable() for ch in spec):
            # urlsplit silently drops tabs and newlines: refuse rather than connect elsewhere
            raise InputError(f"invalid target {spec[:80]!r}: whitespace or control characters")
        try:
            url = urlsplit(spec)
            url_port = url.port
        except ValueError as exc:
            raise InputError(f"invalid target {spec!r}: {exc}") from None
        if url.password is not None:
            raise InputError("passwords in ssh:// targets are not accepted; use a key")
        if not url.hostname or url.path not in ("", "/") or url.query or url.fragment:
            raise InputError(f"invalid target {spec!r}: expected ssh://user@host[:port]")
        address = names.host_address(url.hostname)
        host = Host(
            name=address if ":" not in address else "ipv6-" + address.replace(":", "-").strip("-"),
            address=address,
            port=url_port or 22,
            user=names.user_name(url.username) if url.username else None,
        )
        return Target(kind="ssh", name=host.name, host=host)
    names.inventory_name(spec)
    if inventory is None:
        raise InputError(
            f"target {spec!r} is neither 'local' nor ssh://user@host[:port], and no inventory "
            "is configured (--inventory or CUDAMEDIC_INVENTORY)"
        )
    host = inventory.get(spec)
    jump = None
    if host.jump and host.jump in inventory.hosts:
        jump = inventory.hosts[host.jump]
    return Target(kind="ssh", name=host.name, host=host, jump=jump)
