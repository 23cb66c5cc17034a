"""`gpu-dra journal quarantine --owned-mig adopt` when the corrupt line was a claim's
completion record: salvage yields the claim's `PrepareStarted` intent. Its pod runs on
the MIG device the prepare created, so the next start completes the entry from the
live device (adopts it) instead of rolling it back, when that is unambiguous: the
claim's CDI spec is in place and names the one instance its attempt can have created
(docs/state.md, "MIG devices after a quarantine")."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest

from driver.cdi.claim_specs import CdiSpecs
from driver.errors import transient
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.mig_instances import ClaimInstances
from tests.unit.test_journal_cli import gpu_dra
from tests.unit.test_mig_prepare import H100, Node, make_node
from tests.unit.test_mig_quarantine import DEVICE, _quarantine, _restart

NEIGHBOUR = "gpu-0-mig-1g10gb-1"


def _completion_record_corrupt(tmp_path: Path) -> Node:
    """Claims u and v prepared; the snapshot holds u's intent, the log u's completion
    and v's prepare. u's completion line is garbled (not the last line: corruption,
    not a torn append): salvage yields u's intent and v's completed entry."""
    node = make_node(tmp_path, H100)
    assert node.state.prepare([node.claims.add("u", DEVICE)])["u"].ok
    assert node.state.prepare([node.claims.add("v", NEIGHBOUR)])["v"].ok
    data = node.root / "plugin"
    assert json.loads((data / "checkpoint.json").read_bytes())["entries"]["u"]["state"] == (
        ClaimState.PREPARE_STARTED.value
    )
    lines = (data / "checkpoint.log").read_bytes().splitlines(keepends=True)
    first = json.loads(lines[0])
    assert first["set"]["u"]["state"] == ClaimState.PREPARE_COMPLETED.value
    lines[0] = lines[0][: len(lines[0]) // 2] + b"\n"
    (data / "checkpoint.log").write_bytes(b"".join(lines))
    return node


def _quarantine_adopt(node: Node) -> str:
    cdi = str(node.root / "cdi")
    code, out, err = _quarantine(node, "--owned-mig", "adopt", "--cdi-root", cdi)
    assert code == 0, err
    return out


def test_adopting_a_running_claims_salvaged_intent_keeps_its_device_and_spec(
    tmp_path: Path,
) -> None:
    node = _completion_record_corrupt(tmp_path)
    devices = {m.placement: m for m in node.live()}
    mine = devices[(0, 1)]
    spec = node.spec("u")
    _quarantine_adopt(node)

    restarted = _restart(node)

    assert restarted.live() == node.live() and len(restarted.live()) == 2  # nothing destroyed
    assert restarted.spec("u") == spec  # the running pod's spec stays
    entry = Checkpoint(node.root / "plugin").load()["u"]
    assert entry.state is ClaimState.PREPARE_COMPLETED
    (device,) = entry.devices
    assert device.mig is not None
    assert (device.mig.gi_id, device.mig.ci_id, device.mig.uuid) == (
        mine.gi_id,
        mine.ci_id,
        mine.uuid,
    )
    assert device.mig.before is None and device.mig.boot is None
    # Owned as any prepared claim's: its unprepare destroys it, and only it.
    assert restarted.state.unprepare([restarted.claims.add("u")]) == {"u": None}
    assert [m.placement for m in restarted.live()] == [(1, 1)]


def test_an_adopted_intent_without_its_spec_is_rolled_back_as_the_preview_says(
    tmp_path: Path,
) -> None:
    """No spec: no pod can be using the device (or the prepare never finished)."""
    node = _completion_record_corrupt(tmp_path)
    node.state.cdi.remove_claim_spec("u")
    out = _quarantine_adopt(node)
    line = next(x for x in out.splitlines() if "claim default/claim-u (u)" in x)
    assert "PrepareStarted" in line and "at the next start rolled back" in line
    assert "adopted if" not in line and "kept" not in line

    restarted = _restart(node)

    assert [m.placement for m in restarted.live()] == [(1, 1)]  # u's device destroyed
    assert set(Checkpoint(node.root / "plugin").load()) == {"v"}


def test_an_adopted_intent_whose_instance_was_there_before_is_not_adopted(
    tmp_path: Path,
) -> None:
    """The instance at the placement is among the intent's `before`: not the attempt's,
    so neither adopted nor destroyed; the entry is rolled back (its spec removed)."""
    node = _completion_record_corrupt(tmp_path)
    data = node.root / "plugin"
    doc = json.loads((data / "checkpoint.json").read_bytes())
    (device,) = doc["entries"]["u"]["devices"]
    mine = next(m for m in node.live() if m.placement == (0, 1))
    device["mig"]["before"] = [mine.gi_id]
    (data / "checkpoint.json").write_text(json.dumps(doc))
    _quarantine_adopt(node)

    restarted = _restart(node)

    assert len(restarted.live()) == 2  # left alone
    assert not restarted.state.cdi.claim_spec_exists("u")
    assert set(Checkpoint(data).load()) == {"v"}


def test_journal_show_says_what_the_next_start_does_with_each_entry(tmp_path: Path) -> None:
    node = _completion_record_corrupt(tmp_path)
    _quarantine_adopt(node)
    data, cdi = str(node.root / "plugin"), str(node.root / "cdi")
    code, out, err = gpu_dra(
        ["journal", "show", "--state-dir", data, "--cdi-root", cdi, "-o", "json"]
    )
    assert code == 0, err
    fates = {e["uid"]: e["nextStart"] for e in json.loads(out)["entries"]}
    assert fates["u"].startswith("adopted if"), fates
    assert fates["v"].startswith("kept"), fates
    code, out, _ = gpu_dra(["journal", "show", "--state-dir", data, "--cdi-root", cdi])
    assert "NEXT START" in out


def _one_transient_error(monkeypatch: pytest.MonkeyPatch, where: str) -> list[str]:
    """The adopting start meets one transient error: EMFILE reading the claim's spec,
    or an NVML listing error finding the instance its attempt created."""
    raised: list[str] = []
    if where == "spec":
        read = CdiSpecs.read_claim_spec

        def emfile(self: CdiSpecs, uid: str) -> Any:
            if not raised:
                raised.append(uid)
                raise OSError(errno.EMFILE, "Too many open files")
            return read(self, uid)

        monkeypatch.setattr(CdiSpecs, "read_claim_spec", emfile)
    else:
        find = ClaimInstances.created_by_attempt

        def listing_error(self: ClaimInstances, *args: Any) -> Any:
            if not raised:
                raised.append(str(args[1]))
                raise transient("listing the GPU instances: NVML_ERROR_UNKNOWN")
            return find(self, *args)

        monkeypatch.setattr(ClaimInstances, "created_by_attempt", listing_error)
    return raised


@pytest.mark.parametrize("where", ["spec", "listing"])
def test_a_transient_error_at_the_adopting_start_leaves_the_adoption_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    node = _completion_record_corrupt(tmp_path)
    live = node.live()
    spec = node.spec("u")
    _quarantine_adopt(node)
    raised = _one_transient_error(monkeypatch, where)

    once = make_node(node.root, H100)  # the next start: one recovery
    assert raised, "the fault was never met"
    assert once.live() == live  # the running pod's MIG device is not destroyed
    assert once.spec("u") == spec
    entry = Checkpoint(node.root / "plugin").load()["u"]
    assert (entry.state, entry.adopt) == (ClaimState.PREPARE_STARTED, True)

    again = make_node(node.root, H100)  # no fault this time: adopted
    assert again.live() == live
    assert Checkpoint(node.root / "plugin").load()["u"].state is ClaimState.PREPARE_COMPLETED
