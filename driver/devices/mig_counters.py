"""The counter set of a GPU in MIG mode (pure; docs/mig.md, "Slice layout").

One set `gpu-<minor>-counter-set` per GPU: its memory slices, counted in blocks where
that admits the same sets (`memory_blocks`), and those of the memory, multiprocessor
and engine counters that some published partitions at disjoint placements could take
beyond what the GPU offers (`capacities`: the most that partitions NVML lets exist
together take), plus `profile-<id>-instances` (worth the profile's `instanceCount`)
for a profile whose `instanceCount` those would not enforce (`instance_limits`). A
partition consumes its memory slices, its profile's share of those counters and 1 of
its profile's instances, the whole GPU all of them, so the scheduler never hands out
overlapping partitions, a GPU together with one of its partitions, or a set NVML
would refuse - and refuses no set NVML allows.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from driver.devices.device_types import PublishedDevice
from driver.devices.formatting import MIG_DIMENSIONS, counters
from driver.nvml.discovered import GpuInfo, PartitionProfile

MEMORY_SLICE_PREFIX = "memory-slice-"
_DIMENSIONS = frozenset(counter for _, counter, _ in MIG_DIMENSIONS)


def counter_set_name(gpu: GpuInfo) -> str:
    return f"gpu-{gpu.minor}-counter-set"


def counter_values(gpu: GpuInfo) -> dict[str, int]:
    """Counter capacities of a GPU's set before its partitions are known: per-dimension
    max over profiles + memory slices (`counted` raises a dimension to what `capacities`
    finds)."""
    profiles = gpu.partition_profiles
    values = {c: max(getattr(p, attr) for p in profiles) for _, c, attr in MIG_DIMENSIONS}
    return values | {f"{MEMORY_SLICE_PREFIX}{i}": 1 for i in range(gpu.memory_slices)}


def instances_counter(profile_id: int) -> str:
    return f"profile-{profile_id}-instances"


Placed = tuple[tuple[PartitionProfile, tuple[int, int]], ...]  # sorted by placement


def _placed(gpu: GpuInfo, partitions: Sequence[PublishedDevice]) -> Placed:
    """The partitions' profiles and placements, sorted by placement."""
    profiles = {p.profile_id: p for p in gpu.partition_profiles}
    return tuple(
        sorted(
            (
                (profiles[p.mig.profile_id], p.mig.placement)
                for p in partitions
                if p.mig is not None
            ),
            key=lambda item: (item[1], item[0].profile_id),
        )
    )


def _in_slices(gpu: GpuInfo, placed: Placed) -> bool:
    """Whether the GPU has memory slices and every placement lies within them."""
    slices = gpu.memory_slices
    return slices >= 1 and all(start >= 0 and start + size <= slices for _, (start, size) in placed)


@functools.lru_cache(maxsize=64)
def _most_together(placed: Placed, unlimited: frozenset[int] = frozenset()) -> dict[str, int]:
    """Per MIG dimension counter, the most that placed partitions NVML lets exist
    together take: placements pairwise disjoint, each profile (but those `unlimited`)
    at most its `instanceCount` times. Every such set is walked (2319 with every H100
    profile); GPUs of one model share the answer."""
    best = dict.fromkeys((counter for _, counter, _ in MIG_DIMENSIONS), 0)
    used: Counter[int] = Counter()

    def walk(first: int, end: int, totals: tuple[int, ...]) -> None:
        for counter, total in zip(best, totals, strict=True):
            best[counter] = max(best[counter], total)
        for i in range(first, len(placed)):
            profile, (start, size) = placed[i]
            pid = profile.profile_id
            if start < end or (pid not in unlimited and used[pid] >= profile.instance_count):
                continue
            used[pid] += 1
            shares = (getattr(profile, attr) for _, _, attr in MIG_DIMENSIONS)
            walk(i + 1, start + size, tuple(t + v for t, v in zip(totals, shares, strict=True)))
            used[pid] -= 1

    walk(0, 0, (0,) * len(best))
    return best


def capacities(gpu: GpuInfo, placed: Placed) -> dict[str, int]:
    """Per MIG dimension counter, what the GPU offers: the most that partitions NVML
    lets exist together take, and no less than any profile's share. On NVIDIA's
    tables the full-size profile's share bounds every such set; on one where it does
    not (go-nvml's mock H100: 7g.80gb has 5 decoders, seven 1g.10gb take 7) the sets
    decide, so that the scheduler refuses none of them."""
    values = counter_values(gpu)
    return {counter: max(values[counter], n) for counter, n in _most_together(placed).items()}


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


