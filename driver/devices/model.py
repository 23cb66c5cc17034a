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
from driver.devices.device_types import (
    DEFAULT_DRIVER_NAME,
    MigStrategy,
    PoolOptions,
    PublishedDevice,
)
from driver.devices.formatting import (
    binary_quantity,
    bool_attr,
    decimal_quantity,
    device_doc,
    int_attr,
    normalize_version,
    quantity,
    quantity_int,
    string_attr,
    version_attr,
)
from driver.nvml.discovered import GpuInfo, Inventory

__all__ = [
    "DEFAULT_DRIVER_NAME",
    "MigStrategy",
    "PoolDevices",
    "PoolError",
    "PoolOptions",
    "PublishedDevice",
    "build_pool",
]

DEFAULT_COMPUTE = 100  # the reference's `compute` capacity of a whole GPU
GIB = 1 << 30
SHARE_MEMORY_STEP = GIB  # shares of memory: min 1Gi, step 1Gi (the reference)
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
    model = gpu.model or gpu.product_name
    driver_version = normalize_version(inventory.driver_version)
    if gpu.reference_example:
        attrs: dict[str, Any] = {
            "index": int_attr(gpu.index),
            "uuid": string_attr(gpu.uuid),
            "model": string_attr(model),
        }
        if driver_version:
            attrs["driverVersion"] = version_attr(driver_version)
        return attrs
    attrs = {
        "index": int_attr(gpu.index),
        "uuid": string_attr(gpu.uuid),
        "model": string_attr(model),
    }
    if driver_version:
        attrs["driverVersion"] = version_attr(driver_version)
    attrs["productName"] = string_attr(gpu.product_name)
    if gpu.brand:
        attrs["brand"] = string_attr(gpu.brand)
    if gpu.architecture:
        attrs["architecture"] = string_attr(gpu.architecture)
    cc = normalize_version(gpu.cuda_compute_capability)
    if cc:
        attrs["cudaComputeCapability"] = version_attr(cc)
    cuda = normalize_version(inventory.cuda_driver_version)
    if cuda:
        attrs["cudaDriverVersion"] = version_attr(cuda)
    attrs["migCapable"] = bool_attr(gpu.mig_capable)
    max_partitions = gpu_max_partitions(gpu)
    if max_partitions is not None:
        attrs["maxPartitions"] = int_attr(max_partitions)
    attrs[PCI_BUS_ID_ATTRIBUTE] = string_attr(gpu.pci_bus_id)
    return attrs


def strict_mps_capable(gpu: GpuInfo) -> bool:
    """Volta or later (CUDA compute capability 7.0 and up; unknown: not), MIG mode off
    (NVML sets a compute mode there per MIG device)."""
    major = (gpu.cuda_compute_capability or "").split(".")[0]
    return not gpu.mig_enabled and major.isdigit() and int(major) >= STRICT_MPS_MIN_CC_MAJOR


def _mps_attr(options: PoolOptions, gpu: GpuInfo, *, whole: bool) -> dict[str, Any]:
    """`mpsIsolation` on the devices of a GPU with MIG off where the node runs MPS:
    `strict` on a `whole` GPU (not a partition) that is not shared by capacity, on
    Volta or later (its one daemon holds the GPU in EXCLUSIVE_PROCESS), and on such a
    GPU's partitions with `mps_strict_partitions` (one server serves them all);
    `cooperative` on the others, whose shares, partitions and SpacePartitioning get
    MPS limits per client process, which a process that bypasses MPS escapes
    (docs/mps.md)."""
    if not options.mps:
        return {}
    one_server = whole or options.mps_strict_partitions
    strict = one_server and not options.allow_multiple_allocations and strict_mps_capable(gpu)
    value = MPS_ISOLATION_STRICT if strict else MPS_ISOLATION_COOPERATIVE
    return {MPS_ISOLATION_ATTRIBUTE: string_attr(value)}


def _compute(gpu: GpuInfo) -> int:
    return gpu.compute if gpu.compute is not None else DEFAULT_COMPUTE


def _base_capacity(gpu: GpuInfo) -> dict[str, Any]:
    capacity: dict[str, Any] = {}
    if gpu.memory_bytes is not None:
        capacity["memory"] = quantity(binary_quantity(gpu.memory_bytes))
    capacity["compute"] = quantity(decimal_quantity(_compute(gpu)))
    return capacity


def _policy(value: int, step: int, fmt: Any) -> dict[str, Any] | None:
    top = value - value % step  # the range's max and default must be on a step
    if top < step:
        return None
    return {
        "default": fmt(top),
        "validRange": {"min": fmt(step), "step": fmt(step), "max": fmt(top)},
    }


