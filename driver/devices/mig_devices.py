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

from collections.abc import Iterable, Sequence, Set
from typing import Any

from driver.devices.device_types import MigBacking, PublishedDevice
from driver.devices.formatting import MIG_DIMENSIONS, counter_quantity, counters, profile_label
from driver.devices.mig_counters import MEMORY_SLICE_PREFIX, counter_set_name, counter_values
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


def _profile_capacity(profile: PartitionProfile) -> dict[str, Any]:
    """What a MIG device of the profile gives the container: memory, SMs, engines."""
    return {
        cap: {"value": counter_quantity(counter, getattr(profile, attr))}
        for cap, counter, attr in MIG_DIMENSIONS
    }


def _consumes(gpu: GpuInfo, values: dict[str, int]) -> list[dict[str, Any]]:
    return [{"counterSet": counter_set_name(gpu), "counters": counters(values, skip_zero=True)}]


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
    attrs = {k: v for k, v in gpu_attrs.items() if k != "uuid"}
    attrs |= {"parentUUID": {"string": gpu.uuid}, "migProfile": {"string": full.name}}
    doc: dict[str, Any] = {
        "name": f"gpu-{gpu.minor}",
        "attributes": attrs,
        "capacity": {**capacity, **_profile_capacity(full)},
        "consumesCounters": _consumes(gpu, counter_values(gpu)),
    }
    mig = MigBacking(full.profile_id, full.slice_count, (0, gpu.memory_slices))
    return PublishedDevice(
        doc["name"],
        doc,
        gpu.uuid,
        gpu.minor,
        is_partition=False,
        max_partitions=max_partitions,
        mig=mig,
    )


# A partition to publish: its profile, placement and (static) existing MIG device.
Candidate = tuple[PartitionProfile, tuple[int, int], MigInstance | None]


def _partitions(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], candidates: Iterable[Candidate]
) -> list[PublishedDevice]:
    """A device per candidate, smallest first: by size, memory, profile name, start."""
    parent = {k: v for k, v in gpu_attrs.items() if k in PARENT_ATTRIBUTES}
    devices = []
    for profile, (start, size), existing in sorted(
        candidates, key=lambda c: (c[1][1], c[0].memory_bytes, c[0].name, c[1][0])
    ):
        attrs = {
            "profile": {"string": profile.name},
            "parentUUID": {"string": gpu.uuid},
            "parentIndex": {"int": gpu.index},
            "placementStart": {"int": start},
            "placementSize": {"int": size},
            "isolated": {"bool": True},
            **parent,
        }
        if existing is not None:  # static: the MIG device's UUID
            attrs["uuid"] = {"string": existing.uuid}
        values = {counter: getattr(profile, attr) for _, counter, attr in MIG_DIMENSIONS}
        values.update({f"{MEMORY_SLICE_PREFIX}{i}": 1 for i in range(start, start + size)})
        name = partition_name(gpu, profile, start)
        doc = {
            "name": name,
            "attributes": attrs,
            "capacity": _profile_capacity(profile),
            "consumesCounters": _consumes(gpu, values),
        }
        mig = MigBacking(profile.profile_id, profile.slice_count, (start, size), existing)
        devices.append(
            PublishedDevice(
                name,
                doc,
                gpu.uuid,
                gpu.minor,
                is_partition=True,
                max_partitions=None,
                profile=profile.name,
                placement=(start, size),
                mig=mig,
            )
        )
    return devices


def dynamic_partitions(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], selected: Sequence[str]
) -> list[PublishedDevice]:
    """Every (profile, placement) of the GPU; with `selected` (profile labels, checked
    by the caller) those profiles' placements only."""
    profiles = [
        p for p in gpu.partition_profiles if not selected or profile_label(p.name) in selected
    ]
    return _partitions(gpu, gpu_attrs, [(p, pl, None) for p in profiles for pl in p.placements])


def static_partitions(
    gpu: GpuInfo, gpu_attrs: dict[str, Any], owned: Set[tuple[str, int]]
) -> tuple[list[PublishedDevice], list[str]]:
    """The GPU's existing MIG devices but those in `owned` ((GPU UUID, GPU-instance
    id) of the ones this driver created for a prepared claim: its unprepare destroys
    them, so a claim given one would get a dead UUID), and why any existing instance
    is not published (owned, no compute instance, or a profile NVML did not report)."""
    profiles = {p.profile_id: p for p in gpu.partition_profiles}
    candidates: list[Candidate] = []
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
            candidates.append((profile, instance.placement, instance))
    return _partitions(gpu, gpu_attrs, candidates), skipped
