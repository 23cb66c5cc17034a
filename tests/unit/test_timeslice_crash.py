"""Kill -9 at every failpoint a time-sliced share passes, restart, check the GPU's
time-slice interval (docs/state.md, "Recovery rules"; the harness of
tests/unit/test_crash_safety.py, with the mock's interval kept in a file under its
driver root like its MIG state).

Share 1 of gpu-0 asks for Long and is prepared; the kill hits the prepare or the
unprepare of share 2 (Short) of the same GPU. After the crash any interval the GPU
runs with is recorded by a journal entry (never ours unrecorded); after the restart
the GPU runs with what the completed entries want; the kubelet's retries end with
Long (share 1 alone), then Default.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from driver.failpoints import ENV_VAR, FAILPOINTS, PREPARE_FAILPOINTS
from driver.nvml.mock.mock_timeslice import MockTimeSlice
from driver.state.claim_timeslices import wanted
from driver.state.journal.checkpoint import Checkpoint

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


class FileClaims:
    def __init__(self, root):
        self.docs = json.loads((Path(root) / "claims.json").read_text())

    def get(self, namespace, name):
        return self.docs[name]


class Healthy:
    def failure(self, device_name):
        return None

    def ensure_tainted(self, device_name):
        raise AssertionError("no device is failed here")


class NoReports:
    def permanent_failure(self, claim, error):
        raise AssertionError(f"unexpected permanent error: {error}")


def build_state(root):
    root = Path(root)
    backend = MockBackend(MockNvml(FLEET, "node-a", driver_root=root / "driver-root"))
    state = DeviceState(
        driver_name="gpu.example.com",
        node_name="node-a",
        devices={},
        cdi_root=root / "cdi",
        data_dir=root / "plugin",
        claims=FileClaims(root),
        health=Healthy(),
        reporter=NoReports(),
        mig=backend.mig(),
        timeslice=backend.timeslice("/unused"),
    )
    report = state.recover()
    pool = build_pool(backend.discover(), PoolOptions(allow_multiple_allocations=True))
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

_NS: dict[str, Any] = {"__name__": "timeslice_crash_harness"}
exec(compile(HARNESS, "timeslice_crash_harness", "exec", dont_inherit=True), _NS)

# A time-sliced share of a GPU with MIG off passes every failpoint but the MIG ones.
SHARE_FAILPOINTS = [name for name in FAILPOINTS if "-mig-" not in name]


def _share(uid: str, interval: str) -> dict[str, Any]:
    params = {
        "apiVersion": "gpu.resource.example.com/v1alpha1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}},
    }
    result = {
        "request": "gpu",
        "driver": "gpu.example.com",
        "pool": "node-a",
        "device": "gpu-0",
        "shareID": f"id-{uid}",
        "consumedCapacity": {"memory": "16Gi", "compute": "20"},
    }
    return {
        "metadata": {"namespace": "default", "name": uid, "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [result],
                    "config": [
                        {
                            "source": "FromClaim",
                            "opaque": {"driver": "gpu.example.com", "parameters": params},
                        }
                    ],
                }
            }
        },
    }


def _run(root: Path, op: str, name: str, failpoint: str | None = None) -> Any:
    env = dict(os.environ)
    if failpoint is not None:
        env[ENV_VAR] = failpoint
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS + "\nmain()\n", str(root), op, name],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if failpoint is not None:
        assert proc.returncode == -signal.SIGKILL, (
            f"{op} did not die at {failpoint}: rc={proc.returncode}\n{proc.stdout}{proc.stderr}"
        )
        return None
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _settings(root: Path) -> dict[str, str]:
    return MockTimeSlice(root / "driver-root", []).settings()


def _recorded(root: Path) -> set[tuple[str, str]]:
    """(GPU, interval) of every record in the journal, whatever the entry's state."""
    return {
        (d.time_slice.gpu_uuid, d.time_slice.interval)
        for e in Checkpoint(root / "plugin").load().values()
        for d in e.devices
        if d.time_slice is not None
    }


@pytest.mark.parametrize("failpoint", SHARE_FAILPOINTS)
def test_kill_around_a_time_slice_setting_then_restart(failpoint: str, tmp_path: Path) -> None:
    _kill_then_restart(failpoint, tmp_path, shared=True)


@pytest.mark.parametrize("failpoint", [f for f in SHARE_FAILPOINTS if f in PREPARE_FAILPOINTS])
def test_kill_during_the_only_time_sliced_prepare_then_restart(
    failpoint: str, tmp_path: Path
) -> None:
    """No other claim holds the GPU: what a rolled-back prepare set goes back to Default."""
    _kill_then_restart(failpoint, tmp_path, shared=False)


def _kill_then_restart(failpoint: str, tmp_path: Path, *, shared: bool) -> None:
    root = tmp_path / "node"
    root.mkdir()
    (root / "claims.json").write_text(
        json.dumps({u: _share(u, i) for u, i in [("s1", "Long"), ("s2", "Short")]})
    )
    state, _ = _NS["build_state"](root)
    gpu = next(iter(state.devices.values())).gpu_uuid
    if shared:
        assert state.prepare([_NS["ClaimRef"]("default", "s1", "s1")])["s1"].ok
        assert _settings(root) == {gpu: "Long"}

    scenario = "unprepare" if failpoint not in PREPARE_FAILPOINTS else "prepare"
    if scenario == "unprepare":
        assert _run(root, "prepare", "s2") is None
        assert _settings(root) == {gpu: "Short"}  # the last writer
        _run(root, "unprepare", "s2", failpoint)
    else:
        if failpoint == "prepare-rollback-after-cdi-removed":
            _run(root, "prepare", "s2", "prepare-after-cdi")  # leaves a half-done prepare
        _run(root, "prepare", "s2", failpoint)

    # Whatever the kill left: the GPU's interval is one a journal entry records.
    for item in _settings(root).items():
        assert item in _recorded(root), f"unrecorded setting {item} after a kill at {failpoint}"

    _, report = _NS["build_state"](root)  # the restart
    assert report.checkpoint_problem is None
    journal = Checkpoint(root / "plugin").load()
    assert _settings(root) == wanted(journal)

    if scenario == "unprepare":
        assert _run(root, "unprepare", "s2") is None  # the kubelet repeats it
    else:
        assert _run(root, "prepare", "s2") is None  # the kubelet retries
        assert _settings(root) == {gpu: "Short"}
        assert _run(root, "unprepare", "s2") is None
    if shared:
        assert _settings(root) == {gpu: "Long"}  # share 1 still holds the GPU
        assert _run(root, "unprepare", "s1") is None
    assert _settings(root) == {} and Checkpoint(root / "plugin").load() == {}
