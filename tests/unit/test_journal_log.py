"""The prepare journal as a snapshot and an append-only log (docs/state.md,
"Durability"): what one store writes, what a torn or corrupt log means, compaction,
and what an older release reading only the snapshot sees."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from driver.errors import DriverError
from driver.state.journal import checkpoint as checkpoint_module
from driver.state.journal.checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
    PreparedDevice,
)
from driver.state.recovery.quarantine import quarantine_checkpoint, salvage_entries
from driver.state.recovery.startup_recovery import compact_journal
from tests.unit.test_mig_prepare import make_node

LOG = "checkpoint.log"


def _entry(name: str, state: ClaimState = ClaimState.PREPARE_COMPLETED) -> ClaimEntry:
    device = PreparedDevice("node-a", f"gpu-{name}", ("gpu",), (f"k8s.x/gpu={name}",))
    return ClaimEntry(state, "default", f"claim-{name}", (device,))


A, B, C = _entry("a"), _entry("b"), _entry("c")


@pytest.fixture
def cp(tmp_path: Path) -> Checkpoint:
    return Checkpoint(tmp_path / "plugin")


def _log(cp: Checkpoint) -> bytes:
    return (cp.data_dir / LOG).read_bytes()


def _files(cp: Checkpoint) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cp.data_dir.iterdir())}


class Syscalls:
    """Counts the calls that make a store durable or visible."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {"fsync": 0, "fdatasync": 0, "replace": 0, "rename": 0}
        for name in self.calls:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._counting(name, real))

    def _counting(self, name: str, real: Callable[..., object]) -> Callable[..., object]:
        def counted(*args: object, **kwargs: object) -> object:
            self.calls[name] += 1
            return real(*args, **kwargs)

        return counted


