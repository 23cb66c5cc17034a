"""The devices of one GPU in MIG mode (pure): dynamic or static (docs/mig.md).

Every partition is a device `gpu-<minor>-mig-<profile label>-<placement start>`
consuming its memory slices and its profile's share of the GPU's counters
(driver/devices/mig_counters.py); it carries `isolated: true` (its own memory, SMs
and engines, unlike a `--gpu-partitions` partition).

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

from collections.abc import Sequence, Set
from typing import Any

from driver.devices.device_types import MigBacking, PublishedDevice
from driver.devices.formatting import (
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
from driver.devices.mig_counters import (
    MEMORY_SLICE_PREFIX,
    counter_set_name,
    counter_values,
)
from driver.nvml.discovered import GpuInfo, MigInstance, PartitionProfile

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


def partition_name(gpu: GpuInfo, profile: PartitionProfile, start: int) -> str:
    return f"gpu-{gpu.minor}-mig-{profile_label(profile.name)}-{start}"


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
    values = counter_values(gpu)
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
