"""Shared fixtures: a real control plane from hack/local-cluster.sh, started once per
session for every tier that needs it (integration, reliability).

``cluster`` (session): starts etcd, kube-apiserver, kube-controller-manager and
kube-scheduler in a private run dir on free loopback ports (so a demo cluster on the
default ports is left alone) and stops them at the end. With ``GPU_DRA_KUBECONFIG``
set, an existing cluster is used instead and nothing is started or stopped.
``GPU_DRA_KEEP_CLUSTER=1`` leaves the started cluster running for inspection.

``node`` (module): a Node object with a Ready condition and capacity, the "fake node"
that the scheduler binds pods to and that ResourceSlices name; the kubelet part is
played by :mod:`tests.integration.kubelet_standin`.

A missing binary or tool fails the tests and names what is missing; nothing skips.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import pytest

if TYPE_CHECKING:
    from driver.kube.api import KubeApi

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "hack" / "local-cluster.sh"
CONTROL_PLANE_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
HOST_TOOLS = ("bash", "openssl", "curl", "flock", "base64")
UP_TIMEOUT = 300  # seconds; a cold `up` takes well under a minute
NODE_NAME = "gpu-node-1"

T = TypeVar("T")


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory under /tmp: a Unix socket's path holds at most 107 bytes, and
    pytest's tmp_path can be longer."""
    path = Path(tempfile.mkdtemp(prefix="gdra-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def wait_for(
    fn: Callable[[], T | None],
    timeout: float = 60,
    what: str = "condition",
    interval: float = 0.5,
) -> T:
    """Poll ``fn`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        try:
            result = fn()
            if result:
                return result
        except Exception as err:  # keep polling; report the last error
            last_error = err
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error})" if last_error else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(interval)


class KubectlError(AssertionError):
    pass


def run_kubectl(
    bin_dir: Path,
    kubeconfig: Path,
    args: Sequence[str],
    input: str | None = None,
    check: bool = True,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """The built kubectl against `kubeconfig`; KubectlError names the command on failure."""
    cmd = [str(bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig), *args]
    proc = subprocess.run(
        cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        raise KubectlError(
            f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr.strip()}"
        )
    return proc


def private_cluster_env(run_dir: Path, *, with_node: bool) -> dict[str, str]:
    """hack/local-cluster.sh settings for a cluster of its own: run dir, free ports."""
    api, etcd, peer, kcm, sched = free_ports(5)
    return {
        "GPU_DRA_CLUSTER_DIR": str(run_dir),
        "GPU_DRA_API_PORT": str(api),
        "GPU_DRA_ETCD_PORT": str(etcd),
        "GPU_DRA_ETCD_PEER_PORT": str(peer),
        "GPU_DRA_KCM_PORT": str(kcm),
        "GPU_DRA_SCHEDULER_PORT": str(sched),
        "GPU_DRA_WITH_NODE": "1" if with_node else "0",
    }


@dataclass
class Cluster:
    kubeconfig: Path
    bin_dir: Path
    run_dir: Path | None = None  # None when the cluster was not started by the fixture
    env: dict[str, str] = field(default_factory=dict)  # the script's environment

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this cluster (text mode)."""
        return run_kubectl(self.bin_dir, self.kubeconfig, args, input, check, timeout)

    def api_client(self) -> KubeApi:
        """The driver's API client for the admin kubeconfig."""
        from driver.kube.api import KubeApi

        return KubeApi.from_kubeconfig(str(self.kubeconfig))

    def script(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run hack/local-cluster.sh with this cluster's run dir and ports."""
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    wait_for = staticmethod(wait_for)


def _bin_dir() -> Path:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "bin-dir"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"hack/local-cluster.sh bin-dir failed: {proc.stderr.strip()}")
    return Path(proc.stdout.strip())


def free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    bin_dir = _bin_dir()
    existing = os.environ.get("GPU_DRA_KUBECONFIG")
    needed = ("kubectl",) if existing else (*CONTROL_PLANE_BINARIES, "kubectl")
    missing = [b for b in needed if not (bin_dir / b).is_file()]
    if missing:
        pytest.fail(
            f"integration tier: {', '.join(missing)} missing from {bin_dir}; "
            "build them with `make cluster-build` (hack/local-cluster.sh build, "
            "about 40 min cold on 2 cores)"
        )
    if existing:
        if not Path(existing).is_file():
            pytest.fail(f"GPU_DRA_KUBECONFIG={existing} does not exist")
        yield Cluster(kubeconfig=Path(existing), bin_dir=bin_dir)
        return

    tools = [t for t in HOST_TOOLS if shutil.which(t) is None]
    if tools:
        pytest.fail(f"integration tier: host tools missing from PATH: {', '.join(tools)}")

    run_dir = Path(tempfile.mkdtemp(prefix="gpu-dra-it-", dir=os.environ.get("TMPDIR", "/tmp")))
    # The integration tier has the fake node; the real one is tests/e2e's.
    env = private_cluster_env(run_dir, with_node=False)
    c = Cluster(kubeconfig=run_dir / "admin.kubeconfig", bin_dir=bin_dir, run_dir=run_dir, env=env)
    try:
        up = c.script("up", timeout=UP_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        c.script("down")
        pytest.fail(f"hack/local-cluster.sh up did not finish in {UP_TIMEOUT}s: {err}")
    if up.returncode != 0:
        keep = c.script("down") if os.environ.get("GPU_DRA_KEEP_CLUSTER") != "1" else None
        pytest.fail(
            f"hack/local-cluster.sh up failed (exit {up.returncode}):\n"
            f"{_tail(up.stdout + up.stderr)}"
            + (f"\n(run dir {run_dir} removed)" if keep else f"\n(logs in {run_dir}/logs)")
        )
    try:
        yield c
    finally:
        if os.environ.get("GPU_DRA_KEEP_CLUSTER") == "1":
            print(f"\nGPU_DRA_KEEP_CLUSTER=1: cluster left running, KUBECONFIG={c.kubeconfig}")
        else:
            down = c.script("down")
            if down.returncode != 0:
                print(f"hack/local-cluster.sh down failed:\n{_tail(down.stdout + down.stderr)}")


class FakeNode(NamedTuple):
    name: str
    uid: str


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> Iterator[FakeNode]:
    """A Ready Node object without a kubelet (no lease; node-lifecycle is off)."""
    import json

    cluster.kubectl("delete", "node", NODE_NAME, "--ignore-not-found", "--wait=true")
    # Like a starting kubelet: no ResourceSlices of an earlier node of this name (the
    # garbage collector removes slices owned by a deleted Node only eventually; stale
    # ones of a higher pool generation would hide the new ones from the scheduler).
    _delete_node_slices(cluster)
    manifest = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": NODE_NAME,
            "labels": {
                "kubernetes.io/hostname": NODE_NAME,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
        },
    }
    created = json.loads(
        cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(manifest)).stdout
    )
    capacity = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    status = {
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": NODE_NAME},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletStandin",
                    "message": "fake node of the integration tests",
                    "lastHeartbeatTime": _now(),
                    "lastTransitionTime": _now(),
                }
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "v1.37.1",
                "containerRuntimeVersion": "none://0",
                "kernelVersion": "",
                "osImage": "",
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }
    }
    cluster.kubectl(
        "patch", "node", NODE_NAME, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    # The TaintNodesByCondition admission plugin gives every new Node the
    # node.kubernetes.io/not-ready:NoSchedule taint; the node-lifecycle controller,
    # off without a kubelet, would remove it once the node is Ready.
    cluster.kubectl("patch", "node", NODE_NAME, "--type=merge", "-p", '{"spec":{"taints":null}}')
    yield FakeNode(name=NODE_NAME, uid=created["metadata"]["uid"])
    # The node goes away with its pods, as the kubelet stand-in would have it: without
    # this they linger (pod GC waits), stay reserved on their claims and keep the
    # devices allocated for the next module's node of the same name.
    cluster.kubectl(
        "delete",
        "pods",
        "--all-namespaces",
        f"--field-selector=spec.nodeName={NODE_NAME}",
        "--grace-period=0",
        "--force",
        check=False,
    )
    _delete_node_slices(cluster)
    cluster.kubectl("delete", "node", NODE_NAME, "--ignore-not-found", "--wait=false", check=False)


def _delete_node_slices(cluster: Cluster) -> None:
    cluster.kubectl(
        "delete",
        "resourceslices",
        f"--field-selector=spec.nodeName={NODE_NAME}",
        "--ignore-not-found",
        check=False,
    )


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """The root logger's handlers and level as they were before the test, afterwards
    (a test that configures the daemons' logging must not write into later tests')."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
