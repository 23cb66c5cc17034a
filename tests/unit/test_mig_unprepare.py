"""An unprepare that stopped half-way (a crash, or a MIG device NVML would not
destroy) is finished, never undone: the entry is marked `unpreparing` before anything
is removed, a restart tears the claim down instead of creating its MIG devices again,
and a prepare of the claim redoes it instead of answering with destroyed devices
(docs/state.md, "Recovery rules")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from driver.nvml.mig.mig_manager import MigError, MigManager, RecordedInstance
from driver.state import teardown
from driver.state.journal.checkpoint import Checkpoint, ClaimEntry, ClaimState
from driver.state.recovery import startup_recovery
from driver.state.request import ClaimRef
from tests.unit.test_journal_log import _disk_with_free_bytes
from tests.unit.test_mig_prepare import H100, Node, make_node, uuids_in

TWO = ("gpu-0-mig-1g10gb-0", "gpu-0-mig-1g10gb-1")


@pytest.fixture
def nvml_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[object]]:
    """The MIG manager's creates and destroys; `fail_destroy` makes the next destroy
    of that GPU-instance id fail once."""
    calls: dict[str, list[object]] = {"create": [], "destroy": [], "fail_destroy": []}
    create, destroy = MigManager.create, MigManager.destroy

    def spy_create(self: MigManager, target: object) -> object:
        calls["create"].append(target)
        return create(self, target)  # type: ignore[arg-type]

    def spy_destroy(
        self: MigManager, gpu_uuid: str, gi_id: int, recorded: RecordedInstance | None = None
    ) -> bool:
        if gi_id in calls["fail_destroy"]:
            calls["fail_destroy"].remove(gi_id)
            raise MigError("NVML refused", code="NVML_ERROR_UNKNOWN", retryable=True)
        calls["destroy"].append(gi_id)
        return destroy(self, gpu_uuid, gi_id, recorded)

    monkeypatch.setattr(MigManager, "create", spy_create)
    monkeypatch.setattr(MigManager, "destroy", spy_destroy)
    return calls


def _half_unprepared(node: Node, calls: dict[str, list[object]]) -> ClaimRef:
    """Claim u holds two MIG devices; its unprepare destroyed the first and NVML
    refused the second."""
    ref = node.claims.add("u", *TWO)
    assert node.state.prepare([ref])["u"].ok
    _, second = sorted(node.live(), key=lambda m: m.placement)
    calls["fail_destroy"].append(second.gi_id)
    error = node.state.unprepare([ref])["u"]
    assert error is not None and not error.permanent
    assert node.live() == [second]
    entry = Checkpoint(node.root / "plugin").load()["u"]
    assert entry.state is ClaimState.PREPARE_COMPLETED
    assert entry.unpreparing == teardown.boot_id() != ""
    calls["create"].clear()
    calls["destroy"].clear()
    return ref


def test_prepare_after_a_half_done_unprepare_redoes_the_claim(
    tmp_path: Path, nvml_calls: dict[str, list[object]]
) -> None:
    node = make_node(tmp_path, H100)
    ref = _half_unprepared(node, nvml_calls)
    res = node.state.prepare([ref])["u"]
    assert res.ok, res.error
    live = {m.uuid for m in node.live()}
    assert len(live) == 2
    answered = {d.mig.uuid for d in res.devices if d.mig is not None}
    assert answered == live  # no destroyed MIG device is handed out
    named = {u for d in node.spec("u")["devices"] for u in uuids_in(d["containerEdits"]["env"])}
    assert named == live
    entry = Checkpoint(tmp_path / "plugin").load()["u"]
    assert entry.state is ClaimState.PREPARE_COMPLETED and entry.unpreparing is None
    assert node.state.unprepare([ref]) == {"u": None} and node.live() == []


def test_restart_finishes_a_half_done_unprepare(
    tmp_path: Path, nvml_calls: dict[str, list[object]]
) -> None:
    node = make_node(tmp_path, H100)
    ref = _half_unprepared(node, nvml_calls)
    restarted = make_node(tmp_path, H100)  # recover() runs first
    assert nvml_calls["create"] == []  # nothing is created for a claim being torn down
    assert restarted.live() == []
    assert Checkpoint(tmp_path / "plugin").load() == {}
    assert restarted.state.cdi.read_claim_spec("u") is None
    assert restarted.state.unprepare([ref]) == {"u": None}  # the kubelet's repeat


def test_unprepare_marks_only_claims_with_mig_devices_it_created(tmp_path: Path) -> None:
    """One more journal store, and only where a restart would otherwise recreate a MIG
    device: other claims keep their single store (test_prepare.py, 64 shares)."""
    node = make_node(tmp_path, H100)
    cp = Checkpoint(tmp_path / "plugin")
    ref = node.claims.add("m", "gpu-0-mig-1g10gb-0")
    assert node.state.prepare([ref])["m"].ok
    stores: list[dict[str, ClaimEntry]] = []
    real = Checkpoint.store

    def spy(self: Checkpoint, entries: dict[str, ClaimEntry], **kwargs: object) -> None:
        stores.append(dict(entries))
        real(self, entries, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Checkpoint, "store", spy)
        assert node.state.unprepare([ref]) == {"m": None}
    assert [sorted(s) for s in stores] == [["m"], []]
    assert stores[0]["m"].unpreparing == teardown.boot_id()
    assert cp.load() == {}


def test_after_a_reboot_a_marked_claim_is_restored_as_before(
    tmp_path: Path, nvml_calls: dict[str, list[object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reboot destroys every MIG device and empties the CDI root, so a mark of an
    earlier boot cannot tell what the unprepare did: the claim is restored (the
    kubelet restarts pods without preparing), its mark dropped; the kubelet's repeated
    unprepare tears it down."""
    node = make_node(tmp_path, H100)
    ref = _half_unprepared(node, nvml_calls)
    for path in (tmp_path / "cdi").iterdir():
        path.unlink()
    node.mock.mock_reboot()
    for module in (teardown, startup_recovery):
        monkeypatch.setattr(module, "boot_id", lambda: "the-next-boot")
    restarted = make_node(tmp_path, H100)
    assert len(restarted.live()) == 2
    entry = Checkpoint(tmp_path / "plugin").load()["u"]
    assert entry.unpreparing is None
    specs = restarted.spec("u")["devices"]
    named = {u for d in specs for u in uuids_in(d["containerEdits"]["env"])}
    assert named == {m.uuid for m in restarted.live()}
    assert restarted.state.unprepare([ref]) == {"u": None} and restarted.live() == []


