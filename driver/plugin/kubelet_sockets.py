"""The kubelet's two gRPC sockets for this plugin instance: the service socket (the DRA
and health services) and the registration socket that announces it to the kubelet."""

from __future__ import annotations

import contextlib
import logging

from driver.devices.device_types import PublishedDevice
from driver.health.recovery_taints import RecoveryActions
from driver.health.store import HealthStore
from driver.observability import metrics
from driver.plugin.dra import add_dra_services
from driver.plugin.health import add_health_services
from driver.plugin.memory_limit_requests import ForgetRequestsOnUnprepare, MemoryLimitRequests
from driver.plugin.options.flags import PluginOptions
from driver.plugin.serving_instance import Succession
from driver.plugin.transport.registration import DRA_SERVICES, HEALTH_SERVICES, RegistrationServicer
from driver.plugin.transport.serving import BuiltServer, SocketServer, SocketWatcher, new_server
from driver.plugin.transport.sockets import socket_paths
from driver.proto.pluginregistration.v1 import api_pb2_grpc as registration_grpc
from driver.state.prepare import DeviceState

log = logging.getLogger("gpu-kubelet-plugin")

SHUTDOWN_GRACE_SECONDS = 5.0


class KubeletSockets:
    """This instance's socket names and registration; `start` serves both sockets."""

    def __init__(
        self,
        o: PluginOptions,
        state: DeviceState,
        *,
        limit_requests: MemoryLimitRequests | None,
        store: HealthStore,
        devices: dict[str, PublishedDevice],
        recovery: RecoveryActions,
        succession: Succession,
    ) -> None:
        self._node_name = o.node_name
        self._state = state
        self._limit_requests = limit_requests
        self._store = store
        self._devices = devices
        self._recovery = recovery
        self._succession = succession
        self.paths = socket_paths(o.driver_name, o.registrar_dir, o.data_dir, o.pod_uid or None)
        self.registration = RegistrationServicer(
            o.driver_name,
            str(self.paths.service),
            DRA_SERVICES + HEALTH_SERVICES,
            on_registered=succession.registered,
        )

    def start(self, running: contextlib.ExitStack) -> SocketWatcher:
        """Serve both sockets until `running` stops them; returns the watcher that
        rebuilds a socket whose file vanished, for the caller to start."""
        service_socket = SocketServer("service", self.paths.service, self._build_service)
        registration_socket = SocketServer(
            "registration", self.paths.registration, self._build_registration
        )
        # The service first: the kubelet dials it as soon as the registration appears.
        # Stopped the other way round: removing the registration socket deregisters.
        service_socket.start()
        running.callback(service_socket.stop, SHUTDOWN_GRACE_SECONDS)
        registration_socket.start()
        running.callback(registration_socket.stop, 0)
        log.info("serving %s; registration socket %s", self.paths.service, self.paths.registration)
        metrics.KUBELET_REGISTERED.set_function(
            lambda: float(self.registration.registered.is_set())
        )
        metrics.SERVING.set_function(lambda: float(self._succession.serving()))
        return SocketWatcher(
            service_socket, registration_socket, on_reregister=self.registration.registered.clear
        )

    def _build_service(self) -> BuiltServer:
        # Each open health stream holds a worker thread for its lifetime.
        server = new_server(max_workers=16)
        preparer = (
            self._state
            if self._limit_requests is None
            else ForgetRequestsOnUnprepare(self._state, self._limit_requests)
        )
        add_dra_services(server, preparer, serving_instead=self._succession.newer)
        health = add_health_services(
            server, self._store, self._devices, pool_name=self._node_name, recovery=self._recovery
        )
        return BuiltServer(server, before_stop=health.stop)

    def _build_registration(self) -> BuiltServer:
        server = new_server(max_workers=2)
        registration_grpc.add_RegistrationServicer_to_server(self.registration, server)
        return BuiltServer(server)
