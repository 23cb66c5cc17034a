"""Checkpoint journal: format, checksum, corruption handling, quarantine, serialize lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from driver.errors import DriverError
from driver.state.journal.checkpoint import (
    SCHEMA_VERSION,
    SCHEMA_WITH_LOG,
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
    HardwareRecord,
    PreparedDevice,
    checksum,
)
from driver.state.journal.locking import SerializeLock
from driver.state.recovery.quarantine import quarantine_checkpoint

DEVICE = PreparedDevice(
    pool_name="node-a",
    device_name="gpu-0",
    request_names=("gpu",),
    cdi_device_ids=("k8s.gpu.example.com/gpu=common", "k8s.gpu.example.com/gpu=uid-a-gpu-0"),
    share_id=None,
    admin_access=False,
)
ENTRIES = {
    "uid-a": ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", "claim-a", (DEVICE,)),
    "uid-b": ClaimEntry(
        ClaimState.PREPARE_STARTED,
        "team",
        "claim-b",
        (PreparedDevice("node-a", "gpu-1", ("g",), ("x",), share_id="s-1", admin_access=True),),
    ),
}


@pytest.fixture
def cp(tmp_path: Path) -> Checkpoint:
    return Checkpoint(tmp_path / "plugin")


def test_missing_file_is_empty(cp: Checkpoint) -> None:
    assert cp.load() == {}


def test_round_trip_and_format(cp: Checkpoint) -> None:
    cp.store(ENTRIES)
    assert cp.load() == ENTRIES
    # The first store writes the snapshot, marked as one a log follows; a clean stop
    # folds the log back into a snapshot every release reads.
    assert json.loads(cp.path.read_bytes())["schemaVersion"] == SCHEMA_WITH_LOG == 2
    assert cp.compact()
    doc = json.loads(cp.path.read_bytes())
    assert doc["schemaVersion"] == SCHEMA_VERSION == 1
    assert doc["checksum"].startswith("sha256:")
    assert doc["checksum"] == checksum(doc["entries"])
    assert doc["entries"]["uid-a"] == {
        "state": "PrepareCompleted",
        "namespace": "default",
        "name": "claim-a",
        "devices": [
            {
                "pool": "node-a",
                "device": "gpu-0",
                "requestNames": ["gpu"],
                "cdiDeviceIds": list(DEVICE.cdi_device_ids),
                "shareID": None,
                "adminAccess": False,
            }
        ],
    }
    assert doc["entries"]["uid-b"]["devices"][0]["shareID"] == "s-1"
    # no temp files left; the log stays, empty
    assert sorted(os.listdir(cp.data_dir)) == ["checkpoint.json", "checkpoint.log"]
    assert cp.log_path.read_bytes() == b"" and Checkpoint(cp.data_dir).load() == ENTRIES


def _assert_corrupt(cp: Checkpoint, reason: str) -> None:
    before = cp.path.read_bytes()
    with pytest.raises(CheckpointCorruptError) as info:
        cp.load()
    err = info.value
    assert isinstance(err, DriverError) and not err.permanent
    assert str(cp.path) in str(err)
    assert reason in err.reason
    assert cp.path.read_bytes() == before  # never discarded or rewritten


def test_bad_json_is_corrupt(cp: Checkpoint) -> None:
    cp.data_dir.mkdir()
    cp.path.write_text('{"schemaVersion": 1, "entr')
    _assert_corrupt(cp, "not valid JSON")


def test_empty_file_is_corrupt(cp: Checkpoint) -> None:
    cp.data_dir.mkdir()
    cp.path.write_bytes(b"")
    _assert_corrupt(cp, "not valid JSON")


def test_checksum_mismatch_is_corrupt(cp: Checkpoint) -> None:
    cp.store(ENTRIES)
    doc = json.loads(cp.path.read_bytes())
    doc["entries"]["uid-a"]["devices"][0]["device"] = "gpu-7"
    cp.path.write_text(json.dumps(doc))
    _assert_corrupt(cp, "checksum mismatch")


def test_unknown_schema_is_corrupt(cp: Checkpoint) -> None:
    cp.store(ENTRIES)
    doc = json.loads(cp.path.read_bytes())
    doc["schemaVersion"] = 3
    cp.path.write_text(json.dumps(doc))
    _assert_corrupt(cp, "unknown schemaVersion 3")


def test_malformed_entry_with_valid_checksum_is_corrupt(cp: Checkpoint) -> None:
    entries = {"uid-a": {"state": "Prepared?", "namespace": "d", "name": "n", "devices": []}}
    cp.data_dir.mkdir()
    doc = {"schemaVersion": 1, "checksum": checksum(entries), "entries": entries}
    cp.path.write_text(json.dumps(doc))
    _assert_corrupt(cp, "entry uid-a: unknown state")


@pytest.mark.parametrize("dangling", [False, True])
def test_symlink_at_the_checkpoint_path_is_never_followed(
    cp: Checkpoint, tmp_path: Path, dangling: bool
) -> None:
    """A valid journal elsewhere, linked in: refused as corrupt (ELOOP), not read."""
    elsewhere = Checkpoint(tmp_path / "elsewhere")
    elsewhere.store(ENTRIES)
    cp.data_dir.mkdir()
    target = tmp_path / "gone.json" if dangling else elsewhere.path
    cp.path.symlink_to(target)
    with pytest.raises(CheckpointCorruptError) as info:
        cp.load()
    err = info.value
    assert not err.permanent and str(cp.path) in str(err)
    assert err.reason == "is a symbolic link; refusing to follow it (ELOOP)"
    assert cp.path.is_symlink()  # never discarded
    assert elsewhere.load() == ENTRIES  # the target is untouched
    # The operator's remedy moves the link itself aside, never its target.
    moved = quarantine_checkpoint(cp.data_dir)
    assert moved is not None and moved.is_symlink() and not os.path.lexists(cp.path)
    assert elsewhere.load() == ENTRIES and cp.load() == {}


def test_fifo_at_the_checkpoint_path_is_refused_without_blocking(cp: Checkpoint) -> None:
    cp.data_dir.mkdir()
    os.mkfifo(cp.path)
    with pytest.raises(CheckpointCorruptError) as info:
        cp.load()  # a plain open() would block here until a writer appeared
    assert info.value.reason == "is not a regular file; refusing to read it (EINVAL)"


def _add_future_fields(cp: Checkpoint) -> dict[str, Any]:
    """What a newer release writes: keys this one does not know, on an entry and a
    device (with the checksum over them)."""
    cp.store(ENTRIES)
    doc = json.loads(cp.path.read_bytes())
    doc["entries"]["uid-a"]["futureField"] = {"x": 1, "y": ["é", None]}
    doc["entries"]["uid-a"]["devices"][0]["futureDeviceField"] = "y"
    doc["checksum"] = checksum(doc["entries"])
    cp.path.write_text(json.dumps(doc))
    return dict(doc["entries"])


def test_checksum_is_over_stored_value_so_added_fields_stay_valid(cp: Checkpoint) -> None:
    """A newer driver adding a field does not break older readers' checksum."""
    _add_future_fields(cp)
    loaded = cp.load()
    assert set(loaded) == set(ENTRIES)
    assert [d.device_name for d in loaded["uid-a"].devices] == ["gpu-0"]
    assert loaded["uid-b"] == ENTRIES["uid-b"]


