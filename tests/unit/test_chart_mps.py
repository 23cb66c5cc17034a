"""The chart's MPS daemons (kubeletPlugin.mps.enabled, docs/mps.md): off by default
(MPS_DAEMONS=off; a Role and the policy only to remove daemons left from before); on,
the plugin gets MPS_DAEMONS=kubernetes, its namespace and image, a Role for its daemon
Deployments in the release namespace only, and a ValidatingAdmissionPolicy confining
them to its own node, the chart's image and the Deployment the plugin renders, with the
paths the plugin renders it from.
tests/integration/test_chart_mps_policy.py applies them to a real API server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast
from unittest import mock

import pytest
from test_chart_render import MOCK_VALUES, NAMESPACE, Doc, one, render

from driver.kube.api import KubeApi
from driver.kube.mps_daemons import KubeDaemons
from driver.nvml.backend import NvmlBackend
from driver.nvml.mps import MpsControl
from driver.plugin.mps_setup import mps_daemons
from driver.plugin.options.flags import PluginOptions, parse_options

MPS = ("--set", "kubeletPlugin.mps.enabled=true")


def _env(docs: list[Doc]) -> dict[str, Doc]:
    daemonset = one(docs, "DaemonSet", "kubeletplugin")
    (plugin,) = [c for c in daemonset["spec"]["template"]["spec"]["containers"]]
    return {e["name"]: e for e in plugin["env"]}


def _named(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _rules(role: Doc) -> dict[tuple[tuple[str, ...], tuple[str, ...]], set[str]]:
    return {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}


def test_off_by_default_the_plugin_may_only_remove_daemons_left_from_before() -> None:
    """MPS off (the default): no daemon is created, but unprepare and the sweep remove
    the daemon Deployments of claims prepared while it was on (docs/upgrade.md): a Role
    to read, list and delete them, no create, confined by the same policy."""
    docs = render()
    assert _env(docs)["MPS_DAEMONS"]["value"] == "off"
    role = _named(docs, "Role", "gpu-dra-driver-mps-daemons")
    assert _rules(role) == {
        (("apps",), ("deployments",)): {"get", "list", "delete"},
        (("",), ("pods",)): {"list"},
    }
    _named(docs, "RoleBinding", "gpu-dra-driver-mps-daemons")
    _named(docs, "ValidatingAdmissionPolicy", "gpu-dra-driver-mps-daemons")
    _named(docs, "ValidatingAdmissionPolicyBinding", "gpu-dra-driver-mps-daemons")


def test_enabled_the_plugin_learns_its_namespace_and_image() -> None:
    env = _env(render(*MPS, "--set", "image.tag=9.9.9"))
    assert env["MPS_DAEMONS"]["value"] == "kubernetes"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert env["MPS_DAEMON_IMAGE"]["value"].endswith(":9.9.9")


def test_enabled_the_role_grants_daemon_deployments_in_the_release_namespace_only() -> None:
    docs = render(*MPS)
    role = _named(docs, "Role", "gpu-dra-driver-mps-daemons")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _rules(role) == {
        (("apps",), ("deployments",)): {"create", "get", "list", "delete"},
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
    # No wildcard: the API server type-checks the validations against apps/v1.
    assert rule["apiVersions"] == ["v1"]
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


class _Backend:
    """`NvmlBackend.mps` where nvidia-cuda-mps-control is installed: real NVML's runs
    from the driver root it is given, the mock's from its own root."""

    def __init__(self, options: PluginOptions) -> None:
        self.options = options

    def mps(self, driver_root: Path | str) -> MpsControl:
        return MpsControl(
            self.options.plugin_mock_driver_root if self.options.mock else driver_root
        )


def _plugin_options(docs: list[Doc]) -> PluginOptions:
    """The options the plugin's pod parses from its rendered env."""
    fields = {"spec.nodeName": "n1", "metadata.namespace": NAMESPACE, "metadata.uid": "u"}
    env = {
        e["name"]: e["value"] if "value" in e else fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in _env(docs).values()
        if e["name"] != "MOCK_FLEET"
    }
    with mock.patch.dict(os.environ, env, clear=True):
        return parse_options([])


@pytest.mark.parametrize(
    "values",
    [
        (),
        ("--set", "nvidiaDriverRoot=/run/nvidia/driver/"),
        ("--values", str(MOCK_VALUES)),
        (
            "--values",
            str(MOCK_VALUES),
            "--set",
            "kubeletPlugin.kubeletPluginsDirectoryPath=/var/lib/kubelet/plugins-x/",
            "--set-json",
            'kubeletPlugin.containers.plugin.extraEnv=[{"name":"MOCK_DRIVER_ROOT",'
            '"value":"/var/lib/gpu-dra-mock/root/"}]',
        ),
    ],
    ids=["driver-on-host", "driver-root-dir", "mock", "mock-own-root"],
)
def test_the_policy_pins_the_paths_the_plugin_renders_its_daemons_with(
    values: tuple[str, ...],
) -> None:
    """The policy's driver root, its host path and the daemons' directory are those of
    the plugin's own KubeDaemons (driver/plugin/mps_setup.py) for the same values."""
    docs = render(*MPS, *values)
    options = _plugin_options(docs)
    # Nothing is requested: mps_daemons only keeps the client.
    daemons = mps_daemons(options, cast(NvmlBackend, _Backend(options)), cast(KubeApi, None))
    assert isinstance(daemons, KubeDaemons)
    settings = daemons.settings
    vap = _named(docs, "ValidatingAdmissionPolicy", "gpu-dra-driver-mps-daemons")
    variables = {v["name"]: v["expression"] for v in vap["spec"]["variables"]}
    assert f"'{options.data_dir}/mps/' + variables.directory" == variables["base"]
    assert f"'--driver-root={settings.driver_root}'" in variables["commandHead"]
    assert f"'mountPath': dyn('{settings.driver_root}')" in variables["containerFixed"]
    assert f"'path': '{settings.driver_root_host}'" in variables["volumes"]
    assert f"'image': dyn('{settings.image}')" in variables["containerFixed"]
    assert f"'imagePullPolicy': dyn('{settings.image_pull_policy}')" in variables["containerFixed"]
