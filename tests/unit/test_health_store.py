"""HealthStore: persisted failed GPUs, precedence rules, taints for every device of a GPU."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from driver.health.store import HealthStore
from driver.observability import metrics
from tests.taints import untimed

GPU0 = "GPU-00000000-0000-4000-8000-000000000000"
GPU1 = "GPU-11111111-1111-4111-8111-111111111111"


@dataclass(frozen=True)
class Dev:
    name: str
    gpu_uuid: str
    placement: tuple[int, int] | None = None  # as PublishedDevice: MIG memory slices


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
    taints = untimed(store.device_taints(DEVICES, driver="gpu.example.com", effect="NoSchedule"))
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
    taints = untimed(store.device_taints(DEVICES, driver="other.example.org", effect="NoExecute"))
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
    assert untimed(store.device_taints(DEVICES, effect="NoSchedule")) == {}
    assert HealthStore(path).failed_gpus() == {}


def test_failure_by_device(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    store.record_xid(GPU0, 79)
    by_name = {d.name: d for d in DEVICES}
    failure = store.device_failure(by_name["gpu-0-mig-1g10gb-0"])
    assert failure is not None and failure.message().startswith("Xid 79")
    assert store.device_failure(by_name["gpu-1"]) is None


UNKNOWN_TAINT = {"key": "gpu.example.com/health-store-corrupt", "effect": "NoSchedule"}


def corrupt_gauge() -> float | None:
    value: float | None = metrics.REGISTRY.get_sample_value("gpu_dra_health_store_corrupt")
    return value


def test_corrupt_file_keeps_every_gpu_failed(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text("{not json")
    store = HealthStore(path)
    assert store.problem is not None and f"health store {path} is corrupt" in store.problem
    assert untimed(store.device_taints(DEVICES)) == {d.name: [UNKNOWN_TAINT] for d in DEVICES}
    failure = store.device_failure(next(d for d in DEVICES if d.name == "gpu-1"))
    assert failure == store.device_failures(DEVICES)["gpu-1"]
    assert "every GPU is kept failed" in failure.message()
    assert corrupt_gauge() == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]  # left where it is

    # A new failure is published with its own taint, but never written over the file.
    assert store.record_xid(GPU0, 79)
    taints = untimed(store.device_taints(DEVICES))
    assert taints["gpu-0"] == [
        {"key": "gpu.example.com/xid", "value": "79", "effect": "NoSchedule"}
    ]
    assert taints["gpu-1"] == [UNKNOWN_TAINT]
    assert not store.flush()
    assert path.read_text() == "{not json"

    # A restart finds the same file: still every GPU failed.
    assert untimed(HealthStore(path).device_taints(DEVICES)) == {
        d.name: [UNKNOWN_TAINT] for d in DEVICES
    }


def test_corrupt_store_never_evicts_with_no_execute(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text('{"gpus": []}')
    store = HealthStore(path)
    store.record_lost(GPU1)
    taints = untimed(store.device_taints(DEVICES, effect="NoExecute"))
    assert taints["gpu-0"] == [UNKNOWN_TAINT]  # unknown health: kept off, not evicted
    assert taints["gpu-1"] == [{"key": "gpu.example.com/gpu-lost", "effect": "NoExecute"}]
    assert untimed(store.device_taints(DEVICES, effect="None"))["gpu-0"][0]["effect"] == "None"


def test_repaired_store_is_trusted_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    good = HealthStore(path)
    good.record_xid(GPU1, 79)
    backup = path.read_bytes()
    path.write_text("garbage")
    assert HealthStore(path).problem is not None
    path.write_bytes(backup)  # the operator restores a good copy
    restored = HealthStore(path)
    assert restored.problem is None and corrupt_gauge() == 0.0
    assert set(restored.device_taints(DEVICES)) == {d.name for d in DEVICES if d.gpu_uuid == GPU1}
    path.rename(tmp_path / "health.json.corrupt-1")  # ... or moves it aside
    assert HealthStore(path).device_taints(DEVICES) == {}


def test_fifo_at_the_path_is_corrupt_not_waited_on(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    os.mkfifo(path)
    store = HealthStore(path)  # returns: the FIFO is never opened blocking
    assert store.problem is not None and "not a regular file" in store.problem
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert store.tainted_device_count(DEVICES) == len(DEVICES)


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


def test_a_wait_is_never_cut_short(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    version = store.version
    start = time.monotonic()
    assert store.wait_changed(version, 0.05) == version
    assert time.monotonic() - start >= 0.05


@pytest.mark.parametrize("changes", [True, False], ids=["a change", "a stopping stream's wake"])
def test_a_wait_ends_at_a_change_or_a_wake(tmp_path: Path, changes: bool) -> None:
    store = HealthStore(tmp_path / "health.json")
    version = store.version
    wake = (lambda: store.record_lost(GPU0)) if changes else store.wake
    timer = threading.Timer(0.05, wake)
    timer.start()
    start = time.monotonic()
    timeout = 60.0  # no busy machine delays the change this long
    assert store.wait_changed(version, timeout) == version + changes
    # woken, not at the timeout, however slow the machine
    assert time.monotonic() - start < timeout / 2
    timer.join()


# -- MIG GPU-instance failures -----------------------------------------------------------

GPU2 = "GPU-22222222-2222-4222-8222-222222222222"


@dataclass(frozen=True)
class Backing:
    placement: tuple[int, int]


@dataclass(frozen=True)
class WholeMigGpu:
    """A dynamic MIG GPU's whole-GPU device: no placement, a full-size MIG backing."""

    name: str
    gpu_uuid: str
    mig: Backing


