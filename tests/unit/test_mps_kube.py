"""MPS daemons as Deployments (--mps-daemons=kubernetes, docs/mps.md) through
DeviceState on the mock, against an in-memory API that plays the Deployment
controller and the kubelet: prepare creates a Deployment pinned to the node and
waits until its pod is ready; unprepare deletes it and waits until its pod is gone;
a plugin restart adopts it by UID and creates it again where it is gone; one that
never gets ready fails the prepare naming the device and leaves nothing behind.
tests/integration/test_chart_mps_policy.py runs the same code against a real API
server and the chart's admission policy."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import PoolOptions
from driver.kube.api import ApiError
from driver.kube.mps_daemons import KubeDaemons
from driver.kube.mps_manifest import DaemonPodSettings, deployment_name
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.mps import DaemonDirs
from driver.state.journal.checkpoint import Checkpoint
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.daemons import daemon_directory
from driver.state.prepare import DeviceState
from driver.state.recovery.startup_recovery import RecoveryReport
from tests.state_fakes import node_state
from tests.unit.test_mps_prepare import DRIVER, FLEET, NODE, Claims

NAMESPACE = "gpu-dra-driver"
IMAGE = "registry.example/gpu-dra-driver:1.2.3"
DEPLOYMENTS = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
PODS = f"/api/v1/namespaces/{NAMESPACE}/pods"
LABEL = f"{DRIVER}/mps-daemon"


class FakeCluster:
    """Deployments and their pods. A created Deployment's pod turns ready after
    `ready_after` reads (never, with None); a deleted one's pod stays `terminating`
    reads long. `tick` is the daemons' sleep: it advances the clock."""

    def __init__(self) -> None:
        self.deployments: dict[str, dict[str, Any]] = {}
        # Deployment name -> reads until its pod is gone (-1: running, not deleted)
        self.pods: dict[str, int] = {}
        self.ready_after: int | None = 2
        self.terminating = 3
        self.now = 0.0
        self.log: list[str] = []
        self._reads: dict[str, int] = {}
        # Deployment name -> its pod's UID and its container's restarts
        self.pod_uids: dict[str, str] = {}
        self.restarts: dict[str, int] = {}

    def replace_pod(self, name: str) -> None:
        """The Deployment's pod deleted or evicted: the controller made a new one."""
        self.pod_uids[name] = str(uuid.uuid4())
        self.restarts[name] = 0

    def restart_container(self, name: str) -> None:
        """The daemon died in its pod: the kubelet restarted the container."""
        self.restarts[name] += 1

    def tick(self, seconds: float) -> None:
        self.now += seconds

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str | int] | None = None,
        body: object = None,
    ) -> dict[str, Any]:
        self.log.append(f"{method} {path}")
        if path == DEPLOYMENTS and method == "POST":
            assert isinstance(body, dict)
            name = body["metadata"]["name"]
            if name in self.deployments:
                raise ApiError(409, "Conflict", "{}")
            doc = json.loads(json.dumps(body))
            doc["metadata"].update(uid=str(uuid.uuid4()), generation=1)
            self.deployments[name] = doc
            self.pods[name] = -1
            self._reads[name] = 0
            self.replace_pod(name)
            return doc
        if path == DEPLOYMENTS and method == "GET":
            assert query is not None
            key = str(query["labelSelector"])
            items = [d for d in self.deployments.values() if key in d["metadata"]["labels"]]
            return {"items": json.loads(json.dumps(items))}
        if path == PODS and method == "GET":
            assert query is not None
            name = str(query["labelSelector"]).split("=", 1)[1]
            left = self.pods.get(name)
            if left is None:
                return {"items": []}
            if left > 0:
                self.pods[name] = left - 1
            elif left == 0:
                del self.pods[name]
                return {"items": []}
            uid = self.pod_uids.get(name, "")
            pod = {"metadata": {"name": f"{name}-x", "uid": uid}, "status": {"phase": "Pending"}}
            pod["status"]["containerStatuses"] = [
                {
                    "state": {"waiting": {"reason": "ErrImagePull", "message": "no such image"}},
                    "restartCount": self.restarts.get(name, 0),
                }
            ]
            return {"items": [pod]}
        name = path.rsplit("/", 1)[1]
        doc = self.deployments.get(name)
        if doc is None:
            raise ApiError(404, "Not Found", "{}")
        if method == "GET":
            self._reads[name] += 1
            if self.ready_after is not None and self._reads[name] > self.ready_after:
                doc["status"] = {"observedGeneration": 1, "readyReplicas": 1}
            return doc
        if method == "DELETE":
            del self.deployments[name]
            if name in self.pods:
                self.pods[name] = self.terminating
            return {}
        raise AssertionError(f"unexpected {method} {path}")


