"""SSH to a host with paramiko: connection policy, host-key checking, bounded command runs.

The only module that imports paramiko. Host keys are checked against ``known_hosts`` (the user's,
the system's and ``Settings.known_hosts``); an unknown key is rejected unless the inventory opts
in for that host (``accept_unknown_host_key``), a changed key is always rejected. ``~/.ssh/config``
supplies HostName, Port, User, IdentityFile, ProxyJump and UserKnownHostsFile. paramiko's
exceptions are translated to runbooks.core.errors here and nowhere else.
"""

from __future__ import annotations

import logging
import select
import shlex
import threading
import time
from pathlib import Path
from typing import Any

import paramiko

from runbooks.collect.inventory import Host
from runbooks.collect.remote.runner import BoundedBuffer, CommandResult, Keep
from runbooks.core.errors import (
    AuthFailed,
    CudamedicError,
    HostKeyRejected,
    HostUnreachable,
    InputError,
    TargetError,
)
from runbooks.core.settings import Settings

log = logging.getLogger(__name__)
logging.getLogger("paramiko").setLevel(logging.CRITICAL)


class _AcceptOnce(paramiko.MissingHostKeyPolicy):
    """Opt-in policy for one host: accept an unknown key for this connection, never save it."""

    def __init__(self) -> None:
        self.accepted: str | None = None

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        self.accepted = f"{key.get_name()} {key.fingerprint}"
        log.warning(
            "accepting unknown host key for %s (%s) by inventory opt-in", hostname, self.accepted
        )


def _ssh_config(settings: Settings, address: str) -> dict[str, Any]:
    path = settings.ssh_config or Path("~/.ssh/config").expanduser()
    if not path.is_file():
        return {}
    try:
        config = paramiko.SSHConfig.from_path(str(path))
        return dict(config.lookup(address))
    except (OSError, paramiko.SSHException, ValueError) as exc:
        raise InputError(f"cannot read ssh config {path}: {exc}") from exc


def _parse_jump(spec: str) -> tuple[str | None, str, int]:
    user, _, rest = spec.rpartition("@")
    host, _, port = rest.partition(":")
    return (user or None), host, int(port) if port else 22


