"""Fleet health checks, sweep-to-sweep differences, the circuit breaker and runbooks (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from runbooks.collect.bundle import open_bundle
from runbooks.core.errors import InputError
from runbooks.core.runbook import Breaker, Thresholds, load_runbook, parse_runbook
from runbooks.diagnose.facts import Facts, gather, parse_uptime
from runbooks.diagnose.health import HostHealth, check_host, diff, snapshot
from runbooks.fix import breaker

FIX = Path(__file__).parent / "fixtures"
XID79_STAMP = 74889.644138  # the Xid 79 line of dmesg/xid79-fallen-off-bus-aer.txt


def facts_of(tmp_path: Path, files: dict[str, str]) -> Facts:
    """A bundle directory made of recorded fixtures, read the way the sweep reads it."""
    for rel, fixture in files.items():
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((FIX / fixture).read_bytes())
    with open_bundle(tmp_path) as b:
        return gather(b)


H100 = {"nvidia-smi.txt": "nvidia-smi/h100-sxm-8gpu.txt"}


def codes(h: HostHealth) -> list[str]:
    return [f.key for f in h.findings]


def test_healthy_h100_host(tmp_path: Path) -> None:
    facts = facts_of(
        tmp_path,
        {
            **H100,
            "dmesg.txt": "dmesg/driver-load-benign.txt",
            "commands/container-toolkit.txt": "host-commands/nvidia-container-toolkit-version.txt",
            "commands/df.txt": "host-commands/df-h-docker-host.txt",
        },
    )
    h = check_host("h1", facts, Thresholds(), expected_gpus=8)
    assert h.verdict == "healthy", codes(h)
    assert h.gpus_seen == 8 and h.driver


def test_recent_xid79_drains_once_and_old_one_is_history(tmp_path: Path) -> None:
    facts = facts_of(tmp_path, {**H100, "dmesg.txt": "dmesg/xid79-fallen-off-bus-aer.txt"})
    recent = check_host("h1", facts, Thresholds(), uptime_s=XID79_STAMP + 600)
    assert recent.verdict == "drain"
    xid = [f for f in recent.findings if f.code == "xid-79"]
    assert len(xid) == 1 and xid[0].subject == "0000:02:00"
    assert "fallen off the bus" in xid[0].evidence[0].text
    old = check_host("h1", facts, Thresholds(), uptime_s=XID79_STAMP + 25 * 3600)
    assert not any(f.code.startswith("xid-") for f in old.findings)
    wider = check_host("h1", facts, Thresholds(xid_window_h=48), uptime_s=XID79_STAMP + 25 * 3600)
    assert "xid-79@0000:02:00" in codes(wider)


@pytest.mark.parametrize(
    ("fixture", "code"),
    [
        ("nvidia-smi/driver-not-loaded.txt", "driver-not-loaded"),
        ("nvidia-smi/library-mismatch.txt", "driver-library-mismatch"),
        ("nvidia-smi/no-devices.txt", "no-gpus-found"),
    ],
)
def test_driver_states_drain(tmp_path: Path, fixture: str, code: str) -> None:
    h = check_host("h1", facts_of(tmp_path, {"nvidia-smi.txt": fixture}), Thresholds())
    assert h.verdict == "drain"
    assert code in codes(h)
    assert h.findings[0].evidence, "the deciding line is cited"


def test_hung_nvidia_smi_and_missing_gpus(tmp_path: Path) -> None:
    facts = facts_of(tmp_path, H100)
    hung = check_host("h1", facts, Thresholds(), source_status={"nvidia-smi": "timeout"})
    assert "nvidia-smi-hung" in codes(hung) and hung.verdict == "drain"
    low = check_host("h1", facts, Thresholds(), expected_gpus=16)
    assert "gpu-count-low" in codes(low)
    assert "8 GPUs visible, the inventory expects 16" in low.findings[0].message


def test_disk_threshold_comes_from_the_runbook(tmp_path: Path) -> None:
    facts = facts_of(tmp_path, {**H100, "commands/df.txt": "host-commands/df-h-docker-host.txt"})
    assert not [f for f in check_host("h", facts, Thresholds()).findings if f.code == "disk-full"]
    tight = check_host("h", facts, Thresholds(disk_used_max_pct=25))
    assert [f.subject for f in tight.findings if f.code == "disk-full"] == ["/boot"]
    assert tight.verdict == "warning"


def test_unreachable_host_is_a_warning_not_a_crash() -> None:
    facts = Facts(ssh_error="connection refused")
    h = check_host("h1", facts, Thresholds())
    assert h.verdict == "warning" and h.error == "connection refused"
    assert codes(h) == ["host-unreachable"]


def test_parse_uptime() -> None:
    assert parse_uptime("12345.67 54321.00\n") == 12345.67
    assert parse_uptime("garbage") is None
    assert parse_uptime(None) is None


# -- differences between sweeps --------------------------------------------------------------
def _state(**hosts: dict[str, tuple[str, str]]) -> dict[str, dict[str, dict[str, str]]]:
    return {
        host: {
            key: {
                "code": key.split("@")[0],
                "subject": key.partition("@")[2],
                "level": lvl,
                "message": msg,
            }
            for key, (lvl, msg) in findings.items()
        }
        for host, findings in hosts.items()
    }


def test_diff_reports_only_news() -> None:
    before = _state(
        a={"xid-79@0000:02:00": ("drain", "Xid 79; 1 line(s)"), "disk-full@/": ("warning", "91%")},
        b={"gpu-hot@gpu0": ("warning", "90 C")},
    )
    same = diff(before, before)
    assert same == []
    after = _state(
        a={"xid-79@0000:02:00": ("drain", "Xid 79; 2 line(s)"), "disk-full@/": ("warning", "93%")},
        b={},
        c={"driver-not-loaded": ("drain", "NVIDIA-SMI has failed")},
    )
    changes = {(c.host, c.change, c.code) for c in diff(before, after)}
    assert changes == {
        ("a", "changed", "xid-79"),  # more Xid events: news
        ("b", "resolved", "gpu-hot"),
        ("c", "new", "driver-not-loaded"),
    }  # the disk's live percentage at the same level is not news


def test_diff_keeps_hosts_not_swept() -> None:
    before = _state(a={"disk-full@/": ("warning", "91%")})
    assert diff(before, _state(b={})) == []


def test_snapshot_round_trips_through_diff(tmp_path: Path) -> None:
    facts = facts_of(tmp_path, {**H100, "dmesg.txt": "dmesg/xid79-fallen-off-bus-aer.txt"})
    h = check_host("h1", facts, Thresholds(), uptime_s=XID79_STAMP + 60)
    first = diff({}, snapshot([h]))
    assert [(c.change, c.code) for c in first] == [("new", "xid-79")]
    assert diff(snapshot([h]), snapshot([h])) == []


# -- circuit breaker ------------------------------------------------------------------------
def test_breaker_trips_after_the_limit_and_stays_open_until_reset() -> None:
    cfg = Breaker(max_unattended_fixes=2, window_min=30)
    t0 = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
    state = breaker.BreakerState()
    ok1, state, _ = breaker.admit(state, cfg, t0)
    ok2, state, _ = breaker.admit(state, cfg, t0 + timedelta(minutes=1))
    ok3, state, why = breaker.admit(state, cfg, t0 + timedelta(minutes=2))
    assert (ok1, ok2, ok3) == (True, True, False)
    assert state.tripped and "2 unattended fixes within 30 min" in why
    later, state, _ = breaker.admit(state, cfg, t0 + timedelta(days=1))
    assert not later, "an open breaker does not close by itself"
    state = breaker.reset(state, "alice", t0 + timedelta(days=1))
    assert not state.tripped and state.reset_by == "alice"
    ok, state, _ = breaker.admit(state, cfg, t0 + timedelta(days=1))
    assert ok


def test_breaker_window_forgets_old_fixes() -> None:
    cfg = Breaker(max_unattended_fixes=2, window_min=30)
    t0 = datetime(2026, 12, 1, 3, 0, tzinfo=UTC)
    state = breaker.BreakerState()
    for minutes in (0, 40, 80, 120):
        ok, state, _ = breaker.admit(state, cfg, t0 + timedelta(minutes=minutes))
        assert ok
    assert len(state.fixes) == 1  # only the newest is inside the 30 min window


# -- runbooks ---------------------------------------------------------------------------------
def test_packaged_runbooks_load() -> None:
    incident = load_runbook(None, "incident")
    sweep = load_runbook(None, "sweep")
    assert incident.kind == "incident" and sweep.kind == "sweep"
    assert {s.name for s in incident.host_sources} >= {"nvidia-smi", "kernel-log", "uptime"}
    assert [p.name for p in sweep.container_probes] == ["ulimit", "shm", "cuda-cache"]
    assert "nvidia-topo" in {s.name for s in sweep.host_sources}
    assert sweep.thresholds.shm_min_mib == 1024


BASE = """
name: mine
kind: sweep
host_sources:
  - {name: nvidia-smi, path: nvidia-smi.txt, command: nvidia-smi}
