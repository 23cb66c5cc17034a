"""The chart's MPS daemon Role and policy (kubeletPlugin.mps.enabled) against a real
API server: the plugin's service account, with a token bound to a pod on node A, may
create and delete the daemon Deployments KubeDaemons builds for node A in its own
namespace, and is denied a Deployment for node B, one without the MPS label, one of
another image, the deletion of node B's daemon, and any Deployment in another
namespace. No kubelet runs here: the readiness wait is tested against a fake
(tests/unit/test_mps_kube.py); the delete-and-wait path runs for real (no pod is
ever created without a controller manager).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.kube.api import ApiError, KubeApi
from driver.kube.mps_daemons import KubeDaemons
from driver.kube.mps_manifest import DaemonPodSettings, daemon_deployment
from driver.nvml.mps import DaemonDirs
from driver.state.mps_record import MpsRecord
from tests.integration.test_chart import PluginIdentity, _dump, _template, _token_kubeconfig
from tests.unit.test_chart_render import DRIVER

Doc = dict[str, Any]
POLICY = "gpu-dra-driver-mps-daemons"
IMAGE_TAG = "9.9.9-mps"


class Setup:
    def __init__(self, plugin: PluginIdentity, ns: str, node_a: str, node_b: str, image: str):
        self.plugin, self.ns, self.node_a, self.node_b, self.image = (
            plugin,
            ns,
            node_a,
            node_b,
            image,
        )
        self.api = KubeApi.from_kubeconfig(str(plugin.kubeconfig))

    def settings(self, node: str, *, image: str | None = None, ns: str | None = None) -> Any:
        root = Path("/var/lib/kubelet/plugins") / DRIVER / "mock-driver-root"
        return DaemonPodSettings(ns or self.ns, node, DRIVER, image or self.image, root, root)

    def deployment(self, node: str, device: str, **kwargs: Any) -> Doc:
        base = Path("/var/lib/kubelet/plugins") / DRIVER / "mps" / device
        dirs = DaemonDirs(base / "pipe", base / "log", base / "shm")
        return daemon_deployment(
            self.settings(node, **kwargs), MpsRecord("GPU-x", device, 50), dirs
        )

    def create(self, body: Doc) -> tuple[bool, str]:
        proc = self.plugin.kubectl("create", "-f", "-", input=json.dumps(body))
        return proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def mps_setup(cluster: Any) -> Iterator[Setup]:
    suffix = uuid.uuid4().hex[:6]
    ns = f"chart-mps-{suffix}"
    node_a, node_b = f"mps-node-a-{suffix}", f"mps-node-b-{suffix}"
    args = ("--set", "kubeletPlugin.mps.enabled=true", "--set", f"image.tag={IMAGE_TAG}")
    docs = [d for d in yaml.safe_load_all(_template("gpu-dra-driver", ns, *args)) if d]
    wanted = {
        "ServiceAccount", "Role", "RoleBinding",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    }  # fmt: skip
    policy_docs = [
        d
        for d in docs
        if d["kind"] in wanted
        and (
            d["kind"] in ("ServiceAccount", "Role", "RoleBinding")
            or POLICY in d["metadata"]["name"]
        )
    ]
    assert {d["kind"] for d in policy_docs} == wanted
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    env = {e["name"]: e for e in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]}
    image = env["MPS_DAEMON_IMAGE"]["value"]
    sa = next(d["metadata"]["name"] for d in policy_docs if d["kind"] == "ServiceAccount")
    nodes = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}} for n in (node_a, node_b)
    ]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugin-on-a", "namespace": ns},
        "spec": {"nodeName": node_a, "serviceAccountName": sa,
                 "containers": [{"name": "plugin", "image": image}]},
    }  # fmt: skip
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("create", "namespace", f"{ns}-other")
    cluster.kubectl("apply", "-f", "-", input=_dump(policy_docs + nodes))
    cluster.kubectl("apply", "-f", "-", input=_dump([pod]))
    token = cluster.kubectl(
        "create", "token", sa, "--namespace", ns, "--bound-object-kind", "Pod",
        "--bound-object-name", "plugin-on-a", "--duration", "30m",
    ).stdout.strip()  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="gpu-dra-mps-"))
    _token_kubeconfig(cluster, token, tmp / "plugin.kubeconfig")
    setup = Setup(PluginIdentity(cluster, tmp / "plugin.kubeconfig"), ns, node_a, node_b, image)

    def denied() -> bool:
        body = setup.deployment(node_b, "probe-gpu-0")
        proc = setup.plugin.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(body))
        if proc.returncode != 0 and POLICY in proc.stderr:
            return True
        if proc.returncode != 0 and "forbidden" in proc.stderr and "cannot create" in proc.stderr:
            return False  # the RoleBinding is not in effect yet
        if proc.returncode == 0:
            return False  # the policy is not in effect yet
        raise AssertionError(f"exit {proc.returncode}: {proc.stdout} {proc.stderr}")

    cluster.wait_for(denied, timeout=60, what="the MPS policy to deny node B's daemon")
    try:
        yield setup
    finally:
        cluster.kubectl(
            "delete", "-f", "-", "--ignore-not-found", "--wait=false",
            input=_dump(policy_docs + nodes), check=False,
        )  # fmt: skip
        for name in (ns, f"{ns}-other"):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
        shutil.rmtree(tmp, ignore_errors=True)


class TerminatingPodsFinisher(threading.Thread):
    """What the node's kubelet does for a deleted pod bound to it, on a cluster without
    one: confirms its termination (deletes it with grace period 0), so the pods the
    Deployment controller made go when the Deployment does."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.namespace = cluster, namespace
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            listed = self.cluster.kubectl(
                "get", "pods", "-n", self.namespace, "-o", "json", check=False
            )
            for pod in json.loads(listed.stdout or "{}").get("items", []):
                if pod["metadata"].get("deletionTimestamp"):
                    self.cluster.kubectl(
                        "delete", "pod", "-n", self.namespace, pod["metadata"]["name"],
                        "--grace-period=0", "--force", "--wait=false", check=False,
                    )  # fmt: skip


