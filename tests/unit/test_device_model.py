"""Inventory -> PoolDevices: GPU attributes, MIG counters, reference partitions."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from fractions import Fraction
from typing import Any

import pytest

from driver.devices import formatting
from driver.devices import model as dm
from driver.nvml.discovered import GpuInfo, Inventory, MigInstance
from driver.nvml.mock.fleet import default_fleet, example_fleet, mock_gpu_uuid, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml

UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def qty(text: str) -> Fraction:
    for suffix, mult in UNITS.items():
        if text.endswith(suffix):
            return Fraction(text[: -len(suffix)]) * mult
    return Fraction(text)


def inventory(fleet_data: dict[str, Any] | None = None, node: str = "node-a") -> Inventory:
    fleet = parse_fleet(fleet_data) if fleet_data else default_fleet()
    return MockBackend(MockNvml(fleet, node)).discover()


def fits(pool: dm.PoolDevices, names: Iterable[str]) -> bool:
    """Could the scheduler allocate all these devices together, counters-wise?"""
    capacity: dict[tuple[str, str], Fraction] = {}
    for cs in pool.counter_sets:
        for counter, v in cs["counters"].items():
            capacity[(cs["name"], counter)] = qty(v["value"])
    used: dict[tuple[str, str], Fraction] = {}
    for name in names:
        for c in pool.device(name).document.get("consumesCounters", []):
            for counter, v in c["counters"].items():
                key = (c["counterSet"], counter)
                used[key] = used.get(key, Fraction(0)) + qty(v["value"])
    return all(v <= capacity[k] for k, v in used.items())


def test_quantities() -> None:
    assert formatting.binary_quantity(80 * 2**30) == "80Gi"
    assert formatting.binary_quantity(20 * 2**30) == "20Gi"
    assert formatting.binary_quantity(28633115306) == "28633115306"
    assert formatting.binary_quantity(9984 * 2**20) == "9984Mi"
    assert formatting.binary_quantity(1536) == "1536"
    assert formatting.binary_quantity(1024) == "1Ki"
    assert formatting.binary_quantity(0) == "0"
    with pytest.raises(ValueError):
        formatting.binary_quantity(-1)
    assert formatting.decimal_quantity(25) == "25"


@pytest.mark.parametrize(
    ("raw", "semver"),
    [
        ("580.95.05", "580.95.5"),
        ("9.0", "9.0.0"),
        ("13.0", "13.0.0"),
        ("1.0.0", "1.0.0"),
        ("550", "550.0.0"),
        ("470.82.01.1", "470.82.1"),
        ("v1.2.3-rc1", "1.2.3"),
        ("garbage", None),
        (None, None),
    ],
)
def test_normalize_version(raw: str | None, semver: str | None) -> None:
    assert formatting.normalize_version(raw) == semver


def test_profile_label() -> None:
    assert formatting.profile_label("1g.10gb") == "1g10gb"
    assert formatting.profile_label("1g.10gb+me") == "1g10gb-me"
    assert formatting.profile_label("1c.2g.10gb") == "1c2g10gb"
    assert formatting.profile_label("+++") == "profile"


def test_pool_options_validation() -> None:
    with pytest.raises(ValueError):
        dm.PoolOptions(gpu_partitions=-1)


def test_default_fleet_pool_shape() -> None:
    pool = dm.build_pool(inventory())
    assert len(pool.devices) == 8 * 26
    assert [cs["name"] for cs in pool.counter_sets] == [f"gpu-{i}-counter-set" for i in range(8)]
    gpus = [d for d in pool.devices if not d.is_partition]
    assert [d.name for d in gpus] == [f"gpu-{i}" for i in range(8)]
    assert len({d.name for d in pool.devices}) == len(pool.devices)


def test_gpu_attributes_and_capacity() -> None:
    inv = inventory()
    pool = dm.build_pool(inv)
    gpu = pool.device("gpu-2")
    attrs = gpu.document["attributes"]
    assert attrs["index"] == {"int": 2}
    # MIG on: delivered as its 7g.80gb MIG device, so no `uuid` (test_whole_mig_gpu.py).
    assert "uuid" not in attrs and attrs["parentUUID"] == {"string": inv.gpus[2].uuid}
    assert attrs["model"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert attrs["driverVersion"] == {"version": "580.95.5"}
    assert attrs["cudaDriverVersion"] == {"version": "13.0.0"}
    assert attrs["cudaComputeCapability"] == {"version": "9.0.0"}
    assert attrs["brand"] == {"string": "Nvidia"}
    assert attrs["architecture"] == {"string": "Hopper"}
    assert attrs["migCapable"] == {"bool": True}
    assert attrs["maxPartitions"] == {"int": 7}
    assert attrs["resource.kubernetes.io/pciBusID"] == {"string": "0000:3a:00.0"}
    cap = gpu.document["capacity"]
    assert cap["memory"] == {"value": "81152Mi"} and cap["compute"] == {"value": "100"}
    assert cap["multiprocessors"] == {"value": "132"} and cap["copyEngines"] == {"value": "8"}
    assert (gpu.gpu_uuid, gpu.gpu_minor, gpu.is_partition) == (inv.gpus[2].uuid, 2, False)
    assert gpu.max_partitions == 7 and gpu.profile is None and gpu.placement is None


def test_not_supported_attributes_are_omitted() -> None:
    gpu = GpuInfo(
        index=0,
        minor=4,
        uuid="GPU-x",
        product_name="Tesla T4",
        pci_bus_id="0000:3b:00.0",
        memory_bytes=None,
    )
    pool = dm.build_pool(
        Inventory(
            backend="nvml", driver_version="535.104.05", cuda_driver_version=None, gpus=(gpu,)
        )
    )
    (device,) = pool.devices
    attrs = device.document["attributes"]
    assert device.name == "gpu-4"
    assert set(attrs) == {
        "index",
        "uuid",
        "model",
        "driverVersion",
        "productName",
        "migCapable",
        "resource.kubernetes.io/pciBusID",
    }
    assert attrs["driverVersion"] == {"version": "535.104.5"}
    assert device.document["capacity"] == {"compute": {"value": "100"}}
    assert "consumesCounters" not in device.document
    assert device.max_partitions is None and pool.counter_sets == ()


def test_mig_partition_devices() -> None:
    inv = inventory()
    pool = dm.build_pool(inv)
    d = pool.device("gpu-1-mig-1g10gb-me-3")
    assert d.is_partition and d.max_partitions is None
    assert d.profile == "1g.10gb+me" and d.placement == (3, 1)
    assert d.gpu_uuid == inv.gpus[1].uuid and d.gpu_minor == 1
    attrs = d.document["attributes"]
    assert attrs["profile"] == {"string": "1g.10gb+me"}
    assert attrs["parentUUID"] == {"string": inv.gpus[1].uuid}
    assert attrs["placementStart"] == {"int": 3} and attrs["placementSize"] == {"int": 1}
    assert attrs["model"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert "uuid" not in attrs and "maxPartitions" not in attrs
    assert d.document["capacity"]["memory"] == {"value": "9984Mi"}
    assert d.document["capacity"]["ofaEngines"] == {"value": "1"}
    (consumption,) = d.document["consumesCounters"]
    assert consumption["counterSet"] == "gpu-1-counter-set"
    assert consumption["counters"]["memory-slice-3"] == {"value": "1"}
    assert "memory-slice-2" not in consumption["counters"]
    assert consumption["counters"]["ofa-engines"] == {"value": "1"}
    three = pool.device("gpu-1-mig-3g40gb-4").document["consumesCounters"][0]["counters"]
    assert {k for k in three if k.startswith("memory-slice-")} == {
        f"memory-slice-{i}" for i in range(4, 8)
    }
    names = [x.name for x in pool.devices_of_gpu(inv.gpus[1].uuid)]
    assert names[0] == "gpu-1" and len(names) == 26
    assert names[1:8] == [f"gpu-1-mig-1g10gb-{s}" for s in range(7)]
    assert names[-1] == "gpu-1-mig-7g80gb-0"


def test_counter_set_and_whole_gpu_consumption() -> None:
    """The set counts the memory slices and the one engine two 1g.10gb+me at disjoint
    placements would both need; memory, multiprocessors and the other engines never
    run out before the slices do (docs/mig.md, "Slice layout")."""
    pool = dm.build_pool(inventory())
    cs = pool.counter_sets[0]
    counters = cs["counters"]
    assert counters["ofa-engines"] == {"value": "1"}
    for name in ("memory", "multiprocessors", "copy-engines", "decoders", "encoders"):
        assert name not in counters
    assert [f"memory-slice-{i}" for i in range(8)] == [k for k in counters if "slice" in k]
    whole = pool.device("gpu-0").document["consumesCounters"][0]["counters"]
    nonzero = {k: v for k, v in counters.items() if v != {"value": "0"}}
    assert whole == nonzero


def test_counters_forbid_overlaps_and_gpu_plus_partition() -> None:
    pool = dm.build_pool(inventory())
    assert fits(pool, ["gpu-0"])
    assert not fits(pool, ["gpu-0", "gpu-0-mig-1g10gb-6"])
    assert fits(pool, ["gpu-0", "gpu-1-mig-1g10gb-6"])  # other GPU
    assert not fits(pool, ["gpu-0-mig-3g40gb-0", "gpu-0-mig-2g20gb-2"])  # slices 0-3 vs 2-3
    assert not fits(pool, ["gpu-0-mig-1g10gb-0", "gpu-0-mig-1g10gb-me-0"])
    assert fits(pool, ["gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"])
    assert fits(pool, ["gpu-0-mig-4g40gb-0", "gpu-0-mig-2g20gb-4", "gpu-0-mig-1g20gb-6"])
    assert fits(pool, [f"gpu-0-mig-1g10gb-{s}" for s in range(7)])
    # Only one +me instance: the OFA engine is consumed once.
    assert not fits(pool, ["gpu-0-mig-1g10gb-me-0", "gpu-0-mig-1g10gb-me-4"])


@pytest.mark.parametrize("model", ["A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"])
def test_any_pair_of_partitions_fits_iff_placements_do_not_overlap(model: str) -> None:
    pool = dm.build_pool(inventory({"gpus": [{"model": model}]}))
    parts = [d for d in pool.devices if d.is_partition]
    for a, b in itertools.combinations(parts, 2):
        assert a.placement is not None and b.placement is not None
        sa = set(range(a.placement[0], sum(a.placement)))
        sb = set(range(b.placement[0], sum(b.placement)))
        both_me = a.profile == b.profile and (a.profile or "").endswith("+me")
        assert fits(pool, [a.name, b.name]) == (not sa & sb and not both_me), (a.name, b.name)


def test_mig_disabled_or_off_publishes_whole_gpus_only() -> None:
    inv = inventory({"gpus": [{"model": "H100-80GB", "count": 2, "migMode": "disabled"}]})
    pool = dm.build_pool(inv)
    assert [d.name for d in pool.devices] == ["gpu-0", "gpu-1"]
    assert pool.counter_sets == ()
    assert pool.devices[0].document["attributes"]["migCapable"] == {"bool": True}


REFERENCE_UUIDS = [
    mock_gpu_uuid("dra-example-driver-cluster-worker", i, prefix="gpu") for i in (0, 1)
]


def test_example_reproduces_reference_devices() -> None:
    inv = MockBackend(MockNvml(example_fleet(), "dra-example-driver-cluster-worker")).discover()
    pool = dm.build_pool(inv)
    assert pool.devices[1].document == {
        "name": "gpu-1",
        "attributes": {
            "index": {"int": 1},
            "uuid": {"string": REFERENCE_UUIDS[1]},
            "model": {"string": "LATEST-GPU-MODEL"},
            "driverVersion": {"version": "1.0.0"},
        },
        "capacity": {"memory": {"value": "80Gi"}, "compute": {"value": "100"}},
        "allowMultipleAllocations": False,
    }
    assert pool.devices[0].max_partitions is None  # the reference sets no limit


@pytest.mark.parametrize(
    ("n", "memory", "compute"), [(4, "20Gi", "25"), (2, "40Gi", "50"), (3, "28633115306", "33")]
)
def test_reference_gpu_partitions(n: int, memory: str, compute: str) -> None:
    inv = MockBackend(MockNvml(example_fleet(2), "dra-example-driver-cluster-worker")).discover()
    pool = dm.build_pool(inv, dm.PoolOptions(gpu_partitions=n))
    names = [d.name for d in pool.devices]
    expected = []
    for i in range(2):
        expected += [f"gpu-{i}-partition-{j}" for j in range(n)] + [f"gpu-{i}-full"]
    assert names == expected
    assert pool.counter_sets[0] == {
        "name": "gpu-0-counters",
        "counters": {"memory": {"value": "80Gi"}, "compute": {"value": "100"}},
    }
    part = pool.device("gpu-1-partition-0")
    assert part.is_partition and part.max_partitions is None
    assert part.document["attributes"] == {
        "index": {"int": 1},
        "uuid": {"string": REFERENCE_UUIDS[1]},
        "model": {"string": "LATEST-GPU-MODEL"},
        "driverVersion": {"version": "1.0.0"},
        "partition": {"int": 0},
        "partitionable": {"bool": True},
        "isolated": {"bool": False},
    }
    assert part.document["capacity"] == {"memory": {"value": memory}, "compute": {"value": compute}}
    assert part.document["consumesCounters"] == [
        {"counterSet": "gpu-1-counters", "counters": part.document["capacity"]}
    ]
    full = pool.device("gpu-1-full")
    assert not full.is_partition
    assert full.document["attributes"]["full"] == {"bool": True}
    assert full.document["capacity"] == {"memory": {"value": "80Gi"}, "compute": {"value": "100"}}
    assert not fits(pool, ["gpu-1-full", "gpu-1-partition-0"])
    assert fits(pool, [f"gpu-1-partition-{j}" for j in range(n)])


def test_gpu_partitions_replace_mig_on_real_models() -> None:
    pool = dm.build_pool(inventory(), dm.PoolOptions(gpu_partitions=2))
    assert len(pool.devices) == 8 * 3
    assert pool.counter_sets[0]["name"] == "gpu-0-counters"
    attrs = pool.device("gpu-0-full").document["attributes"]
    assert attrs["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert pool.device("gpu-0-full").max_partitions == 7


def test_lookup_errors() -> None:
    pool = dm.build_pool(inventory())
    with pytest.raises(KeyError):
        pool.device("gpu-99")
    assert pool.devices_of_gpu("GPU-none") == ()


def test_empty_inventory() -> None:
    pool = dm.build_pool(Inventory(backend="nvml", driver_version="1", cuda_driver_version=None))
    assert pool.devices == () and pool.counter_sets == ()


# -- MIG strategies ------------------------------------------------------------------


def _with_instances(inv: Inventory, by_minor: dict[int, tuple[MigInstance, ...]]) -> Inventory:
    gpus = tuple(dataclasses.replace(g, mig_instances=by_minor.get(g.minor, ())) for g in inv.gpus)
    return dataclasses.replace(inv, gpus=gpus)


def _instance(inv: Inventory, minor: int, profile: str, start: int, gi: int) -> MigInstance:
    gpu = inv.gpus[minor]
    p = next(p for p in gpu.partition_profiles if p.name == profile)
    size = next(sz for st, sz in p.placements if st == start)
    return MigInstance(gpu.uuid, gi, p.profile_id, (start, size), ci_id=0, uuid=f"MIG-{gi:08x}")


TWO_H100 = {"gpus": [{"model": "H100-80GB", "count": 2}]}


def test_dynamic_whole_gpu_is_backed_by_the_full_size_profile() -> None:
    pool = dm.build_pool(inventory(TWO_H100))
    whole = pool.device("gpu-0")
    assert whole.mig is not None and whole.mig.placement == (0, 8)
    full = next(p for p in inventory(TWO_H100).gpus[0].partition_profiles if p.name == "7g.80gb")
    assert (whole.mig.profile_id, whole.mig.slice_count) == (full.profile_id, 7)
    part = pool.device("gpu-0-mig-1g10gb-3")
    assert part.mig is not None and part.mig.existing is None
    assert part.mig.placement == (3, 1) and part.mig.slice_count == 1
    assert pool.mig_modes == dict.fromkeys((g.uuid for g in inventory(TWO_H100).gpus), "dynamic")


def test_auto_publishes_exactly_the_foreign_instances_of_a_gpu() -> None:
    inv = inventory(TWO_H100)
    small = _instance(inv, 0, "1g.10gb", 0, gi=9)
    big = _instance(inv, 0, "3g.40gb", 4, gi=2)
    pool = dm.build_pool(_with_instances(inv, {0: (small, big)}))

    gpu0 = [d.name for d in pool.devices_of_gpu(inv.gpus[0].uuid)]
    assert gpu0 == ["gpu-0-mig-1g10gb-0", "gpu-0-mig-3g40gb-4"]  # no whole GPU, no overlap
    static = pool.device("gpu-0-mig-3g40gb-4")
    assert static.document["attributes"]["uuid"] == {"string": big.uuid}
    assert static.mig is not None and static.mig.existing == big
    assert pool.mig_modes[inv.gpus[0].uuid] == "static"
    assert pool.mig_modes[inv.gpus[1].uuid] == "dynamic"
    assert (
        "gpu-1" in [d.name for d in pool.devices]
        and len(pool.devices_of_gpu(inv.gpus[1].uuid)) > 20
    )


def test_instances_the_driver_created_keep_the_gpu_dynamic() -> None:
    inv = inventory(TWO_H100)
    mine = _instance(inv, 0, "1g.10gb", 2, gi=11)
    pool = dm.build_pool(_with_instances(inv, {0: (mine,)}), owned_mig={(mine.gpu_uuid, 11)})
    assert pool.mig_modes[inv.gpus[0].uuid] == "dynamic"
    assert "gpu-0" in [d.name for d in pool.devices]


def test_dynamic_strategy_refuses_foreign_instances_naming_them() -> None:
    inv = inventory(TWO_H100)
    foreign = _instance(inv, 1, "2g.20gb", 2, gi=4)
    options = dm.PoolOptions(mig_strategy=dm.MigStrategy.DYNAMIC)
    with pytest.raises(dm.PoolError, match=r"GPU 1 .*GPU instance 4 .*--mig-strategy=auto"):
        dm.build_pool(_with_instances(inv, {1: (foreign,)}), options)


def test_static_strategy_without_usable_instances_publishes_nothing_and_says_why() -> None:
    inv = inventory(TWO_H100)
    half = dataclasses.replace(_instance(inv, 0, "1g.10gb", 0, gi=9), ci_id=None, uuid=None)
    options = dm.PoolOptions(mig_strategy=dm.MigStrategy.STATIC)
    pool = dm.build_pool(_with_instances(inv, {0: (half,)}), options)
    assert pool.devices == ()
    assert any("GPU instance 9" in n and "no compute instance" in n for n in pool.notes)
    assert any("GPU 1" in n and "nothing of it is published" in n for n in pool.notes)


@pytest.mark.parametrize(
    "options",
    [dm.PoolOptions(), dm.PoolOptions(gpu_partitions=4), dm.PoolOptions(gpu_partitions=2)],
    ids=["mig", "gpu-partitions-4", "gpu-partitions-2"],
)
def test_every_partition_says_whether_it_is_isolated(options: dm.PoolOptions) -> None:
    """A MIG device is hardware-isolated (its own memory, SMs, engines); a
    `--gpu-partitions` partition runs time-shared on the whole GPU, with no memory or
    fault isolation from the GPU's other partitions. Whole GPUs carry no such claim."""
    inv = inventory(TWO_H100)
    gpu0 = _instance(inv, 0, "3g.40gb", 4, gi=2)  # GPU 0 static, GPU 1 dynamic
    pool = dm.build_pool(_with_instances(inv, {0: (gpu0,)}), options)
    partitions = [d for d in pool.devices if d.is_partition]
    assert partitions
    for device in pool.devices:
        attrs = device.document["attributes"]
        if device.is_partition:
            assert attrs["isolated"] == {"bool": device.mig is not None}, device.name
        else:
            assert "isolated" not in attrs, device.name


