"""Bundles and reports are private (issue 27, finding 11): they were written 0644/0755 while
the journal and the audit log were already 0600. A real collection by `cudamedic collect --tar`
against the lab, a post-mortem saved by reports/store.py, with a permissive umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from reports.store import save_report
from runbooks.core.settings import Settings
from tests.lab.lab import LabState
from tests.test_fix import fix_settings, run_cli  # noqa: F401 - fixture


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}


def test_bundles_and_reports_are_readable_by_their_owner_only(
    fix_settings: Settings,  # noqa: F811
    lab: LabState,
    tmp_path: Path,
) -> None:
    old = os.umask(0o022)  # the usual umask: what was written came out 0644/0755
    try:
        out = run_cli(lab, fix_settings, "collect", "gpu-healthy", "--tar")
        assert out.returncode == 0, out.stdout + out.stderr
        report = save_report(tmp_path / "reports", "pm.md", "# post-mortem\n")
    finally:
        os.umask(old)
    modes = _modes(Path(fix_settings.out_dir))
    assert any(name.endswith(".tar.gz") for name in modes), modes
    assert any(name.endswith("bundle.json") for name in modes), modes
    loose = {name: oct(mode) for name, mode in modes.items() if mode & 0o077}
    assert loose == {}, loose
    assert stat.S_IMODE(report.stat().st_mode) == 0o600
    assert stat.S_IMODE(report.parent.stat().st_mode) == 0o700
