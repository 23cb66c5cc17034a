"""Every demo/ example on the real node: the GPUs each container sees come from the
container environment that containerd built from the driver's CDI specs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DEMO, DRIVER, E2E, ContainerGpus, demo_namespace, wait_for

EXAMPLES = sorted(DEMO.glob("[0-9]*.yaml"))
H100 = {f"gpu-{i}" for i in (*range(12), 20, 21)}
A100_80 = {f"gpu-{i}" for i in range(12, 16)}
AMPERE = {f"gpu-{i}" for i in range(12, 20)}
A100_40 = {f"gpu-{i}" for i in range(16, 20)}  # MIG off: the shareable GPUs (consumable capacity)
ALL_GPUS = {f"gpu-{i}" for i in range(22)}


def test_examples_exist() -> None:
    names = [p.name for p in EXAMPLES]
    assert len(names) == 13, names


@pytest.fixture(scope="module")
def examples(e2e: E2E) -> Iterator[E2E]:
    """All examples applied at once (as `make demo` does), every pod Ready."""
    for path in EXAMPLES:
        e2e.apply_file(path)
    for path in EXAMPLES:
        ns = demo_namespace(path)
        expected = sum(1 for line in path.read_text().splitlines() if line.strip() == "kind: Pod")
        e2e.wait_pods_ready(ns, "app=gpu-demo", expected)
    yield e2e
    for path in reversed(EXAMPLES):
        e2e.delete_file(path, wait=False)
    for path in EXAMPLES:
        ns = demo_namespace(path)
        wait_for(
            lambda ns=ns: e2e.kubectl("get", "namespace", ns, check=False).returncode != 0,
            240,
            f"namespace {ns} deleted",
        )
    # Cluster-scoped objects outlive the namespaces: 10-device-taints.yaml's DeviceTaintRule
    # must be gone with its example, or gpu-19 stays unschedulable for every later test.
    rules = examples_taint_rules(e2e)
    assert not rules, f"DeviceTaintRules of the demo left behind: {rules}"


def examples_taint_rules(e: E2E) -> list[str]:
    """The demo's DeviceTaintRules (cluster-scoped, labelled app=gpu-demo)."""
    rules = e.get("devicetaintrules", "-l", "app=gpu-demo")["items"]
    return [str(r["metadata"]["name"]) for r in rules]


def seen(e: E2E, example: str, pod: str, container: str = "ctr0") -> ContainerGpus:
    return e.container_gpus(demo_namespace(DEMO / example), pod, container)


def claim_results(e: E2E, namespace: str) -> dict[str, list[dict[str, str]]]:
    """claim name -> allocation results (request, device, ...)."""
    claims = e.get("resourceclaims", "-n", namespace)["items"]
    return {
        c["metadata"]["name"]: c["status"]["allocation"]["devices"]["results"]
        for c in claims
        if c.get("status", {}).get("allocation")
    }


def test_resourceclaimtemplate_one_distinct_gpu_per_pod(examples: E2E) -> None:
    pod0 = seen(examples, "01-resourceclaimtemplate.yaml", "pod0")
    pod1 = seen(examples, "01-resourceclaimtemplate.yaml", "pod1")
    assert len(pod0.gpus) == 1, pod0.log
    assert len(pod1.gpus) == 1, pod1.log
    assert pod0.gpus != pod1.gpus
    assert set(pod0.gpus + pod1.gpus) <= ALL_GPUS
    # The claim's allocation names the same device the container saw.
    results = claim_results(examples, "gpu-demo-template")
    assert sorted(r["device"] for rs in results.values() for r in rs) == sorted(
        pod0.gpus + pod1.gpus
    )


def test_multiple_requests_two_distinct_gpus(examples: E2E) -> None:
    c = seen(examples, "02-multiple-requests.yaml", "pod0")
    assert len(c.gpus) == 2 and len(set(c.gpus)) == 2, c.log


def test_claim_shared_by_two_containers(examples: E2E) -> None:
    c0 = seen(examples, "03-shared-claim-containers.yaml", "pod0", "ctr0")
    c1 = seen(examples, "03-shared-claim-containers.yaml", "pod0", "ctr1")
    assert len(c0.gpus) == 1 and c0.gpus == c1.gpus, (c0.log, c1.log)
    gpu = c0.gpus[0]
    for c in (c0, c1):
        assert c.props[gpu]["SHARING_STRATEGY"] == "TimeSlicing"
        assert c.props[gpu]["TIMESLICE_INTERVAL"] == "Default"


