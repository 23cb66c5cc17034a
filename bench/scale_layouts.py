"""Slice-layout variants of the scheduler-scale benchmark (pure): each reshapes one
node's ResourceSlice specs, as the driver builds them, in one respect, so that its
effect on the scheduler's per-node cost can be measured alone (docs/mig.md, "Slice
layout"). Every variant is a valid pool (`validate_slice_specs`) holding the same
devices under the same names, which a driver could publish instead:

- `gpu-slices`: one device slice per GPU instead of as few as the limits allow;
- `set-slices`: one slice per counter set instead of up to eight sets per slice (the
  API does not allow counter sets in a slice that holds devices);
- `few-attributes`: each device keeps only the attributes the chart's DeviceClasses
  and the benchmark's selector read (`profile`) and its parent (`parentUUID`);
- `all-counters`: every MIG dimension (memory, multiprocessors, engines) counted, as
  the driver published before it dropped those no disjoint placements can exceed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from driver.devices.documents import MIG_DIMENSIONS, parse_quantity
from driver.devices.slices import MAX_COUNTER_SETS_PER_SLICE, validate_slice_specs

Spec = dict[str, Any]
FEW_ATTRIBUTES = ("profile", "parentUUID")
_GPU = re.compile(r"^gpu-(\d+)")


class LayoutError(ValueError):
    pass


def _counter_sets(specs: Sequence[Spec]) -> list[dict[str, Any]]:
    return [cs for s in specs for cs in s.get("sharedCounters") or []]


def _device_bodies(specs: Sequence[Spec]) -> list[dict[str, Any]]:
    return [{"devices": s["devices"]} for s in specs if s.get("devices")]


def _set_bodies(sets: Sequence[dict[str, Any]], per_slice: int) -> list[dict[str, Any]]:
    return [
        {"sharedCounters": list(sets[i : i + per_slice])} for i in range(0, len(sets), per_slice)
    ]


def _respec(specs: Sequence[Spec], bodies: Sequence[dict[str, Any]]) -> list[Spec]:
    """`bodies` (devices or counter sets) as the pool's slices, in this order."""
    common = {k: v for k, v in specs[0].items() if k not in ("devices", "sharedCounters")}
    pool = {**common["pool"], "resourceSliceCount": len(bodies)}
    return [{**common, "pool": pool, **body} for body in bodies]


def _gpu_of(device: dict[str, Any]) -> int:
    match = _GPU.match(device["name"])
    if match is None:
        raise LayoutError(f"device {device['name']!r}: not a device of a GPU (gpu-<minor>...)")
    return int(match.group(1))


def gpu_slices(specs: Sequence[Spec]) -> list[Spec]:
    devices = [d for body in _device_bodies(specs) for d in body["devices"]]
    gpus = sorted({_gpu_of(d) for d in devices})
    bodies = [{"devices": [d for d in devices if _gpu_of(d) == gpu]} for gpu in gpus]
    sets = _set_bodies(_counter_sets(specs), MAX_COUNTER_SETS_PER_SLICE)
    return _respec(specs, sets + bodies)


def set_slices(specs: Sequence[Spec]) -> list[Spec]:
    return _respec(specs, _set_bodies(_counter_sets(specs), 1) + _device_bodies(specs))


def few_attributes(specs: Sequence[Spec]) -> list[Spec]:
    def reduced(device: dict[str, Any]) -> dict[str, Any]:
        attrs = {k: v for k, v in device["attributes"].items() if k in FEW_ATTRIBUTES}
        return {**device, "attributes": attrs}

    bodies = [{"devices": [reduced(d) for d in b["devices"]]} for b in _device_bodies(specs)]
    sets = _set_bodies(_counter_sets(specs), MAX_COUNTER_SETS_PER_SLICE)
    return _respec(specs, sets + bodies)


def all_counters(specs: Sequence[Spec]) -> list[Spec]:
    """Each consuming device also consumes its nonzero MIG capacities as counters; its
    set counts each dimension at the most any of its devices has (the full-size
    profile's, which the whole GPU publishes)."""
    to_counter = {capacity: counter for capacity, counter, _ in MIG_DIMENSIONS}
    most: dict[str, dict[str, str]] = {}

    def widened(device: dict[str, Any]) -> dict[str, Any]:
        consumptions = device.get("consumesCounters")
        if not consumptions:
            return device
        capacity = {
            to_counter[k]: c["value"] for k, c in device["capacity"].items() if k in to_counter
        }
        (consumption,) = consumptions
        tops = most.setdefault(consumption["counterSet"], {})
        for counter, value in capacity.items():
            if counter not in tops or parse_quantity(value) > parse_quantity(tops[counter]):
                tops[counter] = value
        spent = {k: {"value": v} for k, v in capacity.items() if parse_quantity(v) > 0}
        counters = {**spent, **consumption["counters"]}
        return {**device, "consumesCounters": [{**consumption, "counters": counters}]}

    bodies = [{"devices": [widened(d) for d in b["devices"]]} for b in _device_bodies(specs)]
    sets = [
        {
            **cs,
            "counters": {
                **{k: {"value": v} for k, v in most.get(cs["name"], {}).items()},
                **cs["counters"],
            },
        }
        for cs in _counter_sets(specs)
    ]
    return _respec(specs, _set_bodies(sets, MAX_COUNTER_SETS_PER_SLICE) + bodies)


RESHAPES: dict[str, Callable[[Sequence[Spec]], list[Spec]]] = {
    "gpu-slices": gpu_slices,
    "set-slices": set_slices,
    "few-attributes": few_attributes,
    "all-counters": all_counters,
}


def reshape(name: str, specs: Sequence[Spec]) -> list[Spec]:
    """The node's specs in the variant `name` ("": as the driver builds them)."""
    if not name:
        return list(specs)
    if name not in RESHAPES:
        raise LayoutError(f"unknown slice layout {name!r} (known: {', '.join(RESHAPES)})")
    out = RESHAPES[name](specs)
    errors = validate_slice_specs(out)
    if errors:
        raise LayoutError(f"slice layout {name}: {'; '.join(errors[:3])}")
    return out
