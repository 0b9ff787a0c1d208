#!/usr/bin/env python3
"""Test shim standing in for NVIDIA's `nvidia-container-runtime-hook` in the cudamedic lab.

dockerd registers its "nvidia" device driver (what `--gpus` needs) only when a binary with this
name is on its PATH; without it `docker run --gpus all` fails with the real toolkit-missing error
(`could not select device driver "" with capabilities: [[gpu]]`). When dockerd finds it, runc
calls it as an OCI prestart hook: `nvidia-container-runtime-hook prestart`, with the container
state JSON on stdin. The real hook mounts driver libraries and device nodes; this shim instead
installs a recorded `nvidia-smi` into the container's root filesystem, listing only the GPUs in
the container's NVIDIA_VISIBLE_DEVICES, so probes inside the container see "GPUs".

The recorded outputs live beside the shim: `nvidia-smi-L.txt` and `nvidia-smi.txt`.
"""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def visible(lines: list[str], spec: str) -> list[str]:
    spec = spec.strip()
    if spec in ("", "void", "none"):
        return []
    if spec == "all":
        return lines
    wanted = {item.strip() for item in spec.split(",")}
    chosen = []
    for line in lines:
        index = line.split(":", 1)[0].replace("GPU", "").strip()
        uuid = line.rsplit("(UUID:", 1)[-1].strip(" )") if "(UUID:" in line else None
        if index in wanted or (uuid and uuid in wanted):
            chosen.append(line)
    return chosen


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] != "prestart":
        return 0
    state = json.load(sys.stdin)
    bundle = Path(state.get("bundle") or state.get("bundlePath") or ".")
    config = json.loads((bundle / "config.json").read_text())
    root = Path(config["root"]["path"])
    if not root.is_absolute():
        root = bundle / root
    env = dict(e.split("=", 1) for e in config.get("process", {}).get("env", []) if "=" in e)
    listing = (HERE / "nvidia-smi-L.txt").read_text().splitlines()
    gpus = visible(listing, env.get("NVIDIA_VISIBLE_DEVICES", ""))
    renumbered = [f"GPU {i}:{line.split(':', 1)[1]}" for i, line in enumerate(gpus)]
    share = root / "usr/local/share/cudamedic-lab"
    share.mkdir(parents=True, exist_ok=True)
    (share / "nvidia-smi-L.txt").write_text("\n".join(renumbered) + ("\n" if renumbered else ""))
    (share / "nvidia-smi.txt").write_text((HERE / "nvidia-smi.txt").read_text())
    bindir = root / "usr/local/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        "# installed by the cudamedic lab's nvidia-container-runtime-hook shim\n"
        'if [ "$1" = "-L" ]; then cat /usr/local/share/cudamedic-lab/nvidia-smi-L.txt; exit 0; fi\n'
        "cat /usr/local/share/cudamedic-lab/nvidia-smi.txt\n"
    )
    os.chmod(smi, 0o755)
    return 0


if __name__ == "__main__":
    sys.exit(main())
