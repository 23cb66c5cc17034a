"""ResourceSlice splitting within the API limits, and full slice documents."""

from __future__ import annotations

import copy
from decimal import Decimal
from typing import Any

import pytest

from driver.devices import slices as sl
from driver.devices.formatting import parse_quantity
from driver.devices.model import PoolDevices, PoolOptions, build_pool
from driver.nvml.mock.fleet import default_fleet, example_fleet, mock_gpu_uuid, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml

DRIVER = "gpu.example.com"
WORKER = "dra-example-driver-cluster-worker"


def pool_for(fleet: Any, node: str = "n1", options: PoolOptions | None = None) -> PoolDevices:
    return build_pool(MockBackend(MockNvml(fleet, node)).discover(), options)


def specs_for(pool: PoolDevices, **kwargs: Any) -> list[dict[str, Any]]:
    specs = sl.build_slice_specs(pool, driver=DRIVER, node_name="n1", **kwargs)
    assert sl.validate_slice_specs(specs) == []
    return specs


def test_default_fleet_slices() -> None:
    pool = pool_for(default_fleet())
    specs = specs_for(pool)
    assert len(specs) == 5
    assert [s["pool"] for s in specs] == [
        {"name": "n1", "generation": 1, "resourceSliceCount": 5}
    ] * 5
    assert all(s["driver"] == DRIVER and s["nodeName"] == "n1" for s in specs)
    assert "devices" not in specs[0] and len(specs[0]["sharedCounters"]) == 8
    sizes = [len(s["devices"]) for s in specs[1:]]
    assert sizes == [64, 64, 64, 16]
    flat = [d["name"] for s in specs[1:] for d in s["devices"]]
    assert flat == [d.name for d in pool.devices]  # order preserved


def test_sixty_four_gpus_need_several_counter_and_device_slices() -> None:
    pool = pool_for(parse_fleet({"gpus": [{"model": "H100-80GB", "count": 64}]}))
    specs = specs_for(pool)
    counter_slices = [s for s in specs if "sharedCounters" in s]
    device_slices = [s for s in specs if "devices" in s]
    assert len(counter_slices) == 8 and all(len(s["sharedCounters"]) == 8 for s in counter_slices)
    assert sum(len(s["devices"]) for s in device_slices) == 64 * 26
    assert len(device_slices) == 26 and len(specs) == 34
    assert all(len(s["devices"]) <= 64 for s in device_slices)


def test_example_reproduces_the_reference_slice() -> None:
    pool = pool_for(example_fleet(), WORKER)
    specs = sl.build_slice_specs(pool, driver=DRIVER, node_name=WORKER)
    assert len(specs) == 1
    (spec,) = specs
    assert spec["pool"] == {"name": WORKER, "generation": 1, "resourceSliceCount": 1}
    uuids = [mock_gpu_uuid(WORKER, i, prefix="gpu") for i in range(8)]
    assert spec["devices"] == [
        {
            "name": f"gpu-{i}",
            "attributes": {
                "index": {"int": i},
                "uuid": {"string": uuids[i]},
                "model": {"string": "LATEST-GPU-MODEL"},
                "driverVersion": {"version": "1.0.0"},
            },
            "capacity": {"memory": {"value": "80Gi"}, "compute": {"value": "100"}},
            "allowMultipleAllocations": False,
        }
        for i in range(8)
    ]


def test_example_gpu_partitions_use_two_slices_like_the_reference() -> None:
    pool = pool_for(example_fleet(), WORKER, PoolOptions(gpu_partitions=4))
    specs = specs_for(pool)
    assert len(specs) == 2
    assert [cs["name"] for cs in specs[0]["sharedCounters"]] == [
        f"gpu-{i}-counters" for i in range(8)
    ]
    assert len(specs[1]["devices"]) == 40


