"""The kubelet stand-in's plugin-watcher flow, against in-test gRPC servers.

Real unix sockets, real grpcio servers built from the generated stubs: what the
integration tests rely on when they let the stand-in register the driver.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from driver.proto.dra.v1 import api_pb2 as dra_v1
from driver.proto.dra.v1 import api_pb2_grpc as dra_v1_grpc
from driver.proto.dra.v1beta1 import api_pb2 as dra_v1beta1
from driver.proto.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from driver.proto.dra_health.v1 import api_pb2 as health_v1
from driver.proto.dra_health.v1 import api_pb2_grpc as health_v1_grpc
from driver.proto.pluginregistration.v1 import api_pb2 as reg_pb2
from driver.proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc


def _load_standin() -> ModuleType:
    # tests/unit is not a package; load the stand-in from its file.
    path = Path(__file__).resolve().parents[1] / "integration" / "kubelet_standin.py"
    spec = importlib.util.spec_from_file_location("kubelet_standin", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ks = _load_standin()

DRIVER = "gpu.example.com"


class FakeRegistration(reg_grpc.RegistrationServicer):
    def __init__(self, info: reg_pb2.PluginInfo, delays: list[float] | None = None) -> None:
        self.info = info
        self.delays = list(delays or [])
        self.get_info_calls = 0
        self.statuses: list[reg_pb2.RegistrationStatus] = []
        self.notified = threading.Event()

    def GetInfo(self, request: Any, context: Any) -> reg_pb2.PluginInfo:
        self.get_info_calls += 1
        if self.delays:
            time.sleep(self.delays.pop(0))
        return self.info

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.statuses.append(request)
        self.notified.set()
        return reg_pb2.RegistrationStatusResponse()


class FakeDRA(dra_v1_grpc.DRAPluginServicer):
    def __init__(self, skip: set[str] | None = None) -> None:
        self.requests: list[Any] = []
        self.skip = skip or set()

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        self.requests.append(("prepare", request))
        resp = dra_v1.NodePrepareResourcesResponse()
        for claim in request.claims:
            if claim.uid in self.skip:
                continue
            resp.claims[claim.uid].devices.add(
                pool_name="node-1", device_name="gpu-0", cdi_device_ids=[f"k8s.{DRIVER}/gpu=0"]
            )
        return resp

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        self.requests.append(("unprepare", request))
        resp = dra_v1.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            resp.claims[claim.uid].error = ""
        return resp


class FakeDRAv1beta1(dra_v1beta1_grpc.DRAPluginServicer):
    def __init__(self) -> None:
        self.calls = 0

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        self.calls += 1
        resp = dra_v1beta1.NodePrepareResourcesResponse()
        for claim in request.claims:
            resp.claims[claim.uid].devices.add(pool_name="p", device_name="d")
        return resp


class FakeHealth(health_v1_grpc.DRAResourceHealthServicer):
    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        for health in (health_v1.HEALTHY, health_v1.UNHEALTHY):
            yield health_v1.NodeWatchResourcesResponse(
                devices=[
                    health_v1.DeviceHealth(
                        device=health_v1.DeviceIdentifier(pool_name="node-1", device_name="gpu-0"),
                        health=health,
                    )
                ]
            )
        while context.is_active():
            time.sleep(0.05)


class Plugin:
    """A fake DRA plugin: DRA service socket first, then the registration socket."""

    def __init__(
        self,
        base: Path,
        *,
        name: str = DRIVER,
        plugin_type: str = "DRAPlugin",
        versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
        reg_name: str | None = None,
        delays: list[float] | None = None,
        dra: Any = None,
        extra: tuple[Any, ...] = (),
    ) -> None:
        self.registry = base / "registry"
        self.registry.mkdir(exist_ok=True)
        self.endpoint = str(base / f"{name}-dra.sock")
        self.reg_socket = str(self.registry / (reg_name or f"{name}-reg.sock"))
        self.dra = dra if dra is not None else FakeDRA()
        self.dra_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        if isinstance(self.dra, FakeDRAv1beta1):
            dra_v1beta1_grpc.add_DRAPluginServicer_to_server(self.dra, self.dra_server)
        else:
            dra_v1_grpc.add_DRAPluginServicer_to_server(self.dra, self.dra_server)
        for servicer in extra:
            health_v1_grpc.add_DRAResourceHealthServicer_to_server(servicer, self.dra_server)
        self.dra_server.add_insecure_port(f"unix:{self.endpoint}")
        self.dra_server.start()
        self.registration = FakeRegistration(
            reg_pb2.PluginInfo(
                type=plugin_type, name=name, endpoint=self.endpoint, supported_versions=versions
            ),
            delays,
        )
        self.reg_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        reg_grpc.add_RegistrationServicer_to_server(self.registration, self.reg_server)
        self.reg_server.add_insecure_port(f"unix:{self.reg_socket}")
        self.reg_server.start()

    def stop_registration(self) -> None:
        self.reg_server.stop(grace=None).wait()  # grpc removes the socket file

    def stop(self) -> None:
        self.stop_registration()
        self.dra_server.stop(grace=None).wait()


@pytest.fixture
def plugins() -> Iterator[list[Plugin]]:
    started: list[Plugin] = []
    yield started
    for plugin in started:
        plugin.stop()


def test_registers_plugin_and_calls_prepare_over_v1(short_dir: Path, plugins: list[Plugin]) -> None:
    plugin = Plugin(short_dir)
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        registered = kubelet.wait_for_plugin(DRIVER, timeout=10)
        assert registered.service == "v1.DRAPlugin"
        assert registered.endpoint == plugin.endpoint
        assert plugin.registration.notified.wait(5)
        assert [s.plugin_registered for s in plugin.registration.statuses] == [True]

        claims = [("default", "uid-1", "claim-1"), ("default", "uid-2", "claim-2")]
        responses = kubelet.prepare(DRIVER, claims)
        assert set(responses) == {"uid-1", "uid-2"}
        assert responses["uid-1"].devices[0].cdi_device_ids == [f"k8s.{DRIVER}/gpu=0"]
        kind, request = plugin.dra.requests[0]
        assert kind == "prepare"
        assert [(c.namespace, c.uid, c.name) for c in request.claims] == claims

        unprepared = kubelet.unprepare(DRIVER, claims[:1])
        assert set(unprepared) == {"uid-1"} and unprepared["uid-1"].error == ""


def test_first_known_version_in_plugin_order_wins(short_dir: Path, plugins: list[Plugin]) -> None:
    plugin = Plugin(
        short_dir,
        versions=("v9.Future", "v1beta1.DRAPlugin", "v1.DRAPlugin"),
        dra=FakeDRAv1beta1(),
    )
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        assert kubelet.wait_for_plugin(DRIVER, timeout=10).service == "v1beta1.DRAPlugin"
        # The v1beta1 service is used, and the answer comes back as v1 messages.
        responses = kubelet.prepare(DRIVER, [("ns", "u", "c")])
        assert plugin.dra.calls == 1
        assert isinstance(responses["u"], dra_v1.NodePrepareResourceResponse)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"plugin_type": "CSIPlugin"}, "no handler registered for plugin type"),
        ({"versions": ("v1alpha3.DRAPlugin", "v1.DRAResourceHealth")}, "none of the services"),
        ({"name": "Not_A_DNS_Name"}, "not a DNS subdomain"),
    ],
)
def test_invalid_plugin_is_refused_and_told_so(
    short_dir: Path, plugins: list[Plugin], kwargs: dict[str, Any], error: str
) -> None:
    plugin = Plugin(short_dir, **kwargs)
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        assert plugin.registration.notified.wait(5)
        status = plugin.registration.statuses[0]
        assert not status.plugin_registered
        assert error in status.error
        assert kubelet.plugins == {}
        with pytest.raises(ks.KubeletStandinError, match="is not registered"):
            kubelet.prepare(plugin.registration.info.name, [("ns", "u", "c")])


def test_get_info_has_a_one_second_deadline_and_is_retried(
    short_dir: Path, plugins: list[Plugin]
) -> None:
    plugin = Plugin(short_dir, delays=[1.5])
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=15)
        failed = [a for a in kubelet.attempts if not a.ok]
        assert failed and "DEADLINE_EXCEEDED" in failed[0].error
        assert plugin.registration.get_info_calls >= 2
        assert [s.plugin_registered for s in plugin.registration.statuses] == [True]


def test_removing_registration_socket_deregisters(short_dir: Path, plugins: list[Plugin]) -> None:
    plugin = Plugin(short_dir)
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=10)
        plugin.stop_registration()
        assert not Path(plugin.reg_socket).exists()
        kubelet.wait_for_deregistration(DRIVER, timeout=10)
        with pytest.raises(ks.KubeletStandinError, match="is not registered"):
            kubelet.prepare(DRIVER, [("ns", "u", "c")])


def test_hidden_sockets_are_ignored(short_dir: Path, plugins: list[Plugin]) -> None:
    plugin = Plugin(short_dir, reg_name=".hidden-reg.sock")
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        time.sleep(0.5)
        assert plugin.registration.get_info_calls == 0
        assert kubelet.plugins == {}


def test_prepare_rejects_a_response_that_skips_a_claim(
    short_dir: Path, plugins: list[Plugin]
) -> None:
    plugin = Plugin(short_dir, dra=FakeDRA(skip={"uid-2"}))
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=10)
        with pytest.raises(ks.KubeletStandinError, match="skipped 1 ResourceClaims"):
            kubelet.prepare(DRIVER, [("ns", "uid-1", "a"), ("ns", "uid-2", "b")])


def test_same_driver_same_endpoint_twice_is_refused(short_dir: Path, plugins: list[Plugin]) -> None:
    first = Plugin(short_dir)
    plugins.append(first)
    with ks.KubeletStandin(first.registry) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=10)
        # A second registration socket that points at the same DRA endpoint.
        second = FakeRegistration(first.registration.info)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        reg_grpc.add_RegistrationServicer_to_server(second, server)
        server.add_insecure_port(f"unix:{first.registry / 'again-reg.sock'}")
        server.start()
        try:
            assert second.notified.wait(5)
            assert not second.statuses[0].plugin_registered
            assert "already registered" in second.statuses[0].error
        finally:
            server.stop(grace=None).wait()


def test_health_stream_is_collected(short_dir: Path, plugins: list[Plugin]) -> None:
    plugin = Plugin(
        short_dir,
        versions=("v1.DRAPlugin", "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"),
        extra=(FakeHealth(),),
    )
    plugins.append(plugin)
    with ks.KubeletStandin(plugin.registry) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=10)
        watch = kubelet.watch_health(DRIVER)
        assert watch.service == "v1.DRAResourceHealth"
        messages = watch.wait_for(lambda msgs: len(msgs) >= 2, timeout=10)
        assert [m.devices[0].health for m in messages[:2]] == [
            health_v1.HEALTHY,
            health_v1.UNHEALTHY,
        ]


def test_choose_service_follows_plugin_order() -> None:
    assert ks.choose_service(["v1.DRAPlugin", "v1beta1.DRAPlugin"]) == "v1.DRAPlugin"
    assert ks.choose_service(["v1beta1.DRAPlugin", "v1.DRAPlugin"]) == "v1beta1.DRAPlugin"
    assert ks.choose_service(["v1.DRAResourceHealth"]) is None
