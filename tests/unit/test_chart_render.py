"""The Helm chart, rendered with `helm template`: the invariants operators rely on.

Needs the pinned helm (HELM_VERSION in hack/versions.env) built by hack/install-helm.sh,
or HELM=/path/to/helm. Without it these tests fail and say how to get it.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deployments" / "helm" / "gpu-dra-driver"
MOCK_VALUES = CHART / "values-mock.yaml"
NAMESPACE = "gpu-dra-driver"
RELEASE = "gpu-dra-driver"
DRIVER = "gpu.example.com"

# gpu-kubelet-plugin's environment variables (driver/plugin/options/flags.py), each the env
# form of a flag; NVIDIA_DRIVER_ROOT(_HOST) tell the nvml backend where the host's
# driver (libnvidia-ml.so.1) is mounted.
PLUGIN_FLAG_ENV = {
    "NODE_NAME",
    "DRIVER_NAME",
    "CDI_ROOT",
    "KUBELET_REGISTRAR_DIRECTORY_PATH",
    "KUBELET_PLUGINS_DIRECTORY_PATH",
    "POD_UID",
    "NVML_BACKEND",
    "MOCK_FLEET",
    "GPU_PARTITIONS",
    "MPS_DAEMONS",
    "MPS_ESCAPE_TAINT",
    "MPS_STRICT_PARTITIONS",
    "GPU_MEMORY_LIMITS",
    "POD_NAMESPACE",
    "MPS_DAEMON_IMAGE",
    "MPS_SHM_SIZE",
    "MIG_STRATEGY",
    "MIG_PROFILES",
    "XID_TAINT_EFFECT",
    "ADDITIONAL_XIDS_TO_IGNORE",
    "FATAL_XIDS",
    "RECOVERY_ACTION_POLL_INTERVAL",
    "PERMANENT_ERRORS",
    "DEVICE_STATUS",
    "HTTP_PORT",
    "LOG_FORMAT",
    "V",
}
DRIVER_ROOT_ENV = {"NVIDIA_DRIVER_ROOT", "NVIDIA_DRIVER_ROOT_HOST", "NVIDIA_CDI_HOOK_PATH"}

Doc = dict[str, Any]


def find_helm() -> str:
    """The pinned helm, or fail naming how to install it."""
    if os.environ.get("HELM"):
        return os.environ["HELM"]
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "install-helm.sh"), "path"],
        capture_output=True,
        text=True,
        check=False,
    )
    path = proc.stdout.strip()
    if proc.returncode == 0 and path and os.access(path, os.X_OK):
        return path
    pytest.fail(
        f"helm is not installed (expected {path or 'the pinned helm'}): run "
        "hack/install-helm.sh (builds HELM_VERSION from hack/versions.env) "
        "or set HELM=/path/to/helm"
    )


def helm_template(
    *args: str,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [find_helm(), "template", release, str(CHART), "--namespace", namespace, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"helm template {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def render(*args: str, release: str = RELEASE, namespace: str = NAMESPACE) -> list[Doc]:
    out = helm_template(*args, release=release, namespace=namespace).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def one(docs: list[Doc], kind: str, component: str | None = None) -> Doc:
    found = [
        d
        for d in docs
        if d["kind"] == kind
        and (
            component is None
            or d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component
        )
    ]
    assert len(found) == 1, f"expected one {kind} ({component}), got {len(found)}"
    return found[0]


@pytest.fixture(scope="module")
def default_docs() -> list[Doc]:
    return render()


@pytest.fixture(scope="module")
def mock_docs() -> list[Doc]:
    return render("--values", str(MOCK_VALUES))


def plugin_container(docs: list[Doc]) -> Doc:
    ds = one(docs, "DaemonSet")
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container["env"]}


# --- lint, schema, validation -------------------------------------------------------


@pytest.mark.parametrize("values", [[], ["--values", str(MOCK_VALUES)]], ids=["default", "mock"])
def test_helm_lint_is_clean(values: list[str]) -> None:
    proc = subprocess.run(
        [find_helm(), "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *values],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "nvml.backend=fake"], "backend"),
        (["--set", "bogus=1"], "bogus"),
        (["--set", "kubeletPlugin.health.xidTaintEffect=Evict"], "xidTaintEffect"),
        (["--set", "kubeletPlugin.health.fatalXids=79;48"], "fatalXids"),
        (["--set", "webhook.failurePolicy=Maybe"], "failurePolicy"),
        (["--set", "kubeletPlugin.migStrategy=mixed"], "migStrategy"),
        (["--set", "nvml.mockFleet=gpus: []"], "mockFleet"),
    ],
)
def test_bad_values_are_rejected(args: list[str], message: str) -> None:
    proc = helm_template(*args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_default_namespace_is_refused() -> None:
    proc = helm_template(namespace="default", check=False)
    assert proc.returncode != 0
    assert "'default' namespace" in proc.stderr
    render("--set", "allowDefaultNamespace=true", namespace="default")


def test_objects(default_docs: list[Doc], mock_docs: list[Doc]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in default_docs)
    assert kinds == sorted(
        [
            ("ClusterRole", "gpu-dra-driver-kubeletplugin"),
            ("ClusterRoleBinding", "gpu-dra-driver-kubeletplugin"),
            ("DaemonSet", "gpu-dra-driver-kubeletplugin"),
            ("Deployment", "gpu-dra-driver-webhook"),
            ("DeviceClass", "gpu.example.com"),
            ("DeviceClass", "mig.gpu.example.com"),
            ("DeviceClass", "partition.gpu.example.com"),
            ("NetworkPolicy", "gpu-dra-driver-kubeletplugin"),
            ("PodDisruptionBudget", "gpu-dra-driver-webhook"),
            # MPS off: what removes daemons left from before (test_chart_mps.py).
            ("Role", "gpu-dra-driver-mps-daemons"),
            ("RoleBinding", "gpu-dra-driver-mps-daemons"),
            ("Secret", "gpu-dra-driver-webhook-tls"),
            ("Service", "gpu-dra-driver-kubeletplugin-metrics"),
            ("Service", "gpu-dra-driver-webhook"),
            ("ServiceAccount", "gpu-dra-driver-kubeletplugin"),
            ("ServiceAccount", "gpu-dra-driver-webhook"),
            ("ValidatingAdmissionPolicy", "gpu-dra-driver-events"),
            ("ValidatingAdmissionPolicy", "gpu-dra-driver-mps-daemons"),
            ("ValidatingAdmissionPolicy", "gpu-dra-driver-resourceslices"),
            ("ValidatingAdmissionPolicyBinding", "gpu-dra-driver-events"),
            ("ValidatingAdmissionPolicyBinding", "gpu-dra-driver-mps-daemons"),
            ("ValidatingAdmissionPolicyBinding", "gpu-dra-driver-resourceslices"),
            ("ValidatingWebhookConfiguration", "gpu-dra-driver-webhook"),
        ]
    )
    for d in default_docs + mock_docs:
        if d["kind"] not in {
            "ClusterRole",
            "ClusterRoleBinding",
            "DeviceClass",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
            "ValidatingWebhookConfiguration",
        }:
            assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]


# --- RBAC -----------------------------------------------------------------------------

# Exactly the plugin's API requests (driver/kube/publisher.py, claims.py, events.py);
# test_rbac_rules_are_the_requests_the_plugin_sends derives them from the code.
BASE_RULES = [
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceslices"],
        "verbs": ["list", "watch", "create", "update", "delete"],
    },
    {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
]
STATUS_RULES = [
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceclaims/status"],
        "verbs": ["patch"],
    },
    {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceclaims/driver"],
        "verbs": ["associated-node:patch"],
        "resourceNames": [DRIVER],
    },
]


def _sorted_rules(rules: list[Doc]) -> list[str]:
    return sorted(yaml.safe_dump(r, sort_keys=True) for r in rules)


def test_rbac_is_exactly_least_privilege(default_docs: list[Doc]) -> None:
    role = one(default_docs, "ClusterRole")
    assert _sorted_rules(role["rules"]) == _sorted_rules(BASE_RULES)


def test_rbac_device_status_adds_claim_status_rules(mock_docs: list[Doc]) -> None:
    # values-mock.yaml enables deviceStatus.
    role = one(mock_docs, "ClusterRole")
    assert _sorted_rules(role["rules"]) == _sorted_rules(BASE_RULES + STATUS_RULES)
    other = render("--set", "deviceStatus=true", "--set", "driverName=gpu.acme.io")
    rules = one(other, "ClusterRole")["rules"]
    assert [r["resourceNames"] for r in rules if "resourceNames" in r] == [["gpu.acme.io"]]


@pytest.mark.parametrize("version", ["1.34.0", "v1.35.9", "1.35.3-gke.1200"])
def test_device_status_is_refused_below_1_36(version: str) -> None:
    """Below 1.36 `resourceclaims/status: patch` is not narrowed to the plugin's node
    (no DRAResourceClaimGranularStatusAuthorization): every plugin pod could change the
    status of every claim in the cluster."""
    proc = helm_template("--set", "deviceStatus=true", "--kube-version", version, check=False)
    assert proc.returncode != 0
    assert "deviceStatus=true needs Kubernetes >= 1.36" in proc.stderr, proc.stderr
    assert version.lstrip("v") in proc.stderr, proc.stderr
    # Without device status the chart still installs there.
    role = one(render("--kube-version", version), "ClusterRole")
    assert _sorted_rules(role["rules"]) == _sorted_rules(BASE_RULES)


@pytest.mark.parametrize("version", ["1.36.0", "v1.36.0-rc.1", "1.37.1"])
def test_device_status_from_1_36(version: str) -> None:
    docs = render("--set", "deviceStatus=true", "--kube-version", version)
    role = one(docs, "ClusterRole")
    assert _sorted_rules(role["rules"]) == _sorted_rules(BASE_RULES + STATUS_RULES)


_API_PATH = re.compile(
    r"^/(?:api/v1|apis/(?P<group>[^/]+)/[^/]+)(?:/namespaces/[^/]+)?"
    r"/(?P<resource>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
_WRITE_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}

Permission = tuple[str, str, str]  # API group, resource[/subresource], verb


def _permission(method: str, path: str, *, watch: bool = False) -> Permission:
    """The RBAC attributes of a request, as the API server's request-info resolver
    derives them (GET on a collection is list, with watch=true watch)."""
    m = _API_PATH.match(path)
    assert m, path
    resource = m["resource"] + (f"/{m['sub']}" if m["sub"] else "")
    if method == "GET":
        verb = "watch" if watch else ("get" if m["name"] else "list")
    else:
        verb = _WRITE_VERBS[method]
    return m["group"] or "", resource, verb


def _granted(rules: list[Doc]) -> set[Permission]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def _api_call_sites() -> set[tuple[str, str]]:
    """(module, function) of every `*api.request(...)` / `*api.watch(...)` call the
    plugin can make. driver/cli/ is left out: the operator's `gpu-dra` runs with the
    operator's kubeconfig, not the plugin's ServiceAccount."""
    import ast

    sites: set[tuple[str, str]] = set()
    for path in sorted((REPO / "driver").rglob("*.py")):
        if "proto" in path.parts or path.is_relative_to(REPO / "driver" / "cli"):
            continue
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        tree = ast.parse(path.read_text())

        def visit(node: ast.AST, scope: list[str], module: str = module) -> None:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                scope = [*scope, node.name]
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("request", "watch")
                and isinstance(node.func.value, ast.Attribute | ast.Name)
                and (getattr(node.func.value, "attr", None) or getattr(node.func.value, "id", ""))
                .lstrip("_")
                .endswith("api")
            ):
                sites.add((module, ".".join(scope)))
            for child in ast.iter_child_nodes(node):
                visit(child, scope)

        visit(tree, [])
    return sites


def _mps_daemon_requests() -> tuple[set[Permission], set[tuple[str, str]]]:
    """The requests of KubeDaemons (driver/kube/mps_daemons.py), every path: a daemon
    started, adopted, observed, stopped, one that never gets ready, a conflict on
    create, the sweep's listing and removal."""
    import sys
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from driver.kube.mps_daemons import KubeDaemons
    from driver.kube.mps_manifest import DaemonPodSettings
    from driver.nvml.mps import DaemonDirs
    from driver.state.journal.mps_record import MpsRecord
    from tests.unit.test_mps_kube import IMAGE, NAMESPACE, FakeCluster

    used: set[Permission] = set()
    sites: set[tuple[str, str]] = set()

    class Recording(FakeCluster):
        def request(self, method: str, path: str, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code
            sites.add((sys._getframe(1).f_globals["__name__"], caller.co_qualname))
            used.add(_permission(method, path))
            return super().request(method, path, **kwargs)

    cluster = Recording()
    with TemporaryDirectory() as tmp:
        root = Path(tmp)
        settings = DaemonPodSettings(NAMESPACE, "node-a", DRIVER, IMAGE, root, root)
        daemons = KubeDaemons(cluster, settings, clock=lambda: cluster.now, sleep=cluster.tick)
        dirs = DaemonDirs(root / "pipe", root / "log", root / "shm")
        record = daemons.start(MpsRecord("GPU-x", "a-gpu-0", 50), dirs)
        assert daemons.alive(record)
        assert daemons.observe(record) == record
        daemons.start(MpsRecord("GPU-x", "a-gpu-0", 50), dirs)  # conflict: replaced
        daemons.stop(record, dirs)
        left = daemons.start(MpsRecord("GPU-x", "b-gpu-0", 50), dirs)
        assert daemons.leftovers([]) == [left.deployment]
        daemons.remove(left.deployment)
        cluster.ready_after = None
        with pytest.raises(Exception, match="did not get ready"):
            daemons.start(MpsRecord("GPU-x", "b-gpu-0"), dirs)
    return used, sites


def test_rbac_rules_are_the_requests_the_plugin_sends() -> None:
    """Runs every code path that calls the API (publisher: list, watch, create, update,
    delete, node lookup; claim read; permanent-failure Event and device-status apply;
    the Node's Events)
    against a recording fake, and derives the RBAC the requests need: the ClusterRole
    grants exactly that, no verb more or less."""
    import sys
    import threading

    from driver.errors import invalid_config
    from driver.kube.claims import ApiClaimReader, ClaimFailureReporter
    from driver.kube.kube_events import NodeEvent, NodeEvents
    from driver.kube.publisher import SlicePublisher
    from driver.plugin.options.node_overrides import node_mig_profiles
    from tests.unit.test_publisher import NODE, FakeApi, device, spec

    class RecordingApi(FakeApi):
        def __init__(self) -> None:
            super().__init__()
            self.used: set[Permission] = set()
            self.sites: set[tuple[str, str]] = set()
            self.watching = threading.Event()

        def _record(self, method: str, path: str, *, watch: bool = False) -> None:
            caller = sys._getframe(2).f_code
            self.sites.add((sys._getframe(2).f_globals["__name__"], caller.co_qualname))
            self.used.add(_permission(method, path.split("?", 1)[0], watch=watch))

        def request(self, method: str, path: str, **kwargs: Any) -> Any:
            self._record(method, path)
            if path.startswith("/apis/resource.k8s.io/v1/namespaces/"):
                return {"metadata": {"name": "claim", "namespace": "ns", "uid": "u"}}
            if "/events" in path:
                return {}
            return super().request(method, path, **kwargs)

        def watch(self, path: str, **_: Any) -> Any:
            self._record("GET", path, watch=True)
            self.watching.set()
            yield from ()

    recording = RecordingApi()
    api: Any = recording  # duck-typed KubeApi
    desired = [spec(device("gpu-0")), spec(device("gpu-1"))]
    pub = SlicePublisher(api, driver=DRIVER, node_name=NODE, desired=lambda: desired)
    pub.start()
    try:
        assert recording.watching.wait(10), "the slice watch never started"
        assert pub.wait_synced(pub.trigger(), 10)
    finally:
        pub.stop()
    desired[:] = [spec(device("gpu-0", attributes={"index": {"int": 1}}))]
    pub.reconcile()  # one slice changed (update), one surplus (delete)

    claim = ApiClaimReader(api).get("ns", "claim")
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [{"driver": DRIVER, "pool": NODE, "device": "gpu-0", "request": "r"}]
            }
        }
    }
    reporter = ClaimFailureReporter(api, driver=DRIVER, node_name=NODE, device_status=True)
    reporter.permanent_failure(claim, invalid_config("bad"))

    node_events = NodeEvents(api, driver=DRIVER, node_name=NODE)  # a GPU tainted: Node Event
    node_events.start()
    node_events.post(NodeEvent("GpuTainted", "gpu-0: Xid 79"))
    node_events.stop()
    node_mig_profiles(api, NODE, DRIVER)  # the Node's per-node MIG profile label

    mps_used, mps_sites = _mps_daemon_requests()
    sites = recording.sites | mps_sites
    assert sites >= _api_call_sites(), "an API call site this test does not exercise"
    # The MPS daemons' requests (kubeletPlugin.mps.enabled): exactly the Role's rules;
    # MPS off, all but create (daemons left from before are deleted, none created).
    mps_role = [d for d in render("--set", "kubeletPlugin.mps.enabled=true") if d["kind"] == "Role"]
    assert _granted(mps_role[0]["rules"]) == mps_used
    off_role = [d for d in render() if d["kind"] == "Role"]
    assert _granted(off_role[0]["rules"]) == mps_used - {("apps", "deployments", "create")}
    used = set(recording.used)
    if ("resource.k8s.io", "resourceclaims/status", "patch") in used:
        # 1.36+: the API server authorizes changed status.devices entries again as
        # associated-node:<verb> on resourceclaims/driver (named after the driver).
        used.add(("resource.k8s.io", "resourceclaims/driver", "associated-node:patch"))
    assert _granted(BASE_RULES + STATUS_RULES) == used
    status_only = {p for p in used if p[1].startswith("resourceclaims/")}
    assert _granted(BASE_RULES) == used - status_only


