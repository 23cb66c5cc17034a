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
  the driver published before it dropped those no disjoint placements can exceed;
- `slice-counters`: one counter per memory slice, as the driver published before it
  counted blocks of slices (`driver.devices.mig_counters.memory_blocks`: 2 counters instead of
  8 per H100 with `1g.10gb,3g.40gb,7g.80gb`);
- `one-set`: every GPU's counters in one counter set;
- `mig-first`: each GPU's MIG devices before its whole GPU (the allocator walks a
  pool's devices in order and evaluates selectors on each until one fits).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from driver.devices.formatting import MIG_DIMENSIONS, parse_quantity
from driver.devices.slices import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
    validate_slice_specs,
)

Spec = dict[str, Any]
FEW_ATTRIBUTES = ("profile", "parentUUID")
_GPU = re.compile(r"^gpu-(\d+)")
_MEMORY_BLOCK = re.compile(r"^memory-slices?-(\d+)(?:-(\d+))?$")


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


def _span(device: dict[str, Any]) -> range | None:
    """The memory slices a partition sits on (its placement attributes); None for a
    whole GPU, which spans them all."""
    attributes = device["attributes"]
    if "placementStart" not in attributes:
        return None
    start = attributes["placementStart"]["int"]
    return range(start, start + attributes["placementSize"]["int"])


def _slice_counters(counters: dict[str, Any], span: range | None) -> dict[str, Any]:
    """`counters` with each memory-slice block counter turned back into one counter per
    slice: the set's take all of the block's slices, a device's those of its span."""
    out: dict[str, Any] = {}
    for name, value in counters.items():
        match = _MEMORY_BLOCK.match(name)
        if match is None:
            out[name] = value
            continue
        first = int(match.group(1))
        block = range(first, int(match.group(2) or first) + 1)
        slices = (
            block
            if span is None
            else range(max(block.start, span.start), min(block.stop, span.stop))
        )
        if span is not None and len(slices) != parse_quantity(value["value"]):
            raise LayoutError(f"{name}: {value['value']} consumed, {len(slices)} slices placed")
        out |= {f"memory-slice-{i}": {"value": "1"} for i in slices}
    return out


def slice_counters(specs: Sequence[Spec]) -> list[Spec]:
    """One counter per memory slice instead of per block of slices."""
    devices = [
        {
            **d,
            "consumesCounters": [
                {**c, "counters": _slice_counters(c["counters"], _span(d))}
                for c in d["consumesCounters"]
            ],
        }
        if d.get("consumesCounters")
        else d
        for d in _device_list(specs)
    ]
    sets = [
        {**cs, "counters": _slice_counters(cs["counters"], None)} for cs in _counter_sets(specs)
    ]
    return _respec(specs, _set_bodies(sets, MAX_COUNTER_SETS_PER_SLICE) + _device_chunks(devices))


def _device_list(specs: Sequence[Spec]) -> list[dict[str, Any]]:
    return [d for body in _device_bodies(specs) for d in body["devices"]]


def _device_chunks(devices: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    size = MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
    return [{"devices": list(devices[i : i + size])} for i in range(0, len(devices), size)]


ONE_SET = "node-counter-set"


def one_set(specs: Sequence[Spec]) -> list[Spec]:
    """Every counter in one set `node-counter-set` as `<set>-<counter>`
    (`gpu-0-counter-set` -> `gpu-0-...`)."""
    sets, devices = _counter_sets(specs), _device_list(specs)

    def prefix(set_name: str) -> str:
        return set_name.removesuffix("-counter-set")

    merged = {
        f"{prefix(cs['name'])}-{name}": value
        for cs in sets
        for name, value in cs["counters"].items()
    }

    def moved(device: dict[str, Any]) -> dict[str, Any]:
        consumptions = device.get("consumesCounters")
        if not consumptions:
            return device
        counters = {
            f"{prefix(c['counterSet'])}-{name}": value
            for c in consumptions
            for name, value in c["counters"].items()
        }
        return {**device, "consumesCounters": [{"counterSet": ONE_SET, "counters": counters}]}

    one = {"name": ONE_SET, "counters": merged}
    return _respec(specs, [{"sharedCounters": [one]}, *_device_chunks([moved(d) for d in devices])])


def mig_first(specs: Sequence[Spec]) -> list[Spec]:
    devices = _device_list(specs)
    ordered = sorted(devices, key=lambda d: (_gpu_of(d), "profile" not in d["attributes"]))
    sets = _set_bodies(_counter_sets(specs), MAX_COUNTER_SETS_PER_SLICE)
    return _respec(specs, sets + _device_chunks(ordered))


RESHAPES: dict[str, Callable[[Sequence[Spec]], list[Spec]]] = {
    "gpu-slices": gpu_slices,
    "set-slices": set_slices,
    "few-attributes": few_attributes,
    "all-counters": all_counters,
    "slice-counters": slice_counters,
    "one-set": one_set,
    "mig-first": mig_first,
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
