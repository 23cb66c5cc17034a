"""The prepare journal: the snapshot `<data dir>/checkpoint.json` and the log
`<data dir>/checkpoint.log` of the stores since (driver/state/journal/journal_log.py);
formats, versions and compaction in docs/state.md, "The journal" and "The log".

schemaVersion 1: the snapshot is the whole journal (a log beside it is stale: ignored,
and emptied before the next append). schemaVersion 2: the snapshot with the log's
records replayed over it. Releases before the log refuse version 2 as "written by a
newer driver?", so none of them reads a journal without the log's records (their
prepares fail transiently during a rolling update's overlap; nothing is
double-booked); `compact()` at start and at a clean stop writes version 1 again.

A corrupt journal (docs/state.md, "Corrupt checkpoint"; also a symlink at either
path, never followed) raises `CheckpointCorruptError` and is never discarded
automatically: an operator moves it aside (driver/state/recovery/quarantine.py).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from driver.errors import transient
from driver.failpoints import failpoint
from driver.fileio import (
    DATA_DIR_MODE,
    UnsafeFileError,
    atomic_write,
    read_regular_file,
    sweep_temp_files,
)
from driver.state.journal.hardware_record import HardwareRecord, MigRecord
from driver.state.journal.journal_entries import (
    CORRUPT_SUFFIX,
    CheckpointCorruptError,
    ClaimEntry,
    ClaimState,
    PreparedDevice,
    canonical,
    checksum,
)
from driver.state.journal.journal_log import (
    LOG_FILE,
    append,
    empty,
    encode_record,
    open_log,
    replay,
    scan,
)

__all__ = [  # re-exported: the journal's entries, from their own module
    "CORRUPT_SUFFIX",
    "CheckpointCorruptError",
    "ClaimEntry",
    "ClaimState",
    "HardwareRecord",
    "MigRecord",
    "PreparedDevice",
    "checksum",
]

SCHEMA_VERSION: Final = 1  # the snapshot is the whole journal
SCHEMA_WITH_LOG: Final = 2  # the snapshot, then checkpoint.log's records
CHECKPOINT_FILE: Final = "checkpoint.json"
LOG_COMPACT_RECORDS: Final = 256
LOG_COMPACT_BYTES: Final = 1 << 20
# Free space a store that adds or changes entries leaves for the record that rolls
# them back (a 64-claim batch's is a few KiB); not for a store no failure rolls back.
ROLLBACK_RESERVE: Final = 64 << 10
_READ_ATTEMPTS: Final = 3

Identity = tuple[int, int, int]  # a file's (inode, size, modification time in ns)


def _identity(status: os.stat_result) -> Identity:
    return (status.st_ino, status.st_size, status.st_mtime_ns)


def _stat(path: Path) -> Identity | None:
    try:
        return _identity(os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return None


def encode(entries: Mapping[str, ClaimEntry], version: int) -> bytes:
    raw = {uid: entry.to_json() for uid, entry in entries.items()}  # sorted by canonical
    doc = {"schemaVersion": version, "checksum": checksum(raw), "entries": raw}
    # Compact: json's C encoder (indent= falls back to the pure-Python one, which cost
    # about half a millisecond per prepare/unprepare). `gpu-dra journal show` prints it.
    return canonical(doc) + b"\n"


def decode(data: bytes, path: Path) -> tuple[int, dict[str, ClaimEntry]]:
    """Parse and verify a snapshot: its schema version and entries. Raises
    CheckpointCorruptError naming `path`."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise CheckpointCorruptError(path, f"not valid JSON: {err}") from err
    if not isinstance(doc, dict):
        raise CheckpointCorruptError(path, "not a JSON object")
    version = doc.get("schemaVersion")
    if type(version) is not int:
        raise CheckpointCorruptError(path, f"missing or invalid schemaVersion {version!r}")
    if version not in (SCHEMA_VERSION, SCHEMA_WITH_LOG):
        raise CheckpointCorruptError(
            path,
            f"unknown schemaVersion {version} (this driver reads {SCHEMA_VERSION} and "
            f"{SCHEMA_WITH_LOG}; written by a newer driver?)",
        )
    raw = doc.get("entries")
    if not isinstance(raw, dict):
        raise CheckpointCorruptError(path, "entries must be an object")
    stored = doc.get("checksum")
    actual = checksum(raw)
    if stored != actual:
        raise CheckpointCorruptError(
            path, f"checksum mismatch: stored {stored!r}, computed {actual}"
        )
    entries: dict[str, ClaimEntry] = {}
    for uid, entry in raw.items():
        try:
            entries[uid] = ClaimEntry.from_json(entry)
        except ValueError as err:
            raise CheckpointCorruptError(path, f"entry {uid}: {err}") from err
    return version, entries


