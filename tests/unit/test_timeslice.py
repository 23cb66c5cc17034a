"""GPU time-slice intervals through DeviceState and the mock (docs/sharing.md,
"Time-slice intervals"): set at prepare, restored at unprepare, shared GPUs, rollbacks,
start-up re-application, and what is never touched."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from driver.devices.model import PoolOptions
from driver.errors import DriverError, transient
from driver.nvml.backend import NvmlBackend
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.mock_timeslice import MockTimeSlice
from driver.nvml.mock.nvml import MockNvml
from driver.state.claim_timeslices import TimeSliceOps
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.prepare import DeviceState
from driver.state.recovery.startup_recovery import RecoveryReport
from driver.state.request import ClaimRef
from tests.state_fakes import node_state

DRIVER = "gpu.example.com"
NODE = "node-a"
# gpu-0 and gpu-1 with MIG off (shareable), gpu-2 in MIG mode (its devices are MIG devices).
FLEET = parse_fleet(
    {
        "gpus": [
            {"model": "H100-80GB", "count": 2, "migMode": "disabled"},
            {"model": "H100-80GB", "count": 1},
        ]
    }
)


def sharing(interval: str | None = None, strategy: str = "TimeSlicing") -> dict[str, Any]:
    doc: dict[str, Any] = {"strategy": strategy}
    if interval is not None:
        doc["timeSlicingConfig"] = {"interval": interval}
    return doc


class Claims:
    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}

    def add(
        self,
        uid: str,
        *devices: str,
        interval: str | None = "Long",
        share: bool = False,
        admin: bool = False,
    ) -> ClaimRef:
        results = []
        for i, device in enumerate(devices):
            result: dict[str, Any] = {
                "request": f"r{i}",
                "driver": DRIVER,
                "pool": NODE,
                "device": device,
            }
            if share:
                result.update(
                    shareID=f"s-{uid}", consumedCapacity={"memory": "8Gi", "compute": "10"}
                )
            if admin:
                result["adminAccess"] = True
            results.append(result)
        configs = []
        if interval is not None:
            params = {
                "apiVersion": "gpu.resource.example.com/v1alpha1",
                "kind": "GpuConfig",
                "sharing": sharing(interval),
            }
            configs.append(
                {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": params}}
            )
        self.docs[uid] = {
            "metadata": {"namespace": "default", "name": f"claim-{uid}", "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": configs}}},
        }
        return ClaimRef("default", f"claim-{uid}", uid)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.docs[name.removeprefix("claim-")]


class Scripted:
    """Wraps the mock, recording every call; the calls numbered in `fail` (from 1)
    raise, as nvidia-smi refusing would."""

    def __init__(self, inner: TimeSliceOps, fail: set[int] | None = None) -> None:
        self.inner, self.fail = inner, fail or set()
        self.calls: list[tuple[str, str]] = []

    def set(self, gpu_uuid: str, interval: str) -> None:
        self.calls.append((gpu_uuid, interval))
        if len(self.calls) in self.fail:
            raise transient(f"GPU {gpu_uuid}: nvidia-smi: Insufficient Permissions")
        self.inner.set(gpu_uuid, interval)


@dataclass
class Node:
    root: Path
    backend: NvmlBackend
    claims: Claims
    report: RecoveryReport = field(default_factory=RecoveryReport)

    @property
    def mock(self) -> MockNvml:
        module = self.backend.module
        assert isinstance(module, MockNvml)
        return module

    @property
    def ts(self) -> MockTimeSlice:
        ops = self.backend.timeslice("/unused")
        assert isinstance(ops, MockTimeSlice)
        return ops

    def uuid(self, index: int) -> str:
        return self.mock.gpus[index].uuid

    def state(self, ops: TimeSliceOps | None = None, *, timeslice: bool = True) -> DeviceState:
        """A plugin (re)start on this node: a fresh DeviceState, recovered."""
        state, self.report = node_state(
            self.root,
            self.claims,
            self.backend,
            PoolOptions(allow_multiple_allocations=True),
            timeslice=(ops or self.ts) if timeslice else None,
        )
        return state


@pytest.fixture
def node(tmp_path: Path) -> Node:
    root = tmp_path / "driver-root"
    return Node(tmp_path, MockBackend(MockNvml(FLEET, NODE, driver_root=root)), Claims())


def ok(state: DeviceState, *refs: ClaimRef) -> None:
    results = state.prepare(list(refs))
    assert all(r.ok for r in results.values()), {u: str(r.error) for u, r in results.items()}


def test_prepare_sets_long_and_unprepare_restores_default(node: Node) -> None:
    state = node.state()
    ref = node.claims.add("a", "gpu-0", interval="Long")
    ok(state, ref)
    assert node.ts.settings() == {node.uuid(0): "Long"}
    # The journal records what was set, on the device, with its GPU.
    (device,) = Checkpoint(node.root / "plugin").load()["a"].devices
    assert device.time_slice is not None
    assert (device.time_slice.gpu_uuid, device.time_slice.interval) == (node.uuid(0), "Long")
    assert device.time_slice.seq > 0
    # Another process on the same driver root sees it (the mock keeps it in a file).
    assert MockTimeSlice(node.root / "driver-root", [node.uuid(0)]).get(node.uuid(0)) == "Long"

    assert state.unprepare([ref]) == {"a": None}
    assert node.ts.settings() == {}


def test_two_shares_of_one_gpu_the_last_unprepare_restores(node: Node) -> None:
    state = node.state()
    first = node.claims.add("s1", "gpu-1", interval="Medium", share=True)
    second = node.claims.add("s2", "gpu-1", interval="Medium", share=True)
    ok(state, first)
    ok(state, second)
    assert node.ts.settings() == {node.uuid(1): "Medium"}
    calls = Scripted(node.ts)
    state = node.state(calls)  # a restart: re-applies what the journal holds
    assert calls.calls == [(node.uuid(1), "Medium")]
    assert state.unprepare([first]) == {"s1": None}
    assert node.ts.settings() == {node.uuid(1): "Medium"}  # kept for s2
    assert calls.calls == [(node.uuid(1), "Medium")]  # and not even called
    assert state.unprepare([second]) == {"s2": None}
    assert node.ts.settings() == {}


def test_conflicting_intervals_last_writer_wins(node: Node) -> None:
    state = node.state()
    a = node.claims.add("a", "gpu-0", interval="Long", share=True)
    b = node.claims.add("b", "gpu-0", interval="Short", share=True)
    ok(state, a)
    ok(state, b)
    assert node.ts.get(node.uuid(0)) == "Short"
    node.ts.reboot()
    node.state()  # start re-applies the newest claim's interval, not the other's
    assert node.ts.get(node.uuid(0)) == "Short"
    assert state.unprepare([b]) == {"b": None}
    assert node.ts.get(node.uuid(0)) == "Long"  # what the remaining claim asked for
    assert state.unprepare([a]) == {"a": None}
    assert node.ts.settings() == {}


def test_recover_reapplies_after_a_reboot_and_leaves_other_gpus_alone(node: Node) -> None:
    state = node.state()
    ok(state, node.claims.add("a", "gpu-0", interval="Long"))
    node.ts.reboot()  # a node reboot resets every GPU's setting
    node.ts.set(node.uuid(1), "Medium")  # an administrator's setting on a GPU no claim holds
    node.state()
    assert node.report.time_slices == (node.uuid(0),)
    assert node.ts.settings() == {node.uuid(0): "Long", node.uuid(1): "Medium"}


def test_an_interval_that_cannot_be_set_is_refused_not_claimed(node: Node) -> None:
    """A MIG device (gpu-2 is in MIG mode: its whole GPU is delivered as a full-size MIG
    device too) has no time-slice setting, and an admin-access claim only observes a
    GPU: no interval can be applied, so a non-Default one is a permanent invalid-config
    error, never a GPU_DEVICE_<n>_TIMESLICE_INTERVAL that claims what did not happen."""
    state = node.state()
    cases = {
        "whole-mig": ("gpu-2", "a MIG device: its GPU is in MIG mode"),
        "mig": ("gpu-2-mig-1g10gb-0", "a MIG device: its GPU is in MIG mode"),
        "admin": ("gpu-1", "with admin access"),
    }
    for uid, (device, why) in cases.items():
        admin = uid == "admin"
        ref = node.claims.add(uid, device, interval="Long", admin=admin)
        error = state.prepare([ref])[uid].error
        assert error is not None and error.permanent, (uid, error)
        text = str(error)
        assert text.startswith("permanent (invalid-config): "), text
        assert "sharing.timeSlicingConfig.interval" in text and why in text, text
        assert f"cannot set the time-slice interval Long of device {device}" in text, text
    assert node.ts.settings() == {}
    assert Checkpoint(node.root / "plugin").load() == {}
    assert not state.cdi.list_claim_specs()
    # Default asks for nothing: accepted on the same devices.
    ok(state, node.claims.add("mig-default", "gpu-2", interval="Default"))


def test_default_mig_and_admin_access_touch_nothing(node: Node) -> None:
    node.ts.set(node.uuid(0), "Medium")  # the administrator's
    state = node.state()
    refs = [
        node.claims.add("default", "gpu-0", interval="Default", share=True),
        node.claims.add("none", "gpu-0", interval=None, share=True),
        node.claims.add("mig", "gpu-2-mig-1g10gb-0", interval=None),
        node.claims.add("admin", "gpu-1", interval="Default", admin=True),
    ]
    ok(state, *refs)
    assert node.ts.settings() == {node.uuid(0): "Medium"}
    journal = Checkpoint(node.root / "plugin").load()
    assert all(d.time_slice is None for e in journal.values() for d in e.devices)
    assert all(err is None for err in state.unprepare(refs).values())
    assert node.ts.settings() == {node.uuid(0): "Medium"}


def test_a_failing_set_fails_the_prepare_transiently_and_leaves_nothing(node: Node) -> None:
    state = node.state(Scripted(node.ts, fail={1}))
    ref = node.claims.add("a", "gpu-0", interval="Long")
    error = state.prepare([ref])["a"].error
    assert error is not None and not error.permanent
    assert node.uuid(0) in str(error) and "Insufficient Permissions" in str(error)
    assert Checkpoint(node.root / "plugin").load() == {}  # nothing completed, nothing held
    assert not state.cdi.list_claim_specs()
    assert node.ts.settings() == {}
    ok(state, ref)  # the kubelet's retry
    assert node.ts.settings() == {node.uuid(0): "Long"}


def test_a_failure_on_the_second_gpu_puts_the_first_back(node: Node) -> None:
    ok(node.state(), node.claims.add("held", "gpu-0", interval="Short", share=True))
    # 1: start re-applies Short; 2: gpu-0 Long; 3: gpu-1 Long fails; 4: gpu-0 back.
    ops = Scripted(node.ts, fail={3})
    state = node.state(ops)
    ref = node.claims.add("a", "gpu-0", "gpu-1", interval="Long", share=True)
    assert state.prepare([ref])["a"].error is not None
    assert ops.calls == [
        (node.uuid(0), "Short"),
        (node.uuid(0), "Long"),
        (node.uuid(1), "Long"),
        (node.uuid(0), "Short"),  # what the held claim asked for, not Default
    ]
    assert node.ts.settings() == {node.uuid(0): "Short"}
    assert set(Checkpoint(node.root / "plugin").load()) == {"held"}


def test_a_failed_rollback_keeps_the_entry_started(node: Node) -> None:
    """gpu-0 is set, gpu-1 refuses, and putting gpu-0 back fails too: the entry stays
    `PrepareStarted` (its intent names both GPUs), so the setting is never left
    unrecorded; the next start rolls it back."""
    state = node.state(Scripted(node.ts, fail={2, 3}))
    ref = node.claims.add("a", "gpu-0", "gpu-1", interval="Long", share=True)
    assert state.prepare([ref])["a"].error is not None
    journal = Checkpoint(node.root / "plugin").load()
    assert journal["a"].state is ClaimState.PREPARE_STARTED
    assert node.ts.settings() == {node.uuid(0): "Long"}
    node.state()  # a restart, nvidia-smi works again
    assert node.report.rolled_back == ("a",)
    assert node.ts.settings() == {}
    assert Checkpoint(node.root / "plugin").load() == {}


def test_unprepare_keeps_the_entry_when_restoring_fails(node: Node) -> None:
    ref = node.claims.add("a", "gpu-0", interval="Long")
    ok(node.state(), ref)
    state = node.state(Scripted(node.ts, fail={2}))  # 1: start re-applies Long
    error = state.unprepare([ref])["a"]
    assert isinstance(error, DriverError) and node.uuid(0) in str(error)
    assert set(Checkpoint(node.root / "plugin").load()) == {"a"}  # still held
    assert node.ts.settings() == {node.uuid(0): "Long"}
    assert state.unprepare([ref]) == {"a": None}  # the kubelet repeats it
    assert node.ts.settings() == {}
    assert Checkpoint(node.root / "plugin").load() == {}


def test_without_ops_nothing_is_recorded(node: Node) -> None:
    ok(node.state(timeslice=False), node.claims.add("a", "gpu-0", interval="Long"))
    (device,) = Checkpoint(node.root / "plugin").load()["a"].devices
    assert device.time_slice is None and node.ts.settings() == {}


def test_an_unprepare_during_a_corrupt_journal_restores_once_it_is_readable(node: Node) -> None:
    state = node.state()
    ref = node.claims.add("a", "gpu-0", interval="Long")
    ok(state, ref)
    path = Checkpoint(node.root / "plugin").path
    good = path.read_bytes()
    path.write_text("garbage")
    assert state.unprepare([ref]) == {"a": None}  # spec removed, the entry owed
    assert node.ts.settings() == {node.uuid(0): "Long"}  # the journal cannot say more
    path.write_bytes(good)  # the operator restores a good copy
    assert state.unprepare([node.claims.add("other", "gpu-1")]) == {"other": None}
    assert Checkpoint(node.root / "plugin").load() == {}
    assert node.ts.settings() == {}


def test_a_lost_gpu_does_not_keep_its_claims_unprepare_failing(node: Node) -> None:
    """nvidia-smi cannot reach a GPU that fell off the bus; only a GPU reset or a
    reboot brings it back, and both restore the Default interval: the obligation ends
    with the GPU, as for its MIG devices (docs/mig.md, "A lost GPU")."""
    state = node.state()
    ref = node.claims.add("a", "gpu-0", interval="Long")
    ok(state, ref)
    node.mock.inject_gpu_lost(node.uuid(0))
    assert state.unprepare([ref]) == {"a": None}
    assert Checkpoint(node.root / "plugin").load() == {}
    other = node.claims.add("b", "gpu-1", interval="Short")
    ok(state, other)  # a healthy GPU is set as before
    assert node.ts.get(node.uuid(1)) == "Short"


def test_a_lost_gpu_fails_the_prepare_that_would_set_it(node: Node) -> None:
    state = node.state()
    node.mock.inject_gpu_lost(node.uuid(0))
    error = state.prepare([node.claims.add("a", "gpu-0", interval="Long")])["a"].error
    assert error is not None and not error.permanent
    assert "fallen off the bus" in error.message
