"""What the journal owns is never published as a static device, and start-up takes
the MIG listing and the journal snapshot of one moment (docs/mig.md, "What is
published"; "Crash safety")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from driver.devices.model import MigStrategy, PoolOptions, build_pool
from driver.errors import DriverError
from driver.nvml.discovered import Inventory, MigInstance
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.journal.locking import SerializeLock
from tests.unit.test_mig_foreign import _intent, _target
from tests.unit.test_mig_prepare import H100, Node, make_node


def _published_uuids(node: Node) -> set[str]:
    return {
        d.document["attributes"]["uuid"]["string"]
        for d in node.pool.devices
        if "uuid" in d.document["attributes"]
    }


def test_a_gpu_turned_static_never_publishes_the_drivers_own_mig_device(tmp_path: Path) -> None:
    """An administrator adds a MIG device while the driver owns another: at the
    restart the GPU turns static under `auto`, and publishes the administrator's only.
    The driver's own is destroyed by its claim's unprepare; published, the next claim
    would get its dead UUID."""
    node = make_node(tmp_path, H100, MigStrategy.DYNAMIC)
    ref = node.claims.add("mine", "gpu-0-mig-1g10gb-3")
    assert node.state.prepare([ref])["mine"].ok
    (mine,) = node.live()
    admin = node.backend.mig().create(_target(node, "gpu-0-mig-2g20gb-4"))  # behind our back

    restarted = make_node(tmp_path, H100, MigStrategy.AUTO)

    gpu = restarted.mock.gpus[0].uuid
    assert restarted.pool.mig_modes[gpu] == "static"
    assert [d.name for d in restarted.pool.devices_of_gpu(gpu)] == ["gpu-0-mig-2g20gb-4"]
    assert _published_uuids(restarted) == {admin.uuid}
    assert mine.uuid not in _published_uuids(restarted)
    assert any(
        f"GPU instance {mine.gi_id}: created by this driver" in note
        for note in restarted.pool.notes
    )
    assert restarted.state.unprepare([ref]) == {"mine": None}
    assert restarted.live() == [admin]  # the administrator's device is untouched


def _prepare_y(node: Node) -> MigInstance:
    ref = node.claims.add("y", "gpu-0-mig-1g10gb-3")
    res = node.state.prepare([ref])["y"]
    assert res.ok, res.error
    (live,) = node.live()
    return live


def _back_to_intent(node: Node, before: list[int]) -> None:
    """Claim y's entry turned back into the `PrepareStarted` intent it was before the
    create (a prepare caught between the create and the completion)."""
    cp = Checkpoint(node.root / "plugin")
    entry = cp.load()["y"]
    intent = _intent(entry.devices[0], before=before)
    cp.store({"y": replace(entry, state=ClaimState.PREPARE_STARTED, devices=(intent,))})


def test_owned_mig_counts_the_instance_an_intents_attempt_created(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100, MigStrategy.DYNAMIC)
    live = _prepare_y(node)
    _back_to_intent(node, before=[])
    inventory, owned = node.state.discover_with_owned(node.backend.discover)
    assert owned == {(live.gpu_uuid, live.gi_id)} == node.state.owned_mig(inventory)
    assert node.state.owned_mig() == frozenset()  # without a listing: no ids to name
    # Not foreign: a dynamic start does not fail, and `auto` keeps the GPU dynamic.
    for strategy in (MigStrategy.DYNAMIC, MigStrategy.AUTO):
        pool = build_pool(inventory, PoolOptions(mig_strategy=strategy), owned_mig=owned)
        assert pool.mig_modes[live.gpu_uuid] == "dynamic"


def test_an_instance_that_was_there_before_the_intent_is_not_owned(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100, MigStrategy.DYNAMIC)
    live = _prepare_y(node)
    _back_to_intent(node, before=[live.gi_id])
    assert node.state.discover_with_owned(node.backend.discover)[1] == frozenset()


def test_discovery_and_the_journal_snapshot_are_taken_under_the_node_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node(tmp_path, H100, MigStrategy.DYNAMIC)
    probe = SerializeLock(tmp_path / "plugin", timeout=0)
    seen: list[str] = []

    def held() -> bool:
        try:
            with probe.hold():
                return False
        except DriverError:
            return True

    def discover() -> Inventory:
        assert held()
        seen.append("discover")
        return node.backend.discover()

    load = node.state.checkpoint.load

    def spy_load() -> object:
        assert held()
        seen.append("journal")
        return load()

    monkeypatch.setattr(node.state.checkpoint, "load", spy_load)
    assert not held()
    node.state.discover_with_owned(discover)
    assert seen == ["discover", "journal"]
    assert not held()