def test_claim_shared_by_two_pods(examples: E2E) -> None:
    p0 = seen(examples, "04-shared-claim-pods.yaml", "pod0")
    p1 = seen(examples, "04-shared-claim-pods.yaml", "pod1")
    assert len(p0.gpus) == 1 and p0.gpus == p1.gpus, (p0.log, p1.log)
    assert p0.props[p0.gpus[0]]["SHARING_STRATEGY"] == "TimeSlicing"
    claim = examples.get("resourceclaim", "-n", "gpu-demo-shared-pods", "single-gpu")
    assert sorted(r["name"] for r in claim["status"]["reservedFor"]) == ["pod0", "pod1"]


def test_opaque_config_time_slicing_and_space_partitioning(examples: E2E) -> None:
    f = "05-opaque-config.yaml"
    ts0, ts1 = (seen(examples, f, "pod0", c) for c in ("ts-ctr0", "ts-ctr1"))
    sp0, sp1 = (seen(examples, f, "pod0", c) for c in ("sp-ctr0", "sp-ctr1"))
    assert len(ts0.gpus) == 1 and ts0.gpus == ts1.gpus, (ts0.log, ts1.log)
    assert len(sp0.gpus) == 1 and sp0.gpus == sp1.gpus, (sp0.log, sp1.log)
    assert ts0.gpus != sp0.gpus
    x, y = ts0.gpus[0], sp0.gpus[0]
    for c in (ts0, ts1):
        assert c.props[x]["SHARING_STRATEGY"] == "TimeSlicing"
        assert c.props[x]["TIMESLICE_INTERVAL"] == "Long"
        assert c.props[x]["MEMORY"] == "8Gi"  # a share of a GPU with MIG off
    for c in (sp0, sp1):
        assert c.props[y]["SHARING_STRATEGY"] == "SpacePartitioning"
        assert c.props[y]["PARTITION_COUNT"] == "4"


def test_admin_access_sees_every_gpu(examples: E2E) -> None:
    c = seen(examples, "06-admin-access.yaml", "pod0")
    assert c.admin_access, c.log
    # Every A100 40GB (no shared counters), including gpu-18/19 used by 10-device-taints.
    assert set(c.gpus) == {f"gpu-{i}" for i in range(16, 20)}, c.log


def test_cel_selector(examples: E2E) -> None:
    c = seen(examples, "07-cel-selector.yaml", "pod0")
    assert len(c.gpus) == 1 and c.gpus[0] in A100_80, c.log


def test_prioritized_alternatives(examples: E2E) -> None:
    p0 = seen(examples, "08-prioritized-alternatives.yaml", "pod0")
    p1 = seen(examples, "08-prioritized-alternatives.yaml", "pod1")
    assert len(p0.gpus) == 1 and p0.gpus[0] in AMPERE, p0.log
    assert len(p1.gpus) == 1 and p1.gpus[0] in H100, p1.log
    requests = {
        r["request"] for rs in claim_results(examples, "gpu-demo-prioritized").values() for r in rs
    }
    assert requests == {"gpu/older-gpu", "gpu/latest-gpu"}


def test_mig_partitions_on_one_gpu(examples: E2E) -> None:
    c = seen(examples, "09-mig-partitions.yaml", "pod0")
    assert len(c.gpus) == 2, c.log
    parents = {g.split("-mig-")[0] for g in c.gpus}
    assert len(parents) == 1, c.gpus
    profiles = sorted(g.split("-mig-")[1].rsplit("-", 1)[0] for g in c.gpus)
    assert profiles == ["1g10gb", "3g40gb"], c.gpus
    # Each partition is a MIG device the driver created at prepare: two MIG UUIDs, one
    # per device; the legacy runtime's variable names none (void).
    uuids = [
        line.split("=", 1)[1]
        for line in c.log.splitlines()
        if line.startswith("GPU_DEVICE_") and "_UUID=" in line
    ]
    assert len(set(uuids)) == 2 and all(u.startswith("MIG-") for u in uuids), c.log
    assert "NVIDIA_VISIBLE_DEVICES=void" in c.log.splitlines(), c.log
    # Non-overlapping placements: 3g.40gb covers 4 memory slices at 0 or 4.
    devices = examples.devices()
    spans = []
    for g in c.gpus:
        attrs = devices[g]["attributes"]
        start = attrs["placementStart"]["int"]
        spans.append(set(range(start, start + attrs["placementSize"]["int"])))
    assert not spans[0] & spans[1], c.gpus


