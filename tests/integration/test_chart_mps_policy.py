"""The chart's MPS daemon Role and policy (kubeletPlugin.mps.enabled) against a real
API server: the plugin's service account, with a token bound to a pod on node A, may
create and delete the daemon Deployments KubeDaemons builds for node A in its own
namespace, and is denied a Deployment for node B, one without the MPS label, one of
another image, the deletion of node B's daemon, and any Deployment in another
namespace.

The policy pins the whole Deployment the driver renders (driver/kube/mps_manifest.py):
its command and argument shape, its exact volumes and mounts, no service account token,
no host network, one replica, no finalizer, the security context, one container and
nothing else, on CREATE and UPDATE. Every body admitted here is the plugin's own: its
options are parsed from the env of the chart's rendered DaemonSet, `mps_daemons`
(driver/plugin/mps_setup.py) makes its KubeDaemons, and `plan_mps`/`daemon_dirs`
(driver/state/mps/claim_daemons.py) the record and directories prepare gives
`daemon_deployment`.
Each denial test changes one thing in such a body. The chart's Role grants no
`update`; a test Role adds it here, so that UPDATE reaches the policy.

No kubelet runs here: the readiness wait is tested against a fake
(tests/unit/test_mps_kube.py); the delete-and-wait path runs for real (no pod is
ever created without a controller manager).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, cast
from unittest import mock

import pytest
import yaml

from driver.cdi.claim_specs import cdi_device_name
from driver.kube.api import ApiError, KubeApi
from driver.kube.mps_daemons import KubeDaemons
from driver.kube.mps_manifest import daemon_deployment
from driver.nvml.backend import NvmlBackend
from driver.nvml.mock.fleet import mock_gpu_uuid
from driver.nvml.mps import DaemonDirs, MpsControl
from driver.plugin.mps_setup import mps_daemons, mps_others
from driver.plugin.options.flags import PluginOptions, parse_options
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.claim_daemons import ClaimMps
from driver.state.mps.daemon_plan import plan_mps
from driver.state.mps.daemons import daemon_dirs
from driver.state.mps.prepared_limits import MpsLimits
from tests.conftest import REPO
from tests.integration.test_chart import PluginIdentity, _dump, _template, _token_kubeconfig
from tests.unit.test_chart_render import DRIVER, MOCK_VALUES

Doc = dict[str, Any]
RELEASE = "gpu-dra-driver"
POLICY = "gpu-dra-driver-mps-daemons"
IMAGE_TAG = "9.9.9-mps"
GIB = 1 << 30
MPS = ("--set", "kubeletPlugin.mps.enabled=true", "--set", f"image.tag={IMAGE_TAG}")
# The limits a prepare can give a daemon: its command's optional arguments.
LIMITS = {
    "threads": MpsLimits(50),
    "memory": MpsLimits(None, GIB),
    "both": MpsLimits(100, 80 * GIB),
    "none": MpsLimits(),
}
# Chart configurations whose daemons differ (driver root, its host path, data directory).
CONFIGS = {
    "driver-root-dir": ("mps-root", "--set", "nvidiaDriverRoot=/run/nvidia/driver/"),
    "mock": ("mps-mock", "--values", str(MOCK_VALUES)),
    # The demo's and tests/e2e/test_mps.py's values.
    "demo": (
        "mps-demo",
        "--values",
        str(MOCK_VALUES),
        "--values",
        str(REPO / "demo" / "values-demo.yaml"),
        "--values",
        str(REPO / "demo" / "mps" / "values.yaml"),
    ),
    "mock-root": (
        "mps-mockroot",
        "--values",
        str(MOCK_VALUES),
        "--set",
        "kubeletPlugin.kubeletPluginsDirectoryPath=/var/lib/kubelet/plugins-x/",
        "--set-json",
        'kubeletPlugin.containers.plugin.extraEnv=[{"name":"MOCK_DRIVER_ROOT",'
        '"value":"/var/lib/gpu-dra-mock/root/"}]',
    ),
}
TEST_ROLE = "mps-policy-test-update"


class _Backend:
    """`NvmlBackend.mps` on a node with the driver's nvidia-cuda-mps-control installed:
    real NVML's control runs from the driver root it is given (--nvidia-driver-root),
    the mock's from its own root (driver/nvml/mock/mock_backend.py). Nothing is installed
    here, so the binary is not looked for."""

    def __init__(self, options: PluginOptions) -> None:
        self.options = options

    def mps(self, driver_root: Path | str) -> MpsControl:
        return MpsControl(
            self.options.plugin_mock_driver_root if self.options.mock else driver_root
        )


def plugin_options(daemonset: Doc, node: str, ns: str) -> PluginOptions:
    """The plugin's options as its pod on `node` parses them from the rendered env."""
    (container,) = [
        c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "plugin"
    ]
    fields = {"spec.nodeName": node, "metadata.namespace": ns, "metadata.uid": str(uuid.uuid4())}
    env = {
        e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in container["env"]
        # A file of the pod's ConfigMap volume, read at parsing; nothing of the daemon's.
        if e["name"] != "MOCK_FLEET"
    }
    with mock.patch.dict(os.environ, env, clear=True):
        return parse_options([])