def test_no_wildcards_or_secrets_in_rbac(default_docs: list[Doc], mock_docs: list[Doc]) -> None:
    for docs in (default_docs, mock_docs):
        for rule in one(docs, "ClusterRole")["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], rule
            assert "secrets" not in rule["resources"]
            assert "pods" not in rule["resources"]


def test_binding_targets_plugin_service_account(default_docs: list[Doc]) -> None:
    binding = one(default_docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == one(default_docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpu-dra-driver-kubeletplugin", "namespace": NAMESPACE}
    ]
    pod = one(default_docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpu-dra-driver-kubeletplugin"


# --- ValidatingAdmissionPolicy ---------------------------------------------------------


def test_policy_limits_plugin_to_own_node(default_docs: list[Doc]) -> None:
    (vap,) = [
        d
        for d in default_docs
        if d["kind"] == "ValidatingAdmissionPolicy"
        and d["metadata"]["name"] == "gpu-dra-driver-resourceslices"
    ]
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (cond,) = spec["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:gpu-dra-driver-kubeletplugin" in cond["expression"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    assert "oldObject" in variables["slice"] and "DELETE" in variables["slice"]
    exprs = [v["expression"] for v in spec["validations"]]
    assert "variables.userNodeName == variables.objectNodeName" in exprs
    assert any(f"'{DRIVER}'" in e or f'"{DRIVER}"' in e for e in exprs)
    # The pool too (pool squatting; tests/integration/test_chart.py applies it for real).
    assert any("variables.slice.spec.pool.name == variables.userNodeName" in e for e in exprs)
    bindings = [d["spec"] for d in default_docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]} in bindings


# --- DaemonSet -----------------------------------------------------------------------


def test_plugin_host_paths(default_docs: list[Doc], mock_docs: list[Doc]) -> None:
    for docs, nvml in ((default_docs, True), (mock_docs, False)):
        pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        expected = {
            "plugins-registry": "/var/lib/kubelet/plugins_registry",
            "plugin-data": f"/var/lib/kubelet/plugins/{DRIVER}",
            "cdi": "/var/run/cdi",
        }
        if nvml:
            # nvidiaDriverRoot "/": the driver's host directories, never the whole root
            # (tests/unit/test_chart_driver_mounts.py).
            assert "/" not in host_paths.values()
            host_paths = {k: v for k, v in host_paths.items() if not k.startswith("driver-root-")}
        assert host_paths == expected
        mounts = {m["name"]: m for m in plugin_container(docs)["volumeMounts"]}
        # Sockets and CDI specs: identical paths inside the container and on the host.
        for name in ("plugins-registry", "plugin-data", "cdi"):
            assert mounts[name]["mountPath"] == host_paths[name]
        if nvml:
            assert mounts["driver-root-0"]["readOnly"] is True
            assert mounts["driver-root-0"]["mountPath"] == "/driver-root/usr"


def test_driver_root_mount_holds_every_library_dir() -> None:
    """The whole driver root is mounted at NVIDIA_DRIVER_ROOT, so every directory the
    nvml backend searches for libnvidia-ml lies under the mount."""
    from driver.nvml.library import LIBRARY_DIRS

    docs = render("--set", "nvml.driverRoot=/run/nvidia/driver/")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "driver-root"]
    assert volume["hostPath"] == {"path": "/run/nvidia/driver", "type": "DirectoryOrCreate"}
    env = env_of(plugin_container(docs))
    assert env["NVIDIA_DRIVER_ROOT_HOST"]["value"] == "/run/nvidia/driver"  # cleaned
    root = env["NVIDIA_DRIVER_ROOT"]["value"]
    (mount,) = [m for m in plugin_container(docs)["volumeMounts"] if m["name"] == "driver-root"]
    assert mount["mountPath"] == root
    for directory in LIBRARY_DIRS:
        assert f"{root}/{directory}".startswith(mount["mountPath"] + "/"), directory


def init_containers(docs: list[Doc]) -> list[Doc]:
    containers: list[Doc] = one(docs, "DaemonSet")["spec"]["template"]["spec"].get(
        "initContainers", []
    )
    return containers


@pytest.mark.parametrize(
    ("root", "parent", "in_parent"),
    [
        ("/home/kubernetes/bin/nvidia", "/home/kubernetes/bin", "/driver-root-parent/nvidia"),
        ("/run/nvidia/driver", "/run/nvidia", "/driver-root-parent/driver"),
        ("/run/nvidia/driver/", "/run/nvidia", "/driver-root-parent/driver"),
        ("/driver", "/", "/driver-root-parent/driver"),
    ],
    ids=["gke", "gpu-operator", "trailing-slash", "top-level"],
)
def test_driver_root_volumes_and_wait_for_driver(root: str, parent: str, in_parent: str) -> None:
    """A dedicated driver root and its parent (HostToContainer, DirectoryOrCreate: the
    GPU operator mounts its driver there after the plugin pod started), the init
    container that waits for the driver through the parent, and the plugin's env. ("/"
    is never mounted whole: tests/unit/test_chart_driver_mounts.py.)"""
    docs = render("--set", f"nvidiaDriverRoot={root}")
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    host_root = root.rstrip("/") or "/"
    assert volumes["driver-root"]["hostPath"] == {"path": host_root, "type": "DirectoryOrCreate"}
    assert volumes["driver-root-parent"]["hostPath"] == {
        "path": parent,
        "type": "DirectoryOrCreate",
    }
    plugin = plugin_container(docs)
    (mount,) = [m for m in plugin["volumeMounts"] if m["name"] == "driver-root"]
    assert mount == {
        "name": "driver-root",
        "mountPath": "/driver-root",
        "readOnly": True,
        "mountPropagation": "HostToContainer",
    }
    env = env_of(plugin)
    assert env["NVIDIA_DRIVER_ROOT"]["value"] == "/driver-root"
    assert env["NVIDIA_DRIVER_ROOT_HOST"]["value"] == host_root
    assert "NVIDIA_CDI_HOOK_PATH" not in env  # default: the plugin installs its own copy

    (init,) = init_containers(docs)
    assert init["name"] == "wait-for-driver"
    assert init["image"] == plugin["image"]
    assert init["command"][:2] == ["/bin/sh", "-c"]
    assert init["volumeMounts"] == [
        {
            "name": "driver-root-parent",
            "mountPath": "/driver-root-parent",
            "readOnly": True,
            "mountPropagation": "HostToContainer",
        }
    ]
    init_env = {e["name"]: e["value"] for e in init["env"]}
    assert init_env == {"NVIDIA_DRIVER_ROOT_HOST": host_root, "DRIVER_ROOT": in_parent}
    sc = init["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]} and "privileged" not in sc


def _run_wait_for_driver(script: str, driver_root: Path, host_root: str) -> tuple[int, str]:
    """Runs the init container's script over `driver_root` until its first line, then
    SIGTERMs it (it exits 0 on TERM, without waiting out its sleep)."""
    env = {
        "PATH": os.environ["PATH"],
        "DRIVER_ROOT": str(driver_root),
        "NVIDIA_DRIVER_ROOT_HOST": host_root,
    }
    with subprocess.Popen(
        ["/bin/sh", "-c", script], env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.terminate()
        return proc.wait(timeout=5), line


def test_wait_for_driver_script(tmp_path: Path) -> None:
    """The rendered script logs what it waits for and where, and leaves once
    libnvidia-ml.so.1 (usually a symlink) is in one of the library directories."""
    (init,) = init_containers(render("--set", "nvidiaDriverRoot=/home/kubernetes/bin/nvidia"))
    script = init["command"][2]
    root = tmp_path / "nvidia"
    root.mkdir()
    rc, line = _run_wait_for_driver(script, root, "/home/kubernetes/bin/nvidia")
    assert rc == 0
    assert "waiting for the NVIDIA driver: no libnvidia-ml.so.1" in line
    assert "nvidiaDriverRoot=/home/kubernetes/bin/nvidia" in line
    (root / "lib64").mkdir()
    (root / "lib64" / "libnvidia-ml.so.580.95.05").write_bytes(b"")
    (root / "lib64" / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.95.05")
    proc = subprocess.run(
        ["/bin/sh", "-c", script],
        env={
            "PATH": os.environ["PATH"],
            "DRIVER_ROOT": str(root),
            "NVIDIA_DRIVER_ROOT_HOST": "/home/kubernetes/bin/nvidia",
        },
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "found the NVIDIA driver: /home/kubernetes/bin/nvidia/lib64/libnvidia-ml.so.1 on the host\n"
    )


def test_nvidia_cdi_hook_path_value() -> None:
    docs = render(
        "--set", "nvidiaDriverRoot=/run/nvidia/driver",
        "--set", "nvidiaCDIHookPath=/usr/local/nvidia/toolkit/nvidia-cdi-hook",
    )  # fmt: skip
    env = env_of(plugin_container(docs))
    assert env["NVIDIA_CDI_HOOK_PATH"]["value"] == "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    for bad in ("usr/bin/nvidia-cdi-hook", "/usr/bin/"):
        proc = helm_template("--set", f"nvidiaCDIHookPath={bad}", check=False)
        assert proc.returncode != 0
        assert "/nvidiaCDIHookPath" in proc.stderr, proc.stderr


def test_mock_backend_has_no_driver_mounts(mock_docs: list[Doc]) -> None:
    pod = one(mock_docs, "DaemonSet")["spec"]["template"]["spec"]
    assert init_containers(mock_docs) == []
    assert not {v["name"] for v in pod["volumes"]} & {"driver-root", "driver-root-parent"}
    mounts = {m["name"] for m in plugin_container(mock_docs)["volumeMounts"]}
    assert not mounts & {"driver-root", "driver-root-parent"}
    assert not set(env_of(plugin_container(mock_docs))) & DRIVER_ROOT_ENV


def test_mock_backend_with_a_fake_driver_installation() -> None:
    """A named driver root on the mock: its CDI specs become complete (the e2e tier's
    fake driver installation); nothing waits for it, no parent is mounted."""
    docs = render(
        "--values", str(MOCK_VALUES),
        "--set", "nvidiaDriverRoot=/var/lib/gpu-dra-fake-driver",
        "--set", "nvidiaCDIHookPath=/usr/bin/nvidia-cdi-hook",
    )  # fmt: skip
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert init_containers(docs) == []
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["driver-root"]["hostPath"]["path"] == "/var/lib/gpu-dra-fake-driver"
    assert "driver-root-parent" not in volumes
    env = env_of(plugin_container(docs))
    assert env["NVIDIA_DRIVER_ROOT"]["value"] == "/driver-root"
    assert env["NVIDIA_DRIVER_ROOT_HOST"]["value"] == "/var/lib/gpu-dra-fake-driver"
    assert env["NVIDIA_CDI_HOOK_PATH"]["value"] == "/usr/bin/nvidia-cdi-hook"


CLI_STATE_DIR_ENV = "GPU_DRA_STATE_DIR"


def test_plugin_env_matches_plugin_flags(default_docs: list[Doc], mock_docs: list[Doc]) -> None:
    for docs, extra in ((default_docs, DRIVER_ROOT_ENV), (mock_docs, set())):
        env = env_of(plugin_container(docs))
        unread = set(env) - PLUGIN_FLAG_ENV - extra - {CLI_STATE_DIR_ENV}
        assert unread == set(), "env var the plugin does not read"
        # `kubectl exec <pod> -- gpu-dra mock ...` finds the plugin's data dir from it.
        assert env[CLI_STATE_DIR_ENV]["value"] == f"/var/lib/kubelet/plugins/{DRIVER}"
        assert set(env) >= PLUGIN_FLAG_ENV - {"MOCK_FLEET"}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        for e in env.values():
            if "value" in e:
                assert isinstance(e["value"], str), e
    assert env_of(plugin_container(default_docs))["NVML_BACKEND"]["value"] == "nvml"
    assert env_of(plugin_container(mock_docs))["NVML_BACKEND"]["value"] == "mock"


def test_plugin_env_parses_with_plugin_flags(
    mock_docs: list[Doc], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's env, fed to the plugin's own flag parser, gives the intended options."""
    from driver.plugin.options.flags import parse_options

    for name in PLUGIN_FLAG_ENV | DRIVER_ROOT_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, e in env_of(plugin_container(mock_docs)).items():
        monkeypatch.setenv(name, e.get("value", "node-a" if name == "NODE_NAME" else "uid-1"))
    opts = parse_options([])
    assert opts.node_name == "node-a"
    assert opts.pod_uid == "uid-1"
    assert opts.driver_name == DRIVER
    assert opts.nvml_backend == "mock"
    assert str(opts.cdi_root) == "/var/run/cdi"
    assert str(opts.data_dir) == f"/var/lib/kubelet/plugins/{DRIVER}"
    assert opts.device_status is True
    assert opts.http_port == 8080
    assert opts.xid_taint_effect == "NoSchedule"
    assert opts.permanent_errors == "invalid-config,device-failed"
    assert opts.verbosity == 4
    assert opts.mig_strategy == "auto"


def test_mig_strategy_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """kubeletPlugin.migStrategy: the plugin's --mig-strategy choices, passed as MIG_STRATEGY."""
    from driver.devices.device_types import MigStrategy
    from driver.plugin.options.flags import parse_options
    from driver.plugin.options.setting_values import MIG_STRATEGIES

    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["kubeletPlugin"]["properties"]["migStrategy"]["enum"]
    assert enum == list(MIG_STRATEGIES) == [s.value for s in MigStrategy]
    assert (
        yaml.safe_load((CHART / "values.yaml").read_text())["kubeletPlugin"]["migStrategy"]
        == MigStrategy.AUTO.value
    )
    for strategy in MIG_STRATEGIES:
        docs = render("--set", f"kubeletPlugin.migStrategy={strategy}")
        value = env_of(plugin_container(docs))["MIG_STRATEGY"]["value"]
        assert value == strategy
        monkeypatch.setenv("MIG_STRATEGY", value)
        assert parse_options(["--node-name=n"]).mig_strategy == strategy


def test_plugin_probe_ports_and_rolling_update(default_docs: list[Doc]) -> None:
    ds = one(default_docs, "DaemonSet")
    c = plugin_container(default_docs)
    port = int(env_of(c)["HTTP_PORT"]["value"])
    assert c["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["command"] == ["gpu-kubelet-plugin"]
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    svc = next(d for d in default_docs if d["metadata"]["name"].endswith("kubeletplugin-metrics"))
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    surge0 = render(
        "--set",
        "kubeletPlugin.updateStrategy.rollingUpdate.maxSurge=0",
        "--set",
        "kubeletPlugin.updateStrategy.rollingUpdate.maxUnavailable=1",
    )
    assert one(surge0, "DaemonSet")["spec"]["updateStrategy"]["rollingUpdate"] == {
        "maxSurge": 0,
        "maxUnavailable": 1,
    }


def test_plugin_privileged_only_for_real_nvml(
    default_docs: list[Doc], mock_docs: list[Doc]
) -> None:
    real = plugin_container(default_docs)["securityContext"]
    assert real["privileged"] is True and real["runAsUser"] == 0
    assert real["readOnlyRootFilesystem"] is True
    mock = plugin_container(mock_docs)["securityContext"]
    assert mock["privileged"] is False
    assert mock["runAsUser"] == 0  # sockets in root-owned host directories
    assert mock["allowPrivilegeEscalation"] is False
    assert mock["readOnlyRootFilesystem"] is True
    assert mock["capabilities"] == {"drop": ["ALL"]}


def test_metrics_network_policy(default_docs: list[Doc], mock_docs: list[Doc]) -> None:
    # On by default: /metrics names the node's GPUs and claims. No peers: only the node
    # (the kubelet's probes; NetworkPolicy always admits the pod's own node) gets in.
    for docs in (default_docs, mock_docs):
        assert one(docs, "NetworkPolicy", "kubeletplugin")["spec"]["ingress"] == []
    opted_out = render("--set", "kubeletPlugin.metrics.networkPolicy.enabled=false")
    assert not [d for d in opted_out if d["metadata"]["name"].endswith("-kubeletplugin")
                and d["kind"] == "NetworkPolicy"]  # fmt: skip
    peers = [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        }
    ]
    docs = render(
        "--set",
        "kubeletPlugin.metrics.networkPolicy.enabled=true",
        "--set-json",
        f"kubeletPlugin.metrics.networkPolicy.from={json.dumps(peers)}",
        "--set",
        "kubeletPlugin.httpPort=9400",
    )
    policy = one(docs, "NetworkPolicy", "kubeletplugin")
    assert policy["metadata"]["namespace"] == NAMESPACE
    pod_labels = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector["app.kubernetes.io/component"] == "kubeletplugin"
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [
        {"from": peers, "ports": [{"protocol": "TCP", "port": 9400}]}
    ]
    assert "egress" not in policy["spec"]  # the plugin must reach the API server
    # No peers: isolated; only the node (the kubelet's liveness probe) gets in.
    closed = render("--set", "kubeletPlugin.metrics.networkPolicy.enabled=true")
    assert one(closed, "NetworkPolicy")["spec"]["ingress"] == []
    proc = helm_template(
        "--set",
        "kubeletPlugin.metrics.networkPolicy.enabled=true",
        "--set-json",
        "kubeletPlugin.metrics.networkPolicy.from=[{}]",
        check=False,
    )
    assert proc.returncode != 0 and "networkPolicy" in proc.stderr  # {} would admit all


def test_plugin_writes_only_to_volumes(default_docs: list[Doc], mock_docs: list[Doc]) -> None:
    """Read-only root filesystem for both backends: every writable mount is a host path
    of the plugin's or the /tmp emptyDir."""
    for docs in (default_docs, mock_docs):
        c = plugin_container(docs)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert writable == {
            "/var/lib/kubelet/plugins_registry",
            f"/var/lib/kubelet/plugins/{DRIVER}",
            "/var/run/cdi",
            "/tmp",
        }
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {}}


GPU_TERM = {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}


def _affinity(docs: list[Doc]) -> Doc | None:
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    affinity: Doc | None = pod.get("affinity")
    return affinity


def test_plugin_runs_on_gpu_nodes_by_default(default_docs: list[Doc]) -> None:
    affinity = _affinity(default_docs)
    assert affinity is not None
    # The GPU operator's label first, then NFD's (tests/unit/test_chart_install.py).
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms[0] == {"matchExpressions": [GPU_TERM]}
    other = render(
        "--set",
        "kubeletPlugin.gpuNodeLabel.key=feature.node.kubernetes.io/pci-10de.present",
        "--set",
        "kubeletPlugin.gpuNodeLabel.nfdPciLabels=false",
    )
    affinity = _affinity(other)
    assert affinity is not None
    (term,) = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert term["matchExpressions"] == [
        {"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In", "values": ["true"]}
    ]
    assert _affinity(render("--set", "kubeletPlugin.gpuNodeLabel.key=")) is None
    proc = helm_template("--set", "kubeletPlugin.gpuNodeLabel.key=not a label", check=False)
    assert proc.returncode != 0 and "gpuNodeLabel" in proc.stderr


def test_gpu_node_label_is_added_to_a_user_affinity() -> None:
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]},
                ]
            }
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    }
    docs = render(
        "--set-json",
        f"kubeletPlugin.affinity={json.dumps(user)}",
        "--set",
        "kubeletPlugin.gpuNodeLabel.nfdPciLabels=false",
    )
    affinity = _affinity(docs)
    assert affinity is not None
    terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    # Terms are ORed: each one must require the GPU label.
    assert terms == [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}, GPU_TERM]},
        {
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}],
            "matchExpressions": [GPU_TERM],
        },
    ]
    assert affinity["podAntiAffinity"] == user["podAntiAffinity"]


