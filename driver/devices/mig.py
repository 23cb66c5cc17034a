"""The devices of one GPU in MIG mode (pure): dynamic or static (docs/mig.md).

Per GPU one counter set `gpu-<minor>-counter-set`: its memory slices, counted in
blocks where that admits the same sets (`memory_blocks`), and those of the memory,
multiprocessor and engine counters that some published partitions at disjoint
placements could exceed (`counted`). Every partition
is a device `gpu-<minor>-mig-<profile label>-<placement start>` consuming its memory
slices and its profile's share of those counters, so the scheduler never hands out
overlapping partitions, or a GPU together with one of its partitions; it carries
`isolated: true` (its own memory, SMs and engines, unlike a `--gpu-partitions`
partition).

- dynamic: every (profile, placement) NVML reports, and the whole GPU `gpu-<minor>`
  consuming all counters. CUDA cannot use a GPU in MIG mode without a MIG device, so
  the whole GPU is delivered as a MIG device of the full-size profile (the one whose
  placement spans every memory slice), and published as one: that profile's
  capacities, `parentUUID` and `migProfile`, no `uuid`; a GPU without such a profile
  publishes no whole-GPU device.
- static: exactly the MIG devices that exist, under the same names, with attribute
  `uuid` = the MIG device's UUID; no whole GPU (it is split already). Never one this
  driver created for a prepared claim (its unprepare destroys it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Collection, Sequence, Set
from typing import Any

from driver.devices.documents import (
    MIG_DIMENSIONS,
    bool_attr,
    counter_quantity,
    counters,
    device_doc,
    int_attr,
    profile_label,
    quantity,
    string_attr,
)
from driver.devices.types import MigBacking, PublishedDevice
from driver.nvml.types import GpuInfo, MigInstance, PartitionProfile

PARENT_ATTRIBUTES = (
    "model",
    "driverVersion",
    "productName",
    "brand",
    "architecture",
    "cudaComputeCapability",
    "cudaDriverVersion",
    "resource.kubernetes.io/pciBusID",
)


MEMORY_SLICE_PREFIX = "memory-slice-"


def counter_set_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.minor}-counter-set"


def partition_name(gpu: GpuInfo, profile: PartitionProfile, start: int) -> str:
    return f"gpu-{gpu.minor}-mig-{profile_label(profile.name)}-{start}"


def _counter_values(gpu: GpuInfo) -> dict[str, int]:
    """Counter capacities of a GPU's set: per-dimension max over profiles + memory slices."""
    values: dict[str, int] = {}
    for _, counter, attr in MIG_DIMENSIONS:
        values[counter] = max(getattr(p, attr) for p in gpu.partition_profiles)
    for i in range(gpu.memory_slices):
        values[f"{MEMORY_SLICE_PREFIX}{i}"] = 1
    return values


def counter_set(gpu: GpuInfo) -> dict[str, Any]:
    """Every counter of the GPU; `counted` keeps those that can refuse something."""
    return {
        "name": counter_set_name(gpu),
        "counters": counters(_counter_values(gpu), skip_zero=False),
    }


def _most_at_disjoint_placements(
    slices: int, weighted: Sequence[tuple[tuple[int, int], int]]
) -> int:
    """The largest total weight of placements ((start, size), weight) that share no
    memory slice: best[end] is the most within slices [0, end)."""
    best = [0] * (slices + 1)
    for end in range(1, slices + 1):
        best[end] = max(
            [best[end - 1]]
            + [best[start] + w for (start, size), w in weighted if start + size == end]
        )
    return best[slices]


def binding_dimensions(gpu: GpuInfo, partitions: Sequence[PublishedDevice]) -> set[str]:
    """The MIG dimension counters (memory, multiprocessors, engines) some of these
    partitions at pairwise disjoint placements would exceed together. Overlapping
    placements are refused by the memory-slice counters already, and the whole GPU
    spans every slice, so a dimension no disjoint placements can exceed never refuses
    an allocation. Without memory slices every dimension counts."""
    dimensions = {counter for _, counter, _ in MIG_DIMENSIONS}
    slices = gpu.memory_slices
    placed = [(p.mig, p.placement) for p in partitions if p.mig is not None and p.placement]
    if slices < 1 or any(start < 0 or start + size > slices for _, (start, size) in placed):
        return dimensions
    profiles = {p.profile_id: p for p in gpu.partition_profiles}
    most = _counter_values(gpu)
    binding = set()
    for _, counter, field in MIG_DIMENSIONS:
        weighted = [
            (placement, getattr(profiles[mig.profile_id], field)) for mig, placement in placed
        ]
        if _most_at_disjoint_placements(slices, weighted) > most[counter]:
            binding.add(counter)
    return binding


