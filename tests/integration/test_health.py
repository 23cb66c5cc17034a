"""Device health against the real control plane: Xid -> taint -> scheduler, eviction,
permanent device-failed errors. Events are injected with `gpu-dra mock`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.proto.dra.v1 import api_pb2
from driver.proto.dra_health.v1 import api_pb2 as health_v1
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
    unschedulable,
    whole_gpu_selector,
)
from tests.integration.kubelet_standin import KubeletStandin
from tests.integration.plugin_process import DRIVER, PluginProcess, running_plugin

NS = "health-test"
XID_KEY = f"{DRIVER}/xid"


GPU_DRA = Path(sys.executable).parent / "gpu-dra"


def gpu_dra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPU_DRA, *args], capture_output=True, text=True, timeout=30)


def inject(plugin: PluginProcess, *args: str) -> None:
    done = gpu_dra("mock", *args, f"--state-dir={plugin.data_dir}")
    assert done.returncode == 0, done.stderr


def taints(cluster: Cluster, node: str) -> dict[str, list[dict[str, Any]]]:
    pool = complete_pool(cluster, node) or []
    return {name: d["taints"] for name, d in published_devices(pool).items() if d.get("taints")}


def family(pool: list[dict[str, Any]], gpu: str) -> set[str]:
    """The GPU and every partition of it."""
    uuid = gpu_uuid_of(pool, gpu)
    return {
        name
        for name, d in published_devices(pool).items()
        if d["attributes"].get("uuid", {}).get("string") == uuid
        or d["attributes"].get("parentUUID", {}).get("string") == uuid
    }


@pytest.fixture(scope="module", autouse=True)
def _release_namespace(cluster: Cluster) -> Iterator[None]:
    yield
    delete_namespace(cluster, NS)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plugin")


@pytest.fixture(scope="module")
def pool(cluster: Cluster, node: FakeNode, root: Path) -> Iterator[list[dict[str, Any]]]:
    apply(
        cluster,
        namespace(NS),
        device_class(
            "hw-gpu.example.com",
            f'device.driver == "{DRIVER}" && !has(device.attributes["{DRIVER}"].profile)',
        ),
        device_class(
            "hw-mig.example.com",
            f'device.driver == "{DRIVER}" && has(device.attributes["{DRIVER}"].profile)',
        ),
    )
    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root):
        published = cluster.wait_for(
            lambda: complete_pool(cluster, node.name), timeout=60, what="pool"
        )
    # Each test runs its own instance on these directories; the slices stay published.
    yield published


def selector_for(pool: list[dict[str, Any]], gpu: str, attribute: str | None = None) -> str:
    """CEL for the whole GPU, or for the devices whose `attribute` is the GPU's UUID."""
    if attribute is None:
        return whole_gpu_selector(pool, gpu)
    return f'device.attributes["{DRIVER}"].{attribute} == "{gpu_uuid_of(pool, gpu)}"'