def test_mock_and_demo_installs_run_on_every_node(mock_docs: list[Doc]) -> None:
    """GPU-less clusters (kind, tests/integration, the demo and tests/e2e, which layer
    demo/values-demo.yaml on values-mock.yaml) have no GPU label on their nodes."""
    demo = render("--values", str(MOCK_VALUES), "--values", str(REPO / "demo" / "values-demo.yaml"))
    for docs in (mock_docs, demo):
        pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
        assert "affinity" not in pod and "nodeSelector" not in pod


def test_mock_fleet_is_mounted_from_a_configmap() -> None:
    docs = render("--values", str(MOCK_VALUES), "--set", "nvml.mockFleet=gpus: []")
    cm = one(docs, "ConfigMap")
    assert cm["data"]["mock-fleet.yaml"].strip() == "gpus: []"
    env = env_of(plugin_container(docs))
    assert env["MOCK_FLEET"]["value"] == "/etc/gpu-dra-driver/mock-fleet.yaml"
    mounts = {m["mountPath"] for m in plugin_container(docs)["volumeMounts"]}
    assert "/etc/gpu-dra-driver" in mounts


# --- webhook --------------------------------------------------------------------------


def test_webhook_configuration(default_docs: list[Doc]) -> None:
    vwc = one(default_docs, "ValidatingWebhookConfiguration")
    (hook,) = vwc["webhooks"]
    (rule,) = hook["rules"]
    assert rule["apiGroups"] == ["resource.k8s.io"]
    assert set(rule["apiVersions"]) == {"v1", "v1beta1", "v1beta2"}
    assert set(rule["resources"]) == {"resourceclaims", "resourceclaimtemplates"}
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    svc = hook["clientConfig"]["service"]
    assert svc["path"] == "/validate-resource-claim-parameters"
    assert svc["name"] == "gpu-dra-driver-webhook" and svc["namespace"] == NAMESPACE
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    assert f"'{DRIVER}'" in hook["matchConditions"][0]["expression"]
    ca = base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
    assert ca.startswith("-----BEGIN CERTIFICATE-----")
    secret = one(default_docs, "Secret")
    assert secret["type"] == "kubernetes.io/tls"
    assert base64.b64decode(secret["data"]["ca.crt"]).decode() == ca
    assert "PRIVATE KEY" in base64.b64decode(secret["data"]["tls.key"]).decode()

    dep = one(default_docs, "Deployment", "webhook")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["gpu-dra-webhook"]
    assert c["args"] == [
        "--tls-cert-file=/cert/tls.crt",
        "--tls-private-key-file=/cert/tls.key",
        "--port=8443",
        f"--driver-name={DRIVER}",
    ]
    assert c["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": "webhook",
        "scheme": "HTTPS",
    }
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    assert pod["volumes"] == [
        {"name": "cert", "secret": {"secretName": secret["metadata"]["name"]}}
    ]


