"""Prepare/unprepare through the plugin's gRPC socket, against the real control plane.

The kubelet's part is played by tests.integration.kubelet_standin (until the real-node
tier exists); claims are allocated by the real scheduler.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.cdi.claim_specs import CdiSpecs
from driver.failpoints import PREPARE_FAILPOINTS, UNPREPARE_FAILPOINTS
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import MigInstance
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.nvml import MockNvml
from driver.proto.dra.v1 import api_pb2
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from tests.conftest import Cluster, FakeNode
from tests.integration.helpers import (
    allocation,
    apply,
    claim,
    complete_pool,
    delete_namespace,
    device_class,
    get_json,
    gpu_uuid_of,
    namespace,
    pod_using,
    published_devices,
    whole_gpu_selector,
)
from tests.integration.kubelet_standin import KubeletStandin, KubeletStandinError
from tests.integration.plugin_process import DRIVER, PluginProcess

NS = "prepare-test"
WHOLE_GPU = f'device.driver == "{DRIVER}" && !has(device.attributes["{DRIVER}"].profile)'


@pytest.fixture(scope="module", autouse=True)
def _release_namespace(cluster: Cluster) -> Iterator[None]:
    yield
    delete_namespace(cluster, NS)


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plugin")


def start_plugin(cluster: Cluster, node: FakeNode, root: Path, **env: str) -> PluginProcess:
    plugin = PluginProcess(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root, env=env)
    plugin.start()
    if not env:
        plugin.wait_serving()
    return plugin


@pytest.fixture(scope="module")
def plugin(cluster: Cluster, node: FakeNode, plugin_root: Path) -> Iterator[PluginProcess]:
    p = start_plugin(cluster, node, plugin_root)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def kubelet(plugin: PluginProcess, cluster: Cluster, node: FakeNode) -> Iterator[KubeletStandin]:
    standin = KubeletStandin(
        plugin.registry_dir, api_client=cluster.api_client(), node_name=node.name
    )
    standin.start()
    standin.wait_for_plugin(DRIVER)
    yield standin
    standin.stop()


@pytest.fixture(scope="module")
def pool(cluster: Cluster, node: FakeNode, plugin: PluginProcess) -> list[dict[str, Any]]:
    apply(cluster, namespace(NS), device_class("whole-gpu.example.com", WHOLE_GPU))
    return cluster.wait_for(lambda: complete_pool(cluster, node.name), timeout=60, what="pool")


def live_mig(plugin: PluginProcess, pool: list[dict[str, Any]], gpu: str) -> list[MigInstance]:
    """The MIG devices on a GPU of the plugin's mock node, as NVML reports them."""
    uuid = gpu_uuid_of(pool, gpu)
    mock = MockNvml(default_fleet(), plugin.node_name, driver_root=plugin.mock_driver_root)
    return NvmlBackend(mock).mig().instances(uuid)


def allocated_claim(
    cluster: Cluster, name: str, device: str, pool: list[dict[str, Any]], config: Any = None
) -> tuple[str, str, str]:
    selector = whole_gpu_selector(pool, device)
    apply(
        cluster,
        claim(name, NS, "whole-gpu.example.com", selector, config),
        pod_using(name, NS, name),
    )
    cluster.wait_for(
        lambda: allocation(cluster, NS, name), timeout=60, what=f"allocation of {name}"
    )
    uid = get_json(cluster, "resourceclaim", "-n", NS, name)["metadata"]["uid"]
    return (NS, uid, name)


def test_impossible_partition_count_is_permanent_cheap_and_visible(
    cluster: Cluster,
    node: FakeNode,
    plugin: PluginProcess,
    kubelet: KubeletStandin,
    pool: list[dict[str, Any]],
) -> None:
    max_partitions = published_devices(pool)["gpu-1"]["attributes"]["maxPartitions"]["int"]
    config = {
        "apiVersion": "gpu.resource.example.com/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "SpacePartitioning",
            "spacePartitioningConfig": {"partitionCount": max_partitions + 1},
        },
    }
    ref = allocated_claim(cluster, "too-many-partitions", "gpu-1", pool, config)
    first = kubelet.prepare(DRIVER, [ref])[ref[1]]
    assert first.error.startswith("permanent (invalid-config): ")
    assert first.error_type == api_pb2.Permanent
    assert "partition" in first.error and not first.devices

    events = cluster.wait_for(
        lambda: [
            e
            for e in get_json(cluster, "events", "-n", NS)["items"]
            if e["involvedObject"].get("uid") == ref[1] and e["reason"] == "PermanentPrepareFailure"
        ],
        timeout=30,
        what="Event on the claim",
    )
    assert events[0]["message"].startswith("permanent (invalid-config)")
    assert "taints" not in published_devices(complete_pool(cluster, node.name) or [])["gpu-1"]

    nvml_before = plugin.metric("gpu_dra_nvml_calls_total", {"caller": "other"})
    assert nvml_before > 0, "discovery made no NVML call, or the metric is missing"
    writes_before = plugin.metric("gpu_dra_state_file_writes_total")
    replays_before = plugin.metric("gpu_dra_permanent_verdict_replays_total")
    for _ in range(100):
        again = kubelet.prepare(DRIVER, [ref])[ref[1]]
        assert (again.error, again.error_type) == (first.error, first.error_type)
    assert plugin.metric("gpu_dra_permanent_verdict_replays_total") - replays_before == 100
    assert plugin.metric("gpu_dra_nvml_calls_total", {"caller": "other"}) == nvml_before
    assert plugin.metric("gpu_dra_state_file_writes_total") == writes_before
    assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""


