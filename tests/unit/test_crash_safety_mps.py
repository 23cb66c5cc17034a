"""Kill -9 at every failpoint of an MPS share's prepare and unprepare (the crash
harness of tests/unit/test_crash_safety.py with node MPS daemons): the daemon is a
process of its own and outlives the plugin, so after the restart every running daemon
and every daemon directory must belong to a journal entry, every prepared entry's
daemon must run, and the kubelet's retry and unprepare leave no daemon and no
directory behind."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.failpoints import FAILPOINTS
from driver.nvml.mps import DaemonDirs, MpsControl
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from tests.unit.test_crash_safety import (
    _NS,
    SCENARIOS,
    SHARE_1,
    UID_S1,
    _crash,
    _ref,
    _root,
    _state,
)

MPS_FAILPOINTS = [name for name in FAILPOINTS if "-mig-" not in name]


def _control(root: Path) -> MpsControl:
    control = _NS["nvml"](root).mps("/unused")
    assert isinstance(control, MpsControl)
    return control


def _daemon_dirs(root: Path) -> dict[str, int | None]:
    """Each daemon directory under the plugin's MPS root: its running daemon's pid."""
    mps = root / "plugin" / "mps"
    control = _control(root)
    found: dict[str, int | None] = {}
    for directory in sorted(mps.iterdir()) if mps.exists() else ():
        daemon = control.running(DaemonDirs(directory / "pipe", directory / "log"))
        found[directory.name] = daemon.pid if daemon is not None else None
    return found


def _assert_owned(root: Path) -> None:
    """Every daemon directory is a journal entry's, and a prepared entry's daemon runs
    (the one it records)."""
    journal = Checkpoint(root / "plugin").load()
    records = {
        d.mps.directory: (entry.state, d.mps.pid)
        for entry in journal.values()
        for d in entry.devices
        if d.mps is not None
    }
    found = _daemon_dirs(root)
    assert set(found) <= set(records), f"daemon directories no claim owns: {found}, {records}"
    for directory, (state, pid) in records.items():
        if state is ClaimState.PREPARE_COMPLETED:
            assert found.get(directory) == pid and pid, (directory, found, records)


@pytest.fixture
def mps_root(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("GPU_DRA_CRASH_MPS", "1")
    # A short path: the daemon's control socket lives under it (107 bytes at most).
    short = Path(tempfile.mkdtemp(prefix="crash-mps-"))
    root = _root(short, "n")
    try:
        yield root
    finally:
        for pid in _daemon_dirs(root).values():  # a failed test leaves no daemon behind
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(short)


@pytest.mark.parametrize("failpoint", MPS_FAILPOINTS)
def test_kill_with_an_mps_share_leaves_no_daemon_that_no_claim_owns(
    failpoint: str, mps_root: Path
) -> None:
    root = mps_root
    share = _ref(SHARE_1)
    scenario = SCENARIOS[failpoint]
    if scenario == "unprepare":
        assert _state(root).prepare([share])[UID_S1].ok
        assert list(_daemon_dirs(root).values()) != [None]
        _crash(root, "unprepare", failpoint, (SHARE_1,))
    else:
        if scenario == "prepare-retry":
            _crash(root, "prepare", "prepare-after-cdi", (SHARE_1,))
        _crash(root, "prepare", failpoint, (SHARE_1,))

    report = _state(root).recover()  # the plugin's restart
    assert report.checkpoint_problem is None
    _assert_owned(root)

    if scenario != "unprepare":  # the kubelet retries the prepare
        assert _state(root).prepare([share])[UID_S1].ok
        _assert_owned(root)
        assert len(_daemon_dirs(root)) == 1
    assert _state(root).unprepare([share]) == {UID_S1: None}
    assert _daemon_dirs(root) == {}
    assert Checkpoint(root / "plugin").load() == {}