def _cert_end(pem: bytes) -> dt.datetime:
    out = subprocess.run(
        ["openssl", "x509", "-noout", "-enddate"], input=pem, capture_output=True, check=True
    ).stdout.decode()
    end = dt.datetime.strptime(out.strip().removeprefix("notAfter="), "%b %d %H:%M:%S %Y %Z")
    return end.replace(tzinfo=dt.UTC)


def test_webhook_certificate_is_short_lived_and_its_expiry_recorded(
    default_docs: list[Doc],
) -> None:
    secret = one(default_docs, "Secret")
    recorded = dt.datetime.strptime(
        secret["metadata"]["annotations"]["gpu-dra-driver/not-after"], "%Y-%m-%dT%H:%M:%S%z"
    )
    year = dt.datetime.now(dt.UTC) + dt.timedelta(days=365)
    assert abs(recorded - year) < dt.timedelta(minutes=5)
    for key in ("ca.crt", "tls.crt"):
        end = _cert_end(base64.b64decode(secret["data"][key]))
        assert dt.timedelta(0) <= end - recorded < dt.timedelta(minutes=1), key
    week = render(
        "--set", "webhook.tls.certValidityDays=7", "--set", "webhook.tls.renewBeforeDays=2"
    )
    end = _cert_end(base64.b64decode(one(week, "Secret")["data"]["tls.crt"]))
    assert abs(end - (dt.datetime.now(dt.UTC) + dt.timedelta(days=7))) < dt.timedelta(minutes=5)
    proc = helm_template("--set", "webhook.tls.renewBeforeDays=365", check=False)
    assert proc.returncode != 0 and "renewBeforeDays must be less than" in proc.stderr


