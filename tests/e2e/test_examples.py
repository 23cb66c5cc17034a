"""Every demo/ example on the real node: the GPUs each container sees come from the
container environment that containerd built from the driver's CDI specs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DEMO, DRIVER, E2E, ContainerGpus, demo_namespace, wait_for

EXAMPLES = sorted(DEMO.glob("[0-9]*.yaml"))
H100 = {f"gpu-{i}" for i in range(12)}
A100_80 = {f"gpu-{i}" for i in range(12, 16)}
AMPERE = {f"gpu-{i}" for i in range(12, 20)}
ALL_GPUS = {f"gpu-{i}" for i in range(20)}


def test_examples_exist() -> None:
    names = [p.name for p in EXAMPLES]
    assert len(names) == 10, names


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
    # Each partition is a MIG device the driver created at prepare: two MIG UUIDs.
    visible = [
        line.split("=", 1)[1].split(",")
        for line in c.log.splitlines()
        if line.startswith("NVIDIA_VISIBLE_DEVICES=")
    ]
    assert len(visible) == 1, c.log
    assert len(set(visible[0])) == 2 and all(u.startswith("MIG-") for u in visible[0]), c.log
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