class Setup:
    def __init__(
        self, plugin: PluginIdentity, ns: str, node_a: str, node_b: str, daemonset: Doc, policy: str
    ) -> None:
        self.plugin, self.ns, self.node_a, self.node_b = plugin, ns, node_a, node_b
        self.daemonset, self.policy = daemonset, policy
        self.api = KubeApi.from_kubeconfig(str(plugin.kubeconfig))
        self.image = self.daemons(node_a).settings.image

    @property
    def path(self) -> str:
        return f"/apis/apps/v1/namespaces/{self.ns}/deployments"

    def options(self, node: str) -> PluginOptions:
        return plugin_options(self.daemonset, node, self.ns)

    def daemons(self, node: str) -> KubeDaemons:
        """The plugin's KubeDaemons on `node`, made by its own setup code (with MPS
        off, the one it keeps to remove daemons left from before)."""
        options = self.options(node)
        backend = cast(NvmlBackend, _Backend(options))
        daemons = mps_daemons(options, backend, self.api)
        if daemons is None:
            others = mps_others(options, backend, self.api)
            (daemons,) = [d for d in others if d.kind == "kubernetes"]
        assert isinstance(daemons, KubeDaemons)
        return daemons

    def planned(
        self, node: str, limits: MpsLimits, device: str, *, shared: bool = False
    ) -> tuple[MpsRecord, DaemonDirs]:
        """The record and directories a prepare on `node` gives the daemon of a claim's
        `device` (driver/state/plan.py, ClaimMps); `shared`: its GPU's shared server (a
        strict partition's, driver/state/mps/shared.py)."""
        options = self.options(node)
        site = ClaimMps(self.daemons(node), options.data_dir / "mps").site
        cdi_name = cdi_device_name(str(uuid.uuid4()), device, None)
        plan = plan_mps(
            limits,
            gpu_uuid=mock_gpu_uuid(node, 0),
            cdi_name=cdi_name,
            site=site,
            server=limits if shared else None,
        )
        assert plan is not None and site is not None
        return plan.record, daemon_dirs(site.root, plan.record)

    def deployment(
        self,
        node: str,
        limits: MpsLimits = LIMITS["threads"],
        *,
        device: str = "gpu-0",
        image: str | None = None,
        ns: str | None = None,
        shared: bool = False,
    ) -> Doc:
        """The Deployment KubeDaemons.start posts for a claim's device on `node`."""
        settings = self.daemons(node).settings
        settings = replace(
            settings, image=image or settings.image, namespace=ns or settings.namespace
        )
        return daemon_deployment(settings, *self.planned(node, limits, device, shared=shared))

    def create(self, body: Doc, *, dry_run: bool = False) -> tuple[bool, str]:
        args = ("create", "--dry-run=server") if dry_run else ("create",)
        proc = self.plugin.kubectl(*args, "-f", "-", input=json.dumps(body))
        return proc.returncode == 0, proc.stderr

    def update(self, name: str, change: Callable[[Doc], None]) -> tuple[bool, str]:
        """The plugin's UPDATE (PUT) of Deployment `name` as the API server holds it,
        changed by `change`; again where the Deployment controller wrote it meanwhile."""
        path = f"{self.path}/{name}"
        for _ in range(40):
            current = self.api.request("GET", path)
            change(current)
            try:
                self.api.request("PUT", path, body=current)
            except ApiError as err:
                if err.conflict:
                    time.sleep(0.25)
                    continue
                return False, str(err)
            return True, ""
        raise AssertionError(f"{path}: conflicts on every update")


