"""The kubelet's DRA health stream: `DRAResourceHealth.NodeWatchResources`, v1 and v1alpha1.

Each message is the complete list of this node's published devices (pool = node
name) with HEALTHY or UNHEALTHY and, for unhealthy ones, why (a recorded failure, or
a recovery action that taints the GPU). A message is sent at once when the stream
opens, on every change of the health store or of a recovery action, and at least every
`heartbeat_seconds` (10 s): the kubelet marks a device Unknown when it has not heard
of it within its `health_check_timeout_seconds` (30 s here). The stream ends when
the client cancels or `HealthServices.stop()` is called before the server stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc

from driver.health.failures import GpuFailure
from driver.health.recovery_taints import RecoveryActions, RecoveryFailure
from driver.health.store import Devices, HealthStore, device_list
from driver.proto.dra_health.v1 import api_pb2 as v1
from driver.proto.dra_health.v1 import api_pb2_grpc as v1_grpc
from driver.proto.dra_health.v1alpha1 import api_pb2 as v1alpha1
from driver.proto.dra_health.v1alpha1 import api_pb2_grpc as v1alpha1_grpc

log = logging.getLogger(__name__)

HEALTH_CHECK_TIMEOUT_SECONDS = 30
HEARTBEAT_SECONDS = 10.0
CANCEL_CHECK_SECONDS = 0.5
MAX_MESSAGE_CHARS = 1024


@dataclass(frozen=True)
class DeviceStatus:
    name: str
    healthy: bool
    message: str = ""


class HealthSource:
    """Device health from the store and the GPUs' recovery actions, in published
    device order."""

    def __init__(
        self,
        store: HealthStore,
        devices: Devices,
        *,
        pool_name: str,
        recovery: RecoveryActions | None = None,
    ) -> None:
        self.store = store
        self.pool_name = pool_name
        self._devices = devices
        self._recovery = recovery
        self._names = [d.name for d in device_list(devices)]

    def snapshot(self) -> tuple[int, list[DeviceStatus]]:
        """Per device: a whole-GPU failure, or a GPU-instance failure on its slices,
        else a recovery action that taints its GPU."""
        version, failures = self.store.device_snapshot(self._devices)
        statuses: list[DeviceStatus] = []
        for name in self._names:
            failure: GpuFailure | RecoveryFailure | None = failures.get(name)
            if failure is None and self._recovery is not None:
                failure = self._recovery.device_failure(name)
            if failure is None:
                statuses.append(DeviceStatus(name, True))
            else:
                message = failure.message()
                if len(message) > MAX_MESSAGE_CHARS:
                    message = message[: MAX_MESSAGE_CHARS - 3] + "..."
                statuses.append(DeviceStatus(name, False, message))
        return version, statuses


class HealthServices:
    """The registered health services: how many streams are open, and `stop()`."""

    def __init__(self, source: HealthSource, heartbeat_seconds: float) -> None:
        self._source = source
        self._heartbeat = heartbeat_seconds
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.active_streams = 0

    def stop(self) -> None:
        """End every open stream cleanly (call before `server.stop()`)."""
        self._stopping.set()
        self._source.store.wake()

    def _response(self, pb2: ModuleType, statuses: list[DeviceStatus]) -> Any:
        now = int(time.time())
        return pb2.NodeWatchResourcesResponse(
            devices=[
                pb2.DeviceHealth(
                    device=pb2.DeviceIdentifier(
                        pool_name=self._source.pool_name, device_name=status.name
                    ),
                    health=pb2.HEALTHY if status.healthy else pb2.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=HEALTH_CHECK_TIMEOUT_SECONDS,
                    message=status.message,
                )
                for status in statuses
            ]
        )

    def watch(self, pb2: ModuleType, context: grpc.ServicerContext) -> Iterator[Any]:
        """`NodeWatchResources` of one API version (`pb2` is that version's module)."""
        store = self._source.store
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            store.wake()

        context.add_callback(on_end)
        with self._lock:
            self.active_streams += 1
        try:
            version, statuses = self._source.snapshot()
            yield self._response(pb2, statuses)
            next_beat = time.monotonic() + self._heartbeat
            while not (self._stopping.is_set() or ended.is_set()):
                wait = min(max(next_beat - time.monotonic(), 0.0), CANCEL_CHECK_SECONDS)
                current = store.wait_changed(version, wait)
                if self._stopping.is_set() or ended.is_set() or not context.is_active():
                    break
                if current != version or time.monotonic() >= next_beat:
                    version, statuses = self._source.snapshot()
                    yield self._response(pb2, statuses)
                    next_beat = time.monotonic() + self._heartbeat
        finally:
            with self._lock:
                self.active_streams -= 1
            log.debug("health stream (%s) ended", pb2.__name__)


class _Servicer:
    def __init__(self, services: HealthServices, pb2: ModuleType) -> None:
        self._services = services
        self._pb2 = pb2

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        return self._services.watch(self._pb2, context)


def add_health_services(
    server: grpc.Server,
    store: HealthStore,
    devices: Devices,
    *,
    pool_name: str,
    recovery: RecoveryActions | None = None,
    heartbeat_seconds: float = HEARTBEAT_SECONDS,
) -> HealthServices:
    """Register `v1.DRAResourceHealth` and `v1alpha1.DRAResourceHealth` on `server`.

    Each open stream holds one of the server's worker threads."""
    source = HealthSource(store, devices, pool_name=pool_name, recovery=recovery)
    services = HealthServices(source, heartbeat_seconds)
    v1_grpc.add_DRAResourceHealthServicer_to_server(_Servicer(services, v1), server)
    v1alpha1_grpc.add_DRAResourceHealthServicer_to_server(_Servicer(services, v1alpha1), server)
    return services
