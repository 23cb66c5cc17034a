"""KEP-5322 end to end: what the node's kubelet does with the driver's
`error_type = Permanent` (docs/kep-5322.md).

The kubelet under test is found out from its own metrics
(`kubernetes_feature_enabled{name="DRAHandlePermanentDriverFailures"}`):

- the KEP-5322 prototype with the gate on (`GPU_DRA_KEP5322_KUBELET=1`): a pod whose
  claim gets Permanent goes Failed at once, with no further NodePrepareResources for it,
  and its claim is unprepared; a Deployment's replacement fails again for an invalid
  config, and runs on another GPU when the allocated one failed (device-failed, the
  driver tainted it); an error without `error_type` (a driver that does not classify,
  or a Transient one) is still retried;
- the upstream kubelet, or the prototype with the gate off
  (`GPU_DRA_KEP5322_KUBELET=1 GPU_DRA_KEP5322_GATE=false`): today's behaviour, the pod
  stays Pending while the kubelet retries.

The kubelet's calls per claim are counted in the plugin's log (one
`NodePrepareResources: <namespace>/<claim>` line per call).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import DEMO, E2E, NAMESPACE, install_chart, wait_for

GATE = "DRAHandlePermanentDriverFailures"
REASON = "DRAPermanentDriverFailure"
PERMANENT = DEMO / "scenarios" / "permanent-error.yaml"
NS = "gpu-demo-permanent-error"
DEPLOY_NS = "gpu-kep5322-deploy"
# The kubelet resyncs a pod whose prepare failed about once a minute (--sync-frequency):
# a window longer than that shows that no retry came.
NO_RETRY_WINDOW = 75.0


def kubelet_gate(e: E2E) -> bool | None:
    """The gate as the node's kubelet reports it: True/False, or None when the kubelet
    does not know it (upstream)."""
    node = e.get("nodes")["items"][0]["metadata"]["name"]
    metrics = e.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics").stdout
    m = re.search(rf'^kubernetes_feature_enabled{{name="{GATE}"[^}}]*}} (\S+)$', metrics, re.M)
    return None if m is None else float(m.group(1)) == 1.0


@pytest.fixture(scope="module")
def gate_on(e2e: E2E) -> bool:
    gate = kubelet_gate(e2e)
    print(f"\nnode kubelet: {GATE}={'unknown (upstream)' if gate is None else gate}")
    return gate is True


def plugin_log(e: E2E) -> str:
    pod = e.plugin_pod()["metadata"]["name"]
    return e.kubectl("logs", "-n", NAMESPACE, pod, "-c", "plugin", timeout=60).stdout


def prepare_calls(e: E2E, namespace: str, claim: str, *, prefix: bool = False) -> int:
    """NodePrepareResources calls the kubelet made for the claim (the plugin's log), or
    for the claims whose names start with `claim` when `prefix`."""
    return _calls(e, "NodePrepareResources:", namespace, claim, prefix)


def unprepare_calls(e: E2E, namespace: str, claim: str) -> int:
    return _calls(e, "NodeUnprepareResources:", namespace, claim)


def _calls(e: E2E, call: str, namespace: str, claim: str, prefix: bool = False) -> int:
    """Log lines `<call> ns/a, ns/b` that name the claim."""
    wanted = f"{namespace}/{claim}"
    return sum(
        1
        for line in plugin_log(e).splitlines()
        if call in line
        and any(
            c == wanted or (prefix and c.startswith(wanted))
            for c in (c.strip() for c in line.split(call, 1)[1].split(","))
        )
    )


def claim_of(pod: dict[str, Any]) -> str:
    statuses = pod["status"].get("resourceClaimStatuses") or []
    assert statuses and statuses[0].get("resourceClaimName"), pod["status"]
    return str(statuses[0]["resourceClaimName"])


def _created(pod: dict[str, Any]) -> float:
    stamp = str(pod["metadata"]["creationTimestamp"])
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _released(e: E2E, namespace: str, claim: str) -> bool:
    out = e.kubectl(
        "get", "resourceclaim", "-n", namespace, claim, "-o", "json", "--ignore-not-found"
    )
    return not out.stdout.strip() or not json.loads(out.stdout)["status"].get("reservedFor")


def _pod(e: E2E, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = e.get("pod", "-n", namespace, name)
    return pod


@pytest.fixture()
def permanent(e2e: E2E) -> Iterator[E2E]:
    e2e.apply_file(PERMANENT)
    yield e2e
    e2e.delete_file(PERMANENT)


def test_permanent_error_fails_the_pod_when_the_kubelet_handles_it(
    permanent: E2E, gate_on: bool
) -> None:
    e = permanent
    pod = wait_for(
        lambda: (p := _pod(e, NS, "pod0"))["status"].get("resourceClaimStatuses") and p,
        60,
        "pod0's generated claim",
    )
    claim = claim_of(pod)
    created = _created(pod)
    if not gate_on:
        # Today: Pending, and the kubelet calls again (the plugin answers from memory).
        wait_for(lambda: prepare_calls(e, NS, claim) >= 2, 240, f"a second prepare of {claim}")
        pod = _pod(e, NS, "pod0")
        print(f"pod0: phase {pod['status']['phase']}, prepare calls {prepare_calls(e, NS, claim)}")
        assert pod["status"]["phase"] == "Pending"
        return

    pod = wait_for(
        lambda: (p := _pod(e, NS, "pod0"))["status"].get("phase") == "Failed" and p,
        60,
        "pod0 to fail",
    )
    failed_after = time.time() - created
    status = pod["status"]
    print(f"pod0 Failed {failed_after:.1f}s after its creation: {status.get('reason')}")
    print(f"  message: {status.get('message')}")
    # failed at the first answer: no second prepare came before (calls, not seconds)
    assert prepare_calls(e, NS, claim) == 1
    assert status.get("reason") == REASON
    message = str(status.get("message"))
    assert "gpu.example.com" in message and claim in message, message
    assert "permanent (invalid-config)" in message and "64" in message, message

    # The claim is unprepared as for any terminated pod, then released: the claim
    # controller deletes a claim generated for a pod that is done.
    wait_for(lambda: unprepare_calls(e, NS, claim) >= 1, 60, f"NodeUnprepareResources {claim}")
    wait_for(lambda: _released(e, NS, claim), 60, f"{claim} released (deleted or unreserved)")
    # No further NodePrepareResources, for longer than the kubelet's resync period.
    time.sleep(NO_RETRY_WINDOW)
    calls = prepare_calls(e, NS, claim)
    print(
        f"{claim}: {calls} NodePrepareResources, {unprepare_calls(e, NS, claim)} "
        f"NodeUnprepareResources in {time.time() - created:.0f}s"
    )
    assert calls == 1
    assert _pod(e, NS, "pod0")["status"]["phase"] == "Failed"


def _deployment() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(PERMANENT.read_text()) if d]
    template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
    pod = next(d for d in docs if d["kind"] == "Pod")
    template["metadata"]["namespace"] = DEPLOY_NS
    labels = {"app": "kep5322-invalid"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEPLOY_NS}},
        template,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"namespace": DEPLOY_NS, "name": "invalid"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {"metadata": {"labels": labels}, "spec": pod["spec"]},
            },
        },
    ]


@pytest.fixture()
def deployment(e2e: E2E) -> Iterator[E2E]:
    manifest = yaml.safe_dump_all(_deployment())
    e2e.kubectl("apply", "-f", "-", input=manifest)
    yield e2e
    e2e.kubectl("delete", "namespace", DEPLOY_NS, "--wait=true", timeout=300, check=False)


def _pods(e: E2E) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = e.get("pods", "-n", DEPLOY_NS)["items"]
    return items


def test_a_deployment_replacement_is_scheduled_again_and_fails_again(
    deployment: E2E, gate_on: bool
) -> None:
    e = deployment
    if not gate_on:
        pods = wait_for(
            lambda: [p for p in _pods(e) if p["status"].get("resourceClaimStatuses")],
            60,
            "the Deployment's pod and its claim",
        )
        claim = claim_of(pods[0])
        wait_for(lambda: prepare_calls(e, DEPLOY_NS, claim) >= 2, 240, f"a retry of {claim}")
        assert [p["status"]["phase"] for p in _pods(e)] == ["Pending"]
        return

    def failed() -> list[dict[str, Any]] | None:
        pods = [p for p in _pods(e) if p["status"].get("phase") == "Failed"]
        return pods if len(pods) >= 2 else None

    pods = wait_for(failed, 120, "two Failed pods of the Deployment (a replacement failed too)")
    for pod in pods:
        name = pod["metadata"]["name"]
        assert pod["status"].get("reason") == REASON, pod["status"]
        assert pod["spec"].get("nodeName"), name  # scheduled again
        # By claim-name prefix: once the pod is done, the claim controller deletes its
        # claim and may create another one, which status.resourceClaimStatuses then names.
        assert prepare_calls(e, DEPLOY_NS, f"{name}-gpu-", prefix=True) == 1, name
    print(
        "Deployment pods: "
        + ", ".join(
            f"{p['metadata']['name']} {p['status'].get('phase')}/{p['status'].get('reason')}"
            for p in _pods(e)
        )
    )
    # Scale down before the ReplicaSet makes more: nothing slows its replacements.
    e.kubectl("scale", "-n", DEPLOY_NS, "deployment/invalid", "--replicas=0")


UNCLASSIFIED = {"kubeletPlugin": {"permanentErrors": ""}}


@pytest.fixture()
def unclassifying_driver(e2e: E2E) -> Iterator[E2E]:
    """The plugin reinstalled with no permanent class: it answers the same invalid
    config with `error` alone, no field 3 (as a driver without KEP-5322 does, and as
    this one does for a transient error)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(UNCLASSIFIED, f)
    overlay = Path(f.name)
    try:
        install_chart(e2e, overlay)
        e2e.apply_file(PERMANENT)
        yield e2e
    finally:
        e2e.delete_file(PERMANENT)
        install_chart(e2e)
        overlay.unlink()


def test_an_error_without_error_type_is_retried_as_today(unclassifying_driver: E2E) -> None:
    e = unclassifying_driver
    pod = wait_for(
        lambda: (p := _pod(e, NS, "pod0"))["status"].get("resourceClaimStatuses") and p,
        60,
        "pod0's generated claim",
    )
    claim = claim_of(pod)
    wait_for(lambda: prepare_calls(e, NS, claim) >= 2, 240, f"a retry of {claim}")
    pod = _pod(e, NS, "pod0")
    events = e.get("events", "-n", NS, "--field-selector=reason=FailedPrepareDynamicResources")
    messages = [str(ev.get("message", "")) for ev in events["items"]]
    print(f"pod0: phase {pod['status']['phase']}, {prepare_calls(e, NS, claim)} prepare calls")
    assert pod["status"]["phase"] == "Pending"
    assert any("treated as transient" in m for m in messages), messages


XID = DEMO / "scenarios" / "xid-eviction.yaml"
XID_NS = "gpu-demo-xid"
NO_EVICTION = {"kubeletPlugin": {"health": {"xidTaintEffect": "NoSchedule"}}}
MOCK_CLI = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "gpu-dra"
NODE_MARKER = Path("/run/gpu-dra-local-node")


def _kubelet_pid() -> int:
    for line in NODE_MARKER.read_text().splitlines():
        if line.startswith("kubelet_pid="):
            return int(line.split("=", 1)[1])
    raise AssertionError(f"{NODE_MARKER} names no kubelet pid")


def _mock(*args: str) -> None:
    """`gpu-dra mock` on the host: the plugin's status socket is in its data directory,
    a host path, so the injection needs no kubectl exec (which needs the kubelet)."""
    proc = subprocess.run([str(MOCK_CLI), "mock", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture()
def device_failure(e2e: E2E) -> Iterator[E2E]:
    """The plugin with NoSchedule Xid taints (no device-taint eviction: the kubelet's
    prepare is what finds the failure) and the Xid scenario's Deployment, to be applied
    by the test."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(NO_EVICTION, f)
    overlay = Path(f.name)
    try:
        install_chart(e2e, overlay)
        yield e2e
    finally:
        os.kill(_kubelet_pid(), signal.SIGCONT)
        _mock("reset", "--all")
        e2e.delete_file(XID)
        install_chart(e2e)
        overlay.unlink()


def _allocated_device(e: E2E, namespace: str, claim: str) -> str | None:
    status = e.get("resourceclaim", "-n", namespace, claim).get("status") or {}
    results = (status.get("allocation") or {}).get("devices", {}).get("results") or []
    return str(results[0]["device"]) if results else None


def test_a_device_failed_before_prepare_the_replacement_runs_on_another_gpu(
    device_failure: E2E, gate_on: bool
) -> None:
    """The GPU fails between allocation and prepare: the kubelet is paused (SIGSTOP)
    while the scheduler allocates the Deployment's claim, the Xid is injected, then the
    kubelet goes on and prepares."""
    e = device_failure
    kubelet = _kubelet_pid()
    os.kill(kubelet, signal.SIGSTOP)
    try:
        e.apply_file(XID)
        pod = wait_for(
            lambda: next(iter(_with_claims(e, XID_NS)), None), 60, "the trainer pod's claim"
        )
        claim = claim_of(pod)
        gpu = wait_for(lambda: _allocated_device(e, XID_NS, claim), 60, f"{claim} allocated")
        _mock("xid", "--device", gpu, "--xid", "79")
        wait_for(lambda: e.devices()[gpu].get("taints"), 30, f"a taint on {gpu}")
    finally:
        os.kill(kubelet, signal.SIGCONT)
    name = pod["metadata"]["name"]
    print(f"{name}: claim {claim} allocated {gpu}, which failed (Xid 79) before the prepare")
    if not gate_on:
        wait_for(lambda: prepare_calls(e, XID_NS, claim) >= 2, 240, f"a retry of {claim}")
        assert _pod(e, XID_NS, name)["status"]["phase"] == "Pending"
        return

    failed = wait_for(
        lambda: (p := _pod(e, XID_NS, name))["status"].get("phase") == "Failed" and p,
        90,
        f"{name} to fail",
    )
    assert failed["status"].get("reason") == REASON
    assert "permanent (device-failed)" in str(failed["status"].get("message")), failed["status"]
    print(f"  {name}: {failed['status']['reason']}: {failed['status']['message']}")

    def replacement() -> dict[str, Any] | None:
        for p in _with_claims(e, XID_NS):
            if p["metadata"]["name"] != name and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", [])
            ):
                return p
        return None

    new = wait_for(replacement, 180, "a Ready replacement pod")
    new_gpu = _allocated_device(e, XID_NS, claim_of(new))
    print(f"  replacement {new['metadata']['name']} runs on {new_gpu} (was {gpu})")
    assert new_gpu != gpu
    assert prepare_calls(e, XID_NS, claim) == 1


def _with_claims(e: E2E, namespace: str) -> list[dict[str, Any]]:
    return [
        p
        for p in e.get("pods", "-n", namespace)["items"]
        if p["status"].get("resourceClaimStatuses")
    ]
