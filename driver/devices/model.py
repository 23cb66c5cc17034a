"""Inventory -> the devices and counter sets of one node's pool (pure).

Device documents are resource.k8s.io/v1 `Device` dicts (bare attribute keys live in
the driver's domain). Two partition modes share one code path:

- MIG (default for GPUs in MIG mode): per GPU one counter set
  `gpu-<minor>-counter-set` (memory, multiprocessors, engine counters and one
  `memory-slice-<i>` counter per memory slice). The whole GPU `gpu-<minor>` consumes
  all of it; every (profile, placement) NVML reports is a device
  `gpu-<minor>-mig-<profile label>-<placement start>` consuming its profile's share and
  its memory slices, so the scheduler never hands out overlapping partitions, or a GPU
  together with one of its partitions.
- `gpu_partitions=N` (the Go reference's --gpu-partitions): per GPU a counter set
  `gpu-<i>-counters` {memory, compute}, N devices `gpu-<i>-partition-<j>` of equal size
  and `gpu-<i>-full`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from driver.nvml.types import GpuInfo, Inventory, PartitionProfile

DEFAULT_DRIVER_NAME = "gpu.example.com"
DEFAULT_COMPUTE = 100  # the reference's `compute` capacity of a whole GPU
PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"

# Capacity name (C identifier) -> counter name (DNS label) -> PartitionProfile field.
MIG_DIMENSIONS: tuple[tuple[str, str, str], ...] = (
    ("memory", "memory", "memory_bytes"),
    ("multiprocessors", "multiprocessors", "multiprocessors"),
    ("copyEngines", "copy-engines", "copy_engines"),
    ("decoders", "decoders", "decoders"),
    ("encoders", "encoders", "encoders"),
    ("jpegEngines", "jpeg-engines", "jpeg_engines"),
    ("ofaEngines", "ofa-engines", "ofa_engines"),
)

_BINARY_SUFFIXES = (("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10))


@dataclass(frozen=True)
class PoolOptions:
    driver_name: str = DEFAULT_DRIVER_NAME
    # > 0: the reference's N equal partitions per GPU (replaces MIG partitions).
    gpu_partitions: int = 0
    # Publish MIG partitions for GPUs in MIG mode (when gpu_partitions is 0).
    mig: bool = True

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

    @property
    def uses_counters(self) -> bool:
        return bool(self.document.get("consumesCounters"))


@dataclass(frozen=True)
class PoolDevices:
    devices: tuple[PublishedDevice, ...]
    counter_sets: tuple[dict[str, Any], ...] = ()  # resource.k8s.io/v1 CounterSet dicts
    options: PoolOptions = field(default_factory=PoolOptions)

    def device(self, name: str) -> PublishedDevice:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def devices_of_gpu(self, gpu_uuid: str) -> tuple[PublishedDevice, ...]:
        """Every device backed by a physical GPU: the GPU itself and its partitions."""
        return tuple(d for d in self.devices if d.gpu_uuid == gpu_uuid)


# --------------------------------------------------------------------------- helpers


def binary_quantity(value: int) -> str:
    """Canonical Kubernetes BinarySI quantity: 85899345920 -> "80Gi", 1536 -> "1536"."""
    if value < 0:
        raise ValueError(f"negative quantity {value}")
    for suffix, shift in _BINARY_SUFFIXES:
        if value and value % (1 << shift) == 0:
            return f"{value >> shift}{suffix}"
    return str(value)


def decimal_quantity(value: int) -> str:
    return str(value)


def normalize_version(version: str | None) -> str | None:
    """A strict semver string: "580.95.05" -> "580.95.5", "9.0" -> "9.0.0"; None if unusable."""
    if version is None:
        return None
    match = re.match(r"^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        return None
    parts = [int(p) if p is not None else 0 for p in match.groups()]
    return f"{parts[0]}.{parts[1]}.{parts[2]}"


def profile_label(profile: str) -> str:
    """A MIG profile name as a DNS-label fragment: "1g.10gb+me" -> "1g10gb-me"."""
    label = profile.lower().replace(".", "")
    label = re.sub(r"[^a-z0-9]+", "-", label).strip("-")
    return label or "profile"


def _string(v: str) -> dict[str, Any]:
    return {"string": v}


def _int(v: int) -> dict[str, Any]:
    return {"int": v}


def _bool(v: bool) -> dict[str, Any]:
    return {"bool": v}


def _version(v: str) -> dict[str, Any]:
    return {"version": v}


def _value(v: str) -> dict[str, Any]:
    return {"value": v}


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
            "index": _int(gpu.index),
            "uuid": _string(gpu.uuid),
            "model": _string(model),
        }
        if driver_version:
            attrs["driverVersion"] = _version(driver_version)
        return attrs
    attrs = {
        "index": _int(gpu.index),
        "uuid": _string(gpu.uuid),
        "model": _string(model),
    }
    if driver_version:
        attrs["driverVersion"] = _version(driver_version)
    attrs["productName"] = _string(gpu.product_name)
    if gpu.brand:
        attrs["brand"] = _string(gpu.brand)
    if gpu.architecture:
        attrs["architecture"] = _string(gpu.architecture)
    cc = normalize_version(gpu.cuda_compute_capability)
    if cc:
        attrs["cudaComputeCapability"] = _version(cc)
    cuda = normalize_version(inventory.cuda_driver_version)
    if cuda:
        attrs["cudaDriverVersion"] = _version(cuda)
    attrs["migCapable"] = _bool(gpu.mig_capable)
    max_partitions = gpu_max_partitions(gpu)
    if max_partitions is not None:
        attrs["maxPartitions"] = _int(max_partitions)
    attrs[PCI_BUS_ID_ATTRIBUTE] = _string(gpu.pci_bus_id)
    return attrs


def _compute(gpu: GpuInfo) -> int:
    return gpu.compute if gpu.compute is not None else DEFAULT_COMPUTE


def _base_capacity(gpu: GpuInfo) -> dict[str, Any]:
    capacity: dict[str, Any] = {}
    if gpu.memory_bytes is not None:
        capacity["memory"] = _value(binary_quantity(gpu.memory_bytes))
    capacity["compute"] = _value(decimal_quantity(_compute(gpu)))
    return capacity


def _device(name: str, attributes: dict[str, Any], capacity: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": name, "attributes": attributes}
    if capacity:
        doc["capacity"] = capacity
    return doc


# --------------------------------------------------------------------------- MIG


def _mig_counter_values(gpu: GpuInfo) -> dict[str, int]:
    """Counter capacities of a GPU's set: per-dimension max over profiles + memory slices."""
    values: dict[str, int] = {}
    for _, counter, attr in MIG_DIMENSIONS:
        values[counter] = max(getattr(p, attr) for p in gpu.partition_profiles)
    for i in range(gpu.memory_slices):
        values[f"memory-slice-{i}"] = 1
    return values