def test_webhook_is_highly_available_by_default(default_docs: list[Doc]) -> None:
    dep = one(default_docs, "Deployment", "webhook")
    assert dep["spec"]["replicas"] == 2
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    (spread,) = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"  # never leaves one pending
    assert spread["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    pdb = one(default_docs, "PodDisruptionBudget", "webhook")
    assert pdb["metadata"]["namespace"] == NAMESPACE
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert selector["app.kubernetes.io/component"] == "webhook"
    assert (
        one(default_docs, "ValidatingWebhookConfiguration")["webhooks"][0]["failurePolicy"]
        == "Fail"
    )
    single = render(
        "--set",
        "webhook.replicas=1",
        "--set",
        "webhook.podDisruptionBudget.enabled=false",
        "--set",
        "webhook.spreadAcrossNodes=false",
    )
    assert not [d for d in single if d["kind"] == "PodDisruptionBudget"]
    spec = one(single, "Deployment", "webhook")["spec"]
    assert spec["replicas"] == 1 and "topologySpreadConstraints" not in spec["template"]["spec"]


def test_webhook_cert_manager_variant() -> None:
    docs = render("--set", "webhook.certManager.enabled=true")
    kinds = {d["kind"] for d in docs}
    assert "Secret" not in kinds
    vwc = one(docs, "ValidatingWebhookConfiguration")
    assert vwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/gpu-dra-driver-webhook-cert"
    )
    assert "caBundle" not in vwc["webhooks"][0]["clientConfig"]
    issuers = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Issuer"}
    certs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert set(certs) == {"gpu-dra-driver-webhook-cert", "gpu-dra-driver-webhook-ca"}
    # self-signed root -> CA certificate -> CA issuer -> serving certificate
    assert issuers["gpu-dra-driver-webhook-selfsigned"] == {"selfSigned": {}}
    ca = certs["gpu-dra-driver-webhook-ca"]
    assert ca["isCA"] is True
    assert ca["issuerRef"] == {"kind": "Issuer", "name": "gpu-dra-driver-webhook-selfsigned"}
    assert ca["duration"] == f"{1825 * 24}h" and ca["renewBefore"] == "720h"
    assert issuers["gpu-dra-driver-webhook-issuer"] == {"ca": {"secretName": ca["secretName"]}}
    cert = certs["gpu-dra-driver-webhook-cert"]
    assert cert["issuerRef"] == {"kind": "Issuer", "name": "gpu-dra-driver-webhook-issuer"}
    assert cert["secretName"] == "gpu-dra-driver-webhook-tls"  # what the pods mount
    assert f"gpu-dra-driver-webhook.{NAMESPACE}.svc" in cert["dnsNames"]
    assert cert["duration"] == f"{365 * 24}h" and cert["renewBefore"] == f"{90 * 24}h"
    assert cert["privateKey"] == {"rotationPolicy": "Always"}

    own = render(
        "--set",
        "webhook.certManager.enabled=true",
        "--set-json",
        'webhook.certManager.issuerRef={"kind":"ClusterIssuer","name":"corp-ca"}',
    )
    assert not [d for d in own if d["kind"] == "Issuer"]
    (cert_doc,) = [d for d in own if d["kind"] == "Certificate"]
    assert cert_doc["spec"]["issuerRef"] == {"kind": "ClusterIssuer", "name": "corp-ca"}