def memory_blocks(slices: int, spans: Collection[tuple[int, int]]) -> list[range]:
    """A GPU's memory slices cut into blocks, each counted as one counter worth its size
    and consumed by a device as much as its placement ((start, size)) overlaps it: the
    sets of devices this admits are exactly those one counter per slice admits.

    Blocks end wherever a placement of several slices starts or ends, so such a
    placement takes whole blocks, and it shares a block with nothing else it could
    overlap. A one-slice placement takes one unit of its block: one-slice placements
    at different slices fit side by side, as they do slice by slice. Two devices at
    the same single slice (1g.10gb and 1g.10gb+me at slice 3) would fit in a block
    together though they overlap, so a block holding such a slice is cut into single
    slices."""
    wide = [(start, size) for start, size in spans if size > 1]
    edges = sorted({0, slices} | {start for start, _ in wide} | {s + n for s, n in wide})
    singles = Counter(start for start, size in spans if size == 1)
    blocks: list[range] = []
    for start, end in itertools.pairwise(edges):
        if any(singles[i] > 1 for i in range(start, end)):
            blocks += [range(i, i + 1) for i in range(start, end)]
        else:
            blocks.append(range(start, end))
    return blocks


def memory_counter_name(block: range) -> str:
    if len(block) == 1:
        return f"memory-slice-{block.start}"
    return f"memory-slices-{block.start}-{block.stop - 1}"


def _blocked_counters(counter_values: dict[str, Any], blocks: Sequence[range]) -> dict[str, Any]:
    """`counter_values` with its `memory-slice-<i>` entries (each worth 1) replaced by
    the blocks they fall in, each worth the number of those slices."""
    taken = Counter(
        block
        for name in counter_values
        if name.startswith(MEMORY_SLICE_PREFIX)
        for block in blocks
        if int(name.removeprefix(MEMORY_SLICE_PREFIX)) in block
    )
    out = {k: v for k, v in counter_values.items() if not k.startswith(MEMORY_SLICE_PREFIX)}
    for block in blocks:
        if taken[block]:
            out[memory_counter_name(block)] = quantity(str(taken[block]))
    return out


def _recounted(
    device: PublishedDevice, kept: Collection[str], blocks: Sequence[range]
) -> PublishedDevice:
    if not device.document.get("consumesCounters"):
        return device
    document = dict(device.document)
    document["consumesCounters"] = [
        {
            **c,
            "counters": _blocked_counters(
                {k: v for k, v in c["counters"].items() if k in kept}, blocks
            ),
        }
        for c in device.document["consumesCounters"]
    ]
    return dataclasses.replace(device, document=document)


def counted(
    gpu: GpuInfo, devices: Sequence[PublishedDevice]
) -> tuple[list[PublishedDevice], dict[str, Any]]:
    """The GPU's counter set with its memory slices in blocks (`memory_blocks`) and its
    binding dimensions only, and its devices consuming only those (docs/mig.md, "Slice
    layout"): the scheduler's allocator reads every consumed counter of every device of
    a node for every pod, and the allocations it allows stay the same."""
    dimensions = {counter for _, counter, _ in MIG_DIMENSIONS}
    dropped = dimensions - binding_dimensions(gpu, [d for d in devices if d.is_partition])
    full = counter_set(gpu)
    kept = {k: v for k, v in full["counters"].items() if k not in dropped}
    spans = [d.mig.placement for d in devices if d.mig is not None]
    slices = gpu.memory_slices
    if all(start >= 0 and size > 0 and start + size <= slices for start, size in spans):
        blocks = memory_blocks(slices, spans)
    else:  # placements NVML should not report: count slice by slice
        blocks = [range(i, i + 1) for i in range(slices)]
    counted_set = {**full, "counters": _blocked_counters(kept, blocks)}
    return [_recounted(d, kept, blocks) for d in devices], counted_set


def full_size_profile(gpu: GpuInfo) -> PartitionProfile | None:
    """The profile whose placement spans every memory slice (7g.80gb on an H100)."""
    spanning = [p for p in gpu.partition_profiles if (0, gpu.memory_slices) in p.placements]
    return max(spanning, key=lambda p: (p.slice_count, p.memory_bytes), default=None)


def whole_gpu(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], capacity: dict[str, Any], max_partitions: int | None
) -> PublishedDevice | None:
    """The whole GPU of a dynamic MIG GPU, backed by a full-size MIG device.

    It publishes what the container gets: the full-size profile's memory,
    multiprocessors and engines (a 7g.80gb device has less memory than the GPU), no
    `uuid` (the container never sees the GPU's UUID, only a MIG device's created at
    prepare), `parentUUID` as its partitions do, and `migProfile`. Not `profile`: that
    attribute marks a partition (the chart's DeviceClasses select on it)."""
    full = full_size_profile(gpu)
    if full is None:
        return None
    values = _counter_values(gpu)
    capacity = dict(capacity)
    for cap, counter, attr in MIG_DIMENSIONS:
        capacity[cap] = quantity(counter_quantity(counter, getattr(full, attr)))
    attrs = {k: v for k, v in gpu_attrs.items() if k != "uuid"}
    attrs["parentUUID"] = string_attr(gpu.uuid)
    attrs["migProfile"] = string_attr(full.name)
    doc = device_doc(f"gpu-{gpu.minor}", attrs, capacity)
    doc["consumesCounters"] = [
        {"counterSet": counter_set_name(gpu), "counters": counters(values, skip_zero=True)}
    ]
    return PublishedDevice(
        name=doc["name"],
        document=doc,
        gpu_uuid=gpu.uuid,
        gpu_minor=gpu.minor,
        is_partition=False,
        max_partitions=max_partitions,
        mig=MigBacking(full.profile_id, full.slice_count, (0, gpu.memory_slices)),
    )


