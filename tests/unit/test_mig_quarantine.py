"""What a quarantine of a corrupt journal does to the MIG devices its claims own
(`gpu-dra journal quarantine --owned-mig`, docs/state.md "MIG devices after a
quarantine"): the CLI refuses to choose silently; `adopt` keeps them owned (the
claim's unprepare destroys them), `destroy` has the next start destroy them, and
`foreign` leaves them to the administrator."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.recovery.quarantine import OwnedMig, pending_quarantine, quarantine_checkpoint
from tests.unit.test_journal_cli import gpu_dra
from tests.unit.test_mig_prepare import H100, Node, make_node

DEVICE = "gpu-0-mig-1g10gb-0"


def _corrupt_with_a_mig_claim(tmp_path: Path) -> Node:
    """Claim u holds a MIG device the driver created; the journal's checksum no longer
    matches (its entries still parse)."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", DEVICE)])["u"].ok
    path = node.root / "plugin" / "checkpoint.json"
    doc = json.loads(path.read_bytes())
    doc["checksum"] = "sha256:" + "0" * 64
    path.write_text(json.dumps(doc))
    return node


def _quarantine(node: Node, *extra: str) -> tuple[int, str, str]:
    state_dir = str(node.root / "plugin")
    return gpu_dra(["journal", "quarantine", "--state-dir", state_dir, "--yes", *extra])


def _restart(node: Node) -> Node:
    """The plugin's next start on the node: a fresh state, recovered."""
    again = make_node(node.root, H100)
    again.state.recover()
    return again


def test_quarantine_refuses_to_leave_owned_mig_devices_without_a_choice(tmp_path: Path) -> None:
    node = _corrupt_with_a_mig_claim(tmp_path)
    code, _, err = _quarantine(node)
    assert code == 1
    assert "own the MIG devices of 1 claim(s): choose --owned-mig adopt|destroy|foreign" in err
    assert (node.root / "plugin" / "checkpoint.json").exists()  # nothing moved


def test_adopted_mig_device_is_destroyed_by_its_claims_unprepare(tmp_path: Path) -> None:
    node = _corrupt_with_a_mig_claim(tmp_path)
    (device,) = node.live()
    code, out, err = _quarantine(node, "--owned-mig", "adopt")
    assert code == 0, err
    assert "claim default/claim-u (u) owns MIG devices" in out
    node = _restart(node)
    assert node.live() == [device]  # the running pod keeps it
    assert set(Checkpoint(node.root / "plugin").load()) == {"u"}
    assert node.state.unprepare([node.claims.add("u")]) == {"u": None}
    assert node.live() == []


def test_destroyed_mig_device_is_gone_after_the_next_start(tmp_path: Path) -> None:
    node = _corrupt_with_a_mig_claim(tmp_path)
    code, _, err = _quarantine(node, "--owned-mig", "destroy")
    assert code == 0, err
    node = _restart(node)
    assert node.live() == []
    assert Checkpoint(node.root / "plugin").load() == {}
    assert not node.state.cdi.claim_spec_exists("u")


def test_foreign_mig_device_is_left_to_the_administrator(tmp_path: Path) -> None:
    node = _corrupt_with_a_mig_claim(tmp_path)
    (device,) = node.live()
    code, _, err = _quarantine(node, "--owned-mig", "foreign")
    assert code == 0, err
    node = _restart(node)
    assert node.live() == [device]
    assert Checkpoint(node.root / "plugin").load() == {}
    assert node.state.owned_mig() == frozenset()


