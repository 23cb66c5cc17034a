"""The running plugin's /readyz (the chart's readiness probe) against the real API
server: not ready while no kubelet registered it, ready once one did, and, over the
real kubelet, tests/e2e/test_upgrade_readiness.py."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from tests.conftest import Cluster, FakeNode
from tests.integration.kubelet_standin import KubeletStandin
from tests.integration.plugin_process import DRIVER, PluginProcess, running_plugin


def readyz(plugin: PluginProcess) -> tuple[int, str]:
    url = f"http://127.0.0.1:{plugin.http_port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_ready_only_once_a_kubelet_registered_the_plugin(
    cluster: Cluster, node: FakeNode, tmp_path: Path
) -> None:
    with running_plugin(
        kubeconfig=cluster.kubeconfig, node_name=node.name, root=tmp_path
    ) as plugin:
        # Serving, but no kubelet watches its registration directory.
        code, text = readyz(plugin)
        assert code == 503, text
        assert "the kubelet has not registered the plugin" in text
        assert str(plugin.registry_dir) in text
        with KubeletStandin(plugin.registry_dir) as kubelet:
            kubelet.wait_for_plugin(DRIVER)
            code, text = cluster.wait_for(
                lambda: (r := readyz(plugin))[0] == 200 and r,
                timeout=10,
                what="/readyz 200 once registered",
            )
            assert text.startswith(f"ready: registered with the kubelet as {DRIVER}, serving DRA")
            assert plugin.metric("gpu_dra_kubelet_registered") == 1
