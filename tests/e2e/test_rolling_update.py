"""A rolling update on the real kubelet that changes what the node publishes: the
driver upgraded from the demo values to MPS daemons (`mpsIsolation: "cooperative"` on
the devices of the GPUs with MIG off), with claims that select it created while the
old and the new plugin pod both run (docs/rolling-updates.md).

- The slices carry the new content within a bound taken from this run: a multiple of
  how long the serving plugin takes to publish the whole pool again after its slices
  were deleted. From then on, every sample shows the new content: the old pod never
  puts its own back.
- Every claim is prepared by the instance whose content it was allocated against: a
  claim selecting `mpsIsolation == "cooperative"` can only be allocated against the new
  pod's devices; its containers see the MPS daemon's pipe (only an instance with MPS
  prepares that), the new pod logged its prepare and the old pod prepared none of them.

The measurements are printed: run with `-s` to see them.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from driver.plugin.serving_instance import POLL_SECONDS
from tests.e2e.conftest import DEMO, DRIVER, E2E, NAMESPACE, helm_upgrade, install_chart, wait_for

SELECTOR = "app.kubernetes.io/component=kubeletplugin"
SHARES = DEMO / "mps" / "cooperative-shares.yaml"
NS = "gpu-e2e-rolling"
# The new content must be published within this many baseline publishes.
BOUND_FACTOR = 5
SAMPLE_SECONDS = 0.2


def _mps_flags(e: E2E) -> tuple[float, dict[str, bool]]:
    """Per device: whether it publishes `mpsIsolation: "cooperative"`."""
    devices = e.devices()
    flags = {
        name: d.get("attributes", {}).get("mpsIsolation", {}).get("string") == "cooperative"
        for name, d in devices.items()
    }
    return time.monotonic(), flags


def _readyz(pod: dict[str, Any]) -> int:
    ip = pod["status"].get("podIP")
    if not ip:
        return 0
    try:
        with urllib.request.urlopen(f"http://{ip}:8080/readyz", timeout=2) as resp:
            return int(resp.status)
    except (urllib.error.URLError, OSError):
        return 0


def _plugin_pods(e: E2E) -> dict[str, dict[str, Any]]:
    pods = e.get("pods", "-n", NAMESPACE, "-l", SELECTOR)["items"]
    return {p["metadata"]["name"]: p for p in pods}


def _baseline_publish(e: E2E) -> float:
    """Seconds the serving plugin takes to publish the whole pool again after its
    slices were deleted (its watch sees the deletes; a full reconcile creates them)."""
    before = len(e.devices())
    started = time.monotonic()
    e.kubectl("delete", "resourceslices", f"--field-selector=spec.driver={DRIVER}", "--wait=true")
    wait_for(lambda: len(e.devices()) == before or None, 180, "the pool published again")
    return time.monotonic() - started


def test_an_upgrade_that_changes_an_attribute_publishes_the_new_content_and_prepares_there(
    e2e: E2E,
) -> None:
    e = e2e
    baseline = _baseline_publish(e)
    bound = BOUND_FACTOR * baseline + 2 * POLL_SECONDS
    (old_name,) = list(_plugin_pods(e))
    assert not any(_mps_flags(e)[1].values()), "the demo values publish no mpsIsolation attribute"

    follower = subprocess.Popen(
        [str(e.bin_dir / "kubectl"), "--kubeconfig", str(e.kubeconfig), "logs", "-f",
         "-n", NAMESPACE, old_name, "-c", "plugin", "--since=1s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    old_lines: list[str] = []
    reader = threading.Thread(target=lambda: old_lines.extend(follower.stdout or []), daemon=True)
    reader.start()
    samples: list[tuple[float, dict[str, bool]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(_mps_flags(e))
            stop.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    with tempfile.TemporaryDirectory() as tmp:
        overlay = Path(tmp) / "mps.yaml"
        overlay.write_text(yaml.safe_dump({"kubeletPlugin": {"mps": {"enabled": True}}}))
        sampler.start()
        upgrade = helm_upgrade(e, overlay)  # no --wait: the overlap is what is tested
        assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr

        def new_pod() -> dict[str, Any] | None:
            pods = [p for n, p in _plugin_pods(e).items() if n != old_name]
            return pods[0] if pods and pods[0]["status"].get("phase") == "Running" else None

        new = wait_for(new_pod, 180, "the new plugin pod running beside the old one")
        new_name = new["metadata"]["name"]
        # Claims created during the overlap.
        e.kubectl("apply", "-f", "-", input=SHARES.read_text().replace("gpu-demo-mps", NS))
        registered = wait_for(
            lambda: time.monotonic() if _readyz(new_pod() or new) == 200 else None,
            300,
            "the new plugin pod registered (/readyz 200)",
        )
        assert old_name in _plugin_pods(e), "the overlap ended before the registration"
        e.wait_pods_ready(NS, "app=gpu-demo", 2, timeout=300)
        e.kubectl("rollout", "status", "daemonset", "-n", NAMESPACE, "--timeout=300s")
        time.sleep(2 * bound)  # the old pod is gone: anything it wrote would show by now
        stop.set()
        sampler.join()
        follower.terminate()
        follower.wait(10)
        reader.join(10)

        final = samples[-1][1]
        assert any(final.values()), "no device carries mpsIsolation: cooperative after the upgrade"
        # From the first sample showing the new content, every sample shows it.
        first = next(i for i, (_, flags) in enumerate(samples) if flags == final)
        regressed = [t for t, flags in samples[first:] if flags != final]
        assert not regressed, f"the old content came back {len(regressed)} time(s)"
        converged = max(0.0, samples[first][0] - registered)
        print(
            f"\nbaseline publish {baseline:.2f}s; new content {converged:.2f}s after the new "
            f"pod's registration was seen (bound {bound:.2f}s); {len(samples)} samples, "
            f"{sum(final.values())} of {len(final)} devices mpsIsolation: cooperative"
        )
        assert converged <= bound

        # Prepared by the instance whose content the claims were allocated against.
        claims = [c["metadata"]["name"] for c in e.get("resourceclaims", "-n", NS)["items"]]
        assert len(claims) == 2
        new_log = e.kubectl("logs", "-n", NAMESPACE, new_name, "-c", "plugin").stdout
        for claim in claims:
            assert f"{NS}/{claim}" in new_log, f"the new pod never prepared {claim}"
            # The kubelet may have called the old pod first: each call refused.
            calls = [
                line
                for line in old_lines
                if "NodePrepareResources:" in line and f"{NS}/{claim}" in line
            ]
            refused = [
                line
                for line in old_lines
                if f"prepare {NS}/{claim} failed" in line and "serves this node now" in line
            ]
            assert len(calls) == len(refused), f"the old pod prepared {claim}:\n" + "\n".join(calls)
        for pod in ("pod0", "pod1"):
            env = e.kubectl("exec", "-n", NS, pod, "--", "env").stdout
            assert "CUDA_MPS_PIPE_DIRECTORY=" in env, f"{pod} was prepared without MPS"
    e.kubectl("delete", "namespace", NS, "--wait=true", timeout=300)
    install_chart(e)  # back to the demo values the later tests expect
