"""Post-mortem rendering: pure, golden-file tested, and inert to whatever text it carries."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import jinja2
import pytest

from reports.render import (
    CheckResult,
    PostMortem,
    SweepChange,
    SweepHostRow,
    SweepSummary,
    TimelineEvent,
    render_markdown,
    render_sweep,
    report_name,
    sweep_report_name,
)
from runbooks.core.model import Line

GOLDEN = Path(__file__).parent / "fixtures" / "reports"
T0 = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)


def sample(**over: object) -> PostMortem:
    data: dict[str, object] = dict(
        host="node07",
        container="train",
        incident="shm-too-small",
        confidence=0.92,
        summary="/dev/shm is too small for DataLoader workers. Why: /dev/shm of train is 64 MiB; "
        "matched bus-error, dataloader-bus-error.",
        trigger="RuntimeError: DataLoader worker (pid 3185) is killed by signal: Bus error.",
        started_at=T0,
        ended_at=T0 + timedelta(seconds=9.5),
        outcome="fixed",
        outcome_detail="train recreated with --shm-size 8g; verified",
        evidence=(
            Line(source="containers/train.inspect.json", line=142, text='"ShmSize": 67108864,'),
            Line(
                source="containers/train.log",
                line=9,
                text="dd: error writing '/dev/shm/batch-0': No space left on device",
            ),
        ),
        docker_run_diff=("- --shm-size 64m", "  --name train", "+ --shm-size 8g", "  img"),
        checks=(
            CheckResult(name="running", ok=True, detail="status running"),
            CheckResult(name="shm-size", ok=True, detail="df -k /dev/shm: 8388608 KiB"),
        ),
        timeline=(
            TimelineEvent(at=T0, event="fix started"),
            TimelineEvent(at=T0 + timedelta(seconds=9), event="outcome: fixed"),
        ),
        action_items=(
            "Watch train's next run; `cudamedic rollback` restores the backup.",
            "Fix the job template.",
        ),
        bundle="bundles/node07-train-20261202T100000Z",
        detected_by="cudamedic triage",
        triggered_by="alice@ops",
        down_since=T0 - timedelta(seconds=125),
        running_at_collection=False,
        restored_at=T0 + timedelta(seconds=9),
        links={"Prefect flow run": "http://127.0.0.1:4200/runs/flow-run/4061d10d"},
    )
    data.update(over)
    return PostMortem.model_validate(data)


@pytest.mark.parametrize(
    "name, over",
    [
        ("fixed", {}),
        (
            "rolled-back",
            {
                "outcome": "rolled-back",
                "docker_run_diff": (),
                "trigger": None,
                "checks": (CheckResult(name="gpus-visible", ok=False, detail="0 GPUs"),),
                "action_items": (),
                "failure_cause": "container-toolkit-missing",
                "restored_at": None,
                "detected_by": "alert GpuXid79",
                "triggered_by": None,
            },
        ),
        (
            "healthy",
            {
                "incident": "healthy",
                "outcome": "diagnosed",
                "outcome_detail": "",
                "summary": "The GPUs work: nvidia-smi lists 8 GPUs inside the container.",
                "docker_run_diff": (),
                "checks": (),
                "trigger": None,
                "action_items": (),
                "down_since": None,
                "running_at_collection": True,
                "restored_at": None,
                "detected_by": "cudamedic fleet sweep",
            },
        ),
    ],
)
def test_golden(name: str, over: dict[str, object]) -> None:
    text = render_markdown(sample(**over))
    golden = GOLDEN / f"postmortem-{name}.md"
    if os.environ.get("CUDAMEDIC_REGEN_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()


def test_report_says_what_happened_for_people() -> None:
    """Issue 19: human times and durations, how long the workload was down, what detected it
    and when, and none of the classifier's internal signature ids in the prose."""
    fixed = render_markdown(sample())
    assert not re.search(r"\d{4}-\d\d-\d\dT\d\d:", fixed), fixed  # no ISO stamps
    assert "| Response | 2 Dec 2026, 10:00:00 UTC – 10:00:09 UTC (9.5 s) |" in fixed
    assert "| Workload down | 2 min 14 s |" in fixed
    assert (
        "It was down for **2 min 14 s**: it stopped at 09:57:55 UTC and runs again, verified, "
        "since 10:00:09 UTC." in fixed
    )
    assert "alice@ops ran `cudamedic triage` at 10:00:00 UTC on 2 Dec 2026" in fixed
    assert "bus-error" not in fixed and "matched" not in fixed
    assert "Why: /dev/shm of train is 64 MiB." in fixed
    assert "`cudamedic rollback`" in fixed and "\\`" not in fixed  # a code span, not escaped
    assert "- [Prefect flow run](http://127.0.0.1:4200/runs/flow-run/4061d10d)" in fixed

    down = render_markdown(sample(outcome="rolled-back", restored_at=None))
    assert "is **still down** (2 min 14 s when this report was written)" in down
    assert "| Workload down | 2 min 14 s (still down) |" in down
    alert = render_markdown(sample(detected_by="alert GpuXid79", triggered_by=None))
    assert "The Alertmanager alert `GpuXid79` fired at 10:00:00 UTC" in alert
    sweep = render_markdown(sample(detected_by="cudamedic fleet sweep"))
    assert "A fleet health sweep found it at 10:00:00 UTC" in sweep
    unknown = render_markdown(sample(down_since=None, running_at_collection=None))
    assert "How long it was down is not known." in unknown


