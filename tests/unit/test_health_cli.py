"""`gpu-dra health` and `gpu-dra health clear` against a running monitor's control
channel (mock and real NVML backends)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.cli import build_parser
from driver.cli.health.health_clear import DEFAULT_TIMEOUT
from driver.cli.health.health_show import PluginRecovery, build_report
from driver.cli.mock import MockSubmitError, submit
from driver.cli.plugin_endpoint import fetch_control
from driver.cli.published import PublishedView, devices_of
from driver.cli.state_dir import read_health
from driver.devices.model import PoolDevices, build_pool
from driver.health.clear import ClearAction
from driver.health.control_queue import ControlError, ControlQueue
from driver.health.monitor import HealthMonitor
from driver.health.recovery_taints import RecoveryActions
from driver.health.store import HealthStore
from driver.health.unmonitored import UnmonitoredGpus
from driver.health.xid import XidPolicy
from driver.nvml.backend import NvmlBackend
from driver.nvml.mock.fleet import default_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.mock_control import MockRequest
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.recovery_action import RecoveryReading
from driver.observability.status_socket import StatusSocketServer, status_socket_path
from driver.plugin.transport.registration import RegistrationServicer
from tests.control_socket import ServedMonitor, control_socket
from tests.node_events import RecordedNodeEvents

DRIVER = "gpu.example.com"


class FakePublisher:
    def __init__(self, synced: bool = True) -> None:
        self.synced = synced
        self.triggers = 0

    def trigger(self) -> int:
        self.triggers += 1
        return self.triggers

    def wait_synced(self, ticket: int, timeout: float) -> bool:
        return self.synced


class RealNvmlStandIn:
    """Any NVML module that is not the mock, as the real backend runs over it: the
    plugin must not offer mock actions."""

    def __init__(self, mock: MockNvml) -> None:
        self._mock = mock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mock, name)


class Plugin(ServedMonitor):
    """The health monitor and its control requests on the status socket in
    `state_dir`, as the plugin wires them (`start`, `stop`)."""

    def __init__(self, state_dir: Path, *, real: bool = False, synced: bool = True) -> None:
        self.mock = MockNvml(default_fleet(), "node-1")
        self.state_dir = state_dir
        backend = NvmlBackend(RealNvmlStandIn(self.mock)) if real else MockBackend(self.mock)
        self.pool: PoolDevices = build_pool(backend.discover())
        self.store = HealthStore(state_dir / "health.json")
        self.publisher = FakePublisher(synced)
        self.recovery = RecoveryActions(self.pool.devices, driver=DRIVER)
        self.events = RecordedNodeEvents()
        self.monitor = HealthMonitor(
            backend,
            self.store,
            XidPolicy(),
            self.publisher,
            self.pool.devices,
            node_name="node-1",
            node_events=self.events,
            recovery=self.recovery,
            control_actions=backend.control_actions(self.pool.devices),
        )
        self._serving = contextlib.ExitStack()


@pytest.fixture
def plugin(short_dir: Path) -> Iterator[Plugin]:
    p = Plugin(short_dir)
    yield p
    p.monitor.stop()


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def gpu_dra(argv: list[str], stdin: io.StringIO | None = None) -> tuple[int, str, str]:
    args = build_parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    if getattr(args, "health_action", None) == "clear":
        code = args.run(args, out=out, err=err, stdin=stdin or io.StringIO())
    else:
        code = args.run(args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def clear(state_dir: Path, device: str, *extra: str, stdin: io.StringIO | None = None) -> Any:
    return gpu_dra(["health", "clear", device, "--state-dir", str(state_dir), *extra], stdin)


@pytest.fixture(autouse=True)
def no_api_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HTTP_PORT", "1")  # no plugin endpoint unless a test serves one


# -- clear -----------------------------------------------------------------------------


def test_clear_a_gpu_with_yes(plugin: Plugin, short_dir: Path) -> None:
    plugin.store.record_xid(plugin.uuid(3), 79)
    plugin.store.record_instance_xid(plugin.uuid(3), (2, 1), 94, gpu_instance_id=5)
    plugin.store.record_xid(plugin.uuid(4), 48)
    plugin.start()
    code, out, err = clear(short_dir, "gpu-3", "--yes")
    assert (code, err) == (0, "")
    assert "will forget these failures of gpu-3" in out
    assert "Xid 79" in out and "Xid 94 on GPU instance 5" in out
    assert "cleared gpu-3" in out
    assert "the API server accepted" in out
    assert plugin.store.gpu_failure(plugin.uuid(3)) is None
    assert plugin.uuid(3) not in plugin.store.failed_instances()
    assert plugin.store.gpu_failure(plugin.uuid(4)) is not None  # another GPU: untouched
    assert plugin.publisher.triggers >= 1
    on_disk = json.loads((short_dir / "health.json").read_text())
    assert list(on_disk["gpus"]) == [plugin.uuid(4)]


def test_clear_says_which_taint_stays(plugin: Plugin, short_dir: Path) -> None:
    """Xid 48 needs a GPU reset: clearing gpu-5 forgets the Xid, but every device of it
    keeps NVML's gpu-reset taint until NVML reports no action. The preview, the answer
    and the GpuTaintCleared Event say what goes and what stays."""
    uuid = plugin.uuid(5)
    plugin.store.record_xid(uuid, 48)
    plugin.recovery.apply(RecoveryReading(uuid, 1))  # gpu-reset, as the driver sets it
    devices = len(plugin.pool.devices_of_gpu(uuid))
    plugin.start()
    code, out, err = clear(short_dir, "gpu-5", "--yes")
    assert (code, err) == (0, "")
    kept = f"{DRIVER}/recovery-action=gpu-reset:NoSchedule"
    assert f"stay tainted afterwards: all {devices} device(s) keep {kept}" in out
    assert "NVML recovery action gpu-reset: the GPU needs a reset" in out
    assert "gpu-dra health clear does not remove it" in out
    assert "without the taint" not in out
    assert f"the API server accepted this node's ResourceSlices without {DRIVER}/xid=48" in out
    assert f"{devices} device(s) still carry {kept}" in out
    (event,) = [e for e in plugin.events.posted if e.reason == "GpuTaintCleared"]
    assert f"taint removed from {devices} device(s)" in event.message
    assert f"they keep {kept} (NVML recovery action gpu-reset" in event.message

    # Nothing recorded any more: the answer names the taint that is left, and why.
    code, out, _ = clear(short_dir, "gpu-5", "--yes")
    assert code == 0
    assert "gpu-5 has no recorded failure: nothing to clear" in out
    assert f"its devices keep {kept}" in out


def test_clear_refuses_without_a_terminal_and_without_yes(plugin: Plugin, short_dir: Path) -> None:
    plugin.store.record_xid(plugin.uuid(1), 79)
    plugin.start()
    code, out, err = clear(short_dir, "gpu-1")
    assert code == 1
    assert "will forget this failure of gpu-1" in out  # it showed what would happen
    assert "stdin is not a terminal: refusing without --yes" in err
    assert plugin.store.gpu_failure(plugin.uuid(1)) is not None


@pytest.mark.parametrize(("answer", "cleared"), [("n\n", False), ("\n", False), ("y\n", True)])
def test_clear_asks_at_a_terminal(
    plugin: Plugin, short_dir: Path, answer: str, cleared: bool
) -> None:
    plugin.store.record_xid(plugin.uuid(1), 79)
    plugin.start()
    code, out, err = clear(short_dir, "gpu-1", stdin=Tty(answer))
    assert "Clear it? [y/N]" in out
    assert code == (0 if cleared else 1)
    assert (plugin.store.gpu_failure(plugin.uuid(1)) is None) is cleared
    if not cleared:
        assert "not confirmed: nothing changed" in err


def test_clear_of_a_healthy_device_changes_nothing(plugin: Plugin, short_dir: Path) -> None:
    plugin.start()
    version = plugin.store.version
    code, out, _ = clear(short_dir, "gpu-2")
    assert code == 0 and "gpu-2 has no recorded failure: nothing to clear" in out
    assert plugin.store.version == version and plugin.publisher.triggers == 0


def test_clear_a_partition_clears_its_gpu_instance_only(plugin: Plugin, short_dir: Path) -> None:
    uuid = plugin.uuid(0)
    plugin.store.record_instance_xid(uuid, (3, 1), 94, gpu_instance_id=9)
    plugin.store.record_instance_xid(uuid, (5, 1), 94, gpu_instance_id=10)
    plugin.start()
    code, out, err = clear(short_dir, "gpu-0-mig-1g10gb-3", "--yes")
    assert (code, err) == (0, "")
    assert "gpu-0-mig-1g10gb-3" in out.split(f"without {DRIVER}/xid=94 on:")[1].splitlines()[0]
    assert "still tainted afterwards" in out and "gpu-0-mig-1g10gb-5" in out
    assert set(plugin.store.failed_instances()[uuid]) == {(5, 1)}
    taints = plugin.store.device_taints(plugin.pool.devices)
    assert "gpu-0-mig-1g10gb-3" not in taints and "gpu-0-mig-1g10gb-5" in taints


def test_clear_a_partition_of_a_failed_gpu_is_refused(plugin: Plugin, short_dir: Path) -> None:
    plugin.store.record_xid(plugin.uuid(0), 79)
    plugin.start()
    code, _, err = clear(short_dir, "gpu-0-mig-1g10gb-3", "--yes")
    assert code == 1
    assert "because its whole GPU failed" in err and "clear gpu-0 instead" in err
    assert plugin.store.gpu_failure(plugin.uuid(0)) is not None


def test_clear_of_an_unknown_device_is_refused(plugin: Plugin, short_dir: Path) -> None:
    plugin.start()
    code, _, err = clear(short_dir, "gpu-99", "--yes")
    assert code == 1 and "unknown device 'gpu-99'" in err and "gpu-7" in err


def test_clear_by_gpu_uuid(plugin: Plugin, short_dir: Path) -> None:
    plugin.store.record_lost(plugin.uuid(6))
    plugin.start()
    code, out, _ = clear(short_dir, plugin.uuid(6), "--yes")
    assert code == 0 and "GPU is lost" in out
    assert plugin.store.failed_gpus() == {}


def test_clear_works_on_the_real_backend_and_mock_actions_do_not(short_dir: Path) -> None:
    plugin = Plugin(short_dir, real=True)
    plugin.store.record_xid(plugin.uuid(2), 79)
    plugin.start()
    try:
        assert fetch_control(status_socket_path(short_dir))["actions"] == ["clear"]
        with pytest.raises(MockSubmitError, match=r"does not accept 'xid'.*it accepts: clear"):
            submit(short_dir, MockRequest("xid", device="gpu-2", xid=79), timeout=2)
        code, out, _ = clear(short_dir, "gpu-2", "--yes")
        assert code == 0 and "cleared gpu-2" in out
        assert plugin.store.failed_gpus() == {}
    finally:
        plugin.stop()


def test_mock_backend_accepts_clear_and_the_mock_actions(plugin: Plugin, short_dir: Path) -> None:
    plugin.start()
    actions = fetch_control(status_socket_path(short_dir))["actions"]
    assert actions == ["clear", "lost", "process", "recovery-action", "reset", "xid"]


def test_clear_without_a_plugin_fails(short_dir: Path) -> None:
    code, _, err = clear(short_dir, "gpu-0", "--yes")
    assert code == 1 and "no kubelet plugin answers" in err and "no such socket" in err


def test_clear_against_a_plugin_that_predates_it(short_dir: Path) -> None:
    """A plugin whose status socket answers /status only (before control requests)."""
    path = status_socket_path(short_dir)
    with StatusSocketServer(path, dict, lambda: (True, "ok\n")).start():
        code, _, err = clear(short_dir, "gpu-0", "--yes")
    assert code == 1
    assert "the plugin predates control requests on its socket" in err


def test_clear_says_so_when_the_plugin_does_not_answer(short_dir: Path) -> None:
    """A plugin whose health monitor does not take requests (stuck, or not started):
    the request is withdrawn at --timeout, nothing applied."""
    control = ControlQueue(node_name="n")
    control.register("clear", lambda request: pytest.fail("applied"))
    start = time.monotonic()
    with control_socket(short_dir, control):
        code, _, err = clear(short_dir, "gpu-0", "--yes", "--timeout", "0.3")
    assert code == 1 and "did not take the request within 0.3s" in err
    assert "request withdrawn" in err
    # gave up at its --timeout: long before the default it would wait otherwise
    assert time.monotonic() - start < DEFAULT_TIMEOUT / 2
    assert control.poll() == 0  # nothing left to apply


def test_clear_not_published_is_reported(short_dir: Path) -> None:
    plugin = Plugin(short_dir, synced=False)
    plugin.store.record_xid(plugin.uuid(1), 79)
    plugin.start()
    try:
        code, out, err = clear(short_dir, "gpu-1", "--yes")
    finally:
        plugin.stop()
    assert code == 1 and "cleared gpu-1" in out
    assert "has not yet accepted the ResourceSlices without the taint" in err


def test_clear_is_refused_when_the_failures_changed_since_the_preview(short_dir: Path) -> None:
    plugin = Plugin(short_dir)
    uuid = plugin.uuid(1)
    plugin.store.record_xid(uuid, 79)
    action = ClearAction(plugin.store, plugin.pool.devices, plugin.publisher)
    preview = action.handle({"action": "clear", "device": "gpu-1", "dryRun": True})
    assert plugin.store.gpu_failure(uuid) is not None
    plugin.store.record_lost(uuid)  # a new failure after the preview
    request = {"action": "clear", "device": "gpu-1", "expect": preview["plan"]["records"]}
    with pytest.raises(ControlError, match="changed since the preview"):
        action.handle(request)
    assert plugin.store.gpu_failure(uuid) is not None


@pytest.mark.parametrize(
    ("request_doc", "message"),
    [
        ({"action": "clear"}, "device must be a non-empty string"),
        ({"action": "clear", "device": "gpu-0", "dryRun": "yes"}, "dryRun must be a boolean"),
        ({"action": "clear", "device": "gpu-0", "expect": "x"}, "expect must be a list"),
    ],
)
def test_malformed_clear_requests_name_the_field(
    short_dir: Path, request_doc: dict[str, Any], message: str
) -> None:
    plugin = Plugin(short_dir)
    action = ClearAction(plugin.store, plugin.pool.devices, None)
    with pytest.raises(ControlError, match=message):
        action.handle(request_doc)


# -- show ------------------------------------------------------------------------------


def test_show_json_from_the_store(plugin: Plugin, short_dir: Path) -> None:
    plugin.store.record_xid(plugin.uuid(3), 79)
    plugin.store.record_instance_xid(plugin.uuid(0), (3, 1), 94, gpu_instance_id=9)
    plugin.start()
    code, out, err = gpu_dra(["health", "-o", "json", "--state-dir", str(short_dir)])
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["plugin"]["running"] is True and report["plugin"]["acceptsClear"] is True
    assert report["plugin"]["pid"] == os.getpid()
    assert report["store"]["readable"] is True
    failures = {(f["gpuUUID"], f["scope"]): f for f in report["store"]["failures"]}
    assert set(failures) == {(plugin.uuid(3), "gpu"), (plugin.uuid(0), "instance")}
    gpu = failures[(plugin.uuid(3), "gpu")]
    assert (gpu["key"], gpu["value"], gpu["placement"]) == (f"{DRIVER}/xid", "79", None)
    instance = failures[(plugin.uuid(0), "instance")]
    assert (instance["placement"], instance["gpuInstanceId"]) == ([3, 1], 9)
    assert (
        report["slices"]["read"] is False
        and "no API server configured" in (report["slices"]["problem"])
    )
    assert report["consistent"] is None


def test_show_table_says_where_each_line_comes_from(plugin: Plugin, short_dir: Path) -> None:
    plugin.store.record_xid(plugin.uuid(3), 79, "Xid 79 (fell off the bus)")
    code, out, _ = gpu_dra(["health", "--state-dir", str(short_dir)])
    assert code == 0
    header, row = out.splitlines()[:2]
    assert header.split() == ["SOURCE", "DEVICE", "TAINT", "SINCE", "REASON"]
    assert row.startswith("store") and plugin.uuid(3) in row and f"{DRIVER}/xid=79" in row
    assert "store: 1 recorded failure(s)" in out
    assert "slices: not read" in out and "plugin: not found" in out


@contextlib.contextmanager
def plugin_status_served(
    plugin: Plugin, short_dir: Path, recovery: RecoveryActions | None = None
) -> Iterator[str]:
    """The plugin's own /status over `plugin`'s GPUs and store; yields its socket."""
    from test_status_cli import FakePublisher, FakeState

    from driver.devices.gpu_view import gpu_views
    from driver.plugin.journal_summary import JournalReader
    from driver.plugin.node_status import PluginStatus
    from driver.state.journal.checkpoint import Checkpoint

    inventory = MockBackend(plugin.mock).discover()
    state = FakeState(Checkpoint(short_dir))
    status = PluginStatus(
        version="test",
        node="node-1",
        driver=DRIVER,
        taint_effect="NoSchedule",
        gpus=gpu_views(inventory, plugin.pool.mig_modes),
        devices={d.name: d for d in plugin.pool.devices},
        registration=RegistrationServicer(DRIVER, "/plugins/dra.sock", ()),
        publisher=FakePublisher(),
        store=plugin.store,
        recovery=recovery or RecoveryActions(plugin.pool.devices, driver=DRIVER),
        unmonitored=UnmonitoredGpus(plugin.pool.devices, driver=DRIVER),
        state=state,
        journal=JournalReader(state.checkpoint),
    )
    with tempfile.TemporaryDirectory(prefix="gdra-", dir="/tmp") as short:  # sun_path
        path = Path(short) / "status.sock"
        with StatusSocketServer(path, status.document, lambda: (True, "ok\n")).start():
            yield str(path)


def test_without_slices_devices_are_named_by_the_running_plugin(
    plugin: Plugin, short_dir: Path
) -> None:
    """The API server is out of reach: the store's lines name each GPU as the plugin
    on this node does (its /status), not by UUID."""
    plugin.store.record_xid(plugin.uuid(3), 79)
    plugin.store.record_instance_xid(plugin.uuid(5), (3, 1), 94, gpu_instance_id=9)
    with plugin_status_served(plugin, short_dir) as url:
        code, out, _ = gpu_dra(["health", "--state-dir", str(short_dir), "--socket", url])
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert [row[:2] for row in rows] == [["store", "gpu-3"], ["store", "gpu-5"]]
    assert plugin.uuid(3) not in out
    assert "GPU instance 9, slices 3+1" in out


def test_without_slices_or_plugin_devices_are_named_by_nvml(
    plugin: Plugin, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from driver.cli.health import gpu_names

    monkeypatch.setattr(gpu_names, "select_backend", lambda **_: MockBackend(plugin.mock))
    plugin.store.record_xid(plugin.uuid(6), 48)
    code, out, _ = gpu_dra(["health", "-o", "json", "--state-dir", str(short_dir)])
    assert code == 0
    (failure,) = json.loads(out)["store"]["failures"]
    assert (failure["device"], failure["gpuUUID"]) == ("gpu-6", plugin.uuid(6))


def test_show_compares_the_store_with_the_published_taints(short_dir: Path) -> None:
    plugin = Plugin(short_dir)
    uuid3, uuid5 = plugin.uuid(3), plugin.uuid(5)
    plugin.store.record_xid(uuid3, 79)
    plugin.store.record_xid(uuid5, 48)
    taint = {"key": f"{DRIVER}/xid", "value": "79", "effect": "NoSchedule", "timeAdded": "t"}
    slice_doc = {
        "metadata": {"name": "node-1-gpu.example.com-0"},
        "spec": {
            "pool": {"generation": 2},
            "devices": [
                {"name": "gpu-3", "attributes": {"uuid": {"string": uuid3}}, "taints": [taint]},
                {"name": "gpu-5", "attributes": {"uuid": {"string": uuid5}}},
                {
                    "name": "gpu-6",
                    "attributes": {"uuid": {"string": plugin.uuid(6)}},
                    "taints": [{**taint, "value": "13"}],
                },
            ],
        },
    }
    old = {"metadata": {"name": "old"}, "spec": {"pool": {"generation": 1}, "devices": []}}
    published = PublishedView("test", devices=devices_of([old, slice_doc]))
    report = build_report("node-1", DRIVER, short_dir, read_health(short_dir), published)
    assert [
        (t["device"], t["value"], t["reason"] is not None) for t in report["slices"]["taints"]
    ] == [
        ("gpu-3", "79", True),
        ("gpu-6", "13", False),
    ]
    assert {f["device"] for f in report["store"]["failures"]} == {"gpu-3", "gpu-5"}
    assert report["consistent"] is False
    notes = "\n".join(report["notes"])
    assert "gpu-5: Xid 48" in notes and "no taint is published" in notes
    assert "gpu-6: a taint is published but no failure is recorded" in notes
    assert "gpu-3" not in notes


def test_recovery_actions_are_shown_with_their_reason(plugin: Plugin, short_dir: Path) -> None:
    """A recovery-action taint is the running plugin's (NVML, kept in memory), not the
    store's: `gpu-dra health` shows it from the plugin's /status with its reason, and
    its slice taint with that reason, beside an Xid's taint of the same device."""
    uuid5, uuid6 = plugin.uuid(5), plugin.uuid(6)
    plugin.store.record_xid(uuid5, 48)
    recovery = RecoveryActions(plugin.pool.devices, driver=DRIVER)
    recovery.apply(RecoveryReading(uuid5, 1))  # gpu-reset
    recovery.apply(RecoveryReading(uuid6, 2))  # node-reboot
    reboot = f"{DRIVER}/recovery-action=node-reboot:NoSchedule"
    with plugin_status_served(plugin, short_dir, recovery) as url:
        code, out, _ = gpu_dra(["health", "--state-dir", str(short_dir), "--socket", url])
        assert code == 0
        assert ["plugin", "gpu-6", reboot] in [line.split()[:3] for line in out.splitlines()]
        assert "NVML recovery action node-reboot: the node needs a reboot" in out
        assert "recovery: 2 NVML recovery action(s) that taint GPUs" in out

        def slice_taint(key: str, value: str) -> dict[str, Any]:
            return {"key": f"{DRIVER}/{key}", "value": value, "effect": "NoSchedule"}

        slice_doc = {
            "metadata": {"name": "node-1-gpu.example.com-0"},
            "spec": {
                "pool": {"generation": 1},
                "devices": [
                    {
                        "name": "gpu-5",
                        "attributes": {"uuid": {"string": uuid5}},
                        "taints": [
                            slice_taint("xid", "48"),
                            slice_taint("recovery-action", "gpu-reset"),
                        ],
                    },
                    {
                        "name": "gpu-6",
                        "attributes": {"uuid": {"string": uuid6}},
                        "taints": [slice_taint("recovery-action", "node-reboot")],
                    },
                ],
            },
        }
        report = build_report(
            "node-1",
            DRIVER,
            short_dir,
            read_health(short_dir),
            PublishedView("test", devices=devices_of([slice_doc])),
            recovery=PluginRecovery.read(url),
        )
    reasons = {(t["device"], t["value"]): t["reason"] for t in report["slices"]["taints"]}
    assert reasons[("gpu-5", "48")].startswith("Xid 48")
    assert reasons[("gpu-5", "gpu-reset")].startswith("NVML recovery action gpu-reset")
    assert reasons[("gpu-6", "node-reboot")].startswith("NVML recovery action node-reboot")
    assert [a["device"] for a in report["recovery"]["actions"]] == ["gpu-5", "gpu-6"]
    assert report["consistent"] is True  # the action's taints are where they belong


