"""Fixtures for the e2e tier: the local cluster WITH its real node (kubelet, containerd
with CDI, runc), the driver installed by `helm install` as a DaemonSet.

``e2e`` (session): starts hack/local-cluster.sh ``up --with-node`` in a private run dir
on free loopback ports, installs the chart (mock values + demo/values-demo.yaml) and
waits for the plugin's ResourceSlices. At the end: uninstalls (if the uninstall test
did not) and stops the cluster. With ``GPU_DRA_KUBECONFIG`` set, that cluster (which
must have a Ready node with this project's images) is used; nothing is started or
stopped, only the Helm release is installed and removed.
``GPU_DRA_KEEP_CLUSTER=1`` leaves a started cluster running for inspection.

A machine has one local node. Where one already runs (`make demo` leaves its cluster
running), the tier borrows that cluster instead of stopping it, and says so: `up
--with-node` on it imports this tree's driver image; the demo's example namespaces
(`gpu-demo*`) are deleted and its driver release uninstalled (one driver per
cluster); when the tier ends, that release is installed again with its values, and
the cluster keeps running. ResourceClaims outside the demo's namespaces fail the
tier at setup, naming them: they are a user's, and the tier needs the node's devices.

A missing binary, package or image fails the tests and names it; nothing skips.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.conftest import private_cluster_env, run_kubectl, wait_for

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "local-cluster.sh"
CHART = REPO / "deployments" / "helm" / "gpu-dra-driver"
DEMO = REPO / "demo"
DRIVER = "gpu.example.com"
RELEASE = "gpu-dra-e2e"
NAMESPACE = "gpu-dra-e2e"
DEMO_NAMESPACES = "gpu-demo"  # the prefix of every demo/ example's namespace
NODE_BINARIES = ("kubelet", "kubectl", "kube-apiserver", "etcd")
RUNTIME_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "runc")
HOST_TOOLS = ("bash", "openssl", "curl", "flock", "socat", "ip", "gcc", "debootstrap")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
UP_TIMEOUT = 1500  # a cold driver-image build (debootstrap) is part of `up`
E2E_TIMEOUT = 2400  # per test, including the session fixture's setup

T = TypeVar("T")
GPU_LINE = re.compile(r"^GPU_DEVICE_([A-Z0-9_]+)=(gpu-\S+)$")
PROP_LINE = re.compile(
    r"^GPU_DEVICE_([A-Z0-9_]+?)_"
    r"(SHARING_STRATEGY|TIMESLICE_INTERVAL|PARTITION_COUNT|MEMORY|COMPUTE)=(.*)$"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT))


@dataclass
class ContainerGpus:
    """What one container saw: GPU device names and their per-device properties."""

    gpus: list[str]
    props: dict[str, dict[str, str]]  # gpu -> {SHARING_STRATEGY: ..., MEMORY: ..., ...}
    admin_access: bool
    log: str


@dataclass
class E2E:
    kubeconfig: Path
    bin_dir: Path
    helm: str
    run_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    installed: bool = False
    # The driver image tag of the first install, kept for every later (re)install: the
    # tree may change during the session, and `up` imported only the image built then.
    image_tag: str | None = None

    # --- kubectl ----------------------------------------------------------------
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return run_kubectl(self.bin_dir, self.kubeconfig, args, input, check, timeout)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def script(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def helm_cmd(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.helm, "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    # --- the driver ---------------------------------------------------------------
    def plugin_pod(self) -> dict[str, Any]:
        pods = self.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=kubeletplugin")[
            "items"
        ]
        # After a (re)install the old pod may still be terminating (and Running).
        running = [
            p
            for p in pods
            if p["status"].get("phase") == "Running"
            and p["metadata"].get("deletionTimestamp") is None
        ]
        assert running, f"no running plugin pod in {NAMESPACE}"
        return max(running, key=lambda p: str(p["metadata"]["creationTimestamp"]))

    def metrics(self) -> str:
        ip = self.plugin_pod()["status"]["podIP"]
        with urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=5) as resp:
            return resp.read().decode()

    def metric(self, name: str) -> float:
        total = 0.0
        for line in self.metrics().splitlines():
            if (
                line.startswith(f"{name}_total")
                or line.startswith(f"{name} ")
                or line.startswith(f"{name}{{")
            ):
                if "_created" in line.split()[0]:
                    continue
                total += float(line.split()[-1])
        return total

    def plugin_exec(self, *args: str) -> subprocess.CompletedProcess[str]:
        pod = self.plugin_pod()["metadata"]["name"]
        return self.kubectl("exec", "-n", NAMESPACE, pod, "-c", "plugin", "--", *args)

    def slices(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get(
            "resourceslices", f"--field-selector=spec.driver={DRIVER}"
        )["items"]
        return items

    def devices(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for s in self.slices() for d in s["spec"].get("devices") or []}

    # --- workloads ----------------------------------------------------------------
    def apply_file(self, path: Path) -> None:
        self.kubectl("apply", "-f", str(path))

    def delete_file(self, path: Path, wait: bool = True) -> None:
        self.kubectl(
            "delete",
            "-f",
            str(path),
            "--ignore-not-found",
            f"--wait={str(wait).lower()}",
            timeout=300,
        )

    def wait_pods_ready(
        self, namespace: str, selector: str, count: int, timeout: float = 300
    ) -> list[dict[str, Any]]:
        def ready() -> list[dict[str, Any]] | None:
            pods = self.get("pods", "-n", namespace, "-l", selector)["items"]
            ok = [
                p
                for p in pods
                if p["metadata"].get("deletionTimestamp") is None
                and any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions", [])
                )
            ]
            return ok if len(ok) >= count else None

        try:
            return wait_for(ready, timeout, f"{count} Ready pod(s) {selector} in {namespace}")
        except pytest.fail.Exception:
            pods = self.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
            events = self.kubectl("get", "events", "-n", namespace, check=False).stdout
            pytest.fail(f"pods in {namespace} not Ready:\n{pods}\n{events[-3000:]}")

    def container_gpus(self, namespace: str, pod: str, container: str) -> ContainerGpus:
        log = self.kubectl("logs", "-n", namespace, pod, "-c", container).stdout
        gpus: list[str] = []
        ids: dict[str, str] = {}
        props: dict[str, dict[str, str]] = {}
        for line in log.splitlines():
            m = GPU_LINE.match(line.strip())
            if m:
                gpus.append(m.group(2))
                ids[m.group(1)] = m.group(2)
        for line in log.splitlines():
            m = PROP_LINE.match(line.strip())
            if m and m.group(1) in ids:
                props.setdefault(ids[m.group(1)], {})[m.group(2)] = m.group(3)
        return ContainerGpus(
            gpus=sorted(gpus),
            props=props,
            admin_access="DRA_ADMIN_ACCESS=true" in log.splitlines(),
            log=log,
        )


def _run(
    cmd: list[str], timeout: float = 3600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _check_prerequisites(bin_dir: Path, node_bin_dir: Path, reuse: bool) -> None:
    missing = [f"{bin_dir}/{b}" for b in ("kubectl",) if not (bin_dir / b).is_file()]
    if not reuse:
        missing += [f"{bin_dir}/{b}" for b in NODE_BINARIES if not (bin_dir / b).is_file()]
        missing += [
            f"{node_bin_dir}/{b}" for b in RUNTIME_BINARIES if not (node_bin_dir / b).is_file()
        ]
        missing += [f"host tool {t}" for t in HOST_TOOLS if shutil.which(t) is None]
        missing += [
            f"/usr/lib/cni/{p} (apt-get install containernetworking-plugins)"
            for p in CNI_PLUGINS
            if not Path("/usr/lib/cni", p).is_file()
        ]
        if os.geteuid() != 0:
            missing.append("root (the node needs mounts, bridges and cgroups)")
    if missing:
        pytest.fail(
            "e2e tier: missing " + ", ".join(missing) + "; build the node components with "
            "`make cluster-build` (GPU_DRA_WITH_NODE=1 hack/local-cluster.sh build)"
        )


def _paths() -> tuple[Path, Path]:
    proc = _run(["bash", str(SCRIPT), "bin-dir"])
    if proc.returncode != 0:
        pytest.fail(f"hack/local-cluster.sh bin-dir failed: {proc.stderr.strip()}")
    bin_dir = Path(proc.stdout.strip())
    versions = dict(
        line.split("=", 1)
        for line in (REPO / "hack" / "versions.env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    node_bin = (
        bin_dir.parent
        / f"containerd-{versions['CONTAINERD_VERSION']}-runc-{versions['RUNC_VERSION']}"
    )
    return bin_dir, node_bin


def _helm() -> str:
    proc = _run(["bash", str(REPO / "hack" / "install-helm.sh")], timeout=1800)
    if proc.returncode != 0:
        pytest.fail(
            "hack/install-helm.sh failed (helm is needed to install the chart):\n"
            + _tail(proc.stderr)
        )
    return proc.stdout.strip().splitlines()[-1]


def driver_image_tag(e: E2E) -> str:
    """The tag `up --with-node` imported the driver image under (src-<hash of the tree
    then>; recorded in the run dir, so a tree edited since does not change it)."""
    proc = e.script("driver-image-tag")
    if proc.returncode != 0 or not proc.stdout.strip().startswith("src-"):
        pytest.fail(f"hack/local-cluster.sh driver-image-tag failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def mig_layout(devices: dict[str, dict[str, Any]]) -> bool:
    """The demo fleet as values-demo.yaml publishes it: whole GPUs and MIG partitions."""
    return len(devices) >= 400 and not any("-partition-" in name for name in devices)


def helm_upgrade(
    e: E2E, overlay: Path | None = None, *args: str
) -> subprocess.CompletedProcess[str]:
    """helm upgrade --install with the mock and demo values, `overlay` on top, the driver
    image of this session and `args` (e.g. --wait)."""
    if e.image_tag is None:
        e.image_tag = driver_image_tag(e)
    return e.helm_cmd(
        "upgrade",
        "--install",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "-f",
        str(CHART / "values-mock.yaml"),
        "-f",
        str(DEMO / "values-demo.yaml"),
        *(["-f", str(overlay)] if overlay else []),
        # Never a stale gpu-dra-driver:dev: the image built from this tree.
        "--set-string",
        f"image.tag={e.image_tag}",
        *args,
    )


def install_chart(
    e: E2E,
    overlay: Path | None = None,
    published: Callable[[dict[str, dict[str, Any]]], bool] = mig_layout,
) -> None:
    """helm upgrade --install with the mock and demo values (and `overlay` on top), then
    wait until the published devices satisfy `published`."""
    proc = helm_upgrade(e, overlay, "--wait", "--timeout", "5m")
    if proc.returncode != 0:
        pods = e.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False).stdout
        logs = e.kubectl(
            "logs",
            "-n",
            NAMESPACE,
            "-l",
            "app.kubernetes.io/component=kubeletplugin",
            "--tail=40",
            check=False,
        )
        pytest.fail(
            f"helm install failed:\n{_tail(proc.stdout + proc.stderr)}\n{pods}\n"
            f"{logs.stdout}{logs.stderr}"
        )
    e.installed = True
    # The kubelet wipes a node's slices when a plugin (re)registers; wait for the full pool
    # of the values just installed (an upgrade's old slices are there until replaced).
    wait_for(
        lambda: published(e.devices()),
        180,
        f"the plugin's ResourceSlices ({published.__doc__ or published.__name__})",
    )


def _tell(request: pytest.FixtureRequest, text: str) -> None:
    """One line on the terminal, past pytest's capture: what the tier does to a
    cluster it did not start."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n[e2e] {text}", flush=True)