def test_device_status_condition_for_a_permanent_failure(
    cluster: Cluster,
    node: FakeNode,
    pool: list[dict[str, Any]],
    tmp_path: Path,
    plugin: PluginProcess,
) -> None:
    config = {
        "apiVersion": "gpu.resource.example.com/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "SpacePartitioning",
            "spacePartitioningConfig": {"partitionCount": 64},
        },
    }
    ref = allocated_claim(cluster, "status-condition", "gpu-6", pool, config)
    # A second plugin process with device status enabled, in directories of its own
    # (it publishes the same slices as the module's instance, so the two agree).
    other = PluginProcess(
        kubeconfig=cluster.kubeconfig, node_name=node.name, root=tmp_path, args=["--device-status"]
    )
    other.start()
    try:
        other.wait_serving()
        with KubeletStandin(other.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            result = kubelet.prepare(DRIVER, [ref])[ref[1]]
            assert result.error_type == api_pb2.Permanent
        devices = cluster.wait_for(
            lambda: (get_json(cluster, "resourceclaim", "-n", NS, ref[2]).get("status") or {}).get(
                "devices"
            ),
            timeout=30,
            what="claim device status",
        )
        (status,) = devices
        assert (status["driver"], status["device"]) == (DRIVER, "gpu-6")
        (condition,) = status["conditions"]
        assert (condition["type"], condition["status"], condition["reason"]) == (
            "PrepareFailed",
            "True",
            "InvalidConfig",
        )
        assert condition["message"].startswith("permanent (invalid-config): ")
    finally:
        other.stop()


def test_valid_config_yields_cdi_env_and_calls_are_idempotent(
    cluster: Cluster, plugin: PluginProcess, kubelet: KubeletStandin, pool: list[dict[str, Any]]
) -> None:
    config = {
        "apiVersion": "gpu.resource.example.com/v1alpha1",
        "kind": "GpuConfig",
        # Not a time-slice interval: gpu-2 is in MIG mode, where none can be set.
        "sharing": {
            "strategy": "SpacePartitioning",
            "spacePartitioningConfig": {"partitionCount": 2},
        },
    }
    ref = allocated_claim(cluster, "space-partitioned", "gpu-2", pool, config)
    first = kubelet.prepare(DRIVER, [ref])[ref[1]]
    assert first.error == "", first.error
    (device,) = first.devices
    assert (device.device_name, device.pool_name, list(device.request_names)) == (
        "gpu-2",
        plugin.node_name,
        ["gpu"],
    )
    spec_path = CdiSpecs(plugin.cdi_root, DRIVER).claim_spec_path(ref[1])
    spec = plugin.cdi_specs()[spec_path.name]
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env", [])]
    assert spec["kind"] == f"k8s.{DRIVER}/gpu"
    # The default mock fleet has MIG on: the whole GPU is its full-size MIG device,
    # created by this prepare in the plugin's mock driver root.
    (mig,) = live_mig(plugin, pool, "gpu-2")
    assert mig.placement == (0, 8)
    assert env == [
        f"GPU_DEVICE_GPU_2_RESOURCE_CLAIM={ref[1]}",
        "DRA_ADMIN_ACCESS=false",
        "GPU_DEVICE_2=gpu-2",
        "GPU_DEVICE_2_SHARING_STRATEGY=SpacePartitioning",
        "GPU_DEVICE_2_PARTITION_COUNT=2",
        f"GPU_DEVICE_2_UUID={mig.uuid}",
        "NVIDIA_VISIBLE_DEVICES=void",
    ]
    known = {f"{s['kind']}={d['name']}" for s in plugin.cdi_specs().values() for d in s["devices"]}
    for cdi_id in device.cdi_device_ids:
        assert cdi_id in known, f"{cdi_id} resolves to no CDI device"

    again = kubelet.prepare(DRIVER, [ref])[ref[1]]
    assert again == first
    assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""
    assert not spec_path.exists()
    assert live_mig(plugin, pool, "gpu-2") == []
    assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""
    ghost = str(uuid.uuid4())
    assert kubelet.unprepare(DRIVER, [("ns", ghost, "ghost")])[ghost].error == ""


# Seconds to wait for a deleted socket to be back. The plugin checks its sockets every
# second and rebuilds one at the next check (tests/unit/test_serving.py counts the
# checks); the wait only has to outlast a busy machine.
SOCKET_WAIT = 30.0


@pytest.mark.parametrize("socket", ["registration", "service"])
def test_deleted_socket_is_recreated_and_the_plugin_serves_again(
    cluster: Cluster,
    plugin: PluginProcess,
    kubelet: KubeletStandin,
    pool: list[dict[str, Any]],
    socket: str,
) -> None:
    """Either socket deleted: the plugin serves it again and renews its registration (a
    lost service socket rebuilds the registration socket too), and the kubelet stand-in
    registers it anew through the new registration socket: GetInfo and
    NotifyRegistrationStatus(registered) after the deletion."""
    name = f"socket-loss-{socket}"
    ref = allocated_claim(cluster, name, "gpu-4" if socket == "service" else "gpu-5", pool)
    registration = plugin.registry_dir / f"{DRIVER}-reg.sock"
    path = {"registration": registration, "service": plugin.data_dir / "dra.sock"}[socket]
    labels = {"socket": socket}
    before = plugin.metric("gpu_dra_socket_recreations_total", labels)

    path.unlink()
    deleted = time.monotonic()
    cluster.wait_for(
        lambda: plugin.metric("gpu_dra_socket_recreations_total", labels) > before,
        timeout=SOCKET_WAIT,
        interval=0.05,
        what=f"{socket} socket recreated",
    )
    elapsed = time.monotonic() - deleted
    assert path.is_socket()
    print(f"{socket} socket back after {elapsed:.2f}s")

    cluster.wait_for(
        lambda: kubelet.registrations_since(registration, deleted),
        timeout=10,
        interval=0.05,
        what="the kubelet stand-in registering the plugin again",
    )
    registered = kubelet.wait_for_plugin(DRIVER, timeout=10)
    assert registered.registered_at > deleted, "the stand-in still uses the old registration"
    # The plugin cleared its registered flag when it renewed the socket; the new
    # NotifyRegistrationStatus set it again.
    assert plugin.metric("gpu_dra_kubelet_registered") == 1
    result = kubelet.prepare(DRIVER, [ref])[ref[1]]
    assert result.error == "", result.error
    assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""
    plugin.check_alive()


def _local_state(plugin: PluginProcess, uid: str) -> tuple[bool, str | None]:
    spec = CdiSpecs(plugin.cdi_root, DRIVER).claim_spec_path(uid).exists()
    entry = Checkpoint(plugin.data_dir).load().get(uid)
    return spec, None if entry is None else str(entry.state)


def _crash(cluster: Cluster, node: FakeNode, root: Path, failpoint: str, call: Any) -> None:
    crashing = start_plugin(cluster, node, root, GPU_DRA_FAILPOINTS=failpoint)
    standin = KubeletStandin(crashing.registry_dir)
    standin.start()
    try:
        standin.wait_for_plugin(DRIVER)
        with pytest.raises(KubeletStandinError):
            call(standin)
        assert crashing.wait_exit(timeout=10) == -signal.SIGKILL
    finally:
        standin.stop()
        if crashing.proc is not None:
            crashing.kill()


@pytest.fixture(scope="module")
def crash_claim(
    cluster: Cluster, pool: list[dict[str, Any]], plugin: PluginProcess
) -> tuple[str, str, str]:
    ref = allocated_claim(cluster, "crash-me", "gpu-3", pool)
    plugin.stop()  # the crash tests run their own instances on the same directories
    return ref


@pytest.mark.parametrize("failpoint", PREPARE_FAILPOINTS)
def test_kill_during_prepare_then_retry(
    cluster: Cluster,
    node: FakeNode,
    plugin_root: Path,
    crash_claim: tuple[str, str, str],
    failpoint: str,
) -> None:
    ref = crash_claim
    if failpoint == "prepare-rollback-after-cdi-removed":
        # Reached when a half-done prepare is rolled back: leave one behind, then the
        # next instance dies in its start-up recovery.
        _crash(cluster, node, plugin_root, "prepare-after-cdi", lambda k: k.prepare(DRIVER, [ref]))
        dying = start_plugin(cluster, node, plugin_root, GPU_DRA_FAILPOINTS=failpoint)
        assert dying.wait_exit(timeout=30) == -signal.SIGKILL, dying.logs()
    else:
        _crash(cluster, node, plugin_root, failpoint, lambda k: k.prepare(DRIVER, [ref]))

    plugin = start_plugin(cluster, node, plugin_root)
    try:
        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            result = kubelet.prepare(DRIVER, [ref])[ref[1]]
            assert result.error == "", result.error
            assert [d.device_name for d in result.devices] == ["gpu-3"]
            assert _local_state(plugin, ref[1]) == (True, ClaimState.PREPARE_COMPLETED.value)
            assert sorted(CdiSpecs(plugin.cdi_root, DRIVER).list_claim_specs()) == [ref[1]]
            assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""
            assert _local_state(plugin, ref[1]) == (False, None)
            assert not list(plugin.cdi_root.glob("*.tmp*")) and not list(
                plugin.data_dir.glob("*.tmp*")
            )
    finally:
        plugin.stop()


def _prepare_and_stop(
    cluster: Cluster, node: FakeNode, root: Path, ref: tuple[str, str, str]
) -> PluginProcess:
    """Prepare the claim with a plugin of its own, then stop that plugin."""
    plugin = start_plugin(cluster, node, root)
    try:
        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            assert kubelet.prepare(DRIVER, [ref])[ref[1]].error == ""
    finally:
        plugin.stop()
    return plugin


@pytest.mark.parametrize("failpoint", UNPREPARE_FAILPOINTS)
def test_kill_during_unprepare_then_retry(
    cluster: Cluster,
    node: FakeNode,
    plugin_root: Path,
    crash_claim: tuple[str, str, str],
    failpoint: str,
) -> None:
    ref = crash_claim
    plugin = _prepare_and_stop(cluster, node, plugin_root, ref)

    _crash(cluster, node, plugin_root, failpoint, lambda k: k.unprepare(DRIVER, [ref]))

    plugin = start_plugin(cluster, node, plugin_root)
    try:
        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""
            assert _local_state(plugin, ref[1]) == (False, None)
            assert CdiSpecs(plugin.cdi_root, DRIVER).list_claim_specs() == {}
            # The device is free again: preparing works and leaves exactly one spec.
            assert kubelet.prepare(DRIVER, [ref])[ref[1]].error == ""
            assert sorted(CdiSpecs(plugin.cdi_root, DRIVER).list_claim_specs()) == [ref[1]]
            assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""
    finally:
        plugin.stop()


def test_reboot_empties_cdi_root_specs_are_back_before_registration(
    cluster: Cluster, node: FakeNode, plugin_root: Path, crash_claim: tuple[str, str, str]
) -> None:
    ref = crash_claim
    plugin = _prepare_and_stop(cluster, node, plugin_root, ref)
    # The clean stop folded the journal's log into a snapshot every release reads.
    snapshot = json.loads((plugin.data_dir / "checkpoint.json").read_bytes())
    assert snapshot["schemaVersion"] == 1 and ref[1] in snapshot["entries"]
    assert (plugin.data_dir / "checkpoint.log").read_bytes() == b""
    specs = CdiSpecs(plugin.cdi_root, DRIVER)
    before = specs.claim_spec_path(ref[1]).read_bytes()
    for path in plugin.cdi_root.iterdir():  # the CDI root is a tmpfs: a reboot empties it
        path.unlink()

    plugin = start_plugin(cluster, node, plugin_root)
    try:
        registration = plugin.registry_dir / f"{DRIVER}-reg.sock"
        cluster.wait_for(registration.exists, timeout=30, what="registration socket")
        # The kubelet may call prepare the moment the socket appears: the spec is there.
        assert specs.claim_spec_path(ref[1]).read_bytes() == before
        assert specs.common_spec_path.exists()
        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            again = kubelet.prepare(DRIVER, [ref])[ref[1]]
            assert again.error == "" and [d.device_name for d in again.devices] == ["gpu-3"]
            assert kubelet.unprepare(DRIVER, [ref])[ref[1]].error == ""
            assert _local_state(plugin, ref[1]) == (False, None)
    finally:
        plugin.stop()
    assert "recreated the CDI specs of 1 prepared claim(s)" in plugin.logs()


def test_corrupt_checkpoint_is_reported_and_kept(
    cluster: Cluster, node: FakeNode, plugin_root: Path, crash_claim: tuple[str, str, str]
) -> None:
    ref = crash_claim
    data_dir = PluginProcess(
        kubeconfig=cluster.kubeconfig, node_name=node.name, root=plugin_root
    ).data_dir
    journal = data_dir / "checkpoint.json"
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_bytes(b'{"schemaVersion": 1, "checksum": "0000", "entries": {}}')
    corrupt = journal.read_bytes()
    plugin = start_plugin(cluster, node, plugin_root)
    try:
        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            result = kubelet.prepare(DRIVER, [ref])[ref[1]]
            assert "checkpoint" in result.error and str(journal) in result.error
            assert result.error_type != api_pb2.Permanent
        assert journal.read_bytes() == corrupt
        assert "checkpoint" in plugin.logs()
    finally:
        plugin.stop()
        journal.unlink()
