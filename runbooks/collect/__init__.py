"""Stage 1, collect: reach a host (SSH, the Docker API, or local), gather an evidence bundle and
read it back. Uses ``runbooks.core`` only.

- ``collector``: one collection from one host into a bundle (``collect``).
- ``remote``: the transports (``ssh``, ``docker``, ``runner``); ``smi_guard``: nvidia-smi with care.
- ``target``, ``inventory``, ``ansible_inventory``: which host TARGET names, from which inventory.
- ``bundle``: the bundle layout, opened from a directory, a .tar.gz or one log file.
- ``redact``: secrets masked before anything is written.
- ``evidence``: the parsers of what was collected (nvidia-smi, dmesg, docker inspect, ...).
- ``dcgm``: DCGM's diagnostic run into a response's bundle.
"""

__all__ = [
    "ansible_inventory",
    "bundle",
    "collector",
    "dcgm",
    "evidence",
    "inventory",
    "redact",
    "remote",
    "smi_guard",
    "target",
]
