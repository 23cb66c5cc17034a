"""The kind configuration hack/kind/create-cluster.sh renders (checked without a
container engine): the stock path for users with a registry, the offline path built
here, the host facts it adapts to, and a one-line error for bad input."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart_render import REPO

CREATE = REPO / "hack" / "kind" / "create-cluster.sh"
VERSIONS = dict(
    line.split("=", 1)
    for line in (REPO / "hack" / "versions.env").read_text().splitlines()
    if "=" in line and not line.startswith("#")
)


def run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KIND_")}
    return subprocess.run(
        ["bash", str(script), *args],
        env={**base, "CONTAINER_TOOL": "podman", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def config(source: str, **env: str) -> dict[str, Any]:
    proc = run(CREATE, "--print-config", KIND_NODE_SOURCE=source, **env)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, Any] = yaml.safe_load(proc.stdout)
    return doc


def patches(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """kubeadmConfigPatches by kind (each must be YAML of its own)."""
    return {p["kind"]: p for p in (yaml.safe_load(text) for text in doc["kubeadmConfigPatches"])}


def cgroup_v1() -> bool:
    return not Path("/sys/fs/cgroup/cgroup.controllers").exists()


def lacks_sys_resource() -> bool:
    status = Path("/proc/self/status").read_text()
    bounding = int(re.search(r"^CapBnd:\s*([0-9a-f]+)$", status, re.M)[1], 16)  # type: ignore[index]
    return not bounding >> 24 & 1


def test_registry_config_keeps_kinds_own_network_and_dns() -> None:
    doc = config("registry")
    assert doc["kind"] == "Cluster" and doc["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert doc["name"] == "gpu-dra-driver"
    assert "networking" not in doc  # kindnetd and kube-proxy's default mode
    assert "ClusterConfiguration" not in patches(doc)
    assert [n["role"] for n in doc["nodes"]] == ["control-plane", "worker"]
    assert any("enable_cdi = true" in p for p in doc["containerdConfigPatches"])
    # The local cluster's gates, to every component.
    common = (REPO / "hack" / "lib" / "common.sh").read_text()
    gates = re.search(r"^FEATURE_GATES=(\S+)$", common, re.M)[1]  # type: ignore[index]
    assert doc["featureGates"] == {
        k: v == "true" for k, v in (g.split("=") for g in gates.split(","))
    }
    assert doc["runtimeConfig"] == {"resource.k8s.io/v1": "true"}


def test_offline_config_uses_the_images_built_here() -> None:
    doc = config("offline")
    assert doc["networking"] == {"disableDefaultCNI": True, "kubeProxyMode": "nftables"}
    cluster = patches(doc)["ClusterConfiguration"]
    assert cluster["imageRepository"] == "localhost/gpu-dra/k8s"
    assert cluster["etcd"]["local"]["imageTag"] == VERSIONS["ETCD_VERSION"]
    assert cluster["dns"] == {"disabled": True}


@pytest.mark.parametrize("source", ["registry", "offline"])
def test_host_facts_reach_the_kubelet_and_containerd(source: str) -> None:
    doc = config(source)
    kubelet = patches(doc)["KubeletConfiguration"]
    assert kubelet.get("failCgroupV1") == (False if cgroup_v1() else None)
    assert kubelet.get("oomScoreAdj") == (0 if lacks_sys_resource() else None)
    restricted = any("restrict_oom_score_adj = true" in p for p in doc["containerdConfigPatches"])
    assert restricted == lacks_sys_resource()


def test_make_kind_up_asks_for_two_workers() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nkind-up:\n", 1)[1].split("\n\n", 1)[0]
    assert "KIND_WORKERS=$${KIND_WORKERS:-2} hack/kind/create-cluster.sh" in recipe


def test_workers_and_name_from_the_environment() -> None:
    doc = config("registry", KIND_WORKERS="0", KIND_CLUSTER_NAME="other")
    assert doc["name"] == "other"
    assert [n["role"] for n in doc["nodes"]] == ["control-plane"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KIND_WORKERS": "two"}, "KIND_WORKERS must be a number from 0 to 9, not 'two'"),
        ({"KIND_NODE_SOURCE": "docker-hub"}, "KIND_NODE_SOURCE must be auto, registry or offline"),
        ({"CONTAINER_TOOL": "nerdctl"}, "CONTAINER_TOOL must be docker or podman, not nerdctl"),
    ],
)
def test_bad_settings_get_one_line(env: dict[str, str], message: str) -> None:
    proc = run(CREATE, "--print-config", **env)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_unknown_arguments_get_one_line() -> None:
    for script in ("create-cluster.sh", "delete-cluster.sh", "cni.sh", "vap-check.sh", "demo.sh"):
        proc = run(REPO / "hack" / "kind" / script, "--bogus")
        assert proc.returncode == 1, script
        assert "usage:" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, (
            script,
            proc.stderr,
        )


def test_kind_is_pinned_and_built_from_the_module_proxy() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSIONS["KIND_VERSION"])
    tools = (REPO / "hack" / "kind" / "tools.sh").read_text()
    assert 'go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@v$KIND_VERSION"' in tools
    name = run(REPO / "hack" / "kind" / "build-node-image.sh", "--name")
    assert name.stdout.strip() == f"localhost/gpu-dra/kind-node:v{VERSIONS['K8S_VERSION']}"
