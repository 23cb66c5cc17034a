"""`gpu-dra status` against a plugin's /status served on its status socket (the plugin's own
`PluginStatus` over mock GPUs, a health store and a journal on disk), and from the
node's files when the plugin does not answer."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from driver.cli import build_parser
from driver.devices.gpu_view import gpu_views
from driver.devices.model import PoolOptions, build_pool
from driver.health.recovery_taints import RecoveryActions
from driver.health.store import HealthStore
from driver.health.unmonitored import UnmonitoredGpus
from driver.kube.publisher import PublisherStats
from driver.nvml.recovery_action import RecoveryReading
from driver.nvml.selection import select_backend
from driver.observability import metrics
from driver.observability.status_socket import StatusSocketServer
from driver.plugin.journal_summary import JournalReader
from driver.plugin.node_status import PluginStatus, export_gpus, export_journal
from driver.plugin.transport.registration import RegistrationServicer
from driver.state.journal.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    ClaimEntry,
    ClaimState,
    PreparedDevice,
)
from driver.state.mps_watch import DaemonState, MpsCheck
from driver.state.request import ClaimRef

NODE = "n1"
FLEET = """\
gpus:
- model: H100-80GB
  count: 2
- model: H100-80GB
  count: 1
  migInstances: [{profile: 3g.40gb, start: 4}]
- model: A100-40GB
  count: 1
  migMode: disabled
"""


@dataclass
class FakePublisher:
    stats: PublisherStats = field(default_factory=PublisherStats)


@dataclass
class FakeState:
    checkpoint: Checkpoint
    checkpoint_problem: str | None = None


class Node:
    """What the plugin's /status reads, over mock GPUs and files under `root`."""

    def __init__(self, root: Path) -> None:
        fleet = root / "fleet.yaml"
        fleet.write_text(FLEET)
        self.inventory = select_backend(mock=True, fleet_path=fleet, node_name=NODE).discover()
        self.pool = build_pool(self.inventory, PoolOptions())
        self.devices = {d.name: d for d in self.pool.devices}
        self.gpus = gpu_views(self.inventory, self.pool.mig_modes)
        self.store = HealthStore(root / "health.json")
        self.recovery = RecoveryActions(self.devices, driver="gpu.example.com")
        self.unmonitored = UnmonitoredGpus(self.devices, driver="gpu.example.com")
        self.registration = RegistrationServicer("gpu.example.com", "/plugins/dra.sock", ())
        self.registered = self.registration.registered
        self.publisher = FakePublisher()
        self.state = FakeState(Checkpoint(root))
        self.now = 1_000_000.0
        self.status = PluginStatus(
            version="1.2.3",
            node=NODE,
            driver="gpu.example.com",
            taint_effect="NoExecute",
            gpus=self.gpus,
            devices=self.devices,
            registration=self.registration,
            publisher=self.publisher,
            store=self.store,
            recovery=self.recovery,
            unmonitored=self.unmonitored,
            state=self.state,
            journal=JournalReader(self.state.checkpoint),
            started=self.now - 90,
            clock=lambda: self.now,
        )

    def healthy(self) -> None:
        self.registered.set()
        self.publisher.stats.last_synced = self.now - 4

    def prepare(
        self, uid: str, *devices: str, state: ClaimState = ClaimState.PREPARE_COMPLETED
    ) -> None:
        entries = self.state.checkpoint.load()
        entries[uid] = ClaimEntry(
            state,
            "ns",
            f"claim-{uid}",
            tuple(PreparedDevice(NODE, d, ("gpu",), (f"cdi/{d}",)) for d in devices),
        )
        self.state.checkpoint.store(entries)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


@pytest.fixture
def served(node: Node, short_dir: Path) -> Iterator[str]:
    path = short_dir / "status.sock"
    with StatusSocketServer(path, node.status.document, lambda: (True, "ok\n")).start():
        yield str(path)


def status(*argv: str) -> tuple[int, str]:
    args = build_parser().parse_args(["status", *argv])
    out = io.StringIO()
    code = args.run(args, out=out)
    return code, out.getvalue()


def status_json(*argv: str) -> tuple[int, dict[str, Any]]:
    code, out = status(*argv, "-o", "json")
    return code, json.loads(out)


