"""Strict partitions on the real kubelet (docs/mps.md, "Strict partitions: one server per
GPU"): the driver upgraded in place with two partitions per GPU, MPS daemons as
Deployments and kubeletPlugin.mps.strictPartitions. The partitions of an A100 40GB of
values-demo.yaml (MIG off, Ampere) publish `mpsIsolation: "strict"`; two pods, each
with a claim on one of them, get ONE daemon Deployment for the GPU (`--multi-user`,
the partition's limits), their own lower limit in their env, and the GPU held in
EXCLUSIVE_PROCESS: a process outside MPS is refused. The daemon outlives the first
pod and goes with the second, the compute mode with it. Back to the demo values at
the end."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.e2e.conftest import DRIVER, E2E, NAMESPACE, install_chart
from tests.e2e.test_mps import _ask, _daemon_pods, _daemons, _ready

NS = "gpu-e2e-mps-strict-partitions"
A100_40GB = "NVIDIA A100-SXM4-40GB"
OVERLAY = {
    "kubeletPlugin": {
        "gpuPartitions": 2,
        "allowMultipleAllocations": False,
        "mps": {"enabled": True, "strictPartitions": True},
    }
}


def _strict_partitions(devices: dict[str, dict[str, Any]]) -> bool:
    """the partitions of the A100 40GB GPUs, published strict"""
    return any(_attr(d, "mpsIsolation") == "strict" and "-partition-" in n
               for n, d in devices.items())  # fmt: skip


def _attr(device: dict[str, Any], name: str) -> Any:
    value = (device.get("attributes") or {}).get(name) or {}
    return next(iter(value.values()), None)


@pytest.fixture(scope="module")
def strict(e2e: E2E) -> Iterator[E2E]:
    with tempfile.TemporaryDirectory() as tmp:
        overlay = Path(tmp) / "strict-partitions.yaml"
        overlay.write_text(yaml.safe_dump(OVERLAY))
        install_chart(e2e, overlay, _strict_partitions)
    try:
        yield e2e
    finally:
        e2e.kubectl("delete", "namespace", NS, "--ignore-not-found", "--timeout=120s", check=False)
        install_chart(e2e)  # back to the demo values the later tests expect


def _manifest(gpu_uuid: str, threads: dict[str, int]) -> str:
    """A namespace and, per pod name in `threads`, a claim of a partition of GPU
    `gpu_uuid` (its MPS config asking that thread percentage) and the pod with it."""
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    ]
    selector = (
        f'device.attributes["{DRIVER}"].uuid == "{gpu_uuid}" && '
        f'has(device.attributes["{DRIVER}"].partition)'
    )
    for pod, percentage in threads.items():
        parameters = {
            "apiVersion": "gpu.resource.example.com/v1alpha1",
            "kind": "GpuConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {"defaultActiveThreadPercentage": percentage},
            },
        }
        request = {
            "name": "part",
            "exactly": {
                "deviceClassName": f"partition.{DRIVER}",
                "selectors": [{"cel": {"expression": selector}}],
            },
        }
        config = {"requests": ["part"], "opaque": {"driver": DRIVER, "parameters": parameters}}
        docs.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"namespace": NS, "name": pod},
                "spec": {"devices": {"requests": [request], "config": [config]}},
            }
        )
        script = "env | grep -E '^CUDA_MPS' | sort; trap 'exit 0' TERM; sleep 9999 & wait"
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"namespace": NS, "name": pod, "labels": {"app": "strict"}},
                "spec": {
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "ctr0",
                            "image": "localhost/gpu-dra/busybox:1.35",
                            "imagePullPolicy": "Never",
                            "command": ["sh", "-c", script],
                            "resources": {"claims": [{"name": "part"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "part", "resourceClaimName": pod}],
                },
            }
        )
    return yaml.safe_dump_all(docs)


def _process(e: E2E, device: str, kind: str, started: list[str]) -> str:
    """`gpu-dra mock process --kind <kind>` on `device`: what the plugin's mock NVML
    answers (it holds the compute mode the plugin set); a process started is noted in
    `started`, to be ended."""
    proc = e.kubectl(
        "exec", "-n", NAMESPACE, e.plugin_pod()["metadata"]["name"], "-c", "plugin", "--",
        "gpu-dra", "mock", "process", "--device", device, "--kind", kind,
        check=False,
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    pid = re.search(r"started \S+ process (\d+)", said)
    if pid is not None:
        started.append(pid.group(1))
    return said


def test_a_gpus_partitions_share_one_multi_user_server_in_exclusive_process(
    strict: E2E,
) -> None:
    e = strict
    devices = e.devices()
    partitions = {
        n: d
        for n, d in devices.items()
        if "-partition-" in n and _attr(d, "productName") == A100_40GB
    }
    assert partitions and all(_attr(d, "mpsIsolation") == "strict" for d in partitions.values())
    gpu = sorted(_attr(d, "uuid") for d in partitions.values())[0]
    names = sorted(n for n, d in partitions.items() if _attr(d, "uuid") == gpu)
    assert len(names) == 2, names
    full = names[0].split("-partition-")[0] + "-full"
    assert _attr(devices[full], "mpsIsolation") == "strict"

    started: list[str] = []
    try:
        e.kubectl("apply", "-f", "-", input=_manifest(gpu, {"tenant-a": 20, "tenant-b": 30}))
        pods = e.wait_pods_ready(NS, "app=strict", 2)
        assert len(pods) == 2
        daemons = [p for p in _daemon_pods(e) if p["metadata"].get("deletionTimestamp") is None]
        assert len(daemons) == 1 and _ready(daemons[0]), daemons  # one server for the GPU
        (deployment,) = _daemons(e)
        command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
        assert "--multi-user" in command, command
        assert _ask(e, daemons[0], "get_default_active_thread_percentage") == "50.0"
        for pod, threads in (("tenant-a", 20), ("tenant-b", 30)):
            env = e.kubectl("logs", "-n", NS, pod, "-c", "ctr0").stdout.splitlines()
            assert f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={threads}" in env, env
            assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in env, env
        # A client of each tenant: the first starts the GPU's one MPS server.
        for device in names:
            said = _process(e, device, "mps-client", started)
            assert "started mps-client" in said, said
        refused = _process(e, names[0], "compute", started)
        assert "busy or unavailable" in refused, refused

        e.kubectl("delete", "pod", "-n", NS, "tenant-a", "--wait=true", "--timeout=120s")
        e.kubectl("delete", "resourceclaim", "-n", NS, "tenant-a", "--wait=true")
        assert len(_daemons(e)) == 1  # tenant-b's clients keep their server
        refused = _process(e, names[1], "compute", started)
        assert "busy or unavailable" in refused, refused
    finally:
        for pid in started:
            e.plugin_exec("gpu-dra", "mock", "process", "--end", pid)
        started.clear()

    e.kubectl("delete", "namespace", NS, "--wait=true", "--timeout=120s")
    wait_for(
        lambda: not _daemons(e) and not _daemon_pods(e),
        120,
        "the GPU's daemon to be deleted with its last claim",
    )
    try:
        allowed = _process(e, names[1], "compute", started)
        assert "started compute" in allowed, allowed  # the mode found is back
    finally:
        for pid in started:
            e.plugin_exec("gpu-dra", "mock", "process", "--end", pid)
