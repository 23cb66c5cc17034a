"""Kill -9 at every failpoint a strict whole-GPU MPS claim passes, restart, check the
GPU's compute mode (docs/state.md, "Recovery rules"; docs/mps.md, "Strict: one MPS
server, EXCLUSIVE_PROCESS"; the harness of tests/unit/test_timeslice_crash.py, with
the mock's compute modes kept under its driver root as a GPU keeps its mode).

After the crash the GPU is in EXCLUSIVE_PROCESS only while a journal entry records
it; after the restart a completed entry's GPU is in EXCLUSIVE_PROCESS and any other
is back in the mode found (a `PrepareStarted` entry rolled back); the kubelet's
retries end with the mode found. A reboot resets the mode: the start re-applies it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.failpoints import ENV_VAR, FAILPOINTS, PREPARE_FAILPOINTS
from driver.nvml.mps import DaemonDirs, DaemonId, is_running, process_start_time
from driver.state.journal.checkpoint import Checkpoint, ClaimState
from driver.state.request import ClaimRef

HARNESS = r"""
import json
import sys
from pathlib import Path

from driver.devices.model import PoolOptions, build_pool
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.nvml import MockNvml
from driver.state.request import ClaimRef
from driver.state.prepare import DeviceState

FLEET = parse_fleet({"gpus": [{"model": "H100-80GB", "count": 1, "migMode": "disabled"}]})
PARAMS = {
    "apiVersion": "gpu.resource.example.com/v1alpha1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
}


class Claims:
    def get(self, namespace, name):
        result = {"request": "gpu", "driver": "gpu.example.com", "pool": "node-a",
                  "device": "gpu-0"}
        config = {"source": "FromClaim",
                  "opaque": {"driver": "gpu.example.com", "parameters": PARAMS}}
        return {
            "metadata": {"namespace": namespace, "name": name, "uid": name},
            "status": {"allocation": {"devices": {"results": [result], "config": [config]}}},
        }


class Healthy:
    def failure(self, device_name):
        return None

    def ensure_tainted(self, device_name):
        raise AssertionError("no device is failed here")


class NoReports:
    def permanent_failure(self, claim, error):
        raise AssertionError(f"unexpected permanent error: {error}")


def node(root):
    mock = MockNvml(FLEET, "node-a", driver_root=Path(root) / "driver-root")
    mock.privileged = True  # the plugin runs as root: it may set compute modes
    return MockBackend(mock)


def build_state(root):
    root = Path(root)
    backend = node(root)
    state = DeviceState(
        driver_name="gpu.example.com",
        node_name="node-a",
        devices={},
        cdi_root=root / "cdi",
        data_dir=root / "plugin",
        claims=Claims(),
        health=Healthy(),
        reporter=NoReports(),
        mps=backend.mps("/unused"),
        compute_modes=backend.compute_modes(),
    )
    report = state.recover()
    pool = build_pool(backend.discover(), PoolOptions(mps=True))
    state.devices = {d.name: d for d in pool.devices}
    return state, report


def main():
    root, op, name = sys.argv[1:]
    state, _ = build_state(root)
    ref = ClaimRef("default", name, name)
    if op == "prepare":
        error = state.prepare([ref])[name].error
    else:
        error = state.unprepare([ref])[name]
    print(json.dumps(None if error is None else str(error)))