def test_reference_partitions_on_a_real_mig_gpu_fail_at_start() -> None:
    inv = dataclasses.replace(inventory(TWO_H100), backend="nvml")
    with pytest.raises(dm.PoolError, match=r"--gpu-partitions=2: GPU 0 .* MIG mode"):
        dm.build_pool(inv, dm.PoolOptions(gpu_partitions=2))


# --------------------------------------------------------------------------- consumable capacity


def test_quantity_parsing() -> None:
    assert formatting.quantity_int("16Gi") == 16 << 30
    assert formatting.quantity_int("20") == 20
    assert formatting.quantity_int("1.5G") == 1_500_000_000
    assert formatting.quantity_int("500m") == 1  # rounded up to a whole unit
    assert formatting.quantity_int("1e3") == 1000
    assert formatting.quantity_int(7) == 7
    for bad in ("", "Gi", "16GB", "1..2", None, True, "abc"):
        with pytest.raises(ValueError):
            formatting.quantity_int(bad)


def test_multiple_allocations_off_by_default() -> None:
    inv = inventory({"gpus": [{"model": "A100-40GB", "count": 1, "migMode": "disabled"}]})
    doc = dm.build_pool(inv).device("gpu-0").document
    assert "allowMultipleAllocations" not in doc
    assert "requestPolicy" not in doc["capacity"]["memory"]
    assert dm.build_pool(inv).device("gpu-0").share_capacity is None


