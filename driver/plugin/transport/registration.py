"""The kubelet plugin-watcher handshake (pluginregistration v1)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from driver.proto.pluginregistration.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
# Order matters: the kubelet takes the first entry it supports.
DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


class RegistrationServicer(api_pb2_grpc.RegistrationServicer):
    """Answers GetInfo from memory (the kubelet allows 1 s) and records the verdict."""

    def __init__(
        self,
        driver_name: str,
        endpoint: str,
        supported_versions: tuple[str, ...],
        on_registered: Callable[[], object] = lambda: None,
    ):
        self.driver_name = driver_name
        self._on_registered = on_registered
        self._info = api_pb2.PluginInfo(
            type=DRA_PLUGIN_TYPE,
            name=driver_name,
            endpoint=endpoint,
            supported_versions=list(supported_versions),
        )
        self.registered = threading.Event()
        self.last_error = ""

    def GetInfo(
        self, request: api_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> api_pb2.PluginInfo:
        return self._info

    def NotifyRegistrationStatus(
        self, request: api_pb2.RegistrationStatus, context: grpc.ServicerContext
    ) -> api_pb2.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("registered with the kubelet as %s", self._info.name)
            self.last_error = ""
            self.registered.set()
            self._on_registered()
            return api_pb2.RegistrationStatusResponse()
        self.last_error = request.error
        self.registered.clear()
        log.error("the kubelet refused the registration: %s", request.error)
        context.abort(grpc.StatusCode.UNKNOWN, f"failed registration process: {request.error}")
        raise AssertionError("unreachable: context.abort raises")
