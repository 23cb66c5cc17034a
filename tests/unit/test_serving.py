"""The plugin's sockets come back when their files are deleted while it runs."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from driver.observability import metrics
from driver.plugin.transport.registration import DRA_SERVICES, RegistrationServicer
from driver.plugin.transport.serving import BuiltServer, SocketServer, SocketWatcher, new_server
from driver.proto.pluginregistration.v1 import api_pb2, api_pb2_grpc


def _registration_server(path: Path, servicer: RegistrationServicer) -> SocketServer:
    def build() -> BuiltServer:
        server = new_server(max_workers=2)
        api_pb2_grpc.add_RegistrationServicer_to_server(servicer, server)
        return BuiltServer(server)

    return SocketServer("registration", path, build)


def _get_info(path: Path) -> api_pb2.PluginInfo:
    with grpc.insecure_channel(f"unix://{path}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        info: api_pb2.PluginInfo = stub.GetInfo(api_pb2.InfoRequest(), timeout=2)
        return info


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[SocketServer, SocketServer, RegistrationServicer]]:
    """Two registration-service servers stand in for the service and registration
    sockets: what matters here is the socket life cycle, not the services."""
    service_servicer = RegistrationServicer("svc.example.com", "x", DRA_SERVICES)
    servicer = RegistrationServicer("gpu.example.com", str(tmp_path / "dra.sock"), DRA_SERVICES)
    service = _registration_server(tmp_path / "dra.sock", service_servicer)
    service.name = "service"
    registration = _registration_server(tmp_path / "reg" / "gpu-reg.sock", servicer)
    service.start()
    registration.start()
    yield service, registration, servicer
    registration.stop(0)
    service.stop(0)


def _recreations(socket: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "gpu_dra_socket_recreations_total", {"socket": socket}
    )
    return value or 0.0


def test_sockets_are_private_and_intact_after_start(
    servers: tuple[SocketServer, SocketServer, RegistrationServicer],
) -> None:
    service, registration, _ = servers
    assert service.intact() and registration.intact()
    assert os.stat(registration.path).st_mode & 0o777 == 0o600
    assert _get_info(registration.path).name == "gpu.example.com"


def test_deleted_registration_socket_is_served_again_and_registration_renewed(
    servers: tuple[SocketServer, SocketServer, RegistrationServicer],
) -> None:
    service, registration, servicer = servers
    servicer.registered.set()
    watcher = SocketWatcher(service, registration, on_reregister=servicer.registered.clear)
    before = _recreations("registration")
    assert watcher.check_once() == []  # nothing to do while both files exist

    registration.path.unlink()
    assert not registration.intact()
    assert watcher.check_once() == ["registration"]

    assert registration.intact() and service.intact()
    assert _get_info(registration.path).name == "gpu.example.com"
    assert not servicer.registered.is_set()  # the kubelet has to confirm again
    assert _recreations("registration") == before + 1


def test_deleted_service_socket_rebuilds_both_service_first(
    servers: tuple[SocketServer, SocketServer, RegistrationServicer],
) -> None:
    service, registration, servicer = servers
    before = _recreations("registration")
    watcher = SocketWatcher(service, registration, on_reregister=servicer.registered.clear)

    service.path.unlink()
    assert watcher.check_once() == ["service", "registration"]

    assert _get_info(service.path).name == "svc.example.com"
    assert _recreations("registration") == before + 1  # so the kubelet re-dials
    assert _get_info(registration.path).name == "gpu.example.com"


def test_socket_replaced_by_another_file_is_taken_back(
    servers: tuple[SocketServer, SocketServer, RegistrationServicer],
) -> None:
    service, registration, servicer = servers
    watcher = SocketWatcher(service, registration, on_reregister=servicer.registered.clear)
    registration.path.unlink()
    registration.path.write_text("not a socket")
    assert not registration.intact()
    assert watcher.check_once() == ["registration"]
    assert _get_info(registration.path).name == "gpu.example.com"


def test_watcher_thread_recreates_at_its_next_check(
    servers: tuple[SocketServer, SocketServer, RegistrationServicer],
) -> None:
    """Recreated by the first check that starts after the deletion (checks counted,
    not seconds: however late a busy machine runs them)."""
    service, registration, servicer = servers
    watcher = SocketWatcher(
        service, registration, on_reregister=servicer.registered.clear, interval=0.05
    )
    started: list[int] = []  # how many checks had started, at each rebuild
    checks = [0]
    rebuilt = threading.Event()
    check_once = watcher.check_once

    def counted() -> list[str]:
        checks[0] += 1
        number = checks[0]
        names = check_once()
        if names:
            started.append(number)
            rebuilt.set()
        return names

    watcher.check_once = counted  # type: ignore[method-assign]
    watcher.start()
    try:
        registration.path.unlink()
        begun_by_now = checks[0]  # the next one to start comes after the deletion
        assert rebuilt.wait(30), "the registration socket was never recreated"
        assert started[0] <= begun_by_now + 1, (started, begun_by_now)
        assert _get_info(registration.path).name == "gpu.example.com"
    finally:
        watcher.stop()
    assert watcher._thread.name == SocketWatcher.THREAD_NAME