def test_xid_79_taints_gpu_and_partitions_blocks_scheduling_and_fails_prepare(
    cluster: Cluster, node: FakeNode, root: Path, pool: list[dict[str, Any]]
) -> None:
    apply(
        cluster,
        claim("before", NS, "hw-gpu.example.com", selector_for(pool, "gpu-4")),
        pod_using("before", NS, "before"),
    )
    cluster.wait_for(
        lambda: allocation(cluster, NS, "before"), timeout=60, what="allocation before the Xid"
    )
    uid = get_json(cluster, "resourceclaim", "-n", NS, "before")["metadata"]["uid"]

    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin:
        started = time.monotonic()
        inject(plugin, "xid", "--device", "gpu-4", "--xid", "79")
        tainted = cluster.wait_for(
            lambda: (t := taints(cluster, node.name)) and family(pool, "gpu-4") <= set(t) and t,
            timeout=10,
            interval=0.05,
            what="Xid 79 taint on gpu-4 and its partitions",
        )
        print(f"Xid 79 -> taint visible in the API after {time.monotonic() - started:.3f}s")
        assert set(tainted) == family(pool, "gpu-4")
        assert tainted["gpu-4"] == [
            {
                "key": XID_KEY,
                "value": "79",
                "effect": "NoSchedule",
                "timeAdded": tainted["gpu-4"][0]["timeAdded"],
            }
        ]

        # New claims never get the GPU or any of its partitions.
        apply(
            cluster,
            claim("whole-after", NS, "hw-gpu.example.com", selector_for(pool, "gpu-4")),
            pod_using("whole-after", NS, "whole-after"),
            claim(
                "part-after", NS, "hw-mig.example.com", selector_for(pool, "gpu-4", "parentUUID")
            ),
            pod_using("part-after", NS, "part-after"),
        )
        for pod in ("whole-after", "part-after"):
            cluster.wait_for(
                lambda pod=pod: unschedulable(cluster, NS, pod),
                timeout=60,
                what=f"{pod} unschedulable",
            )
            assert allocation(cluster, NS, pod) is None

        # The claim allocated before the failure learns that retrying is pointless.
        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            result = kubelet.prepare(DRIVER, [(NS, uid, "before")])[uid]
            assert result.error.startswith("permanent (device-failed): "), result.error
            assert result.error_type == api_pb2.Permanent
            assert kubelet.unprepare(DRIVER, [(NS, uid, "before")])[uid].error == ""

            # The kubelet's health stream says the same, with the complete device list.
            watch = kubelet.watch_health(DRIVER)
            try:
                first = watch.wait_for(lambda messages: bool(messages), timeout=10)[0]
            finally:
                watch.close()
            health = {d.device.device_name: d.health for d in first.devices}
            assert set(health) == set(published_devices(pool))
            unhealthy = {name for name, h in health.items() if h == health_v1.UNHEALTHY}
            assert unhealthy == family(pool, "gpu-4")
            assert all(h == health_v1.HEALTHY for n, h in health.items() if n not in unhealthy)
            assert {d.device.pool_name for d in first.devices} == {node.name}

    # A restart keeps the taint; deleting the slices brings them back tainted.
    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin:
        cluster.kubectl("delete", "resourceslices", f"--field-selector=spec.nodeName={node.name}")
        cluster.wait_for(
            lambda: family(pool, "gpu-4") <= set(taints(cluster, node.name)),
            timeout=30,
            what="taint after restart",
        )
        inject(plugin, "reset", "--device", "gpu-4")
        cluster.wait_for(
            lambda: not taints(cluster, node.name), timeout=10, what="taint removed by reset"
        )
        # Once the old claim lets go of the healthy GPU, the waiting claim gets it (the
        # waiting partition claim would compete for it: it goes first).
        for name in ("part-after", "before"):
            cluster.kubectl("delete", "pod", "-n", NS, name, "--force", "--grace-period=0")
            cluster.kubectl("delete", "resourceclaim", "-n", NS, name, "--wait=false")
        cluster.wait_for(
            lambda: allocation(cluster, NS, "whole-after"),
            timeout=60,
            what="allocation after reset",
        )


def test_application_xid_13_changes_nothing(
    cluster: Cluster, node: FakeNode, root: Path, pool: list[dict[str, Any]]
) -> None:
    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin:
        cluster.wait_for(lambda: complete_pool(cluster, node.name), timeout=30, what="pool")
        assert "\ngpu_dra_api_writes_total " in plugin.metrics()
        writes = plugin.metric("gpu_dra_api_writes_total")
        inject(plugin, "xid", "--device", "gpu-5", "--xid", "13")
        cluster.wait_for(
            lambda: (
                plugin.metric("gpu_dra_xid_events_total", {"xid": "13", "verdict": "ignored"}) == 1
            ),
            timeout=10,
            what="Xid 13 handled",
        )
        time.sleep(1)
        assert taints(cluster, node.name) == {}
        assert plugin.metric("gpu_dra_api_writes_total") == writes