def _install(
    cluster: Any, release: str, *values: str, mps_on: bool = True
) -> tuple[Setup, Callable[[], None]]:
    """The chart's service account, Role and MPS policy of `release` in a namespace of
    its own, two nodes, the plugin's pod on node A and a kubectl with its pod-bound
    token; a test Role that adds `update` to the chart's. `mps_on` False: the chart
    with MPS off (its Role grants no create)."""
    suffix = uuid.uuid4().hex[:6]
    ns = f"chart-mps-{suffix}"
    node_a, node_b = f"mps-node-a-{suffix}", f"mps-node-b-{suffix}"
    fullname = release if "gpu-dra-driver" in release else f"{release}-gpu-dra-driver"
    policy = f"{fullname}-mps-daemons"
    docs = [d for d in yaml.safe_load_all(_template(release, ns, *MPS, *values)) if d]
    wanted = {
        "ServiceAccount", "Role", "RoleBinding",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    }  # fmt: skip
    policy_docs = [
        d
        for d in docs
        if d["kind"] in wanted
        and (
            d["kind"] in ("ServiceAccount", "Role", "RoleBinding")
            or policy == d["metadata"]["name"]
        )
    ]
    assert {d["kind"] for d in policy_docs} == wanted
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    sa = next(d["metadata"]["name"] for d in policy_docs if d["kind"] == "ServiceAccount")
    test_role: list[Doc] = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": TEST_ROLE, "namespace": ns},
            "rules": [{"apiGroups": ["apps"], "resources": ["deployments"],
                       "verbs": ["update", "patch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": TEST_ROLE, "namespace": ns},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": TEST_ROLE},
        },
    ]  # fmt: skip
    nodes = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}} for n in (node_a, node_b)
    ]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugin-on-a", "namespace": ns},
        "spec": {"nodeName": node_a, "serviceAccountName": sa,
                 "containers": [{"name": "plugin", "image": "plugin:1"}]},
    }  # fmt: skip
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("create", "namespace", f"{ns}-other")
    cluster.kubectl("apply", "-f", "-", input=_dump(policy_docs + test_role + nodes))
    cluster.kubectl("apply", "-f", "-", input=_dump([pod]))
    token = cluster.kubectl(
        "create", "token", sa, "--namespace", ns, "--bound-object-kind", "Pod",
        "--bound-object-name", "plugin-on-a", "--duration", "30m",
    ).stdout.strip()  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="gpu-dra-mps-"))
    _token_kubeconfig(cluster, token, tmp / "plugin.kubeconfig")
    setup = Setup(PluginIdentity(cluster, tmp / "plugin.kubeconfig"), ns, node_a, node_b,
                  daemonset, policy)  # fmt: skip

    def denied() -> bool:
        body = setup.deployment(node_b)
        proc = setup.plugin.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(body))
        if proc.returncode != 0 and policy in proc.stderr:
            return True
        if proc.returncode != 0 and "forbidden" in proc.stderr and "cannot create" in proc.stderr:
            return False  # the RoleBinding is not in effect yet
        if proc.returncode == 0:
            return False  # the policy is not in effect yet
        raise AssertionError(f"exit {proc.returncode}: {proc.stdout} {proc.stderr}")

    def can_delete() -> bool:
        proc = setup.plugin.kubectl("auth", "can-i", "delete", "deployments", "-n", ns)
        return proc.stdout.strip() == "yes"

    if mps_on:
        cluster.wait_for(denied, timeout=60, what="the MPS policy to deny node B's daemon")
    else:
        cluster.wait_for(can_delete, timeout=60, what="the chart Role's delete grant")

    def can_update() -> bool:
        proc = setup.plugin.kubectl("auth", "can-i", "update", "deployments", "-n", ns)
        return proc.stdout.strip() == "yes"

    cluster.wait_for(can_update, timeout=60, what="the test Role's update grant")

    def cleanup() -> None:
        cluster.kubectl(
            "delete", "-f", "-", "--ignore-not-found", "--wait=false",
            input=_dump(policy_docs + nodes), check=False,
        )  # fmt: skip
        for name in (ns, f"{ns}-other"):
            cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
        shutil.rmtree(tmp, ignore_errors=True)

    return setup, cleanup


