"""NVML's recovery action against a running plugin and the real API server: set with
`gpu-dra mock recovery-action`, published as a taint with its own effect, removed by
itself when the action is back to none; an Xid taint stays."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import Cluster, FakeNode
from tests.integration.helpers import complete_pool, gpu_uuid_of, published_devices
from tests.integration.kubelet_standin import KubeletStandin
from tests.integration.plugin_process import DRIVER, PluginProcess, running_plugin
from tests.integration.test_health import node_events

GPU_DRA = Path(sys.executable).parent / "gpu-dra"
KEY = f"{DRIVER}/recovery-action"
XID = f"{DRIVER}/xid"


def mock(plugin: PluginProcess, *args: str) -> None:
    done = subprocess.run(
        [GPU_DRA, "mock", *args, f"--state-dir={plugin.data_dir}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr


def taints_of(cluster: Cluster, node: str) -> dict[str, set[tuple[str, str, str]]]:
    """(key, value, effect) of every taint, by device name."""
    pool = complete_pool(cluster, node) or []
    return {
        name: {(t["key"], t.get("value", ""), t["effect"]) for t in d.get("taints") or []}
        for name, d in published_devices(pool).items()
    }


def family(pool: list[dict[str, Any]], gpu: str) -> set[str]:
    uuid = gpu_uuid_of(pool, gpu)
    return {
        name
        for name, d in published_devices(pool).items()
        if uuid
        in (
            d["attributes"].get("uuid", {}).get("string"),
            d["attributes"].get("parentUUID", {}).get("string"),
        )
    }


def test_recovery_action_taints_and_clears_itself(
    cluster: Cluster, node: FakeNode, tmp_path: Path
) -> None:
    with running_plugin(
        kubeconfig=cluster.kubeconfig,
        node_name=node.name,
        root=tmp_path,
        args=["--recovery-action-poll-interval=1"],
    ) as plugin:
        pool = cluster.wait_for(lambda: complete_pool(cluster, node.name), timeout=60, what="pool")
        gpu2, gpu5 = family(pool, "gpu-2"), family(pool, "gpu-5")
        drain = (KEY, "drain-and-reset", "NoExecute")

        mock(plugin, "recovery-action", "--device", "gpu-2", "--action", "drain-and-reset")
        cluster.wait_for(
            lambda: all(drain in taints_of(cluster, node.name)[d] for d in gpu2),
            timeout=15,
            what="the drain-and-reset taint on gpu-2 and its partitions",
        )
        assert not any(taints_of(cluster, node.name)[d] for d in gpu5)
        # As a failure's taint is: counted, announced on the Node, the GPU unhealthy.
        assert plugin.metric("gpu_dra_tainted_devices") == len(gpu2)
        healthy = {"device": "gpu-2", "uuid": gpu_uuid_of(pool, "gpu-2")}
        assert plugin.metric("gpu_dra_gpu_healthy", healthy) == 0.0
        # Earlier tests on the same Node may have posted events about gpu-2: only this
        # one's count.
        events = cluster.wait_for(
            lambda: [
                e
                for e in node_events(cluster, node, "GpuTainted", "gpu-2")
                if "NVML recovery action drain-and-reset" in e["message"]
            ],
            timeout=15,
            what="GpuTainted Event for the recovery action",
        )
        taint = f"taint {KEY}=drain-and-reset:NoExecute on {len(gpu2)} device(s)"
        assert any(taint in e["message"] for e in events), events

        # Xid 48 needs a GPU reset: the Xid's taint and the action's.
        mock(plugin, "xid", "--device", "gpu-5", "--xid", "48")
        both = {(XID, "48", "NoSchedule"), (KEY, "gpu-reset", "NoSchedule")}
        cluster.wait_for(
            lambda: taints_of(cluster, node.name)["gpu-5"] == both,
            timeout=15,
            what="Xid 48 and gpu-reset on gpu-5",
        )

        # Back to none without a reset: each GPU loses the action's taint by itself;
        # gpu-5 keeps its Xid taint for the operator to clear.
        mock(plugin, "recovery-action", "--device", "gpu-2", "--action", "none")
        mock(plugin, "recovery-action", "--device", "gpu-5", "--action", "none")
        cluster.wait_for(
            lambda: (
                (t := taints_of(cluster, node.name))
                and not any(t[d] for d in gpu2)
                and all(t[d] == {(XID, "48", "NoSchedule")} for d in gpu5)
            ),
            timeout=15,
            what="the recovery-action taints gone, the Xid taint kept",
        )
        cluster.wait_for(
            lambda: [
                e
                for e in node_events(cluster, node, "GpuTaintCleared", "gpu-2")
                if "NVML answers no recovery action" in e["message"]
            ],
            timeout=15,
            what="GpuTaintCleared Event once the action is none",
        )
        assert plugin.metric("gpu_dra_gpu_healthy", healthy) == 1.0
        logs = plugin.logs()
        assert "NVML recovery action drain-and-reset: the GPU must be drained and reset" in logs
        assert "answers NVML with no recovery action: its gpu-reset taint is removed" in logs

        mock(plugin, "reset", "--all")
        cluster.wait_for(
            lambda: not any(taints_of(cluster, node.name).values()),
            timeout=15,
            what="every taint gone after the reset",
        )


def gpu_dra(plugin: PluginProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GPU_DRA, *args, f"--socket={plugin.data_dir / 'status.sock'}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_status_inventory_health_and_metric_agree_on_a_recovery_action(
    cluster: Cluster, node: FakeNode, tmp_path: Path
) -> None:
    """`gpu-dra mock recovery-action --device gpu-6 --action node-reboot`: NoSchedule on
    every device of gpu-6, and every command calls gpu-6 unhealthy, as the metric (and
    so the GpuDraGpuUnhealthy alert) does."""
    with (
        running_plugin(
            kubeconfig=cluster.kubeconfig,
            node_name=node.name,
            root=tmp_path,
            args=["--recovery-action-poll-interval=1"],
        ) as plugin,
        KubeletStandin(plugin.registry_dir) as kubelet,  # registered: one problem only
    ):
        kubelet.wait_for_plugin(DRIVER)
        pool = cluster.wait_for(lambda: complete_pool(cluster, node.name), timeout=60, what="pool")
        gpu6 = family(pool, "gpu-6")
        uuid = gpu_uuid_of(pool, "gpu-6")
        reboot = (KEY, "node-reboot", "NoSchedule")
        mock(plugin, "recovery-action", "--device", "gpu-6", "--action", "node-reboot")
        cluster.wait_for(
            lambda: all(reboot in taints_of(cluster, node.name)[d] for d in gpu6),
            timeout=15,
            what="the node-reboot taint on every device of gpu-6",
        )
        assert plugin.metric("gpu_dra_gpu_healthy", {"device": "gpu-6", "uuid": uuid}) == 0.0

        status = gpu_dra(plugin, "status", "--fail-on-unhealthy")
        assert status.returncode == 1, status.stdout + status.stderr
        first = status.stdout.splitlines()[0]
        assert first.startswith(
            f"UNHEALTHY: gpu-6 ({uuid}) failed: NVML recovery action node-reboot"
        )

        data = f"--state-dir={plugin.data_dir}"
        inventory = gpu_dra(plugin, "inventory", "--mock", "--node-name", node.name, data)
        assert inventory.returncode == 0, inventory.stderr
        row = next(line for line in inventory.stdout.splitlines() if line.startswith("gpu-6 "))
        assert row.endswith(f"Unhealthy ({KEY}=node-reboot:NoSchedule)"), row
        others = [line for line in inventory.stdout.splitlines() if line.startswith("gpu-5 ")]
        assert others and others[0].endswith("Healthy")

        health = gpu_dra(
            plugin,
            "health",
            data,
            "--node-name",
            node.name,
            f"--kubeconfig={cluster.kubeconfig}",
            "-o",
            "json",
        )
        assert health.returncode == 0, health.stderr
        report = json.loads(health.stdout)
        (action,) = report["recovery"]["actions"]
        assert (action["device"], action["value"]) == ("gpu-6", "node-reboot")
        slice_taints = [t for t in report["slices"]["taints"] if t["key"] == KEY]
        assert {t["device"] for t in slice_taints} == gpu6
        assert all(t["reason"] == action["message"] for t in slice_taints)
        assert report["consistent"] is True

        mock(plugin, "recovery-action", "--device", "gpu-6", "--action", "none")
        cluster.wait_for(
            lambda: gpu_dra(plugin, "status", "--fail-on-unhealthy").returncode == 0,
            timeout=15,
            what="gpu-dra status to call the node healthy once the action is none",
        )
        assert plugin.metric("gpu_dra_gpu_healthy", {"device": "gpu-6", "uuid": uuid}) == 1.0
