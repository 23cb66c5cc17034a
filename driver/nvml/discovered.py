"""What NVML discovery yields: plain, immutable data, independent of the backend."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PartitionProfile:
    """A MIG GPU-instance profile as NVML reports it (one per profile id)."""

    name: str  # e.g. "1g.10gb", "1g.10gb+me"
    profile_id: int  # nvmlGpuInstanceProfileInfo.id, the ID nvidia-smi shows (19 = 1g.10gb)
    slice_count: int  # compute slices (the "1g" part)
    memory_bytes: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slices
    instance_count: int = 1  # how many instances of this profile fit on the GPU


@dataclass(frozen=True)
class MigInstance:
    """A live GPU instance at a placement and its compute instance (the MIG device).
    A GPU instance without a compute instance (left by a crash or an administrator)
    has no MIG device: `ci_id` and `uuid` are None."""

    gpu_uuid: str  # the parent GPU
    gi_id: int
    profile_id: int  # the GPU-instance profile id (nvmlGpuInstanceInfo.profileId)
    placement: tuple[int, int]  # (start, size) in memory slices
    ci_id: int | None = None
    uuid: str | None = None  # "MIG-..." as NVML reports it; what NVIDIA_VISIBLE_DEVICES takes


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU. Optional fields are None where NVML answered NOT_SUPPORTED."""

    index: int
    minor: int
    uuid: str
    product_name: str
    pci_bus_id: str  # normalised "0000:3b:00.0"
    memory_bytes: int | None
    brand: str | None = None
    architecture: str | None = None
    cuda_compute_capability: str | None = None  # "9.0"
    mig_capable: bool = False
    mig_enabled: bool = False
    memory_slices: int = 0  # largest placement end over all profiles; 0 without MIG
    multiprocessors: int | None = None
    partition_profiles: tuple[PartitionProfile, ...] = ()
    # MIG devices that exist at discovery (created by an administrator, or by this
    # driver for a prepared claim), GPU instances without a compute instance included.
    mig_instances: tuple[MigInstance, ...] = ()
    # Overrides for the `example` profile, which reproduces the Go reference exactly.
    model: str | None = None  # published `model`; defaults to product_name
    compute: int | None = None  # published `compute` capacity (reference: 100)
    # Publish exactly the reference's attribute set (index, uuid, model, driverVersion).
    reference_example: bool = False


@dataclass(frozen=True)
class Inventory:
    """Everything discovery found on one node."""

    backend: str  # "nvml" or "mock"
    driver_version: str  # as NVML reports it, e.g. "580.95.05"
    cuda_driver_version: str | None  # "13.0"
    gpus: tuple[GpuInfo, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class HealthEvent:
    """A health-relevant NVML event for one physical GPU.

    `gpu_instance_id` / `compute_instance_id`: the MIG GPU instance and compute
    instance NVML attributes an Xid to (nvmlEventData_t.gpuInstanceId /
    computeInstanceId); None where NVML reports 0xFFFFFFFF (not attributable: the
    event concerns the whole GPU, or MIG mode is off). Only Xid events carry them.
    """

    gpu_uuid: str
    kind: str  # "xid" | "ecc-dbe" | "gpu-lost" | "recovered"
    xid: int | None = None
    message: str = ""
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
