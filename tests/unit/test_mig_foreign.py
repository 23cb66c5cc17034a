"""A rollback destroys only what the attempt created (docs/mig.md, "Crash safety"):
never a MIG device that sat at the placement before the intent (an administrator's,
created behind the driver's back), nor one another journal entry records.

The foreign devices here have the same profile at the same placement as the claim's
intent, the case a rollback that finds "its" device by placement alone gets wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from driver.nvml.discovered import MigInstance
from driver.nvml.mig.mig_manager import MigManager, MigTarget, RecordedInstance
from driver.state.journal.checkpoint import Checkpoint, ClaimEntry, ClaimState, PreparedDevice
from driver.state.request import ClaimRef
from tests.unit.test_crash_safety import (
    _NS,
    UID_A,
    _copy,
    _crash,
    _live_mig,
    _ref,
    _root,
    _state,
)
from tests.unit.test_mig_prepare import H100, Node, make_node


def _target(node: Node, device: str) -> MigTarget:
    backing = node.state.devices[device].mig  # type: ignore[attr-defined]
    assert backing is not None and backing.existing is None
    gpu = node.state.devices[device].gpu_uuid
    return MigTarget(gpu, backing.profile_id, backing.placement, backing.slice_count)


@pytest.fixture
def destroyed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every GPU instance the MIG manager is asked to destroy, (GPU UUID, GI id)."""
    calls: list[tuple[str, int]] = []
    real = MigManager.destroy

    def spy(
        self: MigManager, gpu_uuid: str, gi_id: int, recorded: RecordedInstance | None = None
    ) -> bool:
        calls.append((gpu_uuid, gi_id))
        return real(self, gpu_uuid, gi_id, recorded)

    monkeypatch.setattr(MigManager, "destroy", spy)
    return calls


