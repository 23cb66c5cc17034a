"""DRAResourceHealth v1 and v1alpha1 over a real gRPC unix socket."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest

from driver.health.store import HealthStore
from driver.plugin.health import (
    HealthServices,
    HealthSource,
    add_health_services,
)
from driver.plugin.transport.registration import HEALTH_SERVICES
from driver.proto.dra_health.v1 import api_pb2 as v1
from driver.proto.dra_health.v1 import api_pb2_grpc as v1_grpc
from driver.proto.dra_health.v1alpha1 import api_pb2 as v1alpha1
from driver.proto.dra_health.v1alpha1 import api_pb2_grpc as v1alpha1_grpc

GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
GPU1 = "GPU-11111111-1111-4111-8111-111111111111"
VERSIONS = {"v1": (v1, v1_grpc), "v1alpha1": (v1alpha1, v1alpha1_grpc)}
# Seconds a test waits for a message or the end of a stream: generous on a busy
# machine, and shorter than HEARTBEAT, so a message that comes within it was sent
# for a change (or the start, or the end), never by the heartbeat.
EVENT_WAIT = 30.0
HEARTBEAT = 2 * EVENT_WAIT


@dataclass(frozen=True)
class Dev:
    name: str
    gpu_uuid: str


DEVICES = {
    d.name: d
    for d in (
        Dev("gpu-0", GPU0),
        Dev("gpu-0-mig-1g10gb-0", GPU0),
        Dev("gpu-1", GPU1),
        Dev("gpu-1-mig-1g10gb-0", GPU1),
    )
}


@dataclass
class Served:
    store: HealthStore
    services: HealthServices
    server: grpc.Server
    channel: grpc.Channel


def serve(directory: Path, heartbeat: float = HEARTBEAT) -> Served:
    store = HealthStore(directory / "health.json")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    services = add_health_services(
        server, store, DEVICES, pool_name="node-1", heartbeat_seconds=heartbeat
    )
    socket = directory / "dra.sock"
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    return Served(store, services, server, grpc.insecure_channel(f"unix://{socket}"))


@pytest.fixture
def served(short_dir: Path) -> Iterator[Served]:
    s = serve(short_dir)
    yield s
    s.services.stop()
    s.channel.close()
    s.server.stop(1).wait()


class Reader:
    """Reads a stream in a thread so that tests can wait with timeouts."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.messages: queue.Queue[Any] = queue.Queue()
        self.error: list[grpc.RpcError] = []
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for message in self.call:
                self.messages.put(message)
        except grpc.RpcError as err:
            self.error.append(err)
        finally:
            self.done.set()

    def next(self, timeout: float = EVENT_WAIT) -> Any:
        return self.messages.get(timeout=timeout)


def watch(channel: grpc.Channel, version: str) -> Reader:
    pb2, grpc_module = VERSIONS[version]
    stub: Any = grpc_module.DRAResourceHealthStub(channel)
    return Reader(stub.NodeWatchResources(pb2.NodeWatchResourcesRequest()))


def health_map(message: Any) -> dict[str, tuple[int, str]]:
    return {d.device.device_name: (d.health, d.message) for d in message.devices}


def test_service_names() -> None:
    assert HEALTH_SERVICES == ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_initial_full_list_then_updates(served: Served, version: str) -> None:
    pb2: ModuleType = VERSIONS[version][0]
    reader = watch(served.channel, version)
    first = reader.next()
    assert [d.device.device_name for d in first.devices] == list(DEVICES)
    for device in first.devices:
        assert device.device.pool_name == "node-1"
        assert device.health == pb2.HEALTHY
        assert device.health_check_timeout_seconds == 30
        assert abs(device.last_updated_time - time.time()) < 5
        assert device.message == ""

    served.store.record_xid(GPU1, 79)
    update = reader.next()  # within EVENT_WAIT: sent for the change, not the heartbeat
    states = health_map(update)
    assert len(states) == len(DEVICES)  # always the complete list
    assert states["gpu-0"] == (pb2.HEALTHY, "")
    assert states["gpu-0-mig-1g10gb-0"] == (pb2.HEALTHY, "")
    for name in ("gpu-1", "gpu-1-mig-1g10gb-0"):
        health, message = states[name]
        assert health == pb2.UNHEALTHY
        assert message.startswith("Xid 79")

    served.store.clear(GPU1)
    assert all(h == pb2.HEALTHY for h, _ in health_map(reader.next()).values())
    reader.call.cancel()


