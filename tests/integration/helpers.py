"""Small API helpers shared by the integration tests (kubectl with JSON)."""

from __future__ import annotations

import json
from typing import Any

from tests.conftest import Cluster
from tests.integration.plugin_process import DRIVER


def get_json(cluster: Cluster, *args: str) -> Any:
    return json.loads(cluster.kubectl("get", "-o", "json", *args).stdout)


def apply(cluster: Cluster, *docs: dict[str, Any]) -> None:
    payload = {"apiVersion": "v1", "kind": "List", "items": list(docs)}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(payload))


def node_slices(cluster: Cluster, node: str, driver: str = DRIVER) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(
        cluster, "resourceslices", f"--field-selector=spec.nodeName={node},spec.driver={driver}"
    )["items"]
    return items


def complete_pool(cluster: Cluster, node: str) -> list[dict[str, Any]] | None:
    """The node's slices if they form one complete pool generation, else None."""
    slices = node_slices(cluster, node)
    if not slices:
        return None
    generation = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == generation]
    if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"] or len(current) != len(
        slices
    ):
        return None
    return sorted(current, key=lambda s: s["metadata"]["name"])


def published_devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


def gpu_uuid_of(slices: list[dict[str, Any]], device: str) -> str:
    """The UUID of the GPU a published device is on: its `parentUUID` (a partition, or
    the whole GPU of a MIG GPU, delivered as a MIG device) or its `uuid` (MIG off)."""
    attrs = published_devices(slices)[device]["attributes"]
    return str((attrs.get("parentUUID") or attrs["uuid"])["string"])


def whole_gpu_selector(slices: list[dict[str, Any]], device: str) -> str:
    """CEL for exactly this whole GPU within a class without partitions: by `uuid`, or
    by `parentUUID` where the GPU is in MIG mode (its whole device has no `uuid`)."""
    attrs = published_devices(slices)[device]["attributes"]
    key = "uuid" if "uuid" in attrs else "parentUUID"
    return f'device.attributes["{DRIVER}"].{key} == "{attrs[key]["string"]}"'


def device_class(name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def claim(
    name: str,
    namespace: str,
    device_class_name: str,
    selector: str | None = None,
    config: Any = None,
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class_name}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}
    if config is not None:
        spec["devices"]["config"] = [
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": config}}
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def pod_using(name: str, namespace: str, claim_name: str) -> dict[str, Any]:
    """A pod whose only purpose is to make the scheduler allocate `claim_name`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "ctr",
                    "image": "registry.invalid/busybox:local",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
        },
    }


def allocation(cluster: Cluster, namespace: str, name: str) -> list[dict[str, Any]] | None:
    status = get_json(cluster, "resourceclaim", "-n", namespace, name).get("status") or {}
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results")
    return results or None


def unschedulable(cluster: Cluster, namespace: str, pod: str) -> bool:
    conditions = (get_json(cluster, "pod", "-n", namespace, pod).get("status") or {}).get(
        "conditions"
    ) or []
    return any(
        c["type"] == "PodScheduled"
        and c["status"] == "False"
        and c.get("reason") == "Unschedulable"
        for c in conditions
    )


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def delete_namespace(cluster: Cluster, name: str) -> None:
    """Frees what a test module allocated: with no kubelet, pods bound to the fake
    node only go away when force-deleted; their claims are then deallocated."""
    cluster.kubectl(
        "delete", "pods", "--all", "-n", name, "--force", "--grace-period=0", check=False
    )
    cluster.kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)
    cluster.wait_for(
        lambda: not get_json(cluster, "resourceclaims", "-n", name)["items"],
        timeout=60,
        what=f"claims of namespace {name} to be released",
    )
