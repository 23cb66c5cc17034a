"""What an allocation is given of a GPU, limited through MPS on a node that runs MPS
daemons (docs/sharing.md, "Limited through MPS (cooperative), or advisory"): capacity
shares, `--gpu-partitions` partitions and SpacePartitioning get a daemon with their
share of the GPU's memory and SMs as per-process limits; without MPS they stay
advisory; an MPS config may not exceed its share.

The mock H100 80GB has 81559Mi of memory and compute 100; a `--gpu-partitions=4`
partition 20879104Ki (20389.75Mi) and compute 25."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import PoolOptions, PublishedDevice, build_pool
from driver.devices.slices import build_slice_documents, validate_slice_specs
from driver.nvml.mock.fleet import parse_fleet
from driver.state.journal.checkpoint import Checkpoint
from driver.state.journal.mps_record import MpsRecord
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef
from tests.unit.test_mps_prepare import Claims, Node, mps_node, ok

DRIVER = "gpu.example.com"
NODE = "node-a"
# gpu-0 with MIG off, gpu-1 in MIG mode.
FLEET = parse_fleet(
    {"gpus": [{"model": "H100-80GB", "count": 1, "migMode": "disabled"}, {"model": "H100-80GB"}]}
)
SHARES = PoolOptions(allow_multiple_allocations=True)
PARTITIONS = PoolOptions(gpu_partitions=4)
MIB = 1 << 20
GIB = 1 << 30


def claim(
    claims: Claims,
    uid: str,
    device: str,
    *,
    consumed: dict[str, str] | None = None,
    sharing: dict[str, Any] | None = None,
) -> ClaimRef:
    result: dict[str, Any] = {"request": "r0", "driver": DRIVER, "pool": NODE, "device": device}
    if consumed is not None:
        result |= {"shareID": f"share-{uid}", "consumedCapacity": consumed}
    configs = []
    if sharing is not None:
        params = {
            "apiVersion": "gpu.resource.example.com/v1alpha1",
            "kind": "GpuConfig",
            "sharing": sharing,
        }
        configs.append({"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}})
    claims.docs[uid] = {
        "metadata": {"namespace": "default", "name": f"claim-{uid}", "uid": uid},
        "status": {"allocation": {"devices": {"results": [result], "config": configs}}},
    }
    return ClaimRef("default", f"claim-{uid}", uid)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(tmp_path, FLEET)


def records(node: Node, uid: str) -> list[MpsRecord | None]:
    return [d.mps for d in Checkpoint(node.root / "plugin").load()[uid].devices]


def limits(node: Node, uid: str) -> tuple[int | None, int | None]:
    (record,) = records(node, uid)
    assert record is not None, f"claim {uid} has no MPS daemon"
    return record.active_thread_percentage, record.pinned_memory_bytes


def env(state: DeviceState, uid: str) -> set[str]:
    spec = json.loads(state.cdi.claim_spec_path(uid).read_text())
    return set(spec["devices"][0]["containerEdits"]["env"])


def error(state: DeviceState, ref: ClaimRef) -> str:
    (result,) = state.prepare([ref]).values()
    assert result.error is not None
    return str(result.error)


def test_two_shares_of_one_gpu_get_daemons_with_their_own_limits(node: Node) -> None:
    node.options = SHARES
    state = node.state()
    a = claim(node.claims, "a", "gpu-0", consumed={"memory": "16Gi", "compute": "20"})
    b = claim(node.claims, "b", "gpu-0", consumed={"memory": "40Gi", "compute": "50"})
    ok(state, a, b)
    assert limits(node, "a") == (20, 16 * GIB)
    assert limits(node, "b") == (50, 40 * GIB)
    assert len(node.daemons()) == 2
    assert {
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=16384M",
        "GPU_DEVICE_0_MEMORY=16Gi",
    } <= env(state, "a")
    assert state.unprepare([a, b]) == {"a": None, "b": None}
    assert node.daemons() == []


def test_without_mps_a_share_stays_advisory(node: Node) -> None:
    node.options = SHARES
    state = node.state(mps=False)
    ok(state, claim(node.claims, "a", "gpu-0", consumed={"memory": "16Gi", "compute": "20"}))
    assert records(node, "a") == [None]
    assert not any(line.startswith("CUDA_MPS") for line in env(state, "a"))
    assert "GPU_DEVICE_0_MEMORY=16Gi" in env(state, "a")


def test_a_share_that_leaves_nothing_of_the_gpu_gets_no_daemon(node: Node) -> None:
    """What a claim asking no capacity consumes: the request policies' defaults, 79Gi
    of 81559Mi and all of the compute; no other share fits, nothing to limit."""
    node.options = SHARES
    state = node.state()
    a = claim(node.claims, "a", "gpu-0", consumed={"memory": "79Gi", "compute": "100"})
    ok(state, a)
    assert records(node, "a") == [None]
    assert state.unprepare([a]) == {"a": None}
    # A share that asks for memory only consumes all of the compute (the default).
    ok(state, claim(node.claims, "b", "gpu-0", consumed={"memory": "8Gi", "compute": "100"}))
    assert records(node, "b") == [None]


def test_an_exclusive_whole_gpu_gets_no_daemon(node: Node) -> None:
    state = node.state()
    ok(state, claim(node.claims, "a", "gpu-0"))
    assert records(node, "a") == [None]


def test_a_reference_partition_is_limited_to_its_quarter(node: Node) -> None:
    node.options = PARTITIONS
    state = node.state()
    ok(state, claim(node.claims, "a", "gpu-0-partition-1"))
    assert limits(node, "a") == (25, 20389 * MIB)
    # The partitions' whole GPU is not limited.
    ok(state, claim(node.claims, "b", "gpu-1-full"))
    assert records(node, "b") == [None]


def test_space_partitioning_gives_each_process_one_nth_of_the_gpu(node: Node) -> None:
    state = node.state()
    sharing = {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 3}}
    ok(state, claim(node.claims, "a", "gpu-0", sharing=sharing))
    assert limits(node, "a") == (33, 27186 * MIB)  # 81559Mi / 3 = 27186.33Mi
    assert {"GPU_DEVICE_0_PARTITION_COUNT=3", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=33"} <= env(
        state, "a"
    )


def test_space_partitioning_on_a_mig_gpu_starts_no_daemon(node: Node) -> None:
    state = node.state()
    sharing = {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 2}}
    ok(state, claim(node.claims, "a", "gpu-1", sharing=sharing))
    assert records(node, "a") == [None]


def test_an_mps_config_on_a_share_defaults_to_the_share_and_may_not_exceed_it(
    node: Node,
) -> None:
    node.options = SHARES
    state = node.state()
    share = {"memory": "16Gi", "compute": "20"}
    lower = {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "8Gi"}}
    ok(state, claim(node.claims, "a", "gpu-0", consumed=share, sharing=lower))
    assert limits(node, "a") == (20, 8 * GIB)

    above = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 60}}
    message = error(state, claim(node.claims, "b", "gpu-0", consumed=share, sharing=above))
    assert "permanent (invalid-config)" in message
    assert "sharing.mpsConfig.defaultActiveThreadPercentage: 60 is more than the 20%" in message
    more = {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "17Gi"}}
    message = error(state, claim(node.claims, "c", "gpu-0", consumed=share, sharing=more))
    assert "defaultPinnedDeviceMemoryLimit: 17Gi is more than the 16384Mi" in message
    assert len(node.daemons()) == 1  # only a's


def _strict(device: PublishedDevice) -> bool:
    """A whole GPU (`gpu-0`, `gpu-0-full`) of the GPU with MIG off (gpu-0)."""
    return not device.is_partition and device.gpu_minor == 0


def test_devices_of_a_node_with_mps_publish_mps_isolation_cooperative(node: Node) -> None:
    """A node that runs MPS daemons publishes `mpsIsolation` (a string) on every device
    of a GPU with MIG off: `"cooperative"` on partitions, whose limits bind each client
    process and only processes that use MPS, `"strict"` on the whole GPU that no
    capacity share divides (its one daemon holds it in EXCLUSIVE_PROCESS; docs/mps.md,
    "What holds and what does not"). No device publishes the former bare `mps: true`,
    which read as a guarantee."""
    inventory = node.backend.discover()
    for options in (PoolOptions(mps=True), PoolOptions(mps=True, gpu_partitions=2)):
        pool = build_pool(inventory, options)
        marked = {d.name for d in pool.devices if "mpsIsolation" in d.document["attributes"]}
        on_gpu0 = {d.name for d in pool.devices if d.gpu_minor == 0}
        if options.gpu_partitions:
            # The mock publishes partitions of a MIG-mode GPU too; they run on the GPU.
            on_gpu0 |= {d.name for d in pool.devices if d.gpu_minor == 1}
        assert marked == on_gpu0
        assert all(
            pool.device(name).document["attributes"]["mpsIsolation"]
            == {"string": "strict" if _strict(pool.device(name)) else "cooperative"}
            for name in marked
        )
        slices = build_slice_documents(pool, driver=DRIVER, node_name=NODE)
        published = [d for s in slices for d in s["spec"].get("devices", [])]
        assert not validate_slice_specs([s["spec"] for s in slices])
        assert {d["name"] for d in published if "mpsIsolation" in d["attributes"]} == on_gpu0
        assert not any("mps" in d["attributes"] for d in published)
    plain = build_pool(inventory).devices
    assert not any({"mps", "mpsIsolation"} & d.document["attributes"].keys() for d in plain)


def test_a_claim_with_two_mps_limited_devices_is_refused_for_good(node: Node) -> None:
    """A container has one CUDA_MPS_PIPE_DIRECTORY: two daemons mounted there, one
    would shadow the other and its GPU would be unusable under MPS."""
    node.options = PARTITIONS
    state = node.state()
    ref = claim(node.claims, "a", "gpu-0-partition-0")
    doc = node.claims.docs["a"]
    results = doc["status"]["allocation"]["devices"]["results"]
    results.append({**results[0], "device": "gpu-0-partition-1"})
    message = error(state, ref)
    assert "permanent (invalid-config): status.allocation.devices.results: devices " in message
    assert "gpu-0-partition-0, gpu-0-partition-1 would each get an MPS daemon" in message
    assert node.daemons() == [] and not Checkpoint(node.root / "plugin").load()
    # Without MPS on the node the same claim is prepared (advisory partitions).
    ok(node.state(mps=False), ref)