"""


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: [unclosed", "not valid YAML"),
        ("- a\n- b\n", "must be a YAML mapping"),
        (BASE + "thresholds: {shm_min_mb: 10}\n", "thresholds.shm_min_mb: Extra inputs"),
        (BASE + "container_probes: [torch, nvcc]\n", "unknown probe 'nvcc'"),
        (BASE + "fixes: {unattended: {gpu-hardware-fault: ['*']}}\n", "no safe automatic fix"),
        (BASE + "  - {name: nvidia-smi, path: other.txt, command: x}\n", "duplicate nvidia-smi"),
        (BASE + "  - {name: evil, path: ../../etc/passwd, command: x}\n", "host_sources.1.path"),
        (BASE + "thresholds: {disk_used_max_pct: 400}\n", "disk_used_max_pct"),
        ("name: x\nkind: sweep\nhost_sources: []\n", "host_sources"),
    ],
)
def test_bad_runbooks_are_refused_naming_the_key(text: str, needle: str) -> None:
    with pytest.raises(InputError) as err:
        parse_runbook(text, "mine.yaml")
    assert needle in str(err.value)
    assert "mine.yaml" in str(err.value)


def test_runbook_of_the_wrong_kind_or_missing(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(BASE)
    assert load_runbook(path, "sweep").name == "mine"
    with pytest.raises(InputError, match="is a sweep runbook; a incident runbook is needed"):
        load_runbook(path, "incident")
    with pytest.raises(InputError, match="cannot read runbook"):
        load_runbook(tmp_path / "absent.yaml", "sweep")


def test_a_table_cut_short_by_a_dropped_connection_is_no_missing_gpu(tmp_path: Path) -> None:
    """Seen in bench_sweep.py: the SSH connection dropped while the 8-GPU table streamed in, the
    source failed (no exit status) and the table listed 7 GPUs; the sweep said drain. DERIVED:
    the recorded H100 table cut after its 7th GPU, beside the recorded 8-GPU XML."""
    table = (FIX / "nvidia-smi/h100-sxm-8gpu.txt").read_text()
    cut = table[: table.index("|   7  NVIDIA H100")]
    (tmp_path / "nvidia-smi.txt").write_text(cut)
    (tmp_path / "nvidia-smi.xml").write_bytes(
        (FIX / "nvidia-smi-xml/v100s-pcie-8gpu-busy-v11.xml").read_bytes()
    )
    with open_bundle(tmp_path) as b:
        facts = gather(b)
    assert facts.smi is not None and len(facts.smi.gpus) == 7
    dropped = {"nvidia-smi": "failed", "nvidia-smi-xml": "ok"}
    h = check_host("h1", facts, Thresholds(), expected_gpus=8, source_status=dropped)
    assert "gpu-count-low" not in codes(h), codes(h)
    # A whole table with 7 GPUs is evidence; so is the XML when the table is cut.
    whole = check_host("h1", facts, Thresholds(), expected_gpus=8, source_status={})
    assert "gpu-count-low" in codes(whole)
    fewer = check_host("h1", facts, Thresholds(), expected_gpus=9, source_status=dropped)
    assert "8 GPUs visible, the inventory expects 9" in fewer.findings[0].message
