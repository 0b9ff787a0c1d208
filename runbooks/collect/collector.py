"""Collect an evidence bundle from one target (SHELL: SSH, subprocess, Docker API, files).

Each source is independent: one failing source is recorded in ``bundle.json`` with its error and
never stops the others; every call has a timeout; every text is redacted before it is written.
Host commands run concurrently over one SSH connection; Docker calls run beside them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import platform
import re
import shlex
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from runbooks import __version__
from runbooks.collect.bundle import BundleMeta, SourceResult, dumps_json, in_layout
from runbooks.collect.evidence.docker_inspect import docker_time, facts_from_dict
from runbooks.collect.evidence.nvidia_smi import parse_nvidia_smi
from runbooks.collect.redact import redact_json, redact_text
from runbooks.collect.remote.docker import DockerEngine
from runbooks.collect.remote.runner import CommandResult, CommandRunner, LocalRunner
from runbooks.collect.remote.ssh import SshRunner
from runbooks.collect.smi_guard import SmiGuard
from runbooks.collect.target import Target
from runbooks.core import names
from runbooks.core.errors import ContainerNotFound, CudamedicError, InputError, TargetError
from runbooks.core.model import Finding
from runbooks.core.private import private_dir, write_private
from runbooks.core.runbook import Runbook, load_runbook
from runbooks.core.settings import Settings
from runbooks.core.sources import NCCL_TESTS_PATH, ContainerProbe, HostSource

log = logging.getLogger(__name__)
_NOT_PERMITTED = re.compile(r"(?i)operation not permitted|permission denied|not permitted")
_RECENT_EXIT_S = 24 * 3600


class _Writer:
    """Writes redacted files into the bundle directory and keeps the per-source results."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sources: list[SourceResult] = []
        self.findings: list[Finding] = []

    def _path(self, rel: str) -> Path:
        """The file for a bundle-relative path; never anywhere but inside the bundle (names
        come from the target, which may be hostile)."""
        parts = PurePosixPath(rel).parts
        if not in_layout(rel) or any(p in ("", ".", "..") for p in parts) or "\\" in rel:
            raise InputError(f"refused to write {names.display(rel)!r}: not a bundle path")
        path = self.root.joinpath(*parts)
        if self.root.resolve() not in path.resolve().parents:
            raise InputError(f"refused to write {names.display(rel)!r}: outside the bundle")
        private_dir(path.parent)
        return path

    def text(self, rel: str, data: bytes | str) -> None:
        if isinstance(data, bytes):
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError:
                raw = data.decode("utf-8", errors="surrogateescape")
                self.findings.append(
                    Finding(
                        code="non-utf8-output",
                        source=rel,
                        severity="info",
                        message=f"{rel} holds bytes that are not UTF-8; kept as they are",
                    )
                )
        else:
            raw = data
        clean = redact_text(raw)
        write_private(self._path(rel), clean.encode("utf-8", errors="surrogateescape"))

    def json(self, rel: str, data: Any) -> None:
        write_private(self._path(rel), dumps_json(redact_json(data)).encode("utf-8"))

    def add(self, result: SourceResult) -> None:
        self.sources.append(result)


def _result_from_command(
    name: str,
    rel: str | None,
    res: CommandResult,
    ok_codes: tuple[int, ...] = (0,),
    note: str | None = None,
) -> SourceResult:
    if res.timed_out:
        status = "timeout"
        error: str | None = res.note or f"timed out after {res.duration_s:g}s"
    elif res.exit_code in ok_codes:
        status, error = "ok", None
    else:
        status = "failed"
        tail = res.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        error = redact_text(" | ".join(tail)) or f"exit code {res.exit_code}"
    return SourceResult(
        name=name,
        path=rel,
        status=status,
        command=res.command,
        exit_code=res.exit_code,
        duration_s=res.duration_s,
        error=error,
        note=note,
        truncated=res.truncated,
        bytes_seen=res.bytes_seen,
    )


