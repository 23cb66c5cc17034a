"""The chart's MPS daemons (kubeletPlugin.mps.enabled, docs/mps.md): off by default
(MPS_DAEMONS=off, no Role, no policy); on, the plugin gets MPS_DAEMONS=kubernetes, its
namespace and image, a Role for its daemon Deployments in the release namespace only,
and a ValidatingAdmissionPolicy confining them to its own node and the chart's image.
tests/integration/test_chart_mps_policy.py applies them to a real API server."""

from __future__ import annotations

from test_chart_render import NAMESPACE, Doc, one, render

MPS = ("--set", "kubeletPlugin.mps.enabled=true")


def _env(docs: list[Doc]) -> dict[str, Doc]:
    daemonset = one(docs, "DaemonSet", "kubeletplugin")
    (plugin,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"]]
    return {e["name"]: e for e in plugin["env"]}


def _named(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_mps_is_off_by_default_with_no_role_and_no_policy() -> None:
    docs = render()
    assert _env(docs)["MPS_DAEMONS"]["value"] == "off"
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    assert not [d for d in docs if d["metadata"]["name"] == "gpu-dra-driver-mps-daemons"]


def test_enabled_the_plugin_learns_its_namespace_and_image() -> None:
    env = _env(render(*MPS, "--set", "image.tag=9.9.9"))
    assert env["MPS_DAEMONS"]["value"] == "kubernetes"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["MPS_DAEMON_IMAGE"]["value"].endswith(":9.9.9")


def test_enabled_the_role_grants_daemon_deployments_in_the_release_namespace_only() -> None:
    docs = render(*MPS)
    role = _named(docs, "Role", "gpu-dra-driver-mps-daemons")
    assert role["metadata"]["namespace"] == NAMESPACE
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules == {
        (("apps",), ("deployments",)): {"create", "get", "delete"},
        (("",), ("pods",)): {"list"},
    }
    binding = _named(docs, "RoleBinding", "gpu-dra-driver-mps-daemons")
    assert binding["metadata"]["namespace"] == NAMESPACE
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
        "name": "gpu-dra-driver-mps-daemons",
    }  # fmt: skip
    (subject,) = binding["subjects"]
    assert subject["name"] == "gpu-dra-driver-kubeletplugin"
    # No cluster-wide grant of Deployments.
    cluster_role = _named(docs, "ClusterRole", "gpu-dra-driver-kubeletplugin")
    assert not [r for r in cluster_role["rules"] if "deployments" in r["resources"]]


def test_enabled_the_policy_pins_daemons_to_the_plugins_node_label_and_image() -> None:
    docs = render(*MPS, "--set", "image.tag=9.9.9")
    vap = _named(docs, "ValidatingAdmissionPolicy", "gpu-dra-driver-mps-daemons")
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["deployments"] and rule["apiGroups"] == ["apps"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (cond,) = spec["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:gpu-dra-driver-kubeletplugin" in cond["expression"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    assert "'gpu.example.com/mps-daemon'" in variables["labelled"]
    exprs = " ".join(v["expression"] for v in spec["validations"])
    assert "variables.podNodeName == variables.userNodeName" in exprs
    assert ":9.9.9'" in exprs
    binding = _named(docs, "ValidatingAdmissionPolicyBinding", "gpu-dra-driver-mps-daemons")
    assert binding["spec"]["validationActions"] == ["Deny"]