def test_unknown_keys_of_entries_and_devices_are_kept_on_rewrite(cp: Checkpoint) -> None:
    """A downgrade that rewrites the journal (any prepare or unprepare) must not lose
    what the newer release recorded: the keys come back, byte for byte, and survive
    changes to the rest of the entry."""
    stored = _add_future_fields(cp)
    journal = cp.load()
    journal["uid-a"] = replace(journal["uid-a"], state=ClaimState.PREPARE_STARTED)
    del journal["uid-b"]
    cp.store(journal)
    assert b"futureDeviceField" in cp.log_path.read_bytes()  # in the store's record
    cp.compact()
    doc = json.loads(cp.path.read_bytes())
    assert doc["checksum"] == checksum(doc["entries"])
    entry = doc["entries"]["uid-a"]
    assert entry["futureField"] == stored["uid-a"]["futureField"]
    assert entry["devices"][0]["futureDeviceField"] == "y"
    assert entry["state"] == "PrepareStarted"
    assert cp.load() == journal  # and again on the next rewrite
    cp.store(cp.load())
    cp.compact()
    assert json.loads(cp.path.read_bytes()) == doc


def test_hardware_record_round_trip(cp: Checkpoint) -> None:
    records = (
        HardwareRecord("GPU-aaaa"),
        HardwareRecord("GPU-aaaa", slices=(3, 1)),
        HardwareRecord("GPU-aaaa", partition=(1, 4), multi_allocatable=True),
    )
    devices = tuple(replace(DEVICE, device_name=f"d{i}", hardware=r) for i, r in enumerate(records))
    entries = {"uid-a": ClaimEntry(ClaimState.PREPARE_COMPLETED, "default", "a", devices)}
    cp.store(entries)
    assert cp.load() == entries
    raw = json.loads(cp.path.read_bytes())["entries"]["uid-a"]["devices"]
    assert [d["hardware"] for d in raw] == [
        {"gpu": "GPU-aaaa", "multiAllocatable": False},
        {"gpu": "GPU-aaaa", "multiAllocatable": False, "slices": [3, 1]},
        {"gpu": "GPU-aaaa", "multiAllocatable": True, "partition": [1, 4]},
    ]


