"""`gpu-dra mock ...` through the plugin's status socket to a running monitor's MockNvml."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from driver.cli import mock as mock_cli
from driver.cli.mock import MockSubmitError, submit
from driver.cli.plugin_endpoint import fetch_control
from driver.devices.model import PoolDevices, build_pool
from driver.health.control_queue import ControlQueue
from driver.health.monitor import DEFAULT_WAIT_TIMEOUT_MS, HealthMonitor
from driver.health.store import HealthStore
from driver.health.xid import XidPolicy
from driver.nvml.backend import NvmlBackend
from driver.nvml.discovered import MigInstance
from driver.nvml.mig.mig_manager import MigTarget
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.mock_control import MockActions, MockControlError, MockRequest
from driver.nvml.mock.nvml import MockNvml
from driver.observability.status_socket import status_socket_path
from tests.control_socket import ServedMonitor, control_socket

DRIVER = "gpu.example.com"
# Seconds to wait for the plugin (or the test's stand-in for one) to act: it acts at
# once, so only a regression waits this long; a busy machine never does.
EVENT_WAIT = 30.0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-dra")
    mock_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = parse(argv)
    code = args.run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


class Plugin(ServedMonitor):
    """A monitor over a mock backend with its control requests on the status socket in
    `state_dir`, as the plugin wires them (`start`, `stop`)."""

    def __init__(self, state_dir: Path, driver_root: Path | None = None) -> None:
        self.mock = MockNvml(default_fleet(), "node-1", driver_root=driver_root)
        self.state_dir = state_dir
        backend = MockBackend(self.mock)
        self.pool: PoolDevices = build_pool(backend.discover())
        self.store = HealthStore(state_dir / "health.json")
        self.monitor = HealthMonitor(
            backend,
            self.store,
            XidPolicy(),
            None,
            self.pool.devices,
            node_name="node-1",
            control_actions=backend.control_actions(self.pool.devices),
            wait_timeout_ms=backend.event_wait_ms,
        )
        self._serving = contextlib.ExitStack()

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + EVENT_WAIT
        while not predicate():
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.005)


@pytest.fixture
def plugin(short_dir: Path) -> Iterator[Plugin]:
    p = Plugin(short_dir)
    p.start()
    yield p
    p.stop()


def test_xid_lost_reset_round_trip(plugin: Plugin, short_dir: Path) -> None:
    code, out, err = cli(
        ["mock", "xid", "--device", "gpu-3", "--xid", "79", "--state-dir", str(short_dir)]
    )
    assert (code, err) == (0, "")
    assert out.startswith("injected: Xid 79 on gpu-3 (GPU-")
    plugin.wait_for(lambda: plugin.store.gpu_failure(plugin.uuid(3)) is not None)
    taints = plugin.store.device_taints(plugin.pool.devices, driver=DRIVER, effect="NoSchedule")
    assert set(taints) == {d.name for d in plugin.pool.devices_of_gpu(plugin.uuid(3))}

    # A partition name means its GPU.
    code, out, _ = cli(
        ["mock", "lost", "--device", "gpu-2-mig-1g10gb-0", "--state-dir", str(short_dir)]
    )
    assert code == 0 and plugin.uuid(2) in out
    plugin.wait_for(lambda: plugin.store.gpu_failure(plugin.uuid(2)) is not None)
    failure = plugin.store.gpu_failure(plugin.uuid(2))
    assert failure is not None and failure.kind == "gpu-lost"
    assert plugin.mock.is_lost(plugin.uuid(2))

    code, out, _ = cli(["mock", "reset", "--device", "gpu-3", "--state-dir", str(short_dir)])
    assert code == 0 and out.startswith("injected: reset of gpu-3")
    plugin.wait_for(lambda: plugin.store.gpu_failure(plugin.uuid(3)) is None)
    assert plugin.store.gpu_failure(plugin.uuid(2)) is not None

    code, out, _ = cli(["mock", "reset", "--all", "--state-dir", str(short_dir)])
    assert code == 0 and out.startswith("injected: reset of all GPUs")
    plugin.wait_for(lambda: plugin.store.failed_gpus() == {})
    assert not plugin.mock.is_lost(plugin.uuid(2))


def test_application_xid_via_cli_changes_nothing(plugin: Plugin, short_dir: Path) -> None:
    assert (
        cli(["mock", "xid", "--device", "gpu-1", "--xid", "13", "--state-dir", str(short_dir)])[0]
        == 0
    )
    plugin.wait_for(lambda: plugin.monitor.events_handled >= 1)
    assert plugin.store.failed_gpus() == {}


def test_the_requests_go_to_the_root_only_status_socket(plugin: Plugin, short_dir: Path) -> None:
    socket_file = status_socket_path(short_dir)
    assert stat.S_IMODE(socket_file.lstat().st_mode) == 0o600
    described = fetch_control(socket_file)
    assert described["pid"] == os.getpid() and described["node"] == "node-1"
    assert described["actions"] == ["clear", "lost", "process", "recovery-action", "reset", "xid"]


def test_unknown_device_is_refused(plugin: Plugin, short_dir: Path) -> None:
    code, out, err = cli(
        ["mock", "xid", "--device", "gpu-99", "--xid", "79", "--state-dir", str(short_dir)]
    )
    assert code == 1 and out == ""
    assert "the plugin refused the request: unknown device 'gpu-99'" in err
    assert "gpu-0" in err
    assert plugin.store.failed_gpus() == {}


def test_no_plugin_fails_clearly(short_dir: Path) -> None:
    code, _, err = cli(
        ["mock", "xid", "--device", "gpu-3", "--xid", "79", "--state-dir", str(short_dir)]
    )
    assert code == 1
    assert "no kubelet plugin answers" in err and "no such socket" in err
    assert list(short_dir.iterdir()) == []  # the CLI creates nothing


def test_stopped_plugin_fails_clearly(short_dir: Path) -> None:
    plugin = Plugin(short_dir)
    plugin.start()
    plugin.stop()
    assert not status_socket_path(short_dir).exists()
    code, _, err = cli(["mock", "reset", "--all", "--state-dir", str(short_dir)])
    assert code == 1 and "no kubelet plugin answers" in err


def test_a_request_the_monitor_does_not_take_is_withdrawn(short_dir: Path) -> None:
    nvml = MockNvml(default_fleet(), "node-1")
    control = ControlQueue()
    control.register_all(MockActions(nvml).handlers())
    with (
        control_socket(short_dir, control),  # served, but no monitor takes requests
        pytest.raises(MockSubmitError, match=r"did not take the request within 0.1s"),
    ):
        submit(short_dir, MockRequest("lost", device="gpu-0"), timeout=0.1)
    assert control.poll() == 0  # withdrawn: nothing left to apply
    assert not nvml.is_lost(nvml.gpus[0].uuid)


def test_the_mock_actions_inject_into_the_mock(short_dir: Path) -> None:
    nvml = MockNvml(default_fleet(), "node-1")
    backend = MockBackend(nvml)
    backend.open_event_set()
    control = ControlQueue()
    control.register_all(backend.control_actions(()))
    answers: list[str] = []
    with control_socket(short_dir, control):
        thread = threading.Thread(
            target=lambda: answers.append(
                submit(short_dir, MockRequest("xid", device="gpu-5", xid=94))
            )
        )
        thread.start()
        deadline = time.monotonic() + EVENT_WAIT
        while not control.poll():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        thread.join(EVENT_WAIT)
    assert answers and answers[0].startswith("Xid 94 on gpu-5")
    event = backend.wait_event(100)
    assert event is not None and (event.gpu_uuid, event.kind, event.xid) == (
        nvml.gpus[5].uuid,
        "xid",
        94,
    )
    backend.close_event_set()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["mock", "reset"], "one of the arguments --device --all is required"),
        (["mock", "reset", "--device", "gpu-0", "--all"], "not allowed with argument"),
        (["mock", "xid", "--device", "gpu-0", "--xid", "abc"], "not an Xid: 'abc'"),
        (["mock", "xid", "--device", "gpu-0", "--xid", "0"], "out of range"),
        (["mock", "xid", "--device", "gpu-0"], "the following arguments are required: --xid"),
        (["mock", "lost"], "the following arguments are required: --device"),
        (["mock"], "required"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_default_state_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPU_DRA_STATE_DIR", raising=False)
    args = parse(["mock", "reset", "--all"])
    assert args.state_dir == "/var/lib/kubelet/plugins/gpu.example.com"
    assert mock_cli.request_from_args(args) == MockRequest("reset", all=True)


# -- xid --instance: an Xid attributed to a partition's GPU instance ----------------------


@pytest.fixture
def mig_plugin(short_dir: Path) -> Iterator[Plugin]:
    p = Plugin(short_dir, driver_root=short_dir / "driver-root")
    p.start()
    yield p
    p.stop()


def create(
    plugin: Plugin, minor: int, profile_id: int, placement: tuple[int, int], slices: int = 1
) -> MigInstance:
    target = MigTarget(plugin.uuid(minor), profile_id, placement, slices)
    return NvmlBackend(plugin.mock).mig().create(target)


def test_xid_on_a_partitions_gpu_instance(mig_plugin: Plugin, short_dir: Path) -> None:
    plugin = mig_plugin
    instance = create(plugin, 0, 19, (3, 1))  # gpu-0-mig-1g10gb-3, prepared
    create(plugin, 0, 19, (4, 1))  # gpu-0-mig-1g10gb-4, prepared too
    code, out, err = cli(
        [
            "mock",
            "xid",
            "--device",
            "gpu-0-mig-1g10gb-3",
            "--xid",
            "94",
            "--instance",
            "--state-dir",
            str(short_dir),
        ]
    )
    assert (code, err) == (0, "")
    assert out.startswith("injected: Xid 94 on the GPU instance of gpu-0-mig-1g10gb-3 (GPU-")
    assert f"GPU instance {instance.gi_id}, compute instance {instance.ci_id})" in out
    plugin.wait_for(lambda: bool(plugin.store.failed_instances()))
    failure = plugin.store.failed_instances()[plugin.uuid(0)][(3, 1)]
    assert (failure.gpu_instance_id, failure.compute_instance_id) == (
        instance.gi_id,
        instance.ci_id,
    )
    taints = plugin.store.device_taints(plugin.pool.devices, driver=DRIVER)
    assert {"gpu-0", "gpu-0-mig-1g10gb-3", "gpu-0-mig-7g80gb-0"} <= set(taints)
    assert "gpu-0-mig-1g10gb-4" not in taints and "gpu-0-mig-1g10gb-2" not in taints
    assert plugin.store.gpu_failure(plugin.uuid(0)) is None

    code, out, _ = cli(["mock", "reset", "--device", "gpu-0", "--state-dir", str(short_dir)])
    assert code == 0
    plugin.wait_for(lambda: plugin.store.failed_instances() == {})
    assert plugin.store.device_taints(plugin.pool.devices) == {}


def test_whole_gpu_of_a_dynamic_mig_gpu_has_an_instance_when_prepared(
    mig_plugin: Plugin, short_dir: Path
) -> None:
    plugin = mig_plugin
    argv = ["mock", "xid", "--device", "gpu-1", "--xid", "79", "--instance"]
    code, _, err = cli([*argv, "--state-dir", str(short_dir)])
    assert code == 1 and "gpu-1 has no GPU instance now" in err
    create(plugin, 1, 0, (0, 8), 7)  # the whole GPU, delivered as a 7g.80gb MIG device
    code, _, err = cli([*argv, "--state-dir", str(short_dir)])
    assert (code, err) == (0, "")
    plugin.wait_for(lambda: bool(plugin.store.failed_instances()))
    taints = plugin.store.device_taints(plugin.pool.devices)
    assert set(taints) == {d.name for d in plugin.pool.devices_of_gpu(plugin.uuid(1))}


def test_instance_needs_a_live_gpu_instance(mig_plugin: Plugin, short_dir: Path) -> None:
    plugin = mig_plugin
    create(plugin, 0, 20, (3, 1))  # 1g.10gb+me at slice 3: not the 1g.10gb partition
    code, out, err = cli(
        [
            "mock",
            "xid",
            "--device",
            "gpu-0-mig-1g10gb-3",
            "--xid",
            "94",
            "--instance",
            "--state-dir",
            str(short_dir),
        ]
    )
    assert code == 1 and out == ""
    assert "gpu-0-mig-1g10gb-3 has no GPU instance now" in err
    assert "only while it is prepared" in err
    code, _, err = cli(
        [
            "mock",
            "xid",
            "--device",
            plugin.uuid(0),
            "--xid",
            "94",
            "--instance",
            "--state-dir",
            str(short_dir),
        ]
    )
    assert code == 1 and "is not a MIG device of this node" in err
    plugin.wait_for(lambda: plugin.mock.calls["nvmlDeviceGetGpuInstances"] > 0)
    assert plugin.store.failed_gpus() == {} and plugin.store.failed_instances() == {}


def test_instance_flag_only_for_xid(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["mock", "lost", "--device", "gpu-0", "--instance"])
    assert "unrecognized arguments: --instance" in capsys.readouterr().err
    with pytest.raises(MockControlError, match="only valid for the xid action"):
        MockRequest("reset", device="gpu-0", instance=True).validate()
    with pytest.raises(MockControlError, match="either --device or --all"):
        MockRequest("reset", device="gpu-0", all=True).validate()


def test_requests_without_instance_are_unchanged_on_the_wire() -> None:
    """An older plugin gets exactly the bytes it always got; an older CLI's request
    (no `instance` key) means the whole GPU."""
    plain = MockRequest("xid", device="gpu-0", xid=79)
    assert json.loads(plain.to_json()) == {
        "action": "xid",
        "device": "gpu-0",
        "xid": 79,
        "all": False,
    }
    assert MockRequest.from_json(plain.to_json()) == plain
    attributed = MockRequest("xid", device="gpu-0-mig-1g10gb-3", xid=94, instance=True)
    assert json.loads(attributed.to_json())["instance"] is True
    assert MockRequest.from_json(attributed.to_json()) == attributed
    parsed = parse(["mock", "xid", "--device", "gpu-0-mig-1g10gb-3", "--xid", "94", "--instance"])
    assert mock_cli.request_from_args(parsed) == attributed


def test_plugin_predating_instance_is_reported(short_dir: Path) -> None:
    """A plugin that predates `--instance` ignores the key: it injects a whole-GPU Xid
    and answers without `instance`."""
    control = ControlQueue()
    control.register("xid", lambda request: {"message": "Xid 94 on gpu-0"})
    request = MockRequest("xid", device="gpu-0-mig-1g10gb-3", xid=94, instance=True)
    errors: list[str] = []

    def send() -> None:
        try:
            submit(short_dir, request, timeout=EVENT_WAIT)
        except MockSubmitError as err:
            errors.append(str(err))

    with control_socket(short_dir, control):
        thread = threading.Thread(target=send)
        thread.start()
        deadline = time.monotonic() + EVENT_WAIT
        while not control.poll():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        thread.join(EVENT_WAIT)
    assert errors and "predates --instance" in errors[0] and "whole GPU" in errors[0]


def test_over_the_mock_requests_are_taken_as_often_as_an_event_would_wake_a_wait(
    short_dir: Path,
) -> None:
    """An injected event waits for its request to be taken between NVML waits: over
    the mock the wait is short, so the mock's events are not delayed by the transport."""
    assert MockBackend.event_wait_ms == 20 < DEFAULT_WAIT_TIMEOUT_MS
    assert Plugin(short_dir).monitor.wait_timeout_ms == MockBackend.event_wait_ms
    plain = HealthMonitor(
        MockBackend(MockNvml(default_fleet(), "node-1")),
        HealthStore(short_dir / "other.json"),
        XidPolicy(),
        None,
    )
    assert plain.wait_timeout_ms == DEFAULT_WAIT_TIMEOUT_MS


