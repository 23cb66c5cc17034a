"""The chart's webhook bounds: default resources, and the optional NetworkPolicy that
admits only the API server to the webhook port (docs/security.md, "Webhook")."""

from __future__ import annotations

import json

import pytest
from test_chart_render import MOCK_VALUES, NAMESPACE, Doc, helm_template, one, render

POLICY = "webhook.networkPolicy"
CONTROL_PLANE = {"ipBlock": {"cidr": "10.0.0.0/24"}}
KONNECTIVITY = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "konnectivity-agent"}},
}


def webhook_container(docs: list[Doc]) -> Doc:
    pod = one(docs, "Deployment", "webhook")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container


def policies(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}


def with_peers(*peers: Doc, extra: tuple[str, ...] = ()) -> list[Doc]:
    return render(
        "--set",
        f"{POLICY}.enabled=true",
        "--set-json",
        f"{POLICY}.from={json.dumps(peers)}",
        *extra,
    )


def test_webhook_has_bounded_resources_by_default() -> None:
    resources = webhook_container(render())["resources"]
    assert resources["requests"] == {"cpu": "100m", "memory": "128Mi"}
    # a memory limit (a flood cannot take the node's memory), no CPU limit (throttling
    # would hold reviews past the API server's timeout)
    assert resources["limits"] == {"memory": "512Mi"}


def test_webhook_resources_can_be_changed_and_dropped() -> None:
    mock = webhook_container(render("--values", str(MOCK_VALUES)))["resources"]
    assert mock == {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "512Mi"}}
    docs = render(
        "--set",
        "webhook.containers.webhook.resources.limits.memory=1Gi",
        "--set",
        "webhook.containers.webhook.resources.requests=null",
    )
    assert webhook_container(docs)["resources"] == {"limits": {"memory": "1Gi"}}


def test_no_webhook_network_policy_by_default() -> None:
    assert "gpu-dra-driver-webhook" not in policies(render())


def test_network_policy_admits_only_the_given_peers_to_the_webhook_port() -> None:
    docs = with_peers(CONTROL_PLANE, KONNECTIVITY)
    policy = policies(docs)["gpu-dra-driver-webhook"]
    assert policy["metadata"]["namespace"] == NAMESPACE
    spec = policy["spec"]
    pod_labels = one(docs, "Deployment", "webhook")["spec"]["template"]["metadata"]["labels"]
    selector = spec["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()  # selects the webhook pods ...
    plugin = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= plugin.items()  # ... and not the plugin's
    assert spec["policyTypes"] == ["Ingress"]
    port = webhook_container(docs)["ports"][0]["containerPort"]
    assert spec["ingress"] == [
        {"from": [CONTROL_PLANE, KONNECTIVITY], "ports": [{"protocol": "TCP", "port": port}]}
    ]


def test_network_policy_follows_the_container_port() -> None:
    docs = with_peers(CONTROL_PLANE, extra=("--set", "webhook.containerPort=9443"))
    (rule,) = policies(docs)["gpu-dra-driver-webhook"]["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 9443}]
    assert webhook_container(docs)["ports"][0]["containerPort"] == 9443


def test_network_policy_without_peers_is_refused() -> None:
    """An empty `from` would shut the API server out: with failurePolicy Fail every
    claim with an opaque config for the driver would be rejected."""
    proc = helm_template("--set", f"{POLICY}.enabled=true", check=False)
    assert proc.returncode != 0
    assert "webhook.networkPolicy.enabled needs webhook.networkPolicy.from" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--set-json", f'{POLICY}.from=["10.0.0.0/24"]'],
        ["--set-json", f"{POLICY}.from=[{{}}]"],
        ["--set", f"{POLICY}.bogus=1"],
    ],
    ids=["peer-not-an-object", "empty-peer", "unknown-key"],
)
def test_bad_network_policy_values_are_rejected(args: list[str]) -> None:
    proc = helm_template(*args, check=False)
    assert proc.returncode != 0
    assert "networkPolicy" in proc.stderr, proc.stderr


def test_no_network_policy_without_the_webhook() -> None:
    docs = render(
        "--set", "webhook.enabled=false", "--set", f"{POLICY}.enabled=true"
    )  # nothing to protect: no policy, and no refusal of the empty `from`
    assert "gpu-dra-driver-webhook" not in policies(docs)
