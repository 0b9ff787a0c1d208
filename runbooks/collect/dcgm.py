"""Run NVIDIA DCGM's diagnostic on a host during a response, into its bundle (SHELL: SSH).

`dcgmi diag -r 1` takes seconds and only reads (deployment checks: libraries, permissions,
persistence mode, the GPU's retired-page and InfoROM records): a triage runs it by itself when it
suspects the hardware and the host has DCGM (its collection found `dcgmi`). Levels 2 and above run
workloads on the GPUs for minutes (`-r 3`: memory, PCIe, stress), so they run only with a
person's approval (`approved_by`). The output lands in the bundle as ``commands/dcgmi-diag.txt``
(redacted) and its source is added to ``bundle.json``; the diagnosis is then made again from the
same bundle, so DCGM's verdict is evidence like any other file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from runbooks.collect.bundle import BundleMeta, SourceResult
from runbooks.collect.redact import redact_text
from runbooks.collect.remote.runner import CommandRunner, LocalRunner
from runbooks.collect.remote.ssh import SshRunner
from runbooks.collect.target import Target
from runbooks.core.errors import CudamedicError, InputError
from runbooks.core.settings import Settings

DIAG_PATH = "commands/dcgmi-diag.txt"
UNATTENDED_LEVEL = 1  # the highest level run without a person
TIMEOUT_S = {1: 120.0, 2: 900.0, 3: 2700.0, 4: 10800.0}  # DCGM's documented run times, with room


def has_dcgm(bundle: Path) -> bool:
    """Did this bundle's collection find `dcgmi` on the host (its discovery ran)?"""
    meta = _meta(bundle)
    return meta is not None and any(
        s.name == "dcgmi-discovery" and s.status == "ok" for s in meta.sources
    )


def run_diag(
    target: Target,
    settings: Settings,
    bundle: Path,
    level: int = UNATTENDED_LEVEL,
    *,
    approved_by: str | None = None,
) -> SourceResult:
    """Run `dcgmi diag -r LEVEL` on the target and keep its output in `bundle`. Level 2 and above
    need `approved_by` (they load the GPUs for minutes). A host without dcgmi, or one that cannot
    be reached, is a recorded source result, never an exception."""
    if level not in TIMEOUT_S:
        raise InputError(f"dcgmi diag level {level!r}: DCGM has levels 1 to 4")
    if level > UNATTENDED_LEVEL and not approved_by:
        raise InputError(
            f"dcgmi diag -r {level} runs workloads on the GPUs for minutes: it needs a person's "
            "approval"
        )
    name = f"dcgmi-diag-r{level}"
    command = f"dcgmi diag -r {int(level)}"
    try:
        runner = runner_for(target, settings)
    except CudamedicError as exc:
        result = SourceResult(name=name, status="error", command=command, error=str(exc))
        _record(bundle, result)
        return result
    try:
        if not runner.run("command -v dcgmi", timeout=10, max_bytes=4096).ok:
            result = SourceResult(name=name, status="skipped", note="dcgmi not found on the host")
        else:
            res = runner.run(command, timeout=TIMEOUT_S[level], max_bytes=4 * 1024 * 1024)
            text = redact_text((res.stdout + res.stderr).decode("utf-8", "replace"))
            (bundle / DIAG_PATH).write_text(text, encoding="utf-8")
            # dcgmi exits non-zero when a test fails: the output is the evidence either way.
            status = "timeout" if res.timed_out else ("ok" if text.strip() else "failed")
            result = SourceResult(
                name=name,
                path=DIAG_PATH,
                status=status,
                command=command,
                exit_code=res.exit_code,
                duration_s=res.duration_s,
                note=f"run by {approved_by}" if approved_by else "run by the triage (read-only)",
            )
    finally:
        runner.close()
    _record(bundle, result)
    return result


def runner_for(target: Target, settings: Settings) -> CommandRunner:
    if target.kind == "local":
        return LocalRunner()
    assert target.host is not None
    return SshRunner(target.host, settings, jump_host=target.jump)


def _meta(bundle: Path) -> BundleMeta | None:
    try:
        return BundleMeta.model_validate_json((bundle / "bundle.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _record(bundle: Path, result: SourceResult) -> None:
    """Add the source to bundle.json (atomically; replacing an earlier run of the same name)."""
    meta = _meta(bundle)
    if meta is None:
        return
    sources = (*(s for s in meta.sources if s.name != result.name), result)
    data = meta.model_copy(update={"sources": sources}).model_dump(mode="json")
    tmp = bundle / "bundle.json.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, bundle / "bundle.json")
