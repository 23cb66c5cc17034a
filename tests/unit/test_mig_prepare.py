"""Prepare/unprepare of MIG devices through DeviceState, the MIG manager and the mock
NVML (whose MIG state and capability files live under a driver root, as on a GPU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from driver.cdi.device_nodes import CharMajors
from driver.devices.model import MigStrategy, PoolDevices, PoolOptions, build_pool
from driver.errors import transient
from driver.nvml.backend import NvmlBackend
from driver.nvml.mig.mig_manager import MigTarget
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mig.mig_state import mig_minor
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.nvml import MockNvml
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.prepare import DeviceState
from driver.state.request import ClaimRef
from tests.state_fakes import device_state

DRIVER = "gpu.example.com"
NODE = "node-a"


class Claims:
    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}

    def add(self, uid: str, *devices: str) -> ClaimRef:
        results = [
            {"request": f"r{i}", "driver": DRIVER, "pool": NODE, "device": d}
            for i, d in enumerate(devices)
        ]
        self.docs[uid] = {
            "metadata": {"namespace": "default", "name": f"claim-{uid}", "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": []}}},
        }
        return ClaimRef("default", f"claim-{uid}", uid)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.docs[name.removeprefix("claim-")]


@dataclass
class Node:
    root: Path
    backend: NvmlBackend
    pool: PoolDevices
    state: DeviceState
    claims: Claims

    @property
    def mock(self) -> MockNvml:
        module = self.backend.module
        assert isinstance(module, MockNvml)
        return module

    def live(self, minor: int = 0) -> list[Any]:
        return self.backend.mig().instances(self.mock.gpus[minor].uuid)

    def spec(self, uid: str) -> dict[str, Any]:
        doc = self.state.cdi.read_claim_spec(uid)
        assert doc is not None, f"no CDI spec for {uid}"
        return doc


def make_node(root: Path, fleet: dict[str, Any], strategy: MigStrategy = MigStrategy.AUTO) -> Node:
    driver_root = root / "driver-root"
    backend = MockBackend(MockNvml(parse_fleet(fleet), NODE, driver_root=driver_root))
    claims = Claims()
    state = mig_state(root, backend, claims)
    state.recover()
    inventory, owned = state.discover_with_owned(backend.discover)  # as the plugin does
    pool = build_pool(inventory, PoolOptions(mig_strategy=strategy), owned_mig=owned)
    state.devices = {d.name: d for d in pool.devices}
    return Node(root, backend, pool, state, claims)


PROC_DEVICES = Path(__file__).parent / "data" / "proc-devices"


def mig_state(
    root: Path, backend: NvmlBackend, claims: Claims, devices: dict[str, Any] | None = None
) -> DeviceState:
    """The plugin's DeviceState on `make_node`'s node under `root`: real device nodes,
    the backend's MIG manager; `devices` (default: none yet), not recovered."""
    return device_state(
        root,
        claims,
        devices={} if devices is None else devices,
        real_devices=True,
        mig=backend.mig(),
        caps_root=root / "driver-root",
        proc_devices=PROC_DEVICES,
    )


def uuids_in(env: list[str]) -> list[str]:
    """The MIG UUIDs a device's env names; every device's env ends in `void`, so an
    NVIDIA runtime in legacy mode adds no device of its own."""
    assert env[-1] == "NVIDIA_VISIBLE_DEVICES=void", env
    return [e.split("=", 1)[1] for e in env if e.startswith("GPU_DEVICE_") and "_UUID=" in e]


H100 = {"gpus": [{"model": "H100-80GB", "count": 1}]}


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return make_node(tmp_path, H100)


