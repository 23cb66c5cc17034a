"""The Helm chart against a real API server (the local control plane).

* `helm template` with the default and the mock values is accepted by the API server
  (`kubectl apply --dry-run=server`: schema, CEL in DeviceClasses / the policy / the
  webhook's matchConditions, RBAC objects).
* The RBAC and the ValidatingAdmissionPolicy, applied for real: a token bound to a pod
  on node A (so it carries the node-name extra) may write node A's ResourceSlices and
  is denied node B's and slices in node B's pool, and has no rights beyond the
  ClusterRole.
* The plugin's own API code (slice publisher, claim reader, failure reporter with
  device status), run with that token, works with exactly these rules.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.test_chart_render import CHART, DRIVER, MOCK_VALUES, find_helm

Doc = dict[str, Any]
DEVICE_STATUS = ("--set", "deviceStatus=true")


def _template(release: str, namespace: str, *args: str) -> str:
    proc = subprocess.run(
        [find_helm(), "template", release, str(CHART), "--namespace", namespace, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _dump(docs: list[Doc]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


@pytest.mark.parametrize(
    "values",
    [
        [],
        ["--values", str(MOCK_VALUES)],
        [
            "--set",
            "kubeletPlugin.metrics.networkPolicy.enabled=true",
            "--set-json",
            'kubeletPlugin.metrics.networkPolicy.from=[{"namespaceSelector":'
            '{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]',
        ],
        ["--values", str(MOCK_VALUES), "--set", "kubeletPlugin.mps.enabled=true"],
    ],
    ids=["default-values", "mock-values", "network-policy", "mps"],
)
def test_rendered_chart_is_accepted_by_the_api_server(cluster: Any, values: list[str]) -> None:
    ns = f"chart-dry-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        manifest = _template("gpu-dra-driver", ns, *values)
        proc = cluster.kubectl(
            "apply", "--dry-run=server", "-f", "-", input=manifest, check=False, timeout=120
        )
        assert proc.returncode == 0, f"API server rejected the chart:\n{proc.stderr}"
        applied = proc.stdout.splitlines()
        for kind in (
            "daemonset.apps/gpu-dra-driver-kubeletplugin",
            "deviceclass.resource.k8s.io/gpu.example.com",
            "deviceclass.resource.k8s.io/mig.gpu.example.com",
            "deviceclass.resource.k8s.io/partition.gpu.example.com",
            "validatingadmissionpolicy.admissionregistration.k8s.io/gpu-dra-driver-resourceslices",
            "validatingwebhookconfiguration.admissionregistration.k8s.io/gpu-dra-driver-webhook",
            "clusterrole.rbac.authorization.k8s.io/gpu-dra-driver-kubeletplugin",
        ):
            assert any(line.startswith(kind) for line in applied), (kind, applied)
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


# --- the node-scoped policy, for real ---------------------------------------------------


class PluginIdentity:
    """kubectl acting as the plugin's service account, with a pod-bound token."""

    def __init__(self, cluster: Any, kubeconfig: Path) -> None:
        self.cluster = cluster
        self.kubeconfig = kubeconfig

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.cluster.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def _slice(
    name: str, node: str, driver: str = DRIVER, pool: str | None = None, generation: int = 1
) -> str:
    return json.dumps(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": name},
            "spec": {
                "driver": driver,
                "nodeName": node,
                "pool": {
                    "name": pool or node,
                    "generation": generation,
                    "resourceSliceCount": 1,
                },
                "devices": [],
            },
        }
    )


def _touched(cluster: Any, name: str) -> str:
    """A slice as stored (read by the admin: the plugin may list, not get), labelled: a
    PUT, the only way the plugin changes a slice (it has no `patch`)."""
    obj = json.loads(cluster.kubectl("get", "resourceslice", name, "-o", "json").stdout)
    obj["metadata"].setdefault("labels", {})["example.com/touched"] = "yes"
    return json.dumps(obj)


def _token_kubeconfig(cluster: Any, token: str, path: Path) -> None:
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    ctx_name = admin["current-context"]
    ctx = next(c["context"] for c in admin["contexts"] if c["name"] == ctx_name)
    cl = next(c["cluster"] for c in admin["clusters"] if c["name"] == ctx["cluster"])
    if "certificate-authority" in cl:
        ca_path = Path(cl["certificate-authority"])
        if not ca_path.is_absolute():
            cl["certificate-authority"] = str(cluster.kubeconfig.parent / ca_path)
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cl}],
                "users": [{"name": "plugin", "user": {"token": token}}],
                "contexts": [{"name": "plugin", "context": {"cluster": "c", "user": "plugin"}}],
                "current-context": "plugin",
            }
        )
    )
    path.chmod(0o600)


