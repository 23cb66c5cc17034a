"""Consumable capacity on reference partitions: the driver upgraded in place to
demo/partitions/values.yaml (4 partitions per GPU instead of MIG devices) for
demo/partitions/shared-partition-capacity.yaml, then back to the demo values. Runs after
test_examples and test_failures (file name), whose workloads are gone by then: the
partition layout replaces the MIG devices node-wide."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import DEMO, E2E, demo_namespace, install_chart

PARTITIONS = DEMO / "partitions"
EXAMPLE = PARTITIONS / "shared-partition-capacity.yaml"
GPUS = 22  # values-demo.yaml's fleet
PER_GPU = 4  # demo/partitions/values.yaml: kubeletPlugin.gpuPartitions


def partition_layout(devices: dict[str, dict[str, Any]]) -> bool:
    """22 GPUs as 4 partitions and a full device each, no MIG devices"""
    return len(devices) == GPUS * (PER_GPU + 1) and all(
        "-partition-" in name or name.endswith("-full") for name in devices
    )


@pytest.fixture(scope="module")
def partitioned(e2e: E2E) -> Iterator[E2E]:
    install_chart(e2e, PARTITIONS / "values.yaml", partition_layout)
    try:
        e2e.apply_file(EXAMPLE)
        yield e2e
    finally:
        e2e.delete_file(EXAMPLE)
        install_chart(e2e)  # back to the MIG layout the later tests expect


def test_two_pods_share_one_partition_by_capacity(partitioned: E2E) -> None:
    """Three pods each claim 8Gi and 10 compute of a shareable partition: two share one
    H100 partition (19Gi shareable), the third (24Gi) gets another partition."""
    e = partitioned
    ns = demo_namespace(EXAMPLE)
    e.wait_pods_ready(ns, "app=gpu-demo", 3)
    devices = e.devices()
    by_device: dict[str, list[str]] = {}
    for pod in ("pod0", "pod1", "pod2"):
        c = e.container_gpus(ns, pod, "ctr0")
        assert len(c.gpus) == 1 and "-partition-" in c.gpus[0], c.log
        device = c.gpus[0]
        assert c.props[device]["MEMORY"] == "8Gi" and c.props[device]["COMPUTE"] == "10", c.log
        assert devices[device]["allowMultipleAllocations"] is True, devices[device]
        by_device.setdefault(device, []).append(pod)
    assert sorted(len(pods) for pods in by_device.values()) == [1, 2], by_device
    shared = next(d for d, pods in by_device.items() if len(pods) == 2)
    shareable = devices[shared]["capacity"]["memory"]["requestPolicy"]["validRange"]["max"]
    assert 2 * 8 <= int(shareable.removesuffix("Gi")) < 3 * 8, shareable  # why the third moved
    claims = e.get("resourceclaims", "-n", ns)["items"]
    results = [r for c in claims for r in c["status"]["allocation"]["devices"]["results"]]
    assert len({r["shareID"] for r in results}) == 3, results
    assert all(r["consumedCapacity"] == {"memory": "8Gi", "compute": "10"} for r in results)
