"""The chart's ValidatingAdmissionPolicy for the plugin's Events (its RBAC `events:
create` is cluster-wide). tests/integration/test_chart_events_policy.py applies it to a
real API server."""

from __future__ import annotations

from test_chart_render import DRIVER, NAMESPACE, Doc, render


def _by_name(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def test_events_policy_binds_the_plugins_events_to_its_node() -> None:
    docs = render()
    vap = _by_name(docs, "ValidatingAdmissionPolicy", "gpu-dra-driver-events")
    spec = vap["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["", "events.k8s.io"] and rule["resources"] == ["events"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE"}
    (cond,) = spec["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:gpu-dra-driver-kubeletplugin" in cond["expression"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    for form in ("object.involvedObject", "object.regarding"):
        assert form in variables["subjectKind"] and form in variables["subjectName"]
    assert "object.source.host" in variables["sourceHost"]
    assert "object.deprecatedSource.host" in variables["sourceHost"]
    exprs = [v["expression"] for v in spec["validations"]]
    assert "variables.aboutOwnNode || variables.aboutClaim" in exprs
    assert "variables.reportingInstance == variables.userNodeName" in exprs
    for form in ("object.reportingComponent", "object.reportingController"):
        assert form in variables["reportingController"]
    for form in ("object.source.component", "object.deprecatedSource.component"):
        assert form in variables["sourceComponent"]
    assert f'variables.reportingController == "{DRIVER}"' in exprs
    assert f"variables.sourceComponent in ['', \"{DRIVER}\"]" in exprs
    binding = _by_name(docs, "ValidatingAdmissionPolicyBinding", "gpu-dra-driver-events")
    assert binding["spec"] == {"policyName": "gpu-dra-driver-events", "validationActions": ["Deny"]}


def test_events_policy_follows_a_renamed_service_account() -> None:
    docs = render("--set", "serviceAccount.name=gpu-plugin", "--set", "fullnameOverride=gpu")
    vap = _by_name(docs, "ValidatingAdmissionPolicy", "gpu-events")
    (cond,) = vap["spec"]["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:gpu-plugin" in cond["expression"]


def test_events_policy_pins_the_component_to_the_driver_name() -> None:
    """The plugin reports its Events as DRIVER_NAME (driver/kube/claims.py, events.py),
    which the chart sets from driverName: the policy follows it."""
    docs = render("--set", "driverName=gpu.acme.io")
    vap = _by_name(docs, "ValidatingAdmissionPolicy", "gpu-dra-driver-events")
    validations = vap["spec"]["validations"]
    exprs = [v["expression"] for v in validations]
    assert 'variables.reportingController == "gpu.acme.io"' in exprs
    assert "variables.sourceComponent in ['', \"gpu.acme.io\"]" in exprs
    messages = [v.get("messageExpression", "") for v in validations]
    assert sum("\\'gpu.acme.io\\'" in m for m in messages) == 2, messages
    assert DRIVER not in str(vap)