def test_no_execute_taint_evicts_the_pod_using_the_gpu(
    cluster: Cluster, node: FakeNode, tmp_path: Path, pool: list[dict[str, Any]]
) -> None:
    apply(
        cluster,
        claim("evict-me", NS, "hw-gpu.example.com", selector_for(pool, "gpu-6")),
        pod_using("evict-me", NS, "evict-me"),
    )
    cluster.wait_for(lambda: allocation(cluster, NS, "evict-me"), timeout=60, what="allocation")
    cluster.wait_for(
        lambda: get_json(cluster, "pod", "-n", NS, "evict-me")["spec"].get("nodeName") == node.name,
        timeout=60,
        what="pod bound to the node",
    )
    with running_plugin(
        kubeconfig=cluster.kubeconfig,
        node_name=node.name,
        root=tmp_path,
        args=["--xid-taint-effect=NoExecute"],
    ) as plugin:
        inject(plugin, "xid", "--device", "gpu-6", "--xid", "79")

        def evicted() -> bool:
            pod = json.loads(
                cluster.kubectl(
                    "get", "pod", "-n", NS, "evict-me", "-o", "json", "--ignore-not-found"
                ).stdout
                or "null"
            )
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                return True
            return any(
                c["type"] == "DisruptionTarget" and c["status"] == "True"
                for c in pod["status"].get("conditions", [])
            )

        cluster.wait_for(evicted, timeout=90, what="device-taint eviction of the pod")
        inject(plugin, "reset", "--all")
        cluster.wait_for(lambda: not taints(cluster, node.name), timeout=10, what="taints cleared")


def on_slice(pool: list[dict[str, Any]], gpu: str, memory_slice: int) -> set[str]:
    """The GPU and those of its partitions whose memory slices include `memory_slice`."""
    out: set[str] = set()
    for name in family(pool, gpu):
        attrs = published_devices(pool)[name]["attributes"]
        if "placementStart" not in attrs:
            out.add(name)  # the whole GPU
            continue
        start, size = attrs["placementStart"]["int"], attrs["placementSize"]["int"]
        if start <= memory_slice < start + size:
            out.add(name)
    return out


def test_xid_on_a_partitions_gpu_instance_taints_only_its_memory_slices(
    cluster: Cluster, node: FakeNode, root: Path, pool: list[dict[str, Any]]
) -> None:
    uuid = gpu_uuid_of(pool, "gpu-7")

    def partition(start: int) -> str:
        attrs = f'device.attributes["{DRIVER}"]'
        return (
            f'{attrs}.parentUUID == "{uuid}" && {attrs}.profile == "1g.10gb" && '
            f"{attrs}.placementStart == {start}"
        )

    apply(
        cluster,
        claim("slice-3", NS, "hw-mig.example.com", partition(3)),
        pod_using("slice-3", NS, "slice-3"),
    )
    results = cluster.wait_for(
        lambda: allocation(cluster, NS, "slice-3"), timeout=60, what="partition allocation"
    )
    assert [r["device"] for r in results] == ["gpu-7-mig-1g10gb-3"]
    uid = get_json(cluster, "resourceclaim", "-n", NS, "slice-3")["metadata"]["uid"]
    expected = on_slice(pool, "gpu-7", 3)
    assert {"gpu-7", "gpu-7-mig-1g10gb-3"} <= expected
    assert "gpu-7-mig-1g10gb-4" not in expected

    with (
        running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin,
        KubeletStandin(plugin.registry_dir) as kubelet,
    ):
        kubelet.wait_for_plugin(DRIVER)
        # Prepare creates the partition's GPU instance (dynamic MIG).
        prepared = kubelet.prepare(DRIVER, [(NS, uid, "slice-3")])[uid]
        assert prepared.error == "", prepared.error
        inject(plugin, "xid", "--device", "gpu-7-mig-1g10gb-3", "--xid", "94", "--instance")
        tainted = cluster.wait_for(
            lambda: (t := taints(cluster, node.name)) and set(t) == expected and t,
            timeout=10,
            interval=0.05,
            what="Xid 94 taint on the devices on memory slice 3 of gpu-7",
        )
        assert tainted["gpu-7-mig-1g10gb-3"][0]["key"] == XID_KEY
        assert tainted["gpu-7-mig-1g10gb-3"][0]["value"] == "94"

        # A partition on another memory slice of the same GPU is still allocatable.
        apply(
            cluster,
            claim("slice-4", NS, "hw-mig.example.com", partition(4)),
            pod_using("slice-4", NS, "slice-4"),
        )
        cluster.wait_for(
            lambda: allocation(cluster, NS, "slice-4"), timeout=60, what="sibling allocation"
        )
        assert kubelet.unprepare(DRIVER, [(NS, uid, "slice-3")])[uid].error == ""

    # The placement stays tainted across a restart, without the GPU instance; a reset
    # of the GPU clears it.
    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin:
        cluster.kubectl("delete", "resourceslices", f"--field-selector=spec.nodeName={node.name}")
        cluster.wait_for(
            lambda: set(taints(cluster, node.name)) == expected,
            timeout=30,
            what="partition taint after restart",
        )
        inject(plugin, "reset", "--device", "gpu-7")
        cluster.wait_for(
            lambda: not taints(cluster, node.name), timeout=10, what="taint removed by reset"
        )
    for name in ("slice-3", "slice-4"):
        cluster.kubectl("delete", "pod", "-n", NS, name, "--force", "--grace-period=0")
        cluster.kubectl("delete", "resourceclaim", "-n", NS, name, "--wait=false")