class SshRunner:
    """A connected SSH session to one host; runs commands with a timeout and an output bound."""

    def __init__(
        self,
        host: Host,
        settings: Settings,
        *,
        jump_host: Host | None = None,
    ) -> None:
        self.host = host
        self.name = host.name
        self.settings = settings
        self.accepted_host_key: str | None = None
        self._jump: SshRunner | None = None
        self._client = self._connect(jump_host)

    # -- connection -----------------------------------------------------------------------
    def _connect(self, jump_host: Host | None) -> paramiko.SSHClient:
        host, settings = self.host, self.settings
        cfg = _ssh_config(settings, host.address)
        address = str(cfg.get("hostname", host.address))
        port = host.port if host.port != 22 else int(cfg.get("port", 22))
        user = host.user or cfg.get("user") or settings.ssh_user or "root"
        key_files = _key_files(host, settings, cfg)
        client, policy = _client_with_host_keys(host, settings, cfg, address, port)
        jump_spec = host.jump or cfg.get("proxyjump")
        sock = self._through_jump(str(jump_spec), jump_host, address, port) if jump_spec else None
        timeout = settings.ssh_connect_timeout
        where = f"{user}@{address}:{port}"
        try:
            client.connect(
                address,
                port=port,
                username=user,
                key_filename=key_files or None,  # type: ignore[arg-type]  # paramiko takes a list
                password=settings.ssh_password.get_secret_value()
                if settings.ssh_password
                else None,
                look_for_keys=not key_files,
                allow_agent=True,
                timeout=timeout,
                banner_timeout=timeout,
                auth_timeout=timeout,
                channel_timeout=timeout,
                sock=sock,
            )
        except (paramiko.SSHException, OSError, ValueError, TypeError) as exc:
            raise _connect_error(exc, host.name, where, timeout) from None
        if isinstance(policy, _AcceptOnce):
            self.accepted_host_key = policy.accepted
        return client

    def _through_jump(
        self, jump_spec: str, jump_host: Host | None, address: str, port: int
    ) -> paramiko.Channel:
        """A channel to address:port opened by the jump host (ProxyJump), kept in self._jump.
        A chain ``a,b`` (as ssh -J): the jump host is b, reached through a (its own jump)."""
        if jump_host is None:
            *before, last = jump_spec.split(",")
            juser, jaddr, jport = _parse_jump(last)
            jump_host = Host(
                name=jaddr.replace(":", "_") or "jump",
                address=jaddr,
                port=jport,
                user=juser,
                jump=",".join(before) or None,
            )
        self._jump = SshRunner(jump_host, self.settings)
        try:
            transport = self._jump._client.get_transport()
            assert transport is not None
            return transport.open_channel(
                "direct-tcpip",
                (address, port),
                ("127.0.0.1", 0),
                timeout=self.settings.ssh_connect_timeout,
            )
        except (paramiko.SSHException, OSError) as exc:
            self._jump.close()
            raise HostUnreachable(
                f"{self.host.name}: jump host {jump_host.name} cannot reach {address}:{port}: {exc}"
            ) from exc

    @property
    def transport(self) -> paramiko.Transport:
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            raise TargetError(f"{self.name}: SSH connection is closed")
        return transport

    # -- commands -------------------------------------------------------------------------
    def run(
        self, command: str, *, timeout: float, max_bytes: int, keep: Keep = "head"
    ) -> CommandResult:
        start = time.monotonic()
        out, err = BoundedBuffer(max_bytes, keep), BoundedBuffer(max(max_bytes // 4, 65536), "tail")
        try:
            chan = self.transport.open_session(timeout=self.settings.ssh_connect_timeout)
            chan.settimeout(0.5)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, TargetError) as exc:  # TargetError: it dropped
            return CommandResult(command=command, exit_code=255, stderr=f"ssh: {exc}".encode())
        deadline = start + timeout
        timed_out = False
        exited: float | None = None  # when the exit status was first seen
        try:
            while True:
                if chan.recv_ready():
                    out.write(chan.recv(65536))
                elif chan.recv_stderr_ready():
                    err.write(chan.recv_stderr(65536))
                elif chan.exit_status_ready() or chan.closed:
                    # The rest of the output may follow the exit status: read until the
                    # remote end's EOF, or a moment (a background child may hold it open).
                    exited = exited or time.monotonic()
                    if (
                        chan.eof_received
                        or chan.closed
                        or time.monotonic() - exited > _AFTER_EXIT_S
                    ):
                        break
                    select.select([chan], [], [], 0.05)
                elif time.monotonic() > deadline:
                    timed_out = True
                    break
                else:
                    select.select([chan], [], [], min(0.2, max(0.0, deadline - time.monotonic())))
            # The checks above run one after the other: output that arrived after the first
            # and before the one that ended the loop is buffered, unread (issue 28).
            while chan.recv_ready() and time.monotonic() <= deadline:
                out.write(chan.recv(65536))
            while chan.recv_stderr_ready() and time.monotonic() <= deadline:
                err.write(chan.recv_stderr(65536))
            code = None if timed_out else chan.recv_exit_status()
        except (paramiko.SSHException, OSError) as exc:
            err.write(f"\nssh: {exc}".encode())
            code = 255
        finally:
            chan.close()
        return CommandResult(
            command=command,
            exit_code=code,
            stdout=out.getvalue(),
            stderr=err.getvalue(),
            timed_out=timed_out,
            truncated=out.truncated,
            bytes_seen=out.seen,
            duration_s=round(time.monotonic() - start, 3),
        )

    def close(self) -> None:
        self._client.close()
        if self._jump is not None:
            self._jump.close()


_AFTER_EXIT_S = 1.0  # how long output may still come after a command's exit status


def quote(value: str) -> str:
    """Shell-quote one argument for a remote POSIX shell."""
    return shlex.quote(value)


def _key_files(host: Host, settings: Settings, cfg: dict[str, Any]) -> list[str]:
    """The host's key file, else the settings' key, else ~/.ssh/config's IdentityFile(s)."""
    if host.key_file:
        return [str(host.key_file)]
    if settings.ssh_key:
        return [str(settings.ssh_key)]
    return [str(Path(p).expanduser()) for p in cfg.get("identityfile") or []]


def _client_with_host_keys(
    host: Host, settings: Settings, cfg: dict[str, Any], address: str, port: int
) -> tuple[paramiko.SSHClient, paramiko.MissingHostKeyPolicy]:
    """A client that knows the host's keys from the system's, the settings' and ~/.ssh/config's
    known hosts, and rejects unknown keys (unless the inventory opts in for this host)."""
    paths = [Path("~/.ssh/known_hosts").expanduser()]
    paths += [settings.known_hosts] if settings.known_hosts else []
    paths += [Path(p).expanduser() for p in str(cfg.get("userknownhostsfile", "")).split() if p]
    name = address if port == 22 else f"[{address}]:{port}"  # as paramiko looks it up
    client = paramiko.SSHClient()
    mine = client.get_host_keys()
    for path in paths:
        for keytype, key in (_known_hosts(path).lookup(name) or {}).items():
            mine.add(name, keytype, key)
    policy: paramiko.MissingHostKeyPolicy
    policy = _AcceptOnce() if host.accept_unknown_host_key else paramiko.RejectPolicy()
    client.set_missing_host_key_policy(policy)
    return client, policy


_known_lock = threading.Lock()
_known: dict[Path, tuple[tuple[int, int], paramiko.HostKeys]] = {}


def _known_hosts(path: Path) -> paramiko.HostKeys:
    """A known_hosts file, parsed once while it stays the same (a fleet's file has a line per
    host: parsing it for every connection made a 1,000-host sweep quadratic). A missing file
    knows no host."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return paramiko.HostKeys()
    except OSError as exc:
        raise InputError(f"cannot read known_hosts file {path}: {exc}") from exc
    if not path.is_file():
        return paramiko.HostKeys()
    version = (st.st_mtime_ns, st.st_size)
    with _known_lock:
        hit = _known.get(path)
    if hit is not None and hit[0] == version:
        return hit[1]
    try:
        keys = paramiko.HostKeys(str(path))
    except (OSError, paramiko.SSHException, ValueError) as exc:
        raise InputError(f"cannot read known_hosts file {path}: {exc}") from exc
    with _known_lock:
        _known[path] = (version, keys)
    return keys


def _connect_error(exc: Exception, name: str, where: str, timeout: float) -> CudamedicError:
    """What a failed connect means, in words a person can act on."""
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostKeyRejected(
            f"{name} ({where}): host key CHANGED — got {exc.key.get_name()} "
            f"{exc.key.fingerprint}, known_hosts has {exc.expected_key.fingerprint}. "
            "Refusing to connect (possible man-in-the-middle). Verify the host, then update "
            "known_hosts."
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return AuthFailed(f"{name} ({where}): authentication failed: {exc}")
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "not found in known_hosts" in text:
            return HostKeyRejected(
                f"{name} ({where}): unknown host key (not in known_hosts). Add it with "
                f"ssh-keyscan after verifying it, or set accept_unknown_host_key for this host."
            )
        if "protocol banner" in text or "No existing session" in text:
            # paramiko's words for a peer that accepts TCP and never speaks SSH
            return HostUnreachable(
                f"{name} ({where}): no SSH greeting within {timeout:g}s (the port "
                "accepts connections but nothing answers: a hung sshd, or not an SSH server)"
            )
        return HostUnreachable(f"{name} ({where}): SSH error: {text}")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        reasons = sorted({getattr(e, "strerror", None) or str(e) for e in exc.errors.values()})
        return HostUnreachable(f"{name} ({where}): {'; '.join(reasons)}")
    if isinstance(exc, TimeoutError):
        return HostUnreachable(f"{name} ({where}): timed out after {timeout:g}s")
    if isinstance(exc, OSError):
        return HostUnreachable(f"{name} ({where}): {exc.strerror or exc}")
    return InputError(f"{name} ({where}): {exc}")  # bad key file contents and the like