@pytest.fixture(scope="module")
def policy_setup(cluster: Any) -> Iterator[tuple[PluginIdentity, str, str, str]]:
    """Chart RBAC + policy applied; a plugin pod on node A; its token's kubeconfig."""
    suffix = uuid.uuid4().hex[:6]
    ns = f"chart-policy-{suffix}"
    node_a, node_b = f"chart-node-a-{suffix}", f"chart-node-b-{suffix}"
    release = "gpu-dra-driver"
    # deviceStatus=true: the claim-status rules too (the full set the plugin can need).
    docs = [d for d in yaml.safe_load_all(_template(release, ns, *DEVICE_STATUS)) if d]
    wanted = {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    policy_docs = [
        d
        for d in docs
        if d["kind"] in wanted
        and d["metadata"]["labels"].get("app.kubernetes.io/component") == "kubeletplugin"
    ]
    assert {d["kind"] for d in policy_docs} == wanted
    sa = next(d["metadata"]["name"] for d in policy_docs if d["kind"] == "ServiceAccount")
    nodes = [
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}} for n in (node_a, node_b)
    ]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugin-on-a", "namespace": ns},
        "spec": {
            "nodeName": node_a,
            "serviceAccountName": sa,
            "containers": [{"name": "plugin", "image": "gpu-dra-driver:dev"}],
        },
    }
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("apply", "-f", "-", input=_dump(policy_docs + nodes))
    cluster.kubectl("apply", "-f", "-", input=_dump([pod]))
    token = cluster.kubectl(
        "create",
        "token",
        sa,
        "--namespace",
        ns,
        "--bound-object-kind",
        "Pod",
        "--bound-object-name",
        "plugin-on-a",
        "--duration",
        "30m",
    ).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="gpu-dra-chart-"))
    _token_kubeconfig(cluster, token, tmp / "plugin.kubeconfig")
    try:
        yield PluginIdentity(cluster, tmp / "plugin.kubeconfig"), ns, node_a, node_b
    finally:
        for name in (
            f"slice-a-{suffix}", f"slice-b-{suffix}", f"slice-x-{suffix}", f"slice-sq-{suffix}"
        ):  # fmt: skip
            cluster.kubectl("delete", "resourceslice", name, "--ignore-not-found", check=False)
        cluster.kubectl(
            "delete", "-f", "-", "--ignore-not-found", "--wait=false",
            input=_dump(policy_docs + nodes), check=False,
        )  # fmt: skip
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        shutil.rmtree(tmp, ignore_errors=True)  # the plugin's token kubeconfig


