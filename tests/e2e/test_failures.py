"""The failure scenarios on the real node: a KEP-5322 permanent error reported through
the kubelet, a critical Xid with NoExecute evicting a running pod, and the plugin's
registration socket deleted under the real kubelet."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import DEMO, DRIVER, E2E, NAMESPACE, demo_namespace, wait_for

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


REGISTRY = Path("/var/lib/kubelet/plugins_registry")  # the local node's kubelet root
TEMPLATE = DEMO / "01-resourceclaimtemplate.yaml"
REREGISTER_BOUND_SECONDS = 10.0  # socket check every 1 s + the kubelet's plugin watcher


def _registration_sockets() -> list[Path]:
    return sorted(p for p in REGISTRY.glob(f"{DRIVER}*-reg.sock") if p.is_socket())


def test_deleted_registration_socket_the_real_kubelet_registers_the_plugin_again(
    e2e: E2E,
) -> None:
    e = e2e
    (socket,) = _registration_sockets()
    recreated = e.metric("gpu_dra_socket_recreations")
    assert e.metric("gpu_dra_kubelet_registered") == 1

    socket.unlink()  # what a cleanup script or an operator's rm does
    deleted = time.monotonic()
    wait_for(
        lambda: e.metric("gpu_dra_socket_recreations") > recreated,
        REREGISTER_BOUND_SECONDS,
        "the plugin to recreate its registration socket",
        interval=0.2,
    )
    wait_for(
        lambda: e.metric("gpu_dra_kubelet_registered") == 1,
        REREGISTER_BOUND_SECONDS,
        "the kubelet to confirm the new registration",
        interval=0.2,
    )
    print(f"registered again {time.monotonic() - deleted:.2f}s after the socket was deleted")
    assert [p.name for p in _registration_sockets()] == [socket.name]

    # Pods with claims start again: the kubelet reaches the plugin through the new socket.
    e.apply_file(TEMPLATE)
    try:
        e.wait_pods_ready(demo_namespace(TEMPLATE), "app=gpu-demo", 2, timeout=180)
    finally:
        e.delete_file(TEMPLATE)


PLUGIN_DIR = Path("/var/lib/kubelet/plugins") / DRIVER
# The prepare journal: its snapshot and the log of the stores since (docs/state.md).
JOURNAL_FILES = (PLUGIN_DIR / "checkpoint.json", PLUGIN_DIR / "checkpoint.log")


def _journal_bytes() -> tuple[bytes, ...]:
    return tuple(path.read_bytes() if path.exists() else b"" for path in JOURNAL_FILES)


def _restarts(e: E2E, namespace: str) -> dict[str, int]:
    pods = e.get("pods", "-n", namespace)["items"]
    return {
        p["metadata"]["name"]: sum(c["restartCount"] for c in p["status"]["containerStatuses"])
        for p in pods
    }


def test_kubelet_restart_registers_again_and_prepares_nothing_twice(e2e: E2E) -> None:
    e = e2e
    namespace = demo_namespace(TEMPLATE)
    e.apply_file(TEMPLATE)
    try:
        e.wait_pods_ready(namespace, "app=gpu-demo", 2, timeout=180)
        journal = _journal_bytes()
        restarts = _restarts(e, namespace)

        restarted = e.script("restart-kubelet", timeout=300)
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        wait_for(
            lambda: e.metric("gpu_dra_kubelet_registered") == 1,
            REREGISTER_BOUND_SECONDS * 6,
            "the restarted kubelet to register the plugin",
            interval=0.5,
        )
        e.wait_pods_ready(namespace, "app=gpu-demo", 2, timeout=120)
        # Running pods kept their containers and their claims' local state: the
        # journal (with any MIG device ids and UUIDs), snapshot and log, is byte for
        # byte the same.
        assert _restarts(e, namespace) == restarts
        assert _journal_bytes() == journal
    finally:
        e.delete_file(TEMPLATE)
    # And the node still prepares new claims through the new kubelet.
    e.apply_file(TEMPLATE)
    try:
        e.wait_pods_ready(namespace, "app=gpu-demo", 2, timeout=180)
    finally:
        e.delete_file(TEMPLATE)


def _idle_gpu(e: E2E) -> str:
    """A whole GPU no claim on the node holds (neither it nor a partition of it)."""
    claims = e.get("resourceclaims", "-A")["items"]
    used = {
        result["device"].split("-mig-")[0].split("-partition-")[0]
        for c in claims
        for result in ((c.get("status") or {}).get("allocation") or {})
        .get("devices", {})
        .get("results", [])
    }
    gpus = sorted(
        (n for n in e.devices() if n.count("-") == 1 and n.startswith("gpu-")),
        key=lambda n: int(n.split("-")[1]),
    )
    idle = [g for g in gpus if g not in used]
    assert idle, f"every GPU is in use: {sorted(used)}"
    return idle[-1]


def test_health_clear_removes_the_taint_through_the_real_plugin(e2e: E2E) -> None:
    """Day-2 on the real node: an Xid taints an idle GPU, `gpu-dra health` in the
    plugin's pod shows it from the store and the ResourceSlice, `gpu-dra health clear`
    removes it from the published slice; the journal is readable meanwhile."""
    e = e2e
    gpu = _idle_gpu(e)
    e.plugin_exec("gpu-dra", "mock", "xid", "--device", gpu, "--xid", "79")
    try:
        wait_for(lambda: e.devices()[gpu].get("taints"), 60, f"a taint on {gpu}")
        shown = json.loads(e.plugin_exec("gpu-dra", "health", "-o", "json").stdout)
        assert shown["slices"]["read"], shown["slices"]
        assert gpu in {t["device"] for t in shown["slices"]["taints"]}
        assert [f["device"] for f in shown["store"]["failures"]] == [gpu]
        assert shown["plugin"]["acceptsClear"] is True

        pod = e.plugin_pod()["metadata"]["name"]
        args = ("exec", "-n", NAMESPACE, pod, "-c", "plugin", "--", "gpu-dra", "health", "clear")
        refused = e.kubectl(*args, gpu, check=False)  # kubectl exec without -i: no terminal
        assert refused.returncode == 1 and "refusing without --yes" in refused.stderr
        assert e.devices()[gpu].get("taints")

        cleared = e.kubectl(*args, gpu, "--yes", check=False)
        assert cleared.returncode == 0, cleared.stderr
        assert "the API server accepted" in cleared.stdout
        assert not e.devices()[gpu].get("taints")  # accepted means published
        after = json.loads(e.plugin_exec("gpu-dra", "health", "-o", "json").stdout)
        assert after["store"]["failures"] == [] and after["consistent"] is True

        journal = e.plugin_exec("gpu-dra", "journal", "show", "-o", "json")
        assert json.loads(journal.stdout)["status"] in ("ok", "absent")
    finally:
        e.plugin_exec("gpu-dra", "mock", "reset", "--device", gpu)
