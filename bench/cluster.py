"""A private control plane for the benchmarks (hack/local-cluster.sh on free ports).

Same mechanism as the integration tier's ``cluster`` fixture, without pytest: a run dir
of its own and free loopback ports, so a demo cluster on the default ports is left alone.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from driver.kube.api import ApiError, KubeApi
from tests.conftest import private_cluster_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "hack" / "local-cluster.sh"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
NODE_NAME = "bench-node-1"
WRITE_VERBS = ("POST", "PUT", "PATCH", "APPLY", "DELETE", "DELETECOLLECTION")
T = TypeVar("T")


class BenchError(RuntimeError):
    pass


def wait_for(fn: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05) -> T:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        try:
            value = fn()
            if value:
                return value
        except Exception as err:  # keep polling, report the last error
            last = err
        if time.monotonic() >= deadline:
            raise BenchError(f"timed out after {timeout}s waiting for {what} (last error: {last})")
        time.sleep(interval)


@dataclass
class LocalCluster:
    run_dir: Path | None
    kubeconfig: Path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def bin_dir(cls) -> Path:
        out = subprocess.run(
            ["bash", str(SCRIPT), "bin-dir"], capture_output=True, text=True, check=True
        )
        return Path(out.stdout.strip())

    @classmethod
    def start(cls) -> LocalCluster:
        bin_dir = cls.bin_dir()
        missing = [b for b in CONTROL_PLANE if not (bin_dir / b).is_file()]
        if missing:
            raise BenchError(
                f"{', '.join(missing)} missing from {bin_dir}: run `make cluster-build` first"
            )
        run_dir = Path(tempfile.mkdtemp(prefix="gpu-dra-bench-"))
        env = private_cluster_env(run_dir, with_node=False)
        c = cls(run_dir=run_dir, kubeconfig=run_dir / "admin.kubeconfig", env=env)
        up = c.script("up", timeout=300)
        if up.returncode != 0:
            c.script("down")
            raise BenchError(
                f"hack/local-cluster.sh up failed:\n{up.stdout[-3000:]}{up.stderr[-3000:]}"
            )
        return c

    def script(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def stop(self) -> None:
        if self.run_dir is not None:
            self.script("down")


class Api:
    """Raw JSON access for the harness (admin credentials)."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kube = KubeApi.from_kubeconfig(str(kubeconfig))

    def get(self, path: str, **query: str) -> Any:
        return self.kube.request("GET", path, query=query or None)

    def post(self, path: str, body: Any) -> Any:
        return self.kube.request("POST", path, body=body)

    def put(self, path: str, body: Any) -> Any:
        return self.kube.request("PUT", path, body=body)

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.kube.request(
            "PATCH", path, body=body, content_type="application/merge-patch+json"
        )

    def delete(self, path: str, **query: str) -> Any:
        try:
            return self.kube.request("DELETE", path, query=query or None)
        except ApiError as err:
            if not err.not_found:
                raise
            return None

    def slice_writes(self) -> int:
        """ResourceSlice writes the API server has served (all clients), from its /metrics."""
        text = self.kube.get_text("/metrics")
        total = 0
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels, value = line.rsplit(" ", 1)
            if 'resource="resourceslices"' not in labels:
                continue
            if any(f'verb="{v}"' in labels for v in WRITE_VERBS):
                total += int(float(value))
        return total


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ensure_node(api: Api, name: str = NODE_NAME) -> str:
    """A Ready Node object without a kubelet (like tests/integration's `node` fixture)."""
    api.delete(f"/api/v1/nodes/{name}")
    wait_for(lambda: _gone(api, f"/api/v1/nodes/{name}"), 30, f"old node {name} deleted")
    node = api.post(
        "/api/v1/nodes",
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        },
    )
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    api.merge_patch(
        f"/api/v1/nodes/{name}/status",
        {
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "BenchStandin",
                        "message": "fake node of the benchmarks",
                        "lastHeartbeatTime": _now(),
                        "lastTransitionTime": _now(),
                    }
                ],
            }
        },
    )
    return str(node["metadata"]["uid"])


def _gone(api: Api, path: str) -> bool:
    try:
        api.get(path)
    except ApiError as err:
        return err.not_found
    return False


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True)
