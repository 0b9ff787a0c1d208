"""Issue 26, "README and CLI": the edges a newcomer hit, through the real `cudamedic` command (no
lab needed but for the last test): a closed pipe, a paste at a terminal, a directory that is not
a bundle, a short log that is not pasted text, `classify --json`'s schema, a mistyped flag of a
subcommand, completion without gone flags, and the lab's settings from any directory."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.lab.lab import LabState
from tests.test_fix import SHM_WORKLOAD, fix_settings  # noqa: F401 - fixture
from tests.test_flows import GPUS_ALL, cudamedic, env, field  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "runbooks.cli"]
BUNDLE = ROOT / "tests" / "corpus" / "shm-too-small--fastai-course-dataloader-bus-error"  # real
BUS = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error.\n"


def run(*args: str, stdin: str | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    bare = {k: v for k, v in os.environ.items() if not k.startswith("CUDAMEDIC_")}
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, text=True, timeout=60, env=bare, cwd=cwd
    )


def test_a_reader_that_goes_away_is_no_internal_error() -> None:
    """`cudamedic classify - | head` printed "internal error: BrokenPipeError"."""
    proc = subprocess.Popen(
        [*CLI, "classify", str(BUNDLE), "--explain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    assert "BrokenPipe" not in err and "internal error" not in err and "Exception" not in err


def test_a_paste_at_a_terminal_says_how_to_end_it() -> None:
    """`cudamedic classify -` on a terminal waited silently."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [*CLI, "classify", "-"], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    os.close(slave)
    assert proc.stderr is not None
    ready, _, _ = select.select([proc.stderr], [], [], 30)
    assert ready, "nothing said before the paste"
    said = os.read(proc.stderr.fileno(), 4096).decode()
    assert "paste the error text, then press Ctrl-D" in said, said
    os.write(master, BUS.encode() + b"\x04")
    out, _ = proc.communicate(timeout=60)
    os.close(master)
    assert proc.returncode == 0 and b"shm-too-small" in out, out


def test_a_directory_that_is_not_a_bundle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("my notes\n")
    for path in (tmp_path, tmp_path / "empty"):
        path.mkdir(exist_ok=True)
        out = run("classify", str(path))
        assert out.returncode == 2, out.stdout + out.stderr
        assert f"{path} is not an evidence bundle" in out.stderr
        assert "incident:" not in out.stdout  # not "unknown: the evidence is empty"


def test_a_short_container_log_is_not_called_pasted_text(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text("epoch 1\n" + BUS)
    from_log = run("classify", str(log))
    assert from_log.returncode == 0, from_log.stderr
    assert "Only a short container log was seen" in from_log.stdout, from_log.stdout
    assert "pasted" not in from_log.stdout
    pasted = run("classify", "-", stdin=BUS)
    assert "Only pasted text was seen" in pasted.stdout, pasted.stdout


def test_classify_json_has_the_schema_of_every_json(tmp_path: Path) -> None:
    out = run("classify", str(BUNDLE), "--json")
    doc = json.loads(out.stdout)
    assert (doc["schema"], doc["command"], doc["exit_code"]) == (1, "classify", 0)
    assert doc["incident"] == "shm-too-small"
    bad = run("classify", str(tmp_path / "nothing-here"), "--json")
    assert bad.returncode == 2
    err = json.loads(bad.stdout)  # an error is one JSON object too
    assert (err["schema"], err["command"], err["exit_code"]) == (1, "classify", 2), err


def test_a_mistyped_flag_gets_its_subcommands_usage_and_a_suggestion() -> None:
    out = run("triage", "gpu-healthy", "--contianer", "train")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: cudamedic triage "), out.stderr
    assert "--contianer: did you mean --container?" in out.stderr, out.stderr


def test_completion_never_offers_a_gone_flag() -> None:
    out = run("completion", "bash")
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith("approve)"))
    assert "--by" not in line and "--reject" in line, line


def test_the_labs_settings_from_any_directory(lab: LabState, tmp_path: Path) -> None:
    """`python -m tests.lab env` works only from the project directory (Python's own "No
    module named tests" elsewhere): `make -s -C PROJECT lab-env` works from anywhere."""
    with_lab = {**os.environ, "CUDAMEDIC_LAB_DIR": lab.dir}
    started = time.monotonic()
    out = subprocess.run(
        ["make", "-s", "-C", str(ROOT), "lab-env"],
        cwd=tmp_path,
        env=with_lab,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"export CUDAMEDIC_CONFIG={lab.config}" in out.stdout
    assert time.monotonic() - started < 30


# -- post-mortems (the lab, the real CLI) ---------------------------------------------------------
def _section(report: str, title: str) -> str:
    return report.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0].strip()


