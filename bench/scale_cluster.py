"""API work of the scheduler-scale benchmark: bulk creation, the pod watch, scheduler metrics.

Every write goes through the JSON API from a thread pool (the API server, not this
client, is the bottleneck on a small machine). Times are local monotonic clocks:
a pod's creation is taken just before its POST is sent, its scheduling when the pod
watch delivers it with `spec.nodeName` set (condition timestamps have 1 s resolution).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from bench import scale_objects as obj
from bench.cluster import Api, BenchError, wait_for
from driver.kube.api import ApiError

WORKERS = 8
T = TypeVar("T")
R = TypeVar("R")

PODS = f"/api/v1/namespaces/{obj.NAMESPACE}/pods"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{obj.NAMESPACE}/resourceclaims"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def bulk(fn: Callable[[T], R], items: Iterable[T], workers: int = WORKERS) -> list[R]:
    """fn over items on a thread pool, in order; the first failure is raised."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Published:
    slices: int
    devices: int
    slice_bytes: int
    publish_s: float  # wall time of the slice POSTs alone


def create_nodes(api: Api, names: Sequence[str]) -> list[str]:
    """Ready Node objects (no kubelet); returns their UIDs."""
    status = obj.node_status(_now())

    def create(name: str) -> str:
        node = api.post("/api/v1/nodes", obj.node_document(name))
        api.merge_patch(f"/api/v1/nodes/{name}/status", status)
        # Admission gives a new Node the not-ready taint; without the node-lifecycle
        # controller (no kubelets here) nothing would lift it.
        api.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": None}})
        return str(node["metadata"]["uid"])

    return bulk(create, names)


def publish_slices(
    api: Api, layout: obj.Layout, names: Sequence[str], uids: Sequence[str]
) -> Published:
    fleet = layout.fleet()
    docs = [
        d
        for name, uid in zip(names, uids, strict=True)
        for d in obj.node_slices(layout, name, uid, fleet)
    ]
    started = time.monotonic()
    bulk(lambda d: api.post(SLICES, d), docs)
    elapsed = time.monotonic() - started
    return Published(
        slices=len(docs),
        devices=obj.slice_device_count(docs),
        slice_bytes=sum(len(json.dumps(d)) for d in docs),
        publish_s=elapsed,
    )


@dataclass
class PodWatch:
    """Watches the benchmark namespace's pods; records when each is first seen bound."""

    api: Api
    expected: int
    scheduled_at: dict[str, float] = field(default_factory=dict)
    node_of: dict[str, str] = field(default_factory=dict)
    unschedulable: set[str] = field(default_factory=set)
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        version = self.api.get(PODS)["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, args=(version,), daemon=True)
        self._thread.start()

    def _run(self, version: str) -> None:
        try:
            while not self._stop.is_set() and len(self.scheduled_at) < self.expected:
                query = {"resourceVersion": version, "allowWatchBookmarks": "true"}
                for kind, pod in self.api.kube.watch(PODS, query=query, timeout_seconds=5):
                    seen = time.monotonic()
                    version = pod["metadata"]["resourceVersion"]
                    if kind in ("ADDED", "MODIFIED"):
                        self._record(pod, seen)
                    if len(self.scheduled_at) >= self.expected or self._stop.is_set():
                        break
        except BaseException as err:  # handed to the waiting thread
            self.error = err
        finally:
            self._done.set()

    def _record(self, pod: dict[str, Any], seen: float) -> None:
        name = pod["metadata"]["name"]
        node = pod["spec"].get("nodeName")
        if node and name not in self.scheduled_at:
            self.scheduled_at[name] = seen
            self.node_of[name] = node
        for cond in pod.get("status", {}).get("conditions", []):
            if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                self.unschedulable.add(name)

    def wait(self, timeout: float) -> None:
        self._done.wait(timeout)
        self._stop.set()
        self._done.wait(10)
        if self.error is not None:
            raise BenchError(f"pod watch failed: {self.error}") from self.error


def create_claims(api: Api, layout: obj.Layout, names: Sequence[str]) -> None:
    bulk(lambda n: api.post(CLAIMS, obj.claim_document(layout, n)), names)


def create_pods(api: Api, pods: Sequence[tuple[str, str]], scheduler: str) -> dict[str, float]:
    """POSTs the (pod, claim) pairs; returns each pod's creation time (before its POST)."""

    def create(pair: tuple[str, str]) -> tuple[str, float]:
        sent = time.monotonic()
        api.post(PODS, obj.pod_document(*pair, scheduler))
        return pair[0], sent

    return dict(bulk(create, pods))


def check_allocations(api: Api, expected: int) -> int:
    """Every claim allocated, no device handed out twice; returns the claims checked."""
    claims = api.get(CLAIMS)["items"]
    devices: set[tuple[str, str]] = set()
    for claim in claims:
        name = claim["metadata"]["name"]
        allocation = claim.get("status", {}).get("allocation")
        if not allocation:
            raise BenchError(f"claim {name} is not allocated although its pod is scheduled")
        for result in allocation["devices"]["results"]:
            key = (result["pool"], result["device"])
            if key in devices:
                raise BenchError(f"device {key} allocated twice (claim {name})")
            devices.add(key)
    if len(claims) != expected:
        raise BenchError(f"{len(claims)} claims found, {expected} expected")
    return len(claims)


def delete_pods_and_claims(api: Api, timeout: float = 180) -> None:
    """Pods go at once (grace 0, no kubelet to wait for); claims once the resource-claim
    controller has released them."""
    api.delete(PODS, gracePeriodSeconds="0")
    wait_for(lambda: not api.get(PODS)["items"], timeout, "benchmark pods deleted")
    api.delete(CLAIMS)
    wait_for(lambda: not api.get(CLAIMS)["items"], timeout, "benchmark claims deleted")


def ensure_namespace(api: Api, name: str) -> None:
    try:
        api.post(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
        )
    except ApiError as err:
        if not err.conflict:
            raise
