"""Strict MPS on the mock (docs/mps.md, "Strict: one MPS server, EXCLUSIVE_PROCESS"):
a whole GPU that no share divides, of Volta or later, publishes
`mpsIsolation: "strict"`, and its MPS claim holds it in compute mode EXCLUSIVE_PROCESS
while prepared, so a process outside MPS cannot open it while an MPS client can; the
mode found is put back at unprepare (an administrator's EXCLUSIVE_PROCESS left as it
is); partitions and capacity shares stay cooperative and never change the mode."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli.validate.cel_device import Selector, device_activation
from driver.devices.model import PoolOptions, build_pool
from driver.devices.slices import build_slice_documents
from driver.nvml.discovered import GpuInfo, Inventory
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_api import (
    NVML_COMPUTEMODE_DEFAULT,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    NVML_COMPUTEMODE_PROHIBITED,
)
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.mock_control import MockActions, MockControlError
from driver.nvml.mock.nvml import MockNvml
from driver.state.journal.checkpoint import Checkpoint, PreparedDevice
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.compute_modes import ClaimComputeModes, published_strict
from driver.state.mps.daemons import NodeDaemons
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef
from driver.state.spec_render import PlannedDevice
from tests.state_fakes import node_state
from tests.unit.test_mps_prepare import DRIVER, NODE, Claims, Node, mps_node

FLEET = parse_fleet({"gpus": [{"model": "H100-80GB", "count": 2, "migMode": "disabled"}]})
STRICT = PoolOptions(mps=True)
SHARES = PoolOptions(mps=True, allow_multiple_allocations=True)
PARTITIONS = PoolOptions(mps=True, gpu_partitions=2)


class StrictNode(Node):
    """The mock node of tests/unit/test_mps_prepare.py whose plugin sets compute modes,
    as the plugin does (`compute_modes=backend.compute_modes()`), as root."""

    compute: bool = True

    @property
    def mock(self) -> MockNvml:
        module = self.backend.module
        assert isinstance(module, MockNvml)
        return module

    def state(self, *, mps: bool = True) -> DeviceState:
        self.mock.privileged = True
        state, self.report = node_state(
            self.root,
            self.claims,
            self.backend,
            self.options,
            mps=self.control if mps else None,
            compute_modes=self.backend.compute_modes() if self.compute else None,
        )
        return state

    def uuid(self, minor: int = 0) -> str:
        return self.mock.gpus[minor].uuid

    def mode(self, minor: int = 0) -> int:
        return self.mock.compute_mode(self.uuid(minor))

    def sets(self) -> int:
        return self.mock.calls["nvmlDeviceSetComputeMode"]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StrictNode]:
    for plain in mps_node(tmp_path, FLEET):
        yield StrictNode(plain.root, plain.backend, plain.claims, options=STRICT)


def _record(node: StrictNode, uid: str) -> MpsRecord:
    (device,) = Checkpoint(node.root / "plugin").load()[uid].devices
    assert device.mps is not None
    return device.mps


def _share(claims: Claims, uid: str, memory: str, compute: str) -> ClaimRef:
    """A capacity share of gpu-0 (no config: its share gets a daemon of its own)."""
    ref = claims.add(uid)
    result = claims.docs[uid]["status"]["allocation"]["devices"]
    result["config"] = []
    result["results"][0].update(
        shareID=f"s-{uid}", consumedCapacity={"memory": memory, "compute": compute}
    )
    return ref


def test_a_strict_claim_holds_its_gpu_in_exclusive_process(node: StrictNode) -> None:
    state = node.state()
    ref = node.claims.add("a")
    assert state.prepare([ref])["a"].ok
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert node.mode(1) == NVML_COMPUTEMODE_DEFAULT  # a GPU no entry names: untouched
    assert _record(node, "a").compute_mode_before == NVML_COMPUTEMODE_DEFAULT
    actions = MockActions(node.mock, list(state.devices.values()))
    client = actions.handle_process({"device": "gpu-0", "kind": "mps-client"})
    assert client["pid"]  # the claim's MPS client: its server holds the one context
    with pytest.raises(MockControlError, match="all CUDA-capable devices are busy or unavail"):
        actions.handle_process({"device": "gpu-0", "kind": "compute"})
    assert actions.handle_process({"device": "gpu-0", "kind": "mps-client"})["pid"]
    assert actions.handle_process({"device": "gpu-1", "kind": "compute"})["pid"]

    assert state.unprepare([ref]) == {"a": None}
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT
    assert not node.daemons()
    assert node.mock.start_process(node.uuid(), "compute").pid  # Default: several contexts


def test_unprepare_puts_back_exactly_the_mode_found(node: StrictNode) -> None:
    node.mock.privileged = True
    node.backend.compute_modes().set(node.uuid(), NVML_COMPUTEMODE_PROHIBITED)
    state = node.state()
    ref = node.claims.add("a")
    assert state.prepare([ref])["a"].ok
    assert _record(node, "a").compute_mode_before == NVML_COMPUTEMODE_PROHIBITED
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert state.unprepare([ref]) == {"a": None}
    assert node.mode() == NVML_COMPUTEMODE_PROHIBITED


def test_an_administrators_exclusive_process_is_left_as_found(node: StrictNode) -> None:
    node.mock.privileged = True
    node.backend.compute_modes().set(node.uuid(), NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    before = node.sets()
    state = node.state()
    ref = node.claims.add("a")
    assert state.prepare([ref])["a"].ok
    assert _record(node, "a").compute_mode_before == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert state.unprepare([ref]) == {"a": None}
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert node.sets() == before  # never set by the driver


@pytest.mark.parametrize("options", [SHARES, PARTITIONS], ids=["share", "partition"])
def test_shares_and_partitions_never_change_the_compute_mode(
    node: StrictNode, options: PoolOptions
) -> None:
    node.options = options
    state = node.state()
    if options is SHARES:
        refs = [_share(node.claims, "a", "16Gi", "20"), _share(node.claims, "b", "8Gi", "50")]
    else:
        refs = [node.claims.add(uid, f"gpu-0-partition-{j}") for j, uid in enumerate("ab")]
    results = state.prepare(refs)
    assert all(r.ok for r in results.values()), results
    assert len(node.daemons()) == 2  # two servers on one GPU: cooperative
    for uid in ("a", "b"):
        assert _record(node, uid).compute_mode_before is None
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT
    assert node.sets() == 0
    assert state.unprepare(refs) == {"a": None, "b": None}
    assert node.sets() == 0


def test_a_failed_daemon_start_puts_the_mode_back(
    node: StrictNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = node.state()
    modes: list[int] = []

    def refuse(self: NodeDaemons, record: MpsRecord, dirs: Any) -> MpsRecord:
        modes.append(node.mode())
        raise OSError("no daemon today")

    monkeypatch.setattr(NodeDaemons, "start", refuse)
    result = state.prepare([node.claims.add("a")])["a"]
    assert result.error is not None and "no daemon today" in str(result.error)
    assert modes == [NVML_COMPUTEMODE_EXCLUSIVE_PROCESS]  # set before the daemon starts
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT
    assert Checkpoint(node.root / "plugin").load() == {}


def test_a_plugin_that_cannot_set_compute_modes_refuses_a_strict_device(
    node: StrictNode,
) -> None:
    node.compute = False
    state = node.state()
    result = state.prepare([node.claims.add("a")])["a"]
    assert result.error is not None and not result.error.permanent
    assert "mpsIsolation strict" in str(result.error)
    assert not node.daemons() and Checkpoint(node.root / "plugin").load() == {}
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT


def test_a_refused_set_fails_the_prepare_and_leaves_nothing(node: StrictNode) -> None:
    state = node.state()
    node.mock.privileged = False  # NVML: NO_PERMISSION
    result = state.prepare([node.claims.add("a")])["a"]
    assert result.error is not None and "needs root" in str(result.error)
    assert not node.daemons() and Checkpoint(node.root / "plugin").load() == {}
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT


def test_a_record_without_the_key_leaves_the_mode_alone(node: StrictNode) -> None:
    """A record an earlier release wrote (no `computeModeBefore`) reads as cooperative:
    its daemon is stopped and no compute mode is set."""
    state = node.state()
    assert state.prepare([node.claims.add("a")])["a"].ok
    (device,) = Checkpoint(node.root / "plugin").load()["a"].devices
    assert device.mps is not None
    doc = device.mps.to_json()
    assert doc.pop("computeModeBefore") == NVML_COMPUTEMODE_DEFAULT
    old = MpsRecord.from_json(doc)
    assert old.compute_mode_before is None and not old.strict
    assert "computeModeBefore" not in old.to_json()
    before = node.sets()
    state.mps.restore("c", [replace(device, mps=old)], {})
    assert not node.daemons()
    assert node.sets() == before
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS  # nothing recorded to restore
    state.mps.restore("c", [device], {})  # the record that knows it
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT


# -- the published attribute --------------------------------------------------------


def _gpu(minor: int, cc: str | None) -> GpuInfo:
    return GpuInfo(
        index=minor,
        minor=minor,
        uuid=f"GPU-{minor:08d}-0000-4000-8000-000000000000",
        product_name="NVIDIA Test",
        pci_bus_id=f"0000:0{minor}:00.0",
        memory_bytes=16 << 30,
        cuda_compute_capability=cc,
    )


def _published(options: PoolOptions, inventory: Inventory) -> dict[str, str | None]:
    pool = build_pool(inventory, options)
    slices = build_slice_documents(pool, driver=DRIVER, node_name=NODE)
    return {
        d["name"]: d["attributes"].get("mpsIsolation", {}).get("string")
        for s in slices
        for d in s["spec"].get("devices", [])
    }


def test_strict_is_published_on_whole_unshared_gpus_of_volta_and_later() -> None:
    """In the published slices: `strict` on a whole GPU of compute capability 7.0 and
    up that no share divides (`gpu-<i>` and `gpu-<i>-full`), `cooperative` on
    partitions, capacity shares and GPUs before Volta (or of unknown capability),
    nothing where the node runs no MPS daemons."""
    inventory = Inventory(
        gpus=(_gpu(0, "9.0"), _gpu(1, "7.0"), _gpu(2, "6.1"), _gpu(3, None)),
        driver_version="580.95.05",
        backend="mock",
        cuda_driver_version="13.0",
    )
    assert _published(STRICT, inventory) == {
        "gpu-0": "strict",
        "gpu-1": "strict",
        "gpu-2": "cooperative",  # Pascal: no strict mode, the mode is never set
        "gpu-3": "cooperative",
    }
    assert set(_published(SHARES, inventory).values()) == {"cooperative"}
    partitioned = _published(PARTITIONS, inventory)
    assert partitioned["gpu-0-full"] == "strict" and partitioned["gpu-2-full"] == "cooperative"
    assert {v for n, v in partitioned.items() if "-partition-" in n} == {"cooperative"}
    assert set(_published(PoolOptions(), inventory).values()) == {None}


def test_a_pre_volta_gpu_is_never_set() -> None:
    """A whole GPU published cooperative (here: before Volta) prepared with MPS keeps
    its compute mode: nothing but the published attribute makes a claim strict."""
    inventory = Inventory("mock", "580.95.05", "13.0", (_gpu(0, "6.0"),))
    (device,) = build_pool(inventory, STRICT).devices
    assert not published_strict(device)

    class Refuse:
        def get(self, gpu_uuid: str) -> int:
            raise AssertionError("read")

        def set(self, gpu_uuid: str, mode: int) -> None:
            raise AssertionError("set")

    record = MpsRecord(device.gpu_uuid, "d")
    prepared = PreparedDevice("p", device.name, ("r",), (), mps=record)
    planned = PlannedDevice(prepared, "c", (), device.gpu_uuid, 0)
    (noted,) = ClaimComputeModes(Refuse()).note([planned], {device.name: device})
    assert noted.prepared.mps == record


def test_the_strict_demo_selects_only_strict_whole_gpus(tmp_path: Path) -> None:
    """demo/mps/strict-whole-gpu.yaml's selector, evaluated as DRA's CEL, picks the
    whole GPUs that publish `mpsIsolation: "strict"` (MPS daemons on, no capacity
    shares), none of the demo's shared GPUs, none without MPS; its claim asks for MPS."""
    example = Path(__file__).resolve().parents[2] / "demo" / "mps" / "strict-whole-gpu.yaml"
    docs = [d for d in yaml.safe_load_all(example.read_text()) if d]
    (template,) = [d for d in docs if d["kind"] == "ResourceClaimTemplate"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    selectors = [Selector(s["cel"]["expression"]) for s in request["exactly"]["selectors"]]
    (config,) = template["spec"]["spec"]["devices"]["config"]
    assert config["opaque"]["parameters"]["sharing"]["strategy"] == "MPS"
    fleet = parse_fleet(
        {"gpus": [{"model": "A100-40GB", "migMode": "disabled"}, {"model": "H100-80GB"}]}
    )
    inventory = MockBackend(MockNvml(fleet, NODE)).discover()

    def picked(options: PoolOptions) -> list[str]:
        return [
            d.name
            for d in build_pool(inventory, options).devices
            if all(s.matches(device_activation(d.document, DRIVER)) for s in selectors)
        ]

    assert picked(STRICT) == ["gpu-0"]
    assert picked(PARTITIONS) == ["gpu-0-full"]
    assert picked(SHARES) == [] and picked(PoolOptions()) == []
