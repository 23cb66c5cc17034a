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
- `memory-blocks`: a GPU's memory-slice counters merged into one counter per block of
  slices where that admits the same sets (`memory_blocks`): `1g.10gb,3g.40gb,7g.80gb`
  on an H100 needs 2 counters (slices 0-3, 4-7) instead of 8;
- `blocks-one-set`: `memory-blocks` with every GPU's counters in one counter set;
- `mig-first`: each GPU's MIG devices before its whole GPU (the allocator walks a
  pool's devices in order and evaluates selectors on each until one fits);
- `blocks-mig-first`: `memory-blocks` and `mig-first` together.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from driver.devices.documents import MIG_DIMENSIONS, parse_quantity
from driver.devices.slices import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
    validate_slice_specs,
)

Spec = dict[str, Any]
FEW_ATTRIBUTES = ("profile", "parentUUID")
_GPU = re.compile(r"^gpu-(\d+)")
_MEMORY_SLICE = re.compile(r"^memory-slice-(\d+)$")


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


def memory_blocks(slices: int, spans: Iterable[frozenset[int]]) -> list[range]:
    """Blocks of a GPU's memory slices, each countable as one counter (capacity: its
    size; a device consumes its overlap) with the same sets admitted as one counter
    per slice: every span (the slices of a device, contiguous) meets each block in
    nothing, the whole block or one slice, and no two spans meet a block in the same
    single slice. Edges are where spans of several slices start and end; a block
    where two spans share a single slice falls back to one block per slice."""
    spans = list(spans)
    if any(max(s) - min(s) + 1 != len(s) for s in spans):
        raise LayoutError("memory blocks: a device's memory slices are not contiguous")
    wide = [s for s in spans if len(s) > 1]
    edges = sorted({0, slices} | {min(s) for s in wide} | {max(s) + 1 for s in wide})
    single = Counter(i for s in spans if len(s) == 1 for i in s)
    blocks: list[range] = []
    for start, end in itertools.pairwise(edges):
        if any(single[i] > 1 for i in range(start, end)):
            blocks += [range(i, i + 1) for i in range(start, end)]
        else:
            blocks.append(range(start, end))
    return blocks


def _block_name(block: range) -> str:
    if len(block) == 1:
        return f"memory-slice-{block.start}"
    return f"memory-slices-{block.start}-{block.stop - 1}"


def _slices_consumed(counters: dict[str, Any]) -> frozenset[int]:
    return frozenset(int(m.group(1)) for k in counters if (m := _MEMORY_SLICE.match(k)))


def _blocked_set(
    counter_set: dict[str, Any], consumptions: list[dict[str, Any]]
) -> dict[str, range]:
    """Each memory-slice counter of the set -> its block (memory_blocks)."""
    slice_counters = {
        int(m.group(1)): v
        for k, v in counter_set["counters"].items()
        if (m := _MEMORY_SLICE.match(k))
    }
    if sorted(slice_counters) != list(range(len(slice_counters))):
        raise LayoutError(f"counter set {counter_set['name']}: memory slices not 0..n-1")
    values = [v["value"] for v in slice_counters.values()] + [
        v["value"] for c in consumptions for k, v in c["counters"].items() if _MEMORY_SLICE.match(k)
    ]
    if any(parse_quantity(v) != 1 for v in values):
        raise LayoutError(f"counter set {counter_set['name']}: memory slices counted other than 1")
    spans = [_slices_consumed(c["counters"]) for c in consumptions]
    blocks = memory_blocks(len(slice_counters), [s for s in spans if s])
    return {f"memory-slice-{i}": block for block in blocks for i in block}


def _blocked(
    counters: dict[str, Any], block_of: dict[str, range], *, capacity: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in counters.items():
        block = block_of.get(name)
        if block is None:
            out[name] = value
        elif capacity or _block_name(block) not in out:
            taken = len(block) if capacity else len(_slices_consumed(counters) & set(block))
            out[_block_name(block)] = {"value": str(taken)}
    return out


def _device_list(specs: Sequence[Spec]) -> list[dict[str, Any]]:
    return [d for body in _device_bodies(specs) for d in body["devices"]]


def _device_chunks(devices: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    size = MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
    return [{"devices": list(devices[i : i + size])} for i in range(0, len(devices), size)]


def _with_memory_blocks(specs: Sequence[Spec]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pool's counter sets and devices with memory-slice counters merged into blocks."""
    devices = _device_list(specs)
    sets = []
    block_of: dict[str, dict[str, range]] = {}
    for cs in _counter_sets(specs):
        consumptions = [
            c
            for d in devices
            for c in d.get("consumesCounters") or []
            if c["counterSet"] == cs["name"]
        ]
        block_of[cs["name"]] = _blocked_set(cs, consumptions)
        sets.append(
            {**cs, "counters": _blocked(cs["counters"], block_of[cs["name"]], capacity=True)}
        )

    def reduced(device: dict[str, Any]) -> dict[str, Any]:
        consumptions = device.get("consumesCounters")
        if not consumptions:
            return device
        return {
            **device,
            "consumesCounters": [
                {
                    **c,
                    "counters": _blocked(c["counters"], block_of[c["counterSet"]], capacity=False),
                }
                for c in consumptions
            ],
        }

    return sets, [reduced(d) for d in devices]


def memory_blocks_layout(specs: Sequence[Spec]) -> list[Spec]:
    sets, devices = _with_memory_blocks(specs)
    return _respec(specs, _set_bodies(sets, MAX_COUNTER_SETS_PER_SLICE) + _device_chunks(devices))


ONE_SET = "node-counter-set"


def blocks_one_set(specs: Sequence[Spec]) -> list[Spec]:
    """memory-blocks, every counter in one set `node-counter-set` as `<set>-<counter>`
    (`gpu-0-counter-set` -> `gpu-0-...`)."""
    sets, devices = _with_memory_blocks(specs)

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
    "memory-blocks": memory_blocks_layout,
    "blocks-one-set": blocks_one_set,
    "mig-first": mig_first,
    "blocks-mig-first": lambda specs: mig_first(memory_blocks_layout(specs)),
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
