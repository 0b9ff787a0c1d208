"""The Docker Engine API, locally or over SSH: the only module that imports docker-py.

Remote engines are reached the way docker-py's ``ssh://`` transport does it (``docker system
dial-stdio`` on the host), but over *our* paramiko session, so the same host-key policy, jump host
and timeouts apply. Every call has the client timeout; reads of logs and exec output are bounded.
docker-py and requests exceptions are translated to runbooks.core.errors here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import docker
import docker.errors
import paramiko
import requests
import urllib3
from docker.transport.sshconn import SSHConnection, SSHConnectionPool, SSHHTTPAdapter

from runbooks.collect.remote.runner import BoundedBuffer, CommandResult
from runbooks.collect.remote.ssh import SshRunner, quote
from runbooks.core.errors import ContainerNotFound, EngineError, HostUnreachable

T = TypeVar("T")
_API_VERSION = "1.41"  # Docker 20.10; newer engines negotiate down to what we use
_SSH_BASE = "http+docker://ssh"

# The one place that relies on docker-py beyond its public API: the dial-stdio transport below
# subclasses docker-py's SSH transport classes (docker.transport.sshconn) so that the engine is
# reached over our own paramiko session. Checked against docker-py 7.x by
# tests/test_collect.py::test_docker_py_internals_we_subclass_are_as_checked.
DOCKER_PY_CHECKED = (7,)


class _DialConnection(SSHConnection):  # type: ignore[misc]
    def __init__(self, transport: paramiko.Transport, timeout: float, command: str) -> None:
        super().__init__(ssh_transport=transport, timeout=timeout)
        self._command = command

    def connect(self) -> None:
        sock = self.ssh_transport.open_session(timeout=self.timeout)
        sock.settimeout(self.timeout)
        sock.exec_command(self._command)
        self.sock = sock


class _DialPool(SSHConnectionPool):  # type: ignore[misc]
    def __init__(self, transport: paramiko.Transport, timeout: float, command: str) -> None:
        super().__init__(ssh_client=None, timeout=timeout, maxsize=4)
        self.ssh_transport = transport
        self._command = command

    def _new_conn(self) -> _DialConnection:
        return _DialConnection(self.ssh_transport, self.timeout, self._command)


class _DialAdapter(SSHHTTPAdapter):  # type: ignore[misc]
    def __init__(self, runner: SshRunner, timeout: float, docker_host: str | None) -> None:
        self._runner = runner
        self._timeout = timeout
        env = f"DOCKER_HOST={quote(docker_host)} " if docker_host else ""
        self._command = f"{env}docker system dial-stdio"
        super().__init__("ssh://cudamedic", timeout=timeout, shell_out=True)
        self.ssh_client = None

    def get_connection(self, url: Any, proxies: Any = None) -> _DialPool:
        with self.pools.lock:
            pool: _DialPool | None = self.pools.get(url)
            if pool is None:
                pool = _DialPool(self._runner.transport, self._timeout, self._command)
                self.pools[url] = pool
            return pool

    def close(self) -> None:
        self.pools.clear()


class DockerEngine:
    """A handle on one Docker engine. `where` names it in messages (host name or 'local')."""

    def __init__(self, api: docker.APIClient, where: str, timeout: float) -> None:
        self.api = api
        self.where = where
        self.timeout = timeout

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def local(cls, base_url: str | None, timeout: float) -> DockerEngine:
        def make(version: str) -> docker.APIClient:
            if base_url:
                return docker.APIClient(base_url=base_url, version=version, timeout=timeout)
            kwargs = docker.utils.kwargs_from_env()
            kwargs.setdefault("base_url", "unix:///var/run/docker.sock")
            return docker.APIClient(version=version, timeout=timeout, **kwargs)

        return cls._negotiated(make, "local", timeout)

    @classmethod
    def over_ssh(cls, runner: SshRunner, docker_host: str | None, timeout: float) -> DockerEngine:
        def make(version: str) -> docker.APIClient:
            api = docker.APIClient(base_url="unix:///nonexistent", version=version, timeout=timeout)
            api.mount(_SSH_BASE, _DialAdapter(runner, timeout, docker_host))
            api.base_url = _SSH_BASE  # requests picks the mounted adapter by this prefix
            return api

        return cls._negotiated(make, runner.name, timeout)

    @classmethod
    def _negotiated(
        cls, make: Callable[[str], docker.APIClient], where: str, timeout: float
    ) -> DockerEngine:
        """A client speaking _API_VERSION, or the server's older version (a new client: docker-py
        has no public way to change a client's version)."""
        try:
            engine = cls(make(_API_VERSION), where, timeout)
            version = engine._call("version", lambda: engine.api.version(api_version=False))
            server = str(version.get("ApiVersion", _API_VERSION))
            if _version_tuple(server) < _version_tuple(_API_VERSION):
                engine.close()
                engine = cls(make(server), where, timeout)
        except docker.errors.DockerException as exc:
            raise EngineError(f"{where}: cannot configure the Docker client: {exc}") from None
        return engine

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.api.close()

    # -- calls ----------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except docker.errors.NotFound as exc:
            raise ContainerNotFound(f"{self.where}: {what}: {_explain(exc)}") from None
        except docker.errors.APIError as exc:
            raise EngineError(f"{self.where}: {what}: {_explain(exc)}") from None
        except (requests.exceptions.ConnectionError, urllib3.exceptions.HTTPError) as exc:
            raise HostUnreachable(
                f"{self.where}: Docker engine unreachable ({what}): {exc}"
            ) from None
        except (requests.exceptions.Timeout, TimeoutError) as exc:
            raise EngineError(f"{self.where}: Docker engine timed out ({what}): {exc}") from None
        except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
            raise EngineError(f"{self.where}: {what}: {exc}") from None
        except (paramiko.SSHException, OSError) as exc:
            raise HostUnreachable(f"{self.where}: Docker over SSH failed ({what}): {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            # docker-py reads fields of the engine's answers (e.g. Config.Tty before logs): an
            # engine on a broken or compromised host can leave them out or mistype them.
            raise EngineError(
                f"{self.where}: {what}: malformed answer from the engine "
                f"({type(exc).__name__}: {str(exc)[:100]})"
            ) from None

    def info(self) -> dict[str, Any]:
        return self._call("info", self.api.info)

    def containers(self, all_: bool = False) -> list[dict[str, Any]]:
        return self._call("list containers", lambda: self.api.containers(all=all_))

    def inspect(self, name: str) -> dict[str, Any]:
        return self._call(f"inspect {name}", lambda: self.api.inspect_container(name))

    def inspect_image(self, ref: str) -> dict[str, Any]:
        return self._call(f"inspect image {ref}", lambda: self.api.inspect_image(ref))

    def logs_tail(self, name: str, lines: int, max_bytes: int) -> tuple[bytes, bool, int]:
        """The last `lines` lines of stdout+stderr, at most `max_bytes` (newest kept)."""
        buf = BoundedBuffer(max_bytes, "tail")

        def read() -> None:
            stream: Iterator[bytes] = self.api.logs(
                name, stdout=True, stderr=True, tail=lines, stream=True, follow=False
            )
            for chunk in stream:
                buf.write(chunk)

        self._call(f"logs {name}", read)
        return buf.getvalue(), buf.truncated, buf.seen

    # -- lifecycle (used by runbooks/fix/recreate.py) ----------------------------------------------
    def find(self, name_or_id: str) -> dict[str, Any] | None:
        """Inspect a container, or None when it does not exist."""
        try:
            return self.inspect(name_or_id)
        except ContainerNotFound:
            return None

    def list_named(self, prefix: str) -> list[dict[str, Any]]:
        """Containers (any state) whose name starts with `prefix`."""
        found = self._call(
            "list containers", lambda: self.api.containers(all=True, filters={"name": prefix})
        )
        out = []
        for summary in found:
            names = [n.lstrip("/") for n in summary.get("Names") or []]
            if any(n.startswith(prefix) for n in names):
                out.append(summary)
        return out

    def image_id(self, ref: str) -> str | None:
        try:
            return str(
                self._call(f"inspect image {ref}", lambda: self.api.inspect_image(ref))["Id"]
            )
        except ContainerNotFound:
            return None

    def stop(self, name: str, timeout: int) -> None:
        self._call(f"stop {name}", lambda: self.api.stop(name, timeout=timeout))

    def start(self, name: str) -> None:
        self._call(f"start {name}", lambda: self.api.start(name))

    def rename(self, name: str, new_name: str) -> None:
        self._call(f"rename {name} to {new_name}", lambda: self.api.rename(name, new_name))

    def remove(self, name: str) -> None:
        """Remove a container, never its volumes."""
        self._call(f"remove {name}", lambda: self.api.remove_container(name, v=False, force=True))

    def set_restart_policy(self, name: str, policy: dict[str, Any]) -> None:
        self._call(f"update {name}", lambda: self.api.update_container(name, restart_policy=policy))

    def create(
        self,
        name: str,
        config: dict[str, Any],
        host_config: dict[str, Any],
        networking: dict[str, Any] | None,
    ) -> str:
        """Create a container from raw Engine API objects (as inspect shows them)."""
        body = {**config, "HostConfig": host_config}
        if networking:
            body["NetworkingConfig"] = networking

        return self._call(
            f"create {name}",
            lambda: str(self.api.create_container_from_config(body, name=name)["Id"]),
        )

    def connect(self, network: str, name: str, endpoint: dict[str, Any]) -> None:
        self._call(
            f"connect {name} to {network}",
            lambda: self.api.connect_container_to_network(
                name,
                network,
                aliases=endpoint.get("Aliases"),
                links=endpoint.get("Links"),
                ipv4_address=(endpoint.get("IPAMConfig") or {}).get("IPv4Address"),
                ipv6_address=(endpoint.get("IPAMConfig") or {}).get("IPv6Address"),
                driver_opt=endpoint.get("DriverOpts"),
            ),
        )

    def logs_since(self, name: str, since: int, max_bytes: int) -> bytes:
        buf = BoundedBuffer(max_bytes, "tail")

        def read() -> None:
            for chunk in self.api.logs(
                name, stdout=True, stderr=True, since=since, stream=True, follow=False
            ):
                buf.write(chunk)

        self._call(f"logs {name}", read)
        return buf.getvalue()

    def exec(self, name: str, argv: list[str], timeout: float, max_bytes: int) -> CommandResult:
        """Run argv inside a running container (no shell on our side), bounded in time and size."""
        start = time.monotonic()
        out = BoundedBuffer(max_bytes, "head")
        err = BoundedBuffer(max_bytes, "tail")
        exec_id = self._call(
            f"exec in {name}",
            lambda: self.api.exec_create(name, argv, stdout=True, stderr=True, tty=False)["Id"],
        )
        timed_out = False

        def read() -> None:
            nonlocal timed_out
            for stdout, stderr in self.api.exec_start(exec_id, stream=True, demux=True):
                out.write(stdout or b"")
                err.write(stderr or b"")
                if time.monotonic() - start > timeout:
                    timed_out = True
                    return

        try:
            self._call(f"exec in {name}", read)
        except EngineError as exc:
            if "timed out" not in str(exc):
                raise
            timed_out = True
        code: int | None = None
        if not timed_out:
            inspected = self._call("exec inspect", lambda: self.api.exec_inspect(exec_id))
            code = inspected.get("ExitCode")
        return CommandResult(
            command=" ".join(argv),
            exit_code=code,
            stdout=out.getvalue(),
            stderr=err.getvalue(),
            timed_out=timed_out,
            truncated=out.truncated,
            bytes_seen=out.seen,
            duration_s=round(time.monotonic() - start, 3),
        )


def _explain(exc: docker.errors.APIError) -> str:
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc)


def _version_tuple(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in v.split("."))
    except ValueError:
        return (0,)
