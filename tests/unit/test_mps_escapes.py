"""Processes outside MPS on a GPU with cooperative MPS shares (docs/mps.md, "Escapes"):
the mock lists processes as NVML does (one outside MPS in the compute list only, an
MPS client in both lists, its server in the compute list under its name); the mock's
`process` control action starts and ends them; `MpsEscapes` reports a process outside
MPS once (an Event on the claim whose pod runs it, else on every MPS claim of that
GPU, saying so), counts it in gpu_dra_mps_escapes_total, and with the option taints
the GPU's devices while it runs; an MPS client or server, and a process NVML cannot
name, is not reported. The MPS watch runs it after each check."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest

from driver.health.control_queue import ControlError
from driver.health.mps_escapes import (
    KIND_MPS_ESCAPE,
    REASON_ESCAPE,
    MpsEscapes,
    claim_pods_from,
    reserved_pods,
)
from driver.nvml.backend import NvmlBackend
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_api import NVMLError
from driver.nvml.mock.mock_control import MockActions
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.processes import GpuProcess, GpuProcesses
from driver.observability import metrics
from driver.state.mps_watch import MpsWatch
from driver.state.request import ClaimRef
from tests.unit.test_mps_prepare import Node, mps_node, ok

DRIVER = "gpu.example.com"
POD_A = "11111111-2222-4333-8444-555555555555"
POD_B = "66666666-7777-4888-9999-000000000000"
FLEET = parse_fleet({"gpus": [{"model": "H100-80GB", "count": 2, "migMode": "disabled"}]})


@dataclass(frozen=True)
class Device:
    name: str
    gpu_uuid: str


@dataclass(frozen=True)
class Share:
    claim: ClaimRef
    device: str
    gpu_uuid: str


class Events:
    def __init__(self) -> None:
        self.events: list[tuple[ClaimRef, str, str]] = []

    def post(self, claim: ClaimRef, reason: str, message: str) -> None:
        self.events.append((claim, reason, message))


@dataclass
class Setup:
    mock: MockNvml
    backend: NvmlBackend
    events: Events
    pods: dict[str, set[str]]  # claim UID -> its pods
    changes: list[int]

    @property
    def uuid(self) -> str:
        return self.mock.gpus[0].uuid

    @property
    def root(self) -> Path:
        root = self.mock.mock_kernel_root
        assert root is not None
        return root

    def escapes(self, *, taint: bool = False) -> MpsEscapes:
        devices = [
            Device(f"gpu-{g.minor}{suffix}", g.uuid)
            for g in self.mock.gpus
            for suffix in ("", "-partition-0")
        ]
        return MpsEscapes(
            self.backend.gpu_processes,
            self.events,
            devices,
            driver=DRIVER,
            claim_pods=lambda c: self.pods.get(c.uid),
            taint=taint,
            on_taints_changed=lambda: self.changes.append(1),
            proc_root=self.root / "proc",
        )


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    mock = MockNvml(FLEET, "node-a", driver_root=tmp_path / "root")
    yield Setup(mock, NvmlBackend(mock, backend_name="mock"), Events(), {}, [])


A = ClaimRef("default", "claim-a", "a")
B = ClaimRef("default", "claim-b", "b")


def shares(uuid: str, *claims: ClaimRef) -> list[Share]:
    return [Share(c, f"gpu-0-share-{c.uid}", uuid) for c in claims]


def escapes_total(uuid: str) -> float:
    return metrics.REGISTRY.get_sample_value("gpu_dra_mps_escapes_total", {"gpu": uuid}) or 0.0


# -- the mock lists processes as NVML does ---------------------------------------------


def test_the_mock_lists_processes_as_nvml_does(setup: Setup) -> None:
    mock = setup.mock
    mock.nvmlInit()
    handle = mock.nvmlDeviceGetHandleByIndex(0)
    assert mock.nvmlDeviceGetComputeRunningProcesses(handle) == []
    outside = mock.start_process(setup.uuid, used_bytes=2 << 30)
    client = mock.start_process(setup.uuid, "mps-client")
    (server,) = [p for p in mock.processes(setup.uuid) if p.kind == "mps-server"]
    compute = {p.pid: p.usedGpuMemory for p in mock.nvmlDeviceGetComputeRunningProcesses(handle)}
    assert compute == {outside.pid: 2 << 30, server.pid: 32 << 20, client.pid: 1 << 30}
    assert [p.pid for p in mock.nvmlDeviceGetMPSComputeRunningProcesses(handle)] == [client.pid]
    assert mock.nvmlSystemGetProcessName(server.pid).endswith("/nvidia-cuda-mps-server")
    assert all(p.pid > 4194304 for p in mock.processes())  # never a real pid
    other = mock.nvmlDeviceGetHandleByIndex(1)
    assert mock.nvmlDeviceGetComputeRunningProcesses(other) == []
    mock.end_process(outside.pid)
    with pytest.raises(NVMLError) as err:
        mock.nvmlSystemGetProcessName(outside.pid)
    assert err.value.value == pynvml.NVML_ERROR_NOT_FOUND
    mock.inject_gpu_lost(setup.uuid)
    with pytest.raises(NVMLError) as err:
        mock.nvmlDeviceGetComputeRunningProcesses(handle)
    assert err.value.value == pynvml.NVML_ERROR_GPU_IS_LOST


def test_the_backend_tells_which_processes_run_outside_mps(setup: Setup) -> None:
    outside = setup.mock.start_process(setup.uuid)
    setup.mock.start_process(setup.uuid, "mps-client")
    listing = setup.backend.gpu_processes(setup.uuid)
    assert not listing.error
    assert [p.pid for p in listing.processes if p.outside_mps] == [outside.pid]
    assert [p.mps_server for p in listing.processes].count(True) == 1
    assert [p.mps_client for p in listing.processes].count(True) == 1
    assert not GpuProcess(7, None, mps_client=False, name=None).outside_mps  # unnamed


def test_the_process_control_action_starts_and_ends_one(setup: Setup) -> None:
    handlers = MockActions(setup.mock, [Device("gpu-0", setup.uuid)]).handlers()
    answer = handlers["process"]({"device": "gpu-0", "memoryMiB": 512, "podUID": POD_A})
    (process,) = setup.mock.processes(setup.uuid)
    assert answer["pid"] == process.pid and process.kind == "compute"
    assert process.used_bytes == 512 << 20 and f"pod {POD_A}" in answer["message"]
    cgroup = setup.root / "proc" / str(process.pid) / "cgroup"
    assert POD_A.replace("-", "_") in cgroup.read_text()
    handlers["process"]({"end": process.pid})
    assert setup.mock.processes() == [] and not cgroup.exists()
    for bad, why in [
        ({"device": "gpu-9"}, "unknown device"),
        ({"device": "gpu-0", "kind": "mps-server"}, "invalid kind"),
        ({"device": "gpu-0", "podUID": "x"}, "invalid podUID"),
        ({"device": "gpu-0", "memoryMiB": -1}, "invalid memoryMiB"),
        ({"device": "gpu-0", "pid": 1}, "unknown field"),
        ({"end": 12}, "no mock process 12"),
    ]:
        with pytest.raises(ControlError, match=why):
            handlers["process"](bad)


# -- what the check reports ---------------------------------------------------------------


def test_an_escape_is_reported_once_on_the_claim_whose_pod_runs_it(setup: Setup) -> None:
    setup.pods = {"a": {POD_A}, "b": {POD_B}}
    escapes = setup.escapes()
    before = escapes_total(setup.uuid)
    process = setup.mock.start_process(setup.uuid, used_bytes=3 << 30, pod_uid=POD_B)

    (found,) = escapes.check(shares(setup.uuid, A, B))

    assert (found.pid, found.pod_uid, found.gpu_uuid) == (process.pid, POD_B, setup.uuid)
    ((claim, reason, message),) = setup.events.events
    assert (claim, reason) == (B, REASON_ESCAPE)
    assert f"process {process.pid}" in message and setup.uuid in message, message
    assert "3072 MiB" in message and "outside MPS" in message
    assert f"pod {POD_B}, which this claim is reserved for" in message
    assert escapes_total(setup.uuid) == before + 1
    # Seen again: nothing new.
    assert escapes.check(shares(setup.uuid, A, B)) == []
    assert len(setup.events.events) == 1 and escapes_total(setup.uuid) == before + 1
    assert [e.pid for e in escapes.escapes()] == [process.pid]
    # It ends; another starts: that one is new.
    setup.mock.end_process(process.pid)
    assert escapes.check(shares(setup.uuid, A, B)) == [] and escapes.escapes() == []
    again = setup.mock.start_process(setup.uuid, pod_uid=POD_B)
    assert [e.pid for e in escapes.check(shares(setup.uuid, A, B))] == [again.pid]
    assert escapes_total(setup.uuid) == before + 2


def test_an_mps_client_and_its_server_are_not_escapes(setup: Setup) -> None:
    escapes = setup.escapes(taint=True)
    setup.mock.start_process(setup.uuid, "mps-client", pod_uid=POD_A)
    setup.mock.start_process(setup.uuid, "mps-client", pod_uid=POD_A)
    before = escapes_total(setup.uuid)
    assert escapes.check(shares(setup.uuid, A)) == []
    assert setup.events.events == [] and escapes_total(setup.uuid) == before
    assert escapes.add_taints({}) == {} and setup.changes == []


def test_a_process_of_no_known_pod_is_reported_on_every_claim_of_the_gpu(setup: Setup) -> None:
    escapes = setup.escapes()
    setup.pods = {"a": {POD_A}}
    setup.mock.start_process(setup.uuid)  # no pod cgroup seen
    setup.mock.start_process(setup.uuid, pod_uid=POD_B)  # a pod no MPS claim is for
    escapes.check([*shares(setup.uuid, A, B), Share(A, "gpu-0-share-a2", setup.uuid)])
    by_message: dict[str, list[str]] = {}
    for claim, _, message in setup.events.events:
        by_message.setdefault(message, []).append(claim.uid)
    assert sorted(by_message.values()) == [["a", "b"], ["a", "b"]]  # each claim once
    texts = " ".join(by_message)
    assert "its pod cannot be told" in texts and "reported on every claim" in texts
    assert f"pod {POD_B}, for which none of the claims" in texts


def test_a_gpu_without_mps_shares_is_not_looked_at(setup: Setup) -> None:
    escapes = setup.escapes()
    setup.mock.start_process(setup.mock.gpus[1].uuid)
    assert escapes.check(shares(setup.uuid, A)) == []
    assert setup.mock.calls["nvmlDeviceGetComputeRunningProcesses"] == 1  # gpu-0 only


def test_a_process_nvml_cannot_name_is_not_taken_for_an_escape(setup: Setup) -> None:
    unnamed = GpuProcesses(setup.uuid, (GpuProcess(99, 1 << 20, False, None),))
    escapes = MpsEscapes(
        lambda uuid: unnamed,
        setup.events,
        [],
        driver=DRIVER,
        claim_pods=lambda c: set(),
    )
    assert escapes.check(shares(setup.uuid, A)) == [] and setup.events.events == []


def test_a_gpu_nvml_cannot_list_keeps_what_was_seen(setup: Setup) -> None:
    escapes = setup.escapes(taint=True)
    setup.mock.start_process(setup.uuid)
    assert len(escapes.check(shares(setup.uuid, A))) == 1
    setup.mock.inject_gpu_lost(setup.uuid)
    assert escapes.check(shares(setup.uuid, A)) == []
    assert len(escapes.escapes()) == 1 and len(setup.events.events) == 1
    assert setup.changes == [1]  # tainted once, not untainted by the failed listing


# -- the taint option ------------------------------------------------------------------


def test_the_option_taints_the_gpu_s_devices_while_the_process_runs(setup: Setup) -> None:
    escapes = setup.escapes(taint=True)
    process = setup.mock.start_process(setup.uuid)
    escapes.check(shares(setup.uuid, A))
    assert setup.changes == [1]
    taints = escapes.add_taints({"gpu-0": [{"key": "other", "effect": "None"}]})
    assert sorted(taints) == ["gpu-0", "gpu-0-partition-0"]  # not gpu-1's
    taint = taints["gpu-0-partition-0"][0]
    assert (taint["key"], taint["effect"]) == (f"{DRIVER}/{KIND_MPS_ESCAPE}", "NoSchedule")
    assert taint["timeAdded"] == escapes.escapes()[0].since
    assert taints["gpu-0"][0] == {"key": "other", "effect": "None"}
    assert "taint gpu.example.com/mps-escape:NoSchedule" in setup.events.events[0][2]
    escapes.check(shares(setup.uuid, A))  # still there: no change
    assert setup.changes == [1]
    setup.mock.end_process(process.pid)
    escapes.check(shares(setup.uuid, A))
    assert setup.changes == [1, 1] and escapes.add_taints({}) == {}


def test_without_the_option_nothing_is_tainted(setup: Setup) -> None:
    escapes = setup.escapes()
    setup.mock.start_process(setup.uuid)
    assert len(escapes.check(shares(setup.uuid, A))) == 1
    assert escapes.add_taints({}) == {} and setup.changes == []
    assert "taint" not in setup.events.events[0][2]


# -- the claim's pods ------------------------------------------------------------------


def test_a_claim_s_pods_are_its_reserved_for_pods() -> None:
    claim: dict[str, Any] = {
        "metadata": {"uid": "a"},
        "status": {
            "reservedFor": [
                {"resource": "pods", "name": "p", "uid": POD_A},
                {"apiGroup": "x.io", "resource": "jobs", "name": "j", "uid": POD_B},
            ]
        },
    }
    assert reserved_pods(claim, "a") == {POD_A}
    assert reserved_pods(claim, "other") == set()  # a claim made again under the name

    class Reader:
        def get(self, namespace: str, name: str) -> dict[str, Any]:
            if name == "gone":
                from driver.errors import transient

                raise transient("not found")
            return claim

    pods = claim_pods_from(Reader())
    found: Collection[str] | None = pods(ClaimRef("default", "claim-a", "a"))
    assert found == {POD_A}
    assert pods(ClaimRef("default", "gone", "a")) is None


# -- after each check of the MPS daemons -------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    yield from mps_node(
        tmp_path, parse_fleet({"gpus": [{"model": "H100-80GB", "count": 1, "migMode": "disabled"}]})
    )


def test_the_mps_watch_looks_for_escapes_after_each_check(node: Node) -> None:
    state = node.state()
    ref = node.claims.add("a")
    node.claims.docs["a"]["status"]["reservedFor"] = [{"resource": "pods", "uid": POD_A}]
    ok(state, ref)
    mock = node.backend.module
    uuid = node.record("a").gpu_uuid
    events = Events()
    escapes = MpsEscapes(
        node.backend.gpu_processes,
        events,
        list(state.devices.values()),
        driver=DRIVER,
        claim_pods=claim_pods_from(node.claims),
        proc_root=mock.mock_kernel_root / "proc",
    )
    watch = MpsWatch(state, events, after_check=escapes)
    mock.start_process(uuid, "mps-client", pod_uid=POD_A)
    watch.check()
    assert events.events == []
    process = mock.start_process(uuid, pod_uid=POD_A)
    watch.check()
    ((claim, reason, message),) = events.events
    assert (claim, reason) == (ref, REASON_ESCAPE) and f"process {process.pid}" in message
    assert f"pod {POD_A}, which this claim is reserved for" in message
    watch.check()
    assert len(events.events) == 1