def test_token_carries_the_node(cluster: Any, policy_setup: Any) -> None:
    plugin, ns, node_a, _ = policy_setup
    proc = plugin.kubectl("auth", "whoami", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    user = json.loads(proc.stdout)["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{ns}:gpu-dra-driver-kubeletplugin"
    assert user.get("extra", {}).get("authentication.kubernetes.io/node-name") == [node_a], (
        "the API server did not put the pod's node into the token "
        "(ServiceAccountTokenPodNodeInfo); the policy cannot work without it"
    )


def test_rbac_grants_exactly_the_plugin_rights(cluster: Any, policy_setup: Any) -> None:
    """The verbs of the plugin's requests (tests/unit/test_chart_render.py derives them
    from the code) are allowed; the ones the plugin never sends are denied."""
    plugin = policy_setup[0]

    def can(*args: str) -> bool:
        proc = plugin.kubectl("auth", "can-i", *args)
        return proc.stdout.strip() == "yes"

    cluster.wait_for(lambda: can("create", "resourceslices.resource.k8s.io"), what="RBAC binding")
    for verb in ("list", "watch", "create", "update", "delete"):
        assert can(verb, "resourceslices.resource.k8s.io"), verb
    assert can("get", "resourceclaims.resource.k8s.io", "--all-namespaces")
    assert can("get", "nodes")
    assert can("create", "events", "--all-namespaces")
    claims = "resourceclaims.resource.k8s.io"
    assert can("patch", claims, "--subresource=status", "--all-namespaces")
    assert can("associated-node:patch", f"{claims}/{DRIVER}", "--subresource=driver", "-A")
    for denied in (
        ("get", "resourceslices.resource.k8s.io"),
        ("patch", "resourceslices.resource.k8s.io"),
        ("list", claims, "--all-namespaces"),
        ("watch", claims, "--all-namespaces"),
        ("update", claims, "--subresource=status", "--all-namespaces"),
        ("associated-node:update", f"{claims}/{DRIVER}", "--subresource=driver", "-A"),
        ("arbitrary-node:patch", f"{claims}/{DRIVER}", "--subresource=driver", "-A"),
        ("associated-node:patch", f"{claims}/other.example.com", "--subresource=driver", "-A"),
        ("patch", "events", "--all-namespaces"),
        ("create", "events.events.k8s.io", "--all-namespaces"),
        ("list", "nodes"),
        ("get", "secrets", "--all-namespaces"),
        ("list", "pods", "--all-namespaces"),
        ("create", "deviceclasses.resource.k8s.io"),
    ):
        assert not can(*denied), denied


def test_policy_allows_own_node_and_denies_other_nodes(cluster: Any, policy_setup: Any) -> None:
    plugin, _, node_a, node_b = policy_setup
    suffix = node_a.rsplit("-", 1)[1]
    slice_a, slice_b, slice_x = f"slice-a-{suffix}", f"slice-b-{suffix}", f"slice-x-{suffix}"

    # The policy is enforced once the API server's policy informer has it: probe with
    # a server-side dry run until node B's slice is denied.
    def denied_for_b() -> bool:
        proc = plugin.kubectl(
            "create", "--dry-run=server", "-f", "-", input=_slice(slice_b, node_b)
        )
        return proc.returncode != 0 and "may not modify resourceslices on node" in proc.stderr

    cluster.wait_for(denied_for_b, timeout=60, what="the ValidatingAdmissionPolicy to deny node B")

    # Own node: create, update, delete are allowed.
    proc = plugin.kubectl("create", "-f", "-", input=_slice(slice_a, node_a))
    assert proc.returncode == 0, proc.stderr
    proc = plugin.kubectl("replace", "-f", "-", input=_touched(cluster, slice_a))
    assert proc.returncode == 0, proc.stderr

    # Another node: create is denied, naming both nodes.
    proc = plugin.kubectl("create", "-f", "-", input=_slice(slice_b, node_b))
    assert proc.returncode != 0
    assert f"running on node '{node_a}' may not modify resourceslices on node '{node_b}'" in (
        proc.stderr
    )
    assert "ValidatingAdmissionPolicy" in proc.stderr

    # Another node's existing slice (made by the admin): update and delete are denied.
    cluster.kubectl("create", "-f", "-", input=_slice(slice_b, node_b))
    proc = plugin.kubectl("replace", "-f", "-", input=_touched(cluster, slice_b))
    assert proc.returncode != 0 and "may not modify resourceslices" in proc.stderr
    proc = plugin.kubectl("delete", "resourceslice", slice_b)
    assert proc.returncode != 0 and "may not modify resourceslices" in proc.stderr
    assert cluster.kubectl("get", "resourceslice", slice_b, check=False).returncode == 0

    # Own node but another driver: denied.
    proc = plugin.kubectl("create", "-f", "-", input=_slice(slice_x, node_a, "other.example.com"))
    assert proc.returncode != 0 and "may only modify resourceslices of driver" in proc.stderr

    # Own slice: delete is allowed.
    proc = plugin.kubectl("delete", "resourceslice", slice_a)
    assert proc.returncode == 0, proc.stderr

    # The admin is not affected by the policy.
    proc = cluster.kubectl("delete", "resourceslice", slice_b, check=False)
    assert proc.returncode == 0, proc.stderr


def test_policy_denies_publishing_in_another_nodes_pool(cluster: Any, policy_setup: Any) -> None:
    """Pool squatting: node A's plugin may not put a slice of its own node into node B's
    pool (the scheduler groups slices by pool name across nodes: with a huge generation
    B's pool looks outdated or incomplete and its devices unallocatable). A squatting
    slice already on node A may still be deleted by A's plugin (its publisher removes
    surplus slices of its node), not updated."""
    plugin, _, node_a, node_b = policy_setup
    squat = f"slice-sq-{node_a.rsplit('-', 1)[1]}"
    huge = 2**62

    def denied_pool() -> bool:
        proc = plugin.kubectl(
            "create", "--dry-run=server", "-f", "-",
            input=_slice(squat, node_a, pool=node_b, generation=huge),
        )  # fmt: skip
        return proc.returncode != 0 and "pool" in proc.stderr

    cluster.wait_for(denied_pool, timeout=60, what="the ValidatingAdmissionPolicy to deny pool B")
    proc = plugin.kubectl("create", "-f", "-", input=_slice(squat, node_a, pool=node_b))
    assert proc.returncode != 0
    assert "ValidatingAdmissionPolicy" in proc.stderr
    assert (
        f"running on node '{node_a}' may only publish resourceslices in pool '{node_a}', "
        f"not '{node_b}'"
    ) in proc.stderr

    # A squatting slice on node A (made by the admin; spec.pool.name is immutable): A's
    # plugin may not update it, and may delete it.
    cluster.kubectl("create", "-f", "-", input=_slice(squat, node_a, pool=node_b))
    proc = plugin.kubectl("replace", "-f", "-", input=_touched(cluster, squat))
    assert proc.returncode != 0 and f"not '{node_b}'" in proc.stderr
    proc = plugin.kubectl("delete", "resourceslice", squat)
    assert proc.returncode == 0, proc.stderr


# --- the plugin's own API code, authenticated as the plugin pod ---------------------------


def _claim(cluster: Any, ns: str, name: str, node: str) -> None:
    """A ResourceClaim allocated (by the admin, like the scheduler) on `node`."""
    cluster.kubectl(
        "create",
        "-f",
        "-",
        input=json.dumps(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]
                    }
                },
            }
        ),
    )
    allocation = {
        "devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": "gpu-0"}]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }
    cluster.kubectl(
        "patch", "resourceclaim", name, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"allocation": allocation}}),
    )  # fmt: skip


