"""`gpu-dra status` and the operator metrics against a running plugin and the real
control plane: registration, slice sync, GPUs by MIG mode, a prepared claim."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Cluster, FakeNode
from tests.integration.helpers import (
    allocation,
    apply,
    claim,
    complete_pool,
    delete_namespace,
    device_class,
    get_json,
    namespace,
    pod_using,
    whole_gpu_selector,
)
from tests.integration.kubelet_standin import KubeletStandin
from tests.integration.plugin_process import DRIVER, PluginProcess, running_plugin

NS = "status-test"
GPU_DRA = Path(sys.executable).parent / "gpu-dra"


@pytest.fixture(scope="module", autouse=True)
def _release_namespace(cluster: Cluster) -> Iterator[None]:
    yield
    delete_namespace(cluster, NS)


def status(plugin: PluginProcess, *args: str) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [
            GPU_DRA,
            "status",
            "-o",
            "json",
            f"--socket={plugin.data_dir / 'status.sock'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode in (0, 1), done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return done.returncode, report


def test_status_and_metrics_of_a_running_plugin(
    cluster: Cluster, node: FakeNode, tmp_path: Path
) -> None:
    apply(
        cluster,
        namespace(NS),
        device_class(
            "hw-gpu.example.com",
            f'device.driver == "{DRIVER}" && !has(device.attributes["{DRIVER}"].profile)',
        ),
    )
    with running_plugin(
        kubeconfig=cluster.kubeconfig, node_name=node.name, root=tmp_path
    ) as plugin:
        pool = cluster.wait_for(lambda: complete_pool(cluster, node.name), timeout=60, what="pool")

        # /status (GPU UUIDs, PCI ids, Xid text, claims) is not on the pod-network port:
        # only on the status socket, which only root on the node can open.
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{plugin.http_port}/status", timeout=5)
        assert refused.value.code == 404
        socket_mode = (plugin.data_dir / "status.sock").lstat().st_mode
        assert stat.S_ISSOCK(socket_mode) and stat.S_IMODE(socket_mode) == 0o600

        # Served, but no kubelet has registered it: a problem, and the check fails.
        code, report = status(plugin, "--fail-on-unhealthy")
        assert code == 1
        assert "the kubelet has not registered the plugin (yet)" in report["problems"]
        assert report["plugin"]["version"] == version("gpu-dra-driver")
        assert report["plugin"]["node"] == node.name

        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)

            def healthy() -> dict[str, Any] | None:
                code, report = status(plugin, "--fail-on-unhealthy")
                return report if code == 0 else None

            report = cluster.wait_for(healthy, timeout=30, what="a healthy status once registered")
            assert report["registration"]["registered"] is True
            assert report["slices"]["stale"] is False and report["slices"]["lastError"] is None
            gpus = report["gpus"]
            assert [g["name"] for g in gpus] == [f"gpu-{i}" for i in range(len(gpus))]
            assert {g["migMode"] for g in gpus} == {"dynamic"}
            assert all(g["health"] == "healthy" for g in gpus)
            assert (report["journal"]["status"], report["journal"]["preparedClaims"]) in {
                ("absent", 0),
                ("ok", 0),
            }

            assert plugin.metric("gpu_dra_build_info", {"version": version("gpu-dra-driver")}) == 1
            assert plugin.metric("gpu_dra_gpus", {"mig_mode": "dynamic"}) == len(gpus)
            assert plugin.metric("gpu_dra_gpus", {"mig_mode": "static"}) == 0
            assert plugin.metric("gpu_dra_gpu_healthy") == len(gpus)
            assert 'gpu_dra_requests_in_flight{method="prepare"} 0.0' in plugin.metrics()
            assert plugin.metric("gpu_dra_prepared_claims") == 0

            # A prepared claim shows in the journal line and the metrics.
            apply(
                cluster,
                claim("one", NS, "hw-gpu.example.com", whole_gpu_selector(pool, "gpu-1")),
                pod_using("one", NS, "one"),
            )
            cluster.wait_for(lambda: allocation(cluster, NS, "one"), timeout=60, what="allocation")
            uid = get_json(cluster, "resourceclaim", "-n", NS, "one")["metadata"]["uid"]
            result = kubelet.prepare(DRIVER, [(NS, uid, "one")])[uid]
            assert result.error == "", result.error
            code, report = status(plugin)
            assert report["journal"]["status"] == "ok"
            assert report["journal"]["preparedClaims"] == 1
            assert plugin.metric("gpu_dra_prepared_claims") == 1
            assert plugin.metric("gpu_dra_prepared_devices") >= 1
            assert plugin.metric("gpu_dra_prepare_claims_total", {"outcome": "ok"}) >= 1
            assert kubelet.unprepare(DRIVER, [(NS, uid, "one")])[uid].error == ""
            assert plugin.metric("gpu_dra_prepared_claims") == 0

    # The plugin gone, the node's files still tell the journal's state.
    done = subprocess.run(
        [GPU_DRA, "status", f"--state-dir={plugin.data_dir}", "--fail-on-unhealthy"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stdout.startswith("UNHEALTHY: the plugin does not answer")
    assert not (plugin.data_dir / "status.sock").exists()  # a clean stop removes it
    assert "journal       ok: " in done.stdout