def test_plain_devices_use_128_per_slice_and_taints_lower_the_limit() -> None:
    pool = pool_for(example_fleet(130))
    specs = specs_for(pool)
    assert [len(s["devices"]) for s in specs] == [128, 2]
    tainted = specs_for(
        pool, taints={"gpu-3": [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]}
    )
    assert [len(s["devices"]) for s in tainted] == [64, 66]
    dev = next(d for d in tainted[0]["devices"] if d["name"] == "gpu-3")
    assert dev["taints"] == [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
    # The pool's own documents are not modified.
    assert "taints" not in pool.device("gpu-3").document


def test_taints_for_a_gpu_and_its_partitions() -> None:
    pool = pool_for(default_fleet())
    gpu = pool.devices[0]
    taint = [{"key": f"{DRIVER}/gpu-lost", "effect": "NoExecute"}]
    taints = {d.name: taint for d in pool.devices_of_gpu(gpu.gpu_uuid)}
    taints["gpu-not-in-pool"] = taint  # ignored
    specs = specs_for(pool, taints=taints)
    tainted = [d["name"] for s in specs for d in s.get("devices", []) if d.get("taints")]
    assert tainted == [d.name for d in pool.devices_of_gpu(gpu.gpu_uuid)]


@pytest.mark.parametrize(
    "bad",
    [
        [{"key": "x", "effect": "Evict"}],
        [{"effect": "NoSchedule"}],
        [{"key": f"k{i}", "effect": "None"} for i in range(17)],
    ],
)
def test_invalid_taints_are_rejected(bad: list[dict[str, Any]]) -> None:
    pool = pool_for(example_fleet(1))
    with pytest.raises(ValueError):
        sl.build_slice_specs(pool, driver=DRIVER, node_name="n1", taints={"gpu-0": bad})


def test_empty_pool_publishes_one_empty_slice() -> None:
    specs = specs_for(PoolDevices(devices=()))
    assert specs == [
        {
            "driver": DRIVER,
            "nodeName": "n1",
            "pool": {"name": "n1", "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        }
    ]


def test_generation_is_passed_through() -> None:
    specs = specs_for(pool_for(example_fleet(1)), generation=7)
    assert specs[0]["pool"]["generation"] == 7


def test_generate_name() -> None:
    assert sl.slice_generate_name(0, 1, DRIVER, "node-1") == "00000-gpu.example.com-node-1-"
    assert sl.slice_generate_name(26, 34, DRIVER, "n") == "0001a-gpu.example.com-n-"
    assert sl.slice_generate_name(5, 0x123456, DRIVER, "n") == "000005-gpu.example.com-n-"


def test_documents() -> None:
    pool = pool_for(default_fleet())
    docs = sl.build_slice_documents(pool, driver=DRIVER, node_name="n1", node_uid="uid-1")
    assert len(docs) == 5
    for i, doc in enumerate(docs):
        assert doc["apiVersion"] == "resource.k8s.io/v1" and doc["kind"] == "ResourceSlice"
        assert doc["metadata"]["generateName"] == f"{i:05x}-{DRIVER}-n1-"
        assert doc["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1", "controller": True}
        ]
    assert [d["spec"] for d in docs] == sl.build_slice_specs(pool, driver=DRIVER, node_name="n1")
    bare = sl.build_slice_documents(pool, driver=DRIVER, node_name="n1")
    assert "ownerReferences" not in bare[0]["metadata"]


# --------------------------------------------------------------------------- validator


def _valid() -> list[dict[str, Any]]:
    return sl.build_slice_specs(pool_for(default_fleet()), driver=DRIVER, node_name="n1")


def _break(mutate: Any) -> list[str]:
    specs = copy.deepcopy(_valid())
    mutate(specs)
    return sl.validate_slice_specs(specs)


def test_validator_accepts_generated_specs() -> None:
    assert sl.validate_slice_specs(_valid()) == []


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s[0].update(devices=[{"name": "x"}]), "both devices and sharedCounters"),
        (
            lambda s: s[0]["sharedCounters"].append({"name": "gpu-x", "counters": {"a": {}}}),
            "9 counter sets",
        ),
        (lambda s: s[1]["devices"].append(copy.deepcopy(s[2]["devices"][5])), "65 devices > 64"),
        (
            lambda s: s[1]["devices"][0]["consumesCounters"].extend(
                [
                    {"counterSet": "gpu-1-counter-set", "counters": {}},
                    {"counterSet": "gpu-2-counter-set", "counters": {}},
                ]
            ),
            "3 consumptions",
        ),
        (
            lambda s: s[1]["devices"][0]["consumesCounters"][0].update(counterSet="nope"),
            "unknown counter set nope",
        ),
        (
            lambda s: s[1]["devices"][1]["consumesCounters"][0]["counters"].update(
                {"memory-slice-9": {"value": "1"}}
            ),
            "unknown counters ['memory-slice-9']",
        ),
        (lambda s: s[4]["devices"].append(copy.deepcopy(s[1]["devices"][0])), "duplicate device"),
        (
            # An H100's set: 8 memory slices and ofa-engines (docs/mig.md, "Slice layout").
            lambda s: s[0]["sharedCounters"][0]["counters"].update(
                {f"c{i}": {"value": "1"} for i in range(24)}
            ),
            "33 counters",
        ),
        (lambda s: s[1]["devices"][0].update(name="GPU_0"), "not a DNS label"),
        (
            lambda s: s[1]["devices"][0]["attributes"].update(
                {f"a{i}": {"int": i} for i in range(20)}
            ),
            "attrs+caps",
        ),
        (
            lambda s: s[1]["devices"][0]["attributes"].update(driverVersion={"version": "580.95"}),
            "not semver",
        ),
        (lambda s: s[1]["devices"][0]["attributes"].update(model={"string": "x" * 65}), "too long"),
        (lambda s: s[2]["pool"].update(resourceSliceCount=4), "resourceSliceCount 4 != 5"),
        (lambda s: s[3]["pool"].update(name="other"), "span pools"),
        (
            lambda s: s[1]["devices"][0].update(taints=[{"key": "k", "effect": "Bad"}]),
            "taint effect",
        ),
    ],
)
def test_validator_reports_violations(mutate: Any, message: str) -> None:
    errors = _break(mutate)
    assert any(message in e for e in errors), errors


