"""scripts/gpu-check.sh against recorded outputs: this machine has no GPU, so its `nvidia-smi` and
`dmesg` are stand-ins first on PATH that replay real recordings (an 8 x H100 node, each with its
.source under tests/fixtures/). The script is run as on a GPU machine, with the real cudamedic and
the tests' Prefect server; what it keeps must be what a fixture needs (the outputs, their sources,
the machine's versions) and cudamedic's own verdicts on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"
SCRIPT = REPO / "scripts" / "gpu-check.sh"
NVIDIA_SMI = f"""#!/bin/sh
case "$*" in
  "-L") cat {FIX}/nvidia-smi/list-h100-8gpu.txt ;;
  "topo -m") cat {FIX}/nvidia-smi-topo/h100-8gpu-nv18.txt ;;
  "-q -x") exit 0 ;;  # no recording of this node's XML: nothing printed
  *) cat {FIX}/nvidia-smi/h100-sxm-8gpu.txt ;;
esac
"""
DMESG = f"#!/bin/sh\ncat {FIX}/dmesg/driver-load-benign.txt\n"


def _stand_ins(tmp_path: Path) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("nvidia-smi", NVIDIA_SMI), ("dmesg", DMESG)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return bindir


def test_gpu_check_records_the_machine_and_cudamedics_verdicts(
    prefect_api: str, tmp_path: Path
) -> None:
    bindir = _stand_ins(tmp_path)
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "CUDAMEDIC": str(REPO / ".venv" / "bin" / "cudamedic"),
        "PREFECT_API_URL": prefect_api,
        "CUDAMEDIC_FLEET": "t-gpu-check",
        "DOCKER_HOST": "unix:///nonexistent/docker.sock",  # a GPU machine without Docker
    }
    env.pop("CUDAMEDIC_CONFIG", None)
    out = tmp_path / "real"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    dest = out / "nvidia-h100-80gb-hbm3"
    meta = dict(
        line.split(": ", 1) for line in (dest / "meta.txt").read_text().splitlines() if ": " in line
    )
    assert (meta["gpu"], meta["gpus"]) == ("NVIDIA H100 80GB HBM3", "8")
    assert (meta["driver"], meta["cuda"]) == ("565.57.01", "12.7")
    assert meta["recorded"].endswith("Z")
    table = (FIX / "nvidia-smi" / "h100-sxm-8gpu.txt").read_text()
    assert (dest / "nvidia-smi.txt").read_text() == table
    for name in ("nvidia-smi-L.txt", "nvidia-smi-topo.txt", "dmesg.txt", "nvidia-smi.xml"):
        assert (dest / name).exists(), name
    for kept in dest.iterdir():
        if not kept.name.endswith(".source"):
            source = dest / f"{kept.name}.source"
            assert source.exists(), f"{kept.name} has no .source"
            assert "8 x NVIDIA H100 80GB HBM3, driver 565.57.01" in source.read_text()
    # cudamedic's own view of the machine: a healthy GPU node on positive evidence.
    diagnosis = json.loads((dest / "classify.json").read_text())
    assert diagnosis["incident"] == "healthy", diagnosis["summary"]
    with tarfile.open(dest / "bundle-local.tar.gz") as tar:
        assert any(m.name.endswith("/nvidia-smi.txt") for m in tar.getmembers())
    sweep = json.loads((dest / "sweep.json").read_text())
    assert sweep["hosts"] == 1 and "local" in sweep["verdicts"], sweep


def test_gpu_check_without_nvidia_smi_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    if any((Path(p) / "nvidia-smi").exists() for p in env["PATH"].split(":")):
        pytest.fail("this test machine has an nvidia-smi on /usr/bin:/bin")
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "real")],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2 and "no nvidia-smi on this machine" in proc.stderr
    assert not (tmp_path / "real").exists()
