"""A human-readable table of a node's devices for `gpu-dra inventory -o table`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from driver.devices.model import PoolDevices, PublishedDevice

HEADERS = ("DEVICE", "MODEL", "MEMORY", "PARTITIONS", "HEALTH")


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


def device_rows(
    pool: PoolDevices,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    *,
    partitions: bool = False,
) -> list[tuple[str, str, str, str, str]]:
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
        model = _attr(device, "model") or _attr(device, "productName")
        rows.append((device.name, model, memory, detail, _health(taints.get(device.name, ()))))
    return rows


def format_table(
    pool: PoolDevices,
    taints: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    *,
    partitions: bool = False,
) -> str:
    rows = [HEADERS, *device_rows(pool, taints, partitions=partitions)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines) + "\n"
