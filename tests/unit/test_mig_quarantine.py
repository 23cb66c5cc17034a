"""What a quarantine of a corrupt journal does to the MIG devices its claims own
(`gpu-dra journal quarantine --owned-mig`, docs/state.md "MIG devices after a
quarantine"): the CLI refuses to choose silently; `adopt` keeps them owned (the
claim's unprepare destroys them), `destroy` has the next start destroy them, and
`foreign` leaves them to the administrator."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from driver.state.checkpoint import Checkpoint, ClaimState
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
    Adopting carries that intent as it is, and the next start rolls it back (its
    running pod loses the device): the preview says so before the operator confirms,
    not 'adopt keeps it'."""
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
    assert "PrepareStarted" in line and "rolled back at the next start" in line
    assert "CDI spec is in place" in line  # a pod may be running on it
