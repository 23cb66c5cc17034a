"""Offline check of consumable-capacity requests against published devices.

A claim's request may ask for part of a device's capacity (`capacity.requests`, e.g.
`memory: 16Gi`). The scheduler leaves a claim pending forever when no device can give
that much; `gpu-dra validate --slices FILE` reports it before the claim is applied,
reading the ResourceSlices from `kubectl get resourceslices -o yaml` or
`gpu-dra inventory -o yaml`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from driver.devices.documents import binary_quantity, parse_quantity


@dataclass(frozen=True)
class CapacityDevice:
    """One published device: where it is and the capacity it offers."""

    node: str
    name: str
    capacity: Mapping[str, Decimal]


@dataclass(frozen=True)
class CapacityProblem:
    path: str
    message: str


def devices_of_slices(slices: Iterable[Any], driver: str) -> list[CapacityDevice]:
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
            if not isinstance(device, Mapping):
                continue
            capacity: dict[str, Decimal] = {}
            for key, entry in (device.get("capacity") or {}).items():
                try:
                    capacity[str(key)] = parse_quantity((entry or {}).get("value"))
                except (ValueError, TypeError, AttributeError):
                    continue
            devices.append(CapacityDevice(node, str(device.get("name")), capacity))
    return devices


def _device_requests(doc: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(field path, request) of each device request of a ResourceClaim or template."""
    if doc.get("kind") == "ResourceClaimTemplate":
        spec, prefix = (doc.get("spec") or {}).get("spec") or {}, "spec.spec"
    elif doc.get("kind") == "ResourceClaim":
        spec, prefix = doc.get("spec") or {}, "spec"
    else:
        return
    requests = (spec.get("devices") or {}).get("requests") or []
    for i, request in enumerate(requests if isinstance(requests, list) else []):
        if not isinstance(request, Mapping):
            continue
        path = f"{prefix}.devices.requests[{i}]"
        if isinstance(request.get("exactly"), Mapping):
            yield f"{path}.exactly", request["exactly"]
        for j, sub in enumerate(request.get("firstAvailable") or []):
            if isinstance(sub, Mapping):
                yield f"{path}.firstAvailable[{j}]", sub


def requests_capacity(doc: Any) -> bool:
    """Whether any device request of a claim document has `capacity.requests`."""
    if not isinstance(doc, Mapping):
        return False
    return any(
        isinstance(request.get("capacity"), Mapping) and request["capacity"].get("requests")
        for _, request in _device_requests(doc)
    )


def capacity_problems(doc: Any, devices: list[CapacityDevice]) -> list[CapacityProblem]:
    """Each request of a claim document whose capacity requests no single device of
    `devices` can satisfy, with the largest capacity offered."""
    if not isinstance(doc, Mapping):
        return []
    problems = []
    for path, request in _device_requests(doc):
        wanted = (request.get("capacity") or {}).get("requests") or {}
        if not isinstance(wanted, Mapping) or not wanted:
            continue
        field = f"{path}.capacity.requests"
        parsed: dict[str, Decimal] = {}
        for key, value in wanted.items():
            try:
                parsed[str(key)] = parse_quantity(value)
            except (ValueError, TypeError) as err:
                problems.append(CapacityProblem(f"{field}.{key}", f"not a quantity: {err}"))
        if len(parsed) != len(wanted):
            continue
        if any(_fits(device, parsed) for device in devices):
            continue
        problems.append(CapacityProblem(field, _why_nothing_fits(parsed, devices)))
    return problems


def _fits(device: CapacityDevice, wanted: Mapping[str, Decimal]) -> bool:
    return all(key in device.capacity and device.capacity[key] >= v for key, v in wanted.items())


def _why_nothing_fits(wanted: Mapping[str, Decimal], devices: list[CapacityDevice]) -> str:
    asked = ", ".join(f"{k}={_show(v)}" for k, v in sorted(wanted.items()))
    if not devices:
        return f"{asked}: the given slices publish no device of this driver"
    parts = []
    for key in sorted(wanted):
        offered = [d for d in devices if key in d.capacity]
        if not offered:
            parts.append(f"no device has a {key} capacity")
            continue
        largest = max(offered, key=lambda d: d.capacity[key])
        parts.append(
            f"largest {key}: {_show(largest.capacity[key])} ({largest.name} on {largest.node})"
        )
    return f"{asked}: no single device offers this much ({'; '.join(parts)})"


def _show(value: Decimal) -> str:
    """A whole quantity as the API server writes it (80Gi); a fraction as a number."""
    if value == value.to_integral_value() and value >= 0:
        return binary_quantity(int(value))
    return f"{value.normalize():f}"
