"""Readiness on the real kubelet: an upgrade whose plugin cannot register stalls with the
old plugin serving (its status socket too, during the stall and after `helm rollback`),
and a registration the kubelet refuses reads as not ready.

The transcript (pods, /readyz, rollout status) is printed: run with `-s` to see it.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import yaml

from driver.plugin.readiness import Readiness
from driver.plugin.transport.registration import RegistrationServicer
from driver.plugin.transport.sockets import SocketPaths
from driver.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from tests.e2e.conftest import (
    DEMO,
    DRIVER,
    E2E,
    NAMESPACE,
    RELEASE,
    demo_namespace,
    helm_upgrade,
    wait_for,
)

REGISTRY = Path("/var/lib/kubelet/plugins_registry")  # the local node's kubelet root
TYPO_REGISTRY = Path("/var/lib/kubelet/plugins_registri")
TEMPLATE = DEMO / "01-resourceclaimtemplate.yaml"
SELECTOR = "app.kubernetes.io/component=kubeletplugin"
# How long the stalled rollout is watched: several readiness periods (5 s each by
# default) after the new pod answered "not ready".
STALL_SECONDS = 30


def _readyz(pod: dict[str, Any]) -> tuple[int, str]:
    url = f"http://{pod['status']['podIP']}:8080/readyz"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", [])
    )


def _plugin_pods(e: E2E) -> dict[str, dict[str, Any]]:
    pods = e.get("pods", "-n", NAMESPACE, "-l", SELECTOR)["items"]
    return {p["metadata"]["uid"]: p for p in pods}


def _show(title: str, text: str) -> None:
    print(f"\n--- {title}\n{text.rstrip()}")


def test_an_upgrade_that_cannot_register_keeps_the_old_plugin_serving(
    e2e: E2E, tmp_path: Path
) -> None:
    e = e2e
    (old,) = [p for p in _plugin_pods(e).values() if _ready(p)]
    status, text = _readyz(old)
    assert status == 200 and text.startswith("ready: registered with the kubelet"), text
    old_uid = old["metadata"]["uid"]

    with _typo(e, tmp_path / "typo.yaml"):

        def new_pod_unready() -> tuple[dict[str, Any], str] | None:
            for uid, pod in _plugin_pods(e).items():
                if uid == old_uid or pod["status"].get("phase") != "Running":
                    continue
                if not pod["status"].get("podIP"):
                    continue
                code, body = _readyz(pod)
                if code == 503 and "has not registered" in body:
                    return pod, body
            return None

        new, body = wait_for(new_pod_unready, 180, "the upgraded plugin pod to answer /readyz")
        assert str(TYPO_REGISTRY) in body and "kubeletRegistrarDirectoryPath" in body
        _show(f"/readyz of the new pod {new['metadata']['name']} (HTTP 503)", body)
        # docs/upgrade.md's command: through the API server's pod proxy, the reason too.
        proxied = e.kubectl(
            "get",
            "--raw",
            f"/api/v1/namespaces/{NAMESPACE}/pods/{new['metadata']['name']}:8080/proxy/readyz/reason",
        ).stdout
        _show("kubectl get --raw .../proxy/readyz/reason", proxied)
        assert proxied.startswith("not ready:") and "kubeletRegistrarDirectoryPath" in proxied
        watched = time.monotonic()
        while time.monotonic() - watched < STALL_SECONDS:
            pods = _plugin_pods(e)
            assert old_uid in pods, "the old plugin pod was removed before the new one was Ready"
            assert pods[old_uid]["metadata"].get("deletionTimestamp") is None
            assert _ready(pods[old_uid])
            assert not _ready(pods[new["metadata"]["uid"]])
            time.sleep(2)
        rollout = e.kubectl(
            "rollout", "status", "daemonset", "-n", NAMESPACE, "--timeout=10s", check=False
        )
        assert rollout.returncode != 0
        _show("kubectl rollout status --timeout=10s", rollout.stdout + rollout.stderr)
        _show("plugin pods", e.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide").stdout)

        # The old plugin still serves the node: pods with claims start, and the status
        # socket on the node is its own (the stalled pod never served, never bound it).
        e.apply_file(TEMPLATE)
        try:
            e.wait_pods_ready(demo_namespace(TEMPLATE), "app=gpu-demo", 2, timeout=180)
        finally:
            e.delete_file(TEMPLATE)
        assert _ready(_plugin_pods(e)[old_uid])
        _assert_status_from(e, old)
    # After `helm rollback` removed the stalled pod, the old one still answers.
    assert old_uid in _plugin_pods(e)
    _assert_status_from(e, old)


def _assert_status_from(e: E2E, pod: dict[str, Any]) -> None:
    """`gpu-dra status` on the node answers from `pod`, which serves the node."""
    name = pod["metadata"]["name"]
    proc = e.kubectl(
        "exec", "-n", NAMESPACE, name, "-c", "plugin", "--", "gpu-dra", "status", "-o", "json",
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"gpu-dra status in {name}: {proc.stdout}{proc.stderr}"
    document = json.loads(proc.stdout)
    instance = document["plugin"]["instance"]
    _show(f"gpu-dra status in {name}: plugin.instance", json.dumps(instance))
    assert instance["holder"].startswith(f"{name} pid "), instance
    assert instance["serving"] is True
    assert document["registration"]["registered"] is True


@contextlib.contextmanager
def _typo(e: E2E, overlay: Path) -> Iterator[None]:
    """helm upgrade with kubeletRegistrarDirectoryPath misspelt, naming a directory
    that exists but the kubelet does not watch (the chart mounts it with hostPath type
    Directory: one that does not exist fails the pod's mount instead, and is never
    created); back to the right values (and a completed rollout) at the end."""
    overlay.write_text(
        yaml.safe_dump({"kubeletPlugin": {"kubeletRegistrarDirectoryPath": str(TYPO_REGISTRY)}})
    )
    TYPO_REGISTRY.mkdir(exist_ok=True)
    try:
        proc = helm_upgrade(e, overlay)  # no --wait: an operator's plain upgrade
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _show("helm upgrade (kubeletRegistrarDirectoryPath typo): exit 0", proc.stdout[-400:])
        try:
            yield
        finally:
            # What the operator runs: back to the previous revision. The old pod is of
            # that revision, so the DaemonSet removes the stalled pod and keeps the old one.
            rollback = e.helm_cmd("rollback", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "5m")
            assert rollback.returncode == 0, rollback.stdout + rollback.stderr
            e.kubectl("rollout", "status", "daemonset", "-n", NAMESPACE, "--timeout=180s")
            wait_for(
                lambda: len(_plugin_pods(e)) == 1 or None, 120, "the stalled plugin pod removed"
            )
    finally:
        for leftover in TYPO_REGISTRY.glob("*"):  # a registration socket of the stalled pod
            leftover.unlink()
        with contextlib.suppress(OSError):
            TYPO_REGISTRY.rmdir()


def test_a_registration_the_real_kubelet_refuses_reads_not_ready(e2e: E2E, tmp_path: Path) -> None:
    """The plugin's registration servicer and readiness check against the real kubelet,
    advertising a DRA service no kubelet knows: the kubelet refuses it."""
    e = e2e
    paths = SocketPaths(REGISTRY / f"{DRIVER}-refusal-test-reg.sock", tmp_path / "dra.sock")
    registration = RegistrationServicer(DRIVER, str(paths.service), ("v0.DRAPlugin",))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reg_grpc.add_RegistrationServicer_to_server(registration, server)
    server.add_insecure_port(f"unix://{paths.registration}")
    server.start()
    try:
        wait_for(lambda: registration.last_error, 60, "the kubelet's verdict on the registration")
        ready, text = Readiness(registration, paths)()
    finally:
        server.stop(0).wait()  # removes the socket: the kubelet forgets it
    _show("readiness of a registration the kubelet refused", text)
    assert not ready
    assert "the kubelet refused the registration:" in text
    assert "none of services supported by the plugin" in text  # the kubelet's own words
    assert e.metric("gpu_dra_kubelet_registered") == 1  # the real plugin is untouched
