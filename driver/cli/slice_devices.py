"""The devices of ResourceSlice documents given to `gpu-dra validate --slices FILE`
(`kubectl get resourceslices -o yaml`, `gpu-dra inventory -o yaml`): what the offline
checks of claims need to know of each."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from driver.devices.documents import parse_quantity

#: The attribute that makes a device a MIG partition (class `mig.<driver>`), and a
#: `--gpu-partitions` partition (class `partition.<driver>`), as the chart's selectors say.
MIG_ATTRIBUTE = "profile"
GPU_PARTITION_ATTRIBUTE = "partition"


@dataclass(frozen=True)
class OfferedDevice:
    """One published device: where it is, the capacity it offers and what prepare asks
    of it before it splits it (`driver.config.validate_for_device`)."""

    node: str
    name: str
    capacity: Mapping[str, Decimal]
    partition_attribute: str | None = None  # MIG_ATTRIBUTE, GPU_PARTITION_ATTRIBUTE or None
    max_partitions: int | None = None
    shared: bool = False  # allowMultipleAllocations: every allocation of it is a share

    @property
    def is_partition(self) -> bool:
        return self.partition_attribute is not None

    def where(self) -> str:
        return f"{self.name} on {self.node}"


def devices_of_slices(slices: Iterable[Any], driver: str) -> list[OfferedDevice]:
    """The devices of `driver` in ResourceSlice documents (other kinds and drivers are
    skipped); a capacity whose value is not a quantity is left out."""
    devices = []
    for doc in slices:
        if not isinstance(doc, Mapping) or doc.get("kind") != "ResourceSlice":
            continue
        spec = doc.get("spec")
        if not isinstance(spec, Mapping) or spec.get("driver") != driver:
            continue
        node = str(spec.get("nodeName") or (spec.get("pool") or {}).get("name") or "")
        for device in spec.get("devices") or []:
            if isinstance(device, Mapping):
                devices.append(_offered(device, node))
    return devices


def _offered(device: Mapping[str, Any], node: str) -> OfferedDevice:
    capacity: dict[str, Decimal] = {}
    for key, entry in (device.get("capacity") or {}).items():
        try:
            capacity[str(key)] = parse_quantity((entry or {}).get("value"))
        except (ValueError, TypeError, AttributeError):
            continue
    attributes = device.get("attributes")
    attributes = attributes if isinstance(attributes, Mapping) else {}
    max_partitions = attributes.get("maxPartitions")
    if isinstance(max_partitions, Mapping):
        max_partitions = max_partitions.get("int")
    return OfferedDevice(
        node=node,
        name=str(device.get("name")),
        capacity=capacity,
        partition_attribute=next(
            (a for a in (MIG_ATTRIBUTE, GPU_PARTITION_ATTRIBUTE) if a in attributes), None
        ),
        max_partitions=max_partitions if type(max_partitions) is int else None,
        shared=device.get("allowMultipleAllocations") is True,
    )
