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
from driver.health.monitor import HealthMonitor
from driver.health.prepare_health import KubeDeviceHealth
from driver.health.store import HealthStore
from driver.health.xid import XidPolicy
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import HealthEvent, MigInstance
from driver.nvml.mig.mig_manager import MigTarget
from driver.nvml.mock.fleet import Fleet, default_fleet, parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.observability.metrics import REGISTRY
from tests.taints import untimed

DRIVER = "gpu.example.com"
# Seconds to wait for the monitor thread to act on an event: it acts at once, so only
# a regression waits this long; a busy machine never does.
EVENT_WAIT = 30.0


class FakePublisher:
    def __init__(self, synced: bool = True) -> None:
        self.synced = synced
        self.triggers = 0
        self._cond = threading.Condition()

    def trigger(self) -> int:
        with self._cond:
            self.triggers += 1
            self._cond.notify_all()
            return self.triggers

    def wait_synced(self, ticket: int, timeout: float) -> bool:
        return self.synced

    def wait_triggers(self, count: int, timeout: float = EVENT_WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.triggers >= count, timeout)


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
        return untimed(
            self.store.device_taints(self.pool.devices, driver=DRIVER, effect="NoSchedule")
        )

    def names_of(self, minor: int) -> set[str]:
        return {d.name for d in self.pool.devices_of_gpu(self.uuid(minor))}

    def wait_handled(self, count: int, timeout: float = EVENT_WAIT) -> None:
        deadline = time.monotonic() + timeout
        while self.monitor.events_handled < count:
            assert time.monotonic() < deadline, f"only {self.monitor.events_handled} handled"
            time.sleep(0.005)


def make_rig(path: Path, driver_root: Path | None = None, fleet: Fleet | None = None) -> Rig:
    mock = MockNvml(fleet or default_fleet(), "node-1", driver_root=driver_root)
    backend = MockBackend(mock)
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


def test_fatal_xid_taints_gpu_and_all_partitions(rig: Rig) -> None:
    """The event itself triggers the publish (how fast, Xid -> taint visible in the
    API, is measured by `make bench`, not asserted here)."""
    before = xid_count("79", "fatal")
    rig.mock.inject_xid(rig.uuid(3), 79)
    assert rig.publisher.wait_triggers(1)
    assert rig.monitor.events_handled == 1
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
    assert rig.publisher.triggers == 0
    assert xid_count("13", "ignored") == before + 1


def test_ignored_xid_never_weakens_a_taint(rig: Rig) -> None:
    rig.mock.inject_xid(rig.uuid(1), 79)
    rig.mock.inject_xid(rig.uuid(1), 13)
    rig.wait_handled(2)
    taints = rig.taints()
    assert set(taints) == rig.names_of(1)
    assert taints["gpu-1"][0]["value"] == "79"
    assert rig.publisher.triggers == 1


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


# -- MIG partitions ----------------------------------------------------------------------

PROFILE_1G = 19  # 1g.10gb on an H100 80GB: one memory slice


def create_1g(rig: Rig, minor: int, start: int) -> MigInstance:
    """Create the 1g.10gb partition at `start` as prepare does (dynamic MIG)."""
    return NvmlBackend(rig.mock).mig().create(MigTarget(rig.uuid(minor), PROFILE_1G, (start, 1), 1))


def on_slice_3(rig: Rig, minor: int) -> set[str]:
    """The devices of the GPU whose memory slices include slice 3."""
    names = set()
    for d in rig.pool.devices_of_gpu(rig.uuid(minor)):
        start, size = d.placement or (0, 8)
        if start <= 3 < start + size:
            names.add(d.name)
    return names


@pytest.fixture
def mig_rig(tmp_path: Path) -> Iterator[Rig]:
    r = make_rig(tmp_path / "health.json", tmp_path / "driver-root")
    assert r.pool.mig_modes[r.uuid(0)] == "dynamic"
    r.monitor.start()
    yield r
    r.monitor.stop()


def test_xid_on_a_gpu_instance_taints_its_partition_and_the_gpu_only(mig_rig: Rig) -> None:
    rig = mig_rig
    failed = create_1g(rig, 0, 3)
    create_1g(rig, 0, 4)  # a sibling partition in use on the next slice
    rig.mock.inject_xid(
        rig.uuid(0), 94, gpu_instance_id=failed.gi_id, compute_instance_id=failed.ci_id
    )
    assert rig.publisher.wait_triggers(1)
    taints = rig.taints()
    assert set(taints) == on_slice_3(rig, 0)
    assert {"gpu-0", "gpu-0-mig-1g10gb-3", "gpu-0-mig-3g40gb-0"} <= set(taints)
    for sibling in ("gpu-0-mig-1g10gb-4", "gpu-0-mig-1g10gb-2", "gpu-0-mig-3g40gb-4"):
        assert sibling not in taints
    assert taints["gpu-0-mig-1g10gb-3"] == [
        {"key": f"{DRIVER}/xid", "value": "94", "effect": "NoSchedule"}
    ]
    assert rig.store.gpu_failure(rig.uuid(0)) is None  # the GPU itself is not failed
    failure = rig.store.failed_instances()[rig.uuid(0)][(3, 1)]
    assert (failure.gpu_instance_id, failure.compute_instance_id) == (failed.gi_id, failed.ci_id)
    assert REGISTRY.get_sample_value("gpu_dra_tainted_devices") == len(taints)


def test_unattributed_xid_on_a_mig_gpu_taints_everything_of_it(mig_rig: Rig) -> None:
    rig = mig_rig
    create_1g(rig, 0, 3)
    rig.mock.inject_xid(rig.uuid(0), 79)
    assert rig.publisher.wait_triggers(1)
    assert set(rig.taints()) == rig.names_of(0)


