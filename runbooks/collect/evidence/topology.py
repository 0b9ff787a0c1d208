"""Parse ``nvidia-smi topo -m``: how each pair of GPUs is connected.

Reads the matrix ``nvidia-smi topo -m`` prints (any ``commands/*.txt`` holding it). Returns
:class:`Topology`: the GPU names and, per pair, the link kind of NVIDIA's legend: ``NV#`` (NVLink,
# bonded links), ``PIX`` / ``PXB`` (PCIe switches), ``PHB`` (through a PCIe host bridge), ``NODE``
(across host bridges within a NUMA node), ``SYS`` (across NUMA nodes: SMP interconnect). Never
raises; rows it cannot read are skipped.

Real example (2x RTX 5880 Ada, https://github.com/NVIDIA/nccl/issues/2079)::

            GPU0    GPU1    CPU Affinity    NUMA Affinity
    GPU0     X      NODE    0-63            0
    GPU1    NODE     X      0-63            0

gives ``gpus=("GPU0", "GPU1")``, ``links={("GPU0", "GPU1"): "NODE"}``, ``nvlink=False``.
"""

from __future__ import annotations

import re

from runbooks.core.model import Frozen, Line

_KIND = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")
_GPU = re.compile(r"^GPU\d+$")


class Topology(Frozen):
    source: str
    gpus: tuple[str, ...] = ()
    links: dict[tuple[str, str], str] = {}
    line: Line | None = None  # the header line, to cite

    @property
    def nvlink(self) -> bool:
        """Is any GPU pair joined by NVLink?"""
        return any(kind.startswith("NV") for kind in self.links.values())

    @property
    def through_host(self) -> bool:
        """Does peer traffic between some GPUs cross a host bridge or the CPU interconnect
        (PHB/NODE/SYS), where ACS or the IOMMU can block or slow peer-to-peer?"""
        return any(kind in ("PHB", "NODE", "SYS", "SOC") for kind in self.links.values())


def is_topology(text: str) -> bool:
    head = text[:4000]
    return "GPU0" in head and ("CPU Affinity" in head or "X    = Self" in head)


def parse_topology(text: str, source: str) -> Topology:
    header: list[str] = []
    header_line: Line | None = None
    links: dict[tuple[str, str], str] = {}
    for number, raw in enumerate(text.splitlines()[:400], 1):
        cells = raw.split()
        if not cells:
            continue
        if not header and cells[0] == "GPU0":
            header = [c for c in cells if _GPU.match(c) or c.startswith(("mlx", "NIC"))]
            header_line = Line(source=source, line=number, text=raw.strip()[:300])
            continue
        if header and _GPU.match(cells[0]):
            row, values = cells[0], cells[1 : 1 + len(header)]
            for col, kind in zip(header, values, strict=False):
                if _GPU.match(col) and col != row and _KIND.match(kind):
                    a, b = sorted((row, col))
                    links[(a, b)] = kind
    gpus = tuple(c for c in header if _GPU.match(c))
    return Topology(source=source, gpus=gpus, links=links, line=header_line)
