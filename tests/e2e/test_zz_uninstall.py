"""Registration through the kubelet's plugin watcher, then `helm uninstall`: the driver's
ResourceSlices go away and no CDI spec stays behind. Runs last (file name): it removes
the driver that the other e2e tests use."""

from __future__ import annotations

import time
from pathlib import Path

from tests.e2e.conftest import DRIVER, E2E, NAMESPACE, RELEASE, wait_for

REGISTRY = Path("/var/lib/kubelet/plugins_registry")
CDI_ROOT = Path("/var/run/cdi")


def _registration_sockets() -> list[Path]:
    return sorted(REGISTRY.glob(f"{DRIVER}*.sock")) if REGISTRY.is_dir() else []


def _cdi_files() -> list[Path]:
    return sorted(CDI_ROOT.glob(f"k8s.{DRIVER}-*")) if CDI_ROOT.is_dir() else []


def test_plugin_registered_through_plugin_watcher(e2e: E2E) -> None:
    assert _registration_sockets(), f"no {DRIVER} registration socket in {REGISTRY}"
    node = e2e.get("nodes")["items"][0]["metadata"]["name"]
    slices = e2e.slices()
    assert slices and all(s["spec"]["nodeName"] == node for s in slices)
    assert all(s["metadata"]["ownerReferences"][0]["kind"] == "Node" for s in slices)
    # Published devices: 22 GPUs of values-demo.yaml and their MIG partitions.
    names = set(e2e.devices())
    assert {f"gpu-{i}" for i in range(22)} <= names


def test_uninstall_removes_slices_and_cdi_files(e2e: E2E) -> None:
    # No workloads may hold claims any more (the other modules cleaned up theirs).
    wait_for(
        lambda: not e2e.get("resourceclaims", "-A")["items"] or None,
        180,
        "all ResourceClaims gone before uninstalling",
    )
    proc = e2e.helm_cmd("uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "3m")
    assert proc.returncode == 0, proc.stderr
    e2e.installed = False
    wait_for(
        lambda: not e2e.get("pods", "-n", NAMESPACE)["items"] or None,
        120,
        "plugin pods gone",
    )
    # The kubelet deletes a deregistered driver's slices after its 30 s grace period.
    t0 = time.monotonic()
    wait_for(lambda: not e2e.slices() or None, 90, f"no ResourceSlices of {DRIVER}")
    print(f"\nslices gone {time.monotonic() - t0:.0f}s after the plugin pods")
    assert not _registration_sockets()
    assert not _cdi_files(), f"CDI files left behind: {_cdi_files()}"
    assert e2e.kubectl("get", "deviceclass", DRIVER, check=False).returncode != 0
