"""The plugin's readiness (/readyz): ready only once the kubelet registered this instance
and both sockets answer over gRPC, so that a rolling update whose new pod cannot
register (a wrong kubeletRegistrarDirectoryPath, a kubelet that refuses it) stalls with
the old pod still serving."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from driver.observability.http import HttpServer
from driver.plugin.dra import add_dra_services
from driver.plugin.readiness import Readiness
from driver.plugin.transport.registration import DRA_SERVICES, HEALTH_SERVICES, RegistrationServicer
from driver.plugin.transport.sockets import SocketPaths
from driver.proto.pluginregistration.v1 import api_pb2 as reg
from driver.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from tests.unit.test_plugin_grpc import FakeState

DRIVER = "gpu.example.com"


@dataclass
class Served:
    paths: SocketPaths
    registration: RegistrationServicer
    service: grpc.Server
    readiness: Readiness

    def kubelet_notifies(self, registered: bool, error: str = "") -> None:
        """What the kubelet's plugin watcher does: GetInfo, then its verdict."""
        with grpc.insecure_channel(f"unix://{self.paths.registration}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            stub.GetInfo(reg.InfoRequest(), timeout=1)
            status = reg.RegistrationStatus(plugin_registered=registered, error=error)
            try:
                stub.NotifyRegistrationStatus(status, timeout=1)
            except grpc.RpcError:
                assert not registered  # the plugin answers a refusal with an error


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    paths = SocketPaths(tmp_path / "registry" / f"{DRIVER}-reg.sock", tmp_path / "dra.sock")
    paths.registration.parent.mkdir()
    registration = RegistrationServicer(DRIVER, str(paths.service), DRA_SERVICES + HEALTH_SERVICES)
    reg_server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    reg_grpc.add_RegistrationServicer_to_server(registration, reg_server)
    reg_server.add_insecure_port(f"unix://{paths.registration}")
    service = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    add_dra_services(service, FakeState())
    service.add_insecure_port(f"unix://{paths.service}")
    service.start()
    reg_server.start()
    yield Served(paths, registration, service, Readiness(registration, paths))
    reg_server.stop(0).wait()
    service.stop(0).wait()


def test_not_ready_until_the_kubelet_registers(served: Served) -> None:
    ready, text = served.readiness()
    assert not ready
    assert "the kubelet has not registered the plugin" in text
    # Where the socket is, and which setting puts it there: a wrong directory is the
    # usual cause (the kubelet watches <its --root-dir>/plugins_registry only).
    assert str(served.paths.registration) in text
    assert "kubeletRegistrarDirectoryPath" in text

    served.kubelet_notifies(registered=True)
    ready, text = served.readiness()
    assert ready, text
    assert text.startswith("ready: registered with the kubelet as gpu.example.com")
    assert str(served.paths.service) in text


def test_a_refused_registration_is_not_ready_and_says_why(served: Served) -> None:
    served.kubelet_notifies(registered=True)
    refusal = "none of services supported by the plugin are supported by the kubelet"
    served.kubelet_notifies(registered=False, error=refusal)
    ready, text = served.readiness()
    assert not ready
    assert f"the kubelet refused the registration: {refusal}" in text
    served.kubelet_notifies(registered=True)  # the kubelet's next attempt succeeds
    assert served.readiness()[0]


def test_not_ready_when_the_dra_socket_does_not_answer(served: Served) -> None:
    served.kubelet_notifies(registered=True)
    served.service.stop(0).wait()
    ready, text = served.readiness()
    assert not ready
    assert f"the DRA service socket {served.paths.service} does not answer" in text


def test_not_ready_when_the_registration_socket_does_not_answer(served: Served) -> None:
    served.kubelet_notifies(registered=True)
    served.paths.registration.unlink()
    ready, text = served.readiness()
    assert not ready
    assert f"the registration socket {served.paths.registration} does not answer" in text


def _get(server: HttpServer, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_readyz_is_503_until_ready_and_200_after(served: Served) -> None:
    server = HttpServer(0, lambda: (True, "ok\n"), "127.0.0.1").start()
    try:
        assert _get(server, "/readyz") == (503, "not ready: starting\n")
        server.serve_readiness(served.readiness)
        status, text = _get(server, "/readyz")
        assert status == 503 and "has not registered" in text
        served.kubelet_notifies(registered=True)
        status, text = _get(server, "/readyz")
        assert status == 200 and text.startswith("ready: ")
        assert _get(server, "/healthz") == (200, "ok\n")  # liveness is another question
    finally:
        server.shutdown()


def test_readyz_reason_answers_200_with_the_same_text_ready_or_not(served: Served) -> None:
    """Through the API server's pod proxy (`kubectl get --raw .../proxy/readyz`) a 503
    prints only `ServiceUnavailable`, not the reason: /readyz/reason answers 200 with
    what /readyz says, so the proxy passes it on. The probe stays on /readyz."""
    server = HttpServer(0, lambda: (True, "ok\n"), "127.0.0.1").start()
    try:
        assert _get(server, "/readyz/reason") == (200, "not ready: starting\n")
        server.serve_readiness(served.readiness)
        status, text = _get(server, "/readyz/reason")
        assert status == 200 and "has not registered" in text
        assert (503, text) == _get(server, "/readyz")
        served.kubelet_notifies(registered=True)
        status, text = _get(server, "/readyz/reason")
        assert status == 200 and text.startswith("ready: ")
    finally:
        server.shutdown()