def test_xid_on_a_vanished_gpu_instance_fails_the_whole_gpu(mig_rig: Rig) -> None:
    rig = mig_rig
    gone = create_1g(rig, 0, 3)
    NvmlBackend(rig.mock).mig().destroy(rig.uuid(0), gone.gi_id)  # unprepared meanwhile
    rig.mock.inject_xid(rig.uuid(0), 94, gpu_instance_id=gone.gi_id)
    assert rig.publisher.wait_triggers(1)
    assert set(rig.taints()) == rig.names_of(0)
    failure = rig.store.gpu_failure(rig.uuid(0))
    assert failure is not None and "no longer exists" in failure.message()


def test_ignored_xid_on_a_gpu_instance_costs_no_lookup(mig_rig: Rig) -> None:
    rig = mig_rig
    instance = create_1g(rig, 0, 3)
    before = rig.mock.calls["nvmlDeviceGetGpuInstances"]
    rig.mock.inject_xid(rig.uuid(0), 43, gpu_instance_id=instance.gi_id)  # application Xid
    rig.wait_handled(1)
    assert rig.taints() == {}
    assert rig.mock.calls["nvmlDeviceGetGpuInstances"] == before


def test_instance_taint_survives_a_restart_and_reset_clears_it(tmp_path: Path) -> None:
    path, root = tmp_path / "health.json", tmp_path / "driver-root"
    first = make_rig(path, root)
    first.monitor.start()
    try:
        failed = create_1g(first, 1, 3)
        first.mock.inject_xid(first.uuid(1), 94, gpu_instance_id=failed.gi_id)
        assert first.publisher.wait_triggers(1)
        expected = on_slice_3(first, 1)
        assert set(first.taints()) == expected
        # Unprepare destroys the partition: its placement stays tainted.
        NvmlBackend(first.mock).mig().destroy(first.uuid(1), failed.gi_id)
    finally:
        first.monitor.stop()
    second = make_rig(path, root)  # a new process on the same node
    assert set(second.taints()) == expected
    second.monitor.start()
    try:
        second.mock.reset(second.uuid(1))
        assert second.publisher.wait_triggers(1)
        assert second.taints() == {}
    finally:
        second.monitor.stop()
    assert HealthStore(path).failed_instances() == {}


def test_static_mig_device_is_tainted_alone(tmp_path: Path) -> None:
    fleet = parse_fleet(
        {
            "gpus": [
                {
                    "model": "H100-80GB",
                    "migInstances": [
                        {"profile": "1g.10gb", "start": 5},
                        {"profile": "1g.10gb", "start": 6},
                    ],
                }
            ]
        }
    )
    rig = make_rig(tmp_path / "health.json", tmp_path / "driver-root", fleet)
    uuid = rig.mock.gpus[0].uuid
    assert rig.pool.mig_modes[uuid] == "static"
    static = {d.name: d for d in rig.pool.devices}
    assert set(static) == {"gpu-0-mig-1g10gb-5", "gpu-0-mig-1g10gb-6"}
    existing = static["gpu-0-mig-1g10gb-6"].mig
    assert existing is not None and existing.existing is not None
    rig.monitor.start()
    try:
        rig.mock.inject_xid(
            uuid,
            79,
            gpu_instance_id=existing.existing.gi_id,
            compute_instance_id=existing.existing.ci_id,
        )
        assert rig.publisher.wait_triggers(1)
        assert set(rig.taints()) == {"gpu-0-mig-1g10gb-6"}
    finally:
        rig.monitor.stop()


def test_kube_device_health_sees_instance_failures(tmp_path: Path) -> None:
    rig = make_rig(tmp_path / "health.json", tmp_path / "driver-root")
    health = KubeDeviceHealth(rig.store, rig.publisher, rig.pool.devices, sync_timeout=0.1)
    rig.store.record_instance_xid(rig.uuid(2), (3, 1), 94, gpu_instance_id=10)
    message = health.failure("gpu-2-mig-1g10gb-3")
    assert message is not None and message.startswith("Xid 94 on GPU instance 10")
    assert health.failure("gpu-2") == message
    assert health.failure("gpu-2-mig-1g10gb-4") is None
    health.ensure_tainted("gpu-2-mig-1g10gb-3")
    with pytest.raises(DriverError) as err:
        health.ensure_tainted("gpu-2-mig-1g10gb-4")
    assert err.value.error_class is ErrorClass.TRANSIENT


def test_failed_instance_lookup_fails_the_whole_gpu(tmp_path: Path) -> None:
    uuid = "GPU-00000000-0000-4000-8000-000000000000"

    def unlistable(gpu_uuid: str) -> list[MigInstance]:
        raise RuntimeError("NVML hiccup")

    store = HealthStore(tmp_path / "health.json")
    monitor = HealthMonitor(
        FlakySource([]), store, XidPolicy(), FakePublisher(), (), mig_instances=unlistable
    )
    assert monitor.handle(HealthEvent(uuid, "xid", xid=94, gpu_instance_id=9))
    failure = store.gpu_failure(uuid)
    assert failure is not None and "could not be listed (NVML hiccup)" in failure.message()
    assert store.failed_instances() == {}
    # A source without MIG (no `mig()`) cannot place it either.
    other = HealthStore(tmp_path / "other.json")
    plain = HealthMonitor(FlakySource([]), other, XidPolicy(), FakePublisher(), ())
    assert plain.handle(HealthEvent(uuid, "xid", xid=94, gpu_instance_id=9))
    assert other.gpu_failure(uuid) is not None
