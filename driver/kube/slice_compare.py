"""How the publisher compares ResourceSlices: the index in a slice's name, a spec
without what the API server adds or respells, and which devices and counter sets a
slice holds."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

from driver.devices.formatting import parse_quantity
from driver.kube.api import JSON


def slice_index(name: str) -> int | None:
    """The position encoded in a slice name `<hex index>-<driver>-<node>-<suffix>`."""
    head, _, _ = name.partition("-")
    try:
        return int(head, 16)
    except ValueError:
        return None


def comparable_spec(spec: JSON) -> JSON:
    """A spec with server defaults and quantity spelling removed, for equality checks."""
    out = copy.deepcopy(spec)
    out.pop("pool", None)
    for device in out.get("devices") or []:
        for capacity in (device.get("capacity") or {}).values():
            _normalise_quantity(capacity)
        for consumption in device.get("consumesCounters") or []:
            for counter in (consumption.get("counters") or {}).values():
                _normalise_quantity(counter)
        for taint in device.get("taints") or []:
            taint.pop("timeAdded", None)
    for counter_set in out.get("sharedCounters") or []:
        for counter in (counter_set.get("counters") or {}).values():
            _normalise_quantity(counter)
    return out


def layout(spec: JSON) -> tuple[list[str], list[str]]:
    """Which devices and counter sets a slice holds."""
    return (
        [d["name"] for d in spec.get("devices") or []],
        [c["name"] for c in spec.get("sharedCounters") or []],
    )


def _normalise_quantity(holder: dict[str, Any]) -> None:
    if "value" in holder:
        value: Decimal = parse_quantity(holder["value"])
        holder["value"] = str(value.normalize())