def running_local_cluster() -> Path | None:
    """The run dir of the local cluster whose node runs on this machine, if any."""
    proc = _run(["bash", str(SCRIPT), "running-node"])
    found = proc.stdout.strip()
    return Path(found) if proc.returncode == 0 and found else None


@dataclass
class SetAside:
    """Another Helm release of the driver, uninstalled while the tier runs."""

    release: str
    namespace: str
    values: Path


def _set_aside_other_release(e: E2E, tell: Callable[[str], None]) -> SetAside | None:
    found = e.kubectl("get", "deviceclass", DRIVER, "-o", "json", check=False)
    if found.returncode != 0:
        return None
    annotations = json.loads(found.stdout)["metadata"].get("annotations") or {}
    release = annotations.get("meta.helm.sh/release-name")
    namespace = annotations.get("meta.helm.sh/release-namespace")
    if not release or not namespace:
        pytest.fail(
            f"the running local cluster has DeviceClass {DRIVER} from outside Helm; "
            "delete it, or stop that cluster (hack/local-cluster.sh down)"
        )
    if (release, namespace) == (RELEASE, NAMESPACE):
        return None  # an interrupted run's: the tier's install upgrades it
    claims = e.get("resourceclaims", "-A")["items"]
    users = [
        f"{c['metadata']['namespace']}/{c['metadata']['name']}"
        for c in claims
        if not c["metadata"]["namespace"].startswith(DEMO_NAMESPACES)
    ]
    if users:
        pytest.fail(
            f"the running local cluster has ResourceClaims outside the demo's namespaces "
            f"({', '.join(users[:5])}): the e2e tier needs the node's devices; delete "
            "them, or stop that cluster (hack/local-cluster.sh down)"
        )
    values = Path(tempfile.mkstemp(prefix=f"{release}-values-", suffix=".yaml")[1])
    got = e.helm_cmd("get", "values", release, "-n", namespace, "-o", "yaml")
    if got.returncode != 0:
        pytest.fail(f"helm get values {release} -n {namespace} failed: {got.stderr.strip()}")
    values.write_text(got.stdout)
    demo = [
        n["metadata"]["name"]
        for n in e.get("namespaces")["items"]
        if n["metadata"]["name"].startswith(DEMO_NAMESPACES)
    ]
    tell(
        f"deleting the demo's example namespaces ({len(demo)}) and uninstalling the "
        f"driver release {release} -n {namespace}; it is installed again with its values "
        f"({values}) when the tests end"
    )
    if demo:
        e.kubectl("delete", "namespace", *demo, "--wait=true", timeout=600)
    gone = e.helm_cmd("uninstall", release, "-n", namespace, "--wait", "--timeout", "3m")
    if gone.returncode != 0:
        pytest.fail(f"helm uninstall {release} -n {namespace} failed: {gone.stderr.strip()}")
    return SetAside(release, namespace, values)