def _ok(
    name: str,
    rel: str,
    start: float,
    *,
    truncated: bool = False,
    bytes_seen: int = 0,
    note: str | None = None,
) -> SourceResult:
    """A source read through the Docker API and written to `rel`, timed from `start`
    (`time.monotonic()`)."""
    return SourceResult(
        name=name,
        path=rel,
        status="ok",
        duration_s=round(time.monotonic() - start, 3),
        truncated=truncated,
        bytes_seen=bytes_seen,
        note=note,
    )


def _run_host_source(
    runner: CommandRunner, src: HostSource, settings: Settings, writer: _Writer
) -> None:
    timeout = src.timeout or settings.command_timeout
    if src.requires and not _installed(runner, src.requires):
        missing = f"{src.requires} not found on the host"
        writer.add(SourceResult(name=src.name, status="skipped", note=missing))
        return
    res = runner.run(
        src.command, timeout=timeout, max_bytes=settings.output_max_bytes, keep=src.keep
    )
    note = None
    if src.fallback and not res.ok:
        stderr = res.stderr.decode("utf-8", "replace") + res.stdout.decode("utf-8", "replace")
        first = res
        res = runner.run(
            src.fallback, timeout=timeout, max_bytes=settings.output_max_bytes, keep=src.keep
        )
        reason = (
            "not permitted"
            if _NOT_PERMITTED.search(stderr)
            else ("timed out" if first.timed_out else f"exit {first.exit_code}")
        )
        note = f"`{src.command}` {reason}: {stderr.strip()[:200]}; used `{src.fallback}`"
        writer.findings.append(
            Finding(
                code=f"{src.name}-fallback",
                source=src.path,
                severity="info",
                message=redact_text(note),
            )
        )
        if not res.ok:
            # Keep the first command's output: its error text is evidence too.
            body = first.stdout + first.stderr + b"\n" + res.stdout + res.stderr
            writer.text(src.path, body)
            writer.add(_result_from_command(src.name, src.path, res, src.ok_exit_codes, note))
            return
    body = res.stdout if src.stdout_only else res.stdout + res.stderr
    if body or not src.stdout_only:
        writer.text(src.path, body)
    writer.add(
        _result_from_command(src.name, src.path if body else None, res, src.ok_exit_codes, note)
    )


def _installed(runner: CommandRunner, program: str) -> bool:
    """Is `program` on the host's PATH? (`command -v`, quoted; 10 s)"""
    return runner.run(f"command -v {shlex.quote(program)}", timeout=10, max_bytes=4096).ok


def _run_nccl_tests(runner: CommandRunner, settings: Settings, writer: _Writer) -> None:
    name = "nccl-tests"
    if not settings.nccl_tests_enabled:
        writer.add(SourceResult(name=name, status="skipped", note="disabled by settings"))
        return
    binary = shlex.quote(settings.nccl_tests_path)
    probe = runner.run(f"command -v {binary}", timeout=10, max_bytes=4096)
    if not probe.ok:
        writer.add(
            SourceResult(
                name=name,
                status="skipped",
                note=f"{settings.nccl_tests_path} not found on the host",
            )
        )
        return
    gpus = settings.nccl_tests_gpus
    if gpus is None:
        listing = runner.run("nvidia-smi -L", timeout=settings.command_timeout, max_bytes=65536)
        # hung, or not started beside a hung one (runbooks/collect/smi_guard.py)
        if listing.timed_out:
            note = listing.note or "nvidia-smi -L timed out"
            writer.add(SourceResult(name=name, status="skipped", note=note))
            return
        gpus = sum(
            1
            for ln in listing.stdout.decode("utf-8", "replace").splitlines()
            if ln.startswith("GPU ")
        )
        if gpus == 0:  # some drivers/wrappers print no -L list: count the table's GPUs
            table = runner.run("nvidia-smi", timeout=settings.command_timeout, max_bytes=1 << 20)
            gpus = len(parse_nvidia_smi(table.stdout.decode("utf-8", "replace")).gpus)
        if gpus == 0:
            writer.add(
                SourceResult(name=name, status="skipped", note="no GPUs listed by nvidia-smi -L")
            )
            return
    budget = settings.nccl_tests_budget
    command = f"timeout -k 5 {int(budget)} {binary} -b 8 -e 1G -f 2 -g {int(gpus)}"
    res = runner.run(command, timeout=budget + 10, max_bytes=4 * 1024 * 1024)
    writer.text(NCCL_TESTS_PATH, res.stdout + res.stderr)
    writer.add(_result_from_command(name, NCCL_TESTS_PATH, res))