def binding_dimensions(
    gpu: GpuInfo, placed: Placed, most: dict[str, int], limits: Mapping[int, int] | None = None
) -> set[str]:
    """The MIG dimension counters (memory, multiprocessors, engines) some of these
    partitions at pairwise disjoint placements would take beyond `most` (the GPU's
    `capacities`) together; with `limits` (`instance_limits`), only sets that keep
    each of those profiles within its instance counter. Overlapping placements are
    refused by the memory-slice counters already, and the whole GPU spans every slice,
    so a dimension no such set can exceed never refuses an allocation. Without memory
    slices every dimension counts."""
    if not _in_slices(gpu, placed):
        return set(_DIMENSIONS)
    if limits:
        unlimited = frozenset(p.profile_id for p, _ in placed if p.profile_id not in limits)
        together = _most_together(placed, unlimited)
        return {counter for counter in _DIMENSIONS if together[counter] > most[counter]}
    return {
        counter
        for _, counter, attr in MIG_DIMENSIONS
        if _most_at_disjoint_placements(
            gpu.memory_slices,
            [(placement, getattr(profile, attr)) for profile, placement in placed],
        )
        > most[counter]
    }


def instance_limits(
    gpu: GpuInfo, placed: Placed, most: dict[str, int], binding: set[str]
) -> dict[int, int]:
    """Profile id -> `instanceCount` for each profile whose `instanceCount` the
    memory-slice counters and the `binding` dimensions (at `most`) would not enforce:
    more of its partitions than that fit at pairwise disjoint placements (without
    memory slices: are published), and `instanceCount` + 1 of them take no binding
    dimension beyond `most`. NVIDIA's tables place a profile at no more disjoint
    placements than its `instanceCount`, but for those whose engines refuse a second
    one (1g.10gb+me); go-nvml's mock H100 places 1g.20gb (4 at most) at every single
    slice. Any set that holds more of another profile holds `instanceCount` + 1 of it,
    which a binding dimension refuses."""
    in_slices = _in_slices(gpu, placed)
    spans: dict[PartitionProfile, list[tuple[tuple[int, int], int]]] = {}
    for profile, placement in placed:
        spans.setdefault(profile, []).append((placement, 1))
    limits = {}
    for profile, weighted in spans.items():
        n = profile.instance_count
        fit = (
            _most_at_disjoint_placements(gpu.memory_slices, weighted)
            if in_slices
            else len(weighted)
        )
        if fit > n and all(
            (n + 1) * getattr(profile, attr) <= most[counter]
            for _, counter, attr in MIG_DIMENSIONS
            if counter in binding
        ):
            limits[profile.profile_id] = n
    return limits


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
            first, last = block.start, block.stop - 1
            name = f"memory-slice-{first}" if first == last else f"memory-slices-{first}-{last}"
            out[name] = {"value": str(taken[block])}
    return out


def counted(
    gpu: GpuInfo, devices: Sequence[PublishedDevice]
) -> tuple[list[PublishedDevice], dict[str, Any]]:
    """The GPU's counter set with its memory slices in blocks (`memory_blocks`) and its
    binding dimensions only, and its devices consuming only those (docs/mig.md, "Slice
    layout"): the scheduler's allocator reads every consumed counter of every device of
    a node for every pod, and the allocations it allows stay the same."""
    placed = _placed(gpu, [d for d in devices if d.is_partition])
    most = capacities(gpu, placed)
    binding = binding_dimensions(gpu, placed, most)
    limits = instance_limits(gpu, placed, most, binding)
    if limits:  # what the instance counters refuse, no dimension needs to
        binding = binding_dimensions(gpu, placed, most, limits)
    full = counters({**counter_values(gpu), **most}, skip_zero=False)
    kept = {k: v for k, v in full.items() if k not in _DIMENSIONS - binding}
    spans = [d.mig.placement for d in devices if d.mig is not None]
    slices = gpu.memory_slices
    if all(start >= 0 and size > 0 and start + size <= slices for start, size in spans):
        blocks = memory_blocks(slices, spans)
    else:  # placements NVML should not report: count slice by slice
        blocks = [range(i, i + 1) for i in range(slices)]
    instances = {instances_counter(p): {"value": str(n)} for p, n in limits.items()}

    def recounted(device: PublishedDevice) -> PublishedDevice:
        """The device consuming only the `kept` counters, its memory slices in `blocks`,
        and the instance counters: the whole GPU takes each kept dimension and each
        instance counter whole, a partition 1 of its profile's."""
        (consumed,) = device.document["consumesCounters"]
        whole = not device.is_partition
        taken = {
            k: kept[k] if whole and not k.startswith(MEMORY_SLICE_PREFIX) else v
            for k, v in consumed["counters"].items()
            if k in kept
        }
        own = instances
        if not whole:
            name = instances_counter(device.mig.profile_id) if device.mig else ""
            own = {name: {"value": "1"}} if name in instances else {}
        consumption = {**consumed, "counters": {**_blocked_counters(taken, blocks), **own}}
        return dataclasses.replace(
            device, document={**device.document, "consumesCounters": [consumption]}
        )

    counter_set = {
        "name": counter_set_name(gpu),
        "counters": {**_blocked_counters(kept, blocks), **instances},
    }
    return [recounted(d) for d in devices], counter_set