def test_a_healthy_node_at_a_glance(node: Node, served: str) -> None:
    node.healthy()
    node.prepare("a", "gpu-0", "gpu-1-mig-1g10gb-0")
    node.prepare("b", "gpu-3")
    node.prepare("c", "gpu-1-mig-1g10gb-1", state=ClaimState.PREPARE_STARTED)
    code, out = status("--socket", served, "--fail-on-unhealthy")
    assert code == 0, out
    assert out.splitlines()[0] == "OK: 4 GPU(s) healthy, plugin registered, slices in sync"
    assert "version 1.2.3" in out and "node n1" in out and "up 90s" in out
    assert "registration  registered" in out
    assert f"slices        {len(node.devices)} device(s), last in sync" in out and "(4s ago)" in out
    assert "journal       ok: 2 claim(s) prepared (3 device(s)), 1 being prepared" in out
    assert "effect NoExecute" in out

    code, report = status_json("--socket", served)
    assert report["healthy"] is True and report["problems"] == []
    modes = {g["name"]: g["migMode"] for g in report["gpus"]}
    assert modes == {"gpu-0": "dynamic", "gpu-1": "dynamic", "gpu-2": "static", "gpu-3": "disabled"}
    gpu2 = report["gpus"][2]
    assert (gpu2["uuid"], gpu2["index"], gpu2["pciBusID"]) == (
        node.inventory.gpus[2].uuid,
        node.inventory.gpus[2].index,
        node.inventory.gpus[2].pci_bus_id,
    )
    assert report["journal"]["preparedDevices"] == 3


def test_every_problem_is_listed_and_fails_the_check(node: Node, served: str) -> None:
    node.healthy()
    uuid = node.inventory.gpus[1].uuid
    node.store.record_xid(uuid, 79)
    code, out = status("--socket", served)
    assert code == 0  # shown; only --fail-on-unhealthy turns a problem into exit 1
    first = out.splitlines()[0]
    assert first.startswith(f"UNHEALTHY: gpu-1 ({uuid}) failed: Xid 79"), first
    assert "1 GPU(s) failed" in out
    gpu_row = next(line for line in out.splitlines() if line.startswith("gpu-1 "))
    assert "failed: Xid 79" in gpu_row
    assert status("--socket", served, "--fail-on-unhealthy")[0] == 1

    node.registered.clear()
    node.publisher.stats.last_synced = node.now - 3600
    node.publisher.stats.errors.append("503 Service Unavailable")
    node.publisher.stats.failing = "503 Service Unavailable"  # as the publisher records it
    (node.state.checkpoint.path).write_text("{garbage")
    code, report = status_json("--socket", served, "--fail-on-unhealthy")
    assert code == 1
    problems = "\n".join(report["problems"])
    assert "has not registered the plugin" in problems
    assert (
        "ResourceSlices last published 3600s ago (last error: 503 Service Unavailable)" in problems
    )
    assert "prepare journal corrupt" in problems
    assert report["journal"]["preparedClaims"] is None


def test_a_recovery_action_that_taints_the_gpu_is_unhealthy(node: Node, served: str) -> None:
    """A GPU whose NVML recovery action taints its devices (NoSchedule on every one) is
    as unhealthy in `gpu-dra status` as in gpu_dra_gpu_healthy and the health stream."""
    node.healthy()
    uuid = node.inventory.gpus[1].uuid
    node.recovery.apply(RecoveryReading(uuid, 2))  # node-reboot
    code, out = status("--socket", served, "--fail-on-unhealthy")
    assert code == 1, out
    first = out.splitlines()[0]
    assert first.startswith(
        f"UNHEALTHY: gpu-1 ({uuid}) failed: NVML recovery action node-reboot: the node "
        "needs a reboot"
    ), first
    family = [d for d in node.devices.values() if d.gpu_uuid == uuid]
    assert f"1 GPU(s) failed, {len(family)} device(s) tainted" in out
    gpu_row = next(line for line in out.splitlines() if line.startswith("gpu-1 "))
    assert "failed: NVML recovery action node-reboot" in gpu_row

    report = status_json("--socket", served)[1]
    (failure,) = report["gpus"][1]["failures"]
    assert failure["key"] == "gpu.example.com/recovery-action"
    assert (failure["value"], failure["effect"]) == ("node-reboot", "NoSchedule")
    assert report["gpus"][1]["taintedDevices"] == len(family)

    # An action that taints nothing (an IMEX-domain recovery) leaves the GPU healthy,
    # as it leaves the metric and the health stream.
    node.recovery.apply(RecoveryReading(uuid, 5))
    assert status("--socket", served, "--fail-on-unhealthy")[0] == 0