@dataclass(frozen=True)
class JournalView:
    """The journal as a `Checkpoint` last read or wrote it."""

    entries: Mapping[str, ClaimEntry]
    schema_version: int  # of the snapshot; 0: none
    snapshot_id: Identity | None
    log_id: Identity | None
    log_records: int = 0  # replayed over the snapshot (schemaVersion 2)
    log_size: int = 0  # bytes of those records
    torn_bytes: int = 0  # a torn tail after them, cut off by the next append
    log_synced: bool = False  # every byte of the log is known to be on disk


class Checkpoint:
    """The journal of one plugin data directory. Not locked by itself: writers hold
    `SerializeLock` around each read-modify-write. Reads need no lock."""

    def __init__(self, data_dir: Path | str) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / CHECKPOINT_FILE
        self.log_path = self.data_dir / LOG_FILE
        self._view: JournalView | None = None

    def load(self) -> dict[str, ClaimEntry]:
        """The entries; `{}` if there is no journal. Raises CheckpointCorruptError (also
        for a symlink at either path: never followed), or a transient DriverError if a
        file cannot be read."""
        return dict(self.inspect().entries)

    def inspect(self) -> JournalView:
        """The journal, read again only when a file changed since this object last
        read or wrote it (a `stat` of each file otherwise)."""
        view = self._view
        try:
            if view is None or (view.snapshot_id, view.log_id) != (
                _stat(self.path),
                _stat(self.log_path),
            ):
                view = self._read()
                self._view = view
        except OSError as err:
            raise transient(f"cannot read checkpoint {self.path}: {err}") from err
        return view

    def store(
        self,
        entries: Mapping[str, ClaimEntry],
        *,
        before_commit: str | None = None,
        sync: bool = True,
        rollback_reserve: bool = True,
    ) -> None:
        """Make `entries` the journal: one record appended to the log (see the module
        doc). Raises a transient DriverError on I/O errors (the journal keeps its
        content), CheckpointCorruptError if the journal is corrupt (never overwritten).
        `before_commit`: a failpoint passed once the new content is complete and none of
        it is visible (before the append, or before the snapshot's rename).
        `sync=False`: no `fdatasync` of the record, which the next store's covers (a
        process crash keeps it; a power loss may lose it whole or tear it, never an
        earlier record: a store after an unsynced one always syncs).
        `rollback_reserve=False`: a store that adds or changes entries without leaving
        anything a failure rolls back (an unprepare's `unpreparing` mark, its removal)
        needs no `ROLLBACK_RESERVE` free beyond its record."""
        view = self.inspect()
        try:
            self._view = None  # unknown until the store ends
            self._view = self._store(view, entries, before_commit, sync, rollback_reserve)
        except OSError as err:
            raise transient(f"cannot write checkpoint {self.path}: {err}") from err

    def compact(self) -> bool:
        """Fold the log into a schemaVersion 1 snapshot and empty it, so that any
        release can read the journal; False if it was one already. Under the node lock,
        with nothing to prepare meanwhile (at start, at a clean stop)."""
        view = self.inspect()
        if view.schema_version != SCHEMA_WITH_LOG:
            return False
        try:
            self._view = None
            self._view = self._compact(view, SCHEMA_VERSION)
        except OSError as err:
            raise transient(f"cannot compact checkpoint {self.path}: {err}") from err
        return True

    def sweep_temp_files(self) -> list[Path]:
        return sweep_temp_files(self.data_dir, CHECKPOINT_FILE)

    def corrupt_copies(self) -> list[Path]:
        """Snapshots previously moved aside by `quarantine_checkpoint`."""
        try:
            names = os.listdir(self.data_dir)
        except FileNotFoundError:
            return []
        prefix = CHECKPOINT_FILE + CORRUPT_SUFFIX
        return sorted(self.data_dir / n for n in names if n.startswith(prefix))

    def _read(self) -> JournalView:
        for _ in range(_READ_ATTEMPTS):
            view = self._read_once()
            if view is not None:
                return view
        raise transient(f"checkpoint {self.path} kept changing while it was read")

    def _read_once(self) -> JournalView | None:
        """The journal; None if the snapshot was replaced while the log was read (by a
        writer, this reader not holding the node lock): the log may be a later one."""
        try:
            data, status = read_regular_file(self.path)
        except FileNotFoundError:
            return JournalView({}, 0, None, _stat(self.log_path))
        except UnsafeFileError as err:
            raise _unsafe(self.path, err) from err
        snapshot_id = _identity(status)
        version, entries = decode(data, self.path)
        if version == SCHEMA_VERSION:
            return JournalView(entries, version, snapshot_id, _stat(self.log_path))
        problem: CheckpointCorruptError | None = None
        try:
            log, log_status = read_regular_file(self.log_path)
            found = scan(log, self.log_path)
            replay(entries, found.records, self.log_path)
        except FileNotFoundError:
            problem = CheckpointCorruptError(
                self.path, f"schemaVersion {version} but {LOG_FILE} is missing"
            )
        except UnsafeFileError as err:
            problem = _unsafe(self.log_path, err)
        except CheckpointCorruptError as err:
            problem = err
        if _stat(self.path) != snapshot_id:
            return None
        if problem is not None:
            raise problem
        return JournalView(
            entries,
            version,
            snapshot_id,
            _identity(log_status),
            len(found.records),
            found.valid_size,
            found.torn_bytes,
        )

    def _store(
        self,
        view: JournalView,
        entries: Mapping[str, ClaimEntry],
        before_commit: str | None,
        sync: bool,
        rollback_reserve: bool,
    ) -> JournalView:
        if view.schema_version != SCHEMA_WITH_LOG:
            return self._begin_log(entries, before_commit)
        old = view.entries
        changed = {
            uid: e.to_json()
            for uid, e in entries.items()
            if (o := old.get(uid)) is not e and o != e
        }
        deleted = [uid for uid in old if uid not in entries]
        if not changed and not deleted and (view.log_synced or not sync):
            return view
        if view.log_records >= LOG_COMPACT_RECORDS or view.log_size >= LOG_COMPACT_BYTES:
            view = self._compact(view, SCHEMA_WITH_LOG)
        record = encode_record(changed, deleted) if changed or deleted else b""
        # Never append after an unsynced record: a torn record is then always the last.
        synced = sync or not view.log_synced or view.torn_bytes > 0
        if before_commit is not None:
            failpoint(before_commit)
        with open_log(self.log_path) as fd:
            reserve = ROLLBACK_RESERVE if changed and rollback_reserve else 0
            append(fd, record, keep=view.log_size, sync=synced, reserve=reserve)
            status = os.fstat(fd)
        return JournalView(
            dict(entries),
            SCHEMA_WITH_LOG,
            view.snapshot_id,
            _identity(status),
            view.log_records + (1 if record else 0),
            view.log_size + len(record),
            log_synced=synced,
        )

    def _begin_log(
        self, entries: Mapping[str, ClaimEntry], before_commit: str | None
    ) -> JournalView:
        """The first store on a schemaVersion 1 snapshot (or none): an empty log, then
        the entries as a version 2 snapshot."""
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=DATA_DIR_MODE)
        with open_log(self.log_path, create=True) as fd:
            if os.fstat(fd).st_size:
                empty(fd)  # stale: emptied before a snapshot would replay it
            status = os.fstat(fd)
        # The rename's directory fsync also makes a newly created log's name durable.
        atomic_write(self.path, encode(entries, SCHEMA_WITH_LOG), before_rename=before_commit)
        return JournalView(
            dict(entries), SCHEMA_WITH_LOG, _stat(self.path), _identity(status), log_synced=True
        )

    def _compact(self, view: JournalView, version: int) -> JournalView:
        """The entries as a snapshot of `version`, durably, then the log emptied. A
        crash in between leaves the log's records over a snapshot that contains them:
        replaying them changes nothing (version 2), or they are ignored (version 1)."""
        atomic_write(self.path, encode(view.entries, version))
        with open_log(self.log_path) as fd:
            empty(fd)
            status = os.fstat(fd)
        return JournalView(
            view.entries, version, _stat(self.path), _identity(status), log_synced=True
        )


def _unsafe(path: Path, err: UnsafeFileError) -> CheckpointCorruptError:
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    return CheckpointCorruptError(path, f"{err.strerror} ({code})")