def test_webhook_disabled() -> None:
    docs = render("--set", "webhook.enabled=false")
    assert not [d for d in docs if "webhook" in d["metadata"]["name"]]


# --- values hygiene -------------------------------------------------------------------

SECRET_KEY = re.compile(r"(password|passwd|token|secret|credential|apikey|privatekey)", re.I)


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict) and node:
        out: list[tuple[str, Any]] = []
        for k, v in node.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, node)]


@pytest.mark.parametrize("path", [CHART / "values.yaml", MOCK_VALUES], ids=lambda p: p.name)
def test_no_secrets_in_values(path: Path) -> None:
    text = path.read_text()
    assert "BEGIN" not in text and "PRIVATE KEY" not in text
    for key, value in _leaves(yaml.safe_load(text)):
        if SECRET_KEY.search(key.split(".")[-1]):
            # Only references to Secrets by name are allowed, never their content.
            assert (key, value) in (("imagePullSecrets", []), ("webhook.tls.existingSecret", "")), (
                key,
                value,
            )


def documented_values() -> tuple[list[str], list[str]]:
    """Paths of values.yaml keys with a '# --' comment, and leaves not covered by one."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, str, bool]] = []  # indent, key, documented (itself or ancestor)
    documented, undocumented = [], []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z]\w*):(.*)$", line)
        if not m:
            continue
        indent, key, rest = len(m.group(1)), m.group(2), m.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and "# --" not in lines[j]:
            j -= 1
        has_doc = j >= 0 and lines[j].strip().startswith("# --")
        covered = has_doc or any(d for _, _, d in stack)
        path = ".".join([k for _, k, _ in stack] + [key])
        if has_doc:
            documented.append(path)
        elif rest and not covered:
            undocumented.append(path)
        stack.append((indent, key, covered))
    return documented, undocumented


def test_every_value_is_documented() -> None:
    documented, undocumented = documented_values()
    assert undocumented == [], "values without a '# --' comment in values.yaml"
    assert len(documented) > 60
    readme = (CHART / "README.md").read_text()
    missing = [k for k in documented if f"`{k}`" not in readme]
    assert missing == [], "values missing from the chart README"
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False


def test_kind_config_uses_the_local_cluster_feature_gates() -> None:
    gates = subprocess.run(
        [
            "bash",
            "-c",
            'HACK_DIR=hack; source hack/lib/common.sh; echo "$FEATURE_GATES|$RUNTIME_CONFIG"',
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    feature_gates, runtime_config = gates.split("|")
    proc = subprocess.run(
        ["bash", str(REPO / "hack" / "kind" / "create-cluster.sh"), "--print-config"],
        capture_output=True,
        text=True,
        check=True,
    )
    config = yaml.safe_load(proc.stdout)
    assert config["featureGates"] == {
        k: v == "true" for k, v in (item.split("=") for item in feature_gates.split(","))
    }
    assert config["runtimeConfig"] == dict(item.split("=") for item in runtime_config.split(","))
    assert "enable_cdi = true" in config["containerdConfigPatches"][0]
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker"]


def test_allow_multiple_allocations_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """kubeletPlugin.allowMultipleAllocations -> GPU_ALLOW_MULTIPLE_ALLOCATIONS, off by default."""
    from driver.plugin.options.flags import parse_options

    assert "GPU_ALLOW_MULTIPLE_ALLOCATIONS" not in env_of(plugin_container(render()))
    monkeypatch.delenv("GPU_ALLOW_MULTIPLE_ALLOCATIONS", raising=False)
    assert parse_options(["--node-name=n"]).allow_multiple_allocations is False
    docs = render("--set", "kubeletPlugin.allowMultipleAllocations=true")
    value = env_of(plugin_container(docs))["GPU_ALLOW_MULTIPLE_ALLOCATIONS"]["value"]
    monkeypatch.setenv("GPU_ALLOW_MULTIPLE_ALLOCATIONS", value)
    assert parse_options(["--node-name=n"]).allow_multiple_allocations is True
    bad = helm_template("--set", "kubeletPlugin.allowMultipleAllocations=maybe", check=False)
    assert bad.returncode != 0 and "allowMultipleAllocations" in bad.stderr