def test_show_fails_when_nothing_can_be_read(short_dir: Path) -> None:
    code, _, err = gpu_dra(["health", "--state-dir", str(short_dir / "absent")])
    assert code == 1 and "no such directory" in err
    env_dir = short_dir / "plugin-data-gone"
    os.environ["GPU_DRA_STATE_DIR"] = str(env_dir)
    try:
        code, out, err = gpu_dra(["health"])
    finally:
        del os.environ["GPU_DRA_STATE_DIR"]
    assert code == 1 and "nothing could be read" in err
    assert "store: unknown: no plugin data directory" in out


def test_show_reports_an_unreadable_store_without_moving_it(short_dir: Path) -> None:
    (short_dir / "health.json").write_text("{not json")
    code, out, _ = gpu_dra(["health", "-o", "json", "--state-dir", str(short_dir)])
    report = json.loads(out)
    assert code == 1 and report["store"]["readable"] is False
    assert "not valid health state" in report["store"]["problem"]
    assert (short_dir / "health.json").read_text() == "{not json"


def test_clear_and_show_parse(short_dir: Path) -> None:
    args = build_parser().parse_args(["health", "clear", "gpu-0", "-y", "--timeout", "2"])
    assert isinstance(args, argparse.Namespace)
    assert (args.device, args.yes, args.timeout) == ("gpu-0", True, 2.0)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["health", "clear"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["health", "clear", "gpu-0", "--timeout", "0"])


