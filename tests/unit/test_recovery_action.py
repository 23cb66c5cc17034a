"""Health by what the GPU needs: NVML's recovery action, read by the health monitor's
poller over the mock NVML, becomes a taint with its own effect and reason, and goes
by itself once NVML reports NONE again; Xid failures are not touched."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import PoolDevices, build_pool
from driver.errors import DriverError, ErrorClass
from driver.health.monitor import HealthMonitor
from driver.health.prepare_health import KubeDeviceHealth
from driver.health.recovery_taints import (
    RecoveryActions,
    RecoveryAwareHealth,
    RecoveryPoller,
)
from driver.health.store import HealthStore
from driver.health.xid import XidPolicy
from driver.nvml.discovered import HealthEvent
from driver.nvml.mock import mock_api as m
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.recovery_action import RecoveryReading, parse_action
from driver.observability.metrics import REGISTRY
from driver.plugin.health import HealthSource
from driver.state.request import ClaimRef, check_health
from tests.node_events import RecordedNodeEvents
from tests.taints import untimed

DRIVER = "gpu.example.com"
KEY = f"{DRIVER}/recovery-action"
INTERVAL = 5.0


class Publisher:
    def __init__(self) -> None:
        self.triggers = 0

    def trigger(self) -> int:
        self.triggers += 1
        return self.triggers

    def wait_synced(self, ticket: int, timeout: float) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """The plugin's health wiring (driver/plugin/main.py) over a mock NVML, driven one
    monitor iteration at a time with a fake clock."""

    def __init__(self, tmp_path: Path) -> None:
        self.mock = MockNvml(default_fleet(), "node-1")
        self.backend = MockBackend(self.mock)
        self.pool: PoolDevices = build_pool(self.backend.discover())
        self.store = HealthStore(tmp_path / "health.json")
        self.publisher = Publisher()
        self.clock = Clock()
        self.recovery = RecoveryActions(self.pool.devices, driver=DRIVER)
        self.health = RecoveryAwareHealth(
            KubeDeviceHealth(self.store, self.publisher, self.pool.devices),
            self.recovery,
            self.publisher,
        )
        self.events = RecordedNodeEvents()
        self.monitor = HealthMonitor(
            self.backend,
            self.store,
            XidPolicy(),
            self.publisher,
            self.pool.devices,
            wait_timeout_ms=1,
            node_events=self.events,
            driver=DRIVER,
            recovery=self.recovery,
        )
        self.monitor.add_poller(
            RecoveryPoller(
                self.backend.recovery_actions,
                self.recovery,
                self.publisher,
                interval=INTERVAL,
                clock=self.clock,
                on_change=self.monitor.recovery_changed,
            )
        )
        self.stream = HealthSource(
            self.store, self.pool.devices, pool_name="node-1", recovery=self.recovery
        )

    def uuid(self, minor: int) -> str:
        return self.pool.device(f"gpu-{minor}").gpu_uuid

    def names(self, minor: int) -> set[str]:
        return {d.name for d in self.pool.devices_of_gpu(self.uuid(minor))}

    def taints(self) -> dict[str, list[dict[str, str]]]:
        """What the plugin publishes: the store's taints and the recovery actions'."""
        return untimed(
            self.recovery.add_taints(
                self.store.device_taints(self.pool.devices, driver=DRIVER, effect="NoSchedule")
            )
        )

    def recovery_taints(self) -> dict[str, list[dict[str, str]]]:
        return {
            name: [t for t in listed if t["key"] == KEY]
            for name, listed in self.taints().items()
            if any(t["key"] == KEY for t in listed)
        }

    def step(self, seconds: float = 0.0) -> None:
        """Let `seconds` pass, then one monitor iteration (pollers, one event wait)."""
        self.clock.now += seconds
        self.monitor.run_once()

    def drain_events(self) -> None:
        while self.monitor.run_once() is not None:
            pass


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_an_action_taints_every_device_of_its_gpu_with_the_mapped_effect_within_one_poll(
    node: Node,
) -> None:
    node.step()  # the first poll at start: nothing needed
    assert node.taints() == {}
    before = node.publisher.triggers

    node.mock.set_recovery_action(node.uuid(3), m.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
    node.step(INTERVAL)

    expected = {"key": KEY, "value": "drain-and-reset", "effect": "NoExecute"}
    assert node.recovery_taints() == {name: [expected] for name in node.names(3)}
    assert node.publisher.triggers == before + 1
    reason = node.health.failure("gpu-3-mig-1g10gb-2")
    assert reason is not None and reason.startswith(
        "NVML recovery action drain-and-reset: the GPU must be drained and reset"
    )
    assert node.health.failure("gpu-4") is None


def _gpu_healthy(node: Node, minor: int) -> float | None:
    labels = {"uuid": node.uuid(minor), "device": f"gpu-{minor}"}
    return REGISTRY.get_sample_value("gpu_dra_gpu_healthy", labels)


def test_a_recovery_action_is_counted_announced_and_streamed_as_a_failure_is(
    node: Node,
) -> None:
    node.step()
    version, _ = node.stream.snapshot()
    node.mock.set_recovery_action(node.uuid(3), m.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
    node.step(INTERVAL)

    gpu3 = node.names(3)
    assert REGISTRY.get_sample_value("gpu_dra_tainted_devices") == len(gpu3)
    assert (_gpu_healthy(node, 3), _gpu_healthy(node, 4)) == (0.0, 1.0)
    (tainted,) = node.events.posted
    assert (tainted.reason, tainted.event_type) == ("GpuTainted", "Warning")
    assert f"({node.uuid(3)}): NVML recovery action drain-and-reset" in tainted.message
    assert f"taint {KEY}=drain-and-reset:NoExecute on {len(gpu3)} device(s)" in tainted.message
    assert node.store.wait_changed(version, 0) != version  # the kubelet's stream resends
    _, statuses = node.stream.snapshot()
    unhealthy = {s.name: s.message for s in statuses if not s.healthy}
    assert set(unhealthy) == gpu3
    assert all(m.startswith("NVML recovery action drain-and-reset") for m in unhealthy.values())

    node.mock.set_recovery_action(node.uuid(3), m.NVML_GPU_RECOVERY_ACTION_NONE)
    node.step(INTERVAL)
    assert REGISTRY.get_sample_value("gpu_dra_tainted_devices") == 0
    assert _gpu_healthy(node, 3) == 1.0
    cleared = node.events.posted[-1]
    assert (cleared.reason, cleared.event_type) == ("GpuTaintCleared", "Normal")
    assert f"NVML answers no recovery action; taint removed from {len(gpu3)}" in cleared.message
    assert all(s.healthy for s in node.stream.snapshot()[1])


@pytest.mark.parametrize(
    ("action", "value", "effect"),
    [
        (m.NVML_GPU_RECOVERY_ACTION_GPU_RESET, "gpu-reset", "NoSchedule"),
        (m.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, "node-reboot", "NoSchedule"),
        (m.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P, "drain-p2p", "NoExecute"),
        (m.NVML_GPU_RECOVERY_ACTION_BUS_RESET, "bus-reset", "NoSchedule"),
        (m.NVML_GPU_RECOVERY_ACTION_SYSTEM_REBOOT, "system-reboot", "NoSchedule"),
        (42, "action-42", "NoSchedule"),  # newer than this driver: kept off, not ignored
    ],
)
def test_each_action_has_its_effect(node: Node, action: int, value: str, effect: str) -> None:
    node.mock.set_recovery_action(node.uuid(1), action)
    node.step()
    assert node.recovery_taints()["gpu-1"] == [{"key": KEY, "value": value, "effect": effect}]


def test_imex_domain_recovery_is_logged_but_taints_nothing(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    node.mock.set_recovery_action(node.uuid(2), m.NVML_GPU_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN)
    with caplog.at_level(logging.WARNING, logger="driver.health.recovery_taints"):
        node.step()
    assert node.taints() == {}
    assert node.health.failure("gpu-2") is None  # prepare goes on
    assert "NVML recovery action recover-imex-domain: the IMEX domain needs recovery" in caplog.text


def test_back_to_none_and_answering_clears_the_taint_by_itself(node: Node) -> None:
    node.mock.set_recovery_action(node.uuid(3), m.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    node.step()
    assert set(node.recovery_taints()) == node.names(3)
    triggers = node.publisher.triggers

    node.mock.set_recovery_action(node.uuid(3), m.NVML_GPU_RECOVERY_ACTION_NONE)
    node.step(INTERVAL - 1)  # not due yet: no NVML read
    assert set(node.recovery_taints()) == node.names(3)
    node.step(1)
    assert node.taints() == {}
    assert node.publisher.triggers == triggers + 1
    assert node.health.failure("gpu-3") is None


def test_the_automatic_clear_leaves_an_xid_failure_to_the_operator(node: Node) -> None:
    # Xid 48 (double-bit ECC) needs a GPU reset: the mock driver sets the action too.
    node.mock.inject_xid(node.uuid(5), 48)
    node.drain_events()
    node.step(INTERVAL)
    assert node.mock.recovery_action(node.uuid(5)) == m.NVML_GPU_RECOVERY_ACTION_GPU_RESET
    keys = {(t["key"], t.get("value")) for t in node.taints()["gpu-5"]}
    assert keys == {(f"{DRIVER}/xid", "48"), (KEY, "gpu-reset")}

    # The action goes back to NONE without a reset event: only the poll's own taint goes.
    node.mock.set_recovery_action(node.uuid(5), m.NVML_GPU_RECOVERY_ACTION_NONE)
    node.step(INTERVAL)
    assert node.taints()["gpu-5"] == [
        {"key": f"{DRIVER}/xid", "value": "48", "effect": "NoSchedule"}
    ]
    failure = node.store.gpu_failure(node.uuid(5))
    assert failure is not None and failure.value == "48"
    assert node.health.failure("gpu-5") is not None  # still refused: the Xid's


def test_a_gpu_that_does_not_answer_keeps_its_taint(node: Node) -> None:
    node.mock.set_recovery_action(node.uuid(6), m.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    node.step()
    node.mock.inject_gpu_lost(node.uuid(6))
    node.drain_events()
    node.step(INTERVAL)
    assert KEY in {t["key"] for t in node.taints()["gpu-6"]}
    # Another GPU is still read while gpu-6 is lost (handles by index, not by UUID).
    node.mock.set_recovery_action(node.uuid(0), m.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
    node.step(INTERVAL)
    assert "gpu-0" in node.recovery_taints()

    node.mock.reset(node.uuid(6))  # the GPU is back and needs nothing
    node.drain_events()
    node.step(INTERVAL)
    assert "gpu-6" not in node.taints()
    assert "gpu-0" in node.recovery_taints()


def test_reads_are_counted_and_modest(node: Node) -> None:
    gpus = len(node.mock.gpus)
    node.step()  # first read: finds the handles
    first = node.mock.calls["nvmlDeviceGetFieldValues"]
    assert first == gpus
    lookups = node.mock.calls["nvmlDeviceGetHandleByIndex"]
    for _ in range(20):
        node.step(0.1)
    assert node.mock.calls["nvmlDeviceGetFieldValues"] == first  # not before the interval
    node.step(INTERVAL)
    assert node.mock.calls["nvmlDeviceGetFieldValues"] == 2 * gpus
    assert node.mock.calls["nvmlDeviceGetHandleByIndex"] == lookups  # handles are kept


def test_reads_count_as_the_health_monitors_nvml_calls(node: Node) -> None:
    """gpu_dra_nvml_calls_total{caller="health-monitor"} is the monitor thread's count."""
    main_thread = node.backend.nvml_calls.get("MainThread", 0)
    node.monitor.start()
    try:
        deadline = time.monotonic() + 5
        while node.mock.calls["nvmlDeviceGetFieldValues"] < len(node.mock.gpus):
            assert time.monotonic() < deadline, "the monitor thread did not poll"
            time.sleep(0.01)
    finally:
        node.monitor.stop()
    assert node.backend.nvml_calls.get("MainThread", 0) == main_thread
    assert node.backend.nvml_calls[HealthMonitor.THREAD_NAME] >= len(node.mock.gpus)


