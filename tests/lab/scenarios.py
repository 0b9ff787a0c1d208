"""Simulated GPU hosts of the lab: which recorded real outputs each host's commands replay.

`files` maps a data file of the host to a fixture under tests/fixtures/ (each fixture has its
`.source` beside it). `literal` holds only control values (exit codes, hang flags, run times),
never output text: every message a fake command prints comes from a recorded fixture.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Scenario:
    name: str
    engine: str  # "gpu" (toolkit shim present) or "plain" (no toolkit)
    gpus: int
    files: dict[str, str]
    literal: dict[str, str] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    planted: str = ""  # the problem this host carries, for tests and the demo


_H100 = {
    "nvidia-smi.txt": "nvidia-smi/h100-sxm-8gpu.txt",
    "nvidia-smi-L.txt": "nvidia-smi/list-h100-8gpu.txt",
    "nvidia-smi-topo.txt": "nvidia-smi-topo/h100-8gpu-nv18.txt",
    "lsmod.txt": "host-commands/lsmod-nvidia-peermem.txt",
    # The toolkit's hook binary answers --version (1.17.8); no nvidia-ctk on these hosts.
    "nvidia-container-toolkit.txt": "host-commands/nvidia-container-toolkit-version.txt",
    "dmesg.txt": "dmesg/driver-load-benign.txt",
}

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            name="gpu-healthy",
            engine="gpu",
            gpus=8,
            tags=("h100", "lab"),
            files={**_H100, "nccl-tests.txt": "nccl-tests/h100-8gpu-single-node.txt"},
            literal={"nccl-tests.seconds": "2"},
            planted="healthy",
        ),
        Scenario(
            name="gpu-xid79",
            engine="gpu",
            gpus=8,
            tags=("h100", "lab"),
            files={
                **_H100,
                "dmesg.txt": "dmesg/xid79-fallen-off-bus-aer.txt",
                # NVIDIA DCGM runs here (the other hosts have no dcgmi): recorded outputs of
                # other machines (each fixture's .source), replayed as this host's; `diag -r N`
                # replays one recorded Hardware section whatever the level asked.
                "dcgmi-discovery.txt": "dcgmi/discovery-h100-4gpu-null-names-fragment.txt",
                "dcgmi-health.txt": "dcgmi/health-l4-power-warning.txt",
                "dcgmi-diag.txt": "dcgmi/diag-r2-gpu-memory-fail-fragment.txt",
            },
            # The recording's stamps are moved so its Xid 79 is 5 minutes old at lab-up:
            # inside the sweep's Xid window on any machine, whatever its uptime.
            # nvidia-bug-report.sh: a stand-in with the real tool's layout (tests/lab/lab.py)
            literal={"dmesg.recent": "300", "nvidia-bug-report": "1"},
            planted="gpu-hardware-fault",
        ),
        Scenario(
            name="gpu-nodriver",
            engine="gpu",
            gpus=8,
            tags=("h100", "lab"),
            files={
                "nvidia-smi.txt": "nvidia-smi/driver-not-loaded.txt",
                "dmesg.txt": "dmesg/rminitadapter-syslog.txt",
                "nvidia-container-toolkit.txt": _H100["nvidia-container-toolkit.txt"],
            },
            literal={"nvidia-smi.rc": "9"},
            planted="driver-not-loaded",
        ),
        Scenario(
            # dmesg is refused, so the collector falls back to journalctl -k, which shows why.
            name="gpu-mismatch",
            engine="gpu",
            gpus=8,
            tags=("h100", "lab"),
            files={
                "nvidia-smi.txt": "nvidia-smi/library-mismatch.txt",
                "dmesg.denied": "dmesg/not-permitted.txt",
                "journal.txt": "dmesg/api-mismatch-journal.txt",
                "lsmod.txt": "host-commands/lsmod-nvidia-peermem.txt",
                "nvidia-container-toolkit.txt": _H100["nvidia-container-toolkit.txt"],
            },
            literal={"nvidia-smi.rc": "18"},
            planted="driver-library-mismatch",
        ),
        Scenario(
            name="gpu-slow-nccl",
            engine="gpu",
            gpus=4,
            tags=("a100", "lab"),
            files={
                "nvidia-smi.txt": "nvidia-smi/a100-sxm4-80gb-4gpu.txt",
                "nccl-tests.txt": "nccl-tests/a100-4gpu-p2p-disabled.txt",
                "dmesg.txt": "dmesg/driver-load-benign.txt",
                "lsmod.txt": "host-commands/lsmod-nvidia-peermem.txt",
                "nvidia-container-toolkit.txt": _H100["nvidia-container-toolkit.txt"],
            },
            literal={"nccl-tests.seconds": "2"},
            planted="nccl-slow-transport",
        ),
        Scenario(
            name="gpu-notoolkit",
            engine="plain",
            gpus=8,
            tags=("h100", "lab"),
            files={k: v for k, v in _H100.items() if k != "nvidia-container-toolkit.txt"},
            planted="container-toolkit-missing",
        ),
        Scenario(
            # The toolkit's CLI is installed, but the engine was never set up with its hook
            # (e.g. dockerd not restarted after the install): `--gpus` fails at start.
            name="gpu-nohook",
            engine="plain",
            gpus=8,
            tags=("h100", "lab"),
            # An older toolkit (nvidia-ctk 1.12.0), below the sweep's 1.13 floor.
            files={
                **{k: v for k, v in _H100.items() if k != "nvidia-container-toolkit.txt"},
                "nvidia-ctk.txt": "host-commands/nvidia-ctk-version.txt",
            },
            planted="gpu-not-requested whose fix fails: no runtime hook; toolkit 1.12 (old)",
        ),
        Scenario(
            name="gpu-hang",
            engine="gpu",
            gpus=8,
            tags=("h100", "lab"),
            files={**_H100},
            literal={"nvidia-smi.hang": "1"},
            planted="nvidia-smi hangs",
        ),
    ]
}