def _partition(
    gpu: GpuInfo,
    parent_attrs: dict[str, Any],
    profile: PartitionProfile,
    placement: tuple[int, int],
    existing: MigInstance | None,
) -> PublishedDevice:
    start, size = placement
    name = partition_name(gpu, profile, start)
    attrs = {
        "profile": string_attr(profile.name),
        "parentUUID": string_attr(gpu.uuid),
        "parentIndex": int_attr(gpu.index),
        "placementStart": int_attr(start),
        "placementSize": int_attr(size),
        "isolated": bool_attr(True),
        **parent_attrs,
    }
    if existing is not None and existing.uuid is not None:
        attrs["uuid"] = string_attr(existing.uuid)
    values = {counter: getattr(profile, attr) for _, counter, attr in MIG_DIMENSIONS}
    capacity = {
        c: quantity(counter_quantity(counter, values[counter])) for c, counter, _ in MIG_DIMENSIONS
    }
    for i in range(start, start + size):
        values[f"{MEMORY_SLICE_PREFIX}{i}"] = 1
    doc = device_doc(name, attrs, capacity)
    doc["consumesCounters"] = [
        {"counterSet": counter_set_name(gpu), "counters": counters(values, skip_zero=True)}
    ]
    return PublishedDevice(
        name=name,
        document=doc,
        gpu_uuid=gpu.uuid,
        gpu_minor=gpu.minor,
        is_partition=True,
        max_partitions=None,
        profile=profile.name,
        placement=placement,
        mig=MigBacking(profile.profile_id, profile.slice_count, placement, existing),
    )


def _order(item: tuple[PartitionProfile, tuple[int, int]]) -> tuple[int, int, str, int]:
    p, (start, size) = item
    return (size, p.memory_bytes, p.name, start)


def _parent_attributes(gpu_attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in gpu_attrs.items() if k in PARENT_ATTRIBUTES}


def dynamic_partitions(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], selected: Sequence[str] = ()
) -> list[PublishedDevice]:
    """Every (profile, placement) of the GPU, smallest first; with `selected` (profile
    labels, `unselected_profiles` checked them) those profiles' placements only."""
    parent = _parent_attributes(gpu_attrs)
    profiles = [
        p for p in gpu.partition_profiles if not selected or profile_label(p.name) in selected
    ]
    items = [(p, pl) for p in profiles for pl in p.placements]
    return [_partition(gpu, parent, p, pl, None) for p, pl in sorted(items, key=_order)]


def unselected_profiles(gpu: GpuInfo, selected: Sequence[str]) -> list[str]:
    """The labels of `selected` that name none of the GPU's MIG profiles."""
    offered = {profile_label(p.name) for p in gpu.partition_profiles}
    return [label for label in selected if label not in offered]


def static_partitions(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], owned: Set[tuple[str, int]] = frozenset()
) -> tuple[list[PublishedDevice], list[str]]:
    """The GPU's existing MIG devices but those in `owned` ((GPU UUID, GPU-instance
    id) of the ones this driver created for a prepared claim: its unprepare destroys
    them, so a claim given one would get a dead UUID), and why any existing instance
    is not published (owned, no compute instance, or a profile NVML did not report)."""
    parent = _parent_attributes(gpu_attrs)
    profiles = {p.profile_id: p for p in gpu.partition_profiles}
    devices: list[tuple[PartitionProfile, tuple[int, int], MigInstance]] = []
    skipped: list[str] = []
    for instance in gpu.mig_instances:
        profile = profiles.get(instance.profile_id)
        if (gpu.uuid, instance.gi_id) in owned:
            skipped.append(
                f"GPU instance {instance.gi_id}: created by this driver for a prepared "
                "claim (destroyed at its unprepare)"
            )
        elif profile is None:
            skipped.append(f"GPU instance {instance.gi_id}: unknown profile {instance.profile_id}")
        elif instance.uuid is None:
            skipped.append(f"GPU instance {instance.gi_id} ({profile.name}): no compute instance")
        else:
            devices.append((profile, instance.placement, instance))
    devices.sort(key=lambda d: _order((d[0], d[1])))
    return [_partition(gpu, parent, p, pl, inst) for p, pl, inst in devices], skipped