def make_shareable(doc: dict[str, Any]) -> dict[str, int]:
    """Mark a device document multi-allocatable (DRAConsumableCapacity): request
    policies on `memory` (min 1Gi, step 1Gi) and `compute` (min 1, step 1), max and
    default the device's own capacity, so a claim that asks for no capacity gets the
    whole device. Returns what all shares together may consume (name -> amount)."""
    doc["allowMultipleAllocations"] = True
    limits: dict[str, int] = {}
    capacity = doc.get("capacity") or {}
    for name, step, fmt in (
        ("memory", SHARE_MEMORY_STEP, binary_quantity),
        ("compute", SHARE_COMPUTE_STEP, decimal_quantity),
    ):
        if name not in capacity:
            continue
        value = quantity_int(capacity[name]["value"])
        policy = _policy(value, step, fmt)
        if policy is not None:
            capacity[name] = {**capacity[name], "requestPolicy": policy}
        limits[name] = value
    return limits


# --------------------------------------------------------------------------- reference partitions


def _reference_partitions(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], n: int, options: PoolOptions
) -> tuple[list[PublishedDevice], dict[str, Any]]:
    set_name = f"gpu-{gpu.minor}-counters"
    whole: dict[str, str] = {}
    part: dict[str, str] = {}
    if gpu.memory_bytes is not None:
        whole["memory"] = binary_quantity(gpu.memory_bytes)
        part["memory"] = binary_quantity(gpu.memory_bytes // n)
    whole["compute"] = decimal_quantity(_compute(gpu))
    part["compute"] = decimal_quantity(_compute(gpu) // n)
    counter_set = {"name": set_name, "counters": {k: quantity(v) for k, v in whole.items()}}

    def counted(
        name: str, extra: dict[str, Any], amounts: dict[str, str]
    ) -> tuple[dict[str, Any], dict[str, int] | None]:
        """A partition's or the full GPU's document: capacity `amounts`, consumed from
        the GPU's counter set, shareable if the pool allows it; and the share's limits."""
        whole = "partition" not in extra  # gpu-<i>-full
        attrs = {**gpu_attrs, **_mps_attr(options, gpu, whole=whole), **extra}
        doc = device_doc(name, attrs, {k: quantity(v) for k, v in amounts.items()})
        doc["consumesCounters"] = [
            {"counterSet": set_name, "counters": {k: quantity(v) for k, v in amounts.items()}}
        ]
        share = make_shareable(doc) if options.allow_multiple_allocations else None
        if gpu.reference_example and share is None:
            doc["allowMultipleAllocations"] = False
        return doc, share

    devices: list[PublishedDevice] = []
    for j in range(n):
        name = f"gpu-{gpu.minor}-partition-{j}"
        # `isolated: false`: time-shared on the whole GPU, no memory or fault isolation
        # from its other partitions (MIG partitions publish `isolated: true`).
        extra = {
            "partition": int_attr(j),
            "partitionable": bool_attr(True),
            "isolated": bool_attr(False),
        }
        doc, share = counted(name, extra, part)
        devices.append(
            PublishedDevice(
                name, doc, gpu.uuid, gpu.minor, True, None, placement=None, share_capacity=share
            )
        )
    name = f"gpu-{gpu.minor}-full"
    doc, share = counted(name, {"partitionable": bool_attr(True), "full": bool_attr(True)}, whole)
    devices.append(
        PublishedDevice(
            name, doc, gpu.uuid, gpu.minor, False, gpu_max_partitions(gpu), share_capacity=share
        )
    )
    return devices, counter_set


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
    unknown = mig_devices.unselected_profiles(gpu, options.mig_profiles)
    if unknown:
        offered = ", ".join(p.name for p in gpu.partition_profiles)
        raise PoolError(
            f"--mig-profiles: GPU {gpu.minor} ({gpu.product_name}, {gpu.uuid}) has no MIG "
            f"profile {', '.join(unknown)}; its profiles: {offered}"
        )
    whole = mig_devices.whole_gpu(gpu, attrs, _base_capacity(gpu), gpu_max_partitions(gpu))
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
            devs, cs = _reference_partitions(gpu, attrs, options.gpu_partitions, options)
            devices += devs
            counter_sets.append(cs)
        elif gpu.mig_enabled and gpu.partition_profiles:
            devs, mode, why = _mig_gpu(gpu, attrs, options, owned_mig)
            devs, gpu_counters = mig_counters.counted(gpu, devs)
            devices += devs
            counter_sets.append(gpu_counters)
            modes[gpu.uuid] = mode
            notes += why
        else:
            doc = device_doc(
                f"gpu-{gpu.minor}",
                {**attrs, **_mps_attr(options, gpu, whole=True)},
                _base_capacity(gpu),
            )
            share = make_shareable(doc) if options.allow_multiple_allocations else None
            if gpu.reference_example and share is None:
                doc["allowMultipleAllocations"] = False
            devices.append(
                PublishedDevice(
                    name=doc["name"],
                    document=doc,
                    gpu_uuid=gpu.uuid,
                    gpu_minor=gpu.minor,
                    is_partition=False,
                    max_partitions=gpu_max_partitions(gpu),
                    share_capacity=share,
                )
            )
    return PoolDevices(
        devices=tuple(devices),
        counter_sets=tuple(counter_sets),
        options=options,
        mig_modes=modes,
        notes=tuple(notes),
    )
