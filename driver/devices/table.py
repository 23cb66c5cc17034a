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
  limits per process (cooperative)` where an MPS daemon holds a share's or a
  partition's limits, `MPS strict (EXCLUSIVE_PROCESS)` on a whole GPU whose one MPS
  daemon holds it in that compute mode (attribute `mpsIsolation`; `mps_note` says
  what they do not hold; docs/mps.md).
- HEALTH: the health callback's text (taints as the plugin publishes them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from driver.devices.formatting import binary_quantity, taint_text
from driver.devices.gpu_view import GpuView, gpu_views
from driver.devices.model import (
    MPS_ISOLATION_ATTRIBUTE,
    MPS_ISOLATION_COOPERATIVE,
    MPS_ISOLATION_STRICT,
    PoolDevices,
    PublishedDevice,
)
from driver.nvml.discovered import Inventory

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
MPS_SHARING = f"MPS limits per process ({MPS_ISOLATION_COOPERATIVE})"
MPS_STRICT_SHARING = f"MPS {MPS_ISOLATION_STRICT} (EXCLUSIVE_PROCESS)"
# Under the table where a device carries `mpsIsolation` (docs/mps.md, "What holds and
# what does not").
MPS_NOTE = f"""\
MPS limits ({MPS_ISOLATION_ATTRIBUTE}: {MPS_ISOLATION_COOPERATIVE}; docs/mps.md):
  per CUDA process, not per claim: every process of a claim may pin the whole memory \
limit and use the whole SM percentage
  cooperative: a process that points CUDA_MPS_PIPE_DIRECTORY elsewhere runs outside MPS, \
unlimited
  faults: a fatal fault in one process can end the other processes of the same claim \
(one MPS server per claim)
  time: the MPS servers of different claims on one GPU are time-sliced against each other
  clients: at most 48 client processes per server (Volta and later)
  memory: each server's own CUDA context is outside every limit: shares that add up to \
the published memory overcommit the GPU
"""
# Under the table where a device carries `mpsIsolation: strict`.
MPS_STRICT_NOTE = f"""\
MPS {MPS_ISOLATION_STRICT} ({MPS_ISOLATION_ATTRIBUTE}: {MPS_ISOLATION_STRICT}; docs/mps.md):
  a whole GPU prepared with an MPS daemon is set to compute mode EXCLUSIVE_PROCESS: its \
one MPS server holds the GPU's only CUDA context, a process outside MPS fails to open one
  still per CUDA process, not per claim; one server's processes share its faults
  strict partitions (--mps-strict-partitions): every claim on the GPU is a client of \
its one multi-user server, sharing its faults, its 48 clients and its /dev/shm
  before the first MPS client starts the server, a process outside MPS can take the \
GPU's one context (the MPS clients then fail)
"""


HealthText = Callable[[PublishedDevice | GpuView], str]
"""The HEALTH cell of a device, or of a GPU of which nothing is published."""


def health_of_taints(taints: Sequence[Mapping[str, Any]]) -> str:
    """`Healthy`, or `Unhealthy (<key>=<value>:<effect>, ...)`."""
    if not taints:
        return "Healthy"
    return "Unhealthy (" + ", ".join(taint_text(t) for t in taints) + ")"


def _attr(device: PublishedDevice, key: str) -> str:
    value = device.document.get("attributes", {}).get(key)
    return str(next(iter(value.values()))) if value else ""


def mps_note(devices: Sequence[PublishedDevice]) -> str:
    """What the MPS limits of the devices hold and do not (`MPS_NOTE` where a device
    is cooperative, `MPS_STRICT_NOTE` where one is strict), else nothing."""
    kinds = {_attr(d, MPS_ISOLATION_ATTRIBUTE) for d in devices}
    note = MPS_NOTE if MPS_ISOLATION_COOPERATIVE in kinds else ""
    return note + (MPS_STRICT_NOTE if MPS_ISOLATION_STRICT in kinds else "")


def _sharing(device: PublishedDevice) -> str:
    """The SHARING cell: `exclusive`, or the capacities a share consumes with their
    request step; then the device's MPS isolation (module docstring)."""
    isolation = _attr(device, MPS_ISOLATION_ATTRIBUTE)
    if isolation == MPS_ISOLATION_STRICT:
        return f"exclusive, {MPS_STRICT_SHARING}"
    limited = f", {MPS_SHARING}" if isolation else ""
    if device.document.get("allowMultipleAllocations") is not True:
        return "exclusive" + (limited if device.is_partition else "")
    parts = []
    for name, entry in sorted(device.document.get("capacity", {}).items()):
        if policy := entry.get("requestPolicy"):
            step = (policy.get("validRange") or {}).get("step")
            parts.append(name + (f" step {step}" if step else ""))
    return ("shares: " + ", ".join(parts) if parts else "shares") + limited


def _row(
    gpu: GpuView, device: PublishedDevice | None, partitions: str, health: HealthText
) -> tuple[str, ...]:
    """A GPU's row (`partitions`: how many of its partitions are published; `device`
    None where none of it is), or a partition's (`partitions` `-`)."""
    name, uuid, profile, placement, sharing = NONE, NONE, NONE, NONE, NONE
    if device is None:
        uuid = gpu.uuid
        memory = binary_quantity(gpu.memory_bytes) if gpu.memory_bytes is not None else NONE
    else:
        name, sharing = device.name, _sharing(device)
        memory = str(device.document.get("capacity", {}).get("memory", {}).get("value", NONE))
        if device.mig is not None:
            existing = device.mig.existing
            uuid = existing.uuid if existing is not None and existing.uuid else NONE
            profile = device.profile or _attr(device, "migProfile") or NONE
            start, size = device.mig.placement
            placement = f"{start}+{size}"
        if not device.is_partition:
            uuid = gpu.uuid
    return (
        name,
        str(gpu.index),
        gpu.pci_bus_id,
        uuid,
        gpu.model,
        memory,
        gpu.mig_mode.value,
        profile,
        placement,
        partitions,
        sharing,
        health(gpu if device is None else device),
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
        rows.append(_row(gpu, whole, str(len(parts)), health))
        if partitions:
            rows += [_row(gpu, device, NONE, health) for device in parts]
    return rows
