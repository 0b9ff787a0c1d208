"""GPU knowledge tables as data (Xid catalogue, CUDA/driver versions, NCCL floors, ECC rules).

The figures live in the YAML files of this package, each row with its source; the models and
lookups are in ``tables.py`` and re-exported here.
"""

from runbooks.knowledge.tables import (
    BandwidthFloor,
    DriverBranch,
    DriverRequirement,
    EccRule,
    EccRules,
    GpuModel,
    MinorCompat,
    ToolkitDriver,
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

__all__ = [
    "BandwidthFloor",
    "DriverBranch",
    "DriverRequirement",
    "EccRule",
    "EccRules",
    "GpuModel",
    "MinorCompat",
    "ToolkitDriver",
    "XidInfo",
    "cuda_toolkit_table",
    "driver_branch_table",
    "driver_satisfies",
    "ecc_rules",
    "gpu_model_key",
    "investigate_threshold",
    "max_cuda_for_driver",
    "min_driver_for_cuda",
    "minor_compat_table",
    "nccl_floor",
    "nccl_floors",
    "xid_info",
    "xid_table",
]
