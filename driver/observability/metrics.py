"""Prometheus metrics of the kubelet plugin, in one registry.

Every label value known before the first event has its series from the start, at 0
(`rate()` and `increase()` need a series to exist before it grows): the outcomes,
error classes, sockets and request kinds here; the per-GPU series once discovery
named the GPUs (`HealthMonitor`, `driver.plugin.node_status.export_gpus`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from driver.errors import ErrorClass

REGISTRY = CollectorRegistry()
_counter = partial(Counter, registry=REGISTRY)
_gauge = partial(Gauge, registry=REGISTRY)
_histogram = partial(Histogram, registry=REGISTRY)


class CountedElsewhere:
    """A counter whose values are running counts kept by another object (the API
    client's write count, the NVML wrapper's per-thread call counts), read at scrape.

    prometheus_client's Counter can only be incremented, and these counts already
    exist where the work happens; exposing them as gauges would hide that they only
    grow (rate() and increase() need the counter type).
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: tuple[str, ...] = (),
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._sources: dict[tuple[str, ...], Callable[[], float]] = {}
        self._lock = threading.Lock()
        registry.register(self)

    def count_from(self, source: Callable[[], float], **labels: str) -> None:
        """Expose `source()` as the sample with these labels (replaces an earlier source)."""
        if set(labels) != set(self.labelnames):
            raise ValueError(
                f"{self.name}: labels {sorted(labels)} given, {sorted(self.labelnames)} expected"
            )
        with self._lock:
            self._sources[tuple(labels[name] for name in self.labelnames)] = source

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            sources = list(self._sources.items())
        for label_values, source in sources:
            family.add_metric(list(label_values), source())
        return [family]


