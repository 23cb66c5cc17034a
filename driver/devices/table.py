"""A human-readable table of a node's devices for `gpu-dra inventory -o table`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from driver.devices.model import PoolDevices, PublishedDevice

HEADERS = ("DEVICE", "MODEL", "MEMORY", "PARTITIONS", "SHARING", "HEALTH")


def _attr(device: PublishedDevice, key: str) -> str:
    value = device.document.get("attributes", {}).get(key)
    if not value:
        return ""
    return str(next(iter(value.values())))


def _health(taints: Sequence[Mapping[str, Any]]) -> str:
    if not taints:
        return "Healthy"
    parts = []
    for t in taints:
        value = f"={t['value']}" if t.get("value") else ""
        parts.append(f"{t.get('key')}{value}:{t.get('effect')}")
    return "Unhealthy (" + ", ".join(parts) + ")"


def _sharing(device: PublishedDevice) -> str:
    """`exclusive`, or the capacities a share consumes with their request step."""
    if device.document.get("allowMultipleAllocations") is not True:
        return "exclusive"
    parts = []
    for name, entry in sorted(device.document.get("capacity", {}).items()):
        step = ((entry.get("requestPolicy") or {}).get("validRange") or {}).get("step")
        if entry.get("requestPolicy"):
            parts.append(f"{name}" + (f" step {step}" if step else ""))
    return "shares: " + ", ".join(parts) if parts else "shares"


def device_rows(
    pool: PoolDevices,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    *,
    partitions: bool = False,
) -> list[tuple[str, str, str, str, str, str]]:
    """One row per GPU (and per partition when `partitions`)."""
    taints = taints or {}
    rows = []
    for device in pool.devices:
        if device.is_partition and not partitions:
            continue
        memory = device.document.get("capacity", {}).get("memory", {}).get("value", "-")
        if device.is_partition:
            detail = device.profile or "partition"
            if device.placement is not None:
                detail += f" @{device.placement[0]}+{device.placement[1]}"
        else:
            count = sum(1 for d in pool.devices_of_gpu(device.gpu_uuid) if d.is_partition)
            detail = str(count)
            if _attr(device, "migProfile"):  # delivered as its full-size MIG device
                detail += f" (whole: {_attr(device, 'migProfile')})"
        model = _attr(device, "model") or _attr(device, "productName")
        health = _health(taints.get(device.name, ()))
        rows.append((device.name, model, memory, detail, _sharing(device), health))
    return rows
