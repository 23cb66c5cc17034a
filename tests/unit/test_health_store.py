"""HealthStore: persisted failed GPUs, precedence rules, taints for every device of a GPU."""

from __future__ import annotations

import json
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from driver.health.store import HealthStore

GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
GPU1 = "GPU-11111111-1111-4111-8111-111111111111"


@dataclass(frozen=True)
class Dev:
    name: str
    gpu_uuid: str


DEVICES = [
    Dev("gpu-0", GPU0),
    Dev("gpu-0-mig-1g10gb-0", GPU0),
    Dev("gpu-0-mig-3g40gb-4", GPU0),
    Dev("gpu-1", GPU1),
    Dev("gpu-1-mig-1g10gb-0", GPU1),
]


def test_fatal_xid_taints_every_device_of_the_gpu(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    assert store.record_xid(GPU0, 79)
    taints = store.device_taints(DEVICES, driver="gpu.example.com", effect="NoSchedule")
    expected = [{"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}]
    assert taints == {
        "gpu-0": expected,
        "gpu-0-mig-1g10gb-0": expected,
        "gpu-0-mig-3g40gb-4": expected,
    }
    assert store.tainted_device_count(DEVICES) == 3


def test_effect_and_driver_come_from_the_caller(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    store.record_lost(GPU1)
    taints = store.device_taints(DEVICES, driver="other.example.org", effect="NoExecute")
    assert taints["gpu-1"] == [{"key": "other.example.org/gpu-lost", "effect": "NoExecute"}]
    assert set(taints) == {"gpu-1", "gpu-1-mig-1g10gb-0"}


def test_persisted_format_and_restart(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "health.json"
    store = HealthStore(path)
    store.record_xid(GPU0, 79, "Xid 79: fell off the bus")
    store.record_lost(GPU1)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = json.loads(path.read_text())
    assert doc["version"] == 1
    rec = doc["gpus"][GPU0]
    assert (rec["key"], rec["value"], rec["reason"]) == (
        "gpu.example.com/xid",
        "79",
        "Xid 79: fell off the bus",
    )
    assert rec["since"].endswith("Z")
    assert doc["gpus"][GPU1]["key"] == "gpu.example.com/gpu-lost"

    again = HealthStore(path)
    assert again.failed_gpus() == store.failed_gpus()
    assert again.device_taints(DEVICES, effect="NoSchedule") == store.device_taints(
        DEVICES, effect="NoSchedule"
    )


def test_gpu_lost_beats_xid(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    assert store.record_xid(GPU0, 79)
    assert store.record_lost(GPU0)
    assert not store.record_xid(GPU0, 48)
    failure = store.gpu_failure(GPU0)
    assert failure is not None and failure.kind == "gpu-lost" and failure.value is None


def test_later_fatal_xid_wins_keeping_since(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    store.record_xid(GPU0, 48)
    first = store.gpu_failure(GPU0)
    assert not store.record_xid(GPU0, 48)  # no change, no version bump
    version = store.version
    assert store.record_xid(GPU0, 63)
    now = store.gpu_failure(GPU0)
    assert first is not None and now is not None
    assert now.value == "63" and now.since == first.since
    assert store.version == version + 1


def test_clear(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    store = HealthStore(path)
    store.record_lost(GPU0)
    assert store.clear(GPU0)
    assert not store.clear(GPU0)
    assert store.device_taints(DEVICES, effect="NoSchedule") == {}
    assert HealthStore(path).failed_gpus() == {}


def test_failure_by_device_name(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    store.set_devices(DEVICES)
    store.record_xid(GPU0, 79)
    message = store.failure("gpu-0-mig-1g10gb-0")
    assert message is not None and message.startswith("Xid 79")
    assert store.failure("gpu-1") is None
    assert store.failure("no-such-device") is None


def test_corrupt_file_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text("{not json")
    store = HealthStore(path)
    assert store.failed_gpus() == {}
    assert [p.name.startswith("health.json.corrupt-") for p in tmp_path.iterdir()] == [True]
    store.record_xid(GPU0, 79)
    assert HealthStore(path).gpu_failure(GPU0) is not None


def test_unwritable_directory_keeps_memory_state(tmp_path: Path) -> None:
    directory = tmp_path / "data"
    store = HealthStore(directory / "health.json")
    directory.write_text("")  # the data directory is now a regular file: writes fail
    assert store.record_xid(GPU0, 79)
    assert store.gpu_failure(GPU0) is not None
    assert not store.flush()
    directory.unlink()
    assert store.flush()
    assert HealthStore(directory / "health.json").gpu_failure(GPU0) is not None


def test_unreadable_store_fails_loudly(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError):
        HealthStore(blocker / "health.json")  # never silently forget taints


def test_wait_changed_wakes_on_change(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    version = store.version
    start = time.monotonic()
    assert store.wait_changed(version, 0.05) == version
    assert time.monotonic() - start >= 0.05
    timer = threading.Timer(0.05, store.record_lost, args=(GPU0,))
    timer.start()
    start = time.monotonic()
    assert store.wait_changed(version, 5.0) == version + 1
    assert time.monotonic() - start < 2.0
    timer.join()