@pytest.fixture(scope="module")
def mps_setup(cluster: Any) -> Iterator[Setup]:
    setup, cleanup = _install(cluster, RELEASE)
    try:
        yield setup
    finally:
        cleanup()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def config_setup(cluster: Any, request: pytest.FixtureRequest) -> Iterator[Setup]:
    setup, cleanup = _install(cluster, *CONFIGS[request.param])
    try:
        yield setup
    finally:
        cleanup()


class TerminatingPodsFinisher(threading.Thread):
    """What the node's kubelet does for a deleted pod bound to it, on a cluster without
    one: confirms its termination (deletes it with grace period 0), so the pods the
    Deployment controller made go when the Deployment does."""

    def __init__(self, cluster: Any, namespace: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.namespace = cluster, namespace
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            listed = self.cluster.kubectl(
                "get", "pods", "-n", self.namespace, "-o", "json", check=False
            )
            for pod in json.loads(listed.stdout or "{}").get("items", []):
                if pod["metadata"].get("deletionTimestamp"):
                    self.cluster.kubectl(
                        "delete", "pod", "-n", self.namespace, pod["metadata"]["name"],
                        "--grace-period=0", "--force", "--wait=false", check=False,
                    )  # fmt: skip


# -- what the driver renders is admitted ---------------------------------------------


def test_the_plugins_daemon_code_creates_updates_and_deletes_its_nodes_deployment(
    cluster: Any, mps_setup: Setup
) -> None:
    s = mps_setup
    kubelet = TerminatingPodsFinisher(cluster, s.ns)
    kubelet.start()
    daemons = s.daemons(s.node_a)
    daemons.gone_timeout = 60
    record, dirs = s.planned(s.node_a, MpsLimits(50, GIB), "gpu-1")
    body = daemon_deployment(daemons.settings, record, dirs)
    created = s.api.request("POST", s.path, body=body)
    name = created["metadata"]["name"]
    stamped = replace(record, deployment=name, deployment_uid=created["metadata"]["uid"])
    try:
        assert daemons.alive(stamped)
        # UPDATE to the same rendering, over what the API server stored (with the
        # Deployment controller's revision annotation).
        again = daemon_deployment(daemons.settings, record, dirs)

        def rendered(current: Doc) -> None:
            current["metadata"]["labels"] = again["metadata"]["labels"]
            current["metadata"]["annotations"].update(again["metadata"]["annotations"])
            current["spec"] = again["spec"]

        ok, err = s.update(name, rendered)
        assert ok, err
        daemons.stop(stamped, dirs)
    finally:
        kubelet.done.set()
    assert not daemons.alive(stamped)


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
@pytest.mark.parametrize("limits", sorted(LIMITS))
def test_every_command_shape_the_driver_renders_is_admitted(
    mps_setup: Setup, limits: str, shared: bool
) -> None:
    """A device's own daemon, and a GPU's shared one (`--multi-user` after the head)."""
    s = mps_setup
    body = s.deployment(s.node_a, LIMITS[limits], shared=shared)
    assert ("--multi-user" in _container(body)["command"]) is shared
    ok, err = s.create(body, dry_run=True)
    assert ok, err


def test_the_admitted_daemon_is_guaranteed_and_node_critical(mps_setup: Setup) -> None:
    """What the API server stores of the plugin's Deployment (quantities in their
    canonical form) keeps requests equal to limits and the priority class."""
    s = mps_setup
    body = s.deployment(s.node_a, device="qos")
    created = s.api.request("POST", s.path, body=body)
    try:
        pod = created["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == "system-node-critical"
        resources = pod["containers"][0]["resources"]
        assert resources == _container(body)["resources"]
        assert resources["requests"] == resources["limits"]
    finally:
        s.plugin.kubectl("delete", "deployment", created["metadata"]["name"], "-n", s.ns,
                         "--wait=false")  # fmt: skip


def test_the_driver_renders_what_each_chart_configuration_admits(config_setup: Setup) -> None:
    s = config_setup
    for limits in LIMITS.values():
        body = s.deployment(s.node_a, limits)
        ok, err = s.create(body, dry_run=True)
        assert ok, err
    # ... and is still denied another node's and a changed one.
    ok, err = s.create(s.deployment(s.node_b), dry_run=True)
    assert not ok and s.policy in err, err
    body = s.deployment(s.node_a)
    body["spec"]["template"]["spec"]["hostNetwork"] = True
    ok, err = s.create(body, dry_run=True)
    assert not ok and "spec.template.spec.hostNetwork" in err, err


def _type_warnings(cluster: Any, name: str) -> list[Doc]:
    def checked() -> Doc | None:
        got = json.loads(
            cluster.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout
        )
        status = got.get("status") or {}
        done = status.get("observedGeneration") == got["metadata"]["generation"]
        return status if done and "typeChecking" in status else None

    status = cluster.wait_for(checked, timeout=60, what=f"{name}'s type checking")
    return list(status["typeChecking"].get("expressionWarnings") or [])


def test_the_policy_type_checks_without_warnings(cluster: Any, mps_setup: Setup) -> None:
    """The API server type-checks a policy's validations against the Deployment's schema
    (not its variables, and only where matchConstraints names no wildcard): the chart's
    gets no warning, and a copy with a misspelt field in one more validation gets one,
    so the check did run."""
    assert _type_warnings(cluster, POLICY) == []
    policy = json.loads(
        cluster.kubectl("get", "validatingadmissionpolicy", POLICY, "-o", "json").stdout
    )
    probe = {
        "apiVersion": policy["apiVersion"],
        "kind": policy["kind"],
        "metadata": {"name": f"{POLICY}-typecheck-probe"},
        "spec": copy.deepcopy(policy["spec"]),
    }
    probe["spec"]["validations"].append({"expression": "object.spec.replicaz == 1"})
    cluster.kubectl("create", "-f", "-", input=json.dumps(probe))
    try:
        (warning,) = _type_warnings(cluster, probe["metadata"]["name"])
        assert "undefined field 'replicaz'" in warning["warning"], warning
    finally:
        cluster.kubectl("delete", "validatingadmissionpolicy", probe["metadata"]["name"])


# -- one hole each: denied, naming the field -------------------------------------------


def _container(body: Doc) -> Doc:
    return cast(Doc, body["spec"]["template"]["spec"]["containers"][0])


def _pod(body: Doc) -> Doc:
    return cast(Doc, body["spec"]["template"]["spec"])


def _set_command(body: Doc) -> None:
    _container(body)["command"] = ["sh", "-c", "chroot /driver-root sh -c 'id > /tmp/pwned'"]


def _set_program(body: Doc) -> None:
    _container(body)["command"][0] = "python3"


def _set_argument(body: Doc) -> None:
    command = _container(body)["command"]
    (i,) = [i for i, a in enumerate(command) if a.startswith("--pipe-directory=")]
    command[i] = "--pipe-directory=/etc"


def _add_argument(body: Doc) -> None:
    _container(body)["command"].append("--log-directory=/etc")


def _multi_user_late(body: Doc) -> None:
    _container(body)["command"].append("--multi-user")


def _multi_user_twice(body: Doc) -> None:
    _container(body)["command"][6:6] = ["--multi-user", "--multi-user"]


def _set_args(body: Doc) -> None:
    _container(body)["args"] = ["--pipe-directory=/etc"]


def _add_host_root(body: Doc) -> None:
    _pod(body)["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    _container(body)["volumeMounts"].append({"name": "host", "mountPath": "/host"})


def _move_host_path(body: Doc) -> None:
    (pipe,) = [v for v in _pod(body)["volumes"] if v["name"] == "pipe"]
    pipe["hostPath"]["path"] = "/var/lib/kubelet/pki"


def _add_image_volume(body: Doc) -> None:
    _pod(body)["volumes"].append({"name": "tools", "image": {"reference": "evil.example/t:1"}})
    _container(body)["volumeMounts"].append({"name": "tools", "mountPath": "/tools"})


def _add_projected_token(body: Doc) -> None:
    source = {"serviceAccountToken": {"path": "token", "audience": "https://kubernetes"}}
    _pod(body)["volumes"].append({"name": "token", "projected": {"sources": [source]}})
    _container(body)["volumeMounts"].append({"name": "token", "mountPath": "/token"})


def _writable_driver_root(body: Doc) -> None:
    (mount,) = [m for m in _container(body)["volumeMounts"] if m["name"] == "driver-root"]
    del mount["readOnly"]


def _host_network(body: Doc) -> None:
    _pod(body)["hostNetwork"] = True


def _host_ipc(body: Doc) -> None:
    _pod(body)["hostIPC"] = True


def _service_account(body: Doc) -> None:
    _pod(body)["serviceAccountName"] = "gpu-dra-driver-kubeletplugin"


def _token_automounted(body: Doc) -> None:
    _pod(body)["automountServiceAccountToken"] = True


def _token_default(body: Doc) -> None:
    del _pod(body)["automountServiceAccountToken"]


def _replicas(body: Doc) -> None:
    body["spec"]["replicas"] = 5000


def _finalizer(body: Doc) -> None:
    body["metadata"]["finalizers"] = ["example.com/never-removed"]


def _extra_container(body: Doc) -> None:
    sidecar = copy.deepcopy(_container(body))
    sidecar["name"] = "sidecar"
    _pod(body)["containers"].append(sidecar)


def _init_container(body: Doc) -> None:
    image = _container(body)["image"]
    _pod(body)["initContainers"] = [{"name": "init", "image": image, "command": ["sh"]}]


def _container_security_context(body: Doc) -> None:
    _container(body)["securityContext"]["runAsUser"] = 1000


def _pod_security_context(body: Doc) -> None:
    _pod(body)["securityContext"] = {"sysctls": [{"name": "kernel.shm_rmid_forced", "value": "1"}]}


def _env(body: Doc) -> None:
    _container(body)["env"] = [{"name": "LD_PRELOAD", "value": "/driver-root/tmp/x.so"}]


def _post_start(body: Doc) -> None:
    _container(body)["lifecycle"] = {"postStart": {"exec": {"command": ["sh", "-c", "id"]}}}


def _liveness_exec(body: Doc) -> None:
    _container(body)["livenessProbe"] = {"exec": {"command": ["sh", "-c", "id"]}}


def _startup_probe(body: Doc) -> None:
    _container(body)["startupProbe"]["exec"]["command"] = ["sh", "-c", "id"]


def _priority(body: Doc) -> None:
    _pod(body)["priorityClassName"] = "system-cluster-critical"


def _no_priority(body: Doc) -> None:
    del _pod(body)["priorityClassName"]


def _priority_value(body: Doc) -> None:
    _pod(body)["priority"] = 2000001000


def _more_memory(body: Doc) -> None:
    resources = _container(body)["resources"]
    resources["limits"]["memory"] = resources["requests"]["memory"] = "64Gi"


def _more_cpu(body: Doc) -> None:
    resources = _container(body)["resources"]
    resources["limits"]["cpu"] = resources["requests"]["cpu"] = "16"


def _burstable(body: Doc) -> None:
    del _container(body)["resources"]["limits"]


def _best_effort(body: Doc) -> None:
    del _container(body)["resources"]


def _extended_resource(body: Doc) -> None:
    for kind in ("requests", "limits"):
        _container(body)["resources"][kind]["nvidia.com/gpu"] = "1"


def _template_annotation(body: Doc) -> None:
    body["spec"]["template"]["metadata"]["annotations"] = {"example.com/x": "y"}


def _tolerations(body: Doc) -> None:
    _pod(body)["tolerations"].append({"key": "x", "operator": "Exists", "effect": "NoSchedule"})


HOLES: dict[str, tuple[Callable[[Doc], None], str]] = {
    # The brief's list (issue 44, item 7).
    "command": (_set_command, "spec.template.spec.containers[0].command"),
    "command-program": (_set_program, "spec.template.spec.containers[0].command"),
    "command-argument": (_set_argument, "spec.template.spec.containers[0].command"),
    "command-extra-argument": (_add_argument, "spec.template.spec.containers[0].command"),
    "args": (_set_args, "spec.template.spec.containers[0].args"),
    "multi-user-after-limits": (_multi_user_late, "spec.template.spec.containers[0].command"),
    "multi-user-twice": (_multi_user_twice, "spec.template.spec.containers[0].command"),
    "hostpath-root": (_add_host_root, "spec.template.spec.volumes"),
    "image-volume": (_add_image_volume, "spec.template.spec.volumes"),
    "host-network": (_host_network, "spec.template.spec.hostNetwork"),
    "service-account": (_service_account, "spec.template.spec.serviceAccountName"),
    "token-automounted": (_token_automounted, "spec.template.spec.automountServiceAccountToken"),
    "replicas": (_replicas, "spec.replicas"),
    "finalizer": (_finalizer, "metadata.finalizers"),
    "extra-container": (_extra_container, "spec.template.spec.containers"),
    "init-container": (_init_container, "spec.template.spec.initContainers"),
    # More of the same kind.
    "hostpath-moved": (_move_host_path, "spec.template.spec.volumes"),
    "projected-token": (_add_projected_token, "spec.template.spec.volumes"),
    "driver-root-writable": (
        _writable_driver_root,
        "spec.template.spec.containers[0].volumeMounts",
    ),
    "token-default": (_token_default, "spec.template.spec.automountServiceAccountToken"),
    "host-ipc": (_host_ipc, "spec.template.spec.hostIPC"),
    "container-security-context": (
        _container_security_context,
        "spec.template.spec.containers[0].securityContext",
    ),
    "pod-security-context": (_pod_security_context, "spec.template.spec.securityContext"),
    "env": (_env, "spec.template.spec.containers[0].env"),
    "post-start": (_post_start, "spec.template.spec.containers[0].lifecycle"),
    "liveness-exec": (_liveness_exec, "spec.template.spec.containers[0].livenessProbe"),
    "startup-probe": (_startup_probe, "spec.template.spec.containers[0].startupProbe"),
    "priority-class": (_priority, "spec.template.spec.priorityClassName"),
    "priority-class-removed": (_no_priority, "spec.template.spec.priorityClassName"),
    "priority-value": (_priority_value, "spec.template.spec.priority"),
    "resources-memory": (_more_memory, "spec.template.spec.containers[0].resources"),
    "resources-cpu": (_more_cpu, "spec.template.spec.containers[0].resources"),
    "resources-burstable": (_burstable, "spec.template.spec.containers[0].resources"),
    "resources-removed": (_best_effort, "spec.template.spec.containers[0].resources"),
    "resources-extended": (_extended_resource, "spec.template.spec.containers[0].resources"),
    "template-annotation": (_template_annotation, "spec.template.metadata"),
    "tolerations": (_tolerations, "spec.template.spec.tolerations"),
}


@pytest.mark.parametrize("hole", list(HOLES))
def test_a_daemon_changed_from_what_the_driver_renders_is_denied(
    mps_setup: Setup, hole: str
) -> None:
    s = mps_setup
    change, field = HOLES[hole]
    body = s.deployment(s.node_a)
    change(body)
    ok, err = s.create(body, dry_run=True)
    assert not ok, f"{hole}: a daemon Deployment with it was admitted"
    assert s.policy in err and field in err, err


@pytest.mark.parametrize("hole", ["replicas", "host-network", "command", "hostpath-root",
                                  "service-account", "finalizer", "init-container"])  # fmt: skip
def test_an_update_that_changes_the_daemon_is_denied(mps_setup: Setup, hole: str) -> None:
    s = mps_setup
    body = s.deployment(s.node_a, device=f"upd-{hole}")
    created = s.api.request("POST", s.path, body=body)
    name = created["metadata"]["name"]
    try:
        change, field = HOLES[hole]
        ok, err = s.update(name, change)
        assert not ok, f"{hole}: an update with it was admitted"
        assert s.policy in err and field in err, err
    finally:
        s.plugin.kubectl("delete", "deployment", name, "-n", s.ns, "--wait=false")


def test_an_update_may_not_take_over_another_nodes_daemon(cluster: Any, mps_setup: Setup) -> None:
    s = mps_setup
    theirs = s.deployment(s.node_b, device="takeover")
    cluster.kubectl("create", "-f", "-", input=json.dumps(theirs))  # as the admin
    name = theirs["metadata"]["name"]
    mine = s.deployment(s.node_a, device="takeover")

    def take_over(current: Doc) -> None:
        current["metadata"]["annotations"] = mine["metadata"]["annotations"]
        current["spec"]["template"]["spec"] = mine["spec"]["template"]["spec"]

    try:
        ok, err = s.update(name, take_over)
        assert not ok and s.policy in err and "the Deployment it replaces" in err, err
    finally:
        cluster.kubectl("delete", "deployment", name, "-n", s.ns, "--wait=false", check=False)


# -- MPS off: removing what is left, creating nothing ----------------------------------


def test_with_mps_off_the_plugin_removes_its_nodes_daemons_and_creates_none(
    cluster: Any,
) -> None:
    """Claims prepared while MPS was on keep their daemons; with it off the plugin's
    unprepare and sweep delete them (driver/state/mps/orphans.py), on its own node
    only, and it can start none."""
    s, cleanup = _install(
        cluster, "mps-off", "--set", "kubeletPlugin.mps.enabled=false", mps_on=False
    )
    kubelet = TerminatingPodsFinisher(cluster, s.ns)
    kubelet.start()
    try:
        mine = s.deployment(s.node_a, device="off-a")
        theirs = s.deployment(s.node_b, device="off-b")
        for body in (mine, theirs):  # as the admin: what the plugins made while MPS was on
            cluster.kubectl("create", "-f", "-", input=json.dumps(body))
        ok, err = s.create(s.deployment(s.node_a, device="off-new"), dry_run=True)
        assert not ok and "cannot create" in err, err
        daemons = s.daemons(s.node_a)
        daemons.gone_timeout = 60
        assert daemons.leftovers([]) == [mine["metadata"]["name"]]  # its own node's only
        daemons.remove(mine["metadata"]["name"])
        assert daemons.leftovers([]) == []
        name = theirs["metadata"]["name"]
        proc = s.plugin.kubectl("delete", "deployment", name, "-n", s.ns, "--wait=false")
        assert proc.returncode != 0 and s.policy in proc.stderr, proc.stderr
    finally:
        kubelet.done.set()
        cleanup()


# -- node, label, image, namespace ---------------------------------------------------


def test_a_daemon_for_another_node_is_denied(mps_setup: Setup) -> None:
    s = mps_setup
    ok, err = s.create(s.deployment(s.node_b))
    assert not ok, "a daemon Deployment for node B was allowed"
    assert POLICY in err and f"not '{s.node_b}'" in err, err


def test_a_deployment_without_the_label_or_of_another_image_is_denied(mps_setup: Setup) -> None:
    s = mps_setup
    unlabelled = s.deployment(s.node_a)
    del unlabelled["metadata"]["labels"][f"{DRIVER}/mps-daemon"]
    ok, err = s.create(unlabelled)
    assert not ok and POLICY in err and "labelled" in err, err
    ok, err = s.create(s.deployment(s.node_a, image="evil.example/miner:1"))
    assert not ok and POLICY in err and "only run the driver's image" in err, err


def test_deleting_another_nodes_daemon_is_denied(cluster: Any, mps_setup: Setup) -> None:
    s = mps_setup
    theirs = s.deployment(s.node_b)
    cluster.kubectl("create", "-f", "-", input=json.dumps(theirs))  # as the admin
    name = theirs["metadata"]["name"]
    try:
        proc = s.plugin.kubectl("delete", "deployment", name, "-n", s.ns, "--wait=false")
        assert proc.returncode != 0 and POLICY in proc.stderr, proc.stderr
    finally:
        cluster.kubectl("delete", "deployment", name, "-n", s.ns, "--wait=false", check=False)


def test_no_deployment_in_another_namespace(mps_setup: Setup) -> None:
    s = mps_setup
    body = s.deployment(s.node_a, ns=f"{s.ns}-other")
    with pytest.raises(ApiError) as err:
        s.api.request("POST", f"/apis/apps/v1/namespaces/{s.ns}-other/deployments", body=body)
    assert err.value.status == 403
