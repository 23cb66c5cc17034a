"""The kind cluster itself, the driver on its two workers, the ValidatingAdmissionPolicy
with two real kubelets, and `make kind-demo` (hack/kind/demo.sh)."""

from __future__ import annotations

import re

from tests.e2e.conftest import DRIVER
from tests.e2e_kind.conftest import CLUSTER, WORKERS, Kind, _tail

K8S_VERSION = "v1.37.1"
PLUGIN = "app.kubernetes.io/component=kubeletplugin"


def test_one_control_plane_and_two_ready_workers(kind: Kind) -> None:
    nodes = kind.e2e.get("nodes")["items"]
    names = sorted(n["metadata"]["name"] for n in nodes)
    assert names == sorted(
        [f"{CLUSTER}-control-plane", f"{CLUSTER}-worker"]
        + [f"{CLUSTER}-worker{i}" for i in range(2, WORKERS + 1)]
    )
    for n in nodes:
        ready = [c for c in n["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", (n["metadata"]["name"], ready)
        info = n["status"]["nodeInfo"]
        assert info["kubeletVersion"] == K8S_VERSION, info
        assert info["containerRuntimeVersion"].startswith("containerd://"), info
        assert n["spec"].get("podCIDR"), n["metadata"]["name"]
    assert len(kind.workers()) == WORKERS


def test_one_plugin_per_worker_each_publishing_its_own_pool(kind: Kind) -> None:
    pods = kind.e2e.get("pods", "-n", "gpu-dra-driver", "-l", PLUGIN)["items"]
    running = sorted(p["spec"]["nodeName"] for p in pods if p["status"].get("phase") == "Running")
    assert running == kind.workers(), running
    by_node: dict[str, set[str]] = {}
    for s in kind.e2e.slices():
        spec = s["spec"]
        assert spec["pool"]["name"] == spec["nodeName"], spec["pool"]
        owner = s["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("Node", spec["nodeName"])
        by_node.setdefault(spec["nodeName"], set()).update(
            d["name"] for d in spec.get("devices") or []
        )
    assert sorted(by_node) == kind.workers()
    # The same mock fleet on each worker (values-demo.yaml): 22 GPUs and their partitions.
    devices = list(by_node.values())
    assert all(d == devices[0] for d in devices)
    assert {f"gpu-{i}" for i in range(22)} <= devices[0]


def test_the_admission_policy_refuses_another_nodes_slices(kind: Kind) -> None:
    proc = kind.script("vap-check.sh", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    own, other = kind.workers()[:2]
    assert re.search(rf"for its own node\s+{own} 201 allowed", out), out
    assert re.search(
        rf"for the other node\s+{other} 403 .*ValidatingAdmissionPolicy.*"
        rf"may not modify resourceslices on node '{other}'",
        out,
    ), out


def test_demo_gpus_permanent_error_and_xid_eviction(kind: Kind) -> None:
    proc = kind.script("demo.sh", timeout=1200)
    out = proc.stdout + proc.stderr
    try:
        assert proc.returncode == 0, _tail(out)
        gpus = {}
        for pod in ("gpu-pod", "mig-pod", "shared-0", "shared-1"):
            section = out.split(f"environment of {pod}", 1)[1].split("[kind", 1)[0]
            found = re.findall(r"^GPU_DEVICE_\w+=(gpu-\S+)$", section, re.M)
            assert len(found) == 1, (pod, section)
            gpus[pod] = found[0]
        assert "-mig-" not in gpus["gpu-pod"] and "-mig-" in gpus["mig-pod"], gpus
        # One claim, two pods: the same device, with the claim's GpuConfig.
        assert gpus["shared-0"] == gpus["shared-1"], gpus
        assert "PARTITION_COUNT=2" in out.split("environment of shared-0", 1)[1]
        assert re.search(
            r"refused: \S+ denied the request: .*unknown time-slice interval: 'Sometimes'", out
        ), out
        assert "FailedPrepareDynamicResources: Failed to prepare dynamic resources" in out, out
        assert re.search(r"NodePrepareResources failed .*: permanent \(invalid-config\)", out), out
        assert re.search(r"taints: gpu\.example\.com/xid=79:NoExecute", out), out
        moved = re.search(r"replacement \S+ runs on (\S+), (gpu-\d+) \(was (\S+), (gpu-\d+)\)", out)
        assert moved and (moved[1], moved[2]) != (moved[3], moved[4]), out
        assert "refused by the ValidatingAdmissionPolicy" in out
        # The Xid was cleared: no device of this driver is tainted any more.
        tainted = [
            (s["spec"]["nodeName"], d["name"])
            for s in kind.e2e.slices()
            for d in s["spec"].get("devices") or []
            if any(t["key"] == f"{DRIVER}/xid" for t in d.get("taints") or [])
        ]
        assert not tainted, tainted
    finally:
        kind.script("demo.sh", "--cleanup", timeout=300)