def _select_containers(engine: DockerEngine, writer: _Writer) -> list[str]:
    chosen: list[str] = []
    now = time.time()
    for summary in engine.containers(all_=True):
        cid = str(summary.get("Id", ""))
        try:
            facts = facts_from_dict(engine.inspect(cid))
        except TargetError as exc:
            writer.findings.append(
                Finding(code="container-inspect-failed", severity="warning", message=str(exc))
            )
            continue
        if not facts.wants_gpu or names.is_backup(facts.name or ""):
            continue  # cudamedic's own stopped backups are not workloads
        exited = docker_time(facts.finished_at)
        recent_failure = (
            not facts.running
            and (facts.exit_code or 0) != 0
            and exited is not None
            and now - exited.timestamp() < _RECENT_EXIT_S
        )
        if facts.running or recent_failure:
            chosen.append(_safe_name(facts.name, cid, writer))
    return sorted(n for n in chosen if n)


def _safe_name(name: str | None, cid: str, writer: _Writer) -> str:
    """The container's name if it is a valid Docker name, else its short id: the name becomes a
    file name in the bundle, and an engine on a compromised host can send any string."""
    try:
        return names.container_name(name or "")
    except InputError:
        pass
    short = cid[:12] if len(cid) >= 12 and all(c in "0123456789abcdef" for c in cid) else ""
    writer.findings.append(
        Finding(
            code="container-name-refused",
            severity="warning",
            message=f"the engine named a container {names.display(name or '')!r}, which is not "
            f"a valid container name; "
            + (f"collected as {short}" if short else "not collected (no valid id either)"),
        )
    )
    return short


def _collect_container(
    engine: DockerEngine,
    name: str,
    settings: Settings,
    writer: _Writer,
    runbook: Runbook,
    *,
    named: bool = False,
) -> None:
    """Inspect, what its image tag names now, log tail and probes of one container."""
    inspect = _collect_inspect(engine, name, writer, named=named)
    if inspect is None:
        return
    _collect_image_now(engine, name, inspect, writer)
    _collect_log(engine, name, settings, writer, runbook)
    running = bool((inspect.get("State") or {}).get("Running"))
    for probe in runbook.container_probes:
        _run_probe(engine, name, probe, settings, writer, running)


def _collect_inspect(
    engine: DockerEngine, name: str, writer: _Writer, *, named: bool
) -> dict[str, Any] | None:
    start = time.monotonic()
    try:
        inspect = engine.inspect(name)
    except ContainerNotFound as exc:
        if named:  # the person named it: say which containers there are
            _report_missing(engine, name, writer)
        writer.add(SourceResult(name=f"{name}:inspect", status="error", error=str(exc)))
        return None
    except CudamedicError as exc:
        writer.add(SourceResult(name=f"{name}:inspect", status="error", error=str(exc)))
        return None
    rel = f"containers/{name}.inspect.json"
    writer.json(rel, inspect)
    writer.add(_ok(f"{name}:inspect", rel, start))
    return inspect


def _collect_image_now(
    engine: DockerEngine, name: str, inspect: dict[str, Any], writer: _Writer
) -> None:
    """What the container's image reference names now (a tag moved to another image: drift).
    Only the identity is kept: an image's own config (its env) is not evidence we need."""
    ref = str((inspect.get("Config") or {}).get("Image") or "")
    if not ref or ref.startswith("sha256:") or "@" in ref:
        return  # run by ID or digest: it cannot drift
    start = time.monotonic()
    rel = f"containers/{name}.image.json"
    now: dict[str, Any] = {"Ref": ref}
    try:
        image = engine.inspect_image(ref)
        now.update({k: image.get(k) for k in ("Id", "Created", "RepoTags")})
    except ContainerNotFound as exc:  # the tag is gone: it names no image any more
        now.update({"Id": None, "Error": str(exc)})
    except CudamedicError as exc:
        writer.add(SourceResult(name=f"{name}:image", status="error", error=str(exc)))
        return
    writer.json(rel, now)
    writer.add(_ok(f"{name}:image", rel, start))