def test_the_plugins_daemon_code_creates_and_deletes_its_nodes_deployment(
    cluster: Any, mps_setup: Setup
) -> None:
    s = mps_setup
    kubelet = TerminatingPodsFinisher(cluster, s.ns)
    kubelet.start()
    daemons = KubeDaemons(s.api, s.settings(s.node_a), gone_timeout=60)
    record = MpsRecord("GPU-x", "claim-a-gpu-0", 50, 1 << 30)
    body = daemon_deployment(
        s.settings(s.node_a), record, DaemonDirs(Path("/p"), Path("/l"), Path("/s"))
    )
    created = s.api.request("POST", f"/apis/apps/v1/namespaces/{s.ns}/deployments", body=body)
    name = created["metadata"]["name"]
    stamped = MpsRecord("GPU-x", "claim-a-gpu-0", deployment=name,
                        deployment_uid=created["metadata"]["uid"])  # fmt: skip
    assert daemons.alive(stamped)
    try:
        daemons.stop(stamped, DaemonDirs(Path("/p"), Path("/l"), Path("/s")))
    finally:
        kubelet.done.set()
    assert not daemons.alive(stamped)


def test_a_daemon_for_another_node_is_denied(mps_setup: Setup) -> None:
    s = mps_setup
    ok, err = s.create(s.deployment(s.node_b, "claim-b-gpu-0"))
    assert not ok, "a daemon Deployment for node B was allowed"
    assert POLICY in err and f"not '{s.node_b}'" in err, err


def test_a_deployment_without_the_label_or_of_another_image_is_denied(mps_setup: Setup) -> None:
    s = mps_setup
    unlabelled = s.deployment(s.node_a, "claim-c-gpu-0")
    del unlabelled["metadata"]["labels"][f"{DRIVER}/mps-daemon"]
    ok, err = s.create(unlabelled)
    assert not ok and POLICY in err and "labelled" in err, err
    ok, err = s.create(s.deployment(s.node_a, "claim-d-gpu-0", image="evil.example/miner:1"))
    assert not ok and POLICY in err and "only run the driver's image" in err, err
    sneaky = s.deployment(s.node_a, "claim-e-gpu-0")
    template = sneaky["spec"]["template"]["spec"]
    # The driver's own image, but a command of the requester's choosing before the daemon.
    template["initContainers"] = [{"name": "init", "image": s.image, "command": ["sh"]}]
    ok, err = s.create(sneaky)
    assert not ok and POLICY in err and "no init or ephemeral container" in err, err


def test_deleting_another_nodes_daemon_is_denied(cluster: Any, mps_setup: Setup) -> None:
    s = mps_setup
    theirs = s.deployment(s.node_b, "claim-f-gpu-0")
    cluster.kubectl("create", "-f", "-", input=json.dumps(theirs))  # as the admin
    name = theirs["metadata"]["name"]
    try:
        proc = s.plugin.kubectl("delete", "deployment", name, "-n", s.ns, "--wait=false")
        assert proc.returncode != 0 and POLICY in proc.stderr, proc.stderr
    finally:
        cluster.kubectl("delete", "deployment", name, "-n", s.ns, "--wait=false", check=False)


def test_no_deployment_in_another_namespace(mps_setup: Setup) -> None:
    s = mps_setup
    body = s.deployment(s.node_a, "claim-g-gpu-0", ns=f"{s.ns}-other")
    with pytest.raises(ApiError) as err:
        s.api.request("POST", f"/apis/apps/v1/namespaces/{s.ns}-other/deployments", body=body)
    assert err.value.status == 403
