"""The local control plane is a real Kubernetes 1.37 with what the driver needs.

Proves the pieces later driver tests stand on: the DRA API (including
DeviceTaintRules), the feature gates, ResourceSlice validation with gated fields kept,
allocation by the real kube-scheduler onto the fake node, and the
device-taint-eviction controller acting on a NoExecute taint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Cluster, FakeNode
from tests.integration.kubelet_standin import ClaimRef, KubeletStandin

pytestmark = pytest.mark.integration

DRIVER = "gpu.test.example.com"
# Gates the driver relies on; some are locked on in 1.37 and therefore not set by
# hack/lib/common.sh, so this checks the outcome, not the flag string.
REQUIRED_GATES = (
    "DynamicResourceAllocation",
    "DRADeviceTaints",
    "DRADeviceTaintRules",
    "DRAPartitionableDevices",
    "DRAConsumableCapacity",
    "DRAResourceClaimDeviceStatus",
    "DRAAdminAccess",
    "DRAPrioritizedList",
    "DRAExtendedResource",
    "ResourceHealthStatus",
)


def _versions() -> dict[str, str]:
    out = {}
    for line in (REPO / "hack" / "versions.env").read_text().splitlines():
        m = re.match(r"^([A-Z0-9_]+)=(\S+)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _apply(cluster: Cluster, obj: dict[str, Any]) -> dict[str, Any]:
    proc = cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(obj))
    return dict(json.loads(proc.stdout))


def _get(cluster: Cluster, *args: str) -> dict[str, Any]:
    return dict(json.loads(cluster.kubectl("get", "-o", "json", *args).stdout))


@pytest.fixture
def namespace(cluster: Cluster) -> Any:
    name = f"cp-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    # Pods need the namespace's default ServiceAccount (serviceaccount-controller).
    cluster.wait_for(
        lambda: cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        30,
        f"ServiceAccount {name}/default",
    )
    yield name
    # Without a kubelet a gracefully deleted pod stays Terminating (and so would the
    # namespace): force-delete the pods first, as the kubelet stand-in would.
    cluster.kubectl(
        "delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", check=False
    )
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _slice(node: FakeNode, pool: str, devices: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "generateName": f"{node.name}-{pool}-",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid}
            ],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": node.name,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": spec.pop("count", 1)},
            **({"devices": devices} if devices else {}),
            **spec,
        },
    }


def test_control_plane_is_healthy(cluster: Cluster) -> None:
    readyz = cluster.kubectl("get", "--raw", "/readyz?verbose").stdout
    assert "readyz check passed" in readyz
    if cluster.run_dir is not None:
        status = cluster.script("status")
        assert status.returncode == 0, status.stdout + status.stderr
        for component in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            assert re.search(rf"{component}\s+running \(pid \d+\)", status.stdout), status.stdout


def test_server_and_kubectl_are_the_pinned_version(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    wanted = "v" + _versions()["K8S_VERSION"]
    assert wanted == "v1.37.1"
    assert version["serverVersion"]["gitVersion"] == wanted
    assert version["clientVersion"]["gitVersion"] == wanted


def test_dra_api_resources_are_served(cluster: Cluster) -> None:
    out = cluster.kubectl("api-resources", "--api-group=resource.k8s.io", "-o", "name").stdout
    served = set(out.split())
    for resource in (
        "resourceslices",
        "resourceclaims",
        "resourceclaimtemplates",
        "deviceclasses",
        "devicetaintrules",
    ):
        assert f"{resource}.resource.k8s.io" in served, out
    versions = cluster.kubectl("api-versions").stdout.split()
    assert "resource.k8s.io/v1" in versions


def test_required_feature_gates_are_enabled(cluster: Cluster) -> None:
    metrics = cluster.kubectl("get", "--raw", "/metrics").stdout
    enabled = {
        m.group(1): m.group(2) == "1"
        for m in re.finditer(
            r'^kubernetes_feature_enabled\{name="(\w+)"[^}]*\} (\d)', metrics, re.M
        )
    }
    off = [g for g in REQUIRED_GATES if not enabled.get(g)]
    assert not off, f"feature gates not enabled in kube-apiserver: {off}"


def test_minimal_resource_slice_is_accepted(cluster: Cluster, node: FakeNode) -> None:
    created = _apply(
        cluster,
        _slice(node, "minimal", [{"name": "gpu-0", "attributes": {"model": {"string": "T4"}}}]),
    )
    name = created["metadata"]["name"]
    try:
        got = _get(cluster, "resourceslice", name)
        assert got["spec"]["nodeName"] == node.name
        assert got["spec"]["devices"] == [
            {"name": "gpu-0", "attributes": {"model": {"string": "T4"}}}
        ]
    finally:
        cluster.kubectl("delete", "resourceslice", name, "--ignore-not-found")


def test_gated_slice_fields_are_kept(cluster: Cluster, node: FakeNode) -> None:
    """Partitionable devices, consumable capacity and device taints survive a write.

    With a gate off the apiserver silently drops these fields, so reading them back
    proves the gates are on where it matters.
    """
    counters = _slice(
        node,
        "gated",
        [],
        count=2,
        sharedCounters=[{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}],
    )
    device = {
        "name": "gpu-0-mig-1g",
        "consumesCounters": [
            {"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "10Gi"}}}
        ],
        "allowMultipleAllocations": True,
        "capacity": {"memory": {"value": "10Gi"}},
        "taints": [{"key": "example.com/unhealthy", "value": "xid-79", "effect": "NoSchedule"}],
    }
    devices = _slice(node, "gated", [device], count=2)
    names = []
    try:
        names.append(_apply(cluster, counters)["metadata"]["name"])
        names.append(_apply(cluster, devices)["metadata"]["name"])
        got_counters = _get(cluster, "resourceslice", names[0])["spec"]
        got_device = _get(cluster, "resourceslice", names[1])["spec"]["devices"][0]
        assert got_counters["sharedCounters"][0]["name"] == "gpu-0-counters"
        assert got_device["consumesCounters"][0]["counterSet"] == "gpu-0-counters"
        assert got_device["allowMultipleAllocations"] is True
        assert got_device["taints"][0]["effect"] == "NoSchedule"
        assert got_device["taints"][0].get("timeAdded"), "apiserver sets timeAdded"
    finally:
        for name in names:
            cluster.kubectl("delete", "resourceslice", name, "--ignore-not-found")


def _pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "c",
                    "image": "registry.invalid/none:0",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        },
    }


@pytest.fixture
def allocatable_device(cluster: Cluster, node: FakeNode) -> Any:
    """A slice with one device and a DeviceClass selecting it through CEL."""
    pool = f"alloc-{uuid.uuid4().hex[:6]}"
    slice_name = _apply(
        cluster,
        _slice(
            node,
            pool,
            [
                {
                    "name": "gpu-0",
                    "attributes": {
                        "model": {"string": "A100"},
                        "index": {"int": 0},
                    },
                    "capacity": {"memory": {"value": "40Gi"}},
                }
            ],
        ),
    )["metadata"]["name"]
    class_name = f"gpu-{pool}"
    _apply(
        cluster,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": class_name},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
        },
    )
    yield pool, class_name
    cluster.kubectl("delete", "deviceclass", class_name, "--ignore-not-found")
    cluster.kubectl("delete", "resourceslice", slice_name, "--ignore-not-found")


def _claim(name: str, class_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": class_name,
                            "selectors": [
                                {
                                    "cel": {
                                        "expression": (
                                            f'device.attributes["{DRIVER}"].model == "A100" && '
                                            f'device.capacity["{DRIVER}"].memory'
                                            '.compareTo(quantity("16Gi")) >= 0'
                                        )
                                    }
                                }
                            ],
                        },
                    }
                ]
            }
        },
    }


def _schedule_pod_with_claim(
    cluster: Cluster, node: FakeNode, namespace: str, class_name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    _apply(
        cluster,
        {
            **_claim("gpu-claim", class_name),
            "metadata": {"name": "gpu-claim", "namespace": namespace},
        },
    )
    pod = _pod("gpu-pod", "gpu-claim")
    pod["metadata"]["namespace"] = namespace
    _apply(cluster, pod)

    def bound() -> dict[str, Any] | None:
        p = _get(cluster, "pod", "gpu-pod", "-n", namespace)
        return p if p["spec"].get("nodeName") else None

    scheduled = cluster.wait_for(bound, 60, "the scheduler to bind gpu-pod")
    claim = _get(cluster, "resourceclaim", "gpu-claim", "-n", namespace)
    return scheduled, claim


def test_scheduler_allocates_claim_and_binds_pod_to_fake_node(
    cluster: Cluster, node: FakeNode, namespace: str, allocatable_device: Any
) -> None:
    pool, class_name = allocatable_device
    pod, claim = _schedule_pod_with_claim(cluster, node, namespace, class_name)
    assert pod["spec"]["nodeName"] == node.name
    results = claim["status"]["allocation"]["devices"]["results"]
    assert [{k: r.get(k) for k in ("request", "driver", "pool", "device")} for r in results] == [
        {"request": "gpu", "driver": DRIVER, "pool": pool, "device": "gpu-0"}
    ]
    reserved = claim["status"]["reservedFor"]
    assert [(r["resource"], r["name"], r["uid"]) for r in reserved] == [
        ("pods", "gpu-pod", pod["metadata"]["uid"])
    ]
    node_selector = claim["status"]["allocation"]["nodeSelector"]
    assert node.name in json.dumps(node_selector)


def test_claim_template_is_instantiated_and_resolved_like_the_kubelet(
    cluster: Cluster, node: FakeNode, namespace: str, allocatable_device: Any
) -> None:
    """resourceclaim-controller + scheduler + the stand-in's pod-claim resolution."""
    _, class_name = allocatable_device
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu-template", "namespace": namespace},
        "spec": {"spec": _claim("unused", class_name)["spec"]},
    }
    _apply(cluster, template)
    pod = _pod("tmpl-pod", "unused")
    pod["metadata"]["namespace"] = namespace
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "gpu-template"}]
    _apply(cluster, pod)

    def generated_and_bound() -> dict[str, Any] | None:
        p = _get(cluster, "pod", "tmpl-pod", "-n", namespace)
        statuses = p.get("status", {}).get("resourceClaimStatuses") or []
        if p["spec"].get("nodeName") and statuses and statuses[0].get("resourceClaimName"):
            return p
        return None

    bound = cluster.wait_for(generated_and_bound, 60, "a generated claim and a bound tmpl-pod")
    claim_name = bound["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = _get(cluster, "resourceclaim", claim_name, "-n", namespace)

    kubelet = KubeletStandin("/nonexistent", api_client=cluster.api_client(), node_name=node.name)
    assert kubelet.pod_claims(namespace, "tmpl-pod") == {
        DRIVER: [ClaimRef(namespace, claim["metadata"]["uid"], claim_name)]
    }


def test_device_taint_rule_no_execute_evicts_pod(
    cluster: Cluster, node: FakeNode, namespace: str, allocatable_device: Any
) -> None:
    """The device-taint-eviction controller runs: a NoExecute DeviceTaintRule evicts."""
    pool, class_name = allocatable_device
    _schedule_pod_with_claim(cluster, node, namespace, class_name)
    rule = f"evict-{pool}"
    _apply(
        cluster,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {"name": rule},
            "spec": {
                "deviceSelector": {"driver": DRIVER, "pool": pool, "device": "gpu-0"},
                "taint": {"key": "example.com/broken", "value": "test", "effect": "NoExecute"},
            },
        },
    )
    try:

        def evicted() -> dict[str, Any] | None:
            proc = cluster.kubectl(
                "get", "pod", "gpu-pod", "-n", namespace, "-o", "json", check=False
            )
            if proc.returncode != 0 and "NotFound" in proc.stderr:
                return {"deleted": True}
            p = json.loads(proc.stdout)
            return p if p["metadata"].get("deletionTimestamp") else None

        result = cluster.wait_for(evicted, 60, "device-taint-eviction-controller to evict gpu-pod")
        if "deleted" not in result:
            conditions = {c["type"]: c for c in result["status"].get("conditions", [])}
            assert (
                conditions.get("DisruptionTarget", {}).get("reason")
                == "DeletionByDeviceTaintManager"
            )
    finally:
        cluster.kubectl("delete", "devicetaintrule", rule, "--ignore-not-found")
        cluster.kubectl(
            "delete",
            "pod",
            "gpu-pod",
            "-n",
            namespace,
            "--grace-period=0",
            "--force",
            "--ignore-not-found",
            check=False,
        )


def test_script_env_prints_kubeconfig_and_path(cluster: Cluster, tmp_path: Path) -> None:
    run_dir = cluster.run_dir or tmp_path
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "local-cluster.sh"), "env"],
        env={**os.environ, "GPU_DRA_CLUSTER_DIR": str(run_dir)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"export KUBECONFIG={run_dir}/admin.kubeconfig PATH={cluster.bin_dir}:" in proc.stdout