def test_a_device_with_a_recovery_action_is_refused_at_prepare(node: Node) -> None:
    node.mock.set_recovery_action(node.uuid(2), m.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    node.step()
    with pytest.raises(DriverError) as caught:
        check_health(
            ClaimRef("ns", "claim", "uid"), [{"device": "gpu-2-mig-3g40gb-0"}], node.health
        )
    error = caught.value
    assert error.error_class is ErrorClass.DEVICE_FAILED
    assert "NVML recovery action gpu-reset" in str(error)


def test_an_old_driver_never_taints_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class OldDriver(MockNvml):
        """A driver before R565: the field is not known, the call still succeeds."""

        def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: Sequence[Any]) -> Any:
            values = super().nvmlDeviceGetFieldValues(handle, fieldIds)
            for entry in values:
                entry.nvmlReturn = m.NVML_ERROR_NOT_SUPPORTED
            return values

    mock = OldDriver(default_fleet(), "node-1")
    backend = MockBackend(mock)
    pool = build_pool(backend.discover())
    actions = RecoveryActions(pool.devices, driver=DRIVER)
    clock = Clock()
    poller = RecoveryPoller(backend.recovery_actions, actions, None, clock=clock)
    mock.set_recovery_action(mock.gpus[0].uuid, m.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    with caplog.at_level(logging.INFO, logger="driver.health.recovery_taints"):
        poller()
        clock.now += INTERVAL
        poller()
    assert actions.failures() == {}
    said = [
        r
        for r in caplog.records
        if r.name == "driver.health.recovery_taints" and mock.gpus[0].uuid in r.getMessage()
    ]
    assert len(said) == 1 and "NVML reports no recovery action" in said[0].getMessage()


def test_mock_field_values_are_per_field_as_in_nvml() -> None:
    mock = MockNvml(default_fleet(), "node-1")
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    values = mock.nvmlDeviceGetFieldValues(
        handle, [m.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, (229, 0)]
    )
    assert isinstance(values[0], m.c_nvmlFieldValue_t)
    assert (values[0].nvmlReturn, values[0].valueType) == (
        m.NVML_SUCCESS,
        m.NVML_VALUE_TYPE_UNSIGNED_INT,
    )
    assert values[0].value.uiVal == m.NVML_GPU_RECOVERY_ACTION_NONE
    assert (values[1].fieldId, values[1].nvmlReturn) == (229, m.NVML_ERROR_NOT_SUPPORTED)

    uuid = mock.gpus[0].uuid
    mock.inject(HealthEvent(uuid, "ecc-dbe"))
    assert mock.nvmlDeviceGetFieldValues(handle, [230])[0].value.uiVal == 1
    mock.inject_gpu_lost(uuid)
    with pytest.raises(m.NVMLError) as lost:
        mock.nvmlDeviceGetFieldValues(handle, [230])
    assert lost.value.value == m.NVML_ERROR_GPU_IS_LOST
    mock.reset(uuid)
    assert mock.nvmlDeviceGetFieldValues(handle, [230])[0].value.uiVal == 0


@pytest.mark.parametrize(("xid", "action"), [(48, 1), (95, 1), (119, 1), (79, 0), (94, 0), (13, 0)])
def test_mock_xids_set_the_action_the_driver_would(xid: int, action: int) -> None:
    mock = MockNvml(default_fleet(), "node-1")
    mock.inject_xid(mock.gpus[2].uuid, xid)
    assert mock.recovery_action(mock.gpus[2].uuid) == action
    assert mock.recovery_action(mock.gpus[3].uuid) == 0


def test_the_first_action_stays_until_a_reset() -> None:
    mock = MockNvml(default_fleet(), "node-1")
    uuid = mock.gpus[0].uuid
    mock.set_recovery_action(uuid, m.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
    mock.inject_xid(uuid, 48)
    assert mock.recovery_action(uuid) == m.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    mock.reset(uuid)
    assert mock.recovery_action(uuid) == m.NVML_GPU_RECOVERY_ACTION_NONE


def test_reader_reports_why_a_gpu_did_not_answer() -> None:
    mock = MockNvml(default_fleet(), "node-1")
    backend = MockBackend(mock)
    lost, fine = mock.gpus[1].uuid, mock.gpus[2].uuid
    mock.inject_gpu_lost(lost)
    readings = backend.recovery_actions([lost, fine, "GPU-not-here"])
    assert readings[0] == RecoveryReading(lost, None, error=readings[0].error)
    assert readings[0].error and not readings[0].answered
    assert readings[1] == RecoveryReading(fine, 0)
    assert not readings[2].answered and "no such GPU" in readings[2].error


@pytest.mark.parametrize(
    ("text", "code"),
    [("gpu-reset", 1), ("GPU_RESET", 1), ("drain-and-reset", 4), ("none", 0), ("7", 7)],
)
def test_parse_action(text: str, code: int) -> None:
    assert parse_action(text) == code


@pytest.mark.parametrize("text", ["reboot", "-1", "4294967296", ""])
def test_parse_action_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="recovery action"):
        parse_action(text)


def test_poll_interval_must_be_positive(node: Node) -> None:
    with pytest.raises(ValueError, match="poll interval must be > 0"):
        RecoveryPoller(node.backend.recovery_actions, node.recovery, None, interval=0)
