"""Issue 16: the checks an operator expects from a health sweep, each tripped by a real recorded
output (tests/fixtures/*/X.source, tests/corpus/*/case.yaml name the public source) and each
left alone by a healthy one, from the bundle files through `gather` -> `check_host` -> finding."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from runbooks.collect.bundle import open_bundle
from runbooks.collect.evidence.probes import parse_cuda_cache
from runbooks.core.runbook import Thresholds
from runbooks.core.taxonomy import Incident
from runbooks.diagnose.classify import diagnose
from runbooks.diagnose.facts import Facts, gather
from runbooks.diagnose.health import HostHealth, check_host, incident_of
from tests.test_health import facts_of

CORPUS = Path(__file__).parent / "corpus"


def keys(h: HostHealth) -> set[str]:
    return {f.key for f in h.findings}


def corpus_facts(tmp_path: Path, case: str, extra: dict[str, Path] | None = None) -> Facts:
    """A corpus bundle (plus recorded files from other real outputs), read as the sweep does."""
    dest = tmp_path / case
    shutil.copytree(CORPUS / case, dest, ignore=shutil.ignore_patterns("case.yaml"))
    for rel, src in (extra or {}).items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest / rel)
    with open_bundle(dest) as b:
        return gather(b)


# -- 1. NVIDIA Container Toolkit >= 1.13 ----------------------------------------------------------
def test_toolkit_1_12_is_older_than_the_floor(tmp_path: Path) -> None:
    """`nvidia-ctk --version` 1.12.0 (NVIDIA/nvidia-container-toolkit#50) is under 1.13."""
    facts = facts_of(
        tmp_path,
        {
            "nvidia-smi.txt": "nvidia-smi/h100-sxm-8gpu.txt",
            "commands/container-toolkit.txt": "host-commands/nvidia-ctk-version.txt",
        },
    )
    h = check_host("h1", facts, Thresholds())
    old = [f for f in h.findings if f.code == "toolkit-old"]
    assert len(old) == 1 and h.verdict == "warning"
    assert "1.12.0 is older than 1.13" in old[0].message
    assert old[0].evidence[0].text == "NVIDIA Container Toolkit CLI version 1.12.0"
    assert old[0].evidence[0].source == "commands/container-toolkit.txt"
    assert incident_of("toolkit-old") == Incident.CONTAINER_TOOLKIT_MISSING
    # The floor is the runbook's: at 1.12 the same output is fine.
    assert "toolkit-old" not in keys(
        check_host("h1", facts, Thresholds(toolkit_min_version="1.12"))
    )


def test_toolkit_1_17_8_is_recent_enough(tmp_path: Path) -> None:
    """`nvidia-container-toolkit --version` 1.17.8 (ssst0n3/docker_archive) is over 1.13."""
    facts = facts_of(
        tmp_path,
        {
            "nvidia-smi.txt": "nvidia-smi/h100-sxm-8gpu.txt",
            "commands/container-toolkit.txt": "host-commands/nvidia-container-toolkit-version.txt",
        },
    )
    assert facts.toolkit_version is not None and facts.toolkit_version.version == "1.17.8"
    assert "toolkit-old" not in keys(check_host("h1", facts, Thresholds()))


def test_old_nvidia_container_cli_version_is_read_too(tmp_path: Path) -> None:
    """`nvidia-container-cli --version` of libnvidia-container 1.0.7 (NVIDIA/nvidia-docker#1232)."""
    facts = facts_of(
        tmp_path,
        {"commands/container-toolkit.txt": "host-commands/nvidia-container-cli-version.txt"},
    )
    assert facts.toolkit_version is not None and facts.toolkit_version.version == "1.0.7"
    assert "toolkit-old" in keys(check_host("h1", facts, Thresholds()))
    assert "toolkit-old" not in keys(check_host("h", facts, Thresholds(toolkit_min_version="1.0")))


# -- 2. /dev/shm >= 1 GiB for GPU containers ------------------------------------------------------
def test_shm_64m_container_warns_and_1g_does_not(tmp_path: Path) -> None:
    """A vLLM container started with Docker's default 64 MiB /dev/shm (vllm-project/vllm#1710),
    and a TGI container given --shm-size 1g (driver-too-old--llm-swarm-tgi-111...)."""
    small = corpus_facts(tmp_path, "shm-too-small--vllm-tp2-docker-ray-dev-shm-64mb")
    h = check_host("h1", small, Thresholds())
    shm = [f for f in h.findings if f.code == "container-shm-small"]
    assert [f.subject for f in shm] == ["vllm"]
    assert "64 MiB (< 1024 MiB" in shm[0].message
    assert '"ShmSize": 67108864' in shm[0].evidence[0].text
    big = corpus_facts(tmp_path, "driver-too-old--llm-swarm-tgi-111-unsatisfied-condition-cuda-118")
    assert not [f for f in check_host("h1", big, Thresholds()).findings if "shm" in f.code]


# -- 4. the image's CUDA against the host's driver -------------------------------------------------
ANIBALI = "gpu-not-requested--anibali-pytorch-nvcc-nvidia-smi-not-found"  # CUDA 10.1 image


def test_cuda_10_1_image_on_driver_375_is_flagged_before_it_crashes(tmp_path: Path) -> None:
    """The anibali/pytorch image (CUDA_VERSION 10.1, anibali/docker-pytorch#27) on a host whose
    driver is 375.26 (NVIDIA/DIGITS#2005): CUDA 10.1 needs 418.39. One judgment with the
    incident rule driver-too-old."""
    fixtures = Path(__file__).parent / "fixtures"
    facts = corpus_facts(
        tmp_path,
        ANIBALI,
        {"nvidia-smi.txt": fixtures / "nvidia-smi" / "k40m-exclusive-process-fragment.txt"},
    )
    h = check_host("h1", facts, Thresholds())
    found = [f for f in h.findings if f.code == "container-driver-too-old"]
    assert [f.subject for f in found] == ["pytorch"]
    assert "needs CUDA 10.1; driver 375.26 supports at most CUDA" in found[0].message
    assert found[0].incident == Incident.DRIVER_TOO_OLD
    d = diagnose(facts)
    assert "container-driver-too-old@pytorch" in {f.code for f in d.findings}
    assert any(m.incident == Incident.DRIVER_TOO_OLD for m in d.matches)


def test_cuda_10_1_image_on_its_own_hosts_driver_is_fine(tmp_path: Path) -> None:
    """The same image on the reporter's own host (driver 435.21 >= 418.39)."""
    h = check_host("h1", corpus_facts(tmp_path, ANIBALI), Thresholds())
    assert "container-driver-too-old@pytorch" not in keys(h)


# -- 8. Xid dedup per (code, GPU) ---------------------------------------------------------------
def test_repeated_xid_is_one_finding_per_code_and_gpu(tmp_path: Path) -> None:
    """Three Xid 13 lines on 0000:cb:00 (leptonai/gpud#46): one finding citing them."""
    facts = facts_of(tmp_path, {"dmesg.txt": "dmesg/xid13-109-ctime.txt"})
    h = check_host("h1", facts, Thresholds())
    xid13 = [f for f in h.findings if f.code == "xid-13"]
    assert [f.subject for f in xid13] == ["0000:cb:00"]
    assert "3 line(s)" in xid13[0].message and len(xid13[0].evidence) == 3


# -- 6. the node's interconnect from `nvidia-smi topo -m` ------------------------------------------
def test_interconnect_is_read_from_the_nodes_topology(tmp_path: Path) -> None:
    """4 GPUs all paired over NV1/NV2 (NVIDIA/nccl-tests#93): NVLink; 2 GPUs across PCIe host
    bridges (NODE, NVIDIA/nccl#2079): PCIe. nccl_below_floor picks the floor for that."""
    from runbooks.diagnose.judgments import node_interconnect

    nvlink = corpus_facts(
        tmp_path, "nccl-slow-transport--nccl-tests-horovodrun-two-containers-nvlink-host-half-busbw"
    )
    pcie = corpus_facts(
        tmp_path, "nccl-slow-transport--rtx5880-allreduce-deadlock-acs-on-amd-root-bridges"
    )
    assert node_interconnect(nvlink.topology) == "nvlink"
    assert node_interconnect(pcie.topology) == "pcie"
    assert node_interconnect(None) is None


# -- 7. the CUDA JIT cache (`du -sk ~/.nv/ComputeCache`) and image drift --------------------------
@pytest.mark.parametrize("du", ["du", "busybox du"])
def test_the_cuda_cache_probe_reads_real_du_output(tmp_path: Path, du: str) -> None:
    """GNU and busybox `du -sk` run here, on a cache of 3 MiB and on a missing one: the size in
    KiB, and 0 for "No such file or directory" (no cache yet), never an error."""
    cache = tmp_path / ".nv" / "ComputeCache"
    cache.mkdir(parents=True)
    (cache / "entry").write_bytes(b"\1" * (3 << 20))
    argv = [*du.split(), "-sk"]
    if du.startswith("busybox") and shutil.which("busybox") is None:
        pytest.fail("busybox is part of the lab (bootstrap installs busybox-static)")
    found = subprocess.run([*argv, str(cache)], capture_output=True, text=True, check=False)
    missing = subprocess.run(
        [*argv, str(tmp_path / "none")], capture_output=True, text=True, check=False
    )
    size = parse_cuda_cache(found.stdout + found.stderr)
    assert size.kib is not None and 3072 <= size.kib < 3200, found.stdout
    assert size.path == str(cache) and size.line is not None
    gone = parse_cuda_cache(missing.stdout + missing.stderr)
    assert missing.returncode != 0 and gone.kib == 0, missing.stderr
    assert parse_cuda_cache("sh: du: not found").kib is None


def test_a_growing_cuda_cache_is_judged_against_the_last_sweep() -> None:
    """The measure is stored with the sweep's state, compared at the next one, and the
    threshold comes from the runbook."""
    from runbooks.diagnose.health import HostHealth, snapshot, with_history

    def host(kib: int) -> HostHealth:
        return HostHealth(host="h1", verdict="healthy", measures={"cuda-cache@train": kib})

    before = snapshot([host(10 * 1024)])["h1"]
    grown = with_history(host(90 * 1024), before, Thresholds())
    assert grown.verdict == "warning"
    assert [f.key for f in grown.findings] == ["container-cuda-cache-growing@train"]
    assert "grew 80 MiB" in grown.findings[0].message
    assert with_history(host(90 * 1024), before, Thresholds(cuda_cache_growth_mib=100)).verdict == (
        "healthy"
    )
    assert with_history(host(90 * 1024), {}, Thresholds()).verdict == "healthy"  # first sweep


def test_a_moved_tag_is_drift_and_a_tag_that_still_names_the_image_is_not(
    tmp_path: Path,
) -> None:
    """containers/NAME.image.json as the collector writes it from the Engine API."""
    import json

    running = "sha256:" + "a" * 64
    base = {
        "Name": "/train",
        "Image": running,
        "Config": {"Image": "train:latest"},
        "HostConfig": {"ShmSize": 1 << 30},
        "State": {"Running": True},
    }
    for now, drift in ((running, False), ("sha256:" + "b" * 64, True), (None, True)):
        bundle = tmp_path / str(now)
        (bundle / "containers").mkdir(parents=True)
        (bundle / "containers" / "train.inspect.json").write_text(json.dumps(base))
        (bundle / "containers" / "train.image.json").write_text(
            json.dumps({"Ref": "train:latest", "Id": now})
        )
        with open_bundle(bundle) as b:
            h = check_host("h1", gather(b), Thresholds())
        assert ("container-image-drift@train" in keys(h)) is drift, h.findings


# -- 9. ECC, retired pages and row remapping from a real `nvidia-smi -q -x` ----------------------
XML = Path(__file__).parent / "fixtures" / "nvidia-smi-xml"
V100_RETIRED = {"nvidia-smi.xml": "nvidia-smi-xml/v100-sxm3-retired-pages-v10.xml"}


def test_v100_double_bit_errors_and_pending_retirement_drain_the_gpu(tmp_path: Path) -> None:
    """A V100-SXM3 (driver 410.104, DTD v10; microsoft/pai#3468) with 1 volatile double-bit
    error, 7627 aggregate ones, 2 double-bit retired pages and ``pending_retirement`` Yes. DTD v10
    has no ``pending_blacklist`` and counts errors as single_bit/double_bit totals: both are read,
    and the sweep verdict and the diagnosis agree on a hardware fault of that GPU."""
    facts = facts_of(tmp_path, V100_RETIRED)
    gpu = facts.smi_xml.gpus[0] if facts.smi_xml else None
    assert gpu is not None and gpu.retired_pages is not None
    assert gpu.retired_pages.pending_blacklist is None and gpu.retired_pages.pending_retirement
    h = check_host("h1", facts, Thresholds())
    assert h.verdict == "drain"
    ecc = {f.key for f in h.findings if f.code.startswith("ecc-")}
    assert ecc == {
        "ecc-double-bit-volatile@0000:34:00.0",
        "ecc-retired-pages-pending@0000:34:00.0",
    }
    assert all(f.incident == Incident.GPU_HARDWARE_FAULT for f in h.findings if f.key in ecc)
    # 2 retired pages stay under DCGM's soft limit (15) and the 63-page table: no such finding.
    assert not [f for f in h.findings if "dcgm" in f.code or "table-full" in f.code]
    d = diagnose(facts)
    assert d.matches and d.matches[0].incident == Incident.GPU_HARDWARE_FAULT
    assert ecc <= {f.code for f in d.findings}


def test_healthy_ecc_records_trip_nothing(tmp_path: Path) -> None:
    """Zero counters and "Pending Page Blacklist: No" (Tesla T4, driver 515; 8x V100S, driver
    460): no ECC finding, and the diagnosis is not a hardware fault."""
    for name in ("tesla-t4-v11.xml", "v100s-pcie-8gpu-busy-v11.xml"):
        facts = facts_of(tmp_path / name, {"nvidia-smi.xml": f"nvidia-smi-xml/{name}"})
        h = check_host("h1", facts, Thresholds())
        assert not [f for f in h.findings if f.code.startswith("ecc-")], name
        assert h.verdict == "healthy", (name, keys(h))
        assert diagnose(facts).incident == Incident.HEALTHY, name


# -- 10. stragglers: one GPU against the other GPUs of its node ----------------------------------
V100S = "nvidia-smi-xml/v100s-pcie-8gpu-busy-v11.xml"  # 8 busy GPUs, 57-66 C, all gen 3 x16
K80 = "nvidia-smi-xml/k80-4gpu-half-busy-v10.xml"  # 2 busy (gen 3, 64/69 C), 2 idle (gen 1)
STRAGGLER_CODES = ("gpu-straggler", "gpu-straggler-temp", "gpu-straggler-throttle")
PCIE_CODES = ("gpu-straggler-pcie-width", "gpu-straggler-pcie-gen")


def stragglers(h: HostHealth) -> set[str]:
    return {f.key for f in h.findings if f.code.startswith("gpu-straggler")}


def test_uniform_busy_8_gpu_node_has_no_straggler(tmp_path: Path) -> None:
    """Eight busy V100S (GuanceCloud/datakit): temperatures within 9 C, clocks within 16 %, every
    link gen 3 x16. Two GPUs show sw_power_cap, which is not a throttle reason of the runbook
    (aznhc treats a software power cap as normal): no straggler."""
    facts = facts_of(tmp_path, {"nvidia-smi.xml": V100S})
    assert facts.smi_xml is not None and len(facts.smi_xml.gpus) == 8
    assert sum("sw_power_cap" in g.clock_event_reasons_active for g in facts.smi_xml.gpus) == 2
    assert stragglers(check_host("h1", facts, Thresholds())) == set()


def test_half_busy_node_compares_busy_with_busy_and_skips_idle_generation(tmp_path: Path) -> None:
    """4x K80 (microsoft/pai): two busy GPUs at 64/69 C on gen 3, two idle at 28/26 C on gen 1.
    Against all four, the busy ones would be 'hot' and the idle ones 'slow links'; busy GPUs are
    compared with busy ones only (two are too few) and idle GPUs' generation is not judged."""
    facts = facts_of(tmp_path, {"nvidia-smi.xml": K80})
    assert facts.smi_xml is not None
    assert [g.pcie_gen for g in facts.smi_xml.gpus] == [3, 3, 1, 1]
    assert stragglers(check_host("h1", facts, Thresholds())) == set()


def derived(tmp_path: Path, bus: str, old: str, new: str) -> Facts:
    """DERIVED, not a recorded output: the real 8x V100S XML with ONE field of ONE GPU (the
    <gpu id=bus> block) changed from `old` to `new`; written to tmp_path only, never a fixture."""
    text = (XML / "v100s-pcie-8gpu-busy-v11.xml").read_text(encoding="utf-8")
    start = text.index(f'<gpu id="{bus}">')
    end = text.index("</gpu>", start)
    block = text[start:end]
    assert block.count(old) == 1, f"{old!r} is not one field of {bus}"
    (tmp_path / "nvidia-smi.xml").write_text(
        text[:start] + block.replace(old, new) + text[end:], encoding="utf-8"
    )
    with open_bundle(tmp_path) as b:
        return gather(b)


BUS = "00000000:00:14.0"  # busy (99 %), 57 C, 1575 MHz, gen 3 x16, no throttle reason
SUBJECT = "0000:00:14.0"


def test_hot_gpu_among_busy_peers_is_a_straggler(tmp_path: Path) -> None:
    """DERIVED case (no real multi-GPU XML with one hot GPU was found): the real V100S node with
    one GPU's <gpu_temp> changed from 57 C to 80 C; its 6 busy peers' median is 60 C (00:10.0,
    at 23 %, counts as idle)."""
    facts = derived(tmp_path, BUS, "<gpu_temp>57 C</gpu_temp>", "<gpu_temp>80 C</gpu_temp>")
    h = check_host("h1", facts, Thresholds())
    assert stragglers(h) == {f"gpu-straggler-temp@{SUBJECT}"}
    (f,) = [f for f in h.findings if f.code == "gpu-straggler-temp"]
    assert f.message == "80 C, more than 15 C above the median 60 C of the node's 6 other busy GPUs"
    assert f.incident == Incident.GPU_HARDWARE_FAULT and h.verdict == "warning"
    assert f"gpu-straggler-temp@{SUBJECT}" in {x.code for x in diagnose(facts).findings}
    # The threshold is the runbook's: with a 25 C margin the same node is fine.
    assert stragglers(check_host("h1", facts, Thresholds(straggler_temp_delta_c=25))) == set()


def test_throttle_reason_on_one_gpu_only_is_a_straggler(tmp_path: Path) -> None:
    """DERIVED case (no real XML with a hardware slowdown on some GPUs only was found): the real
    V100S node with one GPU's hw_slowdown changed from Not Active to Active."""
    tag = "clocks_throttle_reason_hw_slowdown"
    facts = derived(tmp_path, BUS, f"<{tag}>Not Active</{tag}>", f"<{tag}>Active</{tag}>")
    h = check_host("h1", facts, Thresholds())
    assert stragglers(h) == {f"gpu-straggler-throttle@{SUBJECT}"}
    (f,) = [f for f in h.findings if f.code == "gpu-straggler-throttle"]
    assert f.message.startswith("hw_slowdown active while 7 of the node's 7 other GPUs run")
    assert f"gpu-throttled@{SUBJECT}" in keys(h)  # the per-GPU finding stays


def test_narrow_pcie_link_among_x16_peers_is_a_straggler(tmp_path: Path) -> None:
    """DERIVED case (no real multi-GPU XML with one narrowed link was found): the real V100S node
    with one GPU's current_link_width changed from 16x to 8x."""
    facts = derived(
        tmp_path,
        BUS,
        "<current_link_width>16x</current_link_width>",
        "<current_link_width>8x</current_link_width>",
    )
    h = check_host("h1", facts, Thresholds())
    assert stragglers(h) == {f"gpu-straggler-pcie-width@{SUBJECT}"}
    (f,) = [f for f in h.findings if f.code == "gpu-straggler-pcie-width"]
    assert f.message == (
        "PCIe link x8 (the GPU can do x16), narrower than the x16 median of the node's 7 other GPUs"
    )


def test_low_pcie_generation_while_busy_is_a_straggler(tmp_path: Path) -> None:
    """DERIVED case: the real V100S node with one busy GPU's current_link_gen changed from 3 to 1
    (what the K80 node's idle GPUs show, which is not judged there)."""
    facts = derived(
        tmp_path,
        BUS,
        "<current_link_gen>3</current_link_gen>",
        "<current_link_gen>1</current_link_gen>",
    )
    h = check_host("h1", facts, Thresholds())
    assert stragglers(h) == {f"gpu-straggler-pcie-gen@{SUBJECT}"}
    (f,) = [f for f in h.findings if f.code == "gpu-straggler-pcie-gen"]
    assert "PCIe gen 1 while busy (the GPU can do gen 3), under the gen 3 median" in f.message


def test_slow_sm_clock_among_busy_peers_is_a_straggler(tmp_path: Path) -> None:
    """DERIVED case: the real V100S node with one busy GPU's SM clock changed from 1575 to
    1000 MHz, under 0.8 x the 1511 MHz median of its 6 other busy peers."""
    facts = derived(tmp_path, BUS, "<sm_clock>1575 MHz</sm_clock>", "<sm_clock>1000 MHz</sm_clock>")
    h = check_host("h1", facts, Thresholds())
    assert stragglers(h) == {f"gpu-straggler@{SUBJECT}"}
    assert all(incident_of(c) == Incident.GPU_HARDWARE_FAULT for c in STRAGGLER_CODES + PCIE_CODES)
