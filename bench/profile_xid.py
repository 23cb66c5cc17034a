"""Where an Xid's time goes until its taint is visible in the API server:
`python -m bench.profile_xid [--injections N] [--kubeconfig PATH]`.

The plugin's health path in-process (mock NVML over the default fleet, the control
channel, `HealthMonitor`, `HealthStore` on the disk under --dir, `SlicePublisher`,
`NodeEvents`), wired as `driver.plugin.main` wires it, against a private control
plane (hack/local-cluster.sh; run it under `flock /tmp/gpu-dra-e2e.lock`) or the
cluster of --kubeconfig. Each injection is sent as `gpu-dra mock xid` sends it and
timed to the watch event that shows the taint, like the bench's `xid` scenario; the
components are wrapped to stamp each stage:

    spool    request written -> the plugin's control poll injects it
    ack      injected -> the monitor's answer (taken between its 20 ms event waits)
    wake     injected -> the monitor's event wait returns the event
    store    the store's record (the atomic, fsynced write of health.json)
    trigger  store done -> the publisher is triggered (gauges, Node event queued)
    start    trigger -> the reconcile starts (`desired()` called)
    build    `desired()`: taints and the slice specs
    list     the LIST of the node's slices (none where the watch's copy is used)
    compare  the slices built (or listed) -> first PUT sent
    put      the PUT(s) of the changed slice(s): first sent -> last answered
    watch    last PUT answered -> the watch event seen by the measuring thread
    total    request sent -> watch event (the bench's "Xid -> taint visible")

Prints p50 / p99 / max of each in ms, and how many injections listed the slices and
sent two PUTs (a GPU whose devices span two slices). The measuring side shares the process (and the
GIL) with the plugin's threads, which a real plugin does not.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cluster import NODE_NAME, Api, LocalCluster, ensure_node
from bench.scenarios import SliceWatcher, complete_pool, delete_node_slices, devices_of, percentile
from driver.devices.model import build_pool
from driver.devices.slices import build_slice_specs
from driver.health.monitor import HealthMonitor
from driver.health.recovery_taints import RecoveryActions
from driver.health.store import HealthStore
from driver.health.xid import XidPolicy
from driver.kube.api import KubeApi
from driver.kube.kube_events import NodeEvents
from driver.kube.publisher import SLICES_PATH, SlicePublisher
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.mock_control import MockRequest
from driver.nvml.selection import select_backend
from driver.plugin.options.flags import parse_options

DRIVER = "gpu.example.com"
STAGES = (
    "spool",
    "ack",
    "wake",
    "store",
    "trigger",
    "start",
    "build",
    "list",
    "compare",
    "put",
    "watch",
    "total",
)


class Stamps:
    """perf_counter stamps of the current injection, by name (first one wins)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.marks: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def reset(self) -> None:
        with self._lock:
            self.marks = {}
            self.counts = {}

    def mark(self, name: str, when: float | None = None) -> None:
        with self._lock:
            self.marks.setdefault(name, time.perf_counter() if when is None else when)

    def around(self, before: str, after: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.mark(before)
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(after)

        return timed


class TimedApi(KubeApi):
    """Stamps the slice LIST and PUTs of the reconcile."""

    stamps: Stamps | None = None

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        stamps = self.stamps
        if stamps is None or not path.startswith(SLICES_PATH) or method not in ("GET", "PUT"):
            return super().request(method, path, **kwargs)
        kind = "list" if method == "GET" else "put"
        stamps.mark(f"{kind}_sent")
        try:
            return super().request(method, path, **kwargs)
        finally:
            with stamps._lock:  # the last PUT's answer ends the writes
                stamps.marks[f"{kind}_done"] = time.perf_counter()
                stamps.counts[kind] = stamps.counts.get(kind, 0) + 1
                if kind == "list":
                    stamps.marks.setdefault("first_list_done", stamps.marks["list_done"])


def stage_times(m: dict[str, float]) -> dict[str, float]:
    def span(a: str, b: str) -> float:
        return (m[b] - m[a]) * 1000 if a in m and b in m else float("nan")

    return {
        "spool": span("sent", "injected"),
        "ack": span("injected", "acked"),
        "wake": span("injected", "event"),
        "store": span("store_start", "store_done"),
        "trigger": span("store_done", "triggered"),
        "start": span("triggered", "build_start"),
        "build": span("build_start", "build_done"),
        "list": span("list_sent", "first_list_done"),
        "compare": span("first_list_done" if "first_list_done" in m else "build_done", "put_sent"),
        "put": span("put_sent", "put_done"),
        "watch": span("put_done", "visible"),
        "total": span("sent", "visible"),
    }


def run(
    kubeconfig: Path, work: Path, injections: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    admin = Api(kubeconfig)
    ensure_node(admin)
    delete_node_slices(admin, NODE_NAME)
    o = parse_options(
        [
            f"--node-name={NODE_NAME}",
            f"--kubeconfig={kubeconfig}",
            f"--kubelet-registrar-directory-path={work / 'registry'}",
            f"--kubelet-plugins-directory-path={work / 'plugins'}",
            f"--cdi-root={work / 'cdi'}",
            "--nvml-backend=mock",
        ]
    )
    o.data_dir.mkdir(parents=True, exist_ok=True)
    stamps = Stamps()
    api = TimedApi.from_kubeconfig(str(kubeconfig))
    assert isinstance(api, TimedApi)
    backend = select_backend(
        mock=True, node_name=NODE_NAME, mock_driver_root=o.plugin_mock_driver_root
    )
    pool = build_pool(backend.discover(), o.pool_options())
    devices = {device.name: device for device in pool.devices}
    store = HealthStore(o.data_dir / "health.json")
    recovery = RecoveryActions(devices, driver=o.driver_name)

    def desired() -> list[dict[str, object]]:
        taints = store.device_taints(devices, driver=o.driver_name, effect=o.xid_taint_effect)
        taints = recovery.add_taints(taints)
        return build_slice_specs(pool, driver=o.driver_name, node_name=NODE_NAME, taints=taints)

    publisher = SlicePublisher(
        api,
        driver=o.driver_name,
        node_name=NODE_NAME,
        desired=stamps.around("build_start", "build_done", desired),
    )
    publisher.trigger = stamps.around("triggered", "triggered_return", publisher.trigger)  # type: ignore[method-assign]
    store.record_xid = stamps.around("store_start", "store_done", store.record_xid)  # type: ignore[method-assign]
    assert isinstance(backend, MockBackend)
    mock = backend.mock_module
    mock.inject = stamps.around("injected", "injected_return", mock.inject)  # type: ignore[method-assign]
    wait_event = backend.wait_event

    def timed_wait(timeout_ms: int) -> Any:
        event = wait_event(timeout_ms)
        if event is not None:
            stamps.mark("event")
        return event

    backend.wait_event = timed_wait  # type: ignore[method-assign]
    monitor = HealthMonitor(
        backend,
        store,
        XidPolicy.from_flags(),
        publisher,
        devices,
        node_name=NODE_NAME,
        control_actions=backend.control_actions(devices),
        wait_timeout_ms=backend.event_wait_ms,
        node_events=NodeEvents(api, driver=o.driver_name, node_name=NODE_NAME),
        driver=o.driver_name,
        taint_effect=o.xid_taint_effect,
        recovery=recovery,
    )
    watcher = SliceWatcher(admin, NODE_NAME).start()
    publisher.start()
    monitor.start()
    key = f"{DRIVER}/xid"

    def inject(request: MockRequest) -> None:
        """As the status socket hands `gpu-dra mock` a request: the monitor applies it
        on its thread and answers."""
        monitor.control.submit(request.action, request.to_document(), timeout=10)

    def tainted(device: str, want: bool) -> Callable[[list[dict[str, Any]]], bool]:
        def check(slices: list[dict[str, Any]]) -> bool:
            taints = (devices_of(slices).get(device) or {}).get("taints") or []
            return any(t.get("key") == key for t in taints) == want

        return check

    samples: dict[str, list[float]] = {stage: [] for stage in STAGES}
    counts = {"listed": 0, "two PUTs": 0}
    try:
        watcher.wait(complete_pool, 60, "the published pool")
        for i in range(injections):
            device = f"gpu-{i % 8}"
            stamps.reset()
            api.stamps = stamps
            stamps.mark("sent")
            inject(MockRequest(action="xid", device=device, xid=79))
            stamps.mark("acked")
            stamps.mark("visible", watcher.wait(tainted(device, True), 30, f"taint on {device}"))
            api.stamps = None
            for stage, value in stage_times(stamps.marks).items():
                samples[stage].append(value)
            counts["listed"] += stamps.counts.get("list", 0) > 0
            counts["two PUTs"] += stamps.counts.get("put", 0) > 1
            inject(MockRequest(action="reset", device=device))
            watcher.wait(tainted(device, False), 30, f"taint removed from {device}")
            watcher.wait(complete_pool, 30, "a complete pool after the reset")
            time.sleep(0.05)  # let the reconcile the watch triggers finish
    finally:
        monitor.stop()
        publisher.stop()
        watcher.stop()
    return samples, counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--injections", type=int, default=40)
    p.add_argument("--kubeconfig", type=Path, help="a running cluster (default: start one)")
    p.add_argument("--dir", type=Path, help="the plugin's directories (default: a temp dir)")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    work = Path(tempfile.mkdtemp(prefix="profile-xid-", dir=args.dir))
    cluster = None if args.kubeconfig else LocalCluster.start()
    try:
        kubeconfig = args.kubeconfig or (cluster.kubeconfig if cluster else None)
        assert kubeconfig is not None
        samples, counts = run(kubeconfig, work, args.injections)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'stage':10} {'p50':>8} {'p99':>8} {'max':>8}  ms, n={args.injections}")
    for stage, values in samples.items():
        ordered = sorted(v for v in values if v == v)
        if not ordered:
            print(f"{stage:10} {'-':>8}")
            continue
        p50, p99 = percentile(ordered, 50), percentile(ordered, 99)
        print(f"{stage:10} {p50:8.1f} {p99:8.1f} {ordered[-1]:8.1f}")
    print(", ".join(f"{what}: {n}" for what, n in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
