"""The shape of an evidence source, and the built-in probes run inside containers.

Which sources a response collects is data: the runbook YAML (runbooks/core/runbook.py) lists the
host
commands and names the container probes. Commands are fixed strings from the runbook; the only
parameters that reach a shell (the nccl-tests path and GPU count) are quoted by the collector.
``fallback`` is run when the main command fails (``dmesg`` refused -> ``journalctl -k``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from runbooks.core.model import Frozen

Keep = Literal["head", "tail"]


class HostSource(Frozen):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,40}$")
    path: str = Field(pattern=r"^(commands/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,80}$")  # bundle-relative
    command: str
    timeout: float | None = None  # None: Settings.command_timeout
    keep: Keep = "head"
    fallback: str | None = None
    ok_exit_codes: tuple[int, ...] = (0,)
    stdout_only: bool = False
    # A program the host may not have (e.g. `dcgmi`): where it is not on PATH the source is
    # skipped quietly (status skipped, no finding), like nccl-tests without all_reduce_perf.
    requires: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,60}$")


class ContainerProbe(Frozen):
    """A command run inside a container with exec (argv, no shell of ours)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,40}$")  # containers/C.exec-NAME.txt
    argv: tuple[str, ...] = Field(min_length=1)


# The torch probe is passed as $0 to sh so no quoting of its text is ever needed.
TORCH_PROBE = r"""
import json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
except Exception as exc:
    out["torch"] = None
    out["error"] = f"{type(exc).__name__}: {exc}"
else:
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    try:
        out["is_available"] = torch.cuda.is_available()
        out["device_count"] = torch.cuda.device_count()
        out["devices"] = [
            {"index": i, "name": torch.cuda.get_device_name(i),
             "capability": ".".join(map(str, torch.cuda.get_device_capability(i)))}
            for i in range(out["device_count"])
        ]
        out["arch_list"] = torch.cuda.get_arch_list() if out["is_available"] else []
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

_PY = (
    'if command -v python3 >/dev/null 2>&1; then exec python3 -c "$0"; '
    'elif command -v python >/dev/null 2>&1; then exec python -c "$0"; '
    'else echo "cudamedic: no python in this container"; exit 127; fi'
)

BUILTIN_PROBES: dict[str, ContainerProbe] = {
    p.name: p
    for p in (
        ContainerProbe(name="torch", argv=("sh", "-c", _PY, TORCH_PROBE)),
        ContainerProbe(name="ulimit", argv=("sh", "-c", "ulimit -a")),
        ContainerProbe(name="shm", argv=("df", "-h", "/dev/shm")),
        ContainerProbe(
            name="env",
            argv=(
                "sh",
                "-c",
                "env | grep -E '^(CUDA|NCCL|NVIDIA|TORCH|PYTORCH|LD_LIBRARY_PATH|OMP_NUM|"
                "WORLD_SIZE|RANK|LOCAL_RANK|MASTER_)' | sort",
            ),
        ),
        ContainerProbe(name="nvidia-smi-L", argv=("nvidia-smi", "-L")),
        # The CUDA JIT cache: PTX compiled for a GPU the image has no native code for lands
        # here; a cache that grows sweep after sweep means every start pays for that compile.
        ContainerProbe(
            name="cuda-cache",
            argv=("sh", "-c", 'du -sk "${CUDA_CACHE_PATH:-$HOME/.nv/ComputeCache}" 2>&1'),
        ),
    )
}

NCCL_TESTS_PATH = "nccl-tests.txt"