def test_device_taint_toleration(examples: E2E) -> None:
    tolerating = seen(examples, "10-device-taints.yaml", "pod0")
    other = seen(examples, "10-device-taints.yaml", "pod1")
    assert tolerating.gpus == ["gpu-19"], tolerating.log
    assert other.gpus == ["gpu-18"], other.log


def test_two_pods_share_one_gpu_by_capacity(examples: E2E) -> None:
    """Three pods each claim 16Gi and 20 compute of a shareable A100 40GB: two share one
    GPU, the third (48Gi > 40Gi) is put on another A100 40GB by the scheduler."""
    f = "11-shared-gpu-capacity.yaml"
    pods = {name: seen(examples, f, name) for name in ("pod0", "pod1", "pod2")}
    by_gpu: dict[str, list[str]] = {}
    for name, c in pods.items():
        assert len(c.gpus) == 1 and c.gpus[0] in A100_40, c.log
        gpu = c.gpus[0]
        assert c.props[gpu]["MEMORY"] == "16Gi", c.log
        assert c.props[gpu]["COMPUTE"] == "20", c.log
        by_gpu.setdefault(gpu, []).append(name)
    assert sorted(len(names) for names in by_gpu.values()) == [1, 2], by_gpu
    shared = next(gpu for gpu, names in by_gpu.items() if len(names) == 2)
    device = examples.devices()[shared]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"]["memory"]["value"] == "40Gi"  # 2 x 16Gi fit, 3 x 16Gi do not
    results = [r for rs in claim_results(examples, demo_namespace(DEMO / f)).values() for r in rs]
    assert len(results) == 3, results
    assert len({r["shareID"] for r in results}) == 3, results
    for r in results:
        assert r["consumedCapacity"] == {"memory": "16Gi", "compute": "20"}, r


def test_extended_resources_get_a_gpu_of_this_driver(examples: E2E) -> None:
    """pod0 asks for the DeviceClass's implicit extended resource, pod1 for the explicit
    name the chart set on it; the scheduler creates a claim for each."""
    f = "12-extended-resources.yaml"
    ns = demo_namespace(DEMO / f)
    names = {"pod0": f"deviceclass.resource.kubernetes.io/{DRIVER}", "pod1": "example.com/gpu"}
    gpus = []
    for pod, resource in names.items():
        c = seen(examples, f, pod)
        assert len(c.gpus) == 1 and c.gpus[0] in ALL_GPUS, c.log
        status = examples.get("pod", "-n", ns, pod)["status"]["extendedResourceClaimStatus"]
        mappings = [(m["containerName"], m["resourceName"]) for m in status["requestMappings"]]
        assert mappings == [("ctr0", resource)], status
        claim = examples.get("resourceclaim", "-n", ns, status["resourceClaimName"])
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["driver"], r["device"]) for r in results] == [(DRIVER, c.gpus[0])], results
        gpus += c.gpus
    assert len(set(gpus)) == 2, gpus


def test_init_container_and_container_share_one_claim(examples: E2E) -> None:
    f = "13-init-container-shared-claim.yaml"
    init = seen(examples, f, "pod0", "init0")
    ctr = seen(examples, f, "pod0", "ctr0")
    assert len(init.gpus) == 1 and init.gpus == ctr.gpus, (init.log, ctr.log)
    gpu = init.gpus[0]
    for c in (init, ctr):
        assert c.props[gpu]["MEMORY"] == "4Gi" and c.props[gpu]["COMPUTE"] == "10", c.log


def test_unprepare_removes_cdi_specs(examples: E2E) -> None:
    """Deleting a pod unprepares its claim: its CDI spec file disappears."""
    ns = "gpu-demo-cel-selector"
    claims = examples.get("resourceclaims", "-n", ns)["items"]
    assert len(claims) == 1
    uid = claims[0]["metadata"]["uid"]
    spec = Path("/var/run/cdi") / f"k8s.{DRIVER}-gpu_{uid}.json"
    assert spec.is_file(), f"no CDI spec {spec} for a running pod's claim"
    examples.kubectl("delete", "pod", "-n", ns, "pod0", "--wait=true", timeout=120)
    wait_for(lambda: not spec.exists(), 90, f"{spec} removed after the pod was deleted")
