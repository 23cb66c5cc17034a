"""The whole GPU `gpu-<minor>` of a dynamic MIG GPU publishes what prepare delivers:
the GPU's full-size MIG device (docs/mig.md), not the GPU with MIG off."""

from __future__ import annotations

from typing import Any

import pytest

from driver.cli import main
from driver.cli.published import devices_of
from driver.devices import model as dm
from driver.devices.formatting import MIG_DIMENSIONS, binary_quantity, decimal_quantity
from driver.devices.mig_devices import full_size_profile
from driver.devices.slices import build_slice_specs
from driver.nvml.discovered import GpuInfo, Inventory, PartitionProfile
from driver.nvml.mock.fleet import default_fleet, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml

MODELS = ["A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"]


def inventory(fleet_data: dict[str, Any] | None = None) -> Inventory:
    fleet = parse_fleet(fleet_data) if fleet_data else default_fleet()
    return MockBackend(MockNvml(fleet, "node-a")).discover()


def full_profile(gpu: GpuInfo) -> PartitionProfile:
    full = full_size_profile(gpu)
    assert full is not None
    return full


def test_default_fleet_whole_gpu_memory_is_the_7g_profiles() -> None:
    inv = inventory()
    gpu = inv.gpus[0]
    full = full_profile(gpu)
    assert full.name == "7g.80gb" and full.memory_bytes == 81152 << 20
    assert gpu.memory_bytes == 81559 << 20  # the GPU has more than its 7g device
    capacity = dm.build_pool(inv).device("gpu-0").document["capacity"]
    assert capacity["memory"] == {"value": "81152Mi"}


@pytest.mark.parametrize("model", MODELS)
def test_whole_gpu_capacity_is_the_full_size_profiles(model: str) -> None:
    inv = inventory({"gpus": [{"model": model}]})
    gpu = inv.gpus[0]
    full = full_profile(gpu)
    capacity = dm.build_pool(inv).device("gpu-0").document["capacity"]
    assert capacity["memory"] == {"value": binary_quantity(full.memory_bytes)}
    assert gpu.memory_bytes != full.memory_bytes
    for cap, _, attr in MIG_DIMENSIONS[1:]:
        assert capacity[cap] == {"value": decimal_quantity(getattr(full, attr))}, cap
    assert capacity["compute"] == {"value": "100"}


def test_whole_gpu_of_a_mig_gpu_does_not_claim_the_gpus_uuid() -> None:
    inv = inventory()
    gpu = inv.gpus[0]
    device = dm.build_pool(inv).device("gpu-0")
    attrs = device.document["attributes"]
    assert gpu.uuid not in {v.get("string") for k, v in attrs.items() if k != "parentUUID"}
    assert "uuid" not in attrs
    assert attrs["parentUUID"] == {"string": gpu.uuid}
    assert attrs["migProfile"] == {"string": "7g.80gb"}
    # Still a whole GPU for the chart's DeviceClasses: no `profile`, no `partition`.
    assert "profile" not in attrs and "partition" not in attrs
    assert attrs["index"] == {"int": 0} and attrs["maxPartitions"] == {"int": 7}
    assert (device.gpu_uuid, device.is_partition) == (gpu.uuid, False)


def test_whole_gpu_still_consumes_every_counter_of_its_gpu() -> None:
    pool = dm.build_pool(inventory())
    counters = pool.counter_sets[0]["counters"]
    whole = pool.device("gpu-0").document["consumesCounters"][0]["counters"]
    assert whole == {k: v for k, v in counters.items() if v != {"value": "0"}}
    assert [k for k in whole if k.startswith("memory-slice-")] == [
        f"memory-slice-{i}" for i in range(8)
    ]


def test_gpu_with_mig_off_publishes_its_own_uuid_and_memory() -> None:
    """No regression: a GPU with MIG off is delivered as itself."""
    inv = inventory({"gpus": [{"model": "H100-80GB", "count": 2, "migMode": "disabled"}]})
    device = dm.build_pool(inv).device("gpu-1")
    attrs = device.document["attributes"]
    assert attrs["uuid"] == {"string": inv.gpus[1].uuid}
    assert "parentUUID" not in attrs and "migProfile" not in attrs
    assert device.document["capacity"]["memory"] == {"value": "81559Mi"}
    assert device.mig is None


def test_published_view_sees_the_whole_gpu_as_its_gpu() -> None:
    """`gpu-dra health` reads the slices back: gpu-0 is a GPU, not a partition."""
    inv = inventory()
    pool = dm.build_pool(inv)
    specs = build_slice_specs(pool, driver="gpu.example.com", node_name="node-a")
    slices = [{"metadata": {"name": f"s-{i}"}, "spec": s} for i, s in enumerate(specs)]
    devices = {d.name: d for d in devices_of(slices)}
    assert not devices["gpu-0"].is_partition
    assert devices["gpu-0"].gpu_uuid == inv.gpus[0].uuid
    assert devices["gpu-0-mig-1g10gb-3"].is_partition


def test_inventory_shows_what_is_delivered(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inventory", "--mock", "--node-name", "n1", "-o", "table"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert "81152Mi" in rows["gpu-0"] and "81559Mi" not in rows["gpu-0"]
    assert "7g.80gb" in rows["gpu-0"]


@pytest.fixture(autouse=True)
def no_plugin_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("GPU_DRA_STATE_DIR", str(tmp_path / "no-plugin-here"))
