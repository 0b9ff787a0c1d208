"""Validation of every user-supplied string that can reach a shell, an SSH login or a Docker call.

Validation refuses; it never "cleans". A refused value raises InputError with the reason, before
anything runs. Example: ``container_name("x; touch /tmp/pwned")`` raises
``InputError("invalid container name 'x; touch /tmp/pwned': ...")``.
"""

from __future__ import annotations

import ipaddress
import re

from runbooks.core.errors import InputError

# Docker's own rule for container names (daemon/names: validContainerNamePattern).
_CONTAINER = re.compile(r"/?[a-zA-Z0-9][a-zA-Z0-9_.-]{0,254}")
_HOSTNAME = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,62})(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,62}))*\.?"
)
_INVENTORY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
_ZONE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,31}")


def _show(value: str) -> str:
    shown = value if len(value) <= 80 else value[:77] + "..."
    return repr(shown)


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0, 9), *range(11, 32), 127)}


def terminal_safe(text: str) -> str:
    """Text for a terminal: lines kept, other control characters (ESC, CR, BEL, ...) shown
    escaped, never sent raw (a log line must not clear the screen or fake a line)."""
    return text.translate(_CONTROL)


def display(value: str, limit: int = 80) -> str:
    """A name from a target, safe to print: control characters escaped, length bounded."""
    shown = value if len(value) <= limit else value[: limit - 3] + "..."
    return "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in shown)


def container_name(value: str) -> str:
    """Return the name without a leading '/', or raise InputError."""
    if not isinstance(value, str) or not _CONTAINER.fullmatch(value):
        raise InputError(
            f"invalid container name {_show(str(value))}: allowed are letters, digits and '_.-', "
            "starting with a letter or digit"
        )
    return value.lstrip("/")


def host_address(value: str) -> str:
    """A DNS name or an IP literal (IPv6 may be bracketed)."""
    bracketed = value.startswith("[") and value.endswith("]")
    raw = value[1:-1] if bracketed else value
    try:
        address = str(ipaddress.ip_address(raw))
    except ValueError:
        if bracketed:  # [..] holds an IPv6 address, never a name
            raise InputError(f"invalid host address {_show(value)}: not an IPv6 address") from None
    else:
        # An IPv6 zone (fe80::1%eth0) is an interface name; Python takes any text there.
        if "%" in address and not _ZONE.fullmatch(address.partition("%")[2]):
            raise InputError(f"invalid host address {_show(value)}: bad IPv6 zone")
        return address
    if not _HOSTNAME.fullmatch(raw) or len(raw) > 253:
        raise InputError(f"invalid host address {_show(value)}: not a DNS name or IP address")
    return raw


def is_inventory_name(value: str) -> bool:
    return bool(_INVENTORY_NAME.fullmatch(value))


def inventory_name(value: str) -> str:
    if not _INVENTORY_NAME.fullmatch(value):
        raise InputError(f"invalid host name {_show(value)}: allowed are letters, digits and '_.-'")
    return value


def user_name(value: str) -> str:
    if not _USER.fullmatch(value):
        raise InputError(f"invalid user name {_show(value)}")
    return value


def port(value: int | str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: YAML's .inf
        raise InputError(f"invalid port {_show(str(value))}: not a number") from None
    if not 1 <= number <= 65535:
        raise InputError(f"invalid port {number}: must be 1..65535")
    return number


# The name a fix gives the original container it keeps as a backup (runbooks/fix/plan.py).
BACKUP_RE = re.compile(r"-cudamedic-backup-(\d{8}T\d{6}Z)$")
# The never-started container holding a fix's lock and record on the target
# (runbooks/fix/fixlock.py).
FIX_LOCK_SUFFIX = "-cudamedic-fix-lock"


def is_backup(name: str) -> bool:
    """Is this one of cudamedic's own containers, a backup or a fix's lock (never a workload to
    diagnose)?"""
    return bool(BACKUP_RE.search(name)) or name.endswith(FIX_LOCK_SUFFIX)
