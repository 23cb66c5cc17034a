"""Events on the Node when a GPU is tainted or its taint cleared, and the per-GPU
health metrics, from the health monitor's and `gpu-dra health clear`'s changes."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import pytest

from driver.cli import build_parser
from driver.devices.model import PoolDevices, build_pool
from driver.health.clear import OPERATOR_CAUSE
from driver.health.failures import device_placement, overlaps
from driver.health.monitor import RECOVERED_CAUSE, HealthMonitor, MigInstances
from driver.health.store import HealthStore
from driver.health.xid import XidPolicy
from driver.kube.api import ApiError
from driver.kube.kube_events import NodeEvent, NodeEvents
from driver.nvml.discovered import HealthEvent, MigInstance
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.observability import metrics
from tests.control_socket import control_socket

DRIVER = "gpu.example.com"


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[NodeEvent] = []
        self.started = self.stopped = False

    def post(self, event: NodeEvent) -> None:
        self.events.append(event)

    def start(self) -> None:
        self.started = True

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped = True


class Node:
    def __init__(self, root: Path, *, mig_instances: MigInstances | None = None) -> None:
        self.backend = MockBackend(MockNvml(default_fleet(), "node-1"))
        self.pool: PoolDevices = build_pool(self.backend.discover())
        self.store = HealthStore(root / "health.json")
        self.sink = RecordingSink()
        self.monitor = HealthMonitor(
            self.backend,
            self.store,
            XidPolicy(),
            None,
            self.pool.devices,
            node_name="node-1",
            node_events=self.sink,
            driver=DRIVER,
            taint_effect="NoExecute",
            mig_instances=mig_instances,
        )

    def uuid(self, minor: int) -> str:
        return self.pool.device(f"gpu-{minor}").gpu_uuid

    def family(self, minor: int) -> list[str]:
        return [d.name for d in self.pool.devices_of_gpu(self.uuid(minor))]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_a_fatal_xid_and_the_recovery_are_events_on_the_node(node: Node) -> None:
    uuid = node.uuid(4)
    node.monitor.handle(HealthEvent(uuid, "xid", xid=79, message="fell off the bus"))
    (tainted,) = node.sink.events
    assert (tainted.reason, tainted.event_type) == ("GpuTainted", "Warning")
    count = len(node.family(4))
    assert tainted.message.startswith(f"gpu-4 ({uuid}): Xid 79: fell off the bus (since ")
    assert f"; taint {DRIVER}/xid=79:NoExecute on {count} device(s): gpu-4, " in tainted.message
    assert tainted.message.endswith(f" and {count - 5} more")

    # The same Xid again moves no taint: no event.
    node.monitor.handle(HealthEvent(uuid, "xid", xid=79))
    assert len(node.sink.events) == 1

    node.monitor.handle(HealthEvent(uuid, "recovered"))
    cleared = node.sink.events[-1]
    assert (cleared.reason, cleared.event_type) == ("GpuTaintCleared", "Normal")
    assert cleared.message.startswith(f"gpu-4 ({uuid}): {RECOVERED_CAUSE}; taint removed from ")
    assert "(was: Xid 79" in cleared.message


def test_an_ignored_xid_is_no_event(node: Node) -> None:
    node.monitor.handle(HealthEvent(node.uuid(1), "xid", xid=13))
    assert node.sink.events == []


def test_a_failed_gpu_instance_names_only_its_devices(tmp_path: Path) -> None:
    def live_instances(gpu_uuid: str) -> list[MigInstance]:
        return [MigInstance(gpu_uuid, gi_id=9, profile_id=19, placement=(3, 1), ci_id=0)]

    node = Node(tmp_path, mig_instances=live_instances)
    uuid = node.uuid(2)
    node.monitor.handle(HealthEvent(uuid, "xid", xid=94, gpu_instance_id=9))
    (event,) = node.sink.events
    on_slice_3 = [
        d.name for d in node.pool.devices_of_gpu(uuid) if overlaps(device_placement(d), (3, 1))
    ]
    assert 1 < len(on_slice_3) < len(node.family(2))
    assert f"gpu-2 ({uuid}): Xid 94 on GPU instance 9 at memory slice 3" in event.message
    assert f"{DRIVER}/xid=94:NoExecute on {len(on_slice_3)} device(s)" in event.message

    # A failure of the whole GPU taints the rest too: a new event for the new failure.
    node.monitor.handle(HealthEvent(uuid, "gpu-lost"))
    assert node.sink.events[-1].message.startswith(f"gpu-2 ({uuid}): GPU is lost")
    assert f"{DRIVER}/gpu-lost:NoExecute on {len(node.family(2))} device(s)" in (
        node.sink.events[-1].message
    )


def test_an_operator_clear_is_an_event(node: Node, short_dir: Path) -> None:
    """`gpu-dra health clear` through the running monitor's control requests."""
    uuid = node.uuid(6)
    node.monitor.handle(HealthEvent(uuid, "ecc-dbe"))
    node.monitor.start()
    try:
        with control_socket(short_dir, node.monitor.control):
            args = build_parser().parse_args(
                ["health", "clear", "gpu-6", "--yes", "--state-dir", str(short_dir)]
            )
            out = io.StringIO()
            code = args.run(args, out=out, err=io.StringIO(), stdin=io.StringIO())
    finally:
        node.monitor.stop()
    assert code == 0, out.getvalue()
    cleared = node.sink.events[-1]
    assert cleared.reason == "GpuTaintCleared"
    assert cleared.message.startswith(f"gpu-6 ({uuid}): {OPERATOR_CAUSE}; taint removed from ")
    assert "(was: Xid 48" in cleared.message


