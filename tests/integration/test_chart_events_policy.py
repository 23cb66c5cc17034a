"""The chart's Events policy against a real API server: the plugin's service account,
with a token bound to a pod on node A, may create Events about a ResourceClaim or about
Node A, reported by node A under the driver's name, and nothing else (its RBAC allows
`events: create` in every namespace). The Events the plugin's own code posts pass.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.integration.test_chart import PluginIdentity, policy_setup  # noqa: F401
from tests.unit.test_chart_render import DRIVER

Doc = dict[str, Any]
POLICY_NAME = "gpu-dra-driver-events"


def _core_event(
    ns: str,
    about: Doc,
    node: str,
    *,
    source_host: str | None = None,
    related: Doc | None = None,
    component: str | None = DRIVER,
    reporting_component: str | None = DRIVER,
) -> str:
    """A core/v1 Event as the plugin posts them (driver/kube/claims.py, events.py): one
    about a cluster-scoped object lives in `default` (API validation, before admission).
    `component` (source.component) or `reporting_component` None leaves it out."""
    event: Doc = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"probe.{uuid.uuid4().hex[:12]}", "namespace": _ns(ns, about)},
        "involvedObject": about,
        "reason": "Probe",
        "message": "policy probe",
        "type": "Warning",
        "source": {"host": source_host or node},
        "reportingInstance": node,
    }
    if component is not None:
        event["source"]["component"] = component
    if reporting_component is not None:
        event["reportingComponent"] = reporting_component
    if related is not None:
        event["related"] = related
    return json.dumps(event)


def _events_v1(
    ns: str,
    about: Doc,
    node: str,
    *,
    controller: str = DRIVER,
    deprecated_component: str | None = None,
) -> str:
    """The same in the events.k8s.io/v1 form (regarding, reportingController, and
    deprecatedSource only where `deprecated_component` is given)."""
    event: Doc = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"probe.{uuid.uuid4().hex[:12]}", "namespace": _ns(ns, about)},
        "regarding": about,
        "reason": "Probe",
        "note": "policy probe",
        "type": "Warning",
        "action": "Probe",
        "eventTime": "2026-01-01T00:00:00.000000Z",
        "reportingController": controller,
        "reportingInstance": node,
    }
    if deprecated_component is not None:
        event["deprecatedSource"] = {"component": deprecated_component, "host": node}
    return json.dumps(event)


def _ns(ns: str, about: Doc) -> str:
    return ns if about.get("namespace") else "default"


def _node(name: str) -> Doc:
    return {"apiVersion": "v1", "kind": "Node", "name": name}


def _claim(ns: str, name: str = "some-claim") -> Doc:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "name": name,
            "namespace": ns}  # fmt: skip


def _create(plugin: PluginIdentity, body: str) -> tuple[bool, str]:
    proc = plugin.kubectl("create", "-f", "-", input=body)
    return proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def events_policy(cluster: Any, policy_setup: Any) -> Any:  # noqa: F811
    """The policy setup, once the API server enforces the Events policy."""
    plugin, ns, node_a, node_b = policy_setup

    def denied() -> bool:
        proc = plugin.kubectl(
            "create", "--dry-run=server", "-f", "-",
            input=_core_event(ns, _node(node_b), node_a),
        )  # fmt: skip
        if proc.returncode != 0 and POLICY_NAME in proc.stderr:
            return True
        raise AssertionError(f"exit {proc.returncode}: {proc.stdout} {proc.stderr}")

    cluster.wait_for(denied, timeout=60, what="the Events policy to deny node B's events")
    return policy_setup


def test_plugin_may_not_create_events_about_other_objects(events_policy: Any) -> None:
    plugin, ns, node_a, node_b = events_policy
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "victim", "namespace": ns}
    for about, what in (
        (_node(node_b), f"Node '{node_b}'"),
        (pod, "Pod 'victim'"),
        ({"apiVersion": "v1", "kind": "Secret", "name": "some-claim", "namespace": ns},
         "Secret 'some-claim'"),
    ):  # fmt: skip
        ok, err = _create(plugin, _core_event(ns, about, node_a))
        assert not ok, f"an event about {what} was allowed"
        assert POLICY_NAME in err and f"running on node '{node_a}'" in err, err
        assert f"not about {what.split(' ', 1)[0]}" in err, err


def test_plugin_may_not_report_as_another_node(events_policy: Any) -> None:
    plugin, ns, node_a, node_b = events_policy
    ok, err = _create(plugin, _core_event(ns, _claim(ns), node_b))
    assert not ok and f"reportingInstance '{node_a}', not '{node_b}'" in err, err
    ok, err = _create(plugin, _core_event(ns, _claim(ns), node_a, source_host=node_b))
    assert not ok and f"source host is '{node_a}', not '{node_b}'" in err, err
    ok, err = _create(plugin, _core_event(ns, _claim(ns), node_a, related=_node(node_b)))
    assert not ok and "related object" in err, err


def test_plugin_may_not_report_as_another_component(events_policy: Any) -> None:
    """The reporting component is the driver's name (what the plugin sets, from
    DRIVER_NAME): not "kubelet" or a controller of the control plane. source.component
    may be left out (the reporting component names the reporter then), not
    reportingComponent."""
    plugin, ns, node_a, _ = events_policy
    for about in (_claim(ns), _node(node_a)):
        ok, err = _create(plugin, _core_event(ns, about, node_a, component="kubelet"))
        assert not ok, "an event with source.component 'kubelet' was allowed"
        assert (
            POLICY_NAME in err and f"source.component '{DRIVER}' or none, not 'kubelet'" in err
        ), err
        ok, err = _create(
            plugin,
            _core_event(ns, about, node_a, reporting_component="resourceclaim-controller"),
        )
        assert not ok, "an event with reportingComponent 'resourceclaim-controller' was allowed"
        assert (
            POLICY_NAME in err
            and f"reportingComponent '{DRIVER}', not 'resourceclaim-controller'" in err
        ), err
    ok, err = _create(plugin, _core_event(ns, _claim(ns), node_a, reporting_component=None))
    assert not ok and f"reportingComponent '{DRIVER}', not ''" in err, err
    ok, err = _create(plugin, _core_event(ns, _claim(ns), node_a, component=None))
    assert ok, err


def test_core_events_keep_an_empty_reporting_component(cluster: Any, events_policy: Any) -> None:
    """Why the policy requires reportingComponent and does not fall back to
    source.component: this API server fills in neither from the other (admin, dry run)."""
    _, ns, node_a, _ = events_policy
    out = cluster.kubectl(
        "create", "--dry-run=server", "-o", "json", "-f", "-",
        input=_core_event(ns, _claim(ns), node_a, reporting_component=None),
    ).stdout  # fmt: skip
    stored = json.loads(out)
    assert stored["source"]["component"] == DRIVER
    assert stored.get("reportingComponent", "") == "", stored


def test_plugin_may_create_events_about_its_node_and_claims(events_policy: Any) -> None:
    plugin, ns, node_a, _ = events_policy
    for about in (_node(node_a), _claim(ns)):
        ok, err = _create(plugin, _core_event(ns, about, node_a))
        assert ok, err


def test_the_plugins_own_events_pass(cluster: Any, events_policy: Any) -> None:
    """NodeEvents and ClaimFailureReporter, run with the plugin's token, post their
    Events (the claim's in its namespace, the Node's in `default`)."""
    from driver.errors import invalid_config
    from driver.kube.api import KubeApi
    from driver.kube.claims import ClaimFailureReporter
    from driver.kube.kube_events import EVENT_NAMESPACE, NodeEvent, NodeEvents

    plugin, ns, node_a, _ = events_policy
    api = KubeApi.from_kubeconfig(str(plugin.kubeconfig))
    node_events = NodeEvents(api, driver="gpu.example.com", node_name=node_a)
    api.request(
        "POST",
        f"/api/v1/namespaces/{EVENT_NAMESPACE}/events",
        body=node_events.body(NodeEvent("GpuTainted", "probe")),
    )
    claim = {"metadata": {"name": "failed-claim", "namespace": ns, "uid": str(uuid.uuid4())}}
    reporter = ClaimFailureReporter(api, driver="gpu.example.com", node_name=node_a,
                                    device_status=False)  # fmt: skip
    reporter.permanent_failure(claim, invalid_config("bad parameters"))  # logs, never raises
    out = cluster.kubectl("get", "events", "-n", ns, "-o", "json").stdout
    names = {e["involvedObject"]["name"] for e in json.loads(out)["items"]}
    assert "failed-claim" in names


def test_events_k8s_io_form_is_judged_the_same(cluster: Any, events_policy: Any) -> None:
    """Were the plugin granted events.k8s.io (a Role in this test's namespace only),
    the `regarding` form is held to the same rules."""
    plugin, ns, node_a, node_b = events_policy
    sa = f"system:serviceaccount:{ns}:gpu-dra-driver-kubeletplugin"
    cluster.kubectl("create", "role", "events-v1", "-n", ns, "--verb=create",
                    "--resource=events.events.k8s.io")  # fmt: skip
    cluster.kubectl("create", "rolebinding", "events-v1", "-n", ns, "--role=events-v1",
                    f"--user={sa}")  # fmt: skip
    cluster.wait_for(
        lambda: plugin.kubectl("auth", "can-i", "create", "events.events.k8s.io", "-n", ns)
        .stdout.strip() == "yes",
        what="the test Role",
    )  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "victim", "namespace": ns}
    ok, err = _create(plugin, _events_v1(ns, pod, node_a))
    assert not ok and POLICY_NAME in err and "not about Pod 'victim'" in err, err
    ok, err = _create(plugin, _events_v1(ns, _claim(ns), node_b))
    assert not ok and f"not '{node_b}'" in err, err
    ok, err = _create(plugin, _events_v1(ns, _claim(ns), node_a, controller="kubelet"))
    assert not ok and POLICY_NAME in err, err
    assert f"reportingController '{DRIVER}', not 'kubelet'" in err, err
    ok, err = _create(plugin, _events_v1(ns, _claim(ns), node_a, controller=f"{DRIVER}/x"))
    assert not ok and f"reportingController '{DRIVER}', not '{DRIVER}/x'" in err, err
    # deprecatedSource never reaches the policy: API validation of events.k8s.io/v1
    # refuses it ("needs to be unset"), whatever its component.
    for component in ("resourceclaim-controller", DRIVER):
        ok, err = _create(
            plugin, _events_v1(ns, _claim(ns), node_a, deprecated_component=component)
        )
        assert not ok and "needs to be unset" in err, err
    ok, err = _create(plugin, _events_v1(ns, _claim(ns), node_a))
    assert ok, err