def _collect_log(
    engine: DockerEngine, name: str, settings: Settings, writer: _Writer, runbook: Runbook
) -> None:
    rel = f"containers/{name}.log"
    start = time.monotonic()
    if not runbook.container_logs:
        note = "the runbook collects no container logs"
        writer.add(SourceResult(name=f"{name}:log", status="skipped", note=note))
        return
    try:
        data, truncated, seen = engine.logs_tail(
            name, settings.log_tail_lines, settings.log_tail_bytes
        )
    except CudamedicError as exc:
        writer.add(SourceResult(name=f"{name}:log", status="error", error=str(exc)))
        return
    writer.text(rel, data)
    bounded = f"tail of {settings.log_tail_lines} lines; bounded to {settings.log_tail_bytes} bytes"
    writer.add(
        _ok(
            f"{name}:log",
            rel,
            start,
            truncated=truncated,
            bytes_seen=seen,
            note=bounded if truncated else None,
        )
    )
    if truncated:
        writer.findings.append(
            Finding(
                code="log-truncated",
                source=rel,
                severity="info",
                message=f"log tail was {seen} bytes; kept the newest {settings.log_tail_bytes}",
            )
        )


def _run_probe(
    engine: DockerEngine,
    name: str,
    probe: ContainerProbe,
    settings: Settings,
    writer: _Writer,
    running: bool,
) -> None:
    label = f"{name}:exec-{probe.name}"
    rel = f"containers/{name}.exec-{probe.name}.txt"
    if not running:
        writer.add(SourceResult(name=label, status="skipped", note="container is not running"))
        return
    try:
        res = engine.exec(name, list(probe.argv), settings.exec_timeout, settings.output_max_bytes)
    except CudamedicError as exc:
        writer.add(SourceResult(name=label, status="error", error=str(exc)))
        return
    writer.text(rel, res.stdout + res.stderr)
    shown = " ".join(probe.argv[:3]) if probe.name == "torch" else res.command
    writer.add(_result_from_command(label, rel, res).model_copy(update={"command": shown}))


def _collector_versions() -> dict[str, str]:
    import docker
    import paramiko

    return {
        "cudamedic": __version__,
        "python": platform.python_version(),
        "paramiko": paramiko.__version__,
        "docker-py": docker.__version__,
    }


def bundle_dir_name(host: str, container: str | None, when: datetime) -> str:
    stamp = when.strftime("%Y%m%dT%H%M%SZ")
    return f"{host}-{container}-{stamp}" if container else f"{host}-{stamp}"


def _new_dir(path: Path) -> Path:
    """Create a fresh bundle directory; a second collection in the same second gets -2, -3..."""
    for n in range(1, 100):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            private_dir(candidate.parent)
            return private_dir(candidate, exist_ok=False)
        except FileExistsError:
            continue
        except OSError as exc:
            raise InputError(f"cannot create bundle directory {candidate}: {exc}") from exc
    raise InputError(f"cannot create a new bundle directory beside {path}")


def collect(
    target: Target,
    settings: Settings,
    *,
    container: str | None = None,
    out_dir: Path | None = None,
    trigger: str | None = None,
    runbook: Runbook | None = None,
) -> Path:
    """Collect a bundle and return its directory. Raises only for bad input.

    What is collected comes from the runbook (default: Settings.runbook, else the packaged
    incident runbook)."""
    runbook = runbook or load_runbook(settings.runbook, "incident")
    if container is not None:
        container = names.container_name(container)
    started = time.monotonic()
    when = datetime.now(UTC)
    root = _new_dir((out_dir or settings.out_dir) / bundle_dir_name(target.name, container, when))
    writer = _Writer(root)
    if trigger:
        writer.text("trigger.txt", trigger)
    containers: list[str] = [container] if container else []
    _collect_sources(target, settings, runbook, writer, containers)
    meta = BundleMeta(
        host=target.name,
        target=_target_text(target),
        containers=tuple(containers),
        collected_at=when,
        duration_s=round(time.monotonic() - started, 3),
        trigger=redact_text(trigger) if trigger else None,
        collector=_collector_versions(),
        sources=tuple(sorted(writer.sources, key=lambda s: s.name)),
        findings=tuple(writer.findings),
    )
    tmp = root / "bundle.json.tmp"
    write_private(tmp, (meta.model_dump_json(indent=2) + "\n").encode("utf-8"))
    os.replace(tmp, root / "bundle.json")
    return root