def test_whole_gpus_are_multi_allocatable_with_request_policies() -> None:
    inv = inventory({"gpus": [{"model": "A100-40GB", "count": 2, "migMode": "disabled"}]})
    pool = dm.build_pool(inv, dm.PoolOptions(allow_multiple_allocations=True))
    gpu = pool.device("gpu-1")
    assert gpu.multi_allocatable
    doc = gpu.document
    assert doc["allowMultipleAllocations"] is True
    memory, compute = doc["capacity"]["memory"], doc["capacity"]["compute"]
    assert memory["requestPolicy"] == {
        "default": memory["value"],
        "validRange": {"min": "1Gi", "step": "1Gi", "max": memory["value"]},
    }
    assert compute["requestPolicy"] == {
        "default": compute["value"],
        "validRange": {"min": "1", "step": "1", "max": compute["value"]},
    }
    assert gpu.share_capacity == {
        "memory": formatting.quantity_int(memory["value"]),
        "compute": formatting.quantity_int(compute["value"]),
    }
    # The pool's other documents are not touched by another pool's options.
    assert "allowMultipleAllocations" not in dm.build_pool(inv).device("gpu-1").document


def test_reference_example_and_partitions_share_like_the_reference() -> None:
    inv = MockBackend(MockNvml(example_fleet(2), "dra-example-driver-cluster-worker")).discover()
    opts = dm.PoolOptions(allow_multiple_allocations=True)
    whole = dm.build_pool(inv, opts).device("gpu-0").document
    assert whole["allowMultipleAllocations"] is True
    assert whole["capacity"]["memory"] == {
        "value": "80Gi",
        "requestPolicy": {
            "default": "80Gi",
            "validRange": {"min": "1Gi", "step": "1Gi", "max": "80Gi"},
        },
    }
    pool = dm.build_pool(inv, dm.PoolOptions(gpu_partitions=3, allow_multiple_allocations=True))
    part = pool.device("gpu-0-partition-1")
    assert part.share_capacity == {"memory": 28633115306, "compute": 33}
    policy = part.document["capacity"]["memory"]["requestPolicy"]
    # 28633115306 bytes is not on a 1Gi step: the range ends at the last step below it.
    assert policy == {"default": "26Gi", "validRange": {"min": "1Gi", "step": "1Gi", "max": "26Gi"}}
    # The counters a partition consumes are the fixed size, never the policy.
    assert part.document["consumesCounters"][0]["counters"]["memory"] == {"value": "28633115306"}
    assert pool.device("gpu-0-full").document["allowMultipleAllocations"] is True


def test_mig_devices_are_never_multi_allocatable() -> None:
    """MIG devices are hardware partitions created per claim; the whole GPU of a
    dynamic MIG GPU is a full-size MIG device created per claim as well."""
    pool = dm.build_pool(inventory(), dm.PoolOptions(allow_multiple_allocations=True))
    assert pool.devices
    for device in pool.devices:
        assert device.mig is not None
        assert "allowMultipleAllocations" not in device.document, device.name
        assert device.share_capacity is None
        for cap in (device.document.get("capacity") or {}).values():
            assert "requestPolicy" not in cap
