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

from driver.health.recovery_taints import RecoveryActions
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
SERVICE_NAMES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


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
            failure = failures.get(name)
            recovery = self._recovery.device_failure(name) if self._recovery else None
            if failure is not None:
                statuses.append(DeviceStatus(name, False, _truncate(failure.message())))
            elif recovery is not None:
                statuses.append(DeviceStatus(name, False, _truncate(recovery.message())))
            else:
                statuses.append(DeviceStatus(name, True))
        return version, statuses

    def wait_changed(self, version: int, timeout: float) -> int:
        return self.store.wait_changed(version, timeout)

    def wake(self) -> None:
        self.store.wake()


def _truncate(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[: MAX_MESSAGE_CHARS - 3] + "..."


class HealthServicer:
    """`NodeWatchResources` for one API version (`pb2` is that version's module)."""

    def __init__(
        self,
        source: HealthSource,
        pb2: ModuleType,
        *,
        stopping: threading.Event,
        heartbeat_seconds: float,
        timeout_seconds: int,
    ) -> None:
        self._source = source
        self._pb2 = pb2
        self._stopping = stopping
        self._heartbeat = heartbeat_seconds
        self._timeout = timeout_seconds
        self._lock = threading.Lock()
        self.active_streams = 0

    def _response(self, statuses: list[DeviceStatus]) -> Any:
        pb2 = self._pb2
        now = int(time.time())
        return pb2.NodeWatchResourcesResponse(
            devices=[
                pb2.DeviceHealth(
                    device=pb2.DeviceIdentifier(
                        pool_name=self._source.pool_name, device_name=status.name
                    ),
                    health=pb2.HEALTHY if status.healthy else pb2.UNHEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=self._timeout,
                    message=status.message,
                )
                for status in statuses
            ]
        )

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        ended = threading.Event()

        def on_end() -> None:
            ended.set()
            self._source.wake()

        context.add_callback(on_end)
        with self._lock:
            self.active_streams += 1
        try:
            version, statuses = self._source.snapshot()
            yield self._response(statuses)
            next_beat = time.monotonic() + self._heartbeat
            while not (self._stopping.is_set() or ended.is_set()):
                wait = min(max(next_beat - time.monotonic(), 0.0), CANCEL_CHECK_SECONDS)
                current = self._source.wait_changed(version, wait)
                if self._stopping.is_set() or ended.is_set() or not context.is_active():
                    break
                if current != version or time.monotonic() >= next_beat:
                    version, statuses = self._source.snapshot()
                    yield self._response(statuses)
                    next_beat = time.monotonic() + self._heartbeat
        finally:
            with self._lock:
                self.active_streams -= 1
            log.debug("health stream (%s) ended", self._pb2.__name__)


class HealthServices:
    """Handle on the registered health services: names to advertise, and `stop()`."""

    def __init__(
        self, source: HealthSource, servicers: list[HealthServicer], stopping: threading.Event
    ) -> None:
        self.names = SERVICE_NAMES
        self.servicers = servicers
        self._source = source
        self._stopping = stopping

    @property
    def active_streams(self) -> int:
        return sum(s.active_streams for s in self.servicers)

    def stop(self) -> None:
        """End every open stream cleanly (call before `server.stop()`)."""
        self._stopping.set()
        self._source.wake()


def add_health_services(
    server: grpc.Server,
    store: HealthStore,
    devices: Devices,
    *,
    pool_name: str,
    recovery: RecoveryActions | None = None,
    heartbeat_seconds: float = HEARTBEAT_SECONDS,
    timeout_seconds: int = HEALTH_CHECK_TIMEOUT_SECONDS,
) -> HealthServices:
    """Register `v1.DRAResourceHealth` and `v1alpha1.DRAResourceHealth` on `server`.

    Each open stream holds one of the server's worker threads."""
    source = HealthSource(store, devices, pool_name=pool_name, recovery=recovery)
    stopping = threading.Event()
    servicers: list[HealthServicer] = []
    for pb2, grpc_module in ((v1, v1_grpc), (v1alpha1, v1alpha1_grpc)):
        servicer = HealthServicer(
            source,
            pb2,
            stopping=stopping,
            heartbeat_seconds=heartbeat_seconds,
            timeout_seconds=timeout_seconds,
        )
        grpc_module.add_DRAResourceHealthServicer_to_server(servicer, server)
        servicers.append(servicer)
    return HealthServices(source, servicers, stopping)
