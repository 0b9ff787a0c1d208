"""Knowledge tables: every row sourced, and the lookups answer what the runbooks rely on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from runbooks.knowledge import (
    BandwidthFloor,
    XidInfo,
    cuda_toolkit_table,
    driver_branch_table,
    driver_satisfies,
    ecc_rules,
    gpu_model_key,
    investigate_threshold,
    max_cuda_for_driver,
    min_driver_for_cuda,
    minor_compat_table,
    nccl_floor,
    nccl_floors,
    xid_info,
    xid_table,
)

CORPUS = Path(__file__).parent / "corpus"
HTTPS = re.compile(r"^https://\S+$")

# --- Xid -----------------------------------------------------------------------------------------

REQUIRED_XIDS = [
    8, 13, 31, 32, 43, 45, 46, 48, 56, 57, 58, 61, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81,
    92, 94, 95, 109, 119, 120, 121, 136, 140, 143, 144, 145, 146, 147, 148, 149, 150, 154, 155,
]  # fmt: skip


@pytest.mark.parametrize("code", REQUIRED_XIDS)
def test_required_xids_present_and_sourced(code: int) -> None:
    info = xid_info(code)
    assert info is not None, code
    assert info.code == code
    assert HTTPS.match(info.source)
    assert info.mnemonic and info.meaning


def test_every_xid_row_has_source_and_is_not_both_fault_and_app() -> None:
    rows = xid_table()
    assert [r.code for r in rows] == sorted({r.code for r in rows})
    for row in rows:
        assert HTTPS.match(row.source), row.code
        assert not (row.fault and row.app_error), row.code


def test_xid_catalogue_is_complete() -> None:
    # NVIDIA's catalog (generated 2025-10-29) lists every code from 1 to 172.
    assert [r.code for r in xid_table()] == list(range(1, 173))
    for code in (54, 74, 79, 119, 120, 136, 140, 143, *range(144, 151), 157, 167, 168):
        info = xid_info(code)
        assert info is not None and info.fault, code
    for code in (5, 14, 106, 154, 162):
        info = xid_info(code)
        assert info is not None and not info.fault and info.severity == "info", code


def test_xid_79_restart_machine_and_fault() -> None:
    info = xid_info(79)
    assert info is not None
    assert info.immediate_action == "RESTART_BM"
    assert info.fault and info.severity == "critical"


def test_xid_63_alone_is_informational() -> None:
    info = xid_info(63)
    assert info is not None
    assert not info.fault
    assert info.severity == "info"
    assert info.immediate_action == "IGNORE"


def test_xid_94_restart_app_but_memory_fault() -> None:
    info = xid_info(94)
    assert info is not None
    assert info.immediate_action == "RESTART_APP"
    assert info.fault and not info.app_error


@pytest.mark.parametrize("code", [95, 119, 120, 62, 64])
def test_reset_gpu_xids(code: int) -> None:
    info = xid_info(code)
    assert info is not None and info.immediate_action == "RESET_GPU"
    assert info.severity == "critical"


def test_xid_45_is_noisy_follow_up() -> None:
    info = xid_info(45)
    assert info is not None
    assert info.noisy and not info.fault and info.severity == "info"
    assert sum(r.noisy for r in xid_table()) == 1


@pytest.mark.parametrize("code", [13, 31, 43])
def test_app_caused_xids(code: int) -> None:
    info = xid_info(code)
    assert info is not None and info.app_error and not info.fault


def test_taxonomy_hardware_xids_are_faults_except_63() -> None:
    # taxonomy.md lists 48 61 62 63 64 74 79 92 94 95 119 120 as gpu-hardware-fault evidence;
    # 63 only records a remap and is not a fault on its own.
    for code in [48, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120]:
        info = xid_info(code)
        assert info is not None and info.fault, code
    assert {r.code for r in xid_table() if r.app_error} == {13, 31, 43}


def test_reset_or_reboot_xids_are_never_info() -> None:
    for row in xid_table():
        if row.immediate_action in {"RESET_GPU", "RESTART_BM"}:
            assert row.severity == "critical", row.code


def test_unknown_xid_is_none() -> None:
    assert xid_info(9999) is None


def test_xid_models_are_frozen_and_validated() -> None:
    info = xid_info(79)
    assert info is not None
    with pytest.raises(ValidationError):
        info.fault = False  # type: ignore[misc]
    with pytest.raises(ValidationError):
        XidInfo.model_validate(info.model_dump() | {"app_error": True})
    with pytest.raises(ValidationError):
        XidInfo.model_validate(info.model_dump() | {"source": "somewhere"})


def test_tables_load_once() -> None:
    assert xid_info(79) is xid_info(79)
    assert ecc_rules() is ecc_rules()


# --- CUDA <-> driver -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cuda", "release", "linux"),
    [
        ("12.1", "12.1.0", "530.30.02"),
        ("cu121", "12.1.0", "530.30.02"),
        ("12.1.1", "12.1.1", "530.30.02"),
        ("11.8", "11.8.0", "520.61.05"),
        ("cu118", "11.8.0", "520.61.05"),
        ("12.2.2", "12.2.2", "535.104.05"),
        ("12.3.2", "12.3.1", "545.23.08"),  # not in NVIDIA's table: newest row at or below
        ("12.1.105", "12.1.1", "530.30.02"),  # a component version, not a toolkit update
        ("11.0", "11.0.2", "450.51.05"),  # GA, not the 11.0.1 RC
        ("12.8", "12.8.0", "570.26"),
        ("12.9.1", "12.9.1", "575.57.08"),
        ("13.0", "13.0.0", "580.65.06"),
        ("10.0", "10.0.130", "410.48"),
        ("10.2", "10.2.89", "440.33"),
    ],
)
def test_min_driver_for_cuda(cuda: str, release: str, linux: str) -> None:
    req = min_driver_for_cuda(cuda)
    assert req is not None
    assert (req.release, req.linux) == (release, linux)
    assert HTTPS.match(req.source)


def test_min_driver_minor_compat_floors() -> None:
    r12, r11, r13, r10 = (min_driver_for_cuda(v) for v in ("12.4", "11.3", "13.1", "10.1"))
    assert r12 is not None and (r12.minor_compat_linux, r12.minor_compat_windows) == (
        "525.60.13",
        "528.33",
    )
    assert r11 is not None and r11.minor_compat_linux == "450.80.02"
    assert r13 is not None and r13.minor_compat_linux == "580.65.06" and r13.windows is None
    assert r10 is not None and r10.minor_compat_linux is None  # no minor compat before CUDA 11


@pytest.mark.parametrize("cuda", ["14.0", "12.7", "garbage", "", "cu1"])
def test_min_driver_unknown(cuda: str) -> None:
    assert min_driver_for_cuda(cuda) is None


@pytest.mark.parametrize(
    ("driver", "cuda"),
    [
        ("535.104.05", "12.2"),
        ("535.161.07", "12.2"),
        ("Driver Version: 550.54.15", "12.4"),
        ("470.82.01", "11.4"),
        ("565.57.01", "12.7"),
        ("570.124.06", "12.8"),
        ("580.65.06", "13.0"),
        ("595.71.05", "13.2"),
        ("418.39", "10.1"),
    ],
)
def test_max_cuda_for_driver(driver: str, cuda: str) -> None:
    assert max_cuda_for_driver(driver) == cuda


@pytest.mark.parametrize("driver", ["999.1.1", "384.81", "n/a", ""])
def test_max_cuda_for_unknown_driver(driver: str) -> None:
    assert max_cuda_for_driver(driver) is None


def test_each_toolkit_driver_reports_its_own_cuda() -> None:
    # The driver a toolkit ships with must print that toolkit's major.minor in nvidia-smi.
    for row in cuda_toolkit_table():
        major, minor, _ = row.cuda.split(".")
        if int(major) >= 10:
            assert max_cuda_for_driver(row.linux) == f"{major}.{minor}", row.cuda


def test_toolkit_drivers_never_decrease_with_cuda() -> None:
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split("."))

    rows = sorted(cuda_toolkit_table(), key=lambda r: key(r.cuda))
    drivers = [key(r.linux) for r in rows]
    assert drivers == sorted(drivers)
    for row in rows:
        assert HTTPS.match(row.source), row.cuda
    assert all(HTTPS.match(r.source) for r in driver_branch_table())
    assert all(HTTPS.match(r.source) for r in minor_compat_table())
    ga_minors = [r.cuda.rsplit(".", 1)[0] for r in rows if r.ga]
    assert len(ga_minors) == len(set(ga_minors))  # one GA row per minor


@pytest.mark.parametrize(
    ("driver", "cuda", "expected"),
    [
        ("470.82.01", "12.1", False),  # 470 predates the 12.x family
        ("470.256.02", "cu121", False),
        ("535.104.05", "12.1", True),  # toolkit driver satisfied
        ("535.54.03", "12.4", True),  # minor-version compatibility (>= 525.60.13)
        ("525.60.13", "12.8", True),
        ("520.61.05", "12.0", False),
        ("575.57.08", "13.0", False),  # 13.x needs the 580 family
        ("580.95.05", "13.1", True),
        ("580.65.06", "11.8", True),  # newer drivers run older CUDA
        ("450.80.02", "11.8", True),
        ("450.51.05", "11.8", False),  # below the 11.x minor-compat floor
        ("450.51.05", "11.0", True),
        ("418.39", "10.2", False),  # no minor compatibility before CUDA 11
        ("440.33", "10.2", True),
        ("570.124.06", "12.8", True),  # numeric, not lexical: 570.124 > 570.26
    ],
)
def test_driver_satisfies(driver: str, cuda: str, expected: bool) -> None:
    assert driver_satisfies(driver, cuda) is expected


def test_driver_satisfies_strict_and_windows() -> None:
    assert driver_satisfies("535.54.03", "12.4", strict=True) is False
    assert driver_satisfies("550.54.14", "12.4", strict=True) is True
    assert driver_satisfies("570.26", "12.8.1", strict=True) is False
    assert driver_satisfies("528.33", "12.4", platform="windows") is True
    assert driver_satisfies("527.41", "12.4", platform="windows") is False
    assert driver_satisfies("580.88", "13.0", platform="windows") is None  # NVIDIA lists N/A


@pytest.mark.parametrize(("driver", "cuda"), [("", "12.1"), ("535.1", "nope"), ("535.1", "14.0")])
def test_driver_satisfies_unknown(driver: str, cuda: str) -> None:
    assert driver_satisfies(driver, cuda) is None


# --- NCCL floors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA H200 NVL", "h200-nvl"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4"),
        ("NVIDIA A100-SXM4-40GB", "a100-sxm4"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2"),
        ("NVIDIA GB200", "gb200"),
        ("h100-sxm", "h100-sxm"),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-PCIE-16GB", None),
    ],
)
def test_gpu_model_key(name: str, key: str | None) -> None:
    assert gpu_model_key(name) == key


@pytest.mark.parametrize(
    ("name", "count", "interconnect", "floor"),
    [
        ("NVIDIA H100 80GB HBM3", 8, "nvlink", 460.0),
        ("NVIDIA H100 80GB HBM3", 8, "NVSwitch", 460.0),
        ("NVIDIA H100 80GB HBM3", 8, None, 460.0),
        ("NVIDIA H200", 8, "nvlink", 431.0),
        ("NVIDIA A100-SXM4-80GB", 8, "nvlink", 228.0),
        ("NVIDIA H100 NVL", 2, "nvlink-bridge", 208.0),
        ("NVIDIA H100 NVL", 2, "NV12", 208.0),
        ("NVIDIA A100-PCIE-40GB", 4, "pcie", 25.0),
        ("NVIDIA A100 80GB PCIe", 2, "nvlink", 193.0),
        ("Tesla V100-SXM2-32GB", 8, "nvlink", 110.0),
        ("NVIDIA GB200", 4, "nvlink", 432.0),
        ("NVIDIA H100 PCIe", 8, "pcie", 28.0),
    ],
)
def test_nccl_floor(name: str, count: int, interconnect: str | None, floor: float) -> None:
    got = nccl_floor(name, count, interconnect)
    assert got is not None
    assert got.min_busbw_gbps == floor
    assert got.gpu_count == count


@pytest.mark.parametrize(
    ("name", "count", "interconnect"),
    [
        ("NVIDIA H100 80GB HBM3", 2, "nvlink"),  # only an 8-GPU floor is known
        ("NVIDIA H100 80GB HBM3", 4, None),
        ("NVIDIA H100 80GB HBM3", 16, "nvlink"),  # two nodes: not a single-node floor
        ("NVIDIA A100-SXM4-40GB", 4, "nvlink"),
        ("NVIDIA H100 80GB HBM3", 8, "pcie"),  # not this node's topology
        ("NVIDIA H100 PCIe", 8, "nvlink"),
        ("NVIDIA H100 80GB HBM3", 8, "token-ring"),  # unknown interconnect word
        ("NVIDIA GeForce RTX 4090", 2, "pcie"),
    ],
)
def test_nccl_floor_unknown_shape(name: str, count: int, interconnect: str | None) -> None:
    assert nccl_floor(name, count, interconnect) is None


def test_nccl_floor_never_borrows_another_gpu_count() -> None:
    for floor in nccl_floors():
        for count in range(1, 33):
            got = nccl_floor(floor.model, count, None)
            if got is not None:
                assert got.gpu_count == count


def test_nccl_floors_sourced_and_flagged() -> None:
    for floor in nccl_floors():
        assert HTTPS.match(floor.source), floor
        if floor.basis == "community":
            assert floor.reference_gbps is not None
            expected = investigate_threshold(floor.reference_gbps)
            assert floor.min_busbw_gbps == pytest.approx(expected)
    unverified = {(f.model, f.gpu_count) for f in nccl_floors() if "NOT VERIFIED" in (f.note or "")}
    assert unverified == {("h100-nvl", 2), ("v100-sxm2", 8)}


def test_floor_pass_and_investigate_rule() -> None:
    floor = nccl_floor("NVIDIA H100 80GB HBM3", 8, "nvlink")
    assert isinstance(floor, BandwidthFloor)
    assert floor.passes(460.0) and not floor.passes(459.9)
    assert investigate_threshold(460.0) == pytest.approx(368.0)


def _nccl_case(case: str) -> tuple[str, int, float]:
    path = CORPUS / case / "nccl-tests.txt"
    if not path.exists():
        pytest.skip(f"corpus case {case} not present")
    text = path.read_text()
    ranks = re.findall(r"^#\s+Rank\s+\d+ .* device\s+\d+ \[[^\]]+\] (.+?)\s*$", text, re.M)
    avg = re.search(r"Avg bus bandwidth\s*:\s*([\d.]+)", text)
    assert ranks and avg
    return ranks[0], len(ranks), float(avg.group(1))


@pytest.mark.parametrize(
    "case",
    ["healthy--oci-a100x8-container-nccl-232gbs", "healthy--oci-v100x8-sxm2-nccl-135gbs"],
)
def test_healthy_corpus_nodes_pass_their_floor(case: str) -> None:
    name, count, busbw = _nccl_case(case)
    floor = nccl_floor(name, count, "nvlink")
    assert floor is not None and floor.passes(busbw)


def test_two_node_run_is_not_judged_by_single_node_floor() -> None:
    # 16 ranks over two 8x H100 nodes at 458 GB/s: the 8-GPU 460 floor must not apply.
    name, count, busbw = _nccl_case("healthy--oci-h100-2node-16gpu-nccl-458gbs")
    assert (count, busbw < 460.0) == (16, True)
    assert nccl_floor(name, count, "nvlink") is None


# --- ECC -----------------------------------------------------------------------------------------


def test_ecc_rules_thresholds() -> None:
    rules = ecc_rules()
    assert rules.remapped_rows_pending.trips({"remapped_rows.pending": 1})
    assert not rules.remapped_rows_pending.trips({"remapped_rows.pending": 0})
    assert rules.remapped_rows_failure.trips({"remapped_rows.failure": 1})
    assert rules.sram_uncorrectable.trips({"ecc.errors.uncorrected.aggregate.sram": 1})
    assert not rules.sram_uncorrectable.trips({"ecc.errors.uncorrected.volatile.sram": 0})
    assert rules.sram_correctable.severity == "warning"
    assert not rules.sram_correctable.trips({"ecc.errors.corrected.volatile.sram": 10_000})
    assert rules.sram_correctable.trips({"ecc.errors.corrected.aggregate.sram": 10_001})
    assert rules.dram_counters.severity == "fault"
    assert not rules.dram_counters.trips({"ecc.errors.corrected.aggregate.dram": 20_000_000})
    assert rules.dram_counters.trips({"ecc.errors.corrected.aggregate.dram": 20_000_001})
    assert rules.dram_counters.trips({"ecc.errors.uncorrected.volatile.dram": 20_000_001})
    assert not rules.dram_counters.trips({})  # nothing measured: nothing trips


def test_ecc_retired_pages_rules() -> None:
    rules = ecc_rules()
    full = rules.retired_pages_table_full
    pages = {"retired_pages.sbe": 40, "retired_pages.dbe": 22}
    assert full.trips(pages, pending_blacklist=True)
    assert not full.trips(pages)  # needs "Pending Page Blacklist: Yes"
    fewer = {"retired_pages.sbe": 40, "retired_pages.dbe": 21}
    assert not full.trips(fewer, pending_blacklist=True)
    dcgm = rules.dcgm_max_retired_pages
    assert dcgm.threshold == 63
    assert not dcgm.trips({"retired_pages.sbe": 62})
    assert dcgm.trips({"retired_pages.sbe": 60, "retired_pages.dbe": 3})
    assert rules.dcgm_retired_pages_soft_limit.trips({"retired_pages.dbe": 16})
    assert rules.retired_pages_pending.severity == "fault"
    assert rules.retired_pages_pending.trips({"retired_pages.pending": 1})
    assert not rules.retired_pages_pending.trips({"retired_pages.pending": 0})


def test_ecc_pre_ampere_double_bit_rule() -> None:
    """Volatile double-bit errors (pre-Ampere ``double_bit/total``) are a fault; the lifetime
    (aggregate) count alone is not."""
    dbe = ecc_rules().double_bit_volatile
    assert dbe.severity == "fault"
    assert dbe.trips({"ecc.errors.uncorrected.volatile.total": 1})
    assert not dbe.trips({"ecc.errors.uncorrected.volatile.total": 0})
    assert not dbe.trips({"ecc.errors.uncorrected.aggregate.total": 7627})


def test_ecc_rules_all_sourced() -> None:
    named = dict(ecc_rules().rules())
    assert set(named) >= {
        "remapped_rows_pending",
        "remapped_rows_failure",
        "sram_uncorrectable",
        "sram_correctable",
        "dram_counters",
        "retired_pages_table_full",
        "dcgm_max_retired_pages",
    }
    for name, rule in named.items():
        assert HTTPS.match(rule.source), name
    faults = {n for n, r in named.items() if r.severity == "fault"}
    assert {"remapped_rows_pending", "remapped_rows_failure", "sram_uncorrectable"} <= faults
