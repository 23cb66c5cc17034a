"""The publisher's watch on the node's ResourceSlices, and its copy of them.

The watch (`SliceWatch.run`, the publisher's `slice-watch` thread) lists the slices,
then follows their changes; a change someone else made (a slice deleted or modified)
asks the publisher for a reconcile. While the API server is unreachable it backs off
and logs the outage once a minute (`RetryLog`).

A reconcile that a change of the desired slices asked for (a new taint) compares
against this copy and writes at once, instead of listing the node's slices first: the
LIST of a node with a few hundred devices is a few hundred kB for the API server to
encode and the plugin to parse, on the path from an Xid to its taint.

Correctness never rests on the copy being current: from the copy the publisher only
updates slices in place, each update carrying the resourceVersion it was based on, so
a stale copy makes the API server refuse the write (409, or 404 for a slice deleted
meanwhile) and the publisher lists and reconciles again; creates, deletes and new
generations always follow a LIST. The copy exists only while the watch runs
(`replace` after its LIST, `invalidate` when the stream ends or fails).

The watch also reports the publisher's own writes back. An event for a version the
copy already holds (stored from the write's answer) triggers nothing; one that
arrives before the answer does, and that reconcile finds nothing to write. The answer
never replaces a version the watch stored after the one the write was based on
(`SliceCache.wrote`): that version is someone else's later write, and the reconcile
it asked for must see it, or the other writer's content would stay until the resync.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from driver.kube.api import JSON, KubeApi
from driver.observability.logs import RetryLog

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0  # doubles while the watch keeps failing, up to the maximum
MAX_RETRY_SECONDS = 30.0


def _version(obj: JSON) -> str:
    return str(obj["metadata"].get("resourceVersion", ""))


class SliceCache:
    """Thread-safe: the watch thread feeds it, the reconcile thread reads and writes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, JSON] | None = None

    def replace(self, items: list[JSON]) -> None:
        """The watch listed the slices: the copy is exactly these."""
        with self._lock:
            self._items = {item["metadata"]["name"]: item for item in items}

    def invalidate(self) -> None:
        """The watch stopped: events may be missed until it lists again."""
        with self._lock:
            self._items = None

    def items(self) -> list[JSON] | None:
        """The slices, or None while no watch keeps the copy current."""
        with self._lock:
            return None if self._items is None else list(self._items.values())

    def observed(self, kind: str, obj: JSON) -> bool:
        """Applies a watch event; False when the copy already showed it (the echo of
        this publisher's own write or delete), True for someone else's change."""
        name = obj["metadata"]["name"]
        with self._lock:
            if self._items is None:
                return True
            current = self._items.get(name)
            if kind == "DELETED":
                return self._items.pop(name, None) is not None
            if current is not None and _version(current) == _version(obj):
                return False
            self._items[name] = obj
            return True

    def wrote(self, stored: JSON, based_on: str | None) -> None:
        """The API server's answer to a create (`based_on` None) or to an update of
        the version `based_on`, kept only while the copy still holds what the write
        replaced (or, for a create, nothing yet): see the module's docstring."""
        name = stored["metadata"]["name"]
        with self._lock:
            if self._items is None:
                return
            current = self._items.get(name)
            if (None if current is None else _version(current)) == based_on:
                self._items[name] = stored

    def deleted(self, name: str) -> None:
        """A slice this publisher deleted (or found gone)."""
        with self._lock:
            if self._items is not None:
                self._items.pop(name, None)


class SliceWatch:
    """Keeps `cache` current from a LIST and a watch; calls `on_change` for a slice
    someone else deleted or modified. `run` until `stopped` is set."""

    def __init__(
        self,
        api: KubeApi,
        path: str,
        selector: dict[str, str],
        *,
        on_change: Callable[[], object],
        stopped: threading.Event,
    ) -> None:
        self._api = api
        self._path = path
        self._selector = selector
        self._on_change = on_change
        self._stopped = stopped
        self._retries = RetryLog(log, "watching ResourceSlices")
        self.cache = SliceCache()

    def run(self) -> None:
        retry = RETRY_SECONDS
        while not self._stopped.is_set():
            try:
                listing = self._api.request("GET", self._path, query=self._selector, strict=False)
                retry = RETRY_SECONDS
                self._retries.succeeded()
                self.cache.replace(listing.get("items", []))
                version = listing["metadata"]["resourceVersion"]
                for kind, obj in self._api.watch(
                    self._path, query={**self._selector, "resourceVersion": version}, strict=False
                ):
                    if self._stopped.is_set():
                        return
                    if kind == "ERROR":
                        break
                    if self.cache.observed(kind, obj) and kind in ("DELETED", "MODIFIED"):
                        name = obj["metadata"]["name"]
                        log.info("ResourceSlice %s %s: reconciling", name, kind.lower())
                        self._on_change()
            except Exception as err:
                self.cache.invalidate()
                self._retries.failed(err, retry)
                self._stopped.wait(retry)
                retry = min(retry * 2, MAX_RETRY_SECONDS)
            else:
                self.cache.invalidate()  # the stream ended; listed again at once
