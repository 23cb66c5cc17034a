"""The plugin pod's readiness (/readyz): registered with the kubelet and serving DRA.

The DaemonSet rolls with `maxSurge: 1, maxUnavailable: 0`: the old plugin pod is
removed only once the new one is Ready. So Ready must mean what the node needs from
the plugin, not that the process runs:

1. the kubelet registered this instance: it called `NotifyRegistrationStatus` with
   `plugin_registered: true` since the registration socket was (re)created. A kubelet
   that never finds the socket (a registration directory it does not watch) never
   calls; one that refuses the plugin says why, and that text is the answer;
2. the registration socket answers `GetInfo`, dialled over gRPC as the kubelet
   dials it;
3. the DRA service socket answers a `NodePrepareResources` without claims (the
   servicer answers it at once, with no claim read, lock, log line or metric).

Liveness (/healthz) is another question: a restart repairs none of these.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from driver.plugin.transport.registration import RegistrationServicer
from driver.plugin.transport.sockets import SocketPaths
from driver.proto.dra.v1 import api_pb2 as dra_v1
from driver.proto.dra.v1 import api_pb2_grpc as dra_v1_grpc
from driver.proto.pluginregistration.v1 import api_pb2 as reg
from driver.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

# Each socket call of a check; the chart's probe allows 5 s for the whole answer.
CALL_TIMEOUT = 2.0


class Readiness:
    """(ready, text) for /readyz; each call dials both sockets."""

    def __init__(self, registration: RegistrationServicer, paths: SocketPaths) -> None:
        self._registration = registration
        self._paths = paths

    def __call__(self) -> tuple[bool, str]:
        problem = self._problem()
        if problem is not None:
            return False, f"not ready: {problem}\n"
        return True, (
            f"ready: registered with the kubelet as {self._registration.driver_name}, "
            f"serving DRA on {self._paths.service}\n"
        )

    def _problem(self) -> str | None:
        registration = self._registration
        if not registration.registered.is_set():
            if registration.last_error:
                return f"the kubelet refused the registration: {registration.last_error}"
            return (
                "the kubelet has not registered the plugin (yet). It looks for the "
                f"registration socket {self._paths.registration} only in the directory it "
                "watches, <kubelet --root-dir>/plugins_registry: check the chart value "
                "kubeletPlugin.kubeletRegistrarDirectoryPath"
            )
        paths = self._paths
        try:
            with _channel(paths.registration) as channel:
                reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            return f"the registration socket {paths.registration} does not answer: {_why(err)}"
        try:
            with _channel(paths.service) as channel:
                dra = dra_v1_grpc.DRAPluginStub(channel)
                dra.NodePrepareResources(dra_v1.NodePrepareResourcesRequest(), timeout=CALL_TIMEOUT)
        except grpc.RpcError as err:
            return f"the DRA service socket {paths.service} does not answer: {_why(err)}"
        return None


def _channel(path: Path) -> grpc.Channel:
    """A connection of its own: grpc shares connections between channels to one target
    by default, and one left open to a socket file that is gone still answers."""
    return grpc.insecure_channel(f"unix://{path}", options=[("grpc.use_local_subchannel_pool", 1)])


def _why(err: grpc.RpcError) -> str:
    """The status code and text of a failed call ("UNAVAILABLE: failed to connect ...")."""
    if isinstance(err, grpc.Call):
        return f"{err.code().name}: {err.details()}"
    return f"error: {err}"