def _counter_quantity(counter: str, value: int) -> str:
    return binary_quantity(value) if counter == "memory" else decimal_quantity(value)


def _counters(values: dict[str, int], *, skip_zero: bool) -> dict[str, Any]:
    return {
        name: _value(_counter_quantity(name, v)) for name, v in values.items() if v or not skip_zero
    }


def _mig_devices(
    gpu: GpuInfo, inventory: Inventory, gpu_attrs: dict[str, Any]
) -> tuple[list[PublishedDevice], dict[str, Any]]:
    set_name = f"gpu-{gpu.minor}-counter-set"
    set_values = _mig_counter_values(gpu)
    counter_set = {"name": set_name, "counters": _counters(set_values, skip_zero=False)}

    capacity = _base_capacity(gpu)
    for cap, counter, _ in MIG_DIMENSIONS[1:]:
        capacity[cap] = _value(decimal_quantity(set_values[counter]))
    whole = _device(f"gpu-{gpu.minor}", gpu_attrs, capacity)
    whole["consumesCounters"] = [
        {"counterSet": set_name, "counters": _counters(set_values, skip_zero=True)}
    ]
    devices = [
        PublishedDevice(
            name=whole["name"],
            document=whole,
            gpu_uuid=gpu.uuid,
            gpu_minor=gpu.minor,
            is_partition=False,
            max_partitions=gpu_max_partitions(gpu),
        )
    ]

    parent_attrs = {
        k: v
        for k, v in gpu_attrs.items()
        if k
        in (
            "model",
            "driverVersion",
            "productName",
            "brand",
            "architecture",
            "cudaComputeCapability",
            "cudaDriverVersion",
            PCI_BUS_ID_ATTRIBUTE,
        )
    }

    def order(item: tuple[PartitionProfile, tuple[int, int]]) -> tuple[int, int, str, int]:
        p, (start, size) = item
        return (size, p.memory_bytes, p.name, start)

    items = [(p, pl) for p in gpu.partition_profiles for pl in p.placements]
    for profile, (start, size) in sorted(items, key=order):
        name = f"gpu-{gpu.minor}-mig-{profile_label(profile.name)}-{start}"
        attrs = {
            "profile": _string(profile.name),
            "parentUUID": _string(gpu.uuid),
            "parentIndex": _int(gpu.index),
            "placementStart": _int(start),
            "placementSize": _int(size),
            **parent_attrs,
        }
        values = {counter: getattr(profile, attr) for _, counter, attr in MIG_DIMENSIONS}
        part_capacity = {
            c: _value(_counter_quantity(counter, values[counter]))
            for c, counter, _ in MIG_DIMENSIONS
        }
        for i in range(start, start + size):
            values[f"memory-slice-{i}"] = 1
        doc = _device(name, attrs, part_capacity)
        doc["consumesCounters"] = [
            {"counterSet": set_name, "counters": _counters(values, skip_zero=True)}
        ]
        devices.append(
            PublishedDevice(
                name=name,
                document=doc,
                gpu_uuid=gpu.uuid,
                gpu_minor=gpu.minor,
                is_partition=True,
                max_partitions=None,
                profile=profile.name,
                placement=(start, size),
            )
        )
    return devices, counter_set


