"""The devices of ResourceSlice documents given to `gpu-dra validate --slices FILE`
(`kubectl get resourceslices -o yaml`, `gpu-dra inventory -o yaml`): what the offline
checks of claims need to know of each."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from driver.devices.formatting import parse_quantity

#: The attribute that makes a device a MIG partition (class `mig.<driver>`), and a
#: `--gpu-partitions` partition (class `partition.<driver>`), as the chart's selectors say.
MIG_ATTRIBUTE = "profile"
GPU_PARTITION_ATTRIBUTE = "partition"
#: The attribute of the whole GPU of a GPU in MIG mode, delivered as a full-size MIG
#: device (driver/devices/mig_devices.py).
MIG_WHOLE_GPU_ATTRIBUTE = "migProfile"


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
    # A MIG partition or the whole GPU of a GPU in MIG mode: prepare sets no time-slice
    # interval on it (driver/state/plan.py, `_no_time_slice`).
    mig: bool = False

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
        mig=MIG_ATTRIBUTE in attributes or MIG_WHOLE_GPU_ATTRIBUTE in attributes,
    )


@dataclass(frozen=True)
class SliceDevice:
    """One published device as its ResourceSlice has it (`gpu-dra validate --explain`):
    the node (or the pool's name for a slice without one), its pool and its document."""

    node: str
    pool: str
    name: str
    document: Mapping[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        """(pool, device name): how an allocation result names the device."""
        return self.pool, self.name

    @property
    def fields(self) -> Mapping[str, Any]:
        """The device's fields: v1 and v1beta2 have them at the top, v1beta1 in `basic`."""
        basic = self.document.get("basic")
        return basic if isinstance(basic, Mapping) else self.document


def _resource_slices(documents: Iterable[object], driver: str) -> Iterable[Mapping[str, Any]]:
    """The specs of the ResourceSlices of `driver` among `documents` (Lists' items too)."""
    for doc in documents:
        if not isinstance(doc, Mapping):
            continue
        if str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list):
            yield from _resource_slices(doc["items"], driver)
            continue
        spec = doc.get("spec")
        if doc.get("kind") == "ResourceSlice" and isinstance(spec, Mapping):
            yield from [spec] if spec.get("driver") == driver else []


def _pool_name(spec: Mapping[str, Any]) -> str:
    pool = spec.get("pool")
    return str(pool.get("name") or "") if isinstance(pool, Mapping) else ""


def slice_devices(documents: Iterable[object], driver: str) -> list[SliceDevice]:
    """The devices of `driver` in ResourceSlice documents (Lists' items too)."""
    found: list[SliceDevice] = []
    for spec in _resource_slices(documents, driver):
        pool = _pool_name(spec)
        node = str(spec.get("nodeName") or pool or "?")
        for device in spec.get("devices") or []:
            if isinstance(device, Mapping):
                found.append(SliceDevice(node, pool, str(device.get("name")), device))
    return found


def shared_counters(
    documents: Iterable[object], driver: str
) -> dict[tuple[str, str], dict[str, Decimal]]:
    """(pool, counter set) -> counter -> amount, from the slices' `sharedCounters`; a
    counter whose value is not a quantity is left out."""
    counters: dict[tuple[str, str], dict[str, Decimal]] = {}
    for spec in _resource_slices(documents, driver):
        pool = _pool_name(spec)
        for counter_set in spec.get("sharedCounters") or []:
            if not isinstance(counter_set, Mapping):
                continue
            values = counters.setdefault((pool, str(counter_set.get("name"))), {})
            values.update(counter_amounts(counter_set.get("counters")))
    return counters


def counter_amounts(counters: object) -> dict[str, Decimal]:
    """A `counters` map (name -> {value: quantity}) as amounts; malformed entries left out."""
    amounts: dict[str, Decimal] = {}
    for name, entry in counters.items() if isinstance(counters, Mapping) else ():
        try:
            amounts[str(name)] = parse_quantity(entry.get("value"))
        except (ValueError, TypeError, AttributeError):
            continue
    return amounts