def test_plugin_api_code_works_with_exactly_the_chart_rbac(cluster: Any, policy_setup: Any) -> None:
    """SlicePublisher (list, watch, create, update, delete, node lookup), ApiClaimReader
    and ClaimFailureReporter with device status, run as the plugin pod's identity,
    against the chart's RBAC and policy: every request they send is allowed, and the
    device-status write is allowed for a claim on the plugin's node only."""
    from driver.errors import invalid_config
    from driver.kube.api import KubeApi
    from driver.kube.claims import ApiClaimReader, ClaimFailureReporter
    from driver.kube.publisher import SlicePublisher

    plugin, ns, node_a, node_b = policy_setup
    api = KubeApi.from_kubeconfig(str(plugin.kubeconfig))

    def pool_spec(*devices: str) -> dict[str, Any]:
        return {
            "driver": DRIVER,
            "nodeName": node_a,
            "pool": {"name": node_a, "generation": 0, "resourceSliceCount": 0},
            "devices": [{"name": d, "attributes": {"index": {"int": 0}}} for d in devices],
        }

    def slices() -> list[Doc]:
        out = cluster.kubectl(
            "get", "resourceslices", "--field-selector", f"spec.nodeName={node_a}", "-o", "json"
        ).stdout
        items: list[Doc] = json.loads(out)["items"]
        return items

    desired = [pool_spec("gpu-0"), pool_spec("gpu-1")]
    pub = SlicePublisher(api, driver=DRIVER, node_name=node_a, desired=lambda: desired)
    pub.start()
    try:
        assert pub.wait_synced(pub.trigger(), 60), pub.stats.errors
        assert len(slices()) == 2
        desired[:] = [pool_spec("gpu-0", "gpu-9")]  # one slice changed, one surplus
        assert pub.wait_synced(pub.trigger(), 60), pub.stats.errors
        assert [[d["name"] for d in s["spec"]["devices"]] for s in slices()] == [["gpu-0", "gpu-9"]]
        # The watch: a slice deleted behind the plugin's back is re-created.
        cluster.kubectl("delete", "resourceslices", "--field-selector", f"spec.nodeName={node_a}")
        cluster.wait_for(lambda: len(slices()) == 1, timeout=60, what="the watch to re-create")
        assert pub.stats.errors == [], pub.stats.errors
    finally:
        pub.stop()
        cluster.kubectl(
            "delete", "resourceslices", "--field-selector", f"spec.nodeName={node_a}",
            check=False,
        )  # fmt: skip

    reader = ApiClaimReader(api)
    reporter = ClaimFailureReporter(api, driver=DRIVER, node_name=node_a, device_status=True)
    for name, node in (("claim-on-a", node_a), ("claim-on-b", node_b)):
        _claim(cluster, ns, name, node)
        reporter.permanent_failure(reader.get(ns, name), invalid_config("bad parameters"))

    def status_devices(name: str) -> list[Doc]:
        out = cluster.kubectl("get", "resourceclaim", name, "-n", ns, "-o", "json").stdout
        devices: list[Doc] = json.loads(out).get("status", {}).get("devices", [])
        return devices

    (entry,) = status_devices("claim-on-a")
    assert entry["driver"] == DRIVER and entry["conditions"][0]["type"] == "PrepareFailed"
    # associated-node: not for a claim allocated on another node.
    assert status_devices("claim-on-b") == []
    events = json.loads(cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
    reasons = {(e["involvedObject"]["name"], e["reason"]) for e in events}
    assert {
        ("claim-on-a", "PermanentPrepareFailure"),
        ("claim-on-b", "PermanentPrepareFailure"),
    } <= reasons


# --- the chart-generated webhook certificate across helm upgrades ------------------------


def test_webhook_certificate_is_renewed_by_helm_upgrade(cluster: Any) -> None:
    """`helm upgrade` keeps the generated certificate until renewBeforeDays before the
    expiry recorded on the Secret, then renews it with both CAs in the caBundle for one
    release. A separate driver name and failurePolicy Ignore keep this release's
    webhook (which has no running pod here) away from every other test's claims."""
    import base64
    import datetime as dt

    suffix = uuid.uuid4().hex[:6]
    ns, release = f"chart-tls-{suffix}", f"tls-{suffix}"
    secret_name = f"{release}-gpu-dra-driver-webhook-tls"
    values = [
        "--set", f"driverName=tls-{suffix}.example.com",
        "--set", "webhook.failurePolicy=Ignore",
        "--set", "deviceClasses.gpu.enabled=false",
        "--set", "deviceClasses.partition.enabled=false",
        "--set", "deviceClasses.gpuPartition.enabled=false",
    ]  # fmt: skip

    def helm(*args: str) -> None:
        proc = subprocess.run(
            [find_helm(), "--kubeconfig", str(cluster.kubeconfig), *args],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr

    def upgrade(*extra: str) -> tuple[Doc, list[str]]:
        helm("upgrade", "--install", release, str(CHART), "-n", ns, *values, *extra)
        secret = json.loads(
            cluster.kubectl("get", "secret", secret_name, "-n", ns, "-o", "json").stdout
        )
        vwc = json.loads(
            cluster.kubectl(
                "get", "validatingwebhookconfiguration", f"{release}-gpu-dra-driver-webhook",
                "-o", "json",
            ).stdout
        )  # fmt: skip
        bundle = base64.b64decode(vwc["webhooks"][0]["clientConfig"]["caBundle"]).decode()
        cas = [
            "-----BEGIN CERTIFICATE-----" + c
            for c in bundle.split("-----BEGIN CERTIFICATE-----")[1:]
        ]
        return secret, [c.strip() for c in cas]

    def ca_of(secret: Doc) -> str:
        return base64.b64decode(secret["data"]["ca.crt"]).decode().strip()

    def not_after(secret: Doc) -> dt.datetime:
        value = secret["metadata"]["annotations"]["gpu-dra-driver/not-after"]
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%S%z")

    cluster.kubectl("create", "namespace", ns)
    try:
        first, bundle = upgrade()
        year = dt.datetime.now(dt.UTC) + dt.timedelta(days=365)
        assert abs(not_after(first) - year) < dt.timedelta(minutes=5)
        assert bundle == [ca_of(first)]

        again, bundle = upgrade()  # far from expiry: kept
        assert again["data"] == first["data"] and bundle == [ca_of(first)]

        # Inside the renewal window (365 days left < renewBeforeDays): renewed, with the
        # new validity.
        window = (
            "--set",
            "webhook.tls.certValidityDays=400",
            "--set",
            "webhook.tls.renewBeforeDays=366",
        )
        renewed, bundle = upgrade(*window)
        assert renewed["data"]["tls.crt"] != first["data"]["tls.crt"]
        assert ca_of(renewed) != ca_of(first)
        assert bundle == [ca_of(first), ca_of(renewed)]  # the old CA for one release
        later = dt.datetime.now(dt.UTC) + dt.timedelta(days=400)
        assert abs(not_after(renewed) - later) < dt.timedelta(minutes=5)

        settled, bundle = upgrade(*window)  # 400 days left: kept, old CA dropped
        assert settled["data"] == renewed["data"] and bundle == [ca_of(renewed)]

        # A Secret of an older chart (10-year certificate, no annotation): renewed.
        cluster.kubectl("annotate", "secret", secret_name, "-n", ns, "gpu-dra-driver/not-after-")
        replaced, bundle = upgrade(*window)
        assert replaced["data"]["tls.crt"] != settled["data"]["tls.crt"]
        assert bundle == [ca_of(settled), ca_of(replaced)]
    finally:
        subprocess.run(
            [find_helm(), "--kubeconfig", str(cluster.kubeconfig), "uninstall", release,
             "-n", ns],
            capture_output=True, timeout=180, check=False,
        )  # fmt: skip
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