def _health_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("health "))


def test_the_health_line_gives_each_taint_its_own_effect(node: Node, served: str) -> None:
    """--xid-taint-effect NoExecute is the effect of a failure's taint only: a recovery
    action's taint has the action's own (node-reboot: NoSchedule), and the health line
    says which taint has which effect, on how many devices."""
    node.healthy()
    assert _health_line(status("--socket", served)[1]) == (
        "health        0 GPU(s) failed, 0 device(s) tainted (--xid-taint-effect NoExecute)"
    )
    rebooting, failed = node.inventory.gpus[1].uuid, node.inventory.gpus[3].uuid
    node.recovery.apply(RecoveryReading(rebooting, 2))  # node-reboot
    node.store.record_xid(failed, 79)
    family = len([d for d in node.devices.values() if d.gpu_uuid == rebooting])
    others = len([d for d in node.devices.values() if d.gpu_uuid == failed])
    assert _health_line(status("--socket", served)[1]) == (
        f"health        2 GPU(s) failed, {family + others} device(s) tainted: "
        f"gpu.example.com/recovery-action=node-reboot:NoSchedule on {family}, "
        f"gpu.example.com/xid=79:NoExecute on {others}"
    )
    report = status_json("--socket", served)[1]
    assert report["health"]["taints"] == [
        {
            "key": "gpu.example.com/recovery-action",
            "value": "node-reboot",
            "effect": "NoSchedule",
            "devices": family,
        },
        {"key": "gpu.example.com/xid", "value": "79", "effect": "NoExecute", "devices": others},
    ]


def test_an_unmonitored_gpu_is_named_but_not_unhealthy(node: Node, served: str) -> None:
    """NVML registers no health events for gpu-2: its health is unknown, not bad. The
    status names it (a note, with NVML's reason) and its row says so; the check
    passes, as gpu_dra_gpu_healthy stays 1 (docs/health.md, "What unhealthy means")."""
    node.healthy()
    uuid = node.inventory.gpus[2].uuid
    node.unmonitored.update({uuid: "NVML cannot register its health events: Not Supported"})
    code, out = status("--socket", served, "--fail-on-unhealthy")
    assert code == 0, out
    assert out.splitlines()[0].startswith("OK: ")
    assert "1 GPU(s) NOT MONITORED" in out
    assert (
        f"note: gpu-2 ({uuid}) is not monitored: NVML cannot register its health events: "
        "Not Supported; its failures go unseen" in out
    )
    gpu_row = next(line for line in out.splitlines() if line.startswith("gpu-2 "))
    assert gpu_row.endswith("healthy (unmonitored)")
    report = status_json("--socket", served)[1]
    assert report["gpus"][2]["monitored"] is False
    assert report["health"]["unmonitoredGPUs"] == 1
    assert [g["monitored"] for g in report["gpus"]] == [True, True, False, True]


def test_a_refused_registration_is_the_problem_it_says(node: Node, served: str) -> None:
    """The kubelet refused the plugin: status says so with the kubelet's words, as
    /readyz does, not that the kubelet has not registered it yet."""
    node.healthy()
    node.registered.clear()
    node.registration.last_error = "none of services supported by the plugin are supported"
    code, out = status("--socket", served, "--fail-on-unhealthy")
    assert code == 1
    refused = "the kubelet refused the registration: none of services supported by the plugin"
    assert out.splitlines()[0].startswith(f"UNHEALTHY: {refused}"), out
    assert f"registration  REFUSED: {refused.split(': ', 1)[1]}" in out
    assert status_json("--socket", served)[1]["registration"]["error"].startswith("none of")