# --------------------------------------------------------------------------- reference partitions


def _reference_partitions(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], n: int
) -> tuple[list[PublishedDevice], dict[str, Any]]:
    set_name = f"gpu-{gpu.minor}-counters"
    whole: dict[str, str] = {}
    part: dict[str, str] = {}
    if gpu.memory_bytes is not None:
        whole["memory"] = binary_quantity(gpu.memory_bytes)
        part["memory"] = binary_quantity(gpu.memory_bytes // n)
    whole["compute"] = decimal_quantity(_compute(gpu))
    part["compute"] = decimal_quantity(_compute(gpu) // n)
    counter_set = {"name": set_name, "counters": {k: _value(v) for k, v in whole.items()}}

    devices: list[PublishedDevice] = []
    for j in range(n):
        name = f"gpu-{gpu.minor}-partition-{j}"
        attrs = {**gpu_attrs, "partition": _int(j), "partitionable": _bool(True)}
        doc = _device(name, attrs, {k: _value(v) for k, v in part.items()})
        doc["consumesCounters"] = [
            {"counterSet": set_name, "counters": {k: _value(v) for k, v in part.items()}}
        ]
        if gpu.reference_example:
            doc["allowMultipleAllocations"] = False
        devices.append(PublishedDevice(name, doc, gpu.uuid, gpu.minor, True, None, placement=None))
    name = f"gpu-{gpu.minor}-full"
    attrs = {**gpu_attrs, "partitionable": _bool(True), "full": _bool(True)}
    doc = _device(name, attrs, {k: _value(v) for k, v in whole.items()})
    doc["consumesCounters"] = [
        {"counterSet": set_name, "counters": {k: _value(v) for k, v in whole.items()}}
    ]
    if gpu.reference_example:
        doc["allowMultipleAllocations"] = False
    devices.append(PublishedDevice(name, doc, gpu.uuid, gpu.minor, False, gpu_max_partitions(gpu)))
    return devices, counter_set


# --------------------------------------------------------------------------- pool


def build_pool(inventory: Inventory, options: PoolOptions | None = None) -> PoolDevices:
    """Every device and counter set this node publishes, in publishing order."""
    options = options or PoolOptions()
    devices: list[PublishedDevice] = []
    counter_sets: list[dict[str, Any]] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        attrs = _gpu_attributes(gpu, inventory)
        if options.gpu_partitions > 0:
            devs, cs = _reference_partitions(gpu, attrs, options.gpu_partitions)
            devices += devs
            counter_sets.append(cs)
        elif options.mig and gpu.mig_enabled and gpu.partition_profiles:
            devs, cs = _mig_devices(gpu, inventory, attrs)
            devices += devs
            counter_sets.append(cs)
        else:
            doc = _device(f"gpu-{gpu.minor}", attrs, _base_capacity(gpu))
            if gpu.reference_example:
                doc["allowMultipleAllocations"] = False
            devices.append(
                PublishedDevice(
                    name=doc["name"],
                    document=doc,
                    gpu_uuid=gpu.uuid,
                    gpu_minor=gpu.minor,
                    is_partition=False,
                    max_partitions=gpu_max_partitions(gpu),
                )
            )
    return PoolDevices(devices=tuple(devices), counter_sets=tuple(counter_sets), options=options)