def _restore(e: E2E, aside: SetAside, tell: Callable[[str], None]) -> None:
    proc = e.helm_cmd(
        "upgrade", "--install", aside.release, str(CHART), "--namespace", aside.namespace,
        "--create-namespace", "-f", str(aside.values), "--wait", "--timeout", "5m",
    )  # fmt: skip
    if proc.returncode == 0:
        tell(f"the driver release {aside.release} -n {aside.namespace} is installed again")
        aside.values.unlink()
    else:
        tell(
            f"installing {aside.release} again failed; its values are in {aside.values}:\n"
            f"{_tail(proc.stdout + proc.stderr)}"
        )


@pytest.fixture(scope="session")
def e2e(request: pytest.FixtureRequest) -> Iterator[E2E]:
    def tell(text: str) -> None:
        _tell(request, text)

    bin_dir, node_bin = _paths()
    existing = os.environ.get("GPU_DRA_KUBECONFIG")
    borrowed = None if existing else running_local_cluster()
    _check_prerequisites(bin_dir, node_bin, reuse=bool(existing))
    helm = _helm()
    aside: SetAside | None = None
    if borrowed is not None:
        e = E2E(
            kubeconfig=borrowed / "admin.kubeconfig",
            bin_dir=bin_dir,
            helm=helm,
            # The script reads the run dir's recorded ports itself.
            env={"GPU_DRA_CLUSTER_DIR": str(borrowed), "GPU_DRA_WITH_NODE": "1"},
        )
        tell(
            f"a local cluster runs on this machine (run dir {borrowed}; `make demo` leaves "
            "its cluster running): the e2e tier uses it, and it keeps running afterwards"
        )
        up = e.script("up", "--with-node", timeout=UP_TIMEOUT)  # this tree's driver image
        if up.returncode != 0:
            pytest.fail(
                f"hack/local-cluster.sh up --with-node on the running cluster failed "
                f"(exit {up.returncode}):\n{_tail(up.stdout + up.stderr)}"
            )
        aside = _set_aside_other_release(e, tell)
    elif existing:
        if not Path(existing).is_file():
            pytest.fail(f"GPU_DRA_KUBECONFIG={existing} does not exist")
        e = E2E(kubeconfig=Path(existing), bin_dir=bin_dir, helm=helm)
        classes = e.kubectl("get", "deviceclass", DRIVER, check=False)
        if (
            classes.returncode == 0
            and e.helm_cmd("status", RELEASE, "-n", NAMESPACE).returncode != 0
        ):
            pytest.fail(
                f"GPU_DRA_KUBECONFIG cluster already has DeviceClass {DRIVER} from another "
                "installation of the driver; uninstall it first (one driver per cluster)"
            )
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="gpu-dra-e2e-", dir="/tmp"))
        env = private_cluster_env(run_dir, with_node=True)
        e = E2E(
            kubeconfig=run_dir / "admin.kubeconfig",
            bin_dir=bin_dir,
            helm=helm,
            run_dir=run_dir,
            env=env,
        )
        try:
            up = e.script("up", "--with-node", timeout=UP_TIMEOUT)
        except subprocess.TimeoutExpired as err:
            e.script("down")
            pytest.fail(
                f"hack/local-cluster.sh up --with-node did not finish in {UP_TIMEOUT}s: {err}"
            )
        if up.returncode != 0:
            if os.environ.get("GPU_DRA_KEEP_CLUSTER") != "1":
                e.script("down")
            pytest.fail(
                f"hack/local-cluster.sh up --with-node failed (exit {up.returncode}):\n"
                f"{_tail(up.stdout + up.stderr)}"
            )
    try:
        install_chart(e)
        yield e
    finally:
        if e.installed and os.environ.get("GPU_DRA_KEEP_CLUSTER") != "1":
            e.helm_cmd("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "2m")
        if aside is not None:
            _restore(e, aside, tell)
        if e.run_dir is not None:
            if os.environ.get("GPU_DRA_KEEP_CLUSTER") == "1":
                print(f"\nGPU_DRA_KEEP_CLUSTER=1: cluster left running, KUBECONFIG={e.kubeconfig}")
            else:
                down = e.script("down")
                if down.returncode != 0:
                    print(f"hack/local-cluster.sh down failed:\n{_tail(down.stdout + down.stderr)}")


def demo_namespace(path: Path) -> str:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "Namespace":
            return str(doc["metadata"]["name"])
    raise AssertionError(f"{path} has no Namespace")