def test_without_the_plugin_the_nodes_files_are_shown(node: Node, tmp_path: Path) -> None:
    node.prepare("a", "gpu-0")
    node.store.record_xid(node.inventory.gpus[0].uuid, 48)
    argv = ("--state-dir", str(tmp_path))  # its status socket: none, no plugin runs
    code, out = status(*argv)
    assert code == 0
    assert out.startswith(
        f"UNHEALTHY: the plugin does not answer: {tmp_path / 'status.sock'}: no such socket"
    )
    assert "plugin        NOT REACHABLE" in out
    assert "journal       ok: 1 claim(s) prepared (1 device(s)), 0 being prepared" in out
    assert "Xid 48" in out
    assert status(*argv, "--fail-on-unhealthy")[0] == 1


def test_journal_summary_rereads_only_a_changed_file(node: Node) -> None:
    reader = JournalReader(node.state.checkpoint)
    assert reader.summary().status == "absent"
    node.prepare("a", "gpu-0")
    first = reader.summary()
    assert (first.status, first.prepared_claims) == ("ok", 1)
    assert reader.summary() is first  # unchanged file: not parsed again
    node.prepare("b", "gpu-1")
    assert reader.summary().prepared_claims == 2


def test_prepared_claims_and_gpu_metrics(node: Node) -> None:
    export_journal(node.state)
    export_gpus(node.gpus, "1.2.3")
    value = metrics.REGISTRY.get_sample_value
    assert value("gpu_dra_prepared_claims") == 0
    node.prepare("a", "gpu-0", "gpu-1")
    assert (value("gpu_dra_prepared_claims"), value("gpu_dra_prepared_devices")) == (1, 2)
    (node.state.checkpoint.data_dir / CHECKPOINT_FILE).write_text("{")
    assert math.isnan(value("gpu_dra_prepared_devices") or 0.0)
    assert value("gpu_dra_build_info", {"version": "1.2.3"}) == 1
    assert {
        mode: value("gpu_dra_gpus", {"mig_mode": mode})
        for mode in ("unsupported", "disabled", "dynamic", "static", "ignored")
    } == {"unsupported": 0, "disabled": 1, "dynamic": 2, "static": 1, "ignored": 0}


def test_an_error_the_publisher_recovered_from_is_not_shown(node: Node, served: str) -> None:
    """An ordinary surge upgrade makes a publish meet 404/409 once (the other pod
    changed the slices); the next publish succeeds. Status then says nothing of it."""
    node.healthy()
    node.publisher.stats.errors.append("409 Conflict: the object has been modified")
    node.publisher.stats.failing = None  # the retry succeeded
    code, out = status("--socket", served, "--fail-on-unhealthy")
    assert code == 0, out
    assert "409" not in out and "last error" not in out
    node.publisher.stats.failing = "503 Service Unavailable"
    _, out = status("--socket", served)
    assert "last error: 503 Service Unavailable" in out


@dataclass
class FakeMpsWatch:
    check: MpsCheck = field(default_factory=MpsCheck)

    def last(self) -> MpsCheck:
        return self.check


def test_the_mps_daemons_are_shown_and_one_not_running_is_a_problem(
    node: Node, served: str
) -> None:
    node.healthy()
    code, out = status("--socket", served)
    assert "mps " not in out  # MPS off: no line
    watch = FakeMpsWatch()
    node.status.mps = watch
    _, out = status("--socket", served)
    assert "mps           not checked yet" in out, out

    claim = ClaimRef("ns", "claim-a", "a")
    watch.check = MpsCheck(
        node.now - 5,
        (
            DaemonState(claim, "gpu-0", "GPU-0", "pid 41", running=True),
            DaemonState(
                claim, "gpu-3", "GPU-3", "pid 42", running=False, problem="gone: could not ..."
            ),
        ),
    )
    code, out = status("--socket", served, "--fail-on-unhealthy")
    assert code == 1, out
    assert "mps           2 daemon(s): 1 running, 1 NOT RUNNING" in out, out
    problem = "MPS daemon pid 42 of claim ns/claim-a, device gpu-3 (GPU GPU-3): gone: could not ..."
    assert out.splitlines()[0] == f"UNHEALTHY: {problem}", out
    _, report = status_json("--socket", served)
    assert [(d["device"], d["running"]) for d in report["mps"]["daemons"]] == [
        ("gpu-0", True),
        ("gpu-3", False),
    ]
