"""Offline check of consumable-capacity requests against published devices.

A claim's request may ask for part of a device's capacity (`capacity.requests`, e.g.
`memory: 16Gi`). The scheduler leaves a claim pending forever when no device can give
that much; `gpu-dra validate --slices FILE` reports it before the claim is applied,
reading the ResourceSlices from `kubectl get resourceslices -o yaml` or
`gpu-dra inventory -o yaml`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any

from driver.cli.validate.claim_requests import device_requests
from driver.cli.validate.claim_rules import DeviceClasses
from driver.cli.validate.slice_devices import OfferedDevice
from driver.config.config_error import FieldError
from driver.devices.formatting import binary_quantity, parse_quantity


def requests_capacity(doc: Any) -> bool:
    """Whether any device request of a claim document has `capacity.requests`."""
    if not isinstance(doc, Mapping):
        return False
    return any(
        isinstance(request.fields.get("capacity"), Mapping)
        and request.fields["capacity"].get("requests")
        for request in device_requests(doc)
    )


def capacity_problems(
    doc: Any, devices: list[OfferedDevice], classes: DeviceClasses
) -> list[FieldError]:
    """Each request of a claim document whose capacity requests no single device of
    `devices` its class selects (`DeviceClasses.offered`) can satisfy, with the largest
    capacity offered."""
    if not isinstance(doc, Mapping):
        return []
    problems = []
    for request in device_requests(doc):
        capacity = request.fields.get("capacity")
        wanted = capacity.get("requests") if isinstance(capacity, Mapping) else None
        if not isinstance(wanted, Mapping) or not wanted:
            continue
        field = f"{request.path}.capacity.requests"
        parsed: dict[str, Decimal] = {}
        for key, value in wanted.items():
            try:
                parsed[str(key)] = parse_quantity(value)
            except (ValueError, TypeError) as err:
                problems.append(FieldError(f"{field}.{key}", f"not a quantity: {err}"))
        if len(parsed) != len(wanted):
            continue
        offered = classes.offered(request.device_class, devices)
        if any(_fits(device, parsed) for device in offered):
            continue
        asked = ", ".join(f"{k}={show_quantity(v, k)}" for k, v in sorted(parsed.items()))
        if not devices:
            why = "the given slices publish no device of this driver"
        elif not offered:
            why = f"the given slices publish no device of class {request.device_class}"
        else:
            why = _why_nothing_fits(parsed, offered)
        problems.append(FieldError(field, f"{asked}: {why}"))
    return problems


def _fits(device: OfferedDevice, wanted: Mapping[str, Decimal]) -> bool:
    return all(key in device.capacity and device.capacity[key] >= v for key, v in wanted.items())


def _why_nothing_fits(wanted: Mapping[str, Decimal], devices: list[OfferedDevice]) -> str:
    parts = []
    for key in sorted(wanted):
        offered = [d for d in devices if key in d.capacity]
        if not offered:
            parts.append(f"no device has a {key} capacity")
            continue
        largest = max(offered, key=lambda d: d.capacity[key])
        largest_value = show_quantity(largest.capacity[key], key)
        parts.append(f"largest {key}: {largest_value} ({largest.where()})")
    return f"no single device offers this much ({'; '.join(parts)})"


#: The capacity counted in bytes (`driver.devices.model`); other capacities are counts.
BYTES_CAPACITY = "memory"
_READABLE_UNITS = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def show_quantity(value: Decimal, capacity: str) -> str:
    """A whole quantity as the API server writes it (80Gi); a fraction as a number. A
    memory size no binary suffix divides (a third of a GPU: 28506936661) gets a readable
    size beside it (~26.5Gi)."""
    if value != value.to_integral_value() or value < 0:
        return f"{value.normalize():f}"
    exact = binary_quantity(int(value))
    if capacity != BYTES_CAPACITY or not exact.isdigit():
        return exact
    for suffix, size in _READABLE_UNITS:
        if value >= size:
            return f"{exact} (~{value / size:.1f}{suffix})"
    return exact


@dataclass(frozen=True)
class Consumption:
    """What one allocation of a request takes of one capacity of a device with
    `allowMultipleAllocations`; `why` says where the amount comes from when it is not
    the amount requested ("" when it is); `named`: whether the request names it."""

    amount: Decimal
    why: str = ""
    named: bool = True


class PolicyViolation(ValueError):
    """A capacity request the device's `requestPolicy` does not allow: the scheduler
    never allocates the device for it."""


def request_consumption(
    capacity: Mapping[str, Any], wanted: Mapping[str, Decimal], asked: Mapping[str, str]
) -> dict[str, Consumption]:
    """Capacity name -> what a request asking for `wanted` (`asked`: as written) takes of
    a multi-allocatable device offering `capacity` (its `capacity` map), as the
    scheduler computes it: a capacity requested is rounded up to its requestPolicy's
    `validValues` or `validRange` step (below `min`: min); one not requested takes the
    policy's `default`, or all of it without a policy. Raises PolicyViolation for a
    request above the policy's `max` or every valid value."""
    taken: dict[str, Consumption] = {}
    for name, entry in capacity.items():
        if not isinstance(entry, Mapping):
            continue
        key = str(name)
        policy = entry.get("requestPolicy")
        policy = policy if isinstance(policy, Mapping) else {}
        try:
            value = parse_quantity(entry.get("value"))
            if key not in wanted:
                if policy.get("default") is not None:
                    why = f"(the requestPolicy default: the request names no {key})"
                    taken[key] = Consumption(parse_quantity(policy["default"]), why, False)
                else:
                    why = f"(all of it: the request names no {key})"
                    taken[key] = Consumption(value, why, False)
                continue
            amount = _rounded(wanted[key], policy, key)
        except PolicyViolation:
            raise
        except (ValueError, TypeError):
            continue  # a malformed capacity or policy: the API server refuses it
        shown = asked.get(key, show_quantity(wanted[key], key))
        why = f"({shown} rounded up by the requestPolicy)" if amount != wanted[key] else ""
        taken[key] = Consumption(amount, why)
    return taken


def _rounded(requested: Decimal, policy: Mapping[str, Any], key: str) -> Decimal:
    values = policy.get("validValues")
    if isinstance(values, list) and values:
        valid = sorted(parse_quantity(v) for v in values)
        for candidate in valid:
            if candidate >= requested:
                return candidate
        raise PolicyViolation(
            f"{key} {show_quantity(requested, key)} requested: above every valid value of "
            f"the requestPolicy (largest {show_quantity(valid[-1], key)})"
        )
    valid_range = policy.get("validRange")
    if not isinstance(valid_range, Mapping):
        return requested
    low = parse_quantity(valid_range.get("min"))
    high = valid_range.get("max")
    if high is not None and requested > parse_quantity(high):
        raise PolicyViolation(
            f"{key} {show_quantity(requested, key)} requested: above the requestPolicy's "
            f"max {show_quantity(parse_quantity(high), key)}"
        )
    if requested <= low:
        return low
    step = valid_range.get("step")
    if step is None:
        return requested
    size = parse_quantity(step)
    steps = ((requested - low) / size).to_integral_value(rounding=ROUND_CEILING)
    return low + steps * size
