"""Each physical GPU as an operator names it: device name, NVML index, PCI bus id,
UUID, model and MIG mode. Shared by `gpu-dra inventory`, the plugin's /status and
its per-GPU metrics, so that all three name a GPU the same way."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from driver.nvml.discovered import GpuInfo, Inventory


class MigMode(enum.StrEnum):
    """How a GPU's MIG mode shapes what is published (docs/mig.md)."""

    UNSUPPORTED = "unsupported"  # the GPU cannot do MIG
    DISABLED = "disabled"  # MIG-capable, MIG mode off: published as a whole GPU
    DYNAMIC = "dynamic"  # MIG devices created at prepare (--mig-strategy)
    STATIC = "static"  # the MIG devices that exist are published, nothing is created
    # MIG mode on but published without MIG: --gpu-partitions over the mock, or no
    # MIG profile reported.
    IGNORED = "ignored"


@dataclass(frozen=True)
class GpuView:
    name: str  # gpu-<minor>: the GPU's device name, also when nothing of it is published
    index: int  # NVML index
    minor: int
    uuid: str
    pci_bus_id: str
    model: str
    memory_bytes: int | None
    mig_mode: MigMode

    @property
    def gpu_uuid(self) -> str:
        """The GPU as the health store sees a device: the whole GPU, which every
        failure of it or of its GPU instances covers (`HealthDevice`)."""
        return self.uuid

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "uuid": self.uuid,
            "pciBusID": self.pci_bus_id,
            "model": self.model,
            "migMode": self.mig_mode.value,
        }


def gpu_name(minor: int) -> str:
    return f"gpu-{minor}"


def mig_mode(gpu: GpuInfo, pool_modes: Mapping[str, str]) -> MigMode:
    """`pool_modes`: `PoolDevices.mig_modes` (GPU UUID -> dynamic | static)."""
    if gpu.uuid in pool_modes:
        return MigMode(pool_modes[gpu.uuid])
    if gpu.mig_enabled:
        return MigMode.IGNORED
    return MigMode.DISABLED if gpu.mig_capable else MigMode.UNSUPPORTED


def gpu_views(inventory: Inventory, pool_modes: Mapping[str, str]) -> tuple[GpuView, ...]:
    """Every discovered GPU, by minor number (the order devices are published in)."""
    return tuple(
        GpuView(
            name=gpu_name(gpu.minor),
            index=gpu.index,
            minor=gpu.minor,
            uuid=gpu.uuid,
            pci_bus_id=gpu.pci_bus_id,
            model=gpu.model or gpu.product_name,
            memory_bytes=gpu.memory_bytes,
            mig_mode=mig_mode(gpu, pool_modes),
        )
        for gpu in sorted(inventory.gpus, key=lambda g: g.minor)
    )
