"""Published taints grouped by GPU: one `GpuTaints` per tainted GPU, whatever the number
of devices (the GPU and its partitions) that carry them. A GPU's partitions share its
taints (an Xid NVML attributes to one MIG GPU instance taints only that instance's
devices: then a taint is on some of the GPU's devices, and says on how many).

A device belongs to the GPU its `parentUUID` attribute names, else to its own `uuid`
(`SliceDevice.gpu_uuid`); the GPU is named by its whole-GPU device, else by UUID."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from driver.cli.published import SliceDevice
from driver.health.unmonitored import KIND_UNMONITORED


@dataclass(frozen=True)
class PublishedTaint:
    key: str
    value: str | None
    effect: str | None
    time_added: str | None  # the earliest of the devices that carry it
    devices: int  # how many of the GPU's devices carry it


@dataclass(frozen=True)
class GpuTaints:
    """One GPU's published taints."""

    gpu: str  # its whole-GPU device's name, else its UUID
    uuid: str
    devices: int  # the GPU's published devices (itself and its partitions)
    tainted_devices: int
    taints: tuple[PublishedTaint, ...]

    @property
    def since(self) -> str | None:
        times = [t.time_added for t in self.taints if t.time_added]
        return min(times) if times else None

    def unhealthy(self, driver: str) -> bool:
        """docs/health.md, "What unhealthy means": tainted by this driver for a reason of
        its own; `unmonitored` (effect None) says its health is unknown, not bad."""
        return any(t.key != f"{driver}/{KIND_UNMONITORED}" for t in self.taints)

    def to_json(self, driver: str) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "gpuUUID": self.uuid,
            "unhealthy": self.unhealthy(driver),
            "devices": self.devices,
            "taintedDevices": self.tainted_devices,
            "since": self.since,
            "taints": [
                {
                    "key": t.key,
                    "value": t.value,
                    "effect": t.effect,
                    "timeAdded": t.time_added,
                    "devices": t.devices,
                }
                for t in self.taints
            ],
        }


def taints_text(gpu: dict[str, Any]) -> str:
    """`key=value:effect` of each taint of a `GpuTaints.to_json()`, `(on k of n)` where
    not on all of the GPU's devices."""
    devices = gpu["devices"]
    texts = []
    for taint in gpu["taints"]:
        value = f"={taint['value']}" if taint["value"] is not None else ""
        effect = f":{taint['effect']}" if taint["effect"] else ""
        where = "" if taint["devices"] == devices else f" (on {taint['devices']} of {devices})"
        texts.append(f"{taint['key']}{value}{effect}{where}")
    return ", ".join(texts)


def name_order(name: str) -> tuple[int, str]:
    """gpu-2 before gpu-10."""
    return (len(name), name)


def taints_by_gpu(devices: Sequence[SliceDevice]) -> list[GpuTaints]:
    """The GPUs of `devices` (one node's) that carry at least one taint, in name order."""
    by_gpu: dict[str, list[SliceDevice]] = {}
    for device in devices:
        by_gpu.setdefault(device.gpu_uuid or device.name, []).append(device)
    tainted = [_gpu_taints(uuid, members) for uuid, members in by_gpu.items()]
    return sorted((g for g in tainted if g.taints), key=lambda g: name_order(g.gpu))


def _gpu_taints(uuid: str, members: Sequence[SliceDevice]) -> GpuTaints:
    whole = next((d.name for d in members if not d.is_partition), None)
    return GpuTaints(
        gpu=whole or uuid,
        uuid=uuid,
        devices=len(members),
        tainted_devices=sum(1 for d in members if d.taints),
        taints=_merged(t for d in members for t in _distinct(d.taints)),
    )


def _distinct(taints: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: dict[tuple[Any, Any, Any], dict[str, Any]] = {}
    for taint in taints:
        seen.setdefault((taint.get("key"), taint.get("value"), taint.get("effect")), taint)
    return list(seen.values())


def _merged(taints: Iterable[dict[str, Any]]) -> tuple[PublishedTaint, ...]:
    merged: dict[tuple[str, str | None, str | None], PublishedTaint] = {}
    for taint in taints:
        ident = (str(taint.get("key")), taint.get("value"), taint.get("effect"))
        added = taint.get("timeAdded")
        known = merged.get(ident)
        if known is None:
            merged[ident] = PublishedTaint(*ident, time_added=added, devices=1)
            continue
        times = [t for t in (known.time_added, added) if t]
        merged[ident] = PublishedTaint(
            *ident, time_added=min(times) if times else None, devices=known.devices + 1
        )
    return tuple(sorted(merged.values(), key=lambda t: (t.key, t.value or "", t.effect or "")))
