"""Kill -9 at every failpoint of a strict partition claim that joins, and leaves, the
MPS server its GPU's other partition claim holds (docs/mps.md, "Strict partitions: one
server per GPU"; the harness of tests/unit/test_mps_strict_crash.py on two partitions).

Whatever the kill, the restart leaves the other claim prepared with its server running
and its GPU in EXCLUSIVE_PROCESS; the kubelet's retries then end both claims, and only
the last one's unprepare stops the server and puts back the mode found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from driver.failpoints import PREPARE_FAILPOINTS
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.request import ClaimRef
from tests.unit import test_mps_strict_crash as whole

HARNESS = whole.HARNESS
STRICT_PARTITIONS = "PoolOptions(mps=True, gpu_partitions=2, mps_strict_partitions=True)"
for old, new in (
    ('"device": "gpu-0"}', '"device": "gpu-0-partition-" + name[-1]}'),
    ("PoolOptions(mps=True)", STRICT_PARTITIONS),
):
    assert old in HARNESS, old
    HARNESS = HARNESS.replace(old, new)
_NS: dict[str, Any] = {"__name__": "strict_partitions_crash_harness"}
exec(compile(HARNESS, "strict_partitions_crash_harness", "exec", dont_inherit=True), _NS)

HOLDER, JOINER = "part-0", "part-1"
EXCLUSIVE_PROCESS, DEFAULT = whole.EXCLUSIVE_PROCESS, whole.DEFAULT


def _state(root: Path) -> Any:
    state, _ = _NS["build_state"](root)
    return state


def _ref(uid: str) -> ClaimRef:
    return ClaimRef("default", uid, uid)


def _crash(root: Path, op: str, failpoint: str) -> None:
    whole._crash(root, op, failpoint, harness=HARNESS, uid=JOINER)


root = whole.root  # a short temporary directory; its daemons killed at the end


@pytest.mark.parametrize("failpoint", whole.STRICT_FAILPOINTS)
def test_a_kill_of_the_joining_claim_never_ends_the_holders_server(
    failpoint: str, root: Path
) -> None:
    state = _state(root)
    assert state.prepare([_ref(HOLDER)])[HOLDER].ok
    (server,) = whole._daemons(root)
    if failpoint in PREPARE_FAILPOINTS or failpoint == "prepare-rollback-after-cdi-removed":
        if failpoint == "prepare-rollback-after-cdi-removed":
            _crash(root, "prepare", "prepare-after-cdi")  # a half-done prepare to redo
        _crash(root, "prepare", failpoint)
        unprepare = False
    else:
        assert state.prepare([_ref(JOINER)])[JOINER].ok
        _crash(root, "unprepare", failpoint)
        unprepare = True

    state = _state(root)  # the plugin's restart: recover()
    entries = {u: e.state for u, e in Checkpoint(root / "plugin").load().items()}
    assert entries.get(HOLDER) is ClaimState.PREPARE_COMPLETED, (failpoint, entries)
    assert ClaimState.PREPARE_STARTED not in entries.values(), (failpoint, entries)
    assert whole._daemons(root) == [server], failpoint  # the holder's server, untouched
    assert whole._mode(root) == EXCLUSIVE_PROCESS, failpoint

    if not unprepare:  # the kubelet retries the prepare: it joins the same server
        assert state.prepare([_ref(JOINER)])[JOINER].ok
        assert whole._daemons(root) == [server]
    assert state.unprepare([_ref(JOINER)]) == {JOINER: None}
    assert whole._daemons(root) == [server] and whole._mode(root) == EXCLUSIVE_PROCESS
    assert state.unprepare([_ref(HOLDER)]) == {HOLDER: None}
    assert whole._mode(root) == DEFAULT
    assert whole._daemons(root) == []
    assert Checkpoint(root / "plugin").load() == {}
