"""The failure scenarios on the real node: a KEP-5322 permanent error reported through
the kubelet, and a critical Xid with NoExecute evicting a running pod."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import DEMO, E2E, wait_for

PERMANENT = DEMO / "scenarios" / "permanent-error.yaml"
XID = DEMO / "scenarios" / "xid-eviction.yaml"


def _events(e: E2E, namespace: str, reason: str) -> list[str]:
    items = e.get("events", "-n", namespace, f"--field-selector=reason={reason}")["items"]
    return [str(ev.get("message", "")) for ev in items]


@pytest.fixture()
def permanent(e2e: E2E) -> Iterator[E2E]:
    e2e.apply_file(PERMANENT)
    yield e2e
    e2e.delete_file(PERMANENT)


def test_impossible_partition_count_is_permanent(permanent: E2E) -> None:
    e = permanent
    before = e.metric("gpu_dra_permanent_verdict_replays")
    messages = wait_for(
        lambda: [
            m
            for m in _events(e, "gpu-demo-permanent-error", "FailedPrepareDynamicResources")
            if "permanent (invalid-config)" in m
        ],
        120,
        "a FailedPrepareDynamicResources event with 'permanent (invalid-config)'",
    )
    assert "64" in messages[0], messages
    pod = e.get("pod", "-n", "gpu-demo-permanent-error", "pod0")
    assert pod["status"]["phase"] == "Pending"
    # The kubelet retries; the plugin answers from its remembered verdict.
    wait_for(
        lambda: e.metric("gpu_dra_permanent_verdict_replays") > before,
        180,
        "gpu_dra_permanent_verdict_replays to grow (kubelet retries answered from memory)",
        interval=3,
    )
    # A permanent invalid-config never taints the device.
    claim = e.get("resourceclaims", "-n", "gpu-demo-permanent-error")["items"][0]
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    assert not e.devices()[device].get("taints"), e.devices()[device]


def _gpu_of(e: E2E, namespace: str, pod: str) -> str:
    seen = e.container_gpus(namespace, pod, "ctr0")
    assert len(seen.gpus) == 1, seen.log
    return seen.gpus[0]


@pytest.fixture()
def xid(e2e: E2E) -> Iterator[E2E]:
    e2e.apply_file(XID)
    yield e2e
    e2e.plugin_exec("gpu-dra", "mock", "reset", "--all")
    e2e.delete_file(XID)


def test_xid_noexecute_evicts_and_replaces_on_healthy_gpu(xid: E2E) -> None:
    e = xid
    ns = "gpu-demo-xid"
    old = e.wait_pods_ready(ns, "app=gpu-demo-xid", 1)[0]
    old_name = old["metadata"]["name"]
    gpu = _gpu_of(e, ns, old_name)

    e.plugin_exec("gpu-dra", "mock", "xid", "--device", gpu, "--xid", "79")

    def taint() -> list[dict[str, str]] | None:
        return e.devices()[gpu].get("taints") or None

    taints = wait_for(taint, 60, f"a taint on {gpu} in the ResourceSlice")
    assert {"key": "gpu.example.com/xid", "value": "79", "effect": "NoExecute"}.items() <= {
        k: v for k, v in taints[0].items() if k in ("key", "value", "effect")
    }.items(), taints

    def replacement() -> dict | None:
        pods = e.get("pods", "-n", ns, "-l", "app=gpu-demo-xid")["items"]
        if any(
            p["metadata"]["name"] == old_name
            and not p["metadata"].get("deletionTimestamp")
            and p["status"].get("phase") == "Running"
            for p in pods
        ):
            return None
        for p in pods:
            if p["metadata"]["name"] != old_name and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p["status"].get("conditions", [])
            ):
                return p
        return None

    new = wait_for(replacement, 180, f"eviction of {old_name} and a Ready replacement")
    new_gpu = _gpu_of(e, ns, new["metadata"]["name"])
    assert new_gpu != gpu
    assert not e.devices()[new_gpu].get("taints")
