"""A human-readable table of a node's GPUs and devices for `gpu-dra inventory -o table`.

One row per GPU, also for a GPU of which nothing is published (static MIG mode
without MIG devices), and with `partitions` one more per published partition. Each
column means one thing on every row:

- DEVICE: the published device's name; `-` when nothing of the GPU is published.
- INDEX, PCI BUS ID: NVML's index and PCI bus id of the physical GPU (a partition
  row shows its GPU's).
- UUID: what NVML names the row's device: the GPU's UUID, an existing MIG device's
  UUID; `-` for a partition whose MIG device is created at prepare (or that has
  none: `--gpu-partitions`).
- MIG: the GPU's MIG mode (`driver.devices.gpu_view.MigMode`).
- PROFILE, PLACEMENT: the MIG profile and memory slices (start+size) the device is
  delivered as; `-` for devices that are not MIG devices.
- PARTITIONS: on a GPU row, how many partitions of the GPU are published; `-` on a
  partition row.
- SHARING: `exclusive`, or the capacities that shares of the device consume; `MPS
  limits` where an MPS daemon enforces a share's or a partition's (docs/sharing.md).
- HEALTH: the health callback's text (taints as the plugin publishes them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from driver.devices.documents import binary_quantity
from driver.devices.gpu_view import GpuView, gpu_views
from driver.devices.model import PoolDevices, PublishedDevice
from driver.nvml.types import Inventory

HEADERS = (
    "DEVICE",
    "INDEX",
    "PCI BUS ID",
    "UUID",
    "MODEL",
    "MEMORY",
    "MIG",
    "PROFILE",
    "PLACEMENT",
    "PARTITIONS",
    "SHARING",
    "HEALTH",
)
NONE = "-"


HealthText = Callable[[PublishedDevice | GpuView], str]
"""The HEALTH cell of a device, or of a GPU of which nothing is published."""


def taint_text(taints: Sequence[Mapping[str, Any]]) -> str:
    """`Healthy`, or `Unhealthy (<key>=<value>:<effect>, ...)`."""
    if not taints:
        return "Healthy"
    parts = []
    for t in taints:
        value = f"={t['value']}" if t.get("value") else ""
        parts.append(f"{t.get('key')}{value}:{t.get('effect')}")
    return "Unhealthy (" + ", ".join(parts) + ")"


def _attr(device: PublishedDevice, key: str) -> str:
    value = device.document.get("attributes", {}).get(key)
    if not value:
        return ""
    return str(next(iter(value.values())))


def _sharing(device: PublishedDevice) -> str:
    """`exclusive`, or the capacities a share consumes with their request step; `, MPS
    limits` where MPS enforces what a share or partition is given (attribute `mps`)."""
    enforced = ", MPS limits" if "mps" in device.document.get("attributes", {}) else ""
    if device.document.get("allowMultipleAllocations") is not True:
        return "exclusive" + (enforced if device.is_partition else "")
    parts = []
    for name, entry in sorted(device.document.get("capacity", {}).items()):
        step = ((entry.get("requestPolicy") or {}).get("validRange") or {}).get("step")
        if entry.get("requestPolicy"):
            parts.append(f"{name}" + (f" step {step}" if step else ""))
    return ("shares: " + ", ".join(parts) if parts else "shares") + enforced


def _memory(device: PublishedDevice) -> str:
    return str(device.document.get("capacity", {}).get("memory", {}).get("value", NONE))


def _mig_columns(device: PublishedDevice) -> tuple[str, str, str]:
    """UUID of an existing MIG device, profile, placement."""
    if device.mig is None:
        return NONE, NONE, NONE
    existing = device.mig.existing
    uuid = existing.uuid if existing is not None and existing.uuid else NONE
    profile = device.profile or _attr(device, "migProfile") or NONE
    start, size = device.mig.placement
    return uuid, profile, f"{start}+{size}"


def _gpu_row(
    gpu: GpuView, whole: PublishedDevice | None, partition_count: int, health: HealthText
) -> tuple[str, ...]:
    common = (str(gpu.index), gpu.pci_bus_id, gpu.uuid, gpu.model)
    if whole is None:
        memory = binary_quantity(gpu.memory_bytes) if gpu.memory_bytes is not None else NONE
        return (
            NONE,
            *common,
            memory,
            gpu.mig_mode.value,
            NONE,
            NONE,
            str(partition_count),
            NONE,
            health(gpu),
        )
    _, profile, placement = _mig_columns(whole)
    return (
        whole.name,
        *common,
        _memory(whole),
        gpu.mig_mode.value,
        profile,
        placement,
        str(partition_count),
        _sharing(whole),
        health(whole),
    )


def _partition_row(gpu: GpuView, device: PublishedDevice, health: HealthText) -> tuple[str, ...]:
    uuid, profile, placement = _mig_columns(device)
    return (
        device.name,
        str(gpu.index),
        gpu.pci_bus_id,
        uuid,
        gpu.model,
        _memory(device),
        gpu.mig_mode.value,
        profile,
        placement,
        NONE,
        _sharing(device),
        health(device),
    )


def device_rows(
    inventory: Inventory, pool: PoolDevices, health: HealthText, *, partitions: bool = False
) -> list[tuple[str, ...]]:
    """One row per GPU, each followed by its partitions when `partitions`."""
    rows: list[tuple[str, ...]] = []
    for gpu in gpu_views(inventory, pool.mig_modes):
        devices = pool.devices_of_gpu(gpu.uuid)
        whole = next((d for d in devices if not d.is_partition), None)
        parts = [d for d in devices if d.is_partition]
        rows.append(_gpu_row(gpu, whole, len(parts), health))
        if partitions:
            rows += [_partition_row(gpu, device, health) for device in parts]
    return rows
