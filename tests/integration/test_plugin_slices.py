"""The plugin's ResourceSlices in a real API server, allocated by the real scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.devices.model import build_pool
from driver.nvml.mock.fleet import default_fleet, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from tests.conftest import Cluster, FakeNode
from tests.integration.helpers import (
    allocation,
    apply,
    claim,
    complete_pool,
    delete_namespace,
    device_class,
    gpu_uuid_of,
    namespace,
    pod_using,
    published_devices,
    unschedulable,
    whole_gpu_selector,
)
from tests.integration.plugin_process import DRIVER, PluginProcess, running_plugin

NS = "slices-test"


@pytest.fixture(scope="module", autouse=True)
def _release_namespace(cluster: Cluster) -> Iterator[None]:
    yield
    delete_namespace(cluster, NS)


@pytest.fixture(scope="module")
def plugin(
    cluster: Cluster, node: FakeNode, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PluginProcess]:
    root = tmp_path_factory.mktemp("plugin")
    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as p:
        yield p


@pytest.fixture(scope="module")
def pool(cluster: Cluster, node: FakeNode, plugin: PluginProcess) -> list[dict]:
    return cluster.wait_for(
        lambda: complete_pool(cluster, node.name), timeout=60, what="complete pool"
    )


def test_default_fleet_is_accepted_with_mig_partitions(pool: list[dict], node: FakeNode) -> None:
    expected = build_pool(MockBackend(MockNvml(default_fleet(), node.name)).discover())
    devices = published_devices(pool)
    assert set(devices) == {d.name for d in expected.devices}
    gpus = [n for n in devices if "-mig-" not in n]
    assert len(gpus) == 8
    partitions = [d for n, d in devices.items() if "-mig-" in n]
    assert partitions and all(d["consumesCounters"] for d in partitions)
    counter_sets = [cs for s in pool for cs in s["spec"].get("sharedCounters") or []]
    assert len(counter_sets) == 8
    for s in pool:
        assert s["metadata"]["ownerReferences"][0]["uid"] == node.uid
        spec = s["spec"]
        assert not (spec.get("devices") and spec.get("sharedCounters"))
        assert len(spec.get("devices") or []) <= 64 and len(spec.get("sharedCounters") or []) <= 8


CLI = "import sys; from driver.cli import main; sys.exit(main(sys.argv[1:]))"


def test_inventory_in_the_plugins_environment_shows_what_it_publishes(
    pool: list[dict], node: FakeNode, plugin: PluginProcess
) -> None:
    """`kubectl exec <plugin pod> -- gpu-dra inventory`: the pod's settings (here the
    plugin's flags as the chart's environment variables) give the published devices."""
    env = {k: v for k, v in os.environ.items() if k != "GPU_DRA_STATE_DIR"}
    env.update(
        NODE_NAME=node.name,
        NVML_BACKEND="mock",
        KUBELET_PLUGINS_DIRECTORY_PATH=str(plugin.plugins_dir),
    )
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "inventory", "-o", "json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    listed = published_devices(json.loads(proc.stdout)["items"])
    published = published_devices(pool)
    assert sorted(listed) == sorted(published)
    for name, device in published.items():
        assert listed[name]["attributes"] == device["attributes"], name
        assert listed[name].get("consumesCounters", [{}])[0].get("counterSet") == device.get(
            "consumesCounters", [{}]
        )[0].get("counterSet"), name
    # The start-up log is text, not a Python repr.
    assert "recovered local state: nothing to do" in plugin.logs()
    assert "RecoveryReport(" not in plugin.logs()


def test_deleted_slices_come_back(cluster: Cluster, node: FakeNode, pool: list[dict]) -> None:
    before = {d for d in published_devices(pool)}
    # What the kubelet does when it starts: delete every slice of the node.
    cluster.kubectl("delete", "resourceslices", f"--field-selector=spec.nodeName={node.name}")
    restored = cluster.wait_for(
        lambda: (
            (p := complete_pool(cluster, node.name)) and set(published_devices(p)) == before and p
        ),
        timeout=30,
        what="slices to be recreated",
    )
    assert {s["metadata"]["uid"] for s in restored}.isdisjoint({s["metadata"]["uid"] for s in pool})


@pytest.fixture(scope="module")
def classes(cluster: Cluster, pool: list[dict]) -> None:
    apply(
        cluster,
        namespace(NS),
        device_class(
            "gpu.example.com",
            f'device.driver == "{DRIVER}" && !has(device.attributes["{DRIVER}"].profile)',
        ),
        device_class(
            "mig.gpu.example.com",
            f'device.driver == "{DRIVER}" && has(device.attributes["{DRIVER}"].profile)',
        ),
    )


def _uuid(pool: list[dict], device: str) -> str:
    return gpu_uuid_of(pool, device)


def test_cel_selector_claim_is_allocated_to_the_matching_gpu(
    cluster: Cluster, pool: list[dict], classes: None
) -> None:
    apply(
        cluster,
        claim("by-uuid", NS, "gpu.example.com", whole_gpu_selector(pool, "gpu-5")),
        pod_using("by-uuid", NS, "by-uuid"),
    )
    results = cluster.wait_for(
        lambda: allocation(cluster, NS, "by-uuid"), timeout=60, what="allocation"
    )
    assert [(r["driver"], r["device"]) for r in results] == [(DRIVER, "gpu-5")]


def test_partitions_never_overlap_and_never_share_a_gpu_with_the_whole_gpu(
    cluster: Cluster, pool: list[dict], classes: None
) -> None:
    parent = _uuid(pool, "gpu-2")
    on_gpu2 = f'device.attributes["{DRIVER}"].parentUUID == "{parent}"'
    profile = lambda p: f'{on_gpu2} && device.attributes["{DRIVER}"].profile == "{p}"'  # noqa: E731
    # 4g.40gb has one placement (slices 0-3); 3g.40gb has placements at 0 and 4.
    apply(
        cluster,
        claim("p-4g", NS, "mig.gpu.example.com", profile("4g.40gb")),
        pod_using("p-4g", NS, "p-4g"),
    )
    first = cluster.wait_for(
        lambda: allocation(cluster, NS, "p-4g"), timeout=60, what="4g allocation"
    )
    apply(
        cluster,
        claim("p-3g-a", NS, "mig.gpu.example.com", profile("3g.40gb")),
        pod_using("p-3g-a", NS, "p-3g-a"),
    )
    second = cluster.wait_for(
        lambda: allocation(cluster, NS, "p-3g-a"), timeout=60, what="3g allocation"
    )
    apply(
        cluster,
        claim("p-3g-b", NS, "mig.gpu.example.com", profile("3g.40gb")),
        pod_using("p-3g-b", NS, "p-3g-b"),
        claim("whole", NS, "gpu.example.com", whole_gpu_selector(pool, "gpu-2")),
        pod_using("whole", NS, "whole"),
    )
    for pod in ("p-3g-b", "whole"):
        cluster.wait_for(
            lambda pod=pod: unschedulable(cluster, NS, pod), timeout=60, what=f"{pod} unschedulable"
        )
        assert allocation(cluster, NS, pod) is None

    devices = published_devices(pool)
    taken = []
    for results in (first, second):
        attrs = devices[results[0]["device"]]["attributes"]
        start, size = attrs["placementStart"]["int"], attrs["placementSize"]["int"]
        taken.append(set(range(start, start + size)))
    assert not taken[0] & taken[1], f"overlapping placements {first} {second}"


def test_64_gpu_fleet_needs_several_slices(
    cluster: Cluster, node: FakeNode, tmp_path: Path, plugin: PluginProcess
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps({"gpus": [{"model": "A100-80GB", "count": 64}]}))
    expected = build_pool(
        MockBackend(
            MockNvml(parse_fleet({"gpus": [{"model": "A100-80GB", "count": 64}]}), node.name)
        ).discover()
    )
    plugin.stop()  # one instance per node: the big fleet replaces the default one
    with running_plugin(
        kubeconfig=cluster.kubeconfig,
        node_name=node.name,
        root=tmp_path / "big",
        args=[f"--mock-fleet={fleet}"],
    ) as big:
        slices = cluster.wait_for(
            lambda: (
                (p := complete_pool(cluster, node.name))
                and len(published_devices(p)) == len(expected.devices)
                and p
            ),
            timeout=120,
            what="64-GPU pool",
        )
        assert big.metric("gpu_dra_published_devices") == len(expected.devices)
    counter_slices = [s for s in slices if s["spec"].get("sharedCounters")]
    assert len(counter_slices) == 8  # 64 counter sets, at most 8 per slice
    assert len(slices) > len(expected.devices) // 64


def _capacity_claim(name: str, memory: str, compute: str) -> dict:
    doc = claim(name, NS, "gpu.example.com")
    doc["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {
        "requests": {"memory": memory, "compute": compute}
    }
    return doc


def test_multi_allocatable_gpus_are_accepted_and_shared_by_capacity(
    cluster: Cluster, node: FakeNode, tmp_path: Path, plugin: PluginProcess, classes: None
) -> None:
    """--gpu-allow-multiple-allocations: the API server keeps allowMultipleAllocations
    and the request policies (DRAConsumableCapacity on), and the scheduler puts two
    16Gi shares on the one 40Gi GPU and refuses a third."""
    data = {"gpus": [{"model": "A100-40GB", "count": 1, "migMode": "disabled"}]}
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(json.dumps(data))
    plugin.stop()  # one instance per node
    with running_plugin(
        kubeconfig=cluster.kubeconfig,
        node_name=node.name,
        root=tmp_path / "shared",
        args=[f"--mock-fleet={fleet}", "--gpu-allow-multiple-allocations"],
    ):
        slices = cluster.wait_for(
            lambda: (
                (p := complete_pool(cluster, node.name))
                and set(published_devices(p)) == {"gpu-0"}
                and p
            ),
            timeout=60,
            what="the one-GPU shareable pool",
        )
        gpu = published_devices(slices)["gpu-0"]
        assert gpu.get("allowMultipleAllocations") is True, gpu
        assert gpu["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Gi"
        assert gpu["capacity"]["compute"]["requestPolicy"]["validRange"]["min"] == "1"
        memory = gpu["capacity"]["memory"]["value"]
        assert memory == "40Gi", memory

        for name in ("share-a", "share-b"):
            apply(cluster, _capacity_claim(name, "16Gi", "20"), pod_using(name, NS, name))
        shares = [
            cluster.wait_for(
                lambda name=name: allocation(cluster, NS, name), timeout=60, what=name
            )[0]
            for name in ("share-a", "share-b")
        ]
        assert [s["device"] for s in shares] == ["gpu-0", "gpu-0"]
        assert shares[0]["shareID"] and shares[1]["shareID"]
        assert shares[0]["shareID"] != shares[1]["shareID"]
        for share in shares:
            assert share["consumedCapacity"] == {"memory": "16Gi", "compute": "20"}

        apply(
            cluster, _capacity_claim("share-c", "16Gi", "20"), pod_using("share-c", NS, "share-c")
        )
        cluster.wait_for(
            lambda: unschedulable(cluster, NS, "share-c"), timeout=60, what="share-c unschedulable"
        )
        assert allocation(cluster, NS, "share-c") is None