def test_a_mark_on_a_claim_prepared_again_never_tears_it_down(tmp_path: Path) -> None:
    """An earlier release keeps the mark (an unknown key) without knowing it: after a
    downgrade it may answer a prepare of the marked claim as prepared. Its spec is then
    in place, so nothing is torn down; this release's prepare drops the mark."""
    node = make_node(tmp_path, H100)
    ref = node.claims.add("m", "gpu-0-mig-1g10gb-0")
    assert node.state.prepare([ref])["m"].ok
    cp = Checkpoint(tmp_path / "plugin")
    journal = cp.load()
    cp.store({"m": replace(journal["m"], unpreparing=teardown.boot_id())})
    live = node.live()
    restarted = make_node(tmp_path, H100)  # same boot, spec in place: the claim stays
    assert restarted.live() == live and cp.load() == journal  # the inert mark dropped
    cp.store({"m": replace(journal["m"], unpreparing=teardown.boot_id())})
    ref = restarted.claims.add("m", "gpu-0-mig-1g10gb-0")
    assert restarted.state.prepare([ref])["m"].devices == journal["m"].devices
    assert cp.load() == journal and restarted.live() == live


def test_unpreparing_is_stored_only_when_set() -> None:
    entry = ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", "c")
    assert "unpreparing" not in entry.to_json()  # entries keep their bytes
    marked = ClaimEntry.from_json({**entry.to_json(), "unpreparing": "boot-1"})
    assert marked.unpreparing == "boot-1" and marked.to_json()["unpreparing"] == "boot-1"
    with pytest.raises(ValueError, match="unpreparing"):
        ClaimEntry.from_json({**entry.to_json(), "unpreparing": True})


# -- unprepares owed while the journal was unreadable ---------------------------------


