"""Strict partitions on the mock (docs/mps.md, "Strict partitions: one server per
GPU"): with --mps-strict-partitions the `--gpu-partitions` partitions of a Volta or
later GPU publish `mpsIsolation: "strict"`, and their claims share one MPS daemon per
GPU, with the partition's limits, in EXCLUSIVE_PROCESS; it stops, and the mode found
goes back, with the GPU's last claim, at unprepare, rollback or recovery."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from driver.devices.model import PoolOptions, build_pool
from driver.nvml.mock.mock_api import (
    NVML_COMPUTEMODE_DEFAULT,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    NVML_COMPUTEMODE_PROHIBITED,
)
from driver.nvml.mock.mock_control import MockActions, MockControlError
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.journal.mps_record import MpsRecord
from driver.state.mps.compute_modes import published_strict
from driver.state.mps.shared import shared_directory
from driver.state.request import ClaimRef
from tests.unit.test_mps_prepare import mps_node
from tests.unit.test_mps_strict import FLEET, StrictNode
from tests.unit.test_mps_watch import kill

PARTITIONS = PoolOptions(mps=True, gpu_partitions=2, mps_strict_partitions=True)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StrictNode]:
    for plain in mps_node(tmp_path, FLEET):
        yield StrictNode(plain.root, plain.backend, plain.claims, options=PARTITIONS)


def _records(node: StrictNode) -> dict[str, MpsRecord]:
    journal = Checkpoint(node.root / "plugin").load()
    out = {}
    for uid, entry in journal.items():
        (device,) = entry.devices
        assert device.mps is not None
        out[uid] = device.mps
    return out


def _partition(node: StrictNode, uid: str, j: int, gpu: int = 0) -> ClaimRef:
    return node.claims.add(uid, f"gpu-{gpu}-partition-{j}")


@pytest.mark.parametrize(
    ("options", "strict"),
    [
        (PARTITIONS, True),
        (PoolOptions(mps=True, gpu_partitions=2), False),
        (
            PoolOptions(
                mps=True,
                gpu_partitions=2,
                mps_strict_partitions=True,
                allow_multiple_allocations=True,
            ),
            False,
        ),
    ],
    ids=["strict-partitions", "default", "capacity-shares"],
)
def test_partitions_publish_strict_only_with_the_option(
    node: StrictNode, options: PoolOptions, strict: bool
) -> None:
    pool = build_pool(node.backend.discover(), options)
    partitions = [d for d in pool.devices if d.is_partition]
    assert partitions
    assert {published_strict(d) for d in partitions} == {strict}


def test_a_gpus_partition_claims_share_one_server_in_exclusive_process(
    node: StrictNode,
) -> None:
    state = node.state()
    refs = [_partition(node, "a", 0), _partition(node, "b", 1)]
    results = state.prepare(refs)
    assert all(r.ok for r in results.values()), results
    assert len(node.daemons()) == 1
    records = _records(node)
    assert {r.directory for r in records.values()} == {shared_directory(node.uuid())}
    assert len({(r.pid, r.start_time) for r in records.values()}) == 1
    assert all(
        r.shared and r.compute_mode_before == NVML_COMPUTEMODE_DEFAULT for r in records.values()
    )
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    log = node.root / "plugin" / "mps" / shared_directory(node.uuid()) / "log" / "control.log"
    assert "daemon started in multi-user mode" in log.read_text()  # -d -M
    actions = MockActions(node.mock, list(state.devices.values()))
    assert actions.handle_process({"device": "gpu-0-partition-0", "kind": "mps-client"})["pid"]
    assert actions.handle_process({"device": "gpu-0-partition-1", "kind": "mps-client"})["pid"]
    with pytest.raises(MockControlError, match="all CUDA-capable devices are busy"):
        actions.handle_process({"device": "gpu-0-partition-1", "kind": "compute"})

    assert state.unprepare([refs[0]]) == {"a": None}
    assert len(node.daemons()) == 1  # b's clients keep their server
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert state.unprepare([refs[1]]) == {"b": None}
    assert not node.daemons()
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT
    assert not (node.root / "plugin" / "mps" / shared_directory(node.uuid())).exists()


def test_a_later_claim_joins_the_server_and_keeps_the_mode_found_first(
    node: StrictNode,
) -> None:
    node.mock.privileged = True
    node.backend.compute_modes().set(node.uuid(), NVML_COMPUTEMODE_PROHIBITED)
    state = node.state()
    a, b = _partition(node, "a", 0), _partition(node, "b", 1)
    assert state.prepare([a])["a"].ok
    sets = node.sets()
    assert state.prepare([b])["b"].ok
    assert node.sets() == sets  # joined: no second set, no second daemon
    assert len(node.daemons()) == 1
    records = _records(node)
    assert records["b"].compute_mode_before == NVML_COMPUTEMODE_PROHIBITED  # not what it read
    assert records["a"].pid == records["b"].pid
    # The first claim goes first: the last one still puts back what the first found.
    assert state.unprepare([a]) == {"a": None}
    assert state.unprepare([b]) == {"b": None}
    assert node.mode() == NVML_COMPUTEMODE_PROHIBITED
    assert not node.daemons()


def test_unprepare_of_every_claim_at_once_stops_the_server(node: StrictNode) -> None:
    state = node.state()
    refs = [_partition(node, "a", 0), _partition(node, "b", 1)]
    assert all(r.ok for r in state.prepare(refs).values())
    assert state.unprepare(refs) == {"a": None, "b": None}
    assert not node.daemons()
    assert node.mode() == NVML_COMPUTEMODE_DEFAULT


def test_the_server_has_the_partitions_limits_and_a_claim_lowers_its_own(
    node: StrictNode,
) -> None:
    state = node.state()
    ref = node.claims.add("a", "gpu-0-partition-0", {"defaultActiveThreadPercentage": 20})
    assert state.prepare([ref])["a"].ok
    record = _records(node)["a"]
    assert record.active_thread_percentage == 50  # the partition's half of the SMs
    memory = (node.backend.discover().gpus[0].memory_bytes or 0) // 2
    assert record.pinned_memory_bytes == memory - memory % (1 << 20)
    spec = json.loads(state.cdi.claim_spec_path("a").read_text())
    edits = spec["devices"][0]["containerEdits"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20" in edits["env"]  # clients only lower it
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" not in edits["env"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    shared = node.root / "plugin" / "mps" / shared_directory(node.uuid())
    assert edits["mounts"][0]["hostPath"] == str(shared / "pipe")
    assert state.unprepare([ref]) == {"a": None}


def test_a_lost_server_is_started_again_once_for_all_its_claims(node: StrictNode) -> None:
    state = node.state()
    refs = [_partition(node, "a", 0), _partition(node, "b", 1)]
    assert all(r.ok for r in state.prepare(refs).values())
    (pid,) = node.daemons()
    kill(_records(node)["a"])  # and wait until it is gone: a signal is not yet an exit
    node.state()  # a plugin restart adopts: the daemon is gone
    (new,) = node.daemons()
    assert new != pid
    records = _records(node)
    assert {r.pid for r in records.values()} == {new}
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def test_recovery_rolls_back_an_intent_without_stopping_the_server_of_another(
    node: StrictNode,
) -> None:
    state = node.state()
    a, b = _partition(node, "a", 0), _partition(node, "b", 1)
    assert state.prepare([a])["a"].ok
    assert state.prepare([b])["b"].ok
    checkpoint = Checkpoint(node.root / "plugin")
    journal = checkpoint.load()
    journal["b"] = replace(journal["b"], state=ClaimState.PREPARE_STARTED)  # a crash's
    checkpoint.store(journal)
    node.state()  # the start rolls b back
    assert set(checkpoint.load()) == {"a"}
    assert len(node.daemons()) == 1
    assert node.mode() == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def test_the_shared_key_round_trips() -> None:
    record = MpsRecord("GPU-1", "abc", 50, 1 << 30, pid=3, compute_mode_before=0, shared=True)
    assert record.to_json()["shared"] is True
    assert MpsRecord.from_json(record.to_json()) == record
    assert "shared" not in MpsRecord("GPU-1", "abc").to_json()
    with pytest.raises(ValueError, match=r"mps\.shared must be a boolean"):
        MpsRecord.from_json({"gpu": "GPU-1", "dir": "abc", "shared": "yes"})