def test_failed_create_leaves_the_same_profile_instance_at_its_placement(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    admin = node.backend.mig().create(_target(node, "gpu-0-mig-2g20gb-2"))  # behind our back
    ref = node.claims.add("busy", "gpu-0-mig-2g20gb-2")
    error = node.state.prepare([ref])["busy"].error
    assert error is not None and "occupied" in str(error)
    assert node.live() == [admin]  # the administrator's device is untouched
    assert Checkpoint(tmp_path / "plugin").load() == {}
    # Its retry is refused the same way, and leaves it alone too.
    assert node.state.prepare([ref])["busy"].error is not None
    assert node.live() == [admin]


def test_failed_create_in_a_claim_destroys_only_what_the_claim_created(tmp_path: Path) -> None:
    node = make_node(tmp_path, H100)
    admin = node.backend.mig().create(_target(node, "gpu-0-mig-1g10gb-3"))
    ref = node.claims.add("two", "gpu-0-mig-1g10gb-0", "gpu-0-mig-1g10gb-3")
    assert node.state.prepare([ref])["two"].error is not None
    assert node.live() == [admin]  # the first device, created for the claim, is gone


@pytest.mark.parametrize("failpoint", ["prepare-after-started", "prepare-before-mig-create"])
def test_crash_before_the_create_spares_a_foreign_instance_at_the_placement(
    failpoint: str, tmp_path: Path
) -> None:
    """claim-a wants gpu-0 (its full-size MIG device) and gpu-1-mig-2g20gb-0; an
    administrator's 2g device sits at gpu-1's placement 0. The kill hits after the
    intent is journaled and before anything is created."""
    root = _root(tmp_path, "node")
    backing = _NS["DEVICES"]["gpu-1-mig-2g20gb-0"]
    mig = backing.mig
    foreign = (
        _NS["nvml"](root)
        .mig()
        .create(MigTarget(backing.gpu_uuid, mig.profile_id, mig.placement, mig.slice_count))
    )
    before = _live_mig(root)
    assert len(before) == 1
    _crash(root, "prepare", failpoint)
    (entry,) = Checkpoint(root / "plugin").load().values()
    assert entry.state is ClaimState.PREPARE_STARTED

    recovered = _copy(root, tmp_path / "recover")
    report = _state(recovered).recover()
    assert report.rolled_back == (UID_A,) and report.problems == ()
    assert Checkpoint(recovered / "plugin").load() == {}
    assert _live_mig(recovered) == before  # the foreign device survived the restart

    # The kubelet's retry without a restart in between (the found entry rolled back
    # lazily): refused, the placement is occupied; the foreign device stays.
    error = _state(root).prepare([_ref("default/claim-a")])[UID_A].error
    assert error is not None and "occupied" in str(error)
    assert _live_mig(root) == before
    assert Checkpoint(root / "plugin").load() == {}
    assert foreign.placement == mig.placement


def _intent(device: PreparedDevice, **mig: Any) -> PreparedDevice:
    """`device` as a `PrepareStarted` intent (no ids yet), its `mig` record's JSON
    changed by `mig` (e.g. before=[] as this release writes it)."""
    doc = device.to_json()
    doc["mig"].update(giId=None, ciId=None, uuid=None, **mig)
    return PreparedDevice.from_json(doc)


def _journal_with_intent(node: Node, **mig: Any) -> tuple[ClaimEntry, MigInstance]:
    """Claim x prepared (its MIG device at gpu-0's placement 3); beside it a crafted
    `PrepareStarted` entry of claim y whose intent names the same placement (a stale
    allocation that bypassed the double-booking guard, a journal edited by hand)."""
    ref = node.claims.add("x", "gpu-0-mig-1g10gb-3")
    res = node.state.prepare([ref])["x"]
    assert res.ok, res.error
    (live,) = node.live()
    cp = Checkpoint(node.root / "plugin")
    journal = cp.load()
    y = ClaimEntry(
        ClaimState.PREPARE_STARTED, "default", "claim-y", (_intent(res.devices[0], **mig),)
    )
    cp.store({**journal, "y": y})
    return journal["x"], live


def test_restart_never_destroys_an_instance_another_entry_records(
    tmp_path: Path, destroyed: list[tuple[str, int]]
) -> None:
    node = make_node(tmp_path, H100)
    x, live = _journal_with_intent(node, before=[])  # written as this release writes it
    restarted = make_node(tmp_path, H100)  # recover() rolls y back
    assert destroyed == []  # x's device, at y's placement, is never destroyed
    assert restarted.live() == [live]
    assert Checkpoint(tmp_path / "plugin").load() == {"x": x}
    assert restarted.state.unprepare([ClaimRef("default", "claim-x", "x")]) == {"x": None}
    assert restarted.live() == []


def test_an_intent_without_a_record_of_what_was_there_destroys_nothing(
    tmp_path: Path, destroyed: list[tuple[str, int]]
) -> None:
    """A `PrepareStarted` entry of an earlier release (no `before`): an instance at its
    placement cannot be proved to be the attempt's; it is left (foreign from then on)."""
    node = make_node(tmp_path, H100)
    _, live = _journal_with_intent(node)
    # x's entry goes behind the driver's back: its device is now an administrator's.
    cp = Checkpoint(tmp_path / "plugin")
    cp.store({k: e for k, e in cp.load().items() if k != "x"})
    make_node(tmp_path, H100)
    assert destroyed == []
    assert node.live() == [live]
    assert cp.load() == {}


def test_a_device_created_in_the_create_window_survives_the_failed_create(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The intent's `before` is read under the node lock; the create runs later,
    outside it, after the GPU's earlier MIG operations. An administrator who creates a
    device at the placement in between makes the create fail; the in-process undo
    destroys only what this attempt recorded by id, so that device stays."""
    node = make_node(tmp_path, H100)
    real = MigManager.create
    admin: list[MigInstance] = []

    def administrator_first(self: MigManager, target: MigTarget) -> MigInstance:
        if not admin:  # nvidia-smi mig -cgi ... in the window, after the snapshot
            admin.append(real(self, target))
        return real(self, target)

    monkeypatch.setattr(MigManager, "create", administrator_first)
    ref = node.claims.add("late", "gpu-0-mig-2g20gb-2")
    error = node.state.prepare([ref])["late"].error
    assert error is not None and "occupied" in str(error)
    assert node.live() == admin  # the administrator's device is untouched
    assert Checkpoint(tmp_path / "plugin").load() == {}


def test_a_half_made_instance_the_create_cannot_destroy_is_undone_by_its_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compute instance cannot be created and the GPU instance's destroy fails
    once too: the create names the instance it left, and the claim's undo destroys it
    by that id, not by a search of the placement."""
    node = make_node(tmp_path, H100)
    mock = node.mock
    mock.nvmlGpuInstanceCreateComputeInstance = _refuse(mock, "NVML_ERROR_UNKNOWN")  # type: ignore[method-assign]
    real_destroy = mock.nvmlGpuInstanceDestroy
    refusals = [_refuse(mock, "NVML_ERROR_IN_USE")]

    def destroy_fails_once(gi: Any) -> int:
        return (refusals.pop() if refusals else real_destroy)(gi)  # type: ignore[no-any-return]

    mock.nvmlGpuInstanceDestroy = destroy_fails_once  # type: ignore[method-assign]
    ref = node.claims.add("half", "gpu-0-mig-1g10gb-3")
    assert node.state.prepare([ref])["half"].error is not None
    assert refusals == []
    assert node.live() == []
    assert Checkpoint(tmp_path / "plugin").load() == {}


def _refuse(mock: Any, code: str) -> Any:
    def refuse(*_: Any) -> Any:
        raise mock.NVMLError(getattr(mock, code))

    return refuse