def test_concurrent_clears_are_each_answered(plugin: Plugin, short_dir: Path) -> None:
    plugin.store.record_xid(plugin.uuid(1), 79)
    plugin.start()
    threads = [threading.Thread(target=clear, args=(short_dir, "gpu-2", "--yes")) for _ in range(3)]
    for t in threads:
        t.start()
    code, _, _ = clear(short_dir, "gpu-1", "--yes")
    for t in threads:
        t.join(5)
    assert code == 0 and plugin.store.failed_gpus() == {}


def nvidia_information(uuid: str, minor: int) -> str:
    """/proc/driver/nvidia/gpus/<bus id>/information as the NVIDIA kernel driver writes it."""
    return (
        "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\n"
        f"GPU UUID: \t {uuid}\nVideo BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\n"
        f"DMA Size: \t 52 bits\nBus Location: \t 0000:{minor + 0x18:02x}:00.0\n"
        f"Device Minor: \t {minor}\nGPU Firmware: \t N/A\nGPU Excluded:\t No\n"
    )


def test_without_slices_plugin_or_nvml_devices_are_named_by_the_kernel_driver(
    plugin: Plugin, short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A debug container on the node: no API server, no plugin answering, no NVML in the
    image; the kernel driver's /proc files still name each GPU's minor."""
    from driver.cli.health import gpu_names

    def no_nvml(**_: Any) -> Any:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(gpu_names, "select_backend", no_nvml)
    proc = short_dir / "proc-gpus"
    for minor in (5, 6):
        (proc / f"0000:{minor:02x}:00.0").mkdir(parents=True)
        (proc / f"0000:{minor:02x}:00.0" / "information").write_text(
            nvidia_information(plugin.uuid(minor), minor)
        )
    monkeypatch.setattr(gpu_names, "PROC_GPUS", proc)
    plugin.store.record_xid(plugin.uuid(6), 48)
    state = ["--state-dir", str(short_dir)]
    code, out, _ = gpu_dra(["health", *state])
    assert code == 0
    assert out.splitlines()[1].split()[:2] == ["store", "gpu-6"]
    assert plugin.uuid(6) not in out
    assert f"names: from {proc}" in out

    monkeypatch.setattr(gpu_names, "PROC_GPUS", short_dir / "absent")
    code, out, _ = gpu_dra(["health", *state])
    names = [line for line in out.splitlines() if line.startswith("names:")]
    assert plugin.uuid(6) in out and len(names) == 1
    assert "GPU UUIDs" in names[0] and "NVML Shared Library Not Found" in names[0]