def test_dynamic_partition_is_created_at_prepare_and_destroyed_at_unprepare(node: Node) -> None:
    ref = node.claims.add("u1", "gpu-0-mig-1g10gb-3")
    res = node.state.prepare([ref])["u1"]
    assert res.ok, res.error

    (live,) = node.live()
    assert live.placement == (3, 1) and live.uuid is not None and live.uuid.startswith("MIG-")
    record = res.devices[0].mig
    assert record is not None and record.owned
    assert (record.gi_id, record.ci_id, record.uuid) == (live.gi_id, live.ci_id, live.uuid)
    edits = node.spec("u1")["devices"][0]["containerEdits"]
    assert uuids_in(edits["env"]) == [live.uuid]
    # The MIG device only: its parent's node and its two capability nodes, complete
    # (the majors of /proc/devices, the mode of the capability's access file).
    gi_minor, ci_minor = mig_minor(0, live.gi_id), mig_minor(0, live.gi_id, live.ci_id)
    assert edits["deviceNodes"] == [
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 0o666},
        {"path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}", "type": "c", "major": 237}
        | {"minor": gi_minor, "fileMode": 0o444},
        {"path": f"/dev/nvidia-caps/nvidia-cap{ci_minor}", "type": "c", "major": 237}
        | {"minor": ci_minor, "fileMode": 0o444},
    ]
    entry = Checkpoint(node.root / "plugin").load()["u1"]
    assert entry.state is ClaimState.PREPARE_COMPLETED and entry.devices == res.devices

    assert node.state.unprepare([ref]) == {"u1": None}
    assert node.live() == []
    assert node.state.unprepare([ref]) == {"u1": None}  # repeated: nothing left to do


def test_whole_gpu_in_mig_mode_is_delivered_as_the_full_size_mig_device(node: Node) -> None:
    res = node.state.prepare([node.claims.add("w", "gpu-0")])["w"]
    assert res.ok, res.error
    (live,) = node.live()
    assert live.placement == (0, 8)
    env = node.spec("w")["devices"][0]["containerEdits"]["env"]
    assert uuids_in(env) == [live.uuid]


def test_two_partitions_of_one_claim_see_both_mig_devices(node: Node) -> None:
    ref = node.claims.add("two", "gpu-0-mig-1g10gb-0", "gpu-0-mig-1g10gb-1")
    assert node.state.prepare([ref])["two"].ok
    uuids = {str(m.uuid) for m in node.live()}
    # Each device names its own MIG device only: a container that references one of
    # the two requests cannot reach the other's.
    seen = [uuids_in(d["containerEdits"]["env"]) for d in node.spec("two")["devices"]]
    assert all(len(u) == 1 for u in seen) and {u[0] for u in seen} == uuids


def test_occupied_placement_is_a_transient_error_naming_the_device(node: Node) -> None:
    gpu = node.mock.gpus[0].uuid
    node.backend.mig().create(MigTarget(gpu, 19, (2, 1), 1))  # created behind the driver's back
    ref = node.claims.add("busy", "gpu-0-mig-2g20gb-2")
    error = node.state.prepare([ref])["busy"].error
    assert error is not None and not error.permanent
    assert "gpu-0-mig-2g20gb-2" in str(error) and "occupied" in str(error)
    assert "NVML_ERROR_INSUFFICIENT_RESOURCES" in str(error)
    assert [m.placement for m in node.live()] == [(2, 1)]  # nothing half-created left
    assert Checkpoint(node.root / "plugin").load() == {}


def test_overlapping_placements_are_refused_on_the_node(node: Node) -> None:
    """The scheduler's counters normally prevent this; the node must hold even when
    they are bypassed (a stale allocation, a force-deleted claim)."""
    first = node.claims.add("big", "gpu-0-mig-3g40gb-0")
    assert node.state.prepare([first])["big"].ok
    second = node.claims.add("small", "gpu-0-mig-1g10gb-2")  # slice 2 lies in 0..3
    error = node.state.prepare([second])["small"].error
    assert error is not None and "overlaps device gpu-0-mig-3g40gb-0" in str(error)
    third = node.claims.add("whole", "gpu-0")
    assert "overlaps" in str(node.state.prepare([third])["whole"].error)
    beside = node.claims.add("beside", "gpu-0-mig-1g10gb-4")
    assert node.state.prepare([beside])["beside"].ok
    assert sorted(m.placement for m in node.live()) == [(0, 4), (4, 1)]


def test_overlapping_placements_in_one_request_are_refused(node: Node) -> None:
    a = node.claims.add("a", "gpu-0-mig-2g20gb-0")
    b = node.claims.add("b", "gpu-0-mig-1g10gb-1")
    res = node.state.prepare([a, b])
    assert res["a"].ok and res["b"].error is not None
    assert [m.placement for m in node.live()] == [(0, 2)]


STATIC = {
    "gpus": [
        {
            "model": "H100-80GB",
            "count": 1,
            "migInstances": [
                {"profile": "1g.10gb", "start": 0},
                {"profile": "3g.40gb", "start": 4},
            ],
        }
    ]
}