def test_the_preview_shows_each_carried_entrys_state_and_fate(tmp_path: Path) -> None:
    """The corrupt line was claim u's completion record: salvage yields its intent.
    Adopting carries it to be adopted at the next start, which rolls it back unless
    its device is live and named by its spec: the preview says both before the
    operator confirms, not 'adopt keeps it'."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", DEVICE)])["u"].ok
    cp = Checkpoint(node.root / "plugin")
    entry = cp.load()["u"]
    (device,) = entry.devices
    assert device.mig is not None
    intent = replace(device, mig=replace(device.mig, gi_id=None, ci_id=None, uuid=None, before=()))
    cp.store({"u": replace(entry, state=ClaimState.PREPARE_STARTED, devices=(intent,))})
    path = cp.path
    doc = json.loads(path.read_bytes())
    doc["checksum"] = "sha256:" + "0" * 64
    path.write_text(json.dumps(doc))
    code, out, err = _quarantine(node, "--owned-mig", "adopt", "--cdi-root", str(tmp_path / "cdi"))
    assert code == 0, err
    line = next(x for x in out.splitlines() if "claim default/claim-u (u)" in x)
    assert "PrepareStarted" in line and "at the next start adopted if" in line
    assert "otherwise rolled back: its CDI spec removed, its MIG devices destroyed" in line


def _corrupt_with_claims_in_the_log(tmp_path: Path) -> tuple[Node, dict[str, Any]]:
    """Claim u's intent is in the snapshot (the first store after the start writes it),
    its completion and claim v's whole prepare are in the log; the snapshot's checksum
    no longer matches. Returns the node and the journal as it was."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", DEVICE)])["u"].ok
    assert node.state.prepare([node.claims.add("v", "gpu-0-mig-1g10gb-1")])["v"].ok
    journal = Checkpoint(node.root / "plugin").load()
    path = node.root / "plugin" / "checkpoint.json"
    doc = json.loads(path.read_bytes())
    assert doc["entries"]["u"]["state"] == ClaimState.PREPARE_STARTED.value
    doc["checksum"] = "sha256:" + "0" * 64
    path.write_text(json.dumps(doc))
    return node, journal


class Killed(BaseException):
    """The quarantine's process killed at this point."""


def test_a_quarantine_killed_between_its_renames_is_finished_by_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, journal = _corrupt_with_claims_in_the_log(tmp_path)
    real_rename = os.rename
    renames: list[str] = []

    def rename_then_die(src: Any, dst: Any) -> None:
        if Path(src).name == "checkpoint.json":
            raise Killed  # the log is moved aside already
        renames.append(Path(src).name)
        real_rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename_then_die)
        with pytest.raises(Killed):
            quarantine_checkpoint(node.root / "plugin", owned_mig=OwnedMig.ADOPT)
    assert renames == ["checkpoint.log"]
    code, out, err = _quarantine(node)  # the operator runs it again, as it advises
    assert code == 0, err
    assert "interrupted" in out
    assert Checkpoint(node.root / "plugin").load() == journal  # both claims, completed
    _restart(node)
    assert len(node.live()) == 2  # nothing destroyed


def test_a_quarantine_killed_before_it_stored_the_adopted_entries_is_finished_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node, journal = _corrupt_with_claims_in_the_log(tmp_path)
    with monkeypatch.context() as patch:

        def die(*_: Any, **__: Any) -> None:
            raise Killed

        patch.setattr(Checkpoint, "store", die)
        with pytest.raises(Killed):
            quarantine_checkpoint(node.root / "plugin", owned_mig=OwnedMig.ADOPT)
    assert not (node.root / "plugin" / "checkpoint.json").exists()
    restarted = _restart(node)  # the plugin's start honours the recorded choice
    assert Checkpoint(node.root / "plugin").load() == journal
    assert len(restarted.live()) == 2
    assert pending_quarantine(node.root / "plugin") is None  # finished, once


def test_a_log_moved_aside_without_its_snapshot_is_salvaged_and_reported(
    tmp_path: Path,
) -> None:
    """An earlier release's quarantine killed between its two renames (no record of
    it): the snapshot is still in place, its log already a copy. The salvage reads that
    copy with the snapshot, and the plugin's start names it."""
    node, journal = _corrupt_with_claims_in_the_log(tmp_path)
    data = node.root / "plugin"
    os.rename(data / "checkpoint.log", data / "checkpoint.log.corrupt-20261127T000000.000000Z")
    report = make_node(node.root, H100).state.recover()
    assert report.checkpoint_problem is not None
    assert "checkpoint.log.corrupt-20261127T000000.000000Z" in report.checkpoint_problem
    code, _, err = _quarantine(node, "--owned-mig", "adopt")
    assert code == 0, err
    assert Checkpoint(data).load() == journal