def test_health_clear_removes_the_taint_from_the_published_slice(
    cluster: Cluster, node: FakeNode, root: Path, pool: list[dict[str, Any]]
) -> None:
    """The day-2 commands against a running plugin and the real API server: an Xid
    taints gpu-6, `gpu-dra health` shows it from both sources, `gpu-dra health clear`
    removes it from the published ResourceSlice through the plugin."""
    gpu = family(pool, "gpu-6")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [GPU_DRA, *args, f"--state-dir={plugin.data_dir}"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )

    def show() -> dict[str, Any]:
        done = run(
            "health", "-o", "json", f"--kubeconfig={cluster.kubeconfig}", f"--node-name={node.name}"
        )
        assert done.returncode == 0, done.stderr
        report: dict[str, Any] = json.loads(done.stdout)
        return report

    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin:
        inject(plugin, "xid", "--device", "gpu-6", "--xid", "79")
        cluster.wait_for(
            lambda: gpu <= set(taints(cluster, node.name)), timeout=10, what="Xid 79 on gpu-6"
        )
        report = show()
        assert report["plugin"]["running"] and report["plugin"]["acceptsClear"]
        (failure,) = report["store"]["failures"]
        assert (failure["device"], failure["key"], failure["value"]) == ("gpu-6", XID_KEY, "79")
        published = report["slices"]["taints"]
        assert report["slices"]["read"] and {t["device"] for t in published} == gpu
        assert all(t["reason"].startswith("Xid 79") for t in published)
        assert report["consistent"] is True

        refused = run("health", "clear", "gpu-6")  # no terminal, no --yes
        assert refused.returncode == 1 and "refusing without --yes" in refused.stderr
        assert gpu <= set(taints(cluster, node.name))

        cleared = run("health", "clear", "gpu-6", "--yes")
        assert cleared.returncode == 0, cleared.stderr
        assert "the API server accepted" in cleared.stdout
        # Accepted means published: the taint is gone from the API already.
        assert not gpu & set(taints(cluster, node.name))
        assert (
            plugin.metric(
                "gpu_dra_xid_events_total", {"xid": "operator-clear", "verdict": "cleared"}
            )
            == 1
        )
        assert "operator cleared gpu-6" in plugin.logs()
        after = show()
        assert after["store"]["failures"] == [] and after["slices"]["taints"] == []
        assert after["consistent"] is True

        # The journal is readable while the plugin runs; quarantine refuses then.
        journal = run("journal", "show", "-o", "json")
        assert journal.returncode == 0, journal.stderr
        assert json.loads(journal.stdout)["status"] in ("ok", "absent")
        quarantine = run("journal", "quarantine", "--yes")
        assert quarantine.returncode == 1 and "a kubelet plugin is running" in quarantine.stderr


