"""The counters of a MIG GPU (docs/mig.md, "Slice layout"): its counter set counts the
memory slices, plus only those MIG dimensions (memory, multiprocessors, engines) that
some partitions at disjoint placements could exceed. The scheduler's allocator checks
every consumed counter of every device of a node for every pod, so a counter that can
never refuse anything is pure cost; the published layout must still admit exactly the
combinations that counting every dimension admits."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from typing import Any

import pytest

from driver.devices import mig_counters
from driver.devices import model as dm
from driver.devices.formatting import MIG_DIMENSIONS
from driver.devices.slices import build_slice_specs, validate_slice_specs
from driver.nvml.discovered import GpuInfo, Inventory, MigInstance, PartitionProfile
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from tests.unit.test_device_model import fits, qty

THREE = ("1g10gb", "3g40gb", "7g80gb")
SLICES_OF_8 = {f"memory-slice-{i}" for i in range(8)}
HALVES = {"memory-slices-0-3": {"value": "4"}, "memory-slices-4-7": {"value": "4"}}


def inventory(model: str = "H100-80GB", count: int = 2, **group: Any) -> Inventory:
    fleet = parse_fleet({"gpus": [{"model": model, "count": count, "migMode": "enabled", **group}]})
    return MockBackend(MockNvml(fleet, "node-a")).discover()


def consumed(pool: dm.PoolDevices, name: str) -> dict[str, Any]:
    (consumption,) = pool.device(name).document["consumesCounters"]
    return dict(consumption["counters"])


def test_three_profiles_count_only_two_blocks_of_memory_slices() -> None:
    """1g.10gb x7, 3g.40gb at 0 and 4, 7g.80gb: no disjoint placements exceed any
    dimension, and no placement starts or ends inside slices 0-3 or 4-7, so each half
    is one counter worth 4 (a 1g.10gb takes 1 of its half, a 3g.40gb all 4)."""
    pool = dm.build_pool(inventory(), dm.PoolOptions(mig_profiles=THREE))
    assert {cs["name"]: cs["counters"] for cs in pool.counter_sets} == {
        "gpu-0-counter-set": HALVES,
        "gpu-1-counter-set": HALVES,
    }
    assert consumed(pool, "gpu-0-mig-1g10gb-5") == {"memory-slices-4-7": {"value": "1"}}
    assert consumed(pool, "gpu-1-mig-3g40gb-4") == {"memory-slices-4-7": {"value": "4"}}
    assert consumed(pool, "gpu-0") == consumed(pool, "gpu-0-mig-7g80gb-0") == HALVES
    # What the container gets is still published as capacity.
    capacity = pool.device("gpu-0-mig-1g10gb-5").document["capacity"]
    assert capacity["memory"] == {"value": "9984Mi"} and capacity["multiprocessors"] == {
        "value": "16"
    }
    specs = build_slice_specs(pool, driver="gpu.example.com", node_name="node-a")
    assert validate_slice_specs(specs) == []


def test_a_dimension_disjoint_placements_can_exceed_stays_counted() -> None:
    """Every H100 profile: two 1g.10gb+me at disjoint placements would need two OFA
    engines, the GPU has one, so `ofa-engines` stays; the other dimensions go."""
    pool = dm.build_pool(inventory())
    assert set(pool.counter_sets[0]["counters"]) == SLICES_OF_8 | {"ofa-engines"}
    assert consumed(pool, "gpu-0-mig-1g10gb-me-3") == {
        "memory-slice-3": {"value": "1"},
        "ofa-engines": {"value": "1"},
    }
    assert consumed(pool, "gpu-0-mig-1g10gb-3") == {"memory-slice-3": {"value": "1"}}
    assert set(consumed(pool, "gpu-0")) == SLICES_OF_8 | {"ofa-engines"}
    assert not fits(pool, ["gpu-0-mig-1g10gb-me-0", "gpu-0-mig-1g10gb-me-4"])


def test_static_mig_devices_count_only_their_memory_slices() -> None:
    """MIG devices that exist side by side exceed nothing together."""
    inv = inventory(count=1)
    gpu = inv.gpus[0]
    by_name = {p.name: p for p in gpu.partition_profiles}
    existing = (
        MigInstance(gpu.uuid, 1, by_name["1g.10gb+me"].profile_id, (0, 1), ci_id=0, uuid="MIG-a"),
        MigInstance(gpu.uuid, 2, by_name["1g.10gb"].profile_id, (1, 1), ci_id=0, uuid="MIG-b"),
    )
    static = dataclasses.replace(inv, gpus=(dataclasses.replace(gpu, mig_instances=existing),))
    pool = dm.build_pool(static, dm.PoolOptions(mig_strategy=dm.MigStrategy.STATIC))
    assert pool.counter_sets[0]["counters"] == {"memory-slices-0-7": {"value": "8"}}
    assert {d.placement: consumed(pool, d.name) for d in pool.devices} == {
        (0, 1): {"memory-slices-0-7": {"value": "1"}},
        (1, 1): {"memory-slices-0-7": {"value": "1"}},
    }


def test_memory_blocks_end_where_a_wide_placement_starts_or_ends() -> None:
    """H100 with 1g.10gb x7, 3g.40gb at 0 and 4, 7g.80gb and the whole GPU."""
    spans = [(i, 1) for i in range(7)] + [(0, 4), (4, 4), (0, 8), (0, 8)]
    assert mig_counters.memory_blocks(8, spans) == [range(0, 4), range(4, 8)]
    assert mig_counters.memory_blocks(8, [*spans, (2, 2)]) == [
        range(0, 2),
        range(2, 4),
        range(4, 8),
    ]
    # Two devices at slice 0 (1g.10gb and 1g.10gb+me) would fit one block together.
    assert mig_counters.memory_blocks(8, [*spans, (0, 1)]) == [
        range(0, 1),
        range(1, 2),
        range(2, 3),
        range(3, 4),
        range(4, 8),
    ]
    assert mig_counters.memory_blocks(8, []) == [range(0, 8)]


def test_every_h100_profile_keeps_one_counter_per_slice() -> None:
    """1g.10gb and 1g.10gb+me share each slice 0-6, 2g.20gb and 4g.40gb split the
    halves: every slice is a block of its own."""
    pool = dm.build_pool(inventory())
    assert {k for k in pool.counter_sets[0]["counters"] if "slice" in k} == SLICES_OF_8


def test_without_memory_slices_every_dimension_is_counted() -> None:
    """No memory slices, nothing forbids overlapping placements but the dimensions."""
    inv = inventory(count=1)
    gpu = dataclasses.replace(inv.gpus[0], memory_slices=0)
    pool = dm.build_pool(dataclasses.replace(inv, gpus=(gpu,)), dm.PoolOptions(mig_profiles=THREE))
    names = {counter for _, counter, _ in MIG_DIMENSIONS}
    assert set(pool.counter_sets[0]["counters"]) == names


# ----------------------------------------------------------------- same decisions


def _nvml_allows(gpu: GpuInfo, devices: Sequence[dm.PublishedDevice]) -> bool:
    """The rule the counters encode, NVML's for its profiles: placements pairwise
    disjoint (the whole GPU spans them all) and each profile at most its
    `instanceCount` times (one 1g.10gb+me on an H100)."""
    profiles = {p.profile_id: p for p in gpu.partition_profiles}
    taken: set[int] = set()
    for device in devices:
        start, size = device.placement or (0, gpu.memory_slices)
        span = set(range(start, start + size))
        if span & taken:
            return False
        taken |= span
    count = Counter(d.mig.profile_id for d in devices if d.is_partition and d.mig is not None)
    return all(n <= profiles[profile_id].instance_count for profile_id, n in count.items())


def _published_allow(pool: dm.PoolDevices) -> Callable[[Sequence[dm.PublishedDevice]], bool]:
    """The scheduler's counter rule over the published documents: per counter of a
    set, what the devices consume together stays within it."""
    available = {
        (cs["name"], name): qty(c["value"])
        for cs in pool.counter_sets
        for name, c in cs["counters"].items()
    }
    needs = {
        d.name: [
            ((c["counterSet"], name), qty(v["value"]))
            for c in d.document.get("consumesCounters", [])
            for name, v in c["counters"].items()
        ]
        for d in pool.devices
    }

    def allow(devices: Sequence[dm.PublishedDevice]) -> bool:
        used: dict[tuple[str, str], Fraction] = {}
        for device in devices:
            for key, amount in needs[device.name]:
                used[key] = used.get(key, Fraction(0)) + amount
        return all(amount <= available[key] for key, amount in used.items())

    return allow


def _extensions(
    gpu: GpuInfo, devices: Sequence[dm.PublishedDevice]
) -> Iterator[tuple[list[dm.PublishedDevice], bool]]:
    """Every allowed set and each one-device extension of it (in index order), with
    whether it is allowed: two downward-closed families that agree on all of these
    are the same family."""
    stack: list[tuple[list[dm.PublishedDevice], int]] = [([], 0)]
    while stack:
        chosen, next_index = stack.pop()
        for i in range(next_index, len(devices)):
            candidate = [*chosen, devices[i]]
            allowed = _nvml_allows(gpu, candidate)
            yield candidate, allowed
            if allowed:
                stack.append((candidate, i + 1))


def _go_nvml_profile(
    name: str,
    profile_id: int,
    instances: int,
    mib: int,
    engines: tuple[int, int, int, int, int, int],
    placements: Sequence[tuple[int, int]],
) -> PartitionProfile:
    multiprocessors, copy_engines, decoders, encoders, jpeg, ofa = engines
    return PartitionProfile(
        name=name,
        profile_id=profile_id,
        slice_count=int(name.split("g.")[0]),
        memory_bytes=mib * 2**20,
        multiprocessors=multiprocessors,
        copy_engines=copy_engines,
        decoders=decoders,
        encoders=encoders,
        jpeg_engines=jpeg,
        ofa_engines=ofa,
        placements=tuple(placements),
        instance_count=instances,
    )


SINGLE_SLICES = [(i, 1) for i in range(7)]

# NVIDIA go-nvml v0.13.4-1 (github.com/NVIDIA/go-nvml, the Go module proxy's latest),
# pkg/nvml/mock/gpus/h100.go: H100_SXM5_80GB, the GPU pkg/nvml/mock/dgxh100 serves,
# its h100_80gb_GpuInstanceProfiles and h100_GpuInstancePlacements (what the mock's
# nvmlDeviceGetGpuInstanceProfileInfo and ...PossiblePlacements return). Id is the
# NVML_GPU_INSTANCE_PROFILE_<slot> constant, as that mock reports it; names as its
# comments give them. Engines: (multiprocessors, copy engines, decoders, encoders,
# JPEG, OFA). Unlike our H100 table: 1g.20gb sits at seven one-slice placements yet
# at most 4 exist (5 fit side by side, NVML refuses the fifth); 3g.40gb at (0, 3) and
# (4, 3) and 7g.80gb at (0, 7), so the GPU has 7 memory slices; 7g.80gb has 112 SMs,
# 7 copy engines, 5 decoders and no JPEG or OFA engine, and only 1g.10gb+me has either.
GO_NVML_H100_PROFILES = (
    _go_nvml_profile("1g.10gb", 0, 7, 10240, (16, 1, 1, 0, 0, 0), SINGLE_SLICES),
    _go_nvml_profile("1g.10gb+me", 7, 1, 10240, (16, 1, 1, 0, 1, 1), SINGLE_SLICES),
    _go_nvml_profile("1g.20gb", 9, 4, 20480, (16, 1, 1, 0, 0, 0), SINGLE_SLICES),
    _go_nvml_profile("2g.20gb", 1, 3, 20480, (32, 2, 1, 0, 0, 0), [(0, 2), (2, 2), (4, 2)]),
    _go_nvml_profile("3g.40gb", 2, 2, 40960, (48, 3, 2, 0, 0, 0), [(0, 3), (4, 3)]),
    _go_nvml_profile("4g.40gb", 3, 1, 40960, (64, 4, 2, 0, 0, 0), [(0, 4)]),
    _go_nvml_profile("7g.80gb", 4, 1, 81920, (112, 7, 5, 0, 0, 0), [(0, 7)]),
)


def _go_nvml_h100() -> Inventory:
    """One H100 as go-nvml's mock (dgxh100) reports it: its profile table and
    placements (`GO_NVML_H100_PROFILES`), 80 GiB, 7 memory slices."""
    inv = inventory("H100-80GB", count=1)
    gpu = dataclasses.replace(
        inv.gpus[0],
        memory_bytes=81920 * 2**20,
        memory_slices=7,
        partition_profiles=GO_NVML_H100_PROFILES,
    )
    return dataclasses.replace(inv, gpus=(gpu,))


def _h100_with_a_7g_of_few_engines() -> Inventory:
    """Our H100 with 7g.80gb at 5 decoders and 5 JPEG engines: the full-size profile
    no longer bounds the disjoint splits (seven 1g.10gb take 7 decoders)."""
    inv = inventory("H100-80GB", count=1)
    gpu = inv.gpus[0]
    table = tuple(
        dataclasses.replace(p, decoders=5, jpeg_engines=5) if p.name == "7g.80gb" else p
        for p in gpu.partition_profiles
    )
    return dataclasses.replace(inv, gpus=(dataclasses.replace(gpu, partition_profiles=table),))


TABLES: dict[str, Callable[[], Inventory]] = {
    "go-nvml-H100": _go_nvml_h100,
    "H100-7g-few-engines": _h100_with_a_7g_of_few_engines,
}


@pytest.mark.parametrize("table", sorted(TABLES))
def test_a_table_the_full_size_profile_does_not_bound_refuses_no_split_nvml_allows(
    table: str,
) -> None:
    pool = dm.build_pool(TABLES[table]())
    assert fits(pool, [f"gpu-0-mig-1g10gb-{i}" for i in range(7)])
    assert not fits(pool, ["gpu-0-mig-1g10gb-me-0", "gpu-0-mig-1g10gb-me-4"])


def test_go_nvml_h100_admits_four_1g20gb_not_five() -> None:
    """go-nvml's H100 places 1g.20gb at every single slice, 5 fit side by side, and
    its instanceCount is 4: NVML refuses the fifth, so must the scheduler."""
    pool = dm.build_pool(_go_nvml_h100())
    # 1g.20gb's own counter (profile 9), worth its instanceCount; memory no longer
    # refuses anything; two 1g.10gb+me would take the one JPEG and OFA engine.
    assert pool.counter_sets[0]["counters"] == {
        **{f"memory-slice-{i}": {"value": "1"} for i in range(7)},
        "jpeg-engines": {"value": "1"},
        "ofa-engines": {"value": "1"},
        "profile-9-instances": {"value": "4"},
    }
    assert consumed(pool, "gpu-0-mig-1g20gb-5") == {
        "memory-slice-5": {"value": "1"},
        "profile-9-instances": {"value": "1"},
    }
    assert consumed(pool, "gpu-0")["profile-9-instances"] == {"value": "4"}
    assert fits(pool, [f"gpu-0-mig-1g20gb-{i}" for i in range(4)])
    assert fits(pool, [f"gpu-0-mig-1g20gb-{i}" for i in range(4)] + ["gpu-0-mig-1g10gb-4"])
    assert not fits(pool, [f"gpu-0-mig-1g20gb-{i}" for i in range(5)])
    assert not fits(pool, [f"gpu-0-mig-1g20gb-{i}" for i in (0, 2, 3, 5, 6)])
    specs = build_slice_specs(pool, driver="gpu.example.com", node_name="node-a")
    assert validate_slice_specs(specs) == []


@pytest.mark.parametrize(
    ("model", "profiles"),
    [(m, ()) for m in ("A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB", *TABLES)]
    + [(m, THREE) for m in ("A100-80GB", "H100-80GB", "go-nvml-H100")]
    + [("go-nvml-H100", ("1g20gb", "7g80gb"))],
)
def test_counters_admit_exactly_what_nvml_admits(model: str, profiles: tuple[str, ...]) -> None:
    inv = TABLES[model]() if model in TABLES else inventory(model, count=1)
    pool = dm.build_pool(inv, dm.PoolOptions(mig_profiles=profiles))
    published_allow = _published_allow(pool)
    checked = 0
    for chosen, allowed in _extensions(inv.gpus[0], pool.devices):
        assert published_allow(chosen) == allowed, [d.name for d in chosen]
        checked += 1
    assert checked > len(pool.devices)
