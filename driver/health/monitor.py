"""The health monitor thread: NVML health events -> health store -> slice republish
(docs/health.md, "Events and classification").

`HealthMonitor` waits on NVML events through the backend with a short timeout
(100 ms by default, so an event becomes a published taint quickly and shutdown is
prompt; the plugin passes its backend's `event_wait_ms`: 20 ms over the mock, whose
injected events arrive as control requests taken between waits), classifies each
event (`XidPolicy`), records fatal ones in the `HealthStore`, clears a GPU on
`recovered`, and asks the slice publisher to republish. It never dies: any exception
is logged and followed by a short backoff; an event set that failed is reopened.

A fatal Xid NVML attributes to a MIG GPU instance fails that instance only: the
monitor asks NVML for the GPU's live instances (`MigManager.instances`) at that
moment, since in dynamic MIG mode a GPU-instance ID means a placement only while
that partition exists, and records the failure under the instance's placement. If
the instance is gone already (or the lookup fails), the whole GPU is failed: a
fatal error must never be dropped for want of an address.

The monitor also applies the plugin's control requests (`control`:
`driver.health.control_queue`) before every event wait, and refuses those still pending
on `stop()`. With `node_events`, every change of a GPU's taints is also an Event on the
Node (`driver.health.node_events`). The per-GPU metrics (`driver.health.gpu_metrics`) are
labelled with each GPU's UUID and name (`gpu_names`; by default the names of the
published whole-GPU devices).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from driver.health.clear import ClearAction, Publisher
from driver.health.control_queue import ControlQueue, Handler
from driver.health.gpu_metrics import GpuHealthMetrics, published_gpu_names, tainted_device_names
from driver.health.node_events import EventSink, TaintEvents
from driver.health.recovery_taints import RecoveryActions, RecoveryChange, recovery_event
from driver.health.store import Devices, HealthStore, Placement, device_list
from driver.health.unmonitored import UnmonitoredGpus
from driver.health.xid import Verdict, XidPolicy, attributed_instance
from driver.nvml.discovered import HealthEvent, MigInstance
from driver.observability import metrics

log = logging.getLogger(__name__)

DEFAULT_WAIT_TIMEOUT_MS = 100
MAX_BACKOFF = 5.0  # seconds between tries while every iteration fails
ECC_DBE_XID = 48  # NVIDIA's Xid for a double-bit ECC error


class EventSource(Protocol):
    """What the monitor needs of `NvmlBackend`."""

    def open_event_set(self) -> None: ...
    def wait_event(self, timeout_ms: int) -> HealthEvent | None: ...
    def close_event_set(self) -> None: ...

    @property
    def unmonitored(self) -> dict[str, str]: ...


MigInstances = Callable[[str], Iterable[MigInstance]]  # GPU UUID -> its live GPU instances
RECOVERED_CAUSE = "NVML reported the GPU recovered"
RECORDED_CAUSE = "a new failure was recorded"  # a record never removes a taint


class NodeEventSink(EventSink, Protocol):
    """`driver.kube.kube_events.NodeEvents`, started and stopped with the monitor."""

    def start(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...


def backend_mig_instances(backend: object) -> MigInstances | None:
    """`backend.mig().instances` for an `NvmlBackend`; None for a source without MIG."""
    mig = getattr(backend, "mig", None)
    if not callable(mig):
        return None
    return lambda gpu_uuid: mig().instances(gpu_uuid)


class HealthMonitor:
    THREAD_NAME = "health-monitor"

    def __init__(
        self,
        backend: EventSource,
        store: HealthStore,
        policy: XidPolicy,
        publisher: Publisher | None,
        devices: Devices = (),
        *,
        node_name: str = "",
        control_actions: Mapping[str, Handler] | None = None,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
        pollers: Sequence[Callable[[], object]] = (),
        error_backoff: float = 0.5,
        mig_instances: MigInstances | None = None,
        gpu_names: Mapping[str, str] | None = None,
        node_events: NodeEventSink | None = None,
        driver: str | None = None,
        taint_effect: str = "NoSchedule",
        recovery: RecoveryActions | None = None,
        unmonitored: UnmonitoredGpus | None = None,
    ) -> None:
        if not 0 < wait_timeout_ms <= 1000:
            raise ValueError("wait_timeout_ms must be in 1..1000")
        self._backend = backend
        # The live GPU instances of a GPU, to place an Xid attributed to one of them.
        self._mig_instances = (
            mig_instances if mig_instances is not None else backend_mig_instances(backend)
        )
        self._store = store
        self._policy = policy
        self._publisher = publisher
        self._devices = device_list(devices)
        self._gpu_metrics = GpuHealthMetrics(
            gpu_names if gpu_names is not None else published_gpu_names(self._devices)
        )
        self._recovery = recovery
        self._unmonitored = unmonitored
        self._driver = driver or store.driver
        self._node_events = node_events
        self._taint_events = (
            None
            if node_events is None
            else TaintEvents(
                node_events,
                store,
                self._devices,
                driver=self._driver,
                effect=taint_effect,
                gpu_names=self._gpu_metrics.gpu_names,
                recovery=recovery,
            )
        )
        # How long one NVML event wait may take; control requests are taken between.
        self.wait_timeout_ms = wait_timeout_ms
        self._pollers = list(pollers)
        # The control requests (`gpu-dra health clear`, `gpu-dra mock ...`), taken on
        # every wait.
        self.control = ControlQueue(node_name=node_name)
        ClearAction(
            store,
            self._devices,
            publisher,
            on_change=self._update_gauge,
            taint_events=self._taint_events,
            recovery=recovery,
        ).register_on(self.control)
        self.control.register_all(control_actions or {})
        self._pollers.append(self.control.poll)
        self._error_backoff = self._backoff = error_backoff
        self._opened = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.events_handled = 0
        self.errors = 0
        self._update_gauge()

    def add_poller(self, poller: Callable[[], object]) -> None:
        """Called on every event wait, like `pollers` (before `start`)."""
        if self._thread is not None:
            raise RuntimeError("health monitor already started")
        self._pollers.append(poller)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("health monitor already started")
        log.info("health monitor: %s", self._policy.describe())
        if self._node_events is not None:
            self._node_events.start()
        self._thread = threading.Thread(target=self._run, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("health monitor did not stop within %.1fs", timeout)
        self._close()
        self.control.close()
        if self._node_events is not None:
            self._node_events.stop(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_once()
                self._backoff = self._error_backoff
            except Exception:
                self.errors += 1
                log.exception("health monitor: error; retrying in %.1fs", self._backoff)
                self._close()
                self._stop.wait(self._backoff)
                self._backoff = min(self._backoff * 2, MAX_BACKOFF)
        self._close()

    def _close(self) -> None:
        if self._opened:
            self._opened = False
            with contextlib.suppress(Exception):
                self._backend.close_event_set()

    # -- one iteration -----------------------------------------------------------------

    def run_once(self) -> HealthEvent | None:
        """Run the pollers, wait up to the timeout for one event and handle it."""
        for poll in self._pollers:
            try:
                poll()
            except Exception:
                log.exception("health monitor: poller %r failed", poll)
        if not self._opened:
            self._backend.open_event_set()
            self._opened = True
            unmonitored = self._unmonitored
            changed = unmonitored is not None and unmonitored.update(self._backend.unmonitored)
            if changed and self._publisher is not None:
                self._publisher.trigger()
        event = self._backend.wait_event(self.wait_timeout_ms)
        if event is not None:
            self.handle(event)
        return event

    def handle(self, event: HealthEvent) -> bool:
        """Apply one event to the store; True when a taint was added, changed or cleared."""
        self.events_handled += 1
        if event.kind == "recovered":
            metrics.XID_EVENTS.labels(xid="recovered", verdict="recovered").inc()
            with self._taint_changes(event.gpu_uuid, RECOVERED_CAUSE):
                changed = self._store.clear(event.gpu_uuid)
        else:
            verdict = self._policy.classify(event)
            label = str(event.xid) if event.kind == "xid" else event.kind
            metrics.XID_EVENTS.labels(xid=label, verdict=verdict.value).inc()
            if event.kind in ("xid", "ecc-dbe"):
                self._gpu_metrics.count_xid(event.gpu_uuid, verdict.value)
            if verdict is Verdict.IGNORED:
                log.info(
                    "GPU %s: %s ignored (%s)",
                    event.gpu_uuid,
                    event.message or label,
                    "application Xid" if event.kind == "xid" else event.kind,
                )
                return False
            with self._taint_changes(event.gpu_uuid, RECORDED_CAUSE):
                changed = self._record(event)
        if changed:
            self._update_gauge()
            if self._publisher is not None:
                self._publisher.trigger()
        return changed

    def _taint_changes(self, gpu_uuid: str, cause: str) -> contextlib.AbstractContextManager[None]:
        if self._taint_events is None:
            return contextlib.nullcontext()
        return self._taint_events.change(gpu_uuid, cause)

    def _record(self, event: HealthEvent) -> bool:
        """Records a fatal event; True when the store changed."""
        uuid = event.gpu_uuid
        if event.kind == "gpu-lost":
            return self._store.record_lost(uuid, event.message)
        if event.kind == "ecc-dbe":
            return self._store.record_xid(
                uuid, ECC_DBE_XID, event.message or "double-bit ECC error"
            )
        xid = event.xid if event.xid is not None else 0
        gi = attributed_instance(event)
        if gi is None:
            return self._store.record_xid(uuid, xid, event.message)
        placement = self._placement_of(uuid, gi)
        if isinstance(placement, str):
            return self._store.record_xid(
                uuid, xid, f"attributed to GPU instance {gi}, {placement}"
            )
        return self._store.record_instance_xid(
            uuid,
            placement,
            xid,
            event.message,
            gpu_instance_id=gi,
            compute_instance_id=event.compute_instance_id,
        )

    def _placement_of(self, gpu_uuid: str, gi_id: int) -> Placement | str:
        """The placement of the GPU's live GPU instance `gi_id`, or why it is unknown
        (logged; the caller fails the whole GPU)."""
        if self._mig_instances is None:
            why = "but GPU instances cannot be listed here"
        else:
            try:
                instances = list(self._mig_instances(gpu_uuid))
            except Exception as err:
                why = f"whose GPU instances could not be listed ({err})"
            else:
                for instance in instances:
                    if instance.gi_id == gi_id:
                        return instance.placement
                live = ", ".join(str(i.gi_id) for i in instances) or "none"
                why = f"which no longer exists (live: {live})"
        log.warning(
            "GPU %s: Xid attributed to GPU instance %d, %s: failing the whole GPU",
            gpu_uuid,
            gi_id,
            why,
        )
        return why

    def recovery_changed(self, change: RecoveryChange) -> None:
        """A GPU's recovery action appeared, changed or went (`RecoveryPoller`'s
        `on_change`): the metrics, a Node event, and the kubelet's health stream."""
        self._update_gauge()
        self._store.note_change()
        if self._node_events is None or self._recovery is None:
            return
        uuid = change.gpu_uuid
        name = self._gpu_metrics.gpu_names.get(uuid, uuid)
        event = recovery_event(
            change,
            self._recovery.device_names(uuid),
            gpu=f"{name} ({uuid})",
            driver=self._driver,
        )
        if event is not None:
            self._node_events.post(event)

    def _update_gauge(self) -> None:
        tainted = tainted_device_names(self._store, self._devices, self._recovery)
        metrics.TAINTED_DEVICES.set(len(tainted))
        self._gpu_metrics.update(self._store, self._recovery)