def _unprepared_while_corrupt(node: Node) -> tuple[ClaimRef, bytes]:
    """Claim u holds a MIG device; its unprepare ran while the journal was corrupt
    (spec removed, the MIG device left: the journal that owns it is unreadable).
    Returns the claim and the good journal's bytes, to restore as an operator would."""
    ref = node.claims.add("u", TWO[0])
    assert node.state.prepare([ref])["u"].ok
    path = node.root / "plugin" / "checkpoint.json"
    good = path.read_bytes()
    path.write_bytes(good[:-20])
    assert node.state.unprepare([ref]) == {"u": None}
    assert not node.state.cdi.claim_spec_exists("u")
    assert len(node.live()) == 1
    return ref, good


def test_restored_journal_destroys_the_mig_devices_of_owed_unprepares(
    tmp_path: Path, nvml_calls: dict[str, list[object]]
) -> None:
    node = make_node(tmp_path, H100)
    _, good = _unprepared_while_corrupt(node)
    (node.root / "plugin" / "checkpoint.json").write_bytes(good)  # the documented repair
    other = node.claims.add("v", TWO[1])
    assert node.state.prepare([other])["v"].ok
    journal = Checkpoint(node.root / "plugin").load()
    assert set(journal) == {"v"}
    (held,) = node.live()  # u's device is gone, not leaked as foreign
    assert held.uuid in {d.mig.uuid for d in journal["v"].devices if d.mig is not None}


def test_owed_unprepare_keeps_its_entry_while_the_destroy_fails(
    tmp_path: Path, nvml_calls: dict[str, list[object]]
) -> None:
    node = make_node(tmp_path, H100)
    ref, good = _unprepared_while_corrupt(node)
    (device,) = node.live()
    (node.root / "plugin" / "checkpoint.json").write_bytes(good)
    nvml_calls["fail_destroy"].append(device.gi_id)
    assert node.state.unprepare([node.claims.add("w", TWO[1])]) == {"w": None}
    assert set(Checkpoint(node.root / "plugin").load()) == {"u"}  # still owns it
    assert node.live() == [device]
    assert node.state.unprepare([node.claims.add("w", TWO[1])]) == {"w": None}
    assert Checkpoint(node.root / "plugin").load() == {}
    assert node.live() == []
    assert not node.state.cdi.claim_spec_exists(ref.uid)


def test_a_mig_unprepare_needs_no_rollback_reserve_on_a_nearly_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The `unpreparing` mark is no record a failure rolls back: under the 64 KiB
    kept free for rollbacks it is stored all the same, and every retry does not fail.
    A prepare that adds a claim is still refused there, and says why."""
    node = make_node(tmp_path, H100)
    ref = node.claims.add("u", "gpu-0-mig-1g10gb-0")
    assert node.state.prepare([ref])["u"].ok
    _disk_with_free_bytes(monkeypatch, 32 << 10)
    assert node.state.unprepare([ref]) == {"u": None}
    assert node.live() == [] and Checkpoint(tmp_path / "plugin").load() == {}
    error = node.state.prepare([node.claims.add("v", "gpu-0-mig-1g10gb-1")])["v"].error
    assert error is not None and "keeps 64 KiB free" in str(error)
    assert "prepare" in str(error)


def test_a_begun_unprepare_whose_device_is_gone_frees_its_placement_at_once(
    tmp_path: Path,
) -> None:
    """A rolling update from the release before the log: the old instance unprepared
    claim `old` (marked, spec removed, MIG device destroyed) and answered, but could
    not drop the entry from a journal it cannot write. The running instance finishes
    that teardown at its next request instead of holding the placement until a
    restart."""
    node = make_node(tmp_path, H100)
    old = node.claims.add("old", "gpu-0-mig-1g10gb-0")
    assert node.state.prepare([old])["old"].ok
    (device,) = node.live()
    cp = Checkpoint(tmp_path / "plugin")
    cp.store({"old": replace(cp.load()["old"], unpreparing=teardown.boot_id())})
    node.state.cdi.remove_claim_specs(["old"])
    assert node.backend.mig().destroy(device.gpu_uuid, device.gi_id)
    res = node.state.prepare([node.claims.add("new", "gpu-0-mig-1g10gb-0")])["new"]
    assert res.ok, res.error
    assert sorted(cp.load()) == ["new"]
    assert node.state.unprepare([old]) == {"old": None}  # the kubelet's repeat, if any
