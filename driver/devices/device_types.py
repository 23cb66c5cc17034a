"""What the device model produces: published devices and how each is delivered."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from driver.nvml.discovered import MigInstance

DEFAULT_DRIVER_NAME = "gpu.example.com"


class MigStrategy(enum.StrEnum):
    """How GPUs in MIG mode are published (`--mig-strategy`, docs/mig.md).

    - auto: per GPU; a GPU with MIG devices this driver did not create is static,
      every other MIG GPU is dynamic. Never destroys or overlaps what it finds.
    - dynamic: every MIG GPU is driver-managed: every (profile, placement) is
      published and its MIG device created at prepare, destroyed at unprepare.
      Foreign MIG devices are a start-up error.
    - static: only existing MIG devices are published; nothing is ever created.
    """

    AUTO = "auto"
    DYNAMIC = "dynamic"
    STATIC = "static"


@dataclass(frozen=True)
class MigBacking:
    """How prepare delivers a device of a GPU in MIG mode: a MIG device of this
    GPU-instance profile at this placement, created for the claim, or `existing`
    (static: used as it is, never created or destroyed by the driver)."""

    profile_id: int
    slice_count: int
    placement: tuple[int, int]  # (start, size) in memory slices
    existing: MigInstance | None = None


@dataclass(frozen=True)
class PoolOptions:
    driver_name: str = DEFAULT_DRIVER_NAME
    # > 0: the reference's N equal partitions per GPU (replaces MIG partitions).
    gpu_partitions: int = 0
    mig_strategy: MigStrategy = MigStrategy.AUTO
    # `--gpu-allow-multiple-allocations` (DRAConsumableCapacity, docs/sharing.md): whole
    # GPUs and reference partitions are published with `allowMultipleAllocations: true`
    # and request policies on `memory` and `compute`. Never MIG devices, and never the
    # whole GPU of a dynamic MIG GPU (it is delivered as a MIG device created per claim).
    allow_multiple_allocations: bool = False
    # `--mig-profiles`: the MIG profiles a dynamic-MIG GPU publishes placements of, as
    # profile labels ("1g10gb", `documents.profile_label`); empty: every profile. The
    # whole GPU is published either way.
    mig_profiles: tuple[str, ...] = ()
    # The node runs MPS daemons (`--mps-daemons`, docs/sharing.md): every device on a
    # GPU with MIG off carries `mpsIsolation`, `"strict"` on a whole GPU of Volta or
    # later that is not shared by capacity (its one daemon holds it in
    # EXCLUSIVE_PROCESS), `"cooperative"` on the others; its shares, partitions and
    # SpacePartitioning get MPS limits per client process (docs/mps.md), and a claim
    # may ask for the MPS strategy.
    mps: bool = False
    # `--mps-strict-partitions`: with `mps`, the `--gpu-partitions` partitions of a GPU
    # of Volta or later are `"strict"` too: one MPS server per GPU serves them all,
    # with the partition's limits, in EXCLUSIVE_PROCESS (driver/state/mps/shared.py).
    mps_strict_partitions: bool = False

    def __post_init__(self) -> None:
        if self.gpu_partitions < 0:
            raise ValueError(f"gpu_partitions must be >= 0, got {self.gpu_partitions}")


@dataclass(frozen=True)
class PublishedDevice:
    """One published device and what prepare needs to know about it."""

    name: str
    document: dict[str, Any]  # resource.k8s.io/v1 Device
    gpu_uuid: str
    gpu_minor: int
    is_partition: bool
    max_partitions: int | None  # None for partitions (and GPUs without a known limit)
    profile: str | None = None  # MIG profile, e.g. "1g.10gb"
    placement: tuple[int, int] | None = None  # MIG (start, size) in memory slices
    mig: MigBacking | None = None  # set for every device of a GPU in MIG mode
    # Multi-allocatable devices (`allowMultipleAllocations: true`): what all shares
    # together may consume, capacity name -> amount (memory in bytes). None: exclusive.
    share_capacity: dict[str, int] | None = None

    @property
    def multi_allocatable(self) -> bool:
        return self.share_capacity is not None