def test_the_root_cause_names_no_symptoms(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
) -> None:
    """A clear shm case said "`shm-too-small` (also seen: host-oom-killed, disk-full)": the bus
    error read as an OOM kill and /dev/shm's "No space left on device" as a full disk."""
    c = make_container(container_name, SHM_WORKLOAD, device_requests=GPUS_ALL)
    c.wait(timeout=30)
    out = cudamedic(
        env, "triage", "gpu-healthy", "--container", container_name, "--trigger", BUS.strip()
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = Path(field(out.stdout, "report")).read_text()
    cause = _section(report, "Root cause")
    assert cause.startswith("`shm-too-small`. The decisive evidence:"), cause
    assert "also seen" not in cause


def test_a_rolled_back_fix_reports_its_downtime_and_the_manual_step(
    env: dict[str, str],  # noqa: F811
    make_container: Any,
    container_name: str,
    plain_engine: Any,
) -> None:
    """The rolled-back fix's report said nothing of the downtime the fix itself caused, and its
    action item repeated the Docker error instead of the step for its cause; its Slack copy
    showed Markdown's backslash escapes raw (`\\[\\[gpu\\]\\]`, `\\>=`)."""
    make_container(
        container_name,
        "nvidia-smi -L; sleep 3600",
        engine=plain_engine,
        environment={"NVIDIA_VISIBLE_DEVICES": "all"},
    )
    time.sleep(1)
    out = cudamedic(env, "triage", "gpu-nohook", "--container", container_name, "--apply", "--yes")
    assert out.returncode == 5, out.stdout + out.stderr
    report = Path(field(out.stdout, "report")).read_text()
    assert re.search(r"^\| Down because of the fix \| [\d.]+ s \|$", report, re.M), report
    impact = _section(report, "Impact")
    assert re.search(
        r"The fix itself stopped the running workload at \d\d:\d\d:\d\d UTC; it ran again at "
        r"\d\d:\d\d:\d\d UTC \(the original, restarted by the rollback\): \*\*[\d.]+ s\*\* of "
        r"downtime caused by the fix\.",
        impact,
    ), impact
    actions = _section(report, "Action items")
    assert actions.startswith(
        "- [ ] On gpu-nohook: Install or upgrade the NVIDIA Container Toolkit"
    ), actions
    assert f"`cudamedic triage gpu-nohook --container {container_name} --apply`" in actions
    assert "could not select device driver" not in actions  # said once, under Resolution
    from reports.slack import mrkdwn

    slack = mrkdwn(report)
    assert "\\" not in slack, slack  # no escape shown raw
    assert 'could not select device driver "" with capabilities: [[gpu]]' in slack
    assert "*Root cause*" in slack and "\n#" not in slack


def test_the_readme_says_what_the_set_up_needs_and_how_to_install_for_real() -> None:
    """Before its two commands the README said nothing of root, apt, a system user, two Docker
    engines, eight sshd or port 4200; it had no contents and no way to install for real use. The
    contents' links must land on headings (GitHub's anchors)."""
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set-up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    for needed in (
        "as root",
        "apt-get",
        "`cudamedic-lab`",
        "two Docker engines",
        "eight `sshd`",
        "127.0.0.1:4200",
        "`make test`",
    ):
        assert needed in setup, needed
    assert "15 minutes" not in readme  # the suite's old, untrue time
    headings = {
        re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#{2,3} (.+)$", readme, re.M)
    }
    contents = readme.split("**Contents:**", 1)[1].split("\n\n", 1)[0]
    anchors = re.findall(r"\]\(#([^)]+)\)", contents)
    assert len(anchors) >= 10 and set(anchors) <= headings, set(anchors) - headings
    install = readme.split("## Install for real use", 1)[1].split("\n## ", 1)[0]
    for needed in ("pip install", "CUDAMEDIC_CONFIG", "inventory", "systemd", "compose"):
        assert needed in install, needed
    assert "PREFECT_SERVER_API_AUTH_STRING" in install