# -- recovery-action: the NVML field the plugin polls --------------------------------------


def test_recovery_action_round_trip(plugin: Plugin, short_dir: Path) -> None:
    uuid = plugin.uuid(3)
    argv = ["mock", "recovery-action", "--device", "gpu-3-mig-1g10gb-2", "--action"]
    code, out, err = cli([*argv, "DRAIN_AND_RESET", "--state-dir", str(short_dir)])
    assert (code, err) == (0, "")
    assert out == f"injected: recovery action drain-and-reset on gpu-3-mig-1g10gb-2 ({uuid})\n"
    assert plugin.mock.recovery_action(uuid) == 4  # a partition name means its GPU
    assert plugin.mock.recovery_action(plugin.uuid(2)) == 0

    code, out, _ = cli([*argv, "none", "--state-dir", str(short_dir)])
    assert code == 0 and "recovery action none" in out
    assert plugin.mock.recovery_action(uuid) == 0
    # The field is all it changes: no health event, no record.
    assert plugin.monitor.events_handled == 0 and plugin.store.failed_gpus() == {}


def test_reset_clears_the_recovery_action(plugin: Plugin, short_dir: Path) -> None:
    state = ["--state-dir", str(short_dir)]
    cli(["mock", "recovery-action", "--device", "gpu-1", "--action", "node-reboot", *state])
    assert plugin.mock.recovery_action(plugin.uuid(1)) == 2
    assert cli(["mock", "reset", "--device", "gpu-1", *state])[0] == 0
    assert plugin.mock.recovery_action(plugin.uuid(1)) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--action", "reboot"], "'reboot' is not a recovery action (one of none, gpu-reset"),
        (["--action", "-1"], "out of range"),
        ([], "the following arguments are required: --action"),
    ],
)
def test_recovery_action_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["mock", "recovery-action", "--device", "gpu-0", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_recovery_action_on_the_wire_and_only_for_its_action() -> None:
    request = MockRequest("recovery-action", device="gpu-0", recovery_action=1)
    assert json.loads(request.to_json())["recoveryAction"] == 1
    assert MockRequest.from_json(request.to_json()) == request
    assert "recoveryAction" not in json.loads(MockRequest("reset", all=True).to_json())
    with pytest.raises(MockControlError, match="only valid for recovery-action, not xid"):
        MockRequest("xid", device="gpu-0", xid=79, recovery_action=1).validate()
    with pytest.raises(MockControlError, match="invalid recovery action None"):
        MockRequest("recovery-action", device="gpu-0").validate()
    with pytest.raises(MockControlError, match="malformed request"):
        MockRequest.from_json(
            b'{"action": "recovery-action", "device": "gpu-0", "recoveryAction": "1"}'
        )


def test_plugin_predating_recovery_action_is_reported(short_dir: Path) -> None:
    control = ControlQueue()
    for action in ("clear", "lost", "reset", "xid"):
        control.register(action, lambda request: {"message": "applied"})
    argv = ["mock", "recovery-action", "--device", "gpu-0", "--action", "gpu-reset"]
    with control_socket(short_dir, control):
        code, _, err = cli([*argv, "--state-dir", str(short_dir)])
    assert code == 1
    assert "does not accept 'recovery-action'" in err and "it accepts: clear, lost" in err


def test_a_process_started_and_ended_through_the_cli_is_listed_as_nvml_lists_it(
    plugin: Plugin, short_dir: Path
) -> None:
    code, out, err = cli(
        [
            "mock",
            "process",
            "--device",
            "gpu-1",
            "--memory-mib",
            "64",
            "--state-dir",
            str(short_dir),
        ]
    )
    assert (code, err) == (0, "")
    pid = int(out.split("process ", 1)[1].split()[0])
    handle = plugin.mock.nvmlDeviceGetHandleByUUID(plugin.uuid(1))
    assert [p.pid for p in plugin.mock.nvmlDeviceGetComputeRunningProcesses(handle)] == [pid]

    code, out, _ = cli(["mock", "process", "--end", str(pid), "--state-dir", str(short_dir)])
    assert code == 0 and f"process {pid}" in out
    assert plugin.mock.nvmlDeviceGetComputeRunningProcesses(handle) == []

    code, _, err = cli(["mock", "process", "--end", str(pid), "--state-dir", str(short_dir)])
    assert code == 1 and f"no mock process {pid}" in err