class Node:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.backend = MockBackend(MockNvml(FLEET, NODE, driver_root=root / "root"))
        self.claims = Claims()
        self.cluster = FakeCluster()
        self.report = RecoveryReport()

    def daemons(self) -> KubeDaemons:
        control = self.backend.mps("/unused")
        assert control is not None
        settings = DaemonPodSettings(
            namespace=NAMESPACE,
            node_name=NODE,
            driver_name=DRIVER,
            image=IMAGE,
            driver_root_host=control.driver_root,
            driver_root=control.driver_root,
        )
        return KubeDaemons(
            self.cluster,
            settings,
            ready_timeout=30,
            gone_timeout=30,
            clock=lambda: self.cluster.now,
            sleep=self.cluster.tick,
        )

    def state(self, *, mps: bool = True) -> DeviceState:
        """A plugin (re)start on this node; `mps` False: with --mps-daemons=off (it can
        still delete the Deployments its journal names)."""
        daemons = self.daemons()
        others = {} if mps else {"mps_others": (daemons,)}
        kube = daemons if mps else None
        state, self.report = node_state(
            self.root, self.claims, self.backend, PoolOptions(), mps_daemons=kube, **others
        )
        return state

    def record(self, uid: str) -> MpsRecord:
        (device,) = Checkpoint(self.root / "plugin").load()[uid].devices
        assert device.mps is not None
        return device.mps


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_prepare_creates_a_deployment_pinned_to_the_node_and_waits_until_it_is_ready(
    node: Node,
) -> None:
    state = node.state()
    result = state.prepare([node.claims.add("a")])["a"]
    assert result.error is None, result.error
    record = node.record("a")
    name = deployment_name(NODE, daemon_directory("a-gpu-0"))
    assert (record.deployment, record.pid) == (name, 0)
    deployment = node.cluster.deployments[name]
    assert record.deployment_uid == deployment["metadata"]["uid"]
    # The prepare returned only once the pod was ready: it read the Deployment until then.
    assert node.cluster.log.count(f"GET {DEPLOYMENTS}/{name}") == node.cluster.ready_after + 1
    assert deployment["metadata"]["labels"][LABEL] == name
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeName"] == NODE and pod["hostPID"] is True
    (container,) = pod["containers"]
    assert container["image"] == IMAGE and container["securityContext"]["privileged"] is True
    gpu0 = node.backend.discover().gpus[0].uuid
    base = node.root / "plugin" / "mps" / daemon_directory("a-gpu-0")
    assert container["command"][0] == "gpu-dra-mps-daemon"
    assert {
        f"--pipe-directory={base / 'pipe'}",
        f"--gpu={gpu0}",
        "--active-thread-percentage=25",
        "--pinned-memory-mib=2048",
    } <= set(container["command"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["shm"] == "/dev/shm" and mounts["pipe"] == str(base / "pipe")
    # The clients share the daemon's pipe and shm directories.
    spec = json.loads(state.cdi.claim_spec_path("a").read_text())
    edits = spec["devices"][0]["containerEdits"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    assert [(m["hostPath"], m["containerPath"]) for m in edits["mounts"]] == [
        (str(base / "pipe"), "/tmp/nvidia-mps"),
        (str(base / "shm"), "/dev/shm"),
    ]


def test_unprepare_deletes_the_deployment_and_waits_until_its_pod_is_gone(node: Node) -> None:
    state = node.state()
    ref = node.claims.add("a")
    assert state.prepare([ref])["a"].error is None
    name = node.record("a").deployment
    listed = node.cluster.log.count(f"GET {PODS}")  # the prepare read its pod once
    assert state.unprepare([ref]) == {"a": None}
    assert name not in node.cluster.deployments and name not in node.cluster.pods
    assert node.cluster.log.count(f"GET {PODS}") - listed == node.cluster.terminating + 1
    assert not (node.root / "plugin" / "mps" / daemon_directory("a-gpu-0")).exists()
    assert "a" not in Checkpoint(node.root / "plugin").load()


def test_a_pod_that_never_gets_ready_fails_the_prepare_naming_the_device(node: Node) -> None:
    node.cluster.ready_after = None
    state = node.state()
    error = state.prepare([node.claims.add("a")])["a"].error
    assert error is not None and not error.permanent
    text = str(error)
    assert "device gpu-0" in text and "did not get ready in 30s" in text, text
    assert "ErrImagePull: no such image" in text, text
    assert node.cluster.deployments == {} and node.cluster.pods == {}
    assert not (node.root / "plugin" / "mps" / daemon_directory("a-gpu-0")).exists()


def test_a_plugin_restart_adopts_the_deployment_and_recreates_a_missing_one(
    node: Node,
) -> None:
    ref = node.claims.add("a")
    assert node.state().prepare([ref])["a"].error is None
    before = node.record("a")
    posts = node.cluster.log.count(f"POST {DEPLOYMENTS}")
    node.state()  # the plugin's pod restarts: the Deployment is not its
    assert node.report.mps_adopted == ("a",) and node.report.mps_lost == ()
    assert node.record("a") == before
    assert node.cluster.log.count(f"POST {DEPLOYMENTS}") == posts

    del node.cluster.deployments[before.deployment]  # deleted behind the driver's back
    node.cluster.pods.pop(before.deployment)
    state = node.state()
    assert node.report.mps_lost == ("a",)
    again = node.record("a")
    assert again.deployment == before.deployment
    assert again.deployment_uid != before.deployment_uid
    assert node.cluster.deployments[again.deployment]["metadata"]["uid"] == again.deployment_uid
    assert state.unprepare([ref]) == {"a": None}
    assert node.cluster.deployments == {}


def test_an_intent_left_by_a_crash_deletes_the_deployment_by_its_derived_name(
    node: Node,
) -> None:
    daemons = node.daemons()
    record = MpsRecord("GPU-x", "a-gpu-0", 50)  # the intent: no name, no UID yet
    dirs_root = node.root / "plugin" / "mps" / daemon_directory("a-gpu-0")
    dirs = DaemonDirs(dirs_root / "pipe", dirs_root / "log", dirs_root / "shm")
    started = daemons.start(record, dirs)
    assert started.deployment in node.cluster.deployments
    daemons.stop(record, dirs)
    assert node.cluster.deployments == {} and node.cluster.pods == {}


class Crash(BaseException):
    """The plugin killed mid-prepare: nothing of the driver's own handling runs."""


def test_a_crash_after_the_deployment_was_created_leaves_nothing_after_the_restart(
    node: Node,
) -> None:
    state = node.state()
    real_request = node.cluster.request

    def crash_on_readiness(method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        if method == "GET" and path.startswith(f"{DEPLOYMENTS}/"):
            raise Crash
        return real_request(method, path, **kwargs)

    node.cluster.request = crash_on_readiness  # type: ignore[method-assign]
    with pytest.raises(Crash):
        state.prepare([node.claims.add("a")])
    node.cluster.request = real_request  # type: ignore[method-assign]
    (name,) = node.cluster.deployments  # created, its intent journaled, nothing more
    (device,) = Checkpoint(node.root / "plugin").load()["a"].devices
    assert device.mps is not None and device.mps.deployment == ""

    node.state()  # the restart rolls the intent back
    assert node.cluster.deployments == {} and name not in node.cluster.pods
    assert not (node.root / "plugin" / "mps" / daemon_directory("a-gpu-0")).exists()
    assert "a" not in Checkpoint(node.root / "plugin").load()