# --------------------------------------------------------------------------- consumable capacity

SHAREABLE = {"gpus": [{"model": "A100-40GB", "count": 3, "migMode": "disabled"}]}


def _shared_specs() -> list[dict[str, Any]]:
    pool = pool_for(parse_fleet(SHAREABLE), options=PoolOptions(allow_multiple_allocations=True))
    return sl.build_slice_specs(pool, driver=DRIVER, node_name="n1")


def test_shareable_devices_pass_the_validator() -> None:
    specs = _shared_specs()
    assert sl.validate_slice_specs(specs) == []
    devices = specs[0]["devices"]
    assert all(d["allowMultipleAllocations"] is True for d in devices)
    pool = pool_for(
        example_fleet(2), options=PoolOptions(gpu_partitions=4, allow_multiple_allocations=True)
    )
    assert specs_for(pool)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("allowMultipleAllocations"), "without allowMultipleAllocations"),
        (
            lambda d: d["capacity"]["memory"]["requestPolicy"].update(default="1Ti"),
            "exceeds the capacity",
        ),
        (
            lambda d: d["capacity"]["compute"]["requestPolicy"]["validRange"].update(step="7"),
            "multiple of step",
        ),
        (
            lambda d: d["capacity"]["compute"]["requestPolicy"]["validRange"].update(step="0"),
            "must be positive",
        ),
        (
            lambda d: d["capacity"]["compute"]["requestPolicy"]["validRange"].update(step="-1"),
            "must be positive",
        ),
        (
            lambda d: d["capacity"]["compute"]["requestPolicy"].update(validValues=["1"]),
            "mutually exclusive",
        ),
        (
            lambda d: d["capacity"]["compute"]["requestPolicy"]["validRange"].update(min="x"),
            "malformed",
        ),
    ],
)
def test_validator_reports_bad_request_policies(mutate: Any, message: str) -> None:
    specs = _shared_specs()
    mutate(specs[0]["devices"][0])
    errors = sl.validate_slice_specs(specs)
    assert any(message in e for e in errors), errors


@pytest.mark.parametrize(
    ("text", "value"),
    [("2Ei", 2 << 60), ("1Pi", 1 << 50), ("3E", 3 * 10**18), ("1e3", 1000), ("500m", 0.5)],
)
def test_quantities_with_every_suffix_parse(text: str, value: float) -> None:
    """An exa suffix (`E`, `Ei`) is no decimal exponent (`e3`)."""
    assert parse_quantity(text) == Decimal(str(value))