MIG_DEVICES = [
    WholeMigGpu("gpu-2", GPU2, Backing((0, 8))),
    Dev("gpu-2-mig-1g10gb-3", GPU2, (3, 1)),
    Dev("gpu-2-mig-1g10gb-4", GPU2, (4, 1)),
    Dev("gpu-2-mig-2g20gb-2", GPU2, (2, 2)),
    Dev("gpu-2-mig-3g40gb-4", GPU2, (4, 4)),
    Dev("gpu-1", GPU1),
]


def test_instance_failure_taints_devices_on_its_slices(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    assert store.record_instance_xid(GPU2, (3, 1), 94, gpu_instance_id=9, compute_instance_id=0)
    taints = untimed(
        store.device_taints(MIG_DEVICES, driver="gpu.example.com", effect="NoSchedule")
    )
    expected = [{"key": "gpu.example.com/xid", "value": "94", "effect": "NoSchedule"}]
    # The partition, the larger one containing slice 3 and the whole GPU; not the
    # partitions on other slices.
    assert taints == {
        "gpu-2": expected,
        "gpu-2-mig-1g10gb-3": expected,
        "gpu-2-mig-2g20gb-2": expected,
    }
    assert store.tainted_device_count(MIG_DEVICES) == 3
    assert store.gpu_failure(GPU2) is None and store.failed_gpus() == {}
    failure = store.device_failure(MIG_DEVICES[1])
    assert failure is not None
    assert failure.message().startswith("Xid 94 on GPU instance 9/0 at memory slice 3 (since ")
    assert store.device_failure(MIG_DEVICES[2]) is None
    version, by_device = store.device_snapshot(MIG_DEVICES)  # for the health stream
    assert version == store.version and set(by_device) == set(taints)
    assert by_device["gpu-2"] == failure
    by_name = {d.name: d for d in MIG_DEVICES}
    assert store.device_failure(by_name["gpu-2"]) == failure
    assert store.device_failure(by_name["gpu-2-mig-3g40gb-4"]) is None


def test_whole_gpu_failure_still_taints_every_partition(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    store.record_instance_xid(GPU2, (3, 1), 94, gpu_instance_id=9)
    assert store.record_xid(GPU2, 79)
    taints = untimed(store.device_taints(MIG_DEVICES, effect="NoSchedule"))
    assert set(taints) == {d.name for d in MIG_DEVICES if d.gpu_uuid == GPU2}
    # The whole GPU's failure is the stronger one where both apply.
    assert {t[0]["value"] for t in taints.values()} == {"79"}


def test_gpu_lost_beats_instance_xid(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    assert store.record_instance_xid(GPU2, (4, 1), 94, gpu_instance_id=11)
    assert store.record_lost(GPU2)
    assert not store.record_instance_xid(GPU2, (3, 1), 94, gpu_instance_id=9)
    failure = store.device_failure(MIG_DEVICES[2])
    assert failure is not None and failure.kind == "gpu-lost"
    assert list(store.failed_instances()[GPU2]) == [(4, 1)]


def test_instance_records_follow_the_xid_rules(tmp_path: Path) -> None:
    store = HealthStore(tmp_path / "health.json")
    assert store.record_instance_xid(GPU2, (3, 1), 94, gpu_instance_id=9)
    first = store.failed_instances()[GPU2][(3, 1)]
    version = store.version
    assert not store.record_instance_xid(GPU2, (3, 1), 94, gpu_instance_id=9)
    assert store.version == version
    assert store.record_instance_xid(GPU2, (3, 1), 95, gpu_instance_id=9)
    now = store.failed_instances()[GPU2][(3, 1)]
    assert (now.value, now.since) == ("95", first.since)
    with pytest.raises(ValueError):
        store.record_instance_xid(GPU2, (3, 0), 94)


def test_instance_failures_persist_and_clear(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    store = HealthStore(path)
    store.record_instance_xid(GPU2, (3, 1), 94, "Xid 94", gpu_instance_id=9, compute_instance_id=0)
    store.record_xid(GPU1, 79)
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and list(doc["gpus"]) == [GPU1]
    assert doc["instances"] == {
        GPU2: [
            {
                "start": 3,
                "size": 1,
                "gpuInstanceId": 9,
                "computeInstanceId": 0,
                "key": "gpu.example.com/xid",
                "value": "94",
                "reason": "Xid 94",
                "since": store.failed_instances()[GPU2][(3, 1)].since,
            }
        ]
    }
    again = HealthStore(path)  # a restart
    assert again.failed_instances() == store.failed_instances()
    assert again.device_taints(MIG_DEVICES) == store.device_taints(MIG_DEVICES)
    assert again.clear(GPU2)  # recovery clears the GPU's instances
    assert again.device_taints(MIG_DEVICES) == store.device_taints([MIG_DEVICES[-1]])
    assert not again.clear(GPU2)
    reread = json.loads(path.read_text())
    assert "instances" not in reread and list(reread["gpus"]) == [GPU1]
    assert HealthStore(path).failed_instances() == {}


def test_file_without_instances_still_loads(tmp_path: Path) -> None:
    """A file written before GPU-instance failures existed."""
    path = tmp_path / "health.json"
    old = {
        "version": 1,
        "gpus": {
            GPU0: {
                "key": "gpu.example.com/xid",
                "value": "79",
                "reason": "Xid 79",
                "since": "2026-01-01T00:00:00Z",
            }
        },
    }
    path.write_text(json.dumps(old))
    store = HealthStore(path)
    assert set(untimed(store.device_taints(DEVICES))) == {
        d.name for d in DEVICES if d.gpu_uuid == GPU0
    }
    assert store.failed_instances() == {}
    store.record_lost(GPU1)  # files without instance failures keep the old shape
    assert set(json.loads(path.read_text())) == {"version", "gpus"}


def test_malformed_instance_record_keeps_every_gpu_failed(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    bad = {"version": 1, "gpus": {}, "instances": {GPU2: [{"key": "x/xid", "start": "3"}]}}
    path.write_text(json.dumps(bad))
    store = HealthStore(path)
    assert store.failed_instances() == {}
    assert store.problem is not None and "KeyError: 'size'" in store.problem
    assert set(untimed(store.device_taints(DEVICES))) == {d.name for d in DEVICES}
    assert [p.name for p in tmp_path.iterdir()] == ["health.json"]


def test_a_taint_carries_the_time_its_failure_was_recorded(tmp_path: Path) -> None:
    """The API server would stamp a taint without `timeAdded` at every write of its
    slice, restarting NoExecute's `tolerationSeconds`: the taint keeps the failure's."""
    path = tmp_path / "health.json"
    store = HealthStore(path)
    assert store.record_xid(GPU0, 79)
    (since,) = {f["since"] for f in json.loads(path.read_text())["gpus"].values()}
    taints = store.device_taints(DEVICES, driver="gpu.example.com", effect="NoExecute")
    assert {t["timeAdded"] for listed in taints.values() for t in listed} == {since}
    assert HealthStore(path).device_taints(DEVICES) == store.device_taints(DEVICES)
    record = json.loads(path.read_text())
    record["gpus"][GPU0]["since"] = "yesterday"  # an unreadable time: the server stamps it
    path.write_text(json.dumps(record))
    assert all(
        "timeAdded" not in t for ts in HealthStore(path).device_taints(DEVICES).values() for t in ts
    )
