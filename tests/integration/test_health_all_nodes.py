"""`gpu-dra health --all-nodes` against the real API server: a running plugin (mock)
publishes its node's slices and taints a GPU on an Xid; a second node's slice, posted
as another plugin would, carries a recovery-action taint. One line per tainted GPU,
sorted by node, however many partitions each GPU publishes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster, FakeNode
from tests.integration.helpers import complete_pool, gpu_uuid_of, published_devices
from tests.integration.plugin_process import DRIVER, running_plugin

GPU_DRA = Path(sys.executable).parent / "gpu-dra"
OTHER_NODE = "all-nodes-other"  # sorts before the fixture's node ("node-1")
RESET = {
    "key": f"{DRIVER}/recovery-action",
    "value": "gpu-reset",
    "effect": "NoSchedule",
    "timeAdded": "2026-11-27T10:00:00Z",
}


def gpu_dra(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GPU_DRA, *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )


def other_node_slice() -> dict[str, Any]:
    """A GPU and two partitions, all with the GPU's recovery-action taint."""
    uuid = "GPU-00000000-0000-0000-0000-0000000000aa"

    def device(name: str, **attributes: str) -> dict[str, Any]:
        return {
            "name": name,
            "attributes": {k: {"string": v} for k, v in attributes.items()},
            "taints": [RESET],
        }

    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{OTHER_NODE}-{DRIVER}-0"},
        "spec": {
            "driver": DRIVER,
            "nodeName": OTHER_NODE,
            "pool": {"name": OTHER_NODE, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                device("gpu-0", uuid=uuid),
                device("gpu-0-mig-1g10gb-0", parentUUID=uuid, profile="1g.10gb"),
                device("gpu-0-mig-1g10gb-1", parentUUID=uuid, profile="1g.10gb"),
            ],
        },
    }


@pytest.fixture
def other_node(cluster: Cluster) -> Iterator[str]:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(other_node_slice()))
    yield OTHER_NODE
    cluster.kubectl(
        "delete", "resourceslice", f"{OTHER_NODE}-{DRIVER}-0", "--ignore-not-found", check=False
    )


def test_all_nodes_lists_each_tainted_gpu_once(
    cluster: Cluster, node: FakeNode, other_node: str, tmp_path: Path
) -> None:
    with running_plugin(
        kubeconfig=cluster.kubeconfig, node_name=node.name, root=tmp_path
    ) as plugin:
        pool = cluster.wait_for(lambda: complete_pool(cluster, node.name), timeout=60, what="pool")
        uuid6 = gpu_uuid_of(pool, "gpu-6")
        done = gpu_dra(
            "mock", "xid", "--device", "gpu-6", "--xid", "79", f"--state-dir={plugin.data_dir}"
        )
        assert done.returncode == 0, done.stderr

        def tainted() -> list[str] | None:
            devices = published_devices(complete_pool(cluster, node.name) or [])
            names = [n for n, d in devices.items() if d.get("taints")]
            return names or None

        devices_of_gpu6 = cluster.wait_for(tainted, timeout=10, what="Xid 79 on gpu-6")

        kubeconfig = f"--kubeconfig={cluster.kubeconfig}"
        table = gpu_dra("health", "--all-nodes", kubeconfig)
        assert table.returncode == 0, table.stderr
        ours = {other_node, node.name}  # other modules' nodes may have slices too
        rows = [r for r in map(str.split, table.stdout.splitlines()[1:]) if r and r[0] in ours]
        assert [row[:3] for row in rows] == [
            [other_node, "gpu-0", "3/3"],
            [node.name, "gpu-6", f"{len(devices_of_gpu6)}/{len(devices_of_gpu6)}"],
        ]
        assert f"{DRIVER}/xid=79:NoSchedule" in rows[1]

        report = json.loads(gpu_dra("health", "--all-nodes", kubeconfig, "-o", "json").stdout)
        lines = {(g["node"], g["gpu"]): g for g in report["taintedGPUs"] if g["node"] in ours}
        assert set(lines) == {(other_node, "gpu-0"), (node.name, "gpu-6")}
        gpu6 = lines[(node.name, "gpu-6")]
        assert gpu6["gpuUUID"] == uuid6 and gpu6["unhealthy"] is True
        (xid,) = gpu6["taints"]
        assert (xid["key"], xid["value"], xid["devices"]) == (
            f"{DRIVER}/xid",
            "79",
            len(devices_of_gpu6),
        )
        assert xid["timeAdded"] and gpu6["since"] == xid["timeAdded"]
        assert lines[(other_node, "gpu-0")]["since"] == RESET["timeAdded"]

        failing = gpu_dra("health", "--all-nodes", kubeconfig, "--fail-on-unhealthy")
        assert failing.returncode == 1