def test_the_event_sink_runs_with_the_monitor(node: Node) -> None:
    node.monitor.start()
    node.monitor.stop()
    assert node.sink.started and node.sink.stopped


def test_per_gpu_health_series_exist_from_the_start_and_follow_the_store(node: Node) -> None:
    value = metrics.REGISTRY.get_sample_value
    uuid = node.uuid(5)
    labels = {"uuid": uuid, "device": "gpu-5"}
    assert value("gpu_dra_gpu_healthy", labels) == 1
    for verdict in ("fatal", "ignored"):
        assert value("gpu_dra_gpu_xid_events_total", {**labels, "verdict": verdict}) is not None
    before = value("gpu_dra_gpu_xid_events_total", {**labels, "verdict": "fatal"}) or 0
    node.monitor.handle(HealthEvent(uuid, "xid", xid=79))
    assert value("gpu_dra_gpu_healthy", labels) == 0
    assert value("gpu_dra_gpu_xid_events_total", {**labels, "verdict": "fatal"}) == before + 1
    node.monitor.handle(HealthEvent(uuid, "recovered"))
    assert value("gpu_dra_gpu_healthy", labels) == 1


class FakeApi:
    def __init__(self, *, node_uid: str | None = "uid-1", fail_post: bool = False) -> None:
        self.node_uid = node_uid
        self.fail_post = fail_post
        self.posted: list[dict[str, Any]] = []
        self.release = threading.Event()
        self.release.set()

    def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        if method == "GET":
            if self.node_uid is None:
                raise ApiError(403, "Forbidden")
            return {"metadata": {"uid": self.node_uid}}
        self.release.wait(10)
        if self.fail_post:
            raise ApiError(500, "Internal Server Error")
        assert path == "/api/v1/namespaces/default/events"
        self.posted.append(kwargs["body"])
        return kwargs["body"]


def test_node_events_are_posted_on_the_node_in_the_background() -> None:
    api = FakeApi()
    events = NodeEvents(api, driver=DRIVER, node_name="node-1")  # type: ignore[arg-type]
    events.start()
    events.post(NodeEvent("GpuTainted", "x" * 2000))
    events.stop()
    (body,) = api.posted
    assert body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "node-1",
        "uid": "uid-1",
    }
    assert (body["reason"], body["type"], len(body["message"])) == ("GpuTainted", "Warning", 1024)
    assert body["metadata"]["namespace"] == "default"
    assert body["metadata"]["name"].startswith("node-1.")
    assert (body["reportingComponent"], body["reportingInstance"]) == (DRIVER, "node-1")


def test_node_events_never_block_or_raise() -> None:
    api = FakeApi(node_uid=None, fail_post=True)
    api.release.clear()  # the API server hangs
    events = NodeEvents(api, driver=DRIVER, node_name="node-1", queue_size=2)  # type: ignore[arg-type]
    events.start()
    for i in range(5):
        events.post(NodeEvent("GpuTainted", str(i)))  # returns at once
    assert events.dropped >= 2
    api.release.set()
    events.stop()
    assert api.posted == [] and events.posted == 0
    # Without the Node's UID (no RBAC to read it), the node name stands in, as the
    # kubelet's own Node events carry it.
    assert events.body(NodeEvent("GpuTainted", "m"))["involvedObject"]["uid"] == "node-1"
