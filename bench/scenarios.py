"""The benchmark scenarios, run identically against either plugin.

Everything is timed by the harness from the outside (wall clock around the kubelet's
gRPC call, or from the action to the watch event that shows its effect), so every
plugin is measured the same way. One plugin runs at a time, and each turn starts from a
node without slices, so the node's slices are the running plugin's, whatever its
driver name.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cluster import Api, BenchError, wait_for
from bench.plugins import DRIVER, OursPlugin, PluginUnderTest
from driver.kube.api import ApiError
from tests.integration.kubelet_standin import ClaimRef, KubeletStandin

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NVML_CALLS = "gpu_dra_nvml_calls"
STATE_WRITES = "gpu_dra_state_file_writes"
NS = "gpu-dra-bench"


def device_class(driver: str) -> str:
    """The bench's DeviceClass selecting `driver`'s devices (bench-gpu.example.com)."""
    return f"bench-{driver}"


def percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks of sorted `ordered`."""
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(samples: list[float]) -> dict[str, Any]:
    """n, p50/p99/mean/max in milliseconds, plus the raw samples (seconds)."""
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    return {
        "n": len(samples),
        "p50_ms": round(percentile(ordered, 50) * 1000, 3),
        "p99_ms": round(percentile(ordered, 99) * 1000, 3),
        "mean_ms": round(statistics.fmean(samples) * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
        "samples_s": [round(s, 6) for s in samples],
    }


def load_average() -> dict[str, float]:
    """The machine's load (/proc/loadavg): 1, 5 and 15 minute averages."""
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return {"1m": float(one), "5m": float(five), "15m": float(fifteen)}


# --------------------------------------------------------------------------- slices


class SliceWatcher:
    """Mirrors the node's ResourceSlices (of whichever plugin runs) from a watch;
    waiters get the arrival time of the event that made their predicate true."""

    def __init__(self, api: Api, node: str) -> None:
        self.api = api
        self.node = node
        self.slices: dict[str, dict[str, Any]] = {}
        self.changed_at = 0.0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slice-watch", daemon=True)

    def start(self) -> SliceWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _query(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.nodeName={self.node}"}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                listing = self.api.kube.request("GET", SLICES, query=self._query(), strict=False)
                with self._cond:
                    self.slices = {s["metadata"]["name"]: s for s in listing["items"]}
                    self.changed_at = time.perf_counter()
                    self._cond.notify_all()
                rv = listing["metadata"]["resourceVersion"]
                for kind, obj in self.api.kube.watch(
                    SLICES,
                    query={**self._query(), "resourceVersion": rv},
                    timeout_seconds=60,
                    strict=False,  # a 64-device slice: ~1 ms to parse instead of ~6 ms
                ):
                    now = time.perf_counter()
                    if self._stop.is_set():
                        return
                    if kind == "ERROR":
                        break
                    with self._cond:
                        name = obj["metadata"]["name"]
                        if kind == "DELETED":
                            self.slices.pop(name, None)
                        else:
                            self.slices[name] = obj
                        self.changed_at = now
                        self._cond.notify_all()
            except Exception:  # the API server may restart; re-list
                self._stop.wait(0.2)

    def wait(
        self, predicate: Callable[[list[dict[str, Any]]], Any], timeout: float, what: str
    ) -> float:
        """Waits for `predicate(slices)`; returns the perf_counter time it became true."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if predicate(list(self.slices.values())):
                    return self.changed_at
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"timed out after {timeout}s waiting for {what}")
                self._cond.wait(min(left, 0.5))


def complete_pool(slices: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    if not slices:
        return None
    generation = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == generation]
    if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
        return None
    if len(current) != len(slices):
        return None
    return current


def devices_of(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}


def delete_node_slices(api: Api, node: str) -> None:
    """Every slice of the node, whichever driver published it."""
    api.delete(SLICES, fieldSelector=f"spec.nodeName={node}")
    wait_for(
        lambda: not api.get(SLICES, fieldSelector=f"spec.nodeName={node}")["items"],
        30,
        "the node's slices deleted",
    )


# --------------------------------------------------------------------------- claims


def setup_namespace(api: Api, drivers: tuple[str, ...] = (DRIVER,)) -> None:
    try:
        api.post(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        )
    except ApiError as err:
        if not err.conflict:
            raise
    for driver in drivers:
        try:
            api.post(
                "/apis/resource.k8s.io/v1/deviceclasses",
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": device_class(driver)},
                    "spec": {
                        "selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]
                    },
                },
            )
        except ApiError as err:
            if not err.conflict:
                raise


def allocated_claim(
    api: Api, node: str, name: str, device: str, config: Any = None, driver: str = DRIVER
) -> ClaimRef:
    """A ResourceClaim allocated to `device` of `driver`'s pool on this node.

    The allocation is written into the claim's status directly, as the scheduler would
    (the scheduler's own latency is not what is measured here, and 64 pods would only
    slow the setup down). No reservation and no finalizer: the resourceclaim controller
    leaves such a claim alone.
    """
    path = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"
    api.delete(f"{path}/{name}")
    wait_for(lambda: _absent(api, f"{path}/{name}"), 30, f"old claim {name} deleted")
    spec: dict[str, Any] = {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class(driver)}}]
        }
    }
    allocation: dict[str, Any] = {
        "devices": {
            "results": [{"request": "gpu", "driver": driver, "pool": node, "device": device}]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
            ]
        },
    }
    if config is not None:
        opaque = {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": config}}
        spec["devices"]["config"] = [opaque]
        allocation["devices"]["config"] = [{"source": "FromClaim", **opaque}]
    created = api.post(
        path,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": spec,
        },
    )
    created["status"] = {"allocation": allocation}
    api.put(f"{path}/{name}/status", created)
    return ClaimRef(NS, created["metadata"]["uid"], name)


def _absent(api: Api, path: str) -> bool:
    try:
        api.get(path)
    except ApiError as err:
        return err.not_found
    return False


# --------------------------------------------------------------------------- scenarios


def start_and_publish(
    plugin: PluginUnderTest, gpus: str, api: Api, watcher: SliceWatcher, settle: float = 3.0
) -> tuple[KubeletStandin, dict[str, Any]]:
    """Start the plugin; time until the kubelet registered it and until its complete
    pool is visible in the API; count the ResourceSlice writes it made meanwhile."""
    writes_before = api.slice_writes()
    kubelet = KubeletStandin(plugin.registry_dir, poll_interval=0.005).start()
    plugin.start(gpus)
    registered = kubelet.wait_for_plugin(plugin.driver, timeout=120)
    published_at = watcher.wait(
        lambda s: (p := complete_pool(s)) and devices_of(p), 180, f"{plugin.label}: pool published"
    )
    time.sleep(settle)  # let it finish whatever it still writes
    plugin.check_alive()
    pool = complete_pool(list(watcher.slices.values())) or []
    result = {
        "registered_s": round(registered.registered_at - plugin.spawned_mono, 4),
        "published_s": round(published_at - plugin.spawned_at, 4),
        "slice_writes": api.slice_writes() - writes_before,
        "slices": len(pool),
        "devices": len(devices_of(pool)),
    }
    return kubelet, result


def prepare_single(
    kubelet: KubeletStandin, ref: ClaimRef, n: int, driver: str = DRIVER
) -> dict[str, Any]:
    prep: list[float] = []
    unprep: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        res = kubelet.prepare(driver, [ref])[ref.uid]
        prep.append(time.perf_counter() - t)
        if res.error:
            raise BenchError(f"prepare failed: {res.error}")
        t = time.perf_counter()
        ures = kubelet.unprepare(driver, [ref])[ref.uid]
        unprep.append(time.perf_counter() - t)
        if ures.error:
            raise BenchError(f"unprepare failed: {ures.error}")
    return {"prepare": summary(prep), "unprepare": summary(unprep)}


def prepare_batch(
    kubelet: KubeletStandin, refs: list[ClaimRef], rounds: int, driver: str = DRIVER
) -> dict[str, Any]:
    prep: list[float] = []
    unprep: list[float] = []
    for _ in range(rounds):
        t = time.perf_counter()
        res = kubelet.prepare(driver, refs, timeout=120)
        prep.append(time.perf_counter() - t)
        failed = {uid: r.error for uid, r in res.items() if r.error}
        if failed:
            raise BenchError(
                f"batch prepare failed for {len(failed)} claims: {next(iter(failed.values()))}"
            )
        t = time.perf_counter()
        ures = kubelet.unprepare(driver, refs, timeout=120)
        unprep.append(time.perf_counter() - t)
        if any(r.error for r in ures.values()):
            raise BenchError("batch unprepare failed")
    return {"claims": len(refs), "prepare": summary(prep), "unprepare": summary(unprep)}


def permanent_error_repeats(
    kubelet: KubeletStandin, plugin: OursPlugin, ref: ClaimRef, n: int
) -> dict[str, Any]:
    t = time.perf_counter()
    first = kubelet.prepare(DRIVER, [ref])[ref.uid]
    first_s = time.perf_counter() - t
    if not first.error.startswith("permanent ("):
        raise BenchError(f"expected a permanent error, got {first.error!r}")
    nvml = prepare_path_nvml_calls(plugin)
    writes = plugin.metric(STATE_WRITES)
    samples: list[float] = []
    for _ in range(n):
        t = time.perf_counter()
        again = kubelet.prepare(DRIVER, [ref])[ref.uid]
        samples.append(time.perf_counter() - t)
        if again.error != first.error:
            raise BenchError(f"verdict changed: {again.error!r}")
    kubelet.unprepare(DRIVER, [ref])
    return {
        "first_ms": round(first_s * 1000, 3),
        "repeat": summary(samples),
        "nvml_calls_during_repeats": prepare_path_nvml_calls(plugin) - nvml,
        "state_writes_during_repeats": plugin.metric(STATE_WRITES) - writes,
        "error": first.error[:160],
    }


def prepare_path_nvml_calls(plugin: OursPlugin) -> float:
    """NVML calls made outside the health monitor's thread (its event waits run every
    100 ms whatever prepare does): the gRPC prepare/unprepare path."""
    return plugin.metric(NVML_CALLS, caller="other")


def mig_cycles(
    kubelet: KubeletStandin, plugin: OursPlugin, ref: ClaimRef, n: int
) -> dict[str, Any]:
    """Prepare/unprepare of a dynamic MIG device (instance created at prepare,
    destroyed at unprepare), with the prepare path's NVML calls per cycle."""
    before = prepare_path_nvml_calls(plugin)
    out = prepare_single(kubelet, ref, n)
    out["nvml_calls_per_cycle"] = (prepare_path_nvml_calls(plugin) - before) / n
    return out


def xid_to_taint(
    plugin: OursPlugin, watcher: SliceWatcher, n: int, gpus: int = 8
) -> dict[str, Any]:
    from driver.cli.mock import submit
    from driver.nvml.mock.mock_control import MockRequest

    key = f"{DRIVER}/xid"

    def tainted(device: str) -> Callable[[list[dict[str, Any]]], bool]:
        def check(slices: list[dict[str, Any]]) -> bool:
            d = devices_of(slices).get(device) or {}
            return any(t.get("key") == key for t in d.get("taints") or [])

        return check

    def untainted(device: str) -> Callable[[list[dict[str, Any]]], bool]:
        is_tainted = tainted(device)
        return lambda slices: not is_tainted(slices)

    samples: list[float] = []
    acked: list[float] = []
    for i in range(n):
        device = f"gpu-{i % gpus}"
        t0 = time.perf_counter()
        submit(plugin.data_dir, MockRequest(action="xid", device=device, xid=79), timeout=10)
        acked.append(time.perf_counter() - t0)
        seen = watcher.wait(tainted(device), 30, f"taint on {device}")
        samples.append(max(seen, t0) - t0)
        submit(plugin.data_dir, MockRequest(action="reset", device=device), timeout=10)
        watcher.wait(untainted(device), 30, f"taint removed from {device}")
        watcher.wait(complete_pool, 30, "a complete pool after the reset")
    return {"taint_visible": summary(samples), "injection_acked": summary(acked)}


def resync_writes(
    plugin: PluginUnderTest, api: Api, watcher: SliceWatcher, settle: float = 3.0
) -> dict[str, Any]:
    """A no-change resync: touch a slice (an annotation; the spec is unchanged), which
    makes a watching publisher reconcile; count the slice writes beyond our own."""
    watcher.wait(complete_pool, 60, "a complete pool before the resync")
    time.sleep(1.0)  # let a publisher finish whatever it was doing
    pool = complete_pool(list(watcher.slices.values())) or []
    if not pool:
        raise BenchError("no pool to resync")
    before = api.slice_writes()
    name = pool[0]["metadata"]["name"]
    api.merge_patch(
        f"{SLICES}/{name}",
        {"metadata": {"annotations": {"bench.gpu.example.com/poke": str(time.time())}}},
    )
    time.sleep(settle)
    plugin.check_alive()
    return {"slice_writes": api.slice_writes() - before - 1}


def restart_writes(
    plugin: PluginUnderTest, gpus: str, api: Api, watcher: SliceWatcher, kubelet: KubeletStandin
) -> tuple[KubeletStandin, dict[str, Any]]:
    """Restart with the slices already published: time to registered, writes made."""
    plugin.stop()
    kubelet.wait_for_deregistration(plugin.driver, timeout=30)
    kubelet.stop()
    writes_before = api.slice_writes()
    new_kubelet = KubeletStandin(plugin.registry_dir, poll_interval=0.005).start()
    plugin.start(gpus)
    registered = (
        new_kubelet.wait_for_plugin(plugin.driver, timeout=120).registered_at - plugin.spawned_mono
    )
    time.sleep(4.0)
    plugin.check_alive()
    return new_kubelet, {
        "registered_s": round(registered, 4),
        "slice_writes": api.slice_writes() - writes_before,
    }
