"""HealthMonitor over MockNvml + NvmlBackend with a fake publisher; KubeDeviceHealth."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from driver.devices.model import PoolDevices, build_pool
from driver.errors import DriverError, ErrorClass
from driver.health.monitor import HealthMonitor, KubeDeviceHealth
from driver.health.store import HealthStore
from driver.health.xid import XidPolicy
from driver.nvml.backend import NvmlBackend
from driver.nvml.fleet import default_fleet
from driver.nvml.mock import MockNvml
from driver.nvml.types import HealthEvent
from driver.observability.metrics import REGISTRY

DRIVER = "gpu.example.com"


class FakePublisher:
    def __init__(self, synced: bool = True) -> None:
        self.synced = synced
        self.triggers: list[float] = []
        self._cond = threading.Condition()

    def trigger(self) -> int:
        with self._cond:
            self.triggers.append(time.monotonic())
            self._cond.notify_all()
            return len(self.triggers)

    def wait_synced(self, ticket: int, timeout: float) -> bool:
        return self.synced

    def wait_triggers(self, count: int, timeout: float = 2.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.triggers) >= count, timeout)


@dataclass
class Rig:
    mock: MockNvml
    pool: PoolDevices
    store: HealthStore
    publisher: FakePublisher
    monitor: HealthMonitor
    path: Path
    started: list[HealthMonitor] = field(default_factory=list)

    def uuid(self, minor: int) -> str:
        return next(d.gpu_uuid for d in self.pool.devices if d.name == f"gpu-{minor}")

    def taints(self) -> dict[str, list[dict[str, str]]]:
        return self.store.device_taints(self.pool.devices, driver=DRIVER, effect="NoSchedule")

    def names_of(self, minor: int) -> set[str]:
        return {d.name for d in self.pool.devices_of_gpu(self.uuid(minor))}

    def wait_handled(self, count: int, timeout: float = 2.0) -> None:
        deadline = time.monotonic() + timeout
        while self.monitor.events_handled < count:
            assert time.monotonic() < deadline, f"only {self.monitor.events_handled} handled"
            time.sleep(0.005)


def make_rig(path: Path) -> Rig:
    mock = MockNvml(default_fleet(), "node-1")
    backend = NvmlBackend(mock)
    pool = build_pool(backend.discover())
    store = HealthStore(path)
    publisher = FakePublisher()
    monitor = HealthMonitor(backend, store, XidPolicy(), publisher, pool.devices)
    return Rig(mock, pool, store, publisher, monitor, path)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = make_rig(tmp_path / "health.json")
    r.monitor.start()
    yield r
    r.monitor.stop()


def xid_count(xid: str, verdict: str) -> float:
    value = REGISTRY.get_sample_value("gpu_dra_xid_events_total", {"xid": xid, "verdict": verdict})
    return value or 0.0


def test_fatal_xid_taints_gpu_and_all_partitions_quickly(rig: Rig) -> None:
    before = xid_count("79", "fatal")
    start = time.monotonic()
    rig.mock.inject_xid(rig.uuid(3), 79)
    assert rig.publisher.wait_triggers(1)
    latency = rig.publisher.triggers[0] - start
    assert latency < 0.5
    taints = rig.taints()
    names = rig.names_of(3)
    assert len(names) > 1  # the GPU and its MIG partitions
    assert set(taints) == names
    assert all(
        t == [{"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule"}]
        for t in taints.values()
    )
    assert xid_count("79", "fatal") == before + 1
    gauge = REGISTRY.get_sample_value("gpu_dra_tainted_devices")
    assert gauge == len(names)


def test_application_xid_changes_nothing(rig: Rig) -> None:
    before = xid_count("13", "ignored")
    rig.mock.inject_xid(rig.uuid(2), 13)
    rig.wait_handled(1)
    assert rig.taints() == {}
    assert rig.publisher.triggers == []
    assert xid_count("13", "ignored") == before + 1


def test_ignored_xid_never_weakens_a_taint(rig: Rig) -> None:
    rig.mock.inject_xid(rig.uuid(1), 79)
    rig.mock.inject_xid(rig.uuid(1), 13)
    rig.wait_handled(2)
    taints = rig.taints()
    assert set(taints) == rig.names_of(1)
    assert taints["gpu-1"][0]["value"] == "79"
    assert len(rig.publisher.triggers) == 1


def test_gpu_lost_then_xid_keeps_gpu_lost(rig: Rig) -> None:
    rig.mock.inject_gpu_lost(rig.uuid(4))
    assert rig.publisher.wait_triggers(1)
    rig.mock.inject_xid(rig.uuid(4), 79)
    rig.wait_handled(2)
    taints = rig.taints()
    assert set(taints) == rig.names_of(4)
    assert taints["gpu-4-mig-1g10gb-0"] == [{"key": f"{DRIVER}/gpu-lost", "effect": "NoSchedule"}]


def test_double_bit_ecc_is_fatal(rig: Rig) -> None:
    rig.mock.inject(HealthEvent(rig.uuid(5), "ecc-dbe"))
    assert rig.publisher.wait_triggers(1)
    assert rig.taints()["gpu-5"][0]["value"] == "48"


def test_reset_clears_taints(rig: Rig) -> None:
    rig.mock.inject_gpu_lost(rig.uuid(6))
    rig.mock.inject_xid(rig.uuid(7), 79)
    assert rig.publisher.wait_triggers(2)
    rig.mock.reset(rig.uuid(6))
    assert rig.publisher.wait_triggers(3)
    assert set(rig.taints()) == rig.names_of(7)
    rig.mock.reset(rig.uuid(7))
    assert rig.publisher.wait_triggers(4)
    assert rig.taints() == {}
    assert not rig.mock.is_lost(rig.uuid(6))


def test_taints_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    first = make_rig(path)
    first.monitor.start()
    try:
        first.mock.inject_xid(first.uuid(0), 79)
        assert first.publisher.wait_triggers(1)
    finally:
        first.monitor.stop()
    second = make_rig(path)  # a new process: fresh mock, store read from disk
    assert set(second.taints()) == second.names_of(0)
    assert REGISTRY.get_sample_value("gpu_dra_tainted_devices") == len(second.names_of(0))
    second.monitor.start()
    try:
        second.mock.inject_xid(second.uuid(0), 13)  # ignored: still tainted
        second.mock.reset(second.uuid(0))
        assert second.publisher.wait_triggers(1)
        assert second.taints() == {}
    finally:
        second.monitor.stop()
    assert HealthStore(path).failed_gpus() == {}


class FlakySource:
    """Raises on open and on waits now and then; the monitor must survive."""

    def __init__(self, events: list[HealthEvent | Exception]) -> None:
        self.events = events
        self.opens = 0
        self.closes = 0

    def open_event_set(self) -> None:
        self.opens += 1
        if self.opens == 1:
            raise RuntimeError("NVML hiccup on open")

    def wait_event(self, timeout_ms: int) -> HealthEvent | None:
        if not self.events:
            time.sleep(timeout_ms / 1000)
            return None
        item = self.events.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def close_event_set(self) -> None:
        self.closes += 1


def test_monitor_survives_exceptions(tmp_path: Path) -> None:
    uuid = "GPU-00000000-0000-4000-8000-000000000000"
    source = FlakySource([RuntimeError("wait failed"), HealthEvent(uuid, "xid", xid=79)])
    store = HealthStore(tmp_path / "health.json")
    publisher = FakePublisher()
    polls: list[int] = []

    def bad_poller() -> None:
        polls.append(1)
        raise OSError("spool unreadable")

    monitor = HealthMonitor(
        source, store, XidPolicy(), publisher, (), pollers=[bad_poller], error_backoff=0.01
    )
    monitor.start()
    try:
        assert publisher.wait_triggers(1)
        assert monitor.running
        assert monitor.errors == 2  # open failed, then one wait failed
        assert source.opens == 3 and source.closes >= 1
        assert len(polls) >= 3
    finally:
        monitor.stop()
    assert not monitor.running
    assert store.gpu_failure(uuid) is not None


def test_rejects_long_wait_timeouts(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        HealthMonitor(
            FlakySource([]),
            HealthStore(tmp_path / "h.json"),
            XidPolicy(),
            None,
            (),
            wait_timeout_ms=5000,
        )


# -- KubeDeviceHealth ------------------------------------------------------------------


def kube_health(tmp_path: Path, synced: bool) -> tuple[KubeDeviceHealth, Rig]:
    rig = make_rig(tmp_path / "health.json")
    rig.publisher.synced = synced
    health = KubeDeviceHealth(rig.store, rig.publisher, rig.pool.devices, sync_timeout=0.1)
    return health, rig


def test_kube_device_health_failure_and_taint(tmp_path: Path) -> None:
    health, rig = kube_health(tmp_path, synced=True)
    store, uuid = rig.store, rig.uuid
    assert health.failure("gpu-2-mig-1g10gb-0") is None
    store.record_xid(uuid(2), 79)
    message = health.failure("gpu-2-mig-1g10gb-0")
    assert message is not None and message.startswith("Xid 79")
    assert health.failure("gpu-2") == message
    assert health.failure("gpu-3") is None
    assert health.failure("not-a-device") is None
    health.ensure_tainted("gpu-2-mig-1g10gb-0")  # accepted: returns


def test_kube_device_health_unsynced_is_transient(tmp_path: Path) -> None:
    health, rig = kube_health(tmp_path, synced=False)
    store, uuid = rig.store, rig.uuid
    store.record_lost(uuid(1))
    assert health.failure("gpu-1") is not None
    with pytest.raises(DriverError) as err:
        health.ensure_tainted("gpu-1")
    assert err.value.error_class is ErrorClass.TRANSIENT
    with pytest.raises(DriverError) as err:
        health.ensure_tainted("gpu-0")  # nothing to publish
    assert err.value.error_class is ErrorClass.TRANSIENT