def node_events(cluster: Cluster, node: FakeNode, reason: str, gpu: str) -> list[dict[str, Any]]:
    """The Node's Events of `reason` about `gpu` (their message starts with its name)."""
    listed = get_json(
        cluster,
        "events",
        "-n",
        "default",
        f"--field-selector=involvedObject.kind=Node,involvedObject.name={node.name},"
        f"reason={reason}",
    )["items"]
    return [e for e in listed if e["message"].startswith(f"{gpu} (")]


def test_a_taint_and_its_clear_are_events_on_the_node(
    cluster: Cluster, node: FakeNode, root: Path, pool: list[dict[str, Any]]
) -> None:
    """`kubectl describe node` tells an operator that a GPU was tainted and when it was
    cleared; the per-GPU metrics follow."""
    uuid = gpu_uuid_of(pool, "gpu-2")
    labels = {"device": "gpu-2", "uuid": uuid}
    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin:
        assert plugin.metric("gpu_dra_gpu_healthy", labels) == 1
        assert plugin.metric("gpu_dra_gpu_xid_events_total", {**labels, "verdict": "fatal"}) == 0
        inject(plugin, "xid", "--device", "gpu-2", "--xid", "79")
        (tainted,) = cluster.wait_for(
            lambda: node_events(cluster, node, "GpuTainted", "gpu-2"),
            timeout=20,
            what="GpuTainted Event on the Node",
        )
        assert tainted["type"] == "Warning"
        assert tainted["involvedObject"]["uid"] == node.uid
        assert tainted["reportingComponent"] == DRIVER
        assert tainted["reportingInstance"] == node.name
        count = len(family(pool, "gpu-2"))
        assert tainted["message"].startswith(f"gpu-2 ({uuid}): Xid 79")
        assert f"taint {XID_KEY}=79:NoSchedule on {count} device(s)" in tainted["message"]
        assert plugin.metric("gpu_dra_gpu_healthy", labels) == 0
        assert plugin.metric("gpu_dra_gpu_xid_events_total", {**labels, "verdict": "fatal"}) == 1

        cleared = gpu_dra("health", "clear", "gpu-2", "--yes", f"--state-dir={plugin.data_dir}")
        assert cleared.returncode == 0, cleared.stderr
        (event,) = cluster.wait_for(
            lambda: node_events(cluster, node, "GpuTaintCleared", "gpu-2"),
            timeout=20,
            what="GpuTaintCleared Event on the Node",
        )
        assert event["type"] == "Normal"
        assert "cleared by an operator (gpu-dra health clear)" in event["message"]
        assert f"taint removed from {count} device(s)" in event["message"]
        assert plugin.metric("gpu_dra_gpu_healthy", labels) == 1


def _slice_of(cluster: Cluster, node: str, device: str) -> str:
    pool = complete_pool(cluster, node) or []
    return next(
        s["metadata"]["name"]
        for s in pool
        if any(d["name"] == device for d in s["spec"].get("devices") or [])
    )


def test_a_taint_keeps_its_time_when_its_slice_is_written_again(
    cluster: Cluster, node: FakeNode, root: Path, pool: list[dict[str, Any]]
) -> None:
    """The API server stamps a taint without `timeAdded` at every create or update of
    its slice. The taint of a GPU that failed first must keep its time when the slice is
    written for a second GPU's failure: NoExecute's `tolerationSeconds` count from it."""
    with running_plugin(kubeconfig=cluster.kubeconfig, node_name=node.name, root=root) as plugin:
        inject(plugin, "xid", "--device", "gpu-1", "--xid", "79")
        first = cluster.wait_for(
            lambda: taints(cluster, node.name).get("gpu-1"), timeout=10, what="gpu-1 taint"
        )
        assert _slice_of(cluster, node.name, "gpu-1") == _slice_of(cluster, node.name, "gpu-2")
        time.sleep(1.1)  # timeAdded has a resolution of seconds
        inject(plugin, "xid", "--device", "gpu-2", "--xid", "79")
        cluster.wait_for(
            lambda: taints(cluster, node.name).get("gpu-2"), timeout=10, what="gpu-2 taint"
        )
        assert taints(cluster, node.name)["gpu-1"] == first
        inject(plugin, "reset", "--all")
        cluster.wait_for(
            lambda: not taints(cluster, node.name), timeout=10, what="taints removed by reset"
        )