def test_heartbeat_resends_the_list(short_dir: Path) -> None:
    s = serve(short_dir, heartbeat=0.2)
    try:
        s.store.record_lost(GPU0)
        version = s.store.version
        reader = watch(s.channel, "v1")
        first = reader.next()
        second = reader.next()
        third = reader.next()
        assert s.store.version == version  # nothing changed: the heartbeat sent them
        assert health_map(first) == health_map(second) == health_map(third)
        assert health_map(third)["gpu-0"][0] == v1.UNHEALTHY
        assert "GPU is lost" in health_map(third)["gpu-0"][1]
        reader.call.cancel()
    finally:
        s.services.stop()
        s.channel.close()
        s.server.stop(1).wait()


def test_client_cancel_ends_the_stream(served: Served) -> None:
    reader = watch(served.channel, "v1")
    reader.next()
    other = watch(served.channel, "v1alpha1")
    other.next()
    assert served.services.active_streams == 2
    reader.call.cancel()
    assert reader.done.wait(EVENT_WAIT)
    deadline = time.monotonic() + EVENT_WAIT
    while served.services.active_streams != 1:
        assert time.monotonic() < deadline, "server side of the stream did not end"
        time.sleep(0.01)
    other.call.cancel()


def test_stop_ends_streams_cleanly(short_dir: Path) -> None:
    s = serve(short_dir)
    readers = [watch(s.channel, "v1"), watch(s.channel, "v1alpha1")]
    for reader in readers:
        reader.next()
    s.services.stop()
    for reader in readers:
        assert reader.done.wait(EVENT_WAIT)  # ended by the stop, not at a heartbeat
        assert reader.error == []  # a normal end of stream, not an error
        assert reader.call.code() == grpc.StatusCode.OK
    assert s.services.active_streams == 0
    s.channel.close()
    s.server.stop(1).wait()


def test_server_stop_ends_streams(short_dir: Path) -> None:
    s = serve(short_dir)
    reader = watch(s.channel, "v1")
    reader.next()
    s.server.stop(0.5).wait()
    assert reader.done.wait(EVENT_WAIT)
    s.services.stop()
    deadline = time.monotonic() + EVENT_WAIT
    while s.services.active_streams:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    s.channel.close()


def test_long_messages_are_truncated(served: Served) -> None:
    served.store.record_xid(GPU0, 79, "x" * 5000)
    reader = watch(served.channel, "v1")
    message = health_map(reader.next())["gpu-0"][1]
    assert len(message) == 1024 and message.endswith("...")
    reader.call.cancel()


@dataclass(frozen=True)
class MigDev:
    name: str
    gpu_uuid: str
    placement: tuple[int, int] | None
    mig: Any = None


def test_gpu_instance_failure_marks_only_the_devices_on_its_slices(tmp_path: Path) -> None:
    devices = {
        d.name: d
        for d in (
            MigDev("gpu-0", GPU0, None),
            MigDev("gpu-0-mig-1g10gb-3", GPU0, (3, 1)),
            MigDev("gpu-0-mig-1g10gb-4", GPU0, (4, 1)),
        )
    }
    store = HealthStore(tmp_path / "health.json")
    source = HealthSource(store, devices, pool_name="node-a")
    store.record_instance_xid(GPU0, (3, 1), 94, gpu_instance_id=10)
    _, statuses = source.snapshot()
    healthy = {s.name: s.healthy for s in statuses}
    assert healthy == {
        "gpu-0": False,  # contains slice 3
        "gpu-0-mig-1g10gb-3": False,
        "gpu-0-mig-1g10gb-4": True,
    }