PREPARE_REQUESTS = _counter(
    "gpu_dra_prepare_claims",
    "Claims prepared, by outcome (ok, transient, invalid-config, device-failed).",
    ["outcome"],
)
UNPREPARE_REQUESTS = _counter(
    "gpu_dra_unprepare_claims", "Claims unprepared, by outcome (ok, error).", ["outcome"]
)
PERMANENT_VERDICT_REPLAYS = _counter(
    "gpu_dra_permanent_verdict_replays",
    "Prepare retries answered from a remembered permanent verdict (no NVML, no disk).",
    ["error_class"],
)
PREPARE_SECONDS = _histogram(
    "gpu_dra_prepare_seconds",
    "Latency of NodePrepareResources calls.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
XID_EVENTS = _counter(
    "gpu_dra_xid_events",
    "NVML health events, by Xid (or event kind) and verdict (fatal, ignored).",
    ["xid", "verdict"],
)
TAINTED_DEVICES = _gauge("gpu_dra_tainted_devices", "Published devices that carry a health taint.")
UNMONITORED_GPUS = _gauge(
    "gpu_dra_unmonitored_gpus",
    "GPUs whose NVML health events cannot be registered: their failures go unseen.",
)
PUBLISHED_DEVICES = _gauge("gpu_dra_published_devices", "Devices in this node's ResourceSlices.")
API_WRITES = CountedElsewhere(
    "gpu_dra_api_writes",
    "Write requests (POST, PUT, PATCH, DELETE) sent to the API server since start.",
)
STATE_FILE_WRITES = _counter(
    "gpu_dra_state_file_writes",
    "Files written or removed durably (checkpoint, CDI specs, health state).",
)
CHECKPOINT_CORRUPT = _gauge(
    "gpu_dra_checkpoint_corrupt",
    "1 while the prepare journal (checkpoint.json) is corrupt and prepare is refused, else 0; "
    "as of the last prepare, unprepare or start.",
)
NVIDIA_TOOLKIT_CONFIG = _gauge(
    "gpu_dra_nvidia_toolkit_config",
    "1 for what the plugin found at its start in the NVIDIA Container Toolkit's config "
    "under the driver root, 0 for the other results: accepts-envvar (unprivileged pods "
    "get GPUs with NVIDIA_VISIBLE_DEVICES: alert on it), hardened, no-config, unreadable.",
    ["result"],
)
HEALTH_STORE_CORRUPT = _gauge(
    "gpu_dra_health_store_corrupt",
    "1 while the health store (health.json) is corrupt and every GPU is kept failed "
    "(tainted), else 0; as of the plugin's start.",
)
KUBELET_REGISTERED = _gauge(
    "gpu_dra_kubelet_registered",
    "1 while the kubelet has confirmed this plugin's registration, else 0.",
)
SERVING = _gauge(
    "gpu_dra_serving",
    "1 while this plugin instance serves the node (publishes its ResourceSlices, "
    "prepares claims); 0 while a newer instance does (a rolling update's overlap).",
)
SOCKET_RECREATIONS = _counter(
    "gpu_dra_socket_recreations",
    "Plugin sockets served again after their file vanished, by socket (service, registration).",
    ["socket"],
)
NVML_CALLS = CountedElsewhere(
    "gpu_dra_nvml_calls",
    "NVML functions called since start, by caller (health-monitor, other).",
    ("caller",),
)
PREPARED_CLAIMS = _gauge(
    "gpu_dra_prepared_claims",
    "Claims prepared on this node (PrepareCompleted in the journal); NaN while the journal "
    "cannot be read.",
)
PREPARED_DEVICES = _gauge(
    "gpu_dra_prepared_devices",
    "Devices of the claims prepared on this node; NaN while the journal cannot be read.",
)
REQUESTS_IN_FLIGHT = _gauge(
    "gpu_dra_requests_in_flight",
    "NodePrepareResources and NodeUnprepareResources calls being answered, by method "
    "(prepare, unprepare).",
    ["method"],
)
GPU_HEALTHY = _gauge(
    "gpu_dra_gpu_healthy",
    "Per physical GPU: 1 healthy, 0 when the GPU or one of its MIG GPU instances has a "
    "recorded failure (its devices are tainted) or health is unknown (corrupt health store).",
    ["uuid", "device"],
)
GPU_XID_EVENTS = _counter(
    "gpu_dra_gpu_xid_events",
    "Per physical GPU: NVML Xid events (double-bit ECC errors included), by verdict "
    "(fatal, ignored).",
    ["uuid", "device", "verdict"],
)
GPUS = _gauge(
    "gpu_dra_gpus",
    "Physical GPUs of this node, by MIG mode (unsupported, disabled, dynamic, static, ignored).",
    ["mig_mode"],
)
MPS_DAEMONS_LOST = _counter(
    "gpu_dra_mps_daemon_lost",
    "MPS control daemons of prepared claims found gone (at start or by the periodic check), "
    "by outcome (restarted, failed: starting it again failed, tried again at the next check); "
    "Deployments whose daemon pod is not ready (not-ready: Kubernetes restarts it); and "
    "daemon pods Kubernetes replaced or restarted (replaced). Each: its clients' GPU work lost.",
    ["outcome"],
)
MPS_ORPHANS_REMOVED = _counter(
    "gpu_dra_mps_orphans_removed",
    "MPS daemon Deployments of this node and daemon directories that no prepare journal "
    "entry owned, removed by the MPS watch (at start and with every check), by kind "
    "(deployment, directory).",
    ["kind"],
)
MPS_ESCAPES = _counter(
    "gpu_dra_mps_escapes",
    "Processes seen running outside MPS (a CUDA context of their own, neither MPS server "
    "nor MPS client) on a GPU that carries MPS shares of prepared claims, each counted "
    "once when first seen, by GPU UUID.",
    ["gpu"],
)
BUILD_INFO = _gauge(
    "gpu_dra_build_info", "1, labelled with the version of the running plugin.", ["version"]
)

XID_VERDICTS = ("fatal", "ignored")

for _outcome in ("ok", *(c.value for c in ErrorClass)):
    PREPARE_REQUESTS.labels(outcome=_outcome)
for _outcome in ("ok", "error"):
    UNPREPARE_REQUESTS.labels(outcome=_outcome)
for _class in (ErrorClass.INVALID_CONFIG, ErrorClass.DEVICE_FAILED):
    PERMANENT_VERDICT_REPLAYS.labels(error_class=_class.value)
for _socket in ("service", "registration"):
    SOCKET_RECREATIONS.labels(socket=_socket)
for _outcome in ("restarted", "failed", "not-ready", "replaced"):
    MPS_DAEMONS_LOST.labels(outcome=_outcome)
for _kind in ("deployment", "directory"):
    MPS_ORPHANS_REMOVED.labels(kind=_kind)
for _method in ("prepare", "unprepare"):
    REQUESTS_IN_FLIGHT.labels(method=_method)
