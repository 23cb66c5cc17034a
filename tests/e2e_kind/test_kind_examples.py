"""The demo/ examples (the reference driver's examples and this driver's own) on the
kind cluster, unchanged, with the assertions of the real-node tier
(tests/e2e/test_examples.py), imported from there.

The examples were written for one node: some compare the device names two pods got,
and every worker publishes the same names. So while they run, every worker but the
first is cordoned; the pods all land on that one, as on the local node."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import DRIVER, E2E, wait_for
from tests.e2e.test_examples import (  # noqa: F401  (pytest collects what is imported)
    examples,
    test_admin_access_sees_every_gpu,
    test_cel_selector,
    test_claim_shared_by_two_containers,
    test_claim_shared_by_two_pods,
    test_device_taint_toleration,
    test_examples_exist,
    test_extended_resources_get_a_gpu_of_this_driver,
    test_init_container_and_container_share_one_claim,
    test_mig_partitions_on_one_gpu,
    test_multiple_requests_two_distinct_gpus,
    test_opaque_config_time_slicing_and_space_partitioning,
    test_prioritized_alternatives,
    test_resourceclaimtemplate_one_distinct_gpu_per_pod,
    test_two_pods_share_one_gpu_by_capacity,
)
from tests.e2e_kind.conftest import Kind


@pytest.fixture(scope="module")
def e2e(kind: Kind) -> Iterator[E2E]:
    """The kind cluster with all workers but the first cordoned (the examples' `e2e`)."""
    others = kind.workers()[1:]
    for node in others:
        kind.e2e.kubectl("cordon", node)
    try:
        yield kind.e2e
    finally:
        for node in others:
            kind.e2e.kubectl("uncordon", node, check=False)


def test_unprepare_removes_cdi_specs_in_the_node(kind: Kind, examples: E2E) -> None:  # noqa: F811
    """tests/e2e's test_unprepare_removes_cdi_specs, with the CDI root inside the node
    container: deleting a pod unprepares its claim and its CDI spec disappears."""
    ns = "gpu-demo-cel-selector"
    claims = examples.get("resourceclaims", "-n", ns)["items"]
    assert len(claims) == 1
    uid = claims[0]["metadata"]["uid"]
    node = examples.get("pod", "-n", ns, "pod0")["spec"]["nodeName"]
    spec = f"/var/run/cdi/k8s.{DRIVER}-gpu_{uid}.json"
    assert kind.node_exec(node, "test", "-f", spec).returncode == 0, f"no {spec} in {node}"
    examples.kubectl("delete", "pod", "-n", ns, "pod0", "--wait=true", timeout=120)
    wait_for(
        lambda: kind.node_exec(node, "test", "-e", spec).returncode == 1,
        90,
        f"{spec} removed from {node} after the pod was deleted",
    )
