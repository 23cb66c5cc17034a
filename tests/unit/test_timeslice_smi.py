"""The time-slice backends: `nvidia-smi compute-policy` from the driver root (a fake
nvidia-smi script records its argv; no GPU needed), the mock's file, the backend's
choice, and the journal's `timeSlice` record."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from driver.errors import DriverError
from driver.nvml.backend import NvmlBackend
from driver.nvml.mock.fleet import parse_fleet
from driver.nvml.mock.mock_backend import MockBackend
from driver.nvml.mock.mock_timeslice import STATE_FILE, MockTimeSlice
from driver.nvml.mock.nvml import MockNvml
from driver.nvml.smi_timeslice import GpuLostError, NvidiaSmiTimeSlice
from driver.state.journal.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
    PreparedDevice,
    checksum,
)
from driver.state.journal.timeslice_record import TimeSliceRecord

GPU = "GPU-4f021113-d9d9-4e5c-bcb4-6d2f9864ef5b"


def fake_smi(root: Path, body: str, directory: str = "usr/bin") -> Path:
    """An executable `nvidia-smi` under the driver root that records its argv and
    LD_PRELOAD in `<root>/calls`, then runs `body`."""
    path = root / directory / "nvidia-smi"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "$* | ${{LD_PRELOAD:-}}" >> "{root}/calls"\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def calls(root: Path) -> list[str]:
    path = root / "calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize(
    ("interval", "code"), [("Default", 0), ("Short", 1), ("Medium", 2), ("Long", 3)]
)
def test_command_line_per_interval(tmp_path: Path, interval: str, code: int) -> None:
    smi = fake_smi(tmp_path, "exit 0")
    NvidiaSmiTimeSlice(tmp_path).set(GPU, interval)
    assert calls(tmp_path) == [f"compute-policy -i {GPU} --set-timeslice {code} | "]
    assert NvidiaSmiTimeSlice(tmp_path).command(GPU, interval)[0] == str(smi)


def test_driver_root_libnvidia_ml_is_preloaded(tmp_path: Path) -> None:
    fake_smi(tmp_path, "exit 0")
    library = tmp_path / "usr/lib64/libnvidia-ml.so.1"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    NvidiaSmiTimeSlice(tmp_path).set(GPU, "Long")
    assert calls(tmp_path) == [f"compute-policy -i {GPU} --set-timeslice 3 | {library}"]


def test_binary_search_order_and_a_missing_binary(tmp_path: Path) -> None:
    ops = NvidiaSmiTimeSlice(tmp_path)
    with pytest.raises(DriverError) as info:
        ops.set(GPU, "Long")
    assert not info.value.permanent
    assert f"no executable nvidia-smi under the driver root {tmp_path}" in str(info.value)
    bin_smi = fake_smi(tmp_path, "exit 0", "bin")
    assert ops.binary() == bin_smi
    opt_smi = fake_smi(tmp_path, "exit 0", "opt/bin")  # NVIDIA's order: opt/bin first
    assert ops.binary() == opt_smi


def test_a_failure_is_transient_and_names_the_gpu_and_the_error_line(tmp_path: Path) -> None:
    fake_smi(tmp_path, 'echo "Setting timeslice" ; echo "Insufficient Permissions" >&2 ; exit 4')
    with pytest.raises(DriverError) as info:
        NvidiaSmiTimeSlice(tmp_path).set(GPU, "Long")
    assert not info.value.permanent
    message = str(info.value)
    assert GPU in message and "to Long" in message
    assert message.endswith("exited with status 4: Insufficient Permissions")


def test_stdout_when_stderr_is_empty(tmp_path: Path) -> None:
    fake_smi(tmp_path, 'echo "No devices were found" ; exit 6')
    with pytest.raises(DriverError, match=r"status 6: No devices were found$"):
        NvidiaSmiTimeSlice(tmp_path).set(GPU, "Short")


def test_not_supported_fails_a_setting_but_not_a_restore(tmp_path: Path) -> None:
    fake_smi(tmp_path, 'echo "Not supported on this device" >&2 ; exit 3')
    ops = NvidiaSmiTimeSlice(tmp_path)
    with pytest.raises(DriverError, match="Not supported"):
        ops.set(GPU, "Medium")
    ops.set(GPU, "Default")  # nothing can be left to restore there


def test_a_gpu_fallen_off_the_bus_is_a_gpu_lost_error(tmp_path: Path) -> None:
    fake_smi(
        tmp_path,
        'echo "Unable to determine the device handle for GPU: GPU is lost" >&2 ; exit 15',
    )
    with pytest.raises(GpuLostError, match="status 15: Unable to determine") as err:
        NvidiaSmiTimeSlice(tmp_path).set(GPU, "Default")
    assert not err.value.permanent


def test_a_hanging_nvidia_smi_times_out(tmp_path: Path) -> None:
    fake_smi(tmp_path, "exec sleep 10")
    with pytest.raises(DriverError, match=r"did not finish in 0.2s"):
        NvidiaSmiTimeSlice(tmp_path, timeout=0.2).set(GPU, "Long")


def test_unknown_interval_is_a_programming_error(tmp_path: Path) -> None:
    fake_smi(tmp_path, "exit 0")
    with pytest.raises(ValueError):
        NvidiaSmiTimeSlice(tmp_path).set(GPU, "Fast")
    assert calls(tmp_path) == []


# -- the mock ----------------------------------------------------------------------------


def test_mock_keeps_settings_in_a_file_shared_by_processes(tmp_path: Path) -> None:
    one, two = MockTimeSlice(tmp_path, [GPU]), MockTimeSlice(tmp_path, [GPU])
    assert one.settings() == {} and not (tmp_path / STATE_FILE).exists()  # reads write nothing
    one.set(GPU, "Long")
    assert two.get(GPU) == "Long"
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"version": 1, "gpus": {GPU: "Long"}}
    assert [p.name for p in (tmp_path / STATE_FILE).parent.iterdir() if "tmp" in p.name] == []
    two.set(GPU, "Default")
    assert one.settings() == {}
    one.set(GPU, "Short")
    two.reboot()
    assert one.get(GPU) == "Default"
    with pytest.raises(DriverError, match="no GPU with UUID GPU-nope"):
        one.set("GPU-nope", "Long")


def test_mock_in_memory(tmp_path: Path) -> None:
    ops = MockTimeSlice(None, [GPU])
    ops.set(GPU, "Medium")
    assert ops.settings() == {GPU: "Medium"}
    assert list(tmp_path.iterdir()) == []


def test_backend_picks_the_mock_or_nvidia_smi(tmp_path: Path) -> None:
    fleet = parse_fleet({"gpus": [{"model": "H100-80GB", "count": 1, "migMode": "disabled"}]})
    mock = MockBackend(MockNvml(fleet, "node-a", driver_root=tmp_path / "mock-root"))
    ops = mock.timeslice("/driver-root")
    assert isinstance(ops, MockTimeSlice) and ops is mock.timeslice("/driver-root")
    uuid = mock.module.gpus[0].uuid
    ops.set(uuid, "Long")
    assert MockTimeSlice(tmp_path / "mock-root", [uuid]).get(uuid) == "Long"
    real = NvmlBackend(object(), backend_name="nvml").timeslice(tmp_path / "driver-root")
    assert isinstance(real, NvidiaSmiTimeSlice) and real.driver_root == tmp_path / "driver-root"


# -- the journal record ------------------------------------------------------------------


def _entry(record: TimeSliceRecord | None) -> dict[str, ClaimEntry]:
    device = PreparedDevice("node-a", "gpu-0", ("gpu",), ("k8s.x/gpu=a",), time_slice=record)
    return {"uid-a": ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", "a", (device,))}


def test_journal_round_trip_keeps_other_entries_bytes(tmp_path: Path) -> None:
    cp = Checkpoint(tmp_path)
    entries = _entry(TimeSliceRecord(GPU, "Long", 3))
    cp.store(entries)
    assert cp.load() == entries
    cp.compact()  # the snapshot as a clean stop leaves it, with every entry
    doc = json.loads(cp.path.read_bytes())
    device = doc["entries"]["uid-a"]["devices"][0]
    assert device["timeSlice"] == {"gpu": GPU, "interval": "Long", "seq": 3}
    assert doc["schemaVersion"] == 1
    cp.store(_entry(None))
    cp.compact()
    assert "timeSlice" not in cp.path.read_text()  # absent unless set


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu": GPU, "interval": "Default"},
        {"interval": "Long"},
        {"gpu": GPU, "interval": "Long", "seq": -1},
    ],
)
def test_a_malformed_record_is_corrupt(tmp_path: Path, bad: dict[str, object]) -> None:
    cp = Checkpoint(tmp_path)
    cp.store(_entry(TimeSliceRecord(GPU, "Long", 1)))
    doc = json.loads(cp.path.read_bytes())
    doc["entries"]["uid-a"]["devices"][0]["timeSlice"] = bad
    doc["checksum"] = checksum(doc["entries"])
    cp.path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointCorruptError, match="timeSlice"):
        cp.load()


def test_a_reader_accepts_an_unknown_record_and_keeps_it_when_it_rewrites(
    tmp_path: Path,
) -> None:
    """What docs/state.md says about a downgrade: an unknown device key verifies (the
    checksum is over the stored value); releases before the hardware record lost it at
    their next store, this one writes it back."""
    cp = Checkpoint(tmp_path)
    cp.store(_entry(None))
    doc = json.loads(cp.path.read_bytes())
    doc["entries"]["uid-a"]["devices"][0]["futureTimeSlice"] = {"gpu": GPU}
    doc["checksum"] = checksum(doc["entries"])
    cp.path.write_text(json.dumps(doc))
    entries = cp.load()
    cp.store(entries)
    assert json.loads(cp.path.read_bytes()) == doc
