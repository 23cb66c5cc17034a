"""Inventory -> the devices and counter sets of one node's pool (pure).

Device documents are resource.k8s.io/v1 `Device` dicts (bare attribute keys live in
the driver's domain). Per GPU, one of:

- MIG mode on (and `gpu_partitions` 0): MIG partitions sharing the GPU's counter
  set, dynamic or static by `--mig-strategy` (driver/devices/mig_devices.py, docs/mig.md);
- `gpu_partitions=N` (the Go reference's --gpu-partitions): per GPU a counter set
  `gpu-<i>-counters` {memory, compute}, N devices `gpu-<i>-partition-<j>` of equal size
  (time-shared, attribute `isolated: false`) and `gpu-<i>-full`;
- otherwise the whole GPU `gpu-<minor>`.

With `allow_multiple_allocations` (docs/sharing.md) whole GPUs and reference
partitions carry `allowMultipleAllocations: true` and request policies on their
`memory` and `compute` capacities; MIG devices (and the whole GPU of a dynamic MIG
GPU, delivered as a MIG device created per claim) stay exclusive.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from typing import Any

from driver.devices import mig_counters, mig_devices
from driver.devices.device_types import MigStrategy, PoolOptions, PublishedDevice
from driver.devices.formatting import (
    binary_quantity,
    decimal_quantity,
    normalize_version,
    profile_label,
    quantity_int,
)
from driver.nvml.discovered import GpuInfo, Inventory

__all__ = [
    "MigStrategy",
    "PoolDevices",
    "PoolError",
    "PoolOptions",
    "PublishedDevice",
    "build_pool",
]

DEFAULT_COMPUTE = 100  # the reference's `compute` capacity of a whole GPU
SHARE_MEMORY_STEP = 1 << 30  # shares of memory: min 1Gi, step 1Gi (the reference)
SHARE_COMPUTE_STEP = 1
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
# What the MPS limits of a device hold against (docs/mps.md, "What holds and what does
# not"). `cooperative`: MPS daemons in the GPU's `Default` compute mode (shares and
# partitions: several servers per GPU); the limits bind each client process, and only
# processes that use MPS. `strict`: a whole GPU not shared by capacity, of Volta or
# later (or, with --mps-strict-partitions, its partitions): its one MPS server holds it
# in EXCLUSIVE_PROCESS, so a process outside MPS cannot open it
# (driver/state/mps/compute_modes.py, driver/state/mps/shared.py).
MPS_ISOLATION_ATTRIBUTE = "mpsIsolation"
MPS_ISOLATION_COOPERATIVE = "cooperative"
MPS_ISOLATION_STRICT = "strict"
# EXCLUSIVE_PROCESS with MPS needs Volta (compute capability 7.0) or later: before it
# an MPS server is not isolated from its clients' faults and has 16 clients at most.
STRICT_MPS_MIN_CC_MAJOR = 7


class PoolError(ValueError):
    """The inventory cannot be published with these options (a start-up error)."""


@dataclass(frozen=True)
class PoolDevices:
    devices: tuple[PublishedDevice, ...]
    counter_sets: tuple[dict[str, Any], ...] = ()  # resource.k8s.io/v1 CounterSet dicts
    options: PoolOptions = field(default_factory=PoolOptions)
    # GPU UUID -> "dynamic" | "static" for GPUs in MIG mode; why existing MIG
    # instances were not published (static GPUs).
    mig_modes: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def device(self, name: str) -> PublishedDevice:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def devices_of_gpu(self, gpu_uuid: str) -> tuple[PublishedDevice, ...]:
        """Every device backed by a physical GPU: the GPU itself and its partitions."""
        return tuple(d for d in self.devices if d.gpu_uuid == gpu_uuid)


def gpu_max_partitions(gpu: GpuInfo) -> int | None:
    """The most partitions NVML can carve out of the GPU (MIG), or None if unknown."""
    if not gpu.mig_capable or not gpu.partition_profiles:
        return None
    return max(p.instance_count for p in gpu.partition_profiles)


def _gpu_attributes(gpu: GpuInfo, inventory: Inventory) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "index": {"int": gpu.index},
        "uuid": {"string": gpu.uuid},
        "model": {"string": gpu.model or gpu.product_name},
    }
    driver_version = normalize_version(inventory.driver_version)
    if driver_version:
        attrs["driverVersion"] = {"version": driver_version}
    if gpu.reference_example:
        return attrs
    attrs["productName"] = {"string": gpu.product_name}
    if gpu.brand:
        attrs["brand"] = {"string": gpu.brand}
    if gpu.architecture:
        attrs["architecture"] = {"string": gpu.architecture}
    for name, version in (
        ("cudaComputeCapability", gpu.cuda_compute_capability),
        ("cudaDriverVersion", inventory.cuda_driver_version),
    ):
        if normalized := normalize_version(version):
            attrs[name] = {"version": normalized}
    attrs["migCapable"] = {"bool": gpu.mig_capable}
    max_partitions = gpu_max_partitions(gpu)
    if max_partitions is not None:
        attrs["maxPartitions"] = {"int": max_partitions}
    attrs[PCI_BUS_ID_ATTRIBUTE] = {"string": gpu.pci_bus_id}
    return attrs


def strict_mps_capable(gpu: GpuInfo) -> bool:
    """Volta or later (CUDA compute capability 7.0 and up; unknown: not), MIG mode off
    (NVML sets a compute mode there per MIG device)."""
    major = (gpu.cuda_compute_capability or "").split(".")[0]
    return not gpu.mig_enabled and major.isdigit() and int(major) >= STRICT_MPS_MIN_CC_MAJOR


def _mps_attr(options: PoolOptions, gpu: GpuInfo, *, whole: bool) -> dict[str, Any]:
    """`mpsIsolation` where the node runs MPS (see MPS_ISOLATION_ATTRIBUTE): `strict`
    on a `whole` GPU (or, with `mps_strict_partitions`, a partition) not shared by
    capacity, on Volta or later; `cooperative` on the others."""
    if not options.mps:
        return {}
    one_server = whole or options.mps_strict_partitions
    strict = one_server and not options.allow_multiple_allocations and strict_mps_capable(gpu)
    value = MPS_ISOLATION_STRICT if strict else MPS_ISOLATION_COOPERATIVE
    return {MPS_ISOLATION_ATTRIBUTE: {"string": value}}


def _capacity(gpu: GpuInfo, split: int = 1) -> dict[str, Any]:
    """The GPU's `memory` (if known) and `compute`, each divided by `split`."""
    capacity: dict[str, Any] = {}
    if gpu.memory_bytes is not None:
        capacity["memory"] = {"value": binary_quantity(gpu.memory_bytes // split)}
    compute = DEFAULT_COMPUTE if gpu.compute is None else gpu.compute
    capacity["compute"] = {"value": decimal_quantity(compute // split)}
    return capacity


def _published(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], options: PoolOptions, name: str, extra: dict[str, Any]
) -> PublishedDevice:
    """A device of a GPU with MIG off: the whole GPU `gpu-<i>`, or with `gpu_partitions`
    N a partition (attribute `partition` in `extra`: 1/N of the GPU) or `gpu-<i>-full`,
    which consume the GPU's counter set. Where the pool allows it, shared by capacity
    (DRAConsumableCapacity): request policies on `memory` (min 1Gi, step 1Gi) and
    `compute` (min 1, step 1), max and default the device's own capacity, so a claim
    that asks for none gets the whole device; `share_capacity`: what all shares
    together may consume."""
    partition = "partition" in extra
    split = options.gpu_partitions if partition else 1
    attrs = {**gpu_attrs, **_mps_attr(options, gpu, whole=not partition), **extra}
    doc: dict[str, Any] = {"name": name, "attributes": attrs, "capacity": _capacity(gpu, split)}
    if options.gpu_partitions:
        consumed = {"counterSet": f"gpu-{gpu.minor}-counters", "counters": _capacity(gpu, split)}
        doc["consumesCounters"] = [consumed]
    share: dict[str, int] | None = None
    if options.allow_multiple_allocations:
        doc["allowMultipleAllocations"] = True
        share = {}
        for cap, step, fmt in (
            ("memory", SHARE_MEMORY_STEP, binary_quantity),
            ("compute", SHARE_COMPUTE_STEP, decimal_quantity),
        ):
            if cap not in doc["capacity"]:
                continue
            value = share[cap] = quantity_int(doc["capacity"][cap]["value"])
            top = value - value % step  # the range's max and default must be on a step
            if top >= step:
                valid_range = {"min": fmt(step), "step": fmt(step), "max": fmt(top)}
                policy = {"default": fmt(top), "validRange": valid_range}
                doc["capacity"][cap] = {**doc["capacity"][cap], "requestPolicy": policy}
    elif gpu.reference_example:
        doc["allowMultipleAllocations"] = False
    return PublishedDevice(
        name,
        doc,
        gpu.uuid,
        gpu.minor,
        is_partition=partition,
        max_partitions=None if partition else gpu_max_partitions(gpu),
        share_capacity=share,
    )


# --------------------------------------------------------------------------- MIG


def foreign_instances(gpu: GpuInfo, owned: Set[tuple[str, int]]) -> list[str]:
    """The GPU's MIG instances this driver did not create, described for messages by
    the profile names nvidia-smi shows ("1g.10gb at 3+1": memory slices start+size)."""
    names = {p.profile_id: p.name for p in gpu.partition_profiles}
    return [
        f"GPU instance {i.gi_id} ({names.get(i.profile_id, f'profile {i.profile_id}')} "
        f"at {i.placement[0]}+{i.placement[1]})"
        for i in gpu.mig_instances
        if (gpu.uuid, i.gi_id) not in owned
    ]


def _mig_gpu(
    gpu: GpuInfo, attrs: dict[str, Any], options: PoolOptions, owned: Set[tuple[str, int]]
) -> tuple[list[PublishedDevice], str, list[str]]:
    foreign = foreign_instances(gpu, owned)
    strategy = options.mig_strategy
    if strategy is MigStrategy.DYNAMIC and foreign:
        raise PoolError(
            f"--mig-strategy=dynamic: GPU {gpu.minor} ({gpu.uuid}) has MIG devices this "
            f"driver did not create: {', '.join(foreign)}. Destroy them (nvidia-smi mig "
            "-dci and -dgi) or use --mig-strategy=auto, which publishes exactly them"
        )
    if strategy is MigStrategy.STATIC or (strategy is MigStrategy.AUTO and foreign):
        devices, skipped = mig_devices.static_partitions(gpu, attrs, owned)
        notes = [f"GPU {gpu.minor} ({gpu.uuid}): {why}; not published" for why in skipped]
        if not devices:
            notes.append(
                f"GPU {gpu.minor} ({gpu.uuid}) is in MIG mode without usable MIG devices "
                "and --mig-strategy=static: nothing of it is published"
            )
        return devices, "static", notes
    labels = {profile_label(p.name) for p in gpu.partition_profiles}
    unknown = [label for label in options.mig_profiles if label not in labels]
    if unknown:
        offered = ", ".join(p.name for p in gpu.partition_profiles)
        raise PoolError(
            f"--mig-profiles: GPU {gpu.minor} ({gpu.product_name}, {gpu.uuid}) has no MIG "
            f"profile {', '.join(unknown)}; its profiles: {offered}"
        )
    whole = mig_devices.whole_gpu(gpu, attrs, _capacity(gpu), gpu_max_partitions(gpu))
    partitions = mig_devices.dynamic_partitions(gpu, attrs, options.mig_profiles)
    return ([whole] if whole is not None else []) + partitions, "dynamic", []


# --------------------------------------------------------------------------- pool


def build_pool(
    inventory: Inventory,
    options: PoolOptions | None = None,
    *,
    owned_mig: Set[tuple[str, int]] = frozenset(),
) -> PoolDevices:
    """Every device and counter set this node publishes, in publishing order.

    `owned_mig`: (GPU UUID, GPU-instance id) of the MIG devices this driver created
    for prepared claims; every other existing MIG device is foreign. Raises
    PoolError for a combination that cannot be published.
    """
    options = options or PoolOptions()
    devices: list[PublishedDevice] = []
    counter_sets: list[dict[str, Any]] = []
    modes: dict[str, str] = {}
    notes: list[str] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        attrs = _gpu_attributes(gpu, inventory)
        if options.gpu_partitions > 0:
            if gpu.mig_enabled and inventory.backend == "nvml":
                raise PoolError(
                    f"--gpu-partitions={options.gpu_partitions}: GPU {gpu.minor} ({gpu.uuid}) "
                    "is in MIG mode, where CUDA needs a MIG device; use MIG partitions "
                    "(--gpu-partitions=0) on MIG GPUs"
                )
            # `isolated: false`: time-shared on the whole GPU, no memory or fault isolation
            # from its other partitions (MIG partitions publish `isolated: true`).
            for j in range(options.gpu_partitions):
                name = f"gpu-{gpu.minor}-partition-{j}"
                extra = {
                    "partition": {"int": j},
                    "partitionable": {"bool": True},
                    "isolated": {"bool": False},
                }
                devices.append(_published(gpu, attrs, options, name, extra))
            full = {"partitionable": {"bool": True}, "full": {"bool": True}}
            devices.append(_published(gpu, attrs, options, f"gpu-{gpu.minor}-full", full))
            counter_sets.append({"name": f"gpu-{gpu.minor}-counters", "counters": _capacity(gpu)})
        elif gpu.mig_enabled and gpu.partition_profiles:
            devs, mode, why = _mig_gpu(gpu, attrs, options, owned_mig)
            devs, gpu_counters = mig_counters.counted(gpu, devs)
            devices += devs
            counter_sets.append(gpu_counters)
            modes[gpu.uuid] = mode
            notes += why
        else:
            devices.append(_published(gpu, attrs, options, f"gpu-{gpu.minor}", {}))
    return PoolDevices(
        devices=tuple(devices),
        counter_sets=tuple(counter_sets),
        options=options,
        mig_modes=modes,
        notes=tuple(notes),
    )