"""

_NS: dict[str, Any] = {"__name__": "strict_crash_harness"}
exec(compile(HARNESS, "strict_crash_harness", "exec", dont_inherit=True), _NS)

STRICT_FAILPOINTS = [name for name in FAILPOINTS if "-mig-" not in name]
# Killed after the mode was set and before the PrepareCompleted store: the GPU is in
# EXCLUSIVE_PROCESS and the journal holds the intent, which the restart rolls back.
AFTER_THE_SET = (
    "prepare-cdi-before-rename",
    "prepare-after-cdi",
    "prepare-completed-before-commit",
)
UID = "strict-1"
EXCLUSIVE_PROCESS, DEFAULT = 3, 0


def _state(root: Path) -> Any:
    state, _ = _NS["build_state"](root)
    return state


def _mode(root: Path) -> int:
    mock = _NS["node"](root).module
    return int(mock.compute_mode(mock.gpus[0].uuid))


def _crash(root: Path, op: str, failpoint: str, *, harness: str = HARNESS, uid: str = UID) -> None:
    """`op` of claim `uid` in a process of `harness`, killed at `failpoint`."""
    proc = subprocess.run(
        [sys.executable, "-c", harness + "\nmain()\n", str(root), op, uid],
        env={**os.environ, ENV_VAR: failpoint},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"{op} did not die at {failpoint}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )


def _daemons(root: Path) -> list[int]:
    control = _NS["node"](root).mps("/unused")
    found = []
    for pid_file in (root / "plugin" / "mps").glob("*/pipe/*.pid"):
        daemon = control.running(DaemonDirs(pid_file.parent, pid_file.parent.parent / "log"))
        if daemon is not None:
            found.append(daemon.pid)
    return found


def _strict_entries(root: Path) -> dict[str, ClaimState]:
    return {
        uid: entry.state
        for uid, entry in Checkpoint(root / "plugin").load().items()
        if any(d.mps is not None and d.mps.strict for d in entry.devices)
    }


@pytest.fixture
def root() -> Iterator[Path]:
    short = Path(tempfile.mkdtemp(prefix="crash-strict-"))  # a short socket path
    try:
        yield short
    finally:
        for pid in _daemons(short):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(short)


@pytest.mark.parametrize("failpoint", STRICT_FAILPOINTS)
def test_a_kill_never_leaves_exclusive_process_that_no_entry_records(
    failpoint: str, root: Path
) -> None:
    if failpoint in PREPARE_FAILPOINTS or failpoint == "prepare-rollback-after-cdi-removed":
        if failpoint == "prepare-rollback-after-cdi-removed":
            _crash(root, "prepare", "prepare-after-cdi")  # a half-done prepare to redo
        _crash(root, "prepare", failpoint)
        unprepare = False
    else:
        state = _state(root)
        assert state.prepare([_ref()])[UID].ok
        assert _mode(root) == EXCLUSIVE_PROCESS
        _crash(root, "unprepare", failpoint)
        unprepare = True

    entries = _strict_entries(root)
    if _mode(root) == EXCLUSIVE_PROCESS:  # ours only while an entry records it
        assert entries, f"{failpoint}: EXCLUSIVE_PROCESS that no journal entry records"
    if failpoint in AFTER_THE_SET:
        assert _mode(root) == EXCLUSIVE_PROCESS
        assert entries == {UID: ClaimState.PREPARE_STARTED}

    state = _state(root)  # the plugin's restart: recover()
    entries = _strict_entries(root)
    assert ClaimState.PREPARE_STARTED not in entries.values()
    want = EXCLUSIVE_PROCESS if entries else DEFAULT
    assert _mode(root) == want, (failpoint, entries)

    if not unprepare:  # the kubelet retries the prepare
        assert state.prepare([_ref()])[UID].ok
        assert _mode(root) == EXCLUSIVE_PROCESS
    assert state.unprepare([_ref()]) == {UID: None}
    assert _mode(root) == DEFAULT
    assert Checkpoint(root / "plugin").load() == {}
    assert _daemons(root) == []


def test_a_reboot_resets_the_mode_and_the_start_applies_it_again(root: Path) -> None:
    state = _state(root)
    assert state.prepare([_ref()])[UID].ok
    (pid,) = _daemons(root)
    daemon = DaemonId(pid, process_start_time(pid) or 0)
    os.kill(pid, signal.SIGKILL)  # a reboot ends the daemon ...
    while is_running(daemon):  # (its start time: a reused pid is another process)
        time.sleep(0.01)  # no child of this process: init reaps it
    _NS["node"](root).module.mock_reboot()  # ... and resets the GPU's compute mode
    assert _mode(root) == DEFAULT
    state, report = _NS["build_state"](root)
    assert _mode(root) == EXCLUSIVE_PROCESS
    assert report.mps_lost == (UID,)  # and its daemon is started again
    assert len(_daemons(root)) == 1
    assert state.unprepare([_ref()]) == {UID: None}
    assert _mode(root) == DEFAULT


def _ref() -> ClaimRef:
    return ClaimRef("default", UID, UID)


def test_the_harness_claim_is_strict(root: Path) -> None:
    state = _state(root)
    document = state.devices["gpu-0"].document
    assert document["attributes"]["mpsIsolation"] == {"string": "strict"}
    assert json.loads(json.dumps(document))["name"] == "gpu-0"