def test_static_mig_devices_are_published_prepared_and_never_destroyed(tmp_path: Path) -> None:
    node = make_node(tmp_path, STATIC)
    names = [d.name for d in node.pool.devices]
    assert names == ["gpu-0-mig-1g10gb-0", "gpu-0-mig-3g40gb-4"]  # exactly those
    before = node.live()
    published = node.pool.device("gpu-0-mig-3g40gb-4").document["attributes"]["uuid"]
    static = next(m for m in before if m.placement == (4, 4))
    assert published == {"string": static.uuid}

    ref = node.claims.add("s", "gpu-0-mig-3g40gb-4")
    res = node.state.prepare([ref])["s"]
    assert res.ok, res.error
    assert res.devices[0].mig is not None and not res.devices[0].mig.owned
    env = node.spec("s")["devices"][0]["containerEdits"]["env"]
    assert uuids_in(env) == [static.uuid]
    assert node.state.unprepare([ref]) == {"s": None}
    assert node.live() == before  # untouched


def test_reboot_recreates_the_mig_devices_of_prepared_claims(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    ref = node.claims.add("r", "gpu-0-mig-2g20gb-4")
    assert node.state.prepare([ref])["r"].ok
    for path in (tmp_path / "cdi").iterdir():  # the CDI root is a tmpfs
        path.unlink()
    node.mock.mock_reboot()
    assert node.live() == []

    restarted = make_node(tmp_path, H100)  # recover() runs first, then discovery

    (live,) = restarted.live()
    assert live.placement == (4, 2)
    entry = Checkpoint(tmp_path / "plugin").load()["r"]
    record = entry.devices[0].mig
    assert record is not None and record.uuid == live.uuid
    env = restarted.spec("r")["devices"][0]["containerEdits"]["env"]
    assert uuids_in(env) == [live.uuid]
    assert restarted.pool.mig_modes[restarted.mock.gpus[0].uuid] == "dynamic"
    assert restarted.state.unprepare([ref]) == {"r": None} and restarted.live() == []


def test_admin_access_never_creates_a_mig_device(node: Node) -> None:
    user = node.claims.add("user", "gpu-0-mig-2g20gb-0")
    assert node.state.prepare([user])["user"].ok
    admin = node.claims.add("admin", "gpu-0-mig-2g20gb-0")
    node.claims.docs["admin"]["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    res = node.state.prepare([admin])["admin"]
    assert res.ok, res.error
    assert res.devices[0].mig is None
    edits = node.spec("admin")["devices"][0]["containerEdits"]
    assert uuids_in(edits["env"]) == [] and edits["env"][-1] == "NVIDIA_VISIBLE_DEVICES=void"
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidia0"]  # the parent GPU
    assert node.state.unprepare([admin]) == {"admin": None}
    assert [m.placement for m in node.live()] == [(0, 2)]  # the user's device stays


@pytest.mark.parametrize("failing", [1, 2], ids=["intent", "completed"])
def test_a_failed_journal_store_leaves_no_mig_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    """A MIG claim journals its intent before the create: if that store fails nothing
    is created; if the PrepareCompleted store fails the created device is destroyed."""
    node = make_node(tmp_path, H100)
    stores = {"n": 0}
    real = Checkpoint.store

    def store(self: Checkpoint, entries: Any, **kwargs: Any) -> None:
        stores["n"] += 1
        if stores["n"] == failing:
            raise transient(f"cannot write checkpoint {self.path}: No space left on device")
        real(self, entries, **kwargs)

    monkeypatch.setattr(Checkpoint, "store", store)
    error = node.state.prepare([node.claims.add("u", "gpu-0-mig-1g10gb-0")])["u"].error
    assert error is not None and not error.permanent and "checkpoint" in str(error)
    assert node.live() == []
    assert not node.state.cdi.claim_spec_exists("u")
    assert "u" not in Checkpoint(node.root / "plugin").load()


def test_a_request_reads_the_device_majors_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/proc/devices is read once per prepare request, not once per claim."""
    node = make_node(tmp_path, H100)
    reads = []
    real = CharMajors.read.__func__  # type: ignore[attr-defined]

    def counting(cls: type[CharMajors], path: Path) -> CharMajors:
        reads.append(path)
        return real(cls, path)  # type: ignore[no-any-return]

    monkeypatch.setattr(CharMajors, "read", classmethod(counting))
    refs = [node.claims.add(f"u{i}", f"gpu-0-mig-1g10gb-{i}") for i in range(4)]
    assert all(r.ok for r in node.state.prepare(refs).values())
    assert reads == [PROC_DEVICES]