def test_a_store_appends_one_line_and_renames_nothing(
    cp: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    cp.store({"a": A})
    snapshot = cp.path.read_bytes()
    log = _log(cp)
    spy = Syscalls(monkeypatch)
    cp.store({"a": A, "b": B})
    assert spy.calls == {"fsync": 0, "fdatasync": 1, "replace": 0, "rename": 0}
    assert cp.path.read_bytes() == snapshot  # the snapshot is not rewritten
    added = _log(cp)[len(log) :]
    assert added.endswith(b"\n") and added.count(b"\n") == 1
    assert Checkpoint(cp.data_dir).load() == {"a": A, "b": B}


def test_a_batch_is_one_record_with_every_change(cp: Checkpoint) -> None:
    cp.store({"a": A, "b": B})
    before = _log(cp)
    cp.store({"b": replace(B, state=ClaimState.PREPARE_STARTED), "c": C})
    (line,) = _log(cp)[len(before) :].splitlines()
    record = json.loads(line)
    assert set(record["set"]) == {"b", "c"} and record["delete"] == ["a"]
    assert record["checksum"].startswith("sha256:")
    assert Checkpoint(cp.data_dir).load() == {
        "b": replace(B, state=ClaimState.PREPARE_STARTED),
        "c": C,
    }


def test_an_unsynced_store_is_never_followed_by_another_unsynced_one(
    cp: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torn record can then only be the last line."""
    cp.store({"a": A})
    spy = Syscalls(monkeypatch)
    cp.store({"a": A, "b": B}, sync=False)
    assert spy.calls["fdatasync"] == 0
    cp.store({"a": A, "b": B, "c": C}, sync=False)
    assert spy.calls["fdatasync"] == 1  # the earlier record is synced with this one
    cp.store({"a": A}, sync=False)
    assert spy.calls["fdatasync"] == 1


TORN_TAILS = [b'{"checksum":"sha256:', b'{"checksum":"sha256:\0\0\0\0"}\n', b"\0\0"]


@pytest.mark.parametrize("tail", TORN_TAILS)
def test_a_torn_last_line_is_ignored_and_cut_before_the_next_append(
    cp: Checkpoint, tail: bytes
) -> None:
    cp.store({"a": A})
    cp.store({"a": A, "b": B})  # acknowledged
    acknowledged = _log(cp)
    with (cp.data_dir / LOG).open("ab") as f:
        f.write(tail)  # a power loss during the next append
    restarted = Checkpoint(cp.data_dir)
    assert restarted.load() == {"a": A, "b": B}
    assert _log(cp) == acknowledged + tail  # reading changes nothing
    restarted.store({"b": B, "c": C})
    log = _log(cp)
    appended = log[len(acknowledged) :]  # the torn tail cut off, then the record
    assert log.startswith(acknowledged) and appended.count(b"\n") == 1
    assert set(json.loads(appended)["set"]) == {"c"}
    assert Checkpoint(cp.data_dir).load() == {"b": B, "c": C}


def test_a_bad_line_before_the_last_is_corrupt(cp: Checkpoint) -> None:
    cp.store({"a": A})
    cp.store({"a": A, "b": B})
    cp.store({"a": A, "b": B, "c": C})
    log = cp.data_dir / LOG
    log.write_bytes(log.read_bytes().replace(b"claim-b", b"claim-x", 1))
    files = _files(cp)
    with pytest.raises(CheckpointCorruptError) as info:
        Checkpoint(cp.data_dir).load()
    assert info.value.path == log and info.value.reason.startswith("line 1:")
    assert str(log) in str(info.value) and not info.value.permanent
    with pytest.raises(CheckpointCorruptError):
        Checkpoint(cp.data_dir).store({})  # never overwritten
    assert _files(cp) == files


def test_a_last_record_that_parses_but_fails_its_checksum_is_corrupt(cp: Checkpoint) -> None:
    """Bit rot, not a torn append (which does not parse): never dropped silently."""
    cp.store({"a": A})
    cp.store({"a": A, "b": B})
    log = cp.data_dir / LOG
    log.write_bytes(log.read_bytes().replace(b"claim-b", b"claim-x"))
    with pytest.raises(CheckpointCorruptError) as info:
        Checkpoint(cp.data_dir).load()
    assert info.value.reason.startswith("line 1: checksum mismatch")


def test_a_snapshot_with_a_log_but_no_log_file_is_corrupt(cp: Checkpoint) -> None:
    cp.store({"a": A})
    cp.store({"a": A, "b": B})
    (cp.data_dir / LOG).unlink()
    with pytest.raises(CheckpointCorruptError, match=r"checkpoint\.log is missing"):
        Checkpoint(cp.data_dir).load()


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_at_the_log_path_is_never_followed(
    cp: Checkpoint, tmp_path: Path, dangling: bool
) -> None:
    cp.store({"a": A})
    elsewhere = tmp_path / "elsewhere.log"
    if not dangling:
        elsewhere.write_bytes(_log(cp))
    (cp.data_dir / LOG).unlink()
    (cp.data_dir / LOG).symlink_to(elsewhere)
    with pytest.raises(CheckpointCorruptError) as info:
        Checkpoint(cp.data_dir).load()
    assert info.value.path == cp.data_dir / LOG
    assert info.value.reason == "is a symbolic link; refusing to follow it (ELOOP)"
    with pytest.raises(CheckpointCorruptError):
        Checkpoint(cp.data_dir).store({})
    assert (cp.data_dir / LOG).is_symlink() and not (dangling and elsewhere.exists())


def _older_release_reads(cp: Checkpoint) -> dict[str, object] | None:
    """What a release before the log sees: the snapshot's entries if its
    schemaVersion is 1, else None (it refuses the journal)."""
    doc = json.loads(cp.path.read_bytes())
    return doc["entries"] if doc["schemaVersion"] == 1 else None


def test_an_older_reader_refuses_a_snapshot_while_the_log_holds_records(
    cp: Checkpoint,
) -> None:
    journals = [{"a": A}, {"a": A, "b": B}, {"b": B}, {"b": B, "c": C}, {}]
    for journal in journals:
        cp.store(journal)
        seen = _older_release_reads(cp)
        assert seen is None or seen == {u: e.to_json() for u, e in journal.items()}
    assert _older_release_reads(cp) is None  # the log holds records
    assert cp.compact()  # a clean stop
    assert _older_release_reads(cp) == {} and _log(cp) == b""
    assert not cp.compact()


def test_compaction_at_the_bound_rewrites_the_snapshot_and_empties_the_log(
    cp: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint_module, "LOG_COMPACT_RECORDS", 3)
    cp.store({})
    for n in range(3):
        cp.store({f"u{i}": A for i in range(n + 1)})
    assert len(_log(cp).splitlines()) == 3
    cp.store({"u0": B})
    assert len(_log(cp).splitlines()) == 1  # the snapshot holds the three records
    assert json.loads(cp.path.read_bytes())["entries"].keys() == {"u0", "u1", "u2"}
    assert Checkpoint(cp.data_dir).load() == {"u0": B}


class Crash(BaseException):
    """The process dies here."""


def _crash_in_log_truncation(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """The log's truncation dies; returns the real one."""
    real: Callable[[int], None] = checkpoint_module.empty

    def crashing(fd: int) -> None:
        raise Crash

    monkeypatch.setattr(checkpoint_module, "empty", crashing)
    return real


def test_a_crash_between_the_compaction_rename_and_truncate_loses_nothing(
    cp: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint_module, "LOG_COMPACT_RECORDS", 3)
    journals = [{"a": A}, {"a": A, "b": B}, {"b": B}, {"b": B, "c": C}]
    for journal in journals:
        cp.store(journal)
    real_empty = _crash_in_log_truncation(monkeypatch)
    with pytest.raises(Crash):
        cp.store({"c": C})
    monkeypatch.setattr(checkpoint_module, "empty", real_empty)
    # The new snapshot holds what the old log's records give; they are still there.
    assert json.loads(cp.path.read_bytes())["entries"].keys() == {"b", "c"}
    assert len(_log(cp).splitlines()) == 3
    restarted = Checkpoint(cp.data_dir)
    assert restarted.load() == {"b": B, "c": C}
    restarted.store({"c": C})
    assert Checkpoint(cp.data_dir).load() == {"c": C}


def test_a_crash_between_a_clean_stop_compaction_and_truncate_loses_nothing(
    cp: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    for journal in [{"a": A}, {"a": A, "b": B}, {"b": B}]:
        cp.store(journal)
    _crash_in_log_truncation(monkeypatch)
    with pytest.raises(Crash):
        cp.compact()
    monkeypatch.undo()
    # A schemaVersion 1 snapshot with everything; the log's records are stale.
    assert _older_release_reads(cp) == {"b": B.to_json()} and _log(cp) != b""
    restarted = Checkpoint(cp.data_dir)
    assert restarted.load() == {"b": B}
    restarted.store({"b": B, "c": C})  # empties the stale log first
    assert Checkpoint(cp.data_dir).load() == {"b": B, "c": C}
    assert len(_log(cp).splitlines()) == 0


def test_a_stale_log_beside_a_snapshot_an_older_release_wrote_is_ignored(
    cp: Checkpoint,
) -> None:
    """Downgrade, then upgrade: the older release wrote its own snapshot and never
    read the log this release left (a stop that did not compact)."""
    for journal in [{"a": A}, {"a": A, "b": B}, {"a": A, "b": B, "c": C}]:
        cp.store(journal)
    older = {"x": _entry("x").to_json()}
    doc = {"schemaVersion": 1, "checksum": checkpoint_module.checksum(older), "entries": older}
    cp.path.write_text(json.dumps(doc))
    assert Checkpoint(cp.data_dir).load() == {"x": _entry("x")}


def test_another_writer_between_two_stores_is_seen(cp: Checkpoint) -> None:
    """A rolling update's second instance stored under the node lock since this one
    last read: this one reads the journal again instead of diffing against its copy."""
    cp.store({"a": A})
    assert cp.load() == {"a": A}
    other = Checkpoint(cp.data_dir)
    other.store({"a": A, "b": B})
    assert cp.load() == {"a": A, "b": B}
    other.store({"a": A, "b": B, "c": C})
    cp.store({"a": A, "b": B, "c": replace(C, state=ClaimState.PREPARE_STARTED)})
    assert Checkpoint(cp.data_dir).load()["c"].state is ClaimState.PREPARE_STARTED
    other.store({})  # its copy is stale: it reads the journal before diffing
    assert Checkpoint(cp.data_dir).load() == {} == cp.load()


def _records(cp: Checkpoint) -> Iterator[dict[str, Any]]:
    for line in _log(cp).splitlines():
        yield json.loads(line)


def test_quarantine_moves_the_log_aside_with_the_snapshot(cp: Checkpoint) -> None:
    cp.store({"a": A})
    cp.store({"a": A, "b": B})
    cp.store({"a": A, "b": B, "c": C})
    assert [list(r["set"]) for r in _records(cp)] == [["b"], ["c"]]
    log = cp.data_dir / LOG
    log.write_bytes(log.read_bytes().replace(b"claim-b", b"claim-x", 1))
    target = quarantine_checkpoint(cp.data_dir)
    assert target is not None
    moved_log = cp.data_dir / (LOG + target.name.removeprefix("checkpoint.json"))
    assert moved_log.exists() and not log.exists() and not cp.path.exists()
    # What `journal show` and the quarantine's choices read: snapshot and log, unverified.
    assert set(salvage_entries(target)) == {"a", "b", "c"}
    assert salvage_entries(target)["b"].name == "claim-x"
    assert Checkpoint(cp.data_dir).load() == {}


def test_start_and_clean_stop_leave_a_journal_every_release_reads(tmp_path: Path) -> None:
    fleet = {"gpus": [{"model": "H100-80GB", "count": 2, "migMode": "disabled"}]}
    node = make_node(tmp_path, fleet)
    state = node.state
    for uid, device in (("a", "gpu-0"), ("b", "gpu-1")):
        assert state.prepare([node.claims.add(uid, device)])[uid].ok
    assert _older_release_reads(state.checkpoint) is None  # the log holds a record
    compact_journal(state, drain_seconds=0)  # the plugin's clean stop
    assert set(_older_release_reads(state.checkpoint) or {}) == {"a", "b"}
    assert _log(state.checkpoint) == b""
    error = state.prepare([node.claims.add("c", "gpu-1")])["c"].error
    assert error is not None and "stopping" in str(error)  # nothing stored after it
    assert _log(state.checkpoint) == b""
    state.checkpoint.store({**state.checkpoint.load(), "x": A})  # a stop without compaction
    state.checkpoint.store({**state.checkpoint.load(), "y": B})
    assert _older_release_reads(state.checkpoint) is None
    assert make_node(tmp_path, fleet).state.checkpoint.inspect().schema_version == 1  # start
    assert set(_older_release_reads(state.checkpoint) or {}) == {"a", "b", "x", "y"}


def _disk_with_free_bytes(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    real = os.fstatvfs

    def reporting(fd: int) -> os.statvfs_result:
        st = real(fd)
        fields = list(st)
        fields[4] = fields[3] = free // st.f_frsize  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "fstatvfs", reporting)


def test_a_store_that_adds_entries_keeps_room_to_roll_them_back(
    cp: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An append may fit in the log's last block when the disk is full, and then the
    record that rolls it back may not: a store that sets entries is refused unless the
    disk has room for it and its rollback. A store that only removes entries is not
    (it frees what the claim held)."""
    cp.store({"a": A})
    cp.store({"a": A, "b": B})
    before = _files(cp)
    _disk_with_free_bytes(monkeypatch, 4096)
    with pytest.raises(DriverError, match="No space left on device"):
        cp.store({"a": A, "b": B, "c": C})
    assert _files(cp) == before and Checkpoint(cp.data_dir).load() == {"a": A, "b": B}
    cp.store({"a": A})
    assert Checkpoint(cp.data_dir).load() == {"a": A}
