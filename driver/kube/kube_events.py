"""core/v1 Events on this node's Node object (`kubectl describe node`, `kubectl get
events --field-selector involvedObject.kind=Node`).

`post()` never waits for the API server: events go through a bounded queue to one
background thread, so the health monitor, whose thread calls it, keeps handling NVML
events while the API server is slow or down. Visibility is best effort: a full
queue drops the new event, a failed POST is logged and not retried (the taint, which
the slice publisher retries, is what the scheduler acts on).

Events of a cluster-scoped object live in the `default` namespace, as the kubelet's
Node events do; `involvedObject.uid` is the Node's UID (read once; the node name if
that read fails, as the kubelet writes it: `kubectl describe node` finds both).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Final

from driver.kube.api import JSON, KubeApi, segment

log = logging.getLogger(__name__)

EVENT_NAMESPACE: Final = "default"
MAX_MESSAGE: Final = 1024
DEFAULT_QUEUE_SIZE: Final = 64


@dataclass(frozen=True)
class NodeEvent:
    reason: str  # UpperCamelCase, e.g. GpuTainted
    message: str
    event_type: str = "Warning"  # Warning | Normal


class NodeEvents:
    """Posts `NodeEvent`s on one Node from a background thread (`start`/`stop`)."""

    def __init__(
        self, api: KubeApi, *, driver: str, node_name: str, queue_size: int = DEFAULT_QUEUE_SIZE
    ) -> None:
        self._api = api
        self._driver = driver
        self._node = node_name
        self._node_uid: str | None = None
        self._queue: queue.Queue[NodeEvent | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self.posted = 0
        self.dropped = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="node-events", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Posts what is queued (within `timeout`), then stops."""
        if self._thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("node events: %d not posted at shutdown", self._queue.qsize())
        self._thread.join(timeout)
        self._thread = None

    def post(self, event: NodeEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            log.warning("node events: queue full, not posted: %s: %s", event.reason, event.message)

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            try:
                self._api.request(
                    "POST",
                    f"/api/v1/namespaces/{segment(EVENT_NAMESPACE)}/events",
                    body=self.body(event),
                    timeout=10.0,
                )
                self.posted += 1
            except Exception as err:  # best effort; the log has the same text
                log.warning(
                    "could not post the %s event on node %s: %s", event.reason, self._node, err
                )

    def body(self, event: NodeEvent) -> JSON:
        node = {"apiVersion": "v1", "kind": "Node", "name": self._node, "uid": self._uid()}
        reason, message, event_type = event.reason, event.message, event.event_type
        return event_body(node, reason, message, event_type, driver=self._driver, node=self._node)

    def _uid(self) -> str:
        if self._node_uid is None:
            try:
                node = self._api.request("GET", f"/api/v1/nodes/{segment(self._node)}")
                self._node_uid = str(node["metadata"]["uid"])
            except Exception as err:
                log.warning("node events: reading Node %s for its UID: %s", self._node, err)
                return self._node  # retried with the next event
        return self._node_uid


def event_body(
    involved: JSON, reason: str, message: str, event_type: str, *, driver: str, node: str
) -> JSON:
    """A core/v1 Event on the `involved` object, in its namespace (`default` for a
    cluster-scoped one), reported by this node (what the chart's events admission
    policy lets the plugin post)."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{involved['name']}.{uuid.uuid4().hex[:16]}",
            "namespace": involved.get("namespace", EVENT_NAMESPACE),
        },
        "involvedObject": involved,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": event_type,
        "source": {"component": driver, "host": node},
        "reportingComponent": driver,
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
