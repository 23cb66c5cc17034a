"""An install that works on a first try: where the plugin pods land (GPU node labels,
the `nvidia.com/gpu` taint, a label only administrators can set), what they request,
extra environment, the start-up probe, and values written for the reference chart."""

from __future__ import annotations

import json
import re

import pytest
from test_chart_render import (
    MOCK_VALUES,
    REPO,
    Doc,
    env_of,
    helm_template,
    one,
    plugin_container,
    render,
)

GPU_OPERATOR_LABEL = "nvidia.com/gpu.present"
# The labels node feature discovery puts on a node with an NVIDIA (vendor 10de) PCI
# device: vendor only (the GPU operator's NFD configuration), and class + vendor (NFD's
# default `deviceLabelFields`) for 3D (0302) and VGA (0300) controllers.
NFD_NVIDIA_PCI_LABELS = [
    "feature.node.kubernetes.io/pci-10de.present",
    "feature.node.kubernetes.io/pci-0302_10de.present",
    "feature.node.kubernetes.io/pci-0300_10de.present",
]
RESTRICTED_LABEL = "node-restriction.kubernetes.io/gpu.present"


def pod_spec(docs: list[Doc]) -> Doc:
    spec: Doc = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def node_terms(docs: list[Doc]) -> list[Doc]:
    terms: list[Doc] = pod_spec(docs)["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    return terms


def label_is_true(key: str) -> Doc:
    return {"key": key, "operator": "In", "values": ["true"]}


# --- node selection -------------------------------------------------------------------


def test_plugin_runs_on_nodes_labelled_by_the_gpu_operator_or_by_nfd() -> None:
    """A node with an NVIDIA GPU but without the GPU operator carries NFD's PCI labels
    only: the plugin must run there too (terms are ORed), as in NVIDIA's chart."""
    terms = node_terms(render())
    assert terms == [
        {"matchExpressions": [label_is_true(key)]}
        for key in [GPU_OPERATOR_LABEL, *NFD_NVIDIA_PCI_LABELS]
    ]
    only_operator = render("--set", "kubeletPlugin.gpuNodeLabel.nfdPciLabels=false")
    assert node_terms(only_operator) == [{"matchExpressions": [label_is_true(GPU_OPERATOR_LABEL)]}]


def test_every_gpu_node_term_is_combined_with_every_user_term() -> None:
    """(user term A or B) and (GPU label 1 or 2 or ...): each pair is one term."""
    pool = {"key": "pool", "operator": "In", "values": ["a"]}
    by_name = {"key": "metadata.name", "operator": "In", "values": ["n"]}
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [pool]}, {"matchFields": [by_name]}]
            }
        }
    }
    terms = node_terms(render("--set-json", f"kubeletPlugin.affinity={json.dumps(user)}"))
    gpu_keys = [GPU_OPERATOR_LABEL, *NFD_NVIDIA_PCI_LABELS]
    assert terms == [{"matchExpressions": [pool, label_is_true(key)]} for key in gpu_keys] + [
        {"matchFields": [by_name], "matchExpressions": [label_is_true(key)]} for key in gpu_keys
    ]


def test_hardened_installs_select_gpu_nodes_by_a_label_nodes_cannot_set() -> None:
    """The NodeRestriction admission plugin refuses a kubelet's own changes to labels
    under node-restriction.kubernetes.io/; every other label (the GPU operator's, NFD's)
    a compromised node can put on itself to attract the privileged plugin."""
    docs = render(
        "--set",
        f"kubeletPlugin.gpuNodeLabel.key={RESTRICTED_LABEL}",
        "--set",
        "kubeletPlugin.gpuNodeLabel.nfdPciLabels=false",
    )
    assert node_terms(docs) == [{"matchExpressions": [label_is_true(RESTRICTED_LABEL)]}]
    # The NFD terms would let any node in again: refused, naming the value to change.
    proc = helm_template("--set", f"kubeletPlugin.gpuNodeLabel.key={RESTRICTED_LABEL}", check=False)
    assert proc.returncode != 0
    assert "kubeletPlugin.gpuNodeLabel.nfdPciLabels=false" in proc.stderr, proc.stderr


def test_plugin_tolerates_the_nvidia_gpu_taint() -> None:
    """GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule (GPU operator docs, cloud
    GPU node pools); a plugin that does not tolerate it never runs there."""
    tolerations = pod_spec(render())["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


# --- resources, environment, probes ---------------------------------------------------


def quantity_mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity)
    assert match, f"unexpected memory quantity {quantity!r}"
    return int(match.group(1)) * units[match.group(2)]


def measured_plugin_rss_mib() -> float:
    """The largest RSS of this driver's plugin in docs/benchmarks.md (first value column)."""
    rows = [
        line
        for line in (REPO / "docs" / "benchmarks.md").read_text().splitlines()
        if line.startswith("| RSS")
    ]
    assert rows, "docs/benchmarks.md has no RSS rows"
    values = [float(v) for row in rows for v in re.findall(r"([\d.]+) MiB", row.split("|")[2])]
    return max(values)


@pytest.mark.parametrize("values", [[], ["--values", str(MOCK_VALUES)]], ids=["nvml", "mock"])
def test_plugin_requests_what_the_benchmarks_measured(values: list[str]) -> None:
    """Requests below the measured RSS let the scheduler overcommit the node and make the
    plugin an early eviction candidate under memory pressure; no memory limit, so a
    burst (a fleet of MIG GPUs) never OOM-kills it in the middle of a prepare."""
    resources = plugin_container(render(*values))["resources"]
    requested = quantity_mib(resources["requests"]["memory"])
    assert requested >= 1.25 * measured_plugin_rss_mib()
    assert requested <= 4 * measured_plugin_rss_mib()
    assert resources["requests"]["cpu"]
    assert "memory" not in resources.get("limits", {})