@pytest.mark.parametrize(
    "hardware",
    [
        "GPU-aaaa",
        {"multiAllocatable": False},
        {"gpu": "GPU-aaaa", "multiAllocatable": "yes"},
        {"gpu": "GPU-aaaa", "slices": [3]},
        {"gpu": "GPU-aaaa", "slices": [0, 0]},
        {"gpu": "GPU-aaaa", "partition": [2, 2]},
        {"gpu": "GPU-aaaa", "slices": [0, 1], "partition": [0, 2]},
    ],
)
def test_malformed_hardware_record_is_corrupt(cp: Checkpoint, hardware: object) -> None:
    device = {**DEVICE.to_json(), "hardware": hardware}
    entries = {
        "uid-a": {"state": "PrepareCompleted", "namespace": "d", "name": "n", "devices": [device]}
    }
    cp.data_dir.mkdir()
    doc = {"schemaVersion": 1, "checksum": checksum(entries), "entries": entries}
    cp.path.write_text(json.dumps(doc))
    _assert_corrupt(cp, "entry uid-a: device gpu-0: hardware")


def test_quarantine_moves_a_corrupt_file_aside(cp: Checkpoint) -> None:
    cp.data_dir.mkdir()
    cp.path.write_text("garbage")
    target = quarantine_checkpoint(cp.data_dir, now=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    assert target == cp.data_dir / "checkpoint.json.corrupt-20260102T030405.000000Z"
    assert target.read_text() == "garbage"
    assert not cp.path.exists()
    assert cp.load() == {}
    assert cp.corrupt_copies() == [target]


def test_quarantine_refuses_a_valid_file_unless_forced(cp: Checkpoint) -> None:
    assert quarantine_checkpoint(cp.data_dir) is None
    cp.store(ENTRIES)
    with pytest.raises(ValueError, match="is valid"):
        quarantine_checkpoint(cp.data_dir)
    assert cp.load() == ENTRIES
    moved = quarantine_checkpoint(cp.data_dir, force=True)
    assert moved is not None and moved.exists() and not cp.path.exists()


@pytest.mark.parametrize("broken", ["replace", "fdatasync", "write"])
def test_store_failure_is_transient_and_keeps_old_file(
    cp: Checkpoint, monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    """The first store renames a snapshot; a later one appends to the log. Either
    failing leaves the journal as it was, for this reader and a fresh one."""
    if broken != "replace":
        cp.store(ENTRIES)
    before = {p.name: p.read_bytes() for p in cp.data_dir.iterdir()} if broken != "replace" else {}
    real = getattr(os, broken)

    def failing(*args: Any) -> Any:
        if broken == "write" and real(args[0], bytes(args[1])[:10]) != 10:
            raise AssertionError("short write")  # the first bytes reach the file
        raise OSError(5, "I/O error")

    monkeypatch.setattr(os, broken, failing)
    with pytest.raises(DriverError) as info:
        cp.store({} if broken != "replace" else ENTRIES)
    assert not info.value.permanent and str(cp.path) in str(info.value)
    monkeypatch.undo()
    assert cp.load() == Checkpoint(cp.data_dir).load() == ({} if broken == "replace" else ENTRIES)
    assert {p.name: p.read_bytes() for p in cp.data_dir.iterdir()} == before or (
        broken == "replace" and sorted(os.listdir(cp.data_dir)) == ["checkpoint.log"]
    )


def test_sweep_temp_files(cp: Checkpoint) -> None:
    cp.store({})
    leftover = cp.data_dir / ".checkpoint.json.tmp-deadbeef"
    leftover.write_text("{")
    assert cp.sweep_temp_files() == [leftover]
    assert not leftover.exists()


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_lock_held_by_another_process_times_out_then_is_freed_by_its_death(
    tmp_path: Path,
) -> None:
    lock = SerializeLock(tmp_path, timeout=0.3, poll_interval=0.02)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        started = time.monotonic()
        with pytest.raises(DriverError) as info, lock.hold():
            pass
        assert not info.value.permanent
        assert "another plugin instance" in str(info.value)
        assert time.monotonic() - started >= 0.25
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with lock.hold():  # a killed holder releases the lock
        pass


def test_lock_serialises_threads(tmp_path: Path) -> None:
    inside = 0
    overlaps = 0
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside, overlaps
        for _ in range(20):
            with SerializeLock(tmp_path).hold():
                with guard:
                    inside += 1
                    overlaps += inside > 1
                time.sleep(0.001)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == 0


def test_exception_inside_lock_propagates_unchanged(tmp_path: Path) -> None:
    lock = SerializeLock(tmp_path)
    with pytest.raises(KeyError), lock.hold():
        raise KeyError("x")
    with lock.hold():  # released
        pass