def _collect_sources(
    target: Target,
    settings: Settings,
    runbook: Runbook,
    writer: _Writer,
    containers: list[str],
) -> None:
    """Run every source of the runbook: host commands concurrently over one connection, Docker
    beside them. ``containers`` (empty: pick the GPU containers) gets the ones collected."""
    runner: CommandRunner | None = None
    engine: DockerEngine | None = None
    try:
        runner = _open_runner(target, settings, writer)
        # nvidia-smi one at a time, none while a hung one runs, killed at its timeout
        guarded = SmiGuard(runner) if runner is not None else None
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            futures = _start_host_sources(pool, guarded, runbook, settings, writer)
            # Docker, beside the host commands.
            engine = _open_engine(runner, target, settings, writer)
            if engine is not None:
                _collect_docker(engine, containers, settings, writer, runbook)
            _await_host_sources(futures, writer)
    finally:
        if engine is not None:
            engine.close()
        if runner is not None:
            runner.close()


def _open_runner(target: Target, settings: Settings, writer: _Writer) -> CommandRunner | None:
    """A local runner, or an SSH connection; ``None`` (recorded) when the host is unreachable."""
    if target.kind == "local":
        return LocalRunner()
    assert target.host is not None
    try:
        runner = SshRunner(target.host, settings, jump_host=target.jump)
    except TargetError as exc:
        writer.add(SourceResult(name="ssh", status="error", error=str(exc)))
        writer.findings.append(
            Finding(code="target-unreachable", severity="error", message=str(exc))
        )
        return None
    if runner.accepted_host_key:
        writer.findings.append(
            Finding(
                code="host-key-accepted",
                severity="warning",
                message=f"unknown host key accepted by inventory opt-in: "
                f"{runner.accepted_host_key}",
            )
        )
    return runner


def _start_host_sources(
    pool: concurrent.futures.ThreadPoolExecutor,
    runner: CommandRunner | None,
    runbook: Runbook,
    settings: Settings,
    writer: _Writer,
) -> dict[concurrent.futures.Future[None], str]:
    """Submit each host source (and nccl-tests) to ``pool``; without a runner, record each
    host source as not run."""
    futures: dict[concurrent.futures.Future[None], str] = {}
    if runner is None:
        for src in runbook.host_sources:
            writer.add(SourceResult(name=src.name, status="error", error=NOT_RUN_UNREACHABLE))
        return futures
    for src in runbook.host_sources:
        futures[pool.submit(_run_host_source, runner, src, settings, writer)] = src.name
    if runbook.nccl_tests:
        futures[pool.submit(_run_nccl_tests, runner, settings, writer)] = "nccl-tests"
    return futures


def _open_engine(
    runner: CommandRunner | None, target: Target, settings: Settings, writer: _Writer
) -> DockerEngine | None:
    """The Docker engine of the target (over the SSH connection, or local); ``None`` (recorded
    as source ``docker``) when it cannot be reached, or when the host itself cannot."""
    if runner is None:
        return None
    try:
        if isinstance(runner, SshRunner):
            return DockerEngine.over_ssh(
                runner,
                target.host.docker_host if target.host else None,
                settings.docker_timeout,
            )
        return DockerEngine.local(settings.docker_host, settings.docker_timeout)
    except CudamedicError as exc:
        writer.add(SourceResult(name="docker", status="error", error=str(exc)))
        return None


def _await_host_sources(
    futures: dict[concurrent.futures.Future[None], str], writer: _Writer
) -> None:
    for fut in concurrent.futures.as_completed(futures):
        try:
            fut.result()
        except Exception as exc:  # a bug in one source must not lose the others
            log.exception("source %s crashed", futures[fut])
            writer.add(
                SourceResult(
                    name=futures[fut],
                    status="error",
                    error=f"internal error: {type(exc).__name__}: {exc}",
                )
            )