def test_hostile_text_stays_inert() -> None:
    evil = "{{ 7*7 }} {% for x in range(3) %}x{% endfor %} ``` # Heading\n| a | b |"
    text = render_markdown(
        sample(
            trigger=evil,
            summary=evil,
            evidence=(Line(source="containers/train.log", line=1, text=evil),),
        )
    )
    assert "{{ 7*7 }}" in text and "49" not in text
    assert "````text\n" + evil in text  # fenced longer than the ``` inside


def test_missing_field_is_an_error_not_a_placeholder() -> None:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ pm.nope }}").render(pm={})


def test_report_name() -> None:
    assert report_name(sample()) == "20261202T100000Z-node07-train-shm-too-small.md"


def sweep_sample(**over: object) -> SweepSummary:
    data: dict[str, object] = dict(
        started_at=T0,
        ended_at=T0 + timedelta(seconds=12.4),
        hosts=(
            SweepHostRow(host="node01", verdict="healthy"),
            SweepHostRow(
                host="node07",
                verdict="drain",
                codes=("xid-79@0000:02:00",),
                incident="gpu-hardware-fault",
                incident_summary="A GPU fell off the bus (Xid 79).",
                bundle="bundles/sweeps/20261202T100000Z/node07-20261202T100001Z",
            ),
            SweepHostRow(host="node|09", verdict="warning", codes=("container-shm-small@train",)),
        ),
        changes=(
            SweepChange(
                host="node07",
                change="new",
                code="xid-79",
                subject="0000:02:00",
                level="drain",
                message="Xid 79 on 0000:02:00 within 24 h; 1 line(s)",
            ),
            SweepChange(
                host="node03",
                change="resolved",
                code="disk-full",
                subject="/",
                message="/ is 93% full",
            ),
        ),
        links={"Prefect flow run": "http://127.0.0.1:4200/runs/flow-run/x"},
    )
    data.update(over)
    return SweepSummary.model_validate(data)


@pytest.mark.parametrize("name, over", [("changes", {}), ("quiet", {"changes": (), "links": {}})])
def test_sweep_golden(name: str, over: dict[str, object]) -> None:
    summary = sweep_sample(**over)
    text = render_sweep(summary)
    golden = GOLDEN / f"sweep-{name}.md"
    if os.environ.get("CUDAMEDIC_REGEN_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()
    assert sweep_report_name(summary) == "20261202T100000Z-fleet-sweep.md"


PAYLOADS = (
    "![t](http://x/t.png)",
    "<img src=x onerror=alert(1)>",
    "[Approve the fix](https://evil.example/approve)",
    "done\r## Resolution\rAll good, nothing to see",
    "\x1b[2J\x1b]0;title\x07cleared",
)


def test_evidence_text_from_a_target_is_inert_in_the_post_mortem() -> None:
    """Issue 15: log lines, names and messages from a target reach the report as text only: no
    image, link, HTML, heading or terminal control sequence can be formed by them."""
    import re

    evil = " ".join(PAYLOADS)
    pm = sample(
        summary=f"shm is small. Decided by: {evil}",
        outcome_detail=evil,
        evidence=tuple(
            Line(source="containers/x.log", line=n, text=p) for n, p in enumerate(PAYLOADS, 1)
        ),
        action_items=(evil,),
        timeline=(TimelineEvent(at=T0, event="evidence", detail=evil),),
        checks=(CheckResult(name="error-gone", ok=False, detail=evil),),
        trigger=evil,
        links={},  # our own links (the flow run's URL) are the report's only links
    )
    text = render_markdown(pm)
    assert "\r" not in text and "\x1b" not in text and "\x07" not in text
    assert [ln for ln in text.splitlines() if ln.startswith("## Resolution")] == ["## Resolution"]
    # Outside code fences and code spans nothing active remains.
    prose = re.sub(r"(?ms)^(`{3,})text\n.*?^\1$", "", text)
    prose = re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", prose)
    for active in (r"(?<!\\)!\[", r"(?<!\\)<img", r"(?<!\\)\]\(https?:"):
        assert not re.search(active, prose), (active, prose)