def test_extra_env_reaches_the_plugin_after_the_charts_own() -> None:
    extra = [
        {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
        {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
    ]
    container = plugin_container(
        render("--set-json", f"kubeletPlugin.containers.plugin.extraEnv={json.dumps(extra)}")
    )
    assert container["env"][-2:] == extra
    assert "V" in env_of(container)


def test_extra_env_cannot_replace_a_variable_the_chart_sets() -> None:
    extra = [{"name": "MIG_STRATEGY", "value": "static"}]
    proc = helm_template(
        "--set-json", f"kubeletPlugin.containers.plugin.extraEnv={json.dumps(extra)}", check=False
    )
    assert proc.returncode != 0
    assert "kubeletPlugin.containers.plugin.extraEnv" in proc.stderr
    assert "MIG_STRATEGY" in proc.stderr and "kubeletPlugin.migStrategy" in proc.stderr


def test_startup_probe_gives_discovery_time_before_liveness_counts() -> None:
    """Start-up (NVML discovery, MIG clean-up of a crashed prepare, the first publish) can
    take minutes on a full node; the liveness probe must not restart it meanwhile."""
    container = plugin_container(render())
    probe = container["startupProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300
    slower = plugin_container(render("--set", "kubeletPlugin.startupProbe.failureThreshold=120"))
    assert slower["startupProbe"]["failureThreshold"] == 120


def test_readiness_probe_waits_for_the_kubelet_registration() -> None:
    """A new plugin pod is Ready only once the kubelet registered it and its sockets
    answer (/readyz): with maxUnavailable 0 the rolling update keeps the old pod until
    then, so an upgrade that cannot register stalls instead of replacing a working one."""
    container = plugin_container(render())
    probe = container["readinessProbe"]
    assert probe["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert probe["periodSeconds"] <= 10
    slower = plugin_container(render("--set", "kubeletPlugin.readinessProbe.periodSeconds=20"))
    assert slower["readinessProbe"]["periodSeconds"] == 20


# --- values written for the reference chart -------------------------------------------


@pytest.mark.parametrize(
    ("reference_value", "new_value"),
    [
        ("gpuAllowMultipleAllocations=true", "kubeletPlugin.allowMultipleAllocations"),
        ("gpuDeviceStatus=true", "deviceStatus"),
        (
            "deviceClass.extendedResourceName=example.com/gpu",
            "deviceClasses.gpu.extendedResourceName",
        ),
        ("kubeletPlugin.containers.plugin.metricsPort=9400", "kubeletPlugin.httpPort"),
        ("kubeletPlugin.containers.plugin.healthcheckPort=51515", "kubeletPlugin.livenessProbe"),
        ("kubeletPlugin.numDevices=4", "nvml.mockFleet"),
        ("deviceProfile=gpu", "deviceProfile"),
        ("kubeletPlugin.bindingConditions=true", "bindingConditions"),
    ],
)
def test_reference_chart_values_name_the_value_to_set(reference_value: str, new_value: str) -> None:
    proc = helm_template("--set", reference_value, check=False)
    assert proc.returncode != 0
    key = reference_value.split("=", 1)[0]
    line = next((x for x in proc.stderr.splitlines() if key in x), proc.stderr)
    assert "reference chart" in line and new_value in line, proc.stderr
    assert "additional properties" not in proc.stderr


def test_every_reference_value_is_named_in_one_error() -> None:
    """A values file written for the reference chart: one run lists every key to rename."""
    proc = helm_template(
        "--set", "gpuAllowMultipleAllocations=true", "--set", "gpuDeviceStatus=false", check=False
    )
    assert proc.returncode != 0
    assert "kubeletPlugin.allowMultipleAllocations" in proc.stderr
    assert "deviceStatus" in proc.stderr.replace("gpuDeviceStatus", "")


# --- the namespace's Pod Security level -----------------------------------------------


def shell_blocks(path: str, after: str | None = None) -> list[str]:
    text = (REPO / path).read_text()
    if after is not None:
        assert after in text, f"{path} has no {after!r}"
        text = text.split(after, 1)[1]
    return re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.DOTALL)


@pytest.mark.parametrize(
    ("path", "after"),
    [
        ("README.md", "## Install on a cluster"),
        ("docs/install.md", None),
        ("deployments/helm/gpu-dra-driver/README.md", "## Install"),
    ],
)
def test_install_commands_label_the_namespace_privileged_first(path: str, after: str) -> None:
    """The plugin needs the `privileged` Pod Security level (host paths, root, and a
    privileged container for NVML): where the cluster enforces `baseline` or `restricted`
    by default, a plain `--create-namespace` gets the DaemonSet's pods refused."""
    installs = 0
    for block in shell_blocks(path, after):
        commands = block.replace("\\\n", " ")
        install = re.search(r"helm install \S+ \S+.*?--namespace (\S+)", commands)
        if not install:
            continue
        installs += 1
        label = re.search(
            rf"kubectl label namespace {re.escape(install.group(1))} .*"
            r"pod-security\.kubernetes\.io/enforce=privileged",
            commands,
        )
        assert label and label.start() < install.start(), commands
    assert installs, f"no `helm install ... --namespace` in {path}"