def _target_text(target: Target) -> str:
    """``local``, or the ``ssh://address:port`` collected from."""
    if target.kind == "local":
        return target.kind
    return f"ssh://{target.host.address}:{target.host.port}" if target.host else target.name


def _collect_docker(
    engine: DockerEngine,
    containers: list[str],
    settings: Settings,
    writer: _Writer,
    runbook: Runbook,
) -> None:
    start = time.monotonic()
    try:
        writer.json("docker-info.json", engine.info())
        writer.add(_ok("docker-info", "docker-info.json", start))
    except CudamedicError as exc:
        writer.add(SourceResult(name="docker-info", status="error", error=str(exc)))
        return
    named = bool(containers)
    if not containers:
        try:
            containers.extend(_select_containers(engine, writer))
        except CudamedicError as exc:
            writer.add(SourceResult(name="containers", status="error", error=str(exc)))
            return
        if not containers:
            writer.findings.append(
                Finding(
                    code="no-gpu-containers",
                    severity="info",
                    message="no running container has or wants GPUs",
                )
            )
    for name in containers:
        _collect_container(engine, name, settings, writer, runbook, named=named)


NOT_FOUND = "container-not-found"
NOT_RUN_UNREACHABLE = "host unreachable; see source 'ssh'"  # a source's error: never tried
MAX_LISTED = 20


def _report_missing(engine: DockerEngine, name: str, writer: _Writer) -> None:
    """A named container the engine does not have: a finding that names the containers it has
    (a typo is an error, never an empty diagnosis)."""
    try:
        listed = sorted(
            names.display(str(n).lstrip("/"))
            for summary in engine.containers(all_=True)
            for n in (summary.get("Names") or [])[:1]
            if not names.is_backup(str(n))
        )
    except CudamedicError:
        listed = []
    there = ", ".join(listed[:MAX_LISTED]) + (" ..." if len(listed) > MAX_LISTED else "")
    writer.findings.append(
        Finding(
            code=NOT_FOUND,
            severity="error",
            source=f"containers/{name}",
            message=f"no container named {name!r} on this host; "
            + (f"its containers: {there}" if listed else "it has no containers"),
        )
    )


def _meta_list(bundle: Path, key: str) -> list[dict[str, Any]]:
    """The entries of one list of a bundle's bundle.json (a .tar.gz path reads the directory
    written beside it); [] when it cannot be read."""
    import json

    if bundle.name.endswith(".tar.gz"):
        bundle = bundle.with_name(bundle.name.removesuffix(".tar.gz"))
    try:
        meta = json.loads((bundle / "bundle.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []
    items = meta.get(key) if isinstance(meta, dict) else None
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def finding_message(bundle: Path, code: str) -> str | None:
    """The message of the first finding with this code in a bundle's bundle.json, else None."""
    for finding in _meta_list(bundle, "findings"):
        if finding.get("code") == code:
            return str(finding.get("message") or code)
    return None


FAILED_STATUSES = ("failed", "timeout", "error")


def failed_sources(bundle: Path) -> list[tuple[str, str]]:
    """(name, error) of each source of a bundle that failed, timed out or could not run."""
    return [
        (str(s.get("name")), str(s.get("error") or s.get("status")))
        for s in _meta_list(bundle, "sources")
        if s.get("status") in FAILED_STATUSES
    ]


def missing_container(bundle: Path) -> str | None:
    """The error message when the bundle's named container did not exist, else None."""
    return finding_message(bundle, NOT_FOUND)


@contextlib.contextmanager
def engine_session(target: Target, settings: Settings) -> Iterator[DockerEngine]:
    """A Docker engine handle for the target (over SSH for remote hosts), closed after use.
    Raises TargetError when the host or its engine cannot be reached."""
    runner: SshRunner | None = None
    engine: DockerEngine | None = None
    try:
        if target.kind == "local":
            engine = DockerEngine.local(settings.docker_host, settings.docker_timeout)
        else:
            assert target.host is not None
            runner = SshRunner(target.host, settings, jump_host=target.jump)
            engine = DockerEngine.over_ssh(runner, target.host.docker_host, settings.docker_timeout)
        yield engine
    finally:
        if engine is not None:
            engine.close()
        if runner is not None:
            runner.close()
