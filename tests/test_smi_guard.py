"""The check that runs before a host's first `nvidia-smi` (runbooks/collect/smi_guard.py), run by a
real
`sh` against a process that is gone between `pgrep` listing it and the check reading it (a host's
own nvidia-smi calls come and go: monitoring agents, other collections). The check says nothing
of it: the output is nvidia-smi's alone. (In a demo sweep of the hung host, the shell's "cannot
open /proc/PID/cmdline" went into nvidia-smi's output and was reported as an unrecognized
nvidia-smi.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

from runbooks.collect.smi_guard import wrapped

TABLE = Path(__file__).parent / "fixtures" / "nvidia-smi" / "a100-sxm4-80gb-4gpu.txt"


def test_a_process_gone_before_the_check_reads_it_leaves_no_trace(tmp_path: Path) -> None:
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "pgrep").write_text("#!/bin/sh\necho 999999999\n")  # listed, gone at once
    (bin_ / "nvidia-smi").write_text(f"#!/bin/sh\ncat {TABLE}\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    line, _ = wrapped("nvidia-smi", 10, check=True)
    env = {"PATH": f"{bin_}:/usr/bin:/bin"}
    done = subprocess.run(["sh", "-c", line], env=env, capture_output=True, timeout=30)
    assert done.returncode == 0, done
    assert done.stderr == b"", done.stderr
    assert done.stdout == TABLE.read_bytes()
