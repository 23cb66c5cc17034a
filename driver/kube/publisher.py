"""Keeps this node's ResourceSlices equal to what the driver wants to publish.

One pool per node, owned by the Node object, written by one plugin instance at a time:
while `may_write()` is false (a newer instance serves the node during a rolling update,
`driver.plugin.serving_instance`) the publisher writes nothing and its reconciles wait
for a `trigger()`. A watch on the driver's slices of this node triggers a reconcile, so
slices deleted by someone else (the kubelet wipes a node's slices when it starts) come
back by themselves. A reconcile that finds nothing to change writes nothing.

A reconcile compares against the watch's copy of the slices (`driver.kube.slice_watch`)
and, where the change is updates in place (a taint), writes them without listing the
slices first. The periodic resync, a reconcile without a running watch, one that
creates, deletes or starts a new generation, and one whose write met a slice changed
meanwhile list the slices first. Slices are parsed with the plain JSON decoder
(`KubeApi.request(strict=False)`): they hold no free-form fields, and parsing them was
most of the plugin's own work on the path from an Xid to its taint.

Every write is compared with the API server's answer: a field a feature gate keeps
that the server dropped fails the publish, naming the gate (`feature_gates`). Before
the first write of the process, the slices go through a server-side dry run, so a
server without the gates never stores a slice that lost its counters. While the API
server is unreachable, both loops back off and the outage is logged once a minute
(`RetryLog`), not once per attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from driver.kube.api import JSON, ApiError, KubeApi, segment
from driver.kube.feature_gates import DroppedFieldsError, dropped_fields
from driver.kube.slice_compare import comparable_spec, layout, slice_index
from driver.kube.slice_watch import SliceWatch
from driver.observability.logs import RetryLog

log = logging.getLogger(__name__)

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
RESYNC_SECONDS = 300.0
PARALLEL_WRITES = 4
RETRY_SECONDS = 0.5  # first retry of a failed reconcile; doubles up to MAX_RETRY_SECONDS
MAX_RETRY_SECONDS = 10.0
# A server without a feature gate keeps failing until an operator turns it on.
DROPPED_FIELDS_RETRY_SECONDS = 60.0
DRY_RUN = {"dryRun": "All"}


@dataclass
class PublisherStats:
    last_synced: float = 0.0
    errors: list[str] = field(default_factory=list)
    failing: str | None = None  # why the last reconcile failed; None once one succeeded


class SlicePublisher:
    """Reconciles the desired slice specs (from `desired()`) against the API server."""

    def __init__(
        self,
        api: KubeApi,
        *,
        driver: str,
        node_name: str,
        desired: Callable[[], list[JSON]],
        may_write: Callable[[], bool] = lambda: True,
    ) -> None:
        self._api = api
        self._driver = driver
        self._node = node_name
        self._desired = desired
        self._may_write = may_write
        self._node_uid: str | None = None
        self._wake = threading.Condition()
        self._pending = False
        self._stopped = threading.Event()
        self._synced = threading.Condition()
        self._generation_synced = 0
        self._requested = 0
        # Slice name -> (resourceVersion, the desired spec we wrote or verified): a slice
        # nobody touched since is compared with the new desired spec as it is, not
        # re-normalised. (Python equality: the spec builder gives each field one type.)
        self._known: dict[str, tuple[str, JSON]] = {}
        self._watch = SliceWatch(
            api, SLICES_PATH, self._selector(), on_change=self.trigger, stopped=self._stopped
        )
        self._cache = self._watch.cache
        self._dry_run_passed = False
        self._retries = RetryLog(log, "publishing ResourceSlices")
        self.stats = PublisherStats()

    # -- public API --------------------------------------------------------------------

    def start(self) -> None:
        for target, name in (
            (self._reconcile_loop, "slice-reconcile"),
            (self._watch.run, "slice-watch"),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()
        self.trigger()

    def stop(self) -> None:
        self._stopped.set()
        with self._wake:
            self._wake.notify_all()

    def trigger(self) -> int:
        """Asks for a reconcile soon; returns a ticket for `wait_synced`."""
        with self._wake:
            self._requested += 1
            self._pending = True
            self._wake.notify_all()
            return self._requested

    def wait_synced(self, ticket: int, timeout: float) -> bool:
        """Waits until a reconcile that started after `trigger()` returned `ticket` succeeded."""
        deadline = time.monotonic() + timeout
        with self._synced:
            while self._generation_synced < ticket:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped.is_set():
                    return False
                self._synced.wait(remaining)
            return True

    def reconcile(self) -> None:
        """One full reconcile pass, listing the slices (the background thread compares
        against the watch's copy instead, where it has one)."""
        desired = self._desired()
        listing = self._api.request("GET", SLICES_PATH, query=self._selector(), strict=False)
        self._apply(desired, listing.get("items", []))
        self.stats.last_synced = time.time()

    def _reconcile_changes(self) -> None:
        """A reconcile against the watch's copy of the slices, which writes only
        updates in place (each guarded by the resourceVersion it was based on); a full
        one without a copy, for any other change, or when the API server refused a
        write the copy was stale for."""
        cached = self._cache.items()
        if cached is not None:
            desired = self._desired()
            try:
                if self._apply(desired, cached, in_place_only=True):
                    self.stats.last_synced = time.time()
                    return
            except ApiError as err:
                if not (err.conflict or err.not_found):
                    raise
                log.debug("ResourceSlices changed meanwhile (%s): listing them", err)
        self.reconcile()

    # -- reconcile ---------------------------------------------------------------------

    def _reconcile_loop(self) -> None:
        backoff = RETRY_SECONDS
        while not self._stopped.is_set():
            with self._wake:
                resync = False
                while not self._pending and not self._stopped.is_set():
                    if not self._wake.wait(RESYNC_SECONDS):
                        self._pending = resync = True
                if self._stopped.is_set():
                    return
                self._pending = False
                ticket = self._requested
            if not self._may_write():
                continue  # another instance serves the node; trigger() when it is gone
            try:
                if resync:
                    self.reconcile()
                else:
                    self._reconcile_changes()
            except Exception as err:  # the API server may be down: retry, never die
                dropped = isinstance(err, DroppedFieldsError)
                wait = max(backoff, DROPPED_FIELDS_RETRY_SECONDS) if dropped else backoff
                self._retries.failed(err, wait, level=logging.ERROR if dropped else logging.WARNING)
                self.stats.failing = str(err)
                self.stats.errors.append(str(err))
                del self.stats.errors[:-20]
                self._stopped.wait(wait)
                backoff = min(backoff * 2, MAX_RETRY_SECONDS)
                with self._wake:
                    self._pending = True
                continue
            backoff = RETRY_SECONDS
            self.stats.failing = None
            self._retries.succeeded()
            with self._synced:
                self._generation_synced = max(self._generation_synced, ticket)
                self._synced.notify_all()

    def _selector(self) -> dict[str, str]:
        return {"fieldSelector": f"spec.driver={self._driver},spec.nodeName={self._node}"}

    def _apply(
        self, desired: list[JSON], existing: list[JSON], in_place_only: bool = False
    ) -> bool:
        """Writes what differs; False (nothing written) where `in_place_only` and the
        change needs more than updates in place. Nothing either once another instance
        serves the node (checked again here: a reconcile may have begun before)."""
        if not self._may_write():
            return True
        by_index: dict[int, JSON] = {}
        obsolete: list[JSON] = []
        for item in sorted(existing, key=lambda s: s["metadata"]["creationTimestamp"]):
            index = slice_index(item["metadata"]["name"])
            if index is None or index >= len(desired) or index in by_index:
                obsolete.append(item)
            else:
                by_index[index] = item

        generation = max((s["spec"]["pool"]["generation"] for s in existing), default=0)
        changed = [
            i
            for i, spec in enumerate(desired)
            if i not in by_index
            or by_index[i]["spec"]["pool"]["resourceSliceCount"] != len(desired)
            or not self._matches(by_index[i], spec)
        ]
        stale_generation = any(
            s["spec"]["pool"]["generation"] != generation for s in by_index.values()
        )
        if not changed and not obsolete and not stale_generation:
            return True

        # Updates that leave every device and counter set in the slice it was in are
        # written in place at the same generation: each write is atomic, and a reader
        # never sees a device twice or not at all (taints, the common change, touch
        # only the slices of the failed GPU). Anything that moves, adds or removes
        # slices is published as a new generation, rewriting every slice.
        in_place = (
            not obsolete
            and not stale_generation
            and all(
                i in by_index
                and by_index[i]["spec"]["pool"]["resourceSliceCount"] == len(desired)
                and layout(by_index[i]["spec"]) == layout(desired[i])
                for i in changed
            )
        )
        if not in_place:
            if in_place_only:
                return False
            generation += 1
            changed = list(range(len(desired)))

        def with_pool(index: int) -> JSON:
            count = len(desired)
            pool = {"name": self._node, "generation": generation, "resourceSliceCount": count}
            return {**desired[index], "pool": pool}

        if not self._dry_run_passed:
            self._dry_run([with_pool(index) for index in changed])

        for item in obsolete:
            self._delete(item)

        def write(index: int) -> None:
            spec = with_pool(index)
            current = by_index.get(index)
            stored = self._create(index, spec) if current is None else self._update(current, spec)
            meta = stored["metadata"]
            self._known[meta["name"]] = (meta["resourceVersion"], desired[index])
            based_on = None if current is None else current["metadata"]["resourceVersion"]
            self._cache.wrote(stored, based_on)

        if len(changed) == 1:
            write(changed[0])
            return True
        # Slices are independent objects: writing them concurrently is what makes a
        # taint on a GPU whose devices span two slices visible in one round trip.
        with ThreadPoolExecutor(max_workers=PARALLEL_WRITES) as executor:
            list(executor.map(write, changed))
        return True

    def _matches(self, existing: JSON, spec: JSON) -> bool:
        meta = existing["metadata"]
        known = self._known.get(meta["name"])
        if known is not None and known[0] == meta["resourceVersion"]:
            return known[1] == spec
        if comparable_spec(existing["spec"]) != comparable_spec(spec):
            return False
        self._known[meta["name"]] = (meta["resourceVersion"], spec)
        return True

    def _dry_run(self, specs: list[JSON]) -> None:
        """Creates the slices in a server-side dry run (nothing is stored) and checks
        the answers for dropped fields."""
        with ThreadPoolExecutor(max_workers=PARALLEL_WRITES) as executor:
            list(executor.map(self._dry_run_create, specs))
        self._dry_run_passed = True

    def _dry_run_create(self, spec: JSON) -> None:
        body = self._create_body(0, spec)
        answer = self._api.request("POST", SLICES_PATH, query=DRY_RUN, body=body, strict=False)
        self._check_dropped(spec, answer["spec"], f"{body['metadata']['generateName']}* (dry run)")

    def _create_body(self, index: int, spec: JSON) -> JSON:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "generateName": f"{index:05x}-{self._driver}-{self._node}-",
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self._node,
                        "uid": self._owner_uid(),
                        "controller": True,
                    }
                ],
            },
            "spec": spec,
        }

    def _create(self, index: int, spec: JSON) -> JSON:
        body = self._create_body(index, spec)
        created = self._api.request("POST", SLICES_PATH, body=body, strict=False)
        self._check_dropped(spec, created["spec"], created["metadata"]["name"])
        return created

    def _update(self, current: JSON, spec: JSON) -> JSON:
        body = {**current, "spec": spec}
        name = current["metadata"]["name"]
        updated = self._api.request(
            "PUT", f"{SLICES_PATH}/{segment(name)}", body=body, strict=False
        )
        self._check_dropped(spec, updated["spec"], name)
        return updated

    def _delete(self, item: JSON) -> None:
        meta = item["metadata"]
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]},
        }
        try:
            self._api.request("DELETE", f"{SLICES_PATH}/{segment(meta['name'])}", body=body)
        except ApiError as err:
            if err.conflict:
                return
            if not err.not_found:
                raise
        self._cache.deleted(meta["name"])

    @staticmethod
    def _check_dropped(sent: JSON, stored: JSON, name: str) -> None:
        dropped = dropped_fields(sent, stored)
        if dropped:
            raise DroppedFieldsError(name, dropped)

    def _owner_uid(self) -> str:
        if self._node_uid is None:
            node = self._api.request("GET", f"/api/v1/nodes/{segment(self._node)}")
            self._node_uid = str(node["metadata"]["uid"])
        return self._node_uid
